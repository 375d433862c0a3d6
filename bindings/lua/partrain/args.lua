-- pt.args: command-line options for a training script, nanoGPT's configurator done properly.
--   local cfg = pt.args { epochs = 3, lr = pt.args.number(0.1, "learning rate"),
--                         steps = { 200, "steps to train" }, out = pt.args.option("ckpt", "where to save") }
--   partrain train.lua --epochs 1 --lr=0.05 --no-fp16 --config run.lua
-- The type of each default is the option's type; integer defaults take integers only (wrap a
-- float option whose default happens to be whole in pt.args.number). A description (the second
-- value) shows in --help. --config FILE reads a Lua file returning a table of option values
-- (data only: no io, os or require) that replaces the defaults; flags on the command line win
-- over it. Unknown options, missing values and values of the wrong type are errors that name the
-- option (and the config file's line); --help lists them all.
local core = require "partrain.core"
local raise = core._raise

local args = {}

local NUMBER = {}   -- marks a pt.args.number(default [, description])
local OPTION = {}   -- marks a pt.args.option(default, description)

local function description_of(fn, description)
  if description ~= nil and type(description) ~= "string" then
    raise(("%s: the description must be a string, got %s"):format(fn, type(description)), 3)
  end
  return description
end

--- Declares a number option whose default is a whole number but which takes any number.
function args.number(default, description)
  if type(default) ~= "number" then raise("pt.args.number expects a number, got " .. type(default), 2) end
  return setmetatable({ default = default, description = description_of("pt.args.number", description) }, NUMBER)
end

--- Declares an option with a description: pt.args.option(200, "steps to train").
function args.option(default, description)
  local t = type(default)
  if t ~= "number" and t ~= "string" and t ~= "boolean" and getmetatable(default) ~= NUMBER then
    raise("pt.args.option expects a number, string or boolean default, got " .. t, 2)
  end
  return setmetatable({ default = default, description = description_of("pt.args.option", description) }, OPTION)
end

-- The kind ("integer", "number", "string", "boolean"), default and description of a spec value,
-- or nil when it is none of the forms.
local function kind_of(v)
  local mt = getmetatable(v)
  if mt == NUMBER then return "number", v.default, v.description end
  local description
  if mt == OPTION then
    v, description = v.default, v.description
    if getmetatable(v) == NUMBER then return "number", v.default, description or v.description end
  elseif type(v) == "table" and mt == nil then  -- { default, "description" }
    local n = 0
    for _ in pairs(v) do n = n + 1 end
    if n ~= 2 or v[1] == nil or type(v[2]) ~= "string" then return nil end
    v, description = v[1], v[2]
    if getmetatable(v) == NUMBER then return "number", v.default, description end
  end
  local t = type(v)
  if t == "number" and v == math.floor(v) then return "integer", v, description end
  if t == "number" or t == "string" or t == "boolean" then return t, v, description end
  return nil
end

-- What a number given for an option of `kind` is not, or nil: finite only (--lr inf or nan, or
-- lr = 0/0 in a config file, trained every weight to NaN); an integer exactly as written (2^53 + 1
-- would round to another). The command line and config files say it alike.
local function number_problem(kind, x)
  if x ~= x or x == math.huge or x == -math.huge then return "a finite number" end
  if kind == "integer" and math.abs(x) >= 2 ^ 53 then return "an integer below 2^53 in size" end
end

local function convert(name, kind, text)
  if kind == "string" then return text end
  if kind == "boolean" then
    local truth = { ["true"] = true, ["1"] = true, yes = true, on = true,
                    ["false"] = false, ["0"] = false, no = false, off = false }
    local b = truth[text:lower()]
    if b == nil then error(("--%s expects true or false, got '%s'"):format(name, text), 0) end
    return b
  end
  local x = tonumber(text)
  if x == nil or (kind == "integer" and x ~= math.floor(x)) then
    error(("--%s expects %s, got '%s'"):format(name, kind == "integer" and "an integer" or "a number", text), 0)
  end
  local problem = number_problem(kind, x)
  if problem then error(("--%s expects %s, got '%s'"):format(name, problem, text), 0) end
  return x
end

local function usage(spec, config)
  local names = {}
  for k in pairs(spec) do names[#names + 1] = k end
  table.sort(names)
  local lines = { "options (type [default] description):" }
  for _, k in ipairs(names) do
    local kind, default, description = kind_of(spec[k])
    local shown = kind == "string" and ("'%s'"):format(default) or tostring(default)
    lines[#lines + 1] = ("  --%-20s %-8s %-10s %s"):format(k:gsub("_", "-"), kind, "[" .. shown .. "]",
      description or ""):gsub("%s+$", "")
  end
  if config then
    lines[#lines + 1] = ("  --%-20s %-8s %-10s %s"):format("config", "file", "", "a Lua file returning a table of "
      .. "option values (defaults for the flags given here)")
  end
  return table.concat(lines, "\n")
end

-- The partrain command's own flags (`partrain --help`; tests/cli/test_cli.sh checks that this
-- list holds them all): one given after the script reaches the script, which is told where it goes.
local partrain_flags = {}
for name in ([[check-collectives device execute hang-timeout interactive master-addr master-port max-restarts
  metrics nnodes no-progress node-rank node-timeout nproc-per-node plan plan-mode rdzv-secret-file
  restart-backoff tee threads timeout trace trace-steps version]]):gmatch("%S+") do
  partrain_flags[name] = true
end

-- The word of `words` nearest to `word` ("--epoch" -> "--epochs"), or nil (the engine's rule:
-- within a third of its length).
local function nearest(words, word) return core.files.nearest_word(words, word) end

-- ---- Config files ----------------------------------------------------------------------------

local byte, char, find, sub = string.byte, string.char, string.find, string.sub

-- The escapes of a quoted Lua string that stand for one byte each.
local escapes = { a = "\a", b = "\b", f = "\f", n = "\n", r = "\r", t = "\t", v = "\v", ["\\"] = "\\",
                  ['"'] = '"', ["'"] = "'" }

-- Where each key of a config file's source is first set: { [key] = line } for each name, or
-- string in brackets, that follows `{`, `,` or `;` and comes before `=`. One pass over the text,
-- each byte looked at a bounded number of times (no pattern that backtracks), so a file of any
-- shape (a megabyte of blanks, a key as long as the file) is read in time linear in its size,
-- which read_config bounds.
local function key_lines(text)
  local found, n, line, i = {}, #text, 1, 1
  local k1, k2, k3, k4 = "", "", "", ""  -- the last four tokens' kinds, newest first
  local v1, l1, v2, l2                     -- the values and lines of the newest two
  local function token(kind, value, at)
    k4, k3, k2, k1 = k3, k2, k1, kind
    v2, l2, v1, l1 = v1, l1, value, at
  end
  local function opens(k) return k == "{" or k == "," or k == ";" end
  -- Past the line break at j: \n, \r, \r\n or \n\r, one line each as Lua counts them.
  local function newline(j)
    local c, d = byte(text, j, j + 1)
    line = line + 1
    return (d == 10 or d == 13) and d ~= c and j + 2 or j + 1
  end
  -- Past the end of a long bracket of `level` `=`s whose text starts at j; that text.
  local function long_end(j, level)
    local from = j
    while true do
      local k = find(text, "[%]\n\r]", j)
      if not k then return n + 1, sub(text, from) end
      if byte(text, k) == 93 then
        local _, e = find(text, "^=*", k + 1)
        if e - k == level and byte(text, e + 1) == 93 then return e + 2, sub(text, from, k - 1) end
        j = e + 1
      else
        j = newline(k)
      end
    end
  end
  -- Past a quoted string whose text starts at j (after the quote `q`); its value (nil where an
  -- escape is not read here: \u{...}).
  local function quoted(j, q)
    local parts, exact = {}, true
    local stop = q == 34 and '["\\\n\r]' or "['\\\n\r]"
    while true do
      local k = find(text, stop, j)
      if not k then return n + 1, nil end
      parts[#parts + 1] = sub(text, j, k - 1)
      local c = byte(text, k)
      if c == q then return k + 1, exact and table.concat(parts) or nil end
      if c ~= 92 then return k, nil end  -- a line break: not a string Lua would have read
      local e = sub(text, k + 1, k + 1)
      if escapes[e] then
        parts[#parts + 1], j = escapes[e], k + 2
      elseif e == "\n" or e == "\r" then
        parts[#parts + 1], j = "\n", newline(k + 1)
      elseif e == "x" then
        parts[#parts + 1], j = char(tonumber(sub(text, k + 2, k + 3), 16) or 0), k + 4
      elseif e == "z" then  -- skips blanks and line breaks
        j = k + 2
        while true do
          local _, b = find(text, "^[ \t\v\f]*", j)
          j = b + 1
          local d = byte(text, j)
          if d ~= 10 and d ~= 13 then break end
          j = newline(j)
        end
      elseif find(e, "^%d") then
        local _, b, digits = find(text, "^(%d%d?%d?)", k + 1)
        parts[#parts + 1], j = char(tonumber(digits) % 256), b + 1
      else
        exact, j = false, k + 2
      end
    end
  end
  while i <= n do
    local c = byte(text, i)
    if c == 10 or c == 13 then
      i = newline(i)
    elseif c == 32 or c == 9 or c == 11 or c == 12 then
      local _, e = find(text, "^[ \t\v\f]+", i)
      i = e + 1
    elseif c == 45 and byte(text, i + 1) == 45 then  -- a comment, long or to the line's end
      local _, e, level = find(text, "^%[(=*)%[", i + 2)
      if e then i = long_end(e + 1, #level) else i = find(text, "[\n\r]", i) or n + 1 end
    elseif c == 91 then  -- a long string, or a bracket
      local at, _, e, level = line, find(text, "^%[(=*)%[", i)
      if e then
        local value
        i, value = long_end(e + 1, #level)
        token("string", (value:gsub("^\r?\n", "", 1)), at)
      else
        token("[", nil, line)
        i = i + 1
      end
    elseif c == 34 or c == 39 then
      local at, value = line, nil
      i, value = quoted(i + 1, c)
      token("string", value, at)
    elseif find(text, "^[A-Za-z_\128-\255]", i) then
      local _, e = find(text, "^[A-Za-z0-9_\128-\255]+", i)
      token("name", sub(text, i, e), line)
      i = e + 1
    elseif c >= 48 and c <= 57 then
      local _, e = find(text, "^[A-Za-z0-9_.]+", i)
      token("number", nil, line)
      i = e + 1
    elseif c == 61 and byte(text, i + 1) ~= 61 then
      local key, at
      if k1 == "name" and opens(k2) then key, at = v1, l1 end
      if k1 == "]" and k2 == "string" and k3 == "[" and opens(k4) then key, at = v2, l2 end
      if key ~= nil and found[key] == nil then found[key] = at end
      token("=", nil, line)
      i = i + 1
    elseif (c == 61 or c == 60 or c == 62 or c == 126) and byte(text, i + 1) == 61 then  -- == <= >= ~=
      token("op", nil, line)
      i = i + 2
    else
      token(char(c), nil, line)
      i = i + 1
    end
  end
  return found
end

local kMaxInstructions = 10000000   -- a config file is data: a loop this long is a mistake
local kMaxSeconds = 5                -- and so is one that takes this long (a string grown a byte a
                                     -- step copies it whole each time: quadratic in few steps)
local kMaxMemoryMB = 64              -- and so is more memory than this (its text is at most 1 MiB)
-- What one step of a file may take at once (one table.concat or string.format): the allocator
-- refuses past it, before the memory is taken.
local kMaxAtOnceMB = 2 * kMaxMemoryMB

-- What a config file may call. A config file is data (a table of numbers, strings and
-- booleans), and these make such values, each in one C call of time linear in what it makes
-- (which the memory bound bounds). Left out, besides whatever reaches files, processes or the
-- loader: Lua called back from C (string.gsub's replacement function, table.sort's comparison,
-- table.foreach), which recursing overflows the C stack, a crash no error catches; pattern
-- matching (string.find, match, gmatch, gsub), which can backtrack in C for hours, unseen by the
-- instruction count and the clock, as can string.find's plain search of a long string for a long
-- one and table.sort of a million copies of a long string; string.dump; and math.random and
-- math.randomseed, whose generator is the script's.
local allowed = {
  string = { "byte", "char", "format", "len", "lower", "rep", "reverse", "sub", "upper" },
  table = { "concat", "insert", "maxn", "remove" },
}

local function too_much(what) return what .. "; a config file should only return a table" end

-- A config file's environment: the basic functions that read values, and math, string and
-- table as `allowed` says, with string.rep bounded. Naming another function of these libraries
-- is an error that says it is not there.
local function sandbox()
  local env = {}
  for _, name in ipairs { "assert", "error", "ipairs", "next", "pairs", "select", "tonumber", "tostring", "type",
                          "unpack" } do
    env[name] = _G[name]
  end
  env.math = {}
  for k, v in pairs(math) do
    if k ~= "random" and k ~= "randomseed" then env.math[k] = v end
  end
  for lib, names in pairs(allowed) do
    env[lib] = {}
    for _, k in ipairs(names) do env[lib][k] = _G[lib][k] end
  end
  local rep = string.rep
  -- string.rep, as it reads its arguments (numbers as text, text as counts, a separator between
  -- copies), refused past the bound before it allocates, naming the file's line.
  env.string.rep = function(text, n, sep)
    local t, k = type(text) == "number" and tostring(text) or text, tonumber(n)
    local s = type(sep) == "number" and tostring(sep) or sep
    if type(t) == "string" and k and k > 0 then
      local bytes = #t * k + (type(s) == "string" and #s * (k - 1) or 0)
      if bytes > kMaxMemoryMB * 2 ^ 20 then
        raise(too_much(("makes a string of %.0f bytes with string.rep (more than %d MB)"):format(bytes, kMaxMemoryMB)), 2)
      end
    end
    return rep(text, n, sep)
  end
  for lib in pairs { math = 1, string = 1, table = 1 } do
    setmetatable(env[lib], { __index = function(_, k)
      raise(("%s.%s is not available in a config file (a config file is data: a table of numbers, strings and "
        .. "booleans)"):format(lib, tostring(k)), 2)
    end })
  end
  return env
end

-- A message of a config file's error as one line of at most 300 bytes.
local function one_line(message)
  message = message:gsub("%c", " ")
  return #message > 300 and message:sub(1, 300) .. "..." or message
end

-- Runs a config file's text in the sandbox, bounded in instructions, time, memory (between
-- instructions, and at once) and C stack (nothing in the sandbox calls back into Lua); returns
-- what it returns, or raises an error naming the file.
local function run_config(path, text, what)
  what = what or "config file"
  local env, source = sandbox(), "@" .. path
  local strings = getmetatable("")
  local index = strings.__index
  local hook, mask, count = debug.gethook()  -- a hook set before (the REPL's) is put back after
  local steps, every, deadline = 0, 100, core.now() + kMaxSeconds
  collectgarbage()
  local base = collectgarbage("count")
  local function over() return collectgarbage("count") - base > kMaxMemoryMB * 1024 end
  local function check()
    steps = steps + every
    local problem = steps > kMaxInstructions and ("runs too long (more than %d instructions)"):format(kMaxInstructions)
      or core.now() > deadline and ("runs too long (more than %d s)"):format(kMaxSeconds)
    if not problem and over() then
      collectgarbage()  -- garbage does not count: only what the file holds
      problem = over() and ("uses more than %d MB of memory"):format(kMaxMemoryMB)
    end
    -- Only in the file's own code: this function's lines after it returns (putting the
    -- string methods and the caller's hook back) must run to the end.
    if problem and debug.getinfo(2, "S").source == source then
      debug.sethook()  -- the file has no pcall to go on with: one error stops it
      raise(too_much(problem), 2)
    end
  end
  core._memory_budget(kMaxAtOnceMB * 2 ^ 20)
  local chunk, err = loadstring(text, source)
  local ok, values = false, err
  if chunk then
    setfenv(chunk, env)
    if jit then jit.off(chunk, true) end  -- the count hook needs the interpreter
    strings.__index = env.string          -- ("x"):gsub(...) reaches what the file may call, no more
    debug.sethook(check, "", every)
    ok, values = pcall(chunk)
    debug.sethook()
    strings.__index = index
  end
  local refused = core._memory_budget()
  if hook then debug.sethook(hook, mask, count) else debug.sethook() end
  if ok then return values end
  if refused or values == "not enough memory" then
    error(("%s '%s': %s"):format(what, path, too_much(("uses more than %d MB of memory (it asked for more than %d "
      .. "MB at once)"):format(kMaxMemoryMB, kMaxAtOnceMB))), 0)
  end
  if type(values) ~= "string" and type(values) ~= "number" then
    error(("%s '%s' raised a %s, not an error message"):format(what, path, type(values)), 0)
  end
  local message = one_line(tostring(values))
  if sub(message, 1, #path + 1) ~= path .. ":" then message = ("'%s': %s"):format(path, message) end
  error(what .. " " .. message, 0)
end

-- The option values a config file returns, checked against the kinds: { key = value }.
local function read_config(path, kinds, known)
  local text = core.files.read_config(path)
  if sub(text, 1, 1) == "\27" then error(("config file '%s': Lua bytecode; a config file must be Lua source"):format(path), 0) end
  local values = run_config(path, text)
  if type(values) ~= "table" then
    error(("config file '%s' must return a table of option values, got %s"):format(path, type(values)), 0)
  end
  local lines  -- found when a message needs them
  local function where(k)
    lines = lines or key_lines(text)
    local line = type(k) == "string" and lines[k]
    return line and ("%s:%d"):format(path, line) or ("'%s'"):format(path)
  end
  local key_text = core._key_text
  local out = {}
  for k, v in pairs(values) do
    if type(k) ~= "string" then
      error(("config file %s: option names must be strings, got %s %s"):format(where(k), type(k), key_text(k)), 0)
    end
    local key = k:gsub("%-", "_")
    local kind = kinds[key]
    if kind == nil then
      local near = nearest(known, "--" .. k:gsub("_", "-"))
      error(("config file %s: unknown option %s (known: %s)%s"):format(where(k), key_text(k), table.concat(known, ", "),
        near and ("; did you mean %s?"):format(near:sub(3):gsub("%-", "_")) or ""), 0)
    end
    local good = (kind == "integer" and type(v) == "number" and v % 1 == 0) or (kind == "number" and type(v) == "number")
      or type(v) == kind
    if not good then
      local expected = kind == "integer" and "an integer" or kind == "number" and "a number" or kind == "boolean"
        and "true or false" or "a string"
      error(("config file %s: option %s expects %s, got %s %s"):format(where(k), key_text(k), expected, type(v),
        type(v) == "string" and key_text(v) or tostring(v)), 0)
    end
    local problem = type(v) == "number" and number_problem(kind, v)
    if problem then  -- a whole number in full (2^60 prints as 1.15e+18), anything else as Lua prints it
      local shown = v == v and v % 1 == 0 and math.abs(v) < math.huge and ("%.0f"):format(v) or tostring(v)
      error(("config file %s: option %s expects %s, got %s"):format(where(k), key_text(k), problem, shown), 0)
    end
    out[key] = v
  end
  return out
end

local function parse(spec, argv)
  local out, kinds = {}, {}
  for k, v in pairs(spec) do
    if type(k) ~= "string" then error("pt.args: option names must be strings, got " .. type(k), 0) end
    local kind, default = kind_of(v)
    if not kind then
      error(("pt.args: option '%s' has a %s default; use a number, string or boolean, or { default, \"description\" }")
        :format(k, type(v)), 0)
    end
    kinds[k], out[k] = kind, default
  end
  local known = {}
  for k in pairs(spec) do known[#known + 1] = "--" .. k:gsub("_", "-") end
  table.sort(known)
  local takes_config = kinds.config == nil   -- a script's own --config option wins

  for i = 1, #argv do
    if type(argv[i]) ~= "string" then error(("pt.args: argv[%d] must be a string, got %s"):format(i, type(argv[i])), 0) end
  end
  -- --config FILE first, wherever it stands: its values are the defaults the flags override.
  local config_file
  local words = {}
  local i = 1
  while i <= #argv do
    local word = argv[i]
    local value = takes_config and word:match("^%-%-config=(.*)$")
    if takes_config and (value or word == "--config") then
      if not value then
        value = argv[i + 1]
        if value == nil then error("--config needs a file (a Lua file returning a table of option values)", 0) end
        i = i + 1
      end
      if config_file then error(("--config given twice ('%s' and '%s')"):format(config_file, value), 0) end
      config_file = value
    else
      words[#words + 1] = word
    end
    i = i + 1
  end
  if config_file then
    for k, v in pairs(read_config(config_file, kinds, known)) do out[k] = v end
  end

  i = 1
  while i <= #words do
    local word = words[i]
    if word == "--help" or word == "-h" then
      io.write(usage(spec, takes_config), "\n")
      io.flush()
      os.exit(0)
    end
    local name, value = word:match("^%-%-([^=]+)=(.*)$")
    name = name or word:match("^%-%-(.+)$")
    if not name then
      error(("unexpected argument '%s' (options look like --name value)"):format(word), 0)
    end
    local key = name:gsub("%-", "_")
    if kinds[key] == nil and key:sub(1, 3) == "no_" and kinds[key:sub(4)] == "boolean" and value == nil then
      key, value = key:sub(4), "false"
    end
    if kinds[key] == nil then
      local hint = partrain_flags[(name:gsub("_", "-"))]
        and ("; --%s is partrain's own flag: it goes before the script (partrain --%s ... %s)"):format(name, name,
          arg and arg[0] or "script.lua")
        or ""
      if hint == "" then
        local near = nearest(known, "--" .. name)
        if near then hint = ("; did you mean %s?"):format(near) end
      end
      error(("unknown option --%s (known: %s)%s"):format(name, table.concat(known, ", "), hint), 0)
    end
    if value == nil then
      local nextword = words[i + 1]
      if kinds[key] == "boolean" then
        local lower = nextword and nextword:lower()
        if lower == "true" or lower == "false" then value, i = nextword, i + 1 else value = "true" end
      else
        if nextword == nil then error(("--%s needs a value"):format(name), 0) end
        value, i = nextword, i + 1
      end
    end
    out[key] = convert(name, kinds[key], value)
    i = i + 1
  end
  return out, config_file
end

--- args.load_data(path, what): what the Lua data file at `path` returns (a regular file of at
--- most 1 MiB, Lua source, run in the config files' sandbox: no io, os or require, bounded in
--- instructions, time and memory); errors name `what` ("device file") and the file.
function args.load_data(path, what)
  local text = core.files.read_config(path)
  if sub(text, 1, 1) == "\27" then error(("%s '%s': Lua bytecode; it must be Lua source"):format(what, path), 0) end
  return run_config(path, text, what)
end

--- The resolved options of the script's command line as one compact block: "config: a=1 b=x ...",
--- wrapped at about 100 columns.
function args.describe(cfg, config_file)
  if type(cfg) ~= "table" then raise(("pt.args.describe: expected the options table, got a %s"):format(type(cfg)), 2) end
  if config_file ~= nil and type(config_file) ~= "string" then
    raise(("pt.args.describe: the config file must be a path (a string), got a %s"):format(type(config_file)), 2)
  end
  local names = {}
  for k in pairs(cfg) do names[#names + 1] = k end
  table.sort(names)
  local lines, line = {}, "config" .. (config_file and (" (%s)"):format(config_file) or "") .. ":"
  for _, k in ipairs(names) do
    local v = cfg[k]
    local item = k .. "=" .. (type(v) == "string" and (v == "" or v:find("[%s=]")) and ("%q"):format(v) or tostring(v))
    if #line + 1 + #item > 100 then
      lines[#lines + 1] = line
      line = "  " .. item
    else
      line = line .. " " .. item
    end
  end
  lines[#lines + 1] = line
  return table.concat(lines, "\n")
end

return setmetatable(args, {
  --- pt.args(spec [, argv]): the defaults in spec overridden from argv (default: the script's
  --- arg). For the script's own arguments, the result is also kept as args.resolved (the run
  --- header of the metrics file and checkpoints' user data store it) and printed on rank 0, and
  --- each option's kind as args.declared ({ name = "integer"|"number"|"string"|"boolean" }).
  __call = function(_, spec, argv)
    if type(spec) ~= "table" then raise("pt.args expects a table of defaults, got " .. type(spec), 2) end
    if argv ~= nil and type(argv) ~= "table" then raise("pt.args: argv must be a list of strings, got " .. type(argv), 2) end
    local own = argv == nil
    argv = argv or _G.arg or {}
    local ok, result, config_file = pcall(parse, spec, argv)
    if not ok then raise(result, 2) end
    if own then
      local copy = {}
      for k, v in pairs(result) do copy[k] = v end
      args.resolved, args.config_file = copy, config_file
      -- What the script can be given (partrain plan --auto varies its layout options).
      args.declared = {}
      for k, v in pairs(spec) do args.declared[k] = kind_of(v) end
      if core.dist.rank() == 0 then
        local live = require "partrain.live"
        live.around(function() io.write(args.describe(copy, config_file), "\n"); io.flush() end)
      end
    end
    return result
  end,
})
