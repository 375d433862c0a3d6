-- A rank's way to its first training step, for bench/startup: a small MLP, data-parallel over the
-- world (a world of one without the launcher), one step on random data, then exit.
-- bench/startup_torch.py does the same in PyTorch.
local pt = require "partrain"
local mesh = pt.mesh {}
pt.manual_seed(1)
local model = pt.parallelize(pt.models.mlp { sizes = { 784, 64, 10 } }, nil, mesh)
local opt = pt.optim.sgd(model, { lr = 0.01 })
local x, y = pt.randn(32, 784), pt.randint(0, 10, { 32 })
local loss = pt.nn.cross_entropy(model(x), y)
opt:zero_grad()
loss:backward()
opt:step()
