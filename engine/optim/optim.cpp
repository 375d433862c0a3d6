// Optimizers, schedules and clipping (see optim.hpp).
#include "engine/optim/optim.hpp"

#include "engine/compat.hpp"
#include "engine/util/startup.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <iostream>
#include <unordered_set>

#include "engine/dist/world.hpp"

namespace partrain::optim {

namespace {
// A rate, decay or momentum float32 arithmetic can hold: finite, and at most float32's largest
// (1e39 is finite as a double, yet turned every float32 weight to NaN without an error).
bool usable_factor(double x) { return std::isfinite(x) && x >= 0 && x <= std::numeric_limits<float>::max(); }
constexpr const char* kFactorRange = " must be a finite number from 0 to 3.4e38 (float32's largest), got ";

// The key of a parameter in torch::optim::Optimizer::state(): its TensorImpl's address.
void* state_key(const torch::Tensor& param) { return param.unsafeGetTensorImpl(); }
}  // namespace

void validate(const ScheduleOptions& s) {
  TORCH_CHECK(s.kind == "constant" || s.kind == "cosine" || s.kind == "linear",
              "schedule kind must be constant, cosine or linear, got '", s.kind, "'");
  TORCH_CHECK(s.warmup >= 0, "schedule warmup must be >= 0, got ", s.warmup);
  TORCH_CHECK(usable_factor(s.min_lr), "schedule min_lr", kFactorRange, s.min_lr);
  TORCH_CHECK(s.kind != "constant" || (s.total == 0 && s.min_lr == 0),
              "schedule total and min_lr shape a decay: give kind = \"cosine\" or \"linear\" with them (a constant "
              "schedule keeps the base rate after its warmup), got total=", s.total, " min_lr=", s.min_lr);
  if (s.kind != "constant")
    TORCH_CHECK(s.total > s.warmup, "a ", s.kind, " schedule needs total > warmup, got total=",
                s.total, " warmup=", s.warmup);
}

double scheduled_lr(const ScheduleOptions& s, double lr, int64_t step) {
  TORCH_CHECK(step >= 0, "scheduled_lr: step must be >= 0, got ", step);
  TORCH_CHECK(usable_factor(lr), "scheduled_lr: lr", kFactorRange, lr);
  if (step < s.warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup);
  if (s.kind == "constant") return lr;
  if (step >= s.total) return s.min_lr;
  double progress = static_cast<double>(step - s.warmup) / static_cast<double>(s.total - s.warmup);
  double factor = s.kind == "cosine" ? 0.5 * (1.0 + std::cos(M_PI * progress)) : 1.0 - progress;
  return s.min_lr + (lr - s.min_lr) * factor;
}

torch::Tensor clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm) {
  TORCH_CHECK(max_norm > 0, "clip_grad_norm needs max_norm > 0, got ", max_norm);
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> norms;
  for (const auto& p : params)
    if (p.grad().defined()) norms.push_back(p.grad().norm(2));
  if (norms.empty()) return {};
  auto total = norms.size() == 1 ? norms[0] : torch::stack(norms).norm(2);
  auto scale = torch::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0);
  for (const auto& p : params)
    if (p.grad().defined()) p.grad().mul_(scale);
  return total;
}

bool needs_master(torch::ScalarType dtype) { return dtype == torch::kBFloat16 || dtype == torch::kHalf; }

Optimizer::Optimizer(std::vector<torch::Tensor> params, OptimizerOptions o) : options_(std::move(o)) {
  // Each parameter once: a tied weight listed twice would be updated twice.
  std::unordered_set<const c10::TensorImpl*> seen;
  for (auto& p : params)
    if (p.defined() && seen.insert(p.unsafeGetTensorImpl()).second) params_.push_back(p);
  const auto& k = options_.kind;
  TORCH_CHECK(!params_.empty(), k, " optimizer got no parameters");
  for (const auto& p : params_)
    TORCH_CHECK(p.requires_grad() && p.is_leaf(), k, " optimizer: every parameter must be a leaf "
                "tensor that requires grad");
  // Mixed precision: a float32 master a low-precision parameter, the one the update runs on.
  for (const auto& p : params_) {
    torch::NoGradGuard no_grad;
    index_[p.unsafeGetTensorImpl()] = work_.size();
    work_.push_back(needs_master(p.scalar_type()) && !p.is_meta()
                        ? p.detach().to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true)
                        : p);
    versions_.push_back(p._version());
  }
  main_grads_ = std::make_shared<MainGrads>(params_);
  if (options_.loss_scale.kind != "none") {
    for (const auto& p : params_)
      TORCH_CHECK(p.scalar_type() != torch::kFloat64, k, ": loss scaling is for float16 (and bfloat16 or float32) "
                  "models; a float64 parameter's gradients do not underflow: drop loss_scale");
    scaler_ = std::make_shared<LossScaler>(options_.loss_scale);
  }
  // Finite: an infinite or NaN rate, decay or norm trains every weight to NaN with no error.
  check_lr(options_.lr);
  TORCH_CHECK(usable_factor(options_.weight_decay), k, ": weight_decay", kFactorRange, options_.weight_decay);
  TORCH_CHECK(usable_factor(options_.clip_grad_norm), k, ": clip_grad_norm", kFactorRange, options_.clip_grad_norm);
  validate(options_.schedule);
  const auto& fused = options_.fused;
  TORCH_CHECK(fused == "off" || fused == "on" || fused == "auto", k, ": fused must be on, off or auto, got '", fused, "'");
  TORCH_CHECK(fused != "on" || k == "adamw", k, ": fused is an option of adamw only");
  if (fused != "off" && k == "adamw") {
    // LibTorch's fused kernel runs on CPU tensors and, in a CUDA build, on CUDA ones (meta ones
    // under partrain plan stand for either).
    const auto& where = params_.front().device();
    bool possible = where.is_cpu() || where.is_meta() || (compat::kBuiltWithCuda && where.is_cuda());
    TORCH_CHECK(possible || fused == "auto", k, ": fused = true needs LibTorch's fused AdamW kernel for the "
                "parameters' device (CPU, or CUDA in a CUDA build); this is ", compat::build_description(),
                " with parameters on ", where.str(), ": drop fused, or give fused = \"auto\" to use it only "
                "where it exists");
    // The kernel walks each tensor's memory as one dense run: a parameter that is not contiguous
    // (a transposed tensor handed over in a table) keeps the unfused update.
    for (size_t i = 0; i < work_.size() && possible; ++i)
      if (!work_[i].is_contiguous()) {
        TORCH_CHECK(fused == "auto", k, ": fused = true needs contiguous parameters; parameter ", i + 1, " of shape ",
                    work_[i].sizes(), " is not (make it with .contiguous(), or give fused = \"auto\")");
        possible = false;
      }
    fused_ = possible;
  }
  if (k == "sgd") {
    TORCH_CHECK(usable_factor(options_.momentum), "sgd: momentum", kFactorRange, options_.momentum);
    TORCH_CHECK(std::isfinite(options_.dampening) && options_.dampening >= 0 && options_.dampening <= 1,
                "sgd: dampening must be in [0, 1], got ", options_.dampening);
    TORCH_CHECK(!options_.nesterov || (options_.momentum > 0 && options_.dampening == 0),
                "sgd: nesterov needs momentum > 0 and dampening = 0");
    impl_ = std::make_unique<torch::optim::SGD>(
        work_, torch::optim::SGDOptions(options_.lr)
                     .momentum(options_.momentum)
                     .dampening(options_.dampening)
                     .weight_decay(options_.weight_decay)
                     .nesterov(options_.nesterov));
  } else if (k == "adam" || k == "adamw") {
    TORCH_CHECK(options_.beta1 >= 0 && options_.beta1 < 1 && options_.beta2 >= 0 &&
                    options_.beta2 < 1,
                k, ": betas must be in [0, 1), got ", options_.beta1, ", ", options_.beta2);
    // eps = 0 divides a never-moved element's zero moment by zero: NaN weights.
    TORCH_CHECK(std::isfinite(options_.eps) && options_.eps > 0, k, ": eps must be a finite number > 0, got ",
                options_.eps);
    auto betas = std::make_tuple(options_.beta1, options_.beta2);
    if (k == "adam")
      impl_ = std::make_unique<torch::optim::Adam>(
          work_, torch::optim::AdamOptions(options_.lr).betas(betas).eps(options_.eps)
                       .weight_decay(options_.weight_decay));
    else
      impl_ = std::make_unique<torch::optim::AdamW>(
          work_, torch::optim::AdamWOptions(options_.lr).betas(betas).eps(options_.eps)
                       .weight_decay(options_.weight_decay));
  } else {
    TORCH_CHECK(false, "unknown optimizer '", k, "' (expected sgd, adam or adamw)");
  }
}

void Optimizer::zero_grad() {
  if (distributed_) distributed_->zero_grad();
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].mutable_grad() = torch::Tensor();
    work_[i].mutable_grad() = torch::Tensor();
  }
}

int64_t Optimizer::index_of(const torch::Tensor& param) const {
  auto it = param.defined() ? index_.find(param.unsafeGetTensorImpl()) : index_.end();
  return it == index_.end() ? -1 : static_cast<int64_t>(it->second);
}

torch::Tensor Optimizer::master(const torch::Tensor& param) const {
  auto i = index_of(param);
  return i >= 0 && !work_[i].is_same(params_[i]) ? work_[i] : torch::Tensor();
}

int64_t Optimizer::master_bytes() const {
  int64_t bytes = 0;
  for (size_t i = 0; i < params_.size(); ++i)
    if (!work_[i].is_same(params_[i])) bytes += static_cast<int64_t>(work_[i].nbytes());
  return bytes;
}

torch::TensorOptions Optimizer::state_options(const torch::Tensor& param) const {
  // A distributed optimizer keeps a model parameter's state in its masters' dtype.
  if (distributed_ && !params_.empty())
    return param.options().dtype(params_.front().scalar_type()).requires_grad(false);
  auto i = index_of(param);
  const auto& t = i >= 0 ? work_[i] : param;
  return t.options().requires_grad(false);
}

void Optimizer::refresh_masters() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i)
    if (!work_[i].is_same(params_[i]) && params_[i]._version() != versions_[i]) {
      work_[i].copy_(params_[i]);
      versions_[i] = params_[i]._version();
    }
}

void Optimizer::grads_to_masters() {
  refresh_masters();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (work_[i].is_same(params_[i])) continue;
    const auto& g = params_[i].grad();
    auto sum = main_grads_->sum_of(params_[i]);  // several passes: their float32 sum, not its rounding
    work_[i].mutable_grad() = sum.defined() ? sum.clone() : g.defined() ? g.detach().to(torch::kFloat32) : torch::Tensor();
  }
}

void Optimizer::masters_to_params() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (work_[i].is_same(params_[i])) continue;
    params_[i].copy_(work_[i]);
    versions_[i] = params_[i]._version();
  }
}

std::map<std::string, torch::Tensor> Optimizer::param_state(const torch::Tensor& param) const {
  return distributed_ ? distributed_->param_state(*this, param) : local_state(param);
}

void Optimizer::set_param_state(const torch::Tensor& param, const std::map<std::string, torch::Tensor>& slots,
                                int64_t steps) {
  TORCH_CHECK(steps >= -1 && steps <= steps_, options_.kind, ": a parameter's state cannot have taken ", steps,
              " steps; the optimizer has taken ", steps_);
  if (distributed_) {
    distributed_->set_param_state(*this, param, slots, steps);
  } else {
    set_local_state(param, slots, steps);
  }
}

int64_t Optimizer::param_steps(const torch::Tensor& param) const {
  if (options_.kind == "sgd") return -1;
  if (distributed_) return distributed_->param_steps(*this, param);
  const auto i = index_of(param);
  auto it = impl_->state().find(state_key(i >= 0 ? work_[i] : param));
  if (it == impl_->state().end()) return -1;
  if (auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(it->second.get())) return s->step();
  if (auto* s = dynamic_cast<const torch::optim::AdamParamState*>(it->second.get())) return s->step();
  return -1;
}

std::map<std::string, torch::Tensor> Optimizer::local_state(const torch::Tensor& param) const {
  std::map<std::string, torch::Tensor> out;
  const auto i = index_of(param);
  if (i >= 0 && !work_[i].is_same(params_[i])) {
    const_cast<Optimizer*>(this)->refresh_masters();
    out["master"] = work_[i].detach();
  }
  auto it = impl_->state().find(state_key(i >= 0 ? work_[i] : param));
  if (it == impl_->state().end()) return out;
  auto keep = [&](const char* slot, const torch::Tensor& t) {
    if (t.defined()) out[slot] = t;
  };
  if (auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(it->second.get())) {
    keep("exp_avg", s->exp_avg());
    keep("exp_avg_sq", s->exp_avg_sq());
  } else if (auto* s = dynamic_cast<const torch::optim::AdamParamState*>(it->second.get())) {
    keep("exp_avg", s->exp_avg());
    keep("exp_avg_sq", s->exp_avg_sq());
  } else if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(it->second.get())) {
    keep("momentum_buffer", s->momentum_buffer());
  }
  return out;
}

void Optimizer::set_local_state(const torch::Tensor& param, const std::map<std::string, torch::Tensor>& given,
                                int64_t steps) {
  if (steps < 0) steps = steps_;
  const auto i = index_of(param);  // -1: a tensor this optimizer does not update (frozen): state kept as given
  auto slots = given;
  if (i >= 0) {
    // The master: the saved one, else the parameter's value; a float32 parameter takes a saved
    // master (the full-precision value of a low-precision run).
    torch::NoGradGuard no_grad;
    const auto& work = work_[i];
    auto m = slots.find("master");
    if (m != slots.end()) {
      TORCH_CHECK(m->second.sizes().equals(param.sizes()), options_.kind, ": a master of shape ", m->second.sizes(),
                  " for a parameter of shape ", param.sizes());
      work.copy_(m->second);
      if (!work.is_same(param)) params_[i].copy_(work);
    } else if (!work.is_same(param)) {
      work.copy_(param);
    }
    versions_[i] = params_[i]._version();
  }
  slots.erase("master");
  for (auto& [name, t] : slots) t = t.to(state_options(param));
  auto slot = [&](const char* name) {
    auto it = slots.find(name);
    TORCH_CHECK(it != slots.end(), options_.kind, " state needs '", name, "'");
    return it->second;
  };
  auto key = state_key(i >= 0 ? work_[i] : param);
  if (slots.empty()) {
    impl_->state().erase(key);
    return;
  }
  if (options_.kind == "adamw") {
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(steps);
    s->exp_avg(slot("exp_avg"));
    s->exp_avg_sq(slot("exp_avg_sq"));
    impl_->state()[key] = std::move(s);
  } else if (options_.kind == "adam") {
    auto s = std::make_unique<torch::optim::AdamParamState>();
    s->step(steps);
    s->exp_avg(slot("exp_avg"));
    s->exp_avg_sq(slot("exp_avg_sq"));
    impl_->state()[key] = std::move(s);
  } else {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(slot("momentum_buffer"));
    impl_->state()[key] = std::move(s);
  }
}

std::vector<std::string> state_slots(const OptimizerOptions& o) {
  if (o.kind == "sgd") return o.momentum != 0.0 ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
  return {"exp_avg", "exp_avg_sq"};  // adam, adamw: the two moments
}

int64_t Optimizer::planned_state_bytes() const {
  const auto slots = static_cast<int64_t>(state_slots(options_).size());
  int64_t bytes = 0;
  for (const auto& p : params_) {
    if (!p.requires_grad()) continue;
    const int64_t element = needs_master(p.scalar_type()) ? 4 : static_cast<int64_t>(p.element_size());
    bytes += slots * element * p.numel();
  }
  return bytes;
}

int64_t Optimizer::planned_state_bytes(const torch::Tensor& param) const {
  const bool mine = std::any_of(params_.begin(), params_.end(), [&](const torch::Tensor& p) { return p.is_same(param); });
  if (!mine || !param.requires_grad()) return 0;
  const auto slots = static_cast<int64_t>(state_slots(options_).size());
  const int64_t element = needs_master(param.scalar_type()) ? 4 : static_cast<int64_t>(param.element_size());
  return slots * element * param.numel();
}

int64_t Optimizer::planned_master_bytes() const {
  int64_t bytes = 0;
  for (const auto& p : params_)
    if (p.requires_grad() && needs_master(p.scalar_type())) bytes += 4 * p.numel();
  return bytes;
}

int64_t Optimizer::state_bytes() const {
  int64_t bytes = 0;
  auto add = [&](const torch::Tensor& t) {
    if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
  };
  for (const auto& [key, state] : impl_->state()) {
    if (auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(state.get())) {
      add(s->exp_avg()); add(s->exp_avg_sq()); add(s->max_exp_avg_sq());
    } else if (auto* s = dynamic_cast<const torch::optim::AdamParamState*>(state.get())) {
      add(s->exp_avg()); add(s->exp_avg_sq()); add(s->max_exp_avg_sq());
    } else if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(state.get())) {
      add(s->momentum_buffer());
    }
  }
  return bytes + master_bytes();
}

void Optimizer::check_lr(double lr) const {
  TORCH_CHECK(usable_factor(lr), options_.kind, ": lr", kFactorRange, lr);
}

void Optimizer::set_lr(double lr) {
  check_lr(lr);
  options_.lr = lr;
}

double Optimizer::lr() const { return scheduled_lr(options_.schedule, options_.lr, steps_); }

void Optimizer::apply_lr(double lr) {
  for (auto& group : impl_->param_groups()) {
    if (options_.kind == "sgd")
      static_cast<torch::optim::SGDOptions&>(group.options()).lr(lr);
    else if (options_.kind == "adam")
      static_cast<torch::optim::AdamOptions&>(group.options()).lr(lr);
    else
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
}

void Optimizer::update() {
  if (!fused_) {
    impl_->step();
    return;
  }
  // The state lives where LibTorch's AdamW keeps it (impl_->state(), so checkpoints and
  // param_state read it unchanged), and one kernel a (device, dtype) updates it
  // (_fused_adamw_, CPU and CUDA). The step numbers reach the kernel as float32 scalars made on
  // the device: no copy from the host.
  torch::NoGradGuard no_grad;
  const auto& o = static_cast<const torch::optim::AdamWOptions&>(impl_->param_groups().front().options());
  struct Lists {
    std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
  };
  std::map<std::pair<std::string, int>, Lists> groups;
  std::map<std::pair<std::string, int64_t>, torch::Tensor> step_tensors;  // (device, step) -> its scalar
  for (const auto& w : work_) {
    if (!w.grad().defined()) continue;
    auto& slot = impl_->state()[state_key(w)];
    if (!slot) {
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->exp_avg(torch::zeros_like(w, torch::MemoryFormat::Preserve));
      s->exp_avg_sq(torch::zeros_like(w, torch::MemoryFormat::Preserve));
      slot = std::move(s);
    }
    auto& s = static_cast<torch::optim::AdamWParamState&>(*slot);
    s.step(s.step() + 1);
    auto& step = step_tensors[{w.device().str(), s.step()}];
    if (!step.defined()) step = torch::full({}, static_cast<double>(s.step()), w.options().dtype(torch::kFloat32));
    auto& g = groups[{w.device().str(), static_cast<int>(w.scalar_type())}];
    g.params.push_back(w);
    // A gradient set by hand may be laid out otherwise than its parameter (transposed,
    // expanded): the kernel reads it as dense memory, so it gets a contiguous copy.
    g.grads.push_back(w.grad().is_contiguous() ? w.grad() : w.grad().contiguous());
    g.exp_avgs.push_back(s.exp_avg());
    g.exp_avg_sqs.push_back(s.exp_avg_sq());
    g.steps.push_back(step);
  }
  auto [beta1, beta2] = o.betas();
  for (auto& [key, g] : groups)
    at::_fused_adamw_(g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, /*max_exp_avg_sqs=*/{}, g.steps, o.lr(), beta1,
                      beta2, o.weight_decay(), o.eps(), /*amsgrad=*/false, /*maximize=*/false);
}

double Optimizer::step() {
  util::startup_mark_once("first optimizer step");
  for (const auto& check : checks_) check();
  last_skipped_ = false;
  // The gradients of what is updated: a distributed optimizer's shard of the reduced gradients
  // into its masters; else float32 gradients for the masters of low-precision parameters.
  if (distributed_) distributed_->prepare();
  else grads_to_masters();
  if (scaler_) {
    std::vector<torch::Tensor> grads;
    for (const auto& w : work_) grads.push_back(w.grad());
    const bool overflow = scaler_->unscale_and_check(grads, overflow_group_);
    const double before = scaler_->update(overflow);
    if (overflow) {  // nothing changes but the scale; the gradients stay as they are, unscaled
      last_skipped_ = true;
      if (dist::World::instance().rank() == 0)
        std::cerr << "partrain: optimizer step " << steps_ + 1 << " skipped: gradients overflowed (inf or nan); "
                  << (scaler_->dynamic() ? "loss scale " : "static loss scale ") << before << " -> "
                  << scaler_->scale() << " (" << scaler_->skipped() << " skipped so far)" << std::endl;
      return -1;
    }
    // The norm below reads the parameters' gradients: a low-precision one gets its unscaled value.
    if (!distributed_ && options_.clip_grad_norm > 0 && norm_ && before != 1.0) {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < params_.size(); ++i)
        if (!work_[i].is_same(params_[i]) && params_[i].grad().defined()) params_[i].mutable_grad().copy_(work_[i].grad());
    }
  }
  apply_lr(lr());
  double norm = -1;
  if (distributed_) {
    norm = distributed_->clip(options_.clip_grad_norm);
    update();
    distributed_->publish();
    ++steps_;
    return norm;
  }
  torch::Tensor norm_here;  // clipping on one device: the norm is read once the update is queued
  if (options_.clip_grad_norm > 0) {
    if (norm_) {  // over a group (tensor parallel, pipeline): the collective's sum is read to scale
      norm = norm_(params_);
      double scale = options_.clip_grad_norm / (norm + 1e-6);
      if (scale < 1)
        for (auto& w : work_)
          if (w.grad().defined()) w.mutable_grad().mul_(scale);
    } else {
      norm_here = clip_grad_norm(work_, options_.clip_grad_norm);
      if (!norm_here.defined()) norm = 0.0;
    }
  }
  update();
  masters_to_params();
  ++steps_;
  // The one wait on the device that clipping adds, after every kernel of the step is queued.
  return norm_here.defined() ? norm_here.item<double>() : norm;
}

}  // namespace partrain::optim
