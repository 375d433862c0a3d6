// Hooks into LibTorch's autograd engine that data parallelism uses to start a bucket's
// collective as soon as its gradients are ready (DistributedDataParallel's hooks).
#pragma once

#include <functional>
#include <memory>

#include <torch/torch.h>

namespace partrain::util {

/// Calls `fn` each time autograd has accumulated a new gradient into the leaf `param`'s .grad.
/// Returns the accumulator node, which the caller must keep alive for the hook to stay installed.
std::shared_ptr<torch::autograd::Node> on_grad_accumulated(const torch::Tensor& param, std::function<void()> fn);

/// Runs `fn` once the backward pass now executing has finished (call from inside backward), or,
/// while a BackwardGroup lives, when the group ends.
void at_end_of_backward(std::function<void()> fn);

/// Several engine calls that are one backward pass for what waits for its end (a split
/// backward's W, one call a group of weights): while it lives, at_end_of_backward's functions
/// are held, and they run, in order, on the thread that ends it. Groups nest (the outermost ends).
class BackwardGroup {
 public:
  BackwardGroup();
  ~BackwardGroup() noexcept(false);
  BackwardGroup(const BackwardGroup&) = delete;
  BackwardGroup& operator=(const BackwardGroup&) = delete;
};

}  // namespace partrain::util
