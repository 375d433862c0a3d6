-- Sharding policies: the shipped ones (GPT-2, MLP, the tutorial model) and one written here for a
-- Lua-defined model make training equal to serial training on the global batch (tensor = 2, and
-- tensor = 2 x data = 2 at 4 ranks), within 1e-5; bad policies are refused, each with the
-- policy's file:line, before anything changes.
--   partrain --nproc-per-node 2 tests/dist/test_policy.lua
package.path = "tests/lua/?.lua;examples/simple/?.lua;" .. package.path
local pt = require "partrain"
local P = require "partrain.policy"
local H = require "harness"
local SimpleModel = require "model"
local test, near, eq, ok, raises = H.test, H.near, H.eq, H.ok, H.raises

local args = pt.args { tensor = 2 }
local mesh = pt.mesh { tensor = args.tensor }
local dp = mesh:size("data")
local TOL = 1e-5

-- Trains `make()` serially on whole global batches and parallelized (policy, then data
-- parallelism) on this rank's slices, from the same weights, comparing the loss each step.
local function equal_to_serial(make, policy, loader, loss_of, steps)
  pt.manual_seed(21)
  local serial = make()
  pt.manual_seed(21)
  local model = pt.parallelize(make(), policy, mesh)
  -- Clipping needs the global norm: split parameters' norms must add up over the tensor group.
  local so = pt.optim.adamw(serial, { lr = 1e-3, clip_grad_norm = 0.5 })
  local po = pt.optim.adamw(model, { lr = 1e-3, clip_grad_norm = 0.5 })
  local serial_loss, parallel_loss = loss_of(serial), loss_of(model)
  local whole, mine = loader(false), loader(true)
  for step = 1, steps do
    local gx, gy = whole:next()
    local x, y = mine:next()
    local ls = serial_loss(serial(gx), gy)
    local lp = parallel_loss(model(x), y)
    local global = lp:detach():clone()
    mesh:group("data"):all_reduce(global, "mean")
    near(global, ls, TOL, "loss at step " .. step)
    ls:backward(); lp:backward()
    local ns, np = so:step(), po:step()
    near(np, ns, TOL, "gradient norm at step " .. step)
    so:zero_grad(); po:zero_grad()
  end
  return model
end

test("GPT-2 with policies/gpt2 equals serial GPT-2 (heads, MLP and vocabulary split)", function()
  local cfg = { vocab = 256, seq = 16, dim = 32, heads = 4, layers = 2 }
  local model = equal_to_serial(function() return pt.models.gpt2(cfg) end, nil,
    function(shard) return pt.data.text { path = "data/kjv.txt", seq = 16, batch = 4, seed = 2, mesh = shard and mesh or nil } end,
    function(m) return pt.loss_fn(m) end, 5)
  eq(model:get("h.0.attn"):attribute("heads"), 4 / args.tensor, "heads divided by tensor")
  eq(model:get("lm_head"):type(), "ColumnParallelLinear")
  ok(model.lm_head.weight:equal(model.wte.weight), "the output head stays tied to the embedding")
end)

test("the MLP and the tutorial's SimpleModel with their shipped policies equal serial", function()
  equal_to_serial(function() return pt.models.mlp { sizes = { 784, 64, 32, 10 } } end, "policies.mlp",
    function(shard) return pt.data.mnist { batch = 16, seed = 2, mesh = shard and mesh or nil } end,
    function() return pt.nn.cross_entropy end, 5)
  local model = equal_to_serial(function() return SimpleModel(256, 16) end, nil,
    function(shard) return pt.data.text { path = "data/kjv.txt", seq = 10, batch = 4, seed = 2, mesh = shard and mesh or nil } end,
    function() return function(out) return out:mean() end end, 5)
  eq(model:get("hidden_layer").weight.shape[1], 16 / args.tensor, "hidden dimension split")
end)

-- A model written here in Lua, and a policy for it written here too.
local Block = pt.nn.Module "TestBlock"
function Block:__init() self.up = pt.nn.Linear(6, 12); self.down = pt.nn.Linear(12, 6) end
function Block:forward(x) return x + self.down(self.up(x):tanh()) end
local Net = pt.nn.Module "TestNet"
function Net:__init() self.a = Block(); self.b = Block(); self.head = pt.nn.Linear(6, 3) end
function Net:forward(x) return self.head(self.b(self.a(x))) end
local net_policy = P.policy {
  name = "testnet", targets = { "TestNet" },
  modules = { TestBlock = { replace = { { "up", P.column {} }, { "down", P.row {} } } } },
}

test("a Lua-defined model with a policy written in the test equals serial", function()
  local model = equal_to_serial(function() return Net() end, net_policy,
    function(shard) return pt.data.mnist { batch = 8, seed = 2, mesh = shard and mesh or nil } end,
    function() return function(out, y) return pt.nn.cross_entropy(out, y) end end, 0)
  eq(model:get("a.up"):type(), "ColumnParallelLinear"); eq(model:get("b.down"):type(), "RowParallelLinear")
  local x = pt.randn(4, 6)
  mesh:group("tensor"):broadcast(x, 0)
  pt.manual_seed(21)
  local serial = Net()
  near(model(x), serial(x), TOL, "forward")
end)

-- Bad policies: each refused with the policy's file:line, the model left as it was.
local function refused(policy_fn, message, model)
  model = model or pt.models.mlp { sizes = { 8, 6, 4 } }
  local before = tostring(model)
  local err = raises(function() P.apply(model, policy_fn(), mesh, {}) end, message)
  ok(err:find("test_policy.lua:%d+:"), "names the policy's file:line: " .. err)
  eq(tostring(model), before, "nothing changed")
end

if args.tensor == 2 then  -- the messages below name tensor=2
test("bad policies are refused with file:line before anything changes", function()
  refused(function() return P.policy { modules = { Nothing = { replace = { { "0", P.column {} } } } } } end,
    "modules.Nothing matches no module of MLP")
  refused(function() return P.policy { modules = { MLP = { replace = { { "7", P.column {} } } } } } end,
    "column: no module '7' in MLP")
  refused(function() return P.policy { modules = { MLP = { replace = { { "1", P.column {} } } } } } end,
    "P.column does not fit 1: it is a ReLU, and P.column needs a Linear")
  refused(function() return P.policy { modules = { MLP = { replace = { { "0", P.vocab_embedding {} } } } } } end,
    "P.vocab_embedding does not fit 0: it is a Linear")
  refused(function() return P.policy { modules = { MLP = { replace = { { "0", P.column { fused = 4 } } } } } } end,
    "tensor=2 does not divide 0's output of 6 (4 fused parts")
  refused(function() return P.policy { modules = { MLP = { replace = { { "0", P.row {} } } } } } end,
    "does not divide 0's input of", pt.models.mlp { sizes = { 7, 6, 4 } })
  raises(function() P.column { fused = "3" } end, "P.column option 'fused' must be a number, got string")
  raises(function() P.column { fuse = 3 } end, "P.column has no option 'fuse' (options: fused, gather_output, sequence_parallel)")
  raises(function() P.policy { module = {} } end, "policy has no field 'module'")
  raises(function() P.policy { name = 3, modules = {} } end, "policy field 'name' must be a string, got number")
  raises(function() P.policy { modules = { MLP = { replce = {} } } } end, "modules.MLP has no field 'replce'")
  raises(function() P.policy { modules = { MLP = { replace = { { "0", "column" } } } } } end,
    "modules.MLP.replace[1] must be { \"path\", P.<style> {...}")
  refused(function() return P.policy { targets = { "GPT2" }, modules = { MLP = {} } } end, "policy ? serves GPT2, not MLP")
  refused(function() return P.policy { modules = { MLP = {} }, preprocess = function() error("boom") end } end,
    "preprocess of policy ? failed:")
  local gpt = pt.models.gpt2 { vocab = 256, seq = 8, dim = 12, heads = 3, layers = 1 }
  refused(function() return P.policy { modules = { GPT2Block = { attributes = { ["attn.heads"] = P.divide_by_tensor } } } } end,
    "tensor=2 does not divide h.0.attn.heads=3", gpt)
  refused(function() return P.policy { modules = { GPT2Block = { attributes = { ["attn.width"] = P.divide_by_tensor } } } } end,
    "GPT2Attention has no attribute 'width'", gpt)
  refused(function() return P.policy { modules = { ["h.*.attn"] = { replace = { { "c_q", P.column {} } } } } } end,
    "no module 'h.0.attn.c_q'", gpt)
  local fine = pt.models.mlp { sizes = { 8, 6, 4 } }
  P.apply(fine, P.policy { modules = { MLP = { replace = { { "0", P.column {} }, { "9", P.row {}, ignore_if_missing = true } } } } }, mesh, {})
  eq(fine:get("0"):type(), "ColumnParallelLinear", "ignore_if_missing skips a path that is not there")
  raises(function() pt.parallelize(pt.nn.Linear(2, 2), nil, mesh) end, "no policy is registered for Linear")
end)
end

H.run()
