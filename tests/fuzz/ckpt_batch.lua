-- The partrain side of the checkpoint and safetensors fuzz drivers (fuzz_ckpt.py,
-- fuzz_safetensors.py): makes the pristine inputs, then runs many damaged cases in one process,
-- each under pcall, appending one JSON line a case to a results file as it finishes (so that a
-- driver can restart after the case that killed the process).
--
--   partrain --nproc-per-node 2 ckpt_batch.lua make WORK          pristine checkpoints and files
--   partrain ckpt_batch.lua ckpt WORK LIST RESULTS                 damaged checkpoint folders
--   partrain ckpt_batch.lua staged WORK LIST RESULTS               the same, of a pipeline-2 save
--   partrain ckpt_batch.lua safetensors WORK LIST RESULTS          malformed .safetensors files
--   partrain ckpt_batch.lua safetensors_moe WORK LIST RESULTS      the same, of a Mixtral's (experts)
--
-- LIST holds "<index>\t<path>" lines. A checkpoint case is a folder holding step-00000002,
-- step-00000004 and newest, damaged; a safetensors case is one file.
local pt = require "partrain"

local mode, work, list, results = ...
pt.set_threads(1)

local function setup(seed, tensor)
  pt.manual_seed(seed)
  local mesh = pt.mesh { tensor = tensor or 1 }
  local model = pt.models.gpt2 { vocab = 255, seq = 8, dim = 8, heads = 2, layers = 1 }
  model = pt.parallelize(model, nil, mesh)
  -- A small corpus (the driver writes it): a data position is restored by reshuffling it.
  local data = pt.data.text { path = work .. "/corpus.txt", seq = 8, batch = 4, seed = 7, mesh = mesh }
  local optim = pt.optim.adamw(model, { lr = 3e-3, schedule = { kind = "cosine", warmup = 1, total = 10 } })
  return { model = model, optim = optim, data = data }
end

-- A GPT-2 of two blocks at `pipeline` (the pipelined checkpoints' model; 1: one process).
local function setup_staged(seed, pipeline)
  pt.manual_seed(seed)
  local mesh = pt.mesh { pipeline = pipeline }
  local model = pt.models.gpt2 { vocab = 255, seq = 8, dim = 8, heads = 2, layers = 2 }
  model = pt.parallelize(model, "policies.gpt2", mesh, pipeline > 1 and { microbatches = 2 } or nil)
  local data = pt.data.text { path = work .. "/corpus.txt", seq = 8, batch = 4, seed = 7, mesh = mesh }
  local optim = pt.optim.adamw(model, { lr = 3e-3, schedule = { kind = "cosine", warmup = 1, total = 10 } })
  return { model = model, optim = optim, data = data }
end

-- A Mixtral (LLaMA with experts) of two blocks: Hugging Face stores its experts one tensor an
-- expert, partrain stacked.
local function moe_model(seed)
  pt.manual_seed(seed)
  return pt.models.llama { vocab = 32, seq = 8, dim = 8, heads = 2, kv_heads = 1, layers = 2, hidden = 8, experts = 4,
                           top_k = 2 }
end

local function staged_step(s)
  local x, y = s.data:next()
  s.model:train_step(x, y)
  s.optim:step()
  s.optim:zero_grad()
end

local function train_step(s)
  local x, y = s.data:next()
  local loss = pt.loss_fn(s.model)(s.model(x), y)
  s.optim:zero_grad()
  loss:backward()
  s.optim:step()
end

local function save(dir, s, step, tag)
  pt.ckpt.save(dir, { model = s.model, optim = s.optim, data = s.data, step = step, tag = tag,
                      user = { note = "step " .. step } })
end

if mode == "make" then
  -- At tensor 2: two tags (split and fused pieces in two data files), a decoy of another seed,
  -- and the weights of two seeds as .safetensors.
  local s = setup(1, 2)
  for step = 1, 4 do
    train_step(s)
    if step % 2 == 0 then save(work .. "/pristine", s, step) end
  end
  local d = setup(2, 2)
  for step = 1, 3 do train_step(d) end
  save(work .. "/decoy", d, 3)
  pt.ckpt.export_safetensors(s.model, work .. "/base.safetensors")
  pt.ckpt.export_safetensors(d.model, work .. "/decoy.safetensors")
  pt.ckpt.export_safetensors(moe_model(1), work .. "/base_moe.safetensors")
  pt.ckpt.export_safetensors(moe_model(2), work .. "/decoy_moe.safetensors")
  -- At pipeline 2: the same two tags, each stage writing its own data file, and a decoy.
  s = setup_staged(1, 2)
  for step = 1, 4 do
    staged_step(s)
    if step % 2 == 0 then save(work .. "/staged", s, step) end
  end
  d = setup_staged(2, 2)
  for step = 1, 3 do staged_step(d) end
  save(work .. "/staged-decoy", d, 3)
  return
end

local function read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local bytes = f:read("*a")
  f:close()
  return bytes
end

local R = dofile(debug.getinfo(1, "S").source:sub(2):match("^(.*/)") .. "results.lua")
local record = R.open(results)
-- Set up: the driver treats a process that dies before this line as broken, not as a case.
local function ready() record({ ready = true }) end

local cases = {}
for line in io.lines(list) do
  local index, path = line:match("^(%d+)\t(.*)$")
  cases[#cases + 1] = { index = tonumber(index), path = path }
end
local scratch = work .. "/scratch-" .. cases[1].index
local serial = 0

if mode == "ckpt" or mode == "staged" then
  -- A pipelined checkpoint loads into one process: tensors are found by logical name.
  local s = mode == "ckpt" and setup(9) or setup_staged(9, 1)
  local pristine = work .. (mode == "ckpt" and "/pristine" or "/staged")
  local decoy = work .. (mode == "ckpt" and "/decoy" or "/staged-decoy")
  -- A state as bytes: saved again under one tag, its manifest and data file.
  local function state_bytes(loaded)
    serial = serial + 1
    local dir = ("%s/%d"):format(scratch, serial)
    save(dir, s, loaded.step, "x")
    return (read(dir .. "/x/manifest.bin") or "?") .. (read(dir .. "/x/rank-00000.bin") or "?")
  end
  local want = {}
  for _, tag in ipairs { "step-00000002", "step-00000004" } do
    want[tag] = state_bytes(pt.ckpt.load(pristine, tag, s))
  end
  local decoy_bytes = state_bytes(pt.ckpt.load(decoy, s))
  assert(decoy_bytes ~= want["step-00000004"], "the decoy must differ from what it hides")
  ready()
  for _, case in ipairs(cases) do
    local r = { index = case.index }
    local okv, good, problems = pcall(pt.ckpt.verify, case.path)
    r.verify_error = not okv and tostring(good) or nil
    r.verify = okv and good or false
    r.verify_problems = okv and table.concat(problems, "\n") or ""
    for _, tag in ipairs { "step-00000002", "step-00000004" } do
      local okt, goodt, p = pcall(pt.ckpt.verify, case.path .. "/" .. tag)
      r["verify_" .. tag] = okt and goodt or false
      r["verify_" .. tag .. "_problems"] = okt and table.concat(p, "\n") or tostring(goodt)
    end
    -- The decoy first, so that a load that silently does nothing shows.
    pt.ckpt.load(decoy, s)
    local okl, loaded = pcall(pt.ckpt.load, case.path, "step-00000004", s)
    if okl then
      r.load = "ok"
      r.load_match = state_bytes(loaded) == want["step-00000004"]
    else
      r.load = "error"
      r.load_error = tostring(loaded)
      r.load_unchanged = state_bytes({ step = 3 }) == decoy_bytes  -- a failed load changes nothing
    end
    pt.ckpt.load(decoy, s)
    R.resume(r, case.path, s, want, state_bytes)
    record(r)
  end
elseif mode == "safetensors" or mode == "safetensors_moe" then
  local moe = mode == "safetensors_moe"
  local m = moe and moe_model(9) or setup(9).model
  local decoy = work .. (moe and "/decoy_moe.safetensors" or "/decoy.safetensors")
  -- A state as bytes: the model exported again.
  local function weights()
    serial = serial + 1
    local path = ("%s-%d.safetensors"):format(scratch, serial)
    pt.ckpt.export_safetensors(m, path)
    local bytes = read(path)
    os.remove(path)
    return bytes
  end
  pt.ckpt.import_safetensors(m, decoy)
  local decoy_bytes = weights()
  ready()
  for _, case in ipairs(cases) do
    local r = { index = case.index }
    pt.ckpt.import_safetensors(m, decoy)
    local ok, err = pcall(pt.ckpt.import_safetensors, m, case.path)
    if ok then
      r.import = "ok"
      serial = serial + 1
      r.export = ("%s-%d.safetensors"):format(scratch, serial)
      pt.ckpt.export_safetensors(m, r.export)
    else
      r.import = "error"
      r.error = tostring(err)
      r.unchanged = weights() == decoy_bytes
    end
    record(r)
  end
else
  error("usage: ckpt_batch.lua make|ckpt|staged|safetensors|safetensors_moe WORK [LIST RESULTS]")
end
out:close()
