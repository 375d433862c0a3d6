// Differences between the LibTorch versions partrain builds against (Debian's 1.13 on CPU, the
// 2.x that ships with CUDA wheels), kept in this one header so the rest of the code is version-free.
#pragma once

#include <torch/torch.h>
#include <torch/version.h>

#define PARTRAIN_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace partrain::compat {

/// The LibTorch version as "major.minor.patch".
inline std::string torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

/// GELU with the tanh approximation (GPT-2's). The option's spelling is the same in 1.13 and 2.x,
/// but keeping the call here lets a future rename stay in one place.
inline torch::Tensor gelu_tanh(const torch::Tensor& x) { return at::gelu(x, "tanh"); }

/// Whether this LibTorch can reach a CUDA device at run time.
inline bool cuda_available() { return torch::cuda::is_available(); }

}  // namespace partrain::compat
