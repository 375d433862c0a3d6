-- Pipeline x tensor parallelism trains GPT-2 exactly as serial training: pipeline 2 x tensor 2
-- on 4 ranks (tensor parallelism inside each stage, the pipeline joining the ranks of one tensor
-- coordinate), 1F1B over 20 steps (SGD with momentum in float32, AdamW in float64), the loss every
-- step and every logical parameter at the end within 1e-5 (float32) and 1e-10 (float64) relative
-- to max(|x|, 1); with sequence parallelism
-- inside the stages too; clipping's global norm counts each split parameter once a tensor group
-- and sums over the stages; a sequence sequence parallelism cannot split is refused by all stages. The pipelined model is built deferred: each rank materializes only
-- its stage's shards.
--   partrain --nproc-per-node 4 --threads 1 tests/dist/test_pipeline_tp.lua
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, near, eq, ok = H.test, H.near, H.eq, H.ok

local TOL = { float32 = 1e-5, float64 = 1e-10 }
local gpt = { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 4 }
local BATCH = 8

local mesh = pt.mesh { pipeline = 2, tensor = 2 }
local stage = mesh:coord().pipeline

local function batch()
  local x, y = pt.randint(0, gpt.vocab, { BATCH, gpt.seq }), pt.randint(0, gpt.vocab, { BATCH, gpt.seq })
  mesh:group("world"):broadcast(x, 0); mesh:group("world"):broadcast(y, 0)
  return x, y
end

local function equal_to_serial(what, dtype, steps, opts, optim)
  local tol = TOL[dtype]
  pt.manual_seed(7)
  local serial = pt.models.gpt2(gpt):to(dtype)
  pt.manual_seed(7)
  local deferred = pt.deferred(function() return pt.models.gpt2(gpt):to(dtype) end)
  local model = pt.parallelize(deferred, "policies.gpt2", mesh, opts)
  -- float32: SGD with momentum (Adam divides a near-zero gradient by its own size, which turns
  -- float32's reduction-order rounding into whole steps); float64: AdamW, exact to 1e-10.
  local make = dtype == "float32" and pt.optim.sgd or pt.optim.adamw
  optim = optim or (dtype == "float32" and { lr = 0.1, momentum = 0.9 } or { lr = 1e-2 })
  local so, po = make(serial, optim), make(model, optim)
  for step = 1, steps do
    local x, y = batch()
    local out = serial(x)
    local ls = pt.nn.cross_entropy(out:reshape(-1, out.shape[#out.shape]), y:reshape(-1))
    ls:backward()
    local lp = model:train_step(x, y)
    near(lp, ls, tol, ("%s (%s): loss at step %d"):format(what, dtype, step))
    so:step(); po:step()
    so:zero_grad(); po:zero_grad()
  end
  -- Every logical parameter this stage holds (split ones gathered over the tensor group) equals
  -- the serial one; every serial one is held by some stage.
  local mine, want = model:full_state_dict(), serial:state_dict()
  local names = {}
  for name in pairs(want) do names[#names + 1] = name end
  table.sort(names)
  local flags = {}
  for i, name in ipairs(names) do
    flags[i] = mine[name] and 1 or 0
    if mine[name] then near(mine[name], want[name], tol, ("%s (%s): parameter %s"):format(what, dtype, name)) end
  end
  local held = pt.tensor(flags)
  mesh:group("pipeline"):all_reduce(held)
  for i, name in ipairs(names) do ok(held:select(0, i - 1):item() >= 1, ("%s: %s is held by no stage"):format(what, name)) end
  return model, serial
end

test("pipeline 2 x tensor 2, 1f1b, 20 steps, equals serial training (float32)", function()
  local model = equal_to_serial("pp2 x tp2", "float32", 20, { schedule = "1f1b", microbatches = 4 })
  local sd = model:state_dict()
  eq(sd["wte.weight"] ~= nil, stage == 0, "the embedding lives on the first stage")
  eq(sd["lm_head.weight"] ~= nil, stage == 1, "the vocabulary head lives on the last stage")
  local c_fc = sd[stage == 0 and "h.0.mlp.c_fc.weight" or "h.2.mlp.c_fc.weight"]
  eq(table.concat(c_fc.shape, ","), "32,16", "c_fc is split over the tensor group: 64 / 2 rows here")
  -- A block's 3280 parameters, split: 1104 whole (the norms, the row layers' biases) + 2176 / 2.
  ok(model:num_parameters() < 7712, "a rank holds less than its stage: " .. model:num_parameters())
end)

test("pipeline 2 x tensor 2 equals serial training (float64), with clipping by global norm", function()
  equal_to_serial("pp2 x tp2", "float64", 20, { schedule = "1f1b", microbatches = 4 },
    { lr = 1e-2, clip_grad_norm = 0.05 })
end)

test("sequence parallelism inside the stages of pipeline 2 x tensor 2 equals serial training", function()
  equal_to_serial("pp2 x tp2 sp", "float64", 10, { schedule = "1f1b", microbatches = 4, sequence_parallel = true })
  equal_to_serial("pp2 x tp2 sp", "float32", 10, { schedule = "gpipe", microbatches = 2, sequence_parallel = true })
end)

test("a sequence that does not split over the tensor ranks is refused by every stage, and the pipeline trains on", function()
  -- Only the first stage splits the sequence: the last stage waited for it until --timeout before.
  local model = pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh, { microbatches = 2, sequence_parallel = true })
  local x, y = batch()
  local err = H.raises(function() model:train_step(x:narrow(1, 0, gpt.seq - 1), y:narrow(1, 0, gpt.seq - 1)) end,
    "sequence parallelism: the sequence of 7 does not split into tensor=2 equal parts")
  ok(err:find("^[^:]*test_pipeline_tp%.lua:%d+:"), "the error names the caller's line: " .. err)
  local loss = model:train_step(x, y):item()
  ok(loss == loss and loss > 0, "the next step trains: loss " .. loss)
end)

test("Hugging Face weights load into the stages and export from them, a bad file refused everywhere", function()
  require "safetensors_stages"(mesh, { microbatches = 2 }, "pipeline 2 x tensor 2")
end)

H.run()
