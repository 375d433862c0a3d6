// GPT-2 as a module tree with Hugging Face's names and parameter layouts (wte, wpe, h.N.ln_1,
// h.N.attn.c_attn (fused q, k, v), h.N.attn.c_proj, h.N.ln_2, h.N.mlp.c_fc, h.N.mlp.c_proj, ln_f,
// lm_head tied to wte), GELU with the tanh approximation and GPT-2's initialization, so that HF
// GPT-2 weights map onto it. One difference: HF's Conv1D stores weights [in, out]; these Linear
// layers store [out, in], and import/export transposes.
#pragma once

#include "engine/nn/layers.hpp"
#include "engine/parallel/context_parallel.hpp"

namespace partrain::models {

using torch::Tensor;

struct Gpt2Options {
  int64_t vocab = 50257;   ///< tokens
  int64_t seq = 1024;      ///< positions (context length)
  int64_t dim = 768;       ///< model width
  int64_t heads = 12;      ///< attention heads; must divide dim
  int64_t layers = 12;     ///< blocks
  double dropout = 0.0;    ///< on embeddings, attention probabilities and residual branches
  double attn_dropout = -1;  ///< on the attention probabilities alone; < 0: `dropout`
  double eps = 1e-5;       ///< LayerNorm epsilon
  bool flash_attention = false;  ///< fused attention kernel where LibTorch has one (2.x)
  torch::ScalarType dtype = torch::kFloat32;  ///< parameters and compute (initialized in float32, then cast)
};

/// Causal self-attention: c_attn makes q, k, v (fused, [3*dim, dim]); c_proj mixes the heads.
/// `heads` is the number of heads this module computes (a policy divides it under tensor
/// parallelism); each head is `head_dim` = dim / heads (of the serial model) wide, so c_attn
/// must give 3 * heads * head_dim features: forward and check() refuse anything else.
class Gpt2Attention : public nn::Unary, public parallel::ContextSplit {
 public:
  Gpt2Attention(const Gpt2Options& o);
  Tensor forward(const Tensor& x) override;  // (B, T, dim) -> (B, T, dim)
  std::string extra_repr() const override;
  /// "heads" (Hugging Face calls it n_head): the heads this module computes;
  /// "flash_attention" (0 or 1): use the fused attention kernel where LibTorch has one.
  c10::optional<double> attribute(const std::string& name) const override;
  void set_attribute(const std::string& name, double value) override;
  std::vector<std::string> attribute_names() const override { return {"heads", "flash_attention"}; }
  /// heads x head_dim = the width of q that c_attn gives here; q, k and v of a head on one rank;
  /// c_proj takes what the heads give.
  void check(const std::string& path) const override;
  c10::optional<nn::Features> input_features() const override { return child("c_attn")->input_features(); }
  c10::optional<nn::Features> output_features() const override { return child("c_proj")->output_features(); }
  /// Under context parallelism: this rank's rows of the sequence, attention over all of them.
  bool attends() const override { return true; }
  int64_t heads;
  int64_t head_dim;
  double dropout;       ///< on the residual branch
  double attn_dropout;  ///< on the attention probabilities
  bool flash_attention;
};

/// c_fc (dim -> 4 dim), GELU (tanh), c_proj (4 dim -> dim).
class Gpt2Mlp : public nn::Unary, public parallel::ContextSplit {
 public:
  Gpt2Mlp(const Gpt2Options& o);
  Tensor forward(const Tensor& x) override;
  void check(const std::string& path) const override;  // c_proj takes what c_fc gives
  c10::optional<nn::Features> input_features() const override { return child("c_fc")->input_features(); }
  c10::optional<nn::Features> output_features() const override { return child("c_proj")->output_features(); }
  double dropout;
};

/// x + attn(ln_1(x)), then x + mlp(ln_2(x)).
class Gpt2Block : public nn::Unary {
 public:
  Gpt2Block(const Gpt2Options& o);
  Tensor forward(const Tensor& x) override;
  /// The residual branches give whole features; sequence parallelism is on for all of ln_1,
  /// attn.c_attn, attn.c_proj, ln_2, mlp.c_fc and mlp.c_proj or for none of them.
  void check(const std::string& path) const override;
};

/// Token ids (B, T) -> logits (B, T, vocab).
class Gpt2 : public nn::Unary, public parallel::ContextSplit {
 public:
  explicit Gpt2(const Gpt2Options& o);
  Tensor forward(const Tensor& ids) override;
  /// The two ends of forward, for a pipeline's first and last stages: the embeddings' sum (with
  /// dropout) of the ids (B, T) -> (B, T, dim), and ln_f then lm_head -> (B, T, vocab).
  /// forward(ids) is head(h(embed(ids))).
  Tensor embed(const Tensor& ids);
  /// wte(ids) + wpe(positions), before dropout: what embed and stage_in share.
  Tensor embeddings(const Tensor& ids);
  Tensor head(const Tensor& x);
  /// A pipeline's stage ends: embed and head, and under sequence parallelism (its layers split
  /// the sequence; the forward policies/gpt2.lua installs) the embeddings' sum split along the
  /// sequence before dropout, as that forward does: its blocks and ln_f then see T/t positions
  /// and lm_head gathers them.
  bool has_stage_ends() const override { return true; }
  bool check_batch(const Tensor& x, const Tensor& y, const std::string& loss, int64_t ignore_index) override;
  Tensor stage_in(const Tensor& ids) override;
  Tensor stage_out(const Tensor& x) override { return head(x); }
  std::string extra_repr() const override;
  /// GPT-2's initialization by name: N(0, 0.02) weights, N(0, 0.02/sqrt(2 layers)) for the
  /// residual projections (c_proj), N(0, 0.01) for wpe, zero biases, LayerNorm at (1, 0).
  bool init_tensor(const std::string& path, Tensor& t, at::Generator& gen) const override;
  /// Read-only: "dropout" (on the embeddings' sum), "seq" (the context length) and "context"
  /// (the context ranks its sequence is split over, 1 when not), for a replaced forward to behave
  /// as this one does.
  c10::optional<double> attribute(const std::string& name) const override;
  std::vector<std::string> attribute_names() const override { return {"dropout", "seq", "context"}; }
  /// Its options but dtype (each tensor's is recorded anyway); heads and eps fixed.
  std::vector<nn::ConfigField> config() const override;
  /// Only lm_head may be a vocabulary head, and its logits split only as one; ln_f, lm_head and
  /// the blocks agree on sequence parallelism, which needs a forward that splits the sequence.
  void check(const std::string& path) const override;
  Gpt2Options options;
};

/// Builds GPT-2 and initializes it as GPT-2 does (Gpt2::init_tensor), each tensor by its name
/// (nn::build_initialized): on the meta device when parameter_options() say so, for pt.deferred.
nn::ModulePtr gpt2(const Gpt2Options& options);

}  // namespace partrain::models
