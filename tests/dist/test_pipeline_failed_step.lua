-- A pipeline step that fails part-way leaves what it sent queued between the stages (and, on
-- Gloo, receives posted for what it expected). The next step's receives would take those for
-- its own and train on them, so the pipeline refuses to run another step: at the caller's line,
-- on every rank. (A bad batch is refused by every rank before the step; what is left to fail
-- part-way is the model's own code.) Here the last stage's last block, its forward replaced by
-- one that raises after two good steps, fails in the stage's first forward, after the first stage
-- has sent two micro-batches; the first stage, waiting for a gradient, gives up after --timeout.
--   partrain --nproc-per-node 2 --threads 1 --timeout 3 tests/dist/test_pipeline_failed_step.lua
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, ok, raises = H.test, H.ok, H.raises

local gpt = { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 4 }
local mesh = pt.mesh { pipeline = 2 }

test("after a step that failed part-way, train_step is refused at the caller's line on every rank", function()
  pt.manual_seed(3)
  local model = pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh, { schedule = "1f1b", microbatches = 4 })
  local x, y = pt.zeros({ 8, gpt.seq }, { dtype = "int64" }), pt.ones({ 8, gpt.seq }, { dtype = "int64" })
  model:train_step(x, y)
  model:train_step(x, y)  -- from here on, activations are received as predicted
  local last = mesh:coord().pipeline == 1
  if last then model:get("h.3"):replace_forward(function() error("the block fails on this step") end) end
  raises(function() model:train_step(x, y) end,
    last and "the block fails on this step" or "recv on group 'pipeline[0,1]' (ranks 0,1) failed on rank 0")
  local err = raises(function() model:train_step(x, y) end,
    "an earlier step of this pipeline failed part-way, and what it sent may still be queued between the stages")
  ok(err:find("^[^:]*test_pipeline_failed_step%.lua:%d+:"), "the error names the caller's line: " .. err)
end)

H.run()
