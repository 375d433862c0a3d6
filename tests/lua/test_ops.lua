-- The ops and modules LLaMA-era models need, each against a reference written here from
-- elementary ops (values, and gradients through autograd of both), in float64: silu, rms_norm and
-- nn.RMSNorm, scaled_dot_product_attention (causal, masks, grouped-query heads), rotary
-- embeddings (Hugging Face's rotate-half layout, checked element by element), einsum,
-- repeat_interleave, sort/argsort, scatter, logsumexp, isnan/isfinite, unbind, flip, nll_loss,
-- ModuleList / ModuleDict / Identity, nn.init, and attributes declared by Lua modules.
local pt = require "partrain"
local H = require "harness"
local nn = pt.nn

pt.manual_seed(7)
local f64 = { dtype = "float64" }

-- The gradients of sum(fn(inputs) * w) for a fixed random w, for each input.
local function grads(fn, inputs, w)
  local xs = {}
  for i, x in ipairs(inputs) do xs[i] = x:detach():clone():requires_grad_(true) end
  local y = fn(unpack(xs))
  w = w or pt.randn(y.shape, f64)
  ;(y * w):sum():backward()
  local gs = {}
  for i, x in ipairs(xs) do gs[i] = x.grad end
  return y, gs, w
end

-- fn and ref agree in value and in every input's gradient.
local function same(fn, ref, inputs, tol, what)
  local y, g = grads(fn, inputs)
  local w = pt.randn(y.shape, f64)
  y, g = grads(fn, inputs, w)
  local y2, g2 = grads(ref, inputs, w)
  H.near(y, y2, tol, what .. " (value)")
  for i = 1, #g do H.near(g[i], g2[i], tol, what .. (" (gradient of input %d)"):format(i)) end
end

H.test("silu is x * sigmoid(x), and nn.SiLU the same", function()
  local x = pt.randn({ 3, 5 }, f64)
  same(function(t) return t:silu() end, function(t) return t * t:sigmoid() end, { x }, 1e-12, "silu")
  H.near(nn.SiLU()(x), x * x:sigmoid(), 1e-12, "nn.SiLU")
end)

local function rms_ref(x, w, eps)
  return x / ((x * x):mean(-1, true) + eps):sqrt() * w
end

H.test("rms_norm and nn.RMSNorm: x / sqrt(mean(x^2) + eps) * weight, values and gradients", function()
  local x, w = pt.randn({ 2, 3, 8 }, f64), pt.randn({ 8 }, f64)
  same(function(a, b) return nn.rms_norm(a, b, 1e-5) end, function(a, b) return rms_ref(a, b, 1e-5) end, { x, w }, 1e-12,
    "rms_norm")
  local m = nn.RMSNorm(8, { eps = 1e-5 }):to("float64")
  H.eq(m:type(), "RMSNorm")
  H.near(m.weight, pt.ones({ 8 }, f64), 0, "RMSNorm's weight starts at 1")
  H.near(m(x), rms_ref(x, pt.ones({ 8 }, f64), 1e-5), 1e-12, "nn.RMSNorm")
  H.eq(#m:parameters(), 1, "RMSNorm has a weight and no bias")
  H.eq(#nn.RMSNorm(8, { affine = false }):parameters(), 0, "affine = false: no weight")
  -- bfloat16 input: statistics in float32, result in bfloat16 (Hugging Face's LlamaRMSNorm).
  local xb = x:float():bfloat16()
  local yb = nn.rms_norm(xb, nil, 1e-5)
  H.eq(yb.dtype, "bfloat16")
  H.near(yb:double(), rms_ref(xb:double(), 1, 1e-5), 1e-2, "rms_norm in bfloat16")
  H.raises(function() nn.RMSNorm(8)(pt.randn({ 2, 7 })) end, "RMSNorm(8) expects input (..., 8)")
  H.raises(function() nn.RMSNorm(8, { eps = -1 }) end, "eps must be a finite number >= 0")
end)

-- Each of these had been accepted: the norms and the attention then gave NaN, and the MLP built no
-- Dropout at all.
H.test("values that give NaN or drop a layer are refused where the layer or model is made", function()
  H.raises(function() nn.LayerNorm(8, { eps = -1 }) end, "LayerNorm: eps must be a finite number >= 0, got -1")
  H.raises(function() nn.LayerNorm(8, { eps = 0 / 0 }) end, "LayerNorm: eps must be a finite number >= 0")
  H.raises(function() pt.models.gpt2 { vocab = 8, seq = 4, dim = 8, heads = 2, layers = 1, eps = 1 / 0 } end,
    "gpt2: eps must be a finite number >= 0, got inf")
  H.raises(function() pt.models.llama { vocab = 8, seq = 4, dim = 8, heads = 2, layers = 1, rope_base = 1 / 0 } end,
    "llama: eps and rope_base must be finite numbers > 0")
  H.raises(function() pt.models.mlp { sizes = { 2, 3, 2 }, dropout = 0 / 0 } end, "mlp: dropout must be in [0, 1)")
  H.raises(function() pt.models.mlp { sizes = { 2, 3, 2 }, dropout = -0.5 } end, "mlp: dropout must be in [0, 1), got -0.5")
  local q = pt.randn({ 1, 1, 2, 4 })
  H.raises(function() nn.scaled_dot_product_attention(q, q, q, { scale = 0 / 0 }) end,
    "scaled_dot_product_attention: scale must be a finite number")
end)

-- Attention one head at a time: softmax(q k^T * scale + mask) v, with key/value head h // group.
local function attention_ref(q, k, v, causal, mask)
  local B, Hq, T, d = unpack(q.shape)
  local Hkv, S = k.shape[2], k.shape[3]
  local group = Hq / Hkv
  local out = {}
  for h = 0, Hq - 1 do
    local qh = q:select(1, h)
    local kh = k:select(1, math.floor(h / group))
    local vh = v:select(1, math.floor(h / group))
    local s = qh:matmul(kh:transpose(-2, -1)) / math.sqrt(d)
    if causal then
      local allowed = pt.ones({ T, S }):tril(S - T):bool()
      s = s:masked_fill(allowed:logical_not(), -math.huge)
    end
    if mask then s = s:masked_fill(mask:logical_not(), -math.huge) end
    out[h + 1] = s:softmax(-1):matmul(vh)
  end
  return pt.stack(out, 1)
end

H.test("scaled_dot_product_attention: plain, causal, boolean mask, grouped-query heads, gradients", function()
  local q, k, v = pt.randn({ 2, 4, 5, 8 }, f64), pt.randn({ 2, 4, 5, 8 }, f64), pt.randn({ 2, 4, 5, 8 }, f64)
  local sdpa = nn.scaled_dot_product_attention
  same(function(a, b, c) return sdpa(a, b, c) end, function(a, b, c) return attention_ref(a, b, c, false) end,
    { q, k, v }, 1e-12, "sdpa")
  same(function(a, b, c) return sdpa(a, b, c, { causal = true }) end,
    function(a, b, c) return attention_ref(a, b, c, true) end, { q, k, v }, 1e-12, "causal sdpa")
  local mask = pt.rand({ 5, 5 }):gt(0.3):logical_or(pt.eye(5):bool())
  same(function(a, b, c) return sdpa(a, b, c, { mask = mask }) end,
    function(a, b, c) return attention_ref(a, b, c, false, mask) end, { q, k, v }, 1e-12, "masked sdpa")
  -- 4 query heads over 2 key/value heads: heads 0, 1 use kv head 0; heads 2, 3 kv head 1.
  local k2, v2 = pt.randn({ 2, 2, 5, 8 }, f64), pt.randn({ 2, 2, 5, 8 }, f64)
  same(function(a, b, c) return sdpa(a, b, c, { causal = true }) end,
    function(a, b, c) return attention_ref(a, b, c, true) end, { q, k2, v2 }, 1e-12, "grouped-query sdpa")
  -- fewer queries than keys (a KV cache): query t sits at position S - T + t.
  local q1 = pt.randn({ 2, 4, 2, 8 }, f64)
  same(function(a, b, c) return sdpa(a, b, c, { causal = true }) end,
    function(a, b, c) return attention_ref(a, b, c, true) end, { q1, k2, v2 }, 1e-12, "sdpa over a cache")
  H.near(sdpa(q, k, v, { scale = 0.5 }), sdpa(q * (0.5 * math.sqrt(8)), k, v), 1e-12, "an explicit scale")
  H.raises(function() sdpa(q, pt.randn({ 2, 3, 5, 8 }, f64), pt.randn({ 2, 3, 5, 8 }, f64)) end,
    "4 query heads are not a multiple of 3 key/value heads")
  H.raises(function() sdpa(q:select(0, 0), k, v) end, "expects q, k, v of shape (batch, heads, positions, head size)")
  H.raises(function() sdpa(q, k, v, { causal = "yes" }) end, "causal")
end)

H.test("rotary embeddings: Hugging Face's rotate-half layout, element by element", function()
  local d, T = 8, 6
  local cos, sin = nn.rotary_tables(d, T, { base = 100, dtype = "float64" })
  H.eq(table.concat(cos.shape, "x"), "6x8")
  local x = pt.randn({ 1, 2, T, d }, f64)
  local y = nn.apply_rotary(x, cos, sin)
  local X, Y = x:totable(), y:totable()
  for h = 1, 2 do
    for p = 0, T - 1 do
      for i = 0, d / 2 - 1 do
        local theta = p / 100 ^ (2 * i / d)
        local a, b = X[1][h][p + 1][i + 1], X[1][h][p + 1][i + 1 + d / 2]
        H.near(Y[1][h][p + 1][i + 1], a * math.cos(theta) - b * math.sin(theta), 1e-6, "first half")
        H.near(Y[1][h][p + 1][i + 1 + d / 2], b * math.cos(theta) + a * math.sin(theta), 1e-6, "second half")
      end
    end
  end
  -- Positions as a tensor: a window of the same tables.
  local c2, s2 = nn.rotary_tables(d, pt.arange(2, 5), { base = 100, dtype = "float64" })
  H.near(c2, cos:narrow(0, 2, 3), 1e-12, "cos at positions 2..4")
  H.near(s2, sin:narrow(0, 2, 3), 1e-12, "sin at positions 2..4")
  -- A rotation keeps each pair's length, and its gradient is the inverse rotation.
  H.near(y:pow(2):sum(), x:pow(2):sum(), 1e-9, "norm kept")
  same(function(a) return nn.apply_rotary(a, cos, sin) end,
    function(a)
      local half = d / 2
      local rot = pt.cat({ -a:narrow(-1, half, half), a:narrow(-1, 0, half) }, -1)
      return a * cos + rot * sin
    end, { x }, 1e-12, "apply_rotary")
  H.raises(function() nn.rotary_tables(7, 4) end, "even head size")
  H.raises(function() nn.rotary_tables(4, -1) end, "positions must be a count >= 0 or a tensor of positions, got -1")
  H.raises(function() nn.apply_rotary(x, cos:narrow(-1, 0, 4), sin:narrow(-1, 0, 4)) end, "do not fit x")
end)

H.test("einsum, repeat_interleave, flip, unbind", function()
  local a, b = pt.randn({ 2, 3, 4 }, f64), pt.randn({ 2, 4, 5 }, f64)
  same(function(x, y) return pt.einsum("bij,bjk->bik", x, y) end, function(x, y) return x:bmm(y) end, { a, b }, 1e-12,
    "einsum as bmm")
  H.near(pt.einsum("ii", { pt.eye(3) * 2 }), 6, 1e-12, "einsum trace from a table of operands")
  local x = pt.tensor({ { 1, 2 }, { 3, 4 } })
  H.eq(table.concat(x:repeat_interleave(2, 0):view(-1):totable(), ","), "1,2,1,2,3,4,3,4")
  H.eq(table.concat(x:repeat_interleave(pt.tensor({ 1, 3 }, { dtype = "int64" }), 1):view(-1):totable(), ","), "1,2,2,2,3,4,4,4")
  H.eq(table.concat(x:flip(1):view(-1):totable(), ","), "2,1,4,3")
  H.eq(table.concat(x:flip({ 0, 1 }):view(-1):totable(), ","), "4,3,2,1")
  local rows = x:unbind(0)
  H.eq(#rows, 2)
  H.eq(table.concat(rows[2]:totable(), ","), "3,4")
  H.raises(function() x:repeat_interleave(-1) end, "repeats must be >= 0")
end)

H.test("sort and argsort (stable), scatter, scatter_add, logsumexp", function()
  local x = pt.tensor({ 3, 1, 2, 1 })
  local v, i = x:sort()
  H.eq(table.concat(v:totable(), ","), "1,1,2,3")
  H.eq(table.concat(i:totable(), ","), "1,3,2,0", "stable: equal values keep their order")
  H.eq(table.concat(x:argsort(0, true):totable(), ","), "0,2,1,3", "descending")
  local z = pt.zeros({ 2, 4 })
  local idx = pt.tensor({ { 1, 3 }, { 0, 2 } }, { dtype = "int64" })
  local src = pt.tensor({ { 5, 6 }, { 7, 8 } })
  H.eq(table.concat(z:scatter(1, idx, src):view(-1):totable(), ","), "0,5,0,6,7,0,8,0")
  H.eq(table.concat(z:scatter(1, idx, 9):view(-1):totable(), ","), "0,9,0,9,9,0,9,0")
  local acc = pt.zeros({ 3 }):scatter_add(0, pt.tensor({ 0, 0, 2 }, { dtype = "int64" }), pt.tensor({ 1, 2, 5 }))
  H.eq(table.concat(acc:totable(), ","), "3,0,5")
  local m = pt.randn({ 3, 5 }, f64)
  same(function(t) return t:logsumexp(1) end, function(t) return t:exp():sum(1):log() end, { m }, 1e-12, "logsumexp")
  H.near(m:logsumexp({ 0, 1 }), m:exp():sum():log(), 1e-12, "logsumexp over two dimensions")
  H.eq(table.concat(m:logsumexp(1, true).shape, "x"), "3x1", "keepdim")
end)

H.test("isnan, isinf, isfinite", function()
  local x = pt.tensor({ 1, 0, -1 }) / pt.tensor({ 0, 0, 1 })  -- inf, nan, -1
  local function flags(t)
    local out = {}
    for i, v in ipairs(t:totable()) do out[i] = tostring(v) end
    return table.concat(out, ",")
  end
  H.eq(flags(x:isnan()), "false,true,false")
  H.eq(flags(x:isinf()), "true,false,false")
  H.eq(flags(x:isfinite()), "false,false,true")
end)

H.test("nll_loss: mean over counted targets, sum, none, ignore_index; equals cross_entropy of log_softmax", function()
  local logits = pt.randn({ 4, 6 }, f64)
  local y = pt.tensor({ 2, 0, 5, 1 }, { dtype = "int64" })
  same(function(l) return nn.nll_loss(l:log_softmax(-1), y) end, function(l) return nn.cross_entropy(l, y) end,
    { logits }, 1e-12, "nll_loss of log_softmax")
  local lp = logits:log_softmax(-1)
  local picked = -(lp:gather(1, y:unsqueeze(1)):squeeze(1))
  H.near(nn.nll_loss(lp, y, { reduction = "none" }), picked, 1e-12, "none")
  H.near(nn.nll_loss(lp, y, { reduction = "sum" }), picked:sum(), 1e-12, "sum")
  local masked = pt.tensor({ 2, -100, 5, -100 }, { dtype = "int64" })
  H.near(nn.nll_loss(lp, masked), (picked:select(0, 0) + picked:select(0, 2)) / 2, 1e-12, "ignore_index")
  H.raises(function() nn.nll_loss(lp, pt.tensor({ 2, 0, 6, 1 }, { dtype = "int64" })) end, "nll_loss: target 6 is out of range for 6 classes (targets are 0 to 5, or ignore_index=-100)")
  H.raises(function() nn.nll_loss(lp, y, { reduction = "avg" }) end, "reduction must be 'mean', 'sum' or 'none'")
end)

H.test("ModuleList, ModuleDict and Identity hold modules; their parameters are named by position or key", function()
  local list = nn.ModuleList(nn.Linear(3, 4), nn.Linear(4, 2))
  H.eq(list:type(), "ModuleList")
  local names = {}
  for name in list:named_parameters() do names[#names + 1] = name end
  H.eq(table.concat(names, ","), "0.weight,0.bias,1.weight,1.bias")
  H.eq(#list:children(), 2)
  local x = pt.randn({ 5, 3 })
  local y = x
  for _, m in ipairs(list:children()) do y = m(y) end
  H.near(y, list["1"](list["0"](x)), 0, "children run in order by the parent")
  H.raises(function() list(x) end, "ModuleList holds modules but does not run them")
  local same_list = nn.ModuleList({ nn.Identity(), nn.Identity() })
  H.eq(#same_list:children(), 2, "ModuleList from a table")
  local dict = nn.ModuleDict({ up = nn.Linear(3, 8), down = nn.Linear(8, 3) })
  names = {}
  for name in dict:named_children() do names[#names + 1] = name end
  H.eq(table.concat(names, ","), "down,up", "keys in name order")
  H.near(nn.Identity()(x), x, 0, "Identity")
  H.raises(function() nn.ModuleDict({ ["a.b"] = nn.Identity() }) end, "not a valid child name")
  H.raises(function() nn.ModuleList(nn.Identity(), 3) end, "module")
end)

H.test("nn.init fills tensors in place with the right statistics", function()
  local t = pt.empty({ 200, 100 })
  H.ok(pt.is_tensor(nn.init.normal_(t, 0, 0.02)), "nn.init returns the tensor")
  H.near(t:std():item(), 0.02, 0.05, "normal_ std")
  nn.init.uniform_(t, -0.5, 0.5)
  H.ok(t:min():item() >= -0.5 and t:max():item() <= 0.5, "uniform_ bounds")
  nn.init.constant_(t, 3)
  H.eq(t:mean():item(), 3)
  nn.init.zeros_(t); H.eq(t:abs():sum():item(), 0)
  nn.init.ones_(t); H.eq(t:sum():item(), 20000)
  nn.init.xavier_uniform_(t)  -- bound sqrt(6 / (fan_in + fan_out))
  H.ok(t:abs():max():item() <= math.sqrt(6 / 300) + 1e-6, "xavier_uniform_ bound")
  nn.init.kaiming_normal_(t, { mode = "fan_in", nonlinearity = "relu" })  -- std sqrt(2 / fan_in)
  H.near(t:std():item(), math.sqrt(2 / 100), 0.05, "kaiming_normal_ std")
  nn.init.trunc_normal_(t, 0, 1, -1, 1)
  H.ok(t:min():item() >= -1 and t:max():item() <= 1, "trunc_normal_ bounds")
  H.near(t:std():item(), 0.5396, 0.05, "trunc_normal_ std of a unit normal cut at +-1")
  H.raises(function() nn.init.kaiming_uniform_(t, { mode = "fan_mid" }) end, "mode must be 'fan_in' or 'fan_out'")
  H.raises(function() nn.init.normal_(pt.zeros({ 2 }, { dtype = "int64" })) end, "floating-point tensor")
end)

H.test("a Lua module declares numeric attributes: self.name reads them, a policy can set them", function()
  local Attn = nn.Module "Attn"
  function Attn:__init(dim, heads)
    self:attribute("heads", heads)
    self.qkv = nn.Linear(dim, 3 * dim)
  end
  local a = Attn(8, 4)
  H.eq(a.heads, 4, "self.heads reads the attribute")
  H.eq(a:attribute("heads"), 4)
  H.eq(table.concat(a:attribute_names(), ","), "heads")
  a:set_attribute("heads", 2)
  H.eq(a.heads, 2, "set_attribute shows through self.heads")
  a.heads = 1
  H.eq(a:attribute("heads"), 1, "assigning self.heads sets the attribute")
  H.raises(function() a.heads = "two" end, "numeric attribute")
  H.raises(function() a:set_attribute("width", 3) end, "it declares heads")
  H.raises(function() a:attribute("qkv", 3) end, "not an attribute name")
end)

H.run()
