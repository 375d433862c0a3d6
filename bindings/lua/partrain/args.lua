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

-- The line of `text` (a config file's source) where `key` is set, or nil.
local function line_of(text, key)
  local n = 0
  for line in (text .. "\n"):gmatch("([^\n]*)\n") do
    n = n + 1
    local quoted = "%[%s*[\"']" .. key:gsub("%p", "%%%0") .. "[\"']%s*%]%s*="
    local bare = key:gsub("%p", "%%%0") .. "%s*="
    if line:find("^%s*" .. bare) or line:find("[{,;]%s*" .. bare) or line:find(quoted) then return n end
  end
end

-- What a config file may use: functions without access to files, processes or the loader.
local function sandbox()
  local env = {}
  for _, name in ipairs { "assert", "error", "ipairs", "next", "pairs", "select", "tonumber", "tostring", "type",
                          "unpack" } do
    env[name] = _G[name]
  end
  for _, lib in ipairs { "math", "string", "table" } do
    env[lib] = {}
    for k, v in pairs(_G[lib]) do env[lib][k] = v end
  end
  return env
end

local kMaxInstructions = 10000000   -- a config file is data: a loop this long is a mistake
local kMaxMemoryMB = 64              -- and so is more memory than this (its text is at most 1 MiB)

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

-- The option values a config file returns, checked against the kinds: { key = value }.
local function read_config(path, kinds, known)
  local text = core.files.read_config(path)
  if text:sub(1, 1) == "\27" then error(("config file '%s': Lua bytecode; a config file must be Lua source"):format(path), 0) end
  local chunk, err = loadstring(text, "@" .. path)
  if not chunk then error(("config file %s"):format(err), 0) end
  local env = sandbox()
  setfenv(chunk, env)
  if jit then jit.off(chunk, true) end  -- the limits below need the interpreter
  -- Instructions and memory, checked at every instruction: a string doubled in a loop reaches
  -- gigabytes in a few dozen. string.rep (also as a method: strings index the global string
  -- table) is bounded the same way before it allocates.
  local hook, mask, count = debug.gethook()  -- a hook set before (the REPL's) is put back after
  local base, steps, rep = collectgarbage("count"), 0, string.rep
  local function too_much(what) return what .. "; a config file should only return a table" end
  string.rep = function(text, n, sep)
    -- As string.rep reads them: numbers as text, text as counts; the separator between copies.
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
  env.string.rep = string.rep
  debug.sethook(function()
    steps = steps + 1
    local problem = steps > kMaxInstructions and ("runs too long (more than %d instructions)"):format(kMaxInstructions)
      or collectgarbage("count") - base > kMaxMemoryMB * 1024 and ("uses more than %d MB of memory"):format(kMaxMemoryMB)
    -- Only in the file's own code: this function's lines after it returns (putting string.rep
    -- and the caller's hook back) must run to the end.
    if problem and debug.getinfo(2, "S").source == "@" .. path then
      debug.sethook()  -- the file has no pcall to go on with: one error stops it
      raise(too_much(problem), 2)
    end
  end, "", 1)
  local ok, values = pcall(chunk)
  string.rep = rep
  if hook then debug.sethook(hook, mask, count) else debug.sethook() end
  if not ok then error(("config file %s"):format(tostring(values)), 0) end
  if type(values) ~= "table" then
    error(("config file '%s' must return a table of option values, got %s"):format(path, type(values)), 0)
  end
  local out = {}
  for k, v in pairs(values) do
    local line = type(k) == "string" and line_of(text, k)
    local where = line and ("%s:%d"):format(path, line) or ("'%s'"):format(path)
    if type(k) ~= "string" then
      error(("config file %s: option names must be strings, got %s %s"):format(where, type(k), tostring(k)), 0)
    end
    local key = k:gsub("%-", "_")
    local kind = kinds[key]
    if kind == nil then
      local near = nearest(known, "--" .. tostring(k):gsub("_", "-"))
      error(("config file %s: unknown option '%s' (known: %s)%s"):format(where, k, table.concat(known, ", "),
        near and ("; did you mean %s?"):format(near:sub(3):gsub("%-", "_")) or ""), 0)
    end
    local good = (kind == "integer" and type(v) == "number" and v % 1 == 0) or (kind == "number" and type(v) == "number")
      or type(v) == kind
    if not good then
      local expected = kind == "integer" and "an integer" or kind == "number" and "a number" or kind == "boolean"
        and "true or false" or "a string"
      error(("config file %s: option '%s' expects %s, got %s %s"):format(where, k, expected, type(v),
        type(v) == "string" and "'" .. v .. "'" or tostring(v)), 0)
    end
    local problem = type(v) == "number" and number_problem(kind, v)
    if problem then  -- a whole number in full (2^60 prints as 1.15e+18), anything else as Lua prints it
      local shown = v == v and v % 1 == 0 and math.abs(v) < math.huge and ("%.0f"):format(v) or tostring(v)
      error(("config file %s: option '%s' expects %s, got %s"):format(where, k, problem, shown), 0)
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
  --- header of the metrics file and checkpoints' user data store it) and printed on rank 0.
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
      if core.dist.rank() == 0 then
        local live = require "partrain.live"
        live.around(function() io.write(args.describe(copy, config_file), "\n"); io.flush() end)
      end
    end
    return result
  end,
})
