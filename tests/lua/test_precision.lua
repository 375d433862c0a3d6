-- Mixed precision in one process: models built in a dtype (equal to the float32 model cast, built
-- deferred too), float16 training on the CPU, float32 master weights (a bfloat16 model with
-- AdamW equals a hand-written float32-master loop bit for bit; a parameter changed in place is
-- noticed), checkpoints of masters and of the loss scaler resuming bit-identically, and loss
-- scaling: a static power-of-two scale changes no bit of training, an injected overflow skips the
-- step (parameters unchanged bit for bit, one report line, the scale halved), training recovers
-- and the scale grows after scale_window good steps; bad options are refused at the caller's line.
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, eq, near, raises, ok = H.test, H.eq, H.near, H.raises, H.ok

local gpt = { vocab = 32, seq = 8, dim = 16, heads = 2, layers = 2 }
local THIS = "test_precision.lua:"

local function batch(seed)
  pt.manual_seed(seed)
  return pt.randint(0, gpt.vocab, { 4, gpt.seq }), pt.randint(0, gpt.vocab, { 4, gpt.seq })
end

local function gpt_loss(model, x, y)
  local out = model(x)
  return pt.nn.cross_entropy(out:reshape(-1, gpt.vocab), y:reshape(-1))
end

-- `t` with `extra`'s keys added (model options are read raw: no metatables).
local function with(t, extra)
  local out = {}
  for k, v in pairs(t) do out[k] = v end
  for k, v in pairs(extra) do out[k] = v end
  return out
end

-- name -> parameter, as a table.
local function params(m)
  local out = {}
  for name, p in m:named_parameters() do out[name] = p end
  return out
end

-- Every parameter of a and b equal bit for bit (as float64, which holds bfloat16 and float32 exactly).
local function same_params(a, b, what)
  local pa, pb = params(a), params(b)
  for name, p in pairs(pa) do
    ok(pb[name], what .. ": " .. name .. " missing")
    eq(p:double():equal(pb[name]:double()), true, what .. ": " .. name .. " differs")
  end
end

test("dtype builds the model in that dtype, equal to the float32 model cast, deferred too", function()
  for _, dtype in ipairs { "bfloat16", "float64", "float32" } do
    pt.manual_seed(3)
    local m = pt.models.gpt2(with(gpt, { dtype = dtype }))
    pt.manual_seed(3)
    local ref = pt.models.gpt2(gpt):to(dtype)
    pt.manual_seed(3)
    local deferred = pt.deferred(function() return pt.models.gpt2(with(gpt, { dtype = dtype })) end)
    ok(deferred:is_meta(), "deferred build is on the meta device")
    deferred:materialize()
    for name, p in pairs(params(m)) do eq(p:type(), params(ref)[name]:type(), dtype .. " " .. name) end
    same_params(m, ref, dtype .. " build vs float32 cast")
    same_params(deferred, ref, dtype .. " deferred vs float32 cast")
  end
  pt.manual_seed(4)
  local mlp = pt.models.mlp { sizes = { 4, 8, 2 }, dtype = "bfloat16" }
  for name, p in pairs(params(mlp)) do eq(p:type(), "bfloat16", "mlp " .. name) end
  local loss = pt.nn.mse(mlp(pt.randn(3, 4):bfloat16()), pt.zeros(3, 2):bfloat16())
  eq(loss:type(), "float32", "mse of bfloat16 computes in float32")
end)

test("a bfloat16 GPT-2 runs forward and backward on this device; its loss is float32", function()
  pt.manual_seed(5)
  local m = pt.models.gpt2 { vocab = gpt.vocab, seq = gpt.seq, dim = gpt.dim, heads = gpt.heads, layers = gpt.layers,
                             dtype = "bfloat16", dropout = 0.1 }
  local x, y = batch(1)
  local loss = gpt_loss(m, x, y)
  eq(loss:type(), "float32", "cross_entropy of bfloat16 logits")
  loss:backward()
  for name, p in pairs(params(m)) do
    ok(p.grad, name .. " has a gradient")
    eq(p.grad:type(), "bfloat16", name .. "'s gradient dtype")
  end
end)

test("bad dtypes are refused at the caller's line", function()
  local err = raises(function() pt.models.gpt2 { vocab = 8, seq = 4, dim = 4, heads = 1, layers = 1, dtype = "fp8" } end,
                     "dtype 'fp8' is not a model dtype (expected float32, float64, bfloat16 or float16; fp32, fp64, bf16 and fp16 name them too)")
  ok(err:find(THIS, 1, true), "names this file: " .. err)
  raises(function() pt.models.mlp { sizes = { 2, 2 }, dtype = 16 } end, "dtype")
end)

test("bf16, fp16, fp32 and fp64 name the model dtypes, and the tensor dtypes, as PyTorch users write them", function()
  for alias, name in pairs { bf16 = "bfloat16", fp16 = "float16", fp32 = "float32", fp64 = "float64" } do
    eq(pt.models.mlp({ sizes = { 2, 2 }, dtype = alias }):parameters()[1]:type(), name, "a model built in " .. alias)
    eq(pt.zeros({ 2 }, { dtype = alias }):type(), name, "a tensor made in " .. alias)
    eq(pt.nn.Linear(2, 2):to(alias).weight:type(), name, "a module converted to " .. alias)
  end
end)

test("a float16 GPT-2 trains wherever it is built (LibTorch 2.11 has float16 kernels on the CPU too)", function()
  pt.manual_seed(3)
  local model = pt.models.gpt2(with(gpt, { dtype = "float16" }))
  local opt = pt.optim.adamw(model, { lr = 1e-2, loss_scale = 1024 })
  local x, y = batch(11)
  local first, last
  for step = 1, 5 do
    opt:zero_grad()
    local loss = gpt_loss(model, x, y)
    opt:scale_loss(loss):backward()
    opt:step()
    first = first or loss:item()
    last = loss:item()
  end
  for name, p in pairs(params(model)) do eq(p:type(), "float16", name .. "'s dtype") end
  ok(last < first, "five float16 steps lower the loss: " .. first .. " -> " .. last)
  local d = pt.deferred(function() return pt.models.mlp { sizes = { 2, 2 }, dtype = "float16" } end)
  eq(d:materialize():parameters()[1]:type(), "float16", "a deferred float16 model materializes")
end)

test("a bfloat16 model with AdamW equals a hand-written float32-master loop bit for bit", function()
  local opts = { lr = 1e-2, weight_decay = 0.1, clip_grad_norm = 0.5 }
  local function build()
    pt.manual_seed(7)
    return pt.models.gpt2(with(gpt, { dtype = "bfloat16" }))
  end
  local auto, hand = build(), build()
  local opt = pt.optim.adamw(auto, opts)
  -- The reference: float32 copies of the parameters, an optimizer over them, casts by hand.
  local plist, masters = {}, {}
  for _, p in ipairs(hand:parameters()) do  -- a tied tensor once
    plist[#plist + 1] = p
    masters[#masters + 1] = p:float():detach():clone():requires_grad_(true)
  end
  local ref = pt.optim.adamw(masters, opts)
  local n = auto:num_parameters()
  eq(opt:master_bytes(), 4 * n, "a float32 master a parameter")
  for step = 1, 4 do
    local x, y = batch(10 + step)
    local la = gpt_loss(auto, x, y)
    opt:zero_grad(); la:backward(); opt:step()
    local lh = gpt_loss(hand, x, y)
    ref:zero_grad(); for _, p in ipairs(plist) do p.grad = nil end
    lh:backward()
    for i, p in ipairs(plist) do masters[i].grad = p.grad:float() end
    ref:step()
    pt.no_grad(function() for i, p in ipairs(plist) do p:copy_(masters[i]) end end)
    eq(la:item(), lh:item(), "loss at step " .. step)
  end
  same_params(auto, hand, "after 4 steps")
  -- The masters hold more than the bfloat16 parameters do, and state_bytes counts them.
  local m = opt:master(auto:get("wte").weight)
  eq(m:type(), "float32")
  ok(opt:state_bytes() >= 3 * 4 * n, "state_bytes counts two moments and the master: " .. opt:state_bytes())
end)

test("bfloat16 gradients of several backward passes sum in float32; the master steps on that sum", function()
  for _, dtype in ipairs { "bfloat16", "float16" } do
    pt.manual_seed(31)
    local l = pt.nn.Linear(64, 64):to(dtype)
    local opt = pt.optim.sgd(l, { lr = 1 })
    local xs = {}
    for i = 1, 8 do xs[i] = pt.randn(16, 64):to(dtype) end
    local want = pt.zeros(64, 64)  -- each pass's gradient, summed in float32
    for i = 1, 8 do
      l:zero_grad()
      l(xs[i]):sum():backward()
      want = want + l.weight.grad:to("float32")
    end
    l:zero_grad()
    for i = 1, 8 do l(xs[i]):sum():backward() end
    ok(l.weight.grad:equal(want:to(dtype)), dtype .. ": .grad is the float32 sum rounded once")
    local before = l.weight:to("float32")
    opt:step()
    ok(l.weight:equal((before - want):to(dtype)), dtype .. ": the master stepped on the float32 sum itself")
    -- A .grad changed between passes (zeroed in place here) restarts the sum from what it holds.
    l:zero_grad()
    l(xs[1]):sum():backward()
    l.weight.grad:zero_()
    l(xs[2]):sum():backward()
    l:zero_grad()
    l(xs[2]):sum():backward()
    local alone = l.weight.grad:clone()
    l.weight.grad:zero_()
    l(xs[2]):sum():backward()
    ok(l.weight.grad:equal(alone), dtype .. ": a .grad zeroed in place starts the sum again")
  end
end)

test("a parameter changed in place between steps gives its master its new value", function()
  pt.manual_seed(8)
  local m = pt.models.mlp { sizes = { 3, 2 }, dtype = "bfloat16" }
  local opt = pt.optim.sgd(m, { lr = 0.5 })
  local w = m:get("0").weight
  pt.no_grad(function() w:fill_(0.25) end)   -- after the optimizer was made: its master is stale
  w.grad = pt.full({ 2, 3 }, 0.5):bfloat16()
  m:get("0").bias.grad = pt.zeros(2):bfloat16()
  opt:step()
  eq(opt:master(w):equal(pt.full({ 2, 3 }, 0.25 - 0.5 * 0.5)), true, "the update starts from the new value")
  eq(w:equal(pt.full({ 2, 3 }, 0.0):bfloat16()), true, "and is cast back")
end)

local dir = os.tmpname()
os.remove(dir)

test("a bfloat16 run with dynamic loss scaling resumes from its checkpoint bit for bit", function()
  local function setup()
    pt.manual_seed(11)
    local m = pt.models.gpt2(with(gpt, { dtype = "bfloat16" }))
    return m, pt.optim.adamw(m, { lr = 1e-2, loss_scale = "dynamic",
                                   loss_scale_options = { init_scale = 2 ^ 12, scale_window = 2 } })
  end
  local function step(m, opt, i)
    local x, y = batch(100 + i)
    local loss = gpt_loss(m, x, y)
    opt:zero_grad(); opt:scale_loss(loss):backward(); opt:step()
    return loss:item()
  end
  local m, opt = setup()
  for i = 1, 3 do step(m, opt, i) end
  local scale = opt:loss_scale()
  eq(scale, 2 ^ 13, "grown once after 2 good steps")
  pt.ckpt.save(dir, { model = m, optim = opt, step = 3 })
  local want = {}
  for i = 4, 6 do want[#want + 1] = step(m, opt, i) end

  local m2, opt2 = setup()
  for i = 1, 2 do step(m2, opt2, 50 + i) end  -- a different state, overwritten by the load
  pt.ckpt.load(dir, { model = m2, optim = opt2 })
  eq(opt2:loss_scale(), scale, "the scale comes back")
  eq(opt2:steps(), 3)
  local got = {}
  for i = 4, 6 do got[#got + 1] = step(m2, opt2, i) end
  for i = 1, 3 do eq(got[i], want[i], "loss after resuming, step " .. (i + 3)) end
  same_params(m2, m, "after resuming")
  for name, p in pairs(params(m2)) do
    eq(opt2:master(p):equal(opt:master(params(m)[name])), true, "master of " .. name)
  end
  eq(opt2:loss_scale(), opt:loss_scale(), "the scale after resuming")
end)

test("a float32 checkpoint loads into a bfloat16 run: each master takes its parameter's value", function()
  pt.manual_seed(12)
  local m32 = pt.models.mlp { sizes = { 4, 8, 2 } }
  local o32 = pt.optim.adamw(m32, { lr = 1e-2 })
  local loss = pt.nn.mse(m32(pt.randn(3, 4)), pt.zeros(3, 2))
  loss:backward(); o32:step()
  pt.ckpt.save(dir, { model = m32, optim = o32, step = 1, tag = "f32" })
  local m16 = pt.models.mlp { sizes = { 4, 8, 2 }, dtype = "bfloat16" }
  local o16 = pt.optim.adamw(m16, { lr = 1e-2 })
  pt.ckpt.load(dir, "f32", { model = m16, optim = o16 })
  for name, p in pairs(params(m16)) do
    eq(p:equal(params(m32)[name]:bfloat16()), true, name .. " loaded, cast")
    eq(o16:master(p):equal(p:float()), true, name .. "'s master is the parameter's value")
  end
end)

test("a static power-of-two loss scale changes no bit of training", function()
  local function run(scale)
    pt.manual_seed(13)
    local m = pt.models.gpt2(gpt)
    local opt = pt.optim.adamw(m, { lr = 1e-2, loss_scale = scale })
    for i = 1, 3 do
      local x, y = batch(200 + i)
      opt:zero_grad(); opt:scale_loss(gpt_loss(m, x, y)):backward(); opt:step()
    end
    return m, opt
  end
  local plain = run(nil)
  local scaled, opt = run(1024)
  eq(opt:loss_scale(), 1024)
  same_params(scaled, plain, "loss_scale = 1024 against none")
end)

-- Sets one gradient element to inf, as an overflowing backward would.
local function overflow(p) p.grad:view(-1):narrow(0, 0, 1):fill_(1 / 0) end

test("an injected overflow skips the step, halves the scale, and training recovers and grows", function()
  pt.manual_seed(14)
  local m = pt.models.mlp { sizes = { 4, 8, 2 }, dtype = "bfloat16" }
  local opt = pt.optim.sgd(m, { lr = 0.1, loss_scale = "dynamic",
                                loss_scale_options = { init_scale = 2 ^ 10, scale_window = 3 } })
  local x, y = pt.randn(5, 4):bfloat16(), pt.zeros(5, 2):bfloat16()
  local function backward() opt:zero_grad(); opt:scale_loss(pt.nn.mse(m(x), y)):backward() end
  local function snapshot()
    local s = {}
    for name, p in pairs(params(m)) do s[name] = p:clone() end
    return s
  end
  backward(); eq(select(2, opt:step()), nil, "a good step is not skipped")
  eq(opt:steps(), 1)
  local before = snapshot()
  backward()
  overflow(m:get("0").weight)
  local norm, skipped = opt:step()
  eq(norm, nil); eq(skipped, "skipped", "step() says it skipped")
  eq(opt:steps(), 1, "the step count does not advance")
  eq(opt:skipped_steps(), 1)
  eq(opt:loss_scale(), 2 ^ 9, "the scale halves")
  for name, p in pairs(params(m)) do eq(p:equal(before[name]), true, name .. " unchanged") end
  for i = 1, 3 do
    local s = snapshot()
    backward(); opt:step()
    local moved = false
    for name, p in pairs(params(m)) do moved = moved or not p:equal(s[name]) end
    ok(moved, "good step " .. i .. " after the overflow updates")
    eq(opt:loss_scale(), i < 3 and 2 ^ 9 or 2 ^ 10, "scale after good step " .. i)
  end
  eq(opt:steps(), 4)
end)

-- Grown past what float32 holds, the scale had become inf: every step skipped, and backing off
-- (inf / factor) never brought it back, exit 0.
test("a dynamic scale grows no further than 2^127, and training goes on stepping", function()
  pt.manual_seed(14)
  local m = pt.models.mlp { sizes = { 4, 8, 2 } }
  local opt = pt.optim.sgd(m, { lr = 0.1, loss_scale = "dynamic",
                                loss_scale_options = { init_scale = 2 ^ 100, scale_window = 1, scale_factor = 1e300 } })
  local x, y = pt.randn(5, 4), pt.zeros(5, 2)
  for step = 1, 4 do
    opt:zero_grad(); opt:scale_loss(pt.nn.mse(m(x), y)):backward()
    local _, skipped = opt:step()
    ok(opt:loss_scale() <= 2 ^ 127, "step " .. step .. ": the scale is finite, " .. tostring(opt:loss_scale()))
    if step > 2 then eq(skipped, nil, "step " .. step .. " is taken") end
  end
end)

test("delayed_shift, consecutive_hysteresis and min_scale govern the backoff", function()
  local w = pt.tensor({ 1.0, 2.0 }, { requires_grad = true })
  local opt = pt.optim.sgd({ w }, { lr = 0.1, loss_scale = "dynamic",
    loss_scale_options = { init_scale = 8, delayed_shift = 2, min_scale = 4, scale_window = 100 } })
  local function step(bad)
    opt:zero_grad(); opt:scale_loss((w * w):sum()):backward()
    if bad then w.grad:fill_(0 / 0) end
    return select(2, opt:step())
  end
  eq(step(true), "skipped"); eq(opt:loss_scale(), 8, "first overflow: held by delayed_shift = 2")
  eq(step(false), nil)
  eq(step(true), "skipped"); eq(opt:loss_scale(), 4, "second overflow (not consecutive): backs off")
  eq(step(true), "skipped"); eq(opt:loss_scale(), 4, "never below min_scale")
  eq(opt:skipped_steps(), 3)
  local opt2 = pt.optim.sgd({ w }, { lr = 0.1, loss_scale = "dynamic",
    loss_scale_options = { init_scale = 8, delayed_shift = 2, consecutive_hysteresis = true } })
  opt = opt2
  eq(step(true), "skipped"); eq(step(false), nil)
  eq(step(true), "skipped"); eq(opt:loss_scale(), 8, "consecutive_hysteresis: a good step restores the count")
  eq(step(true), "skipped"); eq(opt:loss_scale(), 4, "two in a row back off")
end)

test("a skipped step is reported once, on stderr, naming the step and the scales", function()
  local bin = os.getenv("PARTRAIN_BIN") or "build/partrain"
  local script = [[
    local pt = require "partrain"
    local w = pt.tensor({ 1.0 }, { requires_grad = true })
    local opt = pt.optim.sgd({ w }, { lr = 0.1, loss_scale = "dynamic", loss_scale_options = { init_scale = 64 } })
    for i = 1, 3 do
      opt:zero_grad(); opt:scale_loss((w * w):sum()):backward()
      if i == 2 then w.grad:fill_(1 / 0) end
      opt:step()
    end
    io.stdout:write("done\n")
  ]]
  local p = io.popen(bin .. " --threads 1 -e '" .. script:gsub("'", "'\\''") .. "' 2>&1")
  local out = p:read("*a")
  p:close()
  local lines = {}
  for line in out:gmatch("[^\n]+") do if line:find("skipped", 1, true) then lines[#lines + 1] = line end end
  eq(#lines, 1, "one report line in:\n" .. out)
  ok(lines[1]:find("optimizer step 2 skipped: gradients overflowed (inf or nan); loss scale 64 -> 32", 1, true),
     lines[1])
  ok(out:find("done", 1, true), out)
end)

test("bad loss scaling options are refused at the caller's line", function()
  local w = pt.tensor({ 1.0 }, { requires_grad = true })
  local function refused(opts, pattern)
    local err = raises(function() pt.optim.adamw({ w }, opts) end, pattern)
    ok(err:find(THIS, 1, true), "names this file: " .. err)
  end
  refused({ loss_scale = "auto" }, "option 'loss_scale' for adamw must be a number (a static scale) or \"dynamic\", got 'auto'")
  refused({ loss_scale = true }, "got boolean")
  refused({ loss_scale = -2 }, "loss_scale must be a number float32 holds, from 2^-126 to 2^127, got -2")
  refused({ loss_scale = 1 / 0 }, "loss_scale must be a number float32 holds")
  refused({ loss_scale = 8, loss_scale_options = { scale_window = 2 } }, "needs loss_scale = \"dynamic\"")
  refused({ loss_scale = "dynamic", loss_scale_options = { scale_windw = 2 } }, "scale_windw")
  refused({ loss_scale = "dynamic", loss_scale_options = { scale_window = 0 } }, "scale_window must be >= 1, got 0")
  refused({ loss_scale = "dynamic", loss_scale_options = { scale_factor = 1 } }, "scale_factor must be a finite number > 1")
  refused({ loss_scale = "dynamic", loss_scale_options = { delayed_shift = 0 } }, "delayed_shift must be >= 1")
  refused({ loss_scale = "dynamic", loss_scale_options = { init_scale = 1, min_scale = 2 } }, "init_scale=1 is below min_scale=2")
  local w64 = pt.tensor({ 1.0 }, { requires_grad = true, dtype = "float64" })
  local err = raises(function() pt.optim.sgd({ w64 }, { loss_scale = "dynamic" }) end, "a float64 parameter")
  ok(err:find(THIS, 1, true), "names this file: " .. err)
  local plain = pt.optim.sgd({ w }, {})
  eq(plain:loss_scale(), nil, "no loss scaling")
  local l = (w * 3):sum()
  eq(plain:scale_loss(l):item(), l:item(), "scale_loss without a scaler is the loss")
end)

H.run()
