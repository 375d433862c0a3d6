// The probe of a sharding policy (see probe.hpp).
#include "engine/parallel/probe.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <sstream>
#include <unordered_set>

#include "engine/parallel/tensor_parallel.hpp"
#include "engine/plan/plan.hpp"

namespace partrain::parallel {

RngGuard::RngGuard(const std::vector<torch::Device>& devices) {
  for (const auto& d : devices) {
    auto gen = d.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    saved_.emplace_back(gen, gen.get_state());
  }
}

RngGuard::~RngGuard() {
  for (auto& [gen, state] : saved_) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
}

namespace {

constexpr uint64_t kSeed = 0x5eed;

// Every module's training flag, put back when this goes (the probe runs in eval mode).
class EvalGuard {
 public:
  explicit EvalGuard(nn::Module& model) {
    for (const auto& [path, m] : model.modules()) flags_.emplace_back(m, m->is_training());
    model.eval();
  }
  ~EvalGuard() {
    for (auto& [m, flag] : flags_) m->train(flag);  // pre-order: each overrides its parent's
  }

 private:
  std::vector<std::pair<std::shared_ptr<nn::Module>, bool>> flags_;
};

double tolerance(c10::ScalarType t) {
  if (t == torch::kFloat64) return 1e-8;
  if (t == torch::kFloat32) return 1e-3;
  return 5e-2;
}

// "" when `got` equals `want` within the tolerance of their dtype, relative to want's largest value.
std::string differ(const Tensor& got, const Tensor& want) {
  std::ostringstream s;
  if (!got.defined() || !want.defined()) return got.defined() == want.defined() ? "" : "one of them is missing";
  if (!got.sizes().equals(want.sizes())) {
    s << "shape " << got.sizes() << " where the serial model's is " << want.sizes();
    return s.str();
  }
  if (got.numel() == 0) return "";
  if (!got.is_floating_point() || !want.is_floating_point()) {
    if (!got.to(torch::kCPU).equal(want.to(torch::kCPU).to(got.scalar_type()))) return "different values";
    return "";
  }
  auto g = got.detach().to(torch::kCPU, torch::kFloat64), w = want.detach().to(torch::kCPU, torch::kFloat64);
  if (!g.isnan().equal(w.isnan())) return "not-a-number in different places";
  g = g.nan_to_num(0), w = w.nan_to_num(0);
  double err = (g - w).abs().max().item<double>(), scale = w.abs().max().item<double>();
  double tol = tolerance(want.scalar_type()) * std::max(scale, 1e-6);
  if (err <= tol) return "";
  s << "a largest difference of " << err << " (tolerance " << tol << ")";
  return s.str();
}

}  // namespace

Tensor probe_input(const std::vector<int64_t>& shape, int64_t high, c10::ScalarType dtype, torch::Device device) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(kSeed);
  auto cpu = torch::TensorOptions().device(torch::kCPU);
  Tensor t = high > 0 ? torch::randint(high, shape, gen, cpu.dtype(torch::kInt64)) : torch::randn(shape, gen, cpu);
  return t.to(device, high > 0 ? torch::kInt64 : dtype);
}

ProbeRecord run_probe(nn::Module& model, const std::vector<Tensor>& inputs) {
  std::vector<torch::Device> devices{torch::kCPU};
  for (const auto& p : model.parameters())
    if (!p.device().is_cpu() && std::find(devices.begin(), devices.end(), p.device()) == devices.end())
      devices.push_back(p.device());
  RngGuard rng(devices);
  plan::FirstStepGuard first_step;  // its forward is not the script's first step
  EvalGuard eval(model);
  torch::AutoGradMode grad_mode(true);

  ProbeRecord record;
  Tensor out = model.forward(inputs);
  if (auto split = split_logits_of(out)) {
    out = gather_split_logits(out, *split);
    record.split_output = true;
  }
  record.output = out.detach();

  // Parameters once each (a tied one under its first name), in registration order: the same on
  // every rank, so the gathers of split gradients line up.
  std::vector<std::string> names;
  std::vector<Tensor> params;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : model.named_parameters())
    if (p.value().requires_grad() && seen.insert(p.value().unsafeGetTensorImpl()).second) {
      names.push_back(p.key());
      params.push_back(p.value());
    }
  if (params.empty() || !out.requires_grad() || !out.is_floating_point()) return record;
  auto w = probe_input(out.sizes().vec(), 0, out.scalar_type(), out.device());
  auto loss = (out * w).sum();
  auto grads = torch::autograd::grad({loss}, params, {}, /*retain_graph=*/false, /*create_graph=*/false,
                                     /*allow_unused=*/true);
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor g = grads[i].defined() ? grads[i] : torch::zeros_like(params[i]);
    if (auto s = sharding_of(model, names[i])) g = gather_full(g, *s);
    record.grads.emplace_back(names[i], g.detach());
  }
  return record;
}

std::string compare_probes(const ProbeRecord& serial, const ProbeRecord& sharded, bool vocab_head) {
  if (vocab_head && !sharded.split_output)
    return "its output is not the vocabulary head's split logits: P.vocab_head belongs on the layer that "
           "gives the model's output (pt.loss_fn(model) would take other values for split logits)";
  if (auto d = differ(sharded.output, serial.output); !d.empty())
    return "its output differs from the serial model's on the probe batch: " + d;
  for (const auto& [name, want] : serial.grads) {
    auto it = std::find_if(sharded.grads.begin(), sharded.grads.end(), [&](const auto& e) { return e.first == name; });
    if (sharded.grads.empty())
      return "no gradient flows from its output to its parameters, as it does in the serial model";
    if (it == sharded.grads.end())
      return "the serial model's parameter " + name + " has no counterpart (or is tied differently) after it";
    if (auto d = differ(it->second, want); !d.empty())
      return "the gradient of " + name + " differs from the serial model's on the probe batch: " + d;
  }
  return "";
}

}  // namespace partrain::parallel
