-- ZeRO-3 (parameters sharded, gathered a unit at a time) trains exactly as serial AdamW: a 3-block
-- GPT-2 in float64, 30 steps, the loss every step, clipping's global norm every step and every
-- logical parameter at the end within 1e-10 relative (to max(|x|, 1)), at data 4 (one zero group),
-- at zero groups of 2 inside data 4 (hierarchical), tensor 2 x data 2, pipeline 2 (1F1B) x data 2,
-- with activation checkpointing, with train_step's accumulation, with prefetch off and deep, and
-- with reshard_after_forward off. Its bf16 parameters with float32 masters train bit for bit as
-- ZeRO-2's. Each rank holds 1/4 of the parameters between steps (its shards), no parameter's
-- values are readable outside a gather (an error names model:gathered), and model:gathered reads
-- and writes them. What cannot run is refused at the caller's line.
--   partrain --nproc-per-node 4 --threads 1 tests/dist/test_zero3.lua   (2 ranks: data 2 only)
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, near, eq, ok, raises = H.test, H.near, H.eq, H.ok, H.raises

local GPT = { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 3 }
local BATCH = 8

local function gpt2(dtype) return function() return pt.models.gpt2(GPT):to(dtype or "float64") end end

local function batch(mesh)
  local x, y = pt.randint(0, GPT.vocab, { BATCH, GPT.seq }), pt.randint(0, GPT.vocab, { BATCH, GPT.seq })
  local world = mesh:group("world")
  world:broadcast(x, 0); world:broadcast(y, 0)
  return x, y
end

local function ce(out, y) return pt.nn.cross_entropy(out:reshape(-1, out.shape[#out.shape]), y:reshape(-1)) end

-- Trains `a` (parallelized with c.opts over c.mesh) beside `b`: a serial model, or (c.against) a
-- model parallelized with c.against over the same mesh, from the same seed on the same global
-- batches; compares each step's loss and clipping's norm, and every parameter at the end, within
-- c.tol (0: bit for bit).
local function equal(c)
  local mesh = pt.mesh(c.mesh)
  local make = c.make or gpt2(c.dtype)
  pt.manual_seed(11)
  -- A deferred model is initialized by name: its serial twin is materialized whole the same way.
  local policy = c.policy or "policies.gpt2"
  local b = c.against and pt.parallelize(make(), policy, mesh, c.against)
            or (c.deferred and pt.deferred(make):materialize() or make())
  pt.manual_seed(11)
  local a = pt.parallelize(c.deferred and pt.deferred(make) or make(), policy, mesh, c.opts)
  local optim = c.optim or { lr = 1e-2, weight_decay = 0.1, clip_grad_norm = 0.5 }
  local ao, bo = pt.optim.adamw(a, optim), pt.optim.adamw(b, optim)
  local d, n = mesh:coord().data, mesh:size("data")
  local part = BATCH / n
  local tol = c.tol or 1e-10
  for step = 1, c.steps or 30 do
    local x, y = batch(mesh)
    local xs, ys = x:narrow(0, d * part, part), y:narrow(0, d * part, part)
    local lb
    if c.against then
      lb = b:train_step(xs, ys, { accumulate = c.accumulate })
    else
      lb = ce(b(x), y)
      lb:backward()
    end
    local la = a:train_step(xs, ys, { accumulate = c.accumulate }):detach():clone()
    if c.against then lb = lb:detach():clone() end
    near(la, lb, tol, ("%s: loss at step %d"):format(c.what, step))
    local nb, na = bo:step(), ao:step()
    if optim.clip_grad_norm then near(na, nb, tol, ("%s: clipping's norm at step %d"):format(c.what, step)) end
    ao:zero_grad(); bo:zero_grad()
  end
  H.same_parameters(a:full_state_dict(), c.against and b:full_state_dict() or b:state_dict(), tol, c.what)
  return a, ao, mesh
end

-- At 2 ranks (ctest dist.zero3_2): data 2, plain and deferred, with recompute.
if pt.dist.world_size() == 2 then
  test("ZeRO-3 over data 2 equals serial AdamW (float64, clipping on)", function()
    local _, opt = equal { what = "zero-3 data 2", mesh = { zero = 0 }, opts = { zero = { stage = 3 } } }
    eq(opt:zero().group, 2)
    equal { what = "zero-3 data 2 deferred recompute", mesh = { zero = 0 }, deferred = true, steps = 10,
            opts = { zero = { stage = 3 }, recompute = "block" } }
  end)
  H.run()
  return
end

test("ZeRO-3 over data 4 equals serial AdamW (float64, clipping on)", function()
  local model, opt = equal { what = "zero-3 data 4", mesh = { zero = 0 }, opts = { zero = { stage = 3 } } }
  local z = opt:zero()
  eq(z.stage, 3); eq(z.group, 4)
end)

test("ZeRO-3 over zero groups of 2 inside data 4 (hierarchical) equals serial AdamW", function()
  equal { what = "zero-3 groups of 2", mesh = { zero = 2 }, opts = { zero = { stage = 3 } } }
end)

test("ZeRO-3 x tensor 2 (the gathers over already split parameters) equals serial AdamW", function()
  equal { what = "zero-3 tensor 2", mesh = { tensor = 2, zero = 0 }, opts = { zero = { stage = 3 } } }
end)

test("ZeRO-3 x pipeline 2 (1F1B, units gathered once a step or every micro-batch) equals serial AdamW", function()
  equal { what = "zero-3 pipeline 2", mesh = { pipeline = 2, zero = 0 },
          opts = { zero = { stage = 3 }, schedule = "1f1b", microbatches = 2 } }
  equal { what = "zero-3 pipeline 2 resharding every micro-batch", mesh = { pipeline = 2, zero = 0 }, steps = 10,
          opts = { zero = { stage = 3, reshard_after_forward = true }, schedule = "1f1b", microbatches = 2 } }
end)

test("a deferred model is made a unit at a time under ZeRO-3 and equals serial AdamW", function()
  equal { what = "zero-3 deferred", mesh = { zero = 0 }, deferred = true, steps = 10, opts = { zero = { stage = 3 } } }
  equal { what = "zero-3 deferred tensor 2", mesh = { tensor = 2, zero = 0 }, deferred = true, steps = 10,
          opts = { zero = { stage = 3 } } }
  equal { what = "zero-3 deferred pipeline 2", mesh = { pipeline = 2, zero = 0 }, deferred = true, steps = 10,
          opts = { zero = { stage = 3 }, schedule = "1f1b", microbatches = 2 } }
end)

test("ZeRO-3 with recompute, accumulation, prefetch 0 and 3, reshard_after_forward off equals serial AdamW", function()
  equal { what = "zero-3 recompute", mesh = { zero = 0 }, opts = { zero = { stage = 3 }, recompute = "block" } }
  equal { what = "zero-3 accumulate 2", mesh = { zero = 0 }, accumulate = 2, steps = 10,
          opts = { zero = { stage = 3 } } }
  equal { what = "zero-3 prefetch 0", mesh = { zero = 0 }, steps = 10, opts = { zero = { stage = 3, prefetch = 0 } } }
  equal { what = "zero-3 prefetch 3 recompute", mesh = { zero = 0 }, steps = 10,
          opts = { zero = { stage = 3, prefetch = 3 }, recompute = "block" } }
  equal { what = "zero-3 kept to backward", mesh = { zero = 0 }, steps = 10,
          opts = { zero = { stage = 3, reshard_after_forward = false } } }
end)

test("ZeRO-3 of LLaMA (grouped-query attention, its blocks 'layers') and with overlap_comm equals serial AdamW", function()
  local llama = function()
    return pt.models.llama { vocab = GPT.vocab, seq = GPT.seq, dim = GPT.dim, heads = 4, kv_heads = 2, layers = 3 }
      :to("float64")
  end
  equal { what = "zero-3 llama", mesh = { zero = 0 }, make = llama, policy = "policies.llama", steps = 10,
          opts = { zero = { stage = 3 } } }
  equal { what = "zero-3 llama tensor 2", mesh = { tensor = 2, zero = 0 }, make = llama, policy = "policies.llama",
          steps = 10, opts = { zero = { stage = 3 } } }
  equal { what = "zero-3 overlap_comm", mesh = { zero = 0 }, steps = 10,
          opts = { zero = { stage = 3, overlap_comm = true } } }
end)

test("ZeRO-3's bf16 parameters with float32 masters train bit for bit as ZeRO-2's", function()
  equal { what = "zero-3 bf16 vs zero-2", mesh = { zero = 0 }, dtype = "bfloat16", steps = 10, tol = 0,
          optim = { lr = 1e-2, weight_decay = 0.1 },
          opts = { zero = { stage = 3 } }, against = { zero = { stage = 2 } } }
end)

test("between steps a rank holds its shards only; values are read inside model:gathered", function()
  local mesh = pt.mesh { zero = 0 }
  pt.manual_seed(5)
  local serial = gpt2()()
  pt.manual_seed(5)
  local model = pt.parallelize(gpt2()(), "policies.gpt2", mesh, { zero = { stage = 3 } })
  local w = model.h[1].mlp.c_fc.weight
  local e = raises(function() local s = w:sum(); return s end, "sharded by ZeRO-3")
  ok(e:find("test_zero3.lua:%d+"), e)
  ok(e:find("model:gathered"), e)
  -- A module inside a unit run on its own while the unit is freed is refused, naming the unit.
  e = raises(function() local y = model.h[1].mlp.c_fc(pt.randn(2, GPT.dim):to("float64")); return y end,
             "ZeRO-3: 'h.1.mlp.c_fc' holds parameters of unit 'h.1', which exist only while it is gathered")
  ok(e:find("test_zero3.lua:%d+"), e)
  local inner = model:gathered(function() return model.h[1].mlp.c_fc(pt.ones(2, GPT.dim):to("float64")) end)
  near(inner, serial.h[1].mlp.c_fc(pt.ones(2, GPT.dim):to("float64")), 1e-12, "inside model:gathered it runs")
  local got = model:gathered(function() return w:clone() end)
  near(got, serial.h[1].mlp.c_fc.weight, 0, "gathered: the unit's weight")
  -- A write inside the gather stays: the shard takes it.
  model:gathered(function() pt.no_grad(function() w:zero_() end) end)
  eq(model:gathered(function() return w:abs():sum():item() end), 0, "the write is kept in the shards")
  eq(model:full_state_dict()["h.1.mlp.c_fc.weight"]:abs():sum():item(), 0)
  -- The forward without gradients (evaluation) gathers and frees as training does.
  pt.no_grad(function() serial.h[1].mlp.c_fc.weight:zero_() end)
  local x = batch(mesh)
  local out = pt.no_grad(function() return model(x) end)
  near(out, pt.no_grad(function() return serial(x) end), 1e-12, "evaluation's output")
end)

test("a policy's units are ZeRO-3's units, and equal serial AdamW", function()
  local P = require "partrain.policy"
  local base = require "policies.gpt2"
  -- Every block in one unit: one larger gather in place of three.
  local whole = P.policy { name = "gpt2_one_unit", targets = { "GPT2" }, modules = base.modules, ties = base.ties,
                           pipeline = base.pipeline, units = { "h" } }
  local _, opt = equal { what = "zero-3 policy units", mesh = { zero = 0 }, policy = whole, steps = 10,
                         opts = { zero = { stage = 3 } } }
  local n = 0
  for name, t in pairs(gpt2()():state_dict()) do
    if name:find("^h%.") then n = n + t:numel() end
  end
  eq(opt:zero().largest_unit_bytes, math.ceil(n / 4) * 4 * 8, "the unit is the blocks' parameters, padded to the zero group")
  local e = raises(function() P.policy { name = "x", targets = { "GPT2" }, modules = {}, pipeline = base.pipeline,
                                         units = { "h.0", 3 } } end, "policy field 'units': entry 2 must be a module path")
  ok(e:find("test_zero3.lua:%d+"), e)
end)

test("what cannot run under ZeRO-3 is refused at the caller's line", function()
  local here = "test_zero3.lua:%d+"
  local mesh = pt.mesh { zero = 0 }
  for _, c in ipairs {
    { { zero = { stage = 2, reshard_after_forward = true } }, "reshard_after_forward is stage 3's" },
    { { zero = { stage = 1, prefetch = 2 } }, "prefetch is stage 3's" },
    { { zero = { stage = 2, units = { "h.0" } } }, "units is stage 3's" },
    { { zero = { stage = 3, prefetch = -1 } }, "prefetch must be a number of units from 0 to 64, got -1" },
    { { zero = { stage = 3, overlap_sync_param = true } }, "stage 3 gathers parameters before each unit's forward" },
    { { zero = { stage = 3, reduce_scatter = false } }, "stages 2 and 3 always reduce-scatter them" },
    { { zero = { stage = 3, units = { "h.9" } } }, "unit 'h.9' is not a module of GPT2" },
    { { zero = { stage = 3, units = { "h", "h.0" } } }, "units 'h' and 'h.0' overlap" },
    { { zero = { stage = 3, units = { "h.0", 3 } } }, "must be a list of strings, element 2 is a number" },
    { { zero = { stage = 3, blocks = "nothing" } }, "the blocks 'nothing' are not a module of GPT2" },
  } do
    local e = raises(function() pt.parallelize(gpt2()(), "policies.gpt2", mesh, c[1]) end, c[2])
    ok(e:find(here), e)
  end
end)

H.run()
