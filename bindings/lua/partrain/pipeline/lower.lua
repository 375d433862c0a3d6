-- Lowering of a compute-only plan (forwards and backwards) to one the executor runs: each
-- transfer is added beside the compute that needs it, a receive just before its forward or
-- backward and a send just after. Sends are asynchronous and receives wait (see check.lua), so
-- this order cannot deadlock when the compute order itself is consistent across ranks.
local A = require "partrain.pipeline.actions"

--- A plan with its transfers added: plan is normalized (see check.normalize) and compute-only.
return function(plan, pp, chunks)
  local S = pp * chunks
  local out = { name = plan.name }
  for r = 0, pp - 1 do
    local list = {}
    local function add(op, m, c, peer) list[#list + 1] = A.action(op, m, c, peer) end
    for _, a in ipairs(plan[r]) do
      local v = A.stage(pp, r, a.chunk)
      local prev, next = v > 0 and A.place(pp, v - 1), v < S - 1 and A.place(pp, v + 1)
      if prev == r then prev = false end   -- one rank (pp = 1): chunks hand over in place
      if next == r then next = false end
      if a.op == "F" then
        if prev then add("RECV_F", a.mb, a.chunk, prev) end
        add("F", a.mb, a.chunk)
        if next then add("SEND_F", a.mb, a.chunk, next) end
      else
        if next then add("RECV_B", a.mb, a.chunk, next) end
        add("B", a.mb, a.chunk)
        if prev then add("SEND_B", a.mb, a.chunk, prev) end
      end
    end
    out[r] = list
  end
  return out
end
