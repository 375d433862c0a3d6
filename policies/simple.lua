-- Tensor parallelism for the tutorial's SimpleModel (examples/simple/model.lua), split on its
-- hidden dimension as the tutorial's "Model parallelism" section does: hidden_layer keeps
-- embedding_dim / t of its outputs, final_layer the matching inputs, and one all-reduce after
-- final_layer gives every rank the whole output.
local P = require "partrain.policy"

return P.policy {
  name = "simple",
  targets = { "SimpleModel" },
  modules = {
    SimpleModel = { replace = { { "hidden_layer", P.column {} }, { "final_layer", P.row {} } } },
  },
}
