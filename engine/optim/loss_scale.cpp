// The loss scaler's arithmetic and its overflow check (see loss_scale.hpp).
#include "engine/optim/loss_scale.hpp"

#include <algorithm>
#include <cmath>

#include "engine/dist/world.hpp"

namespace partrain::optim {

void validate(const LossScaleOptions& o) {
  TORCH_CHECK(o.kind == "none" || o.kind == "static" || o.kind == "dynamic",
              "loss_scale must be a number or \"dynamic\", got kind '", o.kind, "'");
  // A scale float32 cannot hold (or only as a denormal) skips every step as an overflow, forever.
  auto positive = [](const char* name, double v) {
    TORCH_CHECK(std::isfinite(v) && v >= 0x1p-126 && v <= 0x1p127, name,
                " must be a number float32 holds, from 2^-126 to 2^127, got ", v);
  };
  if (o.kind == "static") positive("loss_scale", o.scale);
  if (o.kind != "dynamic") return;
  positive("init_scale", o.init_scale);
  positive("min_scale", o.min_scale);
  TORCH_CHECK(std::isfinite(o.scale_factor) && o.scale_factor > 1, "scale_factor must be a finite number > 1, got ",
              o.scale_factor);
  TORCH_CHECK(o.scale_window >= 1, "scale_window must be >= 1, got ", o.scale_window);
  TORCH_CHECK(o.delayed_shift >= 1, "delayed_shift must be >= 1, got ", o.delayed_shift);
  TORCH_CHECK(o.init_scale >= o.min_scale, "init_scale=", o.init_scale, " is below min_scale=", o.min_scale);
}

LossScaler::LossScaler(LossScaleOptions options) : options_(std::move(options)) {
  validate(options_);
  state_.scale = options_.kind == "dynamic" ? options_.init_scale : options_.kind == "static" ? options_.scale : 1.0;
  state_.hysteresis = options_.delayed_shift;
}

void LossScaler::set_state(const LossScaleState& s) {
  TORCH_CHECK(std::isfinite(s.scale) && s.scale > 0, "loss scaler state: scale must be finite and > 0, got ", s.scale);
  TORCH_CHECK(s.good_steps >= 0 && s.skipped >= 0 && s.hysteresis >= 1, "loss scaler state: good_steps=",
              s.good_steps, ", skipped=", s.skipped, ", hysteresis=", s.hysteresis, " out of range");
  state_ = s;
  state_.hysteresis = std::min(s.hysteresis, options_.delayed_shift);  // saved under a larger delayed_shift
  if (!dynamic()) state_.scale = options_.kind == "static" ? options_.scale : 1.0;  // the option's, not the file's
}

torch::Tensor LossScaler::scale_loss(const torch::Tensor& loss) const { return loss * state_.scale; }

bool LossScaler::unscale_and_check(const std::vector<torch::Tensor>& grads, const dist::GroupPtr& group) const {
  torch::NoGradGuard no_grad;
  const double inverse = 1.0 / state_.scale;
  std::vector<torch::Tensor> flags;  // one bool a gradient, on its device: no host sync yet
  for (const auto& g : grads) {
    if (!g.defined()) continue;
    if (inverse != 1.0) g.mul_(inverse);
    flags.push_back(torch::isfinite(g).all().logical_not().reshape({1}));
  }
  // (1): 1 where some gradient overflowed. On the rank's device, where its collectives run.
  const auto device = dist::World::instance().device();
  auto found = flags.empty() ? torch::zeros({1}, torch::TensorOptions().device(device))
                             : torch::cat(flags).any().to(torch::kFloat32).reshape({1}).to(device);
  // Every rank holding a part of the model decides alike: the largest flag wins.
  if (group && group->size() > 1) group->all_reduce(found, dist::ReduceOp::Max);
  return found.item<float>() > 0;
}

double LossScaler::update(bool found_inf) {
  const double before = state_.scale;
  if (found_inf) {
    ++state_.skipped;
    if (!dynamic()) return before;
    state_.good_steps = 0;
    if (options_.delayed_shift == 1 || state_.hysteresis == 1)
      state_.scale = std::max(state_.scale / options_.scale_factor, options_.min_scale);
    else
      --state_.hysteresis;
    return before;
  }
  if (!dynamic()) return before;
  if (options_.consecutive_hysteresis) state_.hysteresis = options_.delayed_shift;
  if (++state_.good_steps >= options_.scale_window) {
    state_.good_steps = 0;
    state_.hysteresis = options_.delayed_shift;
    // Within what float32 holds: beyond, the scale itself overflows, every step is skipped and
    // backing off (inf / factor) never brings it back.
    state_.scale = std::min(state_.scale * options_.scale_factor, 0x1p127);
  }
  return before;
}

}  // namespace partrain::optim
