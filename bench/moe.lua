-- Grouped against looped expert compute, for bench/moe: the experts' SwiGLU MLP of an MoE block
-- (w1 and w3 [E, ffn, dim], w2 [E, dim, ffn], stacked as the block stores them) over tokens
-- already sorted by expert, forward and backward, three ways on the same tensors:
--   looped:  one x[rows of e] @ w[e] an expert, concatenated (pt.nn.looped_matmul);
--   grouped: pt.nn.grouped_matmul (at::_grouped_mm for float32 in these layouts);
--   padded:  the fallback, each expert's rows padded to the largest count and one bmm
--            (pt.nn.padded_bmm_matmul: what float64 and unaligned layouts take).
-- Per configuration (experts E, widths dim/ffn, routing balanced or Zipf-skewed) the three take
-- turns `reps` times after one untimed round; it prints the medians and their ratios to looped.
--   partrain --threads 1 bench/moe.lua [--experts 8,32,64] [--sizes 256x704,512x1408] [--tokens 4096]
local pt = require "partrain"
local cfg = pt.args {
  experts = "8,32,64",         -- expert counts E
  sizes = "256x704,512x1408",  -- dim x ffn pairs
  tokens = 4096,               -- tokens a batch; each is routed to top_k experts
  top_k = 2,                   -- rows = tokens * top_k
  skew = 1.0,                  -- Zipf exponent of the skewed routing: expert e's share ~ 1 / (e + 1)^skew
  reps = 5,                    -- timed rounds a configuration
  seed = 1,
}
assert(cfg.reps >= 1, "bench/moe.lua: --reps must be >= 1")
local median = require("timing").median

-- Rows an expert: T split evenly, or in Zipf proportions (largest first), summing to T exactly.
local function route(T, E, skewed)
  local shares, total = {}, 0
  for e = 1, E do
    shares[e] = skewed and 1 / e ^ cfg.skew or 1
    total = total + shares[e]
  end
  local counts, given = {}, 0
  for e = 1, E do
    counts[e] = math.floor(T * shares[e] / total)
    given = given + counts[e]
  end
  for e = 1, T - given do counts[(e - 1) % E + 1] = counts[(e - 1) % E + 1] + 1 end
  return counts
end

local function largest(counts)
  local m = 0
  for _, c in ipairs(counts) do m = math.max(m, c) end
  return m
end

-- The experts' MLP through `matmul`: w2(silu(w1 x) * w3 x), each weight a view [E, in, out].
local function mlp(matmul, x, w, counts)
  local gate = matmul(x, w.w1:transpose(1, 2), counts)
  local up = matmul(x, w.w3:transpose(1, 2), counts)
  return matmul(gate:silu() * up, w.w2:transpose(1, 2), counts)
end

local variants = {
  { name = "looped", fn = pt.nn.looped_matmul },
  { name = "grouped", fn = pt.nn.grouped_matmul },
  { name = "padded", fn = pt.nn.padded_bmm_matmul },
}

local function run(E, dim, ffn, skewed)
  local T = cfg.tokens * cfg.top_k
  local counts = route(T, E, skewed)
  pt.manual_seed(cfg.seed)
  local x = pt.randn({ T, dim }, { requires_grad = true })
  local w = {
    w1 = (pt.randn({ E, ffn, dim }) * dim ^ -0.5):requires_grad_(),
    w3 = (pt.randn({ E, ffn, dim }) * dim ^ -0.5):requires_grad_(),
    w2 = (pt.randn({ E, dim, ffn }) * ffn ^ -0.5):requires_grad_(),
  }
  local g = pt.randn({ T, dim })
  local leaves = { x, w.w1, w.w3, w.w2 }
  local function step(v)
    for _, t in ipairs(leaves) do t.grad = nil end
    local t0 = pt.time()
    local y = mlp(v.fn, x, w, counts)
    y:backward(g)
    return pt.time() - t0, y:detach()
  end
  for _, v in ipairs(variants) do v.times = {} end
  local outputs = {}
  for round = 0, cfg.reps do
    for i = 0, #variants - 1 do  -- each round starts with the next variant
      local v = variants[(i + round) % #variants + 1]
      local seconds, y = step(v)
      if round > 0 then v.times[#v.times + 1] = seconds else outputs[v.name] = y end
    end
  end
  -- The three compute the same function (float32: within rounding).
  for _, name in ipairs { "grouped", "padded" } do
    local diff = (outputs[name] - outputs.looped):abs():max():item() / outputs.looped:abs():max():item()
    assert(diff < 1e-4, ("bench/moe.lua: %s differs from looped by %.2e (relative)"):format(name, diff))
  end
  local ms = {}
  for _, v in ipairs(variants) do ms[v.name] = 1000 * median(v.times) end
  print(("E=%d dim=%d ffn=%d T=%d routing=%s max_over_mean=%.2f path=%s looped_ms=%.2f grouped_ms=%.2f "
         .. "padded_ms=%.2f grouped_vs_looped=%.3f padded_vs_looped=%.3f"):format(E, dim, ffn, T,
    skewed and "zipf" or "balanced", largest(counts) * E / T, pt.nn.grouped_matmul_path(x, w.w1:transpose(1, 2)),
    ms.looped, ms.grouped, ms.padded, ms.grouped / ms.looped, ms.padded / ms.looped))
end

print(("== experts' SwiGLU MLP, forward and backward, float32 on the CPU, %d thread(s); %d tokens x top-%d; "
       .. "Zipf exponent %.2f; medians of %d rounds"):format(pt.get_threads(), cfg.tokens, cfg.top_k, cfg.skew, cfg.reps))
for size in cfg.sizes:gmatch("[^,]+") do
  local dim, ffn = size:match("^(%d+)x(%d+)$")
  assert(dim, "bench/moe.lua: --sizes takes dim x ffn pairs such as 256x704, got " .. size)
  for e in cfg.experts:gmatch("%d+") do
    for _, skewed in ipairs { false, true } do
      run(tonumber(e), tonumber(dim), tonumber(ffn), skewed)
      collectgarbage()
    end
  end
end
