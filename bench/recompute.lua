-- Activation checkpointing (recompute = "block") against none, GPT-2 and LLaMA side by side in one
-- run: the bytes a forward leaves allocated for backward (measured from LibTorch's allocator) and
-- the median step time (forward, backward, AdamW), with each ratio to the model without it.
--   partrain --threads 1 bench/recompute.lua [--steps 7] [--dim 256] [--layers 6] [--batch 8] [--seq 256]
local pt = require "partrain"
local cfg = pt.args { steps = 7, dim = 256, layers = 6, heads = 8, batch = 8, seq = 256 }

local function build(family, recompute)
  pt.manual_seed(1)
  local model = family == "gpt2"
      and pt.models.gpt2 { vocab = 256, seq = cfg.seq, dim = cfg.dim, heads = cfg.heads, layers = cfg.layers }
      or pt.models.llama { vocab = 256, seq = cfg.seq, dim = cfg.dim, heads = cfg.heads, kv_heads = cfg.heads / 2,
                           layers = cfg.layers }
  model = pt.parallelize(model, nil, pt.mesh {}, { recompute = recompute })
  return model, pt.optim.adamw(model, { lr = 1e-4 })
end

local x = pt.randint(0, 256, { cfg.batch, cfg.seq })
local y = pt.randint(0, 256, { cfg.batch, cfg.seq })

-- One step; returns the bytes held after forward and the step's seconds.
local function step(model, opt)
  local t0 = pt.time()
  local before = pt.memory().allocated
  local loss = pt.nn.cross_entropy(model(x), y)
  local held = pt.memory().allocated - before
  loss:backward()
  opt:step()
  opt:zero_grad()
  return held, pt.time() - t0
end

local median = require("timing").median

for _, family in ipairs({ "gpt2", "llama" }) do
  local plain, plain_opt = build(family, nil)
  local checked, checked_opt = build(family, "block")
  step(plain, plain_opt); step(checked, checked_opt)  -- warm-up
  local times = { plain = {}, block = {} }
  local bytes = {}
  for i = 1, cfg.steps do  -- the two take turns, so a busy moment hits both
    local b1, t1 = step(plain, plain_opt)
    local b2, t2 = step(checked, checked_opt)
    times.plain[i], times.block[i] = t1, t2
    bytes.plain, bytes.block = b1, b2
  end
  local tp, tb = median(times.plain), median(times.block)
  print(("%-5s activations after forward: %.1f MB -> %.1f MB (x%.3f) | step: %.1f ms -> %.1f ms (x%.2f)"):format(
    family, bytes.plain / 1e6, bytes.block / 1e6, bytes.block / bytes.plain, tp * 1e3, tb * 1e3, tb / tp))
end
