-- Context parallelism: each sequence split over the context ranks (every rank an early and a late
-- chunk), attention exact over all of it, proven against the unsplit computation in float64.
-- pt.cp.attention (ring and all-to-all, causal or not, grouped-query heads, a scale of its own)
-- equals attention over the gathered tensors, forward and backward, within 1e-12; GPT-2 and LLaMA
-- train as serial AdamW for 30 steps (losses, clipping's norm, every parameter within 1e-9) at
-- context 2 and 4 and composed with data, ZeRO, tensor (sequence) parallelism, pipelines and
-- activation checkpointing; a model written in Lua calls pt.cp.attention itself; what cannot be
-- split is refused at the caller's line.
--   partrain --nproc-per-node 4 --threads 1 tests/dist/test_cp.lua   (2 ranks: context 2 only)
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, near, eq, ok, raises = H.test, H.near, H.eq, H.ok, H.raises

local world = pt.dist.world_size()
local GPT = { vocab = 64, seq = 16, dim = 16, heads = 4, layers = 2 }
local LLAMA = { vocab = 64, seq = 16, dim = 16, heads = 4, kv_heads = 2, layers = 2 }
local BATCH, T = 4, 16
local TOL = 1e-9

local WORLD = pt.mesh({}):group("world")
-- The same tensor on every rank: drawn on rank 0 and broadcast.
local function shared(t)
  WORLD:broadcast(t, 0)
  return t
end

-- ---- pt.cp.attention against attention over the whole sequence -------------------------------

-- Runs pt.cp.attention on this rank's rows of q, k, v (B, H, T, d) and compares its rows of the
-- output and of the gradients of sum(out * w) with the unsplit attention's.
local function attention_case(c)
  local mesh = pt.mesh { context = c.context }
  local g = mesh:group("context")
  local hq, hkv, t = c.heads, c.kv_heads or c.heads, c.length or 4 * c.context
  local q = shared(pt.randn({ 2, hq, t, 8 }, { dtype = "float64" }))
  local k = shared(pt.randn({ 2, hkv, t, 8 }, { dtype = "float64" }))
  local v = shared(pt.randn({ 2, hkv, t, 8 }, { dtype = "float64" }))
  local w = shared(pt.randn({ 2, hq, t, 8 }, { dtype = "float64" }))
  local causal = c.causal ~= false
  -- Serial: attention over everything.
  local qa, ka, va = q:clone():requires_grad_(), k:clone():requires_grad_(), v:clone():requires_grad_()
  local whole = pt.nn.scaled_dot_product_attention(qa, ka, va, { causal = causal, scale = c.scale })
  local serial_loss = (whole * w):sum()
  serial_loss:backward()
  -- This rank's rows.
  local function mine(x) return pt.cp.split(x, g, 2):detach():requires_grad_() end
  local qr, kr, vr = mine(q), mine(k), mine(v)
  local out = pt.cp.attention(qr, kr, vr, { group = g, mode = c.mode, causal = causal, scale = c.scale })
  local loss = (out * pt.cp.split(w, g, 2)):sum()
  loss:backward()
  local what = ("%s context %d heads %d/%d%s"):format(c.mode or "ring", c.context, hq, hkv, causal and " causal" or "")
  near(out, pt.cp.split(whole, g, 2), 1e-12, what .. ": output")
  near(qr.grad, pt.cp.split(qa.grad, g, 2), 1e-12, what .. ": dq")
  near(kr.grad, pt.cp.split(ka.grad, g, 2), 1e-12, what .. ": dk")
  near(vr.grad, pt.cp.split(va.grad, g, 2), 1e-12, what .. ": dv")
end

test("ring attention equals attention over the whole sequence, forward and backward", function()
  for _, causal in ipairs { true, false } do
    for _, h in ipairs { { 4, 4 }, { 4, 2 }, { 6, 1 } } do
      attention_case { context = world, heads = h[1], kv_heads = h[2], causal = causal }
      if world == 4 then attention_case { context = 2, heads = h[1], kv_heads = h[2], causal = causal } end
    end
  end
  attention_case { context = world, heads = 4, scale = 0.2 }
end)

test("all-to-all attention equals attention over the whole sequence, forward and backward", function()
  for _, causal in ipairs { true, false } do
    attention_case { context = world, heads = 4, mode = "all_to_all", causal = causal }
    attention_case { context = world, heads = 4, kv_heads = 2, mode = "all_to_all", causal = causal }
  end
  if world == 4 then  -- fewer key/value heads than ranks: each is repeated for 2 ranks
    attention_case { context = 4, heads = 8, kv_heads = 2, mode = "all_to_all" }
  end
  attention_case { context = world, heads = 4, mode = "a2a", scale = 0.7 }
end)

test("context attention refuses what it cannot split, naming the sizes", function()
  local g = pt.mesh({ context = world }):group("context")
  local q = pt.randn({ 1, 4, 3, 8 }, { dtype = "float64" })
  raises(function() pt.cp.attention(q, q, q, { group = g }) end, "not an even number")
  local q6 = pt.randn({ 1, 6, 4, 8 }, { dtype = "float64" })
  local q12 = pt.randn({ 1, 12, 4, 8 }, { dtype = "float64" })
  local k3 = pt.randn({ 1, 3, 4, 8 }, { dtype = "float64" })
  if world == 4 then
    raises(function() pt.cp.attention(q6, q6, q6, { group = g, mode = "all_to_all" }) end,
           "6 query heads do not divide by 4")
  end
  raises(function() pt.cp.attention(q12, k3, k3, { group = g, mode = "all_to_all" }) end,
         "3 key/value heads neither divide by " .. world)
  raises(function() pt.cp.attention(q6, q6, q6, { group = g, mode = "zigzag" }) end, "unknown mode 'zigzag'")
  raises(function() pt.cp.attention(q6, q6, q6, { mode = "ring" }) end, "needs { group")
  raises(function() pt.cp.attention(q6, q6, q6, { group = g, dropout = 0.1 }) end, "dropout")
  raises(function() pt.cp.split(pt.zeros({ 2, 6 }), g) end, "does not split into 2*context")
  local m = pt.parallelize(pt.models.gpt2(GPT), "policies.gpt2", pt.mesh { context = world })
  raises(function() m:generate(pt.zeros({ 1, 2 }, { dtype = "int64" }), { max_new = 1, cache = false }) end,
         "splits its sequences over context=" .. world)
  raises(function() pt.parallelize(pt.models.gpt2(GPT), "policies.gpt2", pt.mesh {}, { context = "all_to_all" }) end,
         "but the mesh has context=1")
  local positions = pt.cp.positions(4, g)
  eq(positions.shape[1], 4)
end)

-- ---- Training against the serial model --------------------------------------------------------

local function ce(out, y) return pt.nn.cross_entropy(out:reshape(-1, out.shape[#out.shape]), y:reshape(-1)) end

-- Trains a model parallelized with c.opts over pt.mesh(c.mesh) beside its serial twin, from the
-- same seed on the same global batches: each rank gets its data slice of the batch and its
-- context chunks of each sequence (what a loader over the mesh hands it); compares the loss and
-- clipping's norm every step and every parameter at the end within c.tol.
local function equal(c)
  local mesh = pt.mesh(c.mesh)
  local make = c.make or function() return pt.models.gpt2(GPT):to("float64") end
  local policy = c.policy == nil and "policies.gpt2" or c.policy or nil
  pt.manual_seed(11)
  local b = make(false)
  pt.manual_seed(11)
  local a = pt.parallelize(make(true, mesh), policy, mesh, c.opts)
  local optim = { lr = 1e-2, weight_decay = 0.1, clip_grad_norm = 0.5 }
  local ao, bo = pt.optim.adamw(a, optim), pt.optim.adamw(b, optim)
  local d, n = mesh:coord().data, mesh:size("data")
  local part, g = BATCH / n, mesh:group("context")
  local tol = c.tol or TOL
  g:reset_traffic()
  for step = 1, c.steps or 30 do
    local x = shared(pt.randint(0, GPT.vocab, { BATCH, T }))
    local y = shared(pt.randint(0, GPT.vocab, { BATCH, T }))
    if c.ignore then y = c.ignore(y) end
    -- With dropout both draw their masks from the same generator state (each rank draws the
    -- whole sequence's mask and keeps its rows).
    if c.dropout then pt.manual_seed(1000 + step) end
    local lb = ce(b(x), y)
    lb:backward()
    local xs, ys = pt.cp.split(x:narrow(0, d * part, part), g), pt.cp.split(y:narrow(0, d * part, part), g)
    if c.dropout then pt.manual_seed(1000 + step) end
    local la = a:train_step(xs, ys, { accumulate = c.accumulate })
    near(la, lb, tol, ("%s: loss at step %d"):format(c.what, step))
    local nb, na = bo:step(), ao:step()
    near(na, nb, tol, ("%s: clipping's norm at step %d"):format(c.what, step))
    ao:zero_grad(); bo:zero_grad()
  end
  H.same_parameters(a:full_state_dict(), b:state_dict(), tol, c.what)
  -- The attention's exchanges went over the context group.
  local moved = g:traffic()
  local op = (c.opts or {}).context == "all_to_all" and "all_to_all" or "send_recv"
  ok(moved[op] and moved[op].calls > 0, c.what .. ": no " .. op .. " over the context group")
  return a, mesh, moved
end

local function llama() return pt.models.llama(LLAMA):to("float64") end

test("GPT-2 and LLaMA (rotary, grouped-query) at context " .. world .. " train as serial AdamW", function()
  local _, _, moved = equal { what = "gpt2 ring", mesh = { context = world } }
  -- A layer's step: c - 1 key/value blocks passed forward, c - 1 again backward and c gradient
  -- blocks (float64 here), each of B x heads x (T/c) x head size, keys and values.
  local c, steps = world, 30
  local block = 2 * BATCH * GPT.heads * (T / c) * (GPT.dim / GPT.heads) * 8
  eq(moved.send_recv.calls, steps * GPT.layers * (3 * c - 2), "ring exchanges")
  eq(moved.send_recv.bytes, steps * GPT.layers * (3 * c - 2) * block, "ring bytes")
  equal { what = "llama ring", mesh = { context = world }, make = llama, policy = "policies.llama" }
  equal { what = "gpt2 all_to_all", mesh = { context = world }, opts = { context = "all_to_all" }, steps = 10 }
  equal { what = "llama all_to_all", mesh = { context = world }, make = llama, policy = "policies.llama",
          opts = { context = "all_to_all" }, steps = 10 }
end)

-- ---- A model written in Lua --------------------------------------------------------------------

-- A one-block causal language model whose attention is Lua: with a context group it reads its
-- positions from pt.cp.positions and attends with pt.cp.attention.
local LuaAttention = pt.nn.Module "LuaAttention"
function LuaAttention:__init(dim, heads, group)
  self.qkv = pt.nn.Linear(dim, 3 * dim)
  self.proj = pt.nn.Linear(dim, dim)
  self.heads, self.group = heads, group
end
function LuaAttention:forward(x)
  local B, L, D = x.shape[1], x.shape[2], x.shape[3]
  local qkv = self.qkv(x):view(B, L, 3, self.heads, D / self.heads):permute(2, 0, 3, 1, 4)
  local q, k, v = qkv:select(0, 0), qkv:select(0, 1), qkv:select(0, 2)
  local y = self.group and pt.cp.attention(q, k, v, { group = self.group })
            or pt.nn.scaled_dot_product_attention(q, k, v, { causal = true })
  return self.proj(y:transpose(1, 2):reshape(B, L, D))
end
local LuaLM = pt.nn.Module "LuaLM"
function LuaLM:__init(group, attend)
  self.emb = pt.nn.Embedding(GPT.vocab, 16)
  self.pos = pt.nn.Embedding(T, 16)
  self.attn = LuaAttention(16, 4, attend ~= false and group or nil)
  self.head = pt.nn.Linear(16, GPT.vocab)
  self.group = group
end
function LuaLM:forward(ids)
  local L = ids.shape[2]
  local positions = self.group and pt.cp.positions(L, self.group) or pt.arange(L)
  local x = self.emb(ids) + self.pos(positions)
  return self.head(x + self.attn(x))
end

test("a Lua model calling pt.cp.attention trains as its serial self; one that does not is refused", function()
  local mesh = pt.mesh { context = world }
  local g = mesh:group("context")
  equal { what = "lua attention", mesh = { context = world }, policy = false,
          make = function(parallel, m) return LuaLM(parallel and m:group("context") or nil):to("float64") end }
  pt.manual_seed(5)
  local plain = pt.parallelize(LuaLM(g, false):to("float64"), nil, mesh)
  local x = pt.randint(0, GPT.vocab, { 2, T / world })
  raises(function() plain:train_step(x, x) end, "computed no context attention")
end)

-- ---- Loader, checkpoints ---------------------------------------------------------------------

local scratch = os.tmpname()
os.remove(scratch)
local DIR = scratch:match("^(.*)/") .. "/partrain-test-cp-" .. (os.getenv("MASTER_PORT") or "0")

test("a loader over the mesh hands each context rank its chunks of the same sequences", function()
  local mesh = pt.mesh { context = world }
  local g = mesh:group("context")
  local text = DIR .. "-text-" .. pt.dist.rank()
  local f = assert(io.open(text, "wb"))
  for i = 1, 4096 do f:write(string.char(32 + (i * 7919) % 90)) end
  f:close()
  local whole = pt.data.text { path = text, seq = T, batch = 4, seed = 3 }
  local mine = pt.data.text { path = text, seq = T, batch = 4, seed = 3, mesh = mesh }
  for _ = 1, 3 do
    local x, y = whole:next()
    local xs, ys = mine:next()
    ok(xs:equal(pt.cp.split(x, g)), "inputs: this rank's chunks of each sequence")
    ok(ys:equal(pt.cp.split(y, g)), "targets: shifted before the split (a chunk's last target is the next token)")
  end
  mine:seek(8)
  whole:seek(8)
  ok(mine:next():equal(pt.cp.split(whole:next(), g)), "seek lands on the same sequences")
  local odd = pt.data.text { path = text, seq = 2 * world + 2, batch = 4, mesh = mesh }
  raises(function() odd:next() end, "make the sequence length a multiple of " .. 2 * world)
  os.remove(text)
end)

test("a checkpoint saved under context parallelism resumes without it, and back", function()
  -- Trains 3 steps at `from`, saves, loads at `to`, and compares the next step's loss with the
  -- uninterrupted run's.
  local function resume(from, to, tag)
    local function model(m)
      pt.manual_seed(11)
      local a = pt.parallelize(pt.models.gpt2(GPT):to("float64"), "policies.gpt2", m)
      return a, pt.optim.adamw(a, { lr = 1e-2 })
    end
    local function step(a, opt, m, x, y)
      local d, n, g = m:coord().data, m:size("data"), m:group("context")
      local part = BATCH / n
      local l = a:train_step(pt.cp.split(x:narrow(0, d * part, part), g), pt.cp.split(y:narrow(0, d * part, part), g))
      opt:step(); opt:zero_grad()
      return l:item()
    end
    pt.manual_seed(99)
    local batches = {}
    for i = 1, 4 do
      batches[i] = { shared(pt.randint(0, GPT.vocab, { BATCH, T })), shared(pt.randint(0, GPT.vocab, { BATCH, T })) }
    end
    local m1 = pt.mesh(from)
    local a, ao = model(m1)
    for i = 1, 3 do step(a, ao, m1, batches[i][1], batches[i][2]) end
    pt.ckpt.save(DIR, { model = a, optim = ao, step = 3, tag = tag, overwrite = true })
    local want = step(a, ao, m1, batches[4][1], batches[4][2])
    local m2 = pt.mesh(to)
    local b, bo = model(m2)
    pt.ckpt.load(DIR, tag, { model = b, optim = bo })
    near(step(b, bo, m2, batches[4][1], batches[4][2]), want, TOL, tag .. ": the next loss after resuming")
  end
  resume({ context = world }, {}, "context-to-data")
  resume({}, { context = world }, "data-to-context")
  if world == 4 then resume({ context = 2, tensor = 2 }, { context = 4 }, "context2-tensor2-to-context4") end
  if pt.dist.rank() == 0 then os.execute("rm -rf '" .. DIR .. "'") end
end)

local function dropped() return pt.models.gpt2 { vocab = 64, seq = 16, dim = 16, heads = 4, layers = 2, dropout = 0.2,
                                                attn_dropout = 0 }:to("float64") end

test("GPT-2's embedding and residual dropout under context parallelism equal serial", function()
  equal { what = "gpt2 dropout", mesh = { context = world }, make = dropped, dropout = true, steps = 10 }
  local mesh = pt.mesh { context = world }
  pt.manual_seed(3)
  local m = pt.parallelize(pt.models.gpt2 { vocab = 64, seq = 16, dim = 16, heads = 4, layers = 2, dropout = 0.1 },
                           "policies.gpt2", mesh)
  local x = pt.randint(0, 64, { 2, T / world })
  raises(function() m:train_step(x, x) end, "attn_dropout")
end)

test("ignored targets on one context rank's chunks only are counted over the whole sequence", function()
  -- Positions of the last chunk's rows only (rank 0's late chunk): an uneven count a rank.
  equal { what = "gpt2 ignore_index", mesh = { context = world }, steps = 10, ignore = function(y)
    local z = y:clone()
    z:narrow(1, T - T / (2 * world), T / (2 * world)):fill_(-100)
    return z
  end }
end)

if world == 4 then
  test("context 2 composed with data 2 (and ZeRO-1, 2 and 3) trains as serial AdamW", function()
    equal { what = "context 2 x data 2", mesh = { context = 2 } }
    equal { what = "context 2 x data 2 zero-1", mesh = { context = 2, zero = 0 }, opts = { zero = { stage = 1 } }, steps = 10 }
    equal { what = "context 2 x data 2 zero-2", mesh = { context = 2, zero = 0 }, opts = { zero = { stage = 2 } }, steps = 10 }
    equal { what = "context 2 x data 2 zero-3", mesh = { context = 2, zero = 0 }, opts = { zero = { stage = 3 } }, steps = 10 }
  end)

  test("context 2 composed with tensor 2 trains as serial AdamW", function()
    equal { what = "context 2 x tensor 2", mesh = { context = 2, tensor = 2 } }
    equal { what = "llama context 2 x tensor 2", mesh = { context = 2, tensor = 2 }, make = llama,
            policy = "policies.llama", steps = 10 }
    equal { what = "context 2 x tensor 2 sequence parallel", mesh = { context = 2, tensor = 2 }, steps = 10,
            opts = { sequence_parallel = true } }
    equal { what = "context 2 x tensor 2 sequence overlap, dropout", mesh = { context = 2, tensor = 2 }, steps = 10,
            make = dropped, dropout = true, opts = { sequence_parallel = true, sequence_overlap = true } }
    equal { what = "llama context 2 x tensor 2 sequence parallel", mesh = { context = 2, tensor = 2 }, make = llama,
            policy = "policies.llama", steps = 10, opts = { sequence_parallel = true } }
    equal { what = "all_to_all x tensor 2", mesh = { context = 2, tensor = 2 }, steps = 10,
            make = function() return pt.models.gpt2 { vocab = 64, seq = 16, dim = 16, heads = 8, layers = 2 }:to("float64") end,
            opts = { context = "all_to_all" } }
  end)

  test("context 2 composed with pipeline 2 (1F1B and GPipe) trains as serial AdamW", function()
    equal { what = "context 2 x pipeline 2", mesh = { context = 2, pipeline = 2 },
            opts = { schedule = "1f1b", microbatches = 2 }, steps = 10 }
    equal { what = "context 2 x pipeline 2 gpipe", mesh = { context = 2, pipeline = 2 },
            opts = { schedule = "gpipe", microbatches = 2 }, steps = 10 }
  end)

  test("context 4 with activation checkpointing trains as serial AdamW", function()
    equal { what = "context 4 recompute", mesh = { context = 4 }, opts = { recompute = "block" }, steps = 10 }
  end)
else
  test("context 2 with activation checkpointing and ZeRO-2 trains as serial AdamW", function()
    equal { what = "context 2 recompute", mesh = { context = 2 }, opts = { recompute = "block" }, steps = 10 }
    equal { what = "context 2 zero-2", mesh = { context = 2, zero = 0 }, opts = { zero = { stage = 2 } }, steps = 10 }
  end)
end

H.run()
