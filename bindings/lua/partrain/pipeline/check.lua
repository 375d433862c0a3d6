-- The pre-flight check of a pipeline plan: reads every rank's action list, simulates all ranks
-- together as the executor will run them, and refuses a plan that would deadlock, mismatch a send
-- and its receive, or run a micro-batch wrongly, naming the first offending action; else reports
-- the bubble, the peak in-flight activations and the memory held.
--
-- Executor semantics the simulation models:
--   * sends are asynchronous: SEND_* hands the tensor over and the rank goes on at once;
--   * receives wait: RECV_* blocks until the matching send has been issued;
--   * messages travel on ordered channels, one per (sender, receiver, kind): activations (F) and
--     gradients (B) are tagged apart, and within a channel the k-th receive takes the k-th send.
--     A receive whose channel's next message is for another micro-batch or chunk is a mismatch.
--   * a rank whose list holds W m.c splits that backward: its B m.c computes the input's gradient
--     only and W m.c, which must come after it, the weights'. Without a W, B does both (fused).
-- So only receives block, and a deadlock is a state where every unfinished rank waits at a
-- receive whose send has not been issued.
--
-- Cost model of the timing (the bubble): a forward of one chunk takes 1 time unit, a split B 1
-- and a W 1, so a fused B takes 2; communication takes none. `costs` = { F, B, W, send } replaces
-- these: each a number or a table by virtual stage { [v] = t } (seconds measured, say), a fused B
-- taking B + W and `send` the time from a send until its receive can complete. A rank starts each
-- action as soon as the one before it ended and its input has arrived. makespan = the latest end
-- over ranks; bubble = sum over ranks of (makespan - busy time) / (pp * makespan); for 1F1B and
-- GPipe this is (pp-1)/(m+pp-1). A rank's gaps: its idle time between the start of its first
-- compute and the end of its last (the idle a schedule leaves inside a rank's own span, which is
-- what "zero bubble" removes; the rest is the ramp-up and ramp-down no order avoids).
--
-- Memory model: a micro-batch's chunk holds `memory.activation` from its forward to its B, and
-- `memory.pending` from a split B to its W (what W needs: the inputs of the weights' products and
-- the gradients captured for them); each a number or a table by virtual stage, by default 1 and 1.
-- `memory.backward` (default 0) is what a B or a W needs above that while it runs (its working
-- memory). A rank's `memory` is the most it holds at once.
local core = require "partrain.core"
local A = require "partrain.pipeline.actions"

local C = {}

local REFUSAL = {}
--- Raises a refusal: a clear message about the plan (not a bug of the checker).
local function refuse(fmt, ...) error(setmetatable({ msg = fmt:format(...) }, REFUSAL), 0) end
C.REFUSAL = REFUSAL
C.refuse = refuse

local LIMITS = { pp = 4096, microbatches = 65536, chunks = 64 }

-- A cost or a memory weight by virtual stage: `value` a finite number (every stage) or a table
-- { [v] = number } covering stages 0 to S-1; nil gives `default`. Times of compute must be > 0 (a
-- rank's clock must move); a send's time and a weight in bytes may be 0. Returns a function of v.
local function by_stage(what, value, S, default, zero)
  local expected = zero and ">= 0" or "> 0"
  local function good(x) return type(x) == "number" and (x > 0 or (zero and x == 0)) and x < math.huge end
  if value == nil then return function() return default end end
  if good(value) then return function() return value end end
  if type(value) ~= "table" then
    refuse("%s must be a number %s or a table by virtual stage { [0] = ..., [%d] = ... }, got %s", what, expected, S - 1,
      type(value) == "number" and A.format(value) or type(value))
  end
  for k in pairs(value) do
    if not (A.is_int(k) and k >= 0 and k < S) then refuse("%s has the key %s (virtual stages are 0 to %d)", what, A.format(k), S - 1) end
  end
  for v = 0, S - 1 do
    if not good(value[v]) then
      refuse("%s[%d] (virtual stage %d) must be a number %s, got %s", what, v, v, expected, A.format(value[v]))
    end
  end
  return function(v) return value[v] end
end

--- The simulation's options checked: { costs = { F, B, W, send }, memory = { activation, pending } }
--- as functions of the virtual stage (see the top of the file).
function C.model(opts, S)
  if opts == nil then opts = {} end
  if type(opts) ~= "table" then refuse("the simulation's options must be a table { costs, memory }, got %s", type(opts)) end
  for k in pairs(opts) do
    if k ~= "costs" and k ~= "memory" then refuse("the simulation has no option %s (options: costs, memory)", core._key_text(k)) end
  end
  local costs, memory = opts.costs or {}, opts.memory or {}
  if type(costs) ~= "table" then refuse("costs must be a table { F, B, W, send }, got %s", type(costs)) end
  if type(memory) ~= "table" then refuse("memory must be a table { activation, pending }, got %s", type(memory)) end
  for k in pairs(costs) do
    if k ~= "F" and k ~= "B" and k ~= "W" and k ~= "send" then refuse("costs has no field %s (fields: F, B, W, send)", core._key_text(k)) end
  end
  for k in pairs(memory) do
    if k ~= "activation" and k ~= "pending" and k ~= "backward" then
      refuse("memory has no field %s (fields: activation, pending, backward)", core._key_text(k))
    end
  end
  return { F = by_stage("costs.F", costs.F, S, 1), B = by_stage("costs.B", costs.B, S, 1),
           W = by_stage("costs.W", costs.W, S, 1), send = by_stage("costs.send", costs.send, S, 0, true),
           activation = by_stage("memory.activation", memory.activation, S, 1, true),
           pending = by_stage("memory.pending", memory.pending, S, 1, true),
           backward = by_stage("memory.backward", memory.backward, S, 0, true) }
end

--- Refuses a layout other than nil, "interleaved" and "v"; `what` names it in the message.
function C.check_layout(layout, what)
  if layout ~= nil and not A.LAYOUTS[layout] then
    refuse("%s must be \"interleaved\" (chunk c of rank r is virtual stage c * pp + r, the default) or \"v\" "
      .. "(odd chunks run back: c * pp + pp - 1 - r), got %s", what, A.format(layout))
  end
end

--- Checks pp, microbatches and chunks are positive integers within bounds.
function C.check_sizes(pp, microbatches, chunks)
  for _, kv in ipairs { { "pp", pp }, { "microbatches", microbatches }, { "chunks", chunks } } do
    local name, v = kv[1], kv[2]
    if not A.is_int(v) or v < 1 or v > LIMITS[name] then
      refuse("%s must be an integer from 1 to %d, got %s", name, LIMITS[name], A.format(v))
    end
  end
  if pp * microbatches * chunks > 2^20 then
    refuse("pp * microbatches * chunks = %d is more actions than a plan may hold (at most %d)",
      pp * microbatches * chunks, 2^20)
  end
end

local function at(r, i, a) return ("rank %d, action %d (%s)"):format(r, i, A.format(a)) end

local FIELDS = { op = true, mb = true, chunk = true, peer = true }

-- One action of rank r at index i as a fresh, validated table.
local function normalize_action(a, r, i, pp, microbatches, chunks)
  if type(a) == "string" then
    local parsed, err = A.parse(a)
    if not parsed then refuse("rank %d, action %d: %s", r, i, err) end
    a = parsed
  elseif type(a) ~= "table" then
    refuse("rank %d, action %d: an action must be a table or a string, got %s", r, i, type(a))
  end
  for k in pairs(a) do
    if not FIELDS[k] then refuse("%s: an action has no field %s (fields: op, mb, chunk, peer)", at(r, i, a), core._key_text(k)) end
  end
  if not (A.COMPUTE[a.op] or A.COMM[a.op]) then
    refuse("%s: op must be one of %s, got %s", at(r, i, a), table.concat(A.OPS, ", "), A.format(a.op))
  end
  if not A.is_int(a.mb) or a.mb < 0 or a.mb >= microbatches then
    refuse("%s: mb must be a micro-batch from 0 to %d, got %s", at(r, i, a), microbatches - 1, A.format(a.mb))
  end
  local chunk = a.chunk == nil and 0 or a.chunk
  if not A.is_int(chunk) or chunk < 0 or chunk >= chunks then
    refuse("%s: chunk must be from 0 to %d, got %s", at(r, i, a), chunks - 1, A.format(a.chunk))
  end
  if A.COMM[a.op] then
    if not A.is_int(a.peer) or a.peer < 0 or a.peer >= pp then
      refuse("%s: peer must be a rank from 0 to %d, got %s", at(r, i, a), pp - 1, A.format(a.peer))
    end
  elseif a.peer ~= nil then
    refuse("%s: a %s has no peer (only sends and receives do), got peer=%s", at(r, i, a), a.op, A.format(a.peer))
  end
  return A.action(a.op, a.mb, chunk, a.peer)
end

--- A plan as fresh, validated action tables: { [r] = { action... } } for r = 0..pp-1, and its
--- name (a plan may carry `name = "..."`); refuses any other key, a hole, an ill-formed action.
function C.normalize(plan, pp, microbatches, chunks)
  C.check_sizes(pp, microbatches, chunks)
  if type(plan) ~= "table" then refuse("a plan must be a table { [rank] = { actions... } }, got %s", type(plan)) end
  if plan.name ~= nil and type(plan.name) ~= "string" then refuse("a plan's name must be a string, got %s", type(plan.name)) end
  C.check_layout(plan.layout, "a plan's layout")
  for k in pairs(plan) do
    if k ~= "name" and k ~= "layout" and not (A.is_int(k) and k >= 0 and k < pp) then
      refuse("a plan's keys are ranks 0 to %d (and name, layout), got %s%s", pp - 1, A.format(k),
        k == pp and plan[0] == nil and " (ranks count from 0)" or "")
    end
  end
  local out = { name = plan.name, layout = plan.layout }
  local most = 7 * microbatches * chunks   -- a valid list: F, B, W and at most 4 transfers a pair
  for r = 0, pp - 1 do
    local list = plan[r]
    if type(list) ~= "table" then refuse("rank %d: its action list must be a table, got %s", r, type(list)) end
    local n = 0
    for k in pairs(list) do
      n = n + 1
      if not (A.is_int(k) and k >= 1) then refuse("rank %d: its action list has the key %s (a list is indexed 1, 2, ...)", r, A.format(k)) end
      if n > most then refuse("rank %d: its list has more than %d actions (at most 7 per micro-batch and chunk)", r, most) end
    end
    if n ~= #list then refuse("rank %d: its action list has holes (%d entries, length %d)", r, n, #list) end
    local actions = {}
    for i = 1, n do actions[i] = normalize_action(list[i], r, i, pp, microbatches, chunks) end
    out[r] = actions
  end
  return out
end

--- Simulates a normalized plan; returns the report or refuses. See the top of the file. With
--- `origin` (what lowering returns for a compute-only plan), messages name the place in the list
--- the schedule returned: a transfer lowering added is named with its forward or backward.
function C.simulate(plan, pp, microbatches, chunks, origin, opts)
  local S = pp * chunks
  local layout = plan.layout
  local model = C.model(opts, S)
  -- Action i of rank r as the schedule wrote it: its index there and its text.
  local function named(r, i, a)
    local o = origin and origin[r][i]
    if not o then return i, A.format(a) end
    if A.COMPUTE[a.op] then return o.index, A.format(a) end
    return o.index, ("%s's %s %s"):format(A.format(o.action), a.op:sub(1, 4) == "SEND" and "send" or "receive", A.format(a))
  end
  -- Action i of rank r named at its place in the schedule's own list (the file-level `at` names
  -- places in the list normalize checks).
  local function where(r, i, a) return ("rank %d, action %d (%s)"):format(r, named(r, i, a)) end
  local function index(r, i) return (named(r, i, plan[r][i])) end
  local function key(m, c) return m * chunks + c end
  local ranks, channels = {}, {}
  for r = 0, pp - 1 do
    ranks[r] = { pos = 1, clock = 0, busy = 0, inflight = 0, peak = 0, pending = 0, pending_peak = 0, memory = 0,
                 memory_peak = 0, fdone = {}, bdone = {}, wdone = {}, split = {},
                 recv = { F = {}, B = {} }, sent = { F = {}, B = {} }, starts = {}, ends = {},
                 counts = { F = 0, B = 0, W = 0, SEND_F = 0, RECV_F = 0, SEND_B = 0, RECV_B = 0 } }
    for _, a in ipairs(plan[r]) do
      if a.op == "W" then ranks[r].split[key(a.mb, a.chunk)] = true end
    end
  end
  local function hold(st, bytes)
    st.memory = st.memory + bytes
    if st.memory > st.memory_peak then st.memory_peak = st.memory end
  end
  -- Action i of a rank computes for t from its clock on.
  local function compute(st, i, t)
    st.starts[i], st.ends[i] = st.clock, st.clock + t
    st.first = st.first or st.clock
    st.clock, st.busy = st.clock + t, st.busy + t
    st.last = st.clock
  end
  local function channel(src, dst, kind)
    local name = src .. ">" .. dst .. kind
    local ch = channels[name]
    if not ch then ch = { first = 1, last = 0, src = src, dst = dst }; channels[name] = ch end
    return ch
  end

  -- Runs the next action of rank r: "done" (list over), "ran", or "blocked" (a receive waits).
  local function step(r)
    local st, list = ranks[r], plan[r]
    local i = st.pos
    local a = list[i]
    if not a then return "done" end
    local m, c, op = a.mb, a.chunk, a.op
    local v, k = A.stage(pp, r, c, layout), key(m, c)
    local function refuse_here(fmt, ...) refuse("%s: " .. fmt, where(r, i, a), ...) end
    local pr, pc = A.place(pp, v - 1, layout)   -- previous virtual stage
    local nr, nc = A.place(pp, v + 1, layout)   -- next virtual stage
    local kind = op:sub(-1)             -- "F" or "B" for transfers
    if op == "F" then
      if st.fdone[k] then refuse_here("a second forward of micro-batch %d on chunk %d (the first is action %d)", m, c, index(r, st.fdone[k])) end
      if v > 0 then
        if pr == r then
          if not st.fdone[key(m, pc)] then refuse_here("its input comes from F%d.c%d on this rank, which has not run", m, pc) end
        elseif not st.recv.F[k] then
          refuse_here("its input was not received (no RECV_F%d.c%d<-%d before it)", m, c, pr)
        end
      end
      st.fdone[k] = i
      st.inflight = st.inflight + 1
      if st.inflight > st.peak then st.peak = st.inflight end
      hold(st, model.activation(v))
      local t = model.F(v)
      compute(st, i, t)
    elseif op == "B" then
      if st.bdone[k] then refuse_here("a second backward of micro-batch %d on chunk %d (the first is action %d)", m, c, index(r, st.bdone[k])) end
      if not st.fdone[k] then refuse_here("its forward F%d.c%d has not run on this rank", m, c) end
      if v < S - 1 then
        if nr == r then
          if not st.bdone[key(m, nc)] then refuse_here("its gradient comes from B%d.c%d on this rank, which has not run", m, nc) end
        elseif not st.recv.B[k] then
          refuse_here("its gradient was not received (no RECV_B%d.c%d<-%d before it)", m, c, nr)
        end
      end
      st.bdone[k] = i
      st.inflight = st.inflight - 1
      hold(st, model.backward(v))   -- its working memory while it runs
      hold(st, -model.backward(v) - model.activation(v))
      local t = model.B(v)
      if st.split[k] then  -- the weights' part waits for W
        st.pending = st.pending + 1
        if st.pending > st.pending_peak then st.pending_peak = st.pending end
        hold(st, model.pending(v))
      else
        t = t + model.W(v)
      end
      compute(st, i, t)
    elseif op == "W" then
      if st.wdone[k] then refuse_here("a second W of micro-batch %d on chunk %d (the first is action %d)", m, c, index(r, st.wdone[k])) end
      if not st.bdone[k] then refuse_here("its B%d.c%d has not run on this rank (a W comes after its B)", m, c) end
      st.wdone[k] = i
      st.pending = st.pending - 1
      hold(st, model.backward(v))
      hold(st, -model.backward(v) - model.pending(v))
      local t = model.W(v)
      compute(st, i, t)
    elseif op == "SEND_F" or op == "SEND_B" then
      local to_stage, tr, tc, done, what = v + 1, nr, nc, st.fdone, "forward F"
      if op == "SEND_B" then to_stage, tr, tc, done, what = v - 1, pr, pc, st.bdone, "backward B" end
      if to_stage < 0 or to_stage >= S then
        refuse_here("virtual stage %d is the %s stage: it has no %s stage to send to", v,
          v == 0 and "first" or "last", v == 0 and "previous" or "next")
      end
      if tr == r then refuse_here("virtual stage %d is on this same rank: nothing is sent", to_stage) end
      if a.peer ~= tr then
        refuse_here("sends to rank %d, but the %s stage (virtual stage %d) is on rank %d", a.peer,
          op == "SEND_F" and "next" or "previous", to_stage, tr)
      end
      if not done[k] then refuse_here("its %s%d.c%d has not run on this rank", what, m, c) end
      if st.sent[kind][k] then refuse_here("a second send of the same %s (the first is action %d)",
        kind == "F" and "activation" or "gradient", index(r, st.sent[kind][k])) end
      st.sent[kind][k] = i
      local ch = channel(r, tr, kind)
      ch.last = ch.last + 1
      ch[ch.last] = { mb = m, chunk = tc, index = i, action = a, time = st.clock + model.send(v) }
    else  -- RECV_F, RECV_B
      local from_stage, fr = v - 1, pr
      if op == "RECV_B" then from_stage, fr = v + 1, nr end
      if from_stage < 0 or from_stage >= S then
        refuse_here("virtual stage %d is the %s stage: it has no %s stage to receive from", v,
          v == 0 and "first" or "last", v == 0 and "previous" or "next")
      end
      if fr == r then refuse_here("virtual stage %d is on this same rank: nothing is received", from_stage) end
      if a.peer ~= fr then
        refuse_here("receives from rank %d, but the %s stage (virtual stage %d) is on rank %d", a.peer,
          op == "RECV_F" and "previous" or "next", from_stage, fr)
      end
      if st.recv[kind][k] then refuse_here("a second receive of the same %s (the first is action %d)",
        kind == "F" and "activation" or "gradient", index(r, st.recv[kind][k])) end
      local ch = channel(fr, r, kind)
      if ch.first > ch.last then return "blocked" end
      local msg = ch[ch.first]
      if msg.mb ~= m or msg.chunk ~= c then
        refuse_here("the next %s rank %d sends here is for %s%d.c%d (rank %d, action %d: %s): sends and receives are out of order",
          kind == "F" and "activation" or "gradient", fr, kind, msg.mb, msg.chunk, fr, named(fr, msg.index, msg.action))
      end
      ch[ch.first], ch.first = nil, ch.first + 1
      st.recv[kind][k] = i
      if msg.time > st.clock then st.clock = msg.time end
    end
    st.counts[op] = st.counts[op] + 1
    st.pos = i + 1
    return "ran"
  end

  -- Round robin: each rank runs as far as it can, until no rank moves. The times come from the
  -- data dependencies, not from this order.
  local moved = true
  while moved do
    moved = false
    for r = 0, pp - 1 do
      while step(r) == "ran" do moved = true end
    end
  end

  local waiting = {}
  for r = 0, pp - 1 do
    local st = ranks[r]
    local a = plan[r][st.pos]
    if a then
      local peer = ranks[a.peer]
      waiting[#waiting + 1] = ("%s waits for rank %d%s"):format(where(r, st.pos, a), a.peer,
        plan[a.peer][peer.pos] and "" or ", which has finished its list without sending it")
    end
  end
  if #waiting > 0 then refuse("no rank can go on (deadlock): %s", table.concat(waiting, "; ")) end

  -- Every send was received? (channels in a fixed order: the earliest sender's action first)
  local left = {}
  for _, ch in pairs(channels) do
    if ch.first <= ch.last then left[#left + 1] = { ch = ch, msg = ch[ch.first] } end
  end
  table.sort(left, function(x, y)
    if x.ch.src ~= y.ch.src then return x.ch.src < y.ch.src end
    return x.msg.index < y.msg.index
  end)
  if left[1] then
    local l = left[1]
    refuse("%s: rank %d never receives it", where(l.ch.src, l.msg.index, l.msg.action), l.ch.dst)
  end

  -- Every micro-batch ran forward and backward on every chunk of every rank.
  for r = 0, pp - 1 do
    local st = ranks[r]
    for m = 0, microbatches - 1 do
      for c = 0, chunks - 1 do
        local fi = st.fdone[key(m, c)]
        if not fi then
          refuse("rank %d, end of its list (%d actions): micro-batch %d never runs forward on chunk %d (no F%d.c%d)",
            r, origin and origin.count[r] or #plan[r], m, c, m, c)
        elseif not st.bdone[key(m, c)] then
          refuse("%s: its activation is never freed (no B%d.c%d after it)", where(r, fi, plan[r][fi]), m, c)
        end
      end
    end
  end

  local makespan, idle, busy = 0, 0, 0
  for r = 0, pp - 1 do makespan = math.max(makespan, ranks[r].clock) end
  local report = { name = plan.name, layout = layout or "interleaved", pp = pp, microbatches = microbatches,
                   chunks = chunks, makespan = makespan, ranks = {}, peak = 0, pending_peak = 0, memory = 0, gaps = 0 }
  for r = 0, pp - 1 do
    local st = ranks[r]
    idle, busy = idle + (makespan - st.busy), busy + st.busy
    report.ranks[r] = { peak = st.peak, busy = st.busy, idle = makespan - st.busy, actions = #plan[r],
                        forwards = st.counts.F, backwards = st.counts.B, weights = st.counts.W,
                        pending_peak = st.pending_peak, memory = st.memory_peak,
                        gaps = st.first and st.last - st.first - st.busy or 0,
                        sends = st.counts.SEND_F + st.counts.SEND_B, receives = st.counts.RECV_F + st.counts.RECV_B,
                        starts = st.starts, ends = st.ends }
    report.peak = math.max(report.peak, st.peak)
    report.pending_peak = math.max(report.pending_peak, st.pending_peak)
    report.memory = math.max(report.memory, st.memory_peak)
    report.gaps = math.max(report.gaps, report.ranks[r].gaps)
  end
  report.bubble = makespan > 0 and idle / (pp * makespan) or 0
  return report
end

return C
