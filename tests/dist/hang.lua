-- Ranks that hang, one way each, for the launcher's hang summary (tests/dist/test_hang.sh). Every
-- rank first makes one all-reduce on the world group (call 0), then, by --mode:
--   skip     the last rank skips the second world all-reduce and waits in a barrier of its data group
--   stop     the last rank stops itself (SIGSTOP); the others wait in a world barrier
--   spin     the last rank loops forever in Lua (compiled by the JIT); the others wait in a barrier
--   spin_interpreted  the same loop with the JIT off, so that the rank can say its Lua line
--   send     rank 0 sends to the last rank, which never receives and waits in the world barrier
--   healthy  every rank all-reduces for --seconds, then the run ends normally
-- The test finds the lines by the markers at their ends.
local pt = require "partrain"
local cfg = pt.args { mode = "healthy", seconds = 4 }
local rank, last = pt.dist.rank(), pt.dist.world_size() - 1
local world = pt.dist.world()
local data = pt.mesh {}:group("data")  -- the world's ranks, as a group of its own
local pid = io.open("/proc/self/stat"):read("*n")

world:all_reduce(pt.ones(4)) -- @first
if cfg.mode == "skip" then
  if rank ~= last then world:all_reduce(pt.ones(4)) end -- @skipped
  data:barrier() -- @skip_barrier
elseif cfg.mode == "stop" then
  if rank == last then os.execute("kill -STOP " .. pid) end -- @stop
  world:barrier() -- @stop_barrier
elseif cfg.mode == "spin" or cfg.mode == "spin_interpreted" then
  if rank == last then
    if cfg.mode == "spin_interpreted" then jit.off() end
    local x = 0
    while true do x = x + 1 end -- @spin
  end
  world:barrier() -- @spin_barrier
elseif cfg.mode == "send" then
  if rank == 0 then world:send(pt.ones(3), last) end -- @send
  world:barrier() -- @send_barrier
elseif cfg.mode == "healthy" then
  local t, until_ = pt.ones(8), os.time() + cfg.seconds
  print("healthy run started")
  io.stdout:flush()
  while os.time() < until_ do world:all_reduce(t, "mean") end -- @healthy
  print("healthy run finished")
else
  error("unknown --mode " .. cfg.mode)
end
