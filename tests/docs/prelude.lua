-- The names the docs' Lua fragments use without defining them, made when a fragment first reads
-- one (a fragment that defines its own never builds ours). tests/docs/test_samples.py runs it
-- with -e before a fragment, in the folder where the doc's samples run (data/ links the corpus).
pt = require "partrain"
local lazy = {
  P = function() return require "partrain.policy" end,
  pipeline = function() return require "partrain.pipeline" end,
  cfg = function() return { vocab = 256, seq = 16, dim = 32, heads = 4, layers = 2 } end,  -- a small GPT-2
  model = function() pt.manual_seed(1); return pt.models.gpt2(cfg) end,
  opt = function() return pt.optim.adamw(model, { lr = 1e-3 }) end,
  mesh = function() return pt.mesh {} end,
  data = function() return pt.data.text { path = "data/kjv.txt", seq = cfg.seq, batch = 8, seed = 1 } end,
  x = function() x, y = data:next(); return x end,   -- one batch: ids (8, seq) and their targets
  y = function() x, y = data:next(); return y end,
  steps = function() return 2 end,
  name = function() return "h.0.attn.c_attn.weight" end,   -- a parameter's name
  context = function() return pt.data.encode("And God said"):view(1, -1) end,  -- (1, T) ids
}
setmetatable(_G, { __index = function(g, key)
  local make = lazy[key]
  if not make then return nil end
  local value = make()
  rawset(g, key, value)
  return value
end })
