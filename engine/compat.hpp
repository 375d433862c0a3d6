// What differs between a CPU build of partrain and a CUDA one (a CUDA LibTorch with the CUDA
// toolkit: PARTRAIN_WITH_CUDA), kept in this one header so the rest of the code is free of #ifdefs.
#pragma once

#include <string>

#include <torch/torch.h>

namespace partrain::compat {

/// The LibTorch version as "major.minor.patch".
std::string torch_version();

/// What this build is, for --version: "LibTorch 2.11.0, CUDA 13.0, NCCL 2.28.9" in a CUDA build
/// (NCCL's version as the library linked reports it), "LibTorch 2.11.0, CPU only" otherwise.
std::string build_description();

/// Whether this is a CUDA build (PARTRAIN_WITH_CUDA, set by cmake/torch.cmake where the LibTorch
/// is a CUDA one and the CUDA toolkit is present): only then does it call into libc10_cuda and
/// libtorch_cuda, and have NCCL.
#ifdef PARTRAIN_WITH_CUDA
constexpr bool kBuiltWithCuda = true;
#else
constexpr bool kBuiltWithCuda = false;
#endif

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
/// The memory CUDA device `index` has, in bytes (what `partrain plan` checks a layout against).
int64_t cuda_total_memory(int index);
std::string cuda_device_name(int index);

/// The state of CUDA device `device`'s default generator (a CPU uint8 tensor), and its
/// replacement. Only on a CUDA build; the format is LibTorch's (Philox seed and offset).
torch::Tensor cuda_rng_state(const torch::Device& device);
void set_cuda_rng_state(const torch::Device& device, const torch::Tensor& state);

/// `host` (a CPU tensor a loader made) on `device`: on CUDA through page-locked memory and a copy
/// that does not block the host (the copy is ordered on the current stream before the kernels
/// that read the batch); itself on the CPU.
torch::Tensor to_device(const torch::Tensor& host, const torch::Device& device);

}  // namespace partrain::compat

// ---- c10d (only for the files that define PARTRAIN_COMPAT_C10D) -----------------------------
// partrain talks to c10d's backend objects (ProcessGroupGloo, ProcessGroupNCCL) directly, not
// through a c10d::ProcessGroup: Gloo's everywhere, NCCL's only in a CUDA build.
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

using C10dGroup = c10d::Backend;

/// A c10d backend of `size` ranks rendezvousing through `store`. The Gloo device binds the
/// interface GLOO_SOCKET_IFNAME names; else loopback when MASTER_ADDR is a loopback address (a
/// run on one machine); else the address this host's name resolves to.
c10::intrusive_ptr<C10dGroup> make_c10d_group(const std::string& backend, const c10::intrusive_ptr<c10d::Store>& store,
                                              int rank, int size, std::chrono::milliseconds timeout);

}  // namespace partrain::compat
#endif  // PARTRAIN_COMPAT_C10D
