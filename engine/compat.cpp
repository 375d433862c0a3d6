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

#ifdef PARTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace partrain::compat {

std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return "float32";
    case c10::kDouble: return "float64";
    case c10::kHalf: return "float16";
    case c10::kBFloat16: return "bfloat16";
    case c10::kLong: return "int64";
    case c10::kInt: return "int32";
    case c10::kShort: return "int16";
    case c10::kChar: return "int8";
    case c10::kByte: return "uint8";
    case c10::kBool: return "bool";
    default: return c10::toString(t);
  }
}

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
#ifdef PARTRAIN_WITH_CUDA
  c10::cuda::CUDAGuard guard(device);
  c10::cuda::device_synchronize();
#else
  TORCH_CHECK(false, "device ", device.str(), " needs a CUDA build of partrain");
#endif
}

void use_device(const torch::Device& device) {
  if (!device.is_cuda()) return;
#ifdef PARTRAIN_WITH_CUDA
  c10::cuda::set_device(device.index());
#else
  TORCH_CHECK(false, "device ", device.str(), " needs a CUDA build of partrain");
#endif
}

namespace {
// Refuses what needs a CUDA device this process can use: no CUDA in the build, none present, or
// an index past the last one.
void check_cuda_index(int index, const char* what) {
  TORCH_CHECK(kBuiltWithCuda, what, ": CUDA is not available in this build (LibTorch ", torch_version(),
              " without CUDA)");
  int count = cuda_device_count();
  TORCH_CHECK(count > 0, what, ": CUDA is not available (this LibTorch sees no CUDA device)");
  TORCH_CHECK(index >= 0 && index < count, what, ": device ", index, " is out of range (", count,
              " CUDA device(s): 0..", count - 1, ")");
}

// Starts CUDA (and with it the caching allocator, whose counters exist from then on) the way
// every LibTorch version does it: allocating on the device.
void start_cuda(int index) { (void)torch::empty({0}, torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index))); }
}  // namespace

CudaMemory cuda_memory(int index) {
  check_cuda_index(index, "memory_stats");
#ifdef PARTRAIN_WITH_CUDA
  start_cuda(index);
  // Index 0 of each StatArray is StatType::AGGREGATE (small and large pools together).
  auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  const auto& allocated = stats.allocated_bytes[0];
  const auto& reserved = stats.reserved_bytes[0];
  return {allocated.current, reserved.current, allocated.peak, reserved.peak};
#else
  return {};
#endif
}

void cuda_reset_peak(int index) {
  check_cuda_index(index, "reset_peak_memory_stats");
#ifdef PARTRAIN_WITH_CUDA
  start_cuda(index);
  c10::cuda::CUDACachingAllocator::resetPeakStats(index);
#endif
}

int cuda_current_device() {
  check_cuda_index(0, "current_device");
#ifdef PARTRAIN_WITH_CUDA
  return static_cast<int>(c10::cuda::current_device());
#else
  return -1;
#endif
}

std::string cuda_device_name(int index) {
  check_cuda_index(index, "device_name");
#ifdef PARTRAIN_WITH_CUDA
  return at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index))->name;
#else
  return "";
#endif
}

torch::Tensor cuda_rng_state(const torch::Device& device) {
  TORCH_CHECK(device.is_cuda(), "cuda_rng_state: ", device.str(), " is not a CUDA device");
  check_cuda_index(device.index(), "cuda_rng_state");
  auto generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_cuda_rng_state(const torch::Device& device, const torch::Tensor& state) {
  TORCH_CHECK(device.is_cuda(), "set_cuda_rng_state: ", device.str(), " is not a CUDA device");
  check_cuda_index(device.index(), "set_cuda_rng_state");
  auto generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

torch::Tensor to_device(const torch::Tensor& host, const torch::Device& device) {
  if (host.device() == device) return host;
  if (!device.is_cuda() || !host.is_cpu()) return host.to(device);
  // pin_memory() copies into the caching host allocator's page-locked blocks, which record the
  // copy's stream: a block is reused only after the copy out of it has finished.
  return host.pin_memory().to(device, /*non_blocking=*/true);
}

void fused_adamw(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                 const std::vector<torch::Tensor>& exp_avgs, const std::vector<torch::Tensor>& exp_avg_sqs,
                 const std::vector<torch::Tensor>& steps, double lr, double beta1, double beta2,
                 double weight_decay, double eps) {
#if PARTRAIN_TORCH_AT_LEAST(2, 1) && defined(PARTRAIN_WITH_CUDA)
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr, beta1, beta2,
                    weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false);
#else
  (void)params, (void)grads, (void)exp_avgs, (void)exp_avg_sqs, (void)steps;
  (void)lr, (void)beta1, (void)beta2, (void)weight_decay, (void)eps;
  TORCH_CHECK(false, "fused AdamW needs LibTorch 2.1 or later built with CUDA; this is ", torch_version(),
              kBuiltWithCuda ? "" : " without CUDA");
#endif
}

std::string unsigned_nan(std::string text) {
  auto before = [](char c) {
    return c == ' ' || c == '(' || c == '[' || c == '{' || c == ',' || c == '=' || c == ':' || c == '\n';
  };
  auto after = [](char c) {
    return c == ' ' || c == ')' || c == ']' || c == '}' || c == ',' || c == ';' || c == ':' || c == '\n';
  };
  for (size_t at = text.find("-nan"); at != std::string::npos; at = text.find("-nan", at + 1)) {
    const size_t end = at + 4;
    if ((at == 0 || before(text[at - 1])) && (end == text.size() || after(text[end]) ||
                                              (text[end] == '.' && (end + 1 == text.size() || text[end + 1] == ' '))))
      text.erase(at, 1);
  }
  return text;
}

std::string message_of(const std::exception& e) {
  if (auto* c10 = dynamic_cast<const c10::Error*>(&e)) return unsigned_nan(c10->what_without_backtrace());
  return unsigned_nan(e.what());
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
