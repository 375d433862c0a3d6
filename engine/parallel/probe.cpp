// The probe of a sharding policy (see probe.hpp).
#include "engine/parallel/probe.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <sstream>
#include <unordered_set>

#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/util/text.hpp"
#include "engine/util/step_events.hpp"

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

// A container's first block only, for as long as this lives (the probe's slice).
class FirstBlockOnly {
 public:
  FirstBlockOnly(nn::Module& root, const std::string& path) {
    if (path.empty()) return;
    container_ = root.find(path);
    TORCH_CHECK(container_, "probe: the model has no module '", path, "' to take a slice of");
    saved_ = container_->save_slots();
    container_->keep_children(1);
  }
  ~FirstBlockOnly() {
    if (container_) container_->restore_slots(saved_);
  }

 private:
  std::shared_ptr<nn::Module> container_;
  nn::Module::Slots saved_;
};

// A deferred model's meta tensors given values for as long as this lives (each initialized by
// name as pt.parallelize will: materialize_local), then the meta tensors put back.
class Materialized {
 public:
  Materialized(nn::Module& root, const nn::InitPlan& plan) {
    for (const auto& [path, m] : root.modules())
      for (const auto& p : m->named_parameters(/*recurse=*/false))
        if (p.value().defined() && p.value().is_meta()) saved_.push_back({m, p.key(), p.value()});
    if (!saved_.empty()) materialize_local(root, plan);
  }
  ~Materialized() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) it->module->replace_tensor(it->local, it->meta);
  }
  Materialized(const Materialized&) = delete;
  Materialized& operator=(const Materialized&) = delete;

 private:
  struct Saved {
    std::shared_ptr<nn::Module> module;
    std::string local;
    Tensor meta;
  };
  std::vector<Saved> saved_;
};

// The model's floating tensors in float64 for as long as this lives, then each back in its own
// dtype (widening and narrowing again is exact). The same tensor objects: ties hold.
class Widened {
 public:
  explicit Widened(nn::Module& root) {
    torch::NoGradGuard no_grad;
    std::unordered_set<const c10::TensorImpl*> seen;
    auto widen = [&](const Tensor& t) {
      if (!t.defined() || !t.is_floating_point() || t.scalar_type() == torch::kFloat64 ||
          !seen.insert(t.unsafeGetTensorImpl()).second) return;
      saved_.emplace_back(t, t.scalar_type());
      Tensor(t).set_data(t.detach().to(torch::kFloat64));
    };
    for (const auto& p : root.parameters(/*recurse=*/true)) widen(p);
    for (const auto& b : root.buffers(/*recurse=*/true)) widen(b);
  }
  ~Widened() {
    torch::NoGradGuard no_grad;
    for (auto& [t, dtype] : saved_) t.set_data(t.detach().to(dtype));
  }
  Widened(const Widened&) = delete;
  Widened& operator=(const Widened&) = delete;

 private:
  std::vector<std::pair<Tensor, c10::ScalarType>> saved_;
};

// The unit of rounding of a floating dtype (half the distance from 1 to the next number).
double unit_roundoff(c10::ScalarType t) {
  switch (t) {
    case torch::kFloat64: return std::ldexp(1.0, -53);
    case torch::kFloat32: return std::ldexp(1.0, -24);
    case torch::kFloat16: return std::ldexp(1.0, -11);
    case torch::kBFloat16: return std::ldexp(1.0, -8);
    default: return std::ldexp(1.0, -8);
  }
}

Tensor as_f64(const Tensor& t) { return t.detach().to(torch::kCPU, torch::kFloat64); }
double max_abs(const Tensor& t) { return t.numel() ? t.abs().max().item<double>() : 0; }

// "" when `got` equals `want` within the tolerance of their dtype; `exact` (when given) is what the
// serial model computes in float64, against which the tolerance is the serial model's own
// rounding (see compare_probes).
std::string differ(const Tensor& got, const Tensor& want, const Tensor& exact = {}) {
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
  auto g = as_f64(got), w = as_f64(want);
  if (!g.isnan().equal(w.isnan())) return "not-a-number in different places";
  g = g.nan_to_num(0), w = w.nan_to_num(0);
  const auto dtype = want.scalar_type();
  if (exact.defined() && exact.sizes().equals(want.sizes()) && dtype != torch::kFloat64) {
    auto x = as_f64(exact).nan_to_num(0);
    const double mine = max_abs(g - x), theirs = max_abs(w - x), scale = max_abs(x);
    const double tol = 4 * theirs + 8 * unit_roundoff(dtype) * scale;
    if (mine <= tol) return "";
    s << "a largest difference from the exact (float64) values of " << mine << " where the serial model's "
      << util::dtype_name(dtype) << " rounding gives " << theirs << " (tolerance " << tol << ")";
    return s.str();
  }
  const double err = max_abs(g - w), scale = max_abs(w);
  const double rel = dtype == torch::kFloat64 ? 1e-8 : dtype == torch::kFloat32 ? 1e-3 : 5e-2;
  const double tol = rel * std::max(scale, 1e-6);
  if (err <= tol) return "";
  s << "a largest difference of " << err << " (tolerance " << tol << ")";
  return s.str();
}

ProbeRecord probe_once(nn::Module& model, const std::vector<Tensor>& inputs) {
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

}  // namespace

Tensor probe_input(const std::vector<int64_t>& shape, int64_t high, c10::ScalarType dtype, torch::Device device) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(kSeed);
  auto cpu = torch::TensorOptions().device(torch::kCPU);
  Tensor t = high > 0 ? torch::randint(high, shape, gen, cpu.dtype(torch::kInt64)) : torch::randn(shape, gen, cpu);
  return t.to(device, high > 0 ? torch::kInt64 : dtype);
}

ProbeRecord run_probe(nn::Module& model, const std::vector<Tensor>& inputs, const ProbeOptions& options,
                      const ProbeRecord* serial) {
  FirstBlockOnly slice(model, options.slice);
  auto init = serial ? serial->plan : nullptr;
  if (!init && nn::has_meta(model)) init = std::make_shared<const nn::InitPlan>(nn::init_plan(model));
  c10::optional<Materialized> made;
  if (init) made.emplace(model, *init);

  std::vector<torch::Device> devices{torch::kCPU};
  for (const auto& p : model.parameters())
    if (!p.device().is_cpu() && std::find(devices.begin(), devices.end(), p.device()) == devices.end())
      devices.push_back(p.device());
  RngGuard rng(devices);
  events::Aside aside;  // its forward is not the script's first step
  EvalGuard eval(model);
  torch::AutoGradMode grad_mode(true);

  ProbeRecord record = probe_once(model, inputs);
  record.plan = init;
  const bool low = record.output.defined() && record.output.is_floating_point() &&
                   record.output.scalar_type() != torch::kFloat64;
  if (options.reference && low) {
    Widened wide(model);
    std::vector<Tensor> wide_inputs;
    for (const auto& x : inputs) wide_inputs.push_back(x.is_floating_point() ? x.to(torch::kFloat64) : x);
    record.reference = std::make_shared<const ProbeRecord>(probe_once(model, wide_inputs));
  }
  return record;
}

std::string repeated_blocks(nn::Module& root) {
  std::string best;
  size_t most = 1;
  for (const auto& [path, m] : root.modules()) {
    auto children = m->children_named();
    if (children.size() <= most) continue;
    bool alike = std::all_of(children.begin(), children.end(),
                             [&](const auto& c) { return c.second->type() == children.front().second->type(); });
    if (alike) best = path, most = children.size();
  }
  return best;
}

std::string compare_probes(const ProbeRecord& serial, const ProbeRecord& sharded, bool vocab_head) {
  if (vocab_head && !sharded.split_output)
    return "its output is not the vocabulary head's split logits: P.vocab_head belongs on the layer that "
           "gives the model's output (pt.loss_fn(model) would take other values for split logits)";
  const auto* exact = serial.reference.get();
  if (auto d = differ(sharded.output, serial.output, exact ? exact->output : Tensor()); !d.empty())
    return "its output differs from the serial model's on the probe batch: " + d;
  for (const auto& [name, want] : serial.grads) {
    auto it = std::find_if(sharded.grads.begin(), sharded.grads.end(), [&](const auto& e) { return e.first == name; });
    if (sharded.grads.empty())
      return "no gradient flows from its output to its parameters, as it does in the serial model";
    if (it == sharded.grads.end())
      return "the serial model's parameter " + name + " has no counterpart (or is tied differently) after it";
    Tensor x;
    if (exact)
      for (const auto& [n, g] : exact->grads)
        if (n == name) x = g;
    if (auto d = differ(it->second, want, x); !d.empty())
      return "the gradient of " + name + " differs from the serial model's on the probe batch: " + d;
  }
  return "";
}

}  // namespace partrain::parallel
