-- A Mixtral-style LLaMA trained a few steps with its metrics written: tests/obs/test_experts.py
-- runs it at expert 2 (and at pipeline 2 and tensor 2) on 2 ranks and checks the experts records
-- and the step fields against the batch it gives. pt.progress { model = model } writes them at
-- every logged step; --explicit calls pt.metrics.experts itself every --every steps instead.
--   partrain --nproc-per-node 2 --metrics m.jsonl tests/obs/experts.lua [--capacity 0.5] [--hot 1 --top-k 1]
local pt = require "partrain"
local cfg = pt.args {
  steps = { 4, "steps to train" },
  batch = { 4, "sequences a data rank a step" },
  seq = { 8, "tokens a sequence" },
  experts = { 4, "experts a block" },
  top_k = { 2, "experts a token goes to" },
  capacity = pt.args.number(0, "capacity factor (0: dropless)"),
  hot = { -1, "route every token to this expert and the next top_k - 1 (a Lua router); -1: the gate's router" },
  expert = { 2, "expert-parallel size" },
  pipeline = { 1, "pipeline stages" },
  tensor = { 1, "tensor-parallel size" },
  explicit = { false, "call pt.metrics.experts and pt.log every --every steps (no pt.progress)" },
  every = { 1, "steps between records" },
}

pt.manual_seed(1)
local model = pt.models.llama { vocab = 64, seq = 16, dim = 16, heads = 4, layers = 2, hidden = 24,
                                experts = cfg.experts, top_k = cfg.top_k, capacity_factor = cfg.capacity }
if cfg.hot >= 0 then
  pt.moe.set_router(model, function(_, logits, _)
    local n, rows = logits.shape[1], {}
    for i = 1, n do
      rows[i] = {}
      for j = 1, cfg.top_k do rows[i][j] = (cfg.hot + j - 1) % cfg.experts end
    end
    return pt.full({ n, cfg.top_k }, 1 / cfg.top_k), pt.tensor(rows, { dtype = "int64" })
  end)
end
local mesh = pt.mesh { expert = cfg.expert, pipeline = cfg.pipeline, tensor = cfg.tensor }
model = pt.parallelize(model, "policies.llama", mesh,
                       cfg.pipeline > 1 and { schedule = "1f1b", microbatches = 2 } or nil)
pt.moe.stats(model)  -- what pt.parallelize's own checks ran through the blocks is not training
local opt = pt.optim.adamw(model, { lr = 1e-2 })
local d, n = mesh:coord().data, mesh:size("data")
local progress = not cfg.explicit and pt.progress { total = cfg.steps, every = cfg.every, model = model, memory = false }
for step = 1, cfg.steps do
  pt.manual_seed(100 + step)
  local x = pt.randint(0, 64, { cfg.batch * n, cfg.seq })
  local y = pt.randint(0, 64, { cfg.batch * n, cfg.seq })
  local loss = model:train_step(x:narrow(0, d * cfg.batch, cfg.batch), y:narrow(0, d * cfg.batch, cfg.batch))
  opt:step()
  opt:zero_grad()
  if progress then
    progress:step(step, { loss = loss })
  elseif step % cfg.every == 0 then
    local record = { step = step, loss = loss }
    local fields = pt.metrics.experts(step, model)  -- every rank: a collective
    -- Every rank got the same fields: their sum over the world is the world times rank 0's.
    local check = pt.tensor({ fields.moe_aux_loss, fields.moe_dropped_fraction, fields.moe_max_over_mean },
                            { dtype = "float64" })
    local mine = check:clone()
    mesh:group("world"):all_reduce(check, "sum")
    assert((check - mine * pt.dist.world_size()):abs():max():item() < 1e-12, "the experts fields differ between ranks")
    for k, v in pairs(fields) do record[k] = v end
    pt.log(record)
  end
end
if progress then progress:finish() end
