--- Timing for the benchmarks: `require "timing"` from a script in bench/ (the script's folder is
--- on the path).
local pt = require "partrain"
local T = {}

--- The median of a list of numbers (the lower middle one of an even count); sorts the list.
function T.median(xs)
  table.sort(xs)
  return xs[math.ceil(#xs / 2)]
end

--- The median wall time of `reps` calls of fn, in seconds.
function T.median_seconds(reps, fn)
  local times = {}
  for i = 1, reps do
    local t0 = pt.time()
    fn()
    times[i] = pt.time() - t0
  end
  return T.median(times)
end

return T
