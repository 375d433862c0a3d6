-- Checkpoints of a pipelined GPT-2 saved and resumed under other layouts: driven by
-- test_pipeline_ckpt.py, which reads the LOSS lines rank 0 prints.
--   straight DIR LAYOUT STEPS SAVE_AT   trains STEPS steps, saving DIR (and DIR-full, a full
--                                       save) at step SAVE_AT, and prints every step's loss (the
--                                       uninterrupted run)
--   resume DIRS LAYOUT STEPS [SAVE_TO]  for each of the comma-separated DIRS, a fresh model
--                                       resumed from it (its newest tag) and trained to step
--                                       STEPS, printing the losses as LOSS <k> (k from 1), then
--                                       saved to SAVE_TO (the last one's). DIR@SAME_AS first
--                                       loads SAME_AS too and checks every parameter this rank
--                                       holds then equals DIR's bit for bit
--   mismatch DIR LAYOUT STEPS K=V...    a model of gpt's settings but K=V loads DIR's newest tag;
--                                       every rank prints (stderr) whether it loaded, how many of
--                                       its parameters changed, the optimizer's step count and the
--                                       error
-- LAYOUT: serial (1 process, pipeline 1 x data 1), pp2, pp2dp2, pp4, tp2, tp4, pp2tp2.
local pt = require "partrain"

local mode, dir, layout, steps = arg[1], arg[2], arg[3], tonumber(arg[4])
local gpt = { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 4 }
local BATCH = 8 -- the global batch: each data rank trains on its slice

local meshes = {
  serial = {}, pp2 = { pipeline = 2 }, pp2dp2 = { pipeline = 2 }, pp4 = { pipeline = 4 },
  tp2 = { tensor = 2 }, tp4 = { tensor = 4 }, pp2tp2 = { pipeline = 2, tensor = 2 },
}
local schedules = { pp2 = "gpipe", pp2dp2 = "1f1b", pp4 = "gpipe", pp2tp2 = "1f1b" }

-- The model at this layout, from the same seed as every other layout.
local function build()
  local mesh = pt.mesh(meshes[layout])
  pt.manual_seed(5)
  local opts = mesh:size("pipeline") > 1 and { schedule = schedules[layout], microbatches = 2 } or nil
  local model = pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh, opts)
  return model, mesh, pt.optim.adamw(model, { lr = 1e-2 })
end

-- One step on the step's batch (the same on every rank, drawn from a seed of its own); the
-- global mean loss on every rank.
local function step(model, mesh, opt, n, k)
  pt.manual_seed(1000 + n)
  local x, y = pt.randint(0, gpt.vocab, { BATCH, gpt.seq }), pt.randint(0, gpt.vocab, { BATCH, gpt.seq })
  local d, size = mesh:coord().data, mesh:size("data")
  local b = BATCH / size
  local loss = model:train_step(x:narrow(0, d * b, b), y:narrow(0, d * b, b)):detach():clone()
  if size > 1 then mesh:group("data"):all_reduce(loss, "mean") end
  opt:step()
  opt:zero_grad()
  if pt.dist.rank() == 0 then print(("LOSS %d %d %.10e"):format(k or 1, n, loss:item())) end
end

if mode == "straight" then
  local model, mesh, opt = build()
  local save_at = tonumber(arg[5])
  for n = 1, steps do
    step(model, mesh, opt, n)
    if n == save_at then
      pt.ckpt.save(dir, { model = model, optim = opt, step = n, user = { layout = layout } })
      -- And consolidated: each tensor whole, from tensor 0, data 0 of its stage.
      pt.ckpt.save(dir .. "-full", { model = model, optim = opt, step = n, user = { layout = layout }, full = true })
    end
  end
elseif mode == "resume" then
  -- A fresh model resumed from `entry` (DIR or DIR@SAME_AS), trained to `steps` as run k.
  local function resume(k, entry)
    local from, same_as = entry:match("^([^@]+)@?(.*)$")
    local model, mesh, opt = build()
    if same_as ~= "" then
      pt.ckpt.load(same_as, { model = model, optim = opt })
      local before = {}
      for name, t in pairs(model:state_dict()) do before[name] = t:clone() end
      pt.ckpt.load(from, { model = model, optim = opt })
      local differ = 0
      for name, t in pairs(model:state_dict()) do
        if not t:equal(before[name]) then differ = differ + 1 end
      end
      -- stderr: under the launcher every rank's stderr shows, only rank 0's stdout.
      io.stderr:write(("SAME rank %d: %d of this rank's parameters differ\n"):format(pt.dist.rank(), differ))
    end
    local loaded = pt.ckpt.resume(from, { model = model, optim = opt })
    assert(loaded, "no checkpoint in " .. from)
    if pt.dist.rank() == 0 then
      print(("RESUMED %d step %d saved by %s"):format(k, loaded.step, tostring(loaded.user.layout)))
    end
    for n = loaded.step + 1, steps do step(model, mesh, opt, n, k) end
    return model, opt
  end
  local k, model, opt = 0, nil, nil
  for entry in dir:gmatch("[^,]+") do
    k = k + 1
    model, opt = resume(k, entry)
  end
  if arg[5] then pt.ckpt.save(arg[5], { model = model, optim = opt, step = steps, user = { layout = layout } }) end
elseif mode == "mismatch" then
  for i = 5, #arg do
    local k, v = arg[i]:match("^([%w_]+)=(.*)$")
    gpt[k] = tonumber(v) or v
  end
  local model, _, opt = build()
  local before = {}
  for name, t in pairs(model:state_dict()) do before[name] = t:clone() end
  local ok, err = pcall(pt.ckpt.load, dir, { model = model, optim = opt })
  local changed = 0
  for name, t in pairs(model:state_dict()) do
    if not t:equal(before[name]) then changed = changed + 1 end
  end
  io.stderr:write(("MISMATCH rank %d: %s; %d parameters changed; optimizer steps %d; %s\n"):format(
    pt.dist.rank(), ok and "loaded" or "refused", changed, opt:steps(), ok and "" or tostring(err)))
else
  error("unknown mode " .. tostring(mode))
end
