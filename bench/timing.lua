--- Timing for the benchmarks: `require "timing"` from a script in bench/ (the script's folder is
--- on the path).
local pt = require "partrain"
local T = {}

--- The median wall time of `reps` calls of fn, in seconds.
function T.median_seconds(reps, fn)
  local times = {}
  for i = 1, reps do
    local t0 = pt.time()
    fn()
    times[i] = pt.time() - t0
  end
  table.sort(times)
  return times[math.ceil(#times / 2)]
end

return T
