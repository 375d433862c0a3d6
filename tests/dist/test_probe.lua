-- The policy probe stays on for models of every size and dtype: above P.probe_limit it checks the
-- first of the model's repeated blocks with the real shapes (so a wrong split of a 25 M-parameter
-- model written in Lua is refused, built normally or deferred); in bfloat16 and float16 its
-- tolerance is the serial model's own rounding, measured against a float64 run of the same
-- weights, so correct splits of GPT-2 pass at several sizes and a wrong split is still refused.
--   partrain --nproc-per-node 2 tests/dist/test_probe.lua            (tensor 2)
--   partrain --nproc-per-node 4 tests/dist/test_probe.lua --tensor 4
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local P = require "partrain.policy"
local H = require "harness"
local test, eq, ok, raises = H.test, H.eq, H.ok, H.raises

local args = pt.args { tensor = 2 }
local mesh = pt.mesh { tensor = args.tensor }

-- A gated MLP block whose gate and up projections are one Linear: split right, each rank takes
-- half of each (fused = 2); split as one (P.column {}), rank 0 gets the gate, rank 1 the up.
local Gated = pt.nn.Module "ProbeGated"
function Gated:__init(d, h)
  self.gate_up = pt.nn.Linear(d, 2 * h)
  self.down = pt.nn.Linear(h, d)
end
function Gated:forward(x)
  local gu = self.gate_up(x)
  local half = math.floor(gu.shape[#gu.shape] / 2)
  return x + self.down(gu:narrow(-1, 0, half):silu() * gu:narrow(-1, half, half))
end

local function gated_model(d, h, blocks, vocab)
  local list = {}
  for i = 1, blocks do list[i] = Gated(d, h) end
  local m = pt.nn.Sequential()
  m:add("embed", pt.nn.Embedding(vocab, d))
  m:add("blocks", pt.nn.Sequential(unpack(list)))
  m:add("head", pt.nn.Linear(d, vocab))
  return m
end

local function gated_policy(fused)
  return P.policy { name = fused and "gated" or "gated-unfused", targets = { "Sequential" },
    modules = { ProbeGated = { replace = { { "gate_up", P.column { fused = fused } }, { "down", P.row {} } } } } }
end

-- 8 blocks of 3.1 M parameters: 25 M, above the 16 M P.probe_limit.
local BIG = { 512, 2048, 8, 256 }

test("above P.probe_limit, a wrong split is refused by a probe of one block; the right one trains", function()
  pt.manual_seed(1)
  local model = gated_model(unpack(BIG))
  ok(model:num_parameters() > P.probe_limit, "the model is above the limit: " .. model:num_parameters())
  raises(function() pt.parallelize(model, gated_policy(nil), mesh) end,
    "policy gated-unfused splits Sequential wrong: its output differs from the serial model's on the probe batch")
  eq(#model.blocks:children(), 8, "the refused model keeps its 8 blocks")
  local sharded = pt.parallelize(model, gated_policy(2), mesh)
  eq(#sharded.blocks:children(), 8, "the probe's slice is put back: 8 blocks")
  local x = pt.randint(0, 256, { 2, 4 })
  mesh:group("world"):broadcast(x, 0)
  local out = sharded(x)
  ok(out:isfinite():all():item(), "the sharded model runs all its blocks")
end)

test("a deferred model above the limit is probed too: its slice is made for the probe, then put back", function()
  pt.manual_seed(2)
  local deferred = pt.deferred(function() return gated_model(unpack(BIG)) end)
  raises(function() pt.parallelize(deferred, gated_policy(nil), mesh) end, "splits Sequential wrong")
  ok(deferred:is_meta(), "the refused deferred model holds no memory still")
  pt.manual_seed(3)
  local small = function() return gated_model(16, 32, 3, 20) end
  local whole = pt.deferred(small):materialize()
  pt.manual_seed(3)
  local model = pt.parallelize(pt.deferred(small), gated_policy(2), mesh)
  for name, t in pairs(model:full_state_dict()) do
    ok(t:equal(whole:state_dict()[name]), name .. ": the probe left the deferred weights as pt.parallelize makes them")
  end
  raises(function()
    pt.manual_seed(3)
    pt.parallelize(pt.deferred(small), gated_policy(nil), mesh)
  end, "splits Sequential wrong")
end)

for _, dtype in ipairs { "bfloat16", "float16" } do
  test(dtype .. ": GPT-2's policy passes the probe at several sizes; a wrong split is refused", function()
    for _, size in ipairs { { 64, 2, 256 }, { 256, 2, 512 }, { 512, 1, 1024 } } do
      pt.manual_seed(4)
      local gpt = pt.models.gpt2 { vocab = size[3], seq = 16, dim = size[1], heads = 8, layers = size[2] }:to(dtype)
      local model = pt.parallelize(gpt, "policies.gpt2", mesh)
      ok(model ~= nil, dtype .. " GPT-2 of width " .. size[1] .. " is accepted")
    end
    pt.manual_seed(5)
    raises(function() pt.parallelize(gated_model(64, 128, 2, 50):to(dtype), gated_policy(nil), mesh) end,
      "differs from the serial model's on the probe batch: a largest difference from the exact (float64) values")
    pt.manual_seed(5)
    ok(pt.parallelize(gated_model(64, 128, 2, 50):to(dtype), gated_policy(2), mesh) ~= nil,
      dtype .. ": the fused split is accepted")
  end)
end

H.run()
