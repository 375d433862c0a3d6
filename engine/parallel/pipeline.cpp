// This file splits a model into pipeline stages and runs a rank's schedule (see pipeline.hpp).
#include "engine/parallel/pipeline.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>

#include "engine/dist/world.hpp"
#include "engine/nn/layers.hpp"
#include "engine/parallel/data_parallel.hpp"
#include "engine/parallel/stage_memory.hpp"
#include "engine/parallel/trace.hpp"
#include "engine/util/planning.hpp"
#include "engine/util/step_events.hpp"

namespace partrain::parallel {

// ---- The split --------------------------------------------------------------------------------

std::vector<int64_t> split_stages(const std::vector<int64_t>& block_params, int64_t stages,
                                  const StageBalance& balance, int64_t first_params, int64_t last_params) {
  const auto n = static_cast<int64_t>(block_params.size());
  TORCH_CHECK(stages >= 1, "pipeline: ", stages, " stages (expected at least 1)");
  std::vector<int64_t> bounds{0};
  if (balance.method == "explicit") {
    TORCH_CHECK(static_cast<int64_t>(balance.sizes.size()) == stages, "pipeline: explicit balance gives ",
                balance.sizes.size(), " stage sizes for ", stages, " stages (pipeline x chunks)");
    for (auto s : balance.sizes) {
      TORCH_CHECK(s >= 1, "pipeline: explicit balance: a stage of ", s, " blocks (each stage needs at least one)");
      bounds.push_back(bounds.back() + s);
    }
    TORCH_CHECK(bounds.back() == n, "pipeline: explicit balance gives ", bounds.back(), " blocks in all, the model has ",
                n);
    return bounds;
  }
  TORCH_CHECK(n >= stages, "pipeline: ", n, n == 1 ? " block" : " blocks", " cannot fill ", stages,
              " stages (pipeline x chunks; each stage needs at least one block)");
  if (balance.method == "uniform") {
    for (int64_t s = 0; s < stages; ++s) bounds.push_back(bounds.back() + n / stages + (s < n % stages ? 1 : 0));
    return bounds;
  }
  TORCH_CHECK(balance.method == "parameters" || balance.method == "time", "pipeline: unknown balance '",
              balance.method, "' (expected uniform, parameters, time, or a list of stage sizes)");
  const bool timed = balance.method == "time";
  TORCH_CHECK(!timed || static_cast<int64_t>(balance.costs.size()) == n + 2, "pipeline: balance 'time' has ",
              balance.costs.size(), " measured times for ", n, " blocks (expected one for the first part, one a "
              "block, one for the last part)");
  if (timed) first_params = balance.costs.front(), last_params = balance.costs.back();
  // The smallest largest stage over contiguous splits: cost[s][i] is the best largest stage when
  // stages 0..s hold the blocks [0, i); `from` remembers where stage s starts.
  std::vector<int64_t> prefix(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + (timed ? balance.costs[i + 1] : block_params[i]);
  auto weight = [&](int64_t s, int64_t a, int64_t b) {
    return prefix[b] - prefix[a] + (s == 0 ? first_params : 0) + (s == stages - 1 ? last_params : 0);
  };
  const int64_t inf = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> cost(stages, std::vector<int64_t>(n + 1, inf)), from = cost;
  for (int64_t i = 1; i <= n; ++i) cost[0][i] = weight(0, 0, i);
  for (int64_t s = 1; s < stages; ++s)
    for (int64_t i = s + 1; i <= n; ++i)
      for (int64_t j = s; j < i; ++j) {
        if (cost[s - 1][j] == inf) continue;
        auto c = std::max(cost[s - 1][j], weight(s, j, i));
        if (c < cost[s][i]) cost[s][i] = c, from[s][i] = j;
      }
  bounds.assign(stages + 1, 0);
  bounds[stages] = n;
  for (int64_t s = stages - 1; s >= 1; --s) bounds[s] = from[s][bounds[s + 1]];
  return bounds;
}

// ---- Actions ----------------------------------------------------------------------------------

PipeOp parse_pipe_op(const std::string& op) {
  static const std::map<std::string, PipeOp> ops{{"F", PipeOp::Forward},         {"B", PipeOp::Backward},
                                                 {"SEND_F", PipeOp::SendForward}, {"RECV_F", PipeOp::RecvForward},
                                                 {"SEND_B", PipeOp::SendBackward}, {"RECV_B", PipeOp::RecvBackward}};
  auto it = ops.find(op);
  TORCH_CHECK(it != ops.end(), "pipeline: unknown action '", op, "' (expected F, B, SEND_F, RECV_F, SEND_B or RECV_B)");
  return it->second;
}

std::string describe(const PipeAction& a) {
  static const char* names[] = {"F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"};
  std::ostringstream s;
  s << names[static_cast<int>(a.op)] << a.mb << ".c" << a.chunk;
  if (a.op == PipeOp::SendForward || a.op == PipeOp::SendBackward) s << "->" << a.peer;
  if (a.op == PipeOp::RecvForward || a.op == PipeOp::RecvBackward) s << "<-" << a.peer;
  return s.str();
}

// ---- The cut ----------------------------------------------------------------------------------

namespace {

// What stands in a rank's tree for a module another stage holds: no parameters, no forward.
class Elsewhere : public nn::Module {
 public:
  /// In place of `module`: what it takes and gives stay known on every rank, so that a chain's
  /// batch check (nn::Sequential::check_batch) is the same on every stage.
  Elsewhere(int stage, const nn::Module& module)
      : nn::Module("PipelineElsewhere"),
        stage(stage),
        input_(module.input_features()),
        output_(module.output_features()),
        elementwise_(module.elementwise()),
        replaced_(module.forward_replaced_in_tree()) {}
  torch::Tensor forward(const std::vector<torch::Tensor>&) override {
    TORCH_CHECK(false, "this module lives on pipeline stage ", stage, ": run the model with model:train_step");
  }
  std::string extra_repr() const override { return "stage=" + std::to_string(stage); }
  c10::optional<nn::Features> input_features() const override { return input_; }
  c10::optional<nn::Features> output_features() const override { return output_; }
  bool elementwise() const override { return elementwise_; }
  bool forward_replaced_in_tree() const override { return replaced_; }
  int stage;

 private:
  c10::optional<nn::Features> input_, output_;
  bool elementwise_, replaced_;
};

// Every rank must cut the model and run the schedule alike. A schedule function that returns
// another plan on another rank (a choice by rank, unseeded random numbers) or options computed
// per rank would pair one stage's micro-batch with another's, or run a block on two stages or
// none, without any error: the ranks compare what they will run once, before the first step.
void agree_on_pipeline(const dist::GroupPtr& world, const PipelineOptions& o, const std::vector<int64_t>& bounds) {
  if (!world || world->size() == 1 || world->planned()) return;
  uint64_t plan = 1469598103934665603ull;  // FNV-1a over every rank's actions
  for (const auto& list : o.plan)
    for (const auto& a : list)
      for (int64_t v : {static_cast<int64_t>(a.op), static_cast<int64_t>(a.mb), static_cast<int64_t>(a.chunk),
                        static_cast<int64_t>(a.peer), int64_t{-7}})
        plan = (plan ^ static_cast<uint64_t>(v)) * 1099511628211ull;
  std::ostringstream mine;
  mine << "microbatches=" << o.microbatches << ", chunks=" << o.chunks << ", blocks a stage ";
  for (size_t s = 0; s + 1 < bounds.size(); ++s) mine << (s ? "," : "") << bounds[s + 1] - bounds[s];
  mine << ", schedule '" << o.schedule << "' whose plan hashes to " << std::hex << plan;
  auto all = dist::all_gather_strings(world, mine.str());
  for (size_t r = 1; r < all.size(); ++r)
    TORCH_CHECK(all[r] == all[0], "pipeline: the ranks would run different pipelines: rank 0 has ", all[0], "; rank ",
                r, " has ", all[r], ". Give every rank the same pipeline options, and a schedule that returns the "
                "same plan on every rank (nothing chosen by rank or by unseeded random numbers): otherwise stages "
                "pair different micro-batches or run a block twice, without any error");
}

int64_t parameter_count(nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters(/*recurse=*/true)) n += p.numel();
  return n;
}

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

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
  Inbox(const dist::GroupPtr& group, torch::Device device, const std::vector<PipeAction>& actions, int chunks, int pp,
        int rank, const std::map<std::pair<int, int>, MessageShape>& predicted)
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
        if (auto it = predicted.find({a.mb, a.chunk * pp + rank}); it != predicted.end()) in.predicted = it->second;
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

std::shared_ptr<Pipeline> Pipeline::cut(nn::Module& root, const dist::Mesh& mesh, PipelineOptions options) {
  auto pipe = std::shared_ptr<Pipeline>(new Pipeline());
  auto& p = *pipe;
  p.root_ = &root;
  p.group_ = mesh.group("pipeline");
  p.pp_ = p.group_->size();
  p.rank_ = p.group_->rank();
  TORCH_CHECK(options.chunks >= 1 && options.microbatches >= 1, "pipeline: chunks=", options.chunks,
              " and microbatches=", options.microbatches, " must be at least 1");
  TORCH_CHECK(static_cast<int>(options.plan.size()) == p.pp_, "pipeline: the schedule has ", options.plan.size(),
              " rank lists for pipeline=", p.pp_);
  // The stage ends: the model's own (stage_in/stage_out), or else the policy's first and last
  // modules applied in order around the blocks (a chain). A replaced forward cannot be cut,
  // except sequence parallelism's, whose equivalent the model's stage ends compute.
  bool sequence_split = false;
  for (const auto& [path, m] : root.modules())
    if (auto split = m->sequence_split(); split && *split) sequence_split = true;
  TORCH_CHECK(!root.forward_replaced() || (root.has_stage_ends() && sequence_split), "pipeline: ", root.type(),
              "'s forward is replaced",
              root.has_stage_ends() ? "" : " and it has no stage ends of its own (stage_in, stage_out)",
              ": the stages run its parts (the policy's first modules, the blocks, its last modules), so a replaced "
              "forward cannot be cut into stages");
  TORCH_CHECK(!sequence_split || root.has_stage_ends(), "pipeline: ", root.type(), " is sequence-parallel but has no "
              "stage ends of its own to split and gather the sequence (sequence_parallel = false, or a model with "
              "stage_in/stage_out such as GPT-2)");
  auto blocks = root.find(options.blocks);
  TORCH_CHECK(blocks && !options.blocks.empty(), "pipeline: the policy's blocks '", options.blocks, "' is not a module "
              "of ", root.type());
  for (const auto& name : options.first)
    TORCH_CHECK(root.child(name), "pipeline: the policy's first module '", name, "' is not a child of ", root.type());
  for (const auto& name : options.last)
    TORCH_CHECK(root.child(name), "pipeline: the policy's last module '", name, "' is not a child of ", root.type());

  if (!root.has_stage_ends()) {
    // A chain only when the root runs its children in order: a Sequential of exactly the first
    // modules, the blocks' container and the last modules. Any other forward could differ from
    // the chain without an error, so it is refused.
    std::vector<std::string> want(options.first), have;
    want.push_back(options.blocks);
    want.insert(want.end(), options.last.begin(), options.last.end());
    for (const auto& [name, child] : root.children_named()) have.push_back(name);
    auto list = [](const std::vector<std::string>& names) {
      std::string out;
      for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
      return out;
    };
    TORCH_CHECK(dynamic_cast<nn::Sequential*>(&root) && have == want, "pipeline: ", root.type(), " has no stage ends of "
                "its own (stage_in, stage_out), so its stages run as a chain: it must be a Sequential whose children "
                "are the policy's first modules, its blocks' container and its last modules, in that order (",
                list(want), "), but it ", dynamic_cast<nn::Sequential*>(&root) ? "has " + list(have)
                                                                                    : std::string("is not a Sequential"));
  }
  auto block_list = blocks->children_named();
  std::vector<int64_t> weights;
  for (auto& [name, b] : block_list) weights.push_back(parameter_count(*b));
  int64_t first = 0, last = 0;
  for (const auto& name : options.first) first += parameter_count(*root.child(name));
  for (const auto& name : options.last) last += parameter_count(*root.child(name));
  const int stages = p.pp_ * options.chunks;
  p.bounds_ = split_stages(weights, stages, options.balance, first, last);
  agree_on_pipeline(mesh.group("world"), options, p.bounds_);

  // Which virtual stage holds each parameter name; a tensor held by more than one rank is a tie.
  auto stage_of_child = [&](const std::string& child) -> int {
    if (child == options.blocks) return -1;  // per block
    if (contains(options.first, child)) return 0;
    if (contains(options.last, child)) return stages - 1;
    return -2;  // not placed
  };
  auto stage_of_block = [&](int64_t i) {
    return static_cast<int>(std::upper_bound(p.bounds_.begin(), p.bounds_.end(), i) - p.bounds_.begin() - 1);
  };
  auto rank_of_stage = [&](int s) { return s % p.pp_; };
  std::unordered_map<const c10::TensorImpl*, std::vector<int>> holders;  // ranks, in name order
  std::unordered_map<const c10::TensorImpl*, std::vector<std::string>> names;
  std::vector<torch::Tensor> order;
  const std::string prefix = options.blocks + ".";
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    const auto& name = item.key();
    auto top = name.substr(0, name.find('.'));
    int stage;
    if (name.rfind(prefix, 0) == 0) {
      auto rest = name.substr(prefix.size());
      auto idx = rest.substr(0, rest.find('.'));
      auto it = std::find_if(block_list.begin(), block_list.end(), [&](const auto& b) { return b.first == idx; });
      TORCH_CHECK(it != block_list.end(), "pipeline: parameter '", name, "' sits in the blocks' container '",
                  options.blocks, "' but in none of its blocks");
      stage = stage_of_block(it - block_list.begin());
    } else {
      stage = stage_of_child(top);
      TORCH_CHECK(stage != -2, "pipeline: parameter '", name, "' belongs to '", top, "', which the policy's pipeline "
                  "places nowhere (blocks '", options.blocks, "', first and last modules)");
    }
    names[item.value().unsafeGetTensorImpl()].push_back(name);
    auto& h = holders[item.value().unsafeGetTensorImpl()];
    if (h.empty()) order.push_back(item.value());
    if (std::find(h.begin(), h.end(), rank_of_stage(stage)) == h.end())
      h.push_back(rank_of_stage(stage));
  }
  for (const auto& t : order) {
    const auto& h = holders[t.unsafeGetTensorImpl()];
    if (h.size() < 2) continue;
    bool mine = std::find(h.begin(), h.end(), p.rank_) != h.end();
    p.ties_.push_back({names[t.unsafeGetTensorImpl()], mine ? t : torch::Tensor(), h.front() == p.rank_,
                       t.sizes().vec(), t.scalar_type()});
  }

  // Keep this rank's modules; the others' become placeholders.
  for (auto& [name, child] : root.children_named()) {
    int s = stage_of_child(name);
    if (s >= 0 && rank_of_stage(s) != p.rank_) root.set_child(name, std::make_shared<Elsewhere>(s, *child));
  }
  if (!root.has_stage_ends()) {  // a chain: the first stage's modules, then the last's
    if (p.rank_ == 0)
      for (const auto& name : options.first) p.first_.push_back(root.child(name));
    if (p.rank_ == rank_of_stage(stages - 1))
      for (const auto& name : options.last) p.last_.push_back(root.child(name));
  }
  p.chunk_blocks_.assign(options.chunks, {});
  for (int64_t i = 0; i < static_cast<int64_t>(block_list.size()); ++i) {
    int s = stage_of_block(i);
    if (rank_of_stage(s) == p.rank_) p.chunk_blocks_[s / p.pp_].push_back(block_list[i].second);
    else blocks->set_child(block_list[i].first, std::make_shared<Elsewhere>(s, *block_list[i].second));
  }
  for (const auto& t : root.parameters(/*recurse=*/true)) {
    // A deferred model's tensors are allocated on the rank's device, except under partrain plan.
    p.device_ = t.is_meta() && !util::planning() ? dist::World::instance().device() : t.device();
    p.dtype_ = t.scalar_type();
    break;
  }
  p.options_ = std::move(options);
  return pipe;
}

void Pipeline::rebind(nn::Module& root) {
  auto params = root.named_parameters(/*recurse=*/true);
  for (auto& tie : ties_) {
    if (!tie.param.defined()) continue;  // held elsewhere
    for (const auto& name : tie.names)
      if (const auto* t = params.find(name)) {
        tie.param = *t;
        break;
      }
  }
}

double Pipeline::grad_norm(const std::vector<torch::Tensor>& params, const std::vector<dist::GroupPtr>& groups) const {
  TORCH_CHECK(groups.empty() || groups.size() == params.size(), "pipeline grad_norm: ", groups.size(), " groups for ",
              params.size(), " parameters");
  // Whole parameters summed here; split ones per tensor group (in first-seen order, the same on
  // every rank of a stage), then added: this rank's stage's share, summed over the pipeline.
  auto options = torch::TensorOptions().dtype(torch::kFloat64).device(device_);
  auto sum = torch::zeros({1}, options);
  std::vector<std::pair<dist::GroupPtr, torch::Tensor>> split;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    if (!p.grad().defined()) continue;
    auto tie = std::find_if(ties_.begin(), ties_.end(), [&](const Tie& t) { return t.param.is_same(p); });
    if (tie != ties_.end() && !tie->counted) continue;  // its other holder counts it
    auto sq = p.grad().detach().to(torch::kFloat64).pow(2).sum().reshape({1});
    auto g = groups.empty() ? nullptr : groups[i];
    if (!g) {
      sum += sq;
      continue;
    }
    auto it = std::find_if(split.begin(), split.end(), [&](const auto& e) { return e.first == g; });
    if (it == split.end()) split.emplace_back(g, sq);
    else it->second += sq;
  }
  for (auto& [g, sq] : split) {
    g->all_reduce(sq);
    sum += sq;
  }
  group_->all_reduce(sum);
  return std::sqrt(sum.item<double>());
}

std::vector<int> Pipeline::own_stages() const {
  std::vector<int> out;
  for (int c = 0; c < options_.chunks; ++c) out.push_back(c * pp_ + rank_);
  return out;
}

std::vector<std::vector<torch::Tensor>> Pipeline::chunk_params() const {
  const int chunks = options_.chunks, last = stages() - 1;
  std::vector<std::vector<torch::Tensor>> out(chunks);
  auto add = [&](int chunk, const nn::Module& m) {
    for (const auto& p : m.parameters(/*recurse=*/true)) out[chunk].push_back(p);
  };
  for (int c = 0; c < chunks; ++c)
    for (const auto& b : chunk_blocks_[c]) add(c, *b);
  // The stage ends' modules, by name: a model with stage ends of its own has no first_/last_.
  if (rank_ == 0)
    for (const auto& name : options_.first)
      if (auto m = root_->child(name)) add(0, *m);
  if (rank_ == last % pp_)
    for (const auto& name : options_.last)
      if (auto m = root_->child(name)) add(last / pp_, *m);
  return out;
}

std::string Pipeline::logical_name(const std::string& name) const {
  for (const auto& tie : ties_)
    if (std::find(tie.names.begin(), tie.names.end(), name) != tie.names.end()) return tie.names.front();
  return name;
}

bool Pipeline::first_holder(const torch::Tensor& param) const {
  for (const auto& tie : ties_)
    if (tie.param.defined() && tie.param.is_same(param)) return tie.counted;
  return true;
}

// ---- The executor -----------------------------------------------------------------------------

torch::Tensor Pipeline::run_chunk(int chunk, const torch::Tensor& in) {
  const int v = chunk * pp_ + rank_;
  const bool ends = root_->has_stage_ends();
  auto x = in;
  if (v == 0) {
    if (ends) x = root_->stage_in(x);
    else
      for (auto& m : first_) x = m->forward({x});
  }
  for (auto& b : chunk_blocks_[chunk]) x = b->forward({x});
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

torch::Tensor Pipeline::train_step(const torch::Tensor& x, const torch::Tensor& y,
                                   const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& loss,
                                   const torch::Tensor& weight, DataParallel* dp, double loss_scale) {
  const int m = options_.microbatches, chunks = options_.chunks, last = stages() - 1;
  check_runnable();
  root_->train();
  events::forward_begins();  // a script's first training step begins (once): the planner counts from here
  auto xs = x.chunk(m, 0), ys = y.chunk(m, 0);
  StageMeter meter(measured_, chunks, device_.type(), *root_);  // the first step weighs its chunks
  struct Slot {
    torch::Tensor input, output, grad, input_grad;
  };
  std::vector<Slot> slots(static_cast<size_t>(m) * chunks);
  const auto& actions = options_.plan[rank_];
  size_t last_backward = 0;
  for (size_t i = 0; i < actions.size(); ++i)
    if (actions[i].op == PipeOp::Backward) last_backward = i;
  torch::Tensor total = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat64).device(device_));
  struct SyncGuard {  // the data-parallel sync runs in the rank's last backward only, whatever happens
    DataParallel* dp;
    ~SyncGuard() {
      if (dp) {
        dp->set_sync(true);
        dp->set_chunk(-1);
      }
    }
  } guard{dp};
  events::train_step_begins();  // the tracer (--trace) records each action's span
  static const TraceKind kinds[] = {  // in PipeOp's order
      TraceKind::Forward,        TraceKind::Backward,     TraceKind::SendActivation,
      TraceKind::RecvActivation, TraceKind::SendGradient, TraceKind::RecvGradient};
  std::vector<int64_t> last_shape;  // this rank's last activation's (partrain plan's fallback)
  // A step that does not finish forgets the shapes the next one would predict: its messages may
  // be half-sent, and every rank's step fails (the loss's broadcast below waits for them all).
  // It also leaves messages queued in the group (sent and not received, receives posted), which
  // a later step would take for its own: the pipeline refuses to run again on this backend.
  struct ForgetUnlessDone {
    Pipeline& p;
    bool done = false;
    ~ForgetUnlessDone() {
      if (done) return;
      p.sent_shapes_.clear();
      p.received_shapes_.clear();
      p.failed_at_renewal_ = p.group_->renewals();
    }
  } forget{*this};
  // A tied gradient an earlier step left (train_step again before opt:step(), or no zero_grad)
  // is summed over the pipeline already: it is set aside and added back after this step's sum.
  std::vector<torch::Tensor> kept(ties_.size());
  for (size_t i = 0; i < ties_.size(); ++i) {
    const auto held = tie_gradient(ties_[i], dp);
    if (!held.defined()) continue;
    kept[i] = held.detach().to(tie_dtype(ties_[i], dp), /*non_blocking=*/false, /*copy=*/true);
    held.detach().zero_();
    if (ties_[i].param.grad().defined()) ties_[i].param.mutable_grad().detach().zero_();
  }
  std::optional<Inbox> inbox;
  if (receives_ahead()) inbox.emplace(group_, device_, actions, chunks, pp_, rank_, received_shapes_);
  for (size_t i = 0; i < actions.size(); ++i) {
    const auto& a = actions[i];
    auto& s = slots[static_cast<size_t>(a.mb) * chunks + a.chunk];
    const int v = a.chunk * pp_ + rank_;
    if (inbox) inbox->post();
    TraceSpan span(kinds[static_cast<int>(a.op)], a.mb, a.chunk, a.peer);
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
        // Under ZeRO-2 each backward reduces its chunk's buckets (the same on every data rank:
        // they run the same schedule).
        if (dp) {
          dp->set_sync(i == last_backward);
          dp->set_chunk(a.chunk);
        }
        meter.backward_begins();
        if (v == last) s.output.backward();
        else torch::autograd::backward({s.output}, {s.grad});
        meter.backward_ends(a.chunk);
        if (dp) dp->complete();  // a pass that backward left to this thread (thread-bound hooks)
        if (s.input.defined()) s.input_grad = s.input.grad();
        s.input = s.output = s.grad = torch::Tensor();  // this micro-batch's activations are freed
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
  if (dp) dp->complete();
  // The loss from the last stage's rank, on every rank.
  total = total.reshape({1}).contiguous();
  group_->broadcast(total, last % pp_);
  forget.done = true;
  meter.finish(actions, gradients_ahead());
  sync.reset();
  events::train_step_ends("rank " + std::to_string(dist::World::instance().rank()) + ": pipeline rank " +
                          std::to_string(rank_));
  return total.squeeze(0);
}

}  // namespace partrain::parallel
