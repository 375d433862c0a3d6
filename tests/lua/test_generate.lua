-- Generation for GPT-2 and LLaMA: with the key/value cache it gives the tokens it gives without,
-- token for token, greedily; the first new token is the argmax of the prompt's last logits; top-k
-- 1 and a tiny top-p are greedy; bad options are refused. (Under tensor parallelism:
-- tests/dist/test_policy.lua.)
local pt = require "partrain"
local H = require "harness"

local function models()
  pt.manual_seed(5)
  return {
    gpt2 = pt.models.gpt2 { vocab = 64, seq = 32, dim = 32, heads = 4, layers = 2 },
    llama = pt.models.llama { vocab = 64, seq = 32, dim = 32, heads = 4, kv_heads = 2, layers = 2 },
  }
end

local prompt = pt.tensor({ { 3, 14, 15, 9, 2 }, { 6, 5, 35, 8, 9 } }, { dtype = "int64" })

for name, model in pairs(models()) do
  H.test(name .. ": the key/value cache gives the tokens a full recomputation gives (greedy, 20 new)", function()
    local cached = model:generate(prompt, { max_new = 20, temperature = 0 })
    local full = model:generate(prompt, { max_new = 20, temperature = 0, cache = false })
    H.eq(table.concat(cached.shape, "x"), "2x25")
    H.ok(cached:equal(full), name .. ": cached " .. tostring(cached) .. " vs " .. tostring(full))
    H.ok(cached:narrow(1, 0, 5):equal(prompt), "the prompt comes first")
    local first = pt.no_grad(function() return model(prompt):select(1, -1):argmax(-1) end)
    H.ok(cached:select(1, 5):equal(first), "the first new token is the argmax of the prompt's last logits")
    H.ok(model:is_training(), "the model's mode is restored")
  end)

  H.test(name .. ": top_k = 1 and a tiny top_p are greedy; sampling is seeded", function()
    local greedy = model:generate(prompt, { max_new = 8, temperature = 0 })
    H.ok(model:generate(prompt, { max_new = 8, top_k = 1 }):equal(greedy), "top_k = 1")
    H.ok(model:generate(prompt, { max_new = 8, top_p = 1e-6 }):equal(greedy), "top_p near 0")
    for _, t in ipairs { 1e-300, 1e-310 } do  -- logits / t had overflowed to inf, and softmax to NaN
      H.ok(model:generate(prompt, { max_new = 8, temperature = t }):equal(greedy), "temperature " .. t .. " is greedy")
    end
    pt.manual_seed(11)
    local a = model:generate(prompt, { max_new = 8, temperature = 1.5, top_k = 10, top_p = 0.9 })
    pt.manual_seed(11)
    local b = model:generate(prompt, { max_new = 8, temperature = 1.5, top_k = 10, top_p = 0.9 })
    H.ok(a:equal(b), "the same seed draws the same tokens")
  end)

  H.test(name .. ": bad options and prompts are refused", function()
    H.raises(function() model:generate(prompt, { max_new = 40 }) end, "pass the model's seq=32")
    H.raises(function() model:generate(prompt, { top_p = 0 }) end, "top_p must be in (0, 1]")
    H.raises(function() model:generate(prompt, { temperature = -1 }) end, "temperature must be a finite number >= 0")
    H.raises(function() model:generate(prompt:float()) end, "expects a prompt of int64 ids")
    H.raises(function() model:generate(prompt, { beams = 2 }) end, "beams")
  end)
end

-- A block that appears twice (weights shared, ALBERT-style) runs twice a forward on other inputs:
-- the cache had kept one entry a module, both uses appending to it (other tokens, exit 0).
H.test("a model whose blocks share one module: the cache gives the tokens recomputation gives (float64)", function()
  for _, family in ipairs { "gpt2", "llama" } do
    pt.manual_seed(1)
    local m = pt.models[family] { vocab = 64, seq = 32, dim = 32, heads = 4, layers = 2, dtype = "float64" }
    local blocks = family == "gpt2" and "h" or "layers"
    pt.no_grad(function() for _, p in m:named_parameters() do if #p.shape == 2 then p:mul_(10) end end end)
    m:get(blocks):set("1", m:get(blocks .. ".0"))
    local one = pt.tensor({ { 3, 14, 15, 9, 2 } }, { dtype = "int64" })
    local cached = m:generate(one, { max_new = 12, temperature = 0 })
    local full = m:generate(one, { max_new = 12, temperature = 0, cache = false })
    H.ok(cached:equal(full), family .. ": cached " .. tostring(cached) .. " vs " .. tostring(full))
  end
end)

-- Two logits that differ in float64 and round to one float32: greedy had picked in float32.
H.test("a float64 model's greedy token is its float64 argmax", function()
  pt.manual_seed(3)
  local m = pt.models.gpt2 { vocab = 16, seq = 16, dim = 8, heads = 2, layers = 1, dtype = "float64" }
  local one = pt.tensor({ { 3, 4, 5 } }, { dtype = "int64" })
  local w = pt.randn(8, { dtype = "float64" })
  pt.no_grad(function()
    local W = pt.zeros(16, 8, { dtype = "float64" })
    W:select(0, 0):copy_(w)
    W:select(0, 1):copy_(w * (1 + 1e-9))
    m.lm_head.weight:copy_(W)
    if m(one):select(1, -1):select(1, 0):item() < 0 then m.lm_head.weight:mul_(-1) end
  end)
  local logits = pt.no_grad(function() return m(one):select(1, -1) end)
  H.ok(logits:select(1, 1):item() > logits:select(1, 0):item(), "token 1 leads in float64")
  H.ok(logits:select(1, 1):float():item() == logits:select(1, 0):float():item(), "a tie in float32")
  H.eq(m:generate(one, { max_new = 1, temperature = 0 }):select(1, -1):item(), 1, "greedy takes token 1")
end)

H.test("only the transformer families generate", function()
  H.raises(function() pt.models.mlp { sizes = { 4, 4 } }:generate(prompt) end, "generate needs a GPT2 or a Llama")
end)

H.run()
