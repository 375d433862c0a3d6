// A pipeline rank's step: its action list run in order, activations and gradients sent and
// received between the stages (headers, predicted shapes, receives posted ahead on Gloo), the
// tied parameters' gradients summed over the pipeline, and the loss from the last stage.
#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "engine/dist/world.hpp"
#include "engine/parallel/data_parallel.hpp"
#include "engine/parallel/pipeline.hpp"
#include "engine/parallel/recompute.hpp"
#include "engine/parallel/split_backward.hpp"
#include "engine/parallel/stage_memory.hpp"
#include "engine/parallel/trace.hpp"
#include "engine/util/planning.hpp"
#include "engine/util/step_events.hpp"

namespace partrain::parallel {

// ---- Messages ---------------------------------------------------------------------------------

namespace {

// partrain plan: the shape of each (stage, micro-batch) input a planned rank sent, for the
// receiving rank planned after it in the same process.
std::map<std::pair<int, int>, std::vector<int64_t>>& planned_shapes() {
  static std::map<std::pair<int, int>, std::vector<int64_t>> shapes;
  return shapes;
}

// The channels between a pair of ranks, each in the sender's order (the pre-flight check sees to
// it). An activation is a header (dtype, shape, and how its tensor follows) on one tag and its
// tensor on another; a gradient is its tensor alone, having the shape and dtype of the activation
// sent for it. With receives posted ahead, an activation whose shape both ends predict (the one
// the same micro-batch's had at that stage last step) goes on a tag of its own, whose receive
// was posted before the message was sent: it moves with no round trip through the receiver.
constexpr int kActivationTag = 1, kGradientTag = 2, kPredictedTag = 3, kActivationBodyTag = 4;
constexpr int64_t kHeader = 11;  // dtype, dims, up to 8 sizes, how the tensor follows
constexpr int64_t kMaxDims = kHeader - 3;
// How an activation's tensor follows its header (the header's last entry).
enum Follows : int64_t {
  kOnBodyTag = 0,     // on kActivationBodyTag: nothing was predicted
  kAsPredicted = 1,   // on kPredictedTag: the predicted shape and dtype
  kAfterDummy = 2,    // a predicted one that did not hold: zeros of the predicted shape on
                      // kPredictedTag (they fill the receive posted for it), the tensor on kActivationBodyTag
};

// The shape and dtype a header (on the host) gives, checked.
MessageShape shape_in(const torch::Tensor& header, int peer) {
  const auto* h = header.data_ptr<int64_t>();
  TORCH_CHECK(h[1] >= 0 && h[1] <= kMaxDims && h[0] >= 0 && h[0] < static_cast<int64_t>(c10::ScalarType::NumOptions) &&
                  h[kHeader - 1] >= kOnBodyTag && h[kHeader - 1] <= kAfterDummy,
              "pipeline: a malformed message header from pipeline rank ", peer);
  std::vector<int64_t> shape(h + 2, h + 2 + h[1]);
  for (auto s : shape) TORCH_CHECK(s >= 0 && s < (int64_t(1) << 40), "pipeline: a malformed size from rank ", peer);
  return {static_cast<c10::ScalarType>(h[0]), shape};
}

torch::Tensor empty_of(const MessageShape& shape, torch::Device device) {
  return torch::empty(shape.sizes, torch::TensorOptions().dtype(shape.dtype).device(device));
}

// An activation's tensor sent after its header (on kActivationBodyTag), received into a new buffer.
torch::Tensor receive_body(const dist::GroupPtr& group, const MessageShape& shape, int peer, torch::Device device) {
  auto t = empty_of(shape, device);
  group->recv(t, peer, /*async=*/false, kActivationBodyTag);
  return t;
}

// A step's receives posted ahead (Gloo): every activation's header at the step's start, the
// tensor of a predicted activation within kActivationsAhead of its channel's next, and every
// gradient as soon as its forward has run (its buffer is then known), each channel in its order,
// looked at before every action. Gloo moves a message once its receive is posted, so these move
// while this rank computes. An activation with no prediction (the first step; a micro-batch whose
// shape changed) is received when its action comes, after its header.
class Inbox {
 public:
  // `predicted`: an activation's shape by (micro-batch, receiving virtual stage), from last step.
  Inbox(const dist::GroupPtr& group, torch::Device device, const std::vector<PipeAction>& actions, int chunks,
        StageLayout layout, int rank, const std::map<std::pair<int, int>, MessageShape>& predicted)
      : group_(group), device_(device), of_action_(actions.size(), -1) {
    for (size_t i = 0; i < actions.size(); ++i) {
      const auto& a = actions[i];
      if (a.op != PipeOp::RecvForward && a.op != PipeOp::RecvBackward) continue;
      Message in;
      in.peer = a.peer;
      in.gradient = a.op == PipeOp::RecvBackward;
      const size_t slot = static_cast<size_t>(a.mb) * chunks + a.chunk;
      if (in.gradient) {
        if (slot >= gradient_of_.size()) gradient_of_.resize(slot + 1, -1);
        gradient_of_[slot] = static_cast<int>(messages_.size());
      } else {
        in.header = torch::zeros({kHeader}, torch::TensorOptions().dtype(torch::kInt64).device(device_));
        in.header_work = group_->recv(in.header, in.peer, /*async=*/true, kActivationTag);
        if (auto it = predicted.find({a.mb, layout.stage(rank, a.chunk)}); it != predicted.end()) in.predicted = it->second;
      }
      auto& channel = channels_[in.peer];
      if (in.gradient) channel.gradients.push_back(messages_.size());
      else if (in.predicted) channel.predicted.push_back(messages_.size());
      of_action_[i] = static_cast<int>(messages_.size());
      messages_.push_back(std::move(in));
    }
  }
  // A step that raised half-way leaves receives posted into these buffers: they are kept for the
  // process's life rather than freed under a transfer still running.
  ~Inbox() {
    static std::vector<Message> abandoned;
    for (auto& in : messages_)
      if (in.posted && !in.taken) abandoned.push_back(std::move(in));
  }

  // The forward of `slot` has run: its gradient will have `like`'s shape and dtype.
  void forward_ran(size_t slot, const torch::Tensor& like) {
    if (slot >= gradient_of_.size() || gradient_of_[slot] < 0) return;
    messages_[static_cast<size_t>(gradient_of_[slot])].body = torch::empty_like(like, torch::MemoryFormat::Contiguous);
  }

  // Posts, in each channel's order, every gradient whose buffer is known and the predicted
  // activations within the window. Each channel's messages are taken in its order, so a cursor
  // per channel and kind says where to go on: nothing before it needs looking at again.
  void post() {
    for (auto& [peer, c] : channels_) {
      for (; c.gradients_posted < c.gradients.size(); ++c.gradients_posted) {
        auto& in = messages_[c.gradients[c.gradients_posted]];
        if (!in.body.defined()) break;  // its forward has not run: neither has any later one's
        in.body_work = group_->recv(in.body, peer, /*async=*/true, kGradientTag);
        in.posted = true;
      }
      while (c.predicted_taken < c.predicted.size() && messages_[c.predicted[c.predicted_taken]].taken)
        ++c.predicted_taken;
      const size_t window = std::min(c.predicted.size(), c.predicted_taken + kActivationsAhead);
      for (size_t k = c.predicted_taken; k < window; ++k) {
        auto& in = messages_[c.predicted[k]];
        if (in.posted) continue;
        in.body = empty_of(*in.predicted, device_);
        in.body_work = group_->recv(in.body, peer, /*async=*/true, kPredictedTag);
        in.posted = true;
      }
    }
  }

  // Action `i`'s message, waited for (the wait is the bubble's).
  torch::Tensor take(size_t i, const PipeAction& a) {
    auto& in = messages_[static_cast<size_t>(of_action_[i])];
    torch::Tensor t;
    {
      TraceSpan wait(TraceKind::Wait, -1, -1, a.peer);
      if (in.gradient) {
        post();  // every earlier gradient of the channel has been taken: this one can be posted
        TORCH_CHECK(in.posted, "pipeline: ", describe(a), " before its forward");
        in.body_work.wait();
        t = std::move(in.body);
      } else {
        in.header_work.wait();
        const auto header = in.header.cpu();
        const auto shape = shape_in(header, a.peer);
        const int64_t follows = header.data_ptr<int64_t>()[kHeader - 1];
        TORCH_CHECK((follows == kOnBodyTag) == !in.predicted, "pipeline: ", describe(a), ": pipeline rank ", a.peer,
                    in.predicted ? " sent no tensor of the predicted shape" : " sent a tensor of a predicted shape",
                    " (the two ranks' record of last step's shapes disagree)");
        if (in.predicted) {
          post();  // posted within the window: everything before it on its channel has been taken
          TORCH_CHECK(in.posted, "pipeline: ", describe(a), ": its predicted receive was not posted");
          in.body_work.wait();
        }
        if (follows == kAsPredicted) {
          TORCH_CHECK(shape.dtype == in.predicted->dtype && shape.sizes == in.predicted->sizes, "pipeline: ",
                      describe(a), ": pipeline rank ", a.peer, " sent a tensor other than the predicted one");
          t = std::move(in.body);
        } else {
          t = receive_body(group_, shape, a.peer, device_);
        }
      }
    }
    in.taken = true;
    in.body = in.header = torch::Tensor();
    return t;
  }

 private:
  struct Message {
    int peer = 0;
    bool gradient = false;
    std::optional<MessageShape> predicted;  // an activation's, from last step
    torch::Tensor header, body;
    dist::Work header_work, body_work;
    bool posted = false, taken = false;  // the body's (or predicted body's) receive is posted; its action has run
  };
  dist::GroupPtr group_;
  torch::Device device_;
  std::vector<Message> messages_;  // in the order of their actions
  std::vector<int> of_action_;     // an action's message, or -1
  std::vector<int> gradient_of_;   // a slot's (micro-batch * chunks + chunk) gradient message, or -1
  struct Channel {                      // one peer's messages, in order
    std::vector<size_t> gradients;      // its gradients
    size_t gradients_posted = 0;        // those before it are posted
    std::vector<size_t> predicted;      // its activations with a predicted shape
    size_t predicted_taken = 0;         // those before it are taken
  };
  std::map<int, Channel> channels_;     // by peer
};

}  // namespace

void forget_planned_shapes() { planned_shapes().clear(); }

// ---- The executor -----------------------------------------------------------------------------

namespace {

// A trace span's kind by PipeOp.
constexpr TraceKind kTraceKinds[] = {TraceKind::Forward,        TraceKind::Backward,     TraceKind::SendActivation,
                                     TraceKind::RecvActivation, TraceKind::SendGradient, TraceKind::RecvGradient,
                                     TraceKind::Weight};

// Which slots (micro-batch * chunks + chunk) a rank's list splits (it holds their W), whether any,
// and the last action that accumulates weights' gradients (a whole B or a W): it ends with the sync.
struct Split {
  std::vector<char> slots;
  bool any = false;
  size_t last = 0;
};
Split split_of(const std::vector<PipeAction>& actions, int m, int chunks) {
  Split out{std::vector<char>(static_cast<size_t>(m) * chunks, 0)};
  for (const auto& a : actions)
    if (a.op == PipeOp::Weight) out.slots[static_cast<size_t>(a.mb) * chunks + a.chunk] = out.any = true;
  for (size_t i = 0; i < actions.size(); ++i) {
    const auto& a = actions[i];
    if (a.op == PipeOp::Weight || (a.op == PipeOp::Backward && !out.slots[static_cast<size_t>(a.mb) * chunks + a.chunk]))
      out.last = i;
  }
  return out;
}

}  // namespace

// A step that does not finish forgets the shapes the next one would predict: its messages may be
// half-sent, and every rank's step fails (the loss's broadcast waits for them all). It also leaves
// messages queued in the group (sent and not received, receives posted), which a later step would
// take for its own: the pipeline refuses to run again on this backend.
Pipeline::StepGuard::~StepGuard() {
  if (done) return;
  p.sent_shapes_.clear();
  p.received_shapes_.clear();
  p.failed_at_renewal_ = p.group_->renewals();
}

torch::Tensor Pipeline::run_chunk(int chunk, const torch::Tensor& in) {
  const int v = layout().stage(rank_, chunk);
  const bool ends = root_->has_stage_ends();
  auto x = in;
  if (v == 0) {
    if (ends) x = root_->stage_in(x);
    else
      for (auto& m : first_) x = m->forward({x});
  }
  for (auto& b : chunk_blocks_[chunk]) x = recompute_ ? checkpointed_forward(*b, x) : b->forward({x});
  if (v == stages() - 1) {
    if (ends) x = root_->stage_out(x);
    else
      for (auto& m : last_) x = m->forward({x});
  }
  return x;
}

// An activation is a header (dtype, dims, sizes) then the tensor: the receiver learns every
// shape from the sender, so micro-batches of any shape flow.
void Pipeline::send_activation(const torch::Tensor& t, int peer, int mb, int to_stage) {
  TORCH_CHECK(t.dim() <= kMaxDims, "pipeline: cannot send a tensor of ", t.dim(), " dimensions (at most ", kMaxDims, ")");
  MessageShape shape{t.scalar_type(), t.sizes().vec()};
  int64_t follows = kOnBodyTag;
  std::optional<MessageShape> predicted;
  if (receives_ahead()) {  // the receiver posts what last step's same message had
    auto [it, fresh] = sent_shapes_.try_emplace({mb, to_stage}, shape);
    if (!fresh) {
      predicted = it->second;
      follows = it->second.dtype == shape.dtype && it->second.sizes == shape.sizes ? kAsPredicted : kAfterDummy;
      it->second = shape;
    }
  }
  auto header = torch::zeros({kHeader}, torch::kInt64);
  auto* fields = header.data_ptr<int64_t>();  // written in place: a tensor op a field would cost more
  fields[0] = static_cast<int64_t>(t.scalar_type());
  fields[1] = t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) fields[2 + d] = t.size(d);
  fields[kHeader - 1] = follows;
  auto h = header.to(device_);
  sends_.emplace_back(group_->send(h, peer, /*async=*/true, kActivationTag), std::vector<torch::Tensor>{h});
  int64_t extra = static_cast<int64_t>(h.nbytes());
  if (follows == kAfterDummy) {  // fills the receive posted for the prediction
    auto dummy = torch::zeros(predicted->sizes, torch::TensorOptions().dtype(predicted->dtype).device(device_));
    sends_.emplace_back(group_->send(dummy, peer, /*async=*/true, kPredictedTag), std::vector<torch::Tensor>{dummy});
    extra += static_cast<int64_t>(dummy.nbytes());
  }
  send_body(t, peer, follows == kAsPredicted ? kPredictedTag : kActivationBodyTag, extra);
}

void Pipeline::send_body(const torch::Tensor& t, int peer, int tag, int64_t header_bytes) {
  auto body = t.detach().contiguous();
  // Sends that have completed let go of their tensors now rather than at the step's end, so that
  // 1F1B holds a bounded number of activations whatever the micro-batch count.
  sends_.erase(std::remove_if(sends_.begin(), sends_.end(),
                              [](auto& in_flight) {
                                if (!in_flight.first.done()) return false;
                                in_flight.first.wait();  // raises what the send met, if anything
                                return true;
                              }),
               sends_.end());
  sends_.emplace_back(group_->send(body, peer, /*async=*/true, tag), std::vector<torch::Tensor>{body});
  if (!measured_.done) {
    auto& q = measured_.peers[peer];
    ++q.sends;
    q.send_bytes += header_bytes + static_cast<int64_t>(body.nbytes());
  }
}

void Pipeline::note_received(int peer, int64_t bytes) {
  if (measured_.done) return;
  auto& q = measured_.peers[peer];
  ++q.recvs;
  q.recv_bytes += bytes;
}

torch::Tensor Pipeline::receive(int peer, const std::vector<int64_t>& expected) {
  auto header = torch::zeros({kHeader}, torch::TensorOptions().dtype(torch::kInt64).device(device_));
  {
    TraceSpan wait(TraceKind::Wait, -1, -1, peer);  // until the sender's message arrives: the bubble
    group_->recv(header, peer, /*async=*/false, kActivationTag);
  }
  MessageShape shape{dtype_, expected};  // partrain plan: nothing arrives; both receives are recorded as a run's
  if (!group_->planned()) {
    auto h = header.cpu();
    shape = shape_in(h, peer);
    TORCH_CHECK(h.data_ptr<int64_t>()[kHeader - 1] == kOnBodyTag, "pipeline: pipeline rank ", peer,
                " sent an activation of a predicted shape, which this rank does not receive ahead");
  }
  auto t = receive_body(group_, shape, peer, device_);
  note_received(peer, static_cast<int64_t>(header.nbytes() + t.nbytes()));
  return t;
}

void Pipeline::check_runnable() const {
  TORCH_CHECK(!failed_at_renewal_ || *failed_at_renewal_ != group_->renewals(), "train_step: an earlier step of ",
              "this pipeline failed part-way, and what it sent may still be queued between the stages, where this ",
              "step's receives would take it: the pipeline cannot run again in this process (resume from a ",
              "checkpoint in a new run)");
}

torch::Tensor Pipeline::tie_gradient(const Tie& tie, DataParallel* dp) const {
  // No .grad (zero_grad): none, whatever the bucket still holds from the last sync.
  if (!tie.param.defined() || !tie.param.grad().defined()) return {};
  auto bucket = dp ? dp->bucket_grad(tie.param) : torch::Tensor();
  return bucket.defined() ? bucket : tie.param.grad();
}

torch::ScalarType Pipeline::tie_dtype(const Tie& tie, DataParallel* dp) const {
  return dp ? dp->reduce_dtype_for(tie.dtype) : tie.dtype;
}

bool Pipeline::gradients_ahead() const { return group_->backend() == "gloo"; }
bool Pipeline::receives_ahead() const { return !group_->planned() && gradients_ahead(); }

// A tied gradient an earlier step left (train_step again before opt:step(), or no zero_grad) is
// summed over the pipeline already: it is set aside (returned, a tie each) and added back after
// this step's sum.
std::vector<torch::Tensor> Pipeline::set_aside_tie_gradients(DataParallel* dp) {
  std::vector<torch::Tensor> kept(ties_.size());
  for (size_t i = 0; i < ties_.size(); ++i) {
    const auto held = tie_gradient(ties_[i], dp);
    if (!held.defined()) continue;
    kept[i] = held.detach().to(tie_dtype(ties_[i], dp), /*non_blocking=*/false, /*copy=*/true);
    held.detach().zero_();
    if (ties_[i].param.grad().defined()) ties_[i].param.mutable_grad().detach().zero_();
  }
  return kept;
}

void Pipeline::sum_tie_gradients(const std::vector<torch::Tensor>& kept, DataParallel* dp) {
  // The tied parameters' gradients of this step, summed over the ranks holding them (the others
  // add zeros), then what an earlier step left added back.
  for (size_t i = 0; i < ties_.size(); ++i) {
    auto& tie = ties_[i];
    const auto held = tie_gradient(tie, dp);
    auto g = held.defined() ? held.detach().to(tie_dtype(tie, dp), /*non_blocking=*/false, /*copy=*/true)
                            : torch::zeros(tie.shape, torch::TensorOptions().dtype(tie_dtype(tie, dp)).device(device_));
    group_->all_reduce(g);
    if (kept[i].defined()) g.add_(kept[i]);
    if (!tie.param.defined()) continue;
    // Into the gradient in place where there is one: data parallelism's bucket holds it (and
    // under ZeRO the optimizer reads it there; .grad may be a copy of another dtype).
    auto bucket = dp ? dp->bucket_grad(tie.param) : torch::Tensor();
    if (bucket.defined()) bucket.copy_(g);
    if (tie.param.grad().defined()) tie.param.mutable_grad().copy_(g);
    else tie.param.mutable_grad() = g.to(tie.param.scalar_type());
  }
}

torch::Tensor Pipeline::train_step(const torch::Tensor& x, const torch::Tensor& y,
                                   const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& loss,
                                   const torch::Tensor& weight, DataParallel* dp, double loss_scale,
                                   const Fsdp* fsdp) {
  const int m = options_.microbatches, chunks = options_.chunks, last = stages() - 1;
  check_runnable();
  root_->train();
  events::forward_begins();  // a script's first training step begins (once): the planner counts from here
  auto xs = x.chunk(m, 0), ys = y.chunk(m, 0);
  StageMeter meter(measured_, chunks, device_.type(), *root_, dp, fsdp);  // the first step weighs its chunks
  // Its backwards set data parallelism's passes (the sync in the last, a chunk each); leaving, by
  // return or exception, they are the sync's again. The caller's scope carries the counts.
  DataParallel::StepScope passes(dp, /*carries_counts=*/false);
  struct Slot {
    torch::Tensor input, output, grad, input_grad;
    std::unique_ptr<SplitBackward> weights;  // B ran: what W needs
  };
  std::vector<Slot> slots(static_cast<size_t>(m) * chunks);
  const auto& actions = options_.plan[rank_];
  const auto split = split_of(actions, m, chunks);
  TORCH_CHECK(!fsdp || !split.any, "pipeline: a split backward under ZeRO-3 (parallelize refuses it)");
  torch::Tensor total = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat64).device(device_));
  events::train_step_begins();  // the tracer (--trace) records each action's span
  std::vector<int64_t> last_shape;  // this rank's last activation's (partrain plan's fallback)
  StepGuard forget{*this};
  auto kept = set_aside_tie_gradients(dp);
  std::optional<Inbox> inbox;
  if (receives_ahead()) inbox.emplace(group_, device_, actions, chunks, layout(), rank_, received_shapes_);
  for (size_t i = 0; i < actions.size(); ++i) {
    const auto& a = actions[i];
    auto& s = slots[static_cast<size_t>(a.mb) * chunks + a.chunk];
    const int v = layout().stage(rank_, a.chunk);
    if (inbox) inbox->post();
    TraceSpan span(kTraceKinds[static_cast<int>(a.op)], a.mb, a.chunk, a.peer);
    switch (a.op) {
      case PipeOp::RecvForward: {
        // Under partrain plan nothing arrives: the shape is what the sending stage's forward gave
        // (virtual ranks are planned in order, so a lower pipeline rank has been planned), or,
        // for an interleaved wrap-around not planned yet, this rank's own last activation's.
        std::vector<int64_t> expected;
        if (group_->planned()) {
          auto it = planned_shapes().find({v, a.mb});
          expected = it != planned_shapes().end() ? it->second : last_shape;
        }
        if (inbox) {
          s.input = inbox->take(i, a);
          note_received(a.peer, kHeader * static_cast<int64_t>(sizeof(int64_t)) + static_cast<int64_t>(s.input.nbytes()));
          received_shapes_.insert_or_assign({a.mb, v}, MessageShape{s.input.scalar_type(), s.input.sizes().vec()});
        } else {
          s.input = receive(a.peer, expected);
        }
        s.input.requires_grad_(true);
        break;
      }
      case PipeOp::Forward: {
        meter.forward_begins(a.chunk);
        auto out = run_chunk(a.chunk, v == 0 ? xs[a.mb] : s.input);
        if (v == last) {
          auto l = loss(out, ys[a.mb]);
          total += l.detach().to(torch::kFloat64);
          s.output = l * weight.to(l.device(), l.scalar_type());
          if (loss_scale != 1.0) s.output = s.output * loss_scale;  // backward starts from the scaled loss
        } else {
          s.output = out;
          last_shape = out.sizes().vec();
        }
        out = torch::Tensor();  // what the backward does not need goes now (the head's logits)
        if (v != last && layout().rank(v + 1) == rank_) {
          // The next stage is this rank's too (a V's turn, or pp = 1): handed over in place, as
          // the input of its own graph, so that each chunk's backward stays its own.
          auto& next = slots[static_cast<size_t>(a.mb) * chunks + layout().chunk(v + 1)];
          next.input = s.output.detach().requires_grad_(true);
        }
        meter.forward_ends(a.chunk, s.input);
        if (inbox && v != last) inbox->forward_ran(static_cast<size_t>(a.mb) * chunks + a.chunk, s.output);
        break;
      }
      case PipeOp::SendForward:
        if (group_->planned()) planned_shapes()[{v + 1, a.mb}] = s.output.sizes().vec();
        send_activation(s.output, a.peer, a.mb, v + 1);
        break;
      case PipeOp::RecvBackward:
        if (inbox) {
          s.grad = inbox->take(i, a);
        } else {  // the activation sent for it says its shape and dtype
          s.grad = torch::empty_like(s.output, torch::MemoryFormat::Contiguous);
          TraceSpan wait(TraceKind::Wait, -1, -1, a.peer);
          group_->recv(s.grad, a.peer, /*async=*/false, kGradientTag);
        }
        note_received(a.peer, static_cast<int64_t>(s.grad.nbytes()));
        meter.gradient_received(a.chunk, s.grad);
        break;
      case PipeOp::Backward: {
        // The gradient of the input, for the previous stage when this rank holds it too.
        auto hand_back = [&] {
          if (v == 0 || layout().rank(v - 1) != rank_ || !s.input_grad.defined()) return;
          slots[static_cast<size_t>(a.mb) * chunks + layout().chunk(v - 1)].grad = s.input_grad;
          s.input_grad = torch::Tensor();
        };
        meter.backward_begins();
        if (split.slots[static_cast<size_t>(a.mb) * chunks + a.chunk]) {  // B: the input's gradient; W the weights'
          s.weights = SplitBackward::input(s.output, v == last ? torch::Tensor() : s.grad, s.input, &s.input_grad);
          meter.backward_ends(a.chunk);
          s.input = s.output = s.grad = torch::Tensor();  // what W does not need is freed
          meter.split_ends(a.chunk, s.input_grad.defined() ? static_cast<int64_t>(s.input_grad.nbytes()) : 0);
          hand_back();
          break;
        }
        // Under ZeRO-2 each backward reduces its chunk's buckets (the same on every data rank:
        // they run the same schedule).
        if (dp) dp->next_pass({i == split.last, a.chunk});  // the sync: the rank's last backward only
        if (v == last) s.output.backward();
        else torch::autograd::backward({s.output}, {s.grad});
        meter.backward_ends(a.chunk);
        if (dp) dp->complete();  // a pass that backward left to this thread (thread-bound hooks)
        if (s.input.defined()) s.input_grad = s.input.grad();
        s.input = s.output = s.grad = torch::Tensor();  // this micro-batch's activations are freed
        hand_back();
        break;
      }
      case PipeOp::Weight: {
        TORCH_CHECK(s.weights, "pipeline: ", describe(a), " before its B");
        if (dp) dp->next_pass({i == split.last, a.chunk});
        meter.backward_begins();
        s.weights->weights();
        s.weights.reset();
        meter.backward_ends(a.chunk);
        if (dp) dp->complete();
        break;
      }
      case PipeOp::SendBackward:
        TORCH_CHECK(s.input_grad.defined(), "pipeline: ", describe(a), " has no gradient to send");
        send_body(s.input_grad, a.peer, kGradientTag);
        s.input_grad = torch::Tensor();
        break;
    }
  }
  std::optional<TraceSpan> sync(std::in_place, TraceKind::Sync);  // sends, tied gradients, data parallel, loss
  for (auto& [work, keep] : sends_) work.wait();
  sends_.clear();
  sum_tie_gradients(kept, dp);
  if (dp) dp->complete();
  // The loss from the last stage's rank, on every rank.
  total = total.reshape({1}).contiguous();
  group_->broadcast(total, layout().rank(last));
  forget.done = true;
  meter.finish(actions, gradients_ahead());
  sync.reset();
  events::train_step_ends("rank " + std::to_string(dist::World::instance().rank()) + ": pipeline rank " +
                          std::to_string(rank_));
  return total.squeeze(0);
}

}  // namespace partrain::parallel
