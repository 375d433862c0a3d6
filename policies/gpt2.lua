-- Tensor parallelism for GPT-2 (pt.models.gpt2), Megatron's split: each block's attention heads
-- and MLP are divided across the tensor group (q, k and v of a head stay together), the
-- vocabulary is split in the embedding and the tied output head, and the loss is computed from
-- split logits without gathering them.
--
-- With sequence_parallel, activations between those regions stay split along the sequence: the
-- LayerNorms run on T/t positions a rank (their gradients summed over the group), the column
-- layers all-gather the sequence and the row layers reduce-scatter it, and GPT-2's forward is
-- replaced so the embeddings' sum is split along the sequence before the first block.
local pt = require "partrain"
local P = require "partrain.policy"

-- GPT-2's forward with the sequence split after the embeddings' dropout: each rank keeps its part
-- of the mask the whole sequence draws, so the parts differ as the unsplit model's do. Under
-- context parallelism the ids are this rank's chunks of a longer sequence: their positions are
-- the chunks', and the mask is drawn for the whole sequence (the model says it is split once
-- pt.parallelize has given it the context group, after the policy's probe).
local function sequence_parallel_forward(group, context)
  return function(self, ids)
    local c = self:attribute("context")
    local T, seq = ids.shape[2], self:attribute("seq")
    if T * c > seq then error(("GPT2: sequence of %d tokens is longer than seq=%d"):format(T * c, seq)) end
    local positions = c > 1 and pt.cp.positions(T, context) or pt.arange(T, { device = ids.device })
    local x = self.wte(ids) + self.wpe(positions)
    local p, training = self:attribute("dropout"), self:is_training()
    x = pt.tp.split_sequence(c > 1 and pt.cp.dropout(x, p, training, context) or x:dropout(p, training), group)
    return self.lm_head(self.ln_f(self.h(x)))
  end
end

return P.policy {
  name = "gpt2",
  targets = { "GPT2" },
  modules = function(cfg)
    local modules = {
      GPT2Block = {
        attributes = {
          ["attn.n_head"] = P.divide_by_tensor,   -- heads this rank computes
          ["attn.flash_attention"] = cfg.flash_attention,
        },
        replace = {
          { "ln_1",        P.norm {} },
          { "attn.c_attn", P.column { fused = 3 } },
          { "attn.c_proj", P.row {} },
          { "ln_2",        P.norm {} },
          { "mlp.c_fc",    P.column {} },
          { "mlp.c_proj",  P.row {} },
        },
      },
      GPT2 = {
        replace = {
          { "wte",     P.vocab_embedding {} },
          { "ln_f",    P.norm {} },
          { "lm_head", P.vocab_head {} },
        },
      },
    }
    if cfg.sequence_parallel then
      modules.GPT2.methods = { forward = sequence_parallel_forward(cfg.group, cfg.context) }
    end
    return modules
  end,
  pipeline = { blocks = "h", first = { "wte", "wpe" }, last = { "ln_f", "lm_head" } },
  ties = { { "lm_head.weight", "wte.weight" } },  -- the head and the embedding share their parts
}
