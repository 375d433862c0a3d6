-- A policy written as a plain table (no P.policy): checked when applied, with the file and
-- line of the pt.parallelize call that applies it.
local P = require "partrain.policy"

return {
  name = "plain", targets = { "MLP" },
  modules = { MLP = { replace = { ["0"] = P.column {}, ["2"] = P.row {} } } },
}
