-- Ranks that hang, one way each, for the launcher's hang summary (tests/dist/test_hang.sh). After
-- one all-reduce on the world group (call 0), by --mode: skip (the last rank skips the next world
-- all-reduce and waits in its data group's barrier), stop (it stops itself: SIGSTOP), spin (it loops
-- forever, compiled by the JIT; spin_interpreted: with the JIT off), send (rank 0 sends to it; it
-- never receives), stop_inside (it is stopped inside the next world all-reduce, after it entered
-- it: every ledger then says "waiting" in the same call), sleep_in_c (it sleeps --seconds in C's
-- sleep() while the others wait in a barrier, and says how much of the sleep was left when it
-- woke), healthy (all-reduces for --seconds). The test finds lines by their markers.
local pt = require "partrain"
local ffi = require "ffi"
local cfg = pt.args { mode = "healthy", seconds = 4 }
local rank, last = pt.dist.rank(), pt.dist.world_size() - 1
local world = pt.dist.world()
local data = pt.mesh {}:group("data")  -- the world's ranks, as a group of its own
local pid = io.open("/proc/self/stat"):read("*n")

if rank == 0 and cfg.mode ~= "healthy" then  -- the hang begins in moments: the test times the end from here
  print("hang begins at " .. os.time())
  io.stdout:flush()
end
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
elseif cfg.mode == "stop_inside" then
  local mine = {}
  for r = 0, last do mine[r + 1] = r == rank and pid or 0 end
  local pids = pt.tensor(mine)  -- every rank's pid (below 2^22: exact in float32)
  world:all_reduce(pids)
  local victim = math.floor(pids:narrow(0, last, 1):item())
  if rank == last then
    os.execute(("(sleep 2; kill -STOP %d) &"):format(pid))  -- it is inside the all-reduce by then
  else  -- the others come once it is stopped
    local function state()
      local f = io.open(("/proc/%d/stat"):format(victim))
      local text = f and f:read("*a") or ""
      if f then f:close() end
      return text:match("%) (%a)")
    end
    while state() ~= "T" do os.execute("sleep 0.1") end
  end
  world:all_reduce(pt.ones(1048576)) -- @stop_inside
elseif cfg.mode == "sleep_in_c" then
  if rank == last then
    ffi.cdef "unsigned int sleep(unsigned int seconds);"
    local left = ffi.C.sleep(cfg.seconds) -- @sleep_in_c
    io.stderr:write(("rank %d woke with %d s of its sleep left\n"):format(rank, left))  -- stderr: every rank's is shown
  end
  world:barrier() -- @sleep_barrier
  print("rank " .. rank .. " finished")
elseif cfg.mode == "healthy" then
  local t, go, until_ = pt.ones(8), pt.ones(1), os.time() + cfg.seconds
  print("healthy run started")
  io.stdout:flush()
  -- Rank 0's clock decides when to stop, so that every rank makes the same calls.
  while true do
    go:fill_((rank == 0 and os.time() < until_) and 1 or 0)
    world:all_reduce(go, "max")
    if go:item() == 0 then break end
    world:all_reduce(t, "mean") -- @healthy
  end
  print("healthy run finished")
else
  error("unknown --mode " .. cfg.mode)
end
