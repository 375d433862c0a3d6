// The bodies behind autograd.hpp.
#include "engine/util/autograd.hpp"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>

#include <exception>
#include <mutex>
#include <vector>

namespace partrain::util {

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

namespace {
// The functions held while a group lives (the engine's threads may add to them).
std::mutex group_mutex;
int group_depth = 0;
std::vector<std::function<void()>> held;
}  // namespace

void at_end_of_backward(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(group_mutex);
    if (group_depth > 0) {
      held.push_back(std::move(fn));
      return;
    }
  }
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

BackwardGroup::BackwardGroup() {
  std::lock_guard<std::mutex> lock(group_mutex);
  ++group_depth;
}

BackwardGroup::~BackwardGroup() noexcept(false) {
  std::vector<std::function<void()>> run;
  {
    std::lock_guard<std::mutex> lock(group_mutex);
    if (--group_depth > 0) return;
    run.swap(held);
  }
  // A call that failed: as the engine does for a failed backward, what waits for the end does not run.
  if (std::uncaught_exceptions() > 0) return;
  for (auto& fn : run) fn();
}

}  // namespace partrain::util
