-- ZB-H2 (Qi et al., ICLR 2024): about twice 1F1B's memory for no idle inside any rank's span. As
-- ZB-H1, with rank r holding up to 2(pp - r) - 1 activations and 2pp - 1 micro-batches until their
-- W, so that the warm-up's forwards fill the start and the deferred W's the end: each rank works
-- without a gap from its first action to its last. One chunk a rank. `costs` as for zbh1.
local zb = require "partrain.pipeline.schedules.zb"
return function(pp, microbatches, chunks, costs)
  if chunks ~= 1 then error(("zbh2 runs one chunk a rank, got chunks=%d (zbv runs two)"):format(chunks), 0) end
  return (zb(pp, microbatches, 1, { activations = function(r) return 2 * (pp - r) - 1 end,
                                     held = function() return 2 * pp - 1 end, costs = costs }))
end
