-- The devices `partrain plan --auto` predicts step times for: the shipped tables (h100, h200, a100,
-- cpu), a device table file (`partrain plan --calibrate FILE` writes one), and the strict check of
-- every field the layout search reads. docs/plan.md, "Automatic layouts".
--
-- A device table:
--   { name = "h100",
--     flops = { bfloat16 = 989e12, float16 = 989e12, float32 = 67e12, float64 = 67e12 },  -- dense peak FLOP/s
--     efficiency = 0.5,        -- share of the peak a training step's matmuls reach (0 < x <= 1)
--     memory = 80 * 2^30,      -- bytes one device (one rank) holds
--     intra = { bandwidth = 450e9, latency = 5e-6 },  -- within a node: bytes/s one direction, seconds a call
--     inter = { bandwidth = 50e9, latency = 15e-6 },  -- between nodes
--     overlap = 1,             -- share of backward compute that gradient reduction can hide behind (0..1)
--     source = "NVIDIA H100 SXM datasheet" }
-- flops needs the dtype the script trains in; name, source, ranks and threads (what --calibrate
-- measured with), cores (the cores a node's ranks share, when they are fewer than its ranks:
-- then a rank waiting frees its core for the others) and op_seconds (what an operator costs
-- whatever its size, on a device that runs them one after the other: the CPU; 0 by default, a
-- GPU's launches overlapping its kernels) are optional; any other field is an error.
local D = {}

local GiB = 2 ^ 30

--- The shipped devices, by name. Peaks are NVIDIA's dense (no sparsity) tensor-core figures for
--- 16-bit types and the plain FP32/FP64 figures (TF32 is not what a float32 model runs unless it
--- asks); bandwidths are one direction.
D.shipped = {
  h100 = {
    name = "h100",
    flops = { bfloat16 = 989e12, float16 = 989e12, float32 = 67e12, float64 = 67e12 },
    efficiency = 0.5,
    memory = 80 * GiB,
    intra = { bandwidth = 450e9, latency = 5e-6 },   -- NVLink 4: 900 GB/s both ways
    inter = { bandwidth = 50e9, latency = 15e-6 },   -- one 400 Gb/s NIC a GPU
    overlap = 1,
    source = "NVIDIA H100 SXM datasheet",
  },
  a100 = {
    name = "a100",
    flops = { bfloat16 = 312e12, float16 = 312e12, float32 = 19.5e12, float64 = 19.5e12 },
    efficiency = 0.5,
    memory = 80 * GiB,
    intra = { bandwidth = 300e9, latency = 5e-6 },   -- NVLink 3: 600 GB/s both ways
    inter = { bandwidth = 25e9, latency = 15e-6 },   -- one 200 Gb/s NIC a GPU
    overlap = 1,
    source = "NVIDIA A100 80GB SXM datasheet",
  },
  -- A placeholder for one CPU core of a typical machine. `partrain plan --calibrate FILE` measures
  -- the machine at hand (its matmul rates, a training step's efficiency, Gloo's all-reduce) and
  -- writes a table like this one to FILE, for `--device FILE`.
  cpu = {
    name = "cpu",
    flops = { bfloat16 = 1e10, float16 = 1e10, float32 = 5e10, float64 = 2.5e10 },
    efficiency = 0.5,
    memory = 16 * GiB,
    intra = { bandwidth = 2e9, latency = 50e-6 },
    inter = { bandwidth = 2e9, latency = 50e-6 },
    overlap = 0,                                     -- Gloo's reductions compete with backward for the cores
    op_seconds = 3e-6,                               -- an operator's dispatch, whatever its size
    source = "a placeholder for a typical core (partrain plan --calibrate measures this machine)",
  },
}
-- The H200: the H100's compute and links with 141 GB of HBM3e.
D.shipped.h200 = {}
for k, v in pairs(D.shipped.h100) do D.shipped.h200[k] = v end
D.shipped.h200.name, D.shipped.h200.memory = "h200", 141e9
D.shipped.h200.source = "NVIDIA H200 SXM datasheet (the H100's compute, 141 GB)"

--- The shipped names, in the order the help lists them.
D.names = { "h100", "h200", "a100", "cpu" }

--- The dtypes a device's flops name, and the names a script's --dtype may give them.
D.dtypes = { "bfloat16", "float16", "float32", "float64" }
local ALIASES = { bfloat16 = "bfloat16", bf16 = "bfloat16", float16 = "float16", fp16 = "float16", half = "float16",
                  float32 = "float32", fp32 = "float32", float = "float32", float64 = "float64", fp64 = "float64",
                  double = "float64" }

--- D.dtype(name): the canonical dtype ("bfloat16", "float16", "float32", "float64") a script's
--- dtype name means, or nil.
function D.dtype(name)
  return type(name) == "string" and ALIASES[name:lower()] or nil
end

local function fail(fmt, ...) error("partrain plan --auto: " .. fmt:format(...), 0) end

local function shown(v)
  if type(v) == "string" then return ("%q"):format(v) end
  if type(v) == "number" then return ("%.6g"):format(v) end
  return type(v)
end

local function finite(x) return type(x) == "number" and x == x and x > -math.huge and x < math.huge end

-- A number field: finite and above `low` (or at it, when `low_ok`), at most `high` when given.
local function number(where, field, x, low, low_ok, high)
  if not finite(x) or x < low or (x == low and not low_ok) or (high and x > high) then
    local range = (low_ok and ">= %g" or "> %g"):format(low) .. (high and (" and <= %g"):format(high) or "")
    fail("device %s: %s must be a finite number %s, got %s", where, field, range, shown(x))
  end
  return x
end

local FIELDS = { name = true, flops = true, efficiency = true, memory = true, intra = true, inter = true,
                 overlap = true, source = true, ranks = true, threads = true, cores = true,
                 op_seconds = true }
local FIELD_LIST = "name, flops, efficiency, memory, intra, inter, overlap, source, ranks, threads, cores, op_seconds"

local function link(where, field, t)
  if type(t) ~= "table" then
    fail("device %s: %s must be a table { bandwidth = bytes/s, latency = seconds }, got %s", where, field, shown(t))
  end
  for k in pairs(t) do
    if k ~= "bandwidth" and k ~= "latency" then
      fail("device %s: %s has no field %s (fields: bandwidth, latency)", where, field, shown(k))
    end
  end
  return { bandwidth = number(where, field .. ".bandwidth", t.bandwidth, 0, false),
           latency = number(where, field .. ".latency", t.latency, 0, true) }
end

--- D.check(t, where [, dtype]): a checked copy of the device table `t`; `where` names it in errors
--- ("h100", "file dev.lua"). Every number must be finite: flops (FLOP/s, > 0, one a dtype; the
--- one for `dtype` required when given), efficiency in (0, 1], memory > 0 bytes, intra and inter
--- { bandwidth > 0, latency >= 0 }, overlap in [0, 1]. Raises "partrain plan --auto: device
--- WHERE: FIELD must be ..., got VALUE".
function D.check(t, where, dtype)
  if type(t) ~= "table" then fail("device %s must be a table (a Lua file returning { flops = ..., memory = ... }), got %s", where, shown(t)) end
  for k in pairs(t) do
    if not FIELDS[k] then fail("device %s: unknown field %s (fields: %s)", where, shown(k), FIELD_LIST) end
  end
  for _, k in ipairs { "flops", "efficiency", "memory", "intra", "inter", "overlap" } do
    if t[k] == nil then fail("device %s: %s is missing (needed: flops, efficiency, memory, intra, inter, overlap)", where, k) end
  end
  if type(t.flops) ~= "table" then
    fail("device %s: flops must be a table of peak FLOP/s by dtype ({ float32 = 5e10, ... }), got %s", where, shown(t.flops))
  end
  local flops = {}
  for k, v in pairs(t.flops) do
    if type(k) ~= "string" or not ALIASES[k:lower()] then
      fail("device %s: flops has an entry %s; expected dtypes %s", where, shown(k), table.concat(D.dtypes, ", "))
    end
    flops[ALIASES[k:lower()]] = number(where, "flops." .. k, v, 0, false)
  end
  if dtype and not flops[dtype] then
    fail("device %s: flops has no %s entry, the dtype the script trains in (give flops.%s = peak FLOP/s)", where, dtype, dtype)
  end
  for _, k in ipairs { "name", "source" } do
    if t[k] ~= nil and type(t[k]) ~= "string" then fail("device %s: %s must be a string, got %s", where, k, shown(t[k])) end
  end
  for _, k in ipairs { "ranks", "threads", "cores" } do
    if t[k] ~= nil and (not finite(t[k]) or t[k] < 1 or t[k] % 1 ~= 0) then
      fail("device %s: %s must be a whole number >= 1, got %s", where, k, shown(t[k]))
    end
  end
  return { name = t.name or where, flops = flops, efficiency = number(where, "efficiency", t.efficiency, 0, false, 1),
           memory = number(where, "memory", t.memory, 0, false), intra = link(where, "intra", t.intra),
           inter = link(where, "inter", t.inter), overlap = number(where, "overlap", t.overlap, 0, true, 1),
           source = t.source, ranks = t.ranks, threads = t.threads, cores = t.cores,
           op_seconds = t.op_seconds == nil and 0 or number(where, "op_seconds", t.op_seconds, 0, true) }
end

-- A device table file: a regular file of at most 1 MiB of Lua source, run in the config files'
-- sandbox (partrain.args: no io, os or require; bounded in instructions, time and memory).
local function from_file(path)
  local ok, t = pcall(require("partrain.args").load_data, path, "device file")
  -- (a read refused in C names the Lua line that asked, which is not the user's: left out)
  if not ok then fail("--device %s: %s", path, (tostring(t):gsub("^%(plan %-%-auto%):%d+: ", ""))) end
  if type(t) ~= "table" then fail("--device %s must return a device table, got %s", path, shown(t)) end
  return t
end

--- D.need(device, dtype): raises unless the checked `device` has a peak for `dtype`.
function D.need(device, dtype)
  if not device.flops[dtype] then
    fail("device %s: flops has no %s entry, the dtype the script trains in (give flops.%s = peak FLOP/s)",
      device.where or device.name, dtype, dtype)
  end
end

--- D.load(spec [, memory]): the checked device `spec` names: a shipped name (nil: "h100") or a
--- Lua file returning a device table (a path: one with a "/" or ending in ".lua"). `memory` (bytes, from --device-memory) replaces the table's. The dtype is checked later
--- (D.check's third argument), once the script says it.
function D.load(spec, memory)
  spec = spec == nil and "h100" or spec
  if type(spec) ~= "string" or spec == "" then fail("--device must be a device name or a file, got %s", shown(spec)) end
  local t, where
  if D.shipped[spec:lower()] then
    t, where = D.shipped[spec:lower()], spec:lower()
  elseif spec:find("/") or spec:match("%.lua$") then  -- (a file: a path or a .lua name)
    t, where = from_file(spec), "file " .. spec
    if t.name == nil then t.name = spec end
  else
    fail("unknown device %s: expected %s, or a device table file (a path or a .lua file returning { flops = ..., memory = ..., "
      .. "... }; partrain plan --calibrate FILE writes one)", shown(spec), table.concat(D.names, ", "))
  end
  local device = D.check(t, where)
  device.where = where
  if memory ~= nil then
    device.memory = number(where, "memory (--device-memory)", memory, 0, false)
    device.memory_source = "--device-memory"
  end
  return device
end

return D
