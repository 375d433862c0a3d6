-- Expert parallelism's all-to-all bytes against the analytic count, for bench/moe: a Mixtral-style
-- LLaMA with its experts split over every rank (pt.mesh { expert = ranks }) trains a few steps
-- with a router forced balanced (token t to experts t, t+1 mod E) and one forced skewed (most
-- tokens to expert 0), and the expert group's traffic is compared with what the layout says:
-- per MoE layer and step, each rank exchanges the counts (E int64), sends its N k routed rows of
-- dim and gets back as many as it received, forward and again backward. Summed over the ranks
-- that is ranks x (8 E + 4 N k dim bytes) whatever the routing; one rank's share follows the
-- routing (balanced: every rank alike). Prints measured, predicted and their ratio, and the
-- median step time of each routing.
--   partrain --nproc-per-node 2 --threads 1 bench/moe_traffic.lua [--steps 5] [--dim 64]
local pt = require "partrain"
local cfg = pt.args { steps = 5, dim = 64, experts = 8, top_k = 2, batch = 4, seq = 64, layers = 2 }
local median = require("timing").median
local world = pt.dist.world_size()
local mesh = pt.mesh { expert = world }
local W = mesh:group("world")
local E, k = cfg.experts, cfg.top_k

local function run(router)
  pt.manual_seed(1)
  local model = pt.parallelize(pt.models.llama { vocab = 256, seq = cfg.seq, dim = cfg.dim, heads = 4, layers = cfg.layers,
                                                 hidden = 2 * cfg.dim, experts = E, top_k = k },
                               "policies.llama", mesh)
  pt.moe.set_router(model, router)
  local opt = pt.optim.adamw(model, { lr = 1e-3 })
  local g = mesh:group("expert")
  g:reset_traffic()
  local times = {}
  for _ = 1, cfg.steps do
    local x = pt.randint(0, 256, { cfg.batch, cfg.seq + 1 })
    local t0 = pt.time()
    model:train_step(x:narrow(1, 0, cfg.seq), x:narrow(1, 1, cfg.seq))
    opt:step(); opt:zero_grad()
    times[#times + 1] = pt.time() - t0
  end
  return g:traffic().all_to_all, median(times)
end

-- Token t to experts (t, t + 1) mod E, weights 1/2 each; or 3 tokens in 4 to expert 0.
local function routing(first_of)
  return function(block, logits)
    local n, idx = logits.shape[1], {}
    for t = 0, n - 1 do
      local e = first_of(t)
      idx[#idx + 1] = e
      idx[#idx + 1] = (e + 1) % E
    end
    return pt.full({ n, 2 }, 0.5), pt.tensor(idx, { dtype = "int64" }):reshape(n, 2)
  end
end
local balanced = routing(function(t) return t % E end)
local skewed = routing(function(t) return t % 4 == 0 and t % E or 0 end)

local rows = cfg.batch * cfg.seq * k                       -- this rank's routed slots a layer
local per_rank = 8 * E + 4 * rows * cfg.dim * 4            -- float32: counts, rows out, back, twice
local predicted = world * cfg.steps * cfg.layers * per_rank
for _, case in ipairs { { "balanced", balanced }, { "skewed", skewed } } do
  local moved, step = run(case[2])
  local mine = pt.tensor({ moved.bytes }, { dtype = "float64" })
  local most = mine:clone()
  W:all_reduce(mine)
  W:all_reduce(most, "max")
  if pt.dist.rank() == 0 then
    print(("%-8s  ranks %d  all-to-all calls %d  bytes over ranks %d  analytic %d  ratio %.4f  busiest rank %.3f of "
           .. "the balanced share  median step %.1f ms"):format(case[1], world, moved.calls, mine:item(), predicted,
           mine:item() / predicted, most:item() / (cfg.steps * cfg.layers * per_rank), step * 1000))
  end
end
