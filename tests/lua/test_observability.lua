-- Seeing a run, in one process: the metrics file's JSON and its resume rule, pt.log's options,
-- FLOPs a token against the models' own parameter counts, pt.progress's options, and pt.args's
-- descriptions and config files (values, overrides, and errors naming the file and line).
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, eq, ok, raises, near = H.test, H.eq, H.ok, H.raises, H.near

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end
local function write(path, text)
  local f = assert(io.open(path, "wb"))
  f:write(text)
  f:close()
end
local function lines(path)
  local out = {}
  for line in read(path):gmatch("([^\n]*)\n") do out[#out + 1] = line end
  return out
end

test("JSON: strings escaped, non-finite numbers as null, integers whole, nested tables", function()
  local j = pt.metrics.json
  eq(j('a"b\\c\nd\te\1'), [["a\"b\\c\nd\te\u0001"]])
  eq(j(0 / 0), "null"); eq(j(math.huge), "null"); eq(j(-math.huge), "null")
  eq(j(3), "3"); eq(j(-2 ^ 40), "-1099511627776"); eq(tonumber(j(0.1)), 0.1, "0.1 round-trips")
  eq(j({ 1, 2, 3 }), "[1,2,3]")
  eq(j({ b = true, a = { x = "y" } }), [[{"a":{"x":"y"},"b":true}]])
  eq(j(pt.tensor({ 2.5 })), "2.5")
  raises(function() j(function() end) end, "a function cannot be written as JSON")
  local t = {}
  t.self = t
  raises(function() j(t) end, "contains itself")
end)

test("pt.log writes a record a step, with time; a resumed run's first step drops the repeats", function()
  local path = os.tmpname()
  -- The file an interrupted run left: steps 1..5 and a torn last line.
  write(path, '{"event":"run","time":1}\n{"step":1,"loss":3}\n{"step":2,"loss":2.5}\n{"step":3,"loss":2}\n'
    .. '{"event":"memory","step":3,"ranks":[1]}\n{"step":4,"loss":1.5}\n{"step":5,"lo')
  pt.metrics(path)
  eq(pt.metrics.file(), path)
  pt.log { step = 3, loss = 0 / 0, lr = 0.1, note = "x\"y" }   -- resumed from a checkpoint at step 2
  pt.log { step = 4, loss = pt.tensor({ 1.25 }) }
  pt.log { epoch = 1 }                                        -- no step: printed, not recorded
  pt.metrics(false)
  local got = lines(path)
  eq(#got, 6, "header, steps 1 and 2 kept; the new header, steps 3 and 4: " .. read(path))
  eq(got[1], '{"event":"run","time":1}')
  eq(got[2], '{"step":1,"loss":3}', "kept lines are kept as they were")
  eq(got[3], '{"step":2,"loss":2.5}')
  ok(got[4]:find('"event":"run"') and got[4]:find('"world":1'), "a new run header: " .. got[4])
  ok(got[5]:find('^{"loss":null,"lr":0.1') and got[5]:find('"note":"x\\"y","step":3,"time":%d'), got[5])
  ok(got[6]:find('"loss":1.25,"step":4,"time":'), got[6])
  os.remove(path)
end)

-- pt.metrics.write had written a NaN step as null, dropping none of the records a resumed run
-- repeats; pt.log checked only that it was a number.
test("a record's step must be a finite number, in pt.metrics.write, pt.metrics.memory and pt.log: the file keeps its records", function()
  local path = os.tmpname()
  local before = '{"event":"run","time":1}\n{"step":1,"loss":3}\n{"step":2,"loss":2.5}\n'
  write(path, before)
  pt.metrics(path)
  raises(function() pt.metrics.write { step = 0 / 0, loss = 1 } end, "pt.metrics.write: step must be a finite number, got")
  raises(function() pt.metrics.write { step = 1 / 0 } end, "pt.metrics.write: step must be a finite number, got inf")
  raises(function() pt.metrics.write { step = "3" } end, "pt.metrics.write: step must be a finite number, got string")
  -- pt.metrics.memory checks its step before its collective, on every rank alike.
  raises(function() pt.metrics.memory(0 / 0) end, "pt.metrics.memory: step must be a finite number, got")
  pt.metrics(false)
  eq(read(path), before, "nothing dropped or written")
  os.remove(path)
end)

test("pt.log's rank option: a rank number or \"all\", anything else refused at the caller's line", function()
  raises(function() pt.log({ step = 1 }, { rank = 1 }) end, "rank must be a rank from 0 to 0 or \"all\", got 1")
  raises(function() pt.log({ step = 1 }, { rank = "some" }) end, "got 'some'")
  raises(function() pt.log({ step = 1 }, { ranks = 0 }) end, "pt.log has no option 'ranks'")
  raises(function() pt.log({ step = "one" }) end, "step must be a finite number, got string")
  -- A NaN step had been printed, and written to the metrics file as null; a table as its address.
  raises(function() pt.log({ step = 0 / 0 }) end, "step must be a finite number, got")
  raises(function() pt.log({ step = 1, x = {} }) end, "field 'x' is a table; numbers, strings, booleans and one-element tensors are logged")
  local err = raises(function() pt.log({ loss = pt.zeros(2) }) end, "tensor of 2 elements")
  ok(err:find("test_observability.lua:%d+:"), err)
end)

test("the metrics file is refused when it is a folder, naming it", function()
  pt.metrics("/tmp")
  local err = raises(function() pt.log { step = 1, loss = 1 } end, "'/tmp'")
  ok(err:find("test_observability.lua:%d+:"), "at the caller's line: " .. err)
  pt.metrics(false)
  raises(function() pt.metrics("") end, "a file name (string) or false expected")
end)

test("pt.metrics.memory: one record with every rank's peak bytes", function()
  local path = os.tmpname()
  pt.metrics(path)
  local ranks = pt.metrics.memory(7)
  pt.metrics(false)
  eq(#ranks, 1)
  ok(ranks[1] > 0 and ranks[1] <= pt.memory().allocated_peak, "peak bytes: " .. ranks[1])
  local got = lines(path)
  ok(got[2]:find('^{"event":"memory","ranks":%[%d+%],"step":7,"time":'), got[2])
  os.remove(path)
end)

-- FLOPs a token: N counted by pt.flops_per_token against the model's own parameters.
test("flops_per_token: GPT-2 counts every parameter but the position embeddings (wte is the head)", function()
  local o = { vocab = 96, seq = 24, dim = 32, heads = 4, layers = 3 }
  local model = pt.models.gpt2(o)
  local wpe = o.seq * o.dim
  local flops, n = pt.flops_per_token(model, 16)
  eq(n, model:num_parameters() - wpe, "N")
  eq(flops, 6 * n + 12 * o.layers * o.dim * 16, "6N + 12 L D T")
  o.family = "gpt2"
  eq(pt.flops_per_token(o, 16), flops, "from the options table")
end)

test("flops_per_token: LLaMA counts the head and not the token embedding; grouped-query k, v; tied", function()
  local o = { vocab = 64, seq = 16, dim = 32, heads = 4, kv_heads = 2, layers = 2 }
  local model = pt.models.llama(o)
  local flops, n = pt.flops_per_token(model, 16)
  eq(n, model:num_parameters() - o.vocab * o.dim, "N (untied: the embedding is a lookup)")
  eq(flops, 6 * n + 12 * o.layers * o.dim * 16)
  o.family = "llama"
  eq(pt.flops_per_token(o, 16), flops, "from the options table")
  o.family, o.tie = nil, true
  local tied = pt.models.llama(o)
  local _, nt = pt.flops_per_token(tied, 16)
  eq(nt, tied:num_parameters(), "N (tied: the shared matrix once, as the head)")
  eq(nt, n, "tying changes no FLOPs")
end)

test("flops_per_token refuses a parallelized model, other models, and bad sizes", function()
  raises(function() pt.flops_per_token(pt.nn.Linear(2, 2), 4) end, "a GPT-2 or LLaMA model")
  raises(function() pt.flops_per_token({ family = "bert", dim = 8 }, 4) end, "family must be \"gpt2\" or \"llama\"")
  local e = raises(function() pt.flops_per_token({ family = "gpt2", vocab = 8, dim = 8, heads = 3, layers = 1 }, 4) end,
    "heads=3 does not divide dim=8")
  ok(e:find("test_observability.lua:%d+:"), e)
  e = raises(function() pt.flops_per_token({ family = "gpt2", vocab = 8, dim = 8.5, heads = 2, layers = 1 }, 4) end,
    "dim must be a whole number, got 8.5")
  ok(e:find("test_observability.lua:%d+:"), e)
  raises(function() pt.flops_per_token({ family = "gpt2", vocab = 8, dim = 8, heads = 2, layers = 1 }, 0) end,
    "seq (tokens a sequence) must be a whole number >= 1, got 0")
  local model = pt.parallelize(pt.models.gpt2 { vocab = 16, seq = 8, dim = 8, heads = 2, layers = 1 }, nil, pt.mesh {})
  raises(function() pt.flops_per_token(model, 8) end, "this model is parallelized")
end)

test("pt.progress: options checked; MFU is TFLOP/s over the peak of every device", function()
  raises(function() pt.progress { totl = 5 } end, "pt.progress has no option 'totl'")
  raises(function() pt.progress { every = 0 } end, "every must be a whole number >= 1, got 0")
  raises(function() pt.progress { every = -1 } end, "every must be a whole number >= 1, got -1")
  raises(function() pt.progress { tokens = -1 } end, "tokens must be a finite number >= 0, got -1")
  raises(function() pt.progress { enabled = "no" } end, "enabled must be true or false")
  local p = pt.progress { tokens = 1000, flops_per_token = 6e9, peak_tflops = 12 }
  local r = p:rates(3, 2)
  near(r.tokens_per_s, 1500, 1e-12); near(r.tflops, 9, 1e-12); near(r.mfu, 0.75, 1e-12)
  eq(pt.progress {}:rates(1, 1).mfu, nil, "no peak on the CPU: no MFU")
end)

-- pt.args: descriptions and config files.
test("pt.args: { default, description } and pt.args.option keep the old forms working", function()
  local spec = { steps = { 200, "steps to train" }, lr = pt.args.number(3e-3, "learning rate"),
                 out = pt.args.option("ckpt", "where"), plain = 4, frac = pt.args.option(pt.args.number(1), "f") }
  local cfg = pt.args(spec, { "--steps", "5", "--frac", "0.5" })
  eq(cfg.steps, 5); eq(cfg.lr, 3e-3); eq(cfg.out, "ckpt"); eq(cfg.plain, 4); eq(cfg.frac, 0.5)
  raises(function() pt.args(spec, { "--steps", "1.5" }) end, "--steps expects an integer, got '1.5'")
  raises(function() pt.args({ x = { 1, 2 } }, {}) end, "option 'x' has a table default")
  raises(function() pt.args.option({}, "x") end, "pt.args.option expects a number, string or boolean default")
  raises(function() pt.args.number(1, 5) end, "the description must be a string")
end)

local config = os.tmpname()
local spec = { steps = { 200, "steps" }, lr = pt.args.number(0.1, "lr"), name = { "run", "name" }, fp16 = false }

test("--config: the file's values replace the defaults, flags win over it", function()
  write(config, "-- a run's settings\nreturn {\n  steps = 50,\n  lr = 0.5 * 2,\n  name = 'from ' .. 'file',\n}\n")
  local cfg = pt.args(spec, { "--config", config, "--steps", "7" })
  eq(cfg.steps, 7, "the flag"); eq(cfg.lr, 1, "the file"); eq(cfg.name, "from file", "the file"); eq(cfg.fp16, false)
  cfg = pt.args(spec, { "--steps=9", "--config=" .. config })
  eq(cfg.steps, 9, "a flag before --config wins too")
end)

test("--config: unknown keys and wrong types name the file and line; no io, os or require", function()
  write(config, "return {\n  steps = 50,\n  stpes = 3,\n}\n")
  raises(function() pt.args(spec, { "--config", config }) end, config .. ":3: unknown option 'stpes' (known: --fp16")
  write(config, "return {\n  name = 'x',\n  steps = 2.5 }\n")
  raises(function() pt.args(spec, { "--config", config }) end, config .. ":3: option 'steps' expects an integer, got number 2.5")
  -- Checked as flags are: lr = 0/0 and 2^60 steps had been taken, status 0.
  write(config, "return {\n  lr = 0/0 }\n")
  raises(function() pt.args(spec, { "--config", config }) end, config .. ":2: option 'lr' expects a finite number, got nan")
  write(config, "return { lr = math.huge }\n")
  raises(function() pt.args(spec, { "--config", config }) end, ":1: option 'lr' expects a finite number, got inf")
  write(config, "return { steps = 2^60 }\n")
  raises(function() pt.args(spec, { "--config", config }) end,
    ":1: option 'steps' expects an integer below 2^53 in size, got 1152921504606846976")
  write(config, "return { fp16 = 'yes' }\n")
  raises(function() pt.args(spec, { "--config", config }) end, ":1: option 'fp16' expects true or false, got string 'yes'")
  write(config, "os.execute('true')\nreturn {}\n")
  raises(function() pt.args(spec, { "--config", config }) end, config .. ":1: attempt to index global 'os'")
  write(config, "return require 'partrain'\n")
  raises(function() pt.args(spec, { "--config", config }) end, "attempt to call global 'require'")
  write(config, "return 5\n")
  raises(function() pt.args(spec, { "--config", config }) end, "must return a table of option values, got number")
  write(config, "while true do end\n")
  raises(function() pt.args(spec, { "--config", config }) end, "runs too long")
  -- Memory: a string doubled in a loop (gigabytes in 30 instructions), or string.rep as a
  -- function or a method, is stopped before it takes more than 64 MB.
  write(config, "local s = 'x'\nfor i = 1, 40 do s = s .. s end\nreturn {}\n")
  raises(function() pt.args(spec, { "--config", config }) end, "uses more than 64 MB of memory")
  write(config, "local s = string.rep('x', 2^30)\nreturn {}\n")
  raises(function() pt.args(spec, { "--config", config }) end, "makes a string of 1073741824 bytes with string.rep")
  write(config, "local s = ('ab'):rep(2^29)\nreturn {}\n")
  raises(function() pt.args(spec, { "--config", config }) end, config .. ":1: makes a string of 1073741824 bytes")
  eq(("ab"):rep(2), "abab", "string.rep is itself again after the config file")
  -- string.rep as it reads its arguments: numbers as text, counts as text, a separator between.
  for _, body in ipairs { "string.rep(12345678, 2^27)", "('12345678'):rep('134217728')",
                          "string.rep('', 2^20, ('y'):rep(1023) .. 'z')" } do
    write(config, "local s = " .. body .. "\nreturn {}\n")
    raises(function() pt.args(spec, { "--config", config }) end, "makes a string of 10737", body)
  end
  -- Stopped for running too long, the caller's hook and string.rep are put back.
  local function mine() end
  debug.sethook(mine, "", 1000000)
  write(config, "for i = 1, 2e7 do end\nreturn {}\n")
  raises(function() pt.args(spec, { "--config", config }) end, config .. ":1: runs too long")
  eq(debug.gethook(), mine, "the caller's hook is back")
  debug.sethook()
  eq(("ab"):rep(2, "-"), "ab-ab", "string.rep is itself again")
  write(config, "return { name = ('x'):rep(1000) }\n")
  eq(#pt.args(spec, { "--config", config }).name, 1000, "a reasonable string.rep is read")
  -- Found by tests/fuzz/fuzz_config.py: a gsub callback that recursed overflowed the C stack
  -- (SIGSEGV); one table.concat of gigabytes was made before the next instruction's check; a
  -- string grown a byte a step ran for hours inside ten million instructions; error({}) named
  -- no file.
  write(config, "local function f(s) return (s:gsub('.', f)) end\nreturn { name = f('abc') }\n")
  raises(function() pt.args(spec, { "--config", config }) end, config .. ":1: string.gsub is not available")
  write(config, "local t = {}\nfor i = 1, 40 do t[i] = ('x'):rep(2^25) end\nreturn { name = table.concat(t) }\n")
  raises(function() pt.args(spec, { "--config", config }) end, "(it asked for more than 128 MB at once)")
  write(config, "local s = ''\nwhile true do s = s .. 'x' end\n")
  raises(function() pt.args(spec, { "--config", config }) end, config .. ":2: runs too long")
  write(config, "error({})\n")
  raises(function() pt.args(spec, { "--config", config }) end, "config file '" .. config .. "' raised a table")
  eq(("abc"):gsub("b", "x"), "axc", "strings' methods are all back after a config file")
  -- The line of a bad key, found in one pass: a pattern search of a file of blanks had taken
  -- seconds for 40 KB and hours for 1 MiB.
  write(config, "return {\n" .. (" \t"):rep(400000) .. "\n  [\"\\t\"] = 1,\n  steps = 2 }\n")
  local began = os.clock()
  raises(function() pt.args(spec, { "--config", config }) end, config .. ":3: unknown option")
  ok(os.clock() - began < 2, ("the line is found in %.1f s"):format(os.clock() - began))
  raises(function() pt.args(spec, { "--config", "/tmp" }) end, "'/tmp' is a folder")
  raises(function() pt.args(spec, { "--config" }) end, "--config needs a file")
  raises(function() pt.args(spec, { "--config", config, "--config", config }) end, "--config given twice")
  eq(pt.args({ config = "mine" }, { "--config", "x" }).config, "x", "a script's own --config option wins")
end)
os.remove(config)

H.run()
