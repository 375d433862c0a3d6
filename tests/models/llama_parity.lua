-- LLaMA from Hugging Face weights trained as tests/models/llama_reference.py trains its PyTorch
-- twin, in any layout: --tensor, --pipeline (with --microbatches), data parallelism over the
-- remaining ranks, --zero STAGE over the data group. Each data rank reads its rows of the
-- reference's global batch; every step goes through model:train_step and prints (rank 0)
-- "loss <step> <value>" with the global batch's loss. --import reads Hugging Face's files; a
-- pipelined model cannot import them, so --save writes a checkpoint of the imported weights
-- before the first step and --load starts from one.
local pt = require "partrain"
local args = pt.args { import = "", load = "", save = "", dtype = "float64", tensor = 1, pipeline = 1, zero = 0,
                       microbatches = 2, steps = 50, batch = 4, seq = 16 }
local cfg = { vocab = 256, seq = args.seq, dim = 32, heads = 8, kv_heads = 4, layers = 2, hidden = 48,
              dtype = args.dtype }
local mesh = pt.mesh { tensor = args.tensor, pipeline = args.pipeline, zero = args.zero > 0 and 0 or nil }
local options = {}
if args.pipeline > 1 then options.microbatches = args.microbatches end
if args.zero > 0 then options.zero = { stage = args.zero } end
local model = pt.parallelize(pt.models.llama(cfg), nil, mesh, options)
if args.import ~= "" then pt.ckpt.import_safetensors(model, args.import) end
if args.load ~= "" then pt.ckpt.load(args.load, { model = model }) end
if args.save ~= "" then pt.ckpt.save(args.save, { model = model, step = 0 }) end

-- The reference's batches (tests/models/kjv_windows.lua).
package.path = "tests/models/?.lua;" .. package.path
local all = require("kjv_windows")(args.steps, args.batch, args.seq)
local d, rows = mesh:coord().data, math.floor(args.batch / mesh:size("data"))
local opt = pt.optim.adamw(model, { lr = 1e-3, weight_decay = 0.1 })
for step = 1, args.steps do
  local window = all:select(0, step - 1):narrow(0, d * rows, rows)
  local loss = model:train_step(window:narrow(1, 0, args.seq), window:narrow(1, 1, args.seq))
  opt:step()
  opt:zero_grad()
  if pt.dist.rank() == 0 then print(("loss %d %.17g"):format(step, tonumber(loss) or loss:item())) end
end
