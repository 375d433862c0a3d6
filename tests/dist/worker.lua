-- A rank for the launcher's failure tests: writes its pid to DIR/pid.RANK, then does what --mode
-- says: "loop" (all-reduce until killed), "stall" (rank 1 sleeps while the others wait in a
-- barrier), "spin" (rank 1 loops forever in Lua while the others wait in a barrier), "stop"
-- (rank 1 stops itself with SIGSTOP, the same), "raise" (rank 1 raises an error while the others
-- wait in an all-reduce), "sum" (one all-reduce, printed), "breakpoint" (pt.breakpoint() between
-- two prints), "handshake" (below).
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
elseif cfg.mode == "spin" then
  if rank == 1 then while true do end end
  pt.dist.barrier()
elseif cfg.mode == "stop" then
  if rank == 1 then os.execute("kill -STOP " .. io.open("/proc/self/stat"):read("*n")) end
  pt.dist.barrier()
elseif cfg.mode == "raise" then
  if rank == 1 then
    os.execute("sleep 0.3")  -- the others are waiting in the all-reduce by now
    error("rank 1 raised on purpose")
  end
  pt.dist.world():all_reduce(pt.ones(4))
elseif cfg.mode == "breakpoint" then
  print("before the breakpoint")
  pt.breakpoint()
  print("after the breakpoint")
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
if cfg.mode == "handshake" then  -- "ready", then up to 20 s for DIR/go, which comes once "ready" was read
  print("ready")
  local waited = 0
  while not io.open(cfg.dir .. "/go") and waited < 20 do
    os.execute("sleep 0.1")
    waited = waited + 0.1
  end
  print(io.open(cfg.dir .. "/go") and "released" or "never released")
end
