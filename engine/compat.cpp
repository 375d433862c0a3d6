// The bodies behind compat.hpp: what differs between a CPU build and a CUDA one, in one file.
#include <atomic>
#include <cstdlib>
#include <mutex>

#include <torch/version.h>

#define PARTRAIN_COMPAT_C10D  // make_c10d_group is defined here
#include "engine/compat.hpp"

#ifdef PARTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>  // CUDA_VERSION
#endif
#ifdef PARTRAIN_WITH_NCCL
#include <torch/csrc/distributed/c10d/NCCLUtils.hpp>
#endif

namespace partrain::compat {

std::string torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

std::string build_description() {
  std::string text = "LibTorch " + torch_version();
#ifdef PARTRAIN_WITH_CUDA
  text += ", CUDA " + std::to_string(CUDA_VERSION / 1000) + "." + std::to_string(CUDA_VERSION % 1000 / 10);
#else
  text += ", CPU only";
#endif
#ifdef PARTRAIN_WITH_NCCL
  text += ", NCCL " + c10d::getNcclVersion();
#endif
  return text;
}

namespace {
std::atomic<bool> cuda_asked{false};  // whether this process has asked a CUDA runtime anything
}  // namespace

bool cuda_available() {
  if (!kBuiltWithCuda) return false;  // a CPU build never calls into CUDA, whatever its LibTorch has
  bool yes = torch::cuda::is_available();
  if (yes) cuda_asked = true;  // no device found: nothing of CUDA's was started for a fork to inherit
  return yes;
}

int cuda_device_count() {
  if (!kBuiltWithCuda) return 0;
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

int64_t cuda_total_memory(int index) {
  check_cuda_index(index, "total_memory");
#ifdef PARTRAIN_WITH_CUDA
  return static_cast<int64_t>(at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index))->totalGlobalMem);
#else
  return 0;
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
