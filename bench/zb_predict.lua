-- The pre-flight check's and the simulator's predictions for bench/zb, in one process: reads the
-- measured per-stage costs and bytes bench/zb wrote as a Lua file (--input), and prints one JSON
-- line a schedule: the bubble in unit time (F = B = W = 1), and with the measured durations the
-- predicted step time and each rank's peak bytes; then, for each memory cap, what
-- pipeline.search picks (its plan written to --out as a Lua file bench/zb.lua can run).
--   partrain bench/zb_predict.lua --input measured.lua --out DIR
local pt = require "partrain"
local P = require "partrain.pipeline"
local cfg = pt.args { input = "", out = "." }
local data = assert(loadfile(cfg.input))()
local pp, m = data.pp, data.microbatches

local source = function(plan) return require("partrain.plan").plan_source(plan, pp) .. "\n" end

for _, s in ipairs(data.schedules) do
  local plan, unit = P.build(s.name, pp, m, s.chunks)
  local sim = P.simulate(plan, pp, m, s.chunks, { costs = s.costs, memory = s.memory })
  local memory = {}
  for r = 0, pp - 1 do memory[r + 1] = sim.ranks[r].memory end
  print(pt.metrics.json { kind = "schedule", name = s.name, chunks = s.chunks, unit_bubble = unit.bubble,
                          unit_makespan = unit.makespan, predicted_s = sim.makespan, bubble = sim.bubble,
                          memory = memory })
end

for i, cap in ipairs(data.caps) do
  local ok, found = pcall(P.search, { stages = pp, microbatches = m, memory = cap, costs = data.costs,
                                      memory_model = data.memory, chunks = { 1, 2 } })
  if not ok then
    print(pt.metrics.json { kind = "search", cap = cap, refused = tostring(found) })
  else
    local path = ("%s/search%d.lua"):format(cfg.out, i)
    local f = assert(io.open(path, "w"))
    f:write(source(found.plan))
    f:close()
    print(pt.metrics.json { kind = "search", cap = cap, name = found.name, chunks = found.chunks,
                            predicted_s = found.makespan, memory = found.memory, plan = path })
  end
end
