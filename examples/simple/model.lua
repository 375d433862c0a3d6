-- The tutorial's SimpleModel ("Parallelism methods. Model and Data parallelism"): an embedding
-- lookup, a hidden dense layer, a final layer to one number a token, and a mean over tokens.
-- Written in Lua; its children are engine modules, so policies can split its hidden dimension.
local pt = require "partrain"

local SimpleModel = pt.nn.Module "SimpleModel"

function SimpleModel:__init(vocab_size, embedding_dim)
  self.embedding = pt.nn.Embedding(vocab_size, embedding_dim)
  self.hidden_layer = pt.nn.Linear(embedding_dim, embedding_dim)
  self.final_layer = pt.nn.Linear(embedding_dim, 1)
end

function SimpleModel:forward(input_ids)
  local embeddings = self.embedding(input_ids)   -- [batch, seq] -> [batch, seq, dim]
  local out1 = self.hidden_layer(embeddings)     -- [batch, seq, dim]
  local out2 = self.final_layer(out1)            -- [batch, seq, 1]
  local pooled = out2:mean(1)                    -- [batch, 1]
  return pooled:squeeze(-1)                      -- [batch]
end

--- The tutorial's loss: the sum of the outputs ("a weird loss but whatever").
function SimpleModel.loss(outputs) return outputs:sum() end

return SimpleModel
