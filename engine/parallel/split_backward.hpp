// A backward pass split in two, as zero-bubble pipelines run it (Qi et al., "Zero Bubble Pipeline
// Parallelism", ICLR 2024): B computes the gradient of a stage's input, which the previous stage
// waits for, and W, deferred, the gradients of the weights. Together they compute exactly what
// one backward does, in the same order of additions at every gradient.
//
// How, on LibTorch's autograd graph: B runs the engine from the output toward the input only
// (`outputs` = the input's edge), and captures the gradient flowing into each node on that path
// that also leads to weights (an "intermediate": a matmul's backward, a checkpointed block). The
// engine computes only the outputs of a node that are needed, so a matmul's backward makes its
// input's gradient in B and its weight's in W, when the node runs again from the captured
// gradient toward the weights alone. The nodes only B needs free their saved tensors once B ends;
// the intermediates keep theirs (the inputs of the weights' products) until W.
//
// W runs one engine call per group of intermediates that share weights, so each weight's
// gradient is accumulated once (as data parallelism's hooks require). Where that cannot be exact
// (a weight also reached through the input's path below its intermediate, or a stage whose output
// does not depend on its input, such as the first one), W runs the whole backward again from the
// output toward the weights: exact, with B's input part computed twice (`whole()` says so).
#pragma once

#include <memory>
#include <vector>

#include <torch/torch.h>

namespace partrain::parallel {

class SplitBackward {
 public:
  /// B: the gradient of `input` (a leaf that requires grad; undefined: none wanted) from
  /// `output` with `grad` (undefined: ones, for a scalar loss); what W needs is kept here.
  static std::unique_ptr<SplitBackward> input(const torch::Tensor& output, const torch::Tensor& grad,
                                              const torch::Tensor& input, torch::Tensor* input_grad);
  ~SplitBackward();

  /// W: accumulates the weights' gradients into their .grad (their accumulation hooks run, a
  /// weight's once), then frees the graph. Runs once.
  void weights();
  /// W for a checkpointed block: the gradients of `leaves` (undefined where none reached one),
  /// returned rather than accumulated. Runs once.
  std::vector<torch::Tensor> weight_gradients(const std::vector<torch::Tensor>& leaves);

  /// Whether W runs the whole backward again (see the top of the file).
  bool whole() const { return whole_; }
  /// The engine calls W makes (one a group of intermediates; 1 when whole).
  size_t groups() const { return whole_ ? 1 : groups_.size(); }

 private:
  SplitBackward() = default;
  std::vector<torch::Tensor> run(bool accumulate, const std::vector<torch::Tensor>& leaves);

  struct Group {
    torch::autograd::edge_list roots;  // (intermediate, input number)
    std::vector<torch::Tensor> grads;  // captured in B, one a root
    torch::autograd::edge_list leaves; // the weights' accumulators it reaches
  };
  bool whole_ = false, done_ = false;
  torch::autograd::Edge root_;  // the output's edge and its gradient (whole)
  torch::Tensor root_grad_;
  torch::autograd::edge_list all_leaves_;  // every weight's accumulator the output reaches
  std::vector<Group> groups_;
};

/// The number of split backwards whose W ran the whole backward again, since the process began
/// (tests and the planner read it).
int64_t split_backward_whole_count();

}  // namespace partrain::parallel
