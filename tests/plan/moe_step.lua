-- A Mixtral-style LLaMA's training step (2 blocks of 4 experts, top 2), for checking plans of expert
-- parallelism against real runs.
--   partrain plan --world 2 tests/plan/moe_step.lua --expert 2                       (the plan)
--   partrain --nproc-per-node 2 tests/plan/moe_step.lua --expert 2 --report DIR      (a real run)
-- A real run writes DIR/rank<N>.json: what the expert group moved during one model:train_step
-- (its all-to-alls' calls and bytes), what the data x context group all-reduced (the router's
-- load-balancing counts among them), the bytes of this rank's expert tensors and what
-- pt.memory_report() says after the step. --router balanced routes token t of a rank to experts
-- t mod E and t + 1 mod E (weights 1/2), so that every expert gets the same rows: the routing the
-- planner assumes.
local pt = require "partrain"

local cfg = pt.args {
  expert = 1,
  experts = 4,
  top_k = 2,
  batch = 8,         -- the global batch, in sequences
  router = "",       -- "balanced": the router above; "": the model's own (Mixtral's)
  report = "",       -- a folder for the real run's measurements
  threads = 1,
}
pt.set_threads(cfg.threads)
pt.manual_seed(1)
local SEQ, VOCAB = 16, 64
local mesh = pt.mesh { expert = cfg.expert }
local model = pt.models.llama { vocab = VOCAB, seq = SEQ, dim = 16, heads = 4, layers = 2, hidden = 24,
                                experts = cfg.experts, top_k = cfg.top_k }
if cfg.router == "balanced" then
  pt.moe.set_router(model, function(_, logits, _)
    local n, rows = logits.shape[1], {}
    for t = 0, n - 1 do
      rows[t + 1] = {}
      for j = 0, cfg.top_k - 1 do rows[t + 1][j + 1] = (t + j) % cfg.experts end
    end
    return pt.full({ n, cfg.top_k }, 1 / cfg.top_k), pt.tensor(rows, { dtype = "int64" })
  end)
end
model = pt.parallelize(model, "policies.llama", mesh)
local opt = pt.optim.adamw(model, { lr = 1e-3 })
local local_batch = math.floor(cfg.batch / mesh:size("data"))
local tokens = pt.randint(0, VOCAB, { local_batch, SEQ + 1 })
local x, y = tokens:narrow(1, 0, SEQ):contiguous(), tokens:narrow(1, 1, SEQ):contiguous()

local expert, replicas = mesh:group("expert"), mesh:group("data_context")
expert:reset_traffic()
replicas:reset_traffic()
model:train_step(x, y)
local moved, reduced = expert:traffic(), replicas:traffic()
opt:step()

if cfg.report ~= "" then
  local experts = 0  -- this rank's part of the stacked experts
  for name, p in pairs(model:state_dict()) do
    if name:match("%.experts%.w[123]$") then experts = experts + p:numel() * p:element_size() end
  end
  local r = pt.memory_report(model)
  local a2a, ar = moved.all_to_all or {}, reduced.all_reduce or {}
  local f = assert(io.open(("%s/rank%d.json"):format(cfg.report, pt.dist.rank()), "w"))
  f:write(('{"params": %d, "grads": %d, "optimizer": %d, "master": %d, "expert_param_bytes": %d, '
    .. '"all_to_all_calls": %d, "all_to_all_bytes": %d, "all_reduce_calls": %d, "all_reduce_bytes": %d}\n'):format(
    r.params, r.grads, r.optimizer, r.master, experts, a2a.calls or 0, a2a.bytes or 0, ar.calls or 0, ar.bytes or 0))
  f:close()
end
