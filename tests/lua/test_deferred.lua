-- Deferred construction and initialization by name: a model built inside pt.deferred holds no
-- memory (its parameters are on the meta device), and model:materialize() gives it exactly the
-- weights the same model gets when built normally after the same pt.manual_seed (GPT-2 and the
-- MLP family: every tensor equal, ties kept), whatever the build order; layers built in Lua get
-- their layer type's initialization; what cannot be initialized by name is refused by name.
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, eq, ok, raises = H.test, H.eq, H.ok, H.raises

local small = { vocab = 50, seq = 16, dim = 24, heads = 3, layers = 2 }

-- Every tensor of `a` equals `b`'s exactly, and they have the same names.
local function same(a, b, what)
  local sa, sb = a:state_dict(), b:state_dict()
  for name, t in pairs(sa) do
    ok(sb[name] ~= nil, what .. ": " .. name .. " missing")
    ok(t:equal(sb[name]), what .. ": " .. name .. " differs")
  end
  for name in pairs(sb) do ok(sa[name] ~= nil, what .. ": unexpected " .. name) end
end

test("GPT-2 built deferred and materialized equals GPT-2 built normally, tensor by tensor", function()
  pt.manual_seed(11)
  local serial = pt.models.gpt2(small)
  pt.manual_seed(11)
  local deferred = pt.deferred(function() return pt.models.gpt2(small) end)
  ok(deferred:is_meta(), "deferred: on the meta device")
  eq(deferred.h["0"].attn.c_attn.weight.device, "meta", "a deferred weight holds no memory")
  deferred:materialize()
  ok(not deferred:is_meta(), "materialized")
  same(deferred, serial, "gpt2")
  ok(deferred.lm_head.weight:equal(deferred.wte.weight), "lm_head still tied to wte")
  deferred.wte.weight:detach():add_(1)
  ok(deferred.lm_head.weight:equal(deferred.wte.weight), "one tensor, not two equal ones")
  -- GPT-2's family init by name: the distributions of before.
  local std = serial.h["0"].mlp.c_fc.weight:std():item()
  ok(math.abs(std - 0.02) < 0.002, "c_fc ~ N(0, 0.02): " .. std)
  eq(serial.h["1"].ln_2.weight:sum():item(), small.dim, "LayerNorm weight 1")
  eq(serial.h["1"].attn.c_proj.bias:abs():sum():item(), 0, "zero biases")
end)

test("a different seed gives different weights; the same seed the same, in float64 too", function()
  pt.manual_seed(1)
  local a = pt.models.gpt2(small)
  pt.manual_seed(2)
  local b = pt.models.gpt2(small)
  ok(not a.wte.weight:equal(b.wte.weight), "seeds 1 and 2 differ")
  pt.manual_seed(1)
  local c = pt.deferred(function() return pt.models.gpt2(small):to("float64") end):materialize()
  eq(c.wte.weight.dtype, "float64")
  ok(c.wte.weight:equal(a.wte.weight:to("float64")), "float64: the float32 draw, widened")
end)

test("the MLP family, and chains built in Lua: deferred equals normal, each layer its own init", function()
  pt.manual_seed(3)
  local serial = pt.models.mlp { sizes = { 8, 16, 4 } }
  pt.manual_seed(3)
  local deferred = pt.deferred(function() return pt.models.mlp { sizes = { 8, 16, 4 } } end):materialize()
  same(deferred, serial, "mlp")
  local function chain()
    return pt.nn.Sequential(pt.nn.Embedding(10, 8), pt.nn.LayerNorm(8), pt.nn.Linear(8, 400))
  end
  pt.manual_seed(4)
  local one = pt.deferred(chain):materialize()
  pt.manual_seed(4)
  local two = pt.deferred(chain):materialize()
  same(one, two, "a chain built in Lua")
  local w = one:get("2").weight
  local bound = 1 / math.sqrt(8)
  ok(w:abs():max():item() <= bound and w:abs():max():item() > 0.9 * bound, "Linear: U(-1/sqrt(in), 1/sqrt(in))")
  ok(math.abs(one:get("0").weight:std():item() - 1) < 0.3, "Embedding: N(0, 1)")
  eq(one:get("1").weight:sum():item(), 8, "LayerNorm: weight 1")
end)

test("a Lua module's __init initialization is replayed when a deferred build is materialized", function()
  local Net = pt.nn.Module("InitNet")
  function Net:__init()
    self.emb = pt.nn.Embedding(40, 16)
    pt.nn.init.normal_(self.emb.weight, 0, 0.02)
    self.fc = pt.nn.Linear(16, 16)
    pt.nn.init.zeros_(self.fc.bias)
    pt.nn.init.xavier_uniform_(self.fc.weight, 2)
    pt.no_grad(function() self.fc.weight:mul_(0.5):add_(1) end)
    self.head = pt.nn.Linear(16, 40, { bias = false })
    self.head.weight = self.emb.weight
    self:register_parameter("scale", pt.zeros({ 16 }):to("meta"))
    pt.nn.init.ones_(self.scale)  -- a Lua module's own meta parameter, set whole: initialized by name
  end
  function Net:forward(x) return self.head(self.fc(self.emb(x)) * self.scale) end
  pt.manual_seed(8)
  local m = pt.deferred(function() return Net() end):materialize()
  local std = m.emb.weight:std():item()
  ok(math.abs(std - 0.02) < 0.004, "normal_(0, 0.02) kept, not Embedding's N(0, 1): std " .. std)
  eq(m.fc.bias:abs():sum():item(), 0, "zeros_ kept")
  local bound = 2 * math.sqrt(6 / 32)  -- xavier_uniform_ with gain 2, then * 0.5 + 1
  local w = m.fc.weight
  ok(w:min():item() >= 1 - bound / 2 and w:max():item() <= 1 + bound / 2 and w:max():item() > 1 + 0.8 * bound / 2,
     "xavier_uniform_, mul_, add_ replayed in order")
  ok(m.head.weight:equal(m.emb.weight), "the tie holds the embedding's initialization")
  eq(m.scale:sum():item(), 16, "ones_ on the module's own meta parameter")
  pt.manual_seed(8)
  same(pt.deferred(function() return Net() end):materialize(), m, "the same deferred build, again")
  -- Built normally, the same initializers run at once on real tensors.
  pt.manual_seed(8)
  local real = pt.nn.Linear(16, 16)
  pt.nn.init.kaiming_normal_(real.weight, { mode = "fan_out", nonlinearity = "relu" })
  local kstd = real.weight:std():item()
  ok(math.abs(kstd - math.sqrt(2 / 16)) < 0.05, "kaiming_normal_ fan_out relu: std " .. kstd)
end)

test("in-place ops a deferred build cannot replay are refused, naming them", function()
  local function refused(body, what)
    raises(function() pt.deferred(function() local l = pt.nn.Linear(4, 4); body(l); return l end) end, what)
  end
  refused(function(l) pt.no_grad(function() l.weight:copy_(pt.ones(4, 4)) end) end,
          "copy_ (of another tensor's values) on a meta tensor of a deferred build cannot be replayed")
  refused(function(l) pt.no_grad(function() l.weight:mul_(pt.ones(4, 4)) end) end, "mul_ by a tensor on a meta tensor")
  refused(function(l) pt.no_grad(function() l.weight:narrow(0, 0, 2):fill_(1) end) end,
          "fill_: an in-place initialization of part of a meta tensor")
  refused(function(l) l.weight:mul_(2) end, "leaf Variable that requires grad")  -- as when built normally
  refused(function(l) pt.no_grad(function() l.weight:fill_(true) end) end, "fill_ with a value that is not a number")
  -- Outside a deferred build the same methods take what they always took.
  local flags = pt.zeros({ 2 }, { dtype = "bool" })
  flags:fill_(true)
  eq(flags:sum():item(), 2, "fill_(true) on a bool tensor")
  local t = pt.zeros({ 2 })
  t:add_(pt.ones(2)):mul_(pt.ones(2) * 3)
  eq(t:sum():item(), 6, "add_ and mul_ of tensors on real tensors")
end)

test("what cannot be initialized by name is refused, naming it", function()
  local Scale = pt.nn.Module("Scale")
  function Scale:__init() self:register_parameter("s", pt.zeros({ 2 }):to("meta")) end
  function Scale:forward(x) return x * self.s end
  local m = pt.deferred(function() return pt.nn.Sequential(pt.nn.Linear(2, 2), Scale()) end)
  raises(function() m:materialize() end, "Scale cannot initialize its tensor 's'")
  raises(function() pt.deferred(function() return 3 end) end, "returned number, not a model")
  raises(function() pt.deferred(function() error("broken build") end) end, "broken build")
  -- A forward before materialize had printed LibTorch's dispatcher dump.
  local unmade = pt.deferred(function() return pt.models.mlp { sizes = { 4, 3 } } end)
  raises(function() unmade(pt.randn(2, 4)) end, "Linear(4, 3)'s weight is on the meta device (built inside pt.deferred)")
  local lm = pt.deferred(function() return pt.models.gpt2(small) end)
  raises(function() lm(pt.tensor({ { 1, 2 } }, { dtype = "int64" })) end, "call model:materialize() first")
  -- Whatever happened inside, layers made afterwards are real again.
  eq(pt.nn.Linear(2, 2).weight.device, "cpu", "deferral ends with pt.deferred")
end)

test("a model larger than the machine's memory is refused before anything is allocated; deferred it is built", function()
  -- 3 * 2^40 elements in c_attn alone: more than any machine this runs on. Allocated, Linux's
  -- out-of-memory killer would end the process part-way, with no message.
  local huge = { vocab = 50, seq = 16, dim = 2 ^ 20, heads = 1, layers = 1 }
  raises(function() pt.models.gpt2(huge) end, "the GPT2 model takes 1.32e+13 elements")
  raises(function() pt.models.gpt2(huge) end, "build it smaller, or inside pt.deferred")
  local meta = pt.deferred(function() return pt.models.gpt2(huge) end)
  ok(meta:is_meta(), "deferred: on the meta device, holding no memory")
  raises(function() meta:materialize() end, "more than this machine's")
  -- A mistyped count is refused at once rather than building 2^32 blocks.
  raises(function() pt.models.gpt2 { vocab = 50, seq = 16, dim = 8, heads = 1, layers = 2 ^ 32 + 1 } end,
         "gpt2: layers must be at most 65536, got 4294967297")
  raises(function() pt.models.llama { vocab = 50, seq = 16, dim = 8, heads = 1, layers = 65537 } end,
         "llama: layers must be at most 65536, got 65537")
end)

H.run()
