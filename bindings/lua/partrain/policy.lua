-- Sharding policies: how a model splits for tensor parallelism, written as Lua data
-- (ColossalAI ShardFormer's Policy). A policy names module types or dotted-path globs and says
-- which of their sub-modules become which parallel layer, which integer attributes divide by the
-- tensor size, which methods Lua functions replace, and what to do before and after
-- (preprocess, postprocess: ties). `modules` may be a function of the configuration (ShardConfig:
-- sequence_parallel, sequence_overlap, fused_norm, flash_attention) returning that table.
--
-- Applying one is a transaction: the sharder checks the policy's shape, plans every change and
-- refuses conflicts, applies them, checks every layer's invariants (an attention's heads x head
-- size = its width), compares a probe batch's output and gradients with the serial model's, and
-- on any failure puts the model back exactly as it was. Every error names the policy's file:line.
--
--   local P = require "partrain.policy"
--   return P.policy {
--     name = "gpt2", targets = { "GPT2" },
--     modules = {
--       GPT2Block = {
--         attributes = { ["attn.heads"] = P.divide_by_tensor },
--         replace = { { "attn.c_attn", P.column { fused = 3 } }, { "attn.c_proj", P.row {} } },
--       },
--     },
--     postprocess = function(model, cfg) P.tie(model, "lm_head.weight", "wte.weight") end,
--   }
local pt = require "partrain"
local core = require "partrain.core"

local P = {}

-- Locations ----------------------------------------------------------------------------------
-- Errors name the user's file:line. A function that ends in a tail call (`return P.policy {...}`,
-- the usual last line of a policy file) loses its frame in Lua, so the frame above is someone
-- else's: a C function (require, pcall), or the loader partrain installs for `require`, which
-- says which file it is loading (pt.loading_file); the line then comes from that file's text.

local own_dir = debug.getinfo(1, "S").source:match("^@(.*/)[^/]+$") or "\0"
local function internal(source) return source:sub(1, 1) == "@" and source:sub(2, #own_dir + 1) == own_dir end

-- The line of the last `return ... policy {` (or `policy (`) in a file, or of any `policy {`.
local function policy_line(path)
  local f = io.open(path, "r")
  if not f then return nil end
  local n, last, last_return = 0, nil, nil
  for line in f:lines() do
    n = n + 1
    local code = line:gsub("%-%-.*$", "")
    if code:find("policy%s*[{(]") then
      last = n
      if code:find("return") then last_return = n end
    end
  end
  f:close()
  return last_return or last
end

--- file:line of the user code that called the function `level` frames above the caller of
--- P.where (1: the caller's caller), seeing through tail calls as described above.
function P.where(level)
  level = (level or 1) + 2
  local info = debug.getinfo(level, "Slf")
  if info and info.what ~= "C" and not internal(info.source) and (info.currentline or 0) > 0 then
    return info.short_src .. ":" .. info.currentline
  end
  for l = level, level + 40 do
    local i = debug.getinfo(l, "Slf")
    if not i then break end
    local path = pt.loading_file(i.func)
    if path then return path .. ":" .. (policy_line(path) or 1) end
    if i.what ~= "C" and not internal(i.source) and (i.currentline or 0) > 0 then
      return i.short_src .. ":" .. i.currentline
    end
  end
  return "?"
end

-- file:line where a Lua function was written.
local function defined_at(fn)
  local info = debug.getinfo(fn, "S")
  return info.short_src .. ":" .. info.linedefined
end

local function fail(at, fmt, ...) error(at .. ": " .. fmt:format(...), 0) end

-- A message without the locations inside partrain's own Lua files that lead it (those of the
-- sharder's calls into the engine): the user's location is added in their place.
local function strip_internal(err)
  local msg = tostring(err)
  while true do
    local rest = msg:match("^[^\n:]*:%d+: (.*)$")
    local prefix = rest and msg:sub(1, #msg - #rest)
    if not prefix or not (prefix:find(own_dir, 1, true) or prefix:find("partrain/[%w_]+%.lua:%d+: $")) then return msg end
    msg = rest
  end
end

local function sorted_keys(t)
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  return keys
end

-- Styles -------------------------------------------------------------------------------------

local STYLE = {}  -- metatable of style values
local function style(kind, needs, allowed)
  return function(opts)
    local at = P.where(1)
    opts = opts or {}
    if type(opts) ~= "table" or getmetatable(opts) == STYLE then
      fail(at, "P.%s expects an options table, got %s", kind, getmetatable(opts) == STYLE and "a style" or type(opts))
    end
    for k, v in pairs(opts) do
      local expected = allowed[k]
      if not expected then
        local names = sorted_keys(allowed)
        fail(at, "P.%s has no option '%s' (options: %s)", kind, tostring(k), #names > 0 and table.concat(names, ", ") or "none")
      end
      if type(v) ~= expected then fail(at, "P.%s option '%s' must be a %s, got %s", kind, k, expected, type(v)) end
      if k == "fused" and (v < 1 or v ~= math.floor(v) or v ~= v or v == math.huge) then
        fail(at, "P.%s option 'fused' must be a whole number of parts >= 1, got %s", kind, tostring(v))
      end
    end
    return setmetatable({ kind = kind, needs = needs, opts = opts, where = at }, STYLE)
  end
end

--- Output features split (Megatron's column-parallel linear). fused = k keeps k output parts
--- (q, k, v) together per head; gather_output gathers the full width after.
P.column = style("column", "Linear", { fused = "number", gather_output = "boolean", sequence_parallel = "boolean" })
--- Input features split; the partial outputs are summed (row-parallel linear).
P.row = style("row", "Linear", { input_is_parallel = "boolean", sequence_parallel = "boolean" })
--- A LayerNorm in the sequence-parallel region: under sequence_parallel its weight's and bias's
--- gradients are summed over the tensor group; fused_norm picks the fused kernel.
P.norm = style("norm", "LayerNorm", { sequence_parallel = "boolean" })
--- An embedding split along the vocabulary (padded to a multiple of the tensor size).
P.vocab_embedding = style("vocab_embedding", "Embedding", {})
--- The output head split along the vocabulary; its logits stay split: use pt.loss_fn(model), or
--- pt.tp.gather_logits(logits) before sampling.
P.vocab_head = style("vocab_head", "Linear", {})

--- An attribute value: divided by the tensor size (which must divide it).
P.divide_by_tensor = setmetatable({ kind = "divide_by_tensor" }, STYLE)

--- Ties parameter `a` to parameter `b` (dotted paths): after it they are one tensor.
function P.tie(model, a, b)
  if not core.nn.is_module(model) then error("P.tie: argument #1 must be the model, got " .. type(model), 2) end
  if type(a) ~= "string" or type(b) ~= "string" then error("P.tie: the parameters must be dotted paths (strings)", 2) end
  local function split(path)
    local owner, name = path:match("^(.*)%.([^.]+)$")
    return owner or "", name or path
  end
  local oa, na = split(a)
  local ob, nb = split(b)
  local ma, mb = model:get(oa), model:get(ob)
  if not ma then error(("tie: no module '%s' in %s"):format(oa, model:type()), 2) end
  if not mb then error(("tie: no module '%s' in %s"):format(ob, model:type()), 2) end
  local ok, pb = pcall(function() return mb[nb] end)
  if not ok or not pt.is_tensor(pb) then error(("tie: '%s' is not a parameter"):format(b), 2) end
  local ok_a, pa = pcall(function() return ma[na] end)
  if not ok_a or not pt.is_tensor(pa) then error(("tie: '%s' is not a parameter"):format(a), 2) end
  local set_ok, err = pcall(function() ma[na] = pb end)
  if not set_ok then error(("tie: %s"):format(strip_internal(err)), 2) end
end

-- The shape of a policy ----------------------------------------------------------------------

local function is_list(t)
  local n = 0
  for _ in pairs(t) do n = n + 1 end
  for i = 1, n do if t[i] == nil then return false end end
  return true
end

local function first_non_index(t)
  for k in pairs(t) do
    if type(k) ~= "number" or k < 1 or k ~= math.floor(k) or k > #t then return k end
  end
end

-- Where a modules entry was written: a method's definition or a style's line, else `at`.
local function entry_where(entry, at)
  if type(entry) ~= "table" then return at end
  if type(entry.replace) == "table" then
    for _, r in pairs(entry.replace) do
      if type(r) == "table" and getmetatable(r[2]) == STYLE and r[2].where then return r[2].where end
      if getmetatable(r) == STYLE and r.where then return r.where end  -- a map { path = style }
    end
  end
  if type(entry.methods) == "table" then
    for _, fn in pairs(entry.methods) do if type(fn) == "function" then return defined_at(fn) end end
  end
  return at
end

-- Checks the shape of a policy's modules table (written at `at`).
local function check_modules(modules, at)
  if type(modules) ~= "table" or getmetatable(modules) == STYLE then
    fail(at, "modules must be a table, got %s", type(modules))
  end
  if next(modules) == nil then fail(at, "modules is empty: the policy would change nothing") end
  for _, key in ipairs(sorted_keys(modules)) do
    local entry = modules[key]
    if type(key) ~= "string" or key == "" then
      fail(at, "modules keys must be module types, paths or globs (non-empty strings), got %s",
        type(key) == "string" and "''" or type(key) .. " " .. tostring(key))
    end
    if type(entry) ~= "table" then fail(at, "modules.%s must be a table, got %s", key, type(entry)) end
    local ew = entry_where(entry, at)
    for k in pairs(entry) do
      if k ~= "attributes" and k ~= "replace" and k ~= "methods" then
        fail(ew, "modules.%s has no field '%s' (fields: attributes, methods, replace)", key, tostring(k))
      end
    end
    if entry.replace ~= nil then
      if type(entry.replace) ~= "table" then fail(ew, "modules.%s.replace must be a list, got %s", key, type(entry.replace)) end
      if not is_list(entry.replace) then
        fail(ew, "modules.%s.replace must be a list of { \"path\", P.<style> {...} } entries, but it has the key '%s' "
          .. "(a map is not read: write { { \"path\", P.column {} }, ... })", key, tostring(first_non_index(entry.replace)))
      end
      for i, r in ipairs(entry.replace) do
        local rw = type(r) == "table" and getmetatable(r[2]) == STYLE and r[2].where or ew
        if type(r) ~= "table" or type(r[1]) ~= "string" or getmetatable(r[2]) ~= STYLE or r[2].kind == "divide_by_tensor" then
          fail(rw, "modules.%s.replace[%d] must be { \"path\", P.<style> {...} [, ignore_if_missing = true] }", key, i)
        end
        if r[1] == "" then fail(rw, "modules.%s.replace[%d]: the path is empty (the module itself cannot be replaced)", key, i) end
        for k in pairs(r) do
          if k ~= 1 and k ~= 2 and k ~= "ignore_if_missing" then
            fail(rw, "modules.%s.replace[%d] has no field '%s' (fields: ignore_if_missing)", key, i, tostring(k))
          end
        end
        if r.ignore_if_missing ~= nil and type(r.ignore_if_missing) ~= "boolean" then
          fail(rw, "modules.%s.replace[%d]: ignore_if_missing must be a boolean, got %s", key, i, type(r.ignore_if_missing))
        end
      end
    end
    if entry.attributes ~= nil then
      if type(entry.attributes) ~= "table" then fail(ew, "modules.%s.attributes must be a table, got %s", key, type(entry.attributes)) end
      for _, path in ipairs(sorted_keys(entry.attributes)) do
        local value = entry.attributes[path]
        local t = type(value)
        if type(path) ~= "string" or path == "" or (value ~= P.divide_by_tensor and t ~= "number" and t ~= "boolean") then
          fail(ew, "modules.%s.attributes: '%s' must map to P.divide_by_tensor, a number or a boolean", key, tostring(path))
        end
        if t == "number" and (value ~= value or value == math.huge or value == -math.huge) then
          fail(ew, "modules.%s.attributes: '%s' is set to %s", key, path, tostring(value))
        end
      end
    end
    if entry.methods ~= nil then
      if type(entry.methods) ~= "table" then fail(ew, "modules.%s.methods must be a table, got %s", key, type(entry.methods)) end
      for _, name in ipairs(sorted_keys(entry.methods)) do
        if type(name) ~= "string" or type(entry.methods[name]) ~= "function" then
          fail(ew, "modules.%s.methods: '%s' must map to a function(self, ...)", key, tostring(name))
        end
      end
    end
  end
end

local FIELDS = { name = "string", targets = "table", modules = "table or function", preprocess = "function",
                 postprocess = "function", pipeline = "table" }
local PIPELINE = { blocks = "string", first = "list", last = "list" }

-- Checks a policy's fields (written at `at`).
local function check_policy(spec, at)
  if type(spec) ~= "table" or getmetatable(spec) == STYLE then fail(at, "P.policy expects a table, got %s", type(spec)) end
  for _, k in ipairs(sorted_keys(spec)) do
    local v, want = spec[k], FIELDS[k]
    if not want then
      fail(at, "policy has no field '%s' (fields: modules, name, pipeline, postprocess, preprocess, targets)", tostring(k))
    end
    if want == "table or function" then
      if type(v) ~= "table" and type(v) ~= "function" then
        fail(at, "policy field '%s' must be a table or a function(cfg) returning one, got %s", k, type(v))
      end
    elseif type(v) ~= want then
      fail(at, "policy field '%s' must be a %s, got %s", k, want, type(v))
    end
  end
  if spec.modules == nil then fail(at, "policy %s has no modules", spec.name or "?") end
  if spec.targets then
    if not is_list(spec.targets) or #spec.targets == 0 then fail(at, "policy field 'targets' must be a non-empty list of model types") end
    for i, name in ipairs(spec.targets) do
      if type(name) ~= "string" then fail(at, "policy field 'targets': entry %d must be a model type (a string), got %s", i, type(name)) end
    end
  end
  if spec.pipeline then
    for _, k in ipairs(sorted_keys(spec.pipeline)) do
      local v, want = spec.pipeline[k], PIPELINE[k]
      if not want then fail(at, "pipeline has no field '%s' (fields: blocks, first, last)", tostring(k)) end
      if want == "string" and type(v) ~= "string" then fail(at, "pipeline.%s must be a string, got %s", k, type(v)) end
      if want == "list" then
        if type(v) ~= "table" or not is_list(v) then fail(at, "pipeline.%s must be a list of module paths", k) end
        for i, p in ipairs(v) do
          if type(p) ~= "string" then fail(at, "pipeline.%s[%d] must be a module path (a string), got %s", k, i, type(p)) end
        end
      end
    end
  end
  if type(spec.modules) == "table" then check_modules(spec.modules, at) end
end

local declared = setmetatable({}, { __mode = "k" })  -- policy table -> where P.policy made it

--- Declares a policy; checks its shape and remembers where it was written.
function P.policy(spec)
  local at = P.where(1)
  check_policy(spec, at)
  declared[spec] = at
  return spec
end

--- Where `policy` was declared (P.policy's file:line), or nil for a plain table.
function P.declared_at(policy) return declared[policy] end

-- Planning -----------------------------------------------------------------------------------

-- A Lua pattern that matches a dotted path exactly, `*` standing for one path component.
local function path_pattern(key)
  local escaped = key:gsub("[%^%$%(%)%%%.%[%]%+%-%?]", "%%%0")
  return "^" .. escaped:gsub("%*", "[^.]+") .. "$"
end

-- Modules of `model` a policy key names: a type name, a path ("lm_head", "h.0.attn"), or a
-- dotted-path glob ("h.*.attn").
local function matches(model, key)
  local found = {}
  local glob = key:find("[%.%*]") ~= nil
  local pattern = path_pattern(key)
  for path, m in model:named_modules() do
    if path:match(pattern) or (not glob and m:type() == key) then found[#found + 1] = { path, m } end
  end
  return found
end

local function join(a, b)
  if a == "" then return b end
  if b == "" then return a end
  return a .. "." .. b
end

local function within(path, root) return path == root or path:sub(1, #root + 1) == root .. "." end

-- Everything a policy would do to `model`, checked, as a list of actions; nothing changes yet.
local function plan(model, policy, modules, cfg, at)
  local t = cfg.tensor
  if policy.targets then
    local ok = false
    for _, name in ipairs(policy.targets) do ok = ok or name == model:type() end
    if not ok then fail(at, "policy %s serves %s, not %s", policy.name or "?", table.concat(policy.targets, ", "), model:type()) end
  end
  local actions = {}
  local replaced = {}    -- path -> what replaces it ("modules.KEY.replace[i] (P.column at f:l)")
  local owned = {}       -- { path, what, where }: attributes and methods, checked against replaced
  local function claim(list, path, what, where)
    if list[path] then fail(where, "%s is changed twice: by %s and by %s", path, list[path], what) end
    list[path] = what
  end
  local set = {}
  for _, key in ipairs(sorted_keys(modules)) do  -- a fixed order: every rank builds its layers alike
    local entry = modules[key]
    local ew = entry_where(entry, at)
    local found = matches(model, key)
    if #found == 0 then fail(ew, "modules.%s matches no module of %s", key, model:type()) end
    for _, item in ipairs(found) do
      local base, parent = item[1], item[2]
      for i, r in ipairs(entry.replace or {}) do
        local path, s = join(base, r[1]), r[2]
        local target = model:get(path)
        if not target then
          if not r.ignore_if_missing then fail(s.where, "%s: no module '%s' in %s (set ignore_if_missing = true if that is expected)", s.kind, path, model:type()) end
        else
          if target:type() ~= s.needs then
            fail(s.where, "P.%s does not fit %s: it is a %s, and P.%s needs a %s", s.kind, path, target:type(), s.kind, s.needs)
          end
          claim(replaced, path, ("modules.%s.replace[%d] (P.%s at %s)"):format(key, i, s.kind, s.where), s.where)
          actions[#actions + 1] = { path = path, style = s, target = target }
          -- Sizes: an error now rather than half-way through.
          if s.kind == "column" then
            local fused = s.opts.fused or 1
            local out = target.weight.shape[1]
            if out % fused ~= 0 or (out / fused) % t ~= 0 then
              fail(s.where, "tensor=%d does not divide %s's output of %d%s", t, path, out, fused > 1 and (" (" .. fused .. " fused parts of " .. out / fused .. ")") or "")
            end
            if fused > 1 and s.opts.gather_output then
              fail(s.where, "P.column: gather_output with fused = %d would interleave the parts of %s", fused, path)
            end
          elseif s.kind == "row" then
            local input = target.weight.shape[2]
            if input % t ~= 0 then fail(s.where, "tensor=%d does not divide %s's input of %d", t, path, input) end
          end
        end
      end
      for _, attr_path in ipairs(sorted_keys(entry.attributes or {})) do
        local value = entry.attributes[attr_path]
        local owner_path, name = attr_path:match("^(.*)%.([^.]+)$")
        owner_path, name = owner_path or "", name or attr_path
        local owner = parent:get(owner_path)
        if not owner then fail(ew, "attributes: no module '%s' under %s", owner_path, base == "" and model:type() or base) end
        local current = owner:attribute(name)
        if current == nil then
          local names = owner:attribute_names()
          fail(ew, "attributes: %s has no attribute '%s'%s", owner:type(), name,
            #names > 0 and " (it has " .. table.concat(names, ", ") .. ")" or " (it has none)")
        end
        local new = value
        if value == P.divide_by_tensor then
          if current % t ~= 0 then
            fail(ew, "tensor=%d does not divide %s.%s=%s", t, join(base, owner_path), name, tostring(current))
          end
          new = current / t
        elseif type(value) == "boolean" then
          new = value and 1 or 0
        end
        local full = join(join(base, owner_path), name)
        claim(set, full, ("modules.%s.attributes"):format(key), ew)
        owned[#owned + 1] = { join(base, owner_path), "the attribute " .. full .. " set by modules." .. key, ew }
        actions[#actions + 1] = { attribute = name, owner = owner, value = new, where = ew }
      end
      for _, name in ipairs(sorted_keys(entry.methods or {})) do
        local fn = entry.methods[name]
        local mw = defined_at(fn)
        if name ~= "forward" and not parent:is_lua() then
          fail(mw, "methods: %s is a built-in module; only its forward can be replaced, not '%s'", parent:type(), name)
        end
        claim(set, join(base, ":" .. name), ("modules.%s.methods"):format(key), mw)
        owned[#owned + 1] = { base, "the method " .. name .. " of " .. (base == "" and model:type() or base) .. " set by modules." .. key, mw }
        actions[#actions + 1] = { method = name, owner = parent, fn = fn }
      end
    end
  end
  -- A change to a module that another entry replaces would be made on a module the model no
  -- longer holds: lost without a word.
  for _, o in ipairs(owned) do
    for path, what in pairs(replaced) do
      if within(o[1], path) then fail(o[3], "%s would be lost: %s is replaced by %s", o[2], path, what) end
    end
  end
  return actions
end

-- The configuration ---------------------------------------------------------------------------

-- The configuration a policy sees (ShardFormer's ShardConfig), with its defaults.
local CONFIG = {
  tensor_parallel = true,     -- split over the mesh's tensor group (false: only check the policy)
  sequence_parallel = false,  -- keep activations split along the sequence between TP regions
  sequence_overlap = false,   -- overlap the sequence all-gather with the matmul (needs the above)
  fused_norm = true,          -- LayerNorm as one fused kernel (false: composed, for reference)
  flash_attention = false,    -- fused attention where LibTorch has it (2.x)
  policy_timeout = 60,        -- seconds each of preprocess, modules(cfg), postprocess and the probe may take
  probe = "auto",             -- compare a probe batch with the serial model: true, false, "auto", or the input
}
P.config_keys = CONFIG
--- Models of at most this many parameters are probed by default (probe = "auto").
P.probe_limit = 16 * 1024 * 1024

--- Fills in and checks a configuration table; an unknown key or a wrong type is an error
--- (at `level`). Returns a new table.
function P.config(opts, level)
  level = (level or 1) + 1
  local cfg = {}
  for k, v in pairs(opts or {}) do
    if CONFIG[k] == nil then
      error(("unknown sharding option '%s' (options: %s)"):format(tostring(k), table.concat(sorted_keys(CONFIG), ", ")), level)
    end
    if k == "policy_timeout" then
      if type(v) ~= "number" or not (v > 0) or v == math.huge then
        error(("sharding option 'policy_timeout' must be a number of seconds > 0, got %s"):format(tostring(v)), level)
      end
    elseif k == "probe" then
      local ok = type(v) == "boolean" or v == "auto" or pt.is_tensor(v)
      if type(v) == "table" then
        ok = #v > 0 and is_list(v)
        for _, x in ipairs(v) do ok = ok and pt.is_tensor(x) end
      end
      if not ok then
        error(("sharding option 'probe' must be true, false, \"auto\", an input tensor or a list of them, got %s"):format(
          type(v) == "string" and ("'" .. v .. "'") or type(v)), level)
      end
    elseif type(v) ~= "boolean" then
      error(("sharding option '%s' must be a boolean, got %s"):format(k, type(v)), level)
    end
    cfg[k] = v
  end
  for k, default in pairs(CONFIG) do
    if cfg[k] == nil then cfg[k] = default end
  end
  if cfg.sequence_overlap and not cfg.sequence_parallel then
    error("sharding option sequence_overlap needs sequence_parallel = true", level)
  end
  return cfg
end

-- Policy code under a time bound ---------------------------------------------------------------

local TIMEOUT = setmetatable({}, { __tostring = function() return "interrupted: the policy's time is up" end })

-- Runs fn(...) in protected mode, interrupted after `seconds`: true, results... or false, message.
-- A count hook checks the clock; LuaJIT runs hooks only in its interpreter, so the JIT is off
-- (and its traces flushed) for the call. Once the time is up the hook raises at every instruction,
-- so a loop that catches errors (pcall in a loop) cannot outlast it.
local function bounded(seconds, fn, ...)
  local had_jit = jit and jit.status()
  if jit then jit.off(); jit.flush() end
  local deadline, interrupted = core.now() + seconds, nil
  local old_hook, old_mask, old_count = debug.gethook()
  local function hook()
    if interrupted or core.now() > deadline then
      -- Only in the user's code: partrain's own (this function, after the call returns) goes on.
      local info = debug.getinfo(2, "Sl")
      if not info or internal(info.source) then return end
      if not interrupted then
        interrupted = (info.currentline or 0) > 0 and (info.short_src .. ":" .. info.currentline) or info.short_src
        debug.sethook(hook, "", 1)
      end
      error(TIMEOUT, 0)
    end
  end
  debug.sethook(hook, "", 1000)
  local results = { pcall(fn, ...) }
  if old_hook then debug.sethook(old_hook, old_mask, old_count) else debug.sethook() end
  if had_jit then jit.on() end
  if interrupted then
    return false, ("did not finish within policy_timeout = %g s (interrupted at %s)"):format(seconds, interrupted)
  end
  if not results[1] then return false, tostring(results[2]) end
  return unpack(results, 1, table.maxn(results))
end

-- Applying -------------------------------------------------------------------------------------

--- Models whose output logits are split along the vocabulary (by P.vocab_head): model -> { group, vocab, where }.
P.vocab_parallel = setmetatable({}, { __mode = "k" })

local function name_of(policy) return policy.name or "?" end

-- Every rank of the world says whether it got this far, with its error: all go on, or all stop
-- with the first rank's message (nil when all are fine).
local function first_error(err)
  if core.plan.planning() or pt.dist.world_size() == 1 then return err end
  local message, rank = core.dist._first_error(err or "")
  if message and message ~= err and not err then
    return ("%s (on rank %d; this rank was fine)"):format(message, rank)
  end
  return err or message
end

-- The probe's input: the one given, or a small batch made for the model's first layer (a Linear
-- takes (2, in) floats; an Embedding (2, T) ids, T a multiple of the tensor size within GPT-2's
-- context); nil when the model does not say what it takes.
local function probe_inputs(model, cfg)
  local given = cfg.probe
  if pt.is_tensor(given) then return { given }, true end
  if type(given) == "table" then return given, true end
  for _, m in model:named_modules() do
    local kind = m:type()
    if kind == "Linear" or kind == "Embedding" then
      local w = m.weight
      if not w then return nil end
      if kind == "Linear" then return { core.tp._probe_input({ 2, w.shape[2] }, 0, w.dtype, w.device) } end
      local t, seq, T = cfg.tensor, model:attribute("seq"), 2 * cfg.tensor
      if seq and seq < T then T = seq >= t and t or seq end
      return { core.tp._probe_input({ 2, T }, w.shape[1], "int64", w.device) }
    end
  end
  return nil
end

local function probing(model, cfg)
  if cfg.probe == false or core.plan.planning() then return false end
  local first = model:parameters()[1]
  if not first or first.device == "meta" then return false end
  return cfg.probe ~= "auto" or model:num_parameters() <= P.probe_limit
end

local function apply_actions(model, actions, cfg, group, where)
  local sp = cfg.sequence_parallel
  local function option(s, name, default)
    if s.opts[name] ~= nil then return s.opts[name] end
    return default
  end
  for _, a in ipairs(actions) do
    if a.attribute then
      local ok, err = pcall(a.owner.set_attribute, a.owner, a.attribute, a.value)
      if not ok then fail(a.where, "%s", strip_internal(err)) end
    elseif a.method then
      if a.method == "forward" then a.owner:replace_forward(a.fn)
      else a.owner[a.method] = a.fn end
    else
      local s, built = a.style, nil
      local ok, err = pcall(function()
        if s.kind == "column" then
          local seq = option(s, "sequence_parallel", sp)
          built = pt.tp.column(a.target, group, { fused = s.opts.fused, gather_output = s.opts.gather_output,
                                                  sequence_parallel = seq, sequence_overlap = seq and cfg.sequence_overlap })
        elseif s.kind == "row" then
          built = pt.tp.row(a.target, group, { input_is_parallel = s.opts.input_is_parallel,
                                               sequence_parallel = option(s, "sequence_parallel", sp) })
        elseif s.kind == "norm" then
          built = pt.tp.layer_norm(a.target, group, { sequence_parallel = option(s, "sequence_parallel", sp), fused = cfg.fused_norm })
        elseif s.kind == "vocab_embedding" then built = pt.tp.vocab_embedding(a.target, group)
        elseif s.kind == "vocab_head" then
          built = pt.tp.column(a.target, group, { pad = true, sequence_parallel = sp, sequence_overlap = sp and cfg.sequence_overlap })
          P.vocab_parallel[model] = { group = group, vocab = a.target.weight.shape[1], where = s.where }
        end
        model:set(a.path, built)
      end)
      if not ok then fail(s.where, "P.%s on %s: %s", s.kind, a.path, strip_internal(err)) end
    end
  end
end

-- The whole transaction's work; raises on any problem (the caller undoes).
local function run(model, policy, mesh, cfg, at)
  local group = mesh:group("tensor")
  cfg.tensor, cfg.group = group:size(), group
  local splitting = cfg.tensor_parallel and cfg.tensor > 1
  local timeout = cfg.policy_timeout
  local function call(what, fn, ...)
    local ok, result = bounded(timeout, fn, ...)
    if not ok then fail(at, "%s of policy %s failed: %s", what, name_of(policy), result) end
    return result
  end
  -- The serial model's answer first, before anything changes.
  local serial, inputs
  if splitting and probing(model, cfg) then
    local given
    inputs, given = probe_inputs(model, cfg)
    if inputs then
      local ok, record = bounded(timeout, core.tp._probe, model, inputs)
      if ok then serial = record
      elseif given then fail(at, "the serial %s fails on the probe input: %s", model:type(), record) end
    end
  end
  local ties = core.nn._ties(model)
  if policy.preprocess then call("preprocess", policy.preprocess, model, cfg) end
  local modules = policy.modules
  if type(modules) == "function" then
    modules = call("modules(cfg)", modules, cfg)
    check_modules(modules, defined_at(policy.modules))
  end
  local actions = plan(model, policy, modules, cfg, at)
  if not splitting then return end
  apply_actions(model, actions, cfg, group, at)
  -- Two names of one attribute (GPT-2's heads and n_head) set by two entries: the last one wins.
  for _, a in ipairs(actions) do
    if a.attribute and a.owner:attribute(a.attribute) ~= a.value then
      fail(a.where, "the attribute %s of %s is set twice, under two of its names (%s ends %s, not %s)", a.attribute,
        a.owner:type(), a.attribute, tostring(a.owner:attribute(a.attribute)), tostring(a.value))
    end
  end
  if policy.postprocess then call("postprocess", policy.postprocess, model, cfg) end
  -- Every layer's invariants, and the ties of the serial model.
  local ok, err = pcall(core.nn._check, model)
  if not ok then fail(at, "policy %s splits %s wrong: %s", name_of(policy), model:type(), strip_internal(err)) end
  local after = core.nn._ties(model)
  local function list(groups)
    local s = {}
    for _, g in ipairs(groups) do s[#s + 1] = table.concat(g, " = ") end
    return #s > 0 and table.concat(s, "; ") or "none"
  end
  if list(ties) ~= list(after) then
    fail(at, "policy %s changes which parameters are tied: the serial %s ties %s, the sharded one %s%s", name_of(policy),
      model:type(), list(ties), list(after), #after < #ties and " (tie them again in postprocess: P.tie(model, a, b))" or "")
  end
  return serial, inputs
end

--- Applies `policy` to `model` over the tensor group of `mesh`; cfg: the sharding options
--- (P.config). Returns the model, changed in place. With tensor_parallel = false, or a tensor
--- group of one, the policy is only checked against the model. All or nothing: on any error (on
--- any rank) the model is put back exactly as it was, and the error names the policy's file:line
--- (for a plain table not made by P.policy, the line of the call). Returns the model and a
--- function that undoes the policy.
function P.apply(model, policy, mesh, cfg)
  cfg = P.config(cfg, 2)
  local at = declared[policy] or P.where(1)
  check_policy(policy, at)
  local undo = P.begin(model)
  local ok, serial, inputs = pcall(run, model, policy, mesh, cfg, at)
  local err = first_error(not ok and tostring(serial) or nil)
  if err then
    undo()
    error(err, 0)
  end
  if serial then  -- the probe: the sharded model must compute what the serial one did
    local ran, sharded = bounded(cfg.policy_timeout, core.tp._probe, model, inputs)
    local problem = not ran and ("its forward fails on the probe batch: " .. strip_internal(sharded))
    if ran then problem = core.tp._probe_compare(serial, sharded, P.vocab_parallel[model] ~= nil) end
    if problem then
      problem = ("%s: policy %s splits %s wrong: %s (the probe compares one batch with the serial model; "
        .. "probe = false turns it off)"):format(at, name_of(policy), model:type(), problem)
    end
    problem = first_error(problem)
    if problem then
      undo()
      error(problem, 0)
    end
  end
  return model, undo
end

--- The undo record of `model` now: a function that puts it back exactly (its modules,
--- parameters and their contents, attributes, forwards, Lua fields, vocabulary split).
function P.begin(model)
  local snapshot = core.nn._snapshot(model, 256 * 1024 * 1024)
  local split = P.vocab_parallel[model]
  return function()
    local lost = snapshot:restore()
    P.vocab_parallel[model] = split
    if #lost > 0 then
      io.stderr:write(("partrain: the policy changed %s in place; too large to keep a copy of, it stays changed\n"):format(
        table.concat(lost, ", ")))
    end
  end
end

--- The policies partrain ships, by model type.
P.registry = { GPT2 = "policies.gpt2", MLP = "policies.mlp", SimpleModel = "policies.simple" }

return P
