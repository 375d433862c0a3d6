-- Mixtral (pt.models.llama with experts) from Hugging Face's per-expert weights, trained as
-- tests/models/llama_reference.py --experts trains its PyTorch twin: import (a file, an index or
-- a folder), export right after (one file and/or the sharded layout) and/or --save a checkpoint
-- of the imported weights (step 0), then AdamW steps through
-- model:train_step, printing (rank 0) "loss <step> <value>" (the cross-entropy: the router losses
-- join the gradient only) and each block's router losses from pt.moe.stats, "aux <step> <block>
-- <value>" and "z <step> <block> <value>". --expert splits the experts over that many ranks, data
-- parallelism over the same ranks (each reads its rows of the reference's batch).
local pt = require "partrain"
local args = pt.args { import = "", export = "", export_sharded = "", save = "", shard_mb = 0.02, dtype = "float64",
                       expert = 1, steps = 30, batch = 4, seq = 16, experts = 4, top_k = 2,
                       aux_loss = pt.args.number(0.02), z_loss = pt.args.number(0.001) }
local cfg = { vocab = 256, seq = args.seq, dim = 32, heads = 8, kv_heads = 4, layers = 2, hidden = 48,
              dtype = args.dtype, experts = args.experts, top_k = args.top_k, aux_loss = args.aux_loss,
              z_loss = args.z_loss }
local mesh = pt.mesh { expert = args.expert }
local model = pt.parallelize(pt.models.llama(cfg), nil, mesh)
if args.import ~= "" then pt.ckpt.import_safetensors(model, args.import) end
if args.export ~= "" then pt.ckpt.export_safetensors(model, args.export) end
if args.export_sharded ~= "" then
  pt.ckpt.export_safetensors(model, args.export_sharded, { max_shard_size = args.shard_mb })
end
if args.save ~= "" then pt.ckpt.save(args.save, { model = model, step = 0 }) end
if args.steps == 0 then return end

-- The reference's batches (tests/models/kjv_windows.lua).
package.path = "tests/models/?.lua;" .. package.path
local all = require("kjv_windows")(args.steps, args.batch, args.seq)
local d, rows = mesh:coord().data, math.floor(args.batch / mesh:size("data"))
local opt = pt.optim.adamw(model, { lr = 1e-3, weight_decay = 0.1 })
pt.moe.stats(model)  -- counted from the first step on
for step = 1, args.steps do
  local window = all:select(0, step - 1):narrow(0, d * rows, rows)
  local loss = model:train_step(window:narrow(1, 0, args.seq), window:narrow(1, 1, args.seq))
  opt:step()
  opt:zero_grad()
  local stats = pt.moe.stats(model)
  if pt.dist.rank() == 0 then
    print(("loss %d %.17g"):format(step, tonumber(loss) or loss:item()))
    local blocks = {}
    for path in pairs(stats) do blocks[#blocks + 1] = path end
    table.sort(blocks)
    for _, path in ipairs(blocks) do
      print(("aux %d %s %.17g"):format(step, path, stats[path].aux))
      print(("z %d %s %.17g"):format(step, path, stats[path].z))
    end
  end
end
