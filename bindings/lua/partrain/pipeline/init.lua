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

-- A whole stage's figure from the search's options: a number (>= 0 where zero is allowed).
local function stage_figure(what, x, default, zero)
  if x == nil then return default end
  if type(x) ~= "number" or not ((x > 0 or (zero and x == 0)) and x < math.huge) then
    C.refuse("search's %s must be a number %s (a whole stage's, at one chunk a rank), got %s", what, zero and ">= 0" or "> 0",
      type(x) == "number" and A.format(x) or type(x))
  end
  return x
end

-- The search's options checked: pp, m, the cap, the chunk counts, and the whole stage's costs and
-- memory weights.
local function search_options(opts)
  if type(opts) ~= "table" then C.refuse("search takes a table { stages, microbatches, memory, ... }, got %s", type(opts)) end
  for k in pairs(opts) do
    if not SEARCH_KEYS[k] then
      C.refuse("search has no option %s (options: stages, microbatches, memory, costs, memory_model, chunks)", core._key_text(k))
    end
  end
  for _, k in ipairs { "stages", "microbatches", "memory" } do
    if opts[k] == nil then C.refuse("search needs %s (the %s)", k, ({ stages = "pipeline's ranks",
      microbatches = "micro-batches a step", memory = "most a rank may hold, in memory_model's units" })[k]) end
  end
  check_int("search's stages", opts.stages, 1, 4096)
  check_int("search's microbatches", opts.microbatches, 1, 65536)
  local cap = opts.memory
  if type(cap) ~= "number" or not (cap > 0) then
    C.refuse("search's memory (the most a rank may hold) must be a number > 0, got %s", type(cap) == "number" and A.format(cap) or type(cap))
  end
  local allowed = opts.chunks or { 1, 2 }
  if type(allowed) ~= "table" or #allowed == 0 then
    C.refuse("search's chunks must be a list of chunk counts such as { 1, 2 }, got %s", type(allowed) == "table" and "an empty table" or type(allowed))
  end
  for i, c in ipairs(allowed) do check_int(("search's chunks[%d]"):format(i), c, 1, 64) end
  C.check_sizes(opts.stages, opts.microbatches, math.max(unpack(allowed)))
  local costs, model = opts.costs or {}, opts.memory_model or {}
  if type(costs) ~= "table" then C.refuse("search's costs must be a table { F, B, W, send }, got %s", type(costs)) end
  if type(model) ~= "table" then C.refuse("search's memory_model must be a table { activation, pending }, got %s", type(model)) end
  for k in pairs(costs) do
    if k ~= "F" and k ~= "B" and k ~= "W" and k ~= "send" then C.refuse("search's costs has no field %s (fields: F, B, W, send)", core._key_text(k)) end
  end
  for k in pairs(model) do
    if k ~= "activation" and k ~= "pending" then C.refuse("search's memory_model has no field %s (fields: activation, pending)", core._key_text(k)) end
  end
  return opts.stages, opts.microbatches, cap, allowed,
    { F = stage_figure("costs.F", costs.F, 1), B = stage_figure("costs.B", costs.B, 1), W = stage_figure("costs.W", costs.W, 1),
      send = stage_figure("costs.send", costs.send, 0, true) },
    { activation = stage_figure("memory_model.activation", model.activation, 1, true),
      pending = stage_figure("memory_model.pending", model.pending, 1, true) }
end

-- The caps the search gives the generator at `chunks` chunks a rank: every count from `chunks` to
-- 16, then steps of about a quarter, up to what holding every micro-batch needs (2pp chunks a
-- chunk, ZB-H2's, or all m): the search stops earlier at the first cap that holds nothing back.
local function search_caps(pp, m, chunks)
  local most = chunks * math.min(2 * pp, m)
  local caps, k = {}, chunks
  while k < most do
    caps[#caps + 1] = k
    k = k < 16 and k + 1 or math.ceil(k * 1.25)
  end
  caps[#caps + 1] = most
  return caps
end

--- P.search { stages = pp, microbatches = m, memory = cap [, costs = { F, B, W, send }]
--- [, memory_model = { activation, pending }] [, chunks = { 1, 2 }] }: the schedule predicted
--- fastest among those whose peak a rank fits `memory`. It weighs the shipped schedules at each
--- allowed chunk count (those that take it; zbh1, zbh2 and zbv placed under the given costs) and
--- the zero-bubble generator's variants (every cap on the micro-batch chunks a rank holds, both
--- layouts at two chunks or more), each simulated by the check. costs and memory_model are a
--- whole stage's (one chunk a rank: seconds, bytes of a micro-batch); at c chunks a rank a chunk
--- takes 1/c of each (send excepted). Defaults: unit times (F = B = W = 1, send = 0) and 1 a
--- micro-batch's activations and 1 its pending weight-gradient inputs, so that `memory` counts
--- micro-batches. Returns { name, plan, chunks, makespan, bubble, memory, candidates = { { name,
--- chunks, makespan, bubble, memory, fits }... } }: plan is the winner's compute-only action
--- lists with its name and layout (keep it, edit it, hand it back as a schedule: function()
--- return plan end, at `chunks` chunks); ties go to the smaller memory, then the fewer chunks.
--- Refuses, naming the least memory any candidate needs, when none fits.
function P.search(opts)
  return guarded_as("pipeline search", nil, function()
    local pp, m, cap, allowed, costs, model = search_options(opts)
    local candidates, plans, best, least = {}, {}, nil, nil
    local function weigh(name, plan, chunks)
      plan.name, plan.layout = name, plan.layout or "interleaved"
      local lowered = lower(C.normalize(plan, pp, m, chunks), pp, chunks)
      local report = C.simulate(lowered, pp, m, chunks, nil, {
        costs = { F = costs.F / chunks, B = costs.B / chunks, W = costs.W / chunks, send = costs.send },
        memory = { activation = model.activation / chunks, pending = model.pending / chunks } })
      local c = { name = name, chunks = chunks, makespan = report.makespan, bubble = report.bubble,
                  memory = report.memory, fits = report.memory <= cap }
      candidates[#candidates + 1], plans[c] = c, plan
      if not least or c.memory < least.memory then least = c end
      local eps = 1e-9 * math.max(1, c.makespan)
      if c.fits and (not best or c.makespan < best.makespan - eps
                     or (math.abs(c.makespan - best.makespan) <= eps and c.memory < best.memory)) then
        best = c
      end
    end
    local zb = require "partrain.pipeline.schedules.zb"
    for _, chunks in ipairs(allowed) do
      local unit = {}  -- the generator's costs at this chunk count: functions of the virtual stage
      for _, k in ipairs { "F", "B", "W" } do local t = costs[k] / chunks; unit[k] = function() return t end end
      unit.send = function() return costs.send end
      for _, name in ipairs(P.schedules) do
        -- (a shipped schedule refuses the chunk counts, or micro-batch counts, it does not take)
        local made, plan = pcall(require("partrain.pipeline.schedules." .. name), pp, m, chunks, unit)
        if made and type(plan) == "table" then weigh(name, plan, chunks) end
      end
      for _, layout in ipairs(chunks > 1 and { "interleaved", "v" } or { "interleaved" }) do
        for _, held in ipairs(search_caps(pp, m, chunks)) do
          local function cap_of() return held end
          local made, plan, _, bound = pcall(zb, pp, m, chunks, { layout = layout ~= "interleaved" and layout or nil,
                                                                  activations = cap_of, held = cap_of, costs = unit })
          if made then
            weigh(("zb%s(chunks=%d,held=%d)"):format(layout == "v" and "-v" or "", chunks, held), plan, chunks)
            if not bound then break end  -- a larger cap would make the same plan
          end
        end
      end
    end
    if not best then
      C.refuse("no schedule fits memory = %s a rank: the least any of the %d candidates needs is %s (%s at %d chunk%s a rank)",
        A.format(cap), #candidates, A.format(least.memory), least.name, least.chunks, least.chunks == 1 and "" or "s")
    end
    return { name = best.name, plan = plans[best], chunks = best.chunks, makespan = best.makespan, bubble = best.bubble,
             memory = best.memory, candidates = candidates }
  end)
end

return P
