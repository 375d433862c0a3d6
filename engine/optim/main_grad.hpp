// Gradients of low-precision parameters summed in float32 across backward passes (Megatron's
// main_grad): a pipeline's micro-batches, gradient accumulation, or a loop of backward calls
// before a step. Without it each bfloat16 pass is added into .grad in bfloat16, rounding the
// running sum once a pass; with it the sum is kept in float32 and .grad holds that sum rounded
// once, and the optimizer's float32 masters take the float32 sum itself.
#pragma once

#include <memory>
#include <unordered_map>
#include <vector>

#include <torch/torch.h>

namespace partrain::optim {

class MainGrads {
 public:
  /// Watches every bfloat16 or float16 parameter of `params` that requires grad (others are left
  /// alone). The hooks sit on each parameter's gradient accumulator, so they run only when a
  /// gradient is added into .grad (not for torch::autograd::grad's captures).
  explicit MainGrads(const std::vector<torch::Tensor>& params);
  /// The hooks stay installed but do nothing once this is gone.
  ~MainGrads();
  MainGrads(const MainGrads&) = delete;
  MainGrads& operator=(const MainGrads&) = delete;

  /// The float32 sum behind `param`'s .grad, when .grad is still the rounding of it that the last
  /// pass left (not replaced, cleared or changed in place since: a data-parallel reduction, a
  /// zero_grad, a user's copy_); undefined otherwise, and for a parameter summed in one pass.
  torch::Tensor sum_of(const torch::Tensor& param) const;

  struct Slot;

 private:
  std::unordered_map<const c10::TensorImpl*, std::shared_ptr<Slot>> slots_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keeps the hooks installed
};

}  // namespace partrain::optim
