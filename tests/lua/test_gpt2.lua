-- GPT-2: Hugging Face's names, tied embeddings, GPT-2's initialization, causal attention, and a
-- forward pass that matches the same math written out in Lua.
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, eq, near, raises, ok = H.test, H.eq, H.near, H.raises, H.ok

local small = { vocab = 50, seq = 16, dim = 24, heads = 3, layers = 2 }

test("parameters carry Hugging Face's GPT-2 names", function()
  local m = pt.models.gpt2(small)
  eq(m:type(), "GPT2")
  local names = {}
  for n in m:named_parameters() do names[#names + 1] = n end
  eq(table.concat(names, " "), table.concat({
    "wte.weight", "wpe.weight",
    "h.0.ln_1.weight", "h.0.ln_1.bias", "h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias",
    "h.0.attn.c_proj.weight", "h.0.attn.c_proj.bias", "h.0.ln_2.weight", "h.0.ln_2.bias",
    "h.0.mlp.c_fc.weight", "h.0.mlp.c_fc.bias", "h.0.mlp.c_proj.weight", "h.0.mlp.c_proj.bias",
    "h.1.ln_1.weight", "h.1.ln_1.bias", "h.1.attn.c_attn.weight", "h.1.attn.c_attn.bias",
    "h.1.attn.c_proj.weight", "h.1.attn.c_proj.bias", "h.1.ln_2.weight", "h.1.ln_2.bias",
    "h.1.mlp.c_fc.weight", "h.1.mlp.c_fc.bias", "h.1.mlp.c_proj.weight", "h.1.mlp.c_proj.bias",
    "ln_f.weight", "ln_f.bias", "lm_head.weight" }, " "))
  eq(m:get("h.1"):type(), "GPT2Block"); eq(m:get("h.0.attn"):type(), "GPT2Attention")
  eq(m:get("h.0.mlp"):type(), "GPT2MLP")
  eq(table.concat(m.h["0"].attn.c_attn.weight.shape, ","), "72,24", "fused q, k, v: [3 * dim, dim]")
end)

test("lm_head is tied to wte; the tie trains as one parameter", function()
  local m = pt.models.gpt2(small)
  ok(m.lm_head.weight:equal(m.wte.weight), "same values")
  local d = small.dim
  local expected = 50 * d + 16 * d + 2 * (4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)) + 2 * d
  eq(m:num_parameters(), expected, "the tied weight counts once")
  local opt = pt.optim.sgd(m, { lr = 0.1 })
  local x = pt.randint(0, 50, { 2, 8 })
  pt.nn.cross_entropy(m(x), x):backward()
  opt:step()
  ok(m.lm_head.weight:equal(m.wte.weight), "still tied after a step")
end)

test("GPT-2's initialization: N(0, 0.02), residual projections scaled by 1/sqrt(2 layers)", function()
  pt.manual_seed(0)
  local m = pt.models.gpt2 { vocab = 256, seq = 64, dim = 256, heads = 4, layers = 8 }
  near(m.h["0"].mlp.c_fc.weight:std(), pt.tensor(0.02), 0.05, "c_fc std")
  near(m.h["0"].mlp.c_proj.weight:std(), pt.tensor(0.02 / math.sqrt(16)), 0.05, "c_proj std")
  eq(m.h["0"].attn.c_attn.bias:abs():sum():item(), 0, "zero biases")
  eq(m.h["0"].ln_1.weight:sum():item(), 256, "LayerNorm weight 1")
end)

test("attention is causal: a position never sees the tokens after it", function()
  local m = pt.models.gpt2(small)
  local a = pt.randint(0, 50, { 1, 10 })
  local b = a:clone()
  b:narrow(1, 6, 4):fill_(7)   -- change tokens 6..9
  local la, lb = m(a), m(b)
  near(la:narrow(1, 0, 6), lb:narrow(1, 0, 6), 1e-6, "positions 0..5 unchanged")
  ok(not la:narrow(1, 6, 1):allclose(lb:narrow(1, 6, 1)), "position 6 sees its own token")
end)

test("the forward pass matches the same math written out", function()
  pt.manual_seed(4)
  local m = pt.models.gpt2(small)
  local ids = pt.randint(0, 50, { 2, 7 })
  local B, T, D, nh = 2, 7, small.dim, small.heads
  local hd = math.floor(D / nh)
  local function ln(x, mod) return ((x - x:mean(-1, true)) / (x:var(-1, false, true) + 1e-5):sqrt()) * mod.weight + mod.bias end
  local function lin(x, mod) return x:matmul(mod.weight:t()) + mod.bias end
  local x = m.wte.weight:index_select(0, ids:view(-1)):view(B, T, D) + m.wpe.weight:narrow(0, 0, T)
  local mask = pt.ones(T, T):triu(1):bool()
  for i = 0, small.layers - 1 do
    local blk = m.h[tostring(i)]
    local qkv = lin(ln(x, blk.ln_1), blk.attn.c_attn):view(B, T, 3, nh, hd):permute(2, 0, 3, 1, 4)
    local q, k, v = qkv:select(0, 0), qkv:select(0, 1), qkv:select(0, 2)
    local att = (q:matmul(k:transpose(-2, -1)) / math.sqrt(hd)):masked_fill(mask, -math.huge):softmax(-1)
    x = x + lin(att:matmul(v):transpose(1, 2):reshape({ B, T, D }), blk.attn.c_proj)
    x = x + lin(lin(ln(x, blk.ln_2), blk.mlp.c_fc):gelu("tanh"), blk.mlp.c_proj)
  end
  local logits = ln(x, m.ln_f):matmul(m.lm_head.weight:t())
  near(m(ids), logits, 1e-5, "logits")
end)

test("bad sizes are refused by name", function()
  raises(function() pt.models.gpt2 { dim = 10, heads = 3 } end, "heads=3 does not divide dim=10")
  raises(function() pt.models.gpt2 { layers = 0 } end, "gpt2 needs positive sizes")
  raises(function() pt.models.gpt2 { layer = 2 } end, "unknown option 'layer' for gpt2")
  local m = pt.models.gpt2(small)
  raises(function() m(pt.randint(0, 50, { 1, 17 })) end, "sequence of 17 tokens is longer than seq=16")
  raises(function() m(pt.randn(1, 4)) end, "expects int64 token ids")
end)

H.run()
