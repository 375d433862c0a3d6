-- Trains a byte-level GPT-2 (or, with --model llama, a LLaMA) on the King James Bible and prints a
-- sample of what it learned. Split over --tensor ranks or cut into --pipeline stages by the model's
-- policy (policies/gpt2.lua, policies/llama.lua), each sequence split over --context ranks,
-- data-parallel over the rest.
--   partrain examples/gpt/train.lua [--steps 200] [--dim 128] [--layers 4] ...
--   partrain --nproc-per-node 4 examples/gpt/train.lua --tensor 2      (tensor 2 x data 2)
--   partrain --nproc-per-node 2 examples/gpt/train.lua --tensor 2 --sequence-parallel
--   partrain --nproc-per-node 2 examples/gpt/train.lua --pipeline 2 --microbatches 4 --schedule 1f1b
--   partrain --nproc-per-node 2 --trace trace.json examples/gpt/train.lua --pipeline 2 --schedule interleaved --chunks 2
--   partrain examples/gpt/train.lua --ckpt ckpt/ --save-every 50   (resumes from ckpt/ when it has one)
--   partrain examples/gpt/train.lua --dtype bfloat16               (float32 master weights in the optimizer)
--   partrain --nproc-per-node 4 examples/gpt/train.lua --pipeline 2 --zero-stage 2   (ZeRO-2 x pipeline 2)
--   partrain --nproc-per-node 4 examples/gpt/train.lua --zero-stage 3   (ZeRO-3: parameters sharded, a block gathered at a time)
--   partrain --nproc-per-node 2 examples/gpt/train.lua --context 2      (each sequence split over 2 ranks: ring attention)
--   partrain --nproc-per-node 4 examples/gpt/train.lua --context 2 --context-mode all_to_all --zero-stage 2
--   partrain --nproc-per-node 2 examples/llama/train.lua --experts 8 --expert 2   (a mixture of experts, split)
--   partrain examples/gpt/train.lua --recompute block                 (activation checkpointing: a block's input kept)
local pt = require "partrain"

local cfg = pt.args {
  model = { LM_DEFAULT_MODEL or "gpt2", "gpt2 or llama (examples/llama/train.lua makes llama the default)" },
  steps = { 200, "steps to train" },
  batch = { 16, "the global batch, in sequences" },
  seq = { 64, "tokens (bytes) a sequence" },
  dim = { 128, "model width" },
  heads = { 4, "attention heads" },
  layers = { 4, "transformer blocks" },
  vocab = { 256, "vocabulary size (the data are bytes: 256; a larger one, such as GPT-2's 50257, plans or "
                 .. "measures a real model's head with the bytes as its first 256 tokens)" },
  kv_heads = { 0, "llama: key/value heads (grouped-query attention; 0: as many as heads)" },
  hidden = { 0, "llama: the MLP's hidden width (0: 8/3 x dim, rounded up to a multiple of 32; LLaMA-3 8B: 14336)" },
  experts = { 0, "llama: a mixture of this many experts in every block (Mixtral; 0: a dense MLP)" },
  top_k = { 2, "with --experts: experts a token goes to" },
  expert = { 1, "with --experts: expert-parallel size, data ranks that split the experts between them "
                .. "(docs/parallel.md#expert-parallelism)" },
  dropout = pt.args.number(0, "dropout (gpt2)"),
  attn_dropout = pt.args.number(-1, "gpt2: dropout on the attention probabilities alone (-1: --dropout's; "
                                    .. "must be 0 with --context above 1)"),
  lr = pt.args.number(3e-3, "peak learning rate (cosine schedule after the warmup)"),
  warmup = { 20, "warmup steps" },
  seed = { 1, "seed of the weights, the data order and the sample" },
  log_every = { 10, "a log line (and metrics record) every this many steps" },
  sample = { 200, "bytes to generate at the end (0: none)" },
  prompt = { "And God said", "the sample's prompt" },
  corpus = { "", "the text to train on (default: data/kjv.txt of this checkout, made by scripts/setup)" },
  threads = { 0, "intra-op threads (0: LibTorch's default)" },
  tensor = { 1, "tensor-parallel size (data = ranks / tensor / context / pipeline)" },
  context = { 1, "context-parallel size: ranks that split each sequence between them (--seq a multiple of "
                 .. "2 x context; docs/parallel.md#context-parallelism)" },
  context_mode = { "ring", "with --context: ring (any heads) or all_to_all (heads / tensor must divide by context)" },
  sequence_parallel = { false, "keep activations split along the sequence between TP regions" },
  pipeline = { 1, "pipeline stages (ranks); each runs its blocks through model:train_step" },
  microbatches = { 0, "with --pipeline: micro-batches a batch is split into (0: the pipeline size)" },
  schedule = { "1f1b", "with --pipeline: gpipe, 1f1b or interleaved (docs/pipeline.md)" },
  chunks = { 1, "with --pipeline: model chunks a rank (interleaved)" },
  recompute = { "none", "block: keep only each block's input in forward and replay the block in backward (activation "
                .. "checkpointing); none" },
  ckpt = { "", "checkpoint folder: resume from its newest checkpoint, save into it" },
  save_every = { 0, "with --ckpt: save every this many steps (and at the end)" },
  dtype = { "float32", "parameters and compute: float32, or bfloat16 or float16 (float32 masters kept by the "
            .. "optimizer; float16 with loss scaling); bf16 and fp16 name them too" },
  zero_stage = { 0, "ZeRO: 1 shards optimizer state and master weights over the data ranks, 2 also "
                 .. "reduce-scatters the gradients, 3 also shards the parameters, a block gathered at a time "
                 .. "(docs/parallel.md)" },
  zero_groups = { 0, "with --zero-stage: split the data ranks into this many zero groups (0: one)" },
  metrics = { "", "append metrics (JSON lines: docs/observability.md) to this file (or partrain --metrics FILE)" },
  peak_tflops = pt.args.number(0, "one device's peak TFLOP/s, for MFU (0: NVIDIA's table on CUDA, none on the CPU)"),
  progress = { true, "the live progress line on a terminal (--no-progress: none)" },
}
if cfg.threads > 0 then pt.set_threads(cfg.threads) end
if cfg.corpus == "" then cfg.corpus = (arg[0]:match("^(.*)/") or ".") .. "/../../data/kjv.txt" end
pt.manual_seed(cfg.seed)
if cfg.metrics ~= "" then pt.metrics(cfg.metrics) end

-- Context parallelism's flags: each rank holds 2 of the 2 x context equal chunks of every sequence.
if cfg.context < 1 or cfg.context % 1 ~= 0 then error(("--context %s: expected a whole number of ranks, 1 or more"):format(cfg.context)) end
if cfg.context_mode ~= "ring" and cfg.context_mode ~= "all_to_all" then
  error(("--context-mode %s: expected ring or all_to_all"):format(cfg.context_mode))
end
if cfg.context_mode ~= "ring" and cfg.context == 1 then
  error(("--context-mode %s needs --context 2 or more"):format(cfg.context_mode))
end
if cfg.seq % (2 * cfg.context) ~= 0 then
  error(("--seq %d with --context %d: each sequence is cut into 2 x context = %d equal chunks (one early and one late "
    .. "a rank), so --seq must be a multiple of %d"):format(cfg.seq, cfg.context, 2 * cfg.context, 2 * cfg.context))
end
local attn_dropout = cfg.attn_dropout < 0 and cfg.dropout or cfg.attn_dropout
if cfg.context > 1 and cfg.model == "gpt2" and attn_dropout ~= 0 then
  error(("--dropout %g with --context %d: dropout on the attention probabilities cannot be split over context ranks "
    .. "(its mask spans the whole sequence); add --attn-dropout 0 (dropout stays on the embeddings and residual "
    .. "branches)"):format(cfg.dropout, cfg.context))
end

-- ZeRO's flags, checked before any group is made. Its groups are parts of the data x context
-- ranks, which hold the same parameters.
local data_size = pt.dist.world_size() / (cfg.tensor * cfg.pipeline)
if cfg.zero_stage ~= 0 and cfg.zero_stage ~= 1 and cfg.zero_stage ~= 2 and cfg.zero_stage ~= 3 then
  error(("--zero-stage %s: expected 0 (off), 1, 2 or 3"):format(cfg.zero_stage))
end
if cfg.zero_groups < 0 or cfg.zero_groups % 1 ~= 0 then
  error(("--zero-groups %s: expected a whole number of groups, 0 or more"):format(cfg.zero_groups))
end
if cfg.zero_groups > 0 and cfg.zero_stage == 0 then
  error(("--zero-groups %d needs --zero-stage 1, 2 or 3"):format(cfg.zero_groups))
end
local zero  -- the zero group's size, as pt.mesh takes it (0: the whole data group)
if cfg.zero_stage > 0 then
  local groups = math.max(cfg.zero_groups, 1)
  if data_size % 1 ~= 0 or data_size % groups ~= 0 or data_size / groups < 2 then
    error(("--zero-stage %d --zero-groups %d: the %s data rank(s) (world %d / tensor %d / pipeline %d) must split "
      .. "into %d group(s) of 2 or more ranks"):format(cfg.zero_stage, cfg.zero_groups, data_size,
      pt.dist.world_size(), cfg.tensor, cfg.pipeline, groups))
  end
  zero = groups == 1 and 0 or data_size / groups
end
if cfg.experts > 0 and cfg.model ~= "llama" then error("--experts: a mixture of experts is LLaMA's (--model llama)") end
if cfg.expert ~= 1 and cfg.experts == 0 then error(("--expert %s needs --experts E to split"):format(cfg.expert)) end
local mesh = pt.mesh { tensor = cfg.tensor, context = cfg.context, pipeline = cfg.pipeline, zero = zero,
                       expert = cfg.expert }
-- Built deferred (on the meta device): pt.parallelize then allocates only what this rank holds
-- (its stages, its shards), with the weights the whole model would have.
if cfg.model ~= "gpt2" and cfg.model ~= "llama" then error(("--model %s: expected gpt2 or llama"):format(cfg.model)) end
if cfg.model == "gpt2" and cfg.kv_heads ~= 0 then error("--kv-heads is LLaMA's (--model llama)") end
if cfg.model == "gpt2" and cfg.hidden ~= 0 then error("--hidden is LLaMA's (--model llama); GPT-2's MLP is 4 x dim") end
if cfg.model == "llama" and (cfg.dropout ~= 0 or cfg.attn_dropout >= 0) then error("--dropout, --attn-dropout: LLaMA has no dropout") end
if cfg.vocab < 256 then error(("--vocab %d: the data are bytes, 256 symbols; give at least 256"):format(cfg.vocab)) end
local model = pt.deferred(function()
  if cfg.model == "llama" then
    return pt.models.llama { vocab = cfg.vocab, seq = cfg.seq, dim = cfg.dim, heads = cfg.heads, kv_heads = cfg.kv_heads,
                             hidden = cfg.hidden,
                             layers = cfg.layers, dtype = cfg.dtype, experts = cfg.experts, top_k = cfg.top_k }
  end
  return pt.models.gpt2 { vocab = cfg.vocab, seq = cfg.seq, dim = cfg.dim, heads = cfg.heads,
                          layers = cfg.layers, dropout = cfg.dropout, attn_dropout = attn_dropout, dtype = cfg.dtype }
end)
-- The whole model's training FLOPs a token (6·N + attention), counted before it is split.
local flops_per_token = pt.flops_per_token(model, cfg.seq)
local pipelined = cfg.pipeline > 1
if cfg.recompute ~= "none" and cfg.recompute ~= "block" then
  error(("--recompute %s: expected none or block"):format(cfg.recompute))
end
local options = { sequence_parallel = cfg.sequence_parallel, context = cfg.context > 1 and cfg.context_mode or nil,
                  recompute = cfg.recompute }
if cfg.zero_stage > 0 then options.zero = { stage = cfg.zero_stage } end
if pipelined then
  options.schedule, options.chunks = cfg.schedule, cfg.chunks
  options.microbatches = cfg.microbatches > 0 and cfg.microbatches or cfg.pipeline
end
model = pt.parallelize(model, pipelined and "policies." .. cfg.model or nil, mesh, options)  -- the family's policy when split
local loss_of = pt.loss_fn(model)          -- from vocabulary-split logits when they are split
-- Over the mesh: each rank reads its data slice of every global batch, and its two chunks of each
-- sequence of it (targets shifted before the split).
local data = pt.data.text { path = cfg.corpus, seq = cfg.seq, batch = cfg.batch, seed = cfg.seed, mesh = mesh }
local opt = pt.optim.adamw(model, { lr = cfg.lr, weight_decay = 0.1, betas = { 0.9, 0.95 }, clip_grad_norm = 1.0,
  schedule = { kind = "cosine", warmup = math.min(cfg.warmup, cfg.steps - 1), total = cfg.steps, min_lr = cfg.lr / 10 },
  -- float16's small gradients need loss scaling: read from the model, whichever name --dtype gave
  loss_scale = model:parameters()[1]:type() == "float16" and "dynamic" or nil })
local sharded = opt:zero()  -- nil without ZeRO
print(("%s: %d layers of width %d, %d parameters a rank; %s; pipeline %d x tensor %d x data %d%s%s"):format(
  cfg.model, cfg.layers, cfg.dim, model:num_parameters(), tostring(data), mesh:size("pipeline"), mesh:size("tensor"),
  mesh:size("data"), (cfg.context > 1 and (" x context %d (%s)"):format(cfg.context, cfg.context_mode) or "")
  .. (cfg.experts > 0 and ("; %d experts, top-%d, split over expert %d"):format(cfg.experts, cfg.top_k, cfg.expert) or ""),
  sharded and ("; ZeRO-%d over %d ranks (%.2f MB of master weights a rank)"):format(sharded.stage,
  sharded.group, sharded.master_bytes / 1e6) or ""))

-- Resuming: from the newest checkpoint in --ckpt, whatever mesh saved it.
local first = 1
if cfg.ckpt ~= "" then
  local resumed = pt.ckpt.resume(cfg.ckpt, { model = model, optim = opt, data = data })
  if resumed then
    first = resumed.step + 1
    if pt.dist.rank() == 0 then print(("resumed from %s/%s at step %d"):format(cfg.ckpt, resumed.tag, resumed.step)) end
  end
end

local progress = pt.progress { total = cfg.steps, tokens = cfg.batch * cfg.seq, flops_per_token = flops_per_token,
                               peak_tflops = cfg.peak_tflops, every = cfg.log_every, enabled = cfg.progress,
                               model = model }   -- its state a rank goes in the metrics file's memory records
local start = pt.time()
for step = first, cfg.steps do
  local x, y = data:next()
  local loss
  opt:zero_grad()
  if pipelined then
    loss = model:train_step(x, y)          -- the schedule's forwards and backwards; the global batch's loss
  else
    -- This rank's mean over its targets. Under --context every rank's chunks hold as many targets
    -- (the corpus has no padding), so the gradient sync's mean over data x context is the global
    -- batch's mean; with padding spread unevenly, model:train_step weighs it right.
    loss = loss_of(model(x), y)
    opt:scale_loss(loss):backward()        -- loss x the loss scale (float16); the loss itself otherwise
  end
  opt:step()
  local global = loss:detach()              -- the global batch's loss, for the progress line and the log
  if not pipelined then
    global = global:clone()
    mesh:group("data_context"):all_reduce(global, "mean")  -- every data and context rank's part
  end
  -- The tensor itself: progress reads it only when it prints or logs (no host sync every step on a GPU).
  progress:step(step, { loss = global, lr = opt:lr(), seconds = pt.time() - start })
  if cfg.ckpt ~= "" and cfg.save_every > 0 and (step % cfg.save_every == 0 or step == cfg.steps) then
    pt.ckpt.save(cfg.ckpt, { model = model, optim = opt, data = data, step = step })
  end
end

progress:finish()

-- Sampling: feed the prompt, then draw each next byte from the softmax of the last position.
-- Every rank takes part (a split model needs its whole tensor group); the same seed makes them
-- draw the same bytes, and rank 0 prints them.
if cfg.sample > 0 and pipelined then
  if pt.dist.rank() == 0 then print("sample: none (a pipelined model runs only through train_step)") end
elseif cfg.sample > 0 then
  model:eval()
  pt.manual_seed(cfg.seed)
  local tokens = pt.data.encode(cfg.prompt):view(1, -1)
  -- Under sequence parallelism the sequence splits over the tensor ranks, and under context
  -- parallelism into 2 x context chunks over the context ranks: the context is padded on the right
  -- to a multiple of them (causal attention: the padding changes no earlier position) and the
  -- logits read at its last real position, on the context rank that holds it.
  local c, group = mesh:size("context"), mesh:group("context")
  local split = (cfg.sequence_parallel and cfg.tensor or 1) * (c > 1 and 2 * c or 1)
  local room = cfg.seq - cfg.seq % split
  pt.no_grad(function()
    for _ = 1, cfg.sample do
      local n = math.min(tokens:size(1), room)
      local context = tokens:narrow(1, tokens:size(1) - n, n)
      local padded = math.ceil(n / split) * split
      if padded > n then context = pt.cat({ context, pt.zeros({ 1, padded - n }, { dtype = "int64" }) }, 1) end
      -- Position n - 1 is in chunk k of 2c; rank k holds chunks k and 2c-1-k, in that order.
      local row, owner = n - 1, 0
      if c > 1 then
        local chunk = padded / (2 * c)
        local k = math.floor((n - 1) / chunk)
        owner = k < c and k or 2 * c - 1 - k
        row = (k < c and 0 or chunk) + (n - 1) % chunk
        context = pt.cp.split(context, group)  -- (1, padded / context): this rank's chunks
      end
      local logits = model(context):select(1, row):float()  -- (1, 256 / tensor) at the last real position
      logits = pt.tp.gather_from(logits, mesh:group("tensor")):narrow(-1, 0, 256)  -- the whole vocabulary: bytes
      if c > 1 then logits = group:all_gather(logits:contiguous())[owner + 1] end  -- the owner's row, on every rank
      local next_byte = (logits / 0.8):softmax(-1):multinomial(1)
      tokens = pt.cat({ tokens, next_byte }, 1)
    end
  end)
  if pt.dist.rank() == 0 then print("sample: " .. pt.data.decode(tokens)) end
end
