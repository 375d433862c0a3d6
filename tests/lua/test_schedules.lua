-- partrain.pipeline: the shipped schedules pass the pre-flight check with the expected counts,
-- bubble and peak activations; broken plans are refused naming the offending action; seeded random
-- damage never trips the checker itself, whatever it accepts a second, simpler validator accepts,
-- and a refusal names the action at its place in the list the schedule returned (also when the
-- schedule gave forwards and backwards only and lowering added the transfers).
package.path = "tests/lua/?.lua;" .. package.path
local P = require "partrain.pipeline"
local H = require "harness"
local test, eq, ok, near, raises = H.test, H.eq, H.ok, H.near, H.raises

-- A plan from text: { [0] = "F0 SEND_F0->1 ...", [1] = "..." } -> { [0] = { "F0", "SEND_F0->1" }, ... }
local function plan_of(ranks)
  local plan = {}
  for r, line in pairs(ranks) do
    if type(r) ~= "number" then plan[r] = line; goto continue end  -- name, layout
    local list = type(line) == "table" and line or {}
    for word in type(line) == "string" and line:gmatch("%S+") or function() end do list[#list + 1] = word end
    plan[r] = list
    ::continue::
  end
  return plan
end

-- Megatron's interleaved warm-up for rank r (a second statement of the rule the schedule follows).
local function interleaved_peak(pp, m, chunks, r)
  local total = m * chunks
  if chunks == 1 then return math.min(pp - r, m) end
  if m == pp then return total end
  return math.min((pp - r - 1) * 2 + (chunks - 1) * pp + 1, total)
end

local function combos(fn)
  for pp = 2, 4 do
    for m = 1, 8 do
      fn("gpipe", pp, m, 1); fn("gpipe", pp, m, 2)
      fn("1f1b", pp, m, 1)
      if m % pp == 0 then for chunks = 1, 3 do fn("interleaved", pp, m, chunks) end end
    end
  end
end

test("actions print and parse in their text form", function()
  eq(P.format(P.action("F", 3, 0)), "F3.c0")
  eq(P.format(P.action("SEND_F", 3, 0, 1)), "SEND_F3.c0->1")
  eq(P.format(P.action("RECV_B", 2, 1, 3)), "RECV_B2.c1<-3")
  for _, text in ipairs { "F3.c0", "B12.c2", "SEND_F3.c0->1", "RECV_F3.c1<-0", "SEND_B0.c1->3", "RECV_B7.c0<-1" } do
    eq(P.format(P.parse(text)), text, "round trip of " .. text)
  end
  eq(P.format(P.parse("B4")), "B4.c0", "the chunk defaults to 0")
  raises(function() P.parse("SEND_F3.c0<-1") end, "'SEND_F3.c0<-1' is not an action")
  raises(function() P.parse("F3.c0->1") end, "'F3.c0->1' is not an action")
  raises(function() P.parse("X3") end, "'X3' is not an action")
  raises(function() P.parse(7) end, "an action must be a table or a string, got number")
end)

test("every shipped schedule passes the check with exact per-rank counts", function()
  local n = 0
  combos(function(name, pp, m, chunks)
    local plan, report = P.build(name, pp, m, chunks)
    local what = ("%s pp=%d m=%d chunks=%d"):format(name, pp, m, chunks)
    eq(report.name, name, what)
    for r = 0, pp - 1 do
      local rr, at = report.ranks[r], what .. " rank " .. r
      eq(rr.forwards, m * chunks, at .. " forwards")
      eq(rr.backwards, m * chunks, at .. " backwards")
      -- every pair crosses a rank boundary except into the first / out of the last virtual stage
      local first, last = r == 0 and m or 0, r == pp - 1 and m or 0
      eq(rr.sends, 2 * m * chunks - first - last, at .. " sends")
      eq(rr.receives, 2 * m * chunks - first - last, at .. " receives")
      eq(rr.actions, #plan[r], at .. " actions")
      eq(rr.actions, rr.forwards + rr.backwards + rr.sends + rr.receives, at .. " nothing else")
      eq(rr.busy, 3 * m * chunks, at .. " busy time")
    end
    n = n + 1
  end)
  eq(n, 3 * 8 * 3 + 3 * (4 + 2 + 2), "combinations checked")
end)

test("the bubble is (p-1)/(m+p-1) for 1F1B and GPipe, and chunks times smaller work for interleaved", function()
  combos(function(name, pp, m, chunks)
    local _, report = P.build(name, pp, m, chunks)
    local what = ("%s pp=%d m=%d chunks=%d"):format(name, pp, m, chunks)
    -- chunks virtual stages a rank: the fill and drain of p-1 stages costs 1/chunks of a step each
    local formula = (pp - 1) / (chunks * m + pp - 1)
    if name == "gpipe" and chunks > 1 and m < pp then
      -- fewer micro-batches than ranks: rank 0 idles until the first one wraps around from the last
      ok(report.bubble > formula + 1e-9, what .. ": GPipe over chunks with m < pp waits at the wrap-around")
      return
    end
    near(report.bubble, formula, 1e-12, what)
    if chunks == 1 then near(report.bubble, (pp - 1) / (m + pp - 1), 1e-12, what) end
    near(report.makespan, 3 * (chunks * m + pp - 1), 1e-12, what .. " makespan")
  end)
  for _, pm in ipairs { { 2, 8 }, { 4, 8 }, { 4, 16 } } do
    local pp, m = pm[1], pm[2]
    local _, one = P.build("1f1b", pp, m, 1)
    for chunks = 2, 3 do
      local _, inter = P.build("interleaved", pp, m, chunks)
      local ratio = one.bubble / inter.bubble
      ok(ratio > 0.75 * chunks and ratio <= chunks,
        ("interleaved x%d pp=%d m=%d divides 1F1B's bubble by about %d: by %.3f"):format(chunks, pp, m, chunks, ratio))
    end
  end
end)

test("peak in-flight: 1F1B holds min(pp-r, m) whatever m, GPipe holds every micro-batch", function()
  for pp = 2, 4 do
    local flat, grow = {}, {}
    for m = 1, 8 do
      local _, one = P.build("1f1b", pp, m, 1)
      local _, gp = P.build("gpipe", pp, m, 1)
      for r = 0, pp - 1 do
        eq(one.ranks[r].peak, math.min(pp - r, m), ("1f1b pp=%d m=%d rank %d peak"):format(pp, m, r))
        eq(gp.ranks[r].peak, m, ("gpipe pp=%d m=%d rank %d peak"):format(pp, m, r))
      end
      flat[m], grow[m] = one.ranks[0].peak, gp.ranks[0].peak
    end
    eq(flat[8], flat[pp], "1f1b's peak stays flat once m >= pp")
    ok(grow[8] > grow[pp], "gpipe's peak grows with m")
  end
end)

test("interleaved holds Megatron's warm-up plus one (virtual micro-batches) at its peak", function()
  combos(function(name, pp, m, chunks)
    if name ~= "interleaved" then return end
    local _, report = P.build(name, pp, m, chunks)
    for r = 0, pp - 1 do
      eq(report.ranks[r].peak, interleaved_peak(pp, m, chunks, r),
        ("interleaved pp=%d m=%d chunks=%d rank %d peak"):format(pp, m, chunks, r))
    end
  end)
end)

test("one rank: chunks hand over in place, with no transfers", function()
  for _, name in ipairs { "gpipe", "1f1b", "interleaved" } do
    local plan, report = P.build(name, 1, 3, name == "1f1b" and 1 or 2)
    eq(report.ranks[0].sends + report.ranks[0].receives, 0, name .. " transfers")
    near(report.bubble, 0, 1e-12, name .. " bubble")
    eq(#plan[0], report.ranks[0].forwards * 2, name .. " actions")
  end
end)

test("describe prints one line a rank, in order or as a timeline", function()
  local plan = P.build("1f1b", 2, 4, 1)
  eq(P.describe(plan, { transfers = false }), "rank 0: F0 F1 B0 F2 B1 F3 B2 B3\nrank 1: F0 B0 F1 B1 F2 B2 F3 B3")
  local full = P.describe(plan)
  ok(full:find("rank 0: F0 SEND_F0->1 F1 SEND_F1->1 RECV_B0<-1 B0", 1, true), full)
  eq(P.describe(plan, { timeline = true }),
    "rank 0 | F0 F1 .. .. B0 == F2 B1 == F3 B2 == .. B3 ==|\n" ..
    "rank 1 | .. F0 B0 == F1 B1 == F2 B2 == F3 B3 == .. ..|")
  eq(P.describe(P.build("interleaved", 1, 2, 2), { timeline = true }),
    -- one rank: a warm-up of (chunks-1)*pp = 1 forward, then one forward and one backward
    "rank 0 | F0.c0 F0.c1 B0.c1 ===== F1.c0 B0.c0 ===== F1.c1 B1.c1 ===== B1.c0 =====|", "one rank, two chunks")
  raises(function() P.describe(plan, { timline = true }) end, "describe has no option 'timline' (options: timeline, transfers)")
  raises(function() P.describe(42) end, "describe takes a plan, got number")
end)

-- A list's values as text, for comparing lists.
local function list(t) local out = {}; for i = 1, table.maxn(t) do out[i] = tostring(t[i]) end; return table.concat(out, ", ") end

-- A plan splitting rank 0's backwards (its W's at the end) and fusing rank 1's, at pp=2, m=2.
local mixed = { [0] = "F0 F1 B0 B1 W0 W1", [1] = "F0 B0 F1 B1" }

test("W prints and parses like F and B", function()
  eq(P.format(P.action("W", 3, 1)), "W3.c1")
  eq(P.format(P.parse("W3.c0")), "W3.c0", "round trip")
  eq(P.format(P.parse("W12")), "W12.c0", "the chunk defaults to 0")
  raises(function() P.parse("W3.c0->1") end, "'W3.c0->1' is not an action (write e.g. F3.c0, B3.c0, W3.c0,")
  raises(function() P.parse("W") end, "'W' is not an action")
end)

test("a split B takes 1 unit and its W 1, a fused B 2; W's hold pending memory from B to W", function()
  local plan, report = P.build(function() return plan_of(mixed) end, 2, 2, 1)
  eq(P.describe(plan, { transfers = false }), "rank 0: F0 F1 B0 B1 W0 W1\nrank 1: F0 B0 F1 B1")
  eq(#plan[0], 10, "lowering adds no transfer for a W (4 sends and receives, 6 computes)")
  -- by hand: rank 1 runs F0 [1,2], B0 [2,4], F1 [4,5], B1 [5,7]; rank 0 F0 F1 [0,2], B0 [4,5],
  -- B1 [7,8], W0 W1 [8,10]
  eq(report.makespan, 10)
  near(report.bubble, 8 / 20, 1e-12)
  eq(P.describe(plan, { timeline = true }),
    "rank 0 | F0 F1 .. .. B0 .. .. B1 W0 W1|\n" ..
    "rank 1 | .. F0 B0 == F1 B1 == .. .. ..|")
  local r0, r1 = report.ranks[0], report.ranks[1]
  eq(list { r0.peak, r0.pending_peak, r0.memory, r0.weights, r0.backwards, r0.gaps }, list { 2, 2, 2, 2, 2, 4 }, "rank 0")
  eq(list { r1.peak, r1.pending_peak, r1.memory, r1.weights, r1.backwards, r1.gaps }, list { 1, 0, 1, 0, 2, 0 }, "rank 1")
  eq(list { report.peak, report.pending_peak, report.memory, report.gaps }, list { 2, 2, 2, 4 }, "the largest over ranks")
  eq(r0.starts[#plan[0]], 9, "W1 starts at 9")
  eq(r0.ends[#plan[0]], 10)
  -- Measured costs: F 1 s on stage 0 and 2 s on stage 1, B 1 s, W 2 s, 0.5 s a transfer. Rank 0:
  -- F0 [0,1], F1 [1,2]; rank 1: F0 [1.5,3.5], B0 + W0 [3.5,6.5], F1 [6.5,8.5], B1 + W1 [8.5,11.5];
  -- rank 0: B0 [7,8], B1 [12,13], W0 [13,15], W1 [15,17].
  local sim = P.simulate(plan_of(mixed), 2, 2, 1, { costs = { F = { [0] = 1, [1] = 2 }, B = 1, W = 2, send = 0.5 },
                                                     memory = { activation = { [0] = 1, [1] = 5 }, pending = 3 } })
  near(sim.makespan, 17, 1e-12, "makespan")
  near(sim.bubble, (17 - 8 + 17 - 10) / 34, 1e-12, "bubble")
  near(sim.ranks[1].starts[3], 3.5, 1e-12, "rank 1's B0 starts when its F0 ends")  -- lowered: RECV_F0 F0 B0 ...
  -- rank 0 holds F0, F1 (1 + 1), then B0 keeps 3 for W0 (1 + 3), B1 another (3 + 3), W0, W1 free them
  eq(list { sim.ranks[0].memory, sim.ranks[1].memory, sim.memory }, list { 6, 5, 6 }, "bytes held")
  eq(sim.ranks[0].peak, 2, "peak still counts activations")
  -- P.check takes the same options; the defaults give the unit-time report
  local _, again = P.build(function() return plan_of(mixed) end, 2, 2, 1, nil, { costs = { W = 2 } })
  eq(again.makespan, 14, "W = 2: rank 1's fused B's take 3 (B1 ends at 9), rank 0's B1 [9,10], W's 2 each")
  eq(P.check(plan, 2, 2, 1).makespan, 10)
  eq(P.check(plan, 2, 2, 1, {}).makespan, 10)
end)

test("the V layout: stage and place invert each other; a V plan hands over in place", function()
  for pp = 1, 5 do
    for chunks = 1, 4 do
      for _, layout in ipairs { "interleaved", "v" } do
        local seen = {}
        for r = 0, pp - 1 do
          for c = 0, chunks - 1 do
            local v = P.stage(pp, r, c, layout)
            ok(v >= 0 and v < pp * chunks and not seen[v], ("%s pp=%d chunks=%d: stage of rank %d chunk %d"):format(layout, pp, chunks, r, c))
            seen[v] = true
            eq(list { P.place(pp, v, layout) }, list { r, c }, ("%s pp=%d: place(stage(%d, %d))"):format(layout, pp, r, c))
            if layout == "interleaved" then eq(P.stage(pp, r, c), v, "nil is interleaved") end
          end
        end
      end
    end
  end
  eq(list { P.stage(4, 0, 0, "v"), P.stage(4, 0, 1, "v"), P.stage(4, 3, 1, "v"), P.stage(4, 1, 3, "v") }, list { 0, 7, 4, 14 })
  eq(list { P.place(4, 7, "v") }, list { 0, 1 }, "rank 0 holds the last of 8 stages")
  raises(function() P.stage(4, 0, 1, "V") end, "layout must be \"interleaved\" (chunk c of rank r is virtual stage c * pp + r, the default) or \"v\"")
  raises(function() P.stage(4, 4, 0) end, "rank must be an integer from 0 to 3, got 4")
  raises(function() P.place(4, -1) end, "stage must be an integer from 0 up, got -1")
  -- pp = 2, 2 chunks: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2 (handed over in place)
  local v = { layout = "v", name = "v by hand", [0] = { "F0.c0", "F0.c1", "B0.c1", "B0.c0" }, [1] = { "F0.c0", "F0.c1", "B0.c1", "B0.c0" } }
  local plan, report = P.build(function() return v end, 2, 1, 2)
  eq(list { plan.layout, plan.name, report.layout }, list { "v", "v by hand", "v" }, "the lowered plan keeps its layout and name")
  eq(P.describe(plan),
    "rank 0: F0.c0 SEND_F0.c0->1 RECV_F0.c1<-1 F0.c1 B0.c1 SEND_B0.c1->1 RECV_B0.c0<-1 B0.c0\n" ..
    "rank 1: RECV_F0.c0<-0 F0.c0 F0.c1 SEND_F0.c1->0 RECV_B0.c1<-0 B0.c1 B0.c0 SEND_B0.c0->0")
  eq(report.makespan, 12)
  eq(P.lower(v, 2, 1, 2).layout, "v", "lower keeps it")
  -- the same lists read as interleaved: rank 1's chunk 1 is then the last stage, fed by rank 0
  local lowered = P.lower(v, 2, 1, 2)
  lowered.layout = nil
  raises(function() P.check(lowered, 2, 1, 2) end,
    "pipeline schedule 'v by hand': rank 1, action 3 (F0.c1): its input was not received (no RECV_F0.c1<-0 before it)")
  raises(function() P.check({ layout = "v", [0] = {}, [1] = {} }, 2, 1, 2) end, "micro-batch 0 never runs forward")
  -- one rank: every hand-over in place
  local _, one = P.build(function() return { layout = "v", [0] = { "F0.c0", "F0.c1", "B0.c1", "B0.c0" } } end, 1, 1, 2)
  eq(one.ranks[0].sends + one.ranks[0].receives, 0, "pp = 1: no transfers")
end)

test("costs and memory must be numbers or tables by virtual stage; refusals name them", function()
  local plan = plan_of(mixed)
  local function sim(opts) return function() return P.simulate(plan, 2, 2, 1, opts) end end
  raises(sim { costs = { F = 0 } }, "pipeline schedule: costs.F must be a number > 0 or a table by virtual stage { [0] = ..., [1] = ... }, got 0")
  raises(sim { costs = { W = 1 / 0 } }, "costs.W must be a number > 0 or a table by virtual stage { [0] = ..., [1] = ... }, got inf")
  raises(sim { costs = { send = -1 } }, "costs.send must be a number >= 0 or a table")
  raises(sim { costs = { B = { [0] = 1 } } }, "costs.B[1] (virtual stage 1) must be a number > 0, got nil")
  raises(sim { costs = { B = { [0] = 1, [1] = 1, [2] = 1 } } }, "costs.B has the key 2 (virtual stages are 0 to 1)")
  raises(sim { costs = { B = { 1, 1 } } }, "costs.B has the key 2 (virtual stages are 0 to 1)")
  raises(sim { costs = { X = 1 } }, "costs has no field 'X' (fields: F, B, W, send)")
  raises(sim { costs = 3 }, "costs must be a table { F, B, W, send }, got number")
  raises(sim { memory = { pending = "x" } }, "memory.pending must be a number >= 0 or a table by virtual stage { [0] = ..., [1] = ... }, got string")
  raises(sim { memory = { activations = 1 } }, "memory has no field 'activations' (fields: activation, pending")
  raises(sim { bogus = 1 }, "the simulation has no option 'bogus' (options: costs, memory)")
  raises(function() P.check(P.lower(plan, 2, 2, 1), 2, 2, 1, 5) end, "the simulation's options must be a table { costs, memory }, got number")
  raises(function() P.build(function() return plan end, 2, 2, 1, nil, { costs = { F = -1 } }) end, "costs.F must be a number > 0")
  eq(P.simulate(plan, 2, 2, 1, { memory = { activation = 0, pending = 0 } }).memory, 0, "zero bytes are allowed")
end)

-- The lowered 1F1B plan for pp=2, m=2, which the broken plans below start from.
local good = {
  [0] = "F0 SEND_F0->1 F1 SEND_F1->1 RECV_B0<-1 B0 RECV_B1<-1 B1",
  [1] = "RECV_F0<-0 F0 B0 SEND_B0->0 RECV_F1<-0 F1 B1 SEND_B1->0",
}

test("the hand-written good plan is the lowered 1F1B plan and passes", function()
  local built = P.build("1f1b", 2, 2, 1)
  eq(P.describe(built), P.describe(plan_of(good)))
  P.check(plan_of(good), 2, 2, 1)
end)

local broken = {
  { "a missing receive",
    { [0] = good[0], [1] = "RECV_F0<-0 F0 B0 SEND_B0->0 F1 B1 SEND_B1->0" },
    "pipeline schedule: rank 1, action 5 (F1.c0): its input was not received (no RECV_F1.c0<-0 before it)" },
  { "a backward before its forward",
    { [0] = good[0], [1] = "RECV_F0<-0 B0 F0 SEND_B0->0 RECV_F1<-0 F1 B1 SEND_B1->0" },
    "rank 1, action 2 (B0.c0): its forward F0.c0 has not run on this rank" },
  { "a cycle across two ranks",
    { [0] = "RECV_B0<-1 F0 SEND_F0->1 F1 SEND_F1->1 B0 RECV_B1<-1 B1", [1] = good[1] },
    "no rank can go on (deadlock): rank 0, action 1 (RECV_B0.c0<-1) waits for rank 1; rank 1, action 1 (RECV_F0.c0<-0) waits for rank 0" },
  { "a receive whose sender has finished",
    { [0] = "F0 SEND_F0->1 F1 RECV_B0<-1 B0", [1] = "RECV_F0<-0 F0 B0 SEND_B0->0 RECV_F1<-0 F1 B1 SEND_B1->0" },
    "rank 1, action 5 (RECV_F1.c0<-0) waits for rank 0, which has finished its list without sending it" },
  { "a micro-batch never run",
    { [0] = "F0 SEND_F0->1 RECV_B0<-1 B0", [1] = "RECV_F0<-0 F0 B0 SEND_B0->0" },
    "rank 0, end of its list (4 actions): micro-batch 1 never runs forward on chunk 0 (no F1.c0)" },
  { "a duplicate forward",
    { [0] = "F0 F0 SEND_F0->1 F1 SEND_F1->1 RECV_B0<-1 B0 RECV_B1<-1 B1", [1] = good[1] },
    "rank 0, action 2 (F0.c0): a second forward of micro-batch 0 on chunk 0 (the first is action 1)" },
  { "a duplicate backward",
    { [0] = good[0], [1] = "RECV_F0<-0 F0 B0 B0 SEND_B0->0 RECV_F1<-0 F1 B1 SEND_B1->0" },
    "rank 1, action 4 (B0.c0): a second backward of micro-batch 0 on chunk 0 (the first is action 3)" },
  { "a duplicate send",
    { [0] = "F0 SEND_F0->1 SEND_F0->1 F1 SEND_F1->1 RECV_B0<-1 B0 RECV_B1<-1 B1", [1] = good[1] },
    "rank 0, action 3 (SEND_F0.c0->1): a second send of the same activation (the first is action 2)" },
  { "a receive of the wrong micro-batch (order mismatch)",
    { [0] = good[0], [1] = "RECV_F1<-0 F1 B1 SEND_B1->0 RECV_F0<-0 F0 B0 SEND_B0->0" },
    "rank 1, action 1 (RECV_F1.c0<-0): the next activation rank 0 sends here is for F0.c0 (rank 0, action 2: SEND_F0.c0->1): sends and receives are out of order" },
  { "a receive on the first stage",
    { [0] = "RECV_F0<-1 F0 SEND_F0->1 F1 SEND_F1->1 RECV_B0<-1 B0 RECV_B1<-1 B1", [1] = good[1] },
    "rank 0, action 1 (RECV_F0.c0<-1): virtual stage 0 is the first stage: it has no previous stage to receive from" },
  { "a send of an activation from the last stage",
    { [0] = good[0], [1] = "RECV_F0<-0 F0 SEND_F0->0 B0 SEND_B0->0 RECV_F1<-0 F1 B1 SEND_B1->0" },
    "rank 1, action 3 (SEND_F0.c0->0): virtual stage 1 is the last stage: it has no next stage to send to" },
  { "a send before its forward ran",
    { [0] = "SEND_F0->1 F0 F1 SEND_F1->1 RECV_B0<-1 B0 RECV_B1<-1 B1", [1] = good[1] },
    "rank 0, action 1 (SEND_F0.c0->1): its forward F0.c0 has not run on this rank" },
  { "a backward without its gradient",
    { [0] = "F0 SEND_F0->1 F1 SEND_F1->1 B0 RECV_B0<-1 RECV_B1<-1 B1", [1] = good[1] },
    "rank 0, action 5 (B0.c0): its gradient was not received (no RECV_B0.c0<-1 before it)" },
  { "an activation never freed",
    { [0] = "F0 SEND_F0->1 F1 SEND_F1->1 RECV_B0<-1 B0", [1] = "RECV_F0<-0 F0 B0 SEND_B0->0 RECV_F1<-0 F1 B1" },
    "rank 0, action 3 (F1.c0): its activation is never freed (no B1.c0 after it)" },
  { "a backward whose gradient is never received",
    { [0] = "F0 SEND_F0->1 F1 SEND_F1->1 RECV_B0<-1 B0 B1", [1] = good[1] },
    "rank 0, action 7 (B1.c0): its gradient was not received" },
  { "a second send of a gradient",
    { [0] = good[0], [1] = good[1] .. " SEND_B1->0" },
    "rank 1, action 9 (SEND_B1.c0->0): a second send of the same gradient (the first is action 8)" },
  { "a send never received",
    { [0] = "F0 SEND_F0->1 F1 SEND_F1->1 RECV_B0<-1 B0", [1] = good[1] },
    "rank 1, action 8 (SEND_B1.c0->0): rank 0 never receives it" },
  { "a chunk that does not exist",
    { [0] = "F0.c1 " .. good[0], [1] = good[1] },
    "rank 0, action 1 (F0.c1): chunk must be from 0 to 0, got 1" },
  { "a micro-batch out of range",
    { [0] = good[0], [1] = good[1]:gsub("F1<", "F2<") },
    "rank 1, action 5 (RECV_F2.c0<-0): mb must be a micro-batch from 0 to 1, got 2" },
  { "an unknown op",
    { [0] = { { op = "FWD", mb = 0, chunk = 0 } }, [1] = {} },
    "rank 0, action 1 (FWD0.c0): op must be one of F, B, W, SEND_F, RECV_F, SEND_B, RECV_B, got \"FWD\"" },
  { "a compute action with a peer",
    { [0] = { { op = "F", mb = 0, chunk = 0, peer = 1 } }, [1] = {} },
    "rank 0, action 1 (F0.c0): a F has no peer (only sends and receives do), got peer=1" },
  { "an unknown field",
    { [0] = { { op = "F", mb = 0, chunk = 0, stage = 1 } }, [1] = {} },
    "rank 0, action 1 (F0.c0): an action has no field 'stage'" },
  { "a missing rank",
    { [0] = {} },
    "rank 1: its action list must be a table, got nil" },
  { "a rank too many",
    { [0] = {}, [1] = {}, [2] = {} },
    "a plan's keys are ranks 0 to 1 (and name, layout), got 2" },
  { "ranks counted from 1",
    { [1] = good[0], [2] = good[1] },
    "a plan's keys are ranks 0 to 1 (and name, layout), got 2 (ranks count from 0)" },
  { "a list with a hole",
    { [0] = { "F0", nil, "F1" }, [1] = {} },
    "rank 0: its action list has" },
  { "a W before its B",
    { [0] = good[0], [1] = "RECV_F0<-0 F0 W0 B0 SEND_B0->0 RECV_F1<-0 F1 B1 SEND_B1->0" },
    "rank 1, action 3 (W0.c0): its B0.c0 has not run on this rank (a W comes after its B)" },
  { "a second W",
    { [0] = good[0], [1] = "RECV_F0<-0 F0 B0 W0 SEND_B0->0 W0 RECV_F1<-0 F1 B1 SEND_B1->0" },
    "rank 1, action 6 (W0.c0): a second W of micro-batch 0 on chunk 0 (the first is action 4)" },
  { "a W with a peer",
    { [0] = { { op = "W", mb = 0, chunk = 0, peer = 1 } }, [1] = {} },
    "rank 0, action 1 (W0.c0): a W has no peer (only sends and receives do), got peer=1" },
  { "a layout that is not one",
    { [0] = good[0], [1] = good[1], layout = "V" },
    "a plan's layout must be \"interleaved\" (chunk c of rank r is virtual stage c * pp + r, the default) or \"v\" (odd chunks run back: c * pp + pp - 1 - r), got \"V\"" },
}

for _, case in ipairs(broken) do
  test("refused: " .. case[1], function()
    raises(function() P.check(plan_of(case[2]), 2, 2, 1) end, case[3], case[1])
  end)
end

test("refused: a send to the wrong peer (pp=3)", function()
  local plan = P.build("1f1b", 3, 1, 1)
  eq(P.format(plan[0][2]), "SEND_F0.c0->1")
  plan[0][2].peer = 2
  raises(function() P.check(plan, 3, 1, 1) end,
    "pipeline schedule '1f1b': rank 0, action 2 (SEND_F0.c0->2): sends to rank 2, but the next stage (virtual stage 1) is on rank 1")
end)

test("refused: a receive from the wrong peer (pp=3)", function()
  local plan = P.build("gpipe", 3, 1, 1)
  eq(P.format(plan[2][1]), "RECV_F0.c0<-1")
  plan[2][1].peer = 0
  raises(function() P.check(plan, 3, 1, 1) end,
    "pipeline schedule 'gpipe': rank 2, action 1 (RECV_F0.c0<-0): receives from rank 0, but the previous stage (virtual stage 1) is on rank 1")
end)

test("refused: interleaved chunks out of order across the wrap-around (last rank to rank 0)", function()
  local plan = P.build("interleaved", 2, 2, 2)
  -- rank 0 receives its chunk-1 inputs from rank 1 (virtual stage 1 -> 2); swap the two receives
  local recvs = {}
  for i, a in ipairs(plan[0]) do if a.op == "RECV_F" then recvs[#recvs + 1] = i end end
  eq(#recvs, 2, "rank 0 receives two activations")
  local i, j = recvs[1], recvs[2]
  plan[0][i], plan[0][j] = plan[0][j], plan[0][i]
  raises(function() P.check(plan, 2, 2, 2) end, ("rank 0, action %d (RECV_F1.c1<-1): the next activation rank 1 sends here is for F0.c1"):format(i))
end)

test("refusals name the script line that asked, and bad sizes and names are refused", function()
  local err = raises(function() P.check(plan_of(broken[2][2]), 2, 2, 1) end, "its forward F0.c0 has not run")
  ok(err:find("^[^:]*test_schedules%.lua:%d+: pipeline schedule: rank 1"), err)
  ok(not err:find("partrain/pipeline", 1, true), "no library location: " .. err)
  raises(function() P.build("interleaved", 3, 4, 2) end,
    "pipeline schedule 'interleaved': interleaved needs microbatches to be a multiple of pp, got microbatches=4, pp=3")
  raises(function() P.build("1f1b", 2, 4, 2) end, "1f1b runs one chunk a rank, got chunks=2")
  raises(function() P.build("zb", 2, 4, 1) end, "no shipped schedule named 'zb' (shipped: gpipe, 1f1b, interleaved, zbh1, zbh2, zbv; or pass a function)")
  raises(function() P.build("1f1b", 0, 4, 1) end, "pp must be an integer from 1 to 4096, got 0")
  raises(function() P.build("1f1b", 2, 1.5, 1) end, "microbatches must be an integer from 1 to 65536, got 1.5")
  raises(function() P.build("1f1b", 2, 4, "2") end, "chunks must be an integer from 1 to 64, got \"2\"")
  raises(function() P.build("1f1b", 4096, 65536, 1) end, "pp * microbatches * chunks = 268435456 is more actions than a plan may hold (at most 1048576)")
  raises(function() P.build(42, 2, 4, 1) end, "a schedule is a shipped name (gpipe, 1f1b, interleaved, zbh1, zbh2, zbv) or a function")
  raises(function() P.check("F0", 2, 4, 1) end, "a plan must be a table { [rank] = { actions... } }, got string")
  raises(function() P.check({ [0] = { "F0" }, [1] = { 1 } }, 2, 1, 1) end,
    "rank 1, action 1: an action must be a table or a string, got number")
end)

test("a user-written schedule goes through the same lowering and check", function()
  -- all forwards, then backwards in reverse order: valid, GPipe's peak
  local function reverse_gpipe(pp, m)
    local plan = {}
    for r = 0, pp - 1 do
      local list = {}
      for i = 0, m - 1 do list[#list + 1] = "F" .. i end
      for i = m - 1, 0, -1 do list[#list + 1] = { op = "B", mb = i } end
      plan[r] = list
    end
    return plan
  end
  local plan, report = P.build(reverse_gpipe, 3, 4)
  ok(report.name:find("test_schedules.lua:%d+$"), "named by where it is defined: " .. report.name)
  eq(report.ranks[0].peak, 4)
  near(report.bubble, 2 / 6, 1e-12)
  eq(P.describe(plan, { transfers = false }):match("^[^\n]*"), "rank 0: F0 F1 F2 F3 B3 B2 B1 B0")
  -- backwards in an order the next rank does not send: refused at the first mismatched receive
  local function mixed(pp, m)
    local plan = reverse_gpipe(pp, m)
    plan[0][m + 1], plan[0][m + 2] = plan[0][m + 2], plan[0][m + 1]
    return plan
  end
  -- (named in the list as written: lowering's transfers by their forward or backward)
  raises(function() P.build(mixed, 2, 2) end, "rank 0, action 3 (B0.c0's receive RECV_B0.c0<-1): the next gradient rank 1 "
    .. "sends here is for B1.c0 (rank 1, action 3: B1.c0's send SEND_B1.c0->0)")
  raises(function() P.build(function() error("my schedule fails") end, 2, 2) end, "my schedule fails")
  raises(function() P.build(function() error({}) end, 2, 2) end, "the function raised an error that is a table, not a message")
  raises(function() P.build(function() error() end, 2, 2) end, "the function raised an error that is nil, not a message")
  raises(function() P.build(function() return 3 end, 2, 2) end, "a plan must be a table")
  -- One that never returns is interrupted, even when it catches errors; the time limit is checked.
  local t0 = os.clock()
  raises(function() P.build(function() while true do pcall(function() while true do end end) end end, 2, 2, 1, 0.2) end,
    "did not finish within schedule_timeout = 0.2 s (interrupted at")
  ok(os.clock() - t0 < 5, "interrupted within seconds")
  -- A loop in an xpcall message handler runs without hooks (LuaJIT calls the handler of a hook's
  -- error with hooks off): the backstop ends the process, naming the limit and the line, instead
  -- of a hang. In a process of its own.
  local bin = assert(os.getenv("PARTRAIN_BIN"), "PARTRAIN_BIN names the partrain executable")
  local script = os.tmpname()
  local f = assert(io.open(script, "w"))
  f:write('local P = require "partrain.pipeline"\n',
          'P.build(function() xpcall(function() while true do end end, function() while true do end end) end, 2, 2, 1, 0.5)\n',
          'print("not reached")\n')
  f:close()
  local started = os.time()
  local out = io.popen(("timeout 60 '%s' '%s' 2>&1; echo \"status $?\""):format(bin, script)):read("*a")
  os.remove(script)
  ok(out:find("did not finish within schedule_timeout = 0.5 s and could not be interrupted", 1, true)
     and out:find("(interrupted at " .. script .. ":2)", 1, true) and out:find("status 1\n", 1, true)
     and not out:find("not reached", 1, true), "an xpcall handler that loops ends the process with the limit: " .. out)
  ok(os.time() - started < 30, "within seconds, not at the outer timeout")
  raises(function() P.build("1f1b", 2, 2, 1, -1) end, "schedule_timeout must be a number of seconds > 0, got -1")
  raises(function() P.build("1f1b", 2, 2, 1, 1 / 0) end, "schedule_timeout must be a number of seconds > 0, got inf")
  eq(#P.build("1f1b", 2, 2, 1, 5)[0], 8, "a schedule that returns in time is built")
  eq(#P.build("1f1b", 2, 2, 1, 1e9)[0], 8, "a limit of 1e9 s (none, in effect) is taken: its backstop is capped")
  -- A schedule that yields out of the build had left its limit armed: the hook raised in the
  -- script's own code a moment later.
  local built, why = coroutine.wrap(function() return pcall(P.build, function() coroutine.yield() end, 2, 2, 1, 0.2) end)()
  eq(built, false, "a schedule that yields is refused")
  ok(tostring(why):find("yield across", 1, true), "... saying it yielded: " .. tostring(why))
  local loops, started_at = 0, os.clock()
  while os.clock() - started_at < 0.6 do loops = loops + 1 end
  ok(loops > 0, "the limit is gone once the build has returned: a loop past it runs on")
end)

-- A second, simpler validator: run any rank whose next action is possible, one action at a time
-- (lowest rank first), with messages matched by identity on ordered (sender, receiver, kind)
-- queues; the plan is valid if every list runs to its end, no message is left, and every
-- (micro-batch, chunk) ran one forward then one backward on every rank, and at most one W after
-- its backward. Its own statement of the layouts: stage u is on rank u % pp, or pp - 1 - u % pp
-- when u // pp is odd under "v"; consecutive stages on one rank hand over in place.
local function brute_valid(plan, pp, m, chunks)
  local S = pp * chunks
  local layout = plan.layout
  if layout ~= nil and layout ~= "interleaved" and layout ~= "v" then return false, "a layout" end
  local function rank_of(u)
    if layout == "v" and math.floor(u / pp) % 2 == 1 then return pp - 1 - u % pp end
    return u % pp
  end
  local pos, did, got, queues = {}, {}, {}, {}
  for r = 0, pp - 1 do
    pos[r], did[r], got[r] = 1, {}, {}
    if type(plan[r]) ~= "table" then return false, "no list" end
  end
  local function q(s, d, k) local name = s .. "/" .. d .. "/" .. k; queues[name] = queues[name] or {}; return queues[name] end
  local function runnable(r, a)
    if type(a) == "string" then a = P.parse(a) end
    local op, mb, c, peer = a.op, a.mb, a.chunk or 0, a.peer
    if (op == "F" or op == "B" or op == "W") and peer ~= nil then return nil end
    if type(mb) ~= "number" or mb < 0 or mb >= m or mb % 1 ~= 0 then return nil end
    if type(c) ~= "number" or c < 0 or c >= chunks or c % 1 ~= 0 then return nil end
    local v
    for u = c * pp, c * pp + pp - 1 do if rank_of(u) == r then v = u end end
    local id = mb .. "." .. c
    local function here(u) return u >= 0 and u < S and rank_of(u) == r end  -- handed over in place
    local function id_at(u) return mb .. "." .. math.floor(u / pp) end
    if op == "F" then
      if did[r]["F" .. id] then return nil end
      if v > 0 and not (here(v - 1) and did[r]["F" .. id_at(v - 1)]) and not got[r]["F" .. id] then return nil end
      return function() did[r]["F" .. id] = true end
    elseif op == "B" then
      if did[r]["B" .. id] or not did[r]["F" .. id] then return nil end
      if v < S - 1 and not (here(v + 1) and did[r]["B" .. id_at(v + 1)]) and not got[r]["B" .. id] then return nil end
      return function() did[r]["B" .. id] = true end
    elseif op == "W" then
      if did[r]["W" .. id] or not did[r]["B" .. id] then return nil end
      return function() did[r]["W" .. id] = true end
    elseif op == "SEND_F" or op == "SEND_B" then
      local kind = op:sub(-1)
      local to = kind == "F" and v + 1 or v - 1
      if to < 0 or to >= S or here(to) or peer ~= rank_of(to) or not did[r][kind .. id] or did[r][op .. id] then return nil end
      return function()
        did[r][op .. id] = true
        table.insert(q(r, peer, kind), id_at(to))
      end
    elseif op == "RECV_F" or op == "RECV_B" then
      local kind = op:sub(-1)
      local from = kind == "F" and v - 1 or v + 1
      if from < 0 or from >= S or here(from) or peer ~= rank_of(from) or got[r][kind .. id] then return nil end
      local queue = q(peer, r, kind)
      if queue[1] ~= id then return nil end
      return function() table.remove(queue, 1); got[r][kind .. id] = true end
    end
    return nil
  end
  while true do
    local moved = false
    for r = 0, pp - 1 do
      local a = plan[r][pos[r]]
      local run = a and runnable(r, a)
      if run then run(); pos[r] = pos[r] + 1; moved = true; break end
    end
    if not moved then break end
  end
  for r = 0, pp - 1 do
    if pos[r] <= #plan[r] then return false, "rank " .. r .. " stuck" end
    for mb = 0, m - 1 do
      for c = 0, chunks - 1 do
        if not (did[r]["F" .. mb .. "." .. c] and did[r]["B" .. mb .. "." .. c]) then return false, "missing compute" end
      end
    end
  end
  for _, queue in pairs(queues) do if #queue > 0 then return false, "message left" end end
  return true
end

-- The second validator on anything: an ill-formed action it cannot read makes the plan invalid.
local function brute(plan, pp, m, chunks)
  local good_call, valid, why = pcall(brute_valid, plan, pp, m, chunks)
  if not good_call then return false, valid end
  return valid, why
end

test("the second validator agrees with the check on the shipped and the broken plans", function()
  combos(function(name, pp, m, chunks)
    local plan = P.build(name, pp, m, chunks)
    ok(brute_valid(plan, pp, m, chunks), ("%s pp=%d m=%d chunks=%d"):format(name, pp, m, chunks))
  end)
  ok(brute_valid(plan_of(good), 2, 2, 1), "the good plan")
  ok(brute_valid(P.build(function() return plan_of(mixed) end, 2, 2, 1), 2, 2, 1), "split and fused backwards")
  local v = { layout = "v", [0] = { "F0.c0", "F0.c1", "B0.c1", "B0.c0" }, [1] = { "F0.c0", "F0.c1", "B0.c1", "B0.c0" } }
  ok(brute_valid(P.build(function() return v end, 2, 1, 2), 2, 1, 2), "a V plan")
  local wrong = P.lower(v, 2, 1, 2)
  wrong.layout = nil
  ok(not brute(wrong, 2, 1, 2), "a V plan read as interleaved")
  for _, case in ipairs(broken) do
    local plan = plan_of(case[2])
    ok(not brute(plan, 2, 2, 1), "the second validator refuses " .. case[1])
  end
end)

-- ---- The zero-bubble schedules ----------------------------------------------------------------

-- Builds a shipped zero-bubble schedule; checks what every plan of the family must be: valid for
-- the second validator, every backward split, a W per backward on every rank.
local function zero_bubble(name, pp, m, chunks)
  local plan, report = P.build(name, pp, m, chunks)
  local what = ("%s pp=%d m=%d"):format(name, pp, m)
  ok(brute_valid(plan, pp, m, chunks), what .. ": the second validator agrees")
  for r = 0, pp - 1 do
    eq(report.ranks[r].weights, m * chunks, what .. " rank " .. r .. ": a W for every backward")
    eq(report.ranks[r].busy, 3 * m * chunks, what .. " rank " .. r .. ": busy 3 units a micro-batch's chunk")
  end
  return plan, report, what
end

test("every zero-bubble schedule passes the check at pp 1 to 8 and any m", function()
  for pp = 1, 8 do
    for m = 1, 4 * pp + 1 do
      zero_bubble("zbh1", pp, m, 1); zero_bubble("zbh2", pp, m, 1); zero_bubble("zbv", pp, m, 2)
    end
  end
  raises(function() P.build("zbh1", 2, 4, 2) end, "pipeline schedule 'zbh1': zbh1 runs one chunk a rank, got chunks=2 (zbv runs two)")
  raises(function() P.build("zbh2", 2, 4, 2) end, "zbh2 runs one chunk a rank, got chunks=2")
  raises(function() P.build("zbv", 2, 4, 1) end, "zbv runs two chunks a rank in V placement, got chunks=1")
end)

test("zbh1 holds 1F1B's activations and peak, for a third of its idle: 3m + pp - 1 units", function()
  for _, pp in ipairs { 2, 4, 8 } do
    for _, m in ipairs { pp, 2 * pp, 3 * pp, 4 * pp } do
      local _, zb, what = zero_bubble("zbh1", pp, m, 1)
      local _, one = P.build("1f1b", pp, m, 1)
      eq(zb.makespan, 3 * m + pp - 1, what .. ": makespan")
      for r = 0, pp - 1 do
        eq(zb.ranks[r].peak, one.ranks[r].peak, what .. ": rank " .. r .. "'s activations, as 1F1B's")
        eq(zb.ranks[r].idle, pp - 1, what .. ": rank " .. r .. "'s idle")
        eq(one.ranks[r].idle, 3 * (pp - 1), "1f1b: rank " .. r .. "'s idle, three times as much")
      end
      eq(zb.memory, one.memory, what .. ": the peak, activations and pending W's, is 1F1B's (rank 0's)")
      near(zb.bubble, (pp - 1) / (3 * m + pp - 1), 1e-12, what .. ": bubble")
      ok(zb.bubble < one.bubble, what .. ": less than 1F1B's")
    end
  end
end)

test("zbh2 leaves no idle inside any rank's span, holding up to 2pp - 1; it gains when B outweighs W", function()
  for _, pp in ipairs { 2, 4, 8 } do
    for _, m in ipairs { pp, 2 * pp, 3 * pp, 4 * pp } do
      local plan, zb, what = zero_bubble("zbh2", pp, m, 1)
      eq(zb.makespan, 3 * m + pp - 1, what .. ": makespan (the last rank's ramp, pp - 1 units, is unavoidable)")
      if m >= 2 * pp - 1 then eq(zb.gaps, 0, what .. ": gaps") end
      ok(zb.memory <= 2 * pp - 1, what .. ": memory")
      for r = 0, pp - 1 do ok(zb.ranks[r].peak <= 2 * (pp - r) - 1, what .. ": rank " .. r .. "'s activations") end
      -- B twice F and W: ZB-H1 idles at least (pp-1)(F + B - W) a rank, ZB-H2 (once m fills its
      -- warm-up) only the last rank's ramp, (pp-1) F: the least any order can
      local costs = { costs = { F = 1, B = 2, W = 1 } }
      local h1 = P.simulate(P.build("zbh1", pp, m, 1), pp, m, 1, costs)
      local h2 = P.simulate(plan, pp, m, 1, costs)
      ok(h1.makespan >= 4 * m + 2 * (pp - 1), what .. ": ZB-H1 with B = 2")
      if m >= 2 * pp then
        near(h2.makespan, 4 * m + pp - 1, 1e-12, what .. ": ZB-H2 with B = 2")
        ok(h2.makespan < h1.makespan, what .. ": ZB-H2 gains")
      end
    end
  end
end)

test("zbv: V placement, two chunks of half a stage, 1F1B's peak in bytes, half of ZB-H1's ramp", function()
  for _, pp in ipairs { 2, 4, 8 } do
    for _, m in ipairs { pp, 2 * pp, 3 * pp, 4 * pp } do
      local plan, zb, what = zero_bubble("zbv", pp, m, 2)
      local _, one = P.build("1f1b", pp, m, 1)
      local _, h1 = P.build("zbh1", pp, m, 1)
      eq(plan.layout, "v", what .. ": layout")
      eq(P.stage(pp, 0, 1, plan.layout), 2 * pp - 1, what .. ": rank 0 holds the last stage")
      eq(zb.makespan, 6 * m + pp - 1, what .. ": makespan in chunk units")
      near(zb.bubble, (pp - 1) / (6 * m + pp - 1), 1e-12, what .. ": bubble")
      ok(zb.bubble < h1.bubble, what .. ": less than ZB-H1's")
      local half = P.simulate(plan, pp, m, 2, { costs = { F = 0.5, B = 0.5, W = 0.5 }, memory = { activation = 0.5, pending = 0.5 } })
      ok(half.memory <= one.memory, ("%s: a chunk half a stage: peak %g, 1F1B's %g"):format(what, half.memory, one.memory))
      near(half.makespan, zb.makespan / 2, 1e-12, what .. ": the times in whole-stage units, unchanged")
    end
  end
end)

-- ---- The search -------------------------------------------------------------------------------

-- The fastest candidate that fits `cap` (the smaller memory on a tie), from a search's list.
local function fastest(candidates, cap)
  local best
  for _, c in ipairs(candidates) do
    if c.memory <= cap and (not best or c.makespan < best.makespan - 1e-9
                            or (math.abs(c.makespan - best.makespan) <= 1e-9 and c.memory < best.memory)) then best = c end
  end
  return best
end

test("search picks the fastest schedule that fits, under three caps, and refuses below the least", function()
  local pp, m = 4, 8
  local all = P.search { stages = pp, microbatches = m, memory = math.huge }
  local least = math.huge
  for _, c in ipairs(all.candidates) do
    least = math.min(least, c.memory)
    ok(not c.name:find("%s"), "a candidate's name is one word (partrain plan prints them in columns): " .. c.name)
  end
  eq(least, 1, "one micro-batch held at a time (zb with cap 1) is the least")
  local _, one = P.build("1f1b", pp, m, 1)
  local _, h1 = P.build("zbh1", pp, m, 1)
  local _, v = P.build("zbv", pp, m, 2)
  for _, cap in ipairs { least, one.memory, 100 } do
    local found = P.search { stages = pp, microbatches = m, memory = cap }
    local what = ("cap %g"):format(cap)
    ok(found.memory <= cap, what .. ": fits")
    local want = fastest(found.candidates, cap)
    eq(found.makespan, want.makespan, what .. ": the fastest that fits")
    eq(found.name, want.name, what .. ": its name")
    eq(found.plan.name, found.name, what .. ": the plan is named")
    ok(found.plan.layout == "interleaved" or found.plan.layout == "v", what .. ": the plan says its layout")
    -- the plan is kept as it is and handed back as a schedule
    local plan, report = P.build(function() return found.plan end, pp, m, found.chunks)
    eq(plan.layout, found.plan.layout, what .. ": built with its layout")
    near(report.makespan / found.chunks, found.makespan, 1e-9, what .. ": the check agrees (units of a chunk)")
    for r = 0, pp - 1 do
      for _, a in ipairs(found.plan[r]) do ok(a.op == "F" or a.op == "B" or a.op == "W", what .. ": compute only") end
    end
    if cap == one.memory then ok(found.makespan <= h1.makespan, what .. ": 1F1B's memory gets ZB-H1's time or better") end
    if cap == 100 then near(found.makespan, v.makespan / 2, 1e-9, what .. ": ZB-V's time (whole-stage units)") end
  end
  raises(function() P.search { stages = pp, microbatches = m, memory = 0.99 } end,
    ("pipeline search: no schedule fits memory = 0.99 a rank: the least any of the %d candidates needs is 1 ("):format(#all.candidates))
  -- only 1 chunk: no V
  local flat = P.search { stages = pp, microbatches = m, memory = 100, chunks = { 1 } }
  eq(flat.chunks, 1)
  eq(flat.makespan, h1.makespan, "one chunk a rank: ZB-H1's time is the least")
end)

test("search weighs measured costs and bytes; what it predicts, the check of its plan gives", function()
  local pp, m = 4, 8
  local costs, model = { F = 2, B = 3, W = 1, send = 0.25 }, { activation = 10, pending = 4 }
  local _, one = P.build("1f1b", pp, m, 1)
  local one_sim = P.simulate(P.build("1f1b", pp, m, 1), pp, m, 1, { costs = costs, memory = model })
  local found = P.search { stages = pp, microbatches = m, memory = one_sim.memory, costs = costs, memory_model = model }
  ok(found.makespan < one_sim.makespan, ("faster than 1F1B in its memory: %g < %g"):format(found.makespan, one_sim.makespan))
  eq(fastest(found.candidates, one_sim.memory).makespan, found.makespan, "the fastest that fits")
  local c = found.chunks
  local sim = P.simulate(found.plan, pp, m, c, {
    costs = { F = costs.F / c, B = costs.B / c, W = costs.W / c, send = costs.send },
    memory = { activation = model.activation / c, pending = model.pending / c } })
  near(sim.makespan, found.makespan, 1e-9, "the predicted step time")
  near(sim.memory, found.memory, 1e-9, "the predicted peak")
  ok(one.memory == 4, "1F1B holds 4 micro-batches on rank 0")
end)

test("search refuses what it cannot read, naming it", function()
  local function search(opts) return function() return P.search(opts) end end
  raises(search(5), "pipeline search: search takes a table { stages, microbatches, memory, ... }, got number")
  raises(search { microbatches = 4, memory = 4 }, "search needs stages (the pipeline's ranks)")
  raises(search { stages = 2, memory = 4 }, "search needs microbatches")
  raises(search { stages = 2, microbatches = 4 }, "search needs memory")
  raises(search { stages = 0, microbatches = 4, memory = 4 }, "search's stages must be an integer from 1 to 4096, got 0")
  raises(search { stages = 2, microbatches = 4, memory = -1 }, "search's memory (the most a rank may hold) must be a number > 0, got -1")
  raises(search { stages = 2, microbatches = 4, memory = 4, chunks = {} }, "search's chunks must be a list of chunk counts such as { 1, 2 }, got an empty table")
  raises(search { stages = 2, microbatches = 4, memory = 4, chunks = { 1, 0 } }, "search's chunks[2] must be an integer from 1 to 64, got 0")
  raises(search { stages = 2, microbatches = 4, memory = 4, costs = { F = 0 } }, "search's costs.F must be a number > 0 (a whole stage's, at one chunk a rank), got 0")
  raises(search { stages = 2, microbatches = 4, memory = 4, costs = { F = { [0] = 1 } } }, "search's costs.F must be a number > 0 (a whole stage's, at one chunk a rank), got table")
  raises(search { stages = 2, microbatches = 4, memory = 4, costs = { G = 1 } }, "search's costs has no field 'G' (fields: F, B, W, send)")
  raises(search { stages = 2, microbatches = 4, memory = 4, memory_model = { activation = -1 } }, "search's memory_model.activation must be a number >= 0")
  raises(search { stages = 2, microbatches = 4, memory = 4, layout = "v" }, "search has no option 'layout' (options: stages, microbatches, memory, costs, memory_model, chunks)")
  local err = raises(function() local found = P.search { stages = 2, microbatches = 4, memory = "4" }; return found end, "got string")
  ok(err:find("^[^:]*test_schedules%.lua:%d+: pipeline search: "), "at the caller's line: " .. err)
end)

test("seeded random damage: refused clearly or accepted and valid, never a checker error", function()
  math.randomseed(20261122)
  local bases = {}
  combos(function(name, pp, m, chunks)
    if m <= 4 then bases[#bases + 1] = { name, pp, m, chunks } end
  end)
  -- 1F1B with every backward split, its W right after its B or all W's at the end
  local function split(at_end)
    return function(pp, m)
      local plan = P.schedule("1f1b", pp, m, 1)
      for r = 0, pp - 1 do
        local list, ws = {}, {}
        for _, a in ipairs(plan[r]) do
          list[#list + 1] = a
          if a.op == "B" then table.insert(at_end and ws or list, P.action("W", a.mb, a.chunk)) end
        end
        for _, w in ipairs(ws) do list[#list + 1] = w end
        plan[r] = list
      end
      return plan
    end
  end
  for pp = 2, 3 do
    for m = 1, 4 do
      bases[#bases + 1] = { split(false), pp, m, 1 }; bases[#bases + 1] = { split(true), pp, m, 1 }
      bases[#bases + 1] = { "zbh1", pp, m, 1 }; bases[#bases + 1] = { "zbh2", pp, m, 1 }; bases[#bases + 1] = { "zbv", pp, m, 2 }
    end
  end
  local function copy(plan, pp)
    local out = { name = plan.name, layout = plan.layout }
    for r = 0, pp - 1 do
      out[r] = {}
      for i, a in ipairs(plan[r]) do out[r][i] = { op = a.op, mb = a.mb, chunk = a.chunk, peer = a.peer } end
    end
    return out
  end
  local ops = { "F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B" }
  local junk = { "F0", "B1.c1", "W0", "W1.c1", { op = "W", mb = 0, chunk = 0, peer = 0 }, "RECV_F0.c0<-0", "SEND_B0->0", "X1", "F", "", 5, true, {}, { op = "F" },
                 { op = "F", mb = 0.5 }, { op = "SEND_F", mb = 0, chunk = 0, peer = -1 }, { op = "B", mb = 2^60 },
                 { op = "F", mb = 0, chunk = 0 / 0 }, { op = "RECV_B", mb = 0, chunk = 0, peer = "1" } }
  local pick_layout = { "v", "interleaved", "V", 1 }
  local tally = { refused = 0, accepted = 0 }
  local mutations = 0
  local started = os.clock()
  for trial = 1, 3000 do
    local b = bases[math.random(#bases)]
    local name, pp, m, chunks = b[1], b[2], b[3], b[4]
    local plan = copy(P.build(name, pp, m, chunks), pp)
    for _ = 1, math.random(3) do
      local r = math.random(0, pp - 1)
      local list = plan[r]
      local n = #list
      local i, j = math.random(n), math.random(n)
      local kind = math.random(12)
      if kind >= 3 and kind <= 7 and type(list[i]) ~= "table" then kind = 1 end
      if kind == 1 then list[i], list[j] = list[j], list[i]                               -- swap
      elseif kind == 2 then table.remove(list, i)                                          -- delete
      elseif kind == 3 then table.insert(list, j, { op = list[i].op, mb = list[i].mb, chunk = list[i].chunk, peer = list[i].peer })
      elseif kind == 4 then list[i].mb = (tonumber(list[i].mb) or 0) + math.random(-1, 1)  -- mb
      elseif kind == 5 then list[i].peer = math.random(0, pp)                              -- peer
      elseif kind == 6 then list[i].chunk = math.random(0, chunks)                         -- chunk
      elseif kind == 7 then list[i].op = ops[math.random(#ops)]                            -- op
      elseif kind == 8 then                                                                -- move to another rank
        local other = plan[math.random(0, pp - 1)]
        table.insert(other, math.random(#other + 1), table.remove(list, i))
      elseif kind == 9 then local k = math.random(i, math.min(n, i + 3)); list[i], list[k] = list[k], list[i]  -- near swap
      elseif kind == 10 then list[i] = H.shallow_copy(junk[math.random(#junk)])                            -- junk
      elseif kind == 11 then table.insert(list, j, { op = "W", mb = math.random(0, m - 1), chunk = math.random(0, chunks - 1) })  -- a W
      else plan.layout = pick_layout[math.random(#pick_layout)] end                                         -- layout
      mutations = mutations + 1
    end
    -- A quarter of the plans lose their transfers: lowering adds them again, and a refusal must
    -- still name the place in the list as written.
    local written = plan
    if math.random(4) == 1 then
      for r = 0, pp - 1 do
        local kept = {}
        for _, a in ipairs(plan[r]) do if type(a) ~= "table" or not tostring(a.op):find("_") then kept[#kept + 1] = a end end
        plan[r] = kept
      end
      local lowered_ok, lowered = pcall(P.lower, plan, pp, m, chunks)
      plan = lowered_ok and lowered or plan
    end
    local good_call, result, report = pcall(P.build, function() return written end, pp, m, chunks)
    if good_call then
      tally.accepted = tally.accepted + 1
      local valid, why = brute(plan, pp, m, chunks)
      ok(valid, ("trial %d: the check accepted a plan the second validator refuses (%s)"):format(trial, tostring(why)))
      eq(report.ranks[0].forwards, m * chunks, "an accepted plan runs every forward")
    else
      tally.refused = tally.refused + 1
      ok(type(result) == "string", "a refusal is a message")
      ok(result:find("^[^:]*test_schedules%.lua:%d+: pipeline schedule '[^']*': "), ("trial %d: not a clear refusal: %s"):format(trial, result))
      ok(result:find("pipeline schedule '[^']*': rank %d+") or result:find("pipeline schedule '[^']*': no rank can go on")
         or result:find("pipeline schedule '[^']*': a plan's layout must be"),
        ("trial %d: a refusal names a rank (or the layout): %s"):format(trial, result))
      ok(not result:find("partrain/pipeline", 1, true) and not result:find("attempt to", 1, true),
        ("trial %d: the checker's own error: %s"):format(trial, result))
      ok(not brute(plan, pp, m, chunks), ("trial %d: refused a plan the second validator accepts: %s"):format(trial, result))
      for r, i, text in result:gmatch("rank (%d+), action (%d+) %(([^)]*)%)") do
        local a = written[tonumber(r)][tonumber(i)]
        ok(a ~= nil, ("trial %d: names rank %s's action %s, past its list: %s"):format(trial, r, i, result))
        local own = text:match("^(.-)'s send ") or text:match("^(.-)'s receive ") or text
        local shown = type(a) == "table" and { op = a.op, mb = a.mb, chunk = a.chunk or 0, peer = a.peer }
        ok(own == P.format(a) or own == P.format(shown or P.parse(a)),
          ("trial %d: names %s as rank %s's action %s, which is %s: %s"):format(trial, text, r, i, P.format(a), result))
      end
    end
  end
  print(("  random damage: %d plans (%d mutations): %d refused, %d accepted, %.1f s"):format(
    tally.refused + tally.accepted, mutations, tally.refused, tally.accepted, os.clock() - started))
  ok(tally.refused > 2000 and tally.accepted > 0, "the damage both breaks plans and leaves some valid")
end)

H.run()
