-- The layouts partrain plan --auto weighs: the layout flags (pt.args names), the ones the user
-- gave, every (tensor, context, pipeline and schedule, expert) a world allows, the ZeRO and
-- recompute tiers, and the ranks planned for each. docs/plan.md, "Automatic layouts".
local M = {}

--- The layout flags the search varies (pt.args names), in the order they are printed.
M.FLAGS = { "tensor", "sequence_parallel", "context", "context_mode", "pipeline", "schedule", "chunks",
            "microbatches", "expert", "zero_stage", "zero_groups", "recompute" }
local IS_FLAG = {}
for _, name in ipairs(M.FLAGS) do IS_FLAG[name] = true end

-- ---- The user's flags ------------------------------------------------------------------------

--- M.given(args, declared): the layout flags (pt.args names) the user's arguments name, as a set:
--- those stay as given. Reads pt.args's syntax: --name value, --name=value, --no-name and a bare
--- boolean --name.
function M.given(args, declared)
  local given, i = {}, 1
  while i <= #args do
    local word = args[i]
    local name, value = word:match("^%-%-([^=]+)=(.*)$")
    name = name or word:match("^%-%-(.+)$")
    if name then
      local key = name:gsub("%-", "_")
      if declared[key] == nil and key:sub(1, 3) == "no_" and declared[key:sub(4)] == "boolean" and value == nil then
        key, value = key:sub(4), "false"
      end
      local kind = declared[key]
      if value == nil and kind == "boolean" then
        local nextword = args[i + 1] and args[i + 1]:lower()
        if nextword == "true" or nextword == "false" then i = i + 1 end
      elseif value == nil and (kind ~= nil or key == "config") then
        i = i + 1  -- its value
      end
      if kind ~= nil and IS_FLAG[key] then given[key] = true end
    end
    i = i + 1
  end
  return given
end

--- M.flag_words(values, names): the command-line words of `values` for `names` (pt.args names):
--- { "--tensor", "2", "--sequence-parallel", "--no-...", ... }.
function M.flag_words(values, names)
  local words = {}
  for _, name in ipairs(names) do
    local v = values[name]
    local flag = "--" .. name:gsub("_", "-")
    if v == true then words[#words + 1] = flag
    elseif v == false then words[#words + 1] = "--no-" .. name:gsub("_", "-")
    elseif v ~= nil then words[#words + 1] = flag; words[#words + 1] = tostring(v) end
  end
  return words
end

-- ---- The space -------------------------------------------------------------------------------

local function powers_of_two(most)
  local t, x = {}, 1
  while x <= most do t[#t + 1] = x; x = x * 2 end
  return t
end

local function divisors(n, most)
  local t = {}
  for d = 1, math.min(n, most) do if n % d == 0 then t[#t + 1] = d end end
  return t
end

-- The chunk count each shipped schedule runs by default.
local SCHEDULE_CHUNKS = { gpipe = 1, ["1f1b"] = 1, zbh1 = 1, zbh2 = 1, interleaved = 2, zbv = 2 }

--- M.space { world, nproc, options, declared, fixed }: the layouts to weigh, as groups: { tensor,
--- sequence_parallel, context, context_mode, pipeline, chunks, data, expert, variants = {
--- { schedule, microbatches }... } }. A group's variants share one reference plan a tier.
--- `options` are the script's values (layers, batch, seq, heads, experts: each rule applies only
--- when the script has the option), `declared` its pt.args kinds (only declared flags vary),
--- `fixed` the values the user gave (kept as given). Rules:
---   tensor: powers of two up to min(nproc, 8) dividing the world and the heads (the policies'
---     rule: a tensor rank takes heads / tensor whole heads); sequence_parallel = (tensor > 1);
---   context: 1, 2, 4, 8 with seq % (2 context) == 0; context_mode: ring, and all_to_all when
---     context > 1;
---   pipeline: divisors of world / (tensor x context) up to 16 and up to layers; data is the rest;
---   expert (when experts > 0): powers of two dividing data and experts;
---   schedules when pipeline > 1: 1f1b and zbh1 (1 chunk), interleaved and zbv (2 chunks, when
---     2 x pipeline <= layers). gpipe is left out: 1F1B runs the same step in the same time
---     holding fewer micro-batches. micro-batches: p, 2p, 4p with batch % (data x m) == 0
---     (without a pipeline: batch % data == 0).
function M.space(s)
  local world, nproc, o, declared, fixed = s.world, s.nproc, s.options or {}, s.declared or {}, s.fixed or {}
  local function pick(name, generated, default)
    if fixed[name] ~= nil then return { fixed[name] } end
    if declared[name] == nil then return { default } end
    return generated
  end
  local function modes(c)
    if fixed.context_mode ~= nil then return (c > 1 or fixed.context_mode == "ring") and { fixed.context_mode } or {} end
    if declared.context_mode == nil or c == 1 then return { false } end
    return { "ring", "all_to_all" }
  end
  local function experts(d)
    if fixed.expert ~= nil then return d % fixed.expert == 0 and { fixed.expert } or {} end
    if declared.expert == nil or (o.experts or 0) <= 0 then return { false } end
    local t = {}
    for _, e in ipairs(powers_of_two(d)) do if d % e == 0 and o.experts % e == 0 then t[#t + 1] = e end end
    return t
  end
  local groups = {}
  for _, t in ipairs(pick("tensor", powers_of_two(math.min(nproc, 8)), 1)) do
    if world % t == 0 and (fixed.tensor or not o.heads or o.heads % t == 0) then
      for _, c in ipairs(pick("context", { 1, 2, 4, 8 }, 1)) do
        if world % (t * c) == 0 and (not o.seq or o.seq % (2 * c) == 0) then
          local most = math.min(16, o.layers or 16)
          for _, p in ipairs(pick("pipeline", divisors(world / (t * c), most), 1)) do
            local d = world / (t * c * p)
            if d % 1 == 0 then
              for _, mode in ipairs(modes(c)) do
                for _, e in ipairs(experts(d)) do
                  for _, v in ipairs(M.variants(p, d, s)) do
                    groups[#groups + 1] = { tensor = t, context = c, context_mode = mode or nil, pipeline = p, data = d,
                                            expert = e or nil, chunks = v.chunks,
                                            sequence_parallel = pick("sequence_parallel", { t > 1 }, nil)[1],
                                            variants = v.variants }
                  end
                end
              end
            end
          end
        end
      end
    end
  end
  return groups
end

--- M.variants(p, d, s): a pipeline's schedule variants at data d, by chunk count: { { chunks,
--- variants = { { schedule, microbatches }... } }... } (one class of one empty variant without a
--- pipeline). nil fields are the script's own (a flag it does not declare).
function M.variants(p, d, s)
  local o, declared, fixed = s.options or {}, s.declared or {}, s.fixed or {}
  local function splits(m) return not o.batch or o.batch % (d * m) == 0 end
  if p == 1 then return splits(1) and { { variants = { {} } } } or {} end
  local classes
  if fixed.chunks ~= nil then classes = { fixed.chunks }
  elseif fixed.schedule ~= nil then classes = { SCHEDULE_CHUNKS[fixed.schedule] or 1 }
  elseif declared.chunks == nil or declared.schedule == nil then classes = { false }
  else
    classes = { 1 }
    if not o.layers or 2 * p <= o.layers then classes[2] = 2 end
  end
  local ms
  if fixed.microbatches ~= nil then ms = { fixed.microbatches }
  elseif declared.microbatches == nil then ms = { false }
  else ms = { p, 2 * p, 4 * p } end
  local out = {}
  for _, chunks in ipairs(classes) do
    local schedules
    if fixed.schedule ~= nil then schedules = { fixed.schedule }
    elseif declared.schedule == nil then schedules = { false }
    elseif (chunks or 1) == 1 then schedules = { "1f1b", "zbh1" }
    elseif chunks == 2 then schedules = { "interleaved", "zbv" }
    else schedules = { "interleaved" } end
    local variants = {}
    for _, schedule in ipairs(schedules) do
      for _, m in ipairs(ms) do
        if not m or splits(m) then variants[#variants + 1] = { schedule = schedule or nil, microbatches = m or nil } end
      end
    end
    if #variants > 0 then out[#out + 1] = { chunks = chunks or nil, variants = variants } end
  end
  return out
end

--- M.tiers(group, s): the ZeRO stages and recompute settings to try, in order: { recompute = {
--- "none", "block" }, stages = { 0, 1, 2, 3 }, groups = function(stage) -> { zero_groups... } }.
--- Stage 1 and up need two or more data x context ranks to shard over. zero_groups: 0 (one
--- group), and, when a stage's data x context ranks span more than one node, groups of one
--- node's worth of them (nproc / tensor ranks).
function M.tiers(group, s)
  local declared, fixed, nproc = s.declared or {}, s.fixed or {}, s.nproc
  local dc = group.data * group.context
  local stages
  if fixed.zero_stage ~= nil then stages = { fixed.zero_stage }
  elseif declared.zero_stage == nil then stages = { false }
  else
    stages = { 0 }
    if dc >= 2 and (fixed.zero_groups or 0) == 0 then stages = { 0, 1, 2, 3 }
    elseif dc >= 2 then stages = { 1, 2, 3 } end  -- zero_groups given: a stage of 1 or more
  end
  local recompute
  if fixed.recompute ~= nil then recompute = { fixed.recompute }
  elseif declared.recompute == nil then recompute = { false }
  else recompute = { "none", "block" } end
  local function groups(stage)
    if not stage or stage == 0 then return { false } end
    if fixed.zero_groups ~= nil then return { fixed.zero_groups } end
    if declared.zero_groups == nil then return { false } end
    local t = { 0 }
    local per_node = nproc % group.tensor == 0 and nproc / group.tensor or 0  -- a stage's data x context ranks a node
    if group.tensor * dc > nproc and per_node >= 2 and dc % per_node == 0 and dc / per_node >= 2 then
      t[2] = dc / per_node
    end
    return t
  end
  return { recompute = recompute, stages = stages, groups = groups }
end

--- Whether a reference plan plans only pipeline ranks 0, 1 and p-1 when it can (see
--- M.representatives; set it here, on partrain.auto.space). Off: the planner plans a pipeline
--- rank right only after its neighbours in the same call (planning ranks {0, 2, 6} of pipeline 4
--- at data 2 refuses rank 6 where {0, 2, 4, 6} plans it), so every pipeline rank is planned, in
--- order, in one call.
M.infer_middle = false

--- M.representatives(group [, reduced, layers]): the global ranks planned for a layout: for each
--- pipeline rank k, rank T·C·D·k (tensor, context and data coordinates 0; mesh order: rank =
--- tensor + T·(context + C·(data + D·pipeline))). `reduced` (with M.infer_middle), when the
--- blocks split evenly over the pipeline's virtual stages (layers % (p x chunks) == 0) and p >= 4:
--- ranks 0, 1 and p-1 only (the middle ranks hold the same as rank 1; M.figures infers them).
function M.representatives(group, reduced, layers)
  local stride, p = group.tensor * group.context * group.data, group.pipeline
  local ks = {}
  if reduced and M.infer_middle and p >= 4 and layers and layers % (p * (group.chunks or 1)) == 0 then ks = { 0, 1, p - 1 }
  else for k = 0, p - 1 do ks[#ks + 1] = k end end
  local ranks = {}
  for i, k in ipairs(ks) do ranks[i] = stride * k end
  return ranks
end

return M
