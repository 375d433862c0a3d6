-- The partrain side of fuzz_ckpt_zero.py: checkpoints of a bfloat16 GPT-2 saved at pipeline 2 x
-- data 2 under ZeRO-2 (float32 masters and moments, each rank's shard gathered at save), damaged
-- by the driver, then verified, loaded and resumed here, case after case in one job, with one
-- JSON line a case (tests/fuzz/results.lua) as ckpt_batch.lua writes them.
--
--   partrain --nproc-per-node 4 zero_ckpt_batch.lua make WORK            pristine and decoy
--   partrain zero_ckpt_batch.lua check WORK LIST RESULTS serial           load into one process
--   partrain --nproc-per-node 4 zero_ckpt_batch.lua check WORK LIST RESULTS zero
--                                                                         load at the saving layout
--
-- LIST holds "<index>\t<path>" lines; a case is a folder holding step-00000002, step-00000004
-- and newest. At several ranks every rank loads each case; whether they all succeeded or all
-- failed is recorded beside the rank 0's results.
local pt = require "partrain"

local mode, work, list, results, layout = ...
pt.set_threads(1)
local gpt = { vocab = 64, seq = 8, dim = 16, heads = 2, layers = 2, dtype = "bfloat16" }
local BATCH = 4

local function setup(seed, where)
  pt.manual_seed(seed)
  local zero = where ~= "serial"
  local mesh = zero and pt.mesh { pipeline = 2, zero = 2 } or pt.mesh {}
  local options = zero and { schedule = "1f1b", microbatches = 2, zero = { stage = 2 } } or nil
  local model = pt.parallelize(pt.models.gpt2(gpt), zero and "policies.gpt2" or nil, mesh, options)
  return { model = model, optim = pt.optim.adamw(model, { lr = 1e-2 }), mesh = mesh }
end

-- One step on the step's batch, each data rank its slice.
local function step(s, n)
  pt.manual_seed(100 + n)
  local x, y = pt.randint(0, gpt.vocab, { BATCH, gpt.seq }), pt.randint(0, gpt.vocab, { BATCH, gpt.seq })
  local d, b = s.mesh:coord().data, BATCH / s.mesh:size("data")
  s.model:train_step(x:narrow(0, d * b, b), y:narrow(0, d * b, b))
  s.optim:step()
  s.optim:zero_grad()
end

local function save(dir, s, n, tag)
  pt.ckpt.save(dir, { model = s.model, optim = s.optim, step = n, tag = tag, user = { note = "step " .. n } })
end

if mode == "make" then
  local s = setup(1, "zero")
  for n = 1, 4 do
    step(s, n)
    if n % 2 == 0 then save(work .. "/pristine", s, n) end
  end
  local d = setup(2, "zero")
  for n = 1, 3 do step(d, n) end
  save(work .. "/decoy", d, 3)
  return
end

local function read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local bytes = f:read("*a")
  f:close()
  return bytes
end

local world, rank = pt.dist.world_size(), pt.dist.rank()
local R = dofile(debug.getinfo(1, "S").source:sub(2):match("^(.*/)") .. "results.lua")
local record = rank == 0 and R.open(results)
  or function() end

local cases = {}
for line in io.lines(list) do
  local index, path = line:match("^(%d+)\t(.*)$")
  cases[#cases + 1] = { index = tonumber(index), path = path }
end
local scratch, serial = ("%s/scratch-%s-%d"):format(work, layout, cases[1].index), 0
local s = setup(9, layout)

-- The state as bytes: saved again under one tag, its manifest and every data file (rank 0's
-- view; every rank saves).
local function state_bytes(loaded)
  serial = serial + 1
  local dir = ("%s/%d"):format(scratch, serial)
  save(dir, s, loaded.step, "x")
  local parts = { read(dir .. "/x/manifest.bin") or "?" }
  for r = 0, world - 1 do parts[#parts + 1] = read(("%s/x/rank-%05d.bin"):format(dir, r)) or "" end
  return table.concat(parts)
end

-- Whether every rank got `ok` alike.
local function agree(ok)
  if world == 1 then return true end
  local t = pt.tensor({ ok and 1 or 0 })
  pt.dist.world():all_reduce(t)
  return t:item() == 0 or t:item() == world
end

local pristine, decoy = work .. "/pristine", work .. "/decoy"
local want = {}
for _, tag in ipairs { "step-00000002", "step-00000004" } do want[tag] = state_bytes(pt.ckpt.load(pristine, tag, s)) end
local decoy_bytes = state_bytes(pt.ckpt.load(decoy, s))
assert(decoy_bytes ~= want["step-00000004"], "the decoy must differ from what it hides")
record({ ready = true })
for _, case in ipairs(cases) do
  local r = { index = case.index }
  local okv, good, problems = pcall(pt.ckpt.verify, case.path)
  r.verify = okv and good or false
  r.verify_problems = okv and table.concat(problems, "\n") or tostring(good)
  for _, tag in ipairs { "step-00000002", "step-00000004" } do
    local okt, goodt, p = pcall(pt.ckpt.verify, case.path .. "/" .. tag)
    r["verify_" .. tag] = okt and goodt or false
    r["verify_" .. tag .. "_problems"] = okt and table.concat(p, "\n") or tostring(goodt)
  end
  pt.ckpt.load(decoy, s)  -- so that a load that silently does nothing shows
  local okl, loaded = pcall(pt.ckpt.load, case.path, "step-00000004", s)
  r.load_agree = agree(okl)
  if okl then
    r.load = "ok"
    r.load_match = state_bytes(loaded) == want["step-00000004"]
  else
    r.load = "error"
    r.load_error = tostring(loaded)
    r.load_unchanged = state_bytes({ step = 3 }) == decoy_bytes  -- a failed load changes nothing
  end
  pt.ckpt.load(decoy, s)
  local okr, resumed = R.resume(r, case.path, s, want, state_bytes)
  r.resume_agree = agree(okr and resumed ~= nil)
  record(r)
end
