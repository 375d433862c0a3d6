-- Zero-bubble pipelines for bench/zb: trains a byte-level GPT-2 through one schedule (1f1b,
-- interleaved, zbh1, zbh2, zbv, or a plan file a search wrote) with micro-batches of fixed size,
-- and writes, for each rank, `<out>/rank<r>.json`: the median step time over the steps after the
-- first, the median peak bytes LibTorch's tensors held during a step above what they held before
-- it (activations, messages in flight, the weight-gradient inputs a split backward keeps, and
-- autograd's temporaries: parameters, gradients and optimizer state are in the "before"), and the
-- first step's weighing of each chunk (model:pipeline().measured). bench/zb runs it under
-- `partrain --trace` and reads the actions' durations and the bubble from the trace.
--   partrain --nproc-per-node 2 --threads 1 --trace t.json bench/zb.lua --schedule zbh1 --out DIR
local pt = require "partrain"
local cfg = pt.args {
  schedule = "1f1b", microbatches = 8, chunks = 1, steps = 6, micro = 2, seq = 128, dim = 256, heads = 4, layers = 8,
  out = ".", plan = "",
}
local mesh = pt.mesh { pipeline = pt.dist.world_size() }
local schedule = cfg.schedule
if cfg.plan ~= "" then  -- a plan a search returned, kept as Lua: `return { [0] = {...}, ..., layout = ... }`
  local kept = assert(loadfile(cfg.plan))()
  schedule = function() return kept end
end
pt.manual_seed(1)
local gpt = { vocab = 256, seq = cfg.seq, dim = cfg.dim, heads = cfg.heads, layers = cfg.layers }
local model = pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh,
  { schedule = schedule, microbatches = cfg.microbatches, chunks = cfg.chunks })
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
table.remove(times, 1)
local median = require("timing").median
local info = model:pipeline()
local out = {
  schedule = info.schedule, layout = info.layout, chunks = info.chunks, microbatches = info.microbatches,
  rank = info.rank, stages = info.stages, step_s = median(times), peak = median(peaks), measured = info.measured,
}
local f = assert(io.open(("%s/rank%d.json"):format(cfg.out, info.rank), "w"))
f:write(pt.metrics.json(out), "\n")
f:close()
