// Differences between the LibTorch versions partrain builds against (Debian's 1.13 on CPU, the
// 2.x that ships with CUDA wheels), kept in this one header so the rest of the code is version-free.
#pragma once

#include <sstream>
#include <string>
#include <type_traits>

#include <torch/torch.h>
#include <torch/version.h>

#define PARTRAIN_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace partrain::compat {

/// The LibTorch version as "major.minor.patch".
std::string torch_version();

/// The name partrain gives a dtype in messages and in Lua ("float32", "bfloat16", "int64", ...),
/// the same whichever name LibTorch's version prints for it.
std::string dtype_name(c10::ScalarType t);

/// GELU with the tanh approximation (GPT-2's). The option's spelling is the same in 1.13 and 2.x,
/// but keeping the call here lets a future rename stay in one place.
torch::Tensor gelu_tanh(const torch::Tensor& x);

/// Whether this LibTorch has a fused attention kernel (scaled_dot_product_attention: flash and
/// memory-efficient attention on CUDA). 1.13 has none.
constexpr bool kHasFusedAttention = PARTRAIN_TORCH_AT_LEAST(2, 0);

/// Causal softmax(q k^T / sqrt(d)) v in one fused call, q, k, v (B, heads, T, d). Only where
/// kHasFusedAttention; callers compute the same math in steps otherwise.
torch::Tensor fused_causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     double dropout);

/// The key of a parameter in torch::optim::Optimizer::state(): the TensorImpl's address printed
/// in LibTorch 1.x, the address itself in 2.x. (A template so the branch not taken is never
/// compiled.)
template <class T = torch::Tensor>
inline auto optimizer_state_key(const T& param) {
  using Key = typename std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream s;
    s << param.unsafeGetTensorImpl();
    return s.str();
  } else {
    return static_cast<Key>(param.unsafeGetTensorImpl());
  }
}

/// The kernels a model computing in `dtype` on `device` needs (matmul, layer_norm, softmax,
/// log_softmax, gelu, relu, tanh, dropout, forward and backward) that this LibTorch lacks there,
/// as a comma-separated list; empty when all are present. Probed once per (dtype, device type) on
/// tiny tensors: LibTorch 1.13's CPU kernels lack most of them in float16 (2.x added some).
std::string missing_kernels(torch::ScalarType dtype, const torch::Device& device);

/// Whether this partrain was built against a CUDA LibTorch (PARTRAIN_WITH_CUDA, set by
/// CMakeLists.txt): only then does it call into libc10_cuda and libtorch_cuda. Debian's CPU
/// LibTorch ships their headers but not the libraries.
#ifdef PARTRAIN_WITH_CUDA
constexpr bool kBuiltWithCuda = true;
#else
constexpr bool kBuiltWithCuda = false;
#endif

/// Whether this LibTorch has the fused AdamW kernel (at::_fused_adamw_, CUDA, LibTorch 2.1 on).
constexpr bool kHasFusedAdamW = kBuiltWithCuda && PARTRAIN_TORCH_AT_LEAST(2, 1);

/// Whether this LibTorch can reach a CUDA device at run time.
bool cuda_available();

/// How many CUDA devices this LibTorch sees (0 without CUDA).
int cuda_device_count();

/// Whether this process has asked a CUDA runtime anything (the two calls above, when CUDA is
/// there). A process that has must not fork children that use CUDA: the launcher then starts
/// its ranks with exec.
bool cuda_touched();

/// Makes `device` (a CUDA device) the thread's current one, as torch.cuda.set_device does, so that
/// NCCL and kernels launched without a device use the rank's. Nothing for a CPU device.
void use_device(const torch::Device& device);

/// Waits until every kernel queued on `device` has finished (CUDA), so a host clock read after it
/// times them; nothing for a CPU device.
void synchronize(const torch::Device& device);

/// The CUDA caching allocator's counters for one device, in bytes: what tensors hold now and at
/// the peak, and what the allocator has reserved from the driver now and at the peak.
struct CudaMemory {
  int64_t allocated = 0, reserved = 0, peak_allocated = 0, peak_reserved = 0;
};
/// The counters of CUDA device `index`, and the reset of their peaks to the current values. A
/// build without CUDA, or an index out of range, is an error.
CudaMemory cuda_memory(int index);
void cuda_reset_peak(int index);
/// The thread's current CUDA device, and a device's name ("NVIDIA H100 80GB HBM3").
int cuda_current_device();
std::string cuda_device_name(int index);

/// The state of CUDA device `device`'s default generator (a CPU uint8 tensor), and its
/// replacement. Only on a CUDA build; the format is LibTorch's (Philox seed and offset).
torch::Tensor cuda_rng_state(const torch::Device& device);
void set_cuda_rng_state(const torch::Device& device, const torch::Tensor& state);

/// `host` (a CPU tensor a loader made) on `device`: on CUDA through page-locked memory and a copy
/// that does not block the host (the copy is ordered on the current stream before the kernels
/// that read the batch); itself on the CPU.
torch::Tensor to_device(const torch::Tensor& host, const torch::Device& device);

/// One AdamW step over same-device, same-dtype lists, in LibTorch's fused CUDA kernel
/// (_fused_adamw_): `step` is a float32 scalar on the device holding the step number after this
/// one (1 on the first), as Adam's bias correction reads it. Only where kHasFusedAdamW.
void fused_adamw(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                 const std::vector<torch::Tensor>& exp_avgs, const std::vector<torch::Tensor>& exp_avg_sqs,
                 const std::vector<torch::Tensor>& steps, double lr, double beta1, double beta2,
                 double weight_decay, double eps);

/// `text` with each "-nan" that stands alone as a number written "nan", as Lua writes a NaN: C++
/// streams write one whose sign bit is set (0/0 makes one) "-nan", and a NaN has no sign to speak
/// of. A name that holds "-nan" ("a-nan.txt", "'-nan'") is left as it is.
std::string unsigned_nan(std::string text);

/// An exception's message without LibTorch's C++ backtrace, a NaN in it written "nan" as Lua
/// writes it (C++ streams write one with its sign bit set "-nan").
std::string message_of(const std::exception& e);

/// Calls `fn` each time autograd has accumulated a new gradient into the leaf `param`'s .grad
/// (the hook DistributedDataParallel uses). Returns the accumulator node, which the caller must
/// keep alive for the hook to stay installed.
std::shared_ptr<torch::autograd::Node> on_grad_accumulated(const torch::Tensor& param, std::function<void()> fn);

/// Runs `fn` once the backward pass now executing has finished (call from inside backward).
void at_end_of_backward(std::function<void()> fn);

}  // namespace partrain::compat

// ---- c10d (only for the files that define PARTRAIN_COMPAT_C10D) -----------------------------
// c10d::Store grew in 2.x: clone() (pure there), append, multiGet, multiSet, hasExtendedApi,
// queuePush/queuePop/queueLen, listKeys. partrain's store (engine/dist/store.hpp) declares them
// all in 2.x's exact signatures without `override`, so that they override where the base has
// them and are plain methods in 1.13: the one class builds against both.
// 1.13 has ProcessGroupGloo derive from ProcessGroup; 2.x makes it a Backend behind a
// ProcessGroup. partrain talks to the backend object directly, whose collectives have the same
// signatures in both.
#ifdef PARTRAIN_COMPAT_C10D
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef PARTRAIN_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace partrain::compat {

#if PARTRAIN_TORCH_AT_LEAST(2, 0)
using C10dGroup = c10d::Backend;
#else
using C10dGroup = c10d::ProcessGroup;
#endif

/// A c10d backend of `size` ranks rendezvousing through `store`. The Gloo device binds the
/// interface GLOO_SOCKET_IFNAME names; else loopback when MASTER_ADDR is a loopback address (a
/// run on one machine); else the address this host's name resolves to.
c10::intrusive_ptr<C10dGroup> make_c10d_group(const std::string& backend, const c10::intrusive_ptr<c10d::Store>& store,
                                              int rank, int size, std::chrono::milliseconds timeout);

}  // namespace partrain::compat
#endif  // PARTRAIN_COMPAT_C10D
