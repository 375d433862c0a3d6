// Tensor parallelism (Megatron-LM's): layers whose weights are split across the ranks of a tensor
// group, built from the serial layer by slicing its initialized weights (ShardFormer's
// from_native_module), and the communication they need as autograd functions, so backward
// communicates exactly what the chain rule asks for.
#pragma once

#include "engine/dist/process_group.hpp"
#include "engine/nn/layers.hpp"
#include "engine/parallel/sharding.hpp"

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
/// Refuses a sequence of `length` positions that does not split into `parts` equal ones.
void check_sequence_parts(int64_t length, int64_t parts);

// ---- Layers --------------------------------------------------------------------------------

/// Output features split across the group: rank r holds rows [r*out/t, (r+1)*out/t) of W and b.
/// With parts (q, k, v: three sizes, unequal under grouped-query attention) each rank takes its
/// slice of every part, so a head's q, k and v stay on one rank.
class ColumnParallelLinear : public nn::Unary {
 public:
  /// Slices `serial` (which it leaves untouched). `gather_output`: all-gather the output so the
  /// caller sees the full width.
  /// `sequence_parallel`: the input arrives split along the sequence and is all-gathered first.
  /// `pad`: the output (a vocabulary) may be padded with zero rows up to a multiple of the group
  /// size, as VocabParallelEmbedding pads, so the two can share a weight.
  /// `pad` also makes it a vocabulary head: its (split) outputs are marked as vocabulary-split
  /// logits (split_logits_of), so losses and sampling recognize them.
  /// `parts`: the sizes the output is made of, each split across the group (empty: one part).
  ColumnParallelLinear(const nn::Linear& serial, dist::GroupPtr group, std::vector<int64_t> parts,
                       bool gather_output = false, bool sequence_parallel = false, bool pad = false);
  /// `fused` equal parts (q, k, v of one size: 3).
  ColumnParallelLinear(const nn::Linear& serial, dist::GroupPtr group, int64_t fused = 1, bool gather_output = false,
                       bool sequence_parallel = false, bool pad = false);
  Tensor forward(const Tensor& x) override;  // (..., in) -> (..., out/t), or (..., out) gathered
  std::string extra_repr() const override;
  /// weight [out/t, in] and bias [out/t], split over `group` as built.
  void check(const std::string& path) const override;
  c10::optional<nn::Features> input_features() const override { return nn::Features{in}; }
  c10::optional<nn::Features> output_features() const override;
  c10::optional<bool> sequence_split() const override { return sequence_parallel; }
  /// weight and bias: split along dimension 0 (on a group of one rank: whole, nullptr).
  const Sharding* sharding_of(const std::string& name) const override;
  dist::GroupPtr group;
  int64_t in, out;             ///< the serial sizes (out padded when `pad`)
  std::vector<int64_t> parts;  ///< the sizes the logical output is made of
  int64_t logical_out;     ///< out without the padding
  bool gather_output, sequence_parallel;
  bool vocab_head = false;  ///< built with `pad`: the output is vocabulary-split logits
  /// With sequence_parallel: overlap the all-gather of the input with the matmul of the local part
  /// (and, in backward, the reduce-scatter of the input's gradient with the weight's gradient):
  /// ShardFormer's sequence_overlap.
  bool sequence_overlap = false;

 private:
  c10::optional<Sharding> weight_split_, bias_split_;
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
  /// weight [out, in/t] split over `group`, bias [out] whole.
  void check(const std::string& path) const override;
  c10::optional<nn::Features> input_features() const override;
  c10::optional<nn::Features> output_features() const override { return nn::Features{out}; }
  c10::optional<bool> sequence_split() const override { return sequence_parallel; }
  /// weight: split along dimension 1 (the bias is whole).
  const Sharding* sharding_of(const std::string& name) const override;
  dist::GroupPtr group;
  int64_t in, out;
  bool input_is_parallel, sequence_parallel;

 private:
  c10::optional<Sharding> weight_split_;
};

/// The vocabulary split across the group: rank r holds rows [r*V'/t, (r+1)*V'/t) where V' is the
/// vocabulary padded up to a multiple of t (the padding rows are zero and never looked up).
class VocabParallelEmbedding : public nn::Unary {
 public:
  VocabParallelEmbedding(const nn::Embedding& serial, dist::GroupPtr group);
  Tensor forward(const Tensor& ids) override;  // ids (...) -> (..., dim), summed over the group
  std::string extra_repr() const override;
  void check(const std::string& path) const override;  // weight [padded/t, dim], split over `group`
  c10::optional<nn::Features> output_features() const override { return nn::Features{dim}; }
  /// weight: split along dimension 0, padded.
  const Sharding* sharding_of(const std::string& name) const override;
  dist::GroupPtr group;
  int64_t count, padded, dim, first;  ///< logical rows, padded rows, width, this rank's first row

 private:
  c10::optional<Sharding> weight_split_;
};

/// LayerNorm or RMSNorm for tensor-parallel models (ShardFormer's FusedLayerNorm replacement).
/// Under sequence parallelism each rank normalizes only its part of the sequence, so the weight's
/// and bias's gradients are partial sums: they are all-reduced over the group in backward.
/// `fused`: one native layer-norm kernel; otherwise the composed mean/variance form (for
/// reference runs). An RMSNorm (type ParallelRMSNorm) always runs nn::rms_norm.
class ParallelLayerNorm : public nn::Unary {
 public:
  /// Shares `serial`'s weight and bias (replicated on every rank).
  ParallelLayerNorm(const nn::LayerNorm& serial, dist::GroupPtr group, bool sequence_parallel, bool fused = true);
  /// Shares `serial`'s weight (an RMSNorm has no bias).
  ParallelLayerNorm(const nn::RMSNorm& serial, dist::GroupPtr group, bool sequence_parallel);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  void check(const std::string& path) const override;  // weight and bias [dim], whole
  c10::optional<nn::Features> input_features() const override { return nn::Features{dim}; }
  c10::optional<nn::Features> output_features() const override { return nn::Features{dim}; }
  c10::optional<bool> sequence_split() const override { return sequence_parallel; }
  dist::GroupPtr group;
  int64_t dim;
  double eps;
  bool sequence_parallel, fused;
  bool rms = false;  ///< an RMSNorm's replacement
};

/// Cross-entropy of logits whose last dimension (the vocabulary) is split across the group,
/// without ever gathering the full logits: (..., V/t) local logits, (...) targets -> the loss
/// over the targets that are not `ignore_index`, as the serial cross-entropy: their mean, or
/// with reduction "sum" their sum. Columns at or beyond `vocab` (padding) never count; a target
/// outside [0, vocab) is an error. Computed in the logits' precision, at least float32 (float64
/// stays float64).
Tensor vocab_parallel_cross_entropy(const Tensor& local_logits, const Tensor& targets, const dist::GroupPtr& group,
                                    int64_t vocab, int64_t ignore_index = -100, const std::string& reduction = "mean");

/// What makes a tensor vocabulary-split logits: the output of a vocabulary head (a
/// ColumnParallelLinear built with `pad`) on a group of more than one rank.
struct SplitLogits {
  dist::GroupPtr group;
  int64_t vocab = 0;   ///< the logical vocabulary
  int64_t padded = 0;  ///< the vocabulary padded to a multiple of the group size
  int64_t local = 0;   ///< this rank's columns: padded / t, the logits' last dimension
};
/// Marks `logits` as vocabulary-split. The mark is on its storage, so every view of it (a
/// view(-1, V/t), a select of the last position) carries it too.
void mark_split_logits(const Tensor& logits, const SplitLogits& info);
/// The mark of `t` when it is (a view of) vocabulary-split logits, or nullopt.
c10::optional<SplitLogits> split_logits_of(const Tensor& t);
/// Whether any tensor was ever marked (a fast path for programs without vocabulary heads).
bool split_logits_marked();
/// The whole logits (..., vocab) from vocabulary-split ones (..., V/t): all-gathered over the
/// group, padding dropped. Autograd flows back to each rank's part.
Tensor gather_split_logits(const Tensor& local_logits, const SplitLogits& info);

/// The module's state with every split tensor gathered to its logical shape (smp's full
/// state_dict); a collective over each tensor group, run in name order on every rank.
nn::TensorMap full_state_dict(const nn::Module& module);
/// Loads logical tensors (a full state_dict) into a split module: each rank takes its parts.
void load_full_state_dict(nn::Module& module, const nn::TensorMap& state, bool strict = true);
/// The global L2 norm of the parameters' gradients: whole parameters count once, split ones add
/// up over their tensor group (their squared norms are all-reduced). `groups[i]`: the group
/// params[i] is split over, or null when whole (empty: all whole). Every rank gets the same.
double global_grad_norm(const std::vector<Tensor>& params, const std::vector<dist::GroupPtr>& groups);

/// Makes every rank of `group` hold group rank 0's parameters and buffers when they differ
/// (a checksum of each tensor, then broadcasts): a tensor-parallel model must be cut from one
/// serial model. Slices of differently seeded initializations, and replicated parameters that
/// differ from rank to rank, would compute nothing serial without a word. Returns whether
/// anything differed. A collective over the group.
bool align_to_first_rank(nn::Module& model, const dist::GroupPtr& group);

}  // namespace partrain::parallel
