-- On a GPU (tests/dist/test_cuda.sh runs it there, and skips without one): data parallelism and
-- tensor x data parallelism and ZeRO-3 with every rank on the same CUDA device (Gloo over CUDA tensors)
-- train as serial training does, in float32 (losses and parameters within 1e-5, relative to
-- max(|x|, 1)) and float64 (1e-10); so does GPT-2 with each sequence split over the ranks (context
-- parallelism, ring and all_to_all) and a Mixtral-style LLaMA with its experts split over the
-- ranks (expert parallelism), and zero-bubble pipelines (ZB-V, ZB-H1), and in bfloat16 pt.cp.attention and that GPT-2 stay within
-- 1e-2 of float32 over the whole sequence; a checkpoint saved from the device reloads bit for bit; the
-- CUDA and CPU generators come back with a checkpoint (the draws after a load repeat the draws
-- after the save). --phase cpu_load and --phase compare are the single-process halves of the
-- device round trip (saved on CUDA, loaded and saved again on the CPU, both loaded on CUDA).
-- The script runs on any device: on the CPU it checks its own logic.
--   partrain --nproc-per-node 2 --device cuda:0 tests/dist/test_cuda.lua --dir DIR
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, near, eq, ok = H.test, H.near, H.eq, H.ok
local cfg = pt.args { dir = "", phase = "ranks", saved_on = "cuda:0" }  -- saved_on: the device of --phase ranks
assert(cfg.dir ~= "", "--dir: the folder for this test's checkpoints")

local device = pt.device()
local on_cuda = device:find("^cuda") ~= nil
local TOL = { float32 = 1e-5, float64 = 1e-10 }
local gpt = { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 1 }
local function make_mlp() return pt.models.mlp { sizes = { 12, 16, 5 } } end
local function gpt_batch() return pt.randint(0, gpt.vocab, { 4, gpt.seq }, { device = device }),
                                  pt.randint(0, gpt.vocab, { 4, gpt.seq }, { device = device }) end
local function mlp_batch(dtype)
  return function() return pt.randn(8, 12, { device = device }):to(dtype), pt.randint(0, 5, { 8 }, { device = device }) end
end

-- Every parameter of two models equal bit for bit.
local function same_bits(a, b, what)
  local sa, sb = a:state_dict(), b:state_dict()
  for name, t in pairs(sa) do
    ok(sb[name] ~= nil, what .. ": " .. name .. " missing")
    ok(t:cpu():equal(sb[name]:cpu()), what .. ": " .. name .. " differs")
  end
end

local function has_note(notes, text)
  for _, n in ipairs(notes or {}) do if n:find(text, 1, true) then return true end end
  return false
end

if cfg.phase == "ranks" then
  -- The global batch (the same on every rank) and this rank's data slice of it (and, over a
  -- context group, its chunks of each sequence).
  local function batches(mesh, make_batch)
    local x, y = make_batch()
    mesh:group("world"):broadcast(x, 0); mesh:group("world"):broadcast(y, 0)
    local d, n, g = mesh:coord().data, mesh:size("data"), mesh:group("context")
    local b = x.shape[1] / n
    local mx, my = x:narrow(0, d * b, b), y:narrow(0, d * b, b)
    if g:size() > 1 then mx, my = pt.cp.split(mx, g), pt.cp.split(my, g) end
    return x, y, mx, my
  end

  local function equal_to_serial(what, mesh, make, policy, make_batch, dtype, opts)
    local tol = TOL[dtype]
    pt.manual_seed(21)
    local serial = make():to(dtype)
    pt.manual_seed(21)
    local model = pt.parallelize(make():to(dtype), policy, mesh, opts)
    eq(model:parameters()[1].device, device, what .. ": the parallelized model is on the rank's device")
    local so = pt.optim.adamw(serial, { lr = 1e-3 })
    local po = pt.optim.adamw(model, { lr = 1e-3 })
    for step = 1, 5 do
      local gx, gy, x, y = batches(mesh, make_batch)
      local out = serial(gx)
      local ls = pt.nn.cross_entropy(out:reshape(-1, out.shape[#out.shape]), gy:reshape(-1))
      ls:backward()
      local lp = model:train_step(x, y)
      local global = lp:detach():clone()
      mesh:group("data"):all_reduce(global, "mean")
      near(global, ls, tol, ("%s (%s): loss at step %d"):format(what, dtype, step))
      so:step(); po:step()
      so:zero_grad(); po:zero_grad()
    end
    local full, want = model:full_state_dict(), serial:state_dict()
    for name, w in pairs(want) do near(full[name], w, tol, ("%s (%s): parameter %s"):format(what, dtype, name)) end
    return model, po
  end

  for _, dtype in ipairs { "float32", "float64" } do
    test("data parallel on " .. device .. " equals serial training (" .. dtype .. ")", function()
      equal_to_serial("mlp", pt.mesh {}, make_mlp, nil, mlp_batch(dtype), dtype)
    end)
    test("tensor x data parallel GPT-2 on " .. device .. " equals serial training (" .. dtype .. ")", function()
      equal_to_serial("gpt2", pt.mesh { tensor = pt.dist.world_size() }, function() return pt.models.gpt2(gpt) end,
        "policies.gpt2", gpt_batch, dtype)
    end)
    -- Zero-bubble pipelines: the split backward (B, then W from captured gradients) on the
    -- device's autograd threads, ZB-V's in-place turn, point-to-point over CUDA tensors.
    test("ZB-V and ZB-H1 pipelines of GPT-2 on " .. device .. " equal serial training (" .. dtype .. ")", function()
      local deep = { vocab = gpt.vocab, seq = gpt.seq, dim = gpt.dim, heads = gpt.heads, layers = 4 }
      for _, s in ipairs { { "zbv", 2 }, { "zbh1", 1 } } do
        local mesh = pt.mesh { pipeline = pt.dist.world_size() }
        pt.manual_seed(21)
        local serial = pt.models.gpt2(deep):to(dtype)
        pt.manual_seed(21)
        local model = pt.parallelize(pt.models.gpt2(deep):to(dtype), "policies.gpt2", mesh,
          { schedule = s[1], chunks = s[2], microbatches = 4 })
        local so, po = pt.optim.adamw(serial, { lr = 1e-3 }), pt.optim.adamw(model, { lr = 1e-3 })
        for step = 1, 5 do
          local x, y = gpt_batch()
          mesh:group("world"):broadcast(x, 0); mesh:group("world"):broadcast(y, 0)
          local out = serial(x)
          local ls = pt.nn.cross_entropy(out:reshape(-1, out.shape[#out.shape]), y:reshape(-1))
          ls:backward()
          near(model:train_step(x, y), ls, TOL[dtype], ("%s (%s): loss at step %d"):format(s[1], dtype, step))
          so:step(); po:step()
          so:zero_grad(); po:zero_grad()
        end
        local mine = model:state_dict()
        for name, w in pairs(serial:state_dict()) do
          if mine[name] then near(mine[name], w, TOL[dtype], ("%s (%s): parameter %s"):format(s[1], dtype, name)) end
        end
      end
    end)
    -- ZeRO-3: the units' storage allocated and freed on the device, gathered, reduce-scattered.
    test("ZeRO-3 GPT-2 on " .. device .. " equals serial training (" .. dtype .. ")", function()
      equal_to_serial("gpt2 zero-3", pt.mesh { zero = 0 }, function() return pt.models.gpt2(gpt) end,
        "policies.gpt2", gpt_batch, dtype, { zero = { stage = 3 } })
    end)
  end

  test("deferred models materialize on " .. device .. ", and models built after them land there too", function()
    local deferred = pt.deferred(function() return pt.models.gpt2(gpt) end)
    local model = pt.parallelize(deferred, "policies.gpt2", pt.mesh { tensor = pt.dist.world_size() })
    for _, p in ipairs(model:parameters()) do eq(p.device, device, "a materialized parameter") end
    eq(pt.nn.Linear(2, 2).weight.device, device, "a module built after pt.deferred")
  end)

  test("a checkpoint saved on " .. device .. " reloads bit for bit, and the generators with it", function()
    local model, opt = equal_to_serial("mlp", pt.mesh {}, make_mlp, nil, mlp_batch("float32"), "float32")
    pt.ckpt.save(cfg.dir, { model = model, optim = opt, step = 5 })
    local cpu_after = pt.randn(4)
    local dev_after = pt.randn(4, { device = device })
    pt.manual_seed(999)    -- the generators move on ...
    local loaded = pt.ckpt.load(cfg.dir, { model = model, optim = opt })
    ok(pt.randn(4):equal(cpu_after), "the CPU generator came back with the checkpoint")
    ok(pt.randn(4, { device = device }):cpu():equal(dev_after:cpu()),
       "the " .. device .. " generator came back with the checkpoint")
    ok(not has_note(loaded.notes, "generator"), "no generator note on the device that saved: " ..
       table.concat(loaded.notes, "; "))
    pt.manual_seed(3)
    local fresh = pt.parallelize(make_mlp(), nil, pt.mesh {})
    pt.ckpt.load(cfg.dir, { model = fresh })
    same_bits(fresh, model, "reloaded on " .. device)
  end)

  -- Context parallelism, last: its ring is the only user here of point-to-point exchanges over
  -- Gloo on the device. Each rank holds 2 of the 2 x ranks chunks of every sequence (seq 8: 4
  -- positions a rank at 2 ranks); on CUDA the ring's blocks are the plain formulas, accumulated in
  -- float32; all_to_all trades positions for heads around one attention.
  for _, dtype in ipairs { "float32", "float64" } do
    for _, mode in ipairs { "ring", "all_to_all" } do
      test(("context-parallel GPT-2 (%s) on %s equals serial training (%s)"):format(mode, device, dtype), function()
        equal_to_serial("gpt2 context " .. mode, pt.mesh { context = pt.dist.world_size() },
          function() return pt.models.gpt2(gpt) end, "policies.gpt2", gpt_batch, dtype, { context = mode })
      end)
    end
  end

  -- Experts: a Mixtral-style LLaMA with its 4 experts split over the ranks (tokens by the
  -- all-to-all of unequal row counts over Gloo on the device, the experts as grouped matmuls:
  -- at::_grouped_mm in float32 where CUDA takes it, the padded bmm in float64).
  for _, dtype in ipairs { "float32", "float64" } do
    test(("expert-parallel Mixtral-style LLaMA on %s equals serial training (%s)"):format(device, dtype), function()
      equal_to_serial("llama experts", pt.mesh { expert = pt.dist.world_size() },
        function() return pt.models.llama { vocab = gpt.vocab, seq = gpt.seq, dim = 16, heads = 4, layers = 1,
                                            hidden = 24, experts = 4, top_k = 2 } end,
        "policies.llama", gpt_batch, dtype)
    end)
  end

  -- bfloat16 against float32 over the whole sequence, on the same (bfloat16) values: the output
  -- and gradients within BF16 in ||got - want|| / ||want|| (bfloat16 keeps 8 bits of mantissa,
  -- 2e-3 relative a rounding; the blocks accumulate in float32; up to 5e-3 measured on the CPU).
  local BF16 = 1e-2
  local function within(got, want, what)
    local g, w = got:detach():double(), want:detach():double()
    local rel = (g - w):norm():item() / w:norm():item()
    ok(rel <= BF16, ("%s: relative difference %.2e exceeds %.0e"):format(what, rel, BF16))
  end
  test("pt.cp.attention in bfloat16 on " .. device .. " is within 1e-2 of float32 attention over the whole sequence",
       function()
    local g = pt.mesh({ context = pt.dist.world_size() }):group("context")
    local function draw(heads)  -- (2, heads, 8 x ranks, 16), the same on every rank, bfloat16's values
      local t = pt.randn({ 2, heads, 8 * pt.dist.world_size(), 16 }, { device = device })
      pt.dist.world():broadcast(t, 0)
      return t:bfloat16():float()
    end
    local q, k, v, w = draw(4), draw(2), draw(2), draw(4)
    local qa, ka, va = q:clone():requires_grad_(), k:clone():requires_grad_(), v:clone():requires_grad_()
    local whole = pt.nn.scaled_dot_product_attention(qa, ka, va, { causal = true })
    local serial_loss = (whole * w):sum()
    serial_loss:backward()
    for _, mode in ipairs { "ring", "all_to_all" } do
      local function mine(x) return pt.cp.split(x, g, 2):bfloat16():detach():requires_grad_() end
      local qr, kr, vr = mine(q), mine(k), mine(v)
      local out = pt.cp.attention(qr, kr, vr, { group = g, mode = mode })
      eq(out:type(), "bfloat16", mode .. ": the output's dtype")
      local loss = (out:float() * pt.cp.split(w, g, 2)):sum()
      loss:backward()
      within(out, pt.cp.split(whole, g, 2), mode .. " in bfloat16: output")
      within(qr.grad, pt.cp.split(qa.grad, g, 2), mode .. " in bfloat16: dq")
      within(kr.grad, pt.cp.split(ka.grad, g, 2), mode .. " in bfloat16: dk")
      within(vr.grad, pt.cp.split(va.grad, g, 2), mode .. " in bfloat16: dv")
    end
  end)

  -- GPT-2 in bfloat16 (SGD on float32 masters) beside the same weights in float32: losses and
  -- parameters within 1e-2 relative to max(|x|, 1) over 5 steps (2e-4 and 1.4e-3 measured on the CPU).
  test("context-parallel GPT-2 in bfloat16 on " .. device .. " trains within 1e-2 of serial float32", function()
    local mesh = pt.mesh { context = pt.dist.world_size() }
    local bf16 = { vocab = gpt.vocab, seq = gpt.seq, dim = gpt.dim, heads = gpt.heads, layers = gpt.layers,
                   dtype = "bfloat16" }
    pt.manual_seed(21)
    local serial = pt.models.gpt2(bf16):to("float32")  -- the same (bfloat16) weights, computed in float32
    pt.manual_seed(21)
    local model = pt.parallelize(pt.models.gpt2(bf16), "policies.gpt2", mesh)
    eq(model:parameters()[1]:type(), "bfloat16", "the context-parallel model's parameters")
    local so, po = pt.optim.sgd(serial, { lr = 0.1 }), pt.optim.sgd(model, { lr = 0.1 })  -- float32 masters
    for step = 1, 5 do
      local gx, gy, x, y = batches(mesh, gpt_batch)
      local out = serial(gx)
      local ls = pt.nn.cross_entropy(out:reshape(-1, out.shape[#out.shape]), gy:reshape(-1))
      ls:backward()
      local lp = model:train_step(x, y)
      near(lp, ls, BF16, ("gpt2 context in bfloat16: loss at step %d"):format(step))
      so:step(); po:step()
      so:zero_grad(); po:zero_grad()
    end
    local full, want = model:full_state_dict(), serial:state_dict()
    for name, w in pairs(want) do near(full[name], w, BF16, "gpt2 context in bfloat16: parameter " .. name) end
  end)
elseif cfg.phase == "cpu_load" then  -- one process on the CPU: load the device's checkpoint, save it again
  test("a checkpoint saved on CUDA loads on the CPU (its CUDA generator states ignored, with a note)", function()
    eq(device, "cpu", "this phase runs with --device cpu")
    local model = make_mlp()
    local loaded = pt.ckpt.load(cfg.dir .. "/gpu", { model = model })
    if cfg.saved_on:find("^cuda") then
      ok(has_note(loaded.notes, "holds CUDA generator states; this run computes on cpu: they are ignored"),
         "the note about CUDA generator states: " .. table.concat(loaded.notes, "; "))
    end
    pt.ckpt.save(cfg.dir .. "/cpu", { model = model, step = 5 })
  end)
elseif cfg.phase == "compare" then  -- one process on CUDA: both checkpoints load to the same bits
  test("saved on CUDA, through the CPU and back: the same bits", function()
    local a, b = make_mlp(), make_mlp()
    pt.ckpt.load(cfg.dir .. "/gpu", { model = a })
    local loaded = pt.ckpt.load(cfg.dir .. "/cpu", { model = b })
    eq(a:parameters()[1].device, device, "loaded onto the model's device")
    same_bits(a, b, "CUDA -> CPU -> CUDA")
    if on_cuda then
      ok(has_note(loaded.notes, "holds no CUDA generator state"), "the note for a CPU checkpoint on CUDA: " ..
         table.concat(loaded.notes, "; "))
    end
  end)
else
  error("--phase must be ranks, cpu_load or compare, got '" .. cfg.phase .. "'")
end

H.run()
