-- The search of partrain plan --auto: plans (through o.plan, each planned rank kept), the bounds
-- that skip pipelines that cannot win, a candidate a layout, its tiers planned or estimated, and
-- the exact plans of the best. docs/plan.md, "Automatic layouts".
local core = require "partrain.core"
local P = require "partrain.pipeline"
local A = require "partrain.pipeline.actions"
local S = require "partrain.auto.space"
local C = require "partrain.auto.cost"
local R = require "partrain.auto.report"

local M = {}

-- Plans `args` on `ranks` through o.plan, keeping each planned rank; a later call that lacks one
-- plans all it asks for again, in one call (the planner hands shapes from a pipeline rank to the
-- next within a call). Returns the plan's header and its ranks in the order asked, or nil and the
-- script's refusal.
local function plan_ranks(ctx, args, ranks)
  local key = table.concat(args, "\0")
  local entry = ctx.cache[key]
  if entry and entry.refused then return nil, entry.refused end
  local missing = {}
  for _, r in ipairs(ranks) do if not (entry and entry.ranks[r]) then missing = ranks; break end end
  if #missing > 0 then
    local started = core.now()
    local plan, refusal = ctx.o.plan(args, missing)
    ctx.stats.calls, ctx.stats.ranks = ctx.stats.calls + 1, ctx.stats.ranks + #missing
    if ctx.o.verbose then
      io.stderr:write(("partrain plan --auto: planned %d rank(s) of %s in %.2f s%s\n"):format(#missing,
        table.concat(args, " ", #ctx.o.args + 1), core.now() - started, plan and "" or ": refused"))
    end
    if not plan then
      ctx.cache[key] = { refused = tostring(refusal or "refused") }
      return nil, ctx.cache[key].refused
    end
    entry = entry or { header = plan, ranks = {} }
    for _, r in ipairs(plan.ranks) do entry.ranks[r.rank] = r end
    ctx.cache[key] = entry
  end
  local out = {}
  for i, r in ipairs(ranks) do out[i] = entry.ranks[r] end
  return entry.header, out
end

-- ---- The bound -----------------------------------------------------------------------------

-- The smallest bubble any of a pipelined group's variants has in unit time (F = B = W = 1,
-- transfers free), cached by (schedule, p, m, chunks).
local function least_bubble(ctx, group)
  local least = 1
  for _, v in ipairs(group.variants) do
    local key = ("%s/%d/%d/%d"):format(v.schedule or "?", group.pipeline, v.microbatches or group.pipeline, group.chunks or 1)
    if ctx.bubbles[key] == nil then
      local pp, m, chunks = group.pipeline, v.microbatches or group.pipeline, group.chunks or 1
      local made, report = pcall(function() return P.simulate(P.schedule(v.schedule or "1f1b", pp, m, chunks), pp, m, chunks) end)
      ctx.bubbles[key] = made and report.bubble or 0
    end
    least = math.min(least, ctx.bubbles[key])
  end
  return least
end

--- M.bound(compute, bubble): the least step a pipeline can take, from the average compute of a
--- rank (the step's FLOPs over the world, at the device's rate) and its least unit-time bubble:
--- the simulator's bubble is idle / (p x makespan), so makespan = average busy / (1 - bubble),
--- and measured costs (uneven stages, transfers) only add idle time to the unit-time schedule.
function M.bound(compute, bubble) return compute / (1 - bubble) end

-- The layout a pipelined group splits into stages: its tensor, context (and mode) and expert
-- sizes, which decide the FLOPs of a step.
local function split_key(group)
  return ("%d/%d/%s/%d"):format(group.tensor, group.context, group.context_mode or "", group.expert or 1)
end

-- Why a pipelined group need not be planned: a bound on its step is no faster than the fastest
-- layout planned exactly that fits (layouts without a pipeline come first, then pipelines from
-- the fewest stages), or nil. The bounds: the same layout without a pipeline's FLOPs over its
-- least unit-time bubble (M.bound), and the compute of its rank with the model's head
-- (M.head_bound), once a plan of 3 stages or more measured a block and the head.
local function bounded_out(ctx, group)
  -- (ranks that share cores fill a bubble with each other's work: neither bound holds)
  if group.pipeline == 1 or not ctx.best or C.shares_cores(ctx.device, ctx.nproc) then return nil end
  local key, why, least = split_key(group), nil, 0
  local flops = ctx.step_flops[key]
  if flops then
    local bubble = least_bubble(ctx, group)
    least = M.bound(flops / ctx.o.world / ctx.rate, bubble)
    why = ("a %.1f %% bubble at the least"):format(bubble * 100)
  end
  local stages, layers = ctx.stage_costs, ctx.options.layers
  if stages and layers then
    local chunks = group.chunks or 1
    local blocks = chunks * (stages.uniform and math.floor(layers / (group.pipeline * chunks)) or 1)
    local head = M.head_bound(stages, blocks, group.tensor * group.context * group.data)
    if head > least then least, why = head, ("its rank with the head computes it and %d blocks"):format(blocks) end
  end
  if not why or least < ctx.best.prediction.step then return nil end
  return ("cannot beat %s: at least %s (%s)"):format(R.seconds_text(ctx.best.prediction.step), R.seconds_text(least), why)
end

--- M.head_bound(stages, blocks, ranks): the least compute of the pipeline rank that holds the
--- model's last stage (its head: final norm, output layer, loss), with `blocks` blocks, when a
--- stage is split over `ranks` ranks (tensor x context x data). stages = { block, head }: a
--- block's and the head's seconds on one rank, a stage's ranks summed (each computes its share:
--- its tensor slice, its positions, its sequences). Under the uniform split into p x chunks
--- stages (the last stages get the fewer blocks) that rank holds at least chunks x floor(layers
--- / (p x chunks)) blocks; under any split, a block a stage.
function M.head_bound(stages, blocks, ranks) return (stages.head + blocks * stages.block) / ranks end

-- What a pipeline plan says of its stages' compute (M.head_bound's stages), from a rank that
-- holds neither the first nor the last stage (a block's seconds) and the rank that holds the last
-- (the rest of its compute is the head's). Kept the least seen over the plans.
local function note_stages(ctx, group, f)
  if f.pp < 3 then return end
  local first = A.place(f.pp, 0, f.layout)
  local last = A.place(f.pp, f.pp * f.chunks - 1, f.layout)
  local middle
  for k = 0, f.pp - 1 do if k ~= first and k ~= last and not middle then middle = k end end
  local m, l = f.ranks[middle], f.ranks[last]
  if not m or (m.blocks or 0) <= 0 or (m.flops or 0) <= 0 then return end
  local block = m.flops / ctx.rate / m.blocks
  local head = math.max(0, (l.flops or 0) / ctx.rate - (l.blocks or 0) * block)
  -- the uniform split's count on the head's rank, or another balance (fewer blocks by the head)
  local layers = ctx.options.layers
  local uniform = layers and l.blocks == f.chunks * math.floor(layers / (f.pp * f.chunks))
  local ranks, known = group.tensor * group.context * group.data, ctx.stage_costs
  ctx.stage_costs = { block = math.min(known and known.block or math.huge, block * ranks),
                      head = math.min(known and known.head or math.huge, head * ranks),
                      uniform = uniform and (not known or known.uniform) or false }
end

-- Notes what a planned candidate says of the search: the FLOPs of a step of a layout without a
-- pipeline (a rank's x the world: every rank does an equal share; without recompute), and the
-- fastest exact layout that fits.
local function note(ctx, cand)
  if not cand.prediction then return end
  local r = cand.group.pipeline == 1 and cand.planned and cand.planned[1]
  if r and (r.flops or 0) > 0 and (cand.tier.recompute or "none") == "none" then
    local key = split_key(cand.group)
    ctx.step_flops[key] = math.min(ctx.step_flops[key] or math.huge, r.flops * ctx.o.world)
  end
  if cand.exact and cand.fits and (not ctx.best or cand.prediction.step < ctx.best.prediction.step) then ctx.best = cand end
end

-- ---- Candidates ------------------------------------------------------------------------------

-- A candidate: a group's variant at a tier, with its values (pt.args names), the arguments it is
-- planned with (the user's, then every varied flag the script declares), its words and text.
local function candidate(ctx, group, tier, v)
  local l = { tensor = group.tensor, sequence_parallel = group.sequence_parallel, context = group.context,
              context_mode = group.context_mode, pipeline = group.pipeline, data = group.data,
              expert = group.expert, zero_stage = tier.zero_stage, zero_groups = tier.zero_groups,
              recompute = tier.recompute }
  if group.pipeline > 1 then l.schedule, l.chunks, l.microbatches = v.schedule, group.chunks, v.microbatches end
  if group.context == 1 then l.context_mode = nil end
  local values, varied = {}, {}
  for _, name in ipairs(S.FLAGS) do
    if ctx.declared[name] ~= nil then
      local value = ctx.fixed[name] ~= nil and ctx.fixed[name] or l[name]
      values[name] = value
      if ctx.fixed[name] == nil and l[name] ~= nil then varied[#varied + 1] = name end
    end
  end
  local args = {}
  for i, w in ipairs(ctx.o.args) do args[i] = w end
  for _, w in ipairs(S.flag_words(values, varied)) do args[#args + 1] = w end
  -- What the output shows: the varied flags whose value is not the script's own default.
  local shown = {}
  for _, name in ipairs(varied) do
    if values[name] ~= ctx.defaults[name] or ctx.always[name] then shown[#shown + 1] = name end
  end
  return { layout = l, values = values, args = args, flags = S.flag_words(values, shown), text = R.layout_text(l),
           group = group, variant = v, tier = tier }
end

local function env_of(ctx, tier)
  return { device = ctx.device, rate = ctx.rate, nproc = ctx.o.nproc, recompute = tier.recompute or "none" }
end

local function settle(ctx, cand, prediction, exact, from)
  cand.prediction, cand.exact, cand.from = prediction, exact, from
  cand.peak = prediction.peak
  cand.fits = cand.peak <= ctx.device.memory
end

-- A layout without a pipeline: its rank 0, planned, is its reference and exact.
local function evaluate_flat(ctx, cand)
  local header, ranks = plan_ranks(ctx, cand.args, { 0 })
  if not header then cand.refusal = ranks; return end
  cand.planned = ranks
  local r = C.rank_figures(ranks[1])
  local prediction = C.flat_prediction(r, env_of(ctx, cand.tier))
  settle(ctx, cand, prediction, true)
end

-- The order in which a group's variants are tried as its reference: a split-backward schedule
-- first (it measures what a micro-batch holds until its W), at 2p micro-batches, then the rest.
local PREFERRED = { zbh1 = 1, zbv = 1, ["1f1b"] = 2, interleaved = 2 }
local function reference_order(variants, p)
  local order = {}
  for i, v in ipairs(variants) do order[i] = v end
  local function rank(v)
    return (PREFERRED[v.schedule or ""] or 3) * 1e6 + (v.microbatches == 2 * p and 0 or 1) * 1e5 + (v.microbatches or 0)
  end
  table.sort(order, function(a, b) return rank(a) < rank(b) end)
  return order
end

-- A tier of a pipelined group: a reference plan, every variant predicted from it. A refusal
-- that names the reference's schedule ("schedule 'zbh1' splits backward ...") refuses that
-- schedule's variants, and the next schedule is tried; any other refuses them all.
local function evaluate_pipeline(ctx, group, variants, cands)
  local refused, whole, f, ref = {}, nil, nil, nil
  while not f and not whole do
    ref = nil
    for _, v in ipairs(reference_order(variants, group.pipeline)) do
      if not refused[v.schedule or ""] then ref = v; break end
    end
    if not ref then break end
    local ranks = S.representatives(group, true, ctx.options.layers)
    local header, planned = plan_ranks(ctx, cands[ref].args, ranks)
    if header and header.pipeline > 1 and planned[1].stage then
      local made, figured = pcall(C.figures, group, header, planned, env_of(ctx, cands[ref].tier))
      if not made then whole = "cannot simulate the planned schedule: " .. tostring(figured); break end
      f, cands[ref].planned = figured, planned
      if (cands[ref].tier.recompute or "none") == "none" then note_stages(ctx, group, f) end
    else
      local why = header and "the script planned no pipeline for --pipeline " .. group.pipeline or planned
      if ref.schedule and why:find("'" .. ref.schedule .. "'", 1, true) then refused[ref.schedule] = why
      else whole = why end
    end
  end
  for _, v in ipairs(variants) do
    local cand = cands[v]
    local why = refused[v.schedule or ""] or whole
    if why or not f then
      cand.refusal = why or "no schedule could be planned"
    else
      local made, prediction = pcall(C.pipeline_prediction, f, v, env_of(ctx, cand.tier))
      if not made then
        cand.refusal = tostring(prediction)  -- a schedule that refuses these sizes
      else
        local exact = v == ref and not f.inferred
        if exact then  -- the plan's own peaks, not the simulation's
          prediction.peak = 0
          for k = 0, f.pp - 1 do prediction.peak = math.max(prediction.peak, f.ranks[k].peak_bytes) end
        end
        settle(ctx, cand, prediction, exact, v ~= ref and cands[ref] or nil)
      end
    end
  end
end

-- Phase 2: a candidate planned with its own schedule and micro-batches on every representative
-- rank, and predicted again from that plan.
local function make_exact(ctx, cand)
  local group = cand.group
  local header, ranks = plan_ranks(ctx, cand.args, S.representatives(group))
  if not header then cand.refusal, cand.prediction, cand.fits = ranks, nil, nil; return end
  if group.pipeline == 1 or not ranks[1].stage then
    settle(ctx, cand, C.flat_prediction(C.rank_figures(ranks[1]), env_of(ctx, cand.tier)), true)
    return
  end
  local env = env_of(ctx, cand.tier)
  local made, prediction = pcall(function()
    return C.pipeline_prediction(C.figures(group, header, ranks, env), cand.variant, env)
  end)
  if not made then
    cand.refusal, cand.prediction, cand.fits = "cannot simulate the planned schedule: " .. tostring(prediction), nil, nil
    return
  end
  prediction.peak = 0
  for _, r in ipairs(ranks) do prediction.peak = math.max(prediction.peak, C.whole_peak(r)) end
  settle(ctx, cand, prediction, true)
end

--- M.rank(cands): the candidates that were not refused, ordered: those that fit by predicted step
--- (ties: the smaller peak), then those that do not by peak.
function M.rank(cands)
  local out = {}
  for _, c in ipairs(cands) do if c.prediction and not c.refusal then out[#out + 1] = c end end
  table.sort(out, function(a, b)
    if a.fits ~= b.fits then return a.fits end
    if a.fits and a.prediction.step ~= b.prediction.step then return a.prediction.step < b.prediction.step end
    if a.peak ~= b.peak then return a.peak < b.peak end
    return a.text < b.text
  end)
  return out
end

-- A group at one tier: a candidate a variant, planned or estimated. Returns them by variant.
local function evaluate(ctx, group, tier, variants, all)
  local cands = {}
  for _, v in ipairs(variants) do
    cands[v] = candidate(ctx, group, tier, v)
    all[#all + 1] = cands[v]
  end
  if group.pipeline == 1 then evaluate_flat(ctx, cands[variants[1]])
  else evaluate_pipeline(ctx, group, variants, cands) end
  for _, v in ipairs(variants) do note(ctx, cands[v]) end
  return cands
end

-- Phase 1 for a group: ZeRO stage 0, 1, 2, 3 (each with its zero_groups choices), then the same
-- with recompute, each tier for the variants no tier before fitted; a variant refused at every
-- choice of a tier is not tried further.
local function search_group(ctx, group, all)
  local skip = bounded_out(ctx, group)
  if skip then
    for _, v in ipairs(group.variants) do
      local cand = candidate(ctx, group, {}, v)
      cand.skipped = skip
      all[#all + 1] = cand
    end
    return
  end
  local tiers = S.tiers(group, ctx)
  local pending = group.variants
  for _, recompute in ipairs(tiers.recompute) do
    local least = {}  -- a variant's least peak at ZeRO-1, 2 and 3, from its stage-0 plan
    for _, stage in ipairs(tiers.stages) do
      if #pending == 0 then return end
      local trying = {}  -- (a variant this stage cannot fit stays pending for the next tier)
      for _, v in ipairs(pending) do
        if not (least[v] and least[v][stage] and least[v][stage] > ctx.device.memory) then trying[#trying + 1] = v end
      end
      local fitted, refused, choices = {}, {}, tiers.groups(stage)
      for _, zg in ipairs(choices) do
        local tier = { zero_stage = stage or nil, zero_groups = zg or nil, recompute = recompute or nil }
        if #trying > 0 then
          local cands = evaluate(ctx, group, tier, trying, all)
          for _, v in ipairs(trying) do
            if cands[v].fits then fitted[v] = true end
            if cands[v].refusal then refused[v] = (refused[v] or 0) + 1 end
          end
          if stage == 0 then M.least_peaks(cands, trying, least) end
        end
      end
      local rest = {}
      for _, v in ipairs(pending) do
        if not fitted[v] and (refused[v] or 0) < #choices then rest[#rest + 1] = v end
      end
      pending = rest
    end
  end
end

--- M.least_peaks(cands, variants, least): for each variant planned or estimated at ZeRO stage 0
--- that does not fit, the least peak it could have at ZeRO-1, 2 and 3 (least[v] = { [1] = bytes,
--- [2] = ..., [3] = ... }), so that a stage that cannot fit it is not planned. From its stage-0
--- peak: ZeRO-1 shrinks at most a rank's optimizer state and masters (to nothing), ZeRO-2 its
--- gradients too, ZeRO-3 its parameters too; the activations stay. The most a rank of the plan holds of them is
--- taken off (the reference plan's ranks: every variant of a tier shares its model state).
function M.least_peaks(cands, variants, least)
  local planned
  for _, v in ipairs(variants) do planned = planned or cands[v].planned end
  if not planned then return end
  local shrink1, shrink2, shrink3 = 0, 0, 0
  for _, r in ipairs(planned) do
    shrink1 = math.max(shrink1, r.optimizer_bytes + r.master_bytes)
    shrink2 = math.max(shrink2, r.grad_bytes + r.optimizer_bytes + r.master_bytes)
    shrink3 = math.max(shrink3, r.model_state_bytes)
  end
  for _, v in ipairs(variants) do
    local c = cands[v]
    if c.prediction and not c.fits and not c.refusal then
      local step = c.prediction.peak  -- (the whole run's may be more: this is a lower bound)
      least[v] = { [1] = step - shrink1, [2] = step - shrink2, [3] = step - shrink3 }
    end
  end
end

-- Phase 2: the first max(top, 2) + 3 of the ranking planned exactly, until they all are.
local function settle_top(ctx, all)
  local keep = math.max(ctx.o.top or 5, 2) + 3
  for _ = 1, 8 do
    local ranked, todo = M.rank(all), {}
    for i = 1, math.min(keep, #ranked) do if not ranked[i].exact then todo[#todo + 1] = ranked[i] end end
    if #todo == 0 then return end
    for _, c in ipairs(todo) do make_exact(ctx, c) end
  end
end

--- M.run(ctx, groups): every candidate of the groups (space.space), planned, estimated, refused
--- or skipped, the best few planned exactly. Layouts without a pipeline go first (a rank each,
--- exact), then pipelines from the fewest stages, so that the bounds have a fast layout to
--- compare with early. ctx: { o (partrain.auto.main's options), device, dtype, rate (FLOP/s:
--- flops[dtype] x efficiency), options and declared (the script's), fixed (the flags the user
--- gave), defaults (the probe's options), always (flags to show whatever their value), world,
--- nproc, and the search's own: cache, bubbles, step_flops, stage_costs, best, stats = { calls,
--- ranks } }. A candidate: { layout, values, args, flags, text, group, variant, tier, prediction
--- = { step, compute, comm, bubble, bubble_ratio, peak }, peak, fits, exact, from (the candidate
--- whose plan it was estimated from), refusal, skipped }.
function M.run(ctx, groups)
  local order = {}
  for i, g in ipairs(groups) do order[i] = { g, i } end
  table.sort(order, function(a, b)
    if a[1].pipeline ~= b[1].pipeline then return a[1].pipeline < b[1].pipeline end
    return a[2] < b[2]
  end)
  local all = {}
  for _, item in ipairs(order) do search_group(ctx, item[1], all) end
  settle_top(ctx, all)
  return all
end

return M
