-- Tensor parallelism for GPT-2 (pt.models.gpt2), Megatron's split: each block's attention heads
-- and MLP are divided across the tensor group (q, k and v of a head stay together), the
-- vocabulary is split in the embedding and the tied output head, and the loss is computed from
-- split logits without gathering them.
local P = require "partrain.policy"

return P.policy {
  name = "gpt2",
  targets = { "GPT2" },
  modules = {
    GPT2Block = {
      attributes = { ["attn.n_head"] = P.divide_by_tensor },   -- heads this rank computes
      replace = {
        { "attn.c_attn", P.column { fused = 3 } },
        { "attn.c_proj", P.row {} },
        { "mlp.c_fc",    P.column {} },
        { "mlp.c_proj",  P.row {} },
      },
    },
    GPT2 = {
      replace = {
        { "wte",     P.vocab_embedding {} },
        { "lm_head", P.vocab_head {} },
      },
    },
  },
  pipeline = { blocks = "h", first = { "wte", "wpe" }, last = { "ln_f", "lm_head" } },
  postprocess = function(model, cfg) P.tie(model, "lm_head.weight", "wte.weight") end,
}
