-- Checkpoint throughput (run by bench/ckpt): saves and loads a GPT-2 with its AdamW state, and
-- prints, per repetition, the seconds and the bytes of the checkpoint's data files.
--   partrain [--nproc-per-node N] bench/ckpt.lua --dir DIR [--dim 512] [--layers 8] [--tensor N]
local pt = require "partrain"
local cfg = pt.args { dir = "", dim = 512, layers = 8, heads = 8, seq = 128, tensor = 1, reps = 3, full = false }
assert(cfg.dir ~= "", "--dir is required")
pt.set_threads(1)
pt.manual_seed(1)
local mesh = pt.mesh { tensor = cfg.tensor }
local model = pt.parallelize(pt.models.gpt2 { vocab = 256, seq = cfg.seq, dim = cfg.dim, heads = cfg.heads,
                                              layers = cfg.layers }, nil, mesh)
local opt = pt.optim.adamw(model, { lr = 1e-3 })
local loss_of = pt.loss_fn(model)
local x = pt.randint(0, 256, { 2, cfg.seq })
local loss = loss_of(model(x), x)
loss:backward()
opt:step()   -- AdamW's moments exist now: the checkpoint holds weights and optimizer state

local function data_bytes(tag_dir)
  local total = 0
  for line in io.popen("ls -l " .. tag_dir .. "/rank-*.bin 2>/dev/null"):lines() do
    total = total + tonumber(line:match("^%S+%s+%S+%s+%S+%s+%S+%s+(%d+)"))
  end
  return total
end

local world = pt.dist.world()
for rep = 1, cfg.reps do
  world:barrier()
  local t0 = pt.time()
  local tag = pt.ckpt.save(cfg.dir, { model = model, optim = opt, step = rep, tag = "bench", full = cfg.full,
                                      overwrite = true })
  world:barrier()
  local saved = pt.time() - t0
  os.execute("sync")
  world:barrier()
  t0 = pt.time()
  pt.ckpt.load(cfg.dir, "bench", { model = model, optim = opt })
  world:barrier()
  local loaded = pt.time() - t0
  if pt.dist.rank() == 0 then
    print(("rep %d save %.4f load %.4f bytes %d"):format(rep, saved, loaded, data_bytes(cfg.dir .. "/" .. tag)))
  end
end
