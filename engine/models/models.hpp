// Built-in model families as module trees. The multilayer perceptron is here; GPT-2 joins it
// with tensor parallelism.
#pragma once

#include <string>
#include <vector>

#include "engine/nn/layers.hpp"
#include "engine/optim/optim.hpp"

namespace partrain::models {

struct MlpOptions {
  std::vector<int64_t> sizes;        ///< layer widths, input first: {784, 256, 10}
  std::string activation = "ReLU";   ///< between layers (not after the last)
  double dropout = 0.0;              ///< after each activation; 0: none
  bool bias = true;                  ///< biases on the Linear layers
  torch::ScalarType dtype = torch::kFloat32;  ///< parameters and compute (initialized in float32, then cast)
};

/// Linear, activation, [dropout], ..., Linear as a Sequential of type "MLP".
nn::ModulePtr mlp(const MlpOptions& options);

/// One supervised classification step, all in C++: forward, cross-entropy against `targets`,
/// zero_grad, backward, optimizer step. Returns the loss.
double classification_step(nn::Module& model, optim::Optimizer& optimizer, const torch::Tensor& inputs,
                           const torch::Tensor& targets);
/// The same step without the update: forward, loss, zero_grad, backward. Returns the loss.
torch::Tensor classification_loss(nn::Module& model, optim::Optimizer& optimizer, const torch::Tensor& inputs,
                                  const torch::Tensor& targets);

}  // namespace partrain::models
