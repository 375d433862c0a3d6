// Optimizers (SGD, Adam, AdamW on LibTorch's implementations), learning-rate schedules and
// gradient clipping by global norm, combined into one object whose step() does all three.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/torch.h>

#include "engine/dist/process_group.hpp"
#include "engine/optim/loss_scale.hpp"
#include "engine/optim/main_grad.hpp"

namespace partrain::optim {

struct ScheduleOptions {
  std::string kind = "constant";  ///< "constant", "cosine" or "linear" (decay after warmup)
  int64_t warmup = 0;             ///< steps of linear warmup from 0 to the base lr
  int64_t total = 0;              ///< step at which decay ends (cosine, linear); required for them
  double min_lr = 0.0;            ///< lr reached at `total` and kept after it
};

/// The learning rate at `step` (counted from 0) for a base rate `lr`.
double scheduled_lr(const ScheduleOptions& schedule, double lr, int64_t step);
/// Throws with the offending field when a schedule cannot be used.
void validate(const ScheduleOptions& schedule);

struct OptimizerOptions {
  std::string kind = "sgd";      ///< "sgd", "adam" or "adamw"
  double lr = 1e-3;              ///< base learning rate
  double weight_decay = 0.0;     ///< L2 (sgd, adam) or decoupled (adamw) decay
  double momentum = 0.0;         ///< sgd only
  double dampening = 0.0;        ///< sgd only
  bool nesterov = false;         ///< sgd only; needs momentum > 0 and dampening = 0
  double beta1 = 0.9;            ///< adam, adamw
  double beta2 = 0.999;          ///< adam, adamw
  double eps = 1e-8;             ///< adam, adamw
  double clip_grad_norm = 0.0;   ///< clip gradients to this global L2 norm before a step; 0: off
  /// adamw only: "on" updates every tensor of a device and dtype in one fused kernel (LibTorch's
  /// _fused_adamw_: CPU parameters, or CUDA ones in a CUDA build), refused where that kernel is
  /// not or a parameter is not contiguous; "auto" (the default) uses it where it is (for sgd and
  /// adam, never); "off" runs LibTorch's torch::optim::AdamW, a loop over the tensors: 2.2-2.6x
  /// slower on the CPU, equal within rounding (bench/torch2).
  std::string fused = "auto";
  ScheduleOptions schedule;      ///< how lr changes with the step count
  LossScaleOptions loss_scale;   ///< kind "none": no loss scaling
};

/// The slots of a parameter's state once it has stepped, as Optimizer::param_state names them
/// (a master aside): Adam's and AdamW's two moments, SGD's momentum buffer when it has momentum.
std::vector<std::string> state_slots(const OptimizerOptions& options);

/// Whether a parameter of `dtype` gets a float32 master copy (bfloat16, float16).
bool needs_master(torch::ScalarType dtype);

/// Scales the gradients of `params` so their global L2 norm is at most `max_norm`; returns the
/// norm before clipping, as a 0-dim tensor on the gradients' device. Nothing waits on the device:
/// the scale min(1, max_norm / (norm + 1e-6)) is applied there (LibTorch's clip_grad_norm_ math,
/// without its read of the norm); undefined when no parameter has a gradient.
torch::Tensor clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm);

class Optimizer;

/// What a distributed optimizer (ZeRO: engine/parallel/zero.hpp) adds around the update: the
/// Optimizer then steps the tensors it was made with (this rank's shard of master weights), and
/// this moves the gradient shard in before, the updated shard out into the model's parameters
/// after, and maps a model parameter's state for checkpoints.
class Distributed {
 public:
  virtual ~Distributed() = default;
  /// Before the update: the gradient shard into the masters' .grad (still scaled by a loss
  /// scale: the Optimizer unscales and checks them after this).
  virtual void prepare() = 0;
  /// Clips the masters' gradients to the global norm `max_norm` (0: no clipping). Returns the
  /// norm before clipping, or -1 when not clipping.
  virtual double clip(double max_norm) = 0;
  /// After the update: the parameters take the updated masters.
  virtual void publish() = 0;
  /// Clears the model parameters' gradients (the masters' too).
  virtual void zero_grad() = 0;
  /// A model parameter's state, shaped as the parameter (a collective over the shard's group:
  /// every member calls it for the same parameters in the same order).
  virtual std::map<std::string, torch::Tensor> param_state(const Optimizer& opt, const torch::Tensor& param) const = 0;
  /// Replaces a model parameter's part of the shard's state from slots shaped as the parameter,
  /// as of `steps` steps (-1: the optimizer's).
  virtual void set_param_state(Optimizer& opt, const torch::Tensor& param,
                               const std::map<std::string, torch::Tensor>& slots, int64_t steps) = 0;
  /// How many steps a model parameter's state has taken (Optimizer::param_steps).
  virtual int64_t param_steps(const Optimizer& opt, const torch::Tensor& param) const = 0;
};

/// The optimizer. A bfloat16 or float16 parameter gets a float32 master copy that the update runs
/// on, with float32 state (mixed precision): step() casts the parameter's gradient into the
/// master's (the float32 sum of its backward passes when there were several: MainGrads), updates
/// the master and casts the result back into the parameter. A parameter changed
/// in place since the last step (a load, a user's copy_) is noticed by its version counter and
/// its master taken from it again.
class Optimizer {
 public:
  Optimizer(std::vector<torch::Tensor> params, OptimizerOptions options);

  /// Clears every parameter's gradient (and its master's).
  void zero_grad();
  /// Sets the scheduled lr, clips, and updates the parameters. Returns the gradient norm before
  /// clipping when clipping is on, otherwise -1. With loss scaling the gradients are unscaled and
  /// checked first: on inf/nan anywhere in the overflow group the step is skipped (nothing
  /// updated, the step count unchanged, the scale backed off, one line on rank 0's stderr) and
  /// last_step_skipped() says so.
  double step();
  bool last_step_skipped() const { return last_skipped_; }

  /// The loss scaler (null without loss scaling).
  const std::shared_ptr<LossScaler>& loss_scaler() const { return scaler_; }
  /// The ranks that must agree on an overflow (every rank holding a part of the model); null:
  /// this rank alone. step() runs a collective over it when loss scaling is on.
  void set_overflow_group(dist::GroupPtr group) { overflow_group_ = std::move(group); }

  /// Mixed precision's two halves of step(), for another optimizer path (a sharded one) to call:
  /// each low-precision parameter's gradient cast into its master's (float32), and the updated
  /// masters cast back into the parameters.
  void grads_to_masters();
  void masters_to_params();
  /// The master copy of `param` (undefined when it has none).
  torch::Tensor master(const torch::Tensor& param) const;
  /// Bytes of the master copies.
  int64_t master_bytes() const;
  /// The tensor options the optimizer's state of `param` has (float32 for a low-precision one).
  torch::TensorOptions state_options(const torch::Tensor& param) const;

  /// The lr the next step will use.
  double lr() const;
  /// Replaces the base lr (the schedule scales from it).
  /// The base rate (a finite number >= 0; anything else is refused).
  void set_lr(double lr);
  int64_t steps_taken() const { return steps_; }
  void set_steps_taken(int64_t steps) { steps_ = steps; }
  const OptimizerOptions& options() const { return options_; }
  /// Whether step() updates through the fused kernel (options().fused resolved for these tensors).
  bool fused() const { return fused_; }
  const std::vector<torch::Tensor>& params() const { return params_; }
  /// Bytes of the optimizer's state (momentum buffers, Adam's moments, master copies), as
  /// allocated so far.
  int64_t state_bytes() const;
  /// Bytes of the state once every parameter has stepped (Adam's two moments, SGD's momentum, in
  /// float32 for a low-precision parameter; masters not included), computed from the parameters
  /// without allocating it: what the planner reports.
  int64_t planned_state_bytes() const;
  /// The same for one of its parameters (0 for one it does not step).
  int64_t planned_state_bytes(const torch::Tensor& param) const;
  /// Bytes of the float32 masters of the low-precision parameters (made on the first step where
  /// the parameters are on the meta device): what the planner reports beside the state. Their
  /// gradients, cast from the parameters' by step(), take as many again.
  int64_t planned_master_bytes() const;
  torch::optim::Optimizer& impl() { return *impl_; }
  /// A parameter's state by slot ("exp_avg", "exp_avg_sq", "momentum_buffer", and "master" for a
  /// low-precision parameter); empty before its first step but for the master.
  std::map<std::string, torch::Tensor> param_state(const torch::Tensor& param) const;
  /// Replaces a parameter's state (slots as param_state gives them), as of steps_taken(). Without
  /// "master" a low-precision parameter's master takes the parameter's value; with one, a float32
  /// parameter takes the master's (full precision back from a bfloat16 run's checkpoint).
  /// `steps`: how many steps the state has taken (Adam's bias correction reads it); -1: as many
  /// as the optimizer, steps_taken().
  void set_param_state(const torch::Tensor& param, const std::map<std::string, torch::Tensor>& slots,
                       int64_t steps = -1);
  /// How many steps `param`'s state has taken: fewer than steps_taken() for a parameter that had
  /// no gradient on some (Adam and AdamW skip it); -1 when it has no state or the optimizer keeps
  /// no count (SGD).
  int64_t param_steps(const torch::Tensor& param) const;
  /// The state of one of the tensors this optimizer steps (under ZeRO: a master shard), by slot;
  /// and its replacement. param_state/set_param_state are these unless a Distributed maps them.
  std::map<std::string, torch::Tensor> local_state(const torch::Tensor& tensor) const;
  void set_local_state(const torch::Tensor& tensor, const std::map<std::string, torch::Tensor>& slots,
                       int64_t steps = -1);
  /// Makes this a distributed optimizer (see Distributed); null: a plain one.
  void set_distributed(std::shared_ptr<Distributed> d) { distributed_ = std::move(d); }
  const std::shared_ptr<Distributed>& distributed() const { return distributed_; }
  /// Adds a check that step() runs first; it throws to refuse the step (data parallelism uses
  /// it to refuse steps on gradients not yet synced).
  void add_step_check(std::function<void()> check) { checks_.push_back(std::move(check)); }
  /// Replaces how clipping measures the gradients' global norm (tensor parallelism sums split
  /// parameters over their group).
  void set_grad_norm(std::function<double(const std::vector<torch::Tensor>&)> norm) { norm_ = std::move(norm); }

 private:
  void check_lr(double lr) const;
  void apply_lr(double lr);
  // The update itself: impl_'s step, or the fused kernel over the same state.
  void update();
  // The index in params_ of `param`, or -1.
  int64_t index_of(const torch::Tensor& param) const;
  // Takes each master from its parameter where the parameter changed since the masters were
  // last written into it (its version counter moved).
  void refresh_masters();

  std::vector<torch::Tensor> params_;
  // What impl_ updates, one for each of params_: the parameter itself, or its float32 master.
  std::vector<torch::Tensor> work_;
  std::unordered_map<const c10::TensorImpl*, size_t> index_;  // params_[i] -> i
  std::vector<int64_t> versions_;  // each parameter's version counter when its master was last written
  std::shared_ptr<LossScaler> scaler_;
  // The low-precision parameters' gradients summed in float32 across backward passes.
  std::shared_ptr<MainGrads> main_grads_;
  dist::GroupPtr overflow_group_;
  bool last_skipped_ = false;
  OptimizerOptions options_;
  std::unique_ptr<torch::optim::Optimizer> impl_;
  bool fused_ = false;
  int64_t steps_ = 0;
  std::vector<std::function<void()>> checks_;
  std::function<double(const std::vector<torch::Tensor>&)> norm_;
  std::shared_ptr<Distributed> distributed_;
};

}  // namespace partrain::optim
