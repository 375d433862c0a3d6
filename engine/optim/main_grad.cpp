// The float32 gradient sums of low-precision parameters (see main_grad.hpp).
#include "engine/optim/main_grad.hpp"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

namespace partrain::optim {

struct MainGrads::Slot {
  explicit Slot(const torch::Tensor& p) : param(p.getIntrusivePtr()) {}
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> param;
  torch::Tensor sum;          // float32
  bool active = false;        // `sum` is what .grad rounds, as of `data`/`version`
  const void* data = nullptr;
  uint32_t version = 0;

  torch::Tensor grad_of() const {
    auto p = param.lock();
    return p ? torch::Tensor(std::move(p)).grad() : torch::Tensor();
  }
  bool in_step(const torch::Tensor& grad) const {
    return active && grad.defined() && grad.data_ptr() == data && static_cast<uint32_t>(grad._version()) == version;
  }
};

namespace {

using Slot = MainGrads::Slot;

// Before a gradient is added into .grad: when .grad already holds a pass's gradient, the sum goes
// on in float32 and .grad is cleared, so that autograd puts the rounded sum there.
struct SumInFloat32 : torch::autograd::FunctionPreHook {
  explicit SumInFloat32(std::weak_ptr<Slot> slot) : slot(std::move(slot)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& inputs) override {
    auto s = slot.lock();
    auto p = s ? s->param.lock() : nullptr;
    if (!p || inputs.empty() || !inputs[0].defined() || inputs[0].is_sparse()) return inputs;
    torch::Tensor param(std::move(p));
    torch::Tensor grad = param.grad();
    if (!grad.defined() || grad.is_sparse() || !grad.sizes().equals(inputs[0].sizes())) {
      s->active = false;  // a fresh sum: this pass's gradient alone
      return inputs;
    }
    torch::NoGradGuard no_grad;
    if (!s->in_step(grad)) {  // .grad came from elsewhere (a reduction, a load): the sum starts there
      if (!s->sum.defined() || !s->sum.sizes().equals(grad.sizes()) || s->sum.device() != grad.device())
        s->sum = torch::empty(grad.sizes(), grad.options().dtype(torch::kFloat32));
      s->sum.copy_(grad);
      s->active = true;
    }
    s->sum.add_(inputs[0].to(torch::kFloat32));
    param.mutable_grad() = torch::Tensor();
    auto out = inputs;
    out[0] = s->sum.to(param.scalar_type());
    return out;
  }
  std::weak_ptr<Slot> slot;
};

// After: remembers which .grad the sum stands behind (autograd may have taken the rounded sum as
// .grad or copied it; data parallelism's hooks may have moved it).
struct Remember : torch::autograd::FunctionPostHook {
  explicit Remember(std::weak_ptr<Slot> slot) : slot(std::move(slot)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto s = slot.lock()) {
      auto grad = s->grad_of();
      if (grad.defined() && s->active) {
        s->data = grad.data_ptr();
        s->version = static_cast<uint32_t>(grad._version());
      } else {
        s->active = false;
      }
    }
    return outputs;
  }
  std::weak_ptr<Slot> slot;
};

}  // namespace

MainGrads::MainGrads(const std::vector<torch::Tensor>& params) {
  for (const auto& p : params) {
    const auto dtype = p.scalar_type();
    if (!p.defined() || !p.requires_grad() || !p.is_leaf() || p.is_meta() ||
        (dtype != torch::kBFloat16 && dtype != torch::kFloat16) || slots_.count(p.unsafeGetTensorImpl()))
      continue;
    auto accumulator = torch::autograd::impl::grad_accumulator(p);
    if (!accumulator) continue;
    auto slot = std::make_shared<Slot>(p);
    accumulator->add_pre_hook(std::make_unique<SumInFloat32>(slot));
    accumulator->add_post_hook(std::make_unique<Remember>(slot));
    accumulators_.push_back(std::move(accumulator));
    slots_.emplace(p.unsafeGetTensorImpl(), std::move(slot));
  }
}

MainGrads::~MainGrads() = default;

torch::Tensor MainGrads::sum_of(const torch::Tensor& param) const {
  auto it = slots_.find(param.unsafeGetTensorImpl());
  if (it == slots_.end()) return {};
  const auto& s = *it->second;
  return s.in_step(param.grad()) ? s.sum : torch::Tensor();
}

}  // namespace partrain::optim
