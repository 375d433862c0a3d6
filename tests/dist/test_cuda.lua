-- On a GPU (tests/dist/test_cuda.sh runs it there, and skips without one): data parallelism and
-- tensor x data parallelism and ZeRO-3 with every rank on the same CUDA device (Gloo over CUDA tensors)
-- train as serial training does, in float32 (losses and parameters within 1e-5, relative to
-- max(|x|, 1)) and float64 (1e-10); a checkpoint saved from the device reloads bit for bit; the
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
  -- The global batch (the same on every rank) and this rank's data slice of it.
  local function batches(mesh, make_batch)
    local x, y = make_batch()
    mesh:group("world"):broadcast(x, 0); mesh:group("world"):broadcast(y, 0)
    local d, n = mesh:coord().data, mesh:size("data")
    local b = x.shape[1] / n
    return x, y, x:narrow(0, d * b, b), y:narrow(0, d * b, b)
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
