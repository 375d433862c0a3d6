// The bodies behind compat.hpp: what differs between the LibTorch versions partrain builds
// against, in one file.
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>

#define PARTRAIN_COMPAT_C10D  // make_c10d_group is defined here
#include "engine/compat.hpp"

#ifdef PARTRAIN_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace partrain::compat {

std::string torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

torch::Tensor gelu_tanh(const torch::Tensor& x) { return at::gelu(x, "tanh"); }

std::string missing_kernels(torch::ScalarType dtype, const torch::Device& device) {
  if (device.is_meta() || !at::isFloatingType(dtype)) return "";
  static std::mutex mutex;
  static std::map<std::pair<int, int>, std::string> probed;
  std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_pair(static_cast<int>(dtype), static_cast<int>(device.type()));
  if (auto it = probed.find(key); it != probed.end()) return it->second;
  torch::AutoGradMode grad(true);
  auto o = torch::TensorOptions().dtype(dtype).device(device);
  std::string missing;
  auto probe = [&](const char* name, const std::function<torch::Tensor(const torch::Tensor&)>& fn) {
    try {
      auto x = torch::ones({2, 4}, o).requires_grad_(true);
      fn(x).sum().backward();
    } catch (const std::exception&) {
      missing += (missing.empty() ? "" : ", ") + std::string(name);
    }
  };
  probe("matmul (addmm)", [&](const torch::Tensor& x) { return at::addmm(torch::ones({2, 2}, o), x, x.t()); });
  probe("layer_norm", [](const torch::Tensor& x) { return at::layer_norm(x, {4}); });
  probe("softmax", [](const torch::Tensor& x) { return x.softmax(-1); });
  probe("log_softmax", [](const torch::Tensor& x) { return x.log_softmax(-1); });
  probe("gelu", [](const torch::Tensor& x) { return gelu_tanh(x); });
  probe("relu", [](const torch::Tensor& x) { return x.relu(); });
  probe("tanh", [](const torch::Tensor& x) { return x.tanh(); });
  probe("dropout", [](const torch::Tensor& x) { return at::dropout(x, 0.5, true); });
  return probed[key] = missing;
}

torch::Tensor fused_causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     double dropout) {
#if PARTRAIN_TORCH_AT_LEAST(2, 0)
  return at::scaled_dot_product_attention(q, k, v, {}, dropout, /*is_causal=*/true);
#else
  (void)q, (void)k, (void)v, (void)dropout;
  TORCH_CHECK(false, "fused attention needs LibTorch 2.0 or later; this is ", torch_version());
#endif
}

namespace {
std::atomic<bool> cuda_asked{false};  // whether this process has asked a CUDA runtime anything
}  // namespace

bool cuda_available() {
  bool yes = torch::cuda::is_available();
  if (yes) cuda_asked = true;  // a CPU LibTorch answers without a CUDA runtime
  return yes;
}

int cuda_device_count() {
  int n = static_cast<int>(torch::cuda::device_count());
  if (n > 0) cuda_asked = true;
  return n;
}

bool cuda_touched() { return cuda_asked; }

void synchronize(const torch::Device& device) {
  if (!device.is_cuda()) return;
#ifdef PARTRAIN_WITH_NCCL
  c10::cuda::CUDAGuard guard(device);
  c10::cuda::device_synchronize();
#else
  TORCH_CHECK(false, "device ", device.str(), " needs a CUDA build of partrain");
#endif
}

void use_device(const torch::Device& device) {
  if (!device.is_cuda()) return;
#ifdef PARTRAIN_WITH_NCCL  // a CUDA LibTorch (the one that carries NCCL)
  c10::cuda::set_device(device.index());
#else
  TORCH_CHECK(false, "device ", device.str(), " needs a CUDA build of partrain");
#endif
}

std::string message_of(const std::exception& e) {
  if (auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

// ---- Autograd hooks ------------------------------------------------------------------------

namespace {
struct LambdaPostHook : torch::autograd::FunctionPostHook {
  explicit LambdaPostHook(std::function<void()> fn) : fn(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fn();
    return outputs;
  }
  std::function<void()> fn;
};
}  // namespace

std::shared_ptr<torch::autograd::Node> on_grad_accumulated(const torch::Tensor& param, std::function<void()> fn) {
  auto accumulator = torch::autograd::impl::grad_accumulator(param);
  TORCH_CHECK(accumulator, "a gradient hook needs a leaf tensor that requires grad");
  accumulator->add_post_hook(std::make_unique<LambdaPostHook>(std::move(fn)));
  return accumulator;
}

void at_end_of_backward(std::function<void()> fn) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

// ---- c10d ----------------------------------------------------------------------------------

c10::intrusive_ptr<C10dGroup> make_c10d_group(const std::string& backend, const c10::intrusive_ptr<c10d::Store>& store,
                                              int rank, int size, std::chrono::milliseconds timeout) {
  if (backend == "nccl") {
#ifdef PARTRAIN_WITH_NCCL
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#else
    TORCH_CHECK(false, "this partrain was built without NCCL (a CPU LibTorch): use the gloo backend");
#endif
  }
  TORCH_CHECK(backend == "gloo", "unknown backend '", backend, "' (expected gloo or nccl)");
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  const char* master = std::getenv("MASTER_ADDR");
  std::string addr = master ? master : "127.0.0.1";
  bool loopback = addr.rfind("127.", 0) == 0 || addr == "localhost" || addr == "::1";
  if (ifname && *ifname)
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  else if (loopback)
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  else
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  options->threads = 1;  // one worker a group: ranks already share few cores
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

}  // namespace partrain::compat
