-- Pipeline parallelism for GPT-2, for bench/pp: trains a byte-level GPT-2 at pipeline 2 with one
-- schedule and micro-batch count, a micro-batch of fixed size (so the batch grows with the count),
-- and prints, on rank 0, each rank's activation memory: the peak bytes LibTorch's tensors held
-- during a step above what they held before it, median over the steps after the first. The
-- parameters, the optimizer state (made by the first step) and the gradients (never zeroed here,
-- so they stay allocated from the first step on) are in the "before", so what the peak adds is
-- the activations, the tensors in flight and autograd's temporaries. bench/pp runs it under
-- `partrain --trace` and reads the bubble from the trace.
--   partrain --nproc-per-node 2 --threads 1 --trace t.json bench/pp.lua --schedule 1f1b --microbatches 4
local pt = require "partrain"
local cfg = pt.args {
  schedule = "1f1b", microbatches = 4, chunks = 1, steps = 6, micro = 4, seq = 128, dim = 256, heads = 4, layers = 8,
}
local mesh = pt.mesh { pipeline = pt.dist.world_size() }
pt.manual_seed(1)
local gpt = { vocab = 256, seq = cfg.seq, dim = cfg.dim, heads = cfg.heads, layers = cfg.layers }
local model = pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh,
  { schedule = cfg.schedule, microbatches = cfg.microbatches, chunks = cfg.chunks })
local opt = pt.optim.adamw(model, { lr = 1e-3 })
local batch = cfg.micro * cfg.microbatches

local peaks, times = {}, {}
for step = 1, cfg.steps do
  local x = pt.randint(0, gpt.vocab, { batch, cfg.seq })
  local y = pt.randint(0, gpt.vocab, { batch, cfg.seq })
  local before = pt.memory().allocated
  pt.reset_peak_memory()
  local start = pt.time()
  model:train_step(x, y)
  times[#times + 1] = pt.time() - start
  if step > 1 then peaks[#peaks + 1] = pt.memory().allocated_peak - before end
  opt:step()
end
local median = require("timing").median
-- Every rank's median peak in KiB (whole numbers: exact in a float tensor), gathered by a sum
-- of one-hot rows.
local world = pt.dist.world_size()
local row = {}
for r = 1, world do row[r] = r - 1 == pt.dist.rank() and math.floor(median(peaks) / 1024 + 0.5) or 0 end
local all = pt.tensor(row)
mesh:group("world"):all_reduce(all)
if pt.dist.rank() == 0 then
  local cells = {}
  for r = 0, world - 1 do cells[#cells + 1] = ("rank%d=%.0fKiB"):format(r, all:select(0, r):item()) end
  print(("pp schedule=%s microbatches=%d chunks=%d step_s=%.4f activation %s"):format(
    cfg.schedule, cfg.microbatches, cfg.chunks, median(times), table.concat(cells, " ")))
end
