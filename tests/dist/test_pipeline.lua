-- Pipeline-parallel GPT-2 (and LLaMA) trains exactly as serial training: gpipe, 1f1b and interleaved schedules,
-- uniform, by-parameter and explicit stage splits, at pipeline 2 (2 ranks), and pipeline 2 x data 2
-- and pipeline 4 (4 ranks); losses every step and every parameter a rank holds at the end within
-- 1e-5 (float32) and 1e-10 (float64) relative to max(|x|, 1), every serial parameter held by some
-- stage, each rank holding only its stages' blocks; the pipelined model is built deferred (on the
-- meta device) and each rank allocates only its stage's parameters; clipping's global norm spans
-- every stage.
-- Also: options that cannot run, ranks that would run different pipelines and bad batches are
-- refused at the caller's line, on every rank, before anything is sent.
--   partrain --nproc-per-node 2 --threads 1 tests/dist/test_pipeline.lua
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, near, eq, ok, raises = H.test, H.near, H.eq, H.ok, H.raises

local TOL = { float32 = 1e-5, float64 = 1e-10 }
local gpt = { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 4 }
local BATCH = 8  -- a data rank's batch: 8 / data rows

-- The global batch (the same on every rank) and this rank's data slice of it; `pad(y, step)`,
-- if given, sets targets of the global batch to ignore_index first.
local function batches(mesh, pad, step)
  local x, y = pt.randint(0, gpt.vocab, { BATCH, gpt.seq }), pt.randint(0, gpt.vocab, { BATCH, gpt.seq })
  mesh:group("world"):broadcast(x, 0); mesh:group("world"):broadcast(y, 0)
  if pad then pad(y, step) end
  local d, n = mesh:coord().data, mesh:size("data")
  local b = BATCH / n
  return x, y, x:narrow(0, d * b, b), y:narrow(0, d * b, b)
end

-- Trains GPT-2 serially (built normally) and through the pipeline (built deferred: each rank
-- materializes only its stages) from the same seed; returns the pipelined model. Every rank's
-- train_step returns the global batch's loss.
local function equal_to_serial(what, mesh, opts, dtype, steps, optim, family, pad)
  local tol = TOL[dtype]
  local build, policy = function() return pt.models.gpt2(gpt) end, "policies.gpt2"
  if family == "llama" then
    build = function() return pt.models.llama { vocab = gpt.vocab, seq = gpt.seq, dim = gpt.dim, heads = 4, kv_heads = 2,
                                                layers = gpt.layers } end
    policy = "policies.llama"
  end
  pt.manual_seed(5)
  local serial = build():to(dtype)
  pt.manual_seed(5)
  local deferred = pt.deferred(function() return build():to(dtype) end)
  local model = pt.parallelize(deferred, policy, mesh, opts)
  local so = pt.optim.adamw(serial, optim or { lr = 1e-2 })
  local po = pt.optim.adamw(model, optim or { lr = 1e-2 })
  for step = 1, steps or 5 do
    local gx, gy, x, y = batches(mesh, pad, step)
    local out = serial(gx)
    local ls = pt.nn.cross_entropy(out:reshape(-1, out.shape[#out.shape]), gy:reshape(-1))
    ls:backward()
    local lp = model:train_step(x, y)
    if ls:item() ~= ls:item() then  -- nothing counted: NaN, as serial training's
      ok(lp:item() ~= lp:item(), ("%s (%s): loss at step %d is %s, serial NaN"):format(what, dtype, step, lp:item()))
    else
      near(lp, ls, tol, ("%s (%s): loss at step %d"):format(what, dtype, step))
    end
    so:step(); po:step()
    so:zero_grad(); po:zero_grad()
  end
  -- Every parameter this rank holds equals the serial one; every serial one is held somewhere.
  local mine, want = model:state_dict(), serial:state_dict()
  local names = {}
  for name in pairs(want) do names[#names + 1] = name end
  table.sort(names)
  local flags = {}
  for i, name in ipairs(names) do
    flags[i] = mine[name] and 1 or 0
    if mine[name] then
      near(mine[name], want[name], tol, ("%s (%s): parameter %s"):format(what, dtype, name))
    end
  end
  for name in pairs(mine) do ok(want[name] ~= nil, what .. ": an unknown parameter " .. name) end
  local held = pt.tensor(flags)
  mesh:group("pipeline"):all_reduce(held)
  for i, name in ipairs(names) do ok(held:select(0, i - 1):item() >= 1, ("%s: %s is held by no stage"):format(what, name)) end
  return model
end

-- The blocks (h.N) whose parameters this rank holds.
local function blocks_held(model)
  local set, list = {}, {}
  for name in pairs(model:state_dict()) do
    local n = name:match("^h%.(%d+)%.")
    if n and not set[n] then set[n] = true; list[#list + 1] = tonumber(n) end
  end
  table.sort(list)
  return table.concat(list, ",")
end

local mesh = pt.mesh { pipeline = 2 }
local stage = mesh:coord().pipeline

for _, dtype in ipairs { "float32", "float64" } do
  for _, schedule in ipairs { "gpipe", "1f1b" } do
    test(("%s over pipeline 2 equals serial training (%s)"):format(schedule, dtype), function()
      local model = equal_to_serial(schedule, mesh, { schedule = schedule, microbatches = 4 }, dtype)
      eq(blocks_held(model), stage == 0 and "0,1" or "2,3", "uniform: two blocks a stage")
      local sd = model:state_dict()
      eq(sd["wte.weight"] ~= nil, stage == 0, "the embeddings live on the first stage")
      eq(sd["lm_head.weight"] ~= nil, stage == 1, "the head lives on the last stage")
    end)
  end
end

test("LLaMA (grouped-query heads, untied head) over the pipeline equals serial training (1f1b and interleaved, float64)", function()
  equal_to_serial("llama 1f1b", mesh, { schedule = "1f1b", microbatches = 4 }, "float64", 3, nil, "llama")
  equal_to_serial("llama interleaved", mesh, { schedule = "interleaved", chunks = 2, microbatches = 4 }, "float64", 3, nil,
    "llama")
end)

-- From the second step on, each activation's receive is posted before it is sent, with the shape
-- the same micro-batch had at that stage last step; a step whose shapes change sends the tensor
-- after zeros of the predicted shape. Serial training with shapes that change every step (fewer
-- tokens, more rows, then back) is what the pipeline must still equal.
test("micro-batches whose shape changes from step to step equal serial training (1f1b and interleaved, float64)", function()
  for _, opts in ipairs { { schedule = "1f1b", microbatches = 4 }, { schedule = "interleaved", chunks = 2, microbatches = 4 } } do
    pt.manual_seed(9)
    local serial = pt.models.gpt2(gpt):to("float64")
    pt.manual_seed(9)
    local model = pt.parallelize(pt.deferred(function() return pt.models.gpt2(gpt):to("float64") end), "policies.gpt2",
      mesh, opts)
    local so, po = pt.optim.adamw(serial, { lr = 1e-2 }), pt.optim.adamw(model, { lr = 1e-2 })
    local d, n = mesh:coord().data, mesh:size("data")
    for step, shape in ipairs { { 8, 8 }, { 8, 8 }, { 8, 5 }, { 16, 8 }, { 8, 8 }, { 8, 8 } } do
      local rows, seq = shape[1], shape[2]
      local gx, gy = pt.randint(0, gpt.vocab, { rows, seq }), pt.randint(0, gpt.vocab, { rows, seq })
      mesh:group("world"):broadcast(gx, 0); mesh:group("world"):broadcast(gy, 0)
      local out = serial(gx)
      local ls = pt.nn.cross_entropy(out:reshape(-1, gpt.vocab), gy:reshape(-1))
      ls:backward()
      local b = rows / n
      local lp = model:train_step(gx:narrow(0, d * b, b), gy:narrow(0, d * b, b))
      near(lp, ls, TOL.float64, ("%s, step %d (%d x %d tokens): loss"):format(opts.schedule, step, rows, seq))
      so:step(); po:step()
      so:zero_grad(); po:zero_grad()
    end
    local want = serial:state_dict()
    for name, t in pairs(model:state_dict()) do
      near(t, want[name], TOL.float64, ("%s: parameter %s after shapes changed"):format(opts.schedule, name))
    end
  end
end)

-- Serial training's loss is the mean over the batch's counted targets. Padding (ignore_index)
-- spread unevenly over the micro-batches and the data ranks, a micro-batch counting nothing, and
-- a batch counting nothing at all (NaN loss, zero gradients) must train as serial training; each
-- micro-batch's mean had weighed alike (a loss of 4.1833 against serial training's 4.1560).
test("targets padded unevenly over micro-batches and data ranks equal serial training (1f1b, interleaved, float64)", function()
  local function pad(y, step)
    if step == 3 then return y:fill_(-100) end  -- nothing counted anywhere
    y:narrow(0, 0, 2):fill_(-100)  -- the first micro-batch (at data 2: the first two of data rank 0's)
    y:narrow(0, 2, 3):narrow(1, step, 4):fill_(-100)  -- part of the next rows
  end
  equal_to_serial("padded 1f1b", mesh, { schedule = "1f1b", microbatches = 4 }, "float64", 4, nil, nil, pad)
  equal_to_serial("padded interleaved", mesh, { schedule = "interleaved", chunks = 2, microbatches = 4 }, "float64", 4,
    nil, nil, pad)
  equal_to_serial("padded 1f1b", mesh, { schedule = "1f1b", microbatches = 2 }, "float32", 2, nil, nil, pad)
end)

-- A gradient the last train_step left (two an opt:step, or no zero_grad at all) accumulates as
-- serial training's; the tied wte = lm_head's was summed over the pipeline a second time.
test("two train_steps an opt:step, and steps without zero_grad, equal serial training (float64)", function()
  for _, never_zero in ipairs { false, true } do
    local what = never_zero and "no zero_grad" or "two train_steps an opt:step"
    pt.manual_seed(3)
    local serial = pt.models.gpt2(gpt):to("float64")
    pt.manual_seed(3)
    local model = pt.parallelize(pt.deferred(function() return pt.models.gpt2(gpt):to("float64") end), "policies.gpt2",
      mesh, { schedule = "1f1b", microbatches = 2 })
    local so, po = pt.optim.sgd(serial, { lr = 0.05 }), pt.optim.sgd(model, { lr = 0.05 })
    for step = 1, 3 do
      for half = 1, never_zero and 1 or 2 do
        local gx, gy, x, y = batches(mesh)
        local ls = pt.nn.cross_entropy(serial(gx):reshape(-1, gpt.vocab), gy:reshape(-1))
        ls:backward()
        near(model:train_step(x, y), ls, TOL.float64, ("%s: loss at step %d, batch %d"):format(what, step, half))
      end
      so:step(); po:step()
      if not never_zero then so:zero_grad(); po:zero_grad() end
    end
    local want = serial:state_dict()
    for name, t in pairs(model:state_dict()) do near(t, want[name], TOL.float64, what .. ": parameter " .. name) end
  end
end)

test("a deferred model's ranks allocate only their own stage's parameters", function()
  -- GPT-2 at dim 16: a block holds 3280 parameters, wte 1024, wpe 128, ln_f 32, lm_head (tied to
  -- wte: its own tensor on the last stage) 1024; serially 14304.
  pt.manual_seed(5)
  local deferred = pt.deferred(function() return pt.models.gpt2(gpt) end)
  ok(deferred:is_meta(), "built on the meta device")
  eq(deferred:num_parameters(), 14304, "the serial model's parameter count")
  local model = pt.parallelize(deferred, "policies.gpt2", mesh, { microbatches = 2 })
  ok(not model:is_meta(), "every tensor this rank holds is allocated")
  local bytes = 0
  for _, p in ipairs(model:parameters()) do bytes = bytes + p:numel() * 4 end
  eq(model:num_parameters(), stage == 0 and 7712 or 7616, "stage " .. stage .. "'s parameters only")
  eq(bytes, model:num_parameters() * 4, "no tensor held twice")
end)

if mesh:size("data") == 1 then
  test("interleaved, 2 chunks a rank, equals serial training (float64)", function()
    local model = equal_to_serial("interleaved", mesh, { schedule = "interleaved", microbatches = 4, chunks = 2 },
      "float64")
    eq(blocks_held(model), stage == 0 and "0,2" or "1,3", "chunk c of rank r is virtual stage 2c + r")
  end)
else
  test("interleaved, 2 chunks a rank, with data parallelism (pipeline 2 x data 2) equals serial training", function()
    local model = equal_to_serial("interleaved x data", mesh, { schedule = "interleaved", microbatches = 4,
      chunks = 2 }, "float64")
    eq(blocks_held(model), stage == 0 and "0,2" or "1,3", "chunk c of rank r is virtual stage 2c + r")
    equal_to_serial("interleaved x data", mesh, { schedule = "interleaved", microbatches = 2, chunks = 2 }, "float32", 5)
  end)
end

if pt.dist.world_size() == 4 then
  test("1f1b and gpipe over pipeline 4 (middle stages, the tie across them) equal serial training (float64)", function()
    local deep = pt.mesh { pipeline = 4 }
    local r = deep:coord().pipeline
    local model = equal_to_serial("1f1b pp4", deep, { schedule = "1f1b", microbatches = 4 }, "float64")
    eq(blocks_held(model), tostring(r), "one block a stage")
    equal_to_serial("gpipe pp4", deep, { schedule = "gpipe", microbatches = 2 }, "float64", 2)
  end)
end

test("explicit and by-parameter stage splits equal serial training (float64)", function()
  local model = equal_to_serial("explicit", mesh, { schedule = "1f1b", microbatches = 2, balance = { 3, 1 } },
    "float64", 3)
  eq(blocks_held(model), stage == 0 and "0,1,2" or "3", "explicit: 3 blocks, then 1")
  -- The tied embedding and head weigh on both ends: with 2 stages they stay balanced.
  model = equal_to_serial("parameters", mesh, { microbatches = 2, balance = "parameters" }, "float64", 3)
  eq(blocks_held(model), stage == 0 and "0,1" or "2,3", "by parameters: the ends weigh alike")
end)

-- A model with no stage ends of its own: a chain (the policy's first modules, the blocks, its last
-- modules, applied in order), built in Lua from pt.nn layers.
local function chain()
  local root = pt.nn.Sequential()
  root:add("inp", pt.nn.Linear(8, 12))
  local h = pt.nn.Sequential()
  for _ = 1, 3 do h:add(pt.nn.Sequential(pt.nn.Linear(12, 12), pt.nn.Tanh())) end
  root:add("h", h)
  root:add("out", pt.nn.Linear(12, 5))
  return root:to("float64")
end
local P = require "partrain.policy"
local chain_policy = P.policy { name = "chain", targets = { "Sequential" }, modules = {},
                                pipeline = { blocks = "h", first = { "inp" }, last = { "out" } } }

-- Trains a float64 chain serially and pipelined (SGD, `steps` steps of the same batches): the losses
-- every step and the parameters the rank holds at the end within 1e-10. Returns its state dict.
local function chain_equals_serial(what, serial, model, steps)
  local so, po = pt.optim.sgd(serial, { lr = 0.1 }), pt.optim.sgd(model, { lr = 0.1 })
  local d, n = mesh:coord().data, mesh:size("data")
  for step = 1, steps do
    local x, y = pt.randn({ BATCH, 8 }):to("float64"), pt.randint(0, 5, { BATCH })
    mesh:group("world"):broadcast(x, 0); mesh:group("world"):broadcast(y, 0)
    local ls = pt.nn.cross_entropy(serial(x), y)
    ls:backward()
    local b = BATCH / n
    local lp = model:train_step(x:narrow(0, d * b, b), y:narrow(0, d * b, b)):detach():clone()
    mesh:group("data"):all_reduce(lp, "mean")
    near(lp, ls, 1e-10, ("%s: loss at step %d"):format(what, step))
    so:step(); po:step(); so:zero_grad(); po:zero_grad()
  end
  local mine, want = model:state_dict(), serial:state_dict()
  for name, t in pairs(mine) do near(t, want[name], 1e-10, what .. ": parameter " .. name) end
  return mine
end

test("a chain model (no stage ends of its own) over pipeline 2 equals serial training (float64)", function()
  pt.manual_seed(9)
  local serial = pt.deferred(chain):materialize()
  pt.manual_seed(9)
  local model = pt.parallelize(pt.deferred(chain), chain_policy, mesh, { microbatches = 2, balance = { 1, 2 } })
  local mine = chain_equals_serial("chain", serial, model, 5)
  eq(mine["inp.weight"] ~= nil, stage == 0, "the first module lives on the first stage")
  eq(mine["out.weight"] ~= nil, stage == 1, "the last module lives on the last stage")
  eq(mine["h.0.0.weight"] ~= nil, stage == 0, "uneven split {1, 2}: block 0 on the first stage")
  eq(mine["h.2.0.weight"] ~= nil, stage == 1, "and blocks 1, 2 on the last")
  -- A model whose forward is not that chain (children out of order, or not a Sequential) is refused.
  local swapped = pt.nn.Sequential()
  swapped:add("h", chain().h); swapped:add("inp", pt.nn.Linear(8, 12)); swapped:add("out", pt.nn.Linear(12, 5))
  raises(function() pt.parallelize(swapped, chain_policy, mesh, {}) end,
    "must be a Sequential whose children are the policy's first modules, its blocks' container and its last "
    .. "modules, in that order (inp, h, out), but it has h, inp, out")
  local Residual = pt.nn.Module("Residual")
  function Residual:__init() self.inp = pt.nn.Linear(8, 12); self.h = chain().h; self.out = pt.nn.Linear(12, 5) end
  function Residual:forward(x) local y = self.inp(x); return self.out(y + self.h(y)) end
  local residual_policy = P.policy { name = "residual", targets = { "Residual" }, modules = {},
                                     pipeline = { blocks = "h", first = { "inp" }, last = { "out" } } }
  raises(function() pt.parallelize(Residual(), residual_policy, mesh, {}) end, "but it is not a Sequential")
end)

-- A chain has no check of its own: its ends' widths (kept on every stage, though each holds its
-- own modules only) say what the first stage's forward and the last stage's loss would refuse.
-- Refused on one stage alone, the other waited for it until --timeout.
test("a chain's bad batch is refused on every stage before anything is sent, and it trains on", function()
  pt.manual_seed(9)
  local serial = pt.deferred(chain):materialize()
  pt.manual_seed(9)
  local model = pt.parallelize(pt.deferred(chain), chain_policy, mesh, { microbatches = 2 })
  local b = BATCH / mesh:size("data")
  local x, y = pt.randn({ b, 8 }):to("float64"), pt.randint(0, 5, { b })
  local here = "^[^:]*test_pipeline%.lua:%d+:"
  for _, case in ipairs {
    { pt.randn({ b, 9 }):to("float64"), y, "Sequential takes inputs (batch, ..., 8) of floating point numbers" },
    { x, y:clone():fill_(5), "target 5 is out of range for Sequential's 5 classes" },
    { x, pt.randint(0, 5, { b, 8 }), "so its targets must have that shape" },
  } do
    local e = raises(function() model:train_step(case[1], case[2]) end, case[3])
    ok(e:find(here), "names the script's line: " .. e)
  end
  chain_equals_serial("chain after refused batches", serial, model, 2)
end)

-- A chain whose first block costs far more time than its parameters say (one Linear applied 48
-- times): by parameters the blocks weigh alike, by measured time the first one outweighs the rest.
local Heavy = pt.nn.Module("Heavy")
function Heavy:__init() self.lin = pt.nn.Linear(12, 12) end
function Heavy:forward(x)
  for _ = 1, 48 do x = self.lin(x):tanh() end
  return x
end
local function lopsided(dropout)
  local root = pt.nn.Sequential()
  root:add("inp", pt.nn.Linear(8, 12))
  local h = pt.nn.Sequential()
  h:add("0", Heavy())
  for i = 1, 3 do
    h:add(tostring(i), dropout and pt.nn.Sequential(pt.nn.Linear(12, 12), pt.nn.Dropout(0.5))
      or pt.nn.Sequential(pt.nn.Linear(12, 12), pt.nn.Tanh()))
  end
  root:add("h", h)
  root:add("out", pt.nn.Linear(12, 5))
  return root:to("float64")
end

test("balance by measured time gives the costly block a stage of its own and equals serial training", function()
  pt.manual_seed(11)
  local serial = pt.deferred(lopsided):materialize()
  local x0 = pt.randn({ BATCH, 8 }):to("float64")
  pt.manual_seed(11)
  local model = pt.parallelize(pt.deferred(lopsided), chain_policy, mesh,
    { microbatches = 2, balance = "time", sample = x0 })
  local info = model:pipeline()
  eq(info.balance, "time", "the balance used")
  eq(#info.costs, 6, "a time for the first part, each of the 4 blocks, the last part")
  ok(info.costs[2] > 5 * math.max(info.costs[3], info.costs[4], info.costs[5]),
    "the heavy block measured costlier than any light one: " .. table.concat(info.costs, ", "))
  eq(table.concat(info.bounds, ","), "0,1,4", "the heavy block alone on stage 0 (uniform and parameters give 2, 2)")
  chain_equals_serial("time-balanced", serial, model, 3)
  -- The timing runs (dropout included) leave the random numbers where they were.
  pt.manual_seed(12)
  pt.parallelize(pt.deferred(function() return lopsided(true) end), chain_policy, mesh,
    { microbatches = 2, balance = "time", sample = x0 })
  local after_timing = pt.randn({ 8 })
  pt.manual_seed(12)
  pt.parallelize(pt.deferred(function() return lopsided(true) end), chain_policy, mesh, { microbatches = 2 })
  near(after_timing, pt.randn({ 8 }), 0, "the generator is where an untimed build leaves it")
  raises(function() pt.parallelize(lopsided(), chain_policy, mesh, { balance = "time" }) end,
    "balance = 'time' times the blocks on a sample input: give sample = one step's input batch, got nil")
  raises(function() pt.parallelize(lopsided(), chain_policy, mesh, { sample = x0 }) end,
    "sample is what balance = 'time' times the blocks on; balance is uniform")
end)

test("clipping by global norm spans every stage, the tied embedding once (float64)", function()
  -- A norm far below the gradients' clips every step: the updates equal serial ones only if the
  -- norm is the whole model's.
  equal_to_serial("clipped", mesh, { microbatches = 2 }, "float64", 3, { lr = 1e-2, clip_grad_norm = 0.05 })
  pt.manual_seed(5)
  local serial = pt.models.gpt2(gpt):to("float64")
  pt.manual_seed(5)
  local model = pt.parallelize(pt.models.gpt2(gpt):to("float64"), "policies.gpt2", mesh, { microbatches = 2 })
  local gx, gy, x, y = batches(mesh)
  local out = serial(gx)
  pt.nn.cross_entropy(out:reshape(-1, out.shape[#out.shape]), gy:reshape(-1)):backward()
  model:train_step(x, y)
  local want = pt.nn.clip_grad_norm(serial, 1e9)
  local got = pt.nn.clip_grad_norm(model, 1e9)
  ok(math.abs(got - want) <= 1e-10 * math.max(want, 1), ("pt.nn.clip_grad_norm: %.15g, serial %.15g"):format(got, want))
end)

test("pipeline options that cannot run are refused at the caller's line", function()
  local function refused(opts, pattern, m)
    local err = raises(function() pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", m or mesh, opts) end, pattern)
    ok(err:find("^[^:]*test_pipeline%.lua:%d+:"), "the error names the caller's line: " .. err)
  end
  refused({ schedule = "interleaved", microbatches = 3, chunks = 2 }, "multiple")
  refused({ balance = "by_flops" }, "balance must be 'uniform', 'parameters', 'time' or a list")
  refused({ balance = { 2, 1 } }, "gives 3 blocks in all, the model has 4")
  refused({ balance = { 1.5, 2.5 } }, "balance[1] (the blocks of stage 0) must be a positive integer, got 1.5")
  refused({ balance = { 2, 2, x = 1 } }, "balance must be a list of blocks a stage, got a table with key x")
  if mesh:size("data") == 1 then
    refused({ chunks = 4, schedule = "interleaved", microbatches = 4 }, "4 blocks cannot fill 8 stages")
  end
  -- Refused before the schedule is built and checked (which takes seconds at this size).
  refused({ schedule = "interleaved", microbatches = 1000, chunks = 64 },
    "4 blocks cannot fill 128 stages (pipeline=2 x chunks=64;")
  refused({ balance = { 1, 1, 2 } }, "explicit balance gives 3 stage sizes for 2 stages (pipeline=2 x chunks=1)")
  local one = { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 1 }
  raises(function() pt.parallelize(pt.models.gpt2(one), "policies.gpt2", mesh, {}) end, "1 block cannot fill 2 stages")
  raises(function() pt.parallelize(pt.models.mlp { sizes = { 4, 4 } }, nil, mesh, {}) end,
    "pipeline=2: the policy for MLP has no pipeline description")
  -- No policy passed in: the registered one describes the stages (policies.md: nil selects it).
  local cut = pt.parallelize(pt.models.gpt2(gpt), nil, mesh, { microbatches = 2 })
  eq(cut:pipeline().size, 2, "GPT-2 with policy nil is cut as policies.gpt2 describes")
  refused({ microbatches = 0 }, "microbatches must be a positive integer")
  refused({ schedule = "gpipe" }, "needs a mesh with pipeline > 1", pt.mesh {})
  -- A schedule function that never returns is interrupted on every rank, naming its line.
  refused({ schedule = function() while true do end end, schedule_timeout = 0.2 },
    "did not finish within schedule_timeout = 0.2 s (interrupted at")
  refused({ schedule_timeout = 0 }, "schedule_timeout must be a number of seconds > 0, got 0")
  local model = pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh, { microbatches = 2 })
  raises(function() model:train_step(pt.zeros({ 3, gpt.seq }, { dtype = "int64" }),
    pt.zeros({ 3, gpt.seq }, { dtype = "int64" })) end, "microbatches=2 does not divide the batch of 3")
  raises(function() model:train_step(pt.zeros({ 2, gpt.seq }, { dtype = "int64" }),
    pt.zeros({ 2, gpt.seq }, { dtype = "int64" }), { accumulate = 2 }) end, "accumulate=2 on a pipeline")
end)

test("ranks that would run different pipelines are refused at parallelize, before any step", function()
  -- A schedule whose plan depends on the rank trained on without any error before: the stages
  -- paired one micro-batch's activation with another's targets.
  local r = pt.dist.rank()
  local function by_rank(pp, m)
    local order = r == 0 and { 0, 1 } or { 1, 0 }
    local plan = {}
    for k = 0, pp - 1 do
      plan[k] = {}
      for _, i in ipairs(order) do plan[k][#plan[k] + 1] = "F" .. i end
      for _, i in ipairs(order) do plan[k][#plan[k] + 1] = "B" .. i end
    end
    return plan
  end
  for _, opts in ipairs { { microbatches = 2, schedule = by_rank }, { microbatches = r == 0 and 2 or 4 },
                          { microbatches = 2, balance = r == 0 and { 3, 1 } or { 2, 2 } } } do
    local err = raises(function() pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh, opts) end,
      "pipeline: the ranks would run different pipelines: rank 0 has microbatches=2")
    ok(err:find("^[^:]*test_pipeline%.lua:%d+:"), "the error names the caller's line: " .. err)
  end
end)

test("a bad batch, or different batches on the stages, is refused by every stage (and data replica) before anything is sent, and the pipeline trains on", function()
  -- Each of these failed on one stage only (the first's forward or the last's loss) while the
  -- other waited for its message until --timeout; the pipeline then refused every later step.
  pt.manual_seed(9)
  local model = pt.parallelize(pt.models.gpt2(gpt):to("float64"), "policies.gpt2", mesh, { microbatches = 2 })
  pt.manual_seed(9)
  local twin = pt.parallelize(pt.models.gpt2(gpt):to("float64"), "policies.gpt2", mesh, { microbatches = 2 })
  local _, _, x, y = batches(mesh)
  local rows = x.shape[1]
  local function ids(shape, value) return pt.full(shape, value, { dtype = "int64" }) end
  local bad = {
    { x, y:narrow(1, 0, gpt.seq - 1), "its targets must have that shape" },
    { x, y:double(), "cross_entropy expects integer class ids as targets" },
    { x, ids({ rows, gpt.seq }, gpt.vocab), "target 64 is out of range for GPT2's vocab=64" },
    { x:double(), y, "GPT2 expects int64 token ids (B, T)" },
    { x:reshape(-1), y:reshape(-1), "GPT2 expects int64 token ids (B, T)" },
    { ids({ rows, gpt.seq + 1 }, 0), ids({ rows, gpt.seq + 1 }, 0), "sequence of 9 tokens is longer than seq=8" },
    { ids({ rows, gpt.seq }, -1), y, "token id -1 is out of range for vocab=64" },
    { x, pt.zeros({ rows, gpt.seq }):to("float64"), "loss mse compares GPT2's logits", { loss = "mse" } },
  }
  -- Batches that differ between the stages (split by rank, not by the data coordinate): the
  -- first stage reads the inputs and the last the targets, which paired them without any error.
  local first = mesh:coord().pipeline == 0
  local flipped = x:flip(0)
  bad[#bad + 1] = { first and x or flipped, y, "the ranks of this pipeline were given different inputs:" }
  bad[#bad + 1] = { x, first and y or y:flip(0), "the ranks of this pipeline were given different targets:" }
  bad[#bad + 1] = { first and x or flipped, first and y or y:flip(0), "given different inputs and targets:" }
  bad[#bad + 1] = { first and x or x:narrow(1, 0, gpt.seq - 2), first and y or y:narrow(1, 0, gpt.seq - 2),
                    "given different inputs and targets:" }
  if mesh:size("data") > 1 then
    -- A bad batch on one data replica only: its ranks refuse it, and the other replica's refuse
    -- the step too (they had gone on and waited in the gradient sync until --timeout).
    local mine = mesh:coord().data == 0
    local others = "another data-parallel replica's batch was refused"
    bad[#bad + 1] = { x, mine and ids({ rows, gpt.seq }, gpt.vocab) or y, mine and "target 64 is out of range" or others }
    bad[#bad + 1] = { mine and x:narrow(0, 0, 1) or x, mine and y:narrow(0, 0, 1) or y,
                      mine and "microbatches=2 does not divide the batch of 1" or others }
  end
  for _, case in ipairs(bad) do
    local err = raises(function() model:train_step(case[1], case[2], case[4]) end, case[3])
    ok(err:find("^[^:]*test_pipeline%.lua:%d+:"), "the error names the caller's line: " .. err)
  end
  -- ignore_index targets count for nothing, and are not out of range
  local masked = y:clone():fill_(-100)
  ok(model:train_step(x, masked) ~= nil and twin:train_step(x, masked) ~= nil, "all targets ignored")
  model:zero_grad(); twin:zero_grad()
  near(model:train_step(x, y), twin:train_step(x, y), 1e-12, "the step after the refusals")
  local mine = {}
  for name, p in twin:named_parameters() do mine[name] = p.grad end
  for name, p in model:named_parameters() do near(p.grad, mine[name], 1e-12, "gradient of " .. name) end
end)

test("Hugging Face weights load into the stages and export from them, a bad file refused everywhere", function()
  require "safetensors_stages"(mesh, { microbatches = 2 }, "pipeline 2" .. (mesh:size("data") > 1 and " x data 2" or ""))
end)

H.run()
