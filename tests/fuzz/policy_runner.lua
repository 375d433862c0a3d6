-- Runs the policy cases tests/fuzz/fuzz_policy.py wrote, one after another in one job of 2 ranks
-- (tensor 2): each case's policy file is required and applied with pt.parallelize to a fresh
-- model inside pcall. A refusal prints its message; an accepted policy trains 3 SGD steps beside
-- the serial model on the same batches and prints whether losses and final weights agree.
--   partrain --nproc-per-node 2 --threads 1 tests/fuzz/policy_runner.lua DIR FIRST LAST
-- Rank 0 prints "START i" before case i and "CASE i <kind> <detail>" after it, so the driver
-- knows which case a crash or a hang belongs to.
local pt = require "partrain"

local dir, first, last = arg[1], tonumber(arg[2]), tonumber(arg[3])
package.path = dir .. "/?.lua;examples/simple/?.lua;" .. package.path
local SimpleModel = require "model"
local mesh = pt.mesh { tensor = 2 }
local rank0 = pt.dist.rank() == 0

local function say(line)
  if rank0 then io.write(line, "\n"); io.flush() end
end

-- The models the cases target, each with a batch maker and a loss.
local Block = pt.nn.Module "FuzzBlock"
function Block:__init() self.up = pt.nn.Linear(6, 8); self.down = pt.nn.Linear(8, 6) end
function Block:forward(x) local h = self.up(x):tanh(); return x + self.down(h) end
local Net = pt.nn.Module "FuzzNet"
function Net:__init() self.a = Block(); self.b = Block(); self.head = pt.nn.Linear(6, 5) end
function Net:forward(x) local y = self.head(self.b(self.a(x))); return y end

local function ids(high, b, t) return pt.randint(0, high, { b, t }) end
local KINDS = {
  gpt2 = {
    make = function() return pt.models.gpt2 { vocab = 63, seq = 8, dim = 16, heads = 4, layers = 2 } end,
    batch = function() return ids(63, 4, 8), ids(63, 4, 8) end,
  },
  mlp = {
    make = function() return pt.models.mlp { sizes = { 8, 16, 4 } } end,
    batch = function() return pt.randn(4, 8), ids(4, 4, 1):view(-1) end,
  },
  net = {
    make = function() return Net() end,
    batch = function() return pt.randn(4, 6), ids(5, 4, 1):view(-1) end,
  },
  simple = {
    make = function() return SimpleModel(32, 8) end,
    batch = function() return ids(32, 4, 6), nil end,
    loss = function(out) return out:mean() end,
  },
}

local function one_line(s) return (tostring(s):gsub("\n", "\\n")) end

-- Trains `model` (parallelized) and `serial` side by side; nil when they agree, else what differs.
local function differs(kind, model, serial, seed)
  local k = KINDS[kind]
  local loss_p = k.loss or pt.loss_fn(model)
  local loss_s = k.loss or pt.nn.cross_entropy
  local po, so = pt.optim.sgd(model, { lr = 0.1 }), pt.optim.sgd(serial, { lr = 0.1 })
  for step = 1, 3 do
    pt.manual_seed(seed * 10 + step)  -- the same batch on every rank
    local x, y = k.batch()
    local lp, ls = loss_p(model(x), y), loss_s(serial(x), y)
    local a, b = lp:item(), ls:item()
    if not (math.abs(a - b) <= 1e-4 * math.max(1, math.abs(b))) then
      return ("loss at step %d: %.7g, serial %.7g"):format(step, a, b)
    end
    po:zero_grad(); so:zero_grad()
    lp:backward(); ls:backward()
    po:step(); so:step()
  end
  local full, want = model:full_state_dict(), serial:state_dict()
  for name, w in pairs(want) do
    local g = full[name]
    if not g then return "no parameter " .. name .. " after sharding" end
    local err = (g:double() - w:double()):abs():max():item()
    if not (err <= 1e-4 * math.max(1, w:abs():max():item())) then
      return ("%s after 3 steps: largest difference %.3g"):format(name, err)
    end
  end
end

for i = first, last do
  local name = ("case_%d"):format(i)
  local spec = require(name .. "_meta")  -- { kind = ..., opts = {...} }
  say("START " .. i)
  local seed = 1000 + i
  pt.manual_seed(seed)
  local model = KINDS[spec.kind].make()
  local loaded, policy = pcall(require, name)
  if not loaded then
    say(("CASE %d refused %s"):format(i, one_line(policy)))
  else
    local ok, err = pcall(function()
      local parallel = pt.parallelize(model, policy, mesh, spec.opts)
      return parallel
    end)
    if not ok then
      say(("CASE %d refused %s"):format(i, one_line(err)))
    else
      pt.manual_seed(seed)
      local serial = KINDS[spec.kind].make()
      local trained, problem = pcall(differs, spec.kind, model, serial, seed)
      if not trained then say(("CASE %d accepted fails %s"):format(i, one_line(problem)))
      elseif problem then say(("CASE %d accepted differs %s"):format(i, one_line(problem)))
      else say(("CASE %d accepted same"):format(i)) end
    end
  end
  package.loaded[name] = nil
  collectgarbage()
end
say("DONE")
