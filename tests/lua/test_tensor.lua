-- Tensors from Lua: creation, shapes, views, arithmetic, reductions, comparisons, activations,
-- conversion to Lua values, autograd, and the errors bad arguments give.
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, eq, near, raises, ok = H.test, H.eq, H.near, H.raises, H.ok

test("creation from nested tables infers shape and dtype", function()
  local t = pt.tensor { { 1, 2, 3 }, { 4, 5, 6 } }
  eq(t.dtype, "float32", "numbers become float32 (Lua cannot tell 1 from 1.0)")
  eq(t:dim(), 2); eq(t.shape[1], 2); eq(t.shape[2], 3); eq(t:numel(), 6)
  eq(pt.tensor({ 1, 2 }, { dtype = "int64" }).dtype, "int64", "dtype option")
  eq(pt.tensor({ true, false }).dtype, "bool")
  eq(pt.tensor({ 1, 2 }, { dtype = "float64" }).dtype, "float64")
  eq(pt.tensor(3.5):item(), 3.5, "a number makes a 0-dim tensor")
  raises(function() pt.tensor { { 1, 2 }, { 3 } } end, "ragged")
  raises(function() pt.tensor { "a" } end, "numbers or booleans")
end)

test("factories take shapes as numbers or tables, and options", function()
  eq(table.concat(pt.zeros(2, 3).shape, ","), "2,3")
  eq(table.concat(pt.ones({ 4, 1 }).shape, ","), "4,1")
  eq(pt.full({ 2 }, 7):sum():item(), 14)
  eq(pt.arange(5):sum():item(), 10)
  eq(pt.arange(5).dtype, "int64")
  eq(pt.arange(0, 1, 0.25):numel(), 4)
  eq(pt.zeros(2, { dtype = "int32" }).dtype, "int32")
  ok(pt.randn(3, { requires_grad = true }).requires_grad, "requires_grad option")
  local r = pt.randint(0, 10, { 100 })
  ok(r:min():item() >= 0 and r:max():item() < 10, "randint bounds")
  eq(pt.eye(3):sum():item(), 3)
  raises(function() pt.zeros(2, { dtpye = "int32" }) end, "unknown option 'dtpye'")
  raises(function() pt.zeros(2, { dtype = "int33" }) end, "unknown dtype 'int33'")
end)

test("manual_seed makes random tensors repeatable", function()
  pt.manual_seed(42); local a = pt.randn(5)
  pt.manual_seed(42); local b = pt.randn(5)
  ok(a:equal(b), "same seed, same numbers")
  ok(not a:equal(pt.randn(5)), "the stream moves on")
end)

test("views: view, reshape, transpose, permute, narrow, select, index_select", function()
  local t = pt.arange(24):view(2, 3, 4)  -- int64, as in PyTorch
  eq(table.concat(t:reshape({ 6, 4 }).shape, ","), "6,4")
  eq(table.concat(t:transpose(0, 2).shape, ","), "4,3,2")
  eq(table.concat(t:permute(2, 0, 1).shape, ","), "4,2,3")
  ok(not t:transpose(0, 1):is_contiguous() and t:transpose(0, 1):contiguous():is_contiguous())
  eq(t:narrow(2, 1, 2):sum():item(), pt.tensor({ 1, 2, 5, 6, 9, 10, 13, 14, 17, 18, 21, 22 }):sum():item())
  eq(t:select(0, 1):select(0, 0):select(0, 0):item(), 12, "select counts from 0")
  eq(t:select(2, -1):sum():item(), 3 + 7 + 11 + 15 + 19 + 23, "negative index counts from the end")
  eq(t:index_select(1, pt.tensor({ 2, 0 }):long()):select(1, 0):sum():item(), 8 + 9 + 10 + 11 + 20 + 21 + 22 + 23)
  eq(t:size(-1), 4)
  eq(#t, 2, "# is the first dimension")
end)

test("cat, stack, chunk, split", function()
  local a, b = pt.ones(2, 3), pt.zeros(2, 3)
  eq(table.concat(pt.cat({ a, b }, 0).shape, ","), "4,3")
  eq(table.concat(pt.cat({ a, b }, 1).shape, ","), "2,6")
  eq(table.concat(pt.stack({ a, b }).shape, ","), "2,2,3")
  local parts = pt.arange(10):chunk(3)
  eq(#parts, 3); eq(parts[1]:numel(), 4)
  local s = pt.arange(10):split(4)
  eq(#s, 3); eq(s[3]:numel(), 2)
  local w = pt.arange(10):split({ 3, 7 })
  eq(w[2]:sum():item(), 3 + 4 + 5 + 6 + 7 + 8 + 9)
end)

test("arithmetic through metamethods and methods, numbers on either side", function()
  local a = pt.tensor { 1.0, 2.0, 3.0 }
  near((a + 1), { 2, 3, 4 }); near((1 + a), { 2, 3, 4 })
  near((a - 1), { 0, 1, 2 }); near((10 - a), { 9, 8, 7 })
  near((a * a), { 1, 4, 9 }); near((6 / a), { 6, 3, 2 })
  near((a ^ 2), { 1, 4, 9 }); near(-a, { -1, -2, -3 })
  near(a:add(a, 2), { 3, 6, 9 }, nil, "add with alpha")
  near(a:exp():log(), a, 1e-6)
  near(a:clamp(1.5, 2.5), { 1.5, 2, 2.5 })
  local m = pt.tensor { { 1.0, 2.0 }, { 3.0, 4.0 } }
  near(m:matmul(m), { { 7, 10 }, { 15, 22 } })
  near(m:t(), { { 1, 3 }, { 2, 4 } })
end)

test("reductions over everything, one dim, or several", function()
  local t = pt.arange(6, { dtype = "float32" }):view(2, 3)
  eq(t:sum():item(), 15)
  near(t:sum(0), { 3, 5, 7 }); near(t:sum(1), { 3, 12 })
  eq(table.concat(t:sum(1, true).shape, ","), "2,1", "keepdim")
  near(t:mean({ 0, 1 }), pt.tensor(2.5))
  local values, indices = t:max(1)
  near(values, { 2, 5 }); near(indices, { 2, 2 })
  eq(t:argmax():item(), 5)
  near(t:std(), pt.tensor(1.8708287), 1e-5)
end)

test("comparisons give bool tensors", function()
  local a = pt.tensor { 1, 2, 3 }
  eq(a:gt(1).dtype, "bool")
  eq(a:gt(1):sum():item(), 2)
  eq(a:eq(pt.tensor { 1, 0, 3 }):totable()[2], false)
  ok(a:le(3):all():item(), "all")
  ok(a:allclose(a:long():float()), "allclose")
end)

test("activations match their formulas", function()
  local x = pt.tensor { -2.0, -0.5, 0.0, 0.5, 2.0 }
  near(x:relu(), { 0, 0, 0, 0.5, 2 })
  near(x:sigmoid(), (1 + (-x):exp()) ^ -1, 1e-6)
  near(x:tanh(), ((x * 2):exp() - 1) / ((x * 2):exp() + 1), 1e-6)
  near(x:softmax(0):sum(), pt.tensor(1.0), 1e-6)
  near(x:log_softmax(0):exp(), x:softmax(0), 1e-6)
  local c = math.sqrt(2 / math.pi)
  near(x:gelu("tanh"), x * 0.5 * (1 + ((x + x ^ 3 * 0.044715) * c):tanh()), 1e-6)
end)

test("item and totable return Lua values", function()
  eq(pt.tensor(2.5):item(), 2.5)
  eq(pt.tensor(true):item(), true)
  local t = pt.tensor({ { 1, 2 }, { 3, 4 } }):totable()
  eq(#t, 2); eq(t[2][1], 3)
  raises(function() pt.ones(2):item() end, "one element")
end)

test("autograd: backward fills grad; no_grad turns it off", function()
  local w = pt.tensor({ 1.0, 2.0, 3.0 }, { requires_grad = true })
  local loss = (w * w):sum()
  loss:backward()
  near(w.grad, { 2, 4, 6 })
  ok(w.is_leaf and w.requires_grad)
  w.grad = nil
  eq(w.grad, nil, "grad can be cleared")
  local y = pt.no_grad(function() return w * 2 end)
  ok(not y.requires_grad, "no_grad result has no history")
  ok(pt.grad_enabled(), "grad mode restored")
  raises(function() pt.no_grad(function() error("inside") end) end, "inside")
  ok(pt.grad_enabled(), "grad mode restored after an error")
end)

test("dtype and device conversion", function()
  local t = pt.ones(2)
  eq(t:to("float64").dtype, "float64")
  eq(t:long().dtype, "int64")
  eq(t:to("cpu").device, "cpu")
  eq(t:to(pt.zeros(1, { dtype = "int32" })).dtype, "int32")
  raises(function() t:to("tpu") end, "unknown device or dtype 'tpu'")
end)

test("bad arguments name the argument, the function and the script line", function()
  local err = raises(function() local x = pt.ones(2):matmul(3); return x end, "bad argument #2 to 'matmul' (tensor expected, got number)")
  ok(err:find("test_tensor.lua:%d+:"), "message starts with file:line: " .. err)
  raises(function() local x = pt.ones(2, 3):matmul(pt.ones(2, 3)); return x end, "cannot be multiplied")
  raises(function() local x = pt.ones(2):view(3); return x end, "invalid for input of size 2")
  raises(function() local x = pt.ones(2):relU(); return x end, "no method or field 'relU'")
  raises(function() local x = pt.ones(2):sum("a"); return x end, "bad argument #2 to 'sum'")
  raises(function() local x = pt.ones(2)[1]; return x end, "not indexed with []")
end)

test("numbers join arithmetic with PyTorch's type promotion", function()
  near(pt.arange(4) * 0.5, { 0, 0.5, 1, 1.5 }, 1e-9, "int64 * 0.5 is float")
  eq((pt.arange(4) * 0.5).dtype, "float32")
  eq((pt.arange(4) * 2).dtype, "int64", "int64 * 2 stays int64")
  eq(pt.arange(5):lt(2.5):sum():item(), 3, "compares against 2.5, not 2")
  eq((pt.ones(2, { dtype = "float16" }) * 3).dtype, "float16", "a number does not widen float16")
  eq((1 - pt.arange(3)):totable()[3], -1)
end)

test("malformed tables and misuse of finalizers are errors, not crashes", function()
  raises(function() pt.tensor { 1, { 2 } } end, "ragged")
  raises(function() pt.tensor { { 1 }, { { 2 } } } end, "ragged")
  local loop = {}
  loop[1] = loop
  raises(function() pt.tensor(loop) end, "nested more than 32 deep")
  local t = pt.ones(2)
  local gc = getmetatable(t).__gc
  gc(5)                                   -- not a tensor: ignored
  gc(pt.nn.Linear(2, 2))                  -- another type: ignored
  gc(t)                                   -- finalized by hand...
  raises(function() return pt.Tensor.sum(t) end, "tensor expected, got userdata")   -- ...then unusable
  raises(function() return t:sum() end, "attempt to index")
end)

test("tostring shows shape, dtype and values", function()
  local s = tostring(pt.tensor { 1.5, 2.5 })
  ok(s:find("tensor%(%[2%], float32%)"), s)
  ok(s:find("1.5"), s)
  -- LibTorch's own footer ("[ CPUFloatType{} ]") is dropped for one number and for no numbers too.
  eq(tostring(pt.tensor(2.5)), "tensor([], float32)\n2.5")
  eq(tostring(pt.zeros { 0, 3 }), "tensor([0, 3], float32)")
  eq(tostring(pt.tensor { 0 / 0, 1 }):find("-nan", 1, true), nil, "a NaN prints nan, as Lua prints it")
end)

-- Into an integer dtype each number as it is: NaN had become -9.2e18, 2^63 INT64_MIN, 1.5 1.
test("pt.tensor into an integer dtype refuses what the dtype cannot hold exactly", function()
  raises(function() pt.tensor({ 1, 0 / 0 }, { dtype = "int64" }) end, "element 2 is NaN, not an integer Long holds")
  raises(function() pt.tensor({ 2 ^ 63 }, { dtype = "int64" }) end, "element 1 is 9.2233720368547758e+18")
  raises(function() pt.tensor({ 1e300 }, { dtype = "int32" }) end, "not an integer Int holds")
  raises(function() pt.tensor({ 1.5 }, { dtype = "int64" }) end, "element 1 is 1.5")
  raises(function() pt.tensor({ 256 }, { dtype = "uint8" }) end, "element 1 is 256, not an integer Byte holds")
  eq(pt.tensor({ -2 ^ 63, 2 ^ 53 }, { dtype = "int64" }):select(0, 1):item(), 2 ^ 53, "the range's ends are taken")
end)

test("a list with other keys beside its elements is refused, never read without them", function()
  -- { 2, 3, dtype = "float64" } had made a float32 2x3 tensor: the key was dropped unseen.
  raises(function() pt.zeros({ 2, 3, dtype = "float64" }) end, "a list of integers expected, but the table also has the key 'dtype'")
  raises(function() pt.ones({ a = 1 }) end, "the table also has the key 'a'")
  raises(function() pt.zeros({ 2, nil, 3 }) end, "the table also has the key [3]")
  raises(function() pt.ones(2, 3):sum({ 0, [5] = 1 }) end, "the table also has the key [5]")
  raises(function() pt.cat({ pt.ones(2), pt.ones(2), dim = 0 }) end, "a list of tensors expected, but the table also has the key 'dim'")
  raises(function() pt.tensor({ { 1, 2 }, { 3, 4, [0] = 1 } }) end, "one also has the key [0]")
  raises(function() pt.tensor({ 1, 2, [true] = 3 }) end, "one also has the key [a boolean]")
  raises(function() pt.nn.ModuleList({ pt.nn.Identity(), x = pt.nn.Identity() }) end, "the table also has the key 'x'")
  raises(function() pt.optim.adamw(pt.models.mlp { sizes = { 2, 2 } }, { betas = { 0.9, 0.99, eps = 1 } }) end,
    "must be a list of numbers, but the table also has the key 'eps'")
  eq(pt.zeros({ 2, 3 }):numel(), 6, "a plain list is a shape")
  eq(pt.tensor({}):numel(), 0, "an empty table is an empty tensor")
end)

H.run()
