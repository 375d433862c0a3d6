// The probe of a sharding policy: one small batch through the serial model and through the
// sharded one, comparing their outputs and every parameter's gradient, so a policy that splits a
// model wrong is refused before it trains to different numbers. The probe leaves no trace: eval
// mode for its forwards, gradients taken without touching .grad, the RNG put back as it was.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "engine/nn/init.hpp"
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
  /// The same model's record in float64 (ProbeOptions::reference): what the model computes
  /// without rounding, against which a low-precision model's own rounding is measured.
  std::shared_ptr<const ProbeRecord> reference;
  /// How a deferred model's tensors were made for the probe (its serial tree's init plan), for
  /// the sharded probe to make its shards alike.
  std::shared_ptr<const nn::InitPlan> plan;
};

/// What a probe runs.
struct ProbeOptions {
  /// Also probe the model in float64 (its floating tensors widened for the run, then put back
  /// bit for bit): the serial record of a model of lower precision carries it.
  bool reference = false;
  /// The dotted path of a container of repeated blocks: only its first block runs (the others
  /// are set aside for the probe), so the probe's cost is bounded whatever the depth. "": all.
  std::string slice;
};

/// Runs `model` on `inputs` as a probe (see above). For a sharded model this is a collective over
/// its tensor groups: every rank of a group runs it with the same inputs. A model built deferred
/// (meta tensors) gets the probed tensors for the run only, initialized by name as pt.parallelize
/// will (`serial`'s plan for a sharded model; its own tree's for a serial one).
ProbeRecord run_probe(nn::Module& model, const std::vector<Tensor>& inputs, const ProbeOptions& options = {},
                      const ProbeRecord* serial = nullptr);

/// What differs between the serial and the sharded record, or "" when they agree. float64 is
/// held to 1e-8 of each tensor's largest value. Lower precisions are held to their own rounding:
/// against the serial record's float64 reference, the sharded tensor may be off by 4 times what
/// the serial one is, plus 8 units of the dtype's rounding of the largest value (float32 without a
/// reference: 1e-3). `vocab_head`: the sharded model has a vocabulary head, so its output must be
/// that head's split logits.
std::string compare_probes(const ProbeRecord& serial, const ProbeRecord& sharded, bool vocab_head);

/// The dotted path of the container with the most children of one type (at least 2): the blocks
/// a probe slice keeps one of; "" when the model has none.
std::string repeated_blocks(nn::Module& root);

/// A probe input from a fixed seed, the same on every rank, without drawing from the global RNG:
/// integer ids in [0, high) when high > 0, else standard normal values of `dtype`.
Tensor probe_input(const std::vector<int64_t>& shape, int64_t high, c10::ScalarType dtype, torch::Device device);

}  // namespace partrain::parallel
