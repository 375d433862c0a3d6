-- An unknown field in a policy declared without a tail call: the error names the P.policy line.
local P = require "partrain.policy"

local policy = P.policy {
  name = "local-form",
  modules = { MLP = { replace = { { "0", P.column {} }, { "2", P.row {} } } } },
  postproces = function() end,
}
return policy
