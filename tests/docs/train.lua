-- The script the docs call train.lua: a small byte-level GPT-2 trained for a few steps through
-- model:train_step, split by --tensor and --pipeline, data-parallel over the remaining ranks.
-- tests/docs/test_samples.py copies it into the folder where a doc's commands run.
local pt = require "partrain"

local cfg = pt.args {
  steps = { 2, "steps to train" },
  tensor = { 1, "tensor-parallel size" },
  pipeline = { 1, "pipeline stages" },
  batch = { 8, "the global batch, in sequences" },
  seq = { 16, "tokens (bytes) a sequence" },
}
pt.manual_seed(1)
local mesh = pt.mesh { tensor = cfg.tensor, pipeline = cfg.pipeline }
local model = pt.models.gpt2 { vocab = 256, seq = cfg.seq, dim = 32, heads = 4, layers = 2 }
model = pt.parallelize(model, cfg.pipeline > 1 and "policies.gpt2" or nil, mesh)
local data = pt.data.text { path = "data/kjv.txt", seq = cfg.seq, batch = cfg.batch, seed = 1, mesh = mesh }
local opt = pt.optim.adamw(model, { lr = 1e-3 })
for step = 1, cfg.steps do
  local x, y = data:next()
  local loss = model:train_step(x, y)   -- the global batch's loss, on every rank
  opt:step(); opt:zero_grad()
  pt.log { step = step, loss = loss }
end
