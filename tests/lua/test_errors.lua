-- Where errors point: at the user's script line, never inside partrain's own Lua library or at
-- a C function, whether the engine raised them, a library wrapper passed them on, or a library
-- function tripped over a bad argument. Each case runs a small script in a new partrain process
-- and reads its stderr.
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, ok = H.test, H.ok

local bin = os.getenv("PARTRAIN_BIN") or "build/partrain"

-- Runs `code` as a script file; returns its exit status and output (stdout and stderr).
local function run(code, env)
  local path = os.tmpname() .. ".lua"
  local f = assert(io.open(path, "w"))
  f:write(code)
  f:close()
  local p = io.popen((env or "") .. " " .. bin .. " --threads 1 " .. path .. " 2>&1; echo \"status=$?\"")
  local out = p:read("*a")
  p:close()
  os.remove(path)
  local status = tonumber(out:match("status=(%d+)%s*$"))
  return status, out, path
end

local function has(out, text, what) ok(out:find(text, 1, true), what .. ": expected '" .. text .. "' in:\n" .. out) end

test("an engine error behind a library wrapper names the script line (pt.mesh)", function()
  local status, out, path = run('local pt = require "partrain"\n\nlocal mesh = pt.mesh { tensor = 3 }\n')
  ok(status == 1, "exit status 1, got " .. tostring(status))
  has(out, "partrain: " .. path .. ":3: mesh: tensor=3", "the user's line once, then the message")
  ok(not out:match("partrain: [^\n]*init%.lua"), "the message's location is not init.lua:\n" .. out)
end)

test("a bad argument that trips inside the library is moved to the user's line, keeping where it was raised", function()
  -- A table whose __call is not a function passes apply's check and trips where it is called.
  local status, out, path = run('local pt = require "partrain"\nlocal m = pt.models.mlp { sizes = { 2, 2 } }\n'
    .. 'm:apply(setmetatable({}, { __call = 5 }))\n')
  ok(status == 1, "exit status 1, got " .. tostring(status))
  has(out, "partrain: " .. path .. ":3: attempt to call local 'fn' (a table value) (raised in partrain/init.lua:", "relocated")
end)

test("a library function's argument check names the caller's line, even when the caller is pcall itself", function()
  -- Lua's error levels name the caller's caller, here pcall, which has no line: these had none.
  local status, out, path = run('local pt = require "partrain"\nlocal m = pt.models.mlp { sizes = { 2, 2 } }\n'
    .. 'print(pcall(pt.log, 5))\nprint(pcall(pt.tp.shards, {}))\nprint(pcall(m.apply, m, 5))\n'
    .. 'print(pcall(pt.nn.GELU, { approx = "tanh" }))\nm:apply(5)\n')
  ok(status == 1, "exit status 1, got " .. tostring(status))
  has(out, "false\t" .. path .. ":3: pt.log expects a table of fields, got number", "pt.log")
  has(out, "false\t" .. path .. ":4: pt.tp.shards: a module expected, got table", "pt.tp.shards")
  has(out, "false\t" .. path .. ":5: apply: a function expected (it is called with each module and its path), got number",
    "apply checks its function")
  has(out, "false\t" .. path .. ":6: GELU has no option 'approx' (options: approximate)", "GELU's unknown option")
  has(out, "partrain: " .. path .. ":7: apply: a function expected", "uncaught, the same line")
end)

test("an error already at the caller's line is passed on once, and unknown keys are shown safely", function()
  local status, out, path = run('local pt = require "partrain"\nlocal m = pt.models.mlp { sizes = { 2, 2 } }\n'
    .. 'print(pcall(pt.args, { a = 1 }, { "--config", "/nonexistent.lua" }))\n'
    .. 'print(pcall(pt.nn.GELU, { ["x\\27[2J\\rX"] = 1 }))\n'
    .. 'print(pcall(pt.nn.GELU, { [("k"):rep(1000)] = 1 }))\n'
    .. 'print(pcall(pt.nn.Linear, 2, 2, { [("b"):rep(50)] = true }))\n'
    .. 'print(pcall(pt.args, { a = 1 }, { "--a", 5 }))\n'
    .. 'print(m:apply(setmetatable({}, { __call = function() end, __metatable = "locked" })) == m)\n')
  ok(status == 0, "exit status 0, got " .. tostring(status) .. ":\n" .. out)
  has(out, "false\t" .. path .. ":3: cannot read the config file", "the line once")
  ok(not out:find(path .. ":3: " .. path .. ":3:", 1, true), "not twice:\n" .. out)
  has(out, "false\t" .. path .. ":4: GELU has no option [a string of 7 bytes, not all printable]", "unprintable key described")
  ok(not out:find("\27", 1, true), "no escape byte echoed")
  has(out, "false\t" .. path .. ":5: GELU has no option [a string of 1000 bytes]", "long key described")
  has(out, "unknown option [a string of 50 bytes] for Linear", "the engine's option reader alike")
  has(out, "false\t" .. path .. ":7: pt.args: argv[2] must be a string, got number", "argv's elements checked")
  has(out, "true", "a callable whose metatable is locked is still callable")
end)

-- Runs `call` as line 3 of a script whose line 2 makes an MLP `m`: it must fail (status 1) with
-- `want` right after the script's line 3. Returns the output.
local function fails_at_line_3(call, want, what)
  local status, out, path = run('local pt = require "partrain"\nlocal m = pt.models.mlp { sizes = { 4, 2 } }\n'
    .. call .. '\n')
  ok(status == 1, "exit status 1, got " .. tostring(status))
  has(out, "partrain: " .. path .. ":3: " .. want, what)
  return out
end

test("an engine error passed on by a library wrapper names the user's line once (pt.ckpt.save)", function()
  fails_at_line_3('pt.ckpt.save(os.tmpname() .. "-ck", { model = m, tag = "../x" })', "bad checkpoint tag '../x'",
    "named once")
end)

test("a library refusal caught by pcall(f, ...) names the line of that pcall", function()
  -- Lua's error level names the caller of pt.parallelize, here pcall itself: no line at all.
  local status, out, path = run('local pt = require "partrain"\nlocal m = pt.models.mlp { sizes = { 2, 2 } }\n'
    .. 'local ok, err = pcall(pt.parallelize, m, nil, pt.mesh {}, { microbatches = 0 })\nprint(err)\n')
  ok(status == 0, "exit status 0, got " .. tostring(status))
  has(out, path .. ":3: parallelize option 'microbatches' needs a mesh with pipeline > 1", "the pcall's line")
end)

-- A script's own pcall sees the message as raised: relocation runs only in partrain's handlers,
-- so a library function checks its arguments itself (these had tripped inside partrain's Lua,
-- naming its line, or raised with no line at all).
test("library functions given a wrong argument name the caller's line, under the script's own pcall too", function()
  local cases = {
    { "pt.nn.GELU(5)", "GELU: options must be a table ({ approximate = 'tanh' }), got a number" },
    { "pt.args.describe(5)", "pt.args.describe: expected the options table, got a number" },
    { "pt.args.describe({}, 5)", "pt.args.describe: the config file must be a path (a string), got a number" },
    { "pt.metrics.json(function() end)", "pt.metrics: a function cannot be written as JSON" },
  }
  for _, case in ipairs(cases) do
    local status, out, path = run('local pt = require "partrain"\nlocal ok, err = pcall(function()\n  local v = '
      .. case[1] .. '\nend)\nprint(err)\n')
    ok(status == 0, case[1] .. ": exit status 0, got " .. tostring(status))
    has(out, path .. ":3: " .. case[2], case[1])
  end
end)

test("an error object that is not a string is described, with the user's frames", function()
  local status, out = run('local function f() error({}) end\nf()\n')
  ok(status == 1, "exit status 1")
  has(out, "(error object is a table value)", "described")
  has(out, "stack traceback:", "traceback")
  status, out = run('error(setmetatable({}, { __tostring = function() return "custom error" end }))\n')
  has(out, "partrain: custom error", "its __tostring")
end)

test("a traceback shows the user's frames only, none when the message names the one; PARTRAIN_TRACEBACK=1 all", function()
  local status, out = run('local pt = require "partrain"\npt.mesh { tensor = 2 }\n')
  ok(status == 1, "exit status 1")
  has(out, "does not divide the world of 1 ranks", "the message")
  ok(not out:find("stack traceback", 1, true), "one frame, named by the message: no traceback:\n" .. out)
  ok(not out:find("partrain/init.lua", 1, true), "no frame of partrain's own files:\n" .. out)
  status, out = run('local pt = require "partrain"\nlocal function make() local m = pt.mesh { tensor = 2 }; return m end\nmake()\n')
  has(out, "stack traceback:", "two frames of the user's: a traceback")
  has(out, ":3: in main chunk", "the caller's frame")
  ok(not out:find("partrain/init.lua", 1, true) and not out:find("[C]:", 1, true), "only the user's frames:\n" .. out)
  status, out = run('local pt = require "partrain"\npt.mesh { tensor = 2 }\n', "PARTRAIN_TRACEBACK=1")
  has(out, "partrain/init.lua", "PARTRAIN_TRACEBACK=1: partrain's frames too")
end)

test("an error object whose __tostring raises or returns no text is described, not 'error in error handling'", function()
  local status, out, path = run('error(setmetatable({}, { __tostring = function() error("no text") end }))\n')
  ok(status == 1, "exit status 1, got " .. tostring(status))
  has(out, "partrain: (error object is a table value; its __tostring raised: " .. path .. ":1: no text)", "its raise")
  ok(not out:find("error in error handling", 1, true), "no bare 'error in error handling':\n" .. out)
  status, out = run('error(setmetatable({}, { __tostring = function() return {} end }))\n')
  ok(status == 1, "exit status 1, got " .. tostring(status))
  has(out, "partrain: (error object is a table value; its __tostring returned a table)", "what it returned")
  -- The same through an engine callback's handler: a hook the optimizer step runs.
  status, out, path = run('local pt = require "partrain"\nlocal m = pt.models.mlp { sizes = { 2, 2 } }\n'
    .. 'local opt = pt.optim.sgd(m, { lr = 0.1 })\nrequire("partrain.plan").at_first_step = function() '
    .. 'error(setmetatable({}, { __tostring = function() error("no text") end })) end\nopt:step()\n',
    "PARTRAIN_PLAN=" .. os.tmpname() .. "-plan PARTRAIN_PLAN_MODE=override")
  ok(status == 1, "exit status 1, got " .. tostring(status))
  has(out, "(error object is a table value; its __tostring raised: " .. path .. ":4: no text)", "through the callback")
  ok(not out:find("error in error handling", 1, true), "no bare 'error in error handling':\n" .. out)
end)

-- The first optimizer step calls partrain.plan's hook when a plan is involved; a hook that raises
-- must come back through the protected call as the script's own error, one it can catch.
local raising_hook = 'local pt = require "partrain"\nlocal m = pt.models.mlp { sizes = { 2, 2 } }\n'
  .. 'local opt = pt.optim.sgd(m, { lr = 0.1 })\n'
  .. 'require("partrain.plan").at_first_step = function() error("the hook failed") end\n'
local plan_env = "PARTRAIN_PLAN=" .. os.tmpname() .. "-plan PARTRAIN_PLAN_MODE=override"

test("a callback the optimizer step runs that raises is the user's error, and can be caught", function()
  local status, out, path = run(raising_hook .. 'local ok, err = pcall(opt.step, opt)\nprint("caught", ok, err)\n'
    .. 'opt:step()\nprint("the next step ran")\n', plan_env)
  ok(status == 0, "exit status 0, got " .. tostring(status) .. ":\n" .. out)
  has(out, "caught\tfalse\t" .. path .. ":4: the hook failed", "caught with the hook's line")
  has(out, "the next step ran", "the script goes on")
end)

test("a callback the optimizer step runs that raises, uncaught, ends the script cleanly", function()
  local status, out, path = run(raising_hook .. 'opt:step()\n', plan_env)
  ok(status == 1, "exit status 1, got " .. tostring(status) .. ":\n" .. out)
  has(out, "partrain: " .. path .. ":4: the hook failed", "the hook's line")
  ok(not out:find("Exception raised from", 1, true) and not out:find("terminate", 1, true), "no C++ trace:\n" .. out)
end)

-- 2^32 + 1 had been cut to 1: num_kept kept one checkpoint and deleted the rest, a mesh of
-- tensor = 2^32 + 1 ran as 1, zero = { stage = 2^32 + 2 } as ZeRO-2.
test("integers past 32 bits are refused as given, never cut to their low bits", function()
  local dir = os.tmpname() .. "-kept"
  local m = pt.models.mlp { sizes = { 4, 2 } }
  for s = 1, 3 do pt.ckpt.save(dir, { model = m, step = s }) end
  H.raises(function() pt.ckpt.save(dir, { model = m, step = 4, num_kept = 2 ^ 32 + 1 }) end,
    "option 'num_kept' for pt.ckpt.save must be an integer from -2147483648 to 2147483647, got number 4294967297")
  local kept = 0
  for s = 1, 3 do
    local f = io.open(("%s/step-%08d/manifest.bin"):format(dir, s), "rb")
    if f then kept = kept + 1; f:close() end
  end
  H.eq(kept, 3, "every checkpoint is kept")
  os.execute("rm -rf '" .. dir .. "'")
  H.raises(function() pt.mesh { tensor = 2 ^ 32 + 1 } end, "got number 4294967297")
  H.raises(function() pt.parallelize(pt.models.mlp { sizes = { 4, 2 } }, nil, pt.mesh {}, { zero = { stage = 2 ^ 32 + 2 } }) end,
    "option 'zero.stage' for parallelize must be an integer from -2147483648 to 2147483647, got number 4294967298")
  H.raises(function() pt.set_threads(2 ^ 40) end, "threads must be 1 to 1024")
  H.raises(function() pt.mesh { tensor = 1e300 } end, "got number 1.0000000000000001e+300")
end)

test("a NaN in a message reads nan, as Lua prints it, not C++'s -nan", function()
  local nan = 0 / 0
  local cases = {
    { function() pt.nn.Dropout(nan) end, "Dropout probability must be in [0, 1), got nan" },
    { function() pt.nn.LayerNorm(4, { eps = nan }) end, "eps must be a finite number >= 0, got nan" },
    { function() pt.nn.Linear(nan, 2) end, "integer expected, got nan)" },
    { function() pt.mesh { tensor = nan } end, "got number nan" },
  }
  for i, c in ipairs(cases) do
    local msg = H.raises(c[1], c[2])
    ok(not msg:find("-nan", 1, true), "case " .. i .. " has no -nan: " .. msg)
  end
end)

test("a bad sharding option names the script line, not partrain's own", function()
  local out = fails_at_line_3('pt.parallelize(m, nil, pt.mesh {}, { probe = "yes" })', "sharding option 'probe' must be",
    "the script's line first")
  ok(not out:match("^[^\n]*init%.lua:%d+:"), "no line of partrain's library in the message:\n" .. out)
end)

H.run()
