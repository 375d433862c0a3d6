-- Zero-bubble pipelines train exactly as serial training: ZB-H1, ZB-H2 and ZB-V (backward split in
-- B and W, V placement) over 4 ranks at pipeline 4 (GPT-2, and LLaMA under ZB-V), pipeline 2 x
-- data 2 under ZeRO-2, pipeline 2 x tensor 2, and with every block recomputed (1F1B too); 30 AdamW steps in float64 with clipping by a global
-- norm far below the gradients' (so every update depends on the whole model's norm): the loss
-- every step and every logical parameter at the end within 1e-9 relative to max(|x|, 1), every
-- serial parameter held by some stage. GPT-2 ties its embedding to its head: under ZB-V both
-- live on rank 0 (stage 0 and the last stage), under ZB-H on the first and last ranks.
--   partrain --nproc-per-node 4 --threads 1 tests/dist/test_zb.lua
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, near, ok, raises = H.test, H.near, H.ok, H.raises

local TOL, STEPS, BATCH = 1e-9, 30, 8
local gpt = { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 8 }

local function build(family)
  if family == "llama" then
    return pt.models.llama { vocab = gpt.vocab, seq = gpt.seq, dim = gpt.dim, heads = 4, kv_heads = 2, layers = gpt.layers }
  end
  return pt.models.gpt2(gpt)
end

-- Trains serially and through the pipeline from the same seed and data; compares.
local function equal_to_serial(what, mesh, opts, family)
  local policy = family == "llama" and "policies.llama" or "policies.gpt2"
  pt.manual_seed(5)
  local serial = build(family):to("float64")
  pt.manual_seed(5)
  local model = pt.parallelize(pt.deferred(function() return build(family):to("float64") end), policy, mesh, opts)
  local optim = { lr = 1e-2, clip_grad_norm = 0.05 }
  local so, po = pt.optim.adamw(serial, optim), pt.optim.adamw(model, optim)
  local d, n = mesh:coord().data, mesh:size("data")
  for step = 1, STEPS do
    local gx, gy = pt.randint(0, gpt.vocab, { BATCH, gpt.seq }), pt.randint(0, gpt.vocab, { BATCH, gpt.seq })
    mesh:group("world"):broadcast(gx, 0); mesh:group("world"):broadcast(gy, 0)
    local out = serial(gx)
    local ls = pt.nn.cross_entropy(out:reshape(-1, out.shape[#out.shape]), gy:reshape(-1))
    ls:backward()
    local b = BATCH / n
    local lp = model:train_step(gx:narrow(0, d * b, b), gy:narrow(0, d * b, b))
    near(lp, ls, TOL, ("%s: loss at step %d"):format(what, step))
    so:step(); po:step()
    so:zero_grad(); po:zero_grad()
  end
  local mine, want = model:full_state_dict(), serial:state_dict()
  local names = {}
  for name in pairs(want) do names[#names + 1] = name end
  table.sort(names)
  local flags = {}
  for i, name in ipairs(names) do
    flags[i] = mine[name] and 1 or 0
    if mine[name] then near(mine[name], want[name], TOL, ("%s: parameter %s"):format(what, name)) end
  end
  local held = pt.tensor(flags)
  mesh:group("pipeline"):all_reduce(held)
  for i, name in ipairs(names) do ok(held:select(0, i - 1):item() >= 1, ("%s: %s is held by no stage"):format(what, name)) end
  return model
end

local function chunks_of(schedule) return schedule == "zbv" and 2 or 1 end

test("ZB-H1, ZB-H2 and ZB-V over pipeline 4 equal serial training (float64, 30 steps, clipped)", function()
  local mesh = pt.mesh { pipeline = 4 }
  for _, schedule in ipairs { "zbh1", "zbh2", "zbv" } do
    local model = equal_to_serial(schedule .. " at pipeline 4", mesh,
      { schedule = schedule, microbatches = 8, chunks = chunks_of(schedule) })
    local info = model:pipeline()
    ok(info.layout == (schedule == "zbv" and "v" or "interleaved"), schedule .. ": layout " .. tostring(info.layout))
    if schedule == "zbv" then  -- rank 0 runs the first stage and the last
      local want = ({ [0] = { 0, 7 }, { 1, 6 }, { 2, 5 }, { 3, 4 } })[info.rank]
      ok(info.stages[1] == want[1] and info.stages[2] == want[2], ("zbv: rank %d runs stages %s"):format(info.rank,
        table.concat(info.stages, ",")))
    end
  end
end)

test("ZB-H1 and ZB-V over pipeline 2 x data 2 under ZeRO-2 equal serial training (float64)", function()
  local mesh = pt.mesh { pipeline = 2, data = 2, zero = 2 }
  for _, schedule in ipairs { "zbh1", "zbv" } do
    equal_to_serial(schedule .. " at pipeline 2 x data 2, ZeRO-2", mesh,
      { schedule = schedule, microbatches = 4, chunks = chunks_of(schedule), zero = { stage = 2 } })
  end
end)

test("ZB-H2 and ZB-V over pipeline 2 x tensor 2 equal serial training (GPT-2, float64)", function()
  local mesh = pt.mesh { pipeline = 2, tensor = 2 }
  equal_to_serial("zbh2 at pipeline 2 x tensor 2", mesh, { schedule = "zbh2", microbatches = 4 })
  equal_to_serial("zbv at pipeline 2 x tensor 2", mesh, { schedule = "zbv", microbatches = 4, chunks = 2 })
end)

test("ZB-V over pipeline 4 trains LLaMA (untied head, grouped-query heads) as serial training (float64)", function()
  equal_to_serial("zbv at pipeline 4 (LLaMA)", pt.mesh { pipeline = 4 }, { schedule = "zbv", microbatches = 4, chunks = 2 },
    "llama")
end)

test("1F1B, ZB-H1 and ZB-V with every block recomputed equal serial training (float64)", function()
  local mesh = pt.mesh { pipeline = 4 }
  for _, schedule in ipairs { "1f1b", "zbh1", "zbv" } do
    equal_to_serial(schedule .. " with recompute at pipeline 4", mesh,
      { schedule = schedule, microbatches = 4, chunks = chunks_of(schedule), recompute = "block" })
  end
end)

test("a schedule that splits backward is refused under ZeRO-3, naming it", function()
  local mesh = pt.mesh { pipeline = 2, data = 2, zero = 2 }
  pt.manual_seed(5)
  local model = build():to("float64")
  raises(function() pt.parallelize(model, "policies.gpt2", mesh, { schedule = "zbh1", microbatches = 4, zero = { stage = 3 } }) end,
    "tests/dist/test_zb.lua:109: parallelize: schedule 'zbh1' splits backward (W actions), which ZeRO-3 does not run yet")
end)

H.run()
