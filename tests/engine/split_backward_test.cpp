// GoogleTest for the split backward of zero-bubble pipelines: B then W gives the input's and every
// weight's gradient of one fused backward (float64, to the last bits), B accumulating nothing and
// W each weight once with one end-of-backward for data parallelism's hooks; the cases W cannot
// split exactly (a weight reached below its intermediate, a stage without an input) run whole
// and stay exact; checkpointed blocks defer their weights to W.
#include <gtest/gtest.h>

#include <map>

#include "engine/nn/layers.hpp"
#include "engine/parallel/recompute.hpp"
#include "engine/parallel/split_backward.hpp"
#include "engine/util/autograd.hpp"

using namespace partrain;
using torch::Tensor;

namespace {

// A residual MLP block chain in float64: Linear, GELU, Linear, LayerNorm, twice, then Tanh.
std::shared_ptr<nn::Sequential> chain(int64_t width) {
  torch::manual_seed(7);
  std::vector<nn::ModulePtr> layers;
  for (int i = 0; i < 2; ++i) {
    layers.push_back(std::make_shared<nn::Linear>(nn::LinearOptions(width, 2 * width)));
    layers.push_back(nn::make_activation("GELU"));
    layers.push_back(std::make_shared<nn::Linear>(nn::LinearOptions(2 * width, width)));
    layers.push_back(std::make_shared<nn::LayerNorm>(nn::LayerNormOptions(width)));
  }
  layers.push_back(nn::make_activation("Tanh"));
  auto seq = std::make_shared<nn::Sequential>(layers);
  for (auto& p : seq->parameters(/*recurse=*/true)) p.set_data(p.detach().to(torch::kFloat64));
  return seq;
}

struct Grads {
  Tensor input;
  std::vector<Tensor> weights;
};

std::vector<Tensor> weight_grads(nn::Module& m) {
  std::vector<Tensor> out;
  for (auto& p : m.parameters(/*recurse=*/true)) {
    out.push_back(p.grad().defined() ? p.grad().clone() : Tensor());
    p.mutable_grad() = Tensor();
  }
  return out;
}

void expect_same(const Grads& a, const Grads& b) {
  ASSERT_EQ(a.input.defined(), b.input.defined());
  if (a.input.defined()) EXPECT_TRUE(torch::allclose(a.input, b.input, 1e-12, 1e-14));
  ASSERT_EQ(a.weights.size(), b.weights.size());
  for (size_t i = 0; i < a.weights.size(); ++i) {
    ASSERT_TRUE(a.weights[i].defined() && b.weights[i].defined()) << "weight " << i;
    EXPECT_TRUE(torch::allclose(a.weights[i], b.weights[i], 1e-12, 1e-14)) << "weight " << i;
  }
}

Tensor sample(int64_t width) {
  torch::manual_seed(11);
  return torch::randn({4, 3, width}, torch::kFloat64);
}

// The fused backward of f(x) from `grad`, and the split one.
template <typename F>
std::pair<Grads, Grads> both(nn::Module& params, F f, const Tensor& x0, bool with_input = true,
                             std::unique_ptr<parallel::SplitBackward>* kept = nullptr) {
  Grads fused, split;
  auto x = x0.clone().requires_grad_(with_input);
  auto y = f(x);
  auto g = torch::ones_like(y) * 0.5 + y.detach();
  torch::autograd::backward({y}, {g});
  fused.input = with_input ? x.grad().clone() : Tensor();
  fused.weights = weight_grads(params);

  auto x2 = x0.clone().requires_grad_(with_input);
  auto y2 = f(x2);
  auto s = parallel::SplitBackward::input(y2, g, with_input ? x2 : Tensor(), &split.input);
  for (auto& p : params.parameters(/*recurse=*/true)) EXPECT_FALSE(p.grad().defined()) << "B accumulated a weight";
  s->weights();
  split.weights = weight_grads(params);
  if (kept) *kept = std::move(s);
  return {fused, split};
}

}  // namespace

TEST(SplitBackward, MatchesTheFusedBackwardOnAChain) {
  auto m = chain(8);
  std::unique_ptr<parallel::SplitBackward> s;
  auto [fused, split] = both(*m, [&](const Tensor& x) { return m->forward({x}) + x; }, sample(8), true, &s);
  EXPECT_FALSE(s->whole());
  expect_same(fused, split);
}

TEST(SplitBackward, WeightsAccumulateOnceInOneEndOfBackward) {
  auto m = chain(8);
  std::map<const c10::TensorImpl*, int> accumulated;
  int ends = 0;
  bool first = true;
  std::vector<std::shared_ptr<torch::autograd::Node>> keep;
  for (auto& p : m->parameters(/*recurse=*/true)) {
    auto* key = p.unsafeGetTensorImpl();
    keep.push_back(util::on_grad_accumulated(p, [&accumulated, &ends, &first, key] {
      if (first) util::at_end_of_backward([&ends] { ++ends; });  // as data parallelism's first hook does
      first = false;
      ++accumulated[key];
    }));
    accumulated[key] = 0;
  }
  auto x = sample(8).requires_grad_(true);
  auto y = m->forward({x});
  Tensor dx;
  auto s = parallel::SplitBackward::input(y, torch::ones_like(y), x, &dx);
  for (auto& [k, n] : accumulated) EXPECT_EQ(n, 0);
  EXPECT_FALSE(s->whole());
  EXPECT_GE(s->groups(), 2u);  // the layers' weights run a call a group
  s->weights();
  for (auto& [k, n] : accumulated) EXPECT_EQ(n, 1);
  EXPECT_EQ(ends, 1);
  EXPECT_THROW(s->weights(), c10::Error);  // once
}

TEST(SplitBackward, AWeightReachedBelowItsIntermediateRunsWholeAndExact) {
  torch::manual_seed(3);
  auto lin = std::make_shared<nn::Linear>(nn::LinearOptions(8, 8));
  for (auto& p : lin->parameters(/*recurse=*/true)) p.set_data(p.detach().to(torch::kFloat64));
  std::unique_ptr<parallel::SplitBackward> s;
  auto [fused, split] = both(*lin, [&](const Tensor& x) { return lin->forward({torch::tanh(lin->forward({x}))}); },
                             sample(8), true, &s);
  EXPECT_TRUE(s->whole());
  expect_same(fused, split);
}

TEST(SplitBackward, AStageWithoutAnInputRunsWhole) {
  auto m = chain(8);
  std::unique_ptr<parallel::SplitBackward> s;
  auto [fused, split] = both(*m, [&](const Tensor& x) { return m->forward({x}); }, sample(8), false, &s);
  EXPECT_TRUE(s->whole());
  EXPECT_FALSE(split.input.defined());
  expect_same(fused, split);
}

TEST(SplitBackward, CheckpointedBlocksDeferTheirWeightsToW) {
  // Each block counts its forwards: the fused step runs each twice (forward, replay in backward),
  // the split one twice too (forward, replay in B): W replays nothing.
  int runs = 0;
  auto counted = [&runs] {
    return std::make_shared<nn::Activation>("Tanh", [&runs](const Tensor& x) { ++runs; return torch::tanh(x); });
  };
  auto a = std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{chain(8), counted()});
  auto b = std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{chain(8), counted()});
  auto root = std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{a, b});
  auto f = [&](const Tensor& x) {
    auto h = parallel::checkpointed_forward(*a, x);
    return parallel::checkpointed_forward(*b, h) * 2;
  };
  std::unique_ptr<parallel::SplitBackward> s;
  auto [fused, split] = both(*root, f, sample(8), true, &s);
  EXPECT_FALSE(s->whole());
  EXPECT_EQ(runs, 8);
  expect_same(fused, split);
}
