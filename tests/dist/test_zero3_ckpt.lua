-- Checkpoints under ZeRO-3 (parameters sharded, gathered a unit at a time): a 3-block GPT-2 in
-- float64 with AdamW and clipping, fed by a text loader, trains 3 steps, saves (parameters,
-- optimizer state, data position), and the run that loads it trains 3 more, equal to one serial
-- run of 6 steps: the loss every step and every logical parameter at the end within 1e-9
-- relative (to max(|x|, 1)). A ZeRO-3 data-4 checkpoint loads without ZeRO, under ZeRO-1 and
-- ZeRO-2, under ZeRO-3 at zero groups of 2, at tensor 2 and at pipeline 2 (1F1B); ZeRO-2 and
-- plain checkpoints load under ZeRO-3; ZeRO-3 saves at tensor 2, at pipeline 2 and consolidated
-- (full = true) load elsewhere; the run that saved goes on as if it had not. A ZeRO-3 save holds
-- one unit gathered at a time (its peak of tensor bytes is under half of the model gathered
-- whole), and safetensors export and import gather the model for their span. In bfloat16 (float32
-- masters, saved in float32) ZeRO-3 checkpoints at zero groups of 4 and 2 resume under ZeRO-2 and
-- ZeRO-3 at either group size bit for bit as the run that saved them goes on.
--   partrain --nproc-per-node 4 --threads 1 tests/dist/test_zero3_ckpt.lua
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, near, eq, ok = H.test, H.near, H.eq, H.ok

local GPT = { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 3 }
local BATCH, TOL = 8, 1e-9
local OPTIM = { lr = 1e-2, weight_decay = 0.1, clip_grad_norm = 0.5 }
local PIPE = { schedule = "1f1b", microbatches = 2 }

-- One folder every rank names alike, beside the system's temporary files.
local scratch = os.tmpname()
os.remove(scratch)
local DIR = scratch:match("^(.*)/") .. "/partrain-test-zero3-ckpt-" .. (os.getenv("MASTER_PORT") or "0")

-- Tokens from the text's bytes: each byte modulo the vocabulary.
local lut = {}
for b = 0, 255 do lut[b + 1] = b % GPT.vocab end
local LUT = pt.tensor(lut, { dtype = "int64" })
local function tokens(t) return LUT:index_select(0, t:reshape(-1)):reshape(t.shape[1], t.shape[2]) end

-- The global batch of 8 (mesh = nil), or this rank's data-parallel slice of it.
local function loader(mesh)
  return pt.data.text { path = "data/kjv.txt", seq = GPT.seq, batch = BATCH, seed = 3, mesh = mesh }
end

local function gpt2() return pt.models.gpt2(GPT):to("float64") end

-- The serial run of `steps` steps: each step's loss and the parameters at the end.
local serial_cache = {}
local function serial(steps)
  if serial_cache[steps] then return serial_cache[steps].losses, serial_cache[steps].params end
  pt.manual_seed(11)
  local model = gpt2()
  local opt, data = pt.optim.adamw(model, OPTIM), loader(nil)
  local losses = {}
  for n = 1, steps do
    local x, y = data:next()
    local out = model(tokens(x))
    local loss = pt.nn.cross_entropy(out:reshape(-1, GPT.vocab), tokens(y):reshape(-1))
    opt:zero_grad()
    loss:backward()
    opt:step()
    losses[n] = loss:item()
  end
  serial_cache[steps] = { losses = losses, params = model:state_dict() }
  return losses, serial_cache[steps].params
end

-- A parallelized run: the model (from seed `seed`), its optimizer and its loader.
local function run(what, mesh_opts, opts, seed, model)
  local mesh = pt.mesh(mesh_opts)
  pt.manual_seed(seed or 11)
  local m = pt.parallelize((model or gpt2)(), "policies.gpt2", mesh, opts)
  return { what = what, mesh = mesh, model = m, opt = pt.optim.adamw(m, OPTIM), data = loader(mesh), losses = {} }
end

local function train(r, from, to)
  for n = from, to do
    local x, y = r.data:next()
    local loss = r.model:train_step(tokens(x), tokens(y)):detach():clone()
    r.mesh:group("data"):all_reduce(loss, "mean")
    r.opt:step()
    r.opt:zero_grad()
    r.losses[n] = loss:item()
  end
end

-- Steps from..to of `r` and its parameters at the end against the serial run of `to` steps.
local function same_as_serial(r, from, to)
  local losses, params = serial(to)
  for n = from, to do near(r.losses[n], losses[n], TOL, ("%s: loss at step %d"):format(r.what, n)) end
  local held = 0
  for name, t in pairs(r.model:full_state_dict()) do
    near(t, params[name], TOL, ("%s: parameter %s after step %d"):format(r.what, name, to))
    held = held + 1
  end
  ok(held > 0, r.what .. ": holds parameters")
end

-- Trains 3 steps under `c.save`, saves under `tag` (c.full: consolidated) and checks the saving
-- run goes on as the serial run does.
local function save_after_3(tag, what, mesh_opts, opts, full)
  local r = run(what, mesh_opts, opts)
  train(r, 1, 3)
  same_as_serial(r, 1, 3)
  pt.ckpt.save(DIR, { model = r.model, optim = r.opt, data = r.data, step = 3, tag = tag, overwrite = true,
                      full = full })
  train(r, 4, 6)
  same_as_serial(r, 4, 6)
end

-- Loads `tag` into a fresh run (other initial weights, its loader at the start), which must
-- then train steps 4..6 as the serial run does.
local function resume_into(tag, what, mesh_opts, opts)
  local r = run(tag .. " -> " .. what, mesh_opts, opts, 99)
  local loaded = pt.ckpt.load(DIR, tag, { model = r.model, optim = r.opt, data = r.data })
  eq(loaded.step, 3, r.what .. ": the step")
  eq(r.opt:steps(), 3, r.what .. ": the optimizer's step count")
  eq(r.data:samples_seen(), 3 * BATCH, r.what .. ": the data position")
  train(r, 4, 6)
  same_as_serial(r, 4, 6)
end

local ZERO3 = { zero = { stage = 3 } }
local ZERO3_PIPE = { zero = { stage = 3 }, schedule = PIPE.schedule, microbatches = PIPE.microbatches }

test("a ZeRO-3 data-4 checkpoint resumes without ZeRO, under ZeRO-1/2, and under ZeRO-3 at other layouts", function()
  save_after_3("zero3", "zero-3 data 4", { zero = 0 }, ZERO3)
  resume_into("zero3", "plain data 4", {}, {})
  resume_into("zero3", "zero-1 data 4", { zero = 0 }, { zero = { stage = 1 } })
  resume_into("zero3", "zero-2 data 4", { zero = 0 }, { zero = { stage = 2 } })
  resume_into("zero3", "zero-3 data 4", { zero = 0 }, ZERO3)
  resume_into("zero3", "zero-3 groups of 2", { zero = 2 }, ZERO3)
  resume_into("zero3", "zero-3 tensor 2", { tensor = 2, zero = 0 }, ZERO3)
  resume_into("zero3", "zero-3 pipeline 2", { pipeline = 2, zero = 0 }, ZERO3_PIPE)
end)

test("ZeRO-2 and plain checkpoints resume under ZeRO-3", function()
  save_after_3("zero2", "zero-2 data 4", { zero = 0 }, { zero = { stage = 2 } })
  resume_into("zero2", "zero-3 data 4", { zero = 0 }, ZERO3)
  save_after_3("plain", "plain data 4", {}, {})
  resume_into("plain", "zero-3 groups of 2", { zero = 2 }, ZERO3)
  resume_into("plain", "zero-3 pipeline 2", { pipeline = 2, zero = 0 }, ZERO3_PIPE)
end)

test("ZeRO-3 saves at tensor 2, at pipeline 2 and consolidated (full) resume elsewhere", function()
  save_after_3("zero3-tp", "zero-3 tensor 2", { tensor = 2, zero = 0 }, ZERO3)
  resume_into("zero3-tp", "zero-3 data 4", { zero = 0 }, ZERO3)
  save_after_3("zero3-pp", "zero-3 pipeline 2", { pipeline = 2, zero = 0 }, ZERO3_PIPE)
  resume_into("zero3-pp", "plain data 4", {}, {})
  resume_into("zero3-pp", "zero-3 tensor 2", { tensor = 2, zero = 0 }, ZERO3)
  save_after_3("zero3-full", "zero-3 data 4, full", { zero = 0 }, ZERO3, true)
  resume_into("zero3-full", "zero-3 groups of 2", { zero = 2 }, ZERO3)
end)

-- bfloat16 parameters with float32 masters: the checkpoint holds the masters and the moments in
-- float32, so a run that loads it steps from the values the saving run steps from. Against the
-- saving run's own steps 4..6 (no serial float64 twin to compare a bf16 run with), bit for bit.
local function bf16() return pt.models.gpt2(GPT):to("bfloat16") end

test("a ZeRO-3 bf16 checkpoint resumes under ZeRO-2 and ZeRO-3 at other zero groups as the run goes on", function()
  local function saved(tag, what, mesh_opts)
    local a = run(what, mesh_opts, ZERO3, 11, bf16)
    train(a, 1, 3)
    pt.ckpt.save(DIR, { model = a.model, optim = a.opt, data = a.data, step = 3, tag = tag, overwrite = true })
    train(a, 4, 6)
    return a, a.model:full_state_dict()
  end
  local function resume(tag, a, want, what, mesh_opts, opts)
    local r = run(tag .. " -> " .. what, mesh_opts, opts, 99, bf16)
    local loaded = pt.ckpt.load(DIR, tag, { model = r.model, optim = r.opt, data = r.data })
    eq(loaded.step, 3, r.what .. ": the step")
    eq(r.data:samples_seen(), 3 * BATCH, r.what .. ": the data position")
    train(r, 4, 6)
    for n = 4, 6 do near(r.losses[n], a.losses[n], 0, ("%s: loss at step %d"):format(r.what, n)) end
    local held = 0
    for name, t in pairs(r.model:full_state_dict()) do
      eq(t.dtype, "bfloat16", r.what .. ": " .. name .. " stays bf16")
      near(t, want[name], 0, ("%s: parameter %s after step 6"):format(r.what, name))
      held = held + 1
    end
    ok(held > 0, r.what .. ": holds parameters")
    eq(r.opt:zero().stage, opts.zero.stage, r.what .. ": the zero stage")
  end
  local a, want = saved("zero3-bf16", "zero-3 bf16 data 4", { zero = 0 })
  resume("zero3-bf16", a, want, "zero-2 data 4", { zero = 0 }, { zero = { stage = 2 } })
  resume("zero3-bf16", a, want, "zero-3 data 4", { zero = 0 }, ZERO3)
  resume("zero3-bf16", a, want, "zero-3 groups of 2", { zero = 2 }, ZERO3)
  resume("zero3-bf16", a, want, "zero-2 groups of 2", { zero = 2 }, { zero = { stage = 2 } })
  a, want = saved("zero3-bf16-2", "zero-3 bf16 groups of 2", { zero = 2 })
  resume("zero3-bf16-2", a, want, "zero-3 groups of 2", { zero = 2 }, ZERO3)
  resume("zero3-bf16-2", a, want, "zero-3 data 4", { zero = 0 }, ZERO3)
  resume("zero3-bf16-2", a, want, "zero-2 data 4", { zero = 0 }, { zero = { stage = 2 } })
end)

-- A wider GPT-2 (6 blocks of 64) so that a unit's gathered bytes stand well above the save's
-- other tensors (each parameter's optimizer state, gathered one parameter at a time).
test("a ZeRO-3 save gathers one unit at a time: its peak is under half the model gathered whole", function()
  local wide = function() return pt.models.gpt2 { vocab = 64, seq = 8, dim = 64, heads = 4, layers = 6 }:to("float64") end
  local r = run("zero-3 wide", { zero = 0 }, ZERO3, 11, wide)
  train(r, 1, 1)
  local function peak_of(fn)
    local before = pt.memory().allocated
    pt.reset_peak_memory()
    fn()
    return pt.memory().allocated_peak - before
  end
  local whole = peak_of(function() r.model:gathered(function() end) end)
  local save = peak_of(function() pt.ckpt.save(DIR, { model = r.model, optim = r.opt, step = 1, tag = "wide",
                                                      overwrite = true }) end)
  local unit = 0
  for name, t in pairs(wide():state_dict()) do
    if name:find("^h%.0%.") then unit = unit + t:numel() * 8 end
  end
  if pt.dist.rank() == 0 then
    print(("zero-3 save: peak %d tensor bytes beside the shards; the model gathered whole %d, one block %d")
      :format(save, whole, unit))
  end
  -- (Between steps ZeRO-3 keeps 1 + prefetch freed block buffers for the next gathers: allocated
  -- before, they are not in the delta.)
  ok(whole >= 4 * unit, ("gathering the whole model holds at least its 6 blocks but the 2 kept (%d of %d)")
    :format(whole, 4 * unit))
  ok(save < whole / 2, ("the save's peak %d is under half the model gathered whole (%d)"):format(save, whole))
  -- The checkpoint holds the values: it resumes as the run goes on.
  local b = run("wide -> zero-3 groups of 2", { zero = 2 }, ZERO3, 99, wide)
  pt.ckpt.load(DIR, "wide", { model = b.model, optim = b.opt })
  local want = r.model:full_state_dict()
  for name, t in pairs(b.model:full_state_dict()) do near(t, want[name], 0, "wide: loaded parameter " .. name) end
end)

test("safetensors export and import under ZeRO-3 carry every parameter", function()
  local r = run("zero-3 export", { zero = 0 }, ZERO3)
  train(r, 1, 2)
  local path = DIR .. "/zero3.safetensors"
  pt.ckpt.export_safetensors(r.model, path)
  local want = r.model:full_state_dict()
  -- Imported without ZeRO (one process's model) and under ZeRO-3 at tensor 2.
  local plain = gpt2()
  pt.ckpt.import_safetensors(plain, path)
  for name, t in pairs(plain:state_dict()) do
    if want[name] then near(t, want[name], 0, "imported serially: " .. name) end
  end
  local b = run("import zero-3 tensor 2", { tensor = 2, zero = 0 }, ZERO3, 99)
  pt.ckpt.import_safetensors(b.model, path)
  local held = 0
  for name, t in pairs(b.model:full_state_dict()) do
    near(t, want[name], 0, "imported under zero-3 tensor 2: " .. name)
    held = held + 1
  end
  ok(held > 0, "the import holds parameters")
end)

local function clean()
  pt.dist.barrier()
  if pt.dist.rank() == 0 then os.execute("rm -rf '" .. DIR .. "'") end
end

clean()     -- a failed run's folder, kept for a look
H.run()
clean()
