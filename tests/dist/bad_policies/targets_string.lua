-- A policy whose targets is a string, not a list of model types; written as the tail call
-- `return P.policy {...}`, which drops this file's frame.
local P = require "partrain.policy"

return P.policy {
  name = "targets-string", targets = "MLP",
  modules = { MLP = { replace = { { "0", P.column {} }, { "2", P.row {} } } } },
}
