-- Trains a small GPT-2 a few steps (pipelined with --pipeline > 1, else data-parallel over the
-- ranks) for tests/trace/test_trace.py, which runs it under `partrain --trace` and checks the
-- trace against the compute order this script prints: "order RANK: F0.c0 F1.c0 B0.c0 ...".
--   partrain --nproc-per-node 2 --trace t.json tests/trace/trace_run.lua --pipeline 2 --schedule 1f1b
local pt = require "partrain"
local cfg = pt.args { pipeline = 2, schedule = "1f1b", microbatches = 4, chunks = 1, steps = 3, fail_first = false,
                     zero3 = false, reshard = true, context = 1, seq = 8, dim = 16 }
local gpt = { vocab = 64, seq = cfg.seq, dim = cfg.dim, heads = 4, layers = 4 }

-- --context c: each sequence split over c ranks (ring attention; this rank's chunks of its batch).
local mesh = pt.mesh { pipeline = cfg.pipeline, context = cfg.context, zero = cfg.zero3 and 0 or nil }
pt.manual_seed(5)
local opts = cfg.pipeline > 1 and { schedule = cfg.schedule, microbatches = cfg.microbatches, chunks = cfg.chunks } or {}
-- --zero3: ZeRO-3 over the data ranks, its units (the 4 blocks) freed after forward unless --no-reshard.
if cfg.zero3 then opts.zero = { stage = 3, reshard_after_forward = cfg.reshard } end
local model = pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh, opts)
local opt = pt.optim.adamw(model, { lr = 1e-2 })
if cfg.pipeline > 1 then
  -- Each pipeline rank's compute order (the world rank, with no data parallelism), as scheduled.
  local pipeline = require "partrain.pipeline"
  local plan = pipeline.schedule(cfg.schedule, cfg.pipeline, cfg.microbatches, cfg.chunks)
  for r = 0, cfg.pipeline - 1 do
    local names = {}
    for _, a in ipairs(plan[r]) do names[#names + 1] = pipeline.format(a) end
    if pt.dist.rank() == 0 then print(("order %d: %s"):format(r, table.concat(names, " "))) end
  end
end
for step = 1, cfg.steps do
  local x, y = pt.randint(0, gpt.vocab, { 8, gpt.seq }), pt.randint(0, gpt.vocab, { 8, gpt.seq })
  if cfg.context > 1 then x, y = pt.cp.split(x, mesh:group("context")), pt.cp.split(y, mesh:group("context")) end
  local loss = model:train_step(x, y)
  opt:step(); opt:zero_grad()
  if pt.dist.rank() == 0 then print(("step %d loss %.4f"):format(step, loss:item())) end
end
-- --fail_first: the first attempt fails after its steps, so that --max-restarts runs a second.
if cfg.fail_first and pt.dist.restart_count() == 0 then error("the first attempt fails after its steps") end
