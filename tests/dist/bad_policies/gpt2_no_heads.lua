-- policies/gpt2.lua without the division of the attention heads: every other layer splits, so
-- each rank would compute all heads from half of q, k and v. Refused, from Lua and from C++; the
-- `return P.policy {` line below is named although the tail call drops this file's frame.
local P = require "partrain.policy"

return P.policy {
  name = "gpt2-no-heads",
  targets = { "GPT2" },
  modules = {
    GPT2Block = {
      replace = {
        { "ln_1",        P.norm {} },
        { "attn.c_attn", P.column { fused = 3 } },
        { "attn.c_proj", P.row {} },
        { "ln_2",        P.norm {} },
        { "mlp.c_fc",    P.column {} },
        { "mlp.c_proj",  P.row {} },
      },
    },
    GPT2 = { replace = { { "wte", P.vocab_embedding {} }, { "ln_f", P.norm {} }, { "lm_head", P.vocab_head {} } } },
  },
  ties = { { "lm_head.weight", "wte.weight" } },
}
