-- Data-parallel training throughput and gradient-sync cost, for bench/dp (which runs the same
-- training in PyTorch DDP beside it). Run under the launcher:
--   partrain --nproc-per-node 2 bench/dp.lua --steps 60 --hidden 1024 --batch 256
local pt = require "partrain"
local cfg = pt.args { steps = 60, warmup = 10, batch = 256, hidden = 1024, bucket_cap_mb = pt.args.number(25), raw_reps = 20 }
local mesh = pt.mesh {}
local rank, world = pt.dist.rank(), pt.dist.world_size()
pt.manual_seed(1)
local model = pt.parallelize(pt.models.mlp { sizes = { 784, cfg.hidden, cfg.hidden, 10 } }, nil, mesh,
  { bucket_cap_mb = cfg.bucket_cap_mb })
local dp = pt.data_parallel(model)
local opt = pt.optim.sgd(model, { lr = 0.01, momentum = 0.9 })
local data = pt.data.mnist { batch = cfg.batch, seed = 1, mesh = mesh }

local function step()
  local x, y = data:next()
  local loss = pt.nn.cross_entropy(model(x), y)
  opt:zero_grad()
  loss:backward()
  opt:step()
end
for _ = 1, cfg.warmup do step() end
dp:reset_stats()
pt.dist.barrier()
local t0 = pt.time()
local syncs, exposed_times = pt.zeros(cfg.steps, { dtype = "float64" }), pt.zeros(cfg.steps, { dtype = "float64" })
for i = 1, cfg.steps do
  step()
  local s = dp:stats()
  syncs:narrow(0, i - 1, 1):fill_(s.last_sync_seconds)
  exposed_times:narrow(0, i - 1, 1):fill_(s.last_exposed_seconds)
end
pt.dist.barrier()
local seconds = pt.time() - t0
local stats = dp:stats()

-- A raw all-reduce of the same bytes, as one tensor, for comparison.
local group = mesh:group("data")
local flat = pt.zeros(stats.bytes / 4)
group:all_reduce(flat)
local raw = require("timing").median_seconds(cfg.raw_reps, function() group:all_reduce(flat) end)
-- Ranks reach each sync at different moments (noise, imbalance), and the first to arrive also
-- waits for the last; the last to arrive measures the collective itself. So: per step, the
-- minimum over ranks; then the mean over steps.
group:all_reduce(syncs, "min")
group:all_reduce(exposed_times, "min")
local sync, exposed = syncs:mean():item(), exposed_times:mean():item()
if rank == 0 then
  print(("partrain world=%d samples_per_s=%.1f step_ms=%.2f grad_mb=%.2f buckets=%d sync_ms=%.2f exposed_ms=%.2f raw_allreduce_ms=%.2f sync_over_raw=%.3f hidden=%.1f%%"):format(
    world, cfg.steps * cfg.batch / seconds, 1000 * seconds / cfg.steps, stats.bytes / 2 ^ 20, dp:buckets(),
    1000 * sync, 1000 * exposed, 1000 * raw, sync / raw, 100 * (1 - exposed / sync)))
end
