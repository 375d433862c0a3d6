-- ZeRO-3's edges: what a script may do to a fully sharded model besides train it, each once
-- crashing or refused late. A table of parameters whose units are freed (pt.cat { p1, p2 }) is
-- refused as one parameter is, not read (SIGSEGV). A whole-model read between a forward and its
-- backward (state_dict, full_state_dict, model:gathered, a checkpoint save) leaves the forward's
-- root unit gathered, and the step trains as serial AdamW (float64, 1e-10); the root's backward had
-- read its freed storage (SIGSEGV). A step between a forward and its backward makes the backward
-- refuse, as serial training's in-place step does. pt.tp.gather of a ZeRO-3 parameter split by
-- tensor parallelism gathers its unit (it had all-gathered freed storage: SIGSEGV). A tensor tied
-- between a unit and a module outside every unit is refused at parallelize, naming both.
--   partrain --nproc-per-node 4 --threads 1 tests/dist/test_zero3_edges.lua
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, near, ok, raises = H.test, H.near, H.ok, H.raises

local DIM, BATCH = 6, 8
local Block = pt.nn.Module "EdgeBlock"
function Block:__init()
  self.fc = pt.nn.Linear(DIM, DIM)
  self.scale = pt.nn.Parameter(pt.ones(DIM))
end
function Block:forward(x) return self.fc(x):tanh() * self.scale + x end

-- The root unit holds inp, out and gain; gain multiplies the output last, so that the first node
-- of backward reads a root parameter's storage directly.
local Net = pt.nn.Module "EdgeNet"
function Net:__init()
  self.inp = pt.nn.Linear(DIM, DIM)
  self.h = pt.nn.ModuleList { Block(), Block(), Block() }
  self.out = pt.nn.Linear(DIM, 3)
  self.gain = pt.nn.Parameter(pt.ones(3) * 0.7)
end
function Net:forward(x)
  x = self.inp(x)
  for _, b in ipairs(self.h:children()) do x = b(x) end
  return self.out(x) * self.gain
end

local Z3 = { zero = { stage = 3, blocks = "h" } }
local DIR = os.tmpname()
os.remove(DIR)
DIR = DIR:match("^(.*)/") .. "/partrain-test-zero3-edges-" .. (os.getenv("MASTER_PORT") or "0")

local function pair(seed, opts)
  local mesh = pt.mesh { zero = 0 }
  pt.manual_seed(seed)
  local serial = Net():to("float64")
  pt.manual_seed(seed)
  return mesh, pt.parallelize(Net():to("float64"), nil, mesh, opts or Z3), serial
end

local function batch(mesh)
  local x, y = pt.randn(BATCH, DIM, { dtype = "float64" }), pt.randint(0, 3, { BATCH })
  mesh:group("world"):broadcast(x, 0); mesh:group("world"):broadcast(y, 0)
  local n, d = mesh:size("data"), mesh:coord().data
  return x, y, x:narrow(0, d * BATCH / n, BATCH / n), y:narrow(0, d * BATCH / n, BATCH / n)
end

test("a table of parameters outside their gather is refused, not read", function()
  local _, model = pair(3)
  local e = raises(function() local t = pt.cat { model.h[1].scale, model.h[2].scale }; return t end, "sharded by ZeRO-3")
  ok(e:find("element 1"), e)
  ok(e:find("test_zero3_edges.lua:%d+"), e)
  -- An optimizer's table reads shapes only: refused for ZeRO's own reason, not for the values.
  raises(function() return pt.optim.sgd({ model.h[1].scale }, { lr = 0.1 }) end, "must be made from the model")
end)

test("a whole-model read between forward and backward keeps the root gathered: steps equal serial", function()
  for _, read in ipairs { "state_dict", "full_state_dict", "gathered", "ckpt" } do
    local mesh, model, serial = pair(5)
    local mo, so = pt.optim.adamw(model, { lr = 1e-2 }), pt.optim.adamw(serial, { lr = 1e-2 })
    for step = 1, 3 do
      local x, y, xs, ys = batch(mesh)
      local la = pt.nn.cross_entropy(model(xs), ys)
      if read == "state_dict" then local _ = model:state_dict()
      elseif read == "full_state_dict" then local _ = model:full_state_dict()
      elseif read == "gathered" then model:gathered(function() return model.gain:sum():item() end)
      else pt.ckpt.save(DIR, { model = model, optim = mo, overwrite = true, tag = "edge" }) end
      la:backward()
      pt.nn.cross_entropy(serial(x), y):backward()
      mo:step(); so:step(); mo:zero_grad(); so:zero_grad()
    end
    local want = serial:state_dict()
    for name, t in pairs(model:full_state_dict()) do near(t, want[name], 1e-10, read .. ": " .. name) end
  end
end)

test("a step between a forward and its backward makes the backward refuse, as in serial training", function()
  local mesh, model = pair(7)
  local opt = pt.optim.adamw(model, { lr = 1e-2 })
  local _, _, xs, ys = batch(mesh)
  pt.nn.cross_entropy(model(xs), ys):backward()
  opt:step(); opt:zero_grad()
  local loss = pt.nn.cross_entropy(model(xs), ys)
  opt:step()
  raises(function() loss:backward() end, "modified by an inplace operation")
  -- and the model trains on afterwards
  opt:zero_grad()
  pt.nn.cross_entropy(model(xs), ys):backward()
  opt:step()
end)

test("a tensor tied between a unit and the root is refused at parallelize", function()
  local mesh = pt.mesh { zero = 0 }
  for _, c in ipairs {
    { { "h.0", "h.1" }, function(m) m.h[2].fc.weight = m.h[1].fc.weight end, "'h.1.fc.weight' and 'h.2.fc.weight'" },
    { { "h.1.fc" }, function(m) m.h[1].scale = m.h[1].fc.bias end, "'h.1.fc.bias' and 'h.1.scale'" },
  } do
    local m = Net():to("float64")
    c[2](m)
    local e = raises(function() pt.parallelize(m, nil, mesh, { zero = { stage = 3, units = c[1] } }) end,
                     "held by a unit and outside every unit")
    ok(e:find(c[3], 1, true), e)
    ok(e:find("test_zero3_edges.lua:%d+"), e)
  end
end)

if pt.dist.world_size() == 4 then
  test("pt.tp.gather of a ZeRO-3 parameter split over tensor 2 gathers its unit", function()
    local gpt = { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 2 }
    pt.manual_seed(9)
    local serial = pt.models.gpt2(gpt):to("float64")
    pt.manual_seed(9)
    local model = pt.parallelize(pt.models.gpt2(gpt):to("float64"), "policies.gpt2", pt.mesh { tensor = 2, zero = 0 },
                                 { zero = { stage = 3 } })
    local want = serial:state_dict()
    local split = 0
    for _, name in ipairs { "wte.weight", "h.0.attn.c_attn.weight", "h.1.mlp.c_proj.weight", "h.1.ln_1.weight" } do
      if pt.tp.sharding(model, name) then split = split + 1 end
      near(pt.tp.gather(model, name), want[name], 0, name)
    end
    ok(split >= 2, "split parameters gathered")
    raises(function() return model.h[1].mlp.c_proj.weight:sum() end, "sharded by ZeRO-3")
  end)
end

H.run()
