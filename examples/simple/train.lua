-- Trains the tutorial's SimpleModel on byte tokens of the King James Bible, data-parallel over
-- however many ranks it runs on (the tutorial's "Data Parallelism" section).
--   partrain examples/simple/train.lua [--steps 50] [--batch 8] [--seq 10] [--lr 0.001]
--   partrain --nproc-per-node 2 examples/simple/train.lua
local pt = require "partrain"
local SimpleModel = require "model"     -- examples/simple/model.lua: the script's folder is on the path

local cfg = pt.args {
  steps = 50,
  epochs = 1,              -- at most this many passes over the corpus
  batch = 8,               -- the global batch, split over the data-parallel ranks
  seq = 10,                -- tokens a text (the tutorial's max_length)
  dim = 64,                -- the tutorial's embedding_dim
  lr = pt.args.number(0.001),
  seed = 1,
  corpus = "",              -- default: data/kjv.txt of this checkout (made by scripts/setup)
  threads = 0,
  ckpt = "",               -- checkpoint folder: resume from its newest checkpoint, save into it
  save_every = 0,          -- with --ckpt: save every this many steps (and at the end)
}
if cfg.threads > 0 then pt.set_threads(cfg.threads) end
if cfg.corpus == "" then cfg.corpus = (arg[0]:match("^(.*)/") or ".") .. "/../../data/kjv.txt" end
pt.manual_seed(cfg.seed)

local mesh = pt.mesh {}
-- The tutorial's loss is a sum over the batch, so the ranks' gradients add up (reduce = "sum").
local model = pt.parallelize(SimpleModel(256, cfg.dim), nil, mesh, { reduce = "sum" })   -- byte-level: 256 ids
local data = pt.data.text { path = cfg.corpus, seq = cfg.seq, batch = cfg.batch, seed = cfg.seed, mesh = mesh }
local opt = pt.optim.sgd(model, { lr = cfg.lr })
if pt.dist.rank() == 0 then print(model) end

local step = 0
if cfg.ckpt ~= "" then
  local resumed = pt.ckpt.resume(cfg.ckpt, { model = model, optim = opt, data = data })
  if resumed then step = resumed.step end
end
while step < cfg.steps and data:epoch() < cfg.epochs do
  local input_ids = data:next()
  local loss = SimpleModel.loss(model(input_ids))
  opt:zero_grad()
  loss:backward()
  opt:step()
  step = step + 1
  local global = loss:detach():clone()
  mesh:group("data"):all_reduce(global, "sum")   -- the loss of the whole global batch
  pt.log { step = step, loss = global:item() }
  if cfg.ckpt ~= "" and cfg.save_every > 0 and (step % cfg.save_every == 0 or step == cfg.steps) then
    pt.ckpt.save(cfg.ckpt, { model = model, optim = opt, data = data, step = step })
  end
end
