// A parallelized model, with one owner: the module tree, the mesh it runs over, the name of the
// policy applied, the data-parallel state and one record per parameter (its logical name and
// shape, its sharding, device and dtype). The composer (ParallelModel::parallelize) applies the
// parallelisms in one commented order; train_step runs a whole step (forward, loss, backward,
// gradient sync) in C++. Checkpoints, the planner, clipping and the REPL read the records or the
// module tree: there are no side tables keyed by object identity.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/dist/mesh.hpp"
#include "engine/nn/init.hpp"
#include "engine/nn/module.hpp"
#include "engine/optim/loss_scale.hpp"
#include "engine/optim/optim.hpp"
#include "engine/parallel/context_parallel.hpp"
#include "engine/parallel/data_parallel.hpp"
#include "engine/parallel/fsdp.hpp"
#include "engine/parallel/pipeline.hpp"
#include "engine/parallel/sharding.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/parallel/zero.hpp"

namespace partrain::parallel {

/// One parameter as the serial model has it, and this rank's part of it.
struct ParameterRecord {
  std::string name;                  ///< dotted name (a tied tensor: its first name in tree order)
  std::vector<std::string> aliases;  ///< the tensor's other names (ties), in tree order
  std::vector<int64_t> shape;        ///< the logical shape (what the serial model has)
  c10::optional<Sharding> sharding;  ///< how it is split across its tensor group; nullopt: whole
  torch::Device device = torch::kCPU;
  torch::ScalarType dtype = torch::kFloat32;
  bool trainable = true;  ///< requires_grad
  torch::Tensor param;    ///< this rank's tensor, the one the module holds
  /// The float32 master copy the optimizer made for the model keeps of a bfloat16 or float16
  /// parameter (set when that optimizer is made; empty otherwise).
  torch::Tensor master;
  /// Where the parameter's gradient sits in data parallelism's flat gradient buffers
  /// (DataParallel::buffers()): the buffer's index and the element offset in it; -1 when it has
  /// none (not trainable). Under ZeRO each rank's shard is a contiguous part of every bucket.
  int64_t flat_buffer = -1, flat_offset = -1;
};

/// The records of `root`'s parameters in tree order, a tied tensor once (its other names in
/// `aliases`). Every name of a tied tensor must be split the same way by the module holding it
/// (or whole under all): otherwise an error naming both names and both splits, since the layers
/// would compute with different slices of one tensor.
std::vector<ParameterRecord> parameter_records(nn::Module& root);

/// For each of `params`, the tensor group it is split over in `root` (null when whole, or not a
/// parameter of `root`): what global_grad_norm needs to count split gradients once.
std::vector<dist::GroupPtr> split_groups(nn::Module& root, const std::vector<torch::Tensor>& params);

/// Clipping for an optimizer of parameters of `tree`, a tree of parallel layers no ParallelModel
/// owns: its global norm counts split parameters over their tensor groups.
void use_split_norm(optim::Optimizer& opt, nn::Module& tree);
/// Scales `params`' gradients so that their global norm is at most `max_norm` and returns the
/// norm before: split parameters of `tree` (if given) counted over their tensor group; the
/// parameters of a ParallelModel are measured as ParallelModel::clip_grad_norm does. Refuses a
/// max_norm that is not a finite number > 0.
double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm, nn::Module* tree = nullptr,
                      const std::string& what = "clip_grad_norm");
/// Throws std::invalid_argument unless `max_norm` is a finite number > 0.
void check_max_norm(double max_norm);

/// The tree's vocabulary head: the ColumnParallelLinear built with padding (P.vocab_head) on a
/// group of more than one rank, whose split logits losses read without gathering them; nullptr
/// when the tree has none. `path` (if given) receives its dotted path.
const ColumnParallelLinear* vocab_head_of(nn::Module& root, std::string* path = nullptr);

/// Allocates every meta parameter and buffer `root` holds on this rank's device, initialized by
/// name as the serial model is (nn::initial_tensor): a split tensor's logical tensor is made, then
/// this rank's slice of it kept, one tensor at a time. `plan`: how each tensor is initialized,
/// captured from the serial tree (nn::init_plan) before tensor parallelism replaced its layers and
/// a pipeline cut dropped a tie's other names.
void materialize_local(nn::Module& root, const nn::InitPlan& plan);

/// ZeRO-3's deferred initialization: how to make a parameter's initial values on this rank (its
/// slice of the logical tensor), by the storage the parameter holds, for Fsdp::attach to fill one
/// unit at a time.
using DeferredValues = std::unordered_map<const c10::StorageImpl*, std::function<torch::Tensor()>>;
/// As materialize_local, but every trainable parameter gets a tensor of its shape whose storage is
/// released at once (no values on any rank), and its values are left to `out`: a model larger
/// than a rank is never made whole. Buffers and frozen parameters are made as materialize_local
/// makes them.
void materialize_deferred(nn::Module& root, const nn::InitPlan& plan, DeferredValues& out);

/// What a training step computes (model:train_step's options).
struct TrainStepOptions {
  /// The loss of the model's output and the targets: "cross_entropy" (vocabulary-parallel when
  /// the model's head is split, the serial one otherwise) or "mse".
  std::string loss = "cross_entropy";
  int accumulate = 1;          ///< micro-batches the batch is split into (along dim 0); one sync
  int64_t ignore_index = -100; ///< cross_entropy: targets that do not count
};

/// The losses train_step knows, for messages.
const std::vector<std::string>& train_step_losses();

/// Activation checkpointing (engine/parallel/recompute.hpp).
struct RecomputeOptions {
  std::string mode = "none";  ///< "none", or "block": each block runs checkpointed
  std::string blocks;         ///< the container of the model's blocks ("h"; a policy's pipeline.blocks)
  /// Refuses a mode it does not know, "block" without blocks, and "block" on a pipeline.
  void validate() const;
};

/// How ParallelModel::parallelize composes a model: one field a parallelism, each checked by
/// validate() before the model changes.
struct ParallelizeOptions {
  /// Applies tensor (and sequence) parallelism to the tree: a policy, written in Lua (the
  /// sharder) or C++ (apply_policy). Empty: the tree is used as it is.
  std::function<void(nn::Module& root, const dist::Mesh& mesh)> tensor_parallel;
  std::string policy;            ///< the applied policy's name, for checkpoints and the REPL
  DataParallelOptions data_parallel;
  /// The stages and schedule when the mesh's pipeline group has more than one rank.
  c10::optional<PipelineOptions> pipeline;
  /// ZeRO over the mesh's zero groups; nullopt: stage 1 when the mesh has zero groups of more than
  /// one rank, else off. A stage above 0 on a mesh whose zero groups are of one rank is refused.
  c10::optional<ZeroOptions> zero;
  RecomputeOptions recompute;
  /// How attention splits the sequence over the mesh's context group: every module of the tree
  /// that computes over the sequence (ContextSplit) learns it. Unset: ring. Set on a mesh whose
  /// context group is of one rank, it is refused (it would do nothing).
  c10::optional<ContextMode> context;

  /// Checks every option against `mesh`; throws naming the one that does not fit.
  void validate(const dist::Mesh& mesh) const;
};

class ParallelModel : public std::enable_shared_from_this<ParallelModel> {
 public:
  /// The composer: makes `root` parallel over `mesh` and returns its owner. `root` must not be
  /// parallelized already.
  static std::shared_ptr<ParallelModel> parallelize(nn::ModulePtr root, std::shared_ptr<dist::Mesh> mesh,
                                                    ParallelizeOptions options);
  ~ParallelModel();

  /// The parallelized model `module` is the root of, or nullptr.
  static std::shared_ptr<ParallelModel> of(const nn::Module& module) { return module.parallel_owner(); }
  /// The parallelized model that holds `param`, or nullptr: an optimizer made from a table of
  /// its parameters is wired to it as one made from the model (clipping's norm over its groups,
  /// loss scaling, masters), and one over a ZeRO model's must be made from the model
  /// (make_zero_optimizer: a plain one would miss the shards). `name`, when given, gets the
  /// parameter's name. (The models searched are a process-wide list of weak references.)
  static std::shared_ptr<ParallelModel> owner(const torch::Tensor& param, std::string* name = nullptr);
  /// The parallelized model a list of parameters belongs to, or nullptr when none of them is
  /// one's. A list with one model's parameters and any other tensor (another model's, or one of
  /// no model: its gradient would not be synced over the model's ranks) is refused, naming it by
  /// its position; `what` begins the message ("pt.optim.adamw").
  static std::shared_ptr<ParallelModel> owner(const std::vector<torch::Tensor>& params, const std::string& what);
  /// How many ParallelModels are alive in this process (tests of their lifetime).
  static int64_t live() { return live_.load(); }
  /// Every ParallelModel alive in this process (the planner sums ZeRO-3's gathered units).
  static std::vector<std::shared_ptr<ParallelModel>> alive();

  nn::Module& module() const { return *root_; }
  const nn::ModulePtr& root() const { return root_; }
  const std::shared_ptr<dist::Mesh>& mesh() const { return mesh_; }
  const std::string& policy() const { return policy_; }
  const std::shared_ptr<DataParallel>& data_parallel() const { return data_parallel_; }
  /// The ZeRO stage the model was parallelized with (0: off); its zero group is
  /// data_parallel()->options().zero.group, and make_zero_optimizer makes its optimizer.
  int zero_stage() const { return data_parallel_ ? data_parallel_->options().zero.stage : 0; }
  /// ZeRO-3's sharded parameters (null below stage 3).
  const std::shared_ptr<Fsdp>& fsdp() const { return fsdp_; }
  /// ZeRO-3's sharded parameters of the parallelized model `module` is part of (the root or any
  /// module below it), or null (below stage 3, or not parallelized).
  static std::shared_ptr<Fsdp> fsdp_of(const nn::Module& module) {
    auto tree = module.parallel_tree();
    return tree ? tree->fsdp() : nullptr;
  }
  /// This rank's stages and their schedule (null without pipeline parallelism).
  const std::shared_ptr<Pipeline>& pipeline() const { return pipeline_; }
  const std::vector<ParameterRecord>& records() const { return records_; }
  /// The record of the parameter called `name` (or one of its aliases), or nullptr.
  const ParameterRecord* record(const std::string& name) const;
  /// Builds the records again from the tree (after a tie or a replacement made since).
  void refresh_records() {
    records_ = parameter_records(*root_);
    note_flat_slots();
  }
  /// Notes the master copy of the parameter `param` in its record (the optimizer's).
  void set_master(const torch::Tensor& param, const torch::Tensor& master);

  /// zero = { overlap_sync_param = true }: the distributed optimizer leaves the updated
  /// parameters' all-gathers in flight after its step, and installs here the wait for them.
  bool overlap_sync_param() const { return overlap_sync_param_; }
  /// zero = { allgather_bucket_size }: MiB of updated parameters one all-gather holds.
  double allgather_bucket_mb() const { return allgather_bucket_mb_; }
  void set_param_wait(std::function<void()> wait) { param_wait_ = std::move(wait); }
  /// Completes the parameters' all-gathers a step left in flight (overlap_sync_param): train_step,
  /// the Lua boundary (any method of the model) and the optimizer's next step call it first.
  void sync_params() {
    if (param_wait_) param_wait_();
  }

  /// The loss scaler of the optimizer made for this model (held weakly): train_step's backward
  /// starts from the loss times its scale.
  void set_loss_scaler(const std::shared_ptr<optim::LossScaler>& scaler) { loss_scaler_ = scaler; }
  std::shared_ptr<optim::LossScaler> loss_scaler() const { return loss_scaler_.lock(); }

  /// One training step: forward on `x`, the loss against `y`, backward, and the data-parallel
  /// gradient sync. With accumulate = n the batch is split into n micro-batches along dim 0,
  /// each run forward and backward, one sync at the end. Under pipeline parallelism the
  /// pipeline's schedule runs over its micro-batches instead. The loss and the gradients are
  /// serial training's on the global batch (every data rank's): the mean over all its counted
  /// targets, however padding (ignore_index) spreads over micro-batches and ranks; every rank
  /// returns that loss. With a loss scaler (loss_scaler()) backward runs on the loss times its
  /// scale; the loss returned is unscaled.
  /// The optimizer steps after (the caller's opt:step()).
  torch::Tensor train_step(const torch::Tensor& x, const torch::Tensor& y, const TrainStepOptions& options = {});

  /// The model's loss of `output` against `targets` as train_step computes it: reduction "mean"
  /// (over the counted targets) or "sum".
  torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& targets, const TrainStepOptions& options,
                     const std::string& reduction = "mean") const;

  // ---- The optimizer (engine/parallel/optimizer.cpp) ----

  /// The optimizer for this model: of all its trainable parameters (no `params`), or of `params`
  /// (some of them, one param group), wired to the model so that it steps what serial training would.
  ///  - Under a zero stage: ZeRO's distributed optimizer (this rank's shard of master weights and
  ///    state; clipping by the norm over the shards), of every parameter: `params` is refused.
  ///  - Otherwise a plain one, whose float32 masters of low-precision parameters the records keep.
  ///  - Clipping measures the global norm: split parameters summed over their tensor group, the
  ///    pipeline's stages summed, a tied tensor once.
  ///  - Loss scaling: train_step scales by this optimizer's scale, and every rank of the mesh
  ///    agrees on an overflow. One optimizer with loss scaling a model, and none beside it.
  ///  - Its step refuses gradients data parallelism has not synced yet.
  /// Throws std::invalid_argument naming what is refused.
  std::shared_ptr<optim::Optimizer> make_optimizer(const optim::OptimizerOptions& options,
                                                   c10::optional<std::vector<torch::Tensor>> params = c10::nullopt);
  /// The optimizers make_optimizer made that are still alive.
  std::vector<std::shared_ptr<optim::Optimizer>> optimizers() const;
  /// Scales the gradients of `params` (this model's) so that their global norm is at most
  /// `max_norm`, measured as make_optimizer's clipping does; returns the norm before. Refused
  /// under ZeRO when the gradients are reduce-scattered (they never reach .grad: the optimizer's
  /// own clip_grad_norm option clips them).
  double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm);

 private:
  ParallelModel() { ++live_; }
  static std::vector<std::weak_ptr<ParallelModel>>& models();  // every one alive, for owner()
  void note_flat_slots();  // fills the records' flat_buffer / flat_offset from the data parallelism
  // The targets of `y` the loss counts (float64), summed over the data ranks: train_step's
  // divisor. The same all-reduce tells whether any data rank refused its batch (`refused` here).
  torch::Tensor counted(const torch::Tensor& y, const TrainStepOptions& options, bool refused,
                        bool& any_refused) const;

  nn::ModulePtr root_;
  std::shared_ptr<dist::Mesh> mesh_;
  std::string policy_;
  std::shared_ptr<DataParallel> data_parallel_;
  std::shared_ptr<Fsdp> fsdp_;
  std::shared_ptr<Pipeline> pipeline_;
  std::vector<ParameterRecord> records_;
  std::weak_ptr<optim::LossScaler> loss_scaler_;
  bool overlap_sync_param_ = false;
  double allgather_bucket_mb_ = ZeroOptions().allgather_bucket_size;
  // Whether this train_step's batch check read the targets' class ids (the loss then need not,
  // on a device).
  bool targets_checked_ = false;
  std::function<void()> param_wait_;
  std::vector<std::weak_ptr<optim::Optimizer>> optimizers_;  // make_optimizer's
  static std::atomic<int64_t> live_;
};

}  // namespace partrain::parallel
