-- pt.args: command-line options for a training script, nanoGPT's configurator done properly.
--   local cfg = pt.args { epochs = 3, lr = pt.args.number(0.1), out = "ckpt", fp16 = false }
--   partrain train.lua --epochs 1 --lr=0.05 --no-fp16
-- The type of each default is the option's type; integer defaults take integers only (wrap a
-- float option whose default happens to be whole in pt.args.number). Unknown options, missing
-- values and values of the wrong type are errors that name the option; --help lists them all.
local args = {}

local NUMBER = {}   -- marks a pt.args.number(default)

--- Declares a number option whose default is a whole number but which takes any number.
function args.number(default)
  if type(default) ~= "number" then error("pt.args.number expects a number, got " .. type(default), 2) end
  return setmetatable({ default = default }, NUMBER)
end

local function kind_of(v)
  if getmetatable(v) == NUMBER then return "number", v.default end
  local t = type(v)
  if t == "number" and v == math.floor(v) then return "integer", v end
  if t == "number" or t == "string" or t == "boolean" then return t, v end
  return nil
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
  return x
end

local function usage(spec)
  local names = {}
  for k in pairs(spec) do names[#names + 1] = k end
  table.sort(names)
  local lines = { "options (defaults in brackets):" }
  for _, k in ipairs(names) do
    local kind, default = kind_of(spec[k])
    lines[#lines + 1] = ("  --%-20s %-8s [%s]"):format(k:gsub("_", "-"), kind, tostring(default))
  end
  return table.concat(lines, "\n")
end

local function parse(spec, argv)
  local out, kinds = {}, {}
  for k, v in pairs(spec) do
    if type(k) ~= "string" then error("pt.args: option names must be strings, got " .. type(k), 0) end
    local kind, default = kind_of(v)
    if not kind then
      error(("pt.args: option '%s' has a %s default; use a number, string or boolean"):format(k, type(v)), 0)
    end
    kinds[k], out[k] = kind, default
  end
  local known = {}
  for k in pairs(spec) do known[#known + 1] = "--" .. k:gsub("_", "-") end
  table.sort(known)

  local i = 1
  while i <= #argv do
    local word = argv[i]
    if word == "--help" or word == "-h" then
      io.write(usage(spec), "\n")
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
      error(("unknown option --%s (known: %s)"):format(name, table.concat(known, ", ")), 0)
    end
    if value == nil then
      local nextword = argv[i + 1]
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
  return out
end

return setmetatable(args, {
  --- pt.args(spec [, argv]): the defaults in spec overridden from argv (default: the script's arg).
  __call = function(_, spec, argv)
    if type(spec) ~= "table" then error("pt.args expects a table of defaults, got " .. type(spec), 2) end
    argv = argv or _G.arg or {}
    local ok, result = pcall(parse, spec, argv)
    if not ok then error(result, 2) end
    return result
  end,
})
