-- The batches llama_reference.py trains on: the first bytes of data/kjv.txt as consecutive windows
-- of seq + 1 bytes, `batch` windows a step, as an int64 tensor (steps, batch, seq + 1).
local pt = require "partrain"
return function(steps, batch, seq)
  local f = assert(io.open("data/kjv.txt", "rb"))
  local bytes = f:read(batch * (seq + 1) * steps)
  f:close()
  local values = {}
  for i = 1, #bytes do values[i] = bytes:byte(i) end
  return pt.tensor(values, { dtype = "int64" }):view(steps, batch, seq + 1)
end
