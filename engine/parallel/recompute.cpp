// Activation checkpointing as an autograd function (see recompute.hpp).
#include "engine/parallel/recompute.hpp"

#include <mutex>

#include "engine/nn/layers.hpp"
#include "engine/parallel/split_backward.hpp"

namespace partrain::parallel {

namespace {

thread_local int replaying = 0;  // checkpointed forwards being replayed on this thread

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What backward needs to run the block again: the block and the generators' states at forward.
struct Replay : torch::CustomClassHolder {
  std::shared_ptr<nn::Module> block;
  std::vector<std::pair<at::Generator, Tensor>> rng;
  /// B of a split backward ran (the input's gradient only): what its W needs.
  std::unique_ptr<SplitBackward> pending;
};

at::Generator generator_of(const torch::Device& d) {
  return d.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(d);
}

struct Checkpoint : torch::autograd::Function<Checkpoint> {
  static Tensor forward(AutogradContext* ctx, Tensor x, at::TensorList params, c10::intrusive_ptr<Replay> replay) {
    std::vector<torch::Device> devices{torch::kCPU};
    if (x.device().is_cuda()) devices.push_back(x.device());  // (a meta tensor, under partrain plan, draws nothing)
    for (const auto& d : devices) {
      auto gen = generator_of(d);
      std::lock_guard<std::mutex> lock(gen.mutex());
      replay->rng.emplace_back(gen, gen.get_state());
    }
    ctx->save_for_backward({x});
    ctx->saved_data["replay"] = c10::IValue::make_capsule(replay);
    ctx->saved_data["params"] = static_cast<int64_t>(params.size());
    torch::NoGradGuard no_grad;
    return replay->block->forward(std::vector<Tensor>{x});
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto replay = c10::static_intrusive_pointer_cast<Replay>(ctx->saved_data["replay"].toCapsule());
    const auto count = ctx->saved_data["params"].toInt();
    std::vector<Tensor> params;
    for (const auto& p : replay->block->parameters())
      if (p.requires_grad()) params.push_back(p);
    TORCH_CHECK(static_cast<int64_t>(params.size()) == count, "recompute: the block's trainable parameters changed "
                "between forward and backward");
    // Under a split backward (zero-bubble pipelines) B asks for the input's gradient alone and W
    // for the weights' alone: B runs the block again and splits its backward, W finishes it.
    bool weights_wanted = false;
    for (int64_t i = 1; i <= count; ++i) weights_wanted = weights_wanted || ctx->needs_input_grad(i);
    const bool input_wanted = ctx->needs_input_grad(0);
    if (replay->pending && !input_wanted && weights_wanted) {
      auto pending = std::move(replay->pending);
      variable_list g{Tensor()};
      for (auto& w : pending->weight_gradients(params)) g.push_back(std::move(w));
      g.push_back(Tensor());  // the replay record
      return g;
    }
    replay->pending.reset();
    auto x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    // Run forward again from the same random state, then put the generators back as they are now.
    std::vector<std::pair<at::Generator, Tensor>> now;
    for (auto& [gen, state] : replay->rng) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      now.emplace_back(gen, gen.get_state());
      gen.set_state(state);
    }
    Tensor out;
    {
      torch::AutoGradMode grad(true);
      struct Replaying {
        Replaying() { ++replaying; }
        ~Replaying() { --replaying; }
      } mark;
      out = replay->block->forward(std::vector<Tensor>{x});
    }
    for (auto& [gen, state] : now) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
    if (input_wanted && !weights_wanted && count > 0) {
      variable_list g(static_cast<size_t>(count) + 2);
      replay->pending = SplitBackward::input(out, grads[0], x, &g[0]);
      return g;
    }
    variable_list inputs{x};
    inputs.insert(inputs.end(), params.begin(), params.end());
    auto g = torch::autograd::grad({out}, inputs, {grads[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                   /*allow_unused=*/true);
    g.push_back(Tensor());  // the replay record
    return g;
  }
};

}  // namespace

bool replaying_checkpoint() { return replaying > 0; }

Tensor checkpointed_forward(nn::Module& block, const Tensor& x) {
  if (!torch::GradMode::is_enabled()) return block.forward(std::vector<Tensor>{x});  // nothing to save
  auto replay = c10::make_intrusive<Replay>();
  replay->block = std::static_pointer_cast<nn::Module>(block.shared_from_this());
  std::vector<Tensor> params;
  for (const auto& p : block.parameters())
    if (p.requires_grad()) params.push_back(p);
  return Checkpoint::apply(x, at::TensorList(params), replay);
}

void recompute_blocks(nn::Module& root, const std::string& container) {
  auto blocks = root.find(container);
  TORCH_CHECK(blocks, "recompute: ", root.type(), " has no module '", container, "' (its blocks)");
  TORCH_CHECK(dynamic_cast<nn::Sequential*>(blocks.get()), "recompute: '", container, "' is a ", blocks->type(),
              ", not a Sequential of blocks");
  TORCH_CHECK(!blocks->forward_replaced(), "recompute: '", container, "' has a replaced forward already");
  blocks->replace_forward([](nn::Module& self, const std::vector<Tensor>& inputs) {
    TORCH_CHECK(inputs.size() == 1, self.type(), " with recompute takes one input, got ", inputs.size());
    Tensor x = inputs[0];
    for (const auto& [name, block] : self.children_named()) x = checkpointed_forward(*block, x);
    return x;
  });
}

}  // namespace partrain::parallel
