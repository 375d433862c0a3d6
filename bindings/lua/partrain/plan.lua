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

-- Bytes as partrain plan prints them (KiB, MiB, GiB: powers of 1024).
local function bytes_text(n)
  local units, i = { "B", "KiB", "MiB", "GiB", "TiB" }, 1
  while n >= 1024 and i < #units do n, i = n / 1024, i + 1 end
  return i == 1 and ("%d B"):format(n) or ("%.2f %s"):format(n, units[i])
end

--- A plan as Lua source a schedule can return (what `partrain plan --pipeline-search` prints).
function M.plan_source(plan, pp)
  local P = require "partrain.pipeline"
  local lines = { "return {" }
  if plan.name then lines[#lines + 1] = ("  name = %q,"):format(plan.name) end
  if plan.layout then lines[#lines + 1] = ("  layout = %q,"):format(plan.layout) end
  for r = 0, pp - 1 do
    local words = {}
    for _, a in ipairs(plan[r]) do words[#words + 1] = ("%q"):format(P.format(a)) end
    lines[#lines + 1] = ("  [%d] = { %s },"):format(r, table.concat(words, ", "))
  end
  lines[#lines + 1] = "}"
  return table.concat(lines, "\n")
end

--- `partrain plan --pipeline-search`: the schedules pipeline.search weighs for the planned
--- stages, and the one it picks as Lua source. `t`: { pp, microbatches, blocks, cap (activation
--- bytes a rank may hold), activation and pending (bytes a micro-batch holds on a rank's stage at
--- one chunk a rank), pending_measured (whether the planned schedule split its backward) }.
function M.pipeline_search(t)
  local P = require "partrain.pipeline"
  local chunks = {}
  for _, c in ipairs { 1, 2 } do if t.pp * c <= t.blocks then chunks[#chunks + 1] = c end end
  local out = {}
  local function say(fmt, ...) out[#out + 1] = fmt:format(...) end
  say("pipeline search: pipeline %d, %d micro-batches, activations up to %s a rank; a micro-batch holds %s of "
    .. "activations a stage and %s for its W (%s); times in units (F = B = W = 1 a stage)", t.pp, t.microbatches,
    bytes_text(t.cap), bytes_text(t.activation), bytes_text(t.pending),
    t.pending_measured and "measured" or "not measured: the planned schedule splits no backward, so the activations, an upper bound")
  local ok, found = pcall(P.search, { stages = t.pp, microbatches = t.microbatches, memory = t.cap, chunks = chunks,
                                      memory_model = { activation = t.activation, pending = t.pending } })
  if not ok then
    say("  %s", tostring(found))
    return table.concat(out, "\n") .. "\n", false
  end
  say("  %-22s %-6s %-10s %-8s %-14s %s", "schedule", "chunks", "step", "bubble", "peak a rank", "fits")
  for _, c in ipairs(found.candidates) do
    say("  %-22s %-6d %-10.2f %-8.4f %-14s %s", c.name, c.chunks, c.makespan, c.bubble, bytes_text(c.memory),
      c.fits and "yes" or "no")
  end
  say("picked: %s (%d chunk%s a rank): step %.2f units, bubble %.4f, peak %s a rank. Its plan, to keep and edit "
    .. "(pt.parallelize { schedule = function() return dofile('plan.lua') end, chunks = %d, ... }):", found.name,
    found.chunks, found.chunks == 1 and "" or "s", found.makespan, found.bubble, bytes_text(found.memory), found.chunks)
  say("%s", M.plan_source(found.plan, t.pp))
  return table.concat(out, "\n") .. "\n", true
end

return M
