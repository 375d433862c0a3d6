-- Modules from Lua: built-in layers, the module tree and its dotted names, state dicts, modes,
-- and Lua-defined modules whose parameters and children are real engine nodes.
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, eq, near, raises, ok = H.test, H.eq, H.near, H.raises, H.ok

test("Linear computes x W^T + b with PyTorch's layout", function()
  local l = pt.nn.Linear(3, 2)
  eq(table.concat(l.weight.shape, ","), "2,3")
  local x = pt.randn(4, 3)
  near(l(x), x:matmul(l.weight:t()) + l.bias, 1e-6)
  eq(pt.nn.Linear(3, 2, { bias = false }).bias, nil, "no bias when bias = false")
  raises(function() pt.nn.Linear(3, 2, { biass = false }) end, "unknown option 'biass' for Linear (expected: bias)")
  raises(function() pt.nn.Linear(3, 2, { bias = 1 }) end, "option 'bias' for Linear must be a boolean, got number 1")
  raises(function() l(pt.randn(4, 5)) end, "Linear(3, 2) expects input (..., 3), got [4, 5]")
end)

test("Embedding, LayerNorm and Dropout behave as in PyTorch", function()
  local e = pt.nn.Embedding(10, 4)
  local ids = pt.tensor({ { 1, 2 }, { 3, 9 } }, { dtype = "int64" })
  near(e(ids):select(0, 1):select(0, 1), e.weight:select(0, 9))
  raises(function() e(pt.randn(2)) end, "integer ids")
  -- LibTorch said "index out of range in self"
  raises(function() e(pt.tensor({ 0, 10 }):long()) end, "Embedding(10, 4): id 10 is out of range (ids are 0 to 9)")
  raises(function() e(pt.tensor({ -1, 3 }):int()) end, "Embedding(10, 4): id -1 is out of range")
  local ln = pt.nn.LayerNorm(4)
  local y = ln(pt.randn(3, 4) * 5 + 2)
  near(y:mean(-1), pt.zeros(3), 1e-5)
  near(y:var(-1):sqrt(), pt.ones(3) * math.sqrt(4 / 3), 1e-3, "unbiased variance of a normalized row of 4")
  near(y:var(-1, false), pt.ones(3), 1e-3, "biased variance 1")
  local d = pt.nn.Dropout(0.5)
  local x = pt.ones(1000)
  local dropped = d(x):eq(0):sum():item()
  ok(dropped > 400 and dropped < 600, "about half dropped in training: " .. dropped)
  d:eval()
  ok(d(x):equal(x), "identity in eval")
end)

test("Sequential and activations chain; the tree has dotted names", function()
  local m = pt.nn.Sequential(pt.nn.Linear(4, 8), pt.nn.ReLU(), pt.nn.Sequential(pt.nn.Linear(8, 2), pt.nn.Tanh()))
  local names = {}
  for name in m:named_parameters() do names[#names + 1] = name end
  eq(table.concat(names, " "), "0.weight 0.bias 2.0.weight 2.0.bias")
  local paths = {}
  for path, mod in m:named_modules() do paths[#paths + 1] = path .. "=" .. mod:type() end
  eq(table.concat(paths, " "), "=Sequential 0=Linear 1=ReLU 2=Sequential 2.0=Linear 2.1=Tanh")
  eq(m:get("2.0"):type(), "Linear")
  eq(m:get("2.9"), nil)
  eq(m:num_parameters(), 4 * 8 + 8 + 8 * 2 + 2)
  local y = m(pt.randn(5, 4))
  eq(table.concat(y.shape, ","), "5,2")
  ok(tostring(m):find("%(2%): Sequential%("), tostring(m))
end)

test("a list's children are indexed by integer as PyTorch's ModuleList[0] is: model.h[0] is model.h[\"0\"]", function()
  local model = pt.models.gpt2 { vocab = 16, seq = 4, dim = 8, heads = 2, layers = 3 }
  ok(model.h[0] == model.h["0"], "h[0] is the child named 0")
  ok(model.h[2] == model:get("h.2"), "h[2] is the child named 2")
  eq(model.h[0].attn.c_attn.weight.shape[1], 24, "a path through an integer index reaches the parameter")
  raises(function() return model.h[3] end, "has no field, method, parameter or child '3'")
  eq(model.h[-1], nil, "a negative index is no child name")
  eq(model.h[0.5], nil, "a fraction is no child name")
  local seq = pt.nn.Sequential(pt.nn.Linear(2, 3), pt.nn.ReLU())
  eq(seq[1]:type(), "ReLU", "a Sequential's children too")
end)

test("the same module is the same Lua value", function()
  local m = pt.nn.Sequential(pt.nn.Linear(2, 2))
  ok(m:get("0") == m:get("0"), "identity holds")
end)

test("state_dict and load_state_dict round-trip and name every problem", function()
  pt.manual_seed(1)
  local a = pt.models.mlp { sizes = { 4, 8, 2 } }
  pt.manual_seed(2)
  local b = pt.models.mlp { sizes = { 4, 8, 2 } }
  ok(not a["0"].weight:equal(b["0"].weight), "different seeds, different weights")
  b:load_state_dict(a:state_dict())
  ok(a["0"].weight:equal(b["0"].weight), "weights copied")
  local sd = a:state_dict()
  sd["2.bias"] = nil
  sd["extra"] = pt.zeros(1)
  raises(function() b:load_state_dict(sd) end, "missing '2.bias'; unexpected 'extra'")
  b:load_state_dict(sd, false)  -- not strict: missing and unexpected keys are allowed
  local bad = a:state_dict()
  bad["0.weight"] = pt.zeros(3, 3)
  raises(function() b:load_state_dict(bad) end, "'0.weight' has shape [3, 3] but the model expects [8, 4]")
end)

test("train/eval, to(dtype) and zero_grad apply to the whole tree", function()
  local m = pt.nn.Sequential(pt.nn.Linear(2, 2), pt.nn.Dropout(0.1))
  m:eval()
  ok(not m:get("1"):is_training(), "eval reaches children")
  m:train()
  ok(m:get("1"):is_training())
  m:to("float64")
  eq(m:get("0").weight.dtype, "float64")
  m(pt.randn(3, 2, { dtype = "float64" })):sum():backward()
  ok(m:get("0").weight.grad ~= nil)
  m:zero_grad()
  eq(m:get("0").weight.grad, nil)
end)

-- A Lua-defined module: y = scale * relu(fc(x)) + shift, with a child, two parameters and a field.
local Block = pt.nn.Module "Block"
function Block:__init(dim)
  self.fc = pt.nn.Linear(dim, dim)
  self.scale = pt.nn.Parameter(pt.ones(dim) * 2)
  self.shift = pt.nn.Parameter(pt.zeros(dim))
  self.note = "plain field"
end
function Block:forward(x) return self.fc(x):relu() * self.scale + self.shift end

test("a Lua-defined module's parameters and children are engine nodes", function()
  local b = Block(3)
  eq(b:type(), "Block")
  eq(b.note, "plain field")
  local names = {}
  for name in b:named_parameters() do names[#names + 1] = name end
  table.sort(names)
  eq(table.concat(names, " "), "fc.bias fc.weight scale shift")
  eq(b:get("fc"):type(), "Linear")
  local sd = b:state_dict()
  ok(sd.scale and sd["fc.weight"], "state_dict holds Lua-registered parameters")
end)

test("a Lua-defined module's gradients match autograd of the same math written directly", function()
  pt.manual_seed(3)
  local b = Block(3)
  local x = pt.randn(5, 3)
  local loss = b(x):pow(2):sum()
  loss:backward()
  -- The same math on plain tensors.
  local W = b.fc.weight:detach():requires_grad_()
  local bias = b.fc.bias:detach():requires_grad_()
  local scale = b.scale:detach():requires_grad_()
  local shift = b.shift:detach():requires_grad_()
  local direct = ((x:matmul(W:t()) + bias):relu() * scale + shift):pow(2):sum()
  direct:backward()
  near(loss, direct, 1e-6, "loss")
  near(b.fc.weight.grad, W.grad, 1e-6, "fc.weight grad")
  near(b.fc.bias.grad, bias.grad, 1e-6, "fc.bias grad")
  near(b.scale.grad, scale.grad, 1e-6, "scale grad")
  near(b.shift.grad, shift.grad, 1e-6, "shift grad")
end)

test("Lua-defined modules nest inside C++ containers and inherit", function()
  local seq = pt.nn.Sequential(Block(4), pt.nn.Linear(4, 1))
  eq(table.concat(seq(pt.randn(2, 4)).shape, ","), "2,1", "C++ Sequential runs the Lua forward")
  local Scaled = pt.nn.Module("Scaled", Block)
  function Scaled:__init(dim) Block.__init(self, dim); self.extra = pt.nn.Linear(dim, dim) end
  function Scaled:forward(x) return self.extra(Block.forward(self, x)) end
  local s = Scaled(4)
  eq(s:type(), "Scaled")
  eq(table.concat(s(pt.randn(2, 4)).shape, ","), "2,4")
  ok(s:get("extra") and s:get("fc"), "children of parent and child class")
end)

test("errors in Lua forwards and misuse of modules are reported with their place", function()
  local Bad = pt.nn.Module "Bad"
  function Bad:forward(x) error("bad forward") end
  local err = raises(function() local y = pt.nn.Sequential(Bad())(pt.ones(1)); return y end, "bad forward")
  ok(err:find("test_nn.lua:%d+: bad forward"), err)
  local NoForward = pt.nn.Module "NoForward"
  raises(function() local y = pt.nn.Sequential(NoForward())(pt.ones(1)); return y end, "NoForward has no forward method")
  local Returns = pt.nn.Module "Returns"
  function Returns:forward() return 42 end
  raises(function() local y = pt.nn.Sequential(Returns())(pt.ones(1)); return y end, "returned a number where its caller needs a tensor")
  local lin = pt.nn.Linear(2, 2)
  raises(function() lin.foo = 1 end, "cannot set field 'foo' on built-in module Linear")
  raises(function() return lin.nothing end, "Linear has no field, method, parameter or child 'nothing'")
  raises(function() lin.weight = "x" end, "cannot replace Linear.weight with a string")
  raises(function() pt.nn.Module(3) end, "expects a type name")
  raises(function() pt.nn.GELU { approximate = "fast" } end, "approximate must be 'none' or 'tanh'")
end)

test("a replaced forward that calls itself stops with a clean error naming the module, not a crash", function()
  local lin = pt.nn.Linear(2, 2)
  lin:replace_forward(function(self, x) local y = self(x); return y end)
  local err = raises(function() local y = lin(pt.ones(1, 2)); return y end,
    "stack overflow: the replaced forward of Linear runs 200 levels deep")
  ok(err:find("test_nn.lua:%d+: stack overflow"), "names the line: " .. err)
  -- Through C++ parents too, and the depth is counted back down: the module works again after.
  local seq = pt.nn.Sequential(lin)
  raises(function() local y = seq(pt.ones(1, 2)); return y end, "stack overflow")
  lin:replace_forward(function(self, x) local y = self:own_forward(x); return y * 2 end)
  near(seq(pt.ones(1, 2)), lin:own_forward(pt.ones(1, 2)) * 2, 1e-6, "works after the overflow")
  -- 150 nested Lua-defined modules run under C++ parents are not a recursion: they still run.
  local Wrap = pt.nn.Module "Wrap"
  function Wrap:__init(inner) self.inner = inner end
  function Wrap:forward(x) local y = self.inner(x); return y + 1 end
  local inner = pt.nn.Linear(2, 2)
  local m = inner
  for _ = 1, 150 do m = pt.nn.Sequential(Wrap(m)) end
  near(m(pt.zeros(1, 2)), inner.bias:view(1, 2) + 150, 1e-5, "150 levels deep")
end)

test("shared parameters count and train once", function()
  local l = pt.nn.Linear(2, 2, { bias = false })
  local m = pt.nn.Sequential(l, pt.nn.ReLU(), l)
  eq(m:num_parameters(), 4, "a reused layer counts once")
  local before = l.weight:clone()
  local opt = pt.optim.sgd(m, { lr = 0.1 })
  local loss = m(pt.ones(1, 2)):sum()
  loss:backward()
  local grad = l.weight.grad:clone()
  opt:step()
  near(l.weight, before - grad * 0.1, 1e-6, "updated once, not twice")
end)

test("the tree refuses cycles; Sequential names never collide", function()
  local s = pt.nn.Sequential(pt.nn.Linear(2, 2))
  raises(function() s:add(s) end, "the tree would contain itself")
  local outer = pt.nn.Sequential(s)
  raises(function() s:add(outer) end, "the tree would contain itself")
  local a, b, c = pt.nn.ReLU(), pt.nn.Tanh(), pt.nn.Sigmoid()
  local seq = pt.nn.Sequential(a)
  seq:add("2", b)
  seq:add(c)
  eq(seq:get("2"):type(), "Tanh", "add(m) does not replace a child named by add(name, m)")
  eq(seq:get("3"):type(), "Sigmoid", "the next free index")
end)

test("parameters and buffers: replaced in place, leaves only, Lua fields give way", function()
  local M = pt.nn.Module "WithBuffer"
  function M:__init() self:register_buffer("mask", pt.ones(2)) end
  local m = M()
  m:register_buffer("mask", pt.zeros(2))
  eq(m.mask:sum():item(), 0, "register_buffer twice replaces")
  m.mask = pt.full({ 2 }, 3)
  eq(m.mask:sum():item(), 6, "assigning to a buffer replaces it")
  m.proj = false
  m.proj = pt.nn.Linear(2, 2)
  eq(m.proj:type(), "Linear", "a child replaces an old plain field of the same name")
  local lin = pt.nn.Linear(2, 2)
  raises(function() lin.weight = lin.weight * 2 end, "must be a leaf tensor")
  local plain = pt.ones(2, 2)
  lin.weight = plain
  ok(not plain.requires_grad, "the caller's tensor is left as it was")
  ok(lin.weight.requires_grad, "the parameter trains")
  local nobias = pt.nn.Linear(2, 2, { bias = false })
  nobias.bias = pt.zeros(2)
  ok(nobias.bias ~= nil, "an empty slot takes a parameter")
end)

test("a module made inside a coroutine outlives it", function()
  local Tiny = pt.nn.Module "Tiny"
  function Tiny:__init() self.fc = pt.nn.Linear(1, 1); self.tag = "t" end
  function Tiny:forward(x) return self.fc(x) end
  local m = coroutine.wrap(function() return Tiny() end)()
  collectgarbage()
  local seq = pt.nn.Sequential(m)
  eq(seq(pt.ones(1, 1)).shape[1], 1)
  eq(m.tag, "t")
  m, seq = nil, nil
  collectgarbage()
end)

test("option errors list each key once and say when there are none", function()
  raises(function() pt.zeros(2, { dtype = "float32", nope = 1 }) end, "(expected: dtype, device, requires_grad)")
  raises(function() pt.nn.Embedding(2, 2, { x = 1 }) end, "for Embedding (it takes no options)")
  raises(function() pt.models.mlp { sizes = { 2, "x" } } end, "element 2 is a string")
end)

test("losses: cross_entropy and mse", function()
  local logits = pt.tensor { { 2.0, 0.5, -1.0 }, { 0.1, 0.2, 3.0 } }
  local y = pt.tensor({ 0, 2 }):long()
  local manual = -(logits:log_softmax(1):gather(1, y:view(2, 1))):mean()
  near(pt.nn.cross_entropy(logits, y), manual, 1e-6)
  near(pt.nn.cross_entropy(logits, pt.tensor({ 0, -100 }):long()), -(logits:log_softmax(1):select(0, 0):select(0, 0)), 1e-6,
    "ignore_index")
  near(pt.nn.mse(pt.tensor { 1.0, 2.0 }, pt.tensor { 0.0, 0.0 }), pt.tensor(2.5))
  raises(function() pt.nn.cross_entropy(logits, pt.tensor { 0.5, 1.5 }) end, "integer class ids")
  raises(function() pt.nn.cross_entropy(logits, pt.tensor { true, false }) end, "integer class ids, got bool")
  -- int32 ids, as the embedding takes them (LibTorch's kernel had said "expected scalar type Long but found Int")
  eq(pt.nn.cross_entropy(logits, y:to("int32")):item(), pt.nn.cross_entropy(logits, y):item(), "int32 targets")
  raises(function() pt.nn.mse(pt.ones(2), pt.ones(3)) end, "equal shapes")
  -- A class id out of range is refused by partrain, before LibTorch's kernel: on a GPU that
  -- kernel stops the device (a device-side assert); on the CPU it said "Target 3 is out of bounds."
  local msg = "cross_entropy: target 3 is out of range for 3 classes (targets are 0 to 2, or ignore_index=-100)"
  raises(function() pt.nn.cross_entropy(logits, pt.tensor({ 0, 3 }):long()) end, msg)
  raises(function() pt.nn.cross_entropy(logits, pt.tensor({ -1, 3 }):long()) end, "target -1 is out of range")
  raises(function() pt.nn.cross_entropy(logits, pt.tensor({ 7, 0 }):long(), { ignore_index = 0 }) end,
    "target 7 is out of range for 3 classes (targets are 0 to 2, or ignore_index=0)")
  near(pt.nn.cross_entropy(logits, pt.tensor({ 7, 0 }):long(), { ignore_index = 7 }),
    -(logits:log_softmax(1):select(0, 1):select(0, 0)), 1e-6, "the ignored id may be out of range")
end)

test("a Linear given another dtype than its weights' names both and the two ways out", function()
  local l = pt.nn.Linear(4, 3)
  -- LibTorch's own text was "mat1 and mat2 must have the same dtype"
  raises(function() l(pt.randn({ 2, 4 }):double()) end,
    'Linear(4, 3) holds float32 weights; its input is float64: convert the input (x:to("float32")) or the model '
    .. '(model:to("float64"))')
  eq(l(pt.randn({ 2, 4 })):size(1), 3, "the same dtype runs")
end)

test("pt.models holds one constructor a registered family, and names a model's family", function()
  local names = {}
  for name in pairs(pt.models) do names[#names + 1] = name end
  table.sort(names)
  eq(table.concat(names, ","), "gpt2,llama,mlp", "the families")
  local f = pt.model_family(pt.models.gpt2 { vocab = 8, seq = 4, dim = 4, heads = 2, layers = 1 })
  eq(f and f.name, "gpt2", "gpt2's family")
  eq(f.type, "GPT2", "its root type")
  eq(f.policy, "policies.gpt2", "its default policy")
  eq(pt.model_family(pt.models.mlp { sizes = { 2, 2 } }).policy, "policies.mlp", "mlp's default policy")
  eq(pt.model_family(pt.nn.Linear(2, 2)), nil, "a layer is no family's model")
  raises(function() pt.models.mlp { sizes = { 2, 2 }, width = 3 } end, "unknown option 'width' for mlp")
end)

test("pt shows its documented functions and keeps the library's internals inside", function()
  for _, name in ipairs { "tensor", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange",
                          "linspace", "eye", "zeros_like", "ones_like", "randn_like", "cat", "stack", "where",
                          "is_tensor", "manual_seed", "no_grad", "grad_enabled", "get_threads", "set_threads",
                          "cuda_available", "device", "time", "cpu_time", "memory" } do
    eq(type(pt[name]), "function", "pt." .. name)
  end
  for _, name in ipairs { "_where", "now", "repl_readline", "repl_start", "string_to_tensor", "reset_peak" } do
    eq(pt[name], nil, "pt." .. name .. " is internal")
  end
end)

-- An optimizer made before a layer or parameter is replaced would go on stepping the old tensors
-- (the new layer moved by 0, exit 0): the replacement is refused while it lives.
test("a layer or parameter a live optimizer steps cannot be replaced", function()
  local m = pt.nn.Sequential(pt.nn.Linear(4, 8), pt.nn.ReLU(), pt.nn.Linear(8, 2))
  local opt = pt.optim.sgd(m, { lr = 0.1 })
  raises(function() m:set("0", pt.nn.Linear(4, 8)) end,
    "cannot replace Sequential.0: a live optimizer steps its parameter 'weight'")
  raises(function() m:get("0").weight = pt.ones(8, 4):requires_grad_(true) end,
    "cannot replace Linear.weight: a live optimizer steps 'weight'")
  ok(opt, "the optimizer is alive")
  opt = nil
  m:set("0", pt.nn.Linear(4, 8))  -- once it is gone (collected), the model may change
  ok(m:get("0"), "replaced after the optimizer was dropped")
end)

H.run()
