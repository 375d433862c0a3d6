-- A modules key with a pattern's magic character (%): it names no module of the model, and the
-- sharder says so instead of failing inside a pattern match.
local P = require "partrain.policy"

return P.policy {
  name = "magic-key",
  modules = { ["%d"] = { replace = { { "0", P.column {} } } } },
}
