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
-- and otherwise waits for the next arrival. Each stage takes its micro-batches in order (so every
-- channel's sends and receives agree), and the W left at the end drain. The order with 1 and 2
-- swapped is played too, and the play without room kept; the shortest is kept. zbh1, zbh2 and zbv call it with their caps;
-- pipeline.search with others and the measured costs.
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
  local arrivals = {}  -- times after now at which something arrives somewhere

  local total, done, t = pp * chunks * microbatches, 0, 0
  while done < total do
    for r = 0, pp - 1 do
      local st = ranks[r]
      if st.free <= t then
        local pick
        local function consider(op, c, m, v)
          if not pick or m < pick.mb then pick = { op = op, mb = m, chunk = c, v = v } end
        end
        local function backward()
          for c = chunks - 1, 0, -1 do
            local m, v = st.nextb[c], st.stages[c]
            if m < st.nextf[c] then
              local ready = v == S - 1 and fend[at(v, m)] or barrive[at(v + 1, m)]
              if ready and ready <= t then consider("B", c, m, v) end
            end
          end
        end
        local function forward()
          -- The oldest micro-batch this rank has started but not yet run forward through all its
          -- chunks, and how many forwards it still owes: the caps keep room for them.
          local oldest = keep_room and st.nextf[chunks - 1] < st.nextf[0] and st.nextf[chunks - 1] or nil
          local owed = 0
          if oldest then for c = 0, chunks - 1 do if st.nextf[c] <= oldest then owed = owed + 1 end end end
          for c = chunks - 1, 0, -1 do
            local m, v = st.nextf[c], st.stages[c]
            local room = m == oldest and owed or owed + 1
            if m < microbatches and st.live + room <= st.live_limit and st.held + room <= st.held_limit then
              local ready = v == 0 and 0 or farrive[at(v - 1, m)]
              if ready and ready <= t then consider("F", c, m, v) end
            end
          end
        end
        if forward_first then forward(); if not pick then backward() end
        else backward(); if not pick then forward() end end
        if not pick and st.first <= #st.pending then
          pick = st.pending[st.first]
          st.first = st.first + 1
        end
        if pick then
          local v, m = pick.v, pick.mb
          st.list[#st.list + 1] = A.action(pick.op, m, pick.chunk)
          if pick.op == "F" then
            st.free = t + cost_F(v)
            fend[at(v, m)] = st.free
            if v < S - 1 then
              local when = st.free + (owner[v + 1] == r and 0 or cost_send(v))
              farrive[at(v, m)] = when
              arrivals[#arrivals + 1] = when
            end
            st.nextf[pick.chunk] = m + 1
            st.held, st.live = st.held + 1, st.live + 1
          elseif pick.op == "B" then
            st.free = t + cost_B(v)
            if v > 0 then
              local when = st.free + (owner[v - 1] == r and 0 or cost_send(v))
              barrive[at(v, m)] = when
              arrivals[#arrivals + 1] = when
            end
            st.nextb[pick.chunk] = m + 1
            st.live = st.live - 1
            st.pending[#st.pending + 1] = { op = "W", mb = m, chunk = pick.chunk, v = v }
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
    local kept = {}
    for _, when in ipairs(arrivals) do
      if when > t then
        kept[#kept + 1] = when
        if when < next_t then next_t = when end
      end
    end
    arrivals = kept
    if next_t == math.huge then
      if done < total then return nil end  -- stuck: the caps leave no rank an action
      break
    end
    t = next_t
  end
  local plan, makespan = { layout = layout }, 0
  for r = 0, pp - 1 do
    plan[r] = ranks[r].list
    makespan = math.max(makespan, ranks[r].free)
  end
  return plan, makespan
end

--- zb(pp, microbatches, chunks, { layout = nil|"v", activations = function(r) -> n, held =
--- function(r) -> n [, costs = { F, B, W, send }: functions of the virtual stage] }) -> the plan
--- (compute only, with its layout) and its makespan as the generator played it. Four plays: B or
--- F preferred, with or without room kept for the oldest micro-batch's deeper forwards (without
--- it the caps may stop the pipeline, with it they may cost a step); the shortest is kept, the
--- first of equals. Raises when every play stops (caps below `chunks`).
return function(pp, microbatches, chunks, opts)
  local best, best_makespan
  for _, keep_room in ipairs { false, true } do
    for _, forward_first in ipairs { false, true } do
      local plan, makespan = place(pp, microbatches, chunks, opts, forward_first, keep_room)
      if plan and (not best or makespan < best_makespan) then best, best_makespan = plan, makespan end
    end
  end
  if not best then
    error(("the zero-bubble generator's caps leave no rank an action (pp=%d, microbatches=%d, chunks=%d: a cap "
      .. "below the chunks a rank?)"):format(pp, microbatches, chunks), 0)
  end
  return best, best_makespan
end
