// The first step's weighing of a pipeline rank (stage_memory.hpp).
#include "engine/parallel/stage_memory.hpp"

#include <algorithm>
#include <map>
#include <set>

#include "engine/parallel/data_parallel.hpp"
#include "engine/parallel/fsdp.hpp"
#include "engine/util/tensor_memory.hpp"

namespace partrain::parallel {

int64_t peak_activation_bytes(const std::vector<PipeAction>& actions, const PipelineMeasure& m, bool receives_ahead) {
  std::map<std::pair<int, int>, int64_t> held;  // (micro-batch, chunk) -> bytes held for its backward
  std::set<std::pair<int, int>> gets_gradient;  // (micro-batch, chunk) whose gradient is received
  std::set<std::pair<int, int>> split;          // (micro-batch, chunk) whose weights wait for W
  for (const auto& a : actions) {
    if (a.op == PipeOp::RecvBackward) gets_gradient.insert({a.mb, a.chunk});
    if (a.op == PipeOp::Weight) split.insert({a.mb, a.chunk});
  }
  auto at = [](const std::vector<int64_t>& v, int c) { return c >= 0 && c < static_cast<int>(v.size()) ? v[c] : 0; };
  // Received ahead, an activation's buffer is allocated once the receive kActivationsAhead before
  // it on its channel has been taken (the executor posts before every action), the first ones
  // at the step's start; its forward then holds it with the rest of its activations.
  std::vector<int64_t> posted_before(actions.size(), 0);  // buffers allocated before action i
  std::set<std::pair<int, int>> input_ahead;              // (micro-batch, chunk) received so
  if (receives_ahead) {
    std::map<int, std::vector<size_t>> channels;  // by peer: its activations' receives
    for (size_t i = 0; i < actions.size(); ++i) {
      const auto& a = actions[i];
      if (a.op != PipeOp::RecvForward) continue;
      auto& channel = channels[a.peer];
      const size_t from = channel.size() < kActivationsAhead ? 0 : channel[channel.size() - kActivationsAhead] + 1;
      posted_before[from] += at(m.inputs, a.chunk);
      channel.push_back(i);
      input_ahead.insert({a.mb, a.chunk});
    }
  }
  int64_t now = 0, peak = 0;
  for (size_t i = 0; i < actions.size(); ++i) {
    const auto& a = actions[i];
    now += posted_before[i];
    int64_t add = 0, allocated_before = 0;
    switch (a.op) {
      case PipeOp::Forward:
        add = at(m.activations, a.chunk);
        if (input_ahead.count({a.mb, a.chunk})) allocated_before = at(m.inputs, a.chunk);
        if (receives_ahead && gets_gradient.count({a.mb, a.chunk})) add += at(m.gradients, a.chunk);
        break;
      case PipeOp::RecvBackward: add = receives_ahead ? 0 : at(m.gradients, a.chunk); break;
      case PipeOp::SendForward: now += at(m.gradients, a.chunk); break;  // the output: the gradient's shape
      case PipeOp::SendBackward: now += at(m.inputs, a.chunk); break;    // the input's gradient
      case PipeOp::Backward:
      case PipeOp::Weight:
        // A split B leaves what its W needs (pending); the W, or a whole B, frees the rest.
        peak = std::max(peak, now + at(m.backward, a.chunk));
        now -= held[{a.mb, a.chunk}];
        held.erase({a.mb, a.chunk});
        if (a.op == PipeOp::Backward && split.count({a.mb, a.chunk})) add = at(m.pending, a.chunk);
        break;
      case PipeOp::RecvForward: break;  // counted in the forward's activations
    }
    held[{a.mb, a.chunk}] += add;
    now += add - allocated_before;
    peak = std::max(peak, now);
  }
  return peak;
}

StageMeter::StageMeter(PipelineMeasure& measure, int chunks, c10::DeviceType device, nn::Module& root,
                       const DataParallel* dp, const Fsdp* fsdp)
    : m_(measure),
      measure_(!measure.done),
      countable_(device == c10::kCPU || device == c10::kMeta),
      device_(device),
      root_(root),
      dp_(dp),
      fsdp_(fsdp) {
  if (!measure_) return;
  m_.activations.assign(chunks, -1);
  m_.backward.assign(chunks, -1);
  m_.inputs.assign(chunks, 0);
  m_.gradients.assign(chunks, 0);
  m_.pending.assign(chunks, 0);
}

// Gather buffers come and go only through Fsdp::allocate and release, so their change over a
// phase is the change in gathered + pooled (a buffer kept for reuse stays allocated).
int64_t StageMeter::gather_buffers() const {
  if (!fsdp_) return 0;
  const auto b = fsdp_->bytes();
  return b.gathered + b.pooled;
}

// ZeRO-2 and 3 take a bucket's scratch while backward fills it (at the backward's peak) and keep
// it; ZeRO-1's inboxes come at the sync, after the activations they replace are freed.
int64_t StageMeter::held() const { return dp_ && dp_->sharded() ? dp_->held_bytes() : 0; }

void StageMeter::forward_begins(int) {
  if (!measure_ || !countable_) return;
  before_ = util::memory(device_).allocated;
  gathered_before_ = gather_buffers();
}

// A chunk's first forward gathers its units (a pipeline holds them for the step): without ZeRO-3's
// share, its activations are what they are under ZeRO-2.
void StageMeter::forward_ends(int chunk, const torch::Tensor& input) {
  if (!measure_ || !countable_ || m_.activations[chunk] >= 0) return;
  m_.inputs[chunk] = input.defined() ? static_cast<int64_t>(input.nbytes()) : 0;
  const int64_t gathered = gather_buffers() - gathered_before_;
  m_.activations[chunk] = util::memory(device_).allocated - before_ - gathered + m_.inputs[chunk];
}

void StageMeter::gradient_received(int chunk, const torch::Tensor& grad) {
  if (measure_) m_.gradients[chunk] = static_cast<int64_t>(grad.nbytes());
}

// The first backward of a chunk makes its parameters' gradients; later ones add into them, as
// every later step does, with their temporaries counted.
void StageMeter::backward_begins() {
  if (!measure_ || !countable_) return;
  gradless_.clear();
  for (const auto& p : root_.parameters(/*recurse=*/true))
    if (!p.grad().defined()) gradless_.push_back(p);
  before_ = util::memory(device_).allocated;
  gathered_before_ = gather_buffers();
  held_before_ = held();
  util::start_mark(device_);
}

void StageMeter::backward_ends(int chunk) {
  if (!measure_ || !countable_) return;
  int64_t new_grads = 0;
  for (const auto& p : gradless_)
    if (p.grad().defined()) new_grads += static_cast<int64_t>(p.grad().nbytes());
  gradless_.clear();
  // A unit gathered again for backward (reshard_after_forward asked for) is a parameter too, and
  // the scratch and gradient shards data parallelism takes in the first backward are gradients
  // (under ZeRO-2 a chunk's whole gradient scratch: the planned peak had counted it twice).
  const int64_t gathered = std::max<int64_t>(0, gather_buffers() - gathered_before_);
  const int64_t kept = std::max<int64_t>(0, held() - held_before_);
  m_.backward[chunk] = std::max<int64_t>(
      m_.backward[chunk], std::max<int64_t>(0, util::mark(device_) - before_ - new_grads - gathered - kept));
}

void StageMeter::split_ends(int chunk, int64_t input_gradient) {
  if (!measure_ || !countable_) return;
  // What the micro-batch held when B began (its activations, the gradient received), less what
  // B freed, less the input's gradient (held until its send, which the walk counts apart).
  const int64_t held_before = std::max<int64_t>(0, m_.activations[chunk]) + m_.gradients[chunk];
  const int64_t kept = std::max<int64_t>(0, held() - held_before_);
  m_.pending[chunk] = std::max(m_.pending[chunk], std::max<int64_t>(0, util::memory(device_).allocated - before_ +
                                                                           held_before - input_gradient - kept));
}

void StageMeter::finish(const std::vector<PipeAction>& actions, bool receives_ahead) {
  if (!measure_) return;
  m_.done = true;
  m_.peak = countable_ ? peak_activation_bytes(actions, m_, receives_ahead) : -1;
}

}  // namespace partrain::parallel
