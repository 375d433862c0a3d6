-- Sharding policies: how a model splits for tensor parallelism, written as Lua data
-- (ColossalAI ShardFormer's Policy). A policy names module types or dotted-path globs and says
-- which of their sub-modules become which parallel layer, which integer attributes divide by the
-- tensor size, and what to do before and after (preprocess, postprocess: ties). The sharder
-- checks everything before it changes anything, and every error names the policy's file:line.
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

local P = {}

-- file:line of the policy code that called a constructor (level 2: the constructor's caller).
local function where(level)
  local info = debug.getinfo(level + 1, "Sl")
  return info and (info.short_src .. ":" .. (info.currentline or 0)) or "?"
end

local function fail(at, fmt, ...) error(at .. ": " .. fmt:format(...), 0) end

local STYLE = {}  -- metatable of style values
local function style(kind, needs, allowed)
  return function(opts)
    local at = where(2)
    opts = opts or {}
    if type(opts) ~= "table" then fail(at, "P.%s expects an options table, got %s", kind, type(opts)) end
    for k, v in pairs(opts) do
      local expected = allowed[k]
      if not expected then
        local names = {}
        for n in pairs(allowed) do names[#names + 1] = n end
        table.sort(names)
        fail(at, "P.%s has no option '%s' (options: %s)", kind, tostring(k), #names > 0 and table.concat(names, ", ") or "none")
      end
      if type(v) ~= expected then fail(at, "P.%s option '%s' must be a %s, got %s", kind, k, expected, type(v)) end
    end
    return setmetatable({ kind = kind, needs = needs, opts = opts, where = at }, STYLE)
  end
end

--- Output features split (Megatron's column-parallel linear). fused = k keeps k output parts
--- (q, k, v) together per head; gather_output gathers the full width after.
P.column = style("column", "Linear", { fused = "number", gather_output = "boolean" })
--- Input features split; the partial outputs are summed (row-parallel linear).
P.row = style("row", "Linear", { input_is_parallel = "boolean" })
--- An embedding split along the vocabulary (padded to a multiple of the tensor size).
P.vocab_embedding = style("vocab_embedding", "Embedding", {})
--- An output head split along the vocabulary; its logits stay split: use pt.loss_fn(model).
P.vocab_head = style("vocab_head", "Linear", {})

--- An attribute value: divided by the tensor size (which must divide it).
P.divide_by_tensor = setmetatable({ kind = "divide_by_tensor" }, STYLE)

--- Ties parameter `a` to parameter `b` (dotted paths): after it they are one tensor.
function P.tie(model, a, b)
  local function split(path)
    local owner, name = path:match("^(.*)%.([^.]+)$")
    return owner or "", name or path
  end
  local oa, na = split(a)
  local ob, nb = split(b)
  local ma, mb = model:get(oa), model:get(ob)
  if not ma then error(("tie: no module '%s' in %s"):format(oa, model:type()), 2) end
  if not mb then error(("tie: no module '%s' in %s"):format(ob, model:type()), 2) end
  local pb = mb[nb]
  if not pt.is_tensor(pb) then error(("tie: '%s' is not a parameter"):format(b), 2) end
  if not pt.is_tensor(ma[na]) then error(("tie: '%s' is not a parameter"):format(a), 2) end
  ma[na] = pb
end

--- Declares a policy; checks its shape and remembers where it was written.
function P.policy(spec)
  local at = where(2)
  if type(spec) ~= "table" then fail(at, "P.policy expects a table, got %s", type(spec)) end
  local keys = { name = "string", targets = "table", modules = "table", preprocess = "function",
                 postprocess = "function", pipeline = "table" }
  for k, v in pairs(spec) do
    if not keys[k] then fail(at, "policy has no field '%s' (fields: modules, name, pipeline, postprocess, preprocess, targets)", tostring(k)) end
    if type(v) ~= keys[k] then fail(at, "policy field '%s' must be a %s, got %s", k, keys[k], type(v)) end
  end
  if not spec.modules then fail(at, "policy %s has no modules", spec.name or "?") end
  for key, entry in pairs(spec.modules) do
    if type(entry) ~= "table" then fail(at, "modules.%s must be a table, got %s", tostring(key), type(entry)) end
    for k in pairs(entry) do
      if k ~= "attributes" and k ~= "replace" then
        fail(at, "modules.%s has no field '%s' (fields: attributes, replace)", tostring(key), tostring(k))
      end
    end
    for i, r in ipairs(entry.replace or {}) do
      if type(r) ~= "table" or type(r[1]) ~= "string" or getmetatable(r[2]) ~= STYLE then
        fail(at, "modules.%s.replace[%d] must be { \"path\", P.<style> {...} [, ignore_if_missing = true] }", key, i)
      end
      for k in pairs(r) do
        if k ~= 1 and k ~= 2 and k ~= "ignore_if_missing" then
          fail(r[2].where, "modules.%s.replace[%d] has no field '%s' (fields: ignore_if_missing)", key, i, tostring(k))
        end
      end
    end
    for path, value in pairs(entry.attributes or {}) do
      if type(path) ~= "string" or (getmetatable(value) ~= STYLE and type(value) ~= "number") then
        fail(at, "modules.%s.attributes: '%s' must map to P.divide_by_tensor or a number", key, tostring(path))
      end
    end
  end
  spec.where = at
  return spec
end

-- Modules of `model` a policy key names: a type name, or a dotted-path glob ("h.*.attn").
local function matches(model, key)
  local found = {}
  local glob = key:find("[%.%*]") ~= nil
  local pattern = glob and ("^" .. key:gsub("%.", "%%."):gsub("%*", "[^.]+") .. "$") or nil
  for path, m in model:named_modules() do
    if (glob and path:match(pattern)) or (not glob and m:type() == key) then found[#found + 1] = { path, m } end
  end
  return found
end

local function join(a, b) return a == "" and b or (a .. "." .. b) end

--- Applies `policy` to `model` over the tensor group of `mesh`; cfg = { sequence_parallel, ... }.
--- Returns the model, changed in place.
function P.apply(model, policy, mesh, cfg)
  cfg = cfg or {}
  local at = policy.where or "policy"
  local group = mesh:group("tensor")
  local t = group:size()
  cfg.tensor = t
  if policy.targets then
    local ok = false
    for _, name in ipairs(policy.targets) do ok = ok or name == model:type() end
    if not ok then fail(at, "policy %s serves %s, not %s", policy.name or "?", table.concat(policy.targets, ", "), model:type()) end
  end
  if policy.preprocess then
    local ok, err = pcall(policy.preprocess, model, cfg)
    if not ok then fail(at, "preprocess of policy %s failed: %s", policy.name or "?", tostring(err)) end
  end
  -- Check everything first: nothing changes unless the whole policy applies.
  local actions = {}
  for key, entry in pairs(policy.modules) do
    local found = matches(model, key)
    if #found == 0 then fail(at, "modules.%s matches no module of %s", key, model:type()) end
    for _, item in ipairs(found) do
      local base, parent = item[1], item[2]
      for _, r in ipairs(entry.replace or {}) do
        local path, s = join(base, r[1]), r[2]
        local target = model:get(path)
        if not target then
          if not r.ignore_if_missing then fail(s.where, "%s: no module '%s' in %s (set ignore_if_missing = true if that is expected)", s.kind, path, model:type()) end
        else
          if target:type() ~= s.needs then
            fail(s.where, "P.%s does not fit %s: it is a %s, and P.%s needs a %s", s.kind, path, target:type(), s.kind, s.needs)
          end
          actions[#actions + 1] = { path = path, style = s, target = target }
          -- Sizes: an error now rather than half-way through.
          if s.kind == "column" then
            local fused = s.opts.fused or 1
            local out = target.weight.shape[1]
            if out % fused ~= 0 or (out / fused) % t ~= 0 then
              fail(s.where, "tensor=%d does not divide %s's output of %d%s", t, path, out, fused > 1 and (" (" .. fused .. " fused parts of " .. out / fused .. ")") or "")
            end
          elseif s.kind == "row" then
            local input = target.weight.shape[2]
            if input % t ~= 0 then fail(s.where, "tensor=%d does not divide %s's input of %d", t, path, input) end
          end
        end
      end
      for attr_path, value in pairs(entry.attributes or {}) do
        local owner_path, name = attr_path:match("^(.*)%.([^.]+)$")
        owner_path, name = owner_path or "", name or attr_path
        local owner = parent:get(owner_path)
        if not owner then fail(at, "attributes: no module '%s' under %s", owner_path, base == "" and model:type() or base) end
        local current = owner:attribute(name)
        if current == nil then fail(at, "attributes: %s has no attribute '%s'", owner:type(), name) end
        local new = value
        if getmetatable(value) == STYLE then
          if current % t ~= 0 then
            fail(at, "tensor=%d does not divide %s.%s=%d", t, join(base, owner_path), name, current)
          end
          new = current / t
        end
        actions[#actions + 1] = { attribute = name, owner = owner, value = new }
      end
    end
  end
  -- Apply.
  for _, a in ipairs(actions) do
    if a.attribute then
      a.owner:set_attribute(a.attribute, a.value)
    else
      local s, built = a.style
      if s.kind == "column" then built = pt.tp.column(a.target, group, { fused = s.opts.fused, gather_output = s.opts.gather_output })
      elseif s.kind == "row" then built = pt.tp.row(a.target, group, { input_is_parallel = s.opts.input_is_parallel })
      elseif s.kind == "vocab_embedding" then built = pt.tp.vocab_embedding(a.target, group)
      elseif s.kind == "vocab_head" then
        built = pt.tp.column(a.target, group, { pad = true })
        P.vocab_parallel[model] = { group = group, vocab = a.target.weight.shape[1] }
      end
      model:set(a.path, built)
    end
  end
  if policy.postprocess then
    local ok, err = pcall(policy.postprocess, model, cfg)
    if not ok then fail(at, "postprocess of policy %s failed: %s", policy.name or "?", tostring(err)) end
  end
  return model
end

--- Models whose output logits are split along the vocabulary (by P.vocab_head): model -> { group, vocab }.
P.vocab_parallel = setmetatable({}, { __mode = "k" })

--- The policies partrain ships, by model type.
P.registry = { GPT2 = "policies.gpt2", MLP = "policies.mlp", SimpleModel = "policies.simple" }

return P
