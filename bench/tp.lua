-- Tensor parallelism for GPT-2, for bench/tp. Run under the launcher with world = tensor size:
--   partrain --nproc-per-node 2 --threads 1 bench/tp.lua [--sequence-parallel]
-- It prints, per rank 0:
--   1. parameter bytes a rank against the serial model, for GPT-2 small (124 M parameters,
--      vocabulary 50257): the split part should be 1/t of its serial size (padding aside);
--   2. step time (forward, backward, AdamW) of a byte-level GPT-2 split t ways against the same
--      serial model stepped in the same process, steps interleaved, medians;
--   3. the bytes the tensor group's collectives moved in one step against the count worked out
--      from the model's sizes (see analytic() below).
local pt = require "partrain"
local cfg = pt.args {
  steps = 10, warmup = 3, batch = 8, seq = 128, dim = 256, heads = 8, layers = 4,
  sequence_parallel = false, sequence_overlap = false, size_check = true,
}
local t = pt.dist.world_size()
local mesh = pt.mesh { tensor = t }
local opts = { sequence_parallel = cfg.sequence_parallel, sequence_overlap = cfg.sequence_overlap }
local rank0 = pt.dist.rank() == 0
local function say(...) if rank0 then print(string.format(...)) end end

local function bytes_of(model)
  local whole, split, logical_split = 0, 0, 0
  for name, p in model:named_parameters() do
    local b = p:numel() * p:element_size()
    local s = pt.tp.sharding(model, name)
    if s then
      split = split + b
      local n = 1
      for _, d in ipairs(s.shape) do n = n * d end
      logical_split = logical_split + n * p:element_size()
    else
      whole = whole + b
    end
  end
  return whole, split, logical_split
end

-- 1. Parameter bytes, GPT-2 small.
if cfg.size_check then
  local small = { vocab = 50257, seq = 1024, dim = 768, heads = 12, layers = 12 }
  local serial_bytes = select(1, bytes_of(pt.models.gpt2(small)))
  local model = pt.parallelize(pt.models.gpt2(small), nil, mesh, opts)
  -- model:parameters() lists the tied wte/lm_head weight once.
  local whole, split, logical = bytes_of(model)
  say("== parameter bytes a rank, GPT-2 small (%.1f M parameters), tensor %d", serial_bytes / 4 / 1e6, t)
  say("serial %.1f MB | a rank %.1f MB (%.3f of serial): split %.1f MB, whole %.2f MB", serial_bytes / 1e6,
      (whole + split) / 1e6, (whole + split) / serial_bytes, split / 1e6, whole / 1e6)
  say("split part: %.1f MB a rank against 1/t of its serial %.1f MB = %.1f MB: ratio %.4f (goal within 5%%)",
      split / 1e6, logical / 1e6, logical / t / 1e6, split / (logical / t))
  model, serial_bytes = nil, nil
  collectgarbage()
end

-- 2 and 3. Step time and traffic, byte-level GPT-2.
local arch = { vocab = 256, seq = cfg.seq, dim = cfg.dim, heads = cfg.heads, layers = cfg.layers }
pt.manual_seed(1)
local serial = pt.models.gpt2(arch)
pt.manual_seed(1)
local model = pt.parallelize(pt.models.gpt2(arch), nil, mesh, opts)
local loss_of = pt.loss_fn(model)
local so = pt.optim.adamw(serial, { lr = 1e-4, clip_grad_norm = 1.0 })
local po = pt.optim.adamw(model, { lr = 1e-4, clip_grad_norm = 1.0 })
local data = pt.data.text { path = "data/kjv.txt", seq = cfg.seq, batch = cfg.batch, seed = 1 }

local function step(m, opt, loss_fn, x, y)
  local loss = loss_fn(m(x), y)
  opt:zero_grad()
  loss:backward()
  opt:step()
end

-- Bytes a step moves over the tensor group, by operation, counted as the group's traffic
-- counts them (the whole message: an all-reduce's tensor, an all-gather's output, a
-- reduce-scatter's input). A = one activation (B, T, D) in fp32.
local function analytic()
  local B, T, D, L, f = cfg.batch, cfg.seq, cfg.dim, cfg.layers, 4
  local A = B * T * D * f
  local ce = 3 * B * T * f       -- vocab-parallel cross-entropy: max, target logit, sum of exp
  local clip = 8                 -- the split parameters' squared gradient norm (float64)
  if not cfg.sequence_parallel then
    -- Embedding forward; per block two forward and two backward all-reduces; the head's input
    -- gradient.
    return { all_reduce = (4 * L + 2) * A + ce + clip }
  end
  -- Per block: all-gather before c_attn and c_fc (forward) and after c_proj x2 (backward),
  -- reduce-scatter the transposes; LayerNorm weights and biases and row biases: partial
  -- gradients summed. The head gathers the sequence; the split after the embeddings gathers
  -- in backward.
  return {
    all_gather = (4 * L + 2) * A,
    reduce_scatter = (4 * L + 1) * A,
    all_reduce = A + (6 * L + 2) * D * f + ce + clip,
  }
end

for _ = 1, cfg.warmup do
  local x, y = data:next()
  step(serial, so, pt.nn.cross_entropy, x, y)
  step(model, po, loss_of, x, y)
end
local group = mesh:group("tensor")
local serial_times, parallel_times = {}, {}
for i = 1, cfg.steps do
  local x, y = data:next()
  local t0 = pt.time()
  step(serial, so, pt.nn.cross_entropy, x, y)
  serial_times[i] = pt.time() - t0
  pt.dist.barrier()
  if i == 1 then group:reset_traffic() end
  t0 = pt.time()
  step(model, po, loss_of, x, y)
  parallel_times[i] = pt.time() - t0
  if i == 1 then
    local traffic, want = group:traffic(), analytic()
    say("== traffic in one step over the tensor group, tensor %d%s", t, cfg.sequence_parallel and ", sequence parallel" or "")
    local ops = {}
    for op in pairs(traffic) do ops[#ops + 1] = op end
    for op in pairs(want) do if not traffic[op] then ops[#ops + 1] = op end end
    table.sort(ops)
    for _, op in ipairs(ops) do
      local got = traffic[op] or { calls = 0, bytes = 0 }
      say("%-15s %3d calls %10.3f MB   analytic %10.3f MB   measured/analytic %.4f", op, got.calls, got.bytes / 1e6,
          (want[op] or 0) / 1e6, got.bytes / (want[op] or 0))
    end
  end
  pt.dist.barrier()
end
local median = require("timing").median
local s, p = median(serial_times), median(parallel_times)
say("== step time, GPT-2 %d layers x %d, batch %d x %d tokens, %d thread(s) a rank, %d steps",
    cfg.layers, cfg.dim, cfg.batch, cfg.seq, pt.get_threads(), cfg.steps)
say("serial %.1f ms | tensor %d%s %.1f ms | parallel/serial %.3f (ideal 1/t = %.3f)", s * 1e3, t,
    cfg.sequence_parallel and (cfg.sequence_overlap and " SP+overlap" or " SP") or "", p * 1e3, p / s, 1 / t)
