-- What partrain plan --auto prints: sizes and times as partrain plan writes them, a layout in
-- words, the ranking as a table or JSON, why each layout lost, and the winner as a config file.
local S = require "partrain.auto.space"

local M = {}

local function fail(fmt, ...) error("partrain plan --auto: " .. fmt:format(...), 0) end

-- ---- Text ------------------------------------------------------------------------------------

--- Bytes as partrain plan prints them (KiB, MiB, GiB: powers of 1024).
function M.bytes_text(n)
  local units, i = { "B", "KiB", "MiB", "GiB", "TiB" }, 1
  while n >= 1024 and i < #units do n, i = n / 1024, i + 1 end
  return i == 1 and ("%d B"):format(n) or ("%.2f %s"):format(n, units[i])
end

--- Seconds as "1.234 s", "12.3 ms" or "45.6 us".
function M.seconds_text(s)
  if s >= 1 then return ("%.3f s"):format(s) end
  if s >= 1e-3 then return ("%.1f ms"):format(s * 1e3) end
  return ("%.1f us"):format(s * 1e6)
end

--- A layout in words: "tensor 8 (SP) x pipeline 2 (zbh1, 8 mb) x data 4, ZeRO-1".
function M.layout_text(l)
  local parts = {}
  if l.tensor > 1 then parts[#parts + 1] = ("tensor %d%s"):format(l.tensor, l.sequence_parallel and " (SP)" or "") end
  if l.context > 1 then parts[#parts + 1] = ("context %d (%s)"):format(l.context, l.context_mode or "ring") end
  if l.pipeline > 1 then
    local inner = { l.schedule or "the script's schedule" }
    if (l.chunks or 1) > 1 then inner[#inner + 1] = l.chunks .. " chunks" end
    if l.microbatches then inner[#inner + 1] = l.microbatches .. " mb" end
    parts[#parts + 1] = ("pipeline %d (%s)"):format(l.pipeline, table.concat(inner, ", "))
  end
  parts[#parts + 1] = "data " .. l.data
  local text = table.concat(parts, " x ")
  if (l.expert or 1) > 1 then text = text .. ", expert " .. l.expert end
  if (l.zero_stage or 0) > 0 then
    text = text .. ", ZeRO-" .. l.zero_stage
    if (l.zero_groups or 0) > 0 then text = text .. (" in %d groups"):format(l.zero_groups) end
  end
  if l.recompute and l.recompute ~= "none" then text = text .. ", recompute " .. l.recompute end
  return text
end

-- ---- Output ----------------------------------------------------------------------------------

-- Why `c` is not first: the step it loses by, and the term most of it is in; or its memory.
local function why_not(c, best, memory)
  if not c.fits then
    return ("does not fit: needs %s of %s"):format(M.bytes_text(c.peak), M.bytes_text(memory))
  end
  if c == best then return "" end
  local a, b = c.prediction, best.prediction
  local terms = { { "compute", a.compute - b.compute }, { "communication", a.comm - b.comm },
                  { "bubble", a.bubble - b.bubble } }
  table.sort(terms, function(x, y) return x[2] > y[2] end)
  local lost = (a.step - b.step) / b.step * 100
  if terms[1][2] <= 0 then return ("+%.1f %%"):format(lost) end
  return ("+%.1f %%, %s +%s"):format(lost, terms[1][1], M.seconds_text(terms[1][2]))
end

local function counts(all)
  local n = { layouts = #all, planned = 0, estimated = 0, refused = 0, unfit = 0, skipped = 0 }
  for _, c in ipairs(all) do
    if c.skipped then n.skipped = n.skipped + 1
    elseif c.refusal then n.refused = n.refused + 1
    elseif c.exact then n.planned = n.planned + 1
    else n.estimated = n.estimated + 1 end
    if c.prediction and not c.refusal and not c.fits then n.unfit = n.unfit + 1 end
  end
  return n
end

local function device_line(ctx)
  local d = ctx.device
  return ("%s (%s%s; peak %.3g TFLOP/s %s at %g %%)"):format(d.name, M.bytes_text(d.memory),
    d.memory_source and " by --device-memory" or "", d.flops[ctx.dtype] / 1e12, ctx.dtype, d.efficiency * 100)
end

-- The command that runs `c`.
local function command_of(ctx, c)
  local o = ctx.o
  local words = { "partrain", "--nproc-per-node", tostring(o.nproc) }
  if o.world / o.nproc > 1 then words[#words + 1] = "--nnodes"; words[#words + 1] = tostring(o.world / o.nproc) end
  words[#words + 1] = o.script
  for _, w in ipairs(o.args) do words[#words + 1] = w end
  for _, w in ipairs(c.flags) do words[#words + 1] = w end
  for i, w in ipairs(words) do
    if w == "" or w:find("[^%w%-_./=:,+@%%]") then words[i] = "'" .. w:gsub("'", "'\\''") .. "'" end
  end
  return table.concat(words, " ")
end

function M.print_text(ctx, ranked, all, seconds)
  local o, n = ctx.o, counts(all)
  print(("auto layout of %s for %d ranks (%d node%s x %d) of %s"):format(o.script, o.world, o.world / o.nproc,
    o.world / o.nproc == 1 and "" or "s", o.nproc, device_line(ctx)))
  print(("searched in %.1f s: %d layouts, %d planned (%d rank plans), %d estimated from them, %d refused by the script, "
    .. "%d do not fit, %d skipped by a bound"):format(seconds, n.layouts, n.planned, ctx.stats.ranks, n.estimated,
    n.refused, n.unfit, n.skipped))
  if #ranked > 0 then
    local rows = { { "#", "layout", "step", "compute", "comm", "bubble", "peak a rank", "why not first" } }
    for i = 1, math.min(o.top or 5, #ranked) do
      local c, p = ranked[i], ranked[i].prediction
      rows[#rows + 1] = { tostring(i), c.text, M.seconds_text(p.step), M.seconds_text(p.compute), M.seconds_text(p.comm),
                          c.layout.pipeline > 1 and M.seconds_text(p.bubble) or "-", M.bytes_text(c.peak) .. (c.exact and "" or " (est.)"),
                          why_not(c, ranked[1], ctx.device.memory) }
    end
    local widths = {}
    for _, row in ipairs(rows) do
      for j, cell in ipairs(row) do widths[j] = math.max(widths[j] or 0, #cell) end
    end
    for _, row in ipairs(rows) do
      local cells = {}
      for j, cell in ipairs(row) do cells[j] = j == #row and cell or cell .. (" "):rep(widths[j] - #cell) end
      print((("  " .. table.concat(cells, "  ")):gsub("%s+$", "")))
    end
    print("  (step = compute + exposed communication + pipeline bubble, predicted; peak: planned, or (est.) "
      .. "simulated from a plan of another schedule; gpipe is not searched: 1F1B takes its time with less memory)")
  end
  if o.verbose and n.refused > 0 then
    print("refused by the script:")
    for _, c in ipairs(all) do if c.refusal then print(("  %s: %s"):format(c.text, c.refusal)) end end
  elseif n.refused > 0 then
    print(("%d layouts refused by the script (-v lists them)"):format(n.refused))
  end
  if o.verbose and n.skipped > 0 then
    print("skipped by a bound (average compute / (1 - the least unit-time bubble), or the compute of the rank with the "
      .. "head, >= the best step planned):")
    for _, c in ipairs(all) do if c.skipped then print(("  %s: %s"):format(c.text, c.skipped)) end end
  elseif n.skipped > 0 then
    print(("%d pipelined layouts skipped: a bound on their step cannot beat the best (-v lists them)"):format(n.skipped))
  end
  if ranked[1] and ranked[1].fits then print("best: " .. command_of(ctx, ranked[1])) end
end

-- JSON of a list of strings (an empty one too: "[]", which metrics.json would write as {}).
local function json_list(list, json)
  local parts = {}
  for i, w in ipairs(list) do parts[i] = json(w) end
  return "[" .. table.concat(parts, ",") .. "]"
end

-- JSON of an object whose fields are { name, value } in order; a value given as { json = text }
-- is written as that text.
local function json_object(fields, json)
  local parts = {}
  for _, f in ipairs(fields) do
    if f[2] ~= nil then
      parts[#parts + 1] = json(f[1]) .. ":" .. (type(f[2]) == "table" and f[2].json or json(f[2]))
    end
  end
  return "{" .. table.concat(parts, ",") .. "}"
end

function M.json_of(ctx, ranked, all, seconds)
  local json = require("partrain.metrics").json
  local n = counts(all)
  local position, list = {}, {}
  for i, c in ipairs(ranked) do position[c] = i end
  local order, searched = {}, {}
  for i, c in ipairs(all) do order[i], searched[c] = c, i end
  table.sort(order, function(a, b)  -- the ranking, then the rest in the order searched
    local x, y = position[a] or math.huge, position[b] or math.huge
    if x ~= y then return x < y end
    return searched[a] < searched[b]
  end)
  for _, c in ipairs(order) do
    local p = c.prediction
    list[#list + 1] = json_object({
      { "rank", position[c] }, { "text", c.text }, { "values", { json = json(c.values) } },
      { "flags", { json = json_list(c.flags, json) } }, { "data", c.layout.data },
      { "step", p and p.step }, { "compute", p and p.compute }, { "comm", p and p.comm },
      { "bubble", p and p.bubble }, { "bubble_ratio", p and p.bubble_ratio }, { "peak_bytes", c.peak },
      { "fits", c.fits }, { "exact", c.exact or false }, { "estimated_from", c.from and c.from.text },
      { "refused", c.refusal }, { "skipped", c.skipped },
      { "why", position[c] and why_not(c, ranked[1], ctx.device.memory) or nil } }, json)
  end
  local d = ctx.device
  local best = ranked[1] and ranked[1].fits and ranked[1] or nil
  return json_object({
    { "script", ctx.o.script }, { "world", ctx.o.world }, { "nproc", ctx.o.nproc }, { "dtype", ctx.dtype },
    { "seconds", seconds },
    { "device", { json = json { name = d.name, memory = d.memory, flops = d.flops[ctx.dtype], efficiency = d.efficiency,
                               intra = d.intra, inter = d.inter, overlap = d.overlap, source = d.source } } },
    { "counts", { json = json { layouts = n.layouts, planned = n.planned, estimated = n.estimated, refused = n.refused,
                               unfit = n.unfit, skipped = n.skipped, rank_plans = ctx.stats.ranks } } },
    { "best", best and best.text }, { "command", best and command_of(ctx, best) },
    { "candidates", { json = "[" .. table.concat(list, ",") .. "]" } } }, json)
end

--- M.config_source(values [, script]): a pt.args config file returning `values` (flag names in
--- S.FLAGS order).
function M.config_source(values, script)
  local lines = { ("-- the layout partrain plan --auto found: partrain %s --config THIS_FILE"):format(script or "script.lua"),
                  "return {" }
  for _, name in ipairs(S.FLAGS) do
    local v = values[name]
    if v ~= nil then
      lines[#lines + 1] = ("  %s = %s,"):format(name, type(v) == "string" and ("%q"):format(v) or tostring(v))
    end
  end
  lines[#lines + 1] = "}"
  return table.concat(lines, "\n") .. "\n"
end

function M.write_config(path, values, script)
  local tmp = path .. ".tmp"
  local f, err = io.open(tmp, "wb")
  if not f then fail("--save-config %s: %s", path, err) end
  local ok, werr = f:write(M.config_source(values, script))
  f:close()
  if not ok then os.remove(tmp); fail("--save-config %s: %s", path, werr) end
  local renamed, rerr = os.rename(tmp, path)
  if not renamed then os.remove(tmp); fail("--save-config %s: %s", path, rerr) end
end

return M
