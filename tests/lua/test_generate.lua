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
    pt.manual_seed(11)
    local a = model:generate(prompt, { max_new = 8, temperature = 1.5, top_k = 10, top_p = 0.9 })
    pt.manual_seed(11)
    local b = model:generate(prompt, { max_new = 8, temperature = 1.5, top_k = 10, top_p = 0.9 })
    H.ok(a:equal(b), "the same seed draws the same tokens")
  end)

  H.test(name .. ": bad options and prompts are refused", function()
    H.raises(function() model:generate(prompt, { max_new = 40 }) end, "pass the model's seq=32")
    H.raises(function() model:generate(prompt, { top_p = 0 }) end, "top_p must be in (0, 1]")
    H.raises(function() model:generate(prompt, { temperature = -1 }) end, "temperature must be >= 0")
    H.raises(function() model:generate(prompt:float()) end, "expects a prompt of int64 ids")
    H.raises(function() model:generate(prompt, { beams = 2 }) end, "beams")
  end)
end

H.test("only the transformer families generate", function()
  H.raises(function() pt.models.mlp { sizes = { 4, 4 } }:generate(prompt) end, "generate needs a GPT2 or a Llama")
end)

H.run()
