-- The zero-bubble family's generator (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024):
-- every backward split in B (the input's gradient, on the critical path) and W (the weights',
-- deferrable), placed by a list scheduler that plays all ranks together, in unit time (F = B = W =
-- 1, transfers free) or under given costs. A rank that is free runs, in this order of preference:
--   1. a ready B (the earliest micro-batch; the deeper stage first): the previous stage waits on it;
--   2. a ready F (the same order), while it holds fewer activations than `activations(r)` (a
--      micro-batch's chunk from its F to its B) and fewer micro-batch chunks than `held(r)` (from
--      its F to its W: the activations, then what W needs), in one play keeping room for the
--      forwards the oldest micro-batch it has started still owes its deeper chunks (so that caps
--      of at least `chunks` never stop the pipeline);
--   3. its oldest pending W, which fills what would be a bubble;
-- and otherwise waits for the next arrival. Each stage takes its micro-batches in order, and a
-- rank takes what another sent it in the order it was sent (the executor's channels are ordered),
-- so every plan it makes passes the check; the W left at the end drain. The order with 1 and 2
-- swapped is played too, and the play without room kept; the shortest is kept. zbh1, zbh2 and
-- zbv call it with their caps; pipeline.search with others and the measured costs.
local A = require "partrain.pipeline.actions"

local function unit() return 1 end
local function free() return 0 end

-- One play of the list scheduler: the plan and its makespan.
local function place(pp, microbatches, chunks, opts, forward_first, keep_room)
  local layout, S = opts.layout, pp * chunks
  local costs = opts.costs or {}
  local cost_F, cost_B, cost_W, cost_send = costs.F or unit, costs.B or unit, costs.W or unit, costs.send or free
  -- [v * microbatches + m]: when the F (B) of micro-batch m at virtual stage v ended, and when its
  -- output can be used on the rank of stage v + 1 (v - 1): at once on the same rank, else after a send.
  local fend, farrive, barrive = {}, {}, {}
  local function at(v, m) return v * microbatches + m end
  local owner = {}
  for v = 0, S - 1 do owner[v] = A.place(pp, v, layout) end
  local ranks = {}
  for r = 0, pp - 1 do
    local st = { free = 0, held = 0, live = 0, list = {}, stages = {}, nextf = {}, nextb = {}, pending = {}, first = 1,
                 live_limit = math.max(1, opts.activations(r)), held_limit = math.max(1, opts.held(r)) }
    for c = 0, chunks - 1 do st.stages[c], st.nextf[c], st.nextb[c] = A.stage(pp, r, c, layout), 0, 0 end
    ranks[r] = st
  end
  -- The times at which something arrives somewhere, as a binary min-heap.
  local arrivals, narrivals = {}, 0
  local function arrive(when)
    narrivals = narrivals + 1
    local i = narrivals
    while i > 1 and arrivals[math.floor(i / 2)] > when do
      arrivals[i] = arrivals[math.floor(i / 2)]
      i = math.floor(i / 2)
    end
    arrivals[i] = when
  end
  local function first_arrival_after(t)  -- drops the arrivals up to t; the earliest after it
    while narrivals > 0 and arrivals[1] <= t do
      local last = arrivals[narrivals]
      arrivals[narrivals], narrivals = nil, narrivals - 1
      local i = 1
      while true do
        local c = 2 * i
        if c > narrivals then break end
        if c < narrivals and arrivals[c + 1] < arrivals[c] then c = c + 1 end
        if arrivals[c] >= last then break end
        arrivals[i] = arrivals[c]
        i = c
      end
      if narrivals > 0 then arrivals[i] = last end
    end
    return narrivals > 0 and arrivals[1] or math.huge
  end
  local capped = false  -- whether the caps ever held back a ready F
  -- The executor's ordered channels, one per (kind, sender, receiver): [kind][src * pp + dst] =
  -- { first, last, [i] = at(v, m) of the stage the i-th message feeds }. A rank takes a message
  -- only at its channel's head, so that its receives come in the order of the sends.
  local channels = { F = {}, B = {} }
  local function post(kind, src, dst, key)
    local ch = channels[kind][src * pp + dst]
    if not ch then ch = { first = 1, last = 0 }; channels[kind][src * pp + dst] = ch end
    ch.last = ch.last + 1
    ch[ch.last] = key
  end
  local function heads(kind, src, dst, key)
    local ch = channels[kind][src * pp + dst]
    return ch ~= nil and ch.first <= ch.last and ch[ch.first] == key
  end
  local function take(kind, src, dst)
    local ch = channels[kind][src * pp + dst]
    ch[ch.first] = nil
    ch.first = ch.first + 1
  end

  -- The B rank r would take at time t (the earliest micro-batch, the deeper stage first): its
  -- chunk, micro-batch and stage, or nil.
  local function backward(st, r, t)
    local pc, pm, pv
    for c = chunks - 1, 0, -1 do
      local m, v = st.nextb[c], st.stages[c]
      if m < st.nextf[c] and (not pm or m < pm) then
        local ready = v == S - 1 and fend[at(v, m)] or barrive[at(v + 1, m)]
        if ready and ready <= t and (v == S - 1 or owner[v + 1] == r or heads("B", owner[v + 1], r, at(v, m))) then
          pc, pm, pv = c, m, v
        end
      end
    end
    return pc, pm, pv
  end
  -- The F rank r would take at time t under its caps, likewise.
  local function forward(st, r, t)
    -- The oldest micro-batch this rank has started but not yet run forward through all its
    -- chunks, and how many forwards it still owes them: the caps keep room for these.
    local oldest = keep_room and st.nextf[chunks - 1] < st.nextf[0] and st.nextf[chunks - 1] or nil
    local owed = 0
    if oldest then for c = 0, chunks - 1 do if st.nextf[c] <= oldest then owed = owed + 1 end end end
    local pc, pm, pv
    for c = chunks - 1, 0, -1 do
      local m, v = st.nextf[c], st.stages[c]
      local room = m == oldest and owed or owed + 1
      if m < microbatches and (not pm or m < pm) then
        local ready = v == 0 and 0 or farrive[at(v - 1, m)]
        if ready and ready <= t and (v == 0 or owner[v - 1] == r or heads("F", owner[v - 1], r, at(v, m))) then
          if st.live + room <= st.live_limit and st.held + room <= st.held_limit then
            pc, pm, pv = c, m, v
          else
            capped = true
          end
        end
      end
    end
    return pc, pm, pv
  end

  local total, done, t = pp * chunks * microbatches, 0, 0
  while done < total do
    for r = 0, pp - 1 do
      local st = ranks[r]
      if st.free <= t then
        local op, c, m, v
        if forward_first then
          op, c, m, v = "F", forward(st, r, t)
          if not c then op, c, m, v = "B", backward(st, r, t) end
        else
          op, c, m, v = "B", backward(st, r, t)
          if not c then op, c, m, v = "F", forward(st, r, t) end
        end
        if not c and st.first <= #st.pending then
          local w = st.pending[st.first]
          op, c, m, v = "W", w.chunk, w.mb, w.v
          st.first = st.first + 1
        end
        if c then
          st.list[#st.list + 1] = A.action(op, m, c)
          if op == "F" then
            if v > 0 and owner[v - 1] ~= r then take("F", owner[v - 1], r) end
            st.free = t + cost_F(v)
            fend[at(v, m)] = st.free
            if v < S - 1 then
              local when = st.free + (owner[v + 1] == r and 0 or cost_send(v))
              farrive[at(v, m)] = when
              arrive(when)
              if owner[v + 1] ~= r then post("F", r, owner[v + 1], at(v + 1, m)) end
            end
            st.nextf[c] = m + 1
            st.held, st.live = st.held + 1, st.live + 1
          elseif op == "B" then
            if v < S - 1 and owner[v + 1] ~= r then take("B", owner[v + 1], r) end
            st.free = t + cost_B(v)
            if v > 0 then
              local when = st.free + (owner[v - 1] == r and 0 or cost_send(v))
              barrive[at(v, m)] = when
              arrive(when)
              if owner[v - 1] ~= r then post("B", r, owner[v - 1], at(v - 1, m)) end
            end
            st.nextb[c] = m + 1
            st.live = st.live - 1
            st.pending[#st.pending + 1] = { mb = m, chunk = c, v = v }
          else
            st.free = t + cost_W(v)
            st.held = st.held - 1
            done = done + 1
          end
        end
      end
    end
    -- on to the next moment something changes: a rank gets free or an output arrives
    local next_t = math.huge
    for r = 0, pp - 1 do
      if ranks[r].free > t and ranks[r].free < next_t then next_t = ranks[r].free end
    end
    next_t = math.min(next_t, first_arrival_after(t))
    if next_t == math.huge then
      if done < total then return nil, nil, true end  -- stuck: the caps leave no rank an action
      break
    end
    t = next_t
  end
  local plan, makespan = { layout = layout }, 0
  for r = 0, pp - 1 do
    plan[r] = ranks[r].list
    makespan = math.max(makespan, ranks[r].free)
  end
  return plan, makespan, capped
end

--- zb(pp, microbatches, chunks, { layout = nil|"v", activations = function(r) -> n, held =
--- function(r) -> n [, costs = { F, B, W, send }: functions of the virtual stage] }) -> the plan
--- (compute only, with its layout), its makespan as the generator played it, and whether the
--- caps held anything back (if not, larger caps give the same plan). Up to four plays: B or F
--- preferred, and at two chunks or more with or without room kept for the oldest micro-batch's
--- deeper forwards (without it the caps may stop the pipeline, with it they may cost a step); the
--- shortest is kept, the first of equals. Raises when every play stops (caps below `chunks`).
return function(pp, microbatches, chunks, opts)
  local best, best_makespan, bound = nil, nil, false
  for _, keep_room in ipairs(chunks > 1 and { false, true } or { false }) do
    for _, forward_first in ipairs { false, true } do
      local plan, makespan, capped = place(pp, microbatches, chunks, opts, forward_first, keep_room)
      bound = bound or capped
      if plan and (not best or makespan < best_makespan) then best, best_makespan = plan, makespan end
    end
  end
  if not best then
    error(("the zero-bubble generator's caps leave no rank an action (pp=%d, microbatches=%d, chunks=%d: a cap "
      .. "below the chunks a rank?)"):format(pp, microbatches, chunks), 0)
  end
  return best, best_makespan, bound
end
