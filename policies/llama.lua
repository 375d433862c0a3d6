-- Tensor parallelism for LLaMA (pt.models.llama), Megatron's split: each block's query heads and
-- key/value heads are divided across the tensor group (q_proj, k_proj and v_proj column-split,
-- each into its own parts, so grouped-query attention keeps every query head with its key/value
-- head; o_proj row-split), the SwiGLU MLP likewise (gate_proj, up_proj column, down_proj row),
-- the vocabulary split in the embedding and the output head, and the loss computed from split
-- logits without gathering them. The tensor size must divide kv_heads.
--
-- With sequence_parallel, activations between those regions stay split along the sequence: the
-- RMSNorms run on T/t positions a rank (their gradients summed over the group), the column layers
-- all-gather the sequence and the row layers reduce-scatter it, and LLaMA's forward is replaced so
-- the embedding is split along the sequence before the first block.
local pt = require "partrain"
local P = require "partrain.policy"

-- Under context parallelism the ids are this rank's chunks of a sequence context times as long
-- (the attention rotates them at their global positions).
local function sequence_parallel_forward(group)
  return function(self, ids)
    local T, seq = ids.shape[2] * self:attribute("context"), self:attribute("seq")
    if T > seq then error(("Llama: sequence of %d tokens is longer than seq=%d"):format(T, seq)) end
    local x = pt.tp.split_sequence(self.embed_tokens(ids), group)
    return self.lm_head(self.norm(self.layers(x)))
  end
end

return P.policy {
  name = "llama",
  targets = { "Llama" },
  modules = function(cfg)
    local modules = {
      LlamaBlock = {
        attributes = {
          ["self_attn.heads"] = P.divide_by_tensor,     -- query heads this rank computes
          ["self_attn.kv_heads"] = P.divide_by_tensor,  -- key/value heads this rank holds
          ["self_attn.flash_attention"] = cfg.flash_attention,
        },
        replace = {
          { "input_layernorm",          P.norm {} },
          { "self_attn.q_proj",         P.column {} },
          { "self_attn.k_proj",         P.column {} },
          { "self_attn.v_proj",         P.column {} },
          { "self_attn.o_proj",         P.row {} },
          { "post_attention_layernorm", P.norm {} },
        },
      },
      -- A mixture of experts (Mixtral's block_sparse_moe): each expert's hidden width split over
      -- the tensor ranks when the model is parallelized (w1, w3 by rows, w2 by columns), its gate
      -- whole; expert parallelism splits the experts between ranks besides.
      MoE = {
        optional = true,
        attributes = { tensor_parallel = true },
      },
      -- A dense block's MLP.
      LlamaMLP = {
        optional = true,
        replace = {
          { "gate_proj", P.column {} },
          { "up_proj",   P.column {} },
          { "down_proj", P.row {} },
        },
      },
      Llama = {
        replace = {
          { "embed_tokens", P.vocab_embedding {} },
          { "norm",         P.norm {} },
          { "lm_head",      P.vocab_head {} },
        },
      },
    }
    if cfg.sequence_parallel then
      modules.Llama.methods = { forward = sequence_parallel_forward(cfg.group) }
    end
    return modules
  end,
  pipeline = { blocks = "layers", first = { "embed_tokens" }, last = { "norm", "lm_head" } },
  -- A tied head (tie = true) stays tied to the embedding's parts; an untied one stays untied.
  ties = { { "lm_head.weight", "embed_tokens.weight" } },
}
