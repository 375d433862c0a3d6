-- Sharding policies: how a model splits for tensor parallelism, written as Lua data
-- (ColossalAI ShardFormer's Policy). A policy names module types or dotted-path globs and says
-- which of their sub-modules become which parallel layer, which integer attributes divide by the
-- tensor size, which methods Lua functions replace, and what to do before and after
-- (preprocess, postprocess: ties). `modules` may be a function of the configuration (ShardConfig:
-- sequence_parallel, sequence_overlap, fused_norm, flash_attention) returning that table. The
-- sharder checks everything before it changes anything, and every error names the policy's
-- file:line.
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
P.column = style("column", "Linear", { fused = "number", gather_output = "boolean", sequence_parallel = "boolean" })
--- Input features split; the partial outputs are summed (row-parallel linear).
P.row = style("row", "Linear", { input_is_parallel = "boolean", sequence_parallel = "boolean" })
--- A LayerNorm in the sequence-parallel region: under sequence_parallel its weight's and bias's
--- gradients are summed over the tensor group; fused_norm picks the fused kernel.
P.norm = style("norm", "LayerNorm", { sequence_parallel = "boolean" })
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

-- Checks the shape of a policy's modules table (written at `at`).
local function check_modules(modules, at)
  if type(modules) ~= "table" then fail(at, "modules must be a table, got %s", type(modules)) end
  for key, entry in pairs(modules) do
    if type(entry) ~= "table" then fail(at, "modules.%s must be a table, got %s", tostring(key), type(entry)) end
    for k in pairs(entry) do
      if k ~= "attributes" and k ~= "replace" and k ~= "methods" then
        fail(at, "modules.%s has no field '%s' (fields: attributes, methods, replace)", tostring(key), tostring(k))
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
      local t = type(value)
      if type(path) ~= "string" or (getmetatable(value) ~= STYLE and t ~= "number" and t ~= "boolean") then
        fail(at, "modules.%s.attributes: '%s' must map to P.divide_by_tensor, a number or a boolean", key, tostring(path))
      end
    end
    for name, fn in pairs(entry.methods or {}) do
      if type(name) ~= "string" or type(fn) ~= "function" then
        fail(at, "modules.%s.methods: '%s' must map to a function(self, ...)", key, tostring(name))
      end
    end
  end
end

--- Declares a policy; checks its shape and remembers where it was written.
function P.policy(spec)
  local at = where(2)
  if type(spec) ~= "table" then fail(at, "P.policy expects a table, got %s", type(spec)) end
  local keys = { name = "string", targets = "table", modules = { table = true, ["function"] = true }, preprocess = "function",
                 postprocess = "function", pipeline = "table" }
  for k, v in pairs(spec) do
    if not keys[k] then fail(at, "policy has no field '%s' (fields: modules, name, pipeline, postprocess, preprocess, targets)", tostring(k)) end
    local want = keys[k]
    if type(want) == "table" and not want[type(v)] then
      fail(at, "policy field '%s' must be a table or a function(cfg) returning one, got %s", k, type(v))
    elseif type(want) == "string" and type(v) ~= want then
      fail(at, "policy field '%s' must be a %s, got %s", k, want, type(v))
    end
  end
  if not spec.modules then fail(at, "policy %s has no modules", spec.name or "?") end
  if type(spec.modules) == "table" then check_modules(spec.modules, at) end
  spec.where = at
  return spec
end

-- Modules of `model` a policy key names: a type name, a path ("lm_head", "h.0.attn"), or a
-- dotted-path glob ("h.*.attn").
local function matches(model, key)
  local found = {}
  local glob = key:find("[%.%*]") ~= nil
  local pattern = "^" .. key:gsub("%.", "%%."):gsub("%*", "[^.]+") .. "$"
  for path, m in model:named_modules() do
    if path:match(pattern) or (not glob and m:type() == key) then found[#found + 1] = { path, m } end
  end
  return found
end

local function join(a, b) return a == "" and b or (a .. "." .. b) end

-- The configuration a policy sees (ShardFormer's ShardConfig), with its defaults.
local CONFIG = {
  tensor_parallel = true,     -- split over the mesh's tensor group (false: only check the policy)
  sequence_parallel = false,  -- keep activations split along the sequence between TP regions
  sequence_overlap = false,   -- overlap the sequence all-gather with the matmul (needs the above)
  fused_norm = true,          -- LayerNorm as one fused kernel (false: composed, for reference)
  flash_attention = false,    -- fused attention where LibTorch has it (2.x)
}
P.config_keys = CONFIG

--- Fills in and checks a configuration table; an unknown key or a wrong type is an error
--- (at `level`). Returns a new table.
function P.config(opts, level)
  level = (level or 1) + 1
  local cfg = {}
  for k, v in pairs(opts or {}) do
    if CONFIG[k] == nil then
      local names = {}
      for n in pairs(CONFIG) do names[#names + 1] = n end
      table.sort(names)
      error(("unknown sharding option '%s' (options: %s)"):format(tostring(k), table.concat(names, ", ")), level)
    end
    if type(v) ~= "boolean" then error(("sharding option '%s' must be a boolean, got %s"):format(k, type(v)), level) end
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

-- Everything a policy would do to `model`, checked, as a list of actions; nothing changes yet.
local function plan(model, policy, cfg)
  local at = policy.where or "policy"
  local t = cfg.tensor
  if policy.targets then
    local ok = false
    for _, name in ipairs(policy.targets) do ok = ok or name == model:type() end
    if not ok then fail(at, "policy %s serves %s, not %s", policy.name or "?", table.concat(policy.targets, ", "), model:type()) end
  end
  local modules = policy.modules
  if type(modules) == "function" then
    local ok, result = pcall(modules, cfg)
    if not ok then fail(at, "modules(cfg) of policy %s failed: %s", policy.name or "?", tostring(result)) end
    modules = result
  end
  check_modules(modules, at)
  local actions = {}
  local keys = {}  -- in a fixed order: every rank must build its layers in the same order
  for key in pairs(modules) do keys[#keys + 1] = key end
  table.sort(keys)
  for _, key in ipairs(keys) do
    local entry = modules[key]
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
        elseif type(value) == "boolean" then
          new = value and 1 or 0
        end
        actions[#actions + 1] = { attribute = name, owner = owner, value = new }
      end
      for name, fn in pairs(entry.methods or {}) do
        if name ~= "forward" and not parent:is_lua() then
          fail(at, "methods: %s is a built-in module; only its forward can be replaced, not '%s'", parent:type(), name)
        end
        actions[#actions + 1] = { method = name, owner = parent, fn = fn }
      end
    end
  end
  return actions
end

--- Applies `policy` to `model` over the tensor group of `mesh`; cfg: the sharding options
--- (P.config). Returns the model, changed in place. With tensor_parallel = false, or a tensor
--- group of one, the policy is only checked against the model.
function P.apply(model, policy, mesh, cfg)
  cfg = P.config(cfg, 2)
  local at = policy.where or "policy"
  local group = mesh:group("tensor")
  cfg.tensor, cfg.group = group:size(), group
  if policy.preprocess then
    local ok, err = pcall(policy.preprocess, model, cfg)
    if not ok then fail(at, "preprocess of policy %s failed: %s", policy.name or "?", tostring(err)) end
  end
  -- Check everything first: nothing changes unless the whole policy applies.
  local actions = plan(model, policy, cfg)
  if not cfg.tensor_parallel or cfg.tensor == 1 then return model end
  local sp = cfg.sequence_parallel
  local function option(s, name, default)
    if s.opts[name] ~= nil then return s.opts[name] end
    return default
  end
  for _, a in ipairs(actions) do
    if a.attribute then
      a.owner:set_attribute(a.attribute, a.value)
    elseif a.method then
      if a.method == "forward" then a.owner:replace_forward(a.fn)
      else a.owner[a.method] = a.fn end
    else
      local s, built = a.style
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
