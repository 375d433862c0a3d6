-- bench/auto's runner: examples/gpt/train.lua, with the tensor memory's peak reset when its
-- training loop begins (pt.progress is made just before it), so that the memory records hold the
-- training steps' peak, what partrain plan predicts; the setup's own peak is printed apart.
local pt = require "partrain"
local progress = pt.progress
pt.progress = function(opts)
  io.stderr:write(("setup peak %d\n"):format(pt.memory().allocated_peak))
  pt.reset_peak_memory()
  return progress(opts)
end
arg[0] = "examples/gpt/train.lua"  -- the example finds its corpus from its own path
dofile(arg[0])
