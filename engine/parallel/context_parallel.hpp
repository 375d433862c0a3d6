// Context parallelism: attention over a sequence split across the ranks of a `context` group.
//
// Every rank holds 2 of the 2c equal chunks of each sequence, one early and one late: rank r holds
// chunks r and 2c-1-r, in that order (the load-balanced "zigzag" layout of Megatron's
// get_batch_on_this_cp_rank and torchtitan's head-tail balancer), so that under a causal mask
// every rank does the same work. The loader hands out those rows, positions are read from the
// same layout, and attention is computed exactly, in one of two ways:
//
// - ring: each rank keeps its queries and passes its keys and values around the ring, c - 1 steps,
//   combining the partial softmaxes exactly through their log-sum-exps; the next block's exchange
//   runs under this block's compute. Backward passes the key/value blocks again and sends each
//   block's gradient on behind it, back to its owner.
// - all_to_all (DeepSpeed-Ulysses): heads scattered and the sequence gathered around attention
//   (one all-to-all each for q, k, v and the output), for when the heads divide by c.
//
// The design, with the derivation of the ring's blocks, is docs/design/context-parallelism.md.
#pragma once

#include <functional>

#include <torch/torch.h>

#include "engine/dist/process_group.hpp"

namespace partrain::parallel {

using torch::Tensor;

enum class ContextMode { Ring, AllToAll };
/// "ring" or "all_to_all" (also "a2a", "ulysses"); anything else is an error listing them.
ContextMode parse_context_mode(const std::string& name);
const char* to_string(ContextMode mode);

struct ContextAttentionOptions {
  dist::GroupPtr group;  ///< the context group; null or of one rank: plain attention
  ContextMode mode = ContextMode::Ring;
  bool causal = true;
  c10::optional<double> scale;  ///< default 1/sqrt(head size)
};

/// softmax(q k^T * scale) v over the whole sequence, for this rank's rows of it: q (B, Hq, L, d)
/// and k, v (B, Hkv, L, d) hold this rank's L = 2n positions in the zigzag layout (L the same on
/// every rank, Hq a multiple of Hkv). Returns this rank's rows of the output, (B, Hq, L, d).
/// Differentiable in q, k and v. Every rank of the group must call it together.
Tensor context_attention(const Tensor& q, const Tensor& k, const Tensor& v, const ContextAttentionOptions& o);

/// How many times context_attention has split attention over a group of more than one rank on
/// this thread: what train_step reads to refuse a model whose forward never did (its attention
/// would see this rank's rows alone).
int64_t context_attention_calls();

/// Why `mode` cannot run attention of `heads` query and `kv_heads` key/value heads over a group of
/// `c`, or "" when it can: all_to_all needs c to divide the query heads, and c to divide the
/// key/value heads or they to divide c (they are then repeated).
std::string context_mode_refusal(ContextMode mode, int64_t heads, int64_t kv_heads, int c);

/// The global positions of context rank r's rows of a sequence of `length` split over c ranks:
/// chunks r and 2c-1-r of 2c (length must divide into 2c equal chunks; an error says so).
Tensor zigzag_index(int64_t length, int c, int r);
/// The global positions of this rank's `local` rows (local * group size positions in all).
Tensor context_positions(int64_t local, const dist::GroupPtr& group);
/// This rank's rows of `x` along `dim` (the whole sequence there), in the zigzag layout; a group
/// of one returns x.
Tensor split_context(const Tensor& x, const dist::GroupPtr& group, int64_t dim = 1);

/// A module that computes over this rank's rows of the sequence when the model is split over a
/// context group: the built-in attentions (GPT-2's, LLaMA's) and models (their positions and
/// dropout). The composer calls split_context on every such module of the tree when the mesh's
/// context group has more than one rank.
class ContextSplit {
 public:
  virtual ~ContextSplit() = default;
  virtual void split_context(const ContextAttentionOptions& o) { context_ = o; }
  /// Whether this module computes attention (the composer refuses a model with none it knows and
  /// no forward of its own that could call pt.cp.attention).
  virtual bool attends() const { return false; }
  const ContextAttentionOptions& context() const { return context_; }
  /// The context group when it has more than one rank, else null.
  dist::GroupPtr context_group() const {
    return context_.group && context_.group->size() > 1 ? context_.group : nullptr;
  }

 protected:
  ContextAttentionOptions context_;
};

/// The global positions of the rows this rank holds of a sequence split over `context` (null:
/// none) and then, contiguously, in `parts` parts of which this is part `part` (sequence
/// parallelism): `rows` rows, of context-rank rows rows * parts.
Tensor sequence_rows(int64_t rows, const dist::GroupPtr& context, int64_t parts, int64_t part);

/// Dropout on x (B, rows, ...) whose rows are the positions `sequence_rows` gives: the mask drawn
/// for the whole sequence (B, length, ...) and its rows kept, as the unsplit model draws it.
Tensor sequence_dropout(const Tensor& x, double p, bool training, const dist::GroupPtr& context, int64_t parts,
                        int64_t part);

// ---- The pieces, exposed for tests ------------------------------------------------------------

/// How a ring passes a block on: sends `out` to the next rank while receiving `in` from the
/// previous one, on channel `tag` (keys and values, or their gradients), at ring step `step`, and
/// returns the wait for both. A process group's ring is ring_of(group) (its passes traced under
/// --trace); tests run c ranks as threads of one process over a link of their own.
class RingLink : public torch::CustomClassHolder {
 public:
  enum Channel { Keys = 0x6370, Grads = 0x6371 };
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::function<void()> pass(const Tensor& out, Tensor& in, Channel channel, int step) = 0;
};
c10::intrusive_ptr<RingLink> ring_of(const dist::GroupPtr& group);

/// Ring attention over `link` (see context_attention).
Tensor ring_attention(const Tensor& q, const Tensor& k, const Tensor& v, const c10::intrusive_ptr<RingLink>& link,
                      bool causal, double scale);

/// One block of attention with its log-sum-exp: out (B, Hq, T, d) and lse (B, Hq, T), both in the
/// accumulation dtype (float32 for 16-bit inputs). `causal` masks a square block top-left.
/// `fused`: LibTorch's CPU flash kernel where it applies (a CPU tensor of a floating dtype);
/// otherwise, or with fused false, the plain formulas.
struct AttentionBlock {
  Tensor out, lse;
};
AttentionBlock attention_block(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                               bool fused = true);
/// The gradients (dq, dk, dv) of one block given the whole attention's output and log-sum-exp
/// (the flash identity: each block's share of the serial gradient), in the accumulation dtype.
std::tuple<Tensor, Tensor, Tensor> attention_block_backward(const Tensor& grad, const Tensor& q, const Tensor& k,
                                                            const Tensor& v, const Tensor& out, const Tensor& lse,
                                                            bool causal, double scale, bool fused = true);
/// Folds block (out_b, lse_b) into the running (out, lse) in place (undefined: starts them).
void merge_attention(Tensor& out, Tensor& lse, const Tensor& out_b, const Tensor& lse_b);

}  // namespace partrain::parallel
