-- Step time through model:train_step (forward, loss, backward and sync in C++) against the
-- hand-written Lua loop doing the same step, on two copies of one GPT-2 in the same run, steps
-- interleaved, medians and their ratio (the goal: train_step no slower). Run under the launcher:
--   partrain --nproc-per-node 4 --threads 1 bench/train_step.lua --tensor 2
local pt = require "partrain"
local cfg = pt.args { steps = 30, warmup = 5, batch = 8, seq = 64, dim = 128, heads = 4, layers = 2, vocab = 256,
                      tensor = 1 }
local mesh = pt.mesh { tensor = cfg.tensor }
local gpt = { vocab = cfg.vocab, seq = cfg.seq, dim = cfg.dim, heads = cfg.heads, layers = cfg.layers }
local function make()
  pt.manual_seed(1)
  local model = pt.parallelize(pt.models.gpt2(gpt), nil, mesh)
  return model, pt.optim.adamw(model, { lr = 1e-4 })
end
local a, opt_a = make()   -- through train_step
local b, opt_b = make()   -- through the Lua loop
local loss_b = pt.loss_fn(b)
local local_batch = cfg.batch / mesh:size("data")

local function batch()
  local tokens = pt.randint(0, cfg.vocab, { local_batch, cfg.seq + 1 })
  return tokens:narrow(1, 0, cfg.seq):contiguous(), tokens:narrow(1, 1, cfg.seq):contiguous()
end
local function with_train_step(x, y)
  local loss = a:train_step(x, y)
  opt_a:step(); opt_a:zero_grad()
  return loss
end
local function with_lua_loop(x, y)
  local loss = loss_b(b(x), y)
  loss:backward()
  opt_b:step(); opt_b:zero_grad()
  return loss
end

local function timed(fn, x, y)
  pt.dist.barrier()
  local t0 = pt.time()
  fn(x, y)
  pt.dist.barrier()
  return pt.time() - t0
end
local ts, ls = {}, {}
for i = 1, cfg.warmup + cfg.steps do
  local x, y = batch()
  -- Interleaved, alternating which goes first, so drift on a shared machine hits both alike.
  local first, second = with_train_step, with_lua_loop
  if i % 2 == 0 then first, second = second, first end
  local t1, t2 = timed(first, x, y), timed(second, x, y)
  if i > cfg.warmup then
    if first == with_train_step then ts[#ts + 1], ls[#ls + 1] = t1, t2 else ts[#ts + 1], ls[#ls + 1] = t2, t1 end
  end
end
local median = require("timing").median
local mt, ml = median(ts), median(ls)
if pt.dist.rank() == 0 then
  print(("train_step_ms=%.3f lua_loop_ms=%.3f ratio=%.3f (train_step / Lua loop; GPT-2 dim %d x %d layers, batch %d x %d, "
    .. "tensor %d x data %d, %d steps)"):format(mt * 1e3, ml * 1e3, mt / ml, cfg.dim, cfg.layers, cfg.batch, cfg.seq,
    mesh:size("tensor"), mesh:size("data"), cfg.steps))
end
