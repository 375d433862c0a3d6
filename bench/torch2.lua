-- What LibTorch 2.11 gives against what partrain did without it, side by side in one run on one
-- rank: AdamW's step through the fused kernel (_fused_adamw_, CPU) against the unfused update
-- (LibTorch's torch::optim::AdamW, a loop over the tensors), and causal attention through
-- scaled_dot_product_attention's fused kernel against the same math in steps, forward and
-- backward. Interleaved, alternating which goes first; medians and ratios; the largest
-- difference between the two sides' results. bench/torch2 runs it.
package.path = "bench/?.lua;" .. package.path
local pt = require "partrain"
local median = require("timing").median
local cfg = pt.args { reps = 30, warmup = 5, dim = 256, layers = 4, heads = 4, seq = 256, batch = 8, vocab = 256,
                      dtype = "float32" }
local gpt = { vocab = cfg.vocab, seq = cfg.seq, dim = cfg.dim, heads = cfg.heads, layers = cfg.layers,
              dtype = cfg.dtype }

local function interleaved(a, b)  -- median seconds of a and of b, called in turns
  local ta, tb = {}, {}
  for i = 1, cfg.warmup + cfg.reps do
    local first, second = a, b
    if i % 2 == 0 then first, second = b, a end
    local t0 = pt.time(); first(); local t1 = pt.time(); second(); local t2 = pt.time()
    if i > cfg.warmup then
      if first == a then ta[#ta + 1], tb[#tb + 1] = t1 - t0, t2 - t1 else tb[#tb + 1], ta[#ta + 1] = t1 - t0, t2 - t1 end
    end
  end
  return median(ta), median(tb)
end

-- 1. AdamW: two copies of one model with the same gradients, one step each in turns.
local function model_with_grads()
  pt.manual_seed(1)
  local m = pt.models.gpt2(gpt)
  pt.manual_seed(2)
  for _, p in ipairs(m:parameters()) do p.grad = pt.randn_like(p) * 1e-3 end
  return m
end
local fm, um = model_with_grads(), model_with_grads()
local fused = pt.optim.adamw(fm, { lr = 1e-4, weight_decay = 0.1, fused = true })
local unfused = pt.optim.adamw(um, { lr = 1e-4, weight_decay = 0.1, fused = false })
local nparams = 0
for _, p in ipairs(fm:parameters()) do nparams = nparams + p:numel() end
local tf, tu = interleaved(function() fused:step() end, function() unfused:step() end)
local diff = 0
for i, p in ipairs(fm:parameters()) do diff = math.max(diff, (p - um:parameters()[i]):abs():max():item()) end
print(("adamw %s: %d tensors, %.2f M parameters; fused %.3f ms, unfused %.3f ms, fused/unfused %.3f; "
  .. "largest difference after %d steps each %.3g"):format(cfg.dtype, #fm:parameters(), nparams / 1e6, tf * 1e3, tu * 1e3,
  tf / tu, cfg.warmup + cfg.reps, diff))

-- 2. Attention: causal attention over GPT-2's shapes (batch, heads, seq, head size), forward and
-- backward, as pt.nn.scaled_dot_product_attention runs it: LibTorch's fused kernel where the
-- call is plainly causal, the same math in steps (scores, mask, softmax, product) when a mask is
-- given, here the causal one itself.
local hd = math.floor(cfg.dim / cfg.heads)
pt.manual_seed(3)
local shape = { cfg.batch, cfg.heads, cfg.seq, hd }
local q, k, v = pt.randn(shape, { dtype = cfg.dtype }), pt.randn(shape, { dtype = cfg.dtype }),
                pt.randn(shape, { dtype = cfg.dtype })
local causal = pt.ones({ cfg.seq, cfg.seq }, { dtype = "bool" }):tril()
local function attention(opts)
  return function()
    local qq, kk, vv = q:detach():requires_grad_(), k:detach():requires_grad_(), v:detach():requires_grad_()
    local y = pt.nn.scaled_dot_product_attention(qq, kk, vv, opts)
    y:sum():backward()
    return y, qq.grad
  end
end
local fused, steps = attention { causal = true }, attention { mask = causal }
local ts, tm = interleaved(fused, steps)
local yf, gf = fused()
local ys, gs = steps()
local out_diff = math.max((yf - ys):abs():max():item(), (gf - gs):abs():max():item())
print(("attention %s: (%d, %d, %d, %d), forward+backward fused %.3f ms, in steps %.3f ms, fused/steps %.3f; "
  .. "largest difference of output and gradient %.3g"):format(cfg.dtype, cfg.batch, cfg.heads, cfg.seq, hd,
  ts * 1e3, tm * 1e3, ts / tm, out_diff))
