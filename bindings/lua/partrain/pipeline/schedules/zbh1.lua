-- ZB-H1 (Qi et al., ICLR 2024): 1F1B's memory for a third of its bubble. Each backward is split in
-- B and W; rank r holds at most pp - r activations (1F1B's warm-up) and pp micro-batches counted
-- until their W (1F1B's peak, rank 0's), and W's fill what would be idle. One chunk a rank. In unit
-- time its step is 3m + pp - 1 (1F1B's 3(m + pp - 1)), the least any one-chunk order reaches.
-- `costs` (functions of the virtual stage, for pipeline.search) place it under measured times.
local zb = require "partrain.pipeline.schedules.zb"
return function(pp, microbatches, chunks, costs)
  if chunks ~= 1 then error(("zbh1 runs one chunk a rank, got chunks=%d (zbv runs two)"):format(chunks), 0) end
  return (zb(pp, microbatches, 1, { activations = function(r) return pp - r end, held = function() return pp end,
                                     costs = costs }))
end
