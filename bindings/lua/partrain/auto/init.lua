-- `partrain plan --auto`: the fastest layout of a training script that fits a device, found by
-- enumerating the layouts its pt.args flags can take at a world size, planning representative
-- ranks of each on virtual ranks, predicting each one's step time from the planned FLOPs and
-- collectives, and ranking those whose peak memory a rank fits. docs/plan.md, "Automatic layouts".
-- This file is the entry (M.main) and the probe; the parts, whose public functions partrain.auto
-- also gives:
--   auto/space.lua   the layouts a world allows: flags, tiers, the ranks planned for each
--   auto/cost.lua    the cost model: collectives on a device's links, overlap, step and peak
--   auto/search.lua  planning and estimating each tier, the bounds, exact plans of the best
--   auto/report.lua  the table or JSON, why each layout lost, the winner as a config file
--
-- The search, in order:
--   1. a probe: the script planned on rank 0 with the user's arguments, for its options (layers,
--      batch, seq, heads, experts, dtype) and the flags it declares;
--   2. the space (space.space): every (tensor, context and its mode, pipeline and its chunks,
--      expert) the flags allow, each with its schedule variants (schedule, micro-batches);
--   3. tiers (space.tiers): ZeRO stage 0, then 1, 2, 3, each tried only for the variants the
--      stage before could not fit (a higher stage is never predicted cheaper), then the same with
--      recompute "block" for the variants no stage fitted without it;
--   4. a tier's reference plan: one (schedule, micro-batches) of the variants planned on the
--      representative ranks; the others are estimated from it with the pipeline simulator
--      (cost.pipeline_prediction). Layouts without a pipeline go first, then pipelines from the
--      fewest stages; a pipelined group that a bound on its step shows slower than the fastest
--      exact layout that fits is not planned (search.bound, search.head_bound);
--   5. exact plans of the best few (each with its own schedule and micro-batches, every
--      representative rank), re-ranked on their exact peaks, until the top of the ranking is exact.
local core = require "partrain.core"
local D = require "partrain.devices"
local S = require "partrain.auto.space"
local C = require "partrain.auto.cost"
local Q = require "partrain.auto.search"
local R = require "partrain.auto.report"

local M = {}

-- The public functions of the parts, under partrain.auto (the tests and the docs name them so).
for _, part in ipairs { S, C, Q, R } do
  for k, v in pairs(part) do if M[k] == nil then M[k] = v end end
end

local function fail(fmt, ...) error("partrain plan --auto: " .. fmt:format(...), 0) end

-- ---- The probe -------------------------------------------------------------------------------

-- The script's options and declared flags: rank 0 planned with the user's arguments; when the
-- script refuses them (a batch that does not split over every rank as data ranks, say), with a
-- larger tensor or pipeline size, a few tries. Returns the plan (or the refusal's third value,
-- when o.plan gives { options, declared } with it) and the flags the tries added.
local function probe(ctx)
  local o = ctx.o
  local plan, refusal, info = o.plan(o.args, { 0 })
  ctx.stats.calls, ctx.stats.ranks = ctx.stats.calls + 1, ctx.stats.ranks + 1
  if plan then return plan, {} end
  if type(info) == "table" and info.options and info.declared then return info, {} end
  local tries = {}
  for _, t in ipairs { 2, 4, 8 } do
    if t <= o.nproc and o.world % t == 0 then tries[#tries + 1] = { tensor = t } end
  end
  for _, p in ipairs { 2, 4 } do
    if o.world % p == 0 then tries[#tries + 1] = { pipeline = p } end
  end
  local given = S.given(o.args, { tensor = "integer", pipeline = "integer" })
  for i = 1, math.min(#tries, 5) do
    local name = next(tries[i])
    if not given[name] then
      local args = {}
      for j, w in ipairs(o.args) do args[j] = w end
      for _, w in ipairs(S.flag_words(tries[i], { name })) do args[#args + 1] = w end
      local p = o.plan(args, { 0 })
      ctx.stats.calls, ctx.stats.ranks = ctx.stats.calls + 1, ctx.stats.ranks + 1
      if p then return p, { [name] = true } end
    end
  end
  return nil, refusal
end

-- ---- The entry -------------------------------------------------------------------------------

local function check_options(o)
  if type(o) ~= "table" then fail("main takes a table of options, got %s", type(o)) end
  if type(o.script) ~= "string" then fail("script must be a path, got %s", type(o.script)) end
  if type(o.args) ~= "table" then fail("args must be a list of strings, got %s", type(o.args)) end
  for i, w in ipairs(o.args) do if type(w) ~= "string" then fail("args[%d] must be a string, got %s", i, type(w)) end end
  for _, k in ipairs { "world", "nproc" } do
    if type(o[k]) ~= "number" or o[k] < 1 or o[k] % 1 ~= 0 then fail("%s must be a whole number >= 1, got %s", k, tostring(o[k])) end
  end
  if o.world % o.nproc ~= 0 then fail("nproc %d does not divide the world of %d ranks", o.nproc, o.world) end
  if o.top ~= nil and (type(o.top) ~= "number" or o.top < 1 or o.top % 1 ~= 0) then
    fail("top must be a whole number >= 1, got %s", tostring(o.top))
  end
  if type(o.plan) ~= "function" then fail("plan must be a function (args, ranks) -> plan, got %s", type(o.plan)) end
end

-- The ranks --verify trains a layout on: the world when it is small (8 or fewer), else the
-- fewest the layout's splits need (tensor x context x pipeline x the data ranks its ZeRO groups
-- or experts need: 2 a zero group, the expert size).
local function verify_ranks(v, world)
  if world <= 8 then return world end
  local data = math.max(v.expert or 1, (v.zero_stage or 0) > 0 and 2 * math.max(v.zero_groups or 0, 1) or 1)
  return (v.tensor or 1) * (v.context or 1) * (v.pipeline or 1) * data
end

--- M.main(o): the search. o = { script, args, world, nproc, device (a name, a file or nil: h100),
--- device_memory (bytes or nil), top (default 5), json, config (a file to write the winner's
--- values to, or nil), verbose, plan = function(args, ranks) -> plan | nil, refusal }. Prints the
--- ranking (text, or JSON with o.json) and returns { status = 0 | 1, layouts = { { flags, values,
--- text, data, step, peak, fits, exact, verify_ranks }... } (fitting first, by predicted step),
--- message (status 1: why) }. A wrong device or option is an error naming it.
function M.main(o)
  check_options(o)
  local started = core.now()
  local ctx = { o = o, cache = {}, bubbles = {}, step_flops = {}, stats = { calls = 0, ranks = 0 } }
  ctx.device = D.load(o.device, o.device_memory)
  local probed, extra = probe(ctx)
  if not probed then
    return { status = 1, layouts = {}, message = ("the script refused its arguments at world %d: %s"):format(o.world,
      tostring(extra)) }
  end
  ctx.options, ctx.declared = probed.options or {}, probed.declared or {}
  ctx.dtype = D.dtype(ctx.options.dtype or "float32")
  if not ctx.dtype then
    fail("the script's dtype %s is none the cost model knows (%s)", tostring(ctx.options.dtype), table.concat(D.dtypes, ", "))
  end
  D.need(ctx.device, ctx.dtype)
  ctx.rate = ctx.device.flops[ctx.dtype] * ctx.device.efficiency
  ctx.defaults, ctx.always, ctx.fixed = ctx.options, extra, {}
  for name in pairs(S.given(o.args, ctx.declared)) do ctx.fixed[name] = ctx.options[name] end
  ctx.world, ctx.nproc = o.world, o.nproc
  local groups = S.space(ctx)
  if #groups == 0 then
    return { status = 1, layouts = {}, message = ("no layout of %d ranks is left by the flags given and the script's "
      .. "options (tensor, context, pipeline must divide the world; the batch must split over the data ranks)"):format(o.world) }
  end
  local all = Q.run(ctx, groups)
  local ranked = Q.rank(all)
  local seconds = core.now() - started
  if o.json then print(R.json_of(ctx, ranked, all, seconds)) else R.print_text(ctx, ranked, all, seconds) end
  local layouts = {}
  for i, c in ipairs(ranked) do
    layouts[i] = { flags = c.flags, values = c.values, text = c.text, data = c.layout.data, step = c.prediction.step,
                   peak = c.peak, fits = c.fits, exact = c.exact, verify_ranks = verify_ranks(c.values, o.world) }
  end
  if not ranked[1] then
    local first
    for _, c in ipairs(all) do if c.refusal then first = c; break end end
    return { status = 1, layouts = layouts, message = ("the script refused every layout (%d); the first, %s: %s")
      :format(#all, first and first.text or "?", first and first.refusal or "?") }
  end
  if not ranked[1].fits then
    return { status = 1, layouts = layouts, message = ("no layout fits %s a rank: the least any needs is %s (%s)")
      :format(R.bytes_text(ctx.device.memory), R.bytes_text(ranked[1].peak), ranked[1].text) }
  end
  if o.config then
    R.write_config(o.config, ranked[1].values, o.script)
    if not o.json then print(("wrote %s (%s --config %s)"):format(o.config, o.script, o.config)) end
  end
  return { status = 0, layouts = layouts }
end

return M
