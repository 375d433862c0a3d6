-- Trains a multilayer perceptron on Fashion-MNIST and reports test accuracy after each epoch.
-- Data-parallel over however many ranks it runs on; the global batch, and so the numbers, stay
-- those of the serial run.
--   partrain examples/mnist/train.lua [--epochs 3] [--steps N] [--lr 0.05] [--batch 64] ...
--   partrain --nproc-per-node 4 examples/mnist/train.lua
local pt = require "partrain"

local cfg = pt.args {
  epochs = { 3, "passes over the 60,000 training images" },
  steps = { 0, "stop after this many steps in all (0: no limit)" },
  batch = { 64, "the global batch, split over the data-parallel ranks" },
  lr = pt.args.number(0.05, "learning rate (cosine schedule)"),
  momentum = pt.args.number(0.9, "SGD's (Nesterov) momentum"),
  hidden = { 256, "width of the first hidden layer (the second is half)" },
  seed = { 1, "seed of the weights and the data order" },
  log_every = { 1, "print the loss (and write a metrics record) every this many steps" },
  threads = { 0, "intra-op threads (0: LibTorch's default)" },
  ckpt = { "", "checkpoint folder: resume from its newest checkpoint, save into it" },
  save_every = { 0, "with --ckpt: save every this many steps" },
  metrics = { "", "append metrics (JSON lines: docs/observability.md) to this file (or partrain --metrics FILE)" },
  peak_tflops = pt.args.number(0, "one device's peak TFLOP/s, for MFU (0: NVIDIA's table on CUDA, none on the CPU)"),
  progress = { true, "the live progress line on a terminal (--no-progress: none)" },
}
if cfg.threads > 0 then pt.set_threads(cfg.threads) end
pt.manual_seed(cfg.seed)
if cfg.metrics ~= "" then pt.metrics(cfg.metrics) end

local mesh = pt.mesh {}    -- every rank a data-parallel replica
local model = pt.models.mlp { sizes = { 784, cfg.hidden, math.floor(cfg.hidden / 2), 10 } }
local flops_per_image = 6 * model:num_parameters()   -- forward and backward of a dense network: 6 FLOPs a weight
model = pt.parallelize(model, nil, mesh)
local train = pt.data.mnist { split = "train", batch = cfg.batch, seed = cfg.seed, mesh = mesh }
local test = pt.data.mnist { split = "test", batch = 1000, shuffle = false, drop_last = false }
local opt = pt.optim.sgd(model, { lr = cfg.lr, momentum = cfg.momentum, nesterov = true,
  schedule = { kind = "cosine", total = cfg.epochs * train:batches_per_epoch() } })
print(("model: %d parameters; data: %s; %d data-parallel rank(s)"):format(
  model:num_parameters(), tostring(train), mesh:size("data")))

-- The loss over the whole global batch: the mean of the ranks' losses (equal slices), a
-- one-element tensor that progress reads only when it prints or logs.
local function global_loss(loss)
  local t = loss:detach():clone()
  mesh:group("data"):all_reduce(t, "mean")
  return t
end

local function accuracy()
  model:eval()
  local correct = 0
  pt.no_grad(function()
    test:start_epoch(0)
    for x, y in test:batches() do
      correct = correct + model(x):argmax(1):eq(y):sum():item()
    end
  end)
  model:train()
  return correct / test:size()
end

local step, resumed = 0, nil
if cfg.ckpt ~= "" then
  resumed = pt.ckpt.resume(cfg.ckpt, { model = model, optim = opt, data = train })
  if resumed then step = resumed.step end
end
local total = cfg.epochs * train:batches_per_epoch()
if cfg.steps > 0 then total = math.min(total, cfg.steps) end
-- An image is this example's "token": tokens_per_s counts images of the global batch a second.
local progress = pt.progress { total = total, tokens = cfg.batch, flops_per_token = flops_per_image,
                               peak_tflops = cfg.peak_tflops, every = cfg.log_every, enabled = cfg.progress }
for epoch = train:epoch() + 1, cfg.epochs do
  if resumed then resumed = nil else train:start_epoch(epoch - 1) end  -- a resumed epoch goes on where it was
  for x, y in train:batches() do
    local loss = pt.nn.cross_entropy(model(x), y)
    opt:zero_grad()
    loss:backward()
    opt:step()
    step = step + 1
    progress:step(step, { epoch = epoch, loss = global_loss(loss) })
    if cfg.ckpt ~= "" and cfg.save_every > 0 and step % cfg.save_every == 0 then
      pt.ckpt.save(cfg.ckpt, { model = model, optim = opt, data = train, step = step })
    end
    if cfg.steps > 0 and step >= cfg.steps then break end
  end
  local acc = accuracy()
  print(("epoch %d | step %d | test_accuracy %.4f"):format(epoch, step, acc))
  pt.metrics.write { event = "eval", epoch = epoch, step = step, test_accuracy = acc }
  if cfg.steps > 0 and step >= cfg.steps then break end
end
progress:finish()
