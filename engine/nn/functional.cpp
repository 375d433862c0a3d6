// RMSNorm, grouped-query attention, rotary embeddings and NLL (see functional.hpp).
#include "engine/nn/functional.hpp"

#include <cmath>


namespace partrain::nn {

std::pair<int64_t, int64_t> extremes(const Tensor& t) {
  auto both = torch::stack({t.min(), t.max()}).to(torch::kCPU, torch::kInt64);
  return {both[0].item<int64_t>(), both[1].item<int64_t>()};
}

c10::optional<int64_t> class_id_outside(const Tensor& ids, int64_t classes, int64_t ignore_index) {
  if (ids.numel() == 0 || ids.is_meta()) return c10::nullopt;
  const auto [lo, hi] = extremes(ids.masked_fill(ids == ignore_index, 0));
  if (lo < 0) return lo;
  if (hi >= classes) return hi;
  return c10::nullopt;
}

std::string class_range(int64_t classes, int64_t ignore_index) {
  return "(targets are 0 to " + std::to_string(classes - 1) + ", or ignore_index=" + std::to_string(ignore_index) + ")";
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1, "rms_norm expects a tensor with at least one dimension");
  TORCH_CHECK(eps >= 0 && std::isfinite(eps), "rms_norm: eps must be a finite number >= 0, got ", eps);
  if (weight.defined())
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: weight of shape ", weight.sizes(),
                " does not fit input (..., ", x.size(-1), ")");
  auto wide = x.scalar_type() == torch::kFloat64 ? x : x.to(torch::kFloat32);
  auto y = (wide * (wide.pow(2).mean(-1, true) + eps).rsqrt()).to(x.scalar_type());
  return weight.defined() ? weight * y : y;
}

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& o) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "scaled_dot_product_attention expects q, k, v of shape (batch, heads, positions, head size), got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes() || (k.size(0) == v.size(0) && k.size(1) == v.size(1) && k.size(2) == v.size(2)),
              "scaled_dot_product_attention: k ", k.sizes(), " and v ", v.sizes(), " differ in batch, heads or positions");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), "scaled_dot_product_attention: q ", q.sizes(),
              " and k ", k.sizes(), " differ in batch or head size");
  const int64_t hq = q.size(1), hkv = k.size(1);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "scaled_dot_product_attention: ", hq, " query heads are not a multiple of ",
              hkv, " key/value heads (grouped-query attention needs each group the same size)");
  TORCH_CHECK(o.dropout >= 0 && o.dropout < 1, "scaled_dot_product_attention: dropout must be in [0, 1), got ", o.dropout);
  TORCH_CHECK(!o.scale || std::isfinite(*o.scale), "scaled_dot_product_attention: scale must be a finite number, got ",
              *o.scale);
  Tensor kk = k, vv = v;
  if (hkv != hq) {  // each k/v head serves hq/hkv consecutive query heads
    kk = k.repeat_interleave(hq / hkv, 1);
    vv = v.repeat_interleave(hq / hkv, 1);
  }
  const int64_t T = q.size(2), S = k.size(2);
  const double dropout = o.training ? o.dropout : 0.0;
  const double default_scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  if (o.causal && !o.mask.defined() && T == S && (!o.scale || *o.scale == default_scale))
    return at::scaled_dot_product_attention(q, kk, vv, {}, dropout, /*is_causal=*/true);
  auto scores = q.matmul(kk.transpose(-2, -1)) * o.scale.value_or(default_scale);
  if (o.causal) {
    TORCH_CHECK(T <= S, "scaled_dot_product_attention: causal attention of ", T, " queries over ", S,
                " keys (expected at most as many queries as keys)");
    // Query t sits at position S - T + t: it sees keys up to there (a cache of earlier keys before it).
    auto allowed = torch::ones({T, S}, q.options().dtype(torch::kBool)).tril(S - T);
    scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  }
  if (o.mask.defined()) {
    if (o.mask.scalar_type() == torch::kBool)
      scores = scores.masked_fill(o.mask.logical_not(), -std::numeric_limits<double>::infinity());
    else
      scores = scores + o.mask;
  }
  auto weights = scores.softmax(-1);
  if (dropout > 0) weights = at::dropout(weights, dropout, true);
  return weights.matmul(vv);
}

std::pair<Tensor, Tensor> rotary_tables(int64_t head_dim, const Tensor& positions, double base, torch::ScalarType dtype) {
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "rotary embeddings need an even head size, got ", head_dim);
  TORCH_CHECK(base > 0 && std::isfinite(base), "rotary embeddings: base must be a finite number > 0, got ", base);
  TORCH_CHECK(positions.dim() == 1 && !positions.is_floating_point(),
              "rotary embeddings: positions must be a 1-D integer tensor, got ", positions.sizes(), " ",
              positions.scalar_type());
  // float32 as Hugging Face computes them (float64 for a float64 model).
  auto wide = dtype == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  auto opts = torch::TensorOptions().dtype(wide).device(positions.device());
  auto inv_freq = 1.0 / torch::pow(base, torch::arange(0, head_dim, 2, opts) / static_cast<double>(head_dim));
  auto freqs = positions.to(wide).unsqueeze(1) * inv_freq.unsqueeze(0);  // (T, d/2)
  auto emb = torch::cat({freqs, freqs}, -1);
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

Tensor apply_rotary(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  TORCH_CHECK(x.dim() >= 2 && x.size(-1) % 2 == 0, "apply_rotary expects x (..., positions, even head size), got ",
              x.sizes());
  TORCH_CHECK(cos.sizes() == sin.sizes(), "apply_rotary: cos ", cos.sizes(), " and sin ", sin.sizes(), " differ");
  TORCH_CHECK(cos.dim() >= 1 && cos.size(-1) == x.size(-1), "apply_rotary: tables of shape ", cos.sizes(),
              " do not fit x ", x.sizes(), " (expected (positions, ", x.size(-1), "))");
  TORCH_CHECK(cos.dim() < 2 || cos.size(-2) == x.size(-2) || cos.size(-2) == 1, "apply_rotary: tables for ",
              cos.size(-2), " positions, x has ", x.size(-2));
  const int64_t half = x.size(-1) / 2;
  auto rotated = torch::cat({x.narrow(-1, half, half).neg(), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

Tensor dropout_part(const Tensor& x, double p, bool training, int64_t dim, int64_t parts, int64_t index) {
  TORCH_CHECK(p >= 0 && p < 1, "dropout: p must be in [0, 1), got ", p);
  TORCH_CHECK(parts >= 1 && index >= 0 && index < parts, "dropout_part: part ", index, " of ", parts);
  TORCH_CHECK(x.dim() >= 1 && dim >= -x.dim() && dim < x.dim(), "dropout: dimension ", dim, " of a tensor of ",
              x.dim(), " dimensions (the part is split along one of them)");
  if (!training || p == 0 || parts == 1) return at::dropout(x, p, training);
  if (dim < 0) dim += x.dim();
  auto whole = x.sizes().vec();
  whole[dim] *= parts;
  auto noise = at::empty(whole, x.options().requires_grad(false)).bernoulli_(1 - p);
  noise.div_(1 - p);
  // This part alone, contiguous: the whole mask is freed now rather than kept for the backward.
  return x * noise.narrow(dim, index * x.size(dim), x.size(dim)).contiguous();
}

Tensor dropout_rows(const Tensor& x, double p, bool training, int64_t dim, int64_t whole, const Tensor& rows) {
  TORCH_CHECK(p >= 0 && p < 1, "dropout: p must be in [0, 1), got ", p);
  TORCH_CHECK(x.dim() >= 1 && dim >= -x.dim() && dim < x.dim(), "dropout: dimension ", dim, " of a tensor of ",
              x.dim(), " dimensions (the rows are taken along one of them)");
  if (dim < 0) dim += x.dim();
  TORCH_CHECK(rows.dim() == 1 && rows.numel() == x.size(dim) && x.size(dim) <= whole, "dropout_rows: ", rows.numel(),
              " rows of ", whole, " for a tensor of ", x.size(dim), " along dimension ", dim);
  if (!training || p == 0) return at::dropout(x, p, training);
  auto shape = x.sizes().vec();
  shape[dim] = whole;
  auto noise = at::empty(shape, x.options().requires_grad(false)).bernoulli_(1 - p);
  noise.div_(1 - p);
  return x * noise.index_select(dim, rows.to(noise.device()));
}

Tensor nll_loss(const Tensor& log_probs, const Tensor& targets, int64_t ignore_index, const std::string& reduction) {
  TORCH_CHECK(reduction == "mean" || reduction == "sum" || reduction == "none", "nll_loss: reduction must be 'mean', "
              "'sum' or 'none', got '", reduction, "'");
  TORCH_CHECK(log_probs.dim() >= 1, "nll_loss expects log-probabilities (..., classes)");
  TORCH_CHECK(!targets.is_floating_point(), "nll_loss expects integer class ids, got ", targets.scalar_type());
  TORCH_CHECK(targets.numel() * log_probs.size(-1) == log_probs.numel(), "nll_loss: targets of shape ",
              targets.sizes(), " do not fit log-probabilities of shape ", log_probs.sizes());
  auto flat = log_probs.reshape({-1, log_probs.size(-1)});
  auto ids = targets.reshape({-1}).to(torch::kInt64);
  auto counted = ids.ne(ignore_index);
  const int64_t classes = flat.size(1);
  const auto outside = class_id_outside(ids, classes, ignore_index);
  TORCH_CHECK(!outside, "nll_loss: target ", outside.value_or(0), " is out of range for ", classes,
              " classes ", class_range(classes, ignore_index));
  auto safe = ids.masked_fill(counted.logical_not(), 0);
  auto picked = -flat.gather(1, safe.unsqueeze(1)).squeeze(1) * counted.to(flat.scalar_type());
  if (reduction == "none") return picked.view(targets.sizes());
  if (reduction == "sum") return picked.sum();
  return picked.sum() / counted.sum().to(flat.scalar_type());
}

}  // namespace partrain::nn
