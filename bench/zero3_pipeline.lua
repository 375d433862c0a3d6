-- ZeRO-3 under a pipeline, for docs/benchmarks.md: pipeline 2 x data 2 (4 ranks), 1F1B over
-- --microbatches micro-batches, a GPT-2 of --layers blocks. Two ways take turns in one run: the
-- default (a stage's units gathered at their first use in a step and kept over its micro-batches)
-- and reshard_after_forward = true (each micro-batch's forward and backward gather them again).
-- Prints, per way, the all-gathers a step on the zero group (calls and MB, from the group's
-- traffic counter), the median step time and its ratio to the default, and the most gathered at
-- once on this rank.
--   partrain --nproc-per-node 4 --threads 1 bench/zero3_pipeline.lua
local pt = require "partrain"
local cfg = pt.args { microbatches = 4, layers = 4, dim = 256, heads = 4, seq = 64, steps = 4, rounds = 3 }
local mesh = pt.mesh { pipeline = 2, zero = 0 }
local gpt = { vocab = 256, seq = cfg.seq, dim = cfg.dim, heads = cfg.heads, layers = cfg.layers }
local ways = { { name = "kept", zero = { stage = 3 } }, { name = "regathered", zero = { stage = 3, reshard_after_forward = true } } }
for _, w in ipairs(ways) do
  pt.manual_seed(1)
  w.model = pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh,
                           { zero = w.zero, schedule = "1f1b", microbatches = cfg.microbatches })
  w.opt = pt.optim.adamw(w.model, { lr = 1e-3 })
  w.times, w.calls, w.bytes = {}, 0, 0
end
local zero = mesh:group("zero")
local b = 2 * cfg.microbatches / mesh:size("data")
for round = 1, cfg.rounds do
  for _, w in ipairs(ways) do
    for i = 1, cfg.steps do
      local x, y = pt.randint(0, 256, { b, cfg.seq }), pt.randint(0, 256, { b, cfg.seq })
      pt.dist.barrier()
      zero:reset_traffic()
      local t0 = pt.time()
      w.model:train_step(x, y)
      w.opt:step(); w.opt:zero_grad()
      local s = pt.tensor({ pt.time() - t0 }, { dtype = "float64" })
      pt.dist.world():all_reduce(s, "max")
      local g = zero:traffic().all_gather or { calls = 0, bytes = 0 }
      w.calls, w.bytes = g.calls, g.bytes
      if round > 1 or i > 1 then w.times[#w.times + 1] = s:item() end
    end
  end
end
local median = require("timing").median
local base = median(ways[1].times)
for _, w in ipairs(ways) do
  local z = w.opt:zero()
  if pt.dist.rank() == 0 then
    print(("%s microbatches=%d layers=%d all_gathers_a_step=%d gathered_mb_a_step=%.3f step_ms=%.2f vs_kept=%.3f "
      .. "peak_gathered_mb=%.3f"):format(w.name, cfg.microbatches, cfg.layers, w.calls, w.bytes / 1e6,
      1000 * median(w.times), median(w.times) / base, z.peak_gathered_bytes / 1e6))
  end
end
