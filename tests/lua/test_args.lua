-- pt.args: defaults overridden from the command line, with types checked and unknown keys refused.
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, eq, raises = H.test, H.eq, H.raises

local spec = { epochs = 3, lr = 0.1, name = "run", fp16 = false, warmup_steps = 10, scale = pt.args.number(1) }

test("defaults come back untouched without arguments", function()
  local cfg = pt.args(spec, {})
  eq(cfg.epochs, 3); eq(cfg.lr, 0.1); eq(cfg.name, "run"); eq(cfg.fp16, false); eq(cfg.scale, 1)
end)

test("--key value, --key=value, dashes for underscores, boolean flags", function()
  local cfg = pt.args(spec, { "--epochs", "1", "--lr=0.05", "--name", "x y", "--warmup-steps", "5", "--fp16" })
  eq(cfg.epochs, 1); eq(cfg.lr, 0.05); eq(cfg.name, "x y"); eq(cfg.warmup_steps, 5); eq(cfg.fp16, true)
  eq(pt.args(spec, { "--fp16", "false" }).fp16, false)
  eq(pt.args(spec, { "--fp16=true" }).fp16, true)
  eq(pt.args({ fp16 = true }, { "--no-fp16" }).fp16, false)
  eq(pt.args(spec, { "--scale", "0.5" }).scale, 0.5, "pt.args.number takes fractions")
end)

test("wrong types, unknown keys and missing values are errors naming the option", function()
  raises(function() pt.args(spec, { "--epochs", "1.5" }) end, "--epochs expects an integer, got '1.5'")
  raises(function() pt.args(spec, { "--lr", "fast" }) end, "--lr expects a number, got 'fast'")
  raises(function() pt.args(spec, { "--lr", "inf" }) end, "--lr expects a finite number, got 'inf'")
  raises(function() pt.args(spec, { "--lr", "nan" }) end, "--lr expects a finite number, got 'nan'")
  raises(function() pt.args(spec, { "--epochs", "9007199254740993" }) end, "--epochs expects an integer below 2^53")
  raises(function() pt.args(spec, { "--fp16=maybe" }) end, "--fp16 expects true or false, got 'maybe'")
  raises(function() pt.args(spec, { "--epoch", "1" }) end, "unknown option --epoch (known: --epochs, --fp16, --lr, --name, --scale, --warmup-steps); did you mean --epochs?")
  raises(function() pt.args(spec, { "--warmup-step", "1" }) end, "did you mean --warmup-steps?")
  local far = raises(function() pt.args(spec, { "--batch", "1" }) end, "unknown option --batch")
  H.ok(not far:find("did you mean", 1, true), "no suggestion when nothing is near: " .. far)
  raises(function() pt.args(spec, { "--epochs" }) end, "--epochs needs a value")
  raises(function() pt.args(spec, { "stray" }) end, "unexpected argument 'stray'")
  raises(function() pt.args({ f = function() end }, {}) end, "option 'f' has a function default")
  raises(function() pt.args(42) end, "expects a table of defaults")
end)

test("errors point at the script line that called pt.args", function()
  local err = raises(function() local cfg = pt.args(spec, { "--nope" }); return cfg end, "unknown option --nope")
  H.ok(err:find("test_args.lua:%d+:"), err)
end)

H.run()
