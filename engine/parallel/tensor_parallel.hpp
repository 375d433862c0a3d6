// Tensor parallelism (Megatron-LM's): layers whose weights are split across the ranks of a tensor
// group, built from the serial layer by slicing its initialized weights (ShardFormer's
// from_native_module), and the communication they need as autograd functions, so backward
// communicates exactly what the chain rule asks for.
#pragma once

#include "engine/dist/process_group.hpp"
#include "engine/nn/layers.hpp"

namespace partrain::parallel {

using torch::Tensor;

// ---- Communication as autograd functions (over the tensor group) ---------------------------
/// Forward: identity. Backward: all-reduce (sum). Where a replicated input enters a sharded region.
Tensor copy_to_tensor_region(const Tensor& x, const dist::GroupPtr& group);
/// Forward: all-reduce (sum). Backward: identity. Where partial results leave a sharded region.
Tensor reduce_from_tensor_region(const Tensor& x, const dist::GroupPtr& group);
/// Forward: all-gather along the last dimension. Backward: this rank's slice of the gradient.
Tensor gather_from_tensor_region(const Tensor& x, const dist::GroupPtr& group);
/// Forward: this rank's slice along the last dimension. Backward: all-gather.
Tensor scatter_to_tensor_region(const Tensor& x, const dist::GroupPtr& group);

// Sequence parallelism (Megatron's, InternLM's and ShardFormer's sequence_parallel): between the
// tensor-parallel regions activations stay split along the sequence (dimension 1 of (B, T, ...)),
// so LayerNorm and dropout run on T/t positions a rank.
/// Forward: all-gather along the sequence. Backward: reduce-scatter along it.
Tensor gather_sequence(const Tensor& x, const dist::GroupPtr& group);
/// Forward: reduce-scatter along the sequence. Backward: all-gather along it.
Tensor reduce_scatter_sequence(const Tensor& x, const dist::GroupPtr& group);
/// Forward: this rank's part of the sequence. Backward: all-gather along it.
Tensor split_sequence(const Tensor& x, const dist::GroupPtr& group);

// ---- Layers --------------------------------------------------------------------------------

/// Output features split across the group: rank r holds rows [r*out/t, (r+1)*out/t) of W and b.
/// With fused = k, the output is k equal parts (q, k, v: k = 3) and each rank takes its slice of
/// every part, so a head's q, k and v stay on one rank.
class ColumnParallelLinear : public nn::Unary {
 public:
  /// Slices `serial` (which it leaves untouched). `gather_output`: all-gather the output so the
  /// caller sees the full width.
  /// `sequence_parallel`: the input arrives split along the sequence and is all-gathered first.
  /// `pad`: the output (a vocabulary) may be padded with zero rows up to a multiple of the group
  /// size, as VocabParallelEmbedding pads, so the two can share a weight.
  ColumnParallelLinear(const nn::Linear& serial, dist::GroupPtr group, int64_t fused = 1, bool gather_output = false,
                       bool sequence_parallel = false, bool pad = false);
  Tensor forward(const Tensor& x) override;  // (..., in) -> (..., out/t), or (..., out) gathered
  std::string extra_repr() const override;
  dist::GroupPtr group;
  int64_t in, out, fused;  ///< the serial (logical) sizes (out padded when `pad`)
  bool gather_output, sequence_parallel;
};

/// Input features split across the group: rank r holds columns [r*in/t, (r+1)*in/t) of W; the
/// partial products are all-reduced and the (whole) bias added once.
class RowParallelLinear : public nn::Unary {
 public:
  /// `input_is_parallel`: the input arrives already split (from a ColumnParallelLinear);
  /// otherwise this layer takes its slice of a full input.
  /// `sequence_parallel`: reduce-scatter the output along the sequence instead of all-reducing it.
  RowParallelLinear(const nn::Linear& serial, dist::GroupPtr group, bool input_is_parallel = true,
                    bool sequence_parallel = false);
  Tensor forward(const Tensor& x) override;  // (..., in/t) or (..., in) -> (..., out)
  std::string extra_repr() const override;
  dist::GroupPtr group;
  int64_t in, out;
  bool input_is_parallel, sequence_parallel;
};

/// The vocabulary split across the group: rank r holds rows [r*V'/t, (r+1)*V'/t) where V' is the
/// vocabulary padded up to a multiple of t (the padding rows are zero and never looked up).
class VocabParallelEmbedding : public nn::Unary {
 public:
  VocabParallelEmbedding(const nn::Embedding& serial, dist::GroupPtr group);
  Tensor forward(const Tensor& ids) override;  // ids (...) -> (..., dim), summed over the group
  std::string extra_repr() const override;
  dist::GroupPtr group;
  int64_t count, padded, dim, first;  ///< logical rows, padded rows, width, this rank's first row
};

/// Cross-entropy of logits whose last dimension (the vocabulary) is split across the group,
/// without ever gathering the full logits: (..., V/t) local logits, (...) targets -> mean loss.
/// Columns at or beyond `vocab` (padding) never count.
Tensor vocab_parallel_cross_entropy(const Tensor& local_logits, const Tensor& targets, const dist::GroupPtr& group,
                                    int64_t vocab);

/// The tensor group a parameter is split over (it was made by a parallel layer), or nullptr for a
/// whole (replicated) parameter (smp's is_distributed_parameter).
dist::GroupPtr sharded_over(const Tensor& param);
/// The global L2 norm of the parameters' gradients: whole parameters count once, split ones add
/// up over their tensor group (their squared norms are all-reduced). Every rank gets the same.
double global_grad_norm(const std::vector<Tensor>& params);

/// The rows [first, first + n) of a tensor's dimension `dim` for rank r of t equal parts;
/// an error naming `what` when t does not divide the size.
Tensor shard(const Tensor& full, int64_t dim, int rank, int parts, const std::string& what);

}  // namespace partrain::parallel
