-- Tensors handed to Lua drive its collector incrementally: a long loop of unreferenced tensors
-- keeps LibTorch's memory bounded, and one push of a tensor far larger than Lua's heap advances
-- the collector by a slice of a cycle instead of running a full collection there.
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, ok = H.test, H.ok

local MiB = 1024 * 1024

test("a long loop of 4 MiB tensors holds a bounded amount of memory", function()
  collectgarbage()
  local base = pt.memory().allocated
  local peak = 0
  for _ = 1, 400 do  -- 1.6 GB in all if nothing were freed
    local t = pt.zeros { MiB }  -- float32: 4 MiB, garbage at the next iteration
    t = t + 1
    peak = math.max(peak, pt.memory().allocated - base)
  end
  ok(peak < 128 * MiB, ("held up to %.0f MiB of tensors across 400 iterations of 8 MiB"):format(peak / MiB))
end)

test("one huge tensor takes an incremental step, not a full collection", function()
  -- A live Lua heap of some 16 MiB, a finished cycle, then one piece of garbage that says when
  -- it is collected.
  local live = {}
  for i = 1, 200000 do live[i] = { i } end
  collectgarbage()
  ok(collectgarbage("count") > 8 * 1024, "the live heap is large")
  local collected = false
  do
    local marker = newproxy(true)
    getmetatable(marker).__gc = function() collected = true end
  end
  local huge = pt.empty { 16 * MiB }  -- 64 MiB: four times the Lua heap
  ok(not collected, "a single push of a 64 MiB tensor ran a whole collection cycle")
  huge = nil
  -- The collector does advance: a few more such tensors finish the cycle.
  for _ = 1, 64 do
    if collected then break end
    local t = pt.empty { 4 * MiB }
  end
  ok(collected, "64 pushes of 16 MiB tensors never finished a collection cycle")
  live = nil
end)

H.run()
