-- Pipeline schedules as data: `require "partrain.pipeline"` gives the action vocabulary, the
-- shipped schedules (gpipe, 1f1b, interleaved), the lowering that adds sends and receives, the
-- pre-flight check that simulates every rank, and a text timeline. See docs/pipeline.md.
local core = require "partrain.core"
local A = require "partrain.pipeline.actions"
local C = require "partrain.pipeline.check"
local lower = require "partrain.pipeline.lower"

local P = {
  action = A.action, format = A.format, stage = A.stage, place = A.place,
  --- The schedules partrain ships: names for P.schedule and P.build.
  schedules = { "gpipe", "1f1b", "interleaved" },
}

-- Runs fn(...) and turns a refusal into an error at the user's line that led here, prefixed with
-- the plan's name; any other error (a bug of this library) goes on as it is.
local function guarded(name_of, fn, ...)
  local results = { pcall(fn, ...) }
  if results[1] then return unpack(results, 2, table.maxn(results)) end
  local err = results[2]
  if getmetatable(err) ~= C.REFUSAL then error(err, 0) end
  local name = name_of()
  local msg = "pipeline schedule" .. (name and (" '" .. name .. "'") or "") .. ": " .. err.msg
  core._raise(msg, 0)
end

--- The action a text names ("F3.c0", "SEND_F3.c0->1", "RECV_B2.c1<-3"; ".c0" may be left out).
function P.parse(text)
  return guarded(function() end, function()
    local a, err = A.parse(text)
    if not a then C.refuse("%s", err) end
    return a
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

--- P.check(plan, pp, microbatches, chunks): simulates every rank of a lowered plan and returns
--- its report, or raises naming the first offending action, its rank and its index:
---   { name, pp, microbatches, chunks, makespan, bubble, peak,
---     ranks = { [r] = { peak, busy, idle, actions, forwards, backwards, sends, receives, starts } } }
--- peak: the most activations (forward run, backward not yet) a rank holds at once; starts[i]:
--- the time action i (a forward or backward) starts in the unit-time simulation.
function P.check(plan, pp, microbatches, chunks)
  return guarded(function() return type(plan) == "table" and type(plan.name) == "string" and plan.name or nil end, function()
    local n = C.normalize(plan, pp, microbatches, chunks or 1)
    return C.simulate(n, pp, microbatches, chunks or 1)
  end)
end

--- P.build(schedule, pp, microbatches, chunks, timeout): schedule, lower and check in one;
--- returns the plan the executor will run and its report. A refusal names the action by its
--- place in the list the schedule returned, also when lowering added the transfers.
function P.build(schedule, pp, microbatches, chunks, timeout)
  local plan = P.schedule(schedule, pp, microbatches, chunks, timeout)
  return guarded(function() return plan.name end, function()
    local origin
    if not has_transfers(plan, pp) then plan, origin = lower(plan, pp, chunks or 1) end
    return plan, C.simulate(plan, pp, microbatches, chunks or 1, origin)
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
--- column a time unit, "F0" a forward (1 unit), "B0==" a backward (2 units), "." idle.
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
          if a.op == "B" then cells[start + 2] = ("="):rep(width) end
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

return P
