-- Measures the machine it runs on, as one of K ranks all measuring at once, and writes the device
-- table the layout search reads (run by `partrain plan --calibrate`):
--   partrain --nproc-per-node K --threads T bindings/lua/partrain/calibrate.lua --out FILE [--dtype float32] [--seconds S]
-- Every rank runs every measurement at the same moment, so contention between ranks that share
-- cores is part of the figures: the table describes "one of K ranks on this machine". A rate is
-- the slowest rank's (a synchronous step goes at its pace) and each time the median of several
-- repetitions after a warm-up; rank 0 writes FILE (FILE.tmp, then renamed) and prints a summary.
local pt = require "partrain"

local cfg = pt.args {
  out = { "", "the device table to write: a Lua file returning the table (required)" },
  dtype = { "float32", "the dtype of the GPT-2 training step whose FLOP rate over flops[dtype] is the efficiency" },
  seconds = pt.args.number(30, "about how long to measure, in seconds (start-up and the launcher come on top)"),
}

local rank, K = pt.dist.rank(), pt.dist.world_size()
local world = pt.dist.world()
local threads = pt.get_threads()
local unpack = table.unpack or unpack

-- Check the options before measuring anything: a bad --out would otherwise be found a minute later.
local DTYPES = { float32 = "float32", float = "float32", fp32 = "float32", float64 = "float64", double = "float64",
                 fp64 = "float64", bfloat16 = "bfloat16", bf16 = "bfloat16", float16 = "float16", half = "float16",
                 fp16 = "float16" }
if cfg.out == "" then
  error("calibrate: --out is required: the file to write the device table to (--out dev.lua)", 0)
end
do
  local f = io.open(cfg.out, "rb")
  local is_folder = cfg.out:sub(-1) == "/"
  if f then
    local _, _, code = f:read(0)
    f:close()
    is_folder = is_folder or code == 21  -- EISDIR
  end
  if is_folder then
    error(("calibrate: --out %s is a folder; expected the file to write the device table to (--out %s/device.lua)")
          :format(cfg.out, cfg.out:gsub("/+$", "")), 0)
  end
end
local dtype = DTYPES[cfg.dtype]
if not dtype then
  error(("calibrate: --dtype %s: expected float32, float64, bfloat16 or float16"):format(cfg.dtype), 0)
end
if not (cfg.seconds > 0) then error(("calibrate: --seconds %s: expected a positive number"):format(cfg.seconds), 0) end
if rank == 0 then  -- can FILE.tmp be written? (the same check every rank would make: one machine)
  local f, err = io.open(cfg.out .. ".tmp", "wb")
  if not f then error(("calibrate: cannot write --out %s: %s"):format(cfg.out, err), 0) end
  f:close()
  os.remove(cfg.out .. ".tmp")
end

--- The median of a list of numbers (the lower middle one of an even count); sorts the list.
local function median(xs)
  table.sort(xs)
  return xs[math.ceil(#xs / 2)]
end

--- The numbers in `values`, each reduced over the ranks by `op` ("min", "max"): one collective,
--- blocking (and so checked), on every rank at the same point.
local function clamp(x, lo, hi) return math.max(lo, math.min(hi, x)) end

local function agree(op, values)
  local t = pt.tensor(values, { dtype = "float64" })
  world:all_reduce(t, op)
  return unpack(t:totable())
end


--- One timed call of fn, in seconds.
local function once(fn)
  local t0 = pt.time()
  fn()
  return pt.time() - t0
end

--- The median seconds a call of fn takes with every rank calling it at once, the slowest rank's.
--- `estimate` is one call's seconds, agreed over the ranks (so every rank makes the same number of
--- calls, which a collective needs and which keeps the ranks busy together). Calls are timed in
--- runs of at least RUN seconds: a call shorter than the scheduler's time slice would otherwise
--- often run alone on a core, and the median would miss the time-sharing between ranks. 3 to
--- `most` runs (default 10), as many as fill `budget` seconds.
local RUN = 0.05
local function measure(fn, estimate, budget, most)
  local calls = math.max(1, math.ceil(RUN / math.max(estimate, 1e-9)))
  local runs = clamp(math.floor(budget / (calls * math.max(estimate, 1e-9))), 3, most or 10)
  world:barrier()
  local times = {}
  for i = 1, runs do
    local t0 = pt.time()
    for _ = 1, calls do fn() end
    times[i] = (pt.time() - t0) / calls
  end
  return agree("max", { median(times) })
end

local started = pt.time()
local budget = cfg.seconds
local notes = {}   -- rank 0's summary lines, printed at the end

-- Peak FLOP/s: square matmuls of a few sizes (2n^3 FLOPs), the best size's median rate. Every rank
-- runs each size at once, the same number of times (agreed from the slowest rank's warm-up), and a
-- size is the slowest rank's rate. Returns the rate and its size, or nil and why (a dtype this
-- build cannot multiply).
local SIZES = { 256, 512, 1024, 2048 }
local function matmul_rate(dt, seconds)
  local deadline = pt.time() + seconds
  local best, best_n = 0, nil
  for i, n in ipairs(SIZES) do
    local ok, a, b = pcall(function()
      local a, b = pt.randn(n, n, { dtype = dt }), pt.randn(n, n, { dtype = dt })
      a:matmul(b)  -- warm-up: the first call allocates, and oneDNN generates its kernel
      return a, b
    end)
    local first = ok and once(function() a:matmul(b) end) or 0
    -- Agreed: whether every rank could multiply, the slowest warm-up, the least time left.
    local all_ok, estimate, neg_left = agree("max", { ok and 0 or 1, first, pt.time() - deadline })
    if all_ok ~= 0 then
      if best_n then break end
      return nil, ok and "it failed on another rank" or (tostring(a):gsub("\n.*", ""))
    end
    local left = -neg_left
    if estimate * 3 > left then break end  -- no time for three calls of this size: keep the smaller sizes'
    local rate = 2 * n ^ 3 / measure(function() a:matmul(b) end, estimate, left / (#SIZES - i + 1))
    if rate > best then best, best_n = rate, n end
  end
  if not best_n then return nil, "too slow to time within --seconds" end
  return best, best_n
end

local flops = {}
for _, share in ipairs { { "float32", 0.20 }, { "float64", 0.10 }, { "bfloat16", 0.10 }, { "float16", 0.10 } } do
  local dt = share[1]
  local rate, n_or_why = matmul_rate(dt, budget * share[2])
  if rate then
    flops[dt] = rate
    notes[#notes + 1] = ("flops.%-8s %.3g FLOP/s a rank  (square matmuls n=256..2048, 2n^3 FLOPs, best median at n=%d)")
                        :format(dt, rate, n_or_why)
  elseif dt == "float32" or dt == "float64" then
    error(("calibrate: a %s matmul could not be timed: %s"):format(dt, n_or_why), 0)
  else
    notes[#notes + 1] = ("flops.%-8s not measured: %s"):format(dt, n_or_why)
  end
end
if not flops[dtype] then
  error(("calibrate: --dtype %s: its matmuls could not be timed on this machine, so it has no peak to measure "
         .. "the efficiency against"):format(dtype), 0)
end

-- Dispatch: the seconds an operator costs whatever its size (dispatch, a tiny kernel, the call
-- from Lua), every rank at once: the median of a 1-element copy.
local op_seconds
do
  local a, b = pt.zeros(1), pt.zeros(1)
  local function tiny() for _ = 1, 100 do b:copy_(a) end end
  tiny()
  op_seconds = measure(tiny, agree("max", { once(tiny) }), budget * 0.03) / 100
  notes[#notes + 1] = ("op_seconds     %.3g  (a 1-element copy, median of runs of 100)"):format(op_seconds)
end

-- Efficiency: a small GPT-2's training step (forward, cross-entropy, backward, AdamW), a plain
-- model on every rank (no collectives): its FLOPs over the slowest rank's median step time less
-- its operators' dispatch (op_seconds each), over flops[dtype]. The FLOPs and the operators are
-- counted as the planner counts them (core.plan.count), on one more step after the timing (the
-- count slows a step).
local GPT = { vocab = 256, seq = 64, dim = 128, heads = 4, layers = 2 }
local BATCH = 8
local efficiency, step_seconds, step_flops, step_ops
do
  pt.manual_seed(1)
  local model = pt.models.gpt2(GPT)
  if dtype ~= "float32" then model:to(dtype) end
  local opt = pt.optim.adamw(model, { lr = 1e-4 })
  local x = pt.randint(0, GPT.vocab, { BATCH, GPT.seq })
  local y = pt.randint(0, GPT.vocab, { BATCH, GPT.seq })
  local function step()
    local loss = pt.nn.cross_entropy(model(x), y)
    opt:zero_grad()
    loss:backward()
    opt:step()
  end
  step()
  step_seconds = measure(step, agree("max", { once(step) }), budget * 0.25)
  local core = require "partrain.core"
  local flops0, ops0 = core.plan.count()
  step()
  local flops1, ops1 = core.plan.count()
  step_flops, step_ops = flops1 - flops0, ops1 - ops0
  local computing = math.max(step_seconds - step_ops * op_seconds, step_seconds / 10)
  efficiency = clamp(step_flops / computing / flops[dtype], 1e-6, 1)
  notes[#notes + 1] = ("efficiency     %.3g  (GPT-2 %d layers of %d, batch %d x %d, %s: %.3g FLOPs and %d operators a "
                       .. "step in %.4g s, of which %.4g s computing = %.3g FLOP/s, over flops.%s)")
                      :format(efficiency, GPT.layers, GPT.dim, BATCH, GPT.seq, dtype, step_flops, step_ops, step_seconds,
                              computing, step_flops / computing, dtype)
end

-- Interconnect: all_reduce over the world group (async and waited: the engine's own collectives
-- skip pt.dist's agreement check, a small all-gather that costs more than a tiny call itself).
-- Latency: the median seconds of a 1-element call; bandwidth: the bus bandwidth of a few MiB,
-- bytes x 2(K-1)/K over the median seconds, the best size. Zeros, so the sums stay finite.
-- With K = 1 there is no collective: a large tensor copy's rate and a 1-element copy's time.
local bandwidth, latency, link_how
if K > 1 then
  local function all_reduce(t) world:all_reduce(t, "sum", { async = true }):wait() end
  local deadline = pt.time() + budget * 0.25
  local one = pt.zeros(1)
  for _ = 1, 5 do all_reduce(one) end
  local ten = agree("max", { once(function() for _ = 1, 10 do all_reduce(one) end end) })
  latency = measure(function() all_reduce(one) end, ten / 10, budget * 0.05)
  bandwidth = 0
  local best_mib
  for _, mib in ipairs { 4, 16 } do
    local t = pt.zeros(mib * 2 ^ 20 / 4)
    all_reduce(t)
    local first, neg_left = agree("max", { once(function() all_reduce(t) end), pt.time() - deadline })
    if first * 3 > -neg_left and best_mib then break end  -- no time for the larger size
    local bus = mib * 2 ^ 20 * 2 * (K - 1) / K / measure(function() all_reduce(t) end, first, -neg_left / 2)
    if bus > bandwidth then bandwidth, best_mib = bus, mib end
  end
  link_how = ("all_reduce over the %d ranks (Gloo); latency: median of a 1-element call; bandwidth: bus bandwidth "
              .. "(bytes x 2(K-1)/K / s), best median of 4 and 16 MiB float32 (at %d MiB)"):format(K, best_mib)
else
  local src, dst = pt.zeros(16 * 2 ^ 20), pt.zeros(16 * 2 ^ 20)  -- 64 MiB of float32
  local function copy() dst:copy_(src) end
  copy()
  bandwidth = 64 * 2 ^ 20 / measure(copy, once(copy), budget * 0.15)
  local a, b = pt.zeros(1), pt.zeros(1)
  local function tiny() b:copy_(a) end
  tiny()
  latency = measure(tiny, once(tiny), budget * 0.02)
  link_how = "one rank, no collective: bandwidth is the rate of a 64 MiB tensor copy (a memcpy, no loopback), "
             .. "latency the seconds of a 1-element copy"
end
notes[#notes + 1] = ("intra          %.3g B/s, latency %.3g s  (%s)"):format(bandwidth, latency, link_how)

-- Memory: the machine's, shared by its K ranks.
local memory
do
  local f = io.open("/proc/meminfo", "r")
  local text = f and f:read("*a") or ""
  if f then f:close() end
  local kb = tonumber(text:match("MemTotal:%s*(%d+)%s*kB"))
  if not kb then error("calibrate: cannot read MemTotal from /proc/meminfo", 0) end
  memory = math.floor(kb * 1024 / K)
  notes[#notes + 1] = ("memory         %d bytes a rank  (MemTotal %d kB / %d ranks)"):format(memory, kb, K)
end

-- Rank 0 writes the table: every figure with %.6g, counts exactly.
if rank == 0 then
  local f = io.open("/proc/sys/kernel/hostname", "r")
  local host = f and f:read("*l") or ""
  if f then f:close() end
  if host == "" then host = "this machine" end
  local g = function(x) return ("%.6g"):format(x) end
  local names = {}
  for _, dt in ipairs { "float32", "float64", "bfloat16", "float16" } do
    if flops[dt] then names[#names + 1] = ("%s = %s"):format(dt, g(flops[dt])) end
  end
  local cores = 0  -- the machine's processors: with fewer than ranks x threads, ranks share them
  local info = io.open("/proc/cpuinfo", "r")
  if info then
    for line in info:lines() do if line:match("^processor%s*:") then cores = cores + 1 end end
    info:close()
  end
  local lines = {
    ("-- measured by partrain plan --calibrate: %d rank%s of %d thread%s on %s, %s")
      :format(K, K == 1 and "" or "s", threads, threads == 1 and "" or "s", host, os.date("%Y-%m-%d %H:%M")),
    "return {",
    '  name = "calibrated",',
    ("  flops = { %s },  -- peak FLOP/s a rank: the best median rate of square matmuls (n = 256 to 2048, 2n^3 FLOPs), every rank busy")
      :format(table.concat(names, ", ")),
    ("  efficiency = %s,  -- GPT-2 (%d layers of %d, vocab %d, batch %d x %d, %s) training step: counted FLOPs / (median seconds - operators x op_seconds) / flops.%s")
      :format(g(efficiency), GPT.layers, GPT.dim, GPT.vocab, BATCH, GPT.seq, dtype, dtype),
    ("  op_seconds = %s,  -- an operator's cost whatever its size: a 1-element copy, every rank at once"):format(g(op_seconds)),
    ("  memory = %d,  -- bytes a rank: MemTotal of /proc/meminfo / %d ranks"):format(memory, K),
    ("  intra = { bandwidth = %s, latency = %s },  -- %s"):format(g(bandwidth), g(latency), link_how),
    ("  inter = { bandwidth = %s, latency = %s },  -- one machine: the same as intra"):format(g(bandwidth), g(latency)),
    "  overlap = 0,  -- on the CPU Gloo's reductions compete with backward for the same cores: nothing hides",
    ("  ranks = %d, threads = %d,"):format(K, threads),
    cores > 0 and ("  cores = %d,  -- the processors the ranks share (/proc/cpuinfo)"):format(cores) or "",
    '  source = "partrain plan --calibrate",',
    "}",
    "",
  }
  local tmp = cfg.out .. ".tmp"
  local out, err = io.open(tmp, "wb")
  if not out then error(("calibrate: cannot write %s: %s"):format(tmp, err), 0) end
  local ok, werr = out:write(table.concat(lines, "\n"))
  out:close()
  if not ok then os.remove(tmp); error(("calibrate: cannot write %s: %s"):format(tmp, werr), 0) end
  local renamed, rerr = os.rename(tmp, cfg.out)
  if not renamed then os.remove(tmp); error(("calibrate: cannot rename %s to %s: %s"):format(tmp, cfg.out, rerr), 0) end
  print(("calibrated %d rank%s of %d thread%s on %s%s, in %.1f s:")
        :format(K, K == 1 and "" or "s", threads, threads == 1 and "" or "s", host,
                K == 1 and "" or ", every rank measuring at once", pt.time() - started))
  for _, line in ipairs(notes) do print("  " .. line) end
  print("wrote " .. cfg.out)
end
