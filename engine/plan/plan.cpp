// Planning without processes: the meta kernels LibTorch lacks, the first step's marks, and the
// plan itself (built, saved, compared and shown, pipeline stages included). See plan.hpp; the
// counting allocators are in memory.cpp.
#include "engine/plan/plan.hpp"
#include "engine/util/step_events.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <ATen/ExpandUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <cereal/archives/binary.hpp>
#include <cereal/types/string.hpp>
#include <cereal/types/utility.hpp>
#include <cereal/types/vector.hpp>
#include <nlohmann/json.hpp>
#include <torch/library.h>

#include "engine/dist/mesh.hpp"
#include "engine/nn/layers.hpp"
#include "engine/optim/optim.hpp"
#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/pipeline.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/parallel/zero.hpp"
#include "engine/util/bounded_archive.hpp"
#include "engine/util/files.hpp"
#include "engine/util/text.hpp"

namespace partrain::plan {

// ---- Meta kernels --------------------------------------------------------------------------
// Shapes only: what the CPU kernel would return, without computing it. Registered only for the
// operators the running LibTorch has no meta kernel for in C++ (PyTorch registers several of its
// meta kernels from Python, in torch/_meta_registrations.py, which a C++ program never loads).

namespace meta {

using at::Tensor;

Tensor index_select(const Tensor& self, int64_t dim, const Tensor& index) {
  auto sizes = self.sizes().vec();
  if (!sizes.empty()) sizes[c10::maybe_wrap_dim(dim, self.dim())] = index.numel();
  return at::empty(sizes, self.options());
}

Tensor embedding_dense_backward(const Tensor& grad, const Tensor&, int64_t num_weights, int64_t, bool) {
  return at::empty({num_weights, grad.size(-1)}, grad.options());
}

std::tuple<Tensor, Tensor, Tensor> native_layer_norm(const Tensor& input, at::IntArrayRef normalized,
                                                     const c10::optional<Tensor>&, const c10::optional<Tensor>&,
                                                     double) {
  auto stat = input.sizes().vec();
  for (size_t i = stat.size() - normalized.size(); i < stat.size(); ++i) stat[i] = 1;
  bool reduced = input.scalar_type() == at::kHalf || input.scalar_type() == at::kBFloat16;
  auto stat_options = input.options().dtype(reduced ? at::kFloat : input.scalar_type());
  return std::make_tuple(at::empty(input.sizes(), input.options()), at::empty(stat, stat_options),
                         at::empty(stat, stat_options));
}

std::tuple<Tensor, Tensor, Tensor> native_layer_norm_backward(const Tensor&, const Tensor& input, at::IntArrayRef,
                                                              const Tensor&, const Tensor&,
                                                              const c10::optional<Tensor>& weight,
                                                              const c10::optional<Tensor>& bias,
                                                              std::array<bool, 3> mask) {
  Tensor dx, dw, db;
  if (mask[0]) dx = at::empty(input.sizes(), input.options());
  if (mask[1] && weight && weight->defined()) dw = at::empty(weight->sizes(), weight->options());
  if (mask[2] && bias && bias->defined()) db = at::empty(bias->sizes(), bias->options());
  return std::make_tuple(dx, dw, db);
}

Tensor where(const Tensor& condition, const Tensor& self, const Tensor& other) {
  auto shape = at::infer_size(at::infer_size(condition.sizes(), self.sizes()), other.sizes());
  return at::empty(shape, self.options().dtype(at::result_type(self, other)));
}

// An elementwise operator's out= form: `out` takes the broadcast shape of the tensor arguments.
void elementwise_out(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  size_t n = op.schema().arguments().size();
  auto args = torch::jit::last(*stack, n);
  at::Tensor out = args[n - 1].toTensor();
  std::vector<int64_t> shape;
  for (size_t i = 0; i + 1 < n; ++i)
    if (args[i].isTensor()) shape = at::infer_size(shape, args[i].toTensor().sizes());
  out.resize_(shape);
  torch::jit::drop(*stack, n);
  stack->push_back(out);
}

// An operator whose one result has the shape and type of its first tensor argument (a
// functional elementwise operator), or is that argument (its in-place form).
void like_first(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  size_t n = op.schema().arguments().size();
  auto args = torch::jit::last(*stack, n);
  at::Tensor first;
  for (const auto& a : args)
    if (a.isTensor()) {
      first = a.toTensor();
      break;
    }
  bool in_place = !op.schema().name().empty() && op.schema().name().back() == '_';
  at::Tensor result = in_place ? first : at::empty_like(first);
  torch::jit::drop(*stack, n);
  stack->push_back(result);
}

void install() {
  static torch::Library library(torch::Library::IMPL, "aten", c10::DispatchKey::Meta, __FILE__, __LINE__);
  static bool done = [] {
    auto missing = [](const char* name, const char* overload) {
      auto op = c10::Dispatcher::singleton().findSchema({name, overload});
      return op && !op->hasKernelForDispatchKey(c10::DispatchKey::Meta);
    };
    if (missing("aten::index_select", "")) library.impl("index_select", TORCH_FN(index_select));
    if (missing("aten::embedding_dense_backward", ""))
      library.impl("embedding_dense_backward", TORCH_FN(embedding_dense_backward));
    if (missing("aten::native_layer_norm", "")) library.impl("native_layer_norm", TORCH_FN(native_layer_norm));
    if (missing("aten::native_layer_norm_backward", ""))
      library.impl("native_layer_norm_backward", TORCH_FN(native_layer_norm_backward));
    if (missing("aten::where", "self")) library.impl("where.self", TORCH_FN(where));
    for (const char* name : {"relu", "relu_", "threshold_backward"})
      if (missing((std::string("aten::") + name).c_str(), ""))
        library.impl(name, torch::CppFunction::makeFromBoxedFunction<&like_first>());
    // where's out= form: scaled_dot_product_attention's math path masks with it on meta tensors.
    if (missing("aten::where", "self_out"))
      library.impl("where.self_out", torch::CppFunction::makeFromBoxedFunction<&elementwise_out>());
    for (const char* name : {"logical_or", "logical_and", "logical_xor", "logical_not"})
      if (missing((std::string("aten::") + name).c_str(), "out")) {
        std::string overload = std::string(name) + ".out";
        library.impl(overload.c_str(), torch::CppFunction::makeFromBoxedFunction<&elementwise_out>());
      }
    return true;
  }();
  (void)done;
}

}  // namespace meta

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
    traffic_base_.clear();
    for (const auto& g : dist::World::instance().groups()) traffic_base_[g.get()] = g->traffic();
  }
  void forward_ends() override {
    if (!first_step_.begun || first_step_.forward_done) return;
    first_step_.forward_done = true;
    first_step_.activations = util::memory(counted_device()).allocated - first_step_.base;
  }
  // A forward set aside puts the record (and the traffic it counts from) back as it was, so that
  // a forward of its that passes through Lua (a policy's sequence-parallel forward) begins no step.
  void aside_begins() override { saved_.push_back({first_step_, traffic_base_}); }
  void aside_ends() override {
    if (saved_.empty()) return;
    first_step_ = saved_.back().step;
    traffic_base_ = std::move(saved_.back().traffic);
    saved_.pop_back();
  }

 private:
  struct Saved {
    FirstStep step;
    std::map<const dist::ProcessGroup*, std::map<std::string, dist::ProcessGroup::Traffic>> traffic;
  };
  std::vector<Saved> saved_;
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

const FirstStep& first_step() {
  (void)observing;
  return first_step_;
}
void reset_first_step() {
  first_step_ = FirstStep{};
  traffic_base_.clear();
}

// ---- Building a rank's plan ----------------------------------------------------------------

bool Shard::operator==(const Shard& o) const {
  return name == o.name && dtype == o.dtype && shape == o.shape && local_shape == o.local_shape && dim == o.dim &&
         slices == o.slices && group == o.group && bytes == o.bytes;
}

bool Collective::operator==(const Collective& o) const {
  return group == o.group && op == o.op && calls == o.calls && bytes == o.bytes;
}

RankPlan describe(int rank, const nn::Module& model, const std::vector<const optim::Optimizer*>& optimizers,
                  const dist::Mesh* mesh) {
  RankPlan r;
  r.rank = rank;
  if (mesh) {
    r.tensor = mesh->coord().tensor;
    r.data = mesh->coord().data;
    r.pipeline = mesh->coord().pipeline;
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
  for (const auto* o : optimizers) {
    r.optimizer_bytes += o->planned_state_bytes();
    if (auto z = parallel::zero_bytes(*o)) {  // the optimizer steps this rank's master shards
      r.master_bytes += z->master;
      r.grad_bytes += z->shard_grad - z->shared_grad;  // ZeRO-2's shard is counted above
      r.zero_stage = z->stage;
      r.zero_group = z->group;
    } else {  // float32 masters of low-precision parameters, and the float32 gradients step() casts for them
      r.master_bytes += o->planned_master_bytes();
      r.grad_bytes += o->planned_master_bytes();
    }
  }
  r.activation_bytes = first_step_.forward_done ? first_step_.activations : -1;
  // What the groups moved since the first step began.
  for (const auto& g : dist::World::instance().groups()) {
    auto before = traffic_base_.find(g.get());
    for (const auto& [op, t] : g->traffic()) {
      dist::ProcessGroup::Traffic base;
      if (before != traffic_base_.end() && before->second.count(op)) base = before->second.at(op);
      int64_t calls = t.calls - base.calls, bytes = t.bytes - base.bytes;
      if (first_step_.begun && calls > 0) r.collectives.push_back({g->name(), op, calls, bytes});
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
      h.master += z->master;
      h.zero_stage = z->stage;
      h.zero_group = z->group;
    }
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
    ch.stage = c * pp + pipe.rank();
    ch.first_block = pipe.bounds()[ch.stage];
    ch.end_block = pipe.bounds()[ch.stage + 1];
    ch.first = ch.stage == 0;
    ch.last = ch.stage == st.stages - 1;
    if (measured.done) {
      ch.activation_bytes = measured.activations[c];
      ch.gradient_bytes = measured.gradients[c];
      ch.backward_bytes = measured.backward[c];
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

// ---- Saving and loading --------------------------------------------------------------------

template <class Archive>
void serialize(Archive& ar, Shard& s) {
  ar(s.name, s.dtype, s.shape, s.local_shape, s.dim, s.slices, s.group, s.bytes);
}
template <class Archive>
void serialize(Archive& ar, Collective& c) {
  ar(c.group, c.op, c.calls, c.bytes);
}
template <class Archive>
void serialize(Archive& ar, StageChunk& c) {
  ar(c.stage, c.first_block, c.end_block, c.first, c.last, c.activation_bytes, c.gradient_bytes, c.backward_bytes);
}
template <class Archive>
void serialize(Archive& ar, PeerTraffic& t) {
  ar(t.peer, t.pipeline_peer, t.sends, t.send_bytes, t.recvs, t.recv_bytes);
}
template <class Archive>
void serialize(Archive& ar, StagePlan& st) {
  ar(st.present, st.schedule, st.blocks, st.first, st.last, st.microbatches, st.stages, st.chunks, st.in_flight, st.activation_peak,
     st.bubble, st.peers);
}

namespace {
// The format version being read: version 1 plans (before pipeline stages) have no StagePlan,
// version 2 ones (before ZeRO) no master bytes or zero stage.
uint32_t reading_version = 3;
}  // namespace

template <class Archive>
void serialize(Archive& ar, RankPlan& r) {
  ar(r.rank, r.tensor, r.data, r.pipeline, r.shards, r.param_bytes, r.grad_bytes, r.optimizer_bytes,
     r.activation_bytes, r.collectives);
  if (reading_version >= 2) ar(r.stage);
  if (reading_version >= 3) ar(r.master_bytes, r.zero_stage, r.zero_group);
}
template <class Archive>
void serialize(Archive& ar, Plan& p) {
  ar(p.script, p.world, p.nproc_per_node, p.tensor, p.data, p.pipeline, p.zero, p.cpu_peak_bytes, p.seconds, p.ranks);
}

namespace {
const char kMagic[] = "partrain-plan";
constexpr uint32_t kVersion = 3;  // 2: pipeline stages; 3: master bytes and the zero stage (1 and 2 still read)
constexpr uint64_t kMaxPlanBytes = 256ull << 20;  // a plan of 65536 ranks of a large model fits
}  // namespace

// Whether `bytes` begin with the magic as cereal writes a string: its length (8 bytes, little
// endian), then its characters.
bool begins_with_magic(const std::string& bytes) {
  const size_t n = sizeof(kMagic) - 1;
  if (bytes.size() < 8 + n) return false;
  uint64_t length = 0;
  std::memcpy(&length, bytes.data(), 8);
  return length == n && bytes.compare(8, n, kMagic) == 0;
}

void check_save(const std::string& path) {
  auto refused = util::may_replace(path, begins_with_magic, "a partrain plan");
  TORCH_CHECK(refused.empty(), "--save ", refused);
}

void save(const Plan& plan, const std::string& path) {
  check_save(path);
  std::ostringstream out(std::ios::binary);
  {
    cereal::BinaryOutputArchive ar(out);
    ar(std::string(kMagic), kVersion, const_cast<Plan&>(plan));
  }
  util::write_atomic(path, out.str());
}

Plan load(const std::string& path) {
  // A regular file of bounded size (never a FIFO or a folder); cereal then reads it from memory,
  // and every length inside it is checked against what is left before anything is allocated.
  std::string bytes = util::read_regular(path, "plan", kMaxPlanBytes);
  TORCH_CHECK(begins_with_magic(bytes), "'", path, "' is not a partrain plan (made by partrain plan --save)");
  Plan plan;
  std::string magic;
  uint32_t version = 0;
  try {
    // Every length is checked against the bytes left before anything is sized.
    util::BoundedInputArchive ar(bytes.data(), bytes.size());
    ar(magic);
    TORCH_CHECK(magic == kMagic, "'", path, "' is not a partrain plan (made by partrain plan --save)");
    ar(version);
    TORCH_CHECK(version >= 1 && version <= kVersion, "the plan '", path, "' has format version ", version,
                "; this partrain reads 1 to ", kVersion);
    struct Reading {  // the version's fields, back to the current one whatever happens
      explicit Reading(uint32_t v) { reading_version = v; }
      ~Reading() { reading_version = kVersion; }
    } reading(version);
    ar(plan);
    if (ar.left() != 0) throw cereal::Exception(std::to_string(ar.left()) + " bytes follow the end of the plan");
  } catch (const cereal::Exception& e) {
    TORCH_CHECK(false, "the plan '", path, "' is damaged or truncated (", e.what(), ")");
  } catch (const std::length_error& e) {
    TORCH_CHECK(false, "'", path, "' is not a partrain plan");
  } catch (const std::bad_alloc& e) {
    TORCH_CHECK(false, "'", path, "' is not a partrain plan");
  }
  return plan;
}

bool starts_like_plan(const std::string& path) {
  int fd = util::open_regular(path, "plan");
  std::string head(8 + sizeof(kMagic) - 1, '\0');
  ssize_t n = ::read(fd, head.data(), head.size());
  ::close(fd);
  return n == static_cast<ssize_t>(head.size()) && begins_with_magic(head);
}

std::string to_bytes(const RankPlan& rank) {
  std::ostringstream out(std::ios::binary);
  {
    cereal::BinaryOutputArchive ar(out);
    ar(const_cast<RankPlan&>(rank));
  }
  return out.str();
}

RankPlan from_bytes(const std::string& bytes) {
  RankPlan r;
  util::BoundedInputArchive ar(bytes.data(), bytes.size());
  ar(r);
  return r;
}

// ---- Comparing -----------------------------------------------------------------------------

namespace {

template <class T>
std::string list(const std::vector<T>& v, const char* sep = "x") {
  std::ostringstream s;
  for (size_t i = 0; i < v.size(); ++i) s << (i ? sep : "") << v[i];
  return v.empty() ? "scalar" : s.str();
}

std::string slices_text(const Shard& s) {
  if (s.dim < 0) return "whole";
  std::ostringstream t;
  for (size_t i = 0; i < s.slices.size(); ++i)
    t << (i ? "+" : "") << s.slices[i].first << ":" << s.slices[i].first + s.slices[i].second;
  return t.str();
}

// A name read from a plan file as a message shows it: as it is when short and printable, else
// its first 40 bytes (unprintable ones as '?') and its length. A damaged or foreign plan can
// hold a name of megabytes, which a mismatch had printed whole.
std::string name_text(const std::string& name) {
  bool plain = name.size() <= 80;
  for (char c : name) plain = plain && c >= 0x20 && c < 0x7f;
  if (plain) return name;
  std::string head = name.substr(0, 40);
  for (auto& c : head)
    if (c < 0x20 || c >= 0x7f) c = '?';
  return head + "... (" + std::to_string(name.size()) + " bytes)";
}

// A shard as a mismatch shows it, in at most 300 bytes (a damaged plan's shape can hold
// thousands of dimensions).
std::string shard_text(const Shard& s) {
  std::ostringstream t;
  t << name_text(s.dtype) << " " << list(s.shape) << " local " << list(s.local_shape);
  if (s.dim >= 0) t << " split on " << s.dim << " [" << slices_text(s) << "] over ranks " << list(s.group, ",");
  std::string text = t.str();
  return text.size() > 300 ? text.substr(0, 300) + "..." : text;
}

}  // namespace

std::string differences(const RankPlan& planned, const RankPlan& actual) {
  std::ostringstream d;
  int shown = 0, hidden = 0;  // at most 8 tensors named, then a count
  if (planned.tensor != actual.tensor || planned.data != actual.data || planned.pipeline != actual.pipeline)
    d << "  coordinates: planned tensor " << planned.tensor << ", data " << planned.data << ", pipeline "
      << planned.pipeline << "; this run " << actual.tensor << ", " << actual.data << ", " << actual.pipeline << "\n";
  std::map<std::string, const Shard*> mine;
  for (const auto& s : actual.shards) mine[s.name] = &s;
  for (const auto& s : planned.shards) {
    auto it = mine.find(s.name);
    bool differs = it == mine.end() || !(s == *it->second);
    if (differs && shown == 8) ++hidden;
    else if (it == mine.end())
      d << "  " << name_text(s.name) << ": planned (" << shard_text(s) << "), missing in this run\n";
    else if (differs)
      d << "  " << name_text(s.name) << ": planned " << shard_text(s) << "; this run " << shard_text(*it->second)
        << "\n";
    if (differs && shown < 8) ++shown;
    if (it != mine.end()) mine.erase(it);
  }
  for (const auto& [name, s] : mine) {
    if (shown == 8) {
      ++hidden;
      continue;
    }
    d << "  " << name << ": not in the plan (" << shard_text(*s) << ")\n";
    ++shown;
  }
  if (hidden) d << "  ... and " << hidden << " more tensor(s)\n";
  auto bytes = [&](const char* what, int64_t p, int64_t a) {
    if (p != a) d << "  " << what << " bytes: planned " << p << ", this run " << a << "\n";
  };
  bytes("parameter", planned.param_bytes, actual.param_bytes);
  bytes("gradient", planned.grad_bytes, actual.grad_bytes);
  bytes("optimizer", planned.optimizer_bytes, actual.optimizer_bytes);
  bytes("master-weight", planned.master_bytes, actual.master_bytes);
  if (planned.zero_stage != actual.zero_stage || planned.zero_group != actual.zero_group)
    d << "  ZeRO: planned stage " << planned.zero_stage << " over " << planned.zero_group << " rank(s); this run stage "
      << actual.zero_stage << " over " << actual.zero_group << "\n";
  if (planned.collectives != actual.collectives) {
    auto text = [](const std::vector<Collective>& cs) {  // the first 16, then a count
      std::ostringstream t;
      for (size_t i = 0; i < cs.size() && i < 16; ++i)
        t << " " << name_text(cs[i].group) << " " << name_text(cs[i].op) << " x" << cs[i].calls << " (" << cs[i].bytes
          << " B)";
      if (cs.size() > 16) t << " and " << cs.size() - 16 << " more";
      return cs.empty() ? std::string(" none") : t.str();
    };
    d << "  collectives in the first step: planned" << text(planned.collectives) << "; this run"
      << text(actual.collectives) << "\n";
  }
  return d.str();
}

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
            planned.pipeline != layout.pipeline || planned.zero != layout.zero)
          d << "  layout: planned world " << planned.world << " (tensor " << planned.tensor << " x data "
            << planned.data << " x pipeline " << planned.pipeline << ", zero " << planned.zero << "); this run world "
            << layout.world << " (tensor " << layout.tensor << " x data " << layout.data << " x pipeline "
            << layout.pipeline << ", zero " << layout.zero << ")\n";
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

// ---- Showing -------------------------------------------------------------------------------

namespace {

std::string human(int64_t bytes) {
  if (bytes < 0) return "-";
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double x = static_cast<double>(bytes);
  int u = 0;
  while (x >= 1024 && u < 4) {
    x /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", x, units[u]);
  return buf;
}

// "0-3", "0,2", "0-1,4-5", and runs with a stride as "1,9..57" (1, 9, 17, ..., 57).
std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream s;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i + 1;
    int step = j < ranks.size() ? ranks[j] - ranks[i] : 1;
    while (j + 1 < ranks.size() && ranks[j + 1] - ranks[j] == step) ++j;
    s << (i ? "," : "");
    if (j < ranks.size() && j - i >= 2) {  // three or more evenly spaced
      if (step == 1) s << ranks[i] << "-" << ranks[j];
      else s << ranks[i] << "," << ranks[i + 1] << ".." << ranks[j];
      i = j + 1;
    } else {
      s << ranks[i];
      i = i + 1;
    }
  }
  return s.str();
}

// Rows of text keyed by content, in first-seen order, with the ranks that share each.
struct Grouped {
  std::vector<std::string> order;
  std::map<std::string, std::vector<int>> ranks;
  void add(const std::string& text, int rank) {
    auto& r = ranks[text];
    if (r.empty()) order.push_back(text);
    r.push_back(rank);
  }
};

std::string kind_of(const std::string& group) { return group.substr(0, group.find('[')); }

std::string join(const std::vector<std::string>& v, const char* sep = ",") {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

// "h.0-2 + wte,wpe": a chunk's blocks and the first or last modules it holds.
std::string chunk_text(const StagePlan& st, const StageChunk& c) {
  std::string t = st.blocks + "." + std::to_string(c.first_block);
  if (c.end_block - c.first_block > 1) t += "-" + std::to_string(c.end_block - 1);
  if (c.first && !st.first.empty()) t = join(st.first) + " + " + t;
  if (c.last && !st.last.empty()) t += " + " + join(st.last);
  return "stage " + std::to_string(c.stage) + ": " + t;
}

// The pipeline's stages, activations under the schedule and point-to-point traffic, by rank.
std::string stages_text(const Plan& plan) {
  std::ostringstream out;
  const StagePlan* any = nullptr;
  for (const auto& r : plan.ranks)
    if (r.stage.present) any = &r.stage;
  if (!any) return "";
  char line[512], bubble[32];
  std::snprintf(bubble, sizeof bubble, "%.4f", any->bubble);
  out << "\npipeline stages: schedule " << any->schedule << ", " << any->microbatches << " micro-batches, "
      << any->stages << " stages; predicted bubble " << (any->bubble < 0 ? std::string("-") : bubble)
      << " (a forward 1 unit, a backward 2, transfers free)\n";
  std::snprintf(line, sizeof line, "  %-14s %-6s %-11s %-11s %-9s %-12s %s\n", "ranks", "stage", "act./mb", "grad in/mb",
                "in flight", "peak act.", "chunks");
  out << line;
  Grouped stages;
  for (const auto& r : plan.ranks) {
    if (!r.stage.present) continue;
    std::string acts, grads, chunks;
    for (const auto& c : r.stage.chunks) {
      acts += (acts.empty() ? "" : ",") + human(c.activation_bytes);
      grads += (grads.empty() ? "" : ",") + human(c.gradient_bytes);
      chunks += (chunks.empty() ? "" : "; ") + chunk_text(r.stage, c);
    }
    std::snprintf(line, sizeof line, "%-6d %-11s %-11s %-9s %-12s %s", r.pipeline, acts.c_str(), grads.c_str(),
                  r.stage.in_flight < 0 ? "-" : std::to_string(r.stage.in_flight).c_str(),
                  human(r.stage.activation_peak).c_str(), chunks.c_str());
    stages.add(line, r.rank);
  }
  for (const auto& text : stages.order) {
    std::snprintf(line, sizeof line, "  %-14s ", rank_list(stages.ranks[text]).c_str());
    out << line << text << "\n";
  }
  out << "\npoint-to-point per training step (messages to and from pipeline ranks; bytes include headers)\n";
  Grouped p2p;
  for (const auto& r : plan.ranks) {
    if (!r.stage.present) continue;
    std::string text;
    for (const auto& t : r.stage.peers) {
      std::string part = "pipeline rank " + std::to_string(t.pipeline_peer) + ":";
      if (t.sends) part += " send x" + std::to_string(t.sends) + " " + human(t.send_bytes);
      if (t.recvs) part += std::string(t.sends ? "," : "") + " recv x" + std::to_string(t.recvs) + " " + human(t.recv_bytes);
      text += (text.empty() ? "" : "; ") + part;
    }
    p2p.add(text.empty() ? "none" : text, r.rank);
  }
  for (const auto& text : p2p.order) {
    std::snprintf(line, sizeof line, "  %-14s ", rank_list(p2p.ranks[text]).c_str());
    out << line << text << "\n";
  }
  return out.str();
}

}  // namespace

namespace {

// What would make a layout that does not fit fit, from what dominates its largest rank.
std::string remedies(const Plan& plan, const RankPlan& r, int64_t device) {
  std::vector<std::string> tries;
  const int64_t sharded = r.grad_bytes + r.optimizer_bytes + r.master_bytes;
  if (r.zero_stage < 2 && plan.data > 1) {
    // ZeRO-2 keeps 1/data of the gradients, optimizer state and masters (the buckets aside).
    const int64_t saved = sharded - sharded / plan.data;
    tries.push_back("ZeRO-2 over the " + std::to_string(plan.data) + " data ranks (zero = { stage = 2 }; about " +
                    human(saved) + " less)");
  }
  if (r.activation_bytes > r.model_state_bytes() / 2)
    tries.push_back(std::string("activation recompute or ") + (plan.pipeline > 1 ? "smaller micro-batches" : "a smaller batch a rank") +
                    " (activations are " + human(r.activation_bytes) + ")");
  tries.push_back(plan.pipeline > 1 ? "more pipeline stages or a larger tensor size"
                                    : "a pipeline (--pipeline 2 or more) or a larger tensor size");
  if (r.peak_bytes() > 4 * device) tries.push_back("more ranks");
  std::string out;
  for (size_t i = 0; i < tries.size(); ++i) out += (i == 0 ? "" : i + 1 == tries.size() ? " or " : ", ") + tries[i];
  return out;
}

}  // namespace

std::string fit_verdict(const Plan& plan, int64_t device, const std::string& source) {
  if (plan.ranks.empty() || device <= 0) return "";
  const RankPlan* top = &plan.ranks.front();
  std::vector<int> all, over;
  for (const auto& r : plan.ranks) {
    all.push_back(r.rank);
    if (r.peak_bytes() > device) over.push_back(r.rank);
    if (r.peak_bytes() > top->peak_bytes()) top = &r;
  }
  const std::string of = " of " + human(device) + " (" + source + ")";
  if (over.empty())
    return "fits: peak " + human(top->peak_bytes()) + of + " on ranks " + rank_list(all) + " (the most on rank " +
           std::to_string(top->rank) + ")";
  return "does not fit: ranks " + rank_list(over) + " need up to " + human(top->peak_bytes()) + of + " (rank " +
         std::to_string(top->rank) + ": model state " + human(top->model_state_bytes()) + " + activations " +
         human(std::max<int64_t>(top->activation_bytes, 0)) + "); try " + remedies(plan, *top, device);
}

std::string to_text(const Plan& plan, const TextOptions& options) {
  std::ostringstream out;
  out << "plan of " << plan.script << " on " << plan.world << " virtual rank(s) (" << plan.world / plan.nproc_per_node
      << " node(s) x " << plan.nproc_per_node << "): tensor " << plan.tensor << " x data " << plan.data
      << " x pipeline " << plan.pipeline << (plan.zero > 1 ? ", zero groups of " + std::to_string(plan.zero) : "");
  const int stage = plan.ranks.empty() ? 0 : plan.ranks.front().zero_stage;
  if (stage > 0) out << ", ZeRO-" << stage << " over " << plan.ranks.front().zero_group << " rank(s)";
  out << "\n";
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.2f", plan.seconds);
  out << "planned in " << secs << " s; tensor memory allocated on the CPU while planning: peak "
      << human(plan.cpu_peak_bytes) << "\n";
  if (options.device_memory > 0) out << fit_verdict(plan, options.device_memory, options.device_source) << "\n";

  // The shard map: each logical tensor and who holds which part of it.
  std::vector<std::string> names;
  std::map<std::string, const Shard*> first;
  std::map<std::string, Grouped> holders;
  for (const auto& r : plan.ranks)
    for (const auto& s : r.shards) {
      if (!first.count(s.name)) {
        names.push_back(s.name);
        first[s.name] = &s;
      }
      holders[s.name].add(slices_text(s), r.rank);
    }
  size_t width = 9;
  for (const auto& n : names) width = std::max(width, n.size());
  char line[512];
  if (!options.shards) {
    out << "\nshards: " << names.size() << " logical tensors (partrain plan -v lists the slices each rank holds)\n";
    names.clear();
  } else {
    out << "\nshards: logical tensors and the slices ranks hold\n";
  }
  std::snprintf(line, sizeof line, "  %-*s  %-16s %-7s %-11s %s\n", static_cast<int>(width), "parameter", "shape",
                "split", "bytes/rank", "held by");
  if (options.shards) out << line;
  for (const auto& n : names) {
    const Shard& s = *first[n];
    std::string held;
    const auto& g = holders[n];
    if (g.order.size() == 1 && g.order[0] == "whole" && g.ranks.at("whole").size() == plan.ranks.size()) {
      held = "every rank (whole)";
    } else {
      for (const auto& text : g.order)
        held += (held.empty() ? "" : "; ") + std::string("ranks ") + rank_list(g.ranks.at(text)) + " [" + text + "]";
    }
    std::snprintf(line, sizeof line, "  %-*s  %-16s %-7s %-11s ", static_cast<int>(width), n.c_str(),
                  list(s.shape).c_str(), s.dim < 0 ? "-" : std::to_string(s.dim).c_str(), human(s.bytes).c_str());
    out << line << held << "\n";
  }

  // Memory per rank, ranks with the same figures together.
  out << "\nmemory per rank (model state = parameters + gradients + optimizer state + master weights; peak = model "
         "state + activations)\n";
  if (stage == 1)
    out << "  ZeRO-1: optimizer state and float32 master weights are this rank's shard; gradients are the whole flat "
           "buffer (backward accumulates into it) plus the float32 shard the update reads\n";
  if (stage == 2)
    out << "  ZeRO-2: optimizer state, float32 master weights and gradients are this rank's shard; gradients are the "
           "shard (what the update reads) plus the scratch of the buckets backward is reducing (and any tie across "
           "pipeline stages, reduced whole)\n";
  const bool staged = plan.pipeline > 1;
  std::snprintf(line, sizeof line, "  %-14s %-12s %-12s %-12s %-12s %-12s %-12s %s\n", "ranks", "parameters",
                "gradients", "optimizer", "masters", "model state", "peak",
                staged ? "activations (peak under the schedule)" : "activations (first step)");
  out << line;
  Grouped memory;
  for (const auto& r : plan.ranks) {
    std::snprintf(line, sizeof line, "%-12s %-12s %-12s %-12s %-12s %-12s %s", human(r.param_bytes).c_str(),
                  human(r.grad_bytes).c_str(), human(r.optimizer_bytes).c_str(), human(r.master_bytes).c_str(),
                  human(r.model_state_bytes()).c_str(), human(r.peak_bytes()).c_str(),
                  r.activation_bytes < 0 ? "- (no forward before the first step)" : human(r.activation_bytes).c_str());
    memory.add(line, r.rank);
  }
  for (const auto& text : memory.order) {
    std::snprintf(line, sizeof line, "  %-14s ", rank_list(memory.ranks[text]).c_str());
    out << line << text << "\n";
  }

  if (staged) out << stages_text(plan);

  // Collectives in a step, by group kind.
  out << "\ncollectives per training step (bytes: whole messages)\n";
  Grouped comms;
  for (const auto& r : plan.ranks) {
    std::map<std::string, Collective> by_kind;
    for (const auto& c : r.collectives) {
      auto& k = by_kind[kind_of(c.group) + " " + c.op];
      k.calls += c.calls;
      k.bytes += c.bytes;
    }
    std::string text;
    for (const auto& [what, c] : by_kind)
      text += (text.empty() ? "" : "; ") + what + " x" + std::to_string(c.calls) + " " + human(c.bytes);
    comms.add(text.empty() ? "none" : text, r.rank);
  }
  for (const auto& text : comms.order) {
    std::snprintf(line, sizeof line, "  %-14s ", rank_list(comms.ranks[text]).c_str());
    out << line << text << "\n";
  }
  return out.str();
}

std::string to_json(const Plan& plan) {
  using nlohmann::json;
  json ranks = json::array();
  for (const auto& r : plan.ranks) {
    json shards = json::array();
    for (const auto& s : r.shards) {
      json slices = json::array();
      for (const auto& [start, length] : s.slices) slices.push_back({start, length});
      shards.push_back({{"name", s.name}, {"dtype", s.dtype}, {"shape", s.shape}, {"local_shape", s.local_shape},
                        {"dim", s.dim < 0 ? json(nullptr) : json(s.dim)}, {"slices", slices}, {"group", s.group},
                        {"bytes", s.bytes}});
    }
    json comms = json::array();
    for (const auto& c : r.collectives)
      comms.push_back({{"group", c.group}, {"op", c.op}, {"calls", c.calls}, {"bytes", c.bytes}});
    json stage = nullptr;
    if (r.stage.present) {
      const auto& st = r.stage;
      json chunks = json::array(), peers = json::array();
      for (const auto& c : st.chunks)
        chunks.push_back({{"stage", c.stage}, {"blocks", {c.first_block, c.end_block}}, {"first", c.first},
                          {"last", c.last}, {"activation_bytes", c.activation_bytes < 0 ? json(nullptr) : json(c.activation_bytes)},
                          {"gradient_bytes", c.gradient_bytes},
                          {"backward_bytes", c.backward_bytes < 0 ? json(nullptr) : json(c.backward_bytes)}});
      for (const auto& t : st.peers)
        peers.push_back({{"peer", t.peer}, {"pipeline_peer", t.pipeline_peer}, {"sends", t.sends},
                         {"send_bytes", t.send_bytes}, {"recvs", t.recvs}, {"recv_bytes", t.recv_bytes}});
      stage = {{"pipeline_rank", r.pipeline}, {"schedule", st.schedule}, {"microbatches", st.microbatches},
               {"stages", st.stages}, {"blocks", st.blocks}, {"first", st.first}, {"last", st.last},
               {"chunks", chunks}, {"in_flight", st.in_flight < 0 ? json(nullptr) : json(st.in_flight)},
               {"activation_peak_bytes", st.activation_peak < 0 ? json(nullptr) : json(st.activation_peak)},
               {"bubble", st.bubble < 0 ? json(nullptr) : json(st.bubble)}, {"p2p", peers}};
    }
    ranks.push_back({{"rank", r.rank},
                     {"coord", {{"tensor", r.tensor}, {"data", r.data}, {"pipeline", r.pipeline}}},
                     {"param_bytes", r.param_bytes},
                     {"grad_bytes", r.grad_bytes},
                     {"optimizer_bytes", r.optimizer_bytes},
                     {"master_bytes", r.master_bytes},
                     {"zero", {{"stage", r.zero_stage}, {"group", r.zero_group}}},
                     {"model_state_bytes", r.model_state_bytes()},
                     {"activation_bytes", r.activation_bytes < 0 ? json(nullptr) : json(r.activation_bytes)},
                     {"collectives", comms},
                     {"pipeline", stage},
                     {"shards", shards}});
  }
  json j = {{"script", plan.script},
            {"world", plan.world},
            {"nproc_per_node", plan.nproc_per_node},
            {"mesh", {{"tensor", plan.tensor}, {"data", plan.data}, {"pipeline", plan.pipeline}, {"zero", plan.zero}}},
            {"seconds", plan.seconds},
            {"cpu_peak_bytes", plan.cpu_peak_bytes},
            {"ranks", ranks}};
  return j.dump(1);
}

}  // namespace partrain::plan
