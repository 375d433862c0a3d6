-- Tensor parallelism for pt.models.mlp: the first Linear splits its outputs, the second its
-- inputs, so the hidden layer between them lives split across the tensor group and only the
-- second layer's output is summed. Layers after the second stay replicated.
local P = require "partrain.policy"

return P.policy {
  name = "mlp",
  targets = { "MLP" },
  modules = {
    MLP = { replace = { { "0", P.column {} }, { "2", P.row {} } } },
  },
}
