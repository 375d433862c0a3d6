-- Pipeline schedules as data: `require "partrain.pipeline"` gives the action vocabulary, the
-- shipped schedules (gpipe, 1f1b, interleaved, and the zero-bubble zbh1, zbh2 and zbv), the
-- lowering that adds sends and receives, the pre-flight check that simulates every rank, the
-- simulator with measured costs, the search under a memory cap, and a text timeline. See
-- docs/pipeline.md.
local core = require "partrain.core"
local A = require "partrain.pipeline.actions"
local C = require "partrain.pipeline.check"
local lower = require "partrain.pipeline.lower"

local P = {
  action = A.action, format = A.format,
  --- The schedules partrain ships: names for P.schedule and P.build.
  schedules = { "gpipe", "1f1b", "interleaved", "zbh1", "zbh2", "zbv" },
  --- The stage layouts a plan may name in plan.layout (nil is "interleaved").
  layouts = { "interleaved", "v" },
}

-- Runs fn(...) and turns a refusal into an error at the user's line that led here, prefixed with
-- `prefix` (or "pipeline schedule" and the plan's name that name_of returns); any other error (a
-- bug of this library) goes on as it is.
local function guarded_as(prefix, name_of, fn, ...)
  local results = { pcall(fn, ...) }
  if results[1] then return unpack(results, 2, table.maxn(results)) end
  local err = results[2]
  if getmetatable(err) ~= C.REFUSAL then error(err, 0) end
  if not prefix then
    local name = name_of()
    prefix = "pipeline schedule" .. (name and (" '" .. name .. "'") or "")
  end
  core._raise(prefix .. ": " .. err.msg, 0)
end
local function guarded(name_of, fn, ...) return guarded_as(nil, name_of, fn, ...) end

--- The action a text names ("F3.c0", "SEND_F3.c0->1", "RECV_B2.c1<-3"; ".c0" may be left out).
function P.parse(text)
  return guarded(function() end, function()
    local a, err = A.parse(text)
    if not a then C.refuse("%s", err) end
    return a
  end)
end

local function check_int(what, x, low, high)
  if not A.is_int(x) or x < low or (high and x > high) then
    C.refuse("%s must be an integer from %d%s, got %s", what, low, high and (" to %d"):format(high) or " up", A.format(x))
  end
end

--- P.stage(pp, rank, chunk [, layout]): the virtual stage chunk `chunk` of rank `rank` runs;
--- P.place(pp, stage [, layout]): the rank and chunk that run virtual stage `stage`. layout:
--- "interleaved" (nil: chunk c of rank r is stage c * pp + r) or "v" (odd chunks run back:
--- c * pp + pp - 1 - r).
function P.stage(pp, rank, chunk, layout)
  return guarded(function() end, function()
    check_int("pp", pp, 1); check_int("rank", rank, 0, pp - 1); check_int("chunk", chunk, 0)
    C.check_layout(layout, "layout")
    return A.stage(pp, rank, chunk, layout)
  end)
end
function P.place(pp, stage, layout)
  return guarded(function() end, function()
    check_int("pp", pp, 1); check_int("stage", stage, 0)
    C.check_layout(layout, "layout")
    return A.place(pp, stage, layout)
  end)
end

local function is_shipped(name)
  for _, s in ipairs(P.schedules) do if s == name then return true end end
  return false
end

-- The function and the name of a schedule given as a shipped name or a function.
local function resolve(schedule)
  if type(schedule) == "string" then
    if not is_shipped(schedule) then
      C.refuse("no shipped schedule named '%s' (shipped: %s; or pass a function)", schedule, table.concat(P.schedules, ", "))
    end
    return require("partrain.pipeline.schedules." .. schedule), schedule
  elseif type(schedule) == "function" then
    local info = debug.getinfo(schedule, "S")
    return schedule, ("%s:%d"):format(info.short_src, info.linedefined)
  end
  C.refuse("a schedule is a shipped name (%s) or a function (pp, microbatches, chunks) -> plan, got %s",
    table.concat(P.schedules, ", "), type(schedule))
end

local function has_transfers(plan, pp)
  for r = 0, pp - 1 do
    for _, a in ipairs(plan[r]) do if A.COMM[a.op] then return true end end
  end
  return false
end

--- The seconds a schedule function may take unless told otherwise (parallelize's schedule_timeout).
P.timeout = 60

--- P.schedule(schedule, pp, microbatches, chunks, timeout): the plan the schedule returns,
--- normalized (strings parsed, fields checked) and named, not lowered nor checked. `schedule` is
--- a shipped name or a function (pp, microbatches, chunks) -> { [rank] = { actions... } }; one
--- still running after `timeout` seconds (default P.timeout) is interrupted and refused.
function P.schedule(schedule, pp, microbatches, chunks, timeout)
  local name
  return guarded(function() return name end, function()
    local fn
    fn, name = resolve(schedule)
    C.check_sizes(pp, microbatches, chunks or 1)
    timeout = timeout == nil and P.timeout or timeout
    if type(timeout) ~= "number" or not (timeout > 0 and timeout < math.huge) then
      C.refuse("schedule_timeout must be a number of seconds > 0, got %s", tostring(timeout))
    end
    local ok, plan = require("partrain.policy")._shape.bounded(timeout, "schedule_timeout", fn, pp, microbatches,
      chunks or 1)
    if not ok then
      C.refuse("%s", type(plan) == "string" and plan or ("the function raised an error that is %s, not a message"):format(
        plan == nil and "nil" or "a " .. type(plan)))
    end
    if type(plan) == "table" and plan.name == nil then
      local named = { name = name }
      for k, v in pairs(plan) do named[k] = v end
      plan = named
    end
    return C.normalize(plan, pp, microbatches, chunks or 1)
  end)
end

--- P.lower(plan, pp, microbatches, chunks): the plan with its sends and receives added. A plan
--- that already has transfers is taken as written (returned normalized): a schedule may spell
--- out its own communication.
function P.lower(plan, pp, microbatches, chunks)
  return guarded(function() return type(plan) == "table" and type(plan.name) == "string" and plan.name or nil end, function()
    local n = C.normalize(plan, pp, microbatches, chunks or 1)
    if has_transfers(n, pp) then return n end
    return lower(n, pp, chunks or 1)
  end)
end

--- P.check(plan, pp, microbatches, chunks [, { costs, memory }]): simulates every rank of a
--- lowered plan (plan.layout: nil or "interleaved", or "v") and returns its report, or raises
--- naming the first offending action, its rank and its index:
---   { name, layout, pp, microbatches, chunks, makespan, bubble, gaps, peak, pending_peak, memory,
---     ranks = { [r] = { peak, pending_peak, memory, weights, busy, idle, gaps, actions, forwards,
---                       backwards, sends, receives, starts, ends } } }
--- peak: the most activations (forward run, B not yet) a rank holds at once; pending_peak: the
--- most micro-batch chunks whose split B ran and W not yet; memory: the most of activations x
--- memory.activation + pending x memory.pending (both 1 by default) at once; weights: its W's;
--- gaps: its idle time between its first compute and the end of its last; starts[i], ends[i]:
--- when compute action i starts and ends. The top-level figures are the largest over ranks. Times
--- are in units (F = B = W = 1, a fused B 2) unless `costs` says otherwise (see P.simulate).
function P.check(plan, pp, microbatches, chunks, opts)
  return guarded(function() return type(plan) == "table" and type(plan.name) == "string" and plan.name or nil end, function()
    local n = C.normalize(plan, pp, microbatches, chunks or 1)
    return C.simulate(n, pp, microbatches, chunks or 1, nil, opts)
  end)
end

--- P.simulate(plan, pp, microbatches, chunks, { costs = { F, B, W, send }, memory = { activation,
--- pending } }): P.check's report under measured costs, so that `makespan` is the predicted step
--- time and ranks[r].memory the predicted peak. Each figure is a number or a table by virtual
--- stage { [0] = x, ..., [pp * chunks - 1] = x }: F, B (a split B: the input's gradient) and W
--- the seconds of one micro-batch's chunk (> 0; a fused B takes B + W), send the seconds from a
--- send until its receive can complete (>= 0, default 0), activation and pending the bytes a
--- micro-batch's chunk holds from F to B and from a split B to its W (>= 0, default 1). A
--- compute-only plan is lowered first.
function P.simulate(plan, pp, microbatches, chunks, opts)
  return guarded(function() return type(plan) == "table" and type(plan.name) == "string" and plan.name or nil end, function()
    local n = C.normalize(plan, pp, microbatches, chunks or 1)
    if not has_transfers(n, pp) then n = lower(n, pp, chunks or 1) end
    return C.simulate(n, pp, microbatches, chunks or 1, nil, opts)
  end)
end

--- P.build(schedule, pp, microbatches, chunks, timeout [, { costs, memory }]): schedule, lower and
--- check in one; returns the plan the executor will run (with its name and layout) and its
--- report. A refusal names the action by its place in the list the schedule returned, also when
--- lowering added the transfers.
function P.build(schedule, pp, microbatches, chunks, timeout, opts)
  local plan = P.schedule(schedule, pp, microbatches, chunks, timeout)
  return guarded(function() return plan.name end, function()
    local origin
    if not has_transfers(plan, pp) then plan, origin = lower(plan, pp, chunks or 1) end
    return plan, C.simulate(plan, pp, microbatches, chunks or 1, origin, opts)
  end)
end

-- The sizes a plan implies: its ranks, and the largest micro-batch and chunk it names.
local function sizes_of(plan)
  local pp, mbs, chunks = 0, 0, 0
  while type(plan[pp]) == "table" do pp = pp + 1 end
  for r = 0, pp - 1 do
    for _, a in ipairs(plan[r]) do
      if type(a) == "string" then a = A.parse(a) or {} end
      if type(a) == "table" then
        if A.is_int(a.mb) then mbs = math.max(mbs, a.mb + 1) end
        if A.is_int(a.chunk) then chunks = math.max(chunks, a.chunk + 1) end
      end
    end
  end
  return pp, math.max(mbs, 1), math.max(chunks, 1)
end

--- P.describe(plan [, { timeline = true, transfers = false }]): one line a rank. By default the
--- ordered actions in text form ("rank 0: F0.c0 SEND_F0.c0->1 ..."); transfers = false leaves out
--- sends and receives. timeline = true checks the plan and draws the unit-time simulation: a
--- column a time unit, "F0" a forward (1 unit), "B0==" a whole backward (2 units), "B0" a split
--- one's input part and "W0" its weights' (1 unit each), "." idle.
function P.describe(plan, opts)
  opts = opts or {}
  guarded(function() end, function()
    if type(plan) ~= "table" then C.refuse("describe takes a plan, got %s", type(plan)) end
    if type(opts) ~= "table" then C.refuse("describe's options must be a table, got %s", type(opts)) end
    for k in pairs(opts) do
      if k ~= "timeline" and k ~= "transfers" then C.refuse("describe has no option %s (options: timeline, transfers)", core._key_text(k)) end
    end
  end)
  local pp, mbs, chunks = sizes_of(plan)
  local n = P.lower(plan, pp, mbs, chunks)
  local lines = {}
  if opts.timeline then
    local report = P.check(n, pp, mbs, chunks)
    local width = #tostring(mbs - 1) + (chunks > 1 and #tostring(chunks - 1) + 2 or 0) + 1
    for r = 0, pp - 1 do
      local cells = {}
      for t = 1, report.makespan do cells[t] = ("."):rep(width) end
      for i, a in ipairs(n[r]) do
        local start = report.ranks[r].starts[i]
        if start then
          local label = a.op .. a.mb .. (chunks > 1 and ".c" .. a.chunk or "")
          cells[start + 1] = label .. (" "):rep(width - #label)
          for t = start + 2, report.ranks[r].ends[i] do cells[t] = ("="):rep(width) end  -- a whole backward
        end
      end
      lines[r + 1] = ("rank %d | %s|"):format(r, table.concat(cells, " "))
    end
    return table.concat(lines, "\n")
  end
  for r = 0, pp - 1 do
    local words = {}
    for _, a in ipairs(n[r]) do
      if opts.transfers ~= false or A.COMPUTE[a.op] then
        words[#words + 1] = chunks > 1 and A.format(a) or A.format(a):gsub("%.c0", "")
      end
    end
    lines[r + 1] = ("rank %d: %s"):format(r, table.concat(words, " "))
  end
  return table.concat(lines, "\n")
end

-- ---- The search ------------------------------------------------------------------------------

local SEARCH_KEYS = { stages = true, microbatches = true, memory = true, costs = true, memory_model = true, chunks = true }

--- P.search { stages = pp, microbatches = m, memory = cap [, costs = { F, B, W, send }]
--- [, memory_model = { activation, pending }] [, chunks = { 1, 2 }] }: the fastest schedule whose
--- predicted peak fits `memory`, among the shipped ones and the zero-bubble generator's variants
--- (every cap on held micro-batches, one and two chunks, both layouts). costs and memory_model are
--- numbers for a whole stage (one chunk a rank: seconds, bytes a micro-batch); a rank of c chunks
--- takes 1/c of them a chunk. Defaults: unit times, and 1 a micro-batch's activations and 1 its
--- pending weight-gradient inputs (so `memory` counts micro-batches). Returns { name, plan (its
--- compute-only actions, with name and layout: keep it, edit it, pass it back as a schedule
--- function returning it), chunks, makespan, bubble, memory, candidates = { { name, chunks,
--- makespan, bubble, memory, fits }... } }, or refuses naming the least memory any candidate needs.
function P.search(opts)
  return guarded(function() return "search" end, function()
    if type(opts) ~= "table" then C.refuse("search takes a table { stages, microbatches, memory, ... }, got %s", type(opts)) end
    for k in pairs(opts) do
      if not SEARCH_KEYS[k] then
        C.refuse("search has no option %s (options: stages, microbatches, memory, costs, memory_model, chunks)", core._key_text(k))
      end
    end
    local pp, m = opts.stages, opts.microbatches
    C.check_sizes(pp, m, 1)
    local cap = opts.memory
    if type(cap) ~= "number" or not (cap > 0) then C.refuse("search's memory (the cap a rank) must be a number > 0, got %s", A.format(cap)) end
    local allowed = opts.chunks or { 1, 2 }
    if type(allowed) ~= "table" or #allowed == 0 then C.refuse("search's chunks must be a list of chunk counts, got %s", A.format(allowed)) end
    for _, c in ipairs(allowed) do
      if not A.is_int(c) or c < 1 or c > 64 then C.refuse("search's chunks must be integers from 1 to 64, got %s", A.format(c)) end
    end
    local costs, model = opts.costs or {}, opts.memory_model or {}
    if type(costs) ~= "table" or type(model) ~= "table" then C.refuse("search's costs and memory_model must be tables") end
    local function scalar(what, x, default)
      if x == nil then return default end
      if type(x) ~= "number" or not (x >= 0 and x < math.huge) then C.refuse("search's %s must be a number >= 0 (a whole stage's), got %s", what, A.format(x)) end
      return x
    end
    for k in pairs(costs) do if k ~= "F" and k ~= "B" and k ~= "W" and k ~= "send" then C.refuse("search's costs has no field %s (fields: F, B, W, send)", core._key_text(k)) end end
    for k in pairs(model) do if k ~= "activation" and k ~= "pending" then C.refuse("search's memory_model has no field %s (fields: activation, pending)", core._key_text(k)) end end
    local F, B, W, send = scalar("costs.F", costs.F, 1), scalar("costs.B", costs.B, 1), scalar("costs.W", costs.W, 1), scalar("costs.send", costs.send, 0)
    local act, pend = scalar("memory_model.activation", model.activation, 1), scalar("memory_model.pending", model.pending, 1)

    local candidates, best, least = {}, nil, math.huge
    local function weigh(name, plan, chunks)
      plan.name = name
      local ok, report = pcall(function()
        local lowered = lower(C.normalize(plan, pp, m, chunks), pp, chunks)
        return C.simulate(lowered, pp, m, chunks, nil, {
          costs = { F = F / chunks, B = B / chunks, W = W / chunks, send = send },
          memory = { activation = act / chunks, pending = pend / chunks } })
      end)
      if not ok then return end  -- a variant the check refuses is not a candidate
      local c = { name = name, chunks = chunks, makespan = report.makespan, bubble = report.bubble,
                  memory = report.memory, fits = report.memory <= cap, plan = plan }
      candidates[#candidates + 1] = c
      least = math.min(least, report.memory)
      if c.fits and (not best or c.makespan < best.makespan - 1e-12
                     or (math.abs(c.makespan - best.makespan) <= 1e-12 and c.memory < best.memory)) then
        best = c
      end
    end
    local zb = require "partrain.pipeline.schedules.zb"
    for _, chunks in ipairs(allowed) do
      for _, name in ipairs(P.schedules) do
        local ok, plan = pcall(require("partrain.pipeline.schedules." .. name), pp, m, chunks)
        if ok and type(plan) == "table" then weigh(name, plan, chunks) end
      end
      local layouts = chunks % 2 == 0 and { "interleaved", "v" } or { "interleaved" }
      for _, layout in ipairs(layouts) do
        for held = 1, math.min(2 * pp * chunks, m * chunks) do
          -- (a cap too small for the chunks to pass micro-batches along makes no plan)
          local made, plan = pcall(zb, pp, m, chunks, { layout = layout ~= "interleaved" and layout or nil,
                                                       activations = function() return held end,
                                                       held = function() return held end })
          if made then weigh(("zb(chunks=%d, layout=%s, held=%d)"):format(chunks, layout, held), plan, chunks) end
        end
      end
    end
    if not best then
      C.refuse("no schedule fits memory = %s a rank: the least any candidate needs is %s (of %d candidates)",
        tostring(cap), tostring(least), #candidates)
    end
    local plan = best.plan
    for _, c in ipairs(candidates) do c.plan = nil end
    return { name = best.name, plan = plan, chunks = best.chunks, makespan = best.makespan, bubble = best.bubble,
             memory = best.memory, candidates = candidates }
  end)
end

return P
