// This file splits a model into pipeline stages (see pipeline.hpp); pipeline_step.cpp runs a
// rank's schedule.
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
#include "engine/util/planning.hpp"

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
                                                 {"SEND_B", PipeOp::SendBackward}, {"RECV_B", PipeOp::RecvBackward},
                                                 {"W", PipeOp::Weight}};
  auto it = ops.find(op);
  TORCH_CHECK(it != ops.end(), "pipeline: unknown action '", op, "' (expected F, B, W, SEND_F, RECV_F, SEND_B or RECV_B)");
  return it->second;
}

std::string describe(const PipeAction& a) {
  static const char* names[] = {"F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "W"};
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
  mine << "microbatches=" << o.microbatches << ", chunks=" << o.chunks << ", layout " << o.layout << ", blocks a stage ";
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

}  // namespace

void PipelineOptions::validate(const dist::Mesh& mesh) const {
  const int pp = mesh.size("pipeline");
  TORCH_CHECK(chunks >= 1 && microbatches >= 1, "pipeline: chunks=", chunks, " and microbatches=", microbatches,
              " must be at least 1");
  TORCH_CHECK(static_cast<int>(plan.size()) == pp, "pipeline: the schedule has ", plan.size(),
              " rank lists for pipeline=", pp);
  TORCH_CHECK(layout == "interleaved" || layout == "v", "pipeline: unknown stage layout '", layout,
              "' (expected interleaved or v)");
}

std::shared_ptr<Pipeline> Pipeline::cut(nn::Module& root, const dist::Mesh& mesh, PipelineOptions options) {
  auto pipe = std::shared_ptr<Pipeline>(new Pipeline());
  auto& p = *pipe;
  p.root_ = &root;
  p.group_ = mesh.group("pipeline");
  p.pp_ = p.group_->size();
  p.rank_ = p.group_->rank();
  options.validate(mesh);
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
  const StageLayout places{p.pp_, options.layout == "v"};
  auto rank_of_stage = [&](int s) { return places.rank(s); };
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
  for (int c = 0; c < options_.chunks; ++c) out.push_back(layout().stage(rank_, c));
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
  if (rank_ == layout().rank(last))
    for (const auto& name : options_.last)
      if (auto m = root_->child(name)) add(layout().chunk(last), *m);
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

}  // namespace partrain::parallel
