-- LLaMA from Hugging Face weights, trained on the bytes of data/kjv.txt as
-- tests/models/llama_reference.py trains its PyTorch twin: import (a file, an index or a folder),
-- export right after (one file and/or Hugging Face's sharded layout), then AdamW steps printing
-- "loss <step> <value>". --tensor splits it over that many ranks (the policy in policies/llama.lua).
local pt = require "partrain"
local args = pt.args { tensor = 1, import = "", export = "", export_sharded = "", shard_mb = 0.02, steps = 10,
                       batch = 4, seq = 16 }
local cfg = { vocab = 256, seq = args.seq, dim = 32, heads = 8, kv_heads = 4, layers = 2, hidden = 48 }
local mesh = pt.mesh { tensor = args.tensor }
local model = pt.parallelize(pt.models.llama(cfg), nil, mesh)
if args.import ~= "" then pt.ckpt.import_safetensors(model, args.import) end
if args.export ~= "" then pt.ckpt.export_safetensors(model, args.export) end
if args.export_sharded ~= "" then pt.ckpt.export_safetensors(model, args.export_sharded, { max_shard_size = args.shard_mb }) end

-- The reference's batches (tests/models/kjv_windows.lua).
package.path = "tests/models/?.lua;" .. package.path
local all = require("kjv_windows")(args.steps, args.batch, args.seq)
local loss_fn = pt.loss_fn(model)
local opt = pt.optim.adamw(model, { lr = 1e-3, weight_decay = 0.1 })
for step = 1, args.steps do
  local window = all:select(0, step - 1)
  local x, y = window:narrow(1, 0, args.seq), window:narrow(1, 1, args.seq)
  local loss = loss_fn(model(x), y)
  opt:zero_grad()
  loss:backward()
  opt:step()
  if pt.dist.rank() == 0 then print(("loss %d %.10f"):format(step, loss:item())) end
end
