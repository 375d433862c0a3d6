-- The sharder: applies a sharding policy (partrain/policy.lua) to a model as a transaction.
-- It plans every change against the model and refuses conflicts, runs the policy's functions
-- under a time bound, builds the parallel layers through the engine's applier
-- (parallel::apply_split), checks every module's invariants and the serial model's ties, compares
-- a probe batch with the serial model, and on any failure, on any rank, puts the model back
-- exactly as it was. S.plan_file gives a policy's plan as data, for C++ programs to apply.
local pt = require "partrain"
local core = require "partrain.core"
local P = require "partrain.policy"

local S = {}
local check_modules, check_policy = P._shape.check_modules, P._shape.check_policy
local entry_where, defined_at = P._shape.entry_where, P._shape.defined_at
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
    -- optional = true: a module only some models of the family have (LLaMA's dense MLP).
    if #found == 0 and not entry.optional then fail(ew, "modules.%s matches no module of %s", key, model:type()) end
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
        actions[#actions + 1] = { attribute = name, owner = owner, path = join(base, owner_path), value = new, where = ew }
      end
      for _, name in ipairs(sorted_keys(entry.methods or {})) do
        local fn = entry.methods[name]
        local mw = defined_at(fn)
        if name ~= "forward" and not parent:is_lua() then
          fail(mw, "methods: %s is a built-in module; only its forward can be replaced, not '%s'", parent:type(), name)
        end
        claim(set, join(base, ":" .. name), ("modules.%s.methods"):format(key), mw)
        owned[#owned + 1] = { base, "the method " .. name .. " of " .. (base == "" and model:type() or base) .. " set by modules." .. key, mw }
        actions[#actions + 1] = { method = name, owner = parent, path = base, key = key, fn = fn }
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

-- A replace action as the engine's parallel::LayerSplit (a style's options left out take the
-- configuration's or the layer's defaults there).
local function layer_split(a)
  local s = a.style
  return { path = a.path, kind = s.kind, where = s.where, fused = s.opts.fused, parts = s.opts.parts,
           gather_output = s.opts.gather_output, input_is_parallel = s.opts.input_is_parallel,
           sequence_parallel = s.opts.sequence_parallel }
end

-- The configuration the engine builds layers with (parallel::SplitOptions).
local function split_options(cfg)
  return { sequence_parallel = cfg.sequence_parallel, sequence_overlap = cfg.sequence_overlap, fused_norm = cfg.fused_norm }
end

-- Each layer is built by the engine's applier (parallel::apply_split), the one C++ programs use.
local function apply_actions(model, actions, cfg, group)
  local options = split_options(cfg)
  for _, a in ipairs(actions) do
    if a.attribute then
      local ok, err = pcall(a.owner.set_attribute, a.owner, a.attribute, a.value)
      if not ok then fail(a.where, "%s", strip_internal(err)) end
    elseif a.method then
      if a.method == "forward" then a.owner:replace_forward(a.fn)
      else a.owner[a.method] = a.fn end
    else
      local ok, err = pcall(core.tp._apply_split, model, layer_split(a), group, options)
      if not ok then fail(a.style.where, "P.%s on %s: %s", a.style.kind, a.path, strip_internal(err)) end
    end
  end
end

-- The policy's ties (ties = { { a, b }, ... }) that the serial model holds (`serial_ties`, as
-- core.nn._ties lists them), made again after the split: `a` takes `b`'s tensor (P.tie). A pair
-- the serial model does not tie is left as it is; a name that is no parameter is an error.
local function retie(model, policy, serial_ties, at)
  local group_of = {}
  for i, names in ipairs(serial_ties) do
    for _, name in ipairs(names) do group_of[name] = i end
  end
  for i, pair in ipairs(policy.ties or {}) do
    local a, b = pair[1], pair[2]
    if group_of[a] and group_of[a] == group_of[b] then
      local ok, err = pcall(P.tie, model, a, b)
      if not ok then fail(at, "ties[%d]: %s", i, strip_internal(err)) end
    end
  end
end

-- The policy's ties named parameters of the serial model (checked before anything changes).
local function check_ties(model, policy, at)
  if not policy.ties then return end
  local params = {}
  for name in model:named_parameters() do params[name] = true end
  for i, pair in ipairs(policy.ties) do
    for _, name in ipairs(pair) do
      if not params[name] then fail(at, "ties[%d]: '%s' is not a parameter of %s", i, name, model:type()) end
    end
  end
end

-- Runs the policy's function `fn` under policy_timeout; an error names `what` and the policy.
local function call(policy, cfg, at, what, fn, ...)
  local ok, result = bounded(cfg.policy_timeout, "policy_timeout", fn, ...)
  if not ok then fail(at, "%s of policy %s failed: %s", what, name_of(policy), tostring(result)) end
  return result
end

-- The policy's modules table: modules(cfg)'s, checked, when it is a function.
local function modules_of(policy, cfg, at)
  local modules = policy.modules
  if type(modules) == "function" then
    modules = call(policy, cfg, at, "modules(cfg)", modules, cfg)
    check_modules(modules, defined_at(policy.modules))
  end
  return modules
end

-- The whole transaction's work; raises on any problem (the caller undoes).
local function run(model, policy, mesh, cfg, at)
  local group = mesh:group("tensor")
  cfg.tensor, cfg.group = group:size(), group
  cfg.context = mesh:group("context")  -- a forward the policy installs reads its positions from it
  local splitting = cfg.tensor_parallel and cfg.tensor > 1
  local timeout = cfg.policy_timeout
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
  check_ties(model, policy, at)
  if policy.preprocess then call(policy, cfg, at, "preprocess", policy.preprocess, model, cfg) end
  local actions = plan(model, policy, modules_of(policy, cfg, at), cfg, at)
  if not splitting then return end
  apply_actions(model, actions, cfg, group)
  -- Two names of one attribute (GPT-2's heads and n_head) set by two entries: the last one wins.
  for _, a in ipairs(actions) do
    if a.attribute and a.owner:attribute(a.attribute) ~= a.value then
      fail(a.where, "the attribute %s of %s is set twice, under two of its names (%s ends %s, not %s)", a.attribute,
        a.owner:type(), a.attribute, tostring(a.owner:attribute(a.attribute)), tostring(a.value))
    end
  end
  retie(model, policy, ties, at)
  if policy.postprocess then call(policy, cfg, at, "postprocess", policy.postprocess, model, cfg) end
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
      model:type(), list(ties), list(after), #after < #ties and " (tie them again: ties = { { a, b } } in the policy, or P.tie(model, a, b) in postprocess)" or "")
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

-- A policy as data ------------------------------------------------------------------------------

-- file:line where a Lua function was written, the file's whole path (short_src may shorten it).
local function written_at(fn)
  local info = debug.getinfo(fn, "S")
  local source = info.source:sub(1, 1) == "@" and info.source:sub(2) or info.short_src
  return source .. ":" .. info.linedefined
end

--- The policy the Lua file `file` returns, planned for `model` over the tensor group of `mesh`
--- with the sharding options `opts` (P.config's), as plain data for the engine's applier
--- (parallel::PolicyPlan, which bindings/policy_loader.cpp reads from it): { name, where,
--- splits = { { path, kind, where, fused, parts, gather_output, input_is_parallel,
--- sequence_parallel }... }, attributes = { { module, name, value, where }... }, ties = { { param,
--- to }... }, options = { sequence_parallel, sequence_overlap, fused_norm } }. The model does not
--- change. Every check of planning runs (targets, matches, sizes, conflicts); what is code rather
--- than data is refused, naming the file: preprocess and postprocess (functions of the model; ties
--- are declared with the policy's `ties`) and methods (Lua forwards).
function S.plan_file(model, file, mesh, opts)
  local cfg = P.config(opts, 0)
  local chunk, err = pt._load_file(file)
  if not chunk then error(("cannot load the policy %s: %s"):format(file, tostring(err)), 0) end
  local ran, policy = pcall(chunk)
  if not ran then error(tostring(policy), 0) end
  if type(policy) ~= "table" then fail(file, "a policy file returns its policy (return P.policy {...}), got %s", type(policy)) end
  local at = P.declared_at(policy) or file
  check_policy(policy, at)
  local group = mesh:group("tensor")
  cfg.tensor, cfg.group = group:size(), group
  local not_data = "policy %s cannot be applied from C++: %s is a Lua function (written at %s), not data"
  if policy.preprocess then fail(at, not_data, name_of(policy), "its preprocess", written_at(policy.preprocess)) end
  if policy.postprocess then
    fail(at, not_data .. "; declare the parameters it ties again with ties = { { a, b } }", name_of(policy),
      "its postprocess", written_at(policy.postprocess))
  end
  check_ties(model, policy, at)
  local actions = plan(model, policy, modules_of(policy, cfg, at), cfg, at)
  local out = { name = policy.name or "", where = at, splits = {}, attributes = {}, ties = {}, options = split_options(cfg) }
  for _, a in ipairs(actions) do
    if a.method then
      fail(at, not_data, name_of(policy), ("modules.%s.methods.%s of %s"):format(a.key, a.method,
        a.path == "" and model:type() or a.path), written_at(a.fn))
    elseif a.attribute then
      out.attributes[#out.attributes + 1] = { module = a.path, name = a.attribute, value = a.value, where = a.where }
    else
      out.splits[#out.splits + 1] = layer_split(a)
    end
  end
  for i, pair in ipairs(policy.ties or {}) do out.ties[i] = { param = pair[1], to = pair[2] } end
  return out
end

return S
