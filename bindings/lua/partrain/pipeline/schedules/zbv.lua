-- ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024; torchtitan's
-- ZBVZeroBubble): two chunks a rank in V placement (layout "v": rank r runs stages r and
-- 2pp - 1 - r, so rank 0 holds the first and the last), each backward split in B and W. Every rank
-- holds at most 2pp chunks' activations, until their W: with chunks of half a stage, 1F1B's peak
-- in bytes, for half of ZB-H1's ramp. `costs` as for zbh1.
local zb = require "partrain.pipeline.schedules.zb"
return function(pp, microbatches, chunks, costs)
  if chunks ~= 2 then error(("zbv runs two chunks a rank in V placement, got chunks=%d"):format(chunks), 0) end
  return (zb(pp, microbatches, 2, { layout = "v", activations = function() return 2 * pp end,
                                     held = function() return 2 * pp end, costs = costs }))
end
