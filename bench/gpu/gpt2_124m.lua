-- GPT-2 124M training throughput on one device (bench/gpu/run puts it beside its PyTorch twin,
-- gpt2_124m_torch.py): bfloat16 parameters with float32 master weights, AdamW (fused where
-- LibTorch has it), fused attention where LibTorch has it, synthetic token ids; prints ms/step,
-- tokens/s and MFU over the steps after the warm-up ones.
--   partrain [--device cuda:0] bench/gpu/gpt2_124m.lua [--batch 16] [--steps 30] [--warmup 5]
--   partrain --device cpu bench/gpu/gpt2_124m.lua --tiny       (a smoke run on the CPU)
-- MFU = tokens/s x FLOPs per token / peak, FLOPs per token = 6 N + 12 L dim seq (N: every
-- parameter, the tied embedding once; the PaLM paper's estimate, appendix B). The peak is
-- --peak-tflops, else looked up from the device's name (bench/gpu/peaks.lua).
package.path = "bench/gpu/?.lua;" .. package.path
local pt = require "partrain"
local peaks = require "peaks"
local cfg = pt.args {
  vocab = 50304, seq = 1024, layers = 12, dim = 768, heads = 12, batch = 8,
  steps = 30, warmup = 5, dtype = "bfloat16", lr = 6e-4,
  fused = "auto",                        -- AdamW's fused kernel: auto, true or false
  peak_tflops = pt.args.number(0),       -- the device's dense peak in TFLOP/s; 0: look it up
  tiny = false,                          -- vocab 512, seq 64, 2 layers of 64, batch 2, 4 + 2 steps
  seed = 1,
}
if cfg.tiny then
  cfg.vocab, cfg.seq, cfg.layers, cfg.dim, cfg.heads, cfg.batch, cfg.steps, cfg.warmup = 512, 64, 2, 64, 4, 2, 4, 2
end
local device = pt.device()
local on_cuda = device:find("^cuda") ~= nil
local fused = cfg.fused == "true" and true or cfg.fused == "false" and false or cfg.fused

pt.manual_seed(cfg.seed)
local model = pt.models.gpt2 { vocab = cfg.vocab, seq = cfg.seq, dim = cfg.dim, heads = cfg.heads,
                               layers = cfg.layers, dtype = cfg.dtype, flash_attention = true }
local opt = pt.optim.adamw(model, { lr = cfg.lr, weight_decay = 0.1, betas = { 0.9, 0.95 }, fused = fused })
local n = model:num_parameters()
-- A few batches made up front on the device: the step, not the data, is measured.
local batches = {}
for i = 1, 4 do
  local ids = pt.randint(0, cfg.vocab, { cfg.batch, cfg.seq + 1 }, { device = device })
  batches[i] = { ids:narrow(1, 0, cfg.seq):contiguous(), ids:narrow(1, 1, cfg.seq):contiguous() }
end
local function sync() if on_cuda then pt.cuda.synchronize() end end

local function step(i)
  local x, y = batches[(i - 1) % #batches + 1][1], batches[(i - 1) % #batches + 1][2]
  opt:zero_grad()
  local loss = pt.nn.cross_entropy(model(x), y)
  loss:backward()
  opt:step()
  return loss
end

for i = 1, cfg.warmup do step(i) end
sync()
if on_cuda then pt.cuda.reset_peak_memory_stats() end
local t0 = pt.time()
local loss
for i = 1, cfg.steps do loss = step(cfg.warmup + i) end
local last = loss:item()   -- the one host synchronization: the loss asked for
sync()
local seconds = pt.time() - t0

local tokens = cfg.batch * cfg.seq * cfg.steps
local flops_per_token = 6 * n + 12 * cfg.layers * cfg.dim * cfg.seq
local name = on_cuda and pt.cuda.device_name() or "cpu"
local peak = cfg.peak_tflops > 0 and cfg.peak_tflops or peaks.lookup(name)
local tokens_per_s = tokens / seconds
local mfu = peak and tokens_per_s * flops_per_token / (peak * 1e12) or nil
local memory = on_cuda and pt.cuda.memory_stats().peak_allocated or pt.memory().allocated_peak
print(("gpt2_124m partrain ms_per_step=%.3f tokens_per_s=%.1f mfu=%s loss=%.4f params=%d batch=%d seq=%d " ..
       "dtype=%s fused_adamw=%s device=%s peak_tflops=%s peak_bytes=%d"):format(
  1000 * seconds / cfg.steps, tokens_per_s, mfu and ("%.4f"):format(mfu) or "n/a", last, n, cfg.batch, cfg.seq,
  cfg.dtype, tostring(opt:fused()), name:gsub(" ", "_"), peak and tostring(peak) or "n/a", memory))
