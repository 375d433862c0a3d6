// Loss scaling for low-precision training (smp's DistributedOptimizer, DeepSpeed's loss scaler):
// the loss is multiplied by a scale before backward so small float16 gradients do not flush to
// zero; before the update the gradients are divided by it and checked for inf/nan, every rank
// holding a part of the model agreeing on the answer; an overflowed step is skipped and a dynamic
// scale backs off, then grows again after a window of good steps.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "engine/dist/process_group.hpp"

namespace partrain::optim {

struct LossScaleOptions {
  std::string kind = "none";       ///< "none", "static" (a fixed scale) or "dynamic"
  double scale = 1.0;              ///< static: the scale
  double init_scale = 4294967296;  ///< dynamic: the first scale (smp's default, 2^32)
  double scale_factor = 2.0;       ///< dynamic: backoff divides by it, growth multiplies by it
  int64_t scale_window = 1000;     ///< dynamic: good steps since the last overflow (or growth) before growing
  double min_scale = 1.0;          ///< dynamic: the scale never backs off below this
  /// dynamic: overflows it takes to back off (hysteresis); 1: every overflow backs off. The count
  /// is restored on growth, or after any good step with consecutive_hysteresis.
  int64_t delayed_shift = 1;
  bool consecutive_hysteresis = false;  ///< dynamic: only consecutive overflows count toward delayed_shift
};

/// Throws, naming the option and value, when options cannot be used.
void validate(const LossScaleOptions& options);

/// A loss scaler's state: what a checkpoint keeps to resume it exactly.
struct LossScaleState {
  double scale = 1.0;
  int64_t good_steps = 0;  ///< good steps since the last overflow or growth (the growth tracker)
  int64_t hysteresis = 1;  ///< overflows still tolerated before the next backoff
  int64_t skipped = 0;     ///< steps skipped so far
};

class LossScaler {
 public:
  explicit LossScaler(LossScaleOptions options);

  const LossScaleOptions& options() const { return options_; }
  bool dynamic() const { return options_.kind == "dynamic"; }
  /// The scale the next backward's loss is multiplied by.
  double scale() const { return state_.scale; }
  int64_t skipped() const { return state_.skipped; }
  const LossScaleState& state() const { return state_; }
  /// Restores a saved state; throws naming the field when it is not one this scaler can have.
  void set_state(const LossScaleState& state);

  /// loss x scale (a new tensor; the loss's dtype).
  torch::Tensor scale_loss(const torch::Tensor& loss) const;

  /// Divides every defined gradient in `grads` by the scale, in place, and tells whether any of
  /// them holds inf or nan on any rank of `group` (null: this rank alone). One fused check: the
  /// flags stay on the device until a single all-reduce and one read, whatever the number of
  /// gradients. Every rank of `group` must call it together.
  bool unscale_and_check(const std::vector<torch::Tensor>& grads, const dist::GroupPtr& group) const;

  /// Records a step's outcome: an overflow counts one skipped step and (dynamic) backs the scale
  /// off once delayed_shift overflows have been seen; a good step (dynamic) grows the scale after
  /// scale_window of them. Returns the scale before the update.
  double update(bool found_inf);

 private:
  LossScaleOptions options_;
  LossScaleState state_;
};

}  // namespace partrain::optim
