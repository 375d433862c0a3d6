// Initialization by name and materialization of meta-built models (see init.hpp).
#include "engine/nn/init.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include "engine/util/memory.hpp"

#include <cstdio>
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

Tensor initial_tensor(const Module& root, const std::string& name, at::IntArrayRef shape, const Module& owner,
                      const std::string& local) {
  auto seed = root.init_seed();
  TORCH_CHECK(seed, "cannot initialize '", name, "': the model (", root.type(), ") has no init seed (build it "
              "inside pt.deferred, or with a built-in model family)");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(mix(*seed, name));
  auto t = torch::empty(shape, torch::kFloat32);
  torch::NoGradGuard no_grad;
  if (!root.init_tensor(name, t, gen)) owner.reset_tensor(local, t, gen);
  return t;
}

std::unordered_map<std::string, std::string> canonical_names(const Module& root) {
  std::unordered_map<const c10::TensorImpl*, std::string> first;
  std::unordered_map<std::string, std::string> out;
  auto add = [&](const std::string& name, const Tensor& t) {
    if (!t.defined()) return;
    auto [it, fresh] = first.emplace(t.unsafeGetTensorImpl(), name);
    if (!fresh) out[name] = it->second, out[it->second] = it->second;
  };
  for (const auto& p : root.named_parameters(/*recurse=*/true)) add(p.key(), p.value());
  for (const auto& b : root.named_buffers(/*recurse=*/true)) add(b.key(), b.value());
  return out;
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
                 const std::unordered_map<std::string, std::string>& canonical) {
  check_fits_in_memory(root, device);
  auto tied = canonical_names(root);
  std::unordered_map<const c10::TensorImpl*, Tensor> done;  // a tied tensor: made once
  for (const auto& [path, m] : const_cast<Module&>(root).modules()) {
    auto visit = [&](const std::string& local, const Tensor& t, bool parameter) {
      if (!t.defined() || !t.is_meta()) return;
      auto it = done.find(t.unsafeGetTensorImpl());
      if (it == done.end()) {
        std::string name = path.empty() ? local : path + "." + local;
        if (auto c = canonical.find(name); c != canonical.end()) name = c->second;
        else if (auto c = tied.find(name); c != tied.end()) name = c->second;
        MetaTensor mt{name, m.get(), local, t};
        Tensor value = make ? make(mt)
                            : initial_tensor(root, name, t.sizes(), *m, local).to(device, t.scalar_type());
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
