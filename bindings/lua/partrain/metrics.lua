-- pt.metrics: the run's metrics file, one JSON object a line (docs/observability.md): a run
-- header, a record for every pt.log step, per-rank memory. Rank 0 writes it, each line with one
-- write() on an O_APPEND descriptor, so a killed run keeps every completed line.
local core = require "partrain.core"
local raise = core._raise

local metrics = {}

local state = {
  chosen = nil,      -- the file pt.metrics(path) chose (false: off), else nil (PARTRAIN_METRICS decides)
  file = nil,        -- the open file (rank 0), or nil
  stepped = false,   -- a record with a step was written: a resumed run's repeats are dropped
  header = nil,      -- the run header, once written
  extra = {},        -- fields pt.metrics.describe adds to the header
}

-- JSON ---------------------------------------------------------------------------------------
local escapes = { ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f", ["\n"] = "\\n", ["\r"] = "\\r",
                  ["\t"] = "\\t" }
local function quote(s)
  return '"' .. s:gsub('[%c"\\]', function(c) return escapes[c] or ("\\u%04x"):format(c:byte()) end) .. '"'
end

local encode
local function encode_table(t, seen)
  if seen[t] then error("pt.metrics: a table that contains itself cannot be written as JSON", 0) end
  seen[t] = true
  local n, keys = 0, {}
  for k in pairs(t) do
    n = n + 1
    keys[#keys + 1] = k
  end
  local parts = {}
  if n > 0 and n == #t then  -- an array 1..n
    for i = 1, n do parts[i] = encode(t[i], seen) end
    seen[t] = nil
    return "[" .. table.concat(parts, ",") .. "]"
  end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  for _, k in ipairs(keys) do parts[#parts + 1] = quote(tostring(k)) .. ":" .. encode(t[k], seen) end
  seen[t] = nil
  return "{" .. table.concat(parts, ",") .. "}"
end

--- JSON text of a Lua value: numbers (non-finite ones as null), strings, booleans, nil (null),
--- one-element tensors (their value), arrays and string-keyed tables of these.
function encode(v, seen)
  local t = type(v)
  if t == "number" then
    if v ~= v or v == math.huge or v == -math.huge then return "null" end
    if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return ("%d"):format(v) end
    for _, f in ipairs { "%.15g", "%.16g" } do   -- the shortest of these that reads back the same
      local text = f:format(v)
      if tonumber(text) == v then return text end
    end
    return ("%.17g"):format(v)
  elseif t == "string" then return quote(v)
  elseif t == "boolean" then return tostring(v)
  elseif v == nil then return "null"
  elseif t == "table" then return encode_table(v, seen or {})
  elseif core.is_tensor(v) and v:numel() == 1 then return encode(v:item())
  end
  error(("pt.metrics: a %s cannot be written as JSON (numbers, strings, booleans and tables of them can)"):format(
    core.is_tensor(v) and "tensor of several elements" or t), 0)
end
--- A value as JSON text; what cannot be written is an error at the caller's line.
function metrics.json(v)
  local ok, text = pcall(encode, v)
  if not ok then raise(text, 2) end
  return text
end

-- The file -------------------------------------------------------------------------------------
--- The metrics file of this run: the one pt.metrics(path) chose, else $PARTRAIN_METRICS (set by
--- `partrain --metrics FILE`), else nil.
function metrics.file()
  if state.chosen ~= nil then return state.chosen or nil end
  local env = os.getenv("PARTRAIN_METRICS")
  if env and env ~= "" then return env end
  return nil
end

local function close()
  if state.file then state.file:close() end
  state.file, state.stepped, state.header, state.plan_written = nil, false, nil, false
end

--- The peak bytes this rank's tensors have held: on its CUDA device when it has one (the caching
--- allocator's count), else on the CPU (pt.memory().allocated_peak, as mem() counts them).
function metrics.peak_bytes()
  local m = core.memory()
  return m.device_allocated_peak or m.allocated_peak
end

--- Chooses the metrics file from Lua (false: none), over $PARTRAIN_METRICS.
function metrics.set(path)
  if path ~= false and (type(path) ~= "string" or path == "") then
    raise("pt.metrics: a file name (string) or false expected, got " .. (path == "" and "''" or type(path)), 2)
  end
  if path ~= state.chosen then close() end
  state.chosen = path
end

--- Adds fields to the run header (peak_tflops, ...), when it is not written yet.
function metrics.describe(fields)
  if type(fields) ~= "table" then raise("pt.metrics.describe: a table of header fields expected, got " .. type(fields), 2) end
  for k, v in pairs(fields) do state.extra[k] = v end
end

-- The run header: the script, the world, the mesh, the resolved pt.args, the device.
local function header()
  local h = { event = "run", time = core.unix_time(), script = arg and arg[0] or nil, world = core.dist.world_size(),
              device = core.device and tostring(core.device()) or nil }
  local pt = package.loaded.partrain
  local mesh = pt and pt.last_mesh and pt.last_mesh()
  if mesh then
    h.mesh = { pipeline = mesh:size("pipeline"), tensor = mesh:size("tensor"), data = mesh:size("data") }
    if mesh:size("context") > 1 then h.mesh.context = mesh:size("context") end  -- absent: not split
    if mesh:size("expert") > 1 then h.mesh.expert = mesh:size("expert") end  -- absent: experts not split
  end
  local args = package.loaded["partrain.args"]
  if args and args.resolved then h.config = args.resolved end
  for k, v in pairs(state.extra) do h[k] = v end
  return h
end

-- The open file on rank 0 for a record of `step` (nil: none), or nil when there is no file. The
-- first record with a step drops every record the file holds from that step on (a resumed run
-- logs them again), and a torn last line; the header goes before the first record.
local function open_for(step)
  if core.dist.rank() ~= 0 then return nil end
  local path = metrics.file()
  if not path then return nil end
  if state.file and step and not state.stepped then  -- opened for a record without a step: drop now
    state.file:close()
    state.file = nil
  end
  if not state.file then
    core.files.jsonl_drop(path, step and not state.stepped and step or -1, "metrics file")
    state.file = core.files.jsonl_open(path, "metrics file")
  end
  if step then state.stepped = true end
  if not state.header then
    state.header = header()
    state.file:append(encode(state.header))
  end
  return state.file
end

--- Refuses, at the caller's `level`, a record's step that is not nil or a finite number: a NaN
--- step had been written as null (and, as a resumed run's first step, dropped none of the
--- records the run repeats).
function metrics._check_step(step, fn, level)
  if step ~= nil and (type(step) ~= "number" or step ~= step or math.abs(step) == math.huge) then
    raise(("%s: step must be a finite number, got %s"):format(fn, type(step) == "number" and tostring(step) or type(step)),
      level + 1)
  end
end

--- Appends a record (a table; "time" is added) on rank 0; other ranks do nothing. A record
--- with a step drops, the first time, the file's records from that step on (a resume).
function metrics.write(record)
  if type(record) ~= "table" then raise("pt.metrics.write: a table expected, got " .. type(record), 2) end
  local step = record.step
  metrics._check_step(step, "pt.metrics.write", 2)
  local file = open_for(step)
  if not file then return false end
  local r = {}
  for k, v in pairs(record) do r[k] = v end
  r.time = r.time or core.unix_time()
  local ok, line = pcall(encode, r)
  if not ok then raise(line, 2) end
  file:append(line)
  return true
end

--- Every rank's peak tensor bytes (metrics.peak_bytes: the device's on a GPU), gathered
--- over the world: a collective every rank calls. Rank 0 writes { event = "memory", step,
--- ranks = { bytes of rank 0, rank 1, ... } }; every rank gets the list back. With `model` (the
--- model, made parallel or not) the record also holds each rank's model state as
--- pt.memory_report measures it (state = { { params, grads, optimizer, master }, ... } in bytes),
--- and the first such record is followed by a plan record: that table as text, the shard summary
--- the run report shows.
local STATE = { "params", "grads", "optimizer", "master" }
function metrics.memory(step, model)
  metrics._check_step(step, "pt.metrics.memory", 2)  -- on every rank, before the collective
  if model ~= nil and not core.nn.is_module(model) then
    raise("pt.metrics.memory: model must be a module, got " .. type(model), 2)
  end
  local world, rank = core.dist.world_size(), core.dist.rank()
  local width = model and 1 + #STATE or 1
  local mine = { metrics.peak_bytes() }
  if model then
    local held = core.plan.held(model, core.optim.of(model))
    for i, k in ipairs(STATE) do mine[i + 1] = held[k] or 0 end
  end
  local rows = { mine }
  if world > 1 and not core.plan.planning() then
    local t = core.zeros(world, width, { dtype = "float64", device = tostring(core.device()) })
    local row = t:select(0, rank)
    for i, v in ipairs(mine) do row:narrow(0, i - 1, 1):fill_(v) end
    core.dist.world():all_reduce(t, "sum")
    rows = t:cpu():totable()
  end
  local ranks, held = {}, model and {} or nil
  for r, row in ipairs(rows) do
    ranks[r] = row[1]
    if held then
      held[r] = {}
      for i, k in ipairs(STATE) do held[r][k] = row[i + 1] end
    end
  end
  metrics.write { event = "memory", step = step, ranks = ranks, state = held }
  if held and not state.plan_written and state.file then  -- once a file: its first memory record's
    state.plan_written = true
    local mb = function(b) return ("%10.2f"):format(b / 1e6) end
    local lines = { ("model state a rank in MB (pt.memory_report) and peak tensor MB, after step %s:"):format(
                      tostring(step or "?")),
                    ("%-6s%10s%10s%10s%10s%10s"):format("rank", "params", "grads", "optimizer", "master", "peak") }
    for r, row in ipairs(rows) do
      lines[#lines + 1] = ("%-6d%s%s%s%s%s"):format(r - 1, mb(row[2]), mb(row[3]), mb(row[4]), mb(row[5]), mb(row[1]))
    end
    metrics.plan(table.concat(lines, "\n"))
  end
  return ranks
end

-- Experts ---------------------------------------------------------------------------------------
-- Each model's MoE blocks over the whole world, found once (a weak table: the model's lifetime):
-- { paths = { block path, ... } in natural order, experts = { E of each }, row = { [path] = i } }.
local layouts = setmetatable({}, { __mode = "k" })

-- "layers.10.x" after "layers.9.x": the numbers in a path compared as numbers.
local function natural(path) return (path:gsub("%d+", function(d) return ("%012d"):format(tonumber(d)) end)) end

-- Every rank's blocks (its pipeline stage holds only some, under their global paths), gathered
-- as text over the world: the longest text's length (max), then each rank's bytes in its row of
-- a [world, longest] table (sum). `mine`: { [path] = E } of this rank.
local function gather_layout(mine, world, rank, device)
  local lines = {}
  for path, e in pairs(mine) do lines[#lines + 1] = e .. "\t" .. path end  -- "" is a lone block's path
  local text = table.concat(lines, "\n")
  local texts = { text }
  if world > 1 and not core.plan.planning() then
    local f64 = { dtype = "float64", device = device }
    local longest = core.tensor({ #text }, f64)
    core.dist.world():all_reduce(longest, "max")
    local n = longest:item()
    texts = {}
    if n > 0 then
      local all = core.zeros(world, n, f64)
      if #text > 0 then
        local bytes = {}
        for i = 1, n do bytes[i] = text:byte(i) or 0 end
        all:select(0, rank):copy_(core.tensor(bytes, f64))
      end
      core.dist.world():all_reduce(all, "sum")
      for _, row in ipairs(all:cpu():totable()) do
        local chars = {}
        for _, b in ipairs(row) do
          if b == 0 then break end
          chars[#chars + 1] = string.char(b)
        end
        texts[#texts + 1] = table.concat(chars)
      end
    end
  end
  local experts = {}
  for _, t in ipairs(texts) do
    for line in (t .. "\n"):gmatch("([^\n]*)\n") do
      local e, path = line:match("^(%d+)\t(.*)$")
      if e then experts[path] = tonumber(e) end
    end
  end
  local layout = { paths = {}, experts = {}, row = {} }
  for path in pairs(experts) do layout.paths[#layout.paths + 1] = path end
  table.sort(layout.paths, function(a, b) return natural(a) < natural(b) end)
  for i, path in ipairs(layout.paths) do layout.experts[i], layout.row[path] = experts[path], i end
  return layout
end

--- The load of every MoE block of `model` since the last call, summed over the world: a
--- collective every rank calls (at the same steps; also where its pipeline stage holds no MoE
--- block). Rank 0 writes { event = "experts", step, since, layers = { block paths }, routed =
--- { { slots routed to each expert, before capacity drops }, ... a layer }, dropped, slots,
--- forwards, aux_loss, z_loss (a layer each: the losses' mean a forward), dropped_fraction,
--- max_over_mean }. Tensor ranks hold the same tokens: only tensor rank 0's are counted. Returns
--- the step record's fields { moe_aux_loss, moe_dropped_fraction, moe_max_over_mean }, the same
--- on every rank ({} when no forward was counted), or nil when the model has no MoE block.
function metrics.experts(step, model)
  metrics._check_step(step, "pt.metrics.experts", 2)  -- on every rank, before the collectives
  if not core.nn.is_module(model) then raise("pt.metrics.experts: model must be a module, got " .. type(model), 2) end
  local world, rank = core.dist.world_size(), core.dist.rank()
  local device = tostring(core.device())
  local pt = package.loaded.partrain
  local stats = pt.moe.stats(model)   -- taken on every rank: the counts start again from here
  local layout = layouts[model]
  if not layout then
    local mine = {}
    for path, s in pairs(stats) do mine[path] = #s.routed end
    layout = gather_layout(mine, world, rank, device)
    layouts[model] = layout
  end
  local rows = #layout.paths
  if rows == 0 then return nil end
  -- A row a block: routed to each of its experts (the widest block's count of columns), then
  -- dropped, slots, aux, z and forwards.
  local width = 0
  for _, e in ipairs(layout.experts) do width = math.max(width, e) end
  local mesh = core.parallel.mesh(model)
  local counted = not mesh or mesh:coord().tensor == 0
  local flat, unknown = {}, nil
  for i = 1, rows * (width + 5) + 1 do flat[i] = 0 end  -- and a last element: blocks the layout lacks
  for path, s in pairs(stats) do
    local at = layout.row[path]
    if not at then
      unknown, flat[#flat] = path, flat[#flat] + 1
    elseif counted then
      local base = (at - 1) * (width + 5)
      for e, v in ipairs(s.routed) do flat[base + e] = v end
      for j, v in ipairs { s.dropped, s.slots, s.aux, s.z, s.forwards } do flat[base + width + j] = v end
    end
  end
  local sums = core.tensor(flat, { dtype = "float64", device = device })
  if world > 1 and not core.plan.planning() then core.dist.world():all_reduce(sums, "sum") end
  local values = sums:cpu():totable()
  if values[#values] > 0 then  -- raised on every rank alike, after the collective
    raise(("pt.metrics.experts: %d MoE block(s)%s appeared after the first call for this model; the blocks "
      .. "must stay as they were"):format(values[#values], unknown and " ('" .. unknown .. "' here)" or ""), 2)
  end
  local event = { event = "experts", step = step, since = layout.since, layers = layout.paths, routed = {}, dropped = {},
                  slots = {}, forwards = {}, aux_loss = {}, z_loss = {} }
  local fields, dropped, slots, aux, worst = {}, 0, 0, 0, nil
  for i = 1, rows do
    local base = (i - 1) * (width + 5)
    local routed, total, top = {}, 0, 0
    for e = 1, layout.experts[i] do
      routed[e] = values[base + e]
      total, top = total + routed[e], math.max(top, routed[e])
    end
    local d, n, a, z, f = unpack(values, base + width + 1, base + width + 5)
    event.routed[i], event.dropped[i], event.slots[i], event.forwards[i] = routed, d, n, f
    -- Every rank that holds a block saw the same global losses a forward: their sums over the
    -- counted ranks, over the forwards, are the losses' mean a forward.
    event.aux_loss[i], event.z_loss[i] = f > 0 and a / f or 0, f > 0 and z / f or 0
    dropped, slots, aux = dropped + d, slots + n, aux + event.aux_loss[i]
    if total > 0 then worst = math.max(worst or 0, top / (total / #routed)) end
  end
  if slots > 0 then
    event.dropped_fraction, event.max_over_mean = dropped / slots, worst
    fields = { moe_aux_loss = aux, moe_dropped_fraction = dropped / slots, moe_max_over_mean = worst }
  end
  layout.since = step
  metrics.write(event)
  return fields
end

--- Writes the planner's per-rank summary (text) as { event = "plan", text }.
function metrics.plan(text)
  if type(text) ~= "string" then raise("pt.metrics.plan: text expected, got " .. type(text), 2) end
  return metrics.write { event = "plan", text = text }
end

return setmetatable(metrics, {
  --- pt.metrics(path): chooses the metrics file (false: none).
  __call = function(_, path)
    if path ~= false and (type(path) ~= "string" or path == "") then
      raise("pt.metrics: a file name (string) or false expected, got " .. (path == "" and "''" or type(path)), 2)
    end
    metrics.set(path)
  end,
})
