// Initialization by name and materialization of meta-built models (see init.hpp).
#include "engine/nn/init.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include "engine/util/memory.hpp"

#include <cmath>
#include <cstdio>
#include <mutex>
#include <limits>
#include <unordered_set>

namespace partrain::nn {

namespace {

// splitmix64's finalizer over (seed, FNV-1a of the name): well-spread seeds for nearby names.
uint64_t mix(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  uint64_t z = seed ^ (h + 0x9e3779b97f4a7c15ull + (seed << 6) + (seed >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct RestoreOptions {
  torch::TensorOptions saved = parameter_options();
  ~RestoreOptions() { set_parameter_options(saved); }
};

}  // namespace

void draw_init_seed(Module& root) {
  auto drawn = torch::randint(std::numeric_limits<int64_t>::max(), {1}, torch::kInt64).item<int64_t>();
  root.set_init_seed(static_cast<uint64_t>(drawn));
}

torch::ScalarType model_dtype(const std::string& name) {
  if (name == "float32" || name == "fp32") return torch::kFloat32;
  if (name == "float64" || name == "fp64") return torch::kFloat64;
  if (name == "bfloat16" || name == "bf16") return torch::kBFloat16;
  if (name == "float16" || name == "fp16") return torch::kFloat16;
  TORCH_CHECK(false, "dtype '", name, "' is not a model dtype (expected float32, float64, bfloat16 or float16; ",
              "fp32, fp64, bf16 and fp16 name them too)");
}

ModulePtr build_initialized(const std::function<ModulePtr()>& build, c10::optional<torch::ScalarType> dtype) {
  auto options = parameter_options();
  if (dtype) options = options.dtype(*dtype);
  const bool deferred = options.device().is_meta();
  ModulePtr root;
  {
    RestoreOptions restore;
    set_parameter_options(options.device(torch::kMeta));
    root = build();
  }
  draw_init_seed(*root);
  if (!deferred) materialize(*root, options.device());
  return root;
}

// ---- Recorded initializations ---------------------------------------------------------------

namespace {

// PyTorch's fans: dimension 1 (inputs) and 0 (outputs), each times the receptive field.
std::pair<double, double> fans(const Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() >= 2, what, " needs a tensor of at least 2 dimensions (its fans), got one of shape ", t.sizes());
  double receptive = 1;
  for (int64_t d = 2; d < t.dim(); ++d) receptive *= static_cast<double>(t.size(d));
  return {static_cast<double>(t.size(1)) * receptive, static_cast<double>(t.size(0)) * receptive};
}

// Meta tensors' recorded initializations, by tensor object; an entry whose tensor is gone is stale
// (its address may be reused) and is dropped when found or when the table has doubled.
struct Recorded {
  c10::weak_intrusive_ptr<c10::TensorImpl> tensor;
  std::vector<InitOp> ops;
};
std::mutex recorded_mutex;
std::unordered_map<const c10::TensorImpl*, Recorded> recorded_table;
size_t recorded_pruned_at = 64;

bool alive(const c10::TensorImpl* key, const Recorded& r) { return r.tensor.lock().get() == key; }

}  // namespace

void apply_init(Tensor& t, const InitOp& op, c10::optional<at::Generator> gen) {
  torch::NoGradGuard no_grad;
  using K = InitOp::Kind;
  auto uniform = [&](double lo, double hi) { t.uniform_(lo, hi, gen); };
  auto normal = [&](double mean, double std) { t.normal_(mean, std, gen); };
  switch (op.kind) {
    case K::normal: normal(op.a, op.b); break;
    case K::uniform: uniform(op.a, op.b); break;
    case K::constant: t.fill_(op.a); break;
    case K::add: t.add_(op.a); break;
    case K::mul: t.mul_(op.a); break;
    case K::xavier_uniform:
    case K::xavier_normal: {
      auto [in, out] = fans(t, "xavier initialization");
      const double std = op.a * std::sqrt(2.0 / (in + out));
      if (op.kind == K::xavier_normal) normal(0, std);
      else uniform(-std::sqrt(3.0) * std, std::sqrt(3.0) * std);
      break;
    }
    case K::kaiming_uniform:
    case K::kaiming_normal: {
      auto [in, out] = fans(t, "kaiming initialization");
      const double std = op.a / std::sqrt(op.b != 0 ? out : in);
      if (op.kind == K::kaiming_normal) normal(0, std);
      else uniform(-std::sqrt(3.0) * std, std::sqrt(3.0) * std);
      break;
    }
    case K::trunc_normal: {  // PyTorch's method: uniform in [cdf(a), cdf(b)], then the inverse normal CDF
      auto cdf = [](double x) { return (1 + std::erf(x / std::sqrt(2.0))) / 2; };
      const double l = cdf((op.c - op.a) / op.b), u = cdf((op.d - op.a) / op.b);
      uniform(2 * l - 1, 2 * u - 1);
      t.erfinv_().mul_(op.b * std::sqrt(2.0)).add_(op.a).clamp_(op.c, op.d);
      break;
    }
  }
}

void init_(Tensor& t, const InitOp& op) {
  if (!t.is_meta()) return apply_init(t, op);
  TORCH_CHECK(!t.is_view(), "an in-place initialization of part of a meta tensor (a view of shape ", t.sizes(),
              ") cannot be replayed when the model is materialized: initialize whole tensors inside pt.deferred");
  std::lock_guard<std::mutex> lock(recorded_mutex);
  const auto* key = t.unsafeGetTensorImpl();
  auto it = recorded_table.find(key);
  if (it != recorded_table.end() && !alive(key, it->second)) recorded_table.erase(it), it = recorded_table.end();
  if (it == recorded_table.end()) {
    if (recorded_table.size() >= 2 * recorded_pruned_at) {
      for (auto e = recorded_table.begin(); e != recorded_table.end();)
        e = alive(e->first, e->second) ? std::next(e) : recorded_table.erase(e);
      recorded_pruned_at = std::max<size_t>(64, recorded_table.size());
    }
    it = recorded_table.emplace(key, Recorded{c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), {}}).first;
  }
  if (op.overwrites()) it->second.ops.clear();  // what came before no longer shows
  it->second.ops.push_back(op);
}

std::vector<InitOp> recorded_inits(const Tensor& t) {
  if (!t.defined() || !t.is_meta()) return {};
  std::lock_guard<std::mutex> lock(recorded_mutex);
  auto it = recorded_table.find(t.unsafeGetTensorImpl());
  if (it == recorded_table.end() || !alive(it->first, it->second)) return {};
  return it->second.ops;
}

InitPlan init_plan(Module& root) {
  InitPlan plan;
  std::unordered_map<const c10::TensorImpl*, std::string> first;  // a tie: its first name in tree order
  for (const auto& [path, m] : root.modules()) {
    auto visit = [&, &path = path, &m = m](const std::string& local, const Tensor& t) {
      if (!t.defined() || !t.is_meta()) return;
      std::string name = path.empty() ? local : path + "." + local;
      auto [it, fresh] = first.emplace(t.unsafeGetTensorImpl(), name);
      if (fresh) plan[name] = TensorInit{name, m, local, recorded_inits(t)};
      else plan[name] = plan.at(it->second);
    };
    for (const auto& p : m->named_parameters(/*recurse=*/false)) visit(p.key(), p.value());
    for (const auto& b : m->named_buffers(/*recurse=*/false)) visit(b.key(), b.value());
  }
  return plan;
}

Tensor initial_tensor(const Module& root, const TensorInit& init, at::IntArrayRef shape) {
  auto seed = root.init_seed();
  TORCH_CHECK(seed, "cannot initialize '", init.name, "': the model (", root.type(), ") has no init seed (build it "
              "inside pt.deferred, or with a built-in model family)");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(mix(*seed, init.name));
  auto t = torch::empty(shape, torch::kFloat32);
  torch::NoGradGuard no_grad;
  if (init.ops.empty() || !init.ops.front().overwrites())
    if (!root.init_tensor(init.name, t, gen)) init.owner->reset_tensor(init.local, t, gen);
  for (const auto& op : init.ops) apply_init(t, op, gen);
  return t;
}

bool has_meta(const Module& root) {
  for (const auto& p : root.parameters(/*recurse=*/true))
    if (p.defined() && p.is_meta()) return true;
  for (const auto& b : root.buffers(/*recurse=*/true))
    if (b.defined() && b.is_meta()) return true;
  return false;
}

namespace {
// Refuses to allocate more than the memory this process may use on the CPU (the machine's, or its
// container's cgroup limit): Linux hands out the pages, and
// its out-of-memory killer ends the process part-way through initialization with no message.
void check_fits_in_memory(const Module& root, const torch::Device& device) {
  if (!device.is_cpu()) return;
  std::unordered_set<const c10::TensorImpl*> seen;  // a tied tensor once
  double bytes = 0, elements = 0;
  auto add = [&](const Tensor& t) {
    if (!t.defined() || !t.is_meta() || !seen.insert(t.unsafeGetTensorImpl()).second) return;
    elements += static_cast<double>(t.numel());
    bytes += static_cast<double>(t.numel()) * static_cast<double>(t.element_size());
  };
  for (const auto& p : root.parameters(/*recurse=*/true)) add(p);
  for (const auto& b : root.buffers(/*recurse=*/true)) add(b);
  const auto limit = util::memory_limit();
  if (limit.bytes <= 0) return;
  char text[160];
  std::snprintf(text, sizeof text, "%.3g elements (%.3g GB) of parameters and buffers, more than ", elements, bytes / 1e9);
  TORCH_CHECK(bytes <= limit.bytes, "the ", root.type(), " model takes ", text, limit.what, ": build it smaller, or inside ",
              "pt.deferred and give each rank its part with pt.parallelize (a pipeline stage, a tensor shard)");
}
}  // namespace

void materialize(Module& root, torch::Device device, const std::function<Tensor(const MetaTensor&)>& make,
                 const InitPlan* plan, bool check_memory) {
  if (check_memory) check_fits_in_memory(root, device);
  InitPlan own;
  if (!plan) own = init_plan(root), plan = &own;
  std::unordered_map<const c10::TensorImpl*, Tensor> done;  // a tied tensor: made once
  for (const auto& [path, m] : root.modules()) {
    auto visit = [&, &path = path, &m = m](const std::string& local, const Tensor& t, bool parameter) {
      if (!t.defined() || !t.is_meta()) return;
      auto it = done.find(t.unsafeGetTensorImpl());
      if (it == done.end()) {
        std::string name = path.empty() ? local : path + "." + local;
        auto init = plan->find(name);
        TORCH_CHECK(init != plan->end(), "materialize: '", name, "' of ", root.type(), " was not in the model as built "
                    "(a tensor put on the meta device after pt.deferred returned cannot be initialized by name)");
        MetaTensor mt{name, m.get(), local, t, &init->second};
        Tensor value = make ? make(mt) : initial_tensor(root, init->second, t.sizes()).to(device, t.scalar_type());
        TORCH_CHECK(value.sizes().equals(t.sizes()), "materialize: '", name, "' came out ", value.sizes(),
                    ", the model holds ", t.sizes());
        if (parameter) value = value.detach().requires_grad_(t.requires_grad());
        it = done.emplace(t.unsafeGetTensorImpl(), value).first;
      }
      m->replace_tensor(local, it->second);
    };
    for (const auto& p : m->named_parameters(/*recurse=*/false)) visit(p.key(), p.value(), true);
    for (const auto& b : m->named_buffers(/*recurse=*/false)) visit(b.key(), b.value(), false);
  }
}

}  // namespace partrain::nn
