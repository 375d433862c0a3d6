-- The partrain side of the dataset fuzz driver (fuzz_data.py): reads many damaged dataset files
-- in one process, each under pcall, and appends one JSON line a case to a results file as it
-- finishes (so that the driver can restart after a case that kills the process).
--
--   partrain data_batch.lua LIST RESULTS
--
-- LIST holds "<index>\t<reader>\t<options>" lines: the reader is idx, mnist or corpus, the options
-- a Lua table the driver wrote. What a case read comes back as text the driver compares with its
-- reference: an IDX file's dtype, shape and values; the first batches of a loader.
local pt = require "partrain"

local list, results = ...
pt.set_threads(1)

local record = dofile(debug.getinfo(1, "S").source:sub(2):match("^(.*/)") .. "results.lua").open(results)

-- Values as text, exactly: a float32 element widened to a double prints as the driver's does.
local function values(t)
  local parts = {}
  for i, v in ipairs(t:reshape({ -1 }):totable()) do
    parts[i] = v ~= v and "nan" or ("%.17g"):format(v)
  end
  return table.concat(parts, ",")
end

local function shape(t) return table.concat(t.shape, ",") end

-- At most this many batches of a loader: enough to cross a few windows, few enough to stay fast.
local MAX_BATCHES = 6

local readers = {}

function readers.idx(o)
  local t = pt.data.read_idx(o.path)
  return { dtype = t.dtype, shape = shape(t), values = values(t) }
end

-- A loader's first batches, read until one fails (a corpus can hold a bad token part-way).
local function batches(loader)
  local r = { size = loader:size(), batches = {} }
  for b = 1, math.min(loader:batches_per_epoch(), MAX_BATCHES) do
    local ok, x, y = pcall(loader.next, loader)
    if not ok then
      r.failed_at, r.error = b, tostring(x)
      break
    end
    r.batches[b] = shape(x) .. ";" .. values(x) .. ";" .. shape(y) .. ";" .. values(y)
  end
  return r
end

function readers.mnist(o) return batches(pt.data.mnist(o)) end

function readers.corpus(o)
  local kind = o.kind
  o.kind = nil
  return batches(pt.data[kind](o))
end

record({ ready = true })  -- the driver treats a process that dies before this line as broken
for line in io.lines(list) do
  local index, reader, options = line:match("^(%d+)\t(%a+)\t(.*)$")
  local o = assert(load("return " .. options))()
  local ok, r = pcall(readers[reader], o)
  if not ok then r = { error = tostring(r) } end
  r.index = tonumber(index)
  record(r)
end
