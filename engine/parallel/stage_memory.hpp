// Weighing a pipeline rank's first step: what each chunk's forward leaves alive for its backward,
// what its backward needs while it runs, the gradients it receives (the counting allocators'
// bytes, engine/util/tensor_memory.hpp), and the schedule's peak those make. The pipeline calls
// the meter at each phase of its first train_step; `partrain plan` reads what it measured.
#pragma once

#include <vector>

#include "engine/nn/module.hpp"
#include "engine/parallel/pipeline.hpp"

namespace partrain::parallel {

/// Fills a PipelineMeasure from one train_step: active when the measure is not done yet and the
/// device's allocations are counted (the CPU, the meta device); every call does nothing otherwise.
/// What the planner counts as model state is left out: under ZeRO-3 (`fsdp`) the gather buffers
/// a phase allocates (the stage's units, gathered at their first use and held for the step, and
/// the freed ones kept for reuse: its units gathered at once), and what data parallelism (`dp`)
/// comes to hold during a backward under ZeRO-2 and 3 (gradient shards and bucket scratch).
class StageMeter {
 public:
  StageMeter(PipelineMeasure& measure, int chunks, c10::DeviceType device, nn::Module& root,
             const DataParallel* dp = nullptr, const Fsdp* fsdp = nullptr);
  /// A chunk's forward of one micro-batch begins ...
  void forward_begins(int chunk);
  /// ... and ends, having received `input` (undefined on the first virtual stage): the first of
  /// each chunk notes what it left allocated, its input included.
  void forward_ends(int chunk, const torch::Tensor& input);
  /// A chunk's micro-batch received the gradient of its output.
  void gradient_received(int chunk, const torch::Tensor& grad);
  /// A chunk's backward of one micro-batch begins ...
  void backward_begins();
  /// ... and ends: the most it allocated while it ran, less the parameters' gradients it made
  /// (model state), the largest over the chunk's micro-batches.
  void backward_ends(int chunk);
  /// A split B of `chunk` ended (after backward_ends, its micro-batch's activations dropped):
  /// what stays allocated for its W is the chunk's pending bytes. `input_gradient`: the bytes of
  /// the gradient it sends (held apart until the send).
  void split_ends(int chunk, int64_t input_gradient);
  /// The step ended: the measure is done, and its schedule's peak (peak_activation_bytes).
  void finish(const std::vector<PipeAction>& actions, bool receives_ahead);

 private:
  PipelineMeasure& m_;
  const bool measure_, countable_;
  const c10::DeviceType device_;
  nn::Module& root_;
  const DataParallel* dp_;
  const Fsdp* fsdp_;
  int64_t gather_buffers() const;  // ZeRO-3's gathered and pooled bytes now (0 without it)
  int64_t held() const;            // data parallelism's gradient buffers and scratch (0 without it)
  int64_t before_ = 0, gathered_before_ = 0, held_before_ = 0;
  std::vector<torch::Tensor> gradless_;  // parameters without a gradient when a backward began
};

}  // namespace partrain::parallel
