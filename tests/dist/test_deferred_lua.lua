-- A model written in Lua, built inside pt.deferred and parallelized, holds on every rank exactly
-- the tensors (bit for bit) of the same deferred build materialized whole: the initialization its
-- modules' __init asked for (pt.nn.init.*, mul_ under no_grad) is replayed, a weight tied across
-- pipeline stages (embedding and head) is the same tensor's values on both, and layers replaced by
-- tensor parallelism keep their serial layer's initialization. It then trains as the whole model
-- does (float64, 3 steps, loss and parameters within 1e-12).
--   partrain --nproc-per-node 2 tests/dist/test_deferred_lua.lua --tensor 2
--   partrain --nproc-per-node 2 tests/dist/test_deferred_lua.lua --pipeline 2
--   partrain --nproc-per-node 4 tests/dist/test_deferred_lua.lua --pipeline 2 --tensor 2
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local P = require "partrain.policy"
local H = require "harness"
local test, near, eq, ok = H.test, H.near, H.eq, H.ok

local args = pt.args { tensor = 1, pipeline = 1 }
local mesh = pt.mesh { tensor = args.tensor, pipeline = args.pipeline }
local VOCAB, DIM, SEQ, BATCH = 32, 8, 6, 4

local Block = pt.nn.Module "DeferredBlock"
function Block:__init(d)
  self.up = pt.nn.Linear(d, 4 * d)
  self.down = pt.nn.Linear(4 * d, d)
  pt.nn.init.normal_(self.up.weight, 0, 0.02)
  pt.nn.init.zeros_(self.up.bias)
  pt.nn.init.kaiming_uniform_(self.down.weight, { a = math.sqrt(5) })
  pt.no_grad(function() self.down.weight:mul_(0.5) end)
end
function Block:forward(x) return x + self.down(self.up(x):relu()) end

local function build()
  local embed = pt.nn.Embedding(VOCAB, DIM)
  pt.nn.init.normal_(embed.weight, 0, 0.02)
  local head = pt.nn.Linear(DIM, VOCAB, { bias = false })
  head.weight = embed.weight  -- tied: first in tree order is the embedding's
  local seq = pt.nn.Sequential()
  seq:add("embed", embed)
  seq:add("blocks", pt.nn.Sequential(Block(DIM), Block(DIM), Block(DIM), Block(DIM)))
  seq:add("head", head)
  return seq
end

local policy = P.policy {
  name = "deferred-chain", targets = { "Sequential" },
  modules = { DeferredBlock = { replace = { { "up", P.column {} }, { "down", P.row {} } } } },
  pipeline = { blocks = "blocks", first = { "embed" }, last = { "head" } },
}

test(("pipeline %d x tensor %d: a deferred Lua model equals its whole materialization, bit for bit")
    :format(args.pipeline, args.tensor), function()
  pt.manual_seed(5)
  local whole = pt.deferred(build):materialize()
  ok(math.abs(whole.embed.weight:std():item() - 0.02) < 0.005, "__init's normal_(0, 0.02) kept: std "
     .. whole.embed.weight:std():item())
  eq(whole.blocks["0"].up.bias:abs():sum():item(), 0, "__init's zeros_ kept")
  pt.manual_seed(5)
  local model = pt.parallelize(pt.deferred(build), policy, mesh, args.pipeline > 1 and { microbatches = 2 } or nil)
  ok(not model:is_meta(), "materialized by pt.parallelize")
  local mine, want = model:full_state_dict(), whole:state_dict()
  local held = 0
  for name, t in pairs(mine) do
    ok(want[name] ~= nil, name .. " is a tensor of the whole model")
    ok(t:equal(want[name]), name .. " equals the whole model's, bit for bit")
    held = held + 1
  end
  ok(held > 0, "this rank holds tensors")
  local sd = model:state_dict()
  if sd["head.weight"] and args.tensor == 1 then
    ok(sd["head.weight"]:equal(whole.embed.weight), "the head on the last stage holds the embedding's values")
  end
end)

test("the deferred Lua model trains as the whole model does (float64, 3 steps)", function()
  pt.manual_seed(6)
  local whole = pt.deferred(function() return build():to("float64") end):materialize()
  pt.manual_seed(6)
  local model = pt.parallelize(pt.deferred(function() return build():to("float64") end), policy, mesh,
    args.pipeline > 1 and { microbatches = 2 } or nil)
  local so, po = pt.optim.sgd(whole, { lr = 0.5 }), pt.optim.sgd(model, { lr = 0.5 })
  local data = pt.randint(0, VOCAB, { 3, 2, BATCH, SEQ })
  mesh:group("world"):broadcast(data, 0)
  for step = 0, 2 do
    local x, y = data:select(0, step):select(0, 0), data:select(0, step):select(0, 1)
    local out = whole(x)
    local ls = pt.nn.cross_entropy(out:reshape(-1, VOCAB), y:reshape(-1))
    ls:backward()
    local lp = model:train_step(x, y)
    near(lp, ls, 1e-12, "loss at step " .. step)
    so:step(); po:step(); so:zero_grad(); po:zero_grad()
  end
  local want = whole:state_dict()
  for name, t in pairs(model:full_state_dict()) do near(t, want[name], 1e-12, "parameter " .. name) end
end)

H.run()
