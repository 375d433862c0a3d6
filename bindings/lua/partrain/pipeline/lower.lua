-- Lowering of a compute-only plan (forwards and backwards) to one the executor runs: each
-- transfer is added beside the compute that needs it, a receive just before its forward or
-- backward and a send just after. Sends are asynchronous and receives wait (see check.lua), so
-- this order cannot deadlock when the compute order itself is consistent across ranks.
local A = require "partrain.pipeline.actions"

--- A plan with its transfers added, and where each of its actions comes from: origin[r][i] =
--- { index = j, action = a }, the j-th action a of rank r in the plan given (so the check names
--- the schedule's own list), origin.count[r] that list's length. plan is normalized (see
--- check.normalize) and compute-only.
return function(plan, pp, chunks)
  local S = pp * chunks
  local out, origin = { name = plan.name, layout = plan.layout }, { count = {} }
  for r = 0, pp - 1 do
    local list, from = {}, {}
    local j, own
    local function add(op, m, c, peer)
      list[#list + 1] = A.action(op, m, c, peer)
      from[#list] = { index = j, action = own }
    end
    for i, a in ipairs(plan[r]) do
      j, own = i, a
      local v = A.stage(pp, r, a.chunk, plan.layout)
      local prev, next = v > 0 and A.place(pp, v - 1, plan.layout), v < S - 1 and A.place(pp, v + 1, plan.layout)
      if prev == r then prev = false end   -- on this rank (pp = 1, a V's turn): handed over in place
      if next == r then next = false end
      if a.op == "W" then                  -- the weights' gradients: nothing moves
        add("W", a.mb, a.chunk)
      elseif a.op == "F" then
        if prev then add("RECV_F", a.mb, a.chunk, prev) end
        add("F", a.mb, a.chunk)
        if next then add("SEND_F", a.mb, a.chunk, next) end
      else
        if next then add("RECV_B", a.mb, a.chunk, next) end
        add("B", a.mb, a.chunk)
        if prev then add("SEND_B", a.mb, a.chunk, prev) end
      end
    end
    out[r], origin[r], origin.count[r] = list, from, #plan[r]
  end
  return out, origin
end
