-- What the reliability checks cost, measured side by side in one run (bench/reliability):
--   partrain --nproc-per-node 2 --threads 1 bench/reliability.lua [--steps 20]
-- 1. A training step of a byte-level GPT-2 at tensor 2 with every collective checked
--    (pt.dist.check_collectives: one small all-gather before each) against the same step
--    unchecked, steps interleaved, medians.
-- 2. The policy probe, and 3. pt.dist's agreement check on a blocking collective: see below.
local pt = require "partrain"
local T = require "timing"
local cfg = pt.args { steps = 10, warmup = 2, batch = 8, seq = 64, dim = 128, heads = 4, layers = 2 }
local rank0 = pt.dist.rank() == 0
local function say(...) if rank0 then print(string.format(...)) end end

local mesh = pt.mesh { tensor = pt.dist.world_size() }
local arch = { vocab = 256, seq = cfg.seq, dim = cfg.dim, heads = cfg.heads, layers = cfg.layers }
pt.manual_seed(1)
local model = pt.parallelize(pt.models.gpt2(arch), nil, mesh)
local loss_of = pt.loss_fn(model)
local opt = pt.optim.adamw(model, { lr = 1e-4, clip_grad_norm = 1.0 })
local data = pt.data.text { path = "data/kjv.txt", seq = cfg.seq, batch = cfg.batch, seed = 1 }
local group = mesh:group("tensor")

local function step()
  local x, y = data:next()
  local loss = loss_of(model(x), y)
  opt:zero_grad()
  loss:backward()
  opt:step()
end

for _ = 1, cfg.warmup do step() end
group:reset_traffic()
step()
local calls = 0
for _, t in pairs(group:traffic()) do calls = calls + t.calls end
local plain, checked = {}, {}
for i = 1, cfg.steps do
  pt.dist.barrier()
  plain[i] = T.median_seconds(1, step)
  pt.dist.check_collectives(true)
  pt.dist.barrier()
  checked[i] = T.median_seconds(1, step)
  pt.dist.check_collectives(false)
end
local median = require("timing").median
local p, c = median(plain), median(checked)
say("== --check-collectives, GPT-2 %d layers x %d, batch %d x %d, tensor %d, %d collectives a step, %d steps",
    cfg.layers, cfg.dim, cfg.batch, cfg.seq, mesh:size("tensor"), calls, cfg.steps)
say("unchecked %.1f ms | checked %.1f ms | checked/unchecked %.3f | %.0f us a checked collective",
    p * 1e3, c * 1e3, c / p, (c - p) / calls * 1e6)

-- 2. What pt.parallelize's probe costs: parallelizing a fresh GPT-2 (the same architecture) with
--    the probe (a serial forward and backward on a small batch, compared with the sharded ones)
--    against without it, alternating, medians.
-- Seconds pt.parallelize takes on a fresh GPT-2 of `shape` (the same initial weights each time).
local function parallelize_seconds(shape, probe)
  pt.manual_seed(1)
  local serial = pt.models.gpt2(shape)
  pt.dist.barrier()
  return T.median_seconds(1, function() pt.parallelize(serial, nil, mesh, { probe = probe }) end)
end
local with, without = {}, {}
for i = 1, 5 do
  without[i] = parallelize_seconds(arch, false)
  with[i] = parallelize_seconds(arch, true)
end
local w, wo = median(with), median(without)
say("== the policy probe, the same GPT-2, 5 times each")
say("without %.1f ms | with %.1f ms | with/without %.2f | probe %.1f ms", wo * 1e3, w * 1e3, w / wo, (w - wo) * 1e3)

-- 3. What pt.dist's own agreement check costs a blocking collective (it all-gathers a record of
--    the call first, even without --check-collectives): 200 blocking all-reduces of 4 floats
--    against 200 async ones waited at once (not checked), alternating rounds, medians per call.
local world = pt.dist.world()
local small = pt.ones(4)
local function blocking() for _ = 1, 200 do world:all_reduce(small) end end
local function async() for _ = 1, 200 do world:all_reduce(small, { async = true }):wait() end end
blocking(); async()
local b, a = {}, {}
for i = 1, 9 do
  pt.dist.barrier()
  b[i] = T.median_seconds(1, blocking) / 200
  pt.dist.barrier()
  a[i] = T.median_seconds(1, async) / 200
end
local bm, am = median(b), median(a)
say("== pt.dist's agreement check, all_reduce of 4 float32 on %d ranks, 9 rounds of 200", pt.dist.world_size())
say("unchecked (async + wait) %.0f us | checked (blocking) %.0f us | checked/unchecked %.2f | %.0f us the check",
    am * 1e6, bm * 1e6, bm / am, (bm - am) * 1e6)

-- 4. The probe above P.probe_limit: a GPT-2 of more than 16 M parameters parallelized without the
--    probe, with "auto" (the first of its blocks, the rest set aside for the probe) and with
--    probe = true (every block), alternating, medians: "auto" is bounded by one block whatever
--    the depth.
local deep = { vocab = 256, seq = cfg.seq, dim = 512, heads = 8, layers = 12 }
local off, auto, all = {}, {}, {}
for i = 1, 5 do
  off[i] = parallelize_seconds(deep, false)
  auto[i] = parallelize_seconds(deep, "auto")
  all[i] = parallelize_seconds(deep, true)
end
local o, a, w = median(off), median(auto), median(all)
say("== the probe of a GPT-2 of %d layers x %d (%.1f M parameters), 5 times each", deep.layers, deep.dim,
    pt.models.gpt2(deep):num_parameters() / 1e6)
say("without %.0f ms | auto, one block %.0f ms | every block %.0f ms | auto/without %.2f | every/without %.2f",
    o * 1e3, a * 1e3, w * 1e3, a / o, w / o)
