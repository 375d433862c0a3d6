// Planning without processes: planning mode, the first step's marks, a rank's plan built from
// its model and optimizers, and a run checked against a saved plan. See plan.hpp; the meta
// kernels are in meta_kernels.cpp, the file format in plan_io.cpp, the text in text.cpp and the
// counting allocators in engine/util/tensor_memory.cpp.
#include "engine/plan/plan.hpp"
#include "engine/util/step_events.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <set>
#include <sstream>

#include "engine/dist/mesh.hpp"
#include "engine/nn/layers.hpp"
#include "engine/optim/optim.hpp"
#include "engine/parallel/context_parallel.hpp"
#include "engine/parallel/moe.hpp"
#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/pipeline.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/parallel/zero.hpp"
#include "engine/plan/meta_kernels.hpp"
#include "engine/util/text.hpp"

namespace partrain::plan {

// ---- Planning mode and the first step ------------------------------------------------------

namespace {
FirstStep first_step_;
// Each group's traffic when the first step began (a group made later counts from zero).
std::map<const dist::ProcessGroup*, std::map<std::string, dist::ProcessGroup::Traffic>> traffic_base_;

// Where activations are counted: the meta device when planning, else the rank's (the CUDA
// caching allocator's counters on a CUDA device).
c10::DeviceType counted_device() {
  return planning() ? c10::kMeta : dist::World::instance().device().type();
}

// ZeRO-3's gather buffers now, over every model of this process: the units gathered and the
// freed buffers kept for the next gathers (a forward allocates them beside its activations).
int64_t gathered_now() {
  int64_t sum = 0;
  for (const auto& m : parallel::ParallelModel::alive())
    if (m->fsdp()) {
      const auto b = m->fsdp()->bytes();
      sum += b.gathered + b.pooled;
    }
  return sum;
}
}  // namespace

void set_planning(bool on) {
  util::set_planning_flag(on);
  util::install_allocators();
  if (on) meta::install();
  nn::set_parameter_options(on ? torch::TensorOptions().device(torch::kMeta) : torch::TensorOptions());
}

namespace {
std::atomic<void (*)()> before_first_step{nullptr};

// The planner's ear on the training step: the first training forward's memory and traffic.
class FirstStepObserver final : public events::StepObserver {
 public:
  void forward_begins() override {
    if (first_step_.begun) return;
    first_step_.begun = true;
    if (auto fn = before_first_step.load()) fn();
    first_step_.base = util::memory(counted_device()).allocated;
    first_step_.flops_base = counted_flops();
    first_step_.ops_base = counted_ops();
    gathered_base_ = gathered_now();
    traffic_base_.clear();
    for (const auto& g : dist::World::instance().groups()) traffic_base_[g.get()] = g->traffic();
    util::keep_context_attention_notes(0);
    util::keep_expert_exchange_notes(0);
  }
  void forward_ends() override {
    if (!first_step_.begun || first_step_.forward_done) return;
    first_step_.forward_done = true;
    first_step_.gathered = gathered_now() - gathered_base_;
    first_step_.activations = util::memory(counted_device()).allocated - first_step_.base - first_step_.gathered;
  }
  // A forward set aside puts the record (and the traffic it counts from) back as it was, so that
  // a forward of its that passes through Lua (a policy's sequence-parallel forward) begins no step.
  void aside_begins() override {
    saved_.push_back({first_step_, traffic_base_, gathered_base_, util::context_attention_notes().size(),
                      util::expert_exchange_notes().size()});
  }
  void aside_ends() override {
    if (saved_.empty()) return;
    first_step_ = saved_.back().step;
    traffic_base_ = std::move(saved_.back().traffic);
    gathered_base_ = saved_.back().gathered;
    util::keep_context_attention_notes(saved_.back().notes);
    util::keep_expert_exchange_notes(saved_.back().expert_notes);
    saved_.pop_back();
  }

 private:
  struct Saved {
    FirstStep step;
    std::map<const dist::ProcessGroup*, std::map<std::string, dist::ProcessGroup::Traffic>> traffic;
    int64_t gathered = 0;
    size_t notes = 0;         // context attention notes
    size_t expert_notes = 0;  // expert exchange notes
  };
  std::vector<Saved> saved_;
  int64_t gathered_base_ = 0;
};

// Listens from the start of the process: a step the engine announces is noted whoever trains.
const bool observing = [] {
  static FirstStepObserver observer;
  events::observe(&observer);
  return true;
}();
}  // namespace

void set_before_first_step(void (*fn)()) { before_first_step = fn; }

void first_step_hooked() { first_step_.hooked = true; }

const FirstStep& first_step() { return first_step_; }
void reset_first_step() {
  first_step_ = FirstStep{};
  traffic_base_.clear();
  util::keep_context_attention_notes(0);
  util::keep_expert_exchange_notes(0);
}

// ---- Building a rank's plan ----------------------------------------------------------------

bool Shard::operator==(const Shard& o) const {
  return name == o.name && dtype == o.dtype && shape == o.shape && local_shape == o.local_shape && dim == o.dim &&
         slices == o.slices && group == o.group && bytes == o.bytes;
}

bool Collective::operator==(const Collective& o) const {
  return group == o.group && op == o.op && calls == o.calls && bytes == o.bytes;
}

namespace {

// ZeRO-3's parameters on this rank: what it keeps (its shards, and every parameter no unit
// holds: ties across pipeline stages, frozen ones) and the most its gathers hold at once.
struct Zero3Params {
  int64_t kept = 0, gathered = 0;
  bool all = false;  // every unit stays gathered from forward to backward
};
Zero3Params zero3_params(const nn::Module& model, const parallel::ParallelModel& owner) {
  const auto& f = *owner.fsdp();
  const auto& dp = *owner.data_parallel();
  Zero3Params out;
  out.kept = f.bytes().shards;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const auto& p = item.value();
    if (!p.defined() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    const int64_t k = dp.index_of(p);
    if (k >= 0 && f.unit_of_bucket(dp.bucket_of(static_cast<size_t>(k))) >= 0) continue;  // in a shard
    out.kept += static_cast<int64_t>(p.nbytes());
  }
  // Each unit's gathered bytes: its buckets' flat buffers, padded to the zero group.
  std::vector<int64_t> unit(f.units(), 0);
  for (size_t i = 0; i < dp.buckets().size(); ++i) {
    const int u = f.unit_of_bucket(i);
    const auto& b = dp.buckets()[i];
    if (u >= 0) unit[u] += b.padded * static_cast<int64_t>(dp.params()[b.params.front()].element_size());
  }
  // The root unit stays gathered from the model's forward until its gradients are in. The others:
  // with reshard_after_forward (a pipeline's default is off) one computes while the next
  // `prefetch` are on their way (forward: the ones after; backward: the ones before), so the
  // most at once is the largest run of 1 + prefetch consecutive units; without it, all of them.
  out.all = !f.options().reshard_after_forward;
  const size_t blocks = unit.size() - 1;
  const size_t run = std::min<size_t>(blocks, 1 + static_cast<size_t>(f.options().prefetch));
  int64_t most = 0;
  for (size_t first = 1; first + run <= unit.size(); ++first) {
    int64_t sum = 0;
    for (size_t u = first; u < first + (out.all ? blocks : run); ++u) sum += unit[u];
    most = std::max(most, sum);
    if (out.all) break;
  }
  out.gathered = unit[0] + most;
  return out;
}

// What the first step's context attention calls would exchange in each mode (see ContextPlan).
ContextPlan context_plan(const std::vector<util::ContextAttentionNote>& notes) {
  ContextPlan p;
  if (notes.empty()) return p;
  const auto& first = notes.front();
  p.mode = first.ring ? "ring" : "all_to_all";
  p.calls = static_cast<int64_t>(notes.size());
  p.batch = first.batch;
  p.heads = first.heads;
  p.kv_heads = first.kv_heads;
  p.rows = first.rows;
  p.head_size = first.head_size;
  p.element_size = first.element_size;
  for (const auto& n : notes) {
    const int64_t c = n.context, e = n.element_size, passes = n.backward ? 2 : 1;
    // Ring: a block is this rank's keys and values; a forward passes c - 1 of them, a backward
    // c - 1 again and c gradient blocks, accumulated in float32 (float64 stays float64).
    const int64_t block = 2 * n.batch * n.kv_heads * n.rows * n.head_size;
    const int64_t gradient = std::max<int64_t>(e, 4);
    p.ring_bytes += (c - 1) * block * e + (n.backward ? (c - 1) * block * e + c * block * gradient : 0);
    // all_to_all: q, k, v and the output, each whole through an all-to-all, in a forward and
    // again (their gradients) in a backward; key/value heads fewer than c are repeated to c.
    const int64_t kv_heads = n.kv_heads < c ? c : n.kv_heads;
    p.all_to_all_bytes += passes * 2 * (n.heads + kv_heads) * n.batch * n.rows * n.head_size * e;
    if (p.all_to_all_refusal.empty())
      p.all_to_all_refusal = parallel::context_mode_refusal(parallel::ContextMode::AllToAll, n.heads, n.kv_heads, n.context);
  }
  if (!p.all_to_all_refusal.empty()) p.all_to_all_bytes = 0;  // it cannot run
  return p;
}

// This rank's share of the stacked experts, their gradients (data parallelism's buffers hold them
// in the buffer's dtype) and optimizer state, and what the first step's MoE forwards would move
// over the expert group (see ExpertPlan).
ExpertPlan expert_plan(const nn::Module& model, const std::vector<const optim::Optimizer*>& optimizers,
                       const std::vector<util::ExpertExchangeNote>& notes) {
  ExpertPlan p;
  auto owner = parallel::ParallelModel::of(model);
  const auto dp = owner ? owner->data_parallel() : nullptr;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const auto& t = item.value();
    const auto& name = item.key();
    const auto dot = name.rfind('.');
    auto holder = dot == std::string::npos ? nullptr : model.find(name.substr(0, dot));
    auto* experts = dynamic_cast<const parallel::GroupedExperts*>(holder.get());
    if (!experts || !t.defined() || !seen.insert(t.unsafeGetTensorImpl()).second) continue;
    if (name.compare(dot + 1, std::string::npos, "w1") == 0) ++p.blocks;
    p.experts = experts->experts;
    p.local = experts->local;
    const auto bytes = static_cast<int64_t>(t.nbytes());
    p.param_bytes += bytes;
    p.stacked_bytes += bytes / experts->local * experts->experts;
    if (t.requires_grad()) {
      const int64_t k = dp ? dp->index_of(t) : -1;
      const auto element = k >= 0 ? c10::elementSize(
                                        c10::typeMetaToScalarType(dp->buffer_options()[dp->buckets()[dp->bucket_of(k)].buffer].dtype()))
                                  : t.element_size();
      p.grad_bytes += t.numel() * static_cast<int64_t>(element);
    }
    for (const auto* o : optimizers) p.optimizer_bytes += o->planned_state_bytes(t);
  }
  for (const auto& n : notes) {
    // Forward: the counts, the rows to their experts' ranks (T of them) and the results back
    // (balanced: T/E rows of every rank for each expert); backward: both rows' gradients again.
    const int64_t passes = n.backward ? 2 : 1, row = n.dim * n.element_size;
    const int64_t back = n.experts * (n.slots / n.experts);
    if (p.forwards++ == 0) {
      p.top_k = n.top_k;
      p.tokens = n.tokens;
      p.slots = n.slots;
      p.dim = n.dim;
      p.element_size = n.element_size;
    }
    p.all_to_alls += 1 + 2 * passes;
    p.count_bytes += n.experts * 8;
    p.balanced_bytes += passes * (n.slots + back) * row;
    p.balanced_sent += passes * (n.slots + back) * row / n.expert * (n.expert - 1);
    p.worst_sent += passes * 2 * n.slots * row;
  }
  return p;
}

}  // namespace

RankPlan describe(int rank, const nn::Module& model, const std::vector<const optim::Optimizer*>& optimizers,
                  const dist::Mesh* mesh) {
  RankPlan r;
  r.rank = rank;
  if (mesh) {
    r.tensor = mesh->coord().tensor;
    r.data = mesh->coord().data;
    r.pipeline = mesh->coord().pipeline;
    r.context = mesh->coord().context;
    r.expert = mesh->coord().expert;
  } else {
    r.data = rank;
  }
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const auto& p = item.value();
    if (!p.defined() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;  // a tied one once
    Shard s;
    s.name = item.key();
    s.dtype = c10::toString(p.scalar_type());
    s.local_shape = p.sizes().vec();
    s.shape = s.local_shape;
    s.bytes = static_cast<int64_t>(p.nbytes());
    if (auto sharding = parallel::sharding_of(model, item.key())) {
      s.shape = sharding->shape;
      s.dim = static_cast<int>(sharding->dim);
      s.slices = sharding->slices(sharding->group->rank());
      s.group = sharding->group->ranks();
    }
    r.param_bytes += s.bytes;
    if (p.requires_grad()) r.grad_bytes += s.bytes;
    r.shards.push_back(std::move(s));
  }
  auto owner = parallel::ParallelModel::of(model);
  // Under data parallelism gradients live in its flat buffers (padded to the zero group); a
  // parameter whose dtype the buffer does not have (reduce_dtype) keeps its own .grad as well.
  // ZeRO-2 holds 1/n of the buffers (its shard), the buckets of ties across pipeline stages whole,
  // and scratch for the buckets backward is filling: what its first backward took, or one bucket
  // (the most it takes when the buckets are reduced in the order their gradients arrive).
  // ZeRO-1 reduce-scattering holds two buckets' inboxes beside its whole buffers.
  if (const auto dp = owner ? owner->data_parallel() : nullptr) {
    r.grad_bytes = dp->held_bytes();
    if (dp->scatters()) r.grad_bytes += std::max<int64_t>(0, dp->planned_scratch_bytes() - dp->scratch_bytes());
    std::set<const c10::TensorImpl*> own;  // a tied parameter has a slot per name, one .grad
    for (const auto& b : dp->buckets()) {
      if (dp->scatters() && !b.whole) continue;  // their .grad is released once in the bucket
      for (size_t k : b.params)
        if (dp->buffer_options()[b.buffer].dtype() != dp->params()[k].scalar_type() &&
            own.insert(dp->params()[k].unsafeGetTensorImpl()).second)
          r.grad_bytes += static_cast<int64_t>(dp->params()[k].nbytes());
    }
  }
  // ZeRO-3 keeps 1/z of each unit and gathers a few units at a time.
  if (owner && owner->fsdp() && owner->data_parallel()) {
    const auto z3 = zero3_params(model, *owner);
    r.param_shard_bytes = z3.kept;
    r.gather_bytes = z3.gathered;
    r.gathers_all = z3.all;
    r.param_bytes = z3.kept + z3.gathered;
  }
  for (const auto* o : optimizers) {
    r.optimizer_bytes += o->planned_state_bytes();
    if (auto z = parallel::zero_bytes(*o)) {  // the optimizer steps this rank's master shards
      // (ZeRO-3: a float32 parameter's shard is its master, counted with the parameters)
      r.master_bytes += z->master - z->shared_master;
      r.grad_bytes += z->shard_grad - z->shared_grad;  // ZeRO-2's shard is counted above
      r.zero_stage = z->stage;
      r.zero_group = z->group;
    } else {  // float32 masters of low-precision parameters, and the float32 gradients step() casts for them
      r.master_bytes += o->planned_master_bytes();
      r.grad_bytes += o->planned_master_bytes();
    }
  }
  r.activation_bytes = first_step_.forward_done ? first_step_.activations : -1;
  if (planning() && first_step_.begun) {
    r.flops = counted_flops() - first_step_.flops_base;
    r.ops = counted_ops() - first_step_.ops_base;
  }
  if (first_step_.begun) r.context_plan = context_plan(util::context_attention_notes());
  r.expert_plan = expert_plan(model, optimizers, first_step_.begun ? util::expert_exchange_notes()
                                                                   : std::vector<util::ExpertExchangeNote>{});
  // What the groups moved since the first step began.
  for (const auto& g : dist::World::instance().groups()) {
    auto before = traffic_base_.find(g.get());
    for (const auto& [op, t] : g->traffic()) {
      dist::ProcessGroup::Traffic base;
      if (before != traffic_base_.end() && before->second.count(op)) base = before->second.at(op);
      int64_t calls = t.calls - base.calls, bytes = t.bytes - base.bytes;
      if (!first_step_.begun || calls <= 0) continue;
      Collective c{g->name(), op, calls, bytes};
      c.size = g->size();
      const int per_node = std::max(1, dist::World::instance().options().local_world_size);
      std::set<int> nodes;
      for (int member : g->ranks()) nodes.insert(member / per_node);
      c.nodes = static_cast<int>(nodes.size());
      r.collectives.push_back(std::move(c));
    }
  }
  std::sort(r.collectives.begin(), r.collectives.end(),
            [](const Collective& a, const Collective& b) { return std::tie(a.group, a.op) < std::tie(b.group, b.op); });
  if (auto owner = parallel::ParallelModel::of(model); owner && owner->pipeline()) r.stage = stage_plan(*owner->pipeline());
  if (r.stage.present) r.activation_bytes = r.stage.activation_peak;
  return r;
}

Held held(const nn::Module& model, const std::vector<const optim::Optimizer*>& optimizers) {
  Held h;
  std::set<const c10::TensorImpl*> seen;
  std::set<const void*> grads;  // storages counted as gradients
  auto grad = [&](const torch::Tensor& g) {
    if (g.defined() && g.has_storage() && grads.insert(g.storage().unsafeGetStorageImpl()).second)
      h.grads += static_cast<int64_t>(g.storage().nbytes());
  };
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const auto& p = item.value();
    if (!p.defined() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    h.params += static_cast<int64_t>(p.nbytes());
    grad(p.grad());
  }
  auto owner = parallel::ParallelModel::of(model);
  if (const auto dp = owner ? owner->data_parallel() : nullptr) {
    for (const auto& b : dp->held()) grad(b);  // held whether or not a .grad views it now
    h.scratch = dp->scratch_bytes();
  }
  for (const auto* o : optimizers) {
    const int64_t masters = o->master_bytes();  // a plain optimizer's copies (none under ZeRO)
    h.optimizer += o->state_bytes() - masters;
    h.master += masters;
    for (const auto& p : o->params()) {  // the masters' float32 gradients
      grad(p.grad());
      grad(o->master(p).defined() ? o->master(p).grad() : torch::Tensor());
    }
    if (auto z = parallel::zero_bytes(*o)) {
      h.master += z->master - z->shared_master;  // ZeRO-3: those are the parameters' shards
      h.zero_stage = z->stage;
      h.zero_group = z->group;
    }
  }
  // ZeRO-3: a parameter's nbytes() is its whole size; what exists is its shard, or its unit's
  // gathered buffer while the unit is gathered (and on the CPU the freed buffers kept for the
  // next gathers, never more than were gathered at once).
  if (owner && owner->fsdp() && owner->data_parallel()) {
    const auto f = owner->fsdp()->bytes();
    h.param_shard = zero3_params(model, *owner).kept;
    h.gathered = f.gathered;
    h.peak_gathered = f.peak_gathered;
    h.largest_unit = f.largest_unit;
    h.root_unit = f.root_unit;
    h.pooled = f.pooled;
    h.params = h.param_shard + h.gathered;
  }
  return h;
}

StagePlan stage_plan(const parallel::Pipeline& pipe) {
  StagePlan st;
  const auto& o = pipe.options();
  const auto& measured = pipe.measured();
  const int pp = pipe.group()->size();
  st.present = true;
  st.schedule = o.schedule;
  st.blocks = o.blocks;
  st.first = o.first;
  st.last = o.last;
  st.microbatches = o.microbatches;
  st.stages = pipe.stages();
  for (int c = 0; c < o.chunks; ++c) {
    StageChunk ch;
    ch.stage = pipe.layout().stage(pipe.rank(), c);
    ch.first_block = pipe.bounds()[ch.stage];
    ch.end_block = pipe.bounds()[ch.stage + 1];
    ch.first = ch.stage == 0;
    ch.last = ch.stage == st.stages - 1;
    if (measured.done) {
      ch.activation_bytes = measured.activations[c];
      ch.gradient_bytes = measured.gradients[c];
      ch.backward_bytes = measured.backward[c];
      ch.pending_bytes = measured.pending[c];
    }
    st.chunks.push_back(ch);
  }
  if (pipe.rank() < static_cast<int>(o.peak_in_flight.size())) st.in_flight = o.peak_in_flight[pipe.rank()];
  st.activation_peak = measured.done ? measured.peak : -1;
  st.bubble = o.bubble;
  for (const auto& [peer, t] : measured.peers)
    st.peers.push_back({pipe.group()->ranks()[peer], peer, t.sends, t.send_bytes, t.recvs, t.recv_bytes});
  return st;
}

Plan layout_of(const dist::Mesh* mesh) {
  Plan p;
  auto& world = dist::World::instance();
  p.world = world.initialized() ? world.size() : 1;
  p.nproc_per_node = world.initialized() ? world.options().local_world_size : 1;
  if (mesh) {
    p.tensor = mesh->layout().tensor;
    p.data = mesh->layout().data;
    p.pipeline = mesh->layout().pipeline;
    p.zero = mesh->layout().zero;
    p.context = mesh->layout().context;
    p.expert = mesh->layout().expert;
  } else {
    p.data = p.world;
    p.zero = 1;  // ZeRO is not built yet: no zero groups
  }
  return p;
}

namespace {
Plan recorded_;
}

void record(RankPlan rank, const Plan& layout) {
  if (recorded_.ranks.empty()) {
    auto ranks = std::move(recorded_.ranks);
    recorded_ = layout;
    recorded_.ranks = std::move(ranks);
  }
  recorded_.ranks.push_back(std::move(rank));
}

Plan& recorded() { return recorded_; }

// ---- Checking a run against a saved plan --------------------------------------------------

std::string check(const RankPlan& actual, const Plan& layout, const std::string& path, const std::string& mode) {
  TORCH_CHECK(mode == "match" || mode == "override" || mode == "moo", "plan mode '", mode,
              "' is not one of match, override, moo");
  auto& world = dist::World::instance();
  dist::GroupPtr group = world.initialized() ? world.world() : nullptr;
  std::string diff, problem;
  bool exists = ::access(path.c_str(), F_OK) == 0;
  if (mode != "override") {
    if (!exists) {
      problem = "there is no plan at '" + path + "' (make one with partrain plan --save)";
    } else {
      try {
        Plan planned = load(path);
        std::ostringstream d;
        if (planned.world != layout.world || planned.tensor != layout.tensor || planned.data != layout.data ||
            planned.pipeline != layout.pipeline || planned.zero != layout.zero || planned.context != layout.context ||
            planned.expert != layout.expert)
          d << "  layout: planned world " << planned.world << " (" << layout_text(planned) << ", zero " << planned.zero
            << "); this run world " << layout.world << " (" << layout_text(layout) << ", zero " << layout.zero << ")\n";
        auto it = std::find_if(planned.ranks.begin(), planned.ranks.end(),
                               [&](const RankPlan& r) { return r.rank == actual.rank; });
        if (it == planned.ranks.end()) d << "  rank " << actual.rank << " is not in the plan\n";
        else d << differences(*it, actual);
        diff = d.str();
      } catch (const std::exception& e) {
        problem = util::message_of(e);
      }
    }
  }
  // Every rank learns whether any rank differs, so all of them act alike.
  bool any = dist::any_rank(group, !diff.empty() || !problem.empty());
  if (mode == "match" && any) {
    if (!problem.empty()) TORCH_CHECK(false, "rank ", actual.rank, ": ", problem);
    if (!diff.empty())
      TORCH_CHECK(false, "rank ", actual.rank, " does not match the plan '", path, "' (plan mode match):\n", diff,
                  "run partrain plan --save again, or use --plan-mode override or moo");
    TORCH_CHECK(false, "rank ", actual.rank, ": another rank does not match the plan '", path, "' (see its message)");
  }
  if (mode == "moo" && !any) return "matches the plan '" + path + "'";
  if (mode == "match") return "matches the plan '" + path + "'";
  // override, or moo with a difference: write this run's plan.
  auto all = dist::all_gather_strings(group, to_bytes(actual));
  if (!group || group->rank() == 0) {
    Plan p = layout;
    for (const auto& bytes : all) p.ranks.push_back(from_bytes(bytes));
    save(p, path);
  }
  if (group && group->size() > 1) group->barrier();
  return std::string(exists ? "wrote this run's plan over '" : "wrote this run's plan to '") + path + "'";
}

}  // namespace partrain::plan
