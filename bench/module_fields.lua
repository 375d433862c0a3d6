-- What reaching into a model from Lua costs: a child (`model.h`), a grandchild path
-- (`model.h["0"].attn`) and a parameter (`attn.c_attn.weight`), each read in a loop, against the
-- same number of calls of the cheapest bound C function (pt.grad_enabled(): the floor any read
-- through the binding pays) in the same run; the ratio is the figure, as the machine's noise
-- moves both alike. Usage: partrain bench/module_fields.lua [--reads N]
package.path = "bench/?.lua;" .. package.path
local pt = require "partrain"
local T = require "timing"
local cfg = pt.args { reads = 200000, reps = 7, threads = 1 }
pt.set_threads(cfg.threads)

local model = pt.models.gpt2 { vocab = 64, seq = 16, dim = 32, heads = 2, layers = 12 }
local n = cfg.reads

local function per_read(fn) return T.median_seconds(cfg.reps, fn) / n * 1e9 end

local grad_enabled = pt.grad_enabled
local base = per_read(function()
  local x
  for _ = 1, n do x = grad_enabled() end
  return x
end)
local rows = {
  { "model.h (a child)", function() local x; for _ = 1, n do x = model.h end; return x end },
  { "model.h[\"0\"].attn (3 levels)", function() local x; for _ = 1, n do x = model.h["0"].attn end; return x end },
  { "attn.c_attn.weight (child, parameter)", function()
      local attn, x = model.h["0"].attn
      for _ = 1, n do x = attn.c_attn.weight end
      return x
    end },
}
print(("%-40s %10s %12s"):format("read", "ns/read", "x C call"))
print(("%-40s %10.1f %12s"):format("pt.grad_enabled() (the floor)", base, "1"))
for _, row in ipairs(rows) do
  local ns = per_read(row[2])
  print(("%-40s %10.1f %12.1f"):format(row[1], ns, ns / base))
end
