-- What driving a training loop from Lua costs, measured in one process so that a noisy, shared
-- machine disturbs both sides alike: blocks of MNIST steps written in Lua (forward, loss,
-- backward, step: one engine call each) alternate with blocks of the same steps done by one C++
-- call (opt:classification_step). Two identical models, data streams and optimizers; the losses
-- must agree step for step.
local pt = require "partrain"
local cfg = pt.args { blocks = 20, block = 25, batch = 64, threads = 1, hidden = 256 }
pt.set_threads(cfg.threads)

local function setup()
  pt.manual_seed(1)
  local model = pt.models.mlp { sizes = { 784, cfg.hidden, math.max(1, math.floor(cfg.hidden / 2)), 10 } }
  return model, pt.optim.sgd(model, { lr = 0.05, momentum = 0.9 }), pt.data.mnist { batch = cfg.batch, seed = 1 }
end
local lua_model, lua_opt, lua_data = setup()
local cpp_model, cpp_opt, cpp_data = setup()

local function lua_block(losses)
  for _ = 1, cfg.block do
    local x, y = lua_data:next()
    local loss = pt.nn.cross_entropy(lua_model(x), y)
    lua_opt:zero_grad()
    loss:backward()
    lua_opt:step()
    losses[#losses + 1] = loss:item()
  end
end

local function cpp_block(losses)
  for _ = 1, cfg.block do
    local x, y = cpp_data:next()
    losses[#losses + 1] = cpp_opt:classification_step(cpp_model, x, y)
  end
end

local lua_cpu, cpp_cpu, lua_wall, cpp_wall = {}, {}, {}, {}
local lua_losses, cpp_losses = {}, {}
local function timed(fn, losses, cpu, wall)
  local c, w = pt.cpu_time(), pt.time()
  fn(losses)
  cpu[#cpu + 1], wall[#wall + 1] = pt.cpu_time() - c, pt.time() - w
end
for b = 1, cfg.blocks do
  if b % 2 == 1 then  -- alternate which side goes first
    timed(lua_block, lua_losses, lua_cpu, lua_wall); timed(cpp_block, cpp_losses, cpp_cpu, cpp_wall)
  else
    timed(cpp_block, cpp_losses, cpp_cpu, cpp_wall); timed(lua_block, lua_losses, lua_cpu, lua_wall)
  end
end

for i = 1, #lua_losses do
  if lua_losses[i] ~= cpp_losses[i] then error(("step %d: Lua loss %.9g, C++ loss %.9g"):format(i, lua_losses[i], cpp_losses[i])) end
end
local function sum(t) local s = 0 for _, v in ipairs(t) do s = s + v end return s end
local median = require("timing").median
local steps = cfg.blocks * cfg.block
print(("%d steps each, batch %d, %d thread(s); losses identical step for step"):format(steps, cfg.batch, cfg.threads))
print(("CPU  total: Lua %.3f s  C++ %.3f s  Lua/C++ %.4f"):format(sum(lua_cpu), sum(cpp_cpu), sum(lua_cpu) / sum(cpp_cpu)))
print(("CPU  median block: Lua %.4f s  C++ %.4f s  Lua/C++ %.4f"):format(median(lua_cpu), median(cpp_cpu), median(lua_cpu) / median(cpp_cpu)))
print(("wall median block: Lua %.4f s  C++ %.4f s  Lua/C++ %.4f"):format(median(lua_wall), median(cpp_wall), median(lua_wall) / median(cpp_wall)))
