-- The sharder: applies a sharding policy (partrain/policy.lua) to a model as a transaction.
-- It plans every change against the model and refuses conflicts, runs the policy's functions
-- under a time bound, builds the parallel layers, checks every module's invariants and the
-- serial model's ties, compares a probe batch with the serial model, and on any failure, on any
-- rank, puts the model back exactly as it was.
local pt = require "partrain"
local core = require "partrain.core"
local P = require "partrain.policy"

local S = {}
local check_modules, entry_where, defined_at = P._shape.check_modules, P._shape.entry_where, P._shape.defined_at
local fail, strip_internal, sorted_keys, bounded = P._shape.fail, P._shape.strip_internal, P._shape.sorted_keys,
  P._shape.bounded

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
          local fits = target:type() == s.needs
          if type(s.needs) == "table" then
            fits = false
            for _, t in ipairs(s.needs) do fits = fits or target:type() == t end
          end
          if not fits then
            local needs = type(s.needs) == "table" and table.concat(s.needs, " or ") or s.needs
            fail(s.where, "P.%s does not fit %s: it is a %s, and P.%s needs a %s", s.kind, path, target:type(), s.kind, needs)
          end
          claim(replaced, path, ("modules.%s.replace[%d] (P.%s at %s)"):format(key, i, s.kind, s.where), s.where)
          actions[#actions + 1] = { path = path, style = s, target = target }
          -- Sizes: an error now rather than half-way through.
          if s.kind == "column" then
            local fused = s.opts.fused or (s.opts.parts and #s.opts.parts) or 1
            local out = target.weight.shape[1]
            if s.opts.parts then
              local sum = 0
              for _, n in ipairs(s.opts.parts) do
                sum = sum + n
                if n % t ~= 0 then
                  fail(s.where, "tensor=%d does not divide %s's output part of %d (parts %s)", t, path, n, table.concat(s.opts.parts, "+"))
                end
              end
              if sum ~= out then
                fail(s.where, "P.column's parts %s add up to %d, but %s's output is %d", table.concat(s.opts.parts, "+"), sum, path, out)
              end
            elseif out % fused ~= 0 or (out / fused) % t ~= 0 then
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

-- Policy code under a time bound ---------------------------------------------------------------

-- Applying -------------------------------------------------------------------------------------

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
      local device = w.device == "meta" and pt.device() or w.device  -- a deferred model: made for the probe
      if kind == "Linear" then return { core.tp._probe_input({ 2, w.shape[2] }, 0, w.dtype, device) } end
      local t, seq, T = cfg.tensor, model:attribute("seq"), 2 * cfg.tensor
      if seq and seq < T then T = seq >= t and t or seq end
      return { core.tp._probe_input({ 2, T }, w.shape[1], "int64", device) }
    end
  end
  return nil
end

local function probing(model, cfg)
  if cfg.probe == false or core.plan.planning() then return false end
  return model:parameters()[1] ~= nil
end

-- What the probe runs of a model: all of it, or (probe = "auto" on a model of more than
-- P.probe_limit parameters) the first of its repeated blocks (the policy's pipeline blocks, else
-- the container with the most children of one type), so that its cost is bounded by the model's
-- size less its other blocks. Returns the container's path ("" for all) and its block count.
local function probe_slice(model, policy, cfg)
  if cfg.probe ~= "auto" or model:num_parameters() <= P.probe_limit then return "", 0 end
  local path = policy.pipeline and policy.pipeline.blocks
  if type(path) ~= "string" or not model:get(path) then path = core.tp._repeated_blocks(model) end
  if path == "" then return "", 0 end
  return path, #model:get(path):children()
end

-- One line on the first rank saying what the probe checked, when it was less than the whole model.
local function say(mesh, text)
  if mesh:rank() == 0 then io.stderr:write("partrain: " .. text .. "\n") end
end

local function apply_actions(model, actions, cfg, group)
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
          built = pt.tp.column(a.target, group, { fused = s.opts.fused, parts = s.opts.parts, gather_output = s.opts.gather_output,
                                                  sequence_parallel = seq, sequence_overlap = seq and cfg.sequence_overlap })
        elseif s.kind == "row" then
          built = pt.tp.row(a.target, group, { input_is_parallel = s.opts.input_is_parallel,
                                               sequence_parallel = option(s, "sequence_parallel", sp) })
        elseif s.kind == "norm" then
          built = pt.tp.layer_norm(a.target, group, { sequence_parallel = option(s, "sequence_parallel", sp), fused = cfg.fused_norm })
        elseif s.kind == "vocab_embedding" then built = pt.tp.vocab_embedding(a.target, group)
        elseif s.kind == "vocab_head" then
          built = pt.tp.column(a.target, group, { pad = true, sequence_parallel = sp, sequence_overlap = sp and cfg.sequence_overlap })
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
    local ok, result = bounded(timeout, "policy_timeout", fn, ...)
    if not ok then fail(at, "%s of policy %s failed: %s", what, name_of(policy), tostring(result)) end
    return result
  end
  -- One serial model to cut from: the tensor group's ranks hold rank 0's weights (they differ
  -- when the ranks were seeded differently). Then its answer, before anything else changes.
  if splitting then core.tp._align(model, group) end
  local serial, inputs, probe_options
  if splitting and probing(model, cfg) then
    local given
    inputs, given = probe_inputs(model, cfg)
    if inputs then
      local slice, blocks = probe_slice(model, policy, cfg)
      probe_options = { reference = true, slice = slice }
      local ok, record = bounded(timeout, "policy_timeout", core.tp._probe, model, inputs, probe_options)
      if ok then
        serial = record
        if slice ~= "" then
          say(mesh, ("policy %s: the probe checks %s with the first of its %d blocks in %s (%d parameters, more than "
            .. "P.probe_limit = %d; probe = true checks them all)"):format(name_of(policy), model:type(), blocks, slice,
            model:num_parameters(), P.probe_limit))
        end
      elseif given then fail(at, "the serial %s fails on the probe input: %s", model:type(), tostring(record))
      elseif slice ~= "" then
        say(mesh, ("policy %s: not probed: %s's forward does not run on its first block of %s alone (%s); "
          .. "probe = true runs the whole model"):format(name_of(policy), model:type(), slice,
          strip_internal(tostring(record))))
      end
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
  apply_actions(model, actions, cfg, group)
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
  return serial, inputs, probe_options
end

--- Applies a checked `policy` (P.policy's shape) to `model` with the configuration `cfg`
--- (P.config's), as a transaction; `at` names the policy in errors. Returns the model and the
--- undo function (see P.apply).
function S.apply(model, policy, mesh, cfg, at)
  local undo = S.begin(model)
  local ok, serial, inputs, probe_options = pcall(run, model, policy, mesh, cfg, at)
  local err = first_error(not ok and tostring(serial) or nil)
  if err then
    undo()
    error(err, 0)
  end
  if serial then  -- the probe: the sharded model must compute what the serial one did
    local sharded_options = { slice = probe_options.slice }
    local ran, sharded = bounded(cfg.policy_timeout, "policy_timeout", core.tp._probe, model, inputs, sharded_options,
                                 serial)
    local problem = not ran and ("its forward fails on the probe batch: " .. strip_internal(tostring(sharded)))
    if ran then problem = core.tp._probe_compare(serial, sharded, core.parallel.vocab_head(model) ~= nil) end
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

--- The undo record of `model` now (P.begin): a function that puts it back exactly (its modules,
--- parameters and their contents, attributes, forwards, Lua fields; the vocabulary head with them).
function S.begin(model)
  local snapshot = core.nn._snapshot(model, 256 * 1024 * 1024)
  return function()
    local lost = snapshot:restore()
    if #lost > 0 then
      io.stderr:write(("partrain: the policy changed %s in place; too large to keep a copy of, it stays changed\n"):format(
        table.concat(lost, ", ")))
    end
  end
end

return S
