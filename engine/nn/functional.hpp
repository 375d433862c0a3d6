// The functional building blocks of LLaMA-era models, as PyTorch and Hugging Face define them:
// RMSNorm, grouped-query scaled dot-product attention, rotary position embeddings (the
// rotate-half convention), and the negative log-likelihood loss; and the range read that the
// checks of token and class ids share. Modules and models call these, and Lua reaches them
// through pt.nn.
#pragma once

#include <utility>

#include <torch/torch.h>

namespace partrain::nn {

using torch::Tensor;

/// x / sqrt(mean(x^2 over the last dimension) + eps), times `weight` when defined, as Hugging
/// Face's LlamaRMSNorm: the statistics in float32 whatever x's dtype, the result in x's dtype.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps);

/// The smallest and largest element of a non-empty integer tensor, read with one transfer from
/// its device (the checks of token ids and class ids).
std::pair<int64_t, int64_t> extremes(const Tensor& t);

/// A class id of `ids` outside 0..classes-1 that is not `ignore_index` (the smallest one below,
/// else the largest above), or none: losses check their targets with it before LibTorch's
/// kernel, which on a GPU would stop the device on one (a device-side assert).
c10::optional<int64_t> class_id_outside(const Tensor& ids, int64_t classes, int64_t ignore_index);
/// "(targets are 0 to classes-1, or ignore_index=...)": how the refusals of class_id_outside's
/// finds end.
std::string class_range(int64_t classes, int64_t ignore_index);

struct AttentionOptions {
  Tensor mask;           ///< boolean (true: attend) or additive float, broadcast to (B, H, T, S)
  bool causal = false;   ///< position t attends to positions <= t (with T = S, or aligned to the end)
  double dropout = 0;    ///< dropout on the attention weights (training only)
  bool training = true;  ///< whether dropout applies
  c10::optional<double> scale;  ///< default 1/sqrt(head size)
};

/// softmax(q k^T * scale [+ mask]) v, q (B, Hq, T, d), k and v (B, Hkv, S, d) with Hq a multiple
/// of Hkv (grouped-query attention: each group of Hq/Hkv query heads shares one k/v head).
/// Returns (B, Hq, T, d). Uses LibTorch's fused kernel where it has one and it computes the same.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& o);

/// Rotary tables for `positions` (T,) integer positions: cos and sin of shape (T, head_dim), the
/// frequencies 1 / base^(2i/head_dim) repeated twice along the last dimension (Hugging Face's
/// layout, so its q/k weights need no permutation). Computed in float32 (float64 for `dtype`
/// float64), returned in `dtype`.
std::pair<Tensor, Tensor> rotary_tables(int64_t head_dim, const Tensor& positions, double base,
                                        torch::ScalarType dtype);

/// x * cos + rotate_half(x) * sin, x (..., T, head_dim), cos and sin (T, head_dim) (or broadcastable),
/// rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2]).
Tensor apply_rotary(const Tensor& x, const Tensor& cos, const Tensor& sin);

/// Dropout on part `index` of `parts` equal parts, along `dim`, of a tensor the unsplit model
/// holds whole (attention weights of this rank's heads, activations of its part of the sequence).
/// The mask is drawn for the whole tensor, as the unsplit model draws it, and this part's slice
/// kept: the ranks holding the parts drop different elements, as the unsplit model's parts do
/// (one mask a rank would repeat itself across them), and every rank's generator advances as the
/// unsplit run's does. On the CPU the result is, bit for bit, that part of the unsplit dropout
/// (at::dropout's mask: bernoulli(1 - p) over the contiguous tensor, divided by 1 - p).
/// With parts = 1, or not training, or p = 0: at::dropout.
Tensor dropout_part(const Tensor& x, double p, bool training, int64_t dim, int64_t parts, int64_t index);

/// Dropout on the rows `rows` (positions of a dimension of size `whole`) along `dim` that x holds
/// of a tensor the unsplit model holds whole: as dropout_part, for rows that are not one
/// contiguous part (context parallelism's early and late chunks of a sequence).
Tensor dropout_rows(const Tensor& x, double p, bool training, int64_t dim, int64_t whole, const Tensor& rows);

/// The negative log-likelihood of log-probabilities (N, C) or (..., C) at class ids (N) or (...);
/// targets equal to `ignore_index` do not count. reduction: "mean" (over counted targets), "sum"
/// or "none".
Tensor nll_loss(const Tensor& log_probs, const Tensor& targets, int64_t ignore_index, const std::string& reduction);

}  // namespace partrain::nn
