-- What examples/mnist/train.lua does before its first step, and that step: the time from
-- `partrain` starting to training (measured from outside by bench/host).
local pt = require "partrain"
pt.manual_seed(1)
local model = pt.models.mlp { sizes = { 784, 256, 128, 10 } }
local train = pt.data.mnist { split = "train", batch = 64, seed = 1 }
local opt = pt.optim.sgd(model, { lr = 0.05, momentum = 0.9 })
local x, y = train:next()
local loss = pt.nn.cross_entropy(model(x), y)
opt:zero_grad()
loss:backward()
opt:step()
