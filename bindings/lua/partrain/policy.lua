-- Sharding policies: how a model splits for tensor parallelism, written as Lua data
-- (ColossalAI ShardFormer's Policy). A policy names module types or dotted-path globs and says
-- which of their sub-modules become which parallel layer, which integer attributes divide by the
-- tensor size, which methods Lua functions replace, which parameters the split ties again (ties),
-- and what to do before and after (preprocess, postprocess). `modules` may be a function of the
-- configuration (ShardConfig: sequence_parallel, sequence_overlap, fused_norm, flash_attention)
-- returning that table. A policy without functions beyond modules(cfg) is data a C++ program can
-- apply too (partrain/sharder.lua's S.plan_file, parallel::apply_policy).
--
-- This file is the language: styles, P.policy and the checks of a policy's shape, the
-- configuration. Applying one (partrain/sharder.lua) is a transaction: plan every change and
-- refuse conflicts, apply them, check every layer's invariants (an attention's heads x head
-- size = its width), compare a probe batch's output and gradients with the serial model's, and
-- on any failure put the model back exactly as it was. Every error names the policy's file:line.
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
--     ties = { { "lm_head.weight", "wte.weight" } },
--   }
local pt = require "partrain"
local core = require "partrain.core"
local raise = core._raise

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

local TIMEOUT = setmetatable({}, { __tostring = function() return "interrupted: its time is up" end })

-- Runs fn(...) in protected mode, interrupted after `seconds`: true, results... or false and the
-- error as raised (`option` names the limit in the message of an interruption: policy_timeout for
-- a policy's functions, schedule_timeout for a pipeline schedule's). A count hook checks the
-- clock; LuaJIT runs hooks only in its interpreter, so the JIT is off (and its traces flushed)
-- for the call. Once the time is up the hook raises at every instruction, so a loop that catches
-- errors (pcall in a loop) cannot outlast it.
local function bounded(seconds, option, fn, ...)
  local had_jit = jit and jit.status()
  if jit then jit.off(); jit.flush() end
  local deadline, interrupted = core.now() + seconds, nil
  local old_hook, old_mask, old_count = debug.gethook()
  -- The backstop: code the hook cannot reach (a loop in an xpcall message handler, which LuaJIT
  -- runs without hooks when a hook raised the error; a long C call) ends the process, twice the
  -- limit (and 5 s) later, rather than running on.
  local stuck = ("did not finish within %s = %g s and could not be interrupted (a loop in an xpcall message "
    .. "handler, or a long C call, runs where the limit cannot reach it); the process ends"):format(option, seconds)
  local backstop = core._deadline_arm(2 * seconds + 5, stuck)
  local function hook()
    if interrupted or core.now() > deadline then
      -- Only in the user's code: partrain's own (this function, after the call returns) goes on.
      local info = debug.getinfo(2, "Sl")
      if not info or internal(info.source) then return end
      if not interrupted then
        interrupted = (info.currentline or 0) > 0 and (info.short_src .. ":" .. info.currentline) or info.short_src
        core._deadline_note(backstop, stuck .. " (interrupted at " .. interrupted .. ")")
        debug.sethook(hook, "", 1)
      end
      error(TIMEOUT, 0)
    end
  end
  debug.sethook(hook, "", 1000)
  -- Behind a C frame: a yield out of fn would leave the hook, the JIT setting and the backstop
  -- armed for whatever runs next.
  local results = { pcall(core._unyielding, fn, ...) }
  core._deadline_disarm(backstop)
  if old_hook then debug.sethook(old_hook, old_mask, old_count) else debug.sethook() end
  if had_jit then jit.on() end
  if interrupted then
    return false, ("did not finish within %s = %g s (interrupted at %s)"):format(option, seconds, interrupted)
  end
  return unpack(results, 1, table.maxn(results))
end

-- A message without the locations inside partrain's own Lua files that lead it (those of the
-- sharder's calls into the engine): the user's location is added in their place.
-- The user's line that led into partrain, which engine errors begin with, goes too: the caller
-- names a better place (the policy's entry).
local function strip_internal(err)
  local msg, user = tostring(err), core._where()
  while true do
    local rest = msg:match("^[^\n:]*:%d+: (.*)$")
    local prefix = rest and msg:sub(1, #msg - #rest)
    if not prefix or not (prefix:find(own_dir, 1, true) or prefix:find("partrain/[%w_]+%.lua:%d+: $")
                          or (user ~= "" and prefix == user .. ": ")) then
      return msg
    end
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
        fail(at, "P.%s has no option %s (options: %s)", kind, core._key_text(k), #names > 0 and table.concat(names, ", ") or "none")
      end
      if type(v) ~= expected then fail(at, "P.%s option '%s' must be a %s, got %s", kind, k, expected, type(v)) end
      if k == "fused" and (v < 1 or v ~= math.floor(v) or v ~= v or v == math.huge) then
        fail(at, "P.%s option 'fused' must be a whole number of parts >= 1, got %s", kind, tostring(v))
      end
      if k == "parts" then
        if #v < 1 then fail(at, "P.%s option 'parts' must list the output's part sizes, got an empty table", kind) end
        for i, n in pairs(v) do
          if type(i) ~= "number" or i > #v or type(n) ~= "number" or n < 1 or n ~= math.floor(n) or n == math.huge then
            fail(at, "P.%s option 'parts' must be a list of whole sizes >= 1, got %s at [%s]", kind, tostring(n), tostring(i))
          end
        end
        if opts.fused then fail(at, "P.%s takes fused or parts, not both", kind) end
      end
    end
    return setmetatable({ kind = kind, needs = needs, opts = opts, where = at }, STYLE)
  end
end

--- Output features split (Megatron's column-parallel linear). fused = k keeps k equal output parts
--- (q, k, v) together per head; parts = { q, k, v } the same for parts of unequal sizes (grouped-query
--- attention); gather_output gathers the full width after.
P.column = style("column", "Linear", { fused = "number", parts = "table", gather_output = "boolean",
                                       sequence_parallel = "boolean" })
--- Input features split; the partial outputs are summed (row-parallel linear).
P.row = style("row", "Linear", { input_is_parallel = "boolean", sequence_parallel = "boolean" })
--- A LayerNorm or RMSNorm in the sequence-parallel region: under sequence_parallel its weight's
--- (and bias's) gradients are summed over the tensor group; fused_norm picks LayerNorm's fused kernel.
P.norm = style("norm", { "LayerNorm", "RMSNorm" }, { sequence_parallel = "boolean" })
--- An embedding split along the vocabulary (padded to a multiple of the tensor size).
P.vocab_embedding = style("vocab_embedding", "Embedding", {})
--- The output head split along the vocabulary; its logits stay split: use pt.loss_fn(model), or
--- pt.tp.gather_logits(logits) before sampling.
P.vocab_head = style("vocab_head", "Linear", {})

--- An attribute value: divided by the tensor size (which must divide it).
P.divide_by_tensor = setmetatable({ kind = "divide_by_tensor" }, STYLE)

--- Ties parameter `a` to parameter `b` (dotted paths): after it they are one tensor.
function P.tie(model, a, b)
  if not core.nn.is_module(model) then raise("P.tie: argument #1 must be the model, got " .. type(model), 2) end
  if type(a) ~= "string" or type(b) ~= "string" then raise("P.tie: the parameters must be dotted paths (strings)", 2) end
  local function split(path)
    local owner, name = path:match("^(.*)%.([^.]+)$")
    return owner or "", name or path
  end
  local oa, na = split(a)
  local ob, nb = split(b)
  local ma, mb = model:get(oa), model:get(ob)
  if not ma then raise(("tie: no module '%s' in %s"):format(oa, model:type()), 2) end
  if not mb then raise(("tie: no module '%s' in %s"):format(ob, model:type()), 2) end
  local ok, pb = pcall(function() return mb[nb] end)
  if not ok or not pt.is_tensor(pb) then raise(("tie: '%s' is not a parameter"):format(b), 2) end
  local ok_a, pa = pcall(function() return ma[na] end)
  if not ok_a or not pt.is_tensor(pa) then raise(("tie: '%s' is not a parameter"):format(a), 2) end
  local set_ok, err = pcall(core.nn._tie, ma, na, pb)  -- that very tensor: a frozen one stays frozen
  if not set_ok then raise(("tie: %s"):format(strip_internal(err)), 2) end
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
      if k ~= "attributes" and k ~= "replace" and k ~= "methods" and k ~= "optional" then
        fail(ew, "modules.%s has no field %s (fields: attributes, methods, optional, replace)", key, core._key_text(k))
      end
    end
    if entry.optional ~= nil and type(entry.optional) ~= "boolean" then
      fail(ew, "modules.%s.optional must be a boolean, got %s", key, type(entry.optional))
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
            fail(rw, "modules.%s.replace[%d] has no field %s (fields: ignore_if_missing)", key, i, core._key_text(k))
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
                 postprocess = "function", pipeline = "table", ties = "table", units = "table" }
local PIPELINE = { blocks = "string", first = "list", last = "list" }

-- Checks a policy's fields (written at `at`).
local function check_policy(spec, at)
  if type(spec) ~= "table" or getmetatable(spec) == STYLE then fail(at, "P.policy expects a table, got %s", type(spec)) end
  for _, k in ipairs(sorted_keys(spec)) do
    local v, want = spec[k], FIELDS[k]
    if not want then
      fail(at, "policy has no field %s (fields: modules, name, pipeline, postprocess, preprocess, targets, ties, units)",
        core._key_text(k))
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
  -- A field that must be a non-empty list of names (`what`, plural and singular).
  local function names(field, plural, singular)
    local v = spec[field]
    if v == nil then return end
    if not is_list(v) or #v == 0 then fail(at, "policy field '%s' must be a non-empty list of %s", field, plural) end
    for i, name in ipairs(v) do
      if type(name) ~= "string" then
        fail(at, "policy field '%s': entry %d must be %s (a string), got %s", field, i, singular, type(name))
      end
    end
  end
  names("targets", "model types", "a model type")
  if spec.ties then
    if not is_list(spec.ties) then fail(at, "policy field 'ties' must be a list of { \"a.weight\", \"b.weight\" } pairs") end
    for i, pair in ipairs(spec.ties) do
      if type(pair) ~= "table" or not is_list(pair) or #pair ~= 2 or type(pair[1]) ~= "string" or type(pair[2]) ~= "string" then
        fail(at, "policy field 'ties': entry %d must be a pair of parameter names { \"a.weight\", \"b.weight\" }", i)
      end
    end
  end
  names("units", "module paths", "a module path")  -- ZeRO-3's units, in forward order
  if spec.pipeline then
    for _, k in ipairs(sorted_keys(spec.pipeline)) do
      local v, want = spec.pipeline[k], PIPELINE[k]
      if not want then fail(at, "pipeline has no field %s (fields: blocks, first, last)", core._key_text(k)) end
      if want == "string" and type(v) ~= "string" then fail(at, "pipeline.%s must be a string, got %s", k, type(v)) end
      if want == "list" then
        if type(v) ~= "table" or not is_list(v) then fail(at, "pipeline.%s must be a list of module paths", k) end
        for i, p in ipairs(v) do
          if type(p) ~= "string" then fail(at, "pipeline.%s[%d] must be a module path (a string), got %s", k, i, type(p)) end
        end
      end
    end
  end
  -- A policy that only says how the model splits into pipeline stages may replace nothing.
  if type(spec.modules) == "table" and (next(spec.modules) ~= nil or not spec.pipeline) then
    check_modules(spec.modules, at)
  end
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
--- (at `level`; 0: no position, for a caller that adds its own). Returns a new table.
function P.config(opts, level)
  level = level == 0 and 0 or (level or 1) + 1
  local cfg = {}
  for k, v in pairs(opts or {}) do
    if CONFIG[k] == nil then
      raise(("unknown sharding option %s (options: %s)"):format(core._key_text(k), table.concat(sorted_keys(CONFIG), ", ")), level)
    end
    if k == "policy_timeout" then
      if type(v) ~= "number" or not (v > 0) or v == math.huge then
        raise(("sharding option 'policy_timeout' must be a number of seconds > 0, got %s"):format(tostring(v)), level)
      end
    elseif k == "probe" then
      local ok = type(v) == "boolean" or v == "auto" or pt.is_tensor(v)
      if type(v) == "table" then
        ok = #v > 0 and is_list(v)
        for _, x in ipairs(v) do ok = ok and pt.is_tensor(x) end
      end
      if not ok then
        raise(("sharding option 'probe' must be true, false, \"auto\", an input tensor or a list of them, got %s"):format(
          type(v) == "string" and ("'" .. v .. "'") or type(v)), level)
      end
    elseif type(v) ~= "boolean" then
      raise(("sharding option '%s' must be a boolean, got %s"):format(k, type(v)), level)
    end
    cfg[k] = v
  end
  for k, default in pairs(CONFIG) do
    if cfg[k] == nil then cfg[k] = default end
  end
  if cfg.sequence_overlap and not cfg.sequence_parallel then
    raise("sharding option sequence_overlap needs sequence_parallel = true", level)
  end
  return cfg
end

-- Applying (partrain/sharder.lua does it) -----------------------------------------------------


--- Applies `policy` to `model` over the tensor group of `mesh`; cfg: the sharding options
--- (P.config). Returns the model, changed in place, and a function that undoes the policy. With
--- tensor_parallel = false, or a tensor group of one, the policy is only checked against the
--- model. All or nothing: on any error (on any rank) the model is put back exactly as it was,
--- and the error names the policy's file:line (for a plain table not made by P.policy, the line
--- of the call).
function P.apply(model, policy, mesh, cfg)
  if not core.nn.is_module(model) then raise("P.apply: argument #1 must be a module, got " .. type(model), 2) end
  if getmetatable(mesh) ~= debug.getregistry()["partrain.Mesh"] then
    raise("P.apply: argument #3 must be a mesh (pt.mesh {...}), got " .. type(mesh), 2)
  end
  cfg = P.config(cfg, 2)
  local at = declared[policy] or P.where(1)
  check_policy(policy, at)
  return require("partrain.sharder").apply(model, policy, mesh, cfg, at)
end

--- The undo record of `model` now: a function that puts it back exactly (its modules,
--- parameters and their contents, attributes, forwards, Lua fields, vocabulary split).
function P.begin(model) return require("partrain.sharder").begin(model) end

-- What partrain/sharder.lua shares with this file.
P._shape = { STYLE = STYLE, check_modules = check_modules, check_policy = check_policy, entry_where = entry_where,
             defined_at = defined_at, fail = fail, strip_internal = strip_internal, sorted_keys = sorted_keys,
             bounded = bounded }

--- The policies partrain ships, by model type.
P.registry = { GPT2 = "policies.gpt2", Llama = "policies.llama", MLP = "policies.mlp", SimpleModel = "policies.simple" }

return P
