-- The partrain library as scripts see it: `local pt = require "partrain"`.
-- The C half (partrain.core) brings tensors, modules, optimizers and loaders; this file gathers
-- them into one table and adds what is clearer in Lua: module classes, iterators, pt.args, pt.log.
local core = require "partrain.core"
-- raise(msg, level): an error at the user's line, as the engine's are (even when the user's caller is
-- pcall itself), or where error(msg, level) would put it when no user code is running.
local raise = core._raise

local pt = { version = core.version }

--- Re-raises an error a pcall caught around an engine call so that it names the caller's line
--- once: the user's line, which an engine error already begins with, or else the frame `level`
--- above the caller of rethrow.
local function rethrow(err, level) raise(tostring(err), level + 1) end
pt._rethrow = rethrow

-- `require` of Lua files through a loader of partrain's own, the same search as Lua's, which
-- remembers which file each running chunk came from: a file that ends in a tail call (`return
-- P.policy {...}`) loses its frame, and errors about it would otherwise name no file of it.
local loading = setmetatable({}, { __mode = "k" })  -- the wrapper running a file's chunk -> its path
-- The chunk of the Lua file at `path`, wrapped so that pt.loading_file knows it; nil and the
-- message when it cannot be loaded.
local function load_file(path)
  local chunk, err = loadfile(path)
  if not chunk then return nil, err end
  local function wrapper(...)
    local results = { chunk(...) }  -- not a tail call: this frame stays while the chunk runs
    return unpack(results, 1, table.maxn(results))
  end
  loading[wrapper] = path
  return wrapper
end
package.loaders[2] = function(name)
  local path, tried = package.searchpath(name, package.path)
  if not path then return tried end
  local wrapper, err = load_file(path)
  if not wrapper then error(("error loading module '%s' from file '%s':\n\t%s"):format(name, path, err), 0) end
  return wrapper
end
--- load_file(path): a Lua file's chunk as `require` loads it (errors about a policy it returns
--- name the file), or nil and the message.
pt._load_file = load_file
--- The file whose chunk `fn` runs, when `fn` is the function partrain's loader made for it.
function pt.loading_file(fn) return loading[fn] end

-- Tensors: pt.zeros, pt.tensor, pt.cat, pt.no_grad, ... (dims and indices count from 0), and
-- where this rank computes. A list, not a copy of core: the REPL's functions and the `_` names
-- stay inside the library.
for _, name in ipairs {
  "tensor", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange", "linspace", "eye",
  "zeros_like", "ones_like", "randn_like", "cat", "stack", "einsum", "where", "is_tensor",
  "manual_seed", "no_grad", "grad_enabled", "get_threads", "set_threads", "cuda_available", "device",
} do
  pt[name] = assert(core[name], name)
end
--- pt.cuda: is_available(), device_count(), current_device(), device_name([d]), synchronize([d]),
--- memory_stats([d]) ({ allocated, reserved, peak_allocated, peak_reserved } bytes),
--- reset_peak_memory_stats([d]); d: an index or "cuda:N". docs/gpu.md.
pt.cuda = core.cuda
pt.Tensor = core.Tensor   -- the tensor method table: add a method here and every tensor has it
do  -- methods first, then the fields that are not methods (shape, dtype, device, grad, ...)
  local methods, field = core.Tensor, core.Tensor_mt.__field
  core.Tensor_mt.__index = function(t, key)
    local m = methods[key]
    if m ~= nil then return m end
    return field(t, key)
  end
end
for _, dtype in ipairs { "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16",
                         "int8", "uint8", "bool" } do
  pt[dtype] = dtype
end

-- Modules -----------------------------------------------------------------------------------
local nn = {}
pt.nn = nn
for name, fn in pairs(core.nn) do
  if name:sub(1, 1) ~= "_" then nn[name] = fn end
end
-- The built-in model families (engine/models/registry.cpp): pt.models.mlp, pt.models.gpt2, ...
pt.models = {}
for name, build in pairs(core.models) do pt.models[name] = build end
--- The family `model` is the root of, as { name, type, policy } (policy: the module of its default
--- sharding policy, e.g. "policies.gpt2"), or nil.
pt.model_family = core.model_families.family_of

--- pt.deferred(fn): runs `fn` (which builds and returns a model) with new layers' parameters on
--- the meta device (no memory), and gives the model its base seed: every tensor is later
--- initialized from (that seed, its dotted name), so pt.parallelize materializes on each rank
--- only the stage and shards it holds, and model:materialize() the whole model, with the weights
--- of the model built normally (built-in families) or of any other deferred build after the
--- same pt.manual_seed. docs/pipeline.md.
function pt.deferred(fn)
  if type(fn) ~= "function" then raise("pt.deferred: a function that builds the model expected, got " .. type(fn), 2) end
  local was = core.nn._defer(true)
  local ok, model = pcall(fn)
  core.nn._defer(was)
  if not ok then error(model, 0) end
  if not core.nn.is_module(model) then raise("pt.deferred: the function returned " .. type(model) .. ", not a model", 2) end
  core.nn._seed_if_unset(model)
  return model
end

function nn.ReLU() return core.nn.activation "ReLU" end
function nn.Tanh() return core.nn.activation "Tanh" end
function nn.Sigmoid() return core.nn.activation "Sigmoid" end
function nn.SiLU() return core.nn.activation "SiLU" end
function nn.Softmax(dim) return core.nn.activation("Softmax", dim or -1) end
function nn.LogSoftmax(dim) return core.nn.activation("LogSoftmax", dim or -1) end
function nn.GELU(options)
  if options ~= nil and type(options) ~= "table" then
    raise(("GELU: options must be a table ({ approximate = 'tanh' }), got a %s"):format(type(options)), 2)
  end
  for k in pairs(options or {}) do
    if k ~= "approximate" then raise(("GELU has no option %s (options: approximate)"):format(core._key_text(k)), 2) end
  end
  local approximate = options and options.approximate or "none"
  if approximate ~= "none" and approximate ~= "tanh" then
    raise(("GELU: approximate must be 'none' or 'tanh', got '%s'"):format(tostring(approximate)), 2)
  end
  return core.nn.activation(approximate == "tanh" and "GELUTanh" or "GELU")
end

--- A tensor that a Lua-defined module should train: assigning it to `self.name` registers it.
function nn.Parameter(t)
  if not pt.is_tensor(t) then raise("nn.Parameter expects a tensor, got " .. type(t), 2) end
  return t:detach():requires_grad_(true)
end

--- Declares a module class written in Lua, Torch7 style:
---   local Block = pt.nn.Module "Block"            -- or pt.nn.Module("Block", Parent)
---   function Block:__init(dim) self.fc = pt.nn.Linear(dim, dim) end
---   function Block:forward(x) return self.fc(x):relu() end
---   local b = Block(16)
--- Children and parameters assigned to self become engine nodes (policies, state_dict and
--- checkpoints see them); other values are plain Lua fields.
function nn.Module(name, parent)
  if type(name) ~= "string" then raise("nn.Module expects a type name (string), got " .. type(name), 2) end
  if parent ~= nil and type(parent) ~= "table" then
    raise("nn.Module: the parent of " .. name .. " must be a class, got " .. type(parent), 2)
  end
  local class = { __name = name, __parent = parent }
  return setmetatable(class, {
    __index = parent,
    __tostring = function() return "module class " .. name end,
    __call = function(cls, ...)
      local self = core.nn._lua_module(name, cls)
      if cls.__init then cls.__init(self, ...) end
      return self
    end,
  })
end

local Module = core.Module    -- methods every module has, built-in or Lua-defined

-- Whether x can be called: a function, or a value whose metatable (the real one, though a
-- __metatable field hides it) has __call.
local function callable(x)
  local mt = debug.getmetatable(x)
  return type(x) == "function" or (type(mt) == "table" and mt.__call ~= nil)
end
core.Module_mt.__call = function(self, ...) return self:forward(...) end

local function pairs_iter(names, values)
  local i = 0
  return function()
    i = i + 1
    if names[i] then return names[i], values[i] end
  end
end

-- A module where `what` needs one (errors at the caller's line: `m.named_modules()` for `m:`).
local function need_module(m, what, level)
  if not core.nn.is_module(m) then
    raise(("%s: a module expected, got %s (call it with a colon: m:%s(...))"):format(what, type(m), what), level + 1)
  end
end

--- for name, p in model:named_parameters() do ... end   (dotted names, registration order)
function Module:named_parameters() need_module(self, "named_parameters", 2); return pairs_iter(self:_named_parameters()) end
function Module:named_buffers() need_module(self, "named_buffers", 2); return pairs_iter(self:_named_buffers()) end
--- for path, m in model:named_modules() do ... end      (the model itself first, as "")
function Module:named_modules() need_module(self, "named_modules", 2); return pairs_iter(self:_named_modules()) end
function Module:named_children() need_module(self, "named_children", 2); return pairs_iter(self:_named_children()) end
function Module:children()
  need_module(self, "children", 2)
  local _, modules = self:_named_children()
  return modules
end
--- Calls fn(module, path) on every module of the tree.
function Module:apply(fn)
  need_module(self, "apply", 2)
  if not callable(fn) then
    raise("apply: a function expected (it is called with each module and its path), got " .. type(fn), 2)
  end
  for path, m in self:named_modules() do fn(m, path) end
  return self
end

-- Optimizers and data -----------------------------------------------------------------------
pt.optim = core.optim
pt.data = core.data

local Loader = debug.getregistry()["partrain.Loader"].__index
--- for x, y in loader:batches() do ... end   (the rest of the current epoch)
function Loader:batches()
  return function()
    if self:has_next() then return self:next() end
  end
end

-- Distribution ------------------------------------------------------------------------------
--- pt.dist: this rank's place (rank, world_size, local_rank, local_world_size), the world group
--- (pt.dist.world()), barrier. Outside a launcher the world has one rank and collectives are no-ops.
pt.dist = {}
for name, fn in pairs(core.dist) do
  pt.dist[name] = fn
end
--- pt.tp: the tensor-parallel building blocks (column/row-parallel linear, vocab-parallel
--- embedding and cross-entropy, the region functions); sharding policies compose them.
pt.tp = core.tp
--- Context parallelism (docs/parallel.md): attention over a sequence split across the context group.
pt.cp = core.cp
--- Mixture of experts (docs/parallel.md, "Expert parallelism"): routers written in Lua, and what
--- the blocks counted.
pt.moe = pt.moe or {}
--- pt.moe.set_router(model, fn): fn(block, logits, x) -> weights, indices [, probs] routes every
--- MoE block of `model` (or `model` itself, an MoE block); returns how many it set.
function pt.moe.set_router(model, fn)
  need_module(model, "pt.moe.set_router", 2)
  if type(fn) ~= "function" then
    error("pt.moe.set_router: expected a function(block, logits, x), got " .. type(fn), 2)
  end
  local n = 0
  for _, m in model:named_modules() do
    if m:type() == "MoE" then
      m:set_router(fn)
      n = n + 1
    end
  end
  if n == 0 then error("pt.moe.set_router: " .. model:type() .. " has no MoE block", 2) end
  return n
end
--- pt.moe.stats(model): { [block path] = { routed = { per expert }, dropped, slots, aux, z,
--- forwards } }, this rank's counts since the last call (which resets them).
function pt.moe.stats(model)
  need_module(model, "pt.moe.stats", 2)
  return model:_take_moe_stats()
end
--- pt.mesh { tensor = t, context = c, pipeline = p, data = d, zero = z }: the world laid out as
--- pipeline x data x context x tensor (tensor fastest), with its groups made once.
local last_mesh = setmetatable({}, { __mode = "v" })
function pt.mesh(...)
  local ok, mesh = pcall(core.dist.mesh, ...)   -- its errors name the caller's line, not this one's
  if not ok then rethrow(mesh, 2) end
  last_mesh[1] = mesh
  return mesh
end
pt.dist.mesh = pt.mesh
--- How many times the launcher has restarted this job (--max-restarts): 0 on the first start.
function pt.dist.restart_count() return tonumber(os.getenv("PARTRAIN_RESTART_COUNT") or "") or 0 end
--- The mesh made last (while it lives).
function pt.last_mesh() return last_mesh[1] end

--- Makes `model` parallel over `mesh` and returns it, used like the serial model. The model then
--- has one owner in the engine (a ParallelModel: docs/parallel.md) that holds its mesh, policy,
--- data-parallel state and parameter records, and runs model:train_step; dropping the model
--- frees it all.
--- `policy` (a table from partrain.policy, a module name such as "policies.gpt2", or nil for the
--- registered policy of the model's type) splits it over the mesh's tensor group; at tensor 1 a
--- policy is only checked. Then data parallelism runs over the data group (parameters broadcast
--- from data rank 0, gradients synced in buckets during backward).
--- opts: the sharding options (sequence_parallel, sequence_overlap, fused_norm, flash_attention,
--- tensor_parallel, probe, policy_timeout: see partrain.policy) and the data-parallel ones
--- (bucket_cap_mb, reduce ("mean", "sum", "min", "max"), grad_accumulation, broadcast_buffers).
--- All or nothing: when anything is refused, the model is left exactly as it was.
-- The engine's pipeline description (engine/parallel/pipeline.hpp) from the policy's `pipeline`
-- table and parallelize's schedule, microbatches, chunks and balance options; nil when the mesh
-- has no pipeline (where those options are refused).
local function pipeline_description(model, policy, mesh, opts)
  local pp = mesh:size("pipeline")
  if pp == 1 then
    local k = next(opts)
    if k then error(("parallelize option '%s' needs a mesh with pipeline > 1"):format(k), 0) end
    return nil
  end
  local stages = type(policy) == "table" and policy.pipeline
  if not stages then
    if policy == nil then
      error(("pipeline=%d: no policy with a pipeline description is registered for %s: pass one with pipeline = "
        .. "{ blocks, first, last }"):format(pp, model:type()), 0)
    end
    error(("pipeline=%d: the policy for %s has no pipeline description (blocks, first, last)"):format(pp, model:type()), 0)
  end
  local schedule = opts.schedule or "1f1b"
  if type(schedule) ~= "string" and type(schedule) ~= "function" then
    error("parallelize: schedule must be a schedule's name or function, got " .. type(schedule), 0)
  end
  local function count(name, v, default)
    v = v == nil and default or v
    if type(v) ~= "number" or v < 1 or v ~= math.floor(v) then
      error(("parallelize: %s must be a positive integer, got %s"):format(name, tostring(v)), 0)
    end
    return v
  end
  local microbatches = count("microbatches", opts.microbatches, pp)
  local chunks = count("chunks", opts.chunks, 1)
  local balance, sizes = opts.balance or "uniform", nil
  if type(balance) == "table" then
    balance, sizes = "explicit", balance
    for i, v in pairs(sizes) do
      if type(i) ~= "number" or i < 1 or i > #sizes or i ~= math.floor(i) then
        error(("parallelize: balance must be a list of blocks a stage, got a table with key %s"):format(tostring(i)), 0)
      elseif type(v) ~= "number" or v < 1 or v ~= math.floor(v) or v > 2 ^ 31 then
        error(("parallelize: balance[%d] (the blocks of stage %d) must be a positive integer, got %s"):format(i, i - 1,
          tostring(v)), 0)
      end
    end
  elseif balance ~= "uniform" and balance ~= "parameters" and balance ~= "time" then
    error(("parallelize: balance must be 'uniform', 'parameters', 'time' or a list of blocks a stage, got %s"):format(tostring(balance)), 0)
  end
  local sample = opts.sample
  if balance == "time" and not pt.is_tensor(sample) then
    error(("parallelize: balance = 'time' times the blocks on a sample input: give sample = one step's input batch, got %s"):format(type(sample)), 0)
  elseif balance ~= "time" and sample ~= nil then
    error("parallelize: sample is what balance = 'time' times the blocks on; balance is " .. tostring(opts.balance or "uniform"), 0)
  end
  -- What the split would refuse, before the schedule is built and checked (seconds for a long one).
  local blocks, stage_count = model:get(stages.blocks), pp * chunks
  local n = blocks and #blocks:children()
  if sizes and #sizes ~= stage_count then
    error(("pipeline: explicit balance gives %d stage sizes for %d stages (pipeline=%d x chunks=%d)"):format(#sizes,
      stage_count, pp, chunks), 0)
  elseif n and n < stage_count then
    error(("pipeline: %d %s cannot fill %d stages (pipeline=%d x chunks=%d; each stage needs at least one of %s's blocks)")
      :format(n, n == 1 and "block" or "blocks", stage_count, pp, chunks, stages.blocks), 0)
  end
  local pipeline = require "partrain.pipeline"
  local plan, report = pipeline.build(schedule, pp, microbatches, chunks, opts.schedule_timeout)
  local flat, peaks = {}, {}
  for r = 0, pp - 1 do
    peaks[r + 1] = report.ranks[r].peak
    local list = {}
    for _, a in ipairs(plan[r]) do
      list[#list + 1] = a.op; list[#list + 1] = a.mb; list[#list + 1] = a.chunk; list[#list + 1] = a.peer or -1
    end
    flat[r + 1] = list
  end
  return { blocks = stages.blocks, first = stages.first or {}, last = stages.last or {}, balance = balance,
           sizes = sizes, schedule = plan.name or tostring(schedule), layout = plan.layout, chunks = chunks,
           microbatches = microbatches, plan = flat, bubble = report.bubble, peaks = peaks, sample = sample }
end

function pt.parallelize(model, policy, mesh, opts)
  if not core.nn.is_module(model) then raise("parallelize: argument #1 must be a module, got " .. type(model), 2) end
  if getmetatable(mesh) ~= debug.getregistry()["partrain.Mesh"] then
    raise("parallelize: bad argument #3 (mesh expected, got " .. type(mesh) .. ")", 2)
  end
  if opts ~= nil and type(opts) ~= "table" then raise("parallelize: bad argument #4 (options table expected, got " .. type(opts) .. ")", 2) end
  local ok, err = pcall(function()
    local P = require "partrain.policy"
    local shard, dp, pipe = {}, {}, {}
    local pipeline_keys = { schedule = true, microbatches = true, chunks = true, balance = true, sample = true,
                            schedule_timeout = true }
    local recompute = (opts or {}).recompute
    if recompute ~= nil and recompute ~= false and recompute ~= "none" and recompute ~= "block" then
      error(("parallelize: recompute must be 'block' or 'none', got %s"):format(tostring(recompute)), 0)
    end
    for k, v in pairs(opts or {}) do
      if k == "recompute" then -- applied below, once the model is parallel
      elseif pipeline_keys[k] then pipe[k] = v
      elseif P.config_keys[k] ~= nil then shard[k] = v else dp[k] = v end
    end
    local tensor = mesh:size("tensor")
    if policy == nil and tensor > 1 then  -- at tensor 1 only a policy passed in is checked
      policy = P.registry[model:type()]
      if not policy then
        error(("no policy is registered for %s: pass one (see policies/ for examples)"):format(model:type()), 0)
      end
    end
    if type(policy) == "string" then
      local loaded, result = pcall(require, policy)
      if not loaded then error(tostring(result), 0) end
      policy = result
    end
    if policy ~= nil and type(policy) ~= "table" then error("parallelize: the policy must be a table, a module name or nil", 0) end
    local cfg = P.config(shard, 0)  -- rethrow below names the caller's line
    -- A pipeline without a policy passed in is cut as the model's registered policy describes
    -- (policies.md: nil selects it); at tensor 1 that policy is not applied.
    local describes = policy
    if describes == nil and mesh:size("pipeline") > 1 then
      describes = P.registry[model:type()]
      if type(describes) == "string" then describes = require(describes) end
    end
    local staged = pipeline_description(model, describes, mesh, pipe)
    -- The engine composes the parallelisms in its order (engine/parallel/parallel_model.cpp);
    -- tensor parallelism is this policy, applied by the sharder when the engine calls for it.
    -- (`undo` is kept only until the composer returns; the model is not kept anywhere by Lua:
    -- a global `_` here once held every parallelized model alive.)
    local undo
    local apply = policy and function() undo = select(2, P.apply(model, policy, mesh, cfg)) end
    local described, recompute_blocks  -- with recompute: the policy whose pipeline description names the blocks
    if recompute == "block" then
      described = policy or P.registry[model:type()]
      if type(described) == "string" then described = require(described) end
      -- Each block runs checkpointed: the blocks are the ones the policy's pipeline description names.
      local blocks = type(described) == "table" and described.pipeline and described.pipeline.blocks
      if not blocks then
        error(("parallelize: recompute = 'block' needs the blocks of %s: a policy with a pipeline description "
          .. "({ blocks = ... })"):format(model:type()), 0)
      end
      recompute_blocks = blocks
    end
    -- ZeRO-3 gathers a unit at a time: the policy's units, or else each of the blocks its
    -- pipeline description names (the engine falls back to the root's children without either).
    if type(dp.zero) == "table" and dp.zero.stage == 3 and dp.zero.units == nil and dp.zero.blocks == nil then
      local d = policy or P.registry[model:type()]
      if type(d) == "string" then d = require(d) end
      local units = type(d) == "table" and d.units
      local blocks = type(d) == "table" and d.pipeline and d.pipeline.blocks
      if units or blocks then
        local zero = {}
        for k, v in pairs(dp.zero) do zero[k] = v end
        if units then zero.units = units else zero.blocks = blocks end
        dp.zero = zero
      end
    end
    -- An optimizer made from the model before now would step the tensors it had then: tensor
    -- parallelism replaces them, and what the parallel model tells its optimizers (mixed
    -- precision's masters, loss scaling, the step on synced gradients) reaches only those made
    -- from it (tensor 2 x data 2 trained 4e-2 off serial training, exit 0).
    if core.optim.holding(model) then collectgarbage(); collectgarbage() end  -- one the script dropped
    local held = core.optim.holding(model)
    if held then
      error(("parallelize: an optimizer made before pt.parallelize steps the model's parameter '%s', and would go "
        .. "on stepping the tensors the model had then; make it from the parallelized model: opt = "
        .. "pt.optim.adamw(pt.parallelize(model, ...), ...)"):format(held), 0)
    end
    -- The options left for the engine are data parallelism's; it lists the ones taken here beside
    -- them when it meets one it does not know.
    local taken = { "recompute" }
    for k in pairs(pipeline_keys) do taken[#taken + 1] = k end
    for k in pairs(P.config_keys) do taken[#taken + 1] = k end
    table.sort(taken)
    local made, result = pcall(core.parallel.parallelize, model, mesh, policy and policy.name or nil, dp, apply, staged,
      taken, recompute_blocks)
    if not made then
      if undo then undo() end
      error(result, 0)
    end
  end)
  if not ok then rethrow(err, 2) end
  return model
end

--- What the model knows of its parallel form (nil on a model pt.parallelize did not make parallel):
--- model:mesh(), model:policy() (the applied policy's name), model:data_parallel() (the handle:
--- hooks, synced(), stats()), model:records() (a table a parameter: name, aliases, shape (logical),
--- local_shape, sharding, device, dtype, trainable, master_dtype: "float32" when the optimizer keeps a master).
function Module:mesh() return core.parallel.mesh(self) end
function Module:policy() return core.parallel.policy(self) end
function Module:data_parallel() return core.parallel.data_parallel(self) end
--- model:pipeline(): nil without pipeline parallelism, else this rank's part of it: { size, rank,
--- schedule, chunks, microbatches, blocks, first, last, bounds, balance, costs, stages }.
function Module:pipeline() return core.parallel.pipeline(self) end
function Module:records()
  need_module(self, "records", 2)
  local ok, records = pcall(core.parallel.records, self)
  if not ok then rethrow(records, 2) end
  return records
end
--- loss = model:train_step(x, y [, { loss = "cross_entropy" | "mse", accumulate = n, ignore_index }]):
--- forward, the model's loss (vocabulary-parallel when its head is split), backward and the
--- gradient sync, all in C++; accumulate = n splits the batch into n micro-batches (one sync, the
--- mean loss). The optimizer steps after: opt:step().
function Module:train_step(x, y, opts)
  need_module(self, "train_step", 2)
  local ok, loss = pcall(core.parallel.train_step, self, x, y, opts)
  if not ok then rethrow(loss, 2) end
  return loss
end

--- The mesh `model` was made parallel over (or nil).
function pt.mesh_of(model) return model and core.nn.is_module(model) and core.parallel.mesh(model) or nil end
--- The model pt.parallelize made last (while it lives), for the REPL's helpers.
function pt.parallelized() return core.parallel.last() end

-- Checkpoints -------------------------------------------------------------------------------
--- pt.ckpt: sharded checkpoints keyed by logical tensor (docs/checkpoints.md).
pt.ckpt = {}
local ckpt_keys = { model = true, optim = true, data = true, step = true, user = true, full = true,
                    num_kept = true, tag = true, mesh = true, overwrite = true }
local save_only = { "step", "user", "full", "num_kept", "tag", "overwrite" }

-- The targets table with the model's mesh and policy filled in, after checking its keys.
local function ckpt_state(fn, what, level)
  if type(what) ~= "table" then
    raise(("pt.ckpt.%s: a table { model = ..., optim = ..., data = ... } expected, got %s"):format(fn, type(what)), level + 1)
  end
  local t = {}
  for k, v in pairs(what) do
    if not ckpt_keys[k] then
      raise(("pt.ckpt.%s: unknown key %s (expected model, optim, data, mesh, step, user, full, num_kept, tag, "
        .. "overwrite)"):format(fn, core._key_text(k)), level + 1)
    end
    t[k] = v
  end
  if not core.nn.is_module(t.model) then raise(("pt.ckpt.%s: 'model' must be a module"):format(fn), level + 1) end
  t.mesh = t.mesh or core.parallel.mesh(t.model)
  return t
end

local function ckpt_call(level, fn, ...)
  local ok, result, more = pcall(fn, ...)
  if not ok then rethrow(result, level + 1) end
  return result, more
end

-- Says on stderr (rank 0 only: every rank reaches the same notes) what a save or load did
-- besides its job: the checkpoint it fell back to and why, a damaged tag it set aside. The
-- caller's file:line comes first, `level` frames above this function's caller.
local function ckpt_notes(level, fn, notes)
  if not notes or #notes == 0 or core.dist.rank() ~= 0 then return end
  local info = debug.getinfo(level + 1, "Sl")
  local where = info and info.currentline and info.currentline > 0 and (info.short_src .. ":" .. info.currentline .. ": ") or ""
  for _, note in ipairs(notes) do io.stderr:write(where, "pt.ckpt.", fn, ": ", note, "\n") end
  io.stderr:flush()
end

--- pt.ckpt.save(dir, { model, optim, data, step, user, full, num_kept, tag, overwrite }) -> tag.
--- Every rank calls it; each writes its own shards (full = true: rank 0 writes every tensor
--- whole). A valid checkpoint already under the tag is refused unless overwrite = true.
function pt.ckpt.save(dir, what)
  if type(dir) ~= "string" then raise("pt.ckpt.save: bad argument #1 (folder name expected)", 2) end
  local t = ckpt_state("save", what, 2)
  t.policy = core.parallel.policy(t.model)
  -- The script's resolved options (pt.args) go with it, as user.config, unless the user table has its own.
  local resolved = pt.args.resolved
  if resolved and (t.user == nil or (type(t.user) == "table" and t.user.config == nil)) then
    local user = { config = resolved }
    for k, v in pairs(t.user or {}) do user[k] = v end
    t.user = user
  end
  -- A plan runs on shapes alone (meta tensors hold no values) and leaves the user's files as they are.
  if core.plan.planning() then return nil end
  local tag, notes = ckpt_call(2, core.ckpt.save, dir, t)  -- not a tail call: error levels count this frame
  ckpt_notes(2, "save", notes)
  return tag
end

-- The load behind pt.ckpt.load and resume; errors point `level` frames above its caller.
local function load_at(level, fn, dir, tag, what)
  if type(dir) ~= "string" then raise(("pt.ckpt.%s: bad argument #1 (folder name expected)"):format(fn), level + 1) end
  if tag ~= nil and type(tag) ~= "string" then raise("pt.ckpt.load: bad argument #2 (tag string expected)", level + 1) end
  local t = ckpt_state(fn, what, level + 1)
  for _, k in ipairs(save_only) do
    if t[k] ~= nil then raise(("pt.ckpt.%s: '%s' is a key of save, not of %s (it takes model, optim, data; "
      .. "the tag is argument #2 of load)"):format(fn, k, fn), level + 1) end
  end
  local loaded
  if fn == "resume" then loaded = ckpt_call(level + 1, core.ckpt.resume, dir, t)
  else loaded = ckpt_call(level + 1, core.ckpt.load, dir, tag, t) end
  if loaded then ckpt_notes(level + 1, fn, loaded.notes) end
  return loaded
end

--- pt.ckpt.load(dir, [tag,] { model, optim, data }) -> { tag, step, user, notes }: loads tag
--- (default: the valid checkpoint with the highest step, see resume) into the model, optimizer
--- and data loader, whatever layout saved it.
function pt.ckpt.load(dir, tag, what)
  if what == nil and type(tag) == "table" then tag, what = nil, tag end
  if core.plan.planning() then return nil end  -- as resume: a load changes no layout
  local loaded = load_at(2, "load", dir, tag, what)  -- not tail calls: error levels count these frames
  return loaded
end

--- pt.ckpt.resume(dir, { model, optim, data }) -> { tag, step, user, notes } from the newest
--- valid checkpoint in dir (falling back past damaged ones, saying so on stderr), or nil when
--- dir holds no checkpoint at all (a fresh start) or under `partrain plan`.
function pt.ckpt.resume(dir, what)
  if type(dir) ~= "string" then raise("pt.ckpt.resume: bad argument #1 (folder name expected)", 2) end
  -- A plan describes the layout, which a resume does not change: no need to read the files.
  if core.plan.planning() then return nil end
  local loaded = load_at(2, "resume", dir, nil, what)
  -- After a launcher restart (--max-restarts), say where the run picked up.
  local restart = pt.dist.restart_count()
  if restart > 0 and pt.dist.rank() == 0 then
    io.stderr:write(loaded and ("partrain: restart %d: resumed from %s/%s at step %d\n"):format(restart, dir, loaded.tag, loaded.step)
      or ("partrain: restart %d: no checkpoint in %s yet: starting over\n"):format(restart, dir))
  end
  return loaded
end

pt.ckpt.newest = core.ckpt.newest
pt.ckpt.tags = core.ckpt.tags
--- pt.ckpt.verify(path) -> ok, problems: a tag folder, or a checkpoint folder whole (every tag,
--- newest), as `partrain ckpt verify` checks it; problems are "path: what" strings.
function pt.ckpt.verify(path)
  if type(path) ~= "string" then raise("pt.ckpt.verify: bad argument #1 (folder name expected)", 2) end
  local ok, problems = ckpt_call(2, core.ckpt.verify, path)
  return ok, problems
end
--- pt.ckpt.export_safetensors(model, path [, { max_shard_size = MB }]) / import_safetensors(model,
--- path): logical weights to and from a .safetensors file, in Hugging Face's names and layout for
--- GPT-2 and LLaMA. With max_shard_size, path is a folder that gets Hugging Face's sharded layout
--- (model-0000N-of-0000M.safetensors and model.safetensors.index.json); an import reads either: a
--- file, an index, or a folder holding one of them.
function pt.ckpt.export_safetensors(model, path, opts)
  ckpt_call(2, core.ckpt.export_safetensors, model, path, opts)
end
function pt.ckpt.import_safetensors(model, path)
  ckpt_call(2, core.ckpt.import_safetensors, model, path)
end

-- Memory and plans ---------------------------------------------------------------------------
--- pt.memory(): { allocated, allocated_peak } bytes LibTorch's tensors hold on the CPU now and at
--- the peak (since pt.reset_peak_memory()), and { resident, resident_peak } of the process.
pt.memory = core.memory
pt.reset_peak_memory = core.reset_peak
--- This rank's model-state bytes, measured from the tensors (each storage once): { params,
--- grads, scratch, optimizer, master, zero_stage, zero_group } of `model` (a tied parameter once)
--- and its optimizers (made with pt.optim.*(model)), plus pt.memory()'s fields. grads counts data
--- parallelism's flat buffers (under ZeRO-2 its shard, buckets reduced whole and the scratch pool,
--- whose part is scratch) and the masters' float32 gradients; optimizer the moments; master the
--- float32 master weights (under ZeRO this rank's shard). Under ZeRO-3 params is what exists now:
--- param_shard (this rank's shards and any parameter kept whole) plus gathered (the units gathered
--- now); peak_gathered is the most gathered at once so far, largest_unit and root_unit a unit's
--- gathered bytes (all 0 below stage 3); master leaves out float32 masters that are the shards;
--- pooled counts, on the CPU, the freed gather buffers kept for the next gathers (beside params).
function pt.memory_report(model)
  if not core.nn.is_module(model) then raise("pt.memory_report: a module expected, got " .. type(model), 2) end
  local r = pt.memory()
  for k, v in pairs(core.plan.held(model, pt.optim.of(model))) do r[k] = v end
  return r
end
--- pt.plan.planning(): whether this script runs under `partrain plan`. pt.plan.first_step():
--- { begun, forward_done, activations } of the first training step (activations: the bytes its
--- forward left allocated, measured at its backward).
pt.plan = { planning = core.plan.planning, first_step = core.plan.first_step }

--- Opens the REPL on every rank at this point of the script (rank 0 reads; every rank runs what
--- it reads; see docs/repl.md). The caller's locals are visible (read-only) beside the globals;
--- exit() or Ctrl-D continues the script. Where it cannot stop (several ranks without -i, under
--- partrain plan, a terminal it may not read) rank 0 says so on stderr, once a line, and the
--- script goes on.
local breakpoints_skipped = {}
function pt.breakpoint()
  local info = debug.getinfo(2, "Sl")
  local at = info and (info.short_src .. ":" .. (info.currentline or 0)) or "?"
  local function skipped(why)
    if why and pt.dist.rank() == 0 and not breakpoints_skipped[at] then
      breakpoints_skipped[at] = true
      io.stderr:write(("pt.breakpoint() at %s skipped: %s\n"):format(at, why))
      io.stderr:flush()
    end
  end
  local why = core.repl_breakpoint_problem()
  if why then return skipped(why) end
  local locals, i = {}, 1
  while true do
    local name, value = debug.getlocal(2, i)
    if not name then break end
    if name:sub(1, 1) ~= "(" then locals[name] = value end
    i = i + 1
  end
  local repl = require "partrain.repl"
  skipped(repl.loop(repl.layered(locals, _G), "breakpoint at " .. at .. " (exit() or Ctrl-D continues)"))
end

-- Split parameters are known by their name in the model: the layer holding one says how it is
-- split (a tensor alone does not know).
local function check_name(fn, model, name, level)
  if not core.nn.is_module(model) then
    raise(("pt.tp.%s: a module expected as argument #1, got %s (pass the model and the parameter's name: "
      .. "pt.tp.%s(model, \"h.0.attn.c_attn.weight\"))"):format(fn, type(model), fn), level + 1)
  end
  if type(name) ~= "string" then
    raise(("pt.tp.%s: bad argument #2 (a parameter's dotted name expected, got %s)"):format(fn, type(name)), level + 1)
  end
end

--- pt.tp.sharding(model, name): nil for a whole parameter, else { dim, shape, local_shape, parts,
--- fused (when the parts are equal), padded, group, slices = { [group rank + 1] = { {start, length}, ... } } }.
function pt.tp.sharding(model, name)
  check_name("sharding", model, name, 2)
  local ok, s = pcall(core.parallel.sharding, model, name)
  if not ok then rethrow(s, 2) end
  return s
end
--- pt.tp.is_sharded(model, name): whether that parameter is split across a tensor group.
function pt.tp.is_sharded(model, name)
  check_name("is_sharded", model, name, 2)
  local ok, s = pcall(core.parallel.sharding, model, name)
  if not ok then rethrow(s, 2) end
  return s ~= nil
end

--- Every parameter of `model` and how it is laid out over the ranks, in registration order
--- (a tied parameter under each of its names): { name, shape (logical), local_shape, dim (the split dimension, or
--- nil when whole), parts, fused, slices = { [group rank + 1] = { {start, length}, ... } }, ranks (the
--- tensor group's global ranks, or nil), bytes (this rank's) }.
function pt.tp.shards(model)
  if not core.nn.is_module(model) then raise("pt.tp.shards: a module expected, got " .. type(model), 2) end
  local rows = {}
  for name, p in model:named_parameters() do
    local s = core.parallel.sharding(model, name)
    rows[#rows + 1] = {
      name = name, shape = s and s.shape or p.shape, local_shape = p.shape, dim = s and s.dim,
      parts = s and s.parts, fused = s and s.fused or 1, slices = s and s.slices, ranks = s and s.group:ranks(),
      bytes = p:numel() * p:element_size(),
    }
  end
  return rows
end

--- pt.tp.gather(model, name [, t]): the logical (global) tensor of the split parameter `name`, or
--- of `t` laid out like it (its gradient, say), gathered over its tensor group: a collective.
--- Whole tensors come back as they are.
function pt.tp.gather(model, name, t)
  check_name("gather", model, name, 2)
  local done, full = pcall(core.parallel.gather, model, name, t)
  if not done then rethrow(full, 2) end
  return full
end

--- The loss to use with `model`'s logits: cross-entropy, computed from vocabulary-split logits
--- without gathering them when a policy split the output head. loss(logits, targets [, { ignore_index }]).
function pt.loss_fn(model)
  if not core.nn.is_module(model) then raise("pt.loss_fn: a module expected, got " .. type(model), 2) end
  local split = core.parallel.vocab_head(model)   -- found in the tree: { group, vocab, path } or nil
  if not split then
    return function(logits, targets, opts)
      local ok, loss = pcall(core.nn.cross_entropy, logits, targets, opts)
      if not ok then rethrow(loss, 2) end
      return loss
    end
  end
  return function(logits, targets, opts)
    -- The logits must be (a view of) the vocabulary head's output: anything else (the head was
    -- not the model's last layer, or they were gathered) would be read as split when it is not.
    if pt.is_tensor(logits) and not core.plan.planning() and not core.tp.split_logits(logits) then
      raise(("pt.loss_fn(model): these logits (%s) are not the split output of %s's vocabulary head (%s): "
        .. "is it the model's output layer? Whole logits take pt.nn.cross_entropy"):format(
        table.concat(logits.shape, "x"), model:type(), split.path), 2)
    end
    local ok, loss = pcall(core.tp.cross_entropy, logits, targets, split.group, split.vocab, opts)
    if not ok then rethrow(loss, 2) end
    return loss
  end
end

--- pt.evaluate(model, loader [, { batches, loss }]) -> the mean loss over the first `batches`
--- batches of the loader's epoch 0 (default: all of them), in eval mode without gradients, averaged
--- over the data-parallel ranks (each reads its slice): a validation loss. `loss` defaults to
--- pt.loss_fn(model). The model's mode and the loader's position are restored.
function pt.evaluate(model, loader, opts)
  if not core.nn.is_module(model) then raise("pt.evaluate: a module expected, got " .. type(model), 2) end
  if type(loader) ~= "userdata" or not pcall(function() return loader.batches_per_epoch end) then
    raise("pt.evaluate: argument #2 must be a loader (pt.data.text, pt.data.tokens, ...), got " .. type(loader), 2)
  end
  opts = opts or {}
  if type(opts) ~= "table" then raise("pt.evaluate: options must be a table, got " .. type(opts), 2) end
  for k in pairs(opts) do
    if k ~= "batches" and k ~= "loss" then raise(("pt.evaluate has no option %s (options: batches, loss)"):format(core._key_text(k)), 2) end
  end
  if model:pipeline() then raise("pt.evaluate: a pipelined model runs only through model:train_step", 2) end
  local available = loader:batches_per_epoch()
  local batches = opts.batches or available
  if type(batches) ~= "number" or batches < 1 or batches % 1 ~= 0 or batches > available then
    raise(("pt.evaluate: batches must be a whole number from 1 to %d (the loader's epoch), got %s"):format(available,
      tostring(batches)), 2)
  end
  if opts.loss ~= nil and not callable(opts.loss) then
    raise("pt.evaluate: loss must be a function (output, target) -> loss tensor, such as pt.nn.mse, got "
      .. type(opts.loss) .. (type(opts.loss) == "string" and " (train_step's loss names are not taken here)" or ""), 2)
  end
  local loss_of = opts.loss or pt.loss_fn(model)
  -- Put back exactly: at an epoch's end seek(samples_seen()) would begin the next epoch, and a
  -- `for x, y in loader:batches()` loop around this call would never end.
  local epoch, position = loader:epoch(), loader:position()
  local training = model:is_training()
  model:eval()
  loader:start_epoch(0)
  local ok, total = pcall(pt.no_grad, function()
    local sum = 0
    for _ = 1, batches do
      local x, y = loader:next()
      sum = sum + loss_of(model(x), y):item()
    end
    return sum / batches
  end)
  model:train(training)
  loader:_place(epoch, position)
  if not ok then rethrow(total, 2) end
  local mesh = pt.mesh_of(model)
  if mesh and mesh:size("data_context") > 1 then  -- each rank's batches, and its chunks of them
    local t = pt.tensor({ total }, { dtype = "float64" })
    mesh:group("data_context"):all_reduce(t, "mean")
    total = t:item()
  end
  return total
end

--- The data-parallel handle of a model made parallel by pt.parallelize (or nil): hooks,
--- synced(), stats(). The same as model:data_parallel().
function pt.data_parallel(model)
  if not core.nn.is_module(model) then raise("pt.data_parallel: a module expected, got " .. type(model), 2) end
  return core.parallel.data_parallel(model)
end

-- Scripts -----------------------------------------------------------------------------------
pt.args = require "partrain.args"

--- pt.metrics(path): the file rank 0 appends the run's records to (docs/observability.md);
--- `partrain --metrics FILE` (PARTRAIN_METRICS) chooses it for every rank without a line of Lua.
pt.metrics = require "partrain.metrics"
local live = require "partrain.live"   -- the in-place progress line, which other output goes around

--- Prints one line of metrics on rank 0: pt.log { step = 3, loss = 0.25 } -> "step 3 | loss 0.25",
--- and, with a step and a metrics file, appends { step, time, loss, ... } to the file.
--- opts.rank: which rank prints (a rank number, or "all"; default 0). Every call with a step is
--- a record of rank 0's, whichever rank prints.
function pt.log(fields, opts)
  if type(fields) ~= "table" then raise("pt.log expects a table of fields, got " .. type(fields), 2) end
  local who = 0
  if opts ~= nil then
    if type(opts) ~= "table" then raise("pt.log: options must be a table ({ rank = 0 | N | \"all\" }), got " .. type(opts), 2) end
    for k in pairs(opts) do
      if k ~= "rank" then raise(("pt.log has no option %s (options: rank)"):format(core._key_text(k)), 2) end
    end
    if opts.rank ~= nil then who = opts.rank end
    local world = pt.dist.world_size()
    if who ~= "all" and (type(who) ~= "number" or who % 1 ~= 0 or who < 0 or who >= world) then
      raise(("pt.log: rank must be a rank from 0 to %d or \"all\", got %s"):format(world - 1,
        type(who) == "string" and "'" .. who .. "'" or tostring(who)), 2)
    end
  end
  pt.metrics._check_step(fields.step, "pt.log", 2)  -- before anything is printed
  local values, keys = {}, {}
  for k, v in pairs(fields) do
    if type(k) ~= "string" then raise("pt.log: field names must be strings, got " .. type(k), 2) end
    if pt.is_tensor(v) then
      if v:numel() ~= 1 then raise(("pt.log: field '%s' is a tensor of %d elements; one expected"):format(k, v:numel()), 2) end
      v = v:item()
    end
    local t = type(v)
    if t ~= "number" and t ~= "string" and t ~= "boolean" then  -- had been printed as its address
      raise(("pt.log: field %s is a %s; numbers, strings, booleans and one-element tensors are logged"):format(
        core._key_text(k), t), 2)
    end
    values[k] = v
    if k ~= "step" and k ~= "epoch" then keys[#keys + 1] = k end
  end
  if who == "all" or who == pt.dist.rank() then
    table.sort(keys)
    if fields.step ~= nil then table.insert(keys, 1, "step") end
    if fields.epoch ~= nil then table.insert(keys, 1, "epoch") end
    local parts = {}
    for _, k in ipairs(keys) do
      local v = values[k]
      if type(v) == "number" and v ~= math.floor(v) then
        -- Seven significant digits: enough to compare runs (a sharded run against a serial one).
        v = string.format(math.abs(v) < 1e-3 and "%.6e" or "%.7g", v)
      end
      parts[#parts + 1] = k .. " " .. tostring(v)
    end
    live.around(function()
      io.write(table.concat(parts, " | "), "\n")
      io.flush()
    end)
  end
  if values.step ~= nil then
    local ok, err = pcall(pt.metrics.write, values)
    if not ok then rethrow(err, 2) end
  end
end

local progress = require "partrain.progress"
--- pt.progress { total, tokens, flops_per_token, peak_tflops, every, seconds, enabled, memory }:
--- a loop's progress: progress:step(step, { loss = ..., lr = ... }) every step on every rank
--- (a live line on rank 0's terminal, pt.log lines and metrics records with tokens/s, TFLOP/s,
--- MFU and memory), progress:finish() after the loop. docs/observability.md.
function pt.progress(opts)
  local p = progress.new(opts, 2)   -- not a tail call: error levels count this frame
  return p
end
--- pt.flops_per_token(model_or_options, seq) -> FLOPs, N: a GPT-2 or LLaMA's training FLOPs a
--- token (6·N + 12·layers·dim·seq), the whole model's. docs/observability.md.
function pt.flops_per_token(what, seq)
  local flops, n = progress.flops_per_token(what, seq, 2)
  return flops, n
end

pt.time = core.now            -- wall-clock seconds (monotonic)
pt.cpu_time = core.cpu_time   -- CPU seconds used by this process

return pt
