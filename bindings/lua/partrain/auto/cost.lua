-- The cost model of partrain plan --auto: a collective's seconds on a device's links, which of a
-- rank's communication its backward hides, and a layout's predicted step and peak memory from
-- its planned ranks (without a pipeline, or through the pipeline simulator from a reference
-- plan of another schedule). Every formula is stated beside its function.
local P = require "partrain.pipeline"
local A = require "partrain.pipeline.actions"

local M = {}

-- ---- The cost model --------------------------------------------------------------------------

-- Bytes that cross the slowest link, per byte of the message, in a ring over g ranks: an
-- all-reduce sends 2(g-1)/g of its message (a reduce-scatter and an all-gather), an all-gather,
-- reduce-scatter or all-to-all (g-1)/g (the part other ranks hold); point-to-point and broadcast
-- the whole message.
local FACTOR = {
  all_reduce = function(g) return 2 * (g - 1) / g end,
  all_gather = function(g) return (g - 1) / g end,
  reduce_scatter = function(g) return (g - 1) / g end,
  all_to_all = function(g) return (g - 1) / g end,
}

--- M.collective_seconds(c, device): one collective line of a plan ({ op, calls, bytes, size,
--- nodes }) on `device`: calls x latency + bytes x factor / bandwidth, over the `inter` link when
--- the group spans more than one node, else `intra`. factor: all_reduce 2(g-1)/g; all_gather,
--- reduce_scatter, all_to_all (g-1)/g; broadcast, send, recv, send_recv and anything else 1
--- (g = size). A group of one rank moves nothing (0).
function M.collective_seconds(c, device)
  local g = c.size or 2
  if g <= 1 then return 0 end
  local link = (c.nodes or 1) > 1 and device.inter or device.intra
  local factor = FACTOR[c.op] and FACTOR[c.op](g) or 1
  return c.calls * link.latency + c.bytes * factor / link.bandwidth
end

-- Gradient reduction (data parallelism's all-reduce, ZeRO's reduce-scatters and gathers, ZeRO-3's
-- prefetched gathers) runs beside backward; a micro-batch's own collectives (tensor, context,
-- expert) sit in its forward and backward; a pipeline's transfers are the simulator's.
local HIDDEN = { data = true, data_context = true, zero = true }
local IN_MICROBATCH = { tensor = true, context = true, expert = true }
local P2P = { send = true, recv = true, send_recv = true }

--- The shares of a micro-batch's compute in its forward (F), its input-gradient backward (B) and
--- its weight-gradient backward (W): the unit-time ratio 1 : 1 : 1 (a matmul's backward is two
--- matmuls), and with recompute 1 : 2 : 1, the forward's replay being in B.
M.SHARES = { none = { F = 1 / 3, B = 1 / 3, W = 1 / 3 }, block = { F = 1 / 4, B = 2 / 4, W = 1 / 4 } }

--- M.exposure(collectives, device, t): a rank's communication seconds by how they meet its
--- compute. t = { compute (seconds of the rank's step compute), backward (its backward's share),
--- microbatches (1 without a pipeline), calls (scale of the per-micro-batch calls: m / m of the
--- plan) }. Returns { inline (tensor, context, expert: exposed, in the micro-batches), hidden
--- (gradient reduction: data, data_context, zero), exposed (what of it backward cannot hide),
--- tail (the rest: exposed, once a step; a pipeline's own all_reduce and broadcast) }.
--- Gradient reduction hides behind backward as the engine runs it: exposed = max(0, hidden -
--- overlap x backward x compute / microbatches); under a pipeline each chunk syncs during its
--- last micro-batch's backward, so only that much compute covers it.
function M.exposure(collectives, device, t)
  local inline, hidden, tail = 0, 0, 0
  for _, c in ipairs(collectives or {}) do
    local kind = tostring(c.group):match("^[%a_]+") or ""
    if not (kind == "pipeline" and P2P[c.op]) then
      if HIDDEN[kind] then
        hidden = hidden + M.collective_seconds(c, device)
      elseif IN_MICROBATCH[kind] then
        local scaled = { op = c.op, calls = c.calls * (t.calls or 1), bytes = c.bytes, size = c.size, nodes = c.nodes }
        inline = inline + M.collective_seconds(scaled, device)
      else
        tail = tail + M.collective_seconds(c, device)
      end
    end
  end
  local cover = device.overlap * (t.backward or 2 / 3) * (t.compute or 0) / (t.microbatches or 1)
  return { inline = inline, hidden = hidden, exposed = math.max(0, hidden - cover), tail = tail }
end

--- M.compute_seconds(flops, ops, env): a rank's compute: flops / rate (flops[dtype] x efficiency)
--- + operators x op_seconds (their dispatch, whatever their size: 0 on a GPU, whose launches
--- overlap its kernels).
function M.compute_seconds(flops, ops, env)
  return (flops or 0) / env.rate + (ops or 0) * (env.device.op_seconds or 0)
end

--- M.flat_prediction(r, env): the step of a layout without a pipeline from its planned rank r
--- (flops, collectives, peak_bytes); env = { device, rate (FLOP/s: flops[dtype] x efficiency),
--- recompute }. compute = flops / rate; step = compute + every exposed communication.
--- Returns { step, compute, comm, bubble = 0, peak }.
function M.flat_prediction(r, env)
  local share = M.SHARES[env.recompute or "none"] or M.SHARES.none
  local compute = M.compute_seconds(r.flops, r.ops, env)
  local e = M.exposure(r.collectives, env.device, { compute = compute, backward = share.B + share.W })
  local comm = e.inline + e.exposed + e.tail
  return { step = compute + comm, compute = compute, comm = comm, bubble = 0, bubble_ratio = 0, peak = r.peak_bytes }
end

-- The seconds of one activation message from pipeline rank r to a peer: the plan's average
-- message (send_bytes / sends, scaled to the micro-batch) over the link to the peer.
local function send_seconds(r, device, nproc, scale)
  local most = 0
  for _, p in ipairs(r.p2p or {}) do
    if (p.sends or 0) > 0 then
      local same = math.floor(p.peer / nproc) == math.floor(r.rank / nproc)
      local link = same and device.intra or device.inter
      most = math.max(most, link.latency + p.send_bytes / p.sends * scale / link.bandwidth)
    end
  end
  return most
end

--- M.pipeline_prediction(f, v, env): the step and peak of pipeline variant v = { schedule,
--- microbatches } predicted from the figures f of a reference plan (M.figures); env = { device,
--- rate, recompute, nproc }. Per virtual stage s (a chunk of rank k):
---   compute(s) = flops(k) / rate / chunks (the reference rank's, split evenly over its chunks);
---   F, B, W = compute(s) / m x the shares (M.SHARES), plus half the rank's in-micro-batch
---     communication a chunk each in F and B; send = one message over its link (+ latency);
---   activation, pending = the reference chunk's bytes a micro-batch (activation + received
---     gradient; pending, or the activation when not measured) x m_ref / m.
--- P.simulate runs the schedule under those costs: step = makespan + the largest exposed
--- gradient reduction and once-a-step communication; a rank's peak = model state + simulated
--- activations + its offset x m_ref / m, where the offset is the reference's measured peak less
--- what the simulator predicts for it (buffers it does not model: a backward's working memory,
--- receives posted ahead), so the reference itself is predicted exactly.
--- Returns { step, compute, comm, bubble, bubble_ratio, peak, peaks = { [k] = bytes } }; terms of
--- the busiest rank: compute + comm + bubble = step.
function M.pipeline_prediction(f, v, env)
  local pp, ch = f.pp, f.chunks
  local m = v.microbatches or f.microbatches
  local scale = f.microbatches / m
  local share = M.SHARES[env.recompute or "none"] or M.SHARES.none
  local stage_compute, act, pend = {}, {}, {}
  for k = 0, pp - 1 do
    for _, c in ipairs(f.ranks[k].chunks) do
      stage_compute[c.stage] = M.compute_seconds(f.ranks[k].flops, (f.ranks[k].ops or 0) / scale, env) / ch
      act[c.stage], pend[c.stage] = c.activation * scale, c.pending * scale
    end
  end
  local plan = P.schedule(v.schedule or f.schedule, pp, m, ch)
  local F, B, W, send, ranks = {}, {}, {}, {}, {}
  for k = 0, pp - 1 do
    local r = f.ranks[k]
    local compute = 0
    for c = 0, ch - 1 do compute = compute + stage_compute[A.stage(pp, k, c, plan.layout)] end
    local e = M.exposure(r.collectives, env.device, { compute = compute, backward = share.B + share.W,
                                                       microbatches = m, calls = m / f.microbatches })
    local message = send_seconds(r, env.device, env.nproc, scale)
    for c = 0, ch - 1 do
      local s = A.stage(pp, k, c, plan.layout)
      local inline = e.inline / (2 * ch * m)
      F[s] = math.max(stage_compute[s] / m * share.F + inline, 1e-12)
      B[s] = math.max(stage_compute[s] / m * share.B + inline, 1e-12)
      W[s] = math.max(stage_compute[s] / m * share.W, 1e-12)
      send[s] = message
    end
    ranks[k] = { busy = compute + e.inline, compute = compute, inline = e.inline, tail = e.exposed + e.tail }
  end
  local report = P.simulate(plan, pp, m, ch, { costs = { F = F, B = B, W = W, send = send },
                                               memory = { activation = act, pending = pend } })
  local tail, busiest, peak, peaks = 0, 0, 0, {}
  for k = 0, pp - 1 do
    tail = math.max(tail, ranks[k].tail)
    if ranks[k].busy > ranks[busiest].busy then busiest = k end
    local simulated = report.ranks[k].memory
    peaks[k] = f.ranks[k].state + math.max(0, simulated + (f.ranks[k].offset or 0) * scale)
    peak = math.max(peak, peaks[k])
  end
  local b = ranks[busiest]
  if M.shares_cores(env.device, env.nproc) then
    -- Ranks that share cores: a rank waiting in the bubble frees its core for the others, so
    -- the step is the longer of the schedule's critical path at the speed of a rank alone (the
    -- calibrated rate x ranks / cores) and the ranks' mean busy time at the calibrated rate
    -- (every core busy); its terms are the mean rank's.
    local busy, compute, inline = 0, 0, 0
    for k = 0, pp - 1 do
      busy, compute, inline = busy + ranks[k].busy / pp, compute + ranks[k].compute / pp, inline + ranks[k].inline / pp
    end
    local alone = env.nproc * (env.device.threads or 1) / env.device.cores
    local span = math.max(report.makespan / alone, busy)
    return { step = span + tail, compute = compute, comm = inline + tail, bubble = span - busy,
             bubble_ratio = report.bubble, peak = peak, peaks = peaks, simulated = report }
  end
  return { step = report.makespan + tail, compute = b.compute, comm = b.inline + tail,
           bubble = report.makespan - b.busy, bubble_ratio = report.bubble, peak = peak, peaks = peaks,
           simulated = report }
end

--- M.shares_cores(device, nproc): whether a node's ranks share cores (a calibrated CPU whose
--- ranks x threads outnumber its cores).
function M.shares_cores(device, nproc)
  return device.cores ~= nil and nproc * (device.threads or 1) > device.cores
end

-- ---- Plans -----------------------------------------------------------------------------------

--- M.whole_peak(r): a planned rank's peak over its whole run: its step's (model state and the
--- step's activations, peak_bytes) or, when more, what the script held at once from its start to
--- its first optimizer step (setup included: a policy's probe forward, a deferred model made
--- whole; run_peak_bytes) with the optimizer state and master weights the step then adds.
function M.whole_peak(r)
  local run = (r.run_peak_bytes or -1) >= 0 and r.run_peak_bytes + (r.optimizer_bytes or 0) + (r.master_bytes or 0) or 0
  return math.max(r.peak_bytes, run)
end

--- M.rank_figures(r): a planned rank's figures the cost model reads: { rank, state, peak_bytes,
--- flops, collectives, p2p, activation_peak, blocks, chunks = { { stage, activation, pending } } }
--- (bytes a micro-batch: the activations and the received gradient; pending, or the activations
--- when the plan's schedule split no backward).
function M.rank_figures(r)
  local f = { rank = r.rank, state = r.model_state_bytes, peak_bytes = M.whole_peak(r), flops = r.flops or 0, ops = r.ops or 0,
              collectives = r.collectives, p2p = r.stage and r.stage.p2p, chunks = {}, blocks = 0 }
  if r.stage then
    f.activation_peak = r.stage.activation_peak
    for i, c in ipairs(r.stage.chunks or {}) do
      f.blocks = f.blocks + math.max(0, (c.end_block or 0) - (c.first_block or 0))
      local activation = math.max(c.activation_bytes or 0, 0)
      f.chunks[i] = { stage = c.stage, activation = activation + (c.gradient_bytes or 0),
                      pending = (c.pending_bytes or 0) > 0 and c.pending_bytes or activation }
    end
  end
  return f
end

-- Pipeline rank k inferred from the planned rank 1 (the same blocks a chunk): its stages, its
-- global rank and its peers' moved by k - 1 pipeline ranks.
local function inferred(one, k, pp, stride, layout)
  local f = { rank = one.rank + (k - 1) * stride, state = one.state, peak_bytes = one.peak_bytes, flops = one.flops,
              ops = one.ops,
              collectives = one.collectives, activation_peak = one.activation_peak, offset = one.offset,
              blocks = one.blocks, inferred = true, chunks = {}, p2p = {} }
  for i, c in ipairs(one.chunks) do
    f.chunks[i] = { stage = A.stage(pp, k, i - 1, layout), activation = c.activation, pending = c.pending }
  end
  for i, p in ipairs(one.p2p or {}) do
    f.p2p[i] = { peer = p.peer + (k - 1) * stride, sends = p.sends, send_bytes = p.send_bytes }
  end
  return f
end

--- M.figures(group, header, planned, env): the figures of a pipeline plan of `group` (its planned
--- ranks in pipeline order, some maybe left to infer) that M.pipeline_prediction reads: { pp,
--- chunks, microbatches, schedule, layout, ranks = { [k] = { rank, state, peak_bytes, flops,
--- collectives, p2p, activation_peak, offset, chunks = { { stage, activation, pending } } } },
--- inferred }, each rank's memory offset set from the plan's own schedule.
function M.figures(group, header, planned, env)
  local pp = header.pipeline
  local stride = group.tensor * group.context * group.data
  local by_k = {}
  for _, r in ipairs(planned) do by_k[math.floor(r.rank / stride)] = M.rank_figures(r) end
  local stage = planned[1].stage
  local f = { pp = pp, chunks = #planned[1].stage.chunks, microbatches = stage.microbatches,
              schedule = stage.schedule, ranks = by_k }
  f.layout = P.schedule(f.schedule, pp, f.microbatches, f.chunks).layout
  for k = 0, pp - 1 do
    if not by_k[k] then by_k[k] = inferred(by_k[1], k, pp, stride, f.layout); f.inferred = true end
  end
  local own = M.pipeline_prediction(f, { schedule = f.schedule, microbatches = f.microbatches }, env)
  for k = 0, pp - 1 do
    local r = by_k[k]
    if not r.inferred then
      local measured = (r.activation_peak or -1) >= 0 and r.activation_peak or nil
      r.offset = measured and measured - own.simulated.ranks[k].memory or 0
    end
  end
  for k = 0, pp - 1 do if by_k[k].inferred then by_k[k].offset = by_k[1].offset end end
  return f
end

return M
