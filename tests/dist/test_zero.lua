-- ZeRO stages 1 and 2 train exactly as unsharded AdamW: at 4 ranks, data 4 with the whole data
-- group as zero group and with zero groups of 2 (hierarchical), tensor 2 x data 2, pipeline 2
-- (1F1B) x data 2, and train_step's accumulation; 20 steps each, the loss every step and every
-- logical parameter at the end within 1e-5 (float32) or 1e-10 (float64) relative to max(|x|, 1),
-- clipping's global norm equal to the serial norm; optimizer state and master bytes per rank are
-- the shard's (total / zero group, within padding); bf16 parameters under ZeRO-1 track float32,
-- and their masters take a model-only checkpoint load (ZeRO-1 and ZeRO-2);
-- ZeRO-2 equals plain data parallelism (losses, clipping's norm, every parameter; sync_shard_grad's
-- .grad equal to plain's) with grad_accumulation 2 at data 4, under pipeline 2 x data 2 with
-- gpipe, 1f1b and interleaved chunks, and with GPT-2's tied embedding, while each rank holds no
-- .grad after the step and at most its shard, the buckets reduced whole and two buckets of
-- scratch; ZeRO-2 with overlap_comm (its reduce-scatters in flight) equals AdamW and plain data
-- parallelism (data 4, zero groups of 2, accumulation, pipelines, GPT-2's tie) within its bound of
-- scratch; a backward that fails part way leaves nothing in flight for the next steps;
-- allgather_bucket_size's gathers and overlap_sync_param train bit for bit as without them;
-- sync_shard_grad makes ZeRO-2's gradients whole; a shard the optimizer steps in several pieces
-- trains as AdamW and its checkpoint loads into plain, ZeRO-1 and ZeRO-2 layouts; ZeRO-1 with
-- reduce_scatter = false (buckets all-reduced, .grad whole) equals AdamW too; reducer pre/post
-- hooks fire under ZeRO-1 (reduce-scattered and all-reduced) and ZeRO-2 (the post-hook of a
-- reduce-scattered bucket gets this rank's part) and what they write reaches the gradients; and
-- what cannot run is refused at the caller's line.
--   partrain --nproc-per-node 4 --threads 1 tests/dist/test_zero.lua
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local P = require "partrain.policy"
local test, near, eq, ok, raises = H.test, H.near, H.eq, H.ok, H.raises

local TOL = { float32 = 1e-5, float64 = 1e-10 }
local BATCH, STEPS = 8, 20

local function mlp(dtype)
  return function() return pt.models.mlp { sizes = { 12, 24, 24, 6 } }:to(dtype) end
end

local function rows(dtype) return pt.randn({ BATCH, 12 }):to(dtype), pt.randint(0, 6, { BATCH }) end
local function deep(dtype) return function() return pt.models.mlp { sizes = { 12, 32, 32, 32, 32, 32, 6 } }:to(dtype) end end

-- A chain for the pipeline: its first module, three blocks (or `blocks`), its last module.
local function chain(dtype, blocks)
  return function()
    local root = pt.nn.Sequential()
    root:add("inp", pt.nn.Linear(12, 16))
    local h = pt.nn.Sequential()
    for _ = 1, blocks or 3 do h:add(pt.nn.Sequential(pt.nn.Linear(16, 16), pt.nn.Tanh())) end
    root:add("h", h)
    root:add("out", pt.nn.Linear(16, 6))
    return root:to(dtype)
  end
end
local chain_policy = P.policy { name = "chain", targets = { "Sequential" }, modules = {},
                                pipeline = { blocks = "h", first = { "inp" }, last = { "out" } } }

-- Trains a serial model and a parallel one (ZeRO in `opts`) from the same seed on the same global
-- batches (`before(model, opt, mesh)`, if given, runs on the parallel one first); returns the
-- parallel model and its optimizer.
local function equal_to_serial(c)
  local dtype = c.dtype or "float32"
  local tol = TOL[dtype]
  local what = c.what .. " (" .. dtype .. ")"
  local mesh = pt.mesh(c.mesh)
  pt.manual_seed(21)
  -- A deferred model is initialized by name: its serial twin is materialized whole the same way.
  local serial = c.deferred and pt.deferred(c.make(dtype)):materialize() or c.make(dtype)()
  pt.manual_seed(21)
  local model = pt.parallelize(c.deferred and pt.deferred(c.make(dtype)) or c.make(dtype)(), c.policy, mesh, c.opts)
  local optim = c.optim or { lr = 1e-2, weight_decay = 0.1 }
  local so, po = pt.optim.adamw(serial, optim), pt.optim.adamw(model, optim)
  if c.before then c.before(model, po, mesh) end  -- what the parallel model goes through first
  local d, n = mesh:coord().data, mesh:size("data")
  local b = BATCH / n
  for step = 1, c.steps or STEPS do
    local x, y = pt.randn({ BATCH, 12 }):to(dtype), pt.randint(0, 6, { BATCH })
    mesh:group("world"):broadcast(x, 0); mesh:group("world"):broadcast(y, 0)
    local ls = pt.nn.cross_entropy(serial(x), y)
    ls:backward()
    local lp = model:train_step(x:narrow(0, d * b, b), y:narrow(0, d * b, b), { accumulate = c.accumulate })
    lp = lp:detach():clone()
    mesh:group("data"):all_reduce(lp, "mean")
    near(lp, ls, tol, ("%s: loss at step %d"):format(what, step))
    local ns, np = so:step(), po:step()
    if optim.clip_grad_norm then near(np, ns, tol, ("%s: clipping's global norm at step %d"):format(what, step)) end
    so:zero_grad(); po:zero_grad()
  end
  local mine, want = model:full_state_dict(), serial:state_dict()
  local held = 0
  for name, t in pairs(mine) do
    near(t, want[name], tol, ("%s: parameter %s"):format(what, name))
    held = held + 1
  end
  ok(held > 0, what .. ": holds parameters")
  return model, po, mesh
end

test("ZeRO-1 and ZeRO-2 over data 4 equal unsharded AdamW (clipping on)", function()
  for _, stage in ipairs { 1, 2 } do
    local _, opt = equal_to_serial { what = "zero-" .. stage .. " data 4", mesh = { zero = 0 }, make = mlp,
                                     opts = { zero = { stage = stage } },
                                     optim = { lr = 1e-2, weight_decay = 0.1, clip_grad_norm = 0.05 } }
    local z = opt:zero()
    eq(z.stage, stage); eq(z.group, 4)
  end
  equal_to_serial { what = "zero-1 all-reduced data 4", mesh = { zero = 0 }, make = mlp,
                    opts = { zero = { stage = 1, reduce_scatter = false } },
                    optim = { lr = 1e-2, weight_decay = 0.1, clip_grad_norm = 0.05 } }
  equal_to_serial { what = "zero-2 data 4", mesh = { zero = 0 }, make = mlp, dtype = "float64",
                    opts = { zero = { stage = 2, reduce_bucket_size = 0.001 } },
                    optim = { lr = 1e-2, clip_grad_norm = 0.05 } }
end)

test("zero groups of 2 inside data 4 (hierarchical) equal unsharded AdamW", function()
  equal_to_serial { what = "zero-1 groups of 2", mesh = { zero = 2 }, make = mlp }
  equal_to_serial { what = "zero-2 groups of 2", mesh = { zero = 2 }, make = mlp, opts = { zero = { stage = 2 } },
                    optim = { lr = 1e-2, clip_grad_norm = 0.05 } }
end)

test("ZeRO-2 with train_step's accumulation equals unsharded AdamW", function()
  equal_to_serial { what = "zero-2 accumulate 2", mesh = { zero = 0 }, make = mlp, accumulate = 2,
                    opts = { zero = { stage = 2, reduce_bucket_size = 0.001 } } }
end)

test("ZeRO-1 with tensor 2 x data 2 equals unsharded AdamW (clipping counts split parameters once)", function()
  equal_to_serial { what = "zero-1 tensor 2", mesh = { tensor = 2, zero = 2 }, make = mlp, policy = "policies.mlp",
                    optim = { lr = 1e-2, weight_decay = 0.1, clip_grad_norm = 0.05 } }
  equal_to_serial { what = "zero-2 tensor 2", mesh = { tensor = 2, zero = 2 }, make = mlp, policy = "policies.mlp",
                    dtype = "float64", opts = { zero = { stage = 2 } }, optim = { lr = 1e-2, clip_grad_norm = 0.05 } }
end)

test("ZeRO-2 with pipeline 2 (1F1B, 2 micro-batches) x data 2 equals unsharded AdamW", function()
  for _, dtype in ipairs { "float32", "float64" } do
    equal_to_serial { what = "zero-2 pipeline 2", mesh = { pipeline = 2, zero = 2 }, make = chain, dtype = dtype,
                      deferred = true, policy = chain_policy,
                      opts = { zero = { stage = 2 }, schedule = "1f1b", microbatches = 2 },
                      optim = { lr = 1e-2, weight_decay = 0.1, clip_grad_norm = 0.05 } }
  end
end)

-- overlap_comm leaves ZeRO-2's reduce-scatters in flight beside backward (a bucket's scratch and an
-- inbox held until it completes, at most two buckets at once): it equals unsharded AdamW at data 4
-- (float32 and float64), over zero groups of 2 (the part all-reduced across them once settled),
-- with train_step's accumulation (the passes before the sync settle theirs at their end) and over
-- pipeline 2 x data 2 with interleaved chunks; buckets are small, so several are in flight, and
-- the scratch stays within the bound the planner counts (the bucket filling, two in flight and
-- their two inboxes).
test("ZeRO-2 with overlap_comm equals unsharded AdamW (data 4, zero groups of 2, accumulation, pipeline 2)", function()
  local o = { lr = 1e-2, weight_decay = 0.1, clip_grad_norm = 0.05 }
  local zero = { stage = 2, overlap_comm = true, reduce_bucket_size = 0.001 }
  for _, dtype in ipairs { "float32", "float64" } do
    local model, opt = equal_to_serial { what = "zero-2 overlap_comm data 4", mesh = { zero = 0 }, make = mlp,
                                         dtype = dtype, opts = { zero = zero }, optim = o }
    local longest = 0
    for _, b in ipairs(pt.data_parallel(model):bucket_bytes()) do longest = math.max(longest, b.bytes) end
    local scratch = opt:zero().scratch_bytes
    ok(scratch > longest and scratch <= 5 * longest,
       ("zero-2 overlap_comm (%s): scratch and inboxes %d bytes, more than one bucket (some were in flight) and at most 5 of %d")
       :format(dtype, scratch, longest))
  end
  equal_to_serial { what = "zero-2 overlap_comm groups of 2", mesh = { zero = 2 }, make = mlp, opts = { zero = zero },
                    optim = o }
  equal_to_serial { what = "zero-2 overlap_comm accumulate 2", mesh = { zero = 0 }, make = mlp, accumulate = 2,
                    opts = { zero = zero } }
  equal_to_serial { what = "zero-2 overlap_comm pipeline 2", mesh = { pipeline = 2, zero = 2 },
                    make = function(dtype) return chain(dtype, 4) end, dtype = "float64", deferred = true,
                    policy = chain_policy,
                    opts = { zero = zero, schedule = "interleaved", microbatches = 2, chunks = 2 }, optim = o }
end)

-- A backward pass that fails part way (a pre-hook raising at the third bucket, on every rank)
-- leaves reduce-scatters of its first buckets in flight: the next pass drops them (their inboxes
-- and scratch are replaced, not reused), so the steps after it train as serial training does
-- without the failed one (float64, data 4; ZeRO-1, ZeRO-2 and ZeRO-2 with overlap_comm; plain data
-- parallelism and ZeRO-1's all-reduces likewise).
test("a backward that fails part way leaves nothing in flight: the next steps equal serial training", function()
  for _, zero in ipairs { { stage = 1 }, { stage = 2 }, { stage = 2, overlap_comm = true }, { stage = 0 },
                          { stage = 1, reduce_scatter = false } } do
    local what = ("zero-%d%s%s after a failed backward"):format(zero.stage, zero.overlap_comm and " overlap_comm" or "",
                                                                zero.reduce_scatter == false and " all-reduced" or "")
    -- Before the steps equal_to_serial compares, a train_step whose pre-hook raises at bucket 2.
    local function fail_once(model, opt, mesh)
      local handle = pt.data_parallel(model)
      ok(handle:buckets() >= 4, what .. ": several buckets")
      local failing = true
      handle:set_pre_hook(function(bucket) if failing and bucket == 2 then error("hook failed at bucket 2") end end)
      local d, b = mesh:coord().data, BATCH / mesh:size("data")
      local x, y = rows("float64")
      raises(function() model:train_step(x:narrow(0, d * b, b), y:narrow(0, d * b, b)) end, "hook failed at bucket 2")
      failing = false
      opt:zero_grad()
    end
    equal_to_serial { what = what, mesh = { zero = 0 }, make = deep, dtype = "float64", steps = 3,
                      opts = { zero = zero, bucket_cap_mb = 0.002 }, before = fail_once }
  end
end)

-- GPT-2's wte and lm_head are one tensor held by both stages: its buckets are all-reduced whole
-- (its gradient is summed over the pipeline after the sync), the rest reduce-scattered.
test("ZeRO-2 with GPT-2 (a tensor tied across stages) over pipeline 2 x data 2 equals AdamW (float64)", function()
  local gpt = { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 2 }
  local mesh = pt.mesh { pipeline = 2, zero = 2 }
  local make = function() return pt.models.gpt2(gpt):to("float64") end
  pt.manual_seed(7)
  local serial = pt.deferred(make):materialize()
  pt.manual_seed(7)
  local model = pt.parallelize(pt.deferred(make), "policies.gpt2", mesh,
                               { zero = { stage = 2 }, schedule = "1f1b", microbatches = 2 })
  local optim = { lr = 1e-2, clip_grad_norm = 0.5 }
  local so, po = pt.optim.adamw(serial, optim), pt.optim.adamw(model, optim)
  local d, b = mesh:coord().data, BATCH / 2
  for step = 1, 5 do
    local x, y = pt.randint(0, gpt.vocab, { BATCH, gpt.seq }), pt.randint(0, gpt.vocab, { BATCH, gpt.seq })
    mesh:group("world"):broadcast(x, 0); mesh:group("world"):broadcast(y, 0)
    local out = serial(x)
    local ls = pt.nn.cross_entropy(out:reshape(-1, out.shape[#out.shape]), y:reshape(-1))
    ls:backward()
    local lp = model:train_step(x:narrow(0, d * b, b), y:narrow(0, d * b, b)):detach():clone()
    mesh:group("data"):all_reduce(lp, "mean")
    near(lp, ls, 1e-10, ("gpt-2 zero-2 pipeline: loss at step %d"):format(step))
    local ns, np = so:step(), po:step()
    near(np, ns, 1e-10, ("gpt-2 zero-2 pipeline: clipping's norm at step %d"):format(step))
    so:zero_grad(); po:zero_grad()
  end
  local want = serial:state_dict()
  for name, t in pairs(model:full_state_dict()) do near(t, want[name], 1e-10, "gpt-2 zero-2 pipeline: " .. name) end
end)

-- The tie's gradient must be summed over the pipeline where the optimizer reads it: under ZeRO
-- that is its bucket, in the reduce dtype, while .grad is only a copy when the parameter's dtype
-- differs (bf16 parameters reduce in float32 by default). The sum went into .grad alone, and each
-- stage stepped its copy with its own part (copies 1e-2 apart after 3 steps, exit 0). And a
-- gradient kept from the last train_step (two an opt:step, or no zero_grad) was summed over the
-- pipeline a second time. Float32 parameters reducing in float64 take the same path, where the
-- result is exact enough to compare with serial training.
test("GPT-2's tie over pipeline 2 x data 2 under ZeRO, reduced in another dtype, two train_steps an opt:step, equals serial training", function()
  local gpt = { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 2 }
  local mesh = pt.mesh { pipeline = 2, zero = 2 }
  local d, b = mesh:coord().data, BATCH / 2
  for _, zero in ipairs { { stage = 2 }, { stage = 1, reduce_scatter = false } } do
    local what = ("zero-%d tie, float64 reduction"):format(zero.stage)
    pt.manual_seed(7)
    local serial = pt.deferred(function() return pt.models.gpt2(gpt) end):materialize()
    pt.manual_seed(7)
    local model = pt.parallelize(pt.deferred(function() return pt.models.gpt2(gpt) end), "policies.gpt2", mesh,
                                 { zero = zero, reduce_dtype = "float64", schedule = "1f1b", microbatches = 2 })
    local so, po = pt.optim.sgd(serial, { lr = 0.1 }), pt.optim.sgd(model, { lr = 0.1 })
    for step = 1, 3 do
      for half = 1, 2 do  -- two batches an optimizer step
        local x, y = pt.randint(0, gpt.vocab, { BATCH, gpt.seq }), pt.randint(0, gpt.vocab, { BATCH, gpt.seq })
        mesh:group("world"):broadcast(x, 0); mesh:group("world"):broadcast(y, 0)
        local ls = pt.nn.cross_entropy(serial(x):reshape(-1, gpt.vocab), y:reshape(-1))
        ls:backward()
        near(model:train_step(x:narrow(0, d * b, b), y:narrow(0, d * b, b)), ls, 1e-5,
             ("%s: loss at step %d, batch %d"):format(what, step, half))
      end
      so:step(); po:step()
      so:zero_grad(); po:zero_grad()
    end
    local want = serial:state_dict()
    for name, t in pairs(model:full_state_dict()) do near(t, want[name], 1e-5, what .. ": " .. name) end
  end
end)

-- Trains plain data parallelism (c.mesh) and ZeRO-2 (c.zero_mesh, small buckets) from the same
-- initial weights on the same batches: each pass's loss, clipping's norm and every logical parameter
-- at the end agree within TOL; before the last step the gradients opt:sync_shard_grad() gathers
-- equal plain's .grad; after every other step no parameter holds a .grad (but views of the
-- buckets reduced whole: ties across pipeline stages) and the gradient bytes alive on this rank
-- (pt.memory_report: each storage once) are at most the shard, the buckets reduced whole and two
-- buckets of scratch.
local function zero2_equals_plain(c)
  local dtype = c.dtype or "float32"
  local tol = TOL[dtype]
  local what = c.what .. " (" .. dtype .. ")"
  local function build(mesh_opts, zero)
    local mesh = pt.mesh(mesh_opts)
    local opts = {}
    for k, v in pairs(c.opts or {}) do opts[k] = v end
    if zero then opts.zero = { stage = 2, reduce_bucket_size = c.bucket or 0.001, overlap_comm = c.overlap_comm } end
    pt.manual_seed(31)
    local model = pt.parallelize(c.deferred and pt.deferred(c.make(dtype)) or c.make(dtype)(), c.policy, mesh, opts)
    return model, mesh, pt.optim.adamw(model, { lr = 1e-2, weight_decay = 0.1, clip_grad_norm = 0.05 })
  end
  local plain, _, popt = build(c.mesh, false)
  local zero, mesh, zopt = build(c.zero_mesh, true)
  local d, b = mesh:coord().data, BATCH / mesh:size("data")
  local steps, worst, dloss, dparam = c.steps or 3, 0, 0, 0
  for step = 1, steps do
    for pass = 1, c.passes or 1 do
      pt.manual_seed(1000 + 10 * step + pass)  -- the same global batch on every rank
      local x, y = c.batch(dtype)
      x, y = x:narrow(0, d * b, b), y:narrow(0, d * b, b)
      local lp, lz = plain:train_step(x, y), zero:train_step(x, y)
      near(lz, lp, tol, ("%s: loss at step %d, pass %d"):format(what, step, pass))
      dloss = math.max(dloss, math.abs(lz:item() - lp:item()) / math.max(1, math.abs(lp:item())))
    end
    if step == steps then
      zopt:sync_shard_grad()
      local pp = plain:parameters()
      for i, p in ipairs(zero:parameters()) do
        near(p.grad, pp[i].grad, tol, ("%s: sync_shard_grad's gradient %d equals plain data parallelism's"):format(what, i))
      end
    end
    near(zopt:step(), popt:step(), tol, ("%s: clipping's norm at step %d"):format(what, step))
    if step < steps then
      local z = zopt:zero()
      local whole, largest = 0, 0
      for _, bucket in ipairs(pt.data_parallel(zero):bucket_bytes()) do
        if bucket.whole then whole = whole + bucket.bytes else largest = math.max(largest, bucket.bytes) end
      end
      -- Only a bucket reduced whole (a tie across stages) leaves .grad views of itself.
      local viewed = 0
      for _, p in ipairs(zero:parameters()) do
        if p.grad ~= nil then viewed = viewed + p.grad:numel() * (dtype == "float64" and 8 or 4) end
      end
      ok(viewed <= whole, ("%s: after step %d no parameter holds a .grad (%d bytes of them) but views of buckets "
         .. "reduced whole (%d bytes)"):format(what, step, viewed, whole))
      -- Scratch: two buckets at most; with overlap_comm the two in flight and their inboxes more.
      local buckets = c.overlap_comm and 6 or 2
      local grads, bound = pt.memory_report(zero).grads, z.shard_grad_bytes + whole + buckets * largest
      ok(grads <= bound, ("%s: gradient bytes alive %d <= shard %d + whole buckets %d + %d x bucket %d"):format(
         what, grads, z.shard_grad_bytes, whole, buckets, largest))
      eq(z.grad_buffer_bytes, grads, what .. ": opt:zero()'s grad_buffer_bytes are the bytes alive")
      worst = math.max(worst, grads - z.shard_grad_bytes - whole)
    end
    popt:zero_grad(); zopt:zero_grad()
  end
  local want = plain:full_state_dict()
  for name, t in pairs(zero:full_state_dict()) do
    near(t, want[name], tol, ("%s: parameter %s"):format(what, name))
    dparam = math.max(dparam, (t - want[name]):abs():max():item() / math.max(1, want[name]:abs():max():item()))
  end
  if pt.dist.rank() == 0 then
    print(("%s: largest relative difference to plain: loss %.2e, parameter %.2e (tolerance %.0e)"):format(
      what, dloss, dparam, tol))
  end
  return worst
end


test("ZeRO-2 at data 4 with grad_accumulation 2 equals plain data parallelism and holds only its shard", function()
  for _, c in ipairs { { dtype = "float32" }, { dtype = "float64" }, { dtype = "float64", overlap_comm = true } } do
    local what = "zero-2 data 4, grad_accumulation 2" .. (c.overlap_comm and ", overlap_comm" or "")
    local scratch = zero2_equals_plain { what = what, mesh = {}, zero_mesh = { zero = 0 },
                                         make = deep, batch = rows, dtype = c.dtype, passes = 2, bucket = 0.004,
                                         overlap_comm = c.overlap_comm, opts = { grad_accumulation = 2 } }
    if pt.dist.rank() == 0 then print(("%s (%s): scratch alive after a step %d bytes"):format(what, c.dtype, scratch)) end
  end
end)

test("ZeRO-2 with pipeline 2 x data 2 (gpipe, 1f1b, interleaved 2 chunks) equals plain data parallelism", function()
  for _, c in ipairs {
    { schedule = "gpipe", microbatches = 2 }, { schedule = "1f1b", microbatches = 2 },
    { schedule = "interleaved", microbatches = 2, chunks = 2, blocks = 4, dtype = "float64" },
  } do
    zero2_equals_plain { what = "zero-2 pipeline 2 " .. c.schedule, mesh = { pipeline = 2 },
                         zero_mesh = { pipeline = 2, zero = 2 }, dtype = c.dtype, deferred = true, policy = chain_policy,
                         make = function(dtype) return chain(dtype, c.blocks) end, batch = rows,
                         opts = { schedule = c.schedule, microbatches = c.microbatches, chunks = c.chunks } }
  end
end)

test("ZeRO-2 with GPT-2's tied wte = lm_head equals plain data parallelism (data 4; pipeline 2 x data 2, float64)", function()
  local gpt = { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 2 }
  local make = function(dtype) return function() return pt.models.gpt2(gpt):to(dtype) end end
  local tokens = function() return pt.randint(0, gpt.vocab, { BATCH, gpt.seq }), pt.randint(0, gpt.vocab, { BATCH, gpt.seq }) end
  zero2_equals_plain { what = "gpt-2 zero-2 data 4", mesh = {}, zero_mesh = { zero = 0 }, make = make, batch = tokens,
                       dtype = "float64", steps = 3, bucket = 0.01 }
  zero2_equals_plain { what = "gpt-2 zero-2 pipeline 2", mesh = { pipeline = 2 }, zero_mesh = { pipeline = 2, zero = 2 },
                       make = make, batch = tokens, dtype = "float64", steps = 3, deferred = true,
                       policy = "policies.gpt2", opts = { schedule = "1f1b", microbatches = 2 } }
  zero2_equals_plain { what = "gpt-2 zero-2 overlap_comm pipeline 2", mesh = { pipeline = 2 },
                       zero_mesh = { pipeline = 2, zero = 2 }, make = make, batch = tokens, dtype = "float64", steps = 3,
                       deferred = true, policy = "policies.gpt2", overlap_comm = true,
                       opts = { schedule = "1f1b", microbatches = 2 } }
end)

-- overlap_sync_param leaves the step's all-gathers in flight (counted by opt:zero()),
-- waited for when the model is next used: training with it is bit for bit training without it
-- (float64), at ZeRO-1 and ZeRO-2 over data 4 and at ZeRO-2 over pipeline 2 x data 2; the
-- parameters read right after a step (through the model) are already the updated ones.
test("overlap_sync_param = true trains bit for bit as false (float64)", function()
  for _, c in ipairs {
    { what = "zero-1 data 4", mesh = { zero = 0 }, stage = 1, make = mlp },
    { what = "zero-2 data 4", mesh = { zero = 0 }, stage = 2, make = mlp },
    { what = "zero-2 pipeline 2", mesh = { pipeline = 2, zero = 2 }, stage = 2, make = chain, deferred = true,
      policy = chain_policy, opts = { schedule = "1f1b", microbatches = 2 } },
  } do
    local runs = {}
    for _, overlap in ipairs { false, true } do
      local mesh = pt.mesh(c.mesh)
      local opts = { zero = { stage = c.stage, reduce_bucket_size = 0.001, overlap_sync_param = overlap } }
      for k, v in pairs(c.opts or {}) do opts[k] = v end
      pt.manual_seed(41)
      local model = pt.parallelize(c.deferred and pt.deferred(c.make("float64")) or c.make("float64")(), c.policy, mesh, opts)
      local opt = pt.optim.adamw(model, { lr = 1e-2, weight_decay = 0.1, clip_grad_norm = 0.05 })
      local d, b = mesh:coord().data, BATCH / mesh:size("data")
      local run = { losses = {}, after = {} }
      for step = 1, 2 do
        pt.manual_seed(700 + step)
        local x, y = rows("float64")
        run.losses[step] = model:train_step(x:narrow(0, d * b, b), y:narrow(0, d * b, b)):item()
        opt:step(); opt:zero_grad()
        local in_flight = opt:zero().gathers_in_flight
        ok(overlap and in_flight == opt:zero().gathers or not overlap and in_flight == 0,
           ("%s: %d all-gathers in flight after step %d (overlap_sync_param %s)"):format(c.what, in_flight, step, overlap))
        run.after[step] = model:parameters()[1]:clone()
        eq(opt:zero().gathers_in_flight, 0, c.what .. ": using the model waits for them")
      end
      run.params = model:full_state_dict()
      runs[#runs + 1] = run
    end
    local plain, overlapped = runs[1], runs[2]
    for step, l in ipairs(plain.losses) do
      eq(overlapped.losses[step], l, ("%s: overlap_sync_param's loss at step %d is bitwise the same"):format(c.what, step))
      ok(overlapped.after[step]:equal(plain.after[step]),
         ("%s: a parameter read right after step %d is the updated one"):format(c.what, step))
    end
    for name, t in pairs(plain.params) do
      ok(overlapped.params[name]:equal(t), ("%s: overlap_sync_param's parameter %s is bitwise the same"):format(c.what, name))
    end
  end
end)

-- allgather_bucket_size groups the buckets' all-gathers after the step: one a bucket (a size
-- below any bucket's), several buckets each, or one of everything (the default here) train bit
-- for bit alike (float64, data 4, ZeRO-1 and ZeRO-2, and with overlap_sync_param), with buckets
-- small enough that parameters span several ranks' parts and several buckets.
test("allgather_bucket_size: one gather a bucket, a few, or one in all train bit for bit alike (float64)", function()
  for _, c in ipairs {
    { stage = 1 }, { stage = 2 }, { stage = 1, overlap = true }, { stage = 2, overlap = true },
  } do
    local runs = {}
    for _, size in ipairs { 1e-6, 0.02, 25 } do
      local mesh = pt.mesh { zero = 0 }
      pt.manual_seed(43)
      local model = pt.parallelize(deep("float64")(), nil, mesh,
        { zero = { stage = c.stage, reduce_bucket_size = 0.002, allgather_bucket_size = size, overlap_sync_param = c.overlap } })
      local opt = pt.optim.adamw(model, { lr = 1e-2, weight_decay = 0.1, clip_grad_norm = 0.05 })
      local d, b = mesh:coord().data, BATCH / mesh:size("data")
      local run = { losses = {}, buckets = #pt.data_parallel(model):bucket_bytes() }
      for step = 1, 3 do
        pt.manual_seed(900 + step)
        local x, y = rows("float64")
        run.losses[step] = model:train_step(x:narrow(0, d * b, b), y:narrow(0, d * b, b)):item()
        opt:step(); opt:zero_grad()
      end
      run.gathers = opt:zero().gathers
      run.params = model:full_state_dict()
      runs[#runs + 1] = run
    end
    local what = ("zero-%d%s"):format(c.stage, c.overlap and " with overlap_sync_param" or "")
    local one, few, all = runs[1], runs[2], runs[3]
    ok(one.buckets >= 4, what .. ": the model spans several buckets, got " .. one.buckets)
    eq(one.gathers, one.buckets, what .. ": a size below every bucket's gathers each bucket alone")
    ok(few.gathers > 1 and few.gathers < few.buckets, ("%s: 0.02 MiB gathers a few buckets together: %d gathers of %d buckets")
       :format(what, few.gathers, few.buckets))
    eq(all.gathers, 1, what .. ": 25 MiB gathers every bucket at once")
    for _, other in ipairs { few, all } do
      for step, l in ipairs(one.losses) do
        eq(other.losses[step], l, ("%s: %d gathers: the loss at step %d is bitwise the same"):format(what, other.gathers, step))
      end
      for name, t in pairs(one.params) do
        ok(other.params[name]:equal(t), ("%s: %d gathers: parameter %s is bitwise the same"):format(what, other.gathers, name))
      end
    end
  end
end)

test("optimizer state and master weights per rank are the shard's: total / zero, within padding", function()
  local mesh = pt.mesh { zero = 0 }
  pt.manual_seed(1)
  local plain_model = pt.parallelize(mlp("float32")(), nil, pt.mesh {}, {})
  local plain = pt.optim.adamw(plain_model, {})
  pt.manual_seed(1)
  local model = pt.parallelize(mlp("float32")(), nil, mesh, { zero = { stage = 2, reduce_bucket_size = 0.001 } })
  local opt = pt.optim.adamw(model, {})
  local x, y = pt.randn({ 2, 12 }), pt.randint(0, 6, { 2 })
  plain_model:train_step(x, y); plain:step()
  model:train_step(x, y); opt:step()
  local total = 0
  for _, p in ipairs(model:parameters()) do total = total + p:numel() end
  local z = opt:zero()
  local buckets = model:data_parallel():buckets()
  eq(plain:state_bytes(), 2 * 4 * total, "unsharded AdamW: two float32 moments an element")
  eq(opt:state_bytes(), z.state_bytes)
  eq(opt:state_bytes(), 2 * z.master_bytes, "two moments a master element")
  local elements = z.master_bytes / 4
  ok(elements * 4 >= total and elements * 4 < total + 4 * buckets,
     ("master elements %d x 4 ranks covers the %d parameters within a bucket's padding"):format(elements, total))
  eq(z.shard_grad_bytes, z.master_bytes, "the gradient shard is the master's size")
end)

test("bf16 parameters under ZeRO-1: float32 masters and state, the loss tracks float32", function()
  local mesh = pt.mesh { zero = 0 }
  pt.manual_seed(4)
  local serial = mlp("float32")()
  pt.manual_seed(4)
  local model = pt.parallelize(mlp("bfloat16")(), nil, mesh, {})
  local so, po = pt.optim.adamw(serial, { lr = 1e-2 }), pt.optim.adamw(model, { lr = 1e-2 })
  local d, b = mesh:coord().data, BATCH / 4
  local worst = 0
  for step = 1, STEPS do
    local x, y = pt.randn({ BATCH, 12 }), pt.randint(0, 6, { BATCH })
    mesh:group("world"):broadcast(x, 0); mesh:group("world"):broadcast(y, 0)
    local ls = pt.nn.cross_entropy(serial(x), y)
    ls:backward()
    local lp = model:train_step(x:narrow(0, d * b, b):to("bfloat16"), y:narrow(0, d * b, b)):detach():to("float32")
    mesh:group("data"):all_reduce(lp, "mean")
    worst = math.max(worst, math.abs(lp:item() - ls:item()) / ls:item())
    so:step(); po:step(); so:zero_grad(); po:zero_grad()
  end
  ok(worst < 0.05, ("bf16 loss within 5%% of float32's at every step (worst %.4f)"):format(worst))
  if pt.dist.rank() == 0 then print(("bf16 under ZeRO-1: worst relative loss difference to float32 %.4f"):format(worst)) end
  eq(model:parameters()[1].dtype, "bfloat16", "the parameters stay bf16")
  local total = 0
  for _, p in ipairs(model:parameters()) do total = total + p:numel() end
  local z = po:zero()
  ok(z.master_bytes * 4 >= 4 * total, "float32 masters: 4 bytes an element, over the 4 ranks")
  eq(po:state_bytes(), 2 * z.master_bytes, "float32 moments")
end)

-- A bf16 parameter written in place (here by pt.ckpt.load without optimizer state) gives its
-- float32 master its value at the next step, as without ZeRO (docs/precision.md): SGD keeps no
-- state, so a model loaded after three steps and a fresh one loaded then step alike, bit for bit.
test("bf16 under ZeRO-1 and ZeRO-2: a model-only load reaches the float32 masters at the next step", function()
  local mesh = pt.mesh { zero = 0 }
  local dir = "/tmp/partrain-test-zero-masters-" .. (os.getenv("MASTER_PORT") or "0")
  local d, b = mesh:coord().data, BATCH / mesh:size("data")
  for _, stage in ipairs { 1, 2 } do
    local function build()
      pt.manual_seed(4)
      local model = pt.parallelize(mlp("bfloat16")(), nil, mesh, { zero = { stage = stage } })
      return model, pt.optim.sgd(model, { lr = 0.5 })
    end
    local function step(model, opt, n)
      pt.manual_seed(900 + n)
      local x, y = pt.randn({ BATCH, 12 }), pt.randint(0, 6, { BATCH })
      model:train_step(x:narrow(0, d * b, b):to("bfloat16"), y:narrow(0, d * b, b))
      opt:step(); opt:zero_grad()
    end
    local trained, topt = build()
    step(trained, topt, 1)
    pt.ckpt.save(dir, { model = trained, step = 1, overwrite = true })
    step(trained, topt, 2); step(trained, topt, 3)
    pt.ckpt.load(dir, { model = trained })  -- its masters hold step 3's weights until the next step
    step(trained, topt, 4)
    local fresh, fopt = build()
    pt.ckpt.load(dir, { model = fresh })  -- its masters hold the initial weights until then
    step(fresh, fopt, 4)
    local want = fresh:full_state_dict()
    for name, t in pairs(trained:full_state_dict()) do
      near(t, want[name], 0, ("zero-%d: parameter %s one step after a model-only load"):format(stage, name))
    end
  end
  pt.dist.barrier()
  if pt.dist.rank() == 0 then os.execute("rm -rf '" .. dir .. "'") end
end)

test("sync_shard_grad makes ZeRO-2's gradients whole", function()
  local mesh = pt.mesh { zero = 0 }
  pt.manual_seed(8)
  local serial = pt.models.mlp { sizes = { 12, 24, 6 } }
  pt.manual_seed(8)
  local model = pt.parallelize(pt.models.mlp { sizes = { 12, 24, 6 } }, nil, mesh, { zero = { stage = 2 } })
  local opt = pt.optim.adamw(model, {})
  local x, y = pt.randn({ BATCH, 12 }), pt.randint(0, 6, { BATCH })
  mesh:group("world"):broadcast(x, 0); mesh:group("world"):broadcast(y, 0)
  pt.nn.cross_entropy(serial(x), y):backward()
  local d, b = mesh:coord().data, BATCH / 4
  model:train_step(x:narrow(0, d * b, b), y:narrow(0, d * b, b))
  opt:sync_shard_grad()
  local sp = serial:parameters()
  for i, p in ipairs(model:parameters()) do near(p.grad, sp[i].grad, 1e-5, "gradient " .. i) end
end)

test("reducer hooks fire under ZeRO-1 and ZeRO-2 and their changes reach the gradients", function()
  for _, c in ipairs { { stage = 1 }, { stage = 1, reduce_scatter = false }, { stage = 2 } } do
    local stage, scattered = c.stage, c.reduce_scatter ~= false
    local mesh = pt.mesh { zero = 0 }
    local model = pt.parallelize(pt.models.mlp { sizes = { 12, 24, 6 } }, nil, mesh,
                                 { zero = { stage = stage, reduce_scatter = c.reduce_scatter, reduce_bucket_size = 1e-4 } })
    local opt = pt.optim.adamw(model, {})
    local handle = pt.data_parallel(model)
    local pre, post = {}, {}
    -- Each rank's bucket becomes rank + 1 everywhere: reduced (summed after the mean's pre-division,
    -- which ran before the hook), 1 + 2 + 3 + 4 = 10.
    handle:set_pre_hook(function(_, grads) pre[#pre + 1] = grads:numel(); return grads * 0 + (pt.dist.rank() + 1) end)
    handle:set_post_hook(function(_, grads)
      post[#post + 1] = { grads:numel(), grads:min():item(), grads:max():item() }
    end)
    model:train_step(pt.randn({ 2, 12 }), pt.randint(0, 6, { 2 }))
    local what = ("ZeRO-%d%s: "):format(stage, scattered and "" or " (all-reduced)")
    ok(handle:buckets() > 1, what .. "several buckets")
    eq(#pre, handle:buckets(), what .. "a pre-hook call per bucket")
    eq(#post, handle:buckets(), what .. "a post-hook call per bucket")
    for i, seen in ipairs(post) do
      eq(seen[1], scattered and pre[i] / 4 or pre[i], what .. "the post-hook's tensor (reduce-scattered: this rank's part) " .. i)
      ok(seen[2] == 10 and seen[3] == 10, what .. "the post-hook sees the reduced values " .. i)
    end
    -- Reduce-scattered, no parameter keeps a .grad (only a part of it is reduced); all-reduced,
    -- every .grad is whole already.
    for i, p in ipairs(model:parameters()) do
      if scattered then eq(p.grad, nil, what .. "no .grad before sync_shard_grad " .. i)
      else ok(p.grad:eq(10):all():item(), what .. "gradient " .. i .. " whole after backward") end
    end
    opt:sync_shard_grad()
    for i, p in ipairs(model:parameters()) do
      ok(p.grad:eq(10):all():item(), what .. "the pre-hook's values reached gradient " .. i)
    end
  end
end)

-- Checkpoints: ZeRO-sharded state is saved gathered (one parameter at a time) and sliced at load,
-- so a ZeRO-2 data-4 run resumes at pipeline 2 x data 2 without ZeRO, and a plain data-4 run
-- under ZeRO-1 at pipeline 2 x data 2, each continuing exactly as the run that saved it (losses
-- and parameters within 1e-5: AdamW's moments and step count came back too).
test("ZeRO checkpoints load without ZeRO and into a pipeline, and plain ones under ZeRO", function()
  local dir = "/tmp/partrain-test-zero-" .. (os.getenv("MASTER_PORT") or "0")
  local function build(mesh_opts, opts)
    local mesh = pt.mesh(mesh_opts)
    pt.manual_seed(21)
    local model = pt.parallelize(pt.deferred(chain("float32")), chain_policy, mesh, opts)
    return model, mesh, pt.optim.adamw(model, { lr = 1e-2, weight_decay = 0.1 })
  end
  local function train(model, mesh, opt, from, to)
    local losses = {}
    local d, b = mesh:coord().data, BATCH / mesh:size("data")
    for n = from, to do
      pt.manual_seed(500 + n)
      local x, y = pt.randn({ BATCH, 12 }), pt.randint(0, 6, { BATCH })
      local loss = model:train_step(x:narrow(0, d * b, b), y:narrow(0, d * b, b)):detach():clone()
      mesh:group("data"):all_reduce(loss, "mean")
      opt:step(); opt:zero_grad()
      losses[n] = loss:item()
    end
    return losses
  end
  local function same(what, model, losses, want_losses, want_params)
    for n, l in pairs(want_losses) do near(losses[n], l, 1e-5, ("%s: loss at step %d"):format(what, n)) end
    for name, t in pairs(model:full_state_dict()) do near(t, want_params[name], 1e-5, what .. ": parameter " .. name) end
  end
  local pipe = { schedule = "1f1b", microbatches = 2 }
  for _, c in ipairs {
    { what = "zero-2 data 4 -> pipeline 2 x data 2", save = { { zero = 0 }, { zero = { stage = 2 } } },
      load = { { pipeline = 2 }, pipe } },
    { what = "plain data 4 -> zero-1 pipeline 2 x data 2", save = { {}, {} },
      load = { { pipeline = 2, zero = 2 }, { schedule = "1f1b", microbatches = 2, zero = { stage = 1 } } } },
  } do
    local a, am, ao = build(c.save[1], c.save[2])
    train(a, am, ao, 1, 3)
    pt.ckpt.save(dir, { model = a, optim = ao, step = 3, overwrite = true })
    local want = train(a, am, ao, 4, 6)
    local want_params = a:full_state_dict()
    local b, bm, bo = build(c.load[1], c.load[2])
    pt.ckpt.load(dir, { model = b, optim = bo })
    eq(bo:steps(), 3, c.what .. ": the step count")
    same(c.what, b, train(b, bm, bo, 4, 6), want, want_params)
  end
  pt.dist.barrier()
  if pt.dist.rank() == 0 then os.execute("rm -rf '" .. dir .. "'") end
end)

-- On the CPU the optimizer steps each master in pieces of one parameter's elements, at most 128
-- Ki of them: with zero groups of 2 each rank holds 174-186 K elements of the 600 x 600 weight,
-- two pieces, beside at least two other parameters' segments. Training, the gathered state a
-- checkpoint holds and the state a load slices back must see the pieces as one master.
test("a shard in several optimizer pieces trains as AdamW, and its checkpoint moves to other layouts", function()
  local wide = function(dtype) return function() return pt.models.mlp { sizes = { 12, 600, 600, 6 } }:to(dtype) end end
  local optim = { lr = 1e-3, weight_decay = 0.1, clip_grad_norm = 0.05 }
  local a, ao, am = equal_to_serial { what = "zero-1 groups of 2, a wide mlp", mesh = { zero = 2 }, make = wide,
                                      steps = 4, optim = optim }
  local z = ao:zero()
  ok(z.pieces >= 4 and z.master_bytes / 4 > 131072,
     ("the shard (%d elements) is in %d pieces (the big weight's part in two)"):format(z.master_bytes / 4, z.pieces))
  local dir = "/tmp/partrain-test-zero-pieces-" .. (os.getenv("MASTER_PORT") or "0")
  local function train(model, mesh, opt)
    local losses = {}
    local d, b = mesh:coord().data, BATCH / mesh:size("data")
    for n = 1, 3 do
      pt.manual_seed(700 + n)
      local x, y = pt.randn({ BATCH, 12 }), pt.randint(0, 6, { BATCH })
      local loss = model:train_step(x:narrow(0, d * b, b), y:narrow(0, d * b, b)):detach():clone()
      mesh:group("data"):all_reduce(loss, "mean")
      losses[n] = loss:item()
      opt:step(); opt:zero_grad()
    end
    return losses
  end
  pt.ckpt.save(dir, { model = a, optim = ao, step = 4, overwrite = true })
  local want = train(a, am, ao)
  local want_params = a:full_state_dict()
  for _, c in ipairs {
    { what = "-> plain data 4", mesh = {}, opts = {} },
    { what = "-> zero-2 groups of 2", mesh = { zero = 2 }, opts = { zero = { stage = 2 } } },
    { what = "-> zero-1 over data 4", mesh = { zero = 0 }, opts = { zero = { stage = 1 } } },
  } do
    local mesh = pt.mesh(c.mesh)
    local b = pt.parallelize(wide("float32")(), nil, mesh, c.opts)
    local bo = pt.optim.adamw(b, optim)
    pt.ckpt.load(dir, { model = b, optim = bo })
    local got = train(b, mesh, bo)
    for n = 1, 3 do near(got[n], want[n], 1e-5, ("%s: loss at step %d after the load"):format(c.what, n)) end
    for name, t in pairs(b:full_state_dict()) do near(t, want_params[name], 1e-5, c.what .. ": parameter " .. name) end
  end
  pt.dist.barrier()
  if pt.dist.rank() == 0 then os.execute("rm -rf '" .. dir .. "'") end
end)

test("what cannot run is refused at the caller's line", function()
  local here = "test_zero.lua:%d+"
  local e = raises(function() pt.mesh { zero = 3 } end, "zero=3 does not divide the data size 4")
  ok(e:find(here), e)
  eq(pt.mesh { zero = 0 }:size("zero"), 4, "zero <= 0: the whole data group")
  eq(pt.mesh {}:size("zero"), 1, "unset: off")
  local m = pt.mesh { zero = 2 }
  eq(m:size("zero"), 2)
  e = raises(function() pt.parallelize(mlp("float32")(), nil, m, { zero = { stage = 4 } }) end,
             "zero stage=4 is not supported: stages 0, 1, 2, 3")
  ok(e:find(here), e)
  e = raises(function() pt.parallelize(mlp("float32")(), nil, pt.mesh {}, { zero = { stage = 1 } }) end,
             "needs zero groups of more than one rank, but the mesh has zero=1")
  ok(e:find(here), e)
  -- Sizes in MiB: a finite number > 0 (infinity had been cast to a byte count, undefined).
  for _, c in ipairs {
    { zero = { stage = 2, reduce_bucket_size = 0 }, "zero: reduce_bucket_size must be a finite number > 0 (MiB), got 0" },
    { zero = { stage = 2, reduce_bucket_size = math.huge }, "zero: reduce_bucket_size must be a finite number > 0 (MiB), got inf" },
    { zero = { stage = 1, allgather_bucket_size = -1 }, "zero: allgather_bucket_size must be a finite number > 0 (MiB), got -1" },
    { zero = { stage = 1, allgather_bucket_size = 0 / 0 }, "zero: allgather_bucket_size must be a finite number > 0 (MiB), got nan" },
    { zero = { stage = 1, allgather_bucket_size = "big" }, "allgather_bucket_size" },
    { bucket_cap_mb = math.huge, "parallelize: bucket_cap_mb must be a finite number > 0 (MiB), got inf" },
    { bucket_cap_mb = 0, "parallelize: bucket_cap_mb must be a finite number > 0 (MiB), got 0" },
  } do
    local message = table.remove(c)
    e = raises(function() pt.parallelize(mlp("float32")(), nil, m, c) end, message)
    ok(e:find(here), e)
  end
  e = raises(function() pt.parallelize(mlp("float32")(), nil, m, { zero = { stage = 0, overlap_sync_param = true } }) end,
             "overlap_sync_param = true overlaps ZeRO's all-gather of the updated parameters, but the zero stage is 0")
  ok(e:find(here), e)
  e = raises(function() pt.parallelize(mlp("float32")(), nil, m, { reduce_dtype = "int8" }) end,
             "reduce_dtype' must be 'float32', 'bfloat16' or 'float64', got 'int8'")
  ok(e:find(here), e)
  e = raises(function() pt.parallelize(mlp("float32")(), nil, m, { zero = { stage = 0, overlap_comm = true } }) end,
             "zero: overlap_comm overlaps ZeRO's reduce-scatters with backward, but the zero stage is 0")
  ok(e:find(here), e)
  e = raises(function() pt.parallelize(mlp("float32")(), nil, m, { zero = { stage = 1, overlap_comm = false } }) end,
             "zero: overlap_comm = false is stage 2's and 3's choice: stage 1 always leaves its reductions in flight")
  ok(e:find(here), e)
  ok(pt.parallelize(mlp("float32")(), nil, m, { zero = { stage = 1, overlap_comm = true } }), "stage 1 takes overlap_comm = true")
  raises(function() pt.parallelize(mlp("float32")(), nil, m, { zero = { stag = 1 } }) end, "stag")
  e = raises(function() pt.parallelize(mlp("float32")(), nil, m, { zero = { stage = 2, reduce_scatter = false } }) end,
             "stages 2 and 3 always reduce-scatter them")
  ok(e:find(here), e)
  -- A plain optimizer over a ZeRO model's parameters (all of them, or a block's) would step on
  -- gradients ZeRO-2 never leaves in .grad: refused, naming the parameter.
  for _, stage in ipairs { 1, 2 } do
    local zm = pt.parallelize(mlp("float32")(), nil, m, { zero = { stage = stage } })
    e = raises(function() pt.optim.adamw(zm:parameters(), { lr = 1e-3 }) end,
               "belongs to a model parallelized with ZeRO-" .. stage)
    ok(e:find(here), e)
    ok(e:find("pt.optim.adamw(model, ...)", 1, true), e)
    e = raises(function() pt.optim.sgd(zm:get("0"), { lr = 1e-3 }) end, "parameter '0.weight' belongs to a model")
    ok(e:find(here), e)
    ok(zm:data_parallel() and pt.optim.adamw(zm, { lr = 1e-3 }), "the model's own optimizer is made")
    -- Reduce-scattered gradients never reach .grad: clipping .grad would clip nothing.
    e = raises(function() pt.nn.clip_grad_norm(zm, 1.0) end, "whose gradients are reduce-scattered and never reach .grad")
    ok(e:find(here), e)
    ok(e:find("clip_grad_norm = 1", 1, true), e)
  end
  -- ZeRO-1 reduce-scattering keeps only this rank's part of the reduced gradients, in the
  -- buckets: a second backward before zero_grad replaced them (where serial training adds to
  -- them) with exit 0. Refused, on every rank, until opt:zero_grad().
  local z1 = pt.parallelize(mlp("float32")(), nil, m, { zero = { stage = 1 } })
  local z1_opt = pt.optim.sgd(z1, { lr = 1e-3 })
  local x1, y1 = pt.randn({ 2, 12 }), pt.randint(0, 6, { 2 })
  z1:train_step(x1, y1)
  e = raises(function() z1:train_step(x1, y1) end, "a backward pass after a synced one, with no zero_grad between them")
  ok(e:find(here), e)
  z1_opt:step()
  raises(function() z1:train_step(x1, y1) end, "Call opt:zero_grad() after opt:step()")
  z1_opt:zero_grad()
  ok(z1:train_step(x1, y1):item() > 0, "after zero_grad it trains")
  -- All-reduced (reduce_scatter = false), .grad is whole and pt.nn.clip_grad_norm clips it.
  local whole = pt.parallelize(mlp("float32")(), nil, m, { zero = { stage = 1, reduce_scatter = false } })
  whole:train_step(pt.randn({ 2, 12 }), pt.randint(0, 6, { 2 }))
  ok(pt.nn.clip_grad_norm(whole, 1e-3) > 0, "clip_grad_norm on whole gradients")
  -- reduce_scatter = false means nothing without ZeRO: refused, not ignored.
  e = raises(function() pt.parallelize(mlp("float32")(), nil, m, { zero = { stage = 0, reduce_scatter = false } }) end,
             "the zero stage is 0 (no ZeRO)")
  ok(e:find(here), e)
  -- A pipeline step accumulates over its micro-batches already: grad_accumulation is refused.
  e = raises(function()
    pt.parallelize(pt.deferred(chain("float32", 4)), chain_policy, pt.mesh { pipeline = 2 },
                   { grad_accumulation = 2, schedule = "1f1b", microbatches = 2 })
  end, "grad_accumulation=2 with a pipeline")
  ok(e:find(here), e)
end)

H.run()
