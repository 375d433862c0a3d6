-- Context parallelism against serial training, for bench/cp: a GPT-2 trained on sequences of
-- each length in --lengths, at context = the world size (ring and all_to_all) beside the same
-- model unsplit on rank 0 alone (the other ranks wait at a barrier, idle: one process trains, as
-- in a serial run), the three taking turns a round of steps each. Per length it prints:
--   1. activations: the most LibTorch's allocator held during a forward and backward above what
--      the step began with (parameters, gradients, optimizer state), the largest rank's, against
--      the serial model's and 1/c of it;
--   2. step time (forward, backward, AdamW; the slowest rank's) against the serial step on the
--      same tokens, medians;
--   3. attention alone, one layer's shapes: the bytes it keeps for backward (its output
--      included) and the most it holds through forward and backward, above its inputs, against
--      serial attention (LibTorch's CPU flash kernel) over the whole sequence.
-- The serial model attends with the fused kernel (flash_attention), which keeps O(T) bytes as
-- the ring does: against GPT-2's default (the T x T scores kept) the ratios would flatter.
--   partrain --nproc-per-node 2 --threads 1 bench/cp.lua [--lengths 256,512,1024,2048]
local pt = require "partrain"
local cfg = pt.args {
  lengths = "256,512,1024,2048",  -- sequence lengths, each a multiple of 2 * context
  dim = 128, heads = 4, layers = 4, vocab = 256,
  batch = 2,                       -- sequences a step (every variant steps the same tokens)
  steps = 2,                       -- steps a round, per variant
  rounds = 2,                      -- rounds; each variant's first step is warm-up, not timed
}
assert(cfg.rounds * cfg.steps >= 2, "bench/cp.lua: --rounds x --steps must be 2 or more (the first step is not timed)")
local rank, c = pt.dist.rank(), pt.dist.world_size()
local median = require("timing").median
local world = pt.dist.world()
local mesh = pt.mesh { context = c }
local group = mesh:group("context")
local function say(...) if rank == 0 then print(string.format(...)) end end

-- The largest of a number over the ranks.
local function most(x)
  local t = pt.tensor({ x }, { dtype = "float64" })
  world:all_reduce(t, "max")
  return t:item()
end

-- Runs fn on this rank, measuring the bytes it held at most above what it began with.
local function peak_of(fn)
  local before = pt.memory().allocated
  pt.reset_peak_memory()
  fn()
  return pt.memory().allocated_peak - before
end

local function ce(out, y) return pt.nn.cross_entropy(out:reshape(-1, cfg.vocab), y:reshape(-1)) end

local function run_length(T)
  local arch = { vocab = cfg.vocab, seq = T, dim = cfg.dim, heads = cfg.heads, layers = cfg.layers,
                 flash_attention = true }
  local variants = {}
  if rank == 0 then
    pt.manual_seed(1)
    local m = pt.models.gpt2(arch)
    variants[#variants + 1] = { name = "serial", model = m, opt = pt.optim.adamw(m, { lr = 1e-4 }) }
  else
    variants[#variants + 1] = { name = "serial" }
  end
  for _, mode in ipairs { "ring", "all_to_all" } do
    pt.manual_seed(1)
    local m = pt.parallelize(pt.models.gpt2(arch), "policies.gpt2", mesh, { context = mode })
    variants[#variants + 1] = { name = mode, model = m, opt = pt.optim.adamw(m, { lr = 1e-4 }), split = true }
  end
  for _, v in ipairs(variants) do v.times, v.bytes = {}, 0 end
  pt.manual_seed(2)
  local batches = {}
  for i = 1, cfg.steps do
    local tokens = pt.randint(0, cfg.vocab, { cfg.batch, T + 1 })
    world:broadcast(tokens, 0)
    local x, y = tokens:narrow(1, 0, T):contiguous(), tokens:narrow(1, 1, T):contiguous()
    batches[i] = { x = x, y = y, xs = pt.cp.split(x, group), ys = pt.cp.split(y, group) }
  end

  -- One step of variant v on batch b: returns its seconds (the slowest rank's) and the bytes it
  -- held above its start (this rank's). The serial model keeps its gradients between steps
  -- (zeroed in place), as the split models' buckets do, so that neither counts them.
  local function step(v, b)
    world:barrier()
    local t0, bytes = pt.time(), 0
    if v.split then
      bytes = peak_of(function() v.model:train_step(b.xs, b.ys) end)
      v.opt:step()
      v.opt:zero_grad()
    elseif v.model then
      bytes = peak_of(function() ce(v.model(b.x), b.y):backward() end)
      v.opt:step()
      for _, p in ipairs(v.model:parameters()) do
        if p.grad then p.grad:zero_() end
      end
    end
    local seconds = v.split and most(pt.time() - t0) or pt.time() - t0
    return seconds, bytes
  end

  for round = 1, cfg.rounds do
    for _, v in ipairs(variants) do
      for i = 1, cfg.steps do
        local seconds, bytes = step(v, batches[i])
        if round > 1 or i > 1 then
          v.times[#v.times + 1] = seconds
          v.bytes = math.max(v.bytes, bytes)
        end
      end
    end
  end
  local serial_ms = 1000 * median(variants[1].times)
  local serial_bytes = variants[1].bytes
  say("T=%d serial (1 rank) activations_mb=%.2f step_ms=%.1f", T, serial_bytes / 1e6, serial_ms)
  for i = 2, #variants do
    local v = variants[i]
    local bytes, ms = most(v.bytes), 1000 * median(v.times)
    say("T=%d %-10s context=%d activations_mb=%.2f act_vs_serial=%.3f ideal=%.3f act_vs_ideal=%.3f "
        .. "step_ms=%.1f step_vs_serial=%.3f", T, v.name, c, bytes / 1e6, bytes / serial_bytes, 1 / c,
        bytes * c / serial_bytes, ms, ms / serial_ms)
  end
end

-- Attention alone on one layer's shapes (batch, heads, T, head size). Its q, k, v are made inside
-- (from leaves, times 1), as a layer's projection makes them, so that they count where attention
-- keeps them: "kept" is what its forward leaves for backward (q, k, v or their rearranged copies,
-- its output, the log-sum-exp), "peak" the most held through forward and backward, both above
-- the leaves and the output's gradient.
local function attention_alone(T)
  local d = cfg.dim / cfg.heads
  pt.manual_seed(3)
  local shape = { cfg.batch, cfg.heads, T, d }
  local q, k, v, g = pt.randn(shape), pt.randn(shape), pt.randn(shape), pt.randn(shape)
  local function measure(attend, a, b, e, grad, split)
    a, b, e = a:detach():requires_grad_(), b:detach():requires_grad_(), e:detach():requires_grad_()
    collectgarbage()
    local kept
    local peak = peak_of(function()
      local before = pt.memory().allocated
      local out = attend(a * 1, b * 1, e * 1)
      -- The copies of q, k, v go unless attention keeps them; a barrier lets a finished
      -- exchange's work (on Gloo's threads) let go of its buffers first.
      if split then group:barrier() end
      collectgarbage()
      kept = pt.memory().allocated - before
      out:backward(grad)
    end)
    return kept, peak
  end
  local serial_kept, serial_peak = 0, 0
  if rank == 0 then
    serial_kept, serial_peak = measure(function(a, b, e)
      return pt.nn.scaled_dot_product_attention(a, b, e, { causal = true })
    end, q, k, v, g)
  end
  world:barrier()
  local function mine(t) return pt.cp.split(t, group, 2):contiguous() end
  for _, mode in ipairs { "ring", "all_to_all" } do
    local kept, peak = measure(function(a, b, e) return pt.cp.attention(a, b, e, { group = group, mode = mode }) end,
                               mine(q), mine(k), mine(v), mine(g), true)
    kept, peak = most(kept), most(peak)
    say("T=%d attention %-10s context=%d kept_mb=%.3f kept_vs_serial=%.3f kept_vs_ideal=%.3f | "
        .. "peak_mb=%.3f peak_vs_serial=%.3f peak_vs_ideal=%.3f", T, mode, c, kept / 1e6, kept / serial_kept,
        kept * c / serial_kept, peak / 1e6, peak / serial_peak, peak * c / serial_peak)
  end
  say("T=%d attention serial     context=1 kept_mb=%.3f peak_mb=%.3f", T, serial_kept / 1e6, serial_peak / 1e6)
end

say("== context %d: GPT-2 width %d, %d layers, %d heads, batch %d; %d round(s) of %d step(s); 1 thread a rank",
    c, cfg.dim, cfg.layers, cfg.heads, cfg.batch, cfg.rounds, cfg.steps)
for length in cfg.lengths:gmatch("%d+") do
  local T = tonumber(length)
  run_length(T)
  attention_alone(T)
  collectgarbage()
end
