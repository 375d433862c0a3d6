-- examples/cpp/gpt_cpp.cpp written in Lua: the same GPT-2 (config and seed), split by
-- policies/gpt2.lua over tensor 2 x data 2 with ZeRO-1 over the data group, trained with AdamW
-- (lr 1e-3, no weight decay, as gpt_cpp's optimizer) on the same batches: manual_seed(100 + step)
-- then randint of the global batch, each data rank taking its rows. tests/dist/test_gpt_cpp.py
-- compares its losses with gpt_cpp's.
--   partrain --nproc-per-node 4 --threads 1 tests/examples/gpt_lua.lua [steps]
-- Rank 0 prints "step N loss L" a line, the loss of the global batch.
local pt = require "partrain"

local steps, batch = tonumber(arg[1]) or 4, 8
local cfg = { vocab = 64, seq = 16, dim = 32, heads = 4, layers = 2 }
pt.manual_seed(1)  -- the same serial model on every rank, and gpt_cpp's
local mesh = pt.mesh { tensor = 2, zero = 0 }  -- ZeRO's groups: the whole data group
local model = pt.parallelize(pt.models.gpt2(cfg), "policies.gpt2", mesh, { zero = { stage = 1 } })
local opt = pt.optim.adamw(model, { lr = 1e-3, weight_decay = 0 })

local data, d = mesh:size("data"), mesh:coord().data
local rows = batch / data
for step = 1, steps do
  pt.manual_seed(100 + step)  -- the global batch, alike everywhere; this rank takes its rows
  local tokens = pt.randint(0, cfg.vocab, { batch, cfg.seq + 1 })
  local x = tokens:narrow(1, 0, cfg.seq):narrow(0, d * rows, rows):contiguous()
  local y = tokens:narrow(1, 1, cfg.seq):narrow(0, d * rows, rows):contiguous()
  local loss = model:train_step(x, y)
  opt:step()
  opt:zero_grad()
  if pt.dist.rank() == 0 then print(("step %d loss %.9f"):format(step, loss:item())) end
end
