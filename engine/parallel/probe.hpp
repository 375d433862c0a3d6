// The probe of a sharding policy: one small batch through the serial model and through the
// sharded one, comparing their outputs and every parameter's gradient, so a policy that splits a
// model wrong is refused before it trains to different numbers. The probe leaves no trace: eval
// mode for its forwards, gradients taken without touching .grad, the RNG put back as it was.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "engine/nn/module.hpp"

namespace partrain::parallel {

using torch::Tensor;

/// The default generators of `devices`, put back as they were when this goes: work that must
/// leave no trace on the training's random numbers (the probe, the stage timing) runs under one.
class RngGuard {
 public:
  explicit RngGuard(const std::vector<torch::Device>& devices);
  ~RngGuard();
  RngGuard(const RngGuard&) = delete;
  RngGuard& operator=(const RngGuard&) = delete;

 private:
  std::vector<std::pair<at::Generator, Tensor>> saved_;
};

/// What a model computed on the probe batch, at logical shapes.
struct ProbeRecord {
  Tensor output;              ///< the output, vocabulary-split logits gathered whole
  bool split_output = false;  ///< the output was vocabulary-split logits (a vocabulary head's)
  /// The gradient of sum(output * w) (w fixed random weights) for every parameter, by the
  /// parameter's first name; split parameters gathered to their logical shape.
  std::vector<std::pair<std::string, Tensor>> grads;
};

/// Runs `model` on `inputs` as a probe (see above). For a sharded model this is a collective over
/// its tensor groups: every rank of a group runs it with the same inputs.
ProbeRecord run_probe(nn::Module& model, const std::vector<Tensor>& inputs);

/// What differs between the serial and the sharded record beyond the tolerance of their dtype
/// (float64 1e-8, float32 1e-3, lower precisions 5e-2, relative to each tensor's largest value),
/// or "" when they agree. `vocab_head`: the sharded model has a vocabulary head, so its output
/// must be that head's split logits.
std::string compare_probes(const ProbeRecord& serial, const ProbeRecord& sharded, bool vocab_head);

/// A probe input from a fixed seed, the same on every rank, without drawing from the global RNG:
/// integer ids in [0, high) when high > 0, else standard normal values of `dtype`.
Tensor probe_input(const std::vector<int64_t>& shape, int64_t high, c10::ScalarType dtype, torch::Device device);

}  // namespace partrain::parallel
