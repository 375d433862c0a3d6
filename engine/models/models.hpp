// Built-in model families as module trees. The multilayer perceptron is here; GPT-2 joins it
// with tensor parallelism.
#pragma once

#include <string>
#include <vector>

#include "engine/nn/layers.hpp"

namespace partrain::models {

struct MlpOptions {
  std::vector<int64_t> sizes;        ///< layer widths, input first: {784, 256, 10}
  std::string activation = "ReLU";   ///< between layers (not after the last)
  double dropout = 0.0;              ///< after each activation; 0: none
  bool bias = true;                  ///< biases on the Linear layers
};

/// Linear, activation, [dropout], ..., Linear as a Sequential of type "MLP".
nn::ModulePtr mlp(const MlpOptions& options);

}  // namespace partrain::models
