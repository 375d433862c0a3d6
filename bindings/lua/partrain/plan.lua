--- What happens at a script's first optimizer step when a plan is involved (docs/plan.md).
--- Under `partrain plan` the virtual rank records what it holds and the script stops there;
--- in a run given `--plan FILE`, every rank checks itself against the saved plan there.
local core = require "partrain.core"

local M = {}

--- The error that ends a planned script (the planner knows it by the rank it recorded).
M.STOP = "partrain plan: stopped before the first optimizer step"

-- The model the optimizer trains, all of its optimizers, and its mesh.
local function subject(opt)
  local pt = require "partrain"
  local model = pt.optim.model_of(opt) or pt.parallelized()
  if not model then
    error("the optimizer was made from a table of parameters and no model went through pt.parallelize: make it "
      .. "from the model (pt.optim.adamw(model, ...)) so the plan can name its parameters", 0)
  end
  local optimizers = pt.optim.of(model)
  if not pt.optim.model_of(opt) then optimizers[#optimizers + 1] = opt end  -- made from a table
  return model, optimizers, pt.mesh_of(model) or pt.last_mesh()
end

function M.at_first_step(opt)
  local model, optimizers, mesh = subject(opt)
  if core.plan.planning() then
    core.plan.record(model, optimizers, mesh)
    error(M.STOP, 0)
  end
  local path = os.getenv("PARTRAIN_PLAN")
  local ok, did = pcall(core.plan.check, model, optimizers, mesh, path, os.getenv("PARTRAIN_PLAN_MODE") or "match")
  if not ok then error(tostring(did):gsub("^[^\n]-:%d+: ", ""), 0) end
  if core.dist.rank() == 0 then io.stderr:write("partrain: the run ", did, "\n") end
end

--- A planned script that ended without stepping an optimizer: plan the model it made parallel.
function M.at_end()
  local pt = require "partrain"
  local model = pt.parallelized()
  if not model then
    error("ended without an optimizer step and made no model with pt.parallelize: nothing to plan", 0)
  end
  core.plan.record(model, pt.optim.of(model), pt.mesh_of(model))
end

return M
