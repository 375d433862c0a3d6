-- Fuzzes partrain's Lua API with wrong arguments: every function reachable from
-- `require "partrain"` (the library's tables, up to three deep) and every method of a tensor, a
-- model, an optimizer, a loader, a mesh and a group is called with zero to three arguments drawn
-- from the seed (nil, booleans, numbers that are negative, fractional, huge, infinite or NaN,
-- strings, tables, a function, a tensor, a model), half the time straight from `pcall` (where
-- Lua's error levels name no line) and half from a Lua function of this file.
--   * returned: harmless (the arguments made sense, or were defaults);
--   * refused: an error that begins with this file's calling line, as a user's mistake must;
--   * failed: an error naming partrain's own Lua (first, or after the caller's line: a slip inside
--     the library passed on), a C function, or no line at all; or an error value that is not a
--     string. A crash or a hang ends the job, after the case's line.
-- Each case is printed before it runs, so the last one printed names a crash or a hang.
--   partrain --threads 1 tests/fuzz/fuzz_api.lua [--seed 1] [--cases 3]   (from an empty folder:
--   the arguments include file names, and a few calls write where they are pointed)
local here = debug.getinfo(1, "S").source:sub(2)
package.path = here:gsub("[^/]*/[^/]*$", "") .. "lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local cfg = pt.args { seed = 1, cases = 3 }
local src = debug.getinfo(1, "S").short_src  -- as error messages name this file
local rng = H.rng(cfg.seed)

-- The objects methods run on, and a text for the loader.
do
  local f = assert(io.open("fuzz-api.txt", "w"))
  f:write(("the quick brown fox jumps over the lazy dog. "):rep(20))
  f:close()
end
local model = pt.models.mlp { sizes = { 4, 3, 2 } }
local objects = {
  tensor = pt.ones(2, 3),
  model = model,
  optimizer = pt.optim.adamw(model, { lr = 1e-3 }),
  loader = pt.data.text { path = "fuzz-api.txt", seq = 4, batch = 2 },
  mesh = pt.mesh {},
}
objects.group = objects.mesh:group("world")

-- Left out: what waits for a terminal, and partrain's internal helpers ("_" names).
local skip = { ["pt.breakpoint"] = true }

local targets = {}  -- { name, fn, self }
local seen = {}
local function walk(t, prefix, depth)
  if seen[t] or depth > 3 then return end
  seen[t] = true
  local keys = {}
  for k in pairs(t) do if type(k) == "string" and not k:match("^_") then keys[#keys + 1] = k end end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local v, name = t[k], prefix .. "." .. k
    local mt = type(v) == "table" and getmetatable(v)
    if (type(v) == "function" or mt and mt.__call) and not skip[name] then targets[#targets + 1] = { name = name, fn = v } end
    if type(v) == "table" and k ~= "Tensor" then walk(v, name, depth + 1) end  -- pt.args is called and has functions
  end
end
walk(pt, "pt", 0)

-- The methods of an object: the method table its metatable's __index resolves through (a
-- function for tensors and modules, so their method tables are named here).
local function methods_of(what, obj)
  local index = what == "tensor" and pt.Tensor or what == "model" and require("partrain.core").Module
    or getmetatable(obj).__index
  local names = {}
  for k, v in pairs(index) do
    if type(k) == "string" and not k:match("^_") and type(v) == "function" then names[#names + 1] = k end
  end
  table.sort(names)
  for _, k in ipairs(names) do
    targets[#targets + 1] = { name = what .. ":" .. k, fn = index[k], self = obj }
  end
end
for _, what in ipairs { "tensor", "model", "optimizer", "loader", "mesh", "group" } do methods_of(what, objects[what]) end

-- The arguments: nil first, so a draw can leave an argument out in the middle.
local POOL = {
  { "nil", nil }, { "true", true }, { "false", false }, { "-1", -1 }, { "0", 0 }, { "1", 1 }, { "2", 2 },
  { "0.5", 0.5 }, { "2^53", 2 ^ 53 }, { "-2^31", -2 ^ 31 }, { "inf", 1 / 0 }, { "-inf", -1 / 0 }, { "nan", 0 / 0 },
  { '"x"', "x" }, { '""', "" }, { '"../x"', "../x" }, { '"sum"', "sum" }, { "{}", {} }, { "{1, 2}", { 1, 2 } },
  { "{a = 1}", { a = 1 } }, { "{lr = \"x\"}", { lr = "x" } }, { "{sizes = {2, \"x\"}}", { sizes = { 2, "x" } } },
  { "{seq = -1, batch = 0.5}", { seq = -1, batch = 0.5 } }, { "{path = 5}", { path = 5 } },
  { "{tensor = 3, data = 0}", { tensor = 3, data = 0 } }, { "{vocab = 8, seq = 4, dim = 6, heads = 4, layers = 1}",
  { vocab = 8, seq = 4, dim = 6, heads = 4, layers = 1 } }, { "function", function() end }, { "tensor", pt.ones(2) }, { "model", pt.models.mlp { sizes = { 2, 2 } } },
}

-- The two ways of calling: from a function of this file, and from pcall itself, each at a line
-- an error must name.
local call_line = debug.getinfo(1, "l").currentline + 2
local function through_lua(fn, ...)
  local result = fn(...)  -- not a tail call, which would drop this frame
  return result
end
local pcall_line = debug.getinfo(1, "l").currentline + 2
local function from_pcall(fn, n, args)
  local ok, err = pcall(fn, unpack(args, 1, n))
  return ok, err
end

-- A message that still shows a line of partrain's own Lua after the caller's: a slip inside the
-- library that a wrapper passed on, or relocated ("(raised in partrain/init.lua:176)").
local function inside_partrain(text)
  return text:find("partrain/[%w_/]+%.lua:%d+") ~= nil or text:find("policies/[%w_]+%.lua:%d+") ~= nil
end

local counts = { returned = 0, refused = 0, failed = 0 }
local failures = {}
for _, target in ipairs(targets) do
  for _ = 1, cfg.cases do
    local n = rng.int(0, 3)
    local args, shown = {}, {}
    if target.self ~= nil then
      args[1], shown[1] = target.self, "self"
    end
    for _ = 1, n do
      local a = rng.pick(POOL)
      args[#shown + 1], shown[#shown + 1] = a[2], a[1]
    end
    local direct = rng.int(0, 1) == 1
    local text = ("%s(%s) %s"):format(target.name, table.concat(shown, ", "), direct and "from pcall" or "from Lua")
    io.stdout:write("case ", text, "\n")
    io.stdout:flush()
    local ok, err
    if direct then
      ok, err = from_pcall(target.fn, #shown, args)
    else
      ok, err = pcall(through_lua, target.fn, unpack(args, 1, #shown))
    end
    local line = direct and pcall_line or call_line
    local prefix = ("%s:%d: "):format(src, line)
    if ok then
      counts.returned = counts.returned + 1
    elseif type(err) == "string" and err:sub(1, #prefix) == prefix and not inside_partrain(err:sub(#prefix + 1)) then
      counts.refused = counts.refused + 1
    else
      counts.failed = counts.failed + 1
      failures[#failures + 1] = text .. ": " .. tostring(err):sub(1, 300)
    end
  end
end

os.remove("fuzz-api.txt")
print(("fuzz.api: seed %d, %d functions and methods, %d cases: %d returned, %d refused at the caller's line, %d failed")
  :format(cfg.seed, #targets, counts.returned + counts.refused + counts.failed, counts.returned, counts.refused, counts.failed))
for _, f in ipairs(failures) do print("FAILED " .. f) end
if #failures > 0 then os.exit(1) end
