-- The MNIST training loop of bench/mnist_cpp.cpp written in Lua: the same model, data, optimizer
-- and steps, so the two timings differ only by what Lua adds.
local pt = require "partrain"
local cfg = pt.args { steps = 300, batch = 64, threads = 1, hidden = 256 }
pt.set_threads(cfg.threads)
pt.manual_seed(1)
local model = pt.models.mlp { sizes = { 784, cfg.hidden, math.max(1, math.floor(cfg.hidden / 2)), 10 } }
local opt = pt.optim.sgd(model, { lr = 0.05, momentum = 0.9 })
local data = pt.data.mnist { batch = cfg.batch, seed = 1 }

local start, cpu_start = pt.time(), pt.cpu_time()
local loss_sum = 0
for _ = 1, cfg.steps do
  local x, y = data:next()
  local loss = pt.nn.cross_entropy(model(x), y)
  opt:zero_grad()
  loss:backward()
  opt:step()
  loss_sum = loss_sum + loss:item()
end
print(("lua steps %d seconds %.4f cpu %.4f mean_loss %.6f"):format(cfg.steps, pt.time() - start,
  pt.cpu_time() - cpu_start, loss_sum / cfg.steps))
