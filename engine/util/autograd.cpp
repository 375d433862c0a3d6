// The bodies behind autograd.hpp.
#include "engine/util/autograd.hpp"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>

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

void at_end_of_backward(std::function<void()> fn) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

}  // namespace partrain::util
