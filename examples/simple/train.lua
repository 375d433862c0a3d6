-- Trains the tutorial's SimpleModel on byte tokens of the King James Bible.
--   partrain examples/simple/train.lua [--steps 50] [--batch 8] [--seq 10] [--lr 0.001]
local pt = require "partrain"
local SimpleModel = require "model"     -- examples/simple/model.lua: the script's folder is on the path

local cfg = pt.args {
  steps = 50,
  epochs = 1,              -- at most this many passes over the corpus
  batch = 8,
  seq = 10,                -- tokens a text (the tutorial's max_length)
  dim = 64,                -- the tutorial's embedding_dim
  lr = pt.args.number(0.001),
  seed = 1,
  corpus = "",              -- default: data/kjv.txt of this checkout (made by scripts/setup)
  threads = 0,
}
if cfg.threads > 0 then pt.set_threads(cfg.threads) end
if cfg.corpus == "" then cfg.corpus = (arg[0]:match("^(.*)/") or ".") .. "/../../data/kjv.txt" end
pt.manual_seed(cfg.seed)

local model = SimpleModel(256, cfg.dim)   -- byte-level: 256 token ids
local data = pt.data.text { path = cfg.corpus, seq = cfg.seq, batch = cfg.batch, seed = cfg.seed }
local opt = pt.optim.sgd(model, { lr = cfg.lr })
print(model)

local step = 0
while step < cfg.steps and data:epoch() < cfg.epochs do
  local input_ids = data:next()
  local loss = SimpleModel.loss(model(input_ids))
  opt:zero_grad()
  loss:backward()
  opt:step()
  step = step + 1
  pt.log { step = step, loss = loss:item() }
end
