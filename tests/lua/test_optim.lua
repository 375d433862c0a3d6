-- Optimizers from Lua: each update matches its formula, schedules give the documented rates,
-- clipping bounds the global norm, and bad options are refused by name.
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, eq, near, raises, ok = H.test, H.eq, H.near, H.raises, H.ok

-- One parameter w with loss sum(w * g): its gradient is exactly g.
local function setup(values)
  local w = pt.tensor(values, { requires_grad = true })
  return w, function(g)
    w.grad = nil
    local loss = (w * pt.tensor(g)):sum()
    loss:backward()
  end
end

test("sgd: plain, weight decay, momentum and nesterov follow PyTorch's formulas", function()
  local w, grad = setup { 1.0, -2.0 }
  local opt = pt.optim.sgd({ w }, { lr = 0.1 })
  grad { 0.5, 1.0 }; opt:step()
  near(w, { 1.0 - 0.05, -2.0 - 0.1 }, 1e-6, "plain step")

  w, grad = setup { 1.0 }
  opt = pt.optim.sgd({ w }, { lr = 0.1, weight_decay = 0.5 })
  grad { 0.0 }; opt:step()
  near(w, { 1.0 - 0.1 * 0.5 }, 1e-6, "weight decay adds wd * w to the gradient")

  w, grad = setup { 0.0 }
  opt = pt.optim.sgd({ w }, { lr = 1.0, momentum = 0.9 })
  grad { 1.0 }; opt:step()   -- buf = 1
  grad { 1.0 }; opt:step()   -- buf = 0.9 + 1 = 1.9
  near(w, { -2.9 }, 1e-6, "momentum")

  w, grad = setup { 0.0 }
  opt = pt.optim.sgd({ w }, { lr = 1.0, momentum = 0.9, nesterov = true })
  grad { 1.0 }; opt:step()   -- buf = 1, step = g + 0.9 buf = 1.9
  near(w, { -1.9 }, 1e-6, "nesterov")
  raises(function() pt.optim.sgd({ w }, { lr = 0.1, nesterov = true }) end, "nesterov needs momentum > 0")
end)

test("adam and adamw take the bias-corrected first step of size lr", function()
  for _, kind in ipairs { "adam", "adamw" } do
    local w, grad = setup { 1.0, 1.0 }
    local opt = pt.optim[kind]({ w }, { lr = 0.01, weight_decay = 0 })
    grad { 3.0, -0.5 }; opt:step()
    near(w, { 1.0 - 0.01, 1.0 + 0.01 }, 1e-5, kind .. " first step is lr * sign(g)")
  end
  local w, grad = setup { 2.0 }
  local opt = pt.optim.adamw({ w }, { lr = 0.1, weight_decay = 0.5 })
  grad { 0.0 }; opt:step()
  near(w, { 2.0 * (1 - 0.1 * 0.5) }, 1e-6, "adamw decays weights directly")
  raises(function() pt.optim.adam({ w }, { betas = { 0.9 } }) end, "must hold two numbers")
end)

test("schedules: warmup then cosine or linear decay to min_lr", function()
  local s = { kind = "cosine", warmup = 10, total = 110, min_lr = 0.1 }
  near(pt.optim.scheduled_lr(s, 1.0, 0), 0.1, 1e-9, "warmup starts at lr/warmup")
  near(pt.optim.scheduled_lr(s, 1.0, 9), 1.0, 1e-9, "warmup reaches lr")
  near(pt.optim.scheduled_lr(s, 1.0, 60), 0.55, 1e-9, "cosine midpoint")
  near(pt.optim.scheduled_lr(s, 1.0, 110), 0.1, 1e-9, "ends at min_lr")
  near(pt.optim.scheduled_lr(s, 1.0, 500), 0.1, 1e-9, "stays at min_lr")
  local l = { kind = "linear", total = 100 }
  near(pt.optim.scheduled_lr(l, 2.0, 25), 1.5, 1e-9, "linear")
  near(pt.optim.scheduled_lr({}, 2.0, 25), 2.0, 1e-9, "constant")
  raises(function() pt.optim.scheduled_lr({ kind = "cosine", total = 5, warmup = 5 }, 1, 0) end, "needs total > warmup")
  raises(function() pt.optim.scheduled_lr({ kind = "exp" }, 1, 0) end, "constant, cosine or linear")
  raises(function() pt.optim.scheduled_lr({ kind = "cosine", totl = 5 }, 1, 0) end, "unknown option 'totl'")
end)

test("the optimizer applies its schedule step by step", function()
  local w, grad = setup { 0.0 }
  local opt = pt.optim.sgd({ w }, { lr = 1.0, schedule = { kind = "linear", warmup = 2, total = 4 } })
  local rates = {}
  for _ = 1, 5 do rates[#rates + 1] = opt:lr(); grad { 1.0 }; opt:step() end
  eq(table.concat(rates, ","), "0.5,1,1,0.5,0")
  near(w, { -3.0 }, 1e-6, "the parameter moved by the sum of the rates")
  eq(opt:steps(), 5)
end)

test("clipping bounds the global gradient norm", function()
  local a = pt.tensor({ 0.0, 0.0 }, { requires_grad = true })
  local b = pt.tensor({ 0.0 }, { requires_grad = true })
  local la = (a * pt.tensor { 3.0, 0.0 }):sum()
  local lb = (b * pt.tensor { 4.0 }):sum()
  la:backward(); lb:backward()
  local norm = pt.nn.clip_grad_norm({ a, b }, 1.0)
  near(norm, 5.0, 1e-6, "returns the norm before clipping")
  near(a.grad, { 0.6, 0 }, 1e-5); near(b.grad, { 0.8 }, 1e-5)
  local w, grad = setup { 0.0 }
  local opt = pt.optim.sgd({ w }, { lr = 1.0, clip_grad_norm = 0.5 })
  grad { 10.0 }
  near(opt:step(), 10.0, 1e-6, "step returns the norm when clipping")
  near(w, { -0.5 }, 1e-6, "clipped before the update")
end)

test("classification_step does in C++ exactly what the Lua step does", function()
  local function make()
    pt.manual_seed(5)
    local m = pt.models.mlp { sizes = { 6, 8, 3 } }
    return m, pt.optim.adam(m, { lr = 0.01 })
  end
  local m1, o1 = make()
  local m2, o2 = make()
  pt.manual_seed(9)
  local x, y = pt.randn(10, 6), pt.randint(0, 3, { 10 })
  for _ = 1, 3 do
    local loss = pt.nn.cross_entropy(m1(x), y)
    o1:zero_grad(); loss:backward(); o1:step()
    eq(o2:classification_step(m2, x, y), loss:item(), "the same loss")
  end
  ok(m1:get("0").weight:equal(m2:get("0").weight), "the same weights after three steps")
end)

-- GPT-2 trained `steps` AdamW steps (weight decay, clipping, a schedule) with `fused` in `dtype`.
local function adamw_run(fused, dtype, steps)
  pt.manual_seed(21)
  local gpt = { vocab = 32, seq = 8, dim = 16, heads = 2, layers = 2, dtype = dtype }
  local model = pt.models.gpt2(gpt)
  local opt = pt.optim.adamw(model, { lr = 1e-2, weight_decay = 0.1, clip_grad_norm = 1.0, fused = fused,
                                      schedule = { kind = "cosine", warmup = 2, total = steps } })
  local losses = {}
  for step = 1, steps do
    pt.manual_seed(100 + step)
    local x, y = pt.randint(0, gpt.vocab, { 4, gpt.seq }), pt.randint(0, gpt.vocab, { 4, gpt.seq })
    opt:zero_grad()
    local loss = pt.nn.cross_entropy(model(x):reshape(-1, gpt.vocab), y:reshape(-1))
    loss:backward()
    opt:step()
    losses[step] = loss:item()
  end
  return model, opt, losses
end

-- Measured on LibTorch 2.11 over these 20 steps (the kernel orders its arithmetic otherwise):
-- float64 losses 1.3e-16 to 2.6e-16 apart (relative) and weights 6.5e-14 to 1.0e-13; float32
-- losses 6.9e-8 (weights up to 7e-5 where a near-zero second moment amplifies the rounding);
-- bfloat16 with float32 masters the same losses, weights one bfloat16 step (3.1e-5) apart.
test("fused AdamW on the CPU (LibTorch's _fused_adamw_) equals the unfused update within rounding over 20 steps", function()
  local bounds = { float64 = { loss = 1e-12, weight = 1e-12 }, float32 = { loss = 1e-6 }, bfloat16 = { loss = 1e-6 } }
  for _, dtype in ipairs { "float64", "float32", "bfloat16" } do
    local fused, fopt, flosses = adamw_run(true, dtype, 20)
    local plain, popt, plosses = adamw_run(false, dtype, 20)
    eq(fopt:fused(), true, dtype .. ": the fused kernel ran")
    eq(popt:fused(), false, dtype .. ": the reference did not")
    local bound = bounds[dtype]
    for step = 1, 20 do
      local rel = math.abs(flosses[step] - plosses[step]) / math.abs(plosses[step])
      ok(rel <= bound.loss, ("%s: loss at step %d %.17g against %.17g (relative %.3g, bound %g)"):format(
        dtype, step, flosses[step], plosses[step], rel, bound.loss))
    end
    if bound.weight then
      local pp = plain:parameters()
      for i, p in ipairs(fused:parameters()) do
        local d = (p:double() - pp[i]:double()):abs():max():item()
        ok(d <= bound.weight, ("%s: parameter %d differs by %.3g (bound %g)"):format(dtype, i, d, bound.weight))
      end
    end
  end
end)

test("fused AdamW takes gradients and parameters laid out otherwise (transposed, expanded) as the unfused update does", function()
  local function run(fused, transposed_param)
    pt.manual_seed(5)
    local base = pt.randn({ 3, 4 }, { dtype = "float64" })
    local w = (transposed_param and base:t() or base:t():contiguous()):detach():requires_grad_(true)
    local opt = pt.optim.adamw({ w }, { lr = 0.1, weight_decay = 0.1, fused = fused })
    for step = 1, 3 do
      pt.manual_seed(50 + step)
      local g = pt.randn({ 3, 4 }, { dtype = "float64" }):t()             -- (4, 3), not contiguous
      if step == 3 then g = pt.randn({ 1, 3 }, { dtype = "float64" }):expand(4, 3) end
      w.grad = g
      opt:step()
    end
    return w
  end
  -- A transposed parameter: "auto" keeps the unfused update (and says so), true is refused.
  for _, case in ipairs { { false, true }, { true, "auto" } } do
    local transposed, fused_option = case[1], case[2]
    local fused, plain = run(fused_option, transposed), run(false, transposed)
    local d = (fused - plain):abs():max():item()
    ok(d <= 1e-12, ("a %s parameter: fused = %s and unfused differ by %.3g after 3 steps"):format(
      transposed and "transposed" or "contiguous", tostring(fused_option), d))
  end
  local t = pt.randn({ 3, 4 }, { dtype = "float64" }):t():detach():requires_grad_(true)
  eq(pt.optim.adamw({ t }, { fused = "auto" }):fused(), false, "auto keeps a transposed parameter unfused")
  eq(pt.optim.adamw({ pt.randn({ 4, 3 }):requires_grad_(true) }, { fused = "auto" }):fused(), true,
     "auto fuses a contiguous one")
  raises(function() pt.optim.adamw({ t }, { fused = true }) end,
         "fused = true needs contiguous parameters; parameter 1 of shape [4, 3] is not")
end)

test("bad optimizer input is refused by name", function()
  local w = pt.tensor({ 1.0 }, { requires_grad = true })
  raises(function() pt.optim.sgd({ w }, { lr = "fast" }) end, "option 'lr' for sgd must be a number, got string 'fast'")
  raises(function() pt.optim.sgd({ w }, { momentun = 0.9 }) end, "unknown option 'momentun' for sgd")
  raises(function() pt.optim.adam({ w }, { momentum = 0.9 }) end, "unknown option 'momentum' for adam")
  raises(function() pt.optim.sgd({ w }, { lr = -1 }) end, "lr must be a finite number from 0 to 3.4e38")
  raises(function() pt.optim.sgd({}, { lr = 1 }) end, "got no parameters")
  raises(function() pt.optim.sgd(42) end, "module or table of parameters expected, got number")
  raises(function() pt.optim.sgd({ pt.ones(1) }) end, "parameter #1 of the table is frozen (requires_grad = false)")
  raises(function() pt.optim.sgd({ w }, { schedule = { kind = "cosine" } }) end, "needs total > warmup")
  -- LibTorch's text had been "Invalid epsilon value: -1"; eps = 0 divides a zero moment by zero.
  raises(function() pt.optim.adam({ w }, { eps = -1 }) end, "adam: eps must be a finite number > 0, got -1")
  raises(function() pt.optim.adamw({ w }, { eps = 0 }) end, "adamw: eps must be a finite number > 0, got 0")
  raises(function() pt.optim.adamw({ w }, { eps = 0 / 0 }) end, "adamw: eps must be a finite number > 0")
  raises(function() pt.optim.sgd({ w }, { momentum = 0.9, dampening = 1 / 0 }) end, "sgd: dampening must be in [0, 1], got inf")
end)

-- Non-finite rates and scales float32 cannot hold trained every weight to NaN, or skipped every
-- step, with exit 0.
test("a non-finite lr, decay or norm, and a loss scale float32 cannot hold, are refused", function()
  local m = pt.models.mlp { sizes = { 4, 2 } }
  raises(function() pt.optim.sgd(m, { lr = 1 / 0 }) end, "sgd: lr must be a finite number from 0 to 3.4e38 (float32's largest), got inf")
  raises(function() pt.optim.adamw(m, { weight_decay = 0 / 0 }) end, "weight_decay must be a finite number from 0 to 3.4e38")
  raises(function() pt.optim.adamw(m, { clip_grad_norm = 1 / 0 }) end, "clip_grad_norm must be a finite number from 0 to 3.4e38")
  local o = pt.optim.sgd(m, { lr = 0.1 })
  for _, bad in ipairs { 0 / 0, -1, 1 / 0 } do
    raises(function() o:set_lr(bad) end, "sgd: lr must be a finite number from 0 to 3.4e38")
  end
  near(o:lr(), 0.1, 0, "the rate stays what it was")
  raises(function() pt.optim.sgd(m, { loss_scale = 1e300 }) end, "loss_scale must be a number float32 holds")
  raises(function() pt.optim.sgd(m, { loss_scale = 1e-300 }) end, "loss_scale must be a number float32 holds")
  raises(function() pt.optim.scheduled_lr({ kind = "cosine", total = 10 }, 0.1, -1) end, "step must be >= 0, got -1")
end)

-- Finite as doubles but past float32's largest, these had trained every float32 weight to NaN
-- (decay, momentum) or failed at the first step with LibTorch's overflow text (lr).
test("rates, decays and momenta past float32's range, and schedule options that would do nothing, are refused", function()
  local m = pt.models.mlp { sizes = { 4, 2 } }
  raises(function() pt.optim.adamw(m, { weight_decay = 1e39 }) end, "adamw: weight_decay must be a finite number from 0 to 3.4e38")
  raises(function() pt.optim.sgd(m, { momentum = 1e39 }) end, "sgd: momentum must be a finite number from 0 to 3.4e38")
  raises(function() pt.optim.sgd(m, { lr = 1e300 }) end, "sgd: lr must be a finite number from 0 to 3.4e38")
  raises(function() pt.optim.sgd(m, { lr = 0.1 }):set_lr(1e300) end, "sgd: lr must be a finite number from 0 to 3.4e38")
  raises(function() pt.optim.scheduled_lr({}, 0 / 0, 1) end, "scheduled_lr: lr must be a finite number from 0 to 3.4e38")
  raises(function() pt.optim.scheduled_lr({}, -1, 1) end, "scheduled_lr: lr must be a finite number from 0 to 3.4e38 (float32's largest), got -1")
  -- A constant schedule (the default kind) had ignored total and min_lr without a word.
  raises(function() pt.optim.scheduled_lr({ total = 2, min_lr = 0.5 }, 0.1, 3) end, "schedule total and min_lr shape a decay")
  raises(function() pt.optim.sgd(m, { lr = 0.1, schedule = { min_lr = 0.01 } }) end, "give kind = \"cosine\" or \"linear\"")
  raises(function() pt.nn.clip_grad_norm(m, 0 / 0) end, "max_norm must be a finite number > 0")
  near(pt.optim.scheduled_lr({ warmup = 2 }, 0.1, 5), 0.1, 1e-12, "a constant schedule with a warmup still works")
end)

H.run()
