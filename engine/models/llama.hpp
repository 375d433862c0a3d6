// LLaMA as a module tree with Hugging Face's names and layouts (embed_tokens, layers.N.input_layernorm,
// layers.N.self_attn.{q,k,v,o}_proj, layers.N.post_attention_layernorm, layers.N.mlp.{gate,up,down}_proj,
// norm, lm_head; Hugging Face puts "model." before all but lm_head): RMSNorm, rotary embeddings in
// Hugging Face's rotate-half layout, grouped-query attention (kv_heads < heads), a SwiGLU MLP, and
// a head untied or tied to the embedding. Hugging Face LLaMA weights map onto it unchanged.
#pragma once

#include "engine/nn/layers.hpp"
#include "engine/parallel/context_parallel.hpp"
#include "engine/parallel/moe.hpp"

namespace partrain::models {

using torch::Tensor;

struct LlamaOptions {
  int64_t vocab = 32000;    ///< tokens
  int64_t seq = 2048;       ///< the longest sequence (max_position_embeddings)
  int64_t dim = 4096;       ///< model width (hidden_size)
  int64_t heads = 32;       ///< query heads (num_attention_heads); must divide dim
  int64_t kv_heads = 0;     ///< key/value heads (num_key_value_heads); 0: heads (no grouping); must divide heads
  int64_t layers = 32;      ///< blocks (num_hidden_layers)
  int64_t hidden = 0;       ///< the MLP's width (intermediate_size); 0: 8·dim/3 rounded up to a multiple of 32
  double eps = 1e-6;        ///< RMSNorm epsilon (rms_norm_eps)
  double rope_base = 10000; ///< rotary base (rope_theta)
  bool tie = false;         ///< lm_head shares embed_tokens' weight (tie_word_embeddings)
  bool flash_attention = false;  ///< fused attention kernel where LibTorch has one (2.x)
  /// Mixtral: experts > 0 makes every block's MLP a mixture of `experts` SwiGLU experts of width
  /// `hidden` (block_sparse_moe), each token routed to `top_k` of them.
  int64_t experts = 0;           ///< num_local_experts; 0: dense
  int64_t top_k = 2;             ///< num_experts_per_tok
  bool normalize = true;         ///< renormalise the top-k weights (Qwen2-MoE's norm_topk_prob)
  double aux_loss = 0.01;        ///< load-balancing loss coefficient (router_aux_loss_coef)
  double z_loss = 0.0;           ///< router z-loss coefficient
  double capacity_factor = 0.0;  ///< 0: dropless
  torch::ScalarType dtype = torch::kFloat32;  ///< parameters and compute (initialized in float32, then cast)
};

/// Causal self-attention with rotary embeddings and grouped-query heads: q_proj (dim -> heads·hd),
/// k_proj and v_proj (dim -> kv_heads·hd), o_proj (heads·hd -> dim), no biases. `heads` and
/// `kv_heads` are what this module computes (a policy divides both under tensor parallelism);
/// `head_dim` is the serial model's dim / heads.
class LlamaAttention : public nn::Unary, public parallel::ContextSplit {
 public:
  explicit LlamaAttention(const LlamaOptions& o);
  Tensor forward(const Tensor& x) override;  // (B, T, dim) -> (B, T, dim)
  std::string extra_repr() const override;
  /// "heads", "kv_heads": the heads this module computes; "flash_attention" (0 or 1).
  c10::optional<double> attribute(const std::string& name) const override;
  void set_attribute(const std::string& name, double value) override;
  std::vector<std::string> attribute_names() const override { return {"heads", "kv_heads", "flash_attention"}; }
  /// q_proj gives heads·hd features here, k_proj and v_proj kv_heads·hd; o_proj takes what the heads give.
  void check(const std::string& path) const override;
  c10::optional<nn::Features> input_features() const override { return child("q_proj")->input_features(); }
  c10::optional<nn::Features> output_features() const override { return child("o_proj")->output_features(); }
  /// Under context parallelism: this rank's rows of the sequence (rotated at their global
  /// positions), attention over all of them.
  bool attends() const override { return true; }
  int64_t heads, kv_heads, head_dim;
  double rope_base;
  bool flash_attention;
};

/// down_proj(silu(gate_proj(x)) * up_proj(x)), no biases.
class LlamaMlp : public nn::Unary {
 public:
  explicit LlamaMlp(const LlamaOptions& o);
  Tensor forward(const Tensor& x) override;
  void check(const std::string& path) const override;
  c10::optional<nn::Features> input_features() const override { return child("gate_proj")->input_features(); }
  c10::optional<nn::Features> output_features() const override { return child("down_proj")->output_features(); }
};

/// x + self_attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)); with experts,
/// block_sparse_moe (a parallel::MoE) in place of mlp.
class LlamaBlock : public nn::Unary {
 public:
  explicit LlamaBlock(const LlamaOptions& o);
  Tensor forward(const Tensor& x) override;
  /// The feed-forward branch's name: "mlp", or "block_sparse_moe" with experts.
  const char* ffn() const;
  /// The branches give whole features; sequence parallelism is on for every layer of the block or none.
  void check(const std::string& path) const override;
};

/// Token ids (B, T) -> logits (B, T, vocab).
class Llama : public nn::Unary, public parallel::ContextSplit {
 public:
  explicit Llama(const LlamaOptions& o);
  Tensor forward(const Tensor& ids) override;
  /// embed_tokens(ids) (B, T) -> (B, T, dim); and norm then lm_head -> (B, T, vocab).
  Tensor embed(const Tensor& ids);
  Tensor head(const Tensor& x);
  /// A pipeline's stage ends: embed and head; under sequence parallelism the embedding split along
  /// the sequence, as the forward policies/llama.lua installs.
  bool has_stage_ends() const override { return true; }
  bool check_batch(const Tensor& x, const Tensor& y, const std::string& loss, int64_t ignore_index) override;
  Tensor stage_in(const Tensor& ids) override;
  Tensor stage_out(const Tensor& x) override { return head(x); }
  std::string extra_repr() const override;
  /// Hugging Face's initialization by name: N(0, 0.02) for every Linear and the embedding, RMSNorm weights 1.
  bool init_tensor(const std::string& path, Tensor& t, at::Generator& gen) const override;
  /// Read-only: "seq" (the longest sequence), for a replaced forward to check as this one does;
  /// "tie" (1: lm_head shares embed_tokens' weight), for the policy to keep the tie; "context"
  /// (the context ranks its sequence is split over, 1 when not).
  c10::optional<double> attribute(const std::string& name) const override;
  std::vector<std::string> attribute_names() const override { return {"seq", "tie", "context"}; }
  /// Its options but dtype, kv_heads and hidden as built (0 resolved); heads, kv_heads, eps and
  /// rope_base fixed.
  std::vector<nn::ConfigField> config() const override;
  /// Only lm_head may be a vocabulary head; the blocks, norm and lm_head agree on sequence
  /// parallelism, which needs a forward that splits the sequence.
  void check(const std::string& path) const override;
  LlamaOptions options;
};

/// Builds LLaMA and initializes it by name (nn::build_initialized), on the meta device when
/// parameter_options() say so (pt.deferred).
nn::ModulePtr llama(const LlamaOptions& options);

}  // namespace partrain::models
