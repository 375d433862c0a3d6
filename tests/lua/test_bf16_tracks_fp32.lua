-- bfloat16 tracks float32: a small byte-level GPT-2 (2 layers, width 64, 64 tokens) trained for
-- 200 AdamW steps on the King James Bible from the same initial weights and batches, once in
-- float32 and once in bfloat16 with float32 master weights; the bfloat16 loss curve stays within
-- a stated distance of the float32 one (mean |loss difference| over the last 50 steps, and the
-- final loss averaged over the last 10 steps), and the bfloat16 run really learned.
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, ok = H.test, H.ok

local STEPS = 200
-- Measured on this machine (docs/precision.md): mean |dloss| over the last 50 steps 0.0064, the
-- final loss 0.15 % apart (2.3613 against 2.3577). The bounds leave about 5x margin over those.
local MEAN_TOL, FINAL_TOL = 0.03, 0.01

local function curve(dtype)
  pt.manual_seed(1)
  local model = pt.models.gpt2 { vocab = 256, seq = 64, dim = 64, heads = 4, layers = 2, dtype = dtype }
  local opt = pt.optim.adamw(model, { lr = 3e-3, weight_decay = 0.01, clip_grad_norm = 1.0,
                                      schedule = { kind = "cosine", warmup = 20, total = STEPS } })
  local data = pt.data.text { path = "data/kjv.txt", seq = 64, batch = 8, seed = 1 }
  local losses = {}
  for step = 1, STEPS do
    local x, y = data:next()
    local out = model(x)
    local loss = pt.nn.cross_entropy(out:reshape(-1, 256), y:reshape(-1))
    opt:zero_grad()
    loss:backward()
    opt:step()
    losses[step] = loss:item()
  end
  return losses
end

test("bfloat16 with float32 masters tracks the float32 loss curve over 200 steps", function()
  local t0 = pt.time()
  local f32 = curve("float32")
  local t1 = pt.time()
  local b16 = curve("bfloat16")
  local t2 = pt.time()
  local sum = 0
  for s = STEPS - 49, STEPS do sum = sum + math.abs(b16[s] - f32[s]) end
  local mean = sum / 50
  local function tail(l)
    local t = 0
    for s = STEPS - 9, STEPS do t = t + l[s] end
    return t / 10
  end
  local final32, final16 = tail(f32), tail(b16)
  local rel = math.abs(final16 - final32) / final32
  print(("float32 %.1f s, bfloat16 %.1f s; first loss %.4f; final (mean of last 10) float32 %.4f, bfloat16 %.4f "
    .. "(%.2f %%); mean |dloss| over the last 50 steps %.4f"):format(t1 - t0, t2 - t1, f32[1], final32, final16,
    100 * rel, mean))
  ok(final16 < f32[1] - 1.5, ("bfloat16 learned: %.4f from %.4f"):format(final16, f32[1]))
  ok(mean < MEAN_TOL, ("mean |dloss| over the last 50 steps %.4f exceeds %.3f"):format(mean, MEAN_TOL))
  ok(rel < FINAL_TOL, ("final loss differs by %.2f %% (more than %.0f %%)"):format(100 * rel, 100 * FINAL_TOL))
end)

H.run()
