-- Mixture of experts and expert parallelism, proven against the serial model in float64: a
-- Mixtral-style LLaMA (pt.models.llama { experts = E }) trains 30 AdamW steps (dropless routing,
-- the load-balancing and z losses on, clipping) with its experts split over the mesh's expert
-- ranks, composed with data parallelism, tensor parallelism and pipelines, and gives the serial
-- losses, clipping's norms and every parameter within 1e-9. The tokens travel by the all-to-all of
-- unequal row counts over the expert group; what is not built is refused at the caller's line.
--   partrain --nproc-per-node 4 --threads 1 tests/dist/test_moe.lua   (2 ranks: expert 2 only)
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, near, eq, ok, raises = H.test, H.near, H.eq, H.ok, H.raises

local world = pt.dist.world_size()
local MOE = { vocab = 64, seq = 16, dim = 16, heads = 4, kv_heads = 2, layers = 2, hidden = 24, experts = 4,
              top_k = 2, aux_loss = 0.05, z_loss = 0.01 }
local BATCH, T = 8, 8
local TOL = 1e-9

local WORLD = pt.mesh({}):group("world")
local function shared(t)
  WORLD:broadcast(t, 0)
  return t
end

local function ce(out, y) return pt.nn.cross_entropy(out:reshape(-1, out.shape[#out.shape]), y:reshape(-1)) end
local function moe_llama(options)
  local o = {}
  for k, v in pairs(MOE) do o[k] = v end
  for k, v in pairs(options or {}) do o[k] = v end
  return pt.models.llama(o):to("float64")
end

-- Trains pt.parallelize(model, policies.llama, pt.mesh(c.mesh), c.opts) beside its serial twin
-- from the same seed on the same global batches (each data rank its slice), comparing the loss and
-- clipping's norm every step and every parameter at the end. `accumulate`: the serial model's
-- micro-batches (a pipeline's), each weighed as train_step weighs them.
local function equal(c)
  local mesh = pt.mesh(c.mesh)
  pt.manual_seed(5)
  local b = moe_llama(c.model)
  pt.manual_seed(5)
  local built = c.deferred and pt.deferred(function()
    local o = { dtype = "float64" }
    for k, v in pairs(MOE) do o[k] = v end
    return pt.models.llama(o)
  end) or moe_llama(c.model)
  local a = pt.parallelize(built, "policies.llama", mesh, c.opts)
  -- train_step weighs each micro-batch's router losses by 1 / micro-batches, as its loss: the
  -- serial micro-batches' coefficients say so.
  for _, m in b:named_modules() do
    if m:type() == "MoE" then
      m:set_attribute("aux_loss", MOE.aux_loss / (c.accumulate or 1))
      m:set_attribute("z_loss", MOE.z_loss / (c.accumulate or 1))
    end
  end
  local optim = { lr = 1e-2, weight_decay = 0.1, clip_grad_norm = 0.5 }
  local ao, bo = pt.optim.adamw(a, optim), pt.optim.adamw(b, optim)
  local d, n = mesh:coord().data, mesh:size("data")
  local part = BATCH / n
  local g = mesh:group("expert")
  g:reset_traffic()
  for step = 1, c.steps or 30 do
    local x = shared(pt.randint(0, MOE.vocab, { BATCH, T }))
    local y = shared(pt.randint(0, MOE.vocab, { BATCH, T }))
    local m = c.accumulate or 1
    local lb = 0
    for i = 0, m - 1 do  -- the serial micro-batches: every data rank's i-th, the mean of their losses
      local xs, ys = {}, {}
      for r = 0, n - 1 do
        xs[#xs + 1] = x:narrow(0, r * part + i * part / m, part / m)
        ys[#ys + 1] = y:narrow(0, r * part + i * part / m, part / m)
      end
      local xi, yi = pt.cat(xs, 0), pt.cat(ys, 0)
      local l = ce(b(xi), yi) / m
      l:backward()
      lb = lb + l:item()
    end
    local xs, ys = x:narrow(0, d * part, part), y:narrow(0, d * part, part)
    local cg = mesh:group("context")
    if cg:size() > 1 then xs, ys = pt.cp.split(xs, cg), pt.cp.split(ys, cg) end
    local la = a:train_step(xs, ys)
    near(la:item(), lb, TOL, ("%s: loss at step %d"):format(c.what, step))
    local nb, na = bo:step(), ao:step()
    near(na, nb, TOL, ("%s: clipping's norm at step %d"):format(c.what, step))
    ao:zero_grad(); bo:zero_grad()
  end
  H.same_parameters(a:full_state_dict(), b:state_dict(), TOL, c.what)
  return a, mesh, g:traffic()
end

test("the MoE block routes each token to top_k experts and its losses reach the gate", function()
  pt.manual_seed(3)
  local block = pt.nn.MoE { dim = 8, hidden = 12, experts = 4, top_k = 2, aux_loss = 0.1, z_loss = 0.01 }
  block:to("float64")
  local x = pt.randn({ 2, 5, 8 }, { dtype = "float64" })
  local y = block(x)
  eq(y.shape[1], 2); eq(y.shape[3], 8)
  -- The loop form: each token through its k experts, weighted, from the block's own weights.
  local w1, w3, w2 = block.experts.w1, block.experts.w3, block.experts.w2
  local logits = block.gate(x:reshape(-1, 8))
  local probs = logits:softmax(-1)
  local top, idx = probs:topk(2, -1)
  top = top / top:sum(-1, true)
  local rows = {}
  for t = 0, 9 do
    local xt = x:reshape(-1, 8):narrow(0, t, 1)
    local acc = pt.zeros({ 1, 8 }, { dtype = "float64" })
    for j = 0, 1 do
      local e = idx:select(0, t):select(0, j):item()
      local h = xt:matmul(w1:select(0, e):t()):silu() * xt:matmul(w3:select(0, e):t())
      acc = acc + h:matmul(w2:select(0, e):t()) * top:select(0, t):select(0, j):item()
    end
    rows[#rows + 1] = acc
  end
  near(y:reshape(-1, 8), pt.cat(rows, 0), 1e-12, "MoE output against the loop over experts")
  -- The router losses' gradient reaches the gate even where the output's gradient is zero.
  local zero = (y * 0):sum()
  zero:backward()
  ok(block.gate.weight.grad:abs():sum():item() > 0, "the aux and z losses give the gate a gradient")
  local stats = pt.moe.stats(block)[""]
  eq(stats.slots, 20)
  local routed = 0
  for _, v in ipairs(stats.routed) do routed = routed + v end
  eq(routed, 20, "every slot routed")
end)

-- The loop form of a block from its own weights: each token through its k experts, weighted.
local function loop_reference(block, x, k, normalize)
  local d = x.shape[2]
  local w1, w3, w2 = block.experts.w1, block.experts.w3, block.experts.w2
  local probs = block.gate(x):softmax(-1)
  local top, idx = probs:topk(k, -1)
  if normalize then top = top / top:sum(-1, true) end
  local rows = {}
  for t = 0, x.shape[1] - 1 do
    local xt = x:narrow(0, t, 1)
    local acc = pt.zeros({ 1, d }, { dtype = "float64" })
    for j = 0, k - 1 do
      local e = idx:select(0, t):select(0, j):item()
      local h = xt:matmul(w1:select(0, e):t()):silu() * xt:matmul(w3:select(0, e):t())
      acc = acc + h:matmul(w2:select(0, e):t()) * top:select(0, t):select(0, j)
    end
    rows[#rows + 1] = acc
  end
  return #rows > 0 and pt.cat(rows, 0) or pt.zeros({ 0, d }, { dtype = "float64" })
end

test("the block equals the loop over experts for 30 seeded random shapes, routings and token counts", function()
  local rng = H.rng(20261128)
  for case = 1, 30 do
    local E = rng.int(1, 6)
    local k = rng.int(1, E)
    local dim, hidden, n = 4 * rng.int(1, 3), 4 * rng.int(1, 4), rng.int(0, 12)
    local normalize = rng.int(0, 1) == 1
    pt.manual_seed(case)
    local block = pt.nn.MoE { dim = dim, hidden = hidden, experts = E, top_k = k, normalize = normalize,
                              aux_loss = 0 }
    block:to("float64")
    local x = pt.randn({ n, dim }, { dtype = "float64" })
    local xa, xb = x:clone():requires_grad_(), x:clone():requires_grad_()
    local ya, yb = block(xa), loop_reference(block, xb, k, normalize)
    local what = ("case %d: E=%d k=%d dim=%d hidden=%d tokens=%d normalize=%s"):format(case, E, k, dim, hidden, n,
                                                                                 tostring(normalize))
    eq(ya.shape[1], n, what .. ": rows")
    if n > 0 then
      near(ya, yb, 1e-12, what .. ": output")
      local wgt = pt.randn({ n, dim }, { dtype = "float64" })
      ;(ya * wgt):sum():backward()
      ;(yb * wgt):sum():backward()
      near(xa.grad, xb.grad, 1e-12, what .. ": the tokens' gradient")
    end
  end
end)

test("expert " .. world .. " dispatch equals the block in one process for 20 seeded random routings", function()
  -- Random token counts a rank (0 included) and skewed routers: ranks send and receive unequal
  -- numbers of rows, some none; the output and every gradient equal the unsplit block's.
  local mesh = pt.mesh { expert = world }
  local rank = mesh:rank()
  local rng = H.rng(77)  -- the same draws on every rank
  for case = 1, 20 do
    local E = world * rng.int(1, 3)
    local k = rng.int(1, math.min(E, 3))
    local counts = {}
    for r = 1, world do counts[r] = rng.int(0, 6) end
    local hot = rng.int(0, E - 1)  -- this case's favourite expert
    local function make()
      pt.manual_seed(100 + case)
      -- No router losses: a rank's share of them is weighed for data parallelism's mean of the
      -- parameters' gradients, which the tokens' gradients compared here do not go through.
      local b = pt.nn.MoE { dim = 8, hidden = 12, experts = E, top_k = k, aux_loss = 0, z_loss = 0 }
      b:to("float64")
      -- Scores that favour `hot`, then the rest by logits: skewed, and the same in both blocks.
      b:set_router(function(self, logits, xs)
        local bias = pt.zeros({ 1, E }, { dtype = "float64" })
        bias:narrow(1, hot, 1):fill_(3)
        local p = (logits + bias):softmax(-1)
        local w, idx = p:topk(k, -1)
        return w / w:sum(-1, true), idx, logits:softmax(-1)
      end)
      return b
    end
    local serial = make()
    local split = pt.parallelize(make(), nil, mesh)
    local total = 0
    for _, c in ipairs(counts) do total = total + c end
    local x = shared(pt.randn({ total, 8 }, { dtype = "float64" }))
    local first = 0
    for r = 1, rank do first = first + counts[r] end
    local mine = counts[rank + 1]
    local xs, xp = x:clone():requires_grad_(), x:narrow(0, first, mine):clone():requires_grad_()
    local wgt = shared(pt.randn({ total, 8 }, { dtype = "float64" }))
    local ys = serial(xs)
    local yp = split(xp)
    local what = ("case %d: E=%d k=%d rows %s"):format(case, E, k, table.concat(counts, ","))
    eq(yp.shape[1], mine, what .. ": rows")
    if mine > 0 then near(yp, ys:narrow(0, first, mine), 1e-12, what .. ": output") end
    ;(ys * wgt):sum():backward()
    ;(yp * wgt:narrow(0, first, mine)):sum():backward()  -- every rank: its backward joins the all-to-alls
    if mine > 0 then near(xp.grad, xs.grad:narrow(0, first, mine), 1e-12, what .. ": the tokens' gradient") end
  end
end)

test("expert " .. world .. " (every data rank its own experts) trains as serial AdamW", function()
  local _, _, moved = equal { what = "expert " .. world, mesh = { expert = world } }
  -- A layer's step: the counts (E int64), then each rank sends its routed rows (N k of dim
  -- float64) and gets back as many as it received, forward and again backward. What one rank
  -- sends depends on the routing; over the group the rows sent equal the rows received.
  local steps, rows = 30, BATCH / world * T * MOE.top_k
  eq(moved.all_to_all.calls, steps * MOE.layers * 5, "all-to-alls: counts, rows out and back, twice back")
  local total = pt.tensor({ moved.all_to_all.bytes }, { dtype = "float64" })
  WORLD:all_reduce(total)
  eq(total:item(), world * steps * MOE.layers * (MOE.experts * 8 + 4 * rows * MOE.dim * 8), "all-to-all bytes")
end)

test("expert " .. world .. " with ZeRO-1, 2 and 3 trains as serial AdamW", function()
  equal { what = "expert " .. world .. " zero-1", mesh = { expert = world, zero = 0 }, opts = { zero = { stage = 1 } } }
  equal { what = "expert " .. world .. " zero-2", mesh = { expert = world, zero = 0 }, opts = { zero = { stage = 2 } },
          steps = 10 }
  equal { what = "expert " .. world .. " zero-3", mesh = { expert = world, zero = 0 }, opts = { zero = { stage = 3 } },
          steps = 10 }
  equal { what = "expert " .. world .. " zero-3 deferred", mesh = { expert = world, zero = 0 },
          opts = { zero = { stage = 3 } }, deferred = true, steps = 10 }
end)

if world == 4 then
  test("expert 2 x data 4 (experts synced over expert_data) trains as serial AdamW", function()
    equal { what = "expert 2 of data 4", mesh = { expert = 2 } }
  end)
  test("expert 2 x data 4 with ZeRO-1, 2 and 3 (experts sharded over expert_data) trains as serial AdamW", function()
    local a, mesh = equal { what = "expert 2 of data 4, zero-1", mesh = { expert = 2, zero = 0 },
                            opts = { zero = { stage = 1 } } }
    -- Masters: the dense parameters split over the 4 data ranks, this rank's experts over the
    -- 2 that hold them (float64, padding to the group sizes aside).
    local dense, experts = 0, 0
    for name, p in a:named_parameters() do
      if name:find("experts%.w") then experts = experts + p:numel() else dense = dense + p:numel() end
    end
    local masters = pt.optim.adamw(a, { lr = 1e-2 }):zero().master_bytes / 8
    local want = dense / 4 + experts / 2
    ok(masters >= want and masters < want + 64, ("masters of %d elements, want %d"):format(masters, want))
    equal { what = "expert 2 of data 4, zero-2", mesh = { expert = 2, zero = 0 }, opts = { zero = { stage = 2 } },
            steps = 10 }
    equal { what = "expert 2 of data 4, zero-3", mesh = { expert = 2, zero = 0 }, opts = { zero = { stage = 3 } },
            steps = 10 }
  end)
  -- Each expert's hidden width split over the tensor ranks too (policies/llama.lua).
  local function local_shape(model, name)
    for n, p in model:named_parameters() do if n == name then return p.shape end end
  end
  test("expert 2 x tensor 2 (each expert split over the tensor ranks) trains as serial AdamW", function()
    local a = equal { what = "expert 2 x tensor 2", mesh = { tensor = 2, expert = 2 } }
    local w1, w2 = local_shape(a, "layers.0.block_sparse_moe.experts.w1"), local_shape(a, "layers.0.block_sparse_moe.experts.w2")
    eq(table.concat(w1, "x"), "2x12x16", "w1: 2 of 4 experts, 12 of 24 hidden rows")
    eq(table.concat(w2, "x"), "2x16x12", "w2: 2 of 4 experts, 12 of 24 hidden columns")
  end)
  test("tensor 2 (experts split inside, not between ranks) and expert 2 x tensor 2 with ZeRO-1 train as serial",
       function()
    local a = equal { what = "tensor 2 of data 2", mesh = { tensor = 2 } }
    eq(table.concat(local_shape(a, "layers.1.block_sparse_moe.experts.w3"), "x"), "4x12x16", "w3 split inside")
    equal { what = "expert 2 x tensor 2, zero-1", mesh = { tensor = 2, expert = 2, zero = 0 },
            opts = { zero = { stage = 1 } }, steps = 10 }
  end)
  test("expert 2 x pipeline 2 trains as serial AdamW (micro-batches)", function()
    equal { what = "expert 2 x pipeline 2", mesh = { pipeline = 2, expert = 2 }, accumulate = 2,
            opts = { schedule = "1f1b", microbatches = 2 } }
  end)
end

test("expert " .. world .. " built deferred, with activation checkpointing, trains as serial AdamW", function()
  equal { what = "expert " .. world .. " deferred", mesh = { expert = world }, deferred = true, steps = 10 }
  equal { what = "expert " .. world .. " recompute", mesh = { expert = world }, opts = { recompute = "block" },
          steps = 10 }
  if world == 4 then
    equal { what = "expert 4 over context 2 x data 2", mesh = { context = 2, expert = 4 }, steps = 10 }
  end
end)

test("with a capacity, expert " .. world .. " equals data parallelism over the same local batches", function()
  -- Drops depend on the tokens a rank holds, so a run with drops equals the data-parallel run
  -- with the same local batches (not the serial run over the whole batch).
  local function make(mesh)
    pt.manual_seed(8)
    local m = pt.parallelize(moe_llama { capacity_factor = 1.0 }, "policies.llama", mesh)
    return m, pt.optim.adamw(m, { lr = 1e-2, clip_grad_norm = 0.5 })
  end
  local mesh_e = pt.mesh { expert = world }
  local a, ao = make(mesh_e)
  local mesh_d = pt.mesh {}
  local b, bo = make(mesh_d)
  local d, part = mesh_e:coord().data, BATCH / world
  local dropped = 0
  for step = 1, 10 do
    local x = shared(pt.randint(0, MOE.vocab, { BATCH, T }))
    local y = shared(pt.randint(0, MOE.vocab, { BATCH, T }))
    local xs, ys = x:narrow(0, d * part, part), y:narrow(0, d * part, part)
    near(a:train_step(xs, ys):item(), b:train_step(xs, ys):item(), TOL, "loss at step " .. step)
    near(ao:step(), bo:step(), TOL, "clipping's norm at step " .. step)
    ao:zero_grad(); bo:zero_grad()
  end
  for _, s in pairs(pt.moe.stats(a)) do dropped = dropped + s.dropped end
  ok(dropped > 0, "a capacity of 1.0 dropped some slots")
  H.same_parameters(a:full_state_dict(), b:full_state_dict(), TOL, "capacity 1.0")
end)

test("a checkpoint saved at one expert size resumes at another", function()
  -- Trains 3 steps at `from`, saves, loads at `to`, and compares the next step's loss and every
  -- parameter after it with the uninterrupted run's.
  local scratch = os.tmpname()
  os.remove(scratch)
  local DIR = scratch:match("^(.*)/") .. "/partrain-test-moe-" .. (os.getenv("MASTER_PORT") or "0")
  local function resume(from, to, tag, from_opts)
    local function model(m, opts)
      pt.manual_seed(11)
      local a = pt.parallelize(moe_llama(), "policies.llama", m, opts)
      return a, pt.optim.adamw(a, { lr = 1e-2 })
    end
    local function step(a, opt, m, x, y)
      local d, n = m:coord().data, m:size("data")
      local part = BATCH / n
      local l = a:train_step(x:narrow(0, d * part, part), y:narrow(0, d * part, part))
      opt:step(); opt:zero_grad()
      return l:item()
    end
    pt.manual_seed(99)
    local batches = {}
    for i = 1, 4 do
      batches[i] = { shared(pt.randint(0, MOE.vocab, { BATCH, T })), shared(pt.randint(0, MOE.vocab, { BATCH, T })) }
    end
    local m1 = pt.mesh(from)
    local a, ao = model(m1, from_opts)
    for i = 1, 3 do step(a, ao, m1, batches[i][1], batches[i][2]) end
    pt.ckpt.save(DIR, { model = a, optim = ao, step = 3, tag = tag, overwrite = true })
    local want = step(a, ao, m1, batches[4][1], batches[4][2])
    local m2 = pt.mesh(to)
    local b, bo = model(m2)
    pt.ckpt.load(DIR, tag, { model = b, optim = bo })
    near(step(b, bo, m2, batches[4][1], batches[4][2]), want, TOL, tag .. ": the next loss after resuming")
    H.same_parameters(b:full_state_dict(), a:full_state_dict(), TOL, tag)
  end
  resume({ expert = world }, {}, "expert-to-data")
  resume({}, { expert = world }, "data-to-expert")
  if world == 4 then resume({ expert = 2 }, { expert = 4 }, "expert2-to-expert4") end
  if world == 4 then resume({ expert = 2, tensor = 2 }, { expert = 4 }, "expert2-tensor2-to-expert4") end
  if world == 4 then resume({ expert = 4 }, { expert = 2, tensor = 2 }, "expert4-to-expert2-tensor2") end
  if world == 4 then
    resume({ expert = 2, zero = 0 }, { expert = 4 }, "expert2-zero1-to-expert4", { zero = { stage = 1 } })
    resume({ expert = 2, zero = 0 }, { expert = 4 }, "expert2-zero3-to-expert4", { zero = { stage = 3 } })
  end
  WORLD:barrier()
  if pt.dist.rank() == 0 then os.execute("rm -rf '" .. DIR .. "'") end
end)

test("a router written in Lua routes the tokens, and a wrong one is refused at the caller's line", function()
  pt.manual_seed(3)
  local block = pt.nn.MoE { dim = 8, hidden = 12, experts = 4, top_k = 2 }
  local x = pt.randn({ 6, 8 })
  -- Every token to experts 0 and 3, weighed 3:1.
  local function fixed(self, logits, tokens)
    local n = logits.shape[1]
    local idx = pt.tensor({ 0, 3 }, { dtype = "int64" }):reshape(1, 2):expand(n, 2):contiguous()
    local w = pt.tensor({ 0.75, 0.25 }):reshape(1, 2):expand(n, 2):contiguous()
    return w, idx
  end
  eq(pt.moe.set_router(block, fixed), 1)
  block(x)
  local routed = pt.moe.stats(block)[""].routed
  eq(routed[1], 6); eq(routed[2], 0); eq(routed[3], 0); eq(routed[4], 6)
  local function router(w, idx) return function() return w, idx end end
  local good_w = pt.ones({ 6, 2 }) / 2
  local cases = {
    { router(pt.ones({ 6, 3 }), pt.zeros({ 6, 2 }, { dtype = "int64" })), "returned weights of shape [6, 3]" },
    { router(good_w, pt.zeros({ 6, 2 })), "expected int64 [6, 2]" },
    { router(good_w, pt.full({ 6, 2 }, 4, { dtype = "int64" })), "indices out of range: they must be in [0, 4)" },
    { router(good_w, pt.zeros({ 6, 2 }, { dtype = "int64" })), "the same expert twice" },
    { router(good_w * (0 / 0), pt.tensor({ 0, 1 }, { dtype = "int64" }):reshape(1, 2):expand(6, 2):contiguous()),
      "weights that are not finite" },
    { function() return "nope" end, "returned a string as its weights" },
  }
  for i, c in ipairs(cases) do
    block:set_router(c[1])
    raises(function() block(x) end, c[2])
    -- The error names this file's line (the call).
    local at = debug.getinfo(1, "l").currentline; raises(function() block(x) end, "test_moe.lua:" .. at)
  end
  -- A router's own error names its own line.
  block:set_router(function() error("router broke") end)
  raises(function() block(x) end, "test_moe.lua:" .. debug.getinfo(1, "l").currentline - 1 .. ": router broke")
  local plain = pt.nn.MoE { dim = 8, hidden = 12, experts = 4, top_k = 2 }
  local nan = pt.randn({ 6, 8 })
  nan:fill_(0 / 0)
  raises(function() plain(nan) end, "logits are not finite")
  raises(function() pt.nn.MoE { dim = 8, hidden = 12, experts = 4, top_k = 5 } end, "top_k=5 must be between 1")
  raises(function() pt.nn.MoE { dim = 8, hidden = 12, experts = 4, router = 3 } end, "router must be a function")
  raises(function() pt.moe.set_router(pt.nn.Linear(2, 2), fixed) end, "has no MoE block")
end)

test("with a capacity, each expert takes at most ceil(cf * N * k / E) slots of a rank, the most probable", function()
  pt.manual_seed(4)
  local block = pt.nn.MoE { dim = 8, hidden = 12, experts = 4, top_k = 1, capacity_factor = 1.0 }
  block:to("float64")
  local x = pt.randn({ 8, 8 }, { dtype = "float64" })
  -- All 8 tokens to expert 2: capacity ceil(1.0 * 8 * 1 / 4) = 2 keeps the 2 most probable.
  local p = pt.tensor({ 0.1, 0.9, 0.3, 0.8, 0.2, 0.5, 0.7, 0.4 }, { dtype = "float64" }):reshape(8, 1)
  block:set_router(function(self, logits, tokens)
    return p, pt.full({ 8, 1 }, 2, { dtype = "int64" }), pt.cat({ p * 0, p * 0, p, p * 0 }, 1)
  end)
  local y = block(x)
  local st = pt.moe.stats(block)[""]
  eq(st.dropped, 6); eq(st.slots, 8)
  -- Kept: tokens 1 and 3 (0.9, 0.8); the others pass through as zeros.
  for t = 0, 7 do
    local row = y:select(0, t):abs():sum():item()
    if t == 1 or t == 3 then ok(row > 0, "token " .. t .. " kept") else eq(row, 0, "token " .. t .. " dropped") end
  end
end)

test("expert parallelism refuses what it cannot split, at the caller's line", function()
  raises(function() pt.parallelize(moe_llama { experts = 3, top_k = 1 }, "policies.llama", pt.mesh { expert = world })
         end, "experts=3 is not divisible by the mesh's expert=" .. world)
  raises(function() pt.parallelize(pt.models.llama { vocab = 64, seq = 16, dim = 16, heads = 4, layers = 1 },
                                   "policies.llama", pt.mesh { expert = world }) end, "no mixture-of-experts block")
  raises(function() moe_llama { top_k = 5 } end, "top_k=5 must be between 1 and experts=4")
  raises(function() pt.parallelize(moe_llama(), "policies.llama", pt.mesh { tensor = 2 }, { sequence_parallel = true })
         end, "off for block_sparse_moe")
  local split = pt.parallelize(moe_llama(), "policies.llama", pt.mesh { expert = world })
  raises(function() split:generate(pt.zeros({ 1, 2 }, { dtype = "int64" }), { max_new = 1 }) end,
         "experts are split over expert=" .. world)
  if world == 4 then
    raises(function() pt.parallelize(moe_llama(), "policies.llama", pt.mesh { expert = 2, zero = 2 },
                                     { zero = { stage = 1 } }) end, "needs zero groups of every data rank")
  end
end)

H.run()
