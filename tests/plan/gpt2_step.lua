-- A GPT-2 training step on random tokens, for checking plans against real runs.
--   partrain plan --world 4 tests/plan/gpt2_step.lua --tensor 2          (the plan)
--   partrain --nproc-per-node 4 tests/plan/gpt2_step.lua --tensor 2 --report DIR   (a real run)
-- A real run writes DIR/rank<N>.json: what pt.memory_report() says after the first step, and
-- the bytes the first forward left allocated (measured here, around the forward).
-- --zero-stage 1|2|3 shards the optimizer over zero groups of --zero data ranks (0: the whole data
-- group), 3 the parameters too (--prefetch units gathered ahead); --dtype bfloat16 builds the
-- model in bfloat16 (float32 masters). --context C splits each sequence over C context ranks
-- (--context-mode ring or all_to_all); a real run then also reports what the context group
-- moved during the first step. --model llama (--kv-heads) plans LLaMA instead of GPT-2.
-- With --pipeline P the model is cut into P stages and model:train_step runs the schedule
-- (--schedule, --microbatches); the activations a real run reports are then the peak of the
-- CPU allocator's count during the second step above what that step began with (parameters,
-- gradients, kept from the first step, and optimizer state are all allocated by then).
local pt = require "partrain"

local cfg = pt.args {
  vocab = 256, seq = 64, dim = 128, heads = 4, layers = 2,
  batch = 8,                 -- the global batch, in sequences
  tensor = 1,
  pipeline = 1,
  schedule = "1f1b",
  microbatches = 0,          -- 0: the pipeline size
  chunks = 1,
  sequence_parallel = false,
  zero_stage = 0,
  zero = 0,                  -- the zero group's size when --zero-stage is given (0: the data group)
  prefetch = 1,              -- ZeRO-3: units gathered ahead
  dtype = "float32",
  context = 1,
  context_mode = "ring",
  model = "gpt2",            -- or llama
  kv_heads = 0,              -- LLaMA's key/value heads (0: heads)
  steps = 1,
  report = "",               -- a folder for the real run's measurements
  threads = 1,
}
pt.set_threads(cfg.threads)
pt.manual_seed(1)
local mesh = pt.mesh { tensor = cfg.tensor, pipeline = cfg.pipeline, context = cfg.context,
                      zero = cfg.zero_stage > 0 and cfg.zero or nil }
local sizes = { vocab = cfg.vocab, seq = cfg.seq, dim = cfg.dim, heads = cfg.heads, layers = cfg.layers, dtype = cfg.dtype }
if cfg.model == "llama" then sizes.kv_heads = cfg.kv_heads end
local model = pt.models[cfg.model](sizes)
local pipelined = cfg.pipeline > 1
local options = { sequence_parallel = cfg.sequence_parallel }
if cfg.context > 1 then options.context = cfg.context_mode end
if cfg.zero_stage > 0 then options.zero = { stage = cfg.zero_stage } end
if cfg.zero_stage == 3 then options.zero.prefetch = cfg.prefetch end
if pipelined then
  options.schedule, options.chunks = cfg.schedule, cfg.chunks
  options.microbatches = cfg.microbatches > 0 and cfg.microbatches or cfg.pipeline
end
model = pt.parallelize(model, (pipelined or cfg.model ~= "gpt2") and "policies." .. cfg.model or nil, mesh, options)
local loss_of = not pipelined and pt.loss_fn(model)  -- a pipeline computes its loss in train_step
local opt = pt.optim.adamw(model, { lr = 1e-3, clip_grad_norm = 1.0 })
local local_batch = math.floor(cfg.batch / mesh:size("data"))
-- This rank's inputs and targets: its data slice's sequences (random here), and under context
-- parallelism its chunks of each (targets shifted before the split, as a loader does).
local context = mesh:group("context")
local function batch()
  local tokens = pt.randint(0, cfg.vocab, { local_batch, cfg.seq + 1 })
  local x, y = tokens:narrow(1, 0, cfg.seq):contiguous(), tokens:narrow(1, 1, cfg.seq):contiguous()
  if cfg.context > 1 then x, y = pt.cp.split(x, context), pt.cp.split(y, context) end
  return x, y
end
local moved  -- what the context group moved in the first step

local activations
for step = 1, pipelined and cfg.steps or 0 do
  local x, y = batch()
  local before = pt.memory().allocated
  pt.reset_peak_memory()
  model:train_step(x, y)
  if step == 2 then activations = pt.memory().allocated_peak - before end
  opt:step()  -- no zero_grad: the gradients stay allocated, so the second step adds only its own
end
for step = 1, pipelined and 0 or cfg.steps do
  local x, y = batch()
  if step == 1 then context:reset_traffic() end
  collectgarbage()  -- garbage freed during the forward (a replaced serial model) would count against it
  local before = pt.memory().allocated
  local loss = loss_of(model(x), y)
  activations = activations or pt.memory().allocated - before
  opt:zero_grad()
  loss:backward()
  if step == 1 then moved = context:traffic() end
  opt:step()
end

if cfg.report ~= "" then
  assert(activations, "--report needs --steps 2 or more with --pipeline")
  local r = pt.memory_report(model)
  local status = io.open("/proc/self/status")  -- the process's peak address space (Linux), for rlimits
  local vm_peak = status and tonumber(status:read("*a"):match("VmPeak:%s*(%d+)")) or 0
  if status then status:close() end
  local f = assert(io.open(("%s/rank%d.json"):format(cfg.report, pt.dist.rank()), "w"))
  f:write(('{"params": %d, "grads": %d, "optimizer": %d, "master": %d, "zero_stage": %d, "zero_group": %d, '
    .. '"activations": %d, "engine_activations": %d, "param_shard": %d, "peak_gathered": %d, "largest_unit": %d, '
    .. '"root_unit": %d, "vm_peak": %d, "context_send_recv": %d, "context_all_to_all": %d}\n'):format(r.params,
    r.grads, r.optimizer, r.master, r.zero_stage, r.zero_group, activations,
    pt.plan.first_step().activations or -1, r.param_shard, r.peak_gathered, r.largest_unit, r.root_unit,
    vm_peak * 1024, moved and moved.send_recv and moved.send_recv.bytes or 0,
    moved and moved.all_to_all and moved.all_to_all.bytes or 0))
  f:close()
end
