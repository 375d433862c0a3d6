-- Data parallelism is serial training: run under the launcher with 2 or 4 ranks, every case
-- trains a data-parallel model on each rank's slice of the global batch and, beside it in the
-- same process, a serial copy on the whole global batch, from the same initial weights. Losses
-- at every step (relative to max(|loss|, 1)) and every parameter at the end (||a - b|| / ||b||)
-- must agree within 1e-5 in fp32.
--   partrain --nproc-per-node 4 tests/dist/test_dp.lua
package.path = "tests/lua/?.lua;examples/simple/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local SimpleModel = require "model"
local cfg = pt.args { steps = 20, tolerance = pt.args.number(1e-5) }

local mesh = pt.mesh {}
local dp = mesh:size("data")
local data_group = mesh:group("data")
local rank = pt.dist.rank()

-- ||a - b|| / ||b||, the tolerance's measure for a tensor.
local function relative(a, b)
  local scale = b:double():norm():item()
  return (a:double() - b:double()):norm():item() / math.max(scale, 1e-12)
end

local function same_everywhere(t)
  for _, other in ipairs(data_group:all_gather(t:detach():contiguous())) do
    if not other:equal(t) then return false end
  end
  return true
end

local cases = {
  mnist = {
    make = function() return pt.models.mlp { sizes = { 784, 64, 10 } } end,
    loader = function(shard) return pt.data.mnist { batch = 32, seed = 5, mesh = shard and mesh or nil } end,
    loss = function(model, x, y) return pt.nn.cross_entropy(model(x), y) end,
    optimizer = function(model) return pt.optim.sgd(model, { lr = 0.05, momentum = 0.9 }) end,
    mean_loss = true,   -- a mean over the batch: ranks' losses average to the global one
  },
  simple = {
    make = function() return SimpleModel(256, 16) end,
    loader = function(shard)
      return pt.data.text { path = "data/kjv.txt", seq = 10, batch = 8, seed = 5, mesh = shard and mesh or nil }
    end,
    loss = function(model, x) return SimpleModel.loss(model(x)) end,
    optimizer = function(model) return pt.optim.adamw(model, { lr = 1e-3 }) end,
    mean_loss = false,  -- the tutorial's sum: ranks' losses add up to the global one
  },
}

local function check_case(name, reduce, accumulation, bucket_cap_mb)
  local case = cases[name]
  pt.manual_seed(11)
  local serial = case.make()
  pt.manual_seed(11)
  local model = case.make()
  if rank > 0 then  -- start the replicas apart: parallelize must broadcast data rank 0's weights
    pt.no_grad(function() for _, p in ipairs(model:parameters()) do p:add_(1) end end)
  end
  pt.parallelize(model, nil, mesh, { reduce = reduce, grad_accumulation = accumulation, bucket_cap_mb = bucket_cap_mb })
  local serial_params = {}
  for n, p in serial:named_parameters() do serial_params[n] = p end
  for n, p in model:named_parameters() do
    H.ok(p:equal(serial_params[n]), "parameters start from data rank 0's weights: " .. n)
  end
  local opt, serial_opt = case.optimizer(model), case.optimizer(serial)
  local shard, whole = case.loader(true), case.loader(false)
  -- The serial loss whose gradient equals what the reducer computes (see docs/parallel.md).
  local scale = (case.mean_loss and dp or 1) / (reduce == "mean" and dp * accumulation or 1)
  local worst = 0
  for step = 1, cfg.steps do
    for _ = 1, accumulation do
      local x, y = shard:next()
      local loss = case.loss(model, x, y)
      loss:backward()
      local gx, gy = whole:next()
      local serial_loss = case.loss(serial, gx, gy)
      local scaled = serial_loss * scale
      scaled:backward()
      local global = loss:detach():clone()
      data_group:all_reduce(global, case.mean_loss and "mean" or "sum")
      -- Relative to max(|loss|, 1): the tutorial's sum loss wanders through 0, where a purely
      -- relative measure of a float32 sum means nothing.
      local err = math.abs(global:item() - serial_loss:item()) / math.max(math.abs(serial_loss:item()), 1)
      worst = math.max(worst, err)
      if err > cfg.tolerance then
        error(("%s reduce=%s k=%d step %d: loss %.9g, serial %.9g (relative %.2e)"):format(
          name, reduce, accumulation, step, global:item(), serial_loss:item(), err))
      end
    end
    opt:step(); opt:zero_grad()
    serial_opt:step(); serial_opt:zero_grad()
  end
  for n, p in model:named_parameters() do
    local err = relative(p, serial_params[n])
    worst = math.max(worst, err)
    H.ok(err <= cfg.tolerance, ("%s: parameter %s differs from serial by %.2e"):format(name, n, err))
    H.ok(same_everywhere(p), ("%s: parameter %s differs between ranks"):format(name, n))
  end
  return worst
end

local function case(name, reduce, accumulation, bucket_cap_mb)
  H.test(("%s, dp=%d, reduce=%s, grad_accumulation=%d%s equals serial"):format(name, dp, reduce, accumulation,
    bucket_cap_mb and (", bucket_cap_mb=" .. bucket_cap_mb) or ""), function()
    local worst = check_case(name, reduce, accumulation, bucket_cap_mb)
    if rank == 0 then print(("       worst relative difference %.2e"):format(worst)) end
  end)
end

case("mnist", "mean", 1)
case("mnist", "mean", 2)
case("mnist", "sum", 1, 0.01)   -- many small buckets
case("simple", "sum", 1)
case("simple", "mean", 2)

H.test("the optimizer refuses to step between accumulation passes", function()
  local model = pt.models.mlp { sizes = { 4, 4, 2 } }
  pt.parallelize(model, nil, mesh, { grad_accumulation = 2 })
  local opt = pt.optim.sgd(model, { lr = 0.1 })
  local x = pt.randn(4, 4)
  model(x):sum():backward()
  H.raises(function() opt:step() end, "optimizer step on unsynced gradients: 1 backward pass(es) since the last sync")
  model(x):sum():backward()
  opt:step()
  H.ok(pt.data_parallel(model):synced())
end)

H.test("bucket hooks run around each all-reduce and may change the gradients", function()
  local model = pt.models.mlp { sizes = { 4, 8, 2 } }
  pt.parallelize(model, nil, mesh, { reduce = "sum", bucket_cap_mb = 1e-4 })
  local handle = pt.data_parallel(model)
  local pre, post = {}, {}
  handle:set_pre_hook(function(bucket, grads) pre[#pre + 1] = bucket; return grads * 0 + 1 end)
  handle:set_post_hook(function(bucket, grads) post[#post + 1] = bucket end)
  model(pt.randn(3, 4)):sum():backward()
  H.eq(#pre, handle:buckets(), "a pre-hook call per bucket")
  H.eq(#post, handle:buckets(), "a post-hook call per bucket")
  H.eq(pre[1], 0, "buckets count from 0")
  for _, p in ipairs(model:parameters()) do
    H.ok(p.grad:eq(dp):all():item(), "each rank's ones summed over the group")
  end
  local stats = handle:stats()
  H.eq(stats.syncs, 1)
  H.ok(stats.bytes == 4 * (4 * 8 + 8 + 8 * 2 + 2), "bytes a sync")
end)

H.test("bad parallelize input is refused by name", function()
  local model = pt.models.mlp { sizes = { 4, 2 } }
  H.raises(function() pt.parallelize(model, nil, mesh, { reduce = "median" }) end, "unknown reduce op 'median'")
  H.raises(function() pt.parallelize(model, nil, mesh, { bucket_cap = 1 }) end, "unknown option 'bucket_cap' for parallelize")
  H.raises(function() pt.parallelize(model, nil, mesh, { grad_accumulation = 0 }) end, "grad_accumulation must be >= 1")
  H.raises(function() pt.parallelize(model, nil, 42) end, "mesh expected, got number")
  H.raises(function() pt.parallelize(42, nil, mesh) end, "argument #1 must be a module")
  pt.parallelize(model, nil, mesh)
  H.raises(function() pt.parallelize(model, nil, mesh) end, "already data-parallel")
end)

-- A parameter the forward skips: serial training leaves it without a gradient and the optimizer
-- skips it; synced as zeros, AdamW's moments and decay had moved it (1.6e-1 after 4 steps, exit
-- 0). In the tests below `extra` is used on some steps only, `other` on data rank 0 only (the
-- mean still reaches every rank), `never` never. ZeRO skips such a parameter too (it had refused
-- the step).
local Skips = pt.nn.Module "Skips"
function Skips:__init()
  self.fc = pt.nn.Linear(4, 3); self.extra = pt.nn.Linear(3, 3); self.other = pt.nn.Linear(3, 3)
  self.never = pt.nn.Linear(3, 3)
end
function Skips:forward(x)
  local h = self.fc(x)
  if self.use_extra then h = self.extra(h) end
  if self.use_other then h = self.other(h) end
  return h
end

-- `zero`: nil, or ZeRO's stage over zero groups of 2 (its optimizer leaves the pieces of a
-- parameter without a gradient unstepped, with their own step counts).
local function trains_skipping_like_serial(zero, optimizer)
  pt.manual_seed(1); local serial = Skips():to("float64")
  local zmesh = zero and pt.mesh { zero = 2 } or mesh
  pt.manual_seed(1)
  local model = pt.parallelize(Skips():to("float64"), nil, zmesh, zero and { zero = { stage = zero } } or nil)
  local make = optimizer or function(m) return pt.optim.adamw(m, { lr = 0.1, weight_decay = 0.1 }) end
  local so, po = make(serial), make(model)
  local d = zmesh:coord().data
  for step = 1, 6 do
    local x, y = pt.randn({ 4 * dp, 4 }):double(), pt.randint(0, 3, { 4 * dp })
    data_group:broadcast(x, 0); data_group:broadcast(y, 0)
    -- extra: used on steps 1 and 4 (its moments and step count wait in between)
    serial.use_extra, model.use_extra = step == 1 or step == 4, step == 1 or step == 4
    -- `other`: serially on data rank 0's rows only; in parallel on data rank 0 only.
    serial.use_other = false
    local head = serial(x:narrow(0, 0, 4))
    serial.use_other = true
    local first = serial(x:narrow(0, 0, 4))
    serial.use_other = false
    local rest = dp > 1 and serial(x:narrow(0, 4, 4 * (dp - 1))) or nil
    local out = rest and pt.cat({ first, rest }, 0) or first
    pt.nn.cross_entropy(out, y):backward()
    H.ok(head, "the serial forward ran")
    model.use_other = d == 0
    if step % 2 == 1 then  -- train_step: the counts ride on the loss's all-reduce
      model:train_step(x:narrow(0, d * 4, 4), y:narrow(0, d * 4, 4))
      if not zero then
        H.eq(model:get("never").weight.grad == nil, true, "never used: no gradient")
        H.eq(model:get("extra").weight.grad == nil, step ~= 1, "extra: a gradient on step 1 only")
      end
    else  -- a hand-written loop: the optimizer's step settles them
      pt.nn.cross_entropy(model(x:narrow(0, d * 4, 4)), y:narrow(0, d * 4, 4)):backward()
    end
    so:step(); po:step()
    if not zero then H.eq(model:get("never").weight.grad == nil, true, "never used: no gradient after step " .. step) end
    so:zero_grad(); po:zero_grad()
  end
  local want = serial:state_dict()
  for name, t in pairs(model:state_dict()) do
    H.near(t, want[name], 1e-10, "parameter " .. name)
  end
end

H.test("a parameter no data rank used keeps no gradient and is not stepped, as in serial training (float64)", function()
  trains_skipping_like_serial(nil)
end)

if dp % 2 == 0 then
  -- ZeRO had refused such a step; stepped as zeros, AdamW's moments and decay move the parameter.
  for _, stage in ipairs { 1, 2 } do
    H.test("ZeRO-" .. stage .. " skips a parameter no data rank used, with its own step count, as serial " ..
           "training does (float64, AdamW and SGD with momentum)", function()
      trains_skipping_like_serial(stage)
      trains_skipping_like_serial(stage, function(m) return pt.optim.sgd(m, { lr = 0.1, momentum = 0.9 }) end)
    end)
  end

  -- Under ZeRO-2 a pass's gradient leaves .grad for the shard: a parameter used in the first of
  -- two train_steps and not the second had been counted unused at the second sync, and its
  -- gradient in the shard dropped without a word. And an opt:step() after opt:zero_grad() with no
  -- backward steps nothing, as serial training (the last sync's flags had stayed).
  H.test("ZeRO-2 steps a parameter used in the first of two train_steps an opt:step() and none after zero_grad, " ..
         "as serial training does (float64)", function()
    pt.manual_seed(1); local serial = Skips():to("float64")
    pt.manual_seed(1)
    local model = pt.parallelize(Skips():to("float64"), nil, pt.mesh { zero = 2 }, { zero = { stage = 2 } })
    local so, po = pt.optim.adamw(serial, { lr = 0.1 }), pt.optim.adamw(model, { lr = 0.1 })
    local d = pt.mesh({ zero = 2 }):coord().data
    for step = 1, 3 do
      for half = 1, 2 do
        local x, y = pt.randn({ 4 * dp, 4 }):double(), pt.randint(0, 3, { 4 * dp })
        data_group:broadcast(x, 0); data_group:broadcast(y, 0)
        serial.use_extra, model.use_extra = half == 1, half == 1
        pt.nn.cross_entropy(serial(x), y):backward()
        model:train_step(x:narrow(0, d * 4, 4), y:narrow(0, d * 4, 4))
      end
      so:step(); po:step()
      so:zero_grad(); po:zero_grad()
      so:step(); po:step()  -- no gradient at all: nothing moves
    end
    local want = serial:state_dict()
    for name, t in pairs(model:state_dict()) do H.near(t, want[name], 1e-10, "parameter " .. name) end
  end)

  -- A hand-written loop's sync leaves its counts in flight; a zero_grad before the step had left
  -- them to be settled by it, so the zeroed parameters counted as used: stepped on zeros under
  -- ZeRO-2 (moments and decay moving them), on the bucket's old part under ZeRO-1.
  for _, zero in ipairs { { stage = 1 }, { stage = 1, reduce_scatter = false }, { stage = 2 } } do
    H.test(("ZeRO-%d%s: backward, zero_grad, then a step moves nothing, as serial training"):format(zero.stage,
           zero.reduce_scatter == false and " (reduce_scatter = false)" or ""), function()
      pt.manual_seed(1)
      local model = pt.parallelize(Skips():to("float64"), nil, pt.mesh { zero = 2 }, { zero = zero })
      local opt = pt.optim.adamw(model, { lr = 0.1, weight_decay = 0.1 })
      model.use_extra = true
      for step = 1, 2 do  -- state in the optimizer first, so that a step on zeros would move things
        pt.nn.cross_entropy(model(pt.randn({ 4, 4 }):double()), pt.randint(0, 3, { 4 })):backward()
        opt:step(); opt:zero_grad()
      end
      local before = {}
      for name, t in pairs(model:state_dict()) do before[name] = t:clone() end
      pt.nn.cross_entropy(model(pt.randn({ 4, 4 }):double()), pt.randint(0, 3, { 4 })):backward()
      opt:zero_grad()
      opt:step()
      for name, t in pairs(model:state_dict()) do H.ok(t:equal(before[name]), name .. " unchanged") end
    end)
  end

  H.test("a checkpoint whose parameter stepped fewer times than the optimizer resumes under data parallelism " ..
         "and under ZeRO-1 and ZeRO-2, whichever saved it, as if never interrupted", function()
    local dir = "/tmp/partrain-test-dp-steps-" .. (os.getenv("MASTER_PORT") or "0")
    local function make(zero)
      pt.manual_seed(1)
      local m = pt.parallelize(Skips():to("float64"), nil, zero and pt.mesh { zero = 2 } or mesh,
                               zero and { zero = { stage = zero } } or nil)
      return m, pt.optim.adamw(m, { lr = 0.1 })
    end
    local function go_on(m, opt)  -- a step that uses `extra`, whose state is a step behind
      m.use_extra = true
      m:train_step(pt.ones({ 4, 4 }):double(), pt.tensor({ 0, 1, 2, 0 }, { dtype = "int64" }))
      opt:step(); opt:zero_grad()
    end
    for _, saver in ipairs { false, 1, 2 } do
      local model, opt = make(saver)
      for step = 1, 2 do
        pt.manual_seed(10 + step)
        model.use_extra = step == 1
        model:train_step(pt.randn({ 4, 4 }):double(), pt.randint(0, 3, { 4 }))
        opt:step(); opt:zero_grad()
      end
      pt.ckpt.save(dir, { model = model, optim = opt, step = 2, overwrite = true })
      go_on(model, opt)
      local want = model:state_dict()
      for _, loader in ipairs { false, 1, 2 } do
        local again, again_opt = make(loader)
        pt.ckpt.load(dir, { model = again, optim = again_opt })
        go_on(again, again_opt)
        for name, t in pairs(again:state_dict()) do
          H.near(t, want[name], 1e-12, ("%s: saved %s, loaded %s, as if never interrupted"):format(name,
            saver and "at ZeRO-" .. saver or "without ZeRO", loader and "at ZeRO-" .. loader or "without ZeRO"))
        end
      end
    end
    if rank == 0 then os.execute("rm -rf '" .. dir .. "'") end
  end)
end

-- Rank 0 writes the file; the others had returned at once, and one reading it next found the
-- previous export (or none), exit 0.
H.test("export_safetensors returns on every rank once the file is in place; a failed write fails every rank", function()
  local path = "/tmp/partrain-test-export-" .. (os.getenv("MASTER_PORT") or "0") .. ".safetensors"
  pt.manual_seed(3)
  local model = pt.models.mlp { sizes = { 4, 6, 3 } }
  for i = 1, 5 do
    pt.no_grad(function() model:get("0").weight:fill_(i) end)
    pt.ckpt.export_safetensors(model, path)
    local fresh = pt.models.mlp { sizes = { 4, 6, 3 } }
    pt.ckpt.import_safetensors(fresh, path)
    H.ok(fresh:get("0").weight:equal(model:get("0").weight), "export " .. i .. " is the one every rank reads")
    pt.dist.barrier()  -- every rank has read export i before rank 0 writes export i + 1 over it
  end
  H.raises(function() pt.ckpt.export_safetensors(model, "/nonexistent-folder/x.safetensors") end, "/nonexistent-folder")
  if rank == 0 then os.remove(path) end
end)

H.run()
