-- The SPMD REPL: rank 0 reads a chunk (readline when stdin is a terminal), every rank runs it,
-- and rank 0 prints the outputs grouped by identical text ("[ranks 0,2] ..."). Started by
-- `partrain -i script.lua`, `partrain repl`, or pt.breakpoint() inside a script.
local pt = require "partrain"
local core = require "partrain.core"
local raise = core._raise

local R = {}

local rank, world = pt.dist.rank(), pt.dist.world_size()
local history_file = (os.getenv("HOME") or ".") .. "/.partrain_history"

-- "0-3", "0,2", "1": a compact list of ranks.
local function rank_list(ranks)
  local parts, i = {}, 1
  while i <= #ranks do
    local j = i
    while j < #ranks and ranks[j + 1] == ranks[j] + 1 do j = j + 1 end
    if j - i >= 2 then parts[#parts + 1] = ranks[i] .. "-" .. ranks[j]
    else for k = i, j do parts[#parts + 1] = tostring(ranks[k]) end end
    i = j + 1
  end
  return table.concat(parts, ",")
end
R.rank_list = rank_list

--- Rank 0's view of every rank's output: identical texts grouped under the ranks that printed them.
function R.group_outputs(outputs)
  if #outputs == 1 then return outputs[1] end
  local order, by_text = {}, {}
  for r, text in ipairs(outputs) do
    if not by_text[text] then
      by_text[text] = {}
      order[#order + 1] = text
    end
    table.insert(by_text[text], r - 1)
  end
  local lines = {}
  for _, text in ipairs(order) do
    if text ~= "" then
      local ranks = by_text[text]
      local tag = ("[rank%s %s]"):format(#ranks > 1 and "s" or "", rank_list(ranks))
      local body = text:gsub("\n$", "")
      if body:find("\n") then lines[#lines + 1] = tag .. "\n" .. body .. "\n"
      else lines[#lines + 1] = tag .. " " .. body .. "\n" end
    end
  end
  return table.concat(lines)
end

-- Runs `fn` with print and io.write writing into a buffer; returns the text and fn's results.
local function captured(fn)
  local buffer = {}
  local saved_print, saved_write = print, io.write
  print = function(...)
    local n = select("#", ...)
    local parts = {}
    for i = 1, n do parts[i] = tostring((select(i, ...))) end
    buffer[#buffer + 1] = table.concat(parts, "\t") .. "\n"
  end
  io.write = function(...)
    for i = 1, select("#", ...) do buffer[#buffer + 1] = tostring((select(i, ...))) end
    return io.stdout
  end
  local ok, err = pcall(fn)
  print, io.write = saved_print, saved_write
  if not ok then buffer[#buffer + 1] = tostring(err) .. "\n" end
  return table.concat(buffer)
end

-- A value as the REPL shows it.
local function show(v)
  if type(v) == "string" then return string.format("%q", v) end
  if type(v) == "table" and getmetatable(v) == nil then
    local parts, n = {}, 0
    for k, x in pairs(v) do
      n = n + 1
      if n > 20 then parts[#parts + 1] = "..."; break end
      parts[#parts + 1] = (type(k) == "string" and k or "[" .. tostring(k) .. "]") .. " = " .. tostring(x)
    end
    return "{ " .. table.concat(parts, ", ") .. " }"
  end
  return tostring(v)
end

-- Compiles a chunk as lua.c does: "=expr" and plain expressions print their values.
-- Returns fn, or nil and the message; `incomplete` when more lines could complete it.
local function compile(code, env)
  if code:sub(1, 1) == "=" then code = "return " .. code:sub(2) end
  -- Source only ("t"): LuaJIT does not verify bytecode, and a bytecode chunk can crash it.
  local fn, err = load("return " .. code, "=stdin", "t")
  if not fn then fn, err = load(code, "=stdin", "t") end
  if not fn then return nil, err, err:find("<eof>") ~= nil end
  setfenv(fn, env)
  return fn
end

-- Reads one chunk on rank 0: lines until they compile (or fail for a reason other than an
-- unfinished statement). Returns the code, or nil at end of input.
local function read_chunk(env)
  local interactive = core.repl_isatty()
  local code
  while true do
    local prompt = code and ">> " or "> "
    local line
    if interactive then line = core.repl_readline(prompt)
    else line = io.read("*l") end
    if line == nil then return nil end
    if line == "\0interrupt" then code = nil  -- Ctrl-C at the prompt: start over
    else
      code = code and (code .. "\n" .. line) or line
      local _, _, incomplete = compile(code, env)
      if not incomplete then
        if interactive and code:find("%S") then core.repl_add_history(code) end
        return code
      end
    end
  end
end

-- Names completion offers: the fields of the table or module before the last dot or colon,
-- or the globals.
local function completions(env)
  return function(word)
    local base, sep, partial = word:match("^(.*)([%.:])([%w_]*)$")
    local candidates, source = {}, env
    if base then
      source = env
      for name in base:gmatch("[^%.:]+") do
        if type(source) ~= "table" and type(source) ~= "userdata" then source = nil break end
        local ok, v = pcall(function() return source[name] end)
        source = ok and v or nil
        if source == nil then break end
      end
    else
      partial = word
    end
    local seen = {}
    local function add(t)
      if type(t) ~= "table" then return end
      for k in pairs(t) do
        if type(k) == "string" and k:sub(1, #partial) == partial and not seen[k] then
          seen[k] = true
          candidates[#candidates + 1] = (base and (base .. sep) or "") .. k
        end
      end
    end
    if source ~= nil then
      if type(source) == "userdata" and pt.nn and core.nn.is_module(source) then
        for name in source:named_children() do add({ [name] = true }) end
        for name in source:named_parameters() do if not name:find("%.") then add({ [name] = true }) end end
        add(core.Module)
      elseif pt.is_tensor(source) then
        add(core.Tensor)
      else
        add(source)
        local mt = getmetatable(source)
        if mt and type(mt.__index) == "table" then add(mt.__index) end
      end
      if not base then add(_G) end
    end
    table.sort(candidates)
    return candidates
  end
end

--- An environment that reads `front` first, then `back`, and writes to `back`.
function R.layered(front, back)
  return setmetatable({}, {
    __index = function(_, k)
      local v = front[k]
      if v ~= nil then return v end
      return back[k]
    end,
    __newindex = back,
  })
end

--- The REPL loop, on every rank. `env`: the environment chunks run in (the script's globals,
--- or a breakpoint's view of its locals). Returns when input ends or a chunk calls exit(); on
--- rank 0 it returns why it could not read (the terminal belongs to another process group), or
--- nil. Chunks and outputs travel through the rendezvous store (repl.cpp), not collectives, so
--- the other ranks wait for the next chunk as long as rank 0 does, and a chunk that Ctrl-C left
--- half-way through its collectives cannot jam the next one.
function R.loop(env, banner)
  env = env or _G
  local done = false
  local helpers = R.helpers(function() done = true end)
  local scope = R.layered(helpers, env)
  local session = world > 1 and core.repl_session() or nil
  local problem, editing = nil, false
  if rank == 0 then
    problem = core.repl_terminal_problem()
    editing = not problem and core.repl_isatty()
    if editing then
      core.repl_start(history_file, completions(scope))
      if banner then io.write(banner, "\n") end
    end
  end
  core.repl_signals(true)
  local ok, err = pcall(function()
    local n = 0
    while not done do
      n = n + 1
      local code
      if rank == 0 then
        if not problem then code = read_chunk(scope) end
        if session then core.repl_publish(session, n, code) end
      else
        code = core.repl_receive(session, n)
      end
      if code == nil then break end
      local output = captured(function()
        local fn, err = compile(code, scope)
        if not fn then print(err) return end
        -- n counts the nils too: =1, nil, 3 shows three values.
        local results = (function(...) return { n = select("#", ...), ... } end)(core.repl_try(fn))
        if results[1] == false then
          -- The traceback down to the chunk; the REPL's own frames below it say nothing.
          print((results[2]:gsub("\n%s*%[C%]: in function 'repl_try'.*$", "")))
          return
        end
        local shown = {}
        for i = 2, results.n do shown[#shown + 1] = show(results[i]) end
        if #shown > 0 then print(table.concat(shown, "\t")) end
      end)
      local outputs, leave = { output }, done
      if session then outputs, leave = core.repl_exchange(session, n, output, done) end
      done = leave  -- exit() on any rank ends the REPL on every rank
      if rank == 0 then
        io.stdout:write(R.group_outputs(outputs))
        io.stdout:flush()
      end
    end
  end)
  core.repl_signals(false)
  if editing then core.repl_stop(history_file) end
  if not ok then error(err, 0) end
  return problem
end

-- Helpers ------------------------------------------------------------------------------------

local function shape_text(shape) return "[" .. table.concat(shape, ", ") .. "]" end
local function mb(bytes) return ("%.2f MB"):format(bytes / 1e6) end

--- The helpers every chunk sees (beside the script's globals).
function R.helpers(stop)
  local H = { pt = pt }
  function H.exit() stop() end

  --- Runs fn on one rank only; the others return nothing.
  function H.on(r, fn, ...)
    if type(r) ~= "number" or type(fn) ~= "function" then raise("on(rank, fn): a rank number and a function expected", 2) end
    if r ~= r or r % 1 ~= 0 or r < 0 or r >= world then  -- a fraction or NaN would run nowhere
      raise(("on: rank %s is not one of the ranks 0..%d"):format(tostring(r), world - 1), 2)
    end
    if rank == r then return fn(...) end
  end

  --- The model shards() and mem() look at: the argument, else the last one made parallel.
  local function model_of(m, helper)
    if m ~= nil then
      if not core.nn.is_module(m) then
        raise(("%s: the model must be a module (or nil: the last one pt.parallelize made), got %s"):format(helper,
          type(m)), 3)
      end
      return m
    end
    local last = pt.parallelized()
    if not last then raise("no model: pass one, or make one with pt.parallelize", 3) end
    return last
  end

  --- "stage 0: h.0-h.1 + wte, wpe": the blocks (and first and last modules) of this rank's
  --- pipeline stages, one "stage" a chunk; nil when the model is not pipelined.
  local function stages_text(model)
    local p = model and core.parallel.pipeline(model)
    if not p then return nil end
    local total = #p.bounds - 1
    local parts = {}
    for _, v in ipairs(p.stages) do
      local lo, hi = p.bounds[v + 1], p.bounds[v + 2] - 1
      local text = ("stage %d: %s.%d"):format(v, p.blocks, lo) .. (hi > lo and ("-%s.%d"):format(p.blocks, hi) or "")
      if v == 0 and #p.first > 0 then text = text .. " + " .. table.concat(p.first, ", ") end
      if v == total - 1 and #p.last > 0 then text = text .. " + " .. table.concat(p.last, ", ") end
      parts[#parts + 1] = text
    end
    return ("pipeline rank %d of %d (%s, %d micro-batches), %s"):format(p.rank, p.size, p.schedule, p.microbatches,
      table.concat(parts, "; "))
  end

  --- "context rank 1 of 2: positions 4-7 and 8-11 of 16 (chunks 1 and 2 of 4 of every
  --- sequence)": under context parallelism, the rows of each sequence this rank holds (chunks r
  --- and 2c-1-r of 2c), as positions of a sequence of the model's `seq` when it has one; nil
  --- without a context split.
  local function context_text(model, mesh)
    if not mesh or mesh:size("context") <= 1 then return nil end
    local c, r = mesh:size("context"), mesh:coord().context
    local chunks = ("chunks %d and %d of %d of every sequence"):format(r, 2 * c - 1 - r, 2 * c)
    local seq = model:attribute("seq")
    if not seq or seq % (2 * c) ~= 0 then return ("context rank %d of %d: %s"):format(r, c, chunks) end
    local n, held = seq / (2 * c), pt.cp.zigzag(seq, c, r)
    local early, late = held:select(0, 0):item(), held:select(0, n):item()
    return ("context rank %d of %d: positions %d-%d and %d-%d of %d (%s)"):format(r, c, early, early + n - 1, late,
      late + n - 1, seq, chunks)
  end

  --- ZeRO-3's slices: for each unit (matching `pattern` by a parameter's name), its flat buffer's
  --- length and, for each zero rank, the element range it keeps and the parameters that range
  --- cuts ("h.0.ln_1.weight .. h.0.attn.c_attn.weight[:48896], 4 parameters").
  local function zero3_text(z3, pattern)
    local size = #z3.group
    local out = { ("ZeRO-3 over ranks %s: zero rank r keeps elements [r*n/%d, (r+1)*n/%d) of each unit's flat buffer "
      .. "(n elements, padded); a unit is whole only while it is gathered"):format(rank_list(z3.group), size, size) }
    local function cut(p, lo, hi)  -- parameter p's part of [lo, hi), as text, or nil when none
      local a, b = math.max(lo, p.offset), math.min(hi, p.offset + p.numel)
      if a >= b then return nil end
      if a == p.offset and b == p.offset + p.numel then return p.name end
      return ("%s[%s:%s]"):format(p.name, a > p.offset and (a - p.offset) or "", b < p.offset + p.numel and (b - p.offset) or "")
    end
    for _, unit in ipairs(z3.units) do
      for _, buffer in ipairs(unit.buffers) do
        local shown = not pattern
        for _, p in ipairs(buffer.params) do shown = shown or p.name:find(pattern) ~= nil end
        if shown then
          out[#out + 1] = ("  %s: %d elements, %s (%s), %d parameters"):format(unit.name, buffer.numel, mb(buffer.bytes),
            buffer.dtype, #buffer.params)
          local part = buffer.numel / size
          for r = 0, size - 1 do
            local lo, hi = r * part, (r + 1) * part
            local cuts = {}
            for _, p in ipairs(buffer.params) do cuts[#cuts + 1] = cut(p, lo, hi) end
            local names = #cuts == 0 and "padding" or #cuts == 1 and cuts[1] or ("%s .. %s, %d parameters"):format(cuts[1],
              cuts[#cuts], #cuts)
            out[#out + 1] = ("    rank %-4d [%d:%d)  %s"):format(z3.group[r + 1], lo, hi, names)
          end
        end
      end
    end
    return out
  end

  --- A table of the model's parameters matching `pattern` (a Lua pattern over names): logical
  --- shape, local shape, split dimension, which ranks hold which slice, bytes a rank.
  function H.shards(pattern, model)
    if type(pattern) == "userdata" then pattern, model = nil, pattern end
    if pattern ~= nil and type(pattern) ~= "string" then
      raise("shards: the pattern must be a string (a Lua pattern over parameter names), got " .. type(pattern), 2)
    end
    model = model_of(model, "shards")
    local mesh = pt.mesh_of(model)
    local staged = stages_text(model)
    -- Whole parameters are held by every rank of this rank's stage (all ranks without a pipeline).
    local whole = "all (whole)"
    if staged then
      local members = {}
      for _, r in ipairs(mesh:ranks("data_context")) do
        for _, t in ipairs(mesh:ranks("tensor", r)) do members[#members + 1] = t end
      end
      table.sort(members)
      whole = ("ranks %s (whole)"):format(rank_list(members))
    end
    local z3 = core.parallel.zero3(model)
    local sliced = {}  -- ZeRO-3: the parameters its units slice over the zero ranks
    for _, unit in ipairs(z3 and z3.units or {}) do
      for _, buffer in ipairs(unit.buffers) do
        for _, p in ipairs(buffer.params) do sliced[p.name] = true end
      end
    end
    local lines = { ("%-32s %-14s %-14s %-5s %-10s %s"):format("parameter", "shape", "local", "split", "bytes/rank", "held by") }
    local total = 0
    for _, row in ipairs(pt.tp.shards(model)) do
      local found, hit = true, nil
      if pattern then found, hit = pcall(string.find, row.name, pattern) end
      if not found then
        raise(("shards: '%s' is not a valid Lua pattern (escape magic characters with %%: %%[ for [)"):format(pattern), 2)
      end
      if not pattern or hit then
        total = total + row.bytes
        local held
        if row.dim then
          local parts = {}
          -- Experts split over the expert group: the ranks holding the same experts are expert_data's.
          local experts = mesh and mesh:size("expert") > 1 and rank_list(mesh:ranks("expert", row.ranks[1]))
                          == rank_list(row.ranks)
          for r, slices in ipairs(row.slices) do
            local global = row.ranks[r]
            local replicas = mesh and mesh:ranks(experts and "expert_data" or "data_context", global) or { global }
            local ranges = {}
            for _, s in ipairs(slices) do ranges[#ranges + 1] = s[1] .. ":" .. (s[1] + s[2]) end
            parts[#parts + 1] = ("ranks %s %s"):format(rank_list(replicas), table.concat(ranges, "+"))
          end
          held = table.concat(parts, "; ")
          local inner = pt.tp.sharding(model, row.name).inner_dim
          if inner then held = held .. (", each split on %d over tensor=%d"):format(inner, mesh:size("tensor")) end
        else
          held = sliced[row.name] and "ZeRO-3: a slice a zero rank, whole while gathered (below)" or whole
        end
        lines[#lines + 1] = ("%-32s %-14s %-14s %-5s %-10s %s"):format(row.name, shape_text(row.shape),
          shape_text(row.local_shape), row.dim and tostring(row.dim) or "-", mb(row.bytes), held)
      end
    end
    lines[#lines + 1] = ("total on this rank: %s"):format(mb(total))
    if z3 then
      lines[#lines + 1] = ("(whole sizes: ZeRO-3 keeps %s of the model here)"):format(mb(pt.memory_report(model).param_shard))
      for _, line in ipairs(zero3_text(z3, pattern)) do lines[#lines + 1] = line end
    end
    if staged then lines[#lines + 1] = staged .. " (the other stages' parameters are not here)" end
    local split = context_text(model, mesh)
    if split then lines[#lines + 1] = split .. "; the parameters are the same on every context rank" end
    print(table.concat(lines, "\n"))
  end

  --- The layout: this rank's coordinates and the members of its groups.
  --- With a pipeline, also its group and the stages this rank holds (of the model pt.parallelize
  --- made last over this mesh).
  function H.mesh(m)
    if m ~= nil and getmetatable(m) ~= debug.getregistry()["partrain.Mesh"] then
      raise("mesh: the argument must be a mesh (or nil: the last parallelized model's), got " .. type(m), 2)
    end
    local model = pt.parallelized()
    m = m or pt.mesh_of(model) or pt.mesh {}
    local c = m:coord()
    -- The context coordinate and group only where the sequence is split.
    local split = m:size("context") > 1
    local context = split and ("context %d, "):format(c.context) or ""
    local context_group = split and ("context group %s, "):format(rank_list(m:ranks("context"))) or ""
    -- The expert coordinate and groups only where the experts are split.
    local experts = m:size("expert") > 1
    local expert = experts and (", expert %d"):format(c.expert) or ""
    local expert_groups = experts and (", expert group %s, expert_data group %s"):format(rank_list(m:ranks("expert")),
      rank_list(m:ranks("expert_data"))) or ""
    local text = ("%s | rank %d: tensor %d, %sdata %d, pipeline %d%s | tensor group %s, %sdata group %s%s"):format(
      tostring(m):match("^[^\n;]*"), rank, c.tensor, context, c.data, c.pipeline, expert, rank_list(m:ranks("tensor")),
      context_group, rank_list(m:ranks("data")), expert_groups)
    if m:size("pipeline") > 1 then
      text = text .. (", pipeline group %s"):format(rank_list(m:ranks("pipeline")))
      local mine = model and pt.mesh_of(model)
      local staged = mine and tostring(mine) == tostring(m) and stages_text(model)
      if staged then text = text .. " | " .. staged end
    end
    print(text)
  end

  --- This rank's memory: parameters, gradients, optimizer state and master weights in bytes
  --- (pt.memory_report), the ZeRO stage and zero group when the optimizer is sharded, the bytes
  --- tensors hold on the CPU now and at their peak, and the process's resident memory.
  function H.mem(model)
    local r = pt.memory_report(model_of(model, "mem"))
    local zero = ""
    if r.zero_stage == 1 then
      zero = (" | ZeRO-1 over %d ranks (optimizer and masters: this rank's shard)"):format(r.zero_group)
    elseif r.zero_stage == 2 then
      zero = (" | ZeRO-2 over %d ranks (optimizer, masters and gradients: this rank's shard)"):format(r.zero_group)
    elseif r.zero_stage == 3 then
      zero = (" | ZeRO-3 over %d ranks (params: shard %s + gathered now %s, at most %s so far; largest unit %s, root %s)")
        :format(r.zero_group, mb(r.param_shard), mb(r.gathered), mb(r.peak_gathered), mb(r.largest_unit),
          mb(r.root_unit))
    end
    local grads = mb(r.grads) .. (r.scratch > 0 and (" (scratch %s)"):format(mb(r.scratch)) or "")
    print(("params %s | grads %s | optimizer %s | masters %s%s | tensors %s (peak %s) | resident %s (peak %s)"):format(
      mb(r.params), grads, mb(r.optimizer), mb(r.master), zero, mb(r.allocated), mb(r.allocated_peak),
      mb(r.resident), mb(r.resident_peak)))
  end
  return H
end

return R
