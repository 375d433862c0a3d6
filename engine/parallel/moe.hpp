// A mixture-of-experts block (Mixtral's sparse MoE, GShard's and Switch's router losses) and
// its expert parallelism. A router (a linear gate; softmax, top-k, optional renormalisation, or a
// router written in Lua) sends each token to k of E SwiGLU experts; the experts are stored
// stacked ([E, ffn, dim]), so each projection is one grouped matmul over the tokens sorted by
// expert, and expert parallelism is a split of the stack along dimension 0 over the mesh's
// `expert` group: tokens travel to their experts' ranks by an all-to-all of unequal row counts
// (counts exchanged first) and come back the same way, forward and backward.
//
// The router's losses reach backward without changing what the block returns: an identity on the
// block's output whose backward also seeds the losses' gradient (Megatron's MoEAuxLossAutoScaler).
// The load-balancing loss is global over the ranks that split the batch (data x context), per
// micro-batch, so that a data-parallel or expert-parallel run trains exactly as one process does.
// See docs/design/mixture-of-experts.md.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "engine/dist/process_group.hpp"
#include "engine/nn/layers.hpp"
#include "engine/parallel/sharding.hpp"

namespace partrain::parallel {

using torch::Tensor;

struct MoEOptions {
  int64_t dim = 0;               ///< model width
  int64_t hidden = 0;            ///< each expert's SwiGLU width (Mixtral's intermediate_size)
  int64_t experts = 8;           ///< E
  int64_t top_k = 2;             ///< experts a token goes to (num_experts_per_tok)
  bool normalize = true;         ///< renormalise the k weights to sum to 1 (Mixtral; Qwen2-MoE's norm_topk_prob)
  double aux_loss = 0.01;        ///< load-balancing loss coefficient (router_aux_loss_coef); 0: off
  double z_loss = 0.0;           ///< router z-loss coefficient (ST-MoE); 0: off
  double capacity_factor = 0.0;  ///< 0: dropless; cf > 0: each expert takes ceil(cf * N * k / E) slots a rank
  /// Throws naming the value that does not fit (sizes, top_k > experts, negative coefficients).
  void validate(const std::string& who) const;
};

/// E SwiGLU experts stacked: w1 and w3 [E, hidden, dim] (gate and up), w2 [E, dim, hidden]
/// (down), with Mixtral's per-expert layouts (nn.Linear's [out, in]). Under expert parallelism
/// this rank holds E/e of them, a split along dimension 0 over the expert group.
class GroupedExperts : public nn::Module {
 public:
  GroupedExperts(int64_t experts, int64_t dim, int64_t hidden);
  /// x: [T, dim], its rows sorted by expert, counts[i] of them for this rank's i-th expert.
  /// Returns [T, dim]: w2_i(silu(w1_i x) * w3_i x) for each row of expert i.
  Tensor compute(const Tensor& x, const std::vector<int64_t>& counts);
  /// Each expert's matrices as nn.Linear initialises one: U(-1/sqrt(in), 1/sqrt(in)).
  void reset_tensor(const std::string& name, Tensor& t, at::Generator& gen) const override;
  const Sharding* sharding_of(const std::string& name) const override;
  std::string extra_repr() const override;
  /// Cuts this rank's experts out of the stack (the composer, under expert parallelism).
  void split(const dist::GroupPtr& group);
  /// Tensor parallelism inside each expert (after split()): w1 and w3 keep this rank's rows of
  /// the hidden width, w2 its columns; compute() takes whole rows and sums the partial outputs
  /// over `tensor`. `both`: the expert x tensor ranks (expert_tensor), where norms sum.
  void split_tensor(const dist::GroupPtr& tensor, const dist::GroupPtr& both);
  const dist::GroupPtr& tensor_group() const { return tensor_; }
  int64_t experts, dim, hidden;
  /// The experts this rank holds (experts / e) and the first one's index.
  int64_t local = 0, first = 0;

 private:
  std::vector<std::pair<std::string, Sharding>> shardings_;
  dist::GroupPtr tensor_;
};

/// What a router returns: [N, k] weights (floating), [N, k] expert indices (int64) and, for the
/// load-balancing loss, [N, E] router probabilities (undefined: the softmax of the logits).
struct Routing {
  Tensor weights, indices, probs;
};

/// Running counts since the last take (metrics): routed slots per expert (before drops), the
/// slots dropped by the capacity, and the losses' values (global, summed over forwards).
struct MoEStats {
  std::vector<double> routed;  ///< per expert, this rank's tokens (before capacity drops)
  double dropped = 0, slots = 0;
  double aux = 0, z = 0;
  int64_t forwards = 0;
};

class MoE : public nn::Unary {
 public:
  explicit MoE(const MoEOptions& o);
  Tensor forward(const Tensor& x) override;  // (..., dim) -> (..., dim)
  std::string extra_repr() const override;
  /// "experts" and "expert" (the expert-parallel size) read-only; "top_k" (a fixed setting: it
  /// changes the function), "aux_loss", "z_loss", "capacity_factor", "normalize" (0 or 1);
  /// "tensor_parallel" (0 or 1: a policy's say that the experts split over the tensor ranks,
  /// each expert's hidden width divided, when the model is parallelized).

  c10::optional<double> attribute(const std::string& name) const override;
  void set_attribute(const std::string& name, double value) override;
  std::vector<std::string> attribute_names() const override {
    return {"experts", "expert", "top_k", "aux_loss", "z_loss", "capacity_factor", "normalize", "tensor_parallel"};
  }
  /// The block is token-wise on whole features: sequence parallelism does not pass through it.
  c10::optional<bool> sequence_split() const override { return false; }
  c10::optional<nn::Features> input_features() const override { return nn::Features{options.dim}; }
  c10::optional<nn::Features> output_features() const override { return nn::Features{options.dim}; }
  void check(const std::string& path) const override;

  /// A router in place of the default: called with the block, its gate's logits [N, E] and the
  /// tokens [N, dim]. `where` names it in errors (a Lua function's file:line).
  using RouterFn = std::function<Routing(MoE& self, const Tensor& logits, const Tensor& x)>;
  void set_router(RouterFn fn, std::string where);
  bool has_router() const { return static_cast<bool>(router_); }

  /// Expert parallelism: this block's experts split over `expert` (null or one rank: none), and
  /// the load-balancing counts summed over `replicas` (the ranks that split the batch: data x
  /// context). The composer calls it once, before any forward.
  /// With tensor_parallel set and `tensor` of more than one rank, each expert is split over it
  /// too (`both`: the expert x tensor ranks).
  void split_experts(const dist::GroupPtr& expert, const dist::GroupPtr& replicas,
                     const dist::GroupPtr& tensor = nullptr, const dist::GroupPtr& both = nullptr);
  const dist::GroupPtr& expert_group() const { return expert_; }
  int expert_size() const { return expert_ ? expert_->size() : 1; }

  /// The counts since the last take, and resets them.
  MoEStats take_stats();
  const MoEStats& stats() const { return stats_; }

  MoEOptions options;
  bool tensor_parallel = false;

 private:
  Routing route(const Tensor& logits, const Tensor& x);
  /// The experts on rows sorted by expert (`kept` of each), here or on their expert ranks.
  Tensor experts_forward(const Tensor& sorted_x, const std::vector<int64_t>& kept);
  /// y with the router's losses attached (their backward seeded), and their values counted.
  Tensor router_losses(const Tensor& y, const Tensor& logits, const Routing& r, const std::vector<int64_t>& routed);
  RouterFn router_;
  std::string router_where_;
  dist::GroupPtr expert_, replicas_;
  MoEStats stats_;
};

/// Every MoE block of a tree, with its path.
std::vector<std::pair<std::string, MoE*>> moe_blocks(nn::Module& root);

/// The weight the router losses' gradient gets on top of the block's replicas (train_step sets
/// it: the loss scale / the micro-batches), for the forwards on this thread while it lives.
class RouterLossWeight {
 public:
  explicit RouterLossWeight(double weight);
  ~RouterLossWeight();
  RouterLossWeight(const RouterLossWeight&) = delete;
  RouterLossWeight& operator=(const RouterLossWeight&) = delete;
  static double current();

 private:
  double saved_;
};

/// x [T, dim] rows of `in_splits[j]` for rank j of `group` in, rows from every rank out (their
/// counts `out_splits`): the all-to-all of unequal row counts, differentiable (backward sends the
/// gradients back with the splits swapped).
Tensor all_to_all_rows(const Tensor& x, const dist::GroupPtr& group, const std::vector<int64_t>& in_splits,
                       const std::vector<int64_t>& out_splits);

}  // namespace partrain::parallel
