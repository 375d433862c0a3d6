-- model:train_step (forward, loss, backward and gradient sync in C++) trains exactly as serial
-- training on the global batch: data parallel (MLP), tensor x data parallel GPT-2 with and without
-- sequence parallelism, with accumulation, with cross-entropy and mse (whose split logits it gathers); in float32 (losses and parameters within 1e-5,
-- relative to max(|x|, 1)) and float64 (1e-10). Also: Lua bucket hooks still run and change
-- nothing, a dropped parallelized model and its optimizer are freed, and bad options are refused
-- at the caller's line.
--   partrain --nproc-per-node 4 --threads 1 tests/dist/test_train_step.lua
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local core = require "partrain.core"
local H = require "harness"
local test, near, eq, ok, raises = H.test, H.near, H.eq, H.ok, H.raises

local world = pt.dist.world_size()
local TOL = { float32 = 1e-5, float64 = 1e-10 }

-- The global batch (the same on every rank) and this rank's data slice of it.
local function batches(mesh, make_batch)
  local x, y = make_batch()
  mesh:group("world"):broadcast(x, 0); mesh:group("world"):broadcast(y, 0)
  local d, n = mesh:coord().data, mesh:size("data")
  local b = x.shape[1] / n
  return x, y, x:narrow(0, d * b, b), y:narrow(0, d * b, b)
end

-- Trains `make()` serially (the hand-written loop, on whole batches) and parallelized through
-- model:train_step (on this rank's slices) from the same weights: losses each step and every
-- parameter at the end must agree within the dtype's tolerance.
-- `optim(model)`, if given, makes both optimizers (else AdamW from the model, lr 1e-3).
local function equal_to_serial(what, mesh, make, policy, opts, make_batch, dtype, step_opts, steps, optim)
  local tol = TOL[dtype]
  optim = optim or function(m) return pt.optim.adamw(m, { lr = 1e-3 }) end
  pt.manual_seed(21)
  local serial = make():to(dtype)
  pt.manual_seed(21)
  local model = pt.parallelize(make():to(dtype), policy, mesh, opts)
  local so, po = optim(serial), optim(model)
  for step = 1, steps or 5 do
    local gx, gy, x, y = batches(mesh, make_batch)
    local out = serial(gx)
    local ls = (step_opts or {}).loss == "mse" and pt.nn.mse(out, gy)
      or pt.nn.cross_entropy(out:reshape(-1, out.shape[#out.shape]), gy:reshape(-1))
    ls:backward()
    local lp = model:train_step(x, y, step_opts)
    if ls:item() ~= ls:item() then  -- nothing counted: NaN, as serial training's
      ok(lp:item() ~= lp:item(), ("%s (%s): loss at step %d is %s, serial NaN"):format(what, dtype, step, lp:item()))
    else  -- every rank returns the global batch's loss
      near(lp, ls, tol, ("%s (%s): loss at step %d"):format(what, dtype, step))
    end
    so:step(); po:step()
    so:zero_grad(); po:zero_grad()
  end
  local full, want = model:full_state_dict(), serial:state_dict()
  for name, w in pairs(want) do
    near(full[name], w, tol, ("%s (%s): parameter %s"):format(what, dtype, name))
  end
  return model
end

local gpt = { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 1 }
local function gpt_batch() return pt.randint(0, gpt.vocab, { 4, gpt.seq }), pt.randint(0, gpt.vocab, { 4, gpt.seq }) end
local function mlp_batch(dtype)
  return function() return pt.randn(8, 12):to(dtype), pt.randint(0, 5, { 8 }) end
end

for _, dtype in ipairs { "float32", "float64" } do
  test("data parallel: train_step equals serial training (" .. dtype .. ")", function()
    local mesh = pt.mesh {}
    equal_to_serial("mlp", mesh, function() return pt.models.mlp { sizes = { 12, 16, 5 } } end, nil, nil,
      mlp_batch(dtype), dtype)
  end)

  test("tensor x data parallel GPT-2: train_step equals serial training (" .. dtype .. ")", function()
    local mesh = pt.mesh { tensor = 2 }
    local model = equal_to_serial("gpt2", mesh, function() return pt.models.gpt2(gpt) end, "policies.gpt2", nil,
      gpt_batch, dtype)
    eq(model:policy(), "gpt2", "the model knows its policy")
  end)

  test("tensor x data parallel GPT-2 with loss mse: train_step equals serial training (" .. dtype .. ")", function()
    -- The vocabulary head's logits are split over the tensor ranks: mse must see them whole (each
    -- rank's slice against targets that wide gave each rank a loss of its own, without an error).
    local mesh = pt.mesh { tensor = 2 }
    local function batch() return pt.randint(0, gpt.vocab, { 4, gpt.seq }), pt.randn({ 4, gpt.seq, gpt.vocab }):to(dtype) end
    equal_to_serial("gpt2 mse", mesh, function() return pt.models.gpt2(gpt) end, "policies.gpt2", nil, batch, dtype,
      { loss = "mse" })
  end)

  test("sequence-parallel GPT-2 with accumulate = 2: train_step equals serial training (" .. dtype .. ")", function()
    local mesh = pt.mesh { tensor = 2 }
    equal_to_serial("gpt2 sp", mesh, function() return pt.models.gpt2(gpt) end, "policies.gpt2",
      { sequence_parallel = true }, gpt_batch, dtype, { accumulate = 2 })
  end)
end

-- Serial training's loss is the mean over the global batch's counted targets. Padding
-- (ignore_index) spread unevenly over the data ranks and the accumulated micro-batches, a
-- micro-batch counting nothing, and a batch counting nothing at all (NaN loss, zero gradients)
-- must train as serial training: each rank's (and micro-batch's) mean had weighed alike.
local padded_step = 0
local function padded(make_batch)
  return function()
    padded_step = padded_step + 1
    local x, y = make_batch()
    if padded_step % 4 == 0 then y:fill_(-100); return x, y end  -- nothing counted anywhere
    y:narrow(0, 0, 2):fill_(-100)  -- data rank 0's first micro-batch (the MLP's: its batch) counts nothing
    if y:dim() == 2 then y:narrow(0, 2, 1):narrow(1, padded_step % 3, 5):fill_(-100)  -- part of another row
    else y:narrow(0, 5, 1):fill_(-100) end
    return x, y
  end
end
for _, dtype in ipairs { "float32", "float64" } do
  test("targets padded unevenly over data ranks and micro-batches: train_step equals serial training (" .. dtype .. ")",
    function()
      local big = function() return pt.randint(0, gpt.vocab, { 8, gpt.seq }), pt.randint(0, gpt.vocab, { 8, gpt.seq }) end
      equal_to_serial("gpt2 padded", pt.mesh { tensor = 2 }, function() return pt.models.gpt2(gpt) end, "policies.gpt2",
        nil, padded(big), dtype, { accumulate = 2 }, 4)
      equal_to_serial("mlp padded", pt.mesh {}, function() return pt.models.mlp { sizes = { 12, 16, 5 } } end, nil, nil,
        padded(mlp_batch(dtype)), dtype, nil, 4)
    end)
end

test("the model answers its mesh, policy, data-parallel handle and records", function()
  local mesh = pt.mesh { tensor = 2 }
  local model = pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh)
  eq(tostring(model:mesh()), tostring(mesh), "model:mesh()")
  eq(pt.mesh_of(model):size("tensor"), 2)
  ok(model:data_parallel():buckets() >= 1, "model:data_parallel()")
  ok(pt.parallelized() == model, "the last parallelized model")
  local records = {}
  for _, r in ipairs(model:records()) do records[r.name] = r end
  local wte = records["wte.weight"]
  eq(table.concat(wte.shape, "x"), "64x16", "the logical shape")
  eq(wte.aliases[1], "lm_head.weight", "the tied head is the same record")
  eq(wte.sharding.dim, 0); eq(wte.dtype, "float32"); eq(wte.device, "cpu")
  eq(records["wpe.weight"].sharding, nil, "a whole parameter")
  eq(pt.models.mlp { sizes = { 2, 2 } }:mesh(), nil, "a model not made parallel has no mesh")
end)

test("Lua bucket hooks run on the script's thread through train_step and change nothing", function()
  local mesh = pt.mesh {}
  local function run(hooked)
    pt.manual_seed(5)
    local model = pt.parallelize(pt.models.mlp { sizes = { 12, 16, 5 } }, nil, mesh, { bucket_cap_mb = 1e-4 })
    local calls = { pre = 0, post = 0 }
    if hooked then
      local dp = model:data_parallel()
      dp:set_pre_hook(function(i, flat) calls.pre = calls.pre + 1; return flat * 1 end)
      dp:set_post_hook(function(i, flat) calls.post = calls.post + 1 end)
    end
    pt.manual_seed(6)
    local losses = {}
    local opt = pt.optim.sgd(model, { lr = 0.1 })
    for step = 1, 3 do
      local _, _, x, y = batches(mesh, mlp_batch("float32"))
      losses[step] = model:train_step(x, y):item()
      opt:step(); opt:zero_grad()
    end
    return losses, calls, model:data_parallel():buckets()
  end
  local plain = run(false)
  local hooked, calls, buckets = run(true)
  for i = 1, 3 do eq(hooked[i], plain[i], "loss at step " .. i .. " with hooks") end
  eq(calls.pre, 3 * buckets, "a pre hook a bucket a step"); eq(calls.post, 3 * buckets, "a post hook a bucket a step")
end)

test("a parallelized model and its optimizer dropped by the script are freed", function()
  local mesh = pt.mesh { tensor = 2 }
  collectgarbage(); collectgarbage()
  local before = core.parallel.live()
  local weak = setmetatable({}, { __mode = "v" })
  do
    local model = pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh)
    local opt = pt.optim.adamw(model, { lr = 1e-3 })
    local _, _, x, y = batches(mesh, gpt_batch)
    model:train_step(x, y)
    opt:step()
    weak.model, weak.opt, weak.dp = model, opt, model:data_parallel()
    eq(core.parallel.live(), before + 1)
  end
  for _ = 1, 3 do collectgarbage() end
  eq(weak.model, nil, "the model is collected")
  eq(weak.opt, nil, "its optimizer is collected")
  eq(weak.dp, nil, "its data-parallel handle is collected")
  eq(core.parallel.live(), before, "the engine's parallelized model is freed")
end)

test("a policy tying tensors its layers split differently is refused, naming both names", function()
  local P = require "partrain.policy"
  local mesh = pt.mesh { tensor = 2 }
  -- 0.weight is split by rows (local 4x8 of 8x8), 4.weight by columns (local 4x8 of 4x16): one
  -- tensor cannot be both.
  local policy = P.policy {
    name = "bad_tie",
    modules = { MLP = { replace = { { "0", P.column { gather_output = true } }, { "2", P.column {} }, { "4", P.row {} } } } },
    postprocess = function(model) P.tie(model, "4.weight", "0.weight") end,
  }
  local model = pt.models.mlp { sizes = { 8, 8, 16, 4 } }
  local e = raises(function() pt.parallelize(model, policy, mesh) end, "'4.weight' is tied to '0.weight'")
  ok(e:find("split on dimension 1") and e:find("split on dimension 0"), "names both splits: " .. e)
  eq(model:get("0"):type(), "Linear", "the model is left as it was")
end)

-- A batch split by rank instead of by the data coordinate gives each tensor-parallel rank its
-- own: each then computed its part of every layer from other rows (a loss of 4.1886, exit 0).
test("tensor-parallel ranks given different batches are refused on every rank, and train on after", function()
  local mesh = pt.mesh { tensor = 2 }
  local model = pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh)
  local _, _, x, y = batches(mesh, gpt_batch)
  local t = mesh:coord().tensor
  local function flipped(v) return t == 0 and v or v:flip(0) end
  local e = raises(function() model:train_step(flipped(x), y) end,
    "the tensor-parallel ranks of this model were given different inputs: each computes its part")
  ok(e:find("^[^:]*test_train_step%.lua:%d+:"), "names the script's line: " .. e)
  raises(function() model:train_step(x, flipped(y)) end, "were given different targets")
  -- Targets one rank alone would refuse (fewer rows than the inputs): refused on both, together.
  raises(function() model:train_step(x, t == 0 and y or y:narrow(0, 0, 1)) end, "were given different targets")
  local loss = model:train_step(x, y)  -- the same batch on both: trains
  ok(loss:item() == loss:item(), "a finite loss after the refusals")
end)

test("bad train_step options are refused at the caller's line", function()
  local mesh = pt.mesh {}
  local model = pt.parallelize(pt.models.mlp { sizes = { 12, 5 } }, nil, mesh)
  local x, y = pt.randn(4, 12), pt.randint(0, 5, { 4 })
  local e = raises(function() model:train_step(x, y, { loss = "hinge" }) end,
    "unknown loss 'hinge' (expected one of cross_entropy, mse)")
  ok(e:find("test_train_step.lua:%d+"), "names the script's line: " .. e)
  raises(function() model:train_step(x, y, { accumulate = 3 }) end, "accumulate=3 does not divide the batch of 4")
  raises(function() model:train_step(x, y, { acumulate = 2 }) end, "unknown option 'acumulate' for train_step")
  raises(function() pt.models.mlp { sizes = { 12, 5 } }:train_step(x, y) end, "made parallel by pt.parallelize")
  local pipelined = raises(function() pt.parallelize(pt.models.mlp { sizes = { 12, 5 } }, nil, mesh, { microbatches = 4 }) end,
    "parallelize option 'microbatches' needs a mesh with pipeline > 1")
  ok(pipelined:find("test_train_step.lua:%d+"), "names the script's line: " .. pipelined)
  raises(function() pt.parallelize(pt.models.mlp { sizes = { 12, 5 } }, nil, mesh, { zero = 2 }) end,
    "option 'zero' for parallelize must be a table, got number 2")
  local twice = pt.parallelize(pt.models.mlp { sizes = { 12, 5 } }, nil, mesh, { grad_accumulation = 2 })
  raises(function() twice:train_step(x, y, { accumulate = 2 }) end, "both split the batch")
end)

-- A bad batch on one data rank: it refuses, and the others refuse the step too instead of
-- waiting for it in the gradient sync (until --timeout, where a script catches the error).
test("a batch one data rank refuses is refused on every rank, and the model trains on", function()
  local mesh = pt.mesh {}
  pt.manual_seed(4)
  local model = pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh)
  local _, _, x, y = batches(mesh, gpt_batch)
  local mine, others = pt.dist.rank() == 1, "another data-parallel replica's batch was refused"
  local e = raises(function() model:train_step(x, mine and y:clone():fill_(gpt.vocab) or y) end,
    mine and "target 64 is out of range" or others)
  ok(e:find("^[^:]*test_train_step%.lua:%d+:"), "names the script's line: " .. e)
  raises(function() model:train_step(x, mine and y:narrow(0, 0, 0) or y) end,
    mine and "must be batches of the same size" or others)
  ok(model:train_step(x, y):item() > 0, "the next step trains")
end)

-- A model without a check of its own (an MLP, a chain of pt.nn layers): its ends' widths say what
-- the first layer's forward and the loss would refuse part-way on one replica.
test("an MLP's batch one data rank refuses (width, class, target shape, dtype) is refused on every rank", function()
  local mesh = pt.mesh {}
  pt.manual_seed(4)
  local model = pt.parallelize(pt.models.mlp { sizes = { 12, 8, 5 } }, nil, mesh)
  local x, y = pt.randn({ 4, 12 }), pt.randint(0, 5, { 4 })
  local mine, others = pt.dist.rank() == 1, "another data-parallel replica's batch was refused"
  local bad = {
    { pt.randn({ 4, 11 }), y, "MLP takes inputs (batch, ..., 12) of floating point numbers, got [4, 11]" },
    { pt.randint(0, 5, { 4, 12 }), y, "MLP takes inputs (batch, ..., 12) of floating point numbers, got [4, 12]" },
    { x, pt.tensor({ 0, 1, 5, 2 }):to("int64"), "target 5 is out of range for MLP's 5 classes (targets are 0 to 4" },
    { x, pt.tensor({ 0, -3, 1, 2 }):to("int64"), "target -3 is out of range for MLP's 5 classes" },
    { x, pt.randint(0, 5, { 4, 2 }), "MLP gives 5 class scores for each of the input's [4] rows, so its targets must "
      .. "have that shape, got [4, 2]" },
    { x, pt.randn({ 4 }), "cross_entropy expects integer class ids as targets, got float" },
  }
  for i, case in ipairs(bad) do
    local e = raises(function() model:train_step(mine and case[1] or x, mine and case[2] or y) end,
      mine and case[3] or others, "bad batch " .. i)
    ok(e:find("^[^:]*test_train_step%.lua:%d+:"), "names the script's line: " .. e)
  end
  -- ignore_index is not a class, and mse's targets have the outputs' shape.
  ok(model:train_step(x, pt.tensor({ 0, -100, 4, 2 }):to("int64")):item() > 0, "ignore_index passes")
  raises(function() model:train_step(x, mine and pt.randn({ 4, 4 }) or pt.randn({ 4, 5 }), { loss = "mse" }) end,
    mine and "loss mse compares MLP's outputs [4, 5] with floating targets of that shape, got [4, 4]" or others)
  ok(model:train_step(x, pt.randn({ 4, 5 }), { loss = "mse" }):item() > 0, "mse's targets of the outputs' shape train")
  ok(model:train_step(x, y):item() > 0, "the next step trains")
end)

-- Frozen parameters (requires_grad = false) stay frozen through tensor parallelism (its layers
-- had made them trainable again: 3e-2 off serial) and the optimizer made from the model leaves
-- them out, as serial training does; with ZeRO too.
test("frozen parameters stay frozen through tensor parallelism and ZeRO, and train as serial (float64)", function()
  local frozen = { ["h.0.attn.c_attn.weight"] = true, ["h.0.ln_1.weight"] = true, ["wte.weight"] = true,
                   ["h.0.mlp.c_proj.bias"] = true, ["lm_head.weight"] = true }  -- tied to wte
  local function make()
    local m = pt.models.gpt2(gpt)
    for name, p in m:named_parameters() do if frozen[name] then p:requires_grad_(false) end end
    return m
  end
  for _, opts in ipairs { {}, { zero = { stage = 2 } } } do
    local mesh = pt.mesh { tensor = 2, zero = opts.zero and 2 or nil }
    pt.manual_seed(21)
    local before = make():to("float64"):state_dict()
    local what = opts.zero and "frozen, zero 2" or "frozen"
    local model = equal_to_serial(what, mesh, make, "policies.gpt2", opts, gpt_batch, "float64", nil, 3,
      function(m) return pt.optim.adamw(m, { lr = 1e-2 }) end)
    local full = model:full_state_dict()
    for name in pairs(frozen) do
      eq((full[name] - before[name]):abs():max():item(), 0, what .. ": " .. name .. " did not move")
    end
    for name, p in model:named_parameters() do
      eq(p.requires_grad, not frozen[name], what .. ": " .. name .. "'s requires_grad")
    end
    for _, r in ipairs(model:records()) do eq(r.trainable, not frozen[r.name], what .. ": record " .. r.name) end
  end
  raises(function()
    local m = pt.models.mlp { sizes = { 4, 2 } }
    for _, p in ipairs(m:parameters()) do p:requires_grad_(false) end
    pt.optim.adamw(m)
  end, "pt.optim.adamw: the MLP has no trainable parameters (every one has requires_grad = false)")
end)

-- An optimizer made from a table of a parallelized model's parameters (param groups, a subset) is
-- wired to the model as one made from the model: it clipped by each rank's own norm and stepped
-- loss-scaled gradients unscaled, exit 0.
test("an optimizer made from a table of a parallelized model's parameters clips and scales as one from the model",
  function()
  local mesh = pt.mesh { tensor = 2 }
  local clipped = function(m) return pt.optim.adamw(m:parameters(), { lr = 1e-2, clip_grad_norm = 0.05 }) end
  equal_to_serial("table, clipped", mesh, function() return pt.models.gpt2(gpt) end, "policies.gpt2", nil, gpt_batch,
    "float64", nil, 3, clipped)
  -- A static power-of-two scale changes no number: from the table as from the model.
  local function run(optim)
    pt.manual_seed(21)
    local model = pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh)
    local opt = optim(model)
    pt.manual_seed(3)
    for _ = 1, 3 do
      local _, _, x, y = batches(mesh, gpt_batch)
      model:train_step(x, y)
      opt:step(); opt:zero_grad()
    end
    return model:full_state_dict()
  end
  local plain = run(function(m) return pt.optim.sgd(m, { lr = 0.5 }) end)
  local scaled = run(function(m) return pt.optim.sgd(m:parameters(), { lr = 0.5, loss_scale = 1024 }) end)
  for name, t in pairs(plain) do eq((scaled[name] - t):abs():max():item(), 0, "loss scale from a table: " .. name) end
  -- What such a table cannot hold, and a second optimizer beside one that scales the loss.
  local model = pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh)
  local params = model:parameters()
  raises(function() pt.optim.adamw({ params[1], pt.zeros(3):requires_grad_(true) }) end,
    "pt.optim.adamw: parameter #2 of the table is not one of the parallelized model's")
  local frozen = pt.zeros(3)
  raises(function() pt.optim.adamw({ frozen }) end,
    "pt.optim.adamw: parameter #1 of the table is frozen (requires_grad = false)")
  local keep = pt.optim.sgd(model, { lr = 0.1 })
  raises(function() pt.optim.sgd(params, { lr = 0.1, loss_scale = 1024 }) end,
    "pt.optim.sgd: the model already has an optimizer, and this one scales the loss")
  ok(keep, "the first optimizer is alive")
end)

-- What trained on silently before: converting a parallelized model (its buckets and optimizer
-- kept the old tensors: the replicas drifted apart), an optimizer made before parallelize
-- (stepping the tensors tensor parallelism replaced), ignore_index with mse (ignored), and a
-- model put in eval() left in training mode by train_step.
test("what a parallelized model cannot honour is refused, and train_step leaves the model's mode as it was", function()
  local here = "^[^:]*test_train_step%.lua:%d+:"
  local mesh = pt.mesh { tensor = 2 }
  local model = pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh)
  local e = raises(function() model:to("float64") end, "to('float64') on a module of a parallelized model")
  ok(e:find(here), e)
  raises(function() model:get("h.0"):to("float64") end, "on a module of a parallelized model")
  ok(model:to("float32") == model, "a conversion that changes nothing is let through")
  local early = pt.models.gpt2(gpt)
  local early_opt = pt.optim.adamw(early, { lr = 1e-3 })
  e = raises(function() pt.parallelize(early, "policies.gpt2", mesh) end,
    "an optimizer made before pt.parallelize steps the model's parameter '")
  ok(e:find(here), e)
  ok(early_opt:kind() == "adamw" and early:mesh() == nil, "the model is left as it was")
  local tabled = pt.models.gpt2(gpt)
  local tabled_opt = pt.optim.sgd({ tabled:get("h.0.mlp.c_fc").weight }, { lr = 1e-3 })
  raises(function() pt.parallelize(tabled, "policies.gpt2", mesh) end,
    "steps the model's parameter 'h.0.mlp.c_fc.weight'")
  ok(tabled_opt:kind() == "sgd", "an optimizer made from a table of its parameters too")
  local dropped = pt.models.gpt2(gpt)
  do local _ = pt.optim.adamw(dropped, { lr = 1e-3 }) end
  ok(pt.parallelize(dropped, "policies.gpt2", mesh):mesh() ~= nil, "an optimizer the script dropped does not count")
  local _, _, x, y = batches(mesh, gpt_batch)
  e = raises(function() model:train_step(x, pt.randn(x.shape[1], gpt.seq, gpt.vocab), { loss = "mse", ignore_index = 0 }) end,
    "ignore_index is what cross_entropy skips; loss 'mse' counts every element")
  ok(e:find(here), e)
  model:eval()
  model:train_step(x, y)
  ok(not model:is_training(), "a model in eval() stays in eval() after train_step")
  model:train()
  model:train_step(x, y)
  ok(model:is_training(), "and one in train() in train()")
  e = raises(function() pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh, { microbatch = 2 }) end,
    "unknown option 'microbatch' for parallelize")
  ok(e:find("microbatches", 1, true) and e:find("sequence_parallel", 1, true) and e:find("bucket_cap_mb", 1, true),
    "the list names every option parallelize takes: " .. e)
end)

H.run()
