-- partrain.auto and partrain.devices (partrain plan --auto): the layout space the flags allow, the
-- collective and overlap formulas on hand examples, ZeRO tiers that stop at the first stage that
-- fits, the no-fit message, device tables checked field by field, and the ranking of a synthetic
-- script (a fake o.plan whose figures follow known formulas) where the answer is known.
package.path = "tests/lua/?.lua;" .. package.path
local H = require "harness"
local auto = require "partrain.auto"
local D = require "partrain.devices"
local P = require "partrain.pipeline"
local test, eq, ok, near, raises = H.test, H.eq, H.ok, H.near, H.raises

-- ---- A synthetic script ------------------------------------------------------------------------

local LAYOUT_KINDS = { tensor = "integer", context = "integer", context_mode = "string", pipeline = "integer",
                       schedule = "string", chunks = "integer", microbatches = "integer", expert = "integer",
                       sequence_parallel = "boolean", zero_stage = "integer", zero_groups = "integer",
                       recompute = "string" }
local DEFAULTS = { tensor = 1, context = 1, context_mode = "ring", pipeline = 1, schedule = "1f1b", chunks = 1,
                   microbatches = 0, expert = 1, sequence_parallel = false, zero_stage = 0, zero_groups = 0,
                   recompute = "none", layers = 8, batch = 32, seq = 64, heads = 8, experts = 0, dtype = "float32" }

local function copy(t) local c = {} for k, v in pairs(t) do c[k] = v end return c end

-- The options of an argument list over the defaults (pt.args's syntax, enough of it).
local function parse(args, defaults, kinds)
  local v, i = copy(defaults), 1
  while i <= #args do
    local name = args[i]:match("^%-%-(.+)$"):gsub("%-", "_")
    if name:sub(1, 3) == "no_" and kinds[name:sub(4)] == "boolean" then v[name:sub(4)] = false
    elseif kinds[name] == "boolean" then v[name] = true
    else
      i = i + 1
      v[name] = kinds[name] == "string" and args[i] or tonumber(args[i])
    end
    i = i + 1
  end
  return v
end

-- The nodes the ranks of a list span (nproc ranks a node).
local function nodes_of(list, nproc)
  local seen, n = {}, 0
  for _, r in ipairs(list) do
    local node = math.floor(r / nproc)
    if not seen[node] then seen[node], n = true, n + 1 end
  end
  return n
end

--- A fake o.plan for a model of `layers` blocks whose figures follow simple formulas: a block
--- holds `param` bytes of parameters (model state 4x: parameters, gradients, two moments), a
--- sequence a block leaves `act` bytes of activations and takes `flops` FLOPs; the last stage's
--- head takes `head` FLOPs a sequence. spec = { world, nproc, param, act, flops, head, options,
--- refuse(v) -> message }. Records every call in spec.calls.
local function fake(spec)
  spec.calls = {}
  local defaults = copy(DEFAULTS)
  for k, v in pairs(spec.options or {}) do defaults[k] = v end
  local kinds = copy(LAYOUT_KINDS)
  for k, v in pairs(defaults) do
    if not kinds[k] then kinds[k] = type(v) == "string" and "string" or "integer" end
  end
  for k in pairs(spec.undeclared or {}) do kinds[k] = nil end
  local world, nproc = spec.world, spec.nproc
  return function(args, ranks)
    spec.calls[#spec.calls + 1] = { args = args, ranks = ranks }
    local v = parse(args, defaults, kinds)
    local T, C, Pp = v.tensor, v.context, v.pipeline
    local Dd = world / (T * C * Pp)
    if Dd % 1 ~= 0 then return nil, "mesh: the sizes do not divide the world" end
    if v.heads % T ~= 0 then return nil, ("tensor=%d does not divide heads=%d"):format(T, v.heads) end
    local m = Pp > 1 and (v.microbatches > 0 and v.microbatches or Pp) or 1
    if v.batch % (Dd * m) ~= 0 then return nil, ("batch=%d does not split over %d x %d"):format(v.batch, Dd, m) end
    if (v.schedule == "zbh1" or v.schedule == "zbv") and v.zero_stage == 3 and Pp > 1 then
      return nil, ("parallelize: schedule '%s' splits backward (W actions), which ZeRO-3 does not run yet"):format(v.schedule)
    end
    if spec.refuse then
      local why = spec.refuse(v)
      if why then return nil, why end
    end
    local ch = Pp > 1 and v.chunks or 1
    local dc = Dd * C
    local zgroup = v.zero_stage > 0 and (v.zero_groups > 0 and dc / v.zero_groups or dc) or 1
    local replay = v.recompute == "block"
    local blocks = v.layers / Pp
    local params = spec.param * blocks / T
    local grads, moments = params, 2 * params
    if v.zero_stage >= 1 then moments = moments / zgroup end
    if v.zero_stage >= 2 then grads = grads / zgroup end
    if v.zero_stage >= 3 then params = params / zgroup end
    local state = params + grads + moments
    local sequences = v.batch / Dd
    local flops = spec.flops * sequences * blocks / (T * C) * (replay and 4 / 3 or 1)
                  + (Pp == 1 and (spec.head or 0) * sequences / (T * C) or 0)
    local per_mb_chunk = spec.act * sequences / m * blocks / ch / (T * C) / (replay and 4 or 1)
    local plan_table = { world = world, nproc = nproc, tensor = T, data = Dd, pipeline = Pp, context = C,
                         expert = v.expert, zero = zgroup, seconds = 0, options = v, declared = kinds, ranks = {} }
    local schedule_plan, report
    if Pp > 1 then
      schedule_plan = P.schedule(v.schedule, Pp, m, ch)
      local zb = v.schedule == "zbh1" or v.schedule == "zbv"
      local a, pend = {}, {}
      for s = 0, Pp * ch - 1 do a[s], pend[s] = per_mb_chunk, zb and per_mb_chunk / 2 or per_mb_chunk end
      report = P.simulate(schedule_plan, Pp, m, ch, { memory = { activation = a, pending = pend } })
    end
    for i, rank in ipairs(ranks) do
      local t = rank % T
      local c = math.floor(rank / T) % C
      local d = math.floor(rank / (T * C)) % Dd
      local k = math.floor(rank / (T * C * Dd))
      local data_members, tensor_members = {}, {}
      for dd = 0, Dd - 1 do for cc = 0, C - 1 do data_members[#data_members + 1] = t + T * (cc + C * (dd + Dd * k)) end end
      for tt = 0, T - 1 do tensor_members[#tensor_members + 1] = tt + T * (c + C * (d + Dd * k)) end
      local collectives = {}
      local function add(group, op, calls, bytes, size, members)
        collectives[#collectives + 1] = { group = group, op = op, calls = calls, bytes = bytes, size = size,
                                          nodes = nodes_of(members, nproc) }
      end
      local dname = C > 1 and "data_context" or "data"
      if v.zero_stage == 0 then add(dname .. "[0]", "all_reduce", 2, spec.param * blocks / T, dc, data_members)
      else
        add("zero[0]", "reduce_scatter", 2, spec.param * blocks / T, zgroup, data_members)
        add("zero[0]", "all_gather", 2, spec.param * blocks / T, zgroup, data_members)
      end
      if T > 1 then add("tensor[0]", "all_reduce", 4 * blocks * m, spec.act * sequences * blocks / C, T, tensor_members) end
      local r = { rank = rank, coord = { tensor = t, data = d, pipeline = k, context = c, expert = 0 },
                  param_bytes = params, grad_bytes = grads, optimizer_bytes = moments, master_bytes = 0,
                  model_state_bytes = state, zero_stage = v.zero_stage, zero_group = zgroup, flops = flops,
                  collectives = collectives }
      if Pp > 1 then
        local stride = T * C * Dd
        local message = per_mb_chunk / blocks * ch  -- a block's output a micro-batch
        local p2p = {}
        for _, peer in ipairs { k - 1, k + 1 } do
          if peer >= 0 and peer < Pp then
            p2p[#p2p + 1] = { peer = rank + (peer - k) * stride, pipeline_peer = peer, sends = m * ch,
                              send_bytes = m * ch * message, recvs = m * ch, recv_bytes = m * ch * message }
            add(("pipeline[%d]"):format(k), "send", m * ch, m * ch * message, Pp, { rank, rank + (peer - k) * stride })
          end
        end
        local chunks = {}
        for c2 = 0, ch - 1 do
          local stage = P.stage(Pp, k, c2, schedule_plan.layout)
          local per_stage = v.layers / (Pp * ch)
          if stage == Pp * ch - 1 then r.flops = r.flops + (spec.head or 0) * sequences / (T * C) end
          chunks[#chunks + 1] = { stage = stage, first_block = stage * per_stage, end_block = (stage + 1) * per_stage,
                                  activation_bytes = per_mb_chunk, gradient_bytes = 0, backward_bytes = 0,
                                  pending_bytes = (v.schedule == "zbh1" or v.schedule == "zbv") and per_mb_chunk / 2 or 0 }
        end
        -- spec.buffer: a backward's working memory on top, a micro-batch chunk's activations
        local activation = report.ranks[k].memory + (spec.buffer and per_mb_chunk or 0)
        r.stage = { schedule = v.schedule, microbatches = m, stages = Pp * ch, in_flight = report.ranks[k].peak,
                    activation_peak = activation, bubble = report.bubble, chunks = chunks, p2p = p2p }
        r.activation_bytes, r.peak_bytes = activation, state + activation
      else
        r.activation_bytes = spec.act * sequences * blocks / (T * C) / (replay and 4 or 1)
        r.peak_bytes = state + r.activation_bytes
      end
      plan_table.ranks[i] = r
    end
    return plan_table
  end
end

-- A device table: one node's link fast, no latency, everything else given.
local function device(fields)
  local d = { name = "test", flops = { float32 = 1e12 }, efficiency = 1, memory = 1e12,
              intra = { bandwidth = 1e12, latency = 0 }, inter = { bandwidth = 1e11, latency = 0 }, overlap = 1 }
  for k, v in pairs(fields or {}) do d[k] = v end
  return d
end

-- A table of numbers, strings and tables as Lua source.
local function lua_source(v)
  if type(v) == "table" then
    local parts = {}
    for k, x in pairs(v) do parts[#parts + 1] = ("[%q] = %s"):format(k, lua_source(x)) end
    return "{ " .. table.concat(parts, ", ") .. " }"
  end
  return type(v) == "string" and ("%q"):format(v) or ("%.17g"):format(v)
end

-- A device table file for --device, written to a temporary file.
local function device_file(source)
  local path = os.tmpname() .. ".lua"
  local f = assert(io.open(path, "w"))
  f:write(source)
  f:close()
  return path
end

-- auto.main on the fake script, its printed lines captured.
local function run(spec, o)
  local plan = fake(spec)
  local lines = {}
  local saved = print
  print = function(...)
    local parts = {}
    for i = 1, select("#", ...) do parts[i] = tostring(select(i, ...)) end
    lines[#lines + 1] = table.concat(parts, "\t")
  end
  local path = device_file("return " .. lua_source(device(o.device_fields)))
  local okay, result = pcall(auto.main, { script = "fake.lua", args = o.args or {}, world = spec.world, nproc = spec.nproc,
                                          device = path, device_memory = o.memory, top = o.top or 5, json = o.json,
                                          config = o.config, verbose = o.verbose, plan = plan })
  print = saved
  os.remove(path)
  if not okay then error(result, 0) end
  return result, table.concat(lines, "\n")
end

local function all_declared()
  local d = copy(LAYOUT_KINDS)
  for _, k in ipairs { "layers", "batch", "seq", "heads", "experts" } do d[k] = "integer" end
  return d
end

-- ---- The space ---------------------------------------------------------------------------------

-- The layouts a second statement of the rules counts: (tensor, context, mode, pipeline, chunks,
-- schedule, micro-batches) at world w, nproc n, layers L, batch B, seq S, heads Hd.
local function count_layouts(w, n, L, B, S, Hd)
  local count = 0
  for _, t in ipairs { 1, 2, 4, 8 } do
    if t <= math.min(n, 8) and w % t == 0 and Hd % t == 0 then
      for _, c in ipairs { 1, 2, 4, 8 } do
        if w % (t * c) == 0 and S % (2 * c) == 0 then
          for p = 1, math.min(16, L) do
            if (w / (t * c)) % p == 0 then
              local d = w / (t * c * p)
              local modes = c > 1 and 2 or 1
              if p == 1 then
                if B % d == 0 then count = count + modes end
              else
                for _, chunks in ipairs { 1, 2 } do
                  if chunks == 1 or 2 * p <= L then
                    for _, m in ipairs { p, 2 * p, 4 * p } do
                      if B % (d * m) == 0 then count = count + modes * 2 end  -- two schedules a chunk count
                    end
                  end
                end
              end
            end
          end
        end
      end
    end
  end
  return count
end

local function space_count(groups)
  local n = 0
  for _, g in ipairs(groups) do n = n + #g.variants end
  return n
end

test("the space holds every layout the rules allow, and no other", function()
  for _, case in ipairs { { 8, 4, 8, 32, 64, 8 }, { 16, 8, 4, 64, 128, 6 }, { 64, 8, 48, 512, 1024, 32 }, { 12, 4, 6, 24, 64, 4 } } do
    local w, n, L, B, S, Hd = unpack(case)
    local groups = auto.space { world = w, nproc = n, declared = all_declared(), fixed = {},
                                options = { layers = L, batch = B, seq = S, heads = Hd } }
    eq(space_count(groups), count_layouts(w, n, L, B, S, Hd), ("layouts at world %d, nproc %d, layers %d"):format(w, n, L))
    for _, g in ipairs(groups) do
      ok(g.tensor <= math.min(n, 8) and math.log(g.tensor) / math.log(2) % 1 == 0, "tensor is a power of two up to nproc")
      eq(g.tensor * g.context * g.pipeline * g.data, w, "the sizes make the world")
      eq(g.sequence_parallel, g.tensor > 1, "sequence parallelism with tensor > 1")
      ok(g.pipeline <= L and g.pipeline <= 16, "pipeline up to the layers and 16")
      for _, v in ipairs(g.variants) do
        if g.pipeline > 1 then
          ok(v.schedule ~= "gpipe", "gpipe is not searched")
          eq(B % (g.data * v.microbatches), 0, "micro-batches split the batch")
          eq(g.chunks == 2, v.schedule == "interleaved" or v.schedule == "zbv", "two chunks for interleaved and zbv")
        end
      end
    end
  end
end)

test("flags the user gave stay as given", function()
  local groups = auto.space { world = 16, nproc = 8, declared = all_declared(),
                              fixed = { tensor = 2, schedule = "1f1b", microbatches = 8 },
                              options = { layers = 8, batch = 64, seq = 64, heads = 8 } }
  ok(#groups > 0, "some layouts are left")
  local pipelined = 0
  for _, g in ipairs(groups) do
    eq(g.tensor, 2, "tensor stays 2")
    if g.pipeline > 1 then
      pipelined = pipelined + 1
      for _, v in ipairs(g.variants) do
        eq(v.schedule, "1f1b", "the schedule stays")
        eq(v.microbatches, 8, "the micro-batches stay")
      end
      eq(g.chunks, 1, "1f1b takes one chunk")
    end
  end
  ok(pipelined > 0, "pipelines are still searched")
  -- a flag the script does not declare is never varied
  local d = all_declared()
  d.context, d.context_mode = nil, nil
  for _, g in ipairs(auto.space { world = 16, nproc = 8, declared = d, fixed = {}, options = { layers = 8, batch = 64 } }) do
    eq(g.context, 1, "context is not varied when the script does not declare it")
  end
end)

test("heads, sequence, layers and batch prune the space", function()
  local base = { world = 8, nproc = 8, declared = all_declared(), fixed = {} }
  base.options = { layers = 2, batch = 8, seq = 8, heads = 6 }
  for _, g in ipairs(auto.space(base)) do
    ok(g.tensor ~= 4 and g.tensor ~= 8, "tensor divides the 6 heads")
    ok(g.context <= 4, "seq 8 splits into 2 x context chunks up to context 4")
    ok(g.pipeline <= 2, "no more stages than the 2 layers")
    ok(g.chunks ~= 2, "2 chunks a rank need 2 x pipeline <= layers")
  end
  local experts = auto.space { world = 8, nproc = 8, declared = all_declared(), fixed = { tensor = 1, context = 1, pipeline = 1 },
                               options = { batch = 8, experts = 4 } }
  local seen = {}
  for _, g in ipairs(experts) do seen[#seen + 1] = g.expert end
  eq(table.concat(seen, ","), "1,2,4", "expert sizes: powers of two dividing data 8 and 4 experts")
end)

test("user flags are read in every pt.args form", function()
  local given = auto.given({ "--dim", "64", "--tensor", "2", "--no-sequence-parallel", "--schedule=zbh1", "--config", "x.lua",
                             "--recompute", "block" }, all_declared())
  ok(given.tensor and given.sequence_parallel and given.schedule and given.recompute, "tensor, SP, schedule, recompute given")
  ok(not given.pipeline and not given.dim, "pipeline not given; dim is no layout flag")
  eq(table.concat(auto.flag_words({ tensor = 2, sequence_parallel = false, schedule = "zbv" },
    { "tensor", "sequence_parallel", "schedule" }), " "), "--tensor 2 --no-sequence-parallel --schedule zbv")
end)

test("ZeRO tiers: stage 1 and up need data x context >= 2; node groups when the ranks span nodes", function()
  local s = { nproc = 4, declared = all_declared(), fixed = {} }
  local tiers = auto.tiers({ tensor = 1, context = 1, data = 1, pipeline = 8 }, s)
  eq(table.concat(tiers.stages, ","), "0", "one data rank: no ZeRO")
  tiers = auto.tiers({ tensor = 1, context = 1, data = 16, pipeline = 1 }, s)
  eq(table.concat(tiers.stages, ","), "0,1,2,3")
  eq(table.concat(tiers.groups(2), ","), "0,4", "16 data ranks over 4 nodes: one group, or 4 of a node each")
  eq(#tiers.groups(0), 1, "one choice at stage 0")
  eq(tiers.groups(0)[1], false, "no zero_groups at stage 0")
  tiers = auto.tiers({ tensor = 2, context = 1, data = 2, pipeline = 1 }, s)
  eq(table.concat(tiers.groups(2), ","), "0", "2 x 2 ranks on one node: one group")
  eq(table.concat(tiers.recompute, ","), "none,block")
end)

-- ---- The cost model ----------------------------------------------------------------------------

test("a collective's seconds: latency a call plus its bytes over the link, by op", function()
  local h100 = D.load("h100")
  -- 2 all-reduces of 1 GB over 4 ranks of one node: 2 x 5 us + 1e9 x 2 x 3/4 / 450e9
  near(auto.collective_seconds({ op = "all_reduce", calls = 2, bytes = 1e9, size = 4, nodes = 1 }, h100),
    2 * 5e-6 + 1e9 * 1.5 / 450e9, 1e-12, "all_reduce in a node")
  -- an all-gather over 8 ranks on 2 nodes: inter-node, (g-1)/g of its gathered output
  near(auto.collective_seconds({ op = "all_gather", calls = 1, bytes = 8e8, size = 8, nodes = 2 }, h100),
    15e-6 + 8e8 * 7 / 8 / 50e9, 1e-12, "all_gather across nodes")
  near(auto.collective_seconds({ op = "send", calls = 3, bytes = 3e6, size = 2, nodes = 1 }, h100),
    3 * 5e-6 + 3e6 / 450e9, 1e-12, "send: the whole message")
  eq(auto.collective_seconds({ op = "all_reduce", calls = 5, bytes = 1e9, size = 1, nodes = 1 }, h100), 0, "a group of one")
end)

test("gradient reduction hides behind backward up to the overlap; tensor traffic never", function()
  local d = D.check(device({ intra = { bandwidth = 1e9, latency = 0 } }), "test")
  local grads = { { group = "data[0,1]", op = "all_reduce", calls = 1, bytes = 0.5e9, size = 2, nodes = 1 } }  -- 0.5 s
  local e = auto.exposure(grads, d, { compute = 1, backward = 2 / 3 })
  near(e.hidden, 0.5, 1e-12, "the all-reduce's time")
  eq(e.exposed, 0, "0.5 s hides behind 2/3 s of backward")
  d.overlap = 0.5
  near(auto.exposure(grads, d, { compute = 1, backward = 2 / 3 }).exposed, 0.5 - 1 / 3, 1e-12, "half the backward hides it")
  d.overlap = 1
  near(auto.exposure(grads, d, { compute = 1, backward = 2 / 3, microbatches = 4 }).exposed, 0.5 - 1 / 6, 1e-12,
    "under a pipeline only the last micro-batch's backward covers it")
  local tensor = { { group = "tensor[0,1]", op = "all_reduce", calls = 2, bytes = 0.5e9, size = 2, nodes = 1 },
                   { group = "pipeline[0,2]", op = "send", calls = 4, bytes = 1e9, size = 2, nodes = 1 },
                   { group = "pipeline[0,2]", op = "broadcast", calls = 1, bytes = 1e8, size = 2, nodes = 1 } }
  e = auto.exposure(tensor, d, { compute = 10, backward = 2 / 3, calls = 2 })
  near(e.inline, 0.5, 1e-12, "tensor all-reduce exposed, its calls scaled")
  near(e.tail, 0.1, 1e-12, "the pipeline's broadcast is a step's; its sends are the simulator's")
end)

test("a pipeline variant estimated from another schedule's plan predicts that variant's own plan", function()
  for _, buffer in ipairs { false, true } do
  local spec = { world = 8, nproc = 8, param = 1e6, act = 1e6, flops = 1e9, buffer = buffer }
  local plan = fake(spec)
  local env = { device = D.check(device(), "test"), rate = 1e12, nproc = 8, recompute = "none" }
  local group = { tensor = 1, context = 1, data = 2, pipeline = 4, chunks = 1 }
  local args = function(s, m) return { "--pipeline", "4", "--schedule", s, "--microbatches", tostring(m) } end
  local ranks = auto.representatives(group)
  eq(table.concat(ranks, ","), "0,2,4,6", "tensor 0, data 0 of each pipeline rank")
  local ref = plan(args("zbh1", 8), ranks)
  local f = auto.figures(group, ref, ref.ranks, env)
  for _, v in ipairs { { "1f1b", 4 }, { "1f1b", 16 }, { "zbh1", 16 } } do
    local own = plan(args(v[1], v[2]), ranks)
    local estimate = auto.pipeline_prediction(f, { schedule = v[1], microbatches = v[2] }, env)
    local exact = auto.pipeline_prediction(auto.figures(group, own, own.ranks, env), { schedule = v[1], microbatches = v[2] }, env)
    local peak = 0
    for _, r in ipairs(own.ranks) do peak = math.max(peak, r.peak_bytes) end
    near(estimate.peak, peak, 1e-9, ("%s at %d micro-batches%s: the estimated peak"):format(v[1], v[2],
      buffer and ", a backward's buffer beside the activations" or ""))
    near(estimate.step, exact.step, 1e-9, ("%s at %d micro-batches: the step"):format(v[1], v[2]))
    near(estimate.compute + estimate.comm + estimate.bubble, estimate.step, 1e-9, "the terms add up to the step")
  end
  local z1 = auto.pipeline_prediction(f, { schedule = "zbh1", microbatches = 8 }, env)
  local f1 = auto.pipeline_prediction(f, { schedule = "1f1b", microbatches = 8 }, env)
  ok(z1.step < f1.step, "ZB-H1 predicted faster than 1F1B at the same micro-batches")
  ok(z1.bubble_ratio < f1.bubble_ratio, "with a smaller bubble")
  end
end)

test("a pipeline's step on a hand example: 1F1B, 2 stages, 2 micro-batches", function()
  -- Each rank computes 6 s a step: 3 s a micro-batch, F = B = W = 1 s (a fused B 2 s); 1F1B's
  -- step is (m + p - 1)(F + B + W) = 9 s. Its tensor all-reduces take 1 s a step, half in F and
  -- half in B: 0.25 s each a micro-batch, so 3 x 3.5 = 10.5 s. Its data all-reduce, 0.5 s, hides
  -- behind the last micro-batch's backward (2 s) with overlap 1, and is exposed with overlap 0.
  local d = D.check(device({ intra = { bandwidth = 1e9, latency = 0 } }), "test")
  local collectives = { { group = "tensor[0,1]", op = "all_reduce", calls = 4, bytes = 1e9, size = 2, nodes = 1 },
                        { group = "data[0,2]", op = "all_reduce", calls = 2, bytes = 0.5e9, size = 2, nodes = 1 } }
  local function rank(k)
    return { rank = k, state = 100, peak_bytes = 100, flops = 6e12, collectives = collectives, offset = 0, p2p = {},
             chunks = { { stage = k, activation = 10, pending = 10 } } }
  end
  local f = { pp = 2, chunks = 1, microbatches = 2, schedule = "1f1b", ranks = { [0] = rank(0), [1] = rank(1) } }
  local env = { device = d, rate = 1e12, nproc = 8, recompute = "none" }
  local p = auto.pipeline_prediction(f, { schedule = "1f1b", microbatches = 2 }, env)
  near(p.step, 10.5, 1e-9, "the step")
  near(p.compute, 6, 1e-9, "compute")
  near(p.comm, 1, 1e-9, "the tensor all-reduces")
  near(p.bubble, 3.5, 1e-9, "the bubble: one micro-batch's 3.5 s")
  near(p.peak, 100 + 2 * 10, 1e-9, "rank 0 holds its 2 micro-batches' activations")
  d.overlap = 0
  near(auto.pipeline_prediction(f, { schedule = "1f1b", microbatches = 2 }, env).step, 11, 1e-9, "overlap 0 exposes the data all-reduce")
  -- 4 micro-batches from the same plan: 1.5 s of compute a micro-batch and the same 1 s of
  -- tensor traffic a step, 0.25 s a micro-batch: (4 + 1)(1.5 + 0.25) = 8.75 s; rank 0 holds 2
  -- micro-batches of half the bytes.
  d.overlap = 1
  local p4 = auto.pipeline_prediction(f, { schedule = "1f1b", microbatches = 4 }, env)
  near(p4.step, 8.75, 1e-9, "4 micro-batches")
  near(p4.peak, 100 + 2 * 5, 1e-9, "4 micro-batches: 2 in flight of half the bytes")
end)

test("with infer_middle, pipeline ranks 0, 1 and p-1 stand for all: the middle ones are inferred", function()
  local space = require "partrain.auto.space"
  local spec = { world = 16, nproc = 8, param = 1e6, act = 1e6, flops = 1e9, head = 4e9 }
  local plan = fake(spec)
  local env = { device = D.check(device(), "test"), rate = 1e12, nproc = 8, recompute = "none" }
  local group = { tensor = 1, context = 1, data = 2, pipeline = 8, chunks = 2 }
  eq(table.concat(auto.representatives(group, true, 16), ","), "0,2,4,6,8,10,12,14", "off: every pipeline rank")
  space.infer_middle = true
  local reduced = auto.representatives(group, true, 16)
  space.infer_middle = false
  eq(table.concat(reduced, ","), "0,2,14", "on: ranks 0, 1 and p-1 (16 layers over 16 stages)")
  eq(table.concat(auto.representatives(group, true, 12), ","), "0,2,4,6,8,10,12,14", "12 layers do not split evenly")
  local args = { "--pipeline", "8", "--schedule", "zbv", "--chunks", "2", "--microbatches", "16" }
  local some, all = plan(args, reduced), plan(args, auto.representatives(group))
  local from_some = auto.figures(group, some, some.ranks, env)
  local from_all = auto.figures(group, all, all.ranks, env)
  ok(from_some.inferred and not from_all.inferred, "the reduced figures are inferred")
  for _, v in ipairs { { "zbv", 16 }, { "interleaved", 32 } } do
    local a = auto.pipeline_prediction(from_some, { schedule = v[1], microbatches = v[2] }, env)
    local b = auto.pipeline_prediction(from_all, { schedule = v[1], microbatches = v[2] }, env)
    near(a.step, b.step, 1e-9, v[1] .. ": the step from 3 ranks")
    near(a.peak, b.peak, 1e-9, v[1] .. ": the peak from 3 ranks")
  end
end)

-- ---- The search --------------------------------------------------------------------------------

test("ZeRO tiers stop at the first stage that fits; layouts that do not fit are pruned", function()
  -- 8 layers of 1 GB of parameters (4 GB of state a layer): 32 GB whole; memory 21 GB.
  local spec = { world = 4, nproc = 4, param = 1e9, act = 1e6, flops = 1e12,
                 options = { layers = 8, batch = 16, seq = 8, heads = 1 }, undeclared = { context = true, context_mode = true } }
  local result = run(spec, { memory = 21e9, top = 50 })
  eq(result.status, 0, "something fits")
  local stages = {}  -- the ZeRO stages tried for the plain data-parallel layout
  for _, call in ipairs(spec.calls) do
    local joined = table.concat(call.args, " ")
    if joined:find("%-%-pipeline 1") then stages[#stages + 1] = joined:match("%-%-zero%-stage (%d)") end
  end
  -- data 4: ZeRO-0 needs 32 GB; ZeRO-1 8 + 8 + 16/4 = 20 GB and 32 MB of activations (fits);
  -- stages 2 and 3 are never tried
  eq(table.concat(stages, ","), "0,1", "data 4 tries stage 0, then 1, and stops")
  local unfit = false
  for _, l in ipairs(result.layouts) do
    if l.fits then
      ok(not unfit, "the layouts that fit come first: " .. l.text)
      ok(l.peak <= 21e9, "its peak fits: " .. l.text)
    else
      unfit = true
      ok(l.peak > 21e9, "its peak does not fit: " .. l.text)
    end
  end
  ok(unfit, "data 4 at ZeRO-0 is listed as not fitting")
  eq(result.layouts[1].values.zero_stage, 1, "the winner is ZeRO-1 over 4")
  ok(result.layouts[1].exact, "the winner's peak is from its own plan")
end)

test("a ZeRO stage that cannot shrink the peak enough is not planned: activations alone do not fit", function()
  -- 8 blocks of tiny parameters whose activations fill 32 GB a rank at data 4; memory 21 GB:
  -- ZeRO-1, 2 and 3 only shrink the (small) model state, so they are skipped, and recompute
  -- (a quarter of the activations) is planned at stage 0, where it fits.
  local spec = { world = 4, nproc = 4, param = 1e6, act = 1e9, flops = 1e12,
                 options = { layers = 8, batch = 16, seq = 8, heads = 1 }, undeclared = { context = true, context_mode = true } }
  local result = run(spec, { memory = 21e9, top = 50 })
  eq(result.status, 0, "something fits")
  local tried = {}
  for _, call in ipairs(spec.calls) do
    local joined = table.concat(call.args, " ")
    if joined:find("%-%-pipeline 1") then
      tried[#tried + 1] = joined:match("%-%-zero%-stage (%d)") .. "/" .. joined:match("%-%-recompute (%a+)")
    end
  end
  eq(table.concat(tried, ","), "0/none,0/block", "data 4: stage 0, then recompute at stage 0")
end)

test("a refusal that names the reference's schedule refuses that schedule only", function()
  -- 4 layers of 1 GB: pipeline 2 x data 2 fits 4.5 GB only at ZeRO-3 (1 + 1 + 2 GB a rank),
  -- which refuses zbh1 (a split backward): its reference is refused, and 1f1b's is planned.
  -- (Overlap 0: data 4's gathers are exposed, so that no bound skips the pipeline.)
  local spec = { world = 4, nproc = 4, param = 1e9, act = 1e3, flops = 1e9,
                 options = { layers = 4, batch = 8, seq = 8, heads = 1 },
                 undeclared = { context = true, context_mode = true, zero_groups = true, recompute = true, chunks = true } }
  local result, text = run(spec, { memory = 4.5e9, json = true, device_fields = { overlap = 0 } })
  eq(result.status, 0)
  local tried = {}
  for _, call in ipairs(spec.calls) do
    local joined = table.concat(call.args, " ")
    if joined:find("--pipeline 2 ", 1, true) and joined:find("--zero-stage 3", 1, true) then
      tried[#tried + 1] = joined:match("%-%-schedule (%w+)")
    end
  end
  eq(table.concat(tried, ",", 1, 2), "zbh1,1f1b", "zbh1's reference at ZeRO-3, refused, then 1f1b's")
  ok(text:find('"text":"pipeline 2 (zbh1, 4 mb) x data 2, ZeRO-3"', 1, true), "zbh1 at ZeRO-3 is listed")
  ok(text:find([["refused":"parallelize: schedule 'zbh1' splits backward (W actions)]], 1, true), "with the script's message")
  ok(text:find('"text":"pipeline 2 (1f1b, 4 mb) x data 2, ZeRO-3","values":', 1, true), "1f1b at ZeRO-3 is weighed")
end)

test("nothing fits: status 1 naming the least any layout needs and the layout", function()
  local spec = { world = 2, nproc = 2, param = 1e9, act = 1e6, flops = 1e12,
                 options = { layers = 2, batch = 4, seq = 8, heads = 1 }, undeclared = { recompute = true } }
  local result, text = run(spec, { memory = 1e9 })
  eq(result.status, 1)
  -- least: pipeline 2 at ZeRO-... none: data 1 a stage; the 1-layer stage holds 4 GB; data 2 at ZeRO-3 holds 8/2=4 GB
  local least = math.huge
  for _, l in ipairs(result.layouts) do least = math.min(least, l.peak) end
  local want = ("no layout fits 953.67 MiB a rank: the least any needs is %s ("):format(auto.bytes_text(least))
  ok(result.message:find(want, 1, true), ("message '%s' starts with '%s'"):format(result.message, want))
  ok(result.message:find(result.layouts[1].text, 1, true), "it names the layout")
  ok(not text:find("best:"), "no best layout is printed")
  ok(text:find("does not fit: needs"), "the table says why each lost")
end)

test("the ranking: the fastest layout that fits is first, on a case whose answer is known", function()
  -- One node of 4, compute-bound: every layout computes the same per rank. Tensor parallelism
  -- adds exposed all-reduces, a pipeline its bubble; data parallelism's all-reduce hides behind
  -- backward (overlap 1). Data 4 wins; with memory for 3 layers' state only, it does not fit
  -- (8 layers x 4 x 1e8 = 3.2 GB) and tensor 4 (0.8 GB) or pipeline 4 wins.
  local spec = { world = 4, nproc = 4, param = 1e8, act = 1e3, flops = 1e11,
                 options = { layers = 8, batch = 16, seq = 8, heads = 4 },
                 undeclared = { context = true, context_mode = true, zero_stage = true, zero_groups = true, recompute = true } }
  local result, text = run(spec, { top = 3 })
  eq(result.status, 0)
  eq(result.layouts[1].text, "data 4", "data parallelism is first")
  near(result.layouts[1].step, 1e11 * 4 * 8 / 1e12, 1e-9, "its step is its compute: 4 sequences x 8 layers x 1e11 FLOPs")
  for i = 2, #result.layouts do
    ok(result.layouts[i].step >= result.layouts[i - 1].step, "ranked by predicted step")
  end
  ok(text:find("best: partrain %-%-nproc%-per%-node 4 fake.lua\n?"), "the winner's command has no layout flags: " .. text)
  ok(text:find("why not first"), "the table has its columns")
  result = run(spec, { memory = 1.5e9, top = 3 })
  ok(result.layouts[1].text ~= "data 4", "data 4 does not fit 1.5 GB")
  ok(result.layouts[1].values.tensor > 1 or result.layouts[1].values.pipeline > 1, "a split layout wins")
  ok(result.layouts[1].fits and result.layouts[1].exact, "it fits, by its own plan")
  local last = result.layouts[#result.layouts]
  ok(not last.fits and last.text:find("data 4"), "data 4 is ranked after the fitting ones")
end)

test("a pipeline whose least bubble cannot beat the best layout planned is not planned", function()
  -- Compute-bound and data parallelism's traffic hidden: data 4's step is its compute, and any
  -- pipeline's at least its compute / (1 - its unit-time bubble): none is planned.
  local spec = { world = 4, nproc = 4, param = 1e6, act = 1e3, flops = 1e11,
                 options = { layers = 8, batch = 16, seq = 8, heads = 1 }, undeclared = { context = true, context_mode = true } }
  local result, text = run(spec, { verbose = true })
  eq(result.layouts[1].text, "data 4")
  for _, call in ipairs(spec.calls) do
    ok(not table.concat(call.args, " "):find("%-%-pipeline [24]"), "no pipeline planned: " .. table.concat(call.args, " "))
  end
  ok(text:find("skipped by a bound"), "the skipped layouts are listed")
  ok(text:find("pipeline 4 %(zbh1, 16 mb%) x data 1: cannot beat "), "with why: " .. text)
  near(auto.bound(1, 0.2), 1.25, 1e-12, "compute / (1 - bubble)")
  -- with the data all-reduce exposed (overlap 0, a slow link) a pipeline, which moves half the
  -- gradients a data rank, is planned again
  local slow = run(spec, { device_fields = { overlap = 0, intra = { bandwidth = 1e5, latency = 0 } } })
  local planned = false
  for _, call in ipairs(spec.calls) do planned = planned or table.concat(call.args, " "):find("%-%-pipeline 2") ~= nil end
  ok(planned, "pipeline 2 is planned when data 4 pays for its all-reduce")
  ok(slow.layouts[1].text ~= "data 4", "and data 4 is not first")
end)

test("a pipeline whose rank with the head cannot beat the best is not planned", function()
  -- 16 layers and a head worth 8 of them; data 8 computes (16 + 8) x 2 sequences x 1 ms = 48 ms
  -- and its all-reduce (16 kB, exposed) takes 10 ms. No pipeline's bubble rules it out, but
  -- pipeline 4 at one chunk a rank, planned, measures a block and the head: the head bound then
  -- skips pipeline 4 at two chunks (head + 4 blocks at data 2: 96 ms) and pipeline 8 (head + 2
  -- blocks at data 1: 160 ms).
  local spec = { world = 8, nproc = 8, param = 1e3, act = 1e3, flops = 1e9, head = 8e9,
                 options = { layers = 16, batch = 16, seq = 8, heads = 1 },
                 undeclared = { context = true, context_mode = true, zero_stage = true, zero_groups = true, recompute = true } }
  local result, text = run(spec, { verbose = true, device_fields = { overlap = 0, intra = { bandwidth = 2.8e6, latency = 0 } } })
  near(result.layouts[1].step, 0.058, 1e-9, "data 8's step")
  eq(result.layouts[1].text, "data 8", "data parallelism wins")
  local planned = {}
  for _, call in ipairs(spec.calls) do
    local joined = table.concat(call.args, " ")
    planned[(joined:match("%-%-pipeline (%d+)") or "?") .. "/" .. (joined:match("%-%-chunks (%d)") or "-")] = true
  end
  ok(planned["4/1"], "pipeline 4 at one chunk is planned")
  ok(not planned["4/2"] and not planned["8/1"] and not planned["8/2"], "pipeline 4 at two chunks and 8 are not")
  ok(text:find("pipeline 8 %(1f1b, 8 mb%) x data 1: cannot beat [%d.]+ ms: at least [%d.]+ ms %(its rank with the head computes it and 2 blocks"),
    "the head bound is given as the reason: " .. text)
  -- a block takes 1 ms a sequence, the head 8 ms: at data 1 a rank does all 16 sequences
  near(auto.head_bound({ block = 16e-3, head = 128e-3 }, 2, 1), 0.16, 1e-9, "the head rank's compute")
end)

test("refusals are kept with the script's message; --json and the config file carry the winner", function()
  local spec = { world = 4, nproc = 4, param = 1e6, act = 1e3, flops = 1e9,
                 options = { layers = 4, batch = 16, seq = 8, heads = 4 },
                 refuse = function(v) if v.tensor == 2 then return "tensor 2 is not welcome here" end end }
  local config = os.tmpname()
  local result, text = run(spec, { json = true, config = config })
  eq(result.status, 0)
  local json = text:match("^{.*}$")
  ok(json and json:find('"refused":"tensor 2 is not welcome here"', 1, true), "the refusal is in the JSON")
  ok(json:find('"candidates":[', 1, true), "the candidates are in the JSON")
  ok(json:find('"best":"' .. result.layouts[1].text .. '"', 1, true), "the best is the first layout")
  local f = assert(io.open(config))
  local source = f:read("*a")
  f:close()
  os.remove(config)
  local values = assert(loadstring(source))()
  for k, v in pairs(result.layouts[1].values) do eq(values[k], v, "the config file's " .. k) end
  for k in pairs(values) do ok(result.layouts[1].values[k] ~= nil, "no other value: " .. k) end
  for _, k in ipairs { "tensor", "sequence_parallel", "context", "pipeline", "zero_stage", "recompute" } do
    ok(values[k] ~= nil, "the config file sets " .. k)
  end
  local _, plain = run(spec, { verbose = true })
  ok(plain:find("refused by the script:\n  tensor 2 %(SP%)"), "-v lists the refusals: " .. plain)
end)

test("arguments the script refuses at this world are probed again with fewer data ranks", function()
  -- batch 4 does not split over 8 data ranks: the probe retries with --tensor 2 (data 4)
  local spec = { world = 8, nproc = 8, param = 1e6, act = 1e3, flops = 1e9,
                 options = { layers = 4, batch = 4, seq = 8, heads = 8 } }
  local result = run(spec, {})
  eq(table.concat(spec.calls[1].args, " "), "", "the probe: the user's arguments")
  eq(table.concat(spec.calls[2].args, " "), "--tensor 2", "then a larger tensor size")
  eq(result.status, 0, "the search goes on")
  for _, l in ipairs(result.layouts) do
    eq(4 % l.data, 0, "every layout splits the batch: " .. l.text)
    ok(table.concat(l.flags, " "):find("%-%-tensor"), "--tensor is always given (the probe's was not the default)")
  end
  spec.options.batch, spec.options.heads = 3, 2  -- no layout splits it
  local refused = run(spec, {})
  eq(refused.status, 1)
  ok(refused.message:find("the script refused its arguments at world 8: batch=3 does not split", 1, true), refused.message)
end)

-- ---- Devices -----------------------------------------------------------------------------------

test("the shipped devices are valid and the H100's figures are NVIDIA's", function()
  for _, name in ipairs(D.names) do D.check(D.shipped[name], name, "float32") end
  local h100 = D.load("h100")
  eq(h100.flops.bfloat16, 989e12)
  eq(h100.memory, 80 * 2 ^ 30)
  eq(D.load("h200").memory, 141e9)
  eq(D.load(nil).name, "h100", "the default device")
  eq(D.load("a100", 40 * 2 ^ 30).memory, 40 * 2 ^ 30, "--device-memory replaces the device's")
  eq(D.dtype("bf16"), "bfloat16")
  eq(D.dtype("fp32"), "float32")
  eq(D.dtype("int8"), nil)
end)

test("a device that is wrong is refused, naming the field, the value and the file", function()
  raises(function() D.load("h900") end, "partrain plan --auto: unknown device \"h900\": expected h100, h200, a100, cpu")
  local function file_error(source, pattern)
    local path = device_file(source)
    local okay, err = pcall(D.load, path)
    os.remove(path)
    ok(not okay, "refused: " .. source)
    ok(tostring(err):find(pattern, 1, true), ("error '%s' contains '%s'"):format(tostring(err), pattern))
    ok(tostring(err):find(path, 1, true), "it names the file")
  end
  local good = 'flops = { float32 = 1e12 }, efficiency = 0.5, memory = 1e9, intra = { bandwidth = 1e9, latency = 0 }, '
               .. 'inter = { bandwidth = 1e9, latency = 1e-5 }, overlap = 1'
  file_error("return 42", "must return a device table, got 42")
  file_error("return {" .. good:gsub("memory = 1e9", "memory = -1") .. "}", "memory must be a finite number > 0, got -1")
  file_error("return {" .. good:gsub("efficiency = 0.5", "efficiency = 1.5") .. "}", "efficiency must be a finite number > 0 and <= 1, got 1.5")
  file_error("return {" .. good:gsub("float32 = 1e12", "float32 = 1/0") .. "}", "flops.float32 must be a finite number > 0, got inf")
  file_error("return {" .. good:gsub("float32", "int4") .. "}", 'flops has an entry "int4"')
  file_error("return {" .. good:gsub("overlap = 1", "overlap = 2") .. "}", "overlap must be a finite number >= 0 and <= 1, got 2")
  file_error("return {" .. good:gsub("latency = 0", "latncy = 0") .. "}", 'intra has no field "latncy"')
  file_error("return {" .. good .. ", colour = 'red' }", 'unknown field "colour"')
  file_error("return {" .. good:gsub(", overlap = 1", "") .. "}", "overlap is missing")
  file_error("return { nonsense", "expected")
  local path = device_file("return {" .. good .. "}")
  local d = D.load(path)
  os.remove(path)
  raises(function() D.need(d, "bfloat16") end, "flops has no bfloat16 entry")
  D.need(d, "float32")
end)

test("numbers print as partrain plan prints them", function()
  eq(auto.bytes_text(80 * 2 ^ 30), "80.00 GiB")
  eq(auto.bytes_text(512), "512 B")
  eq(auto.seconds_text(1.2345), "1.234 s")
  eq(auto.seconds_text(0.0123), "12.3 ms")
  eq(auto.layout_text { tensor = 8, sequence_parallel = true, context = 1, pipeline = 2, schedule = "zbh1",
                        microbatches = 8, data = 4, zero_stage = 1 }, "tensor 8 (SP) x pipeline 2 (zbh1, 8 mb) x data 4, ZeRO-1")
end)

H.run()
