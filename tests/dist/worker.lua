-- A rank for the launcher's failure tests: writes its pid to DIR/pid.RANK, then does what --mode
-- says: "loop" (all-reduce until killed), "stall" (rank 1 sleeps while the others wait in a
-- barrier), "sum" (one all-reduce, printed).
local pt = require "partrain"
local cfg = pt.args { dir = "", mode = "loop" }
local rank = pt.dist.rank()
if cfg.dir ~= "" then
  local f = assert(io.open(cfg.dir .. "/pid." .. rank, "w"))
  f:write(io.open("/proc/self/stat"):read("*n"))
  f:close()
end
if cfg.mode == "loop" then
  local t = pt.ones(1000)
  while true do pt.dist.world():all_reduce(t, "mean") end
elseif cfg.mode == "stall" then
  if rank == 1 then os.execute("sleep 120") end
  pt.dist.barrier()
elseif cfg.mode == "sum" then
  local t = pt.tensor({ rank + 1 })
  pt.dist.world():all_reduce(t)
  print(("rank %d of %d: sum %d"):format(rank, pt.dist.world_size(), t:item()))
end
if cfg.mode == "mismatch" then  -- ranks disagree on the reduction: caught by --check-collectives
  local t = pt.ones(3)
  pt.dist.world():all_reduce(t, rank == 0 and "sum" or "max")
  print("no mismatch noticed")
end
