-- ZeRO against plain data parallelism in one run, for bench/zero: the same GPT-2 from the same
-- weights, trained plain, with ZeRO-1 and with ZeRO-2 over the whole data group, the three taking
-- turns (a round of steps each, several rounds) so that the machine's noise falls on all alike.
-- ZeRO-2 runs twice: as by default, and with overlap_comm (its reduce-scatters in flight beside
-- backward, at the cost of more buckets of scratch). ZeRO-3 runs with prefetch 1 and 0: its
-- parameter shards and model state against 1/z of the unsharded model's, the peak of its gathers
-- against the planner's count, and its step time against ZeRO-2's. Prints, per variant, the median step time and each rank's optimizer-state, master-weight and
-- gradient bytes (pt.memory_report: what the tensors hold) beside ZeRO's theory; under ZeRO-2
-- the gradients are split into the shard and the scratch of the buckets backward reduces (the
-- pool's high-water mark), stated apart. Every variant uses buckets of --bucket MiB.
--   partrain --nproc-per-node 4 --threads 1 bench/zero.lua --dim 256 --layers 4
local pt = require "partrain"
local cfg = pt.args {
  vocab = 256, seq = 64, dim = 256, heads = 4, layers = 4,
  batch = 8,          -- the global batch, in sequences
  dtype = "float32",
  bucket = 1,         -- MiB of gradient a bucket (bucket_cap_mb; ZeRO's reduce_bucket_size)
  steps = 4,          -- steps a round, per variant
  rounds = 3,         -- rounds; the first step of each variant is warm-up, not timed
}
local rank, world = pt.dist.rank(), pt.dist.world_size()
local variants = { { name = "plain", stage = 0 }, { name = "zero1", stage = 1 }, { name = "zero2", stage = 2 },
                   { name = "zero2_overlap", stage = 2, overlap_comm = true },
                   { name = "zero3", stage = 3, prefetch = 1 }, { name = "zero3_noprefetch", stage = 3, prefetch = 0 } }
local local_batch = math.floor(cfg.batch / world)
for _, v in ipairs(variants) do
  pt.manual_seed(1)
  local mesh = v.stage > 0 and pt.mesh { zero = 0 } or pt.mesh {}
  local model = pt.models.gpt2 { vocab = cfg.vocab, seq = cfg.seq, dim = cfg.dim, heads = cfg.heads, layers = cfg.layers,
                                 dtype = cfg.dtype }
  -- ZeRO-3's buckets are its units (a block each), whatever the bucket size.
  v.model = pt.parallelize(model, nil, mesh, v.stage == 3 and { zero = { stage = 3, prefetch = v.prefetch } }
                                             or v.stage > 0 and { zero = { stage = v.stage, reduce_bucket_size = cfg.bucket,
                                                                           overlap_comm = v.overlap_comm } }
                                             or { bucket_cap_mb = cfg.bucket })
  v.opt = pt.optim.adamw(v.model, { lr = 1e-3, clip_grad_norm = 1.0 })
  v.loss_of = pt.loss_fn(v.model)
  v.times = {}
end
pt.manual_seed(2)
local batches = {}
for i = 1, cfg.steps do batches[i] = pt.randint(0, cfg.vocab, { local_batch, cfg.seq + 1 }) end

local function step(v, tokens)
  local x, y = tokens:narrow(1, 0, cfg.seq):contiguous(), tokens:narrow(1, 1, cfg.seq):contiguous()
  v.opt:zero_grad()
  v.loss_of(v.model(x), y):backward()
  v.opt:step()
end
local group = pt.dist.world()
for round = 1, cfg.rounds do
  for _, v in ipairs(variants) do
    for i = 1, cfg.steps do
      pt.dist.barrier()
      local t0 = pt.time()
      step(v, batches[i])
      local seconds = pt.tensor({ pt.time() - t0 }, { dtype = "float64" })
      group:all_reduce(seconds, "max")  -- a step lasts until its slowest rank is done
      if round > 1 or i > 1 then v.times[#v.times + 1] = seconds:item() end
    end
  end
end

local median = require("timing").median
-- Theory (ZeRO paper, per rank, N parameters, z ranks a zero group, P bytes a parameter):
-- Adam's moments 8N/z; float32 masters 4N/z (unsharded: 4N for a low-precision model, none in
-- float32); gradients P*N, and P*N/z under ZeRO-2.
local n = 0
for _, p in ipairs(variants[1].model:parameters()) do n = n + p:numel() end
local pbytes = pt.zeros({ 1 }, { dtype = cfg.dtype }):element_size()
local base = median(variants[1].times)
local zero2 = median(variants[3].times)
for _, v in ipairs(variants) do
  local r = pt.memory_report(v.model)
  local z = v.stage > 0 and world or 1
  local theory = { optimizer = 8 * n / z, master = (v.stage > 0 or pbytes < 4) and 4 * n / z or 0,
                   grads = v.stage >= 2 and pbytes * n / z or pbytes * n }
  local function col(key)
    local t = theory[key]
    return ("%s_mb=%.3f theory_mb=%.3f ratio=%s"):format(key, r[key] / 1e6, t / 1e6,
      t > 0 and ("%.3f"):format(r[key] / t) or (r[key] == 0 and "-" or "inf"))
  end
  local ms = 1000 * median(v.times)
  local scratch = ""
  if v.stage >= 2 then  -- the shard against theory, the scratch apart
    local s = v.opt:zero().scratch_bytes
    local shard = r.grads - s
    scratch = (" | shard_mb=%.3f theory_mb=%.3f ratio=%.3f scratch_mb=%.3f"):format(shard / 1e6, theory.grads / 1e6,
      shard / theory.grads, s / 1e6)
  end
  local params = ""
  if v.stage == 3 then
    -- The parameters' shards against 1/z of the whole; the model state (parameters, gradients,
    -- optimizer state, masters that are not the shards themselves) against 1/z of the unsharded
    -- model's; the gathers' peak against what the planner names (the root unit and 1 + prefetch
    -- of the largest unit).
    local zb = v.opt:zero()
    local state = zb.param_shard_bytes + (r.grads - zb.scratch_bytes) + r.optimizer + (zb.master_bytes - zb.shared_master_bytes)
    local whole = pbytes * n + pbytes * n + 8 * n + (pbytes < 4 and 4 * n or 0)
    local planned = zb.root_unit_bytes + (1 + v.prefetch) * zb.largest_unit_bytes
    params = (" | param_shard_mb=%.3f theory_mb=%.3f ratio=%.3f | state_mb=%.3f whole/z_mb=%.3f state_ratio=%.3f"
              .. " | gathered_peak_mb=%.3f planned_mb=%.3f gather_ratio=%.3f vs_zero2=%.3f"):format(
      zb.param_shard_bytes / 1e6, pbytes * n / z / 1e6, zb.param_shard_bytes / (pbytes * n / z), state / 1e6,
      whole / z / 1e6, state / (whole / z), zb.peak_gathered_bytes / 1e6, planned / 1e6,
      zb.peak_gathered_bytes / planned, ms / (1000 * zero2))
  end
  if rank == 0 then
    print(("%s world=%d dtype=%s params=%d step_ms=%.2f vs_plain=%.3f timed_steps=%d | %s | %s | %s%s%s"):format(v.name,
      world, cfg.dtype, n, ms, ms / (1000 * base), #v.times, col("optimizer"), col("master"), col("grads"), scratch,
      params))
  end
end
