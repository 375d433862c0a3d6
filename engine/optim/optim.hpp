// Optimizers (SGD, Adam, AdamW on LibTorch's implementations), learning-rate schedules and
// gradient clipping by global norm, combined into one object whose step() does all three.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

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
  ScheduleOptions schedule;      ///< how lr changes with the step count
};

/// Scales the gradients of `params` so their global L2 norm is at most `max_norm`; returns the
/// norm before clipping.
double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm);

class Optimizer;

/// What a distributed optimizer (ZeRO: engine/parallel/zero.hpp) adds around the update: the
/// Optimizer then steps the tensors it was made with (this rank's shard of master weights), and
/// this moves the gradient shard in before, the updated shard out into the model's parameters
/// after, and maps a model parameter's state for checkpoints.
class Distributed {
 public:
  virtual ~Distributed() = default;
  /// Before the update: the gradient shard into the masters' .grad, clipped to the global norm
  /// `max_norm` (0: no clipping). Returns the norm before clipping, or -1 when not clipping.
  virtual double prepare(double max_norm) = 0;
  /// After the update: the parameters take the updated masters.
  virtual void publish() = 0;
  /// Clears the model parameters' gradients (the masters' too).
  virtual void zero_grad() = 0;
  /// A model parameter's state, shaped as the parameter (a collective over the shard's group:
  /// every member calls it for the same parameters in the same order).
  virtual std::map<std::string, torch::Tensor> param_state(const Optimizer& opt, const torch::Tensor& param) const = 0;
  /// Replaces a model parameter's part of the shard's state from slots shaped as the parameter.
  virtual void set_param_state(Optimizer& opt, const torch::Tensor& param,
                               const std::map<std::string, torch::Tensor>& slots) = 0;
};

class Optimizer {
 public:
  Optimizer(std::vector<torch::Tensor> params, OptimizerOptions options);

  /// Clears every parameter's gradient.
  void zero_grad();
  /// Sets the scheduled lr, clips, and updates the parameters. Returns the gradient norm before
  /// clipping when clipping is on, otherwise -1.
  double step();

  /// The lr the next step will use.
  double lr() const;
  /// Replaces the base lr (the schedule scales from it).
  void set_lr(double lr) { options_.lr = lr; }
  int64_t steps_taken() const { return steps_; }
  void set_steps_taken(int64_t steps) { steps_ = steps; }
  const OptimizerOptions& options() const { return options_; }
  const std::vector<torch::Tensor>& params() const { return params_; }
  /// Bytes of the optimizer's state (momentum buffers, Adam's moments), as allocated so far.
  int64_t state_bytes() const;
  /// Bytes of the state once every parameter has stepped (Adam's two moments, SGD's momentum),
  /// computed from the parameters without allocating it: what the planner reports.
  int64_t planned_state_bytes() const;
  torch::optim::Optimizer& impl() { return *impl_; }
  /// A parameter's state by slot ("exp_avg", "exp_avg_sq", "momentum_buffer"); empty before its
  /// first step.
  std::map<std::string, torch::Tensor> param_state(const torch::Tensor& param) const;
  /// Replaces a parameter's state (slots as param_state gives them), as of steps_taken().
  void set_param_state(const torch::Tensor& param, const std::map<std::string, torch::Tensor>& slots);
  /// The state of one of the tensors this optimizer steps (under ZeRO: a master shard), by slot;
  /// and its replacement. param_state/set_param_state are these unless a Distributed maps them.
  std::map<std::string, torch::Tensor> local_state(const torch::Tensor& tensor) const;
  void set_local_state(const torch::Tensor& tensor, const std::map<std::string, torch::Tensor>& slots);
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
  void apply_lr(double lr);

  std::vector<torch::Tensor> params_;
  OptimizerOptions options_;
  std::unique_ptr<torch::optim::Optimizer> impl_;
  int64_t steps_ = 0;
  std::vector<std::function<void()>> checks_;
  std::function<double(const std::vector<torch::Tensor>&)> norm_;
  std::shared_ptr<Distributed> distributed_;
};

}  // namespace partrain::optim
