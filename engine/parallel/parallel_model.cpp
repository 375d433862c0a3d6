// This file composes the parallelisms into one parallelized model and runs its training step (see
// parallel_model.hpp).
#include "engine/parallel/parallel_model.hpp"

#include <algorithm>
#include <cmath>
#include <iostream>
#include <unordered_map>

#include "engine/dist/world.hpp"
#include "engine/nn/init.hpp"
#include "engine/parallel/moe.hpp"
#include "engine/parallel/recompute.hpp"
#include "engine/parallel/stage_timing.hpp"
#include "engine/parallel/trace.hpp"
#include "engine/util/planning.hpp"
#include "engine/util/startup.hpp"
#include "engine/util/step_events.hpp"

namespace partrain::parallel {

std::atomic<int64_t> ParallelModel::live_{0};

namespace {

std::string describe_split(const c10::optional<Sharding>& s) { return s ? s->describe() : "whole"; }

}  // namespace

const ColumnParallelLinear* vocab_head_of(nn::Module& root, std::string* path) {
  const ColumnParallelLinear* head = nullptr;
  for (const auto& [where, m] : root.modules())
    if (auto* c = dynamic_cast<const ColumnParallelLinear*>(m.get()); c && c->vocab_head && c->group->size() > 1) {
      head = c;
      if (path) *path = where;
    }
  return head;
}

std::vector<ParameterRecord> parameter_records(nn::Module& root) {
  std::vector<ParameterRecord> records;
  std::unordered_map<const c10::TensorImpl*, size_t> index;  // a tied tensor: one record
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    const auto& name = item.key();
    const auto& p = item.value();
    if (!p.defined()) continue;
    auto sharding = sharding_of(root, name);
    auto [it, fresh] = index.emplace(p.unsafeGetTensorImpl(), records.size());
    if (!fresh) {
      auto& first = records[it->second];
      TORCH_CHECK(first.sharding == sharding, "'", name, "' is tied to '", first.name, "', but its layer holds it ",
                  describe_split(sharding), " and the other ", describe_split(first.sharding),
                  ": tied tensors must be split the same way (or be whole) under every name");
      first.aliases.push_back(name);
      continue;
    }
    ParameterRecord r;
    r.name = name;
    r.shape = sharding ? sharding->shape : p.sizes().vec();
    r.sharding = std::move(sharding);
    r.device = p.device();
    r.dtype = p.scalar_type();
    r.trainable = p.requires_grad();
    r.param = p;
    records.push_back(std::move(r));
  }
  return records;
}

std::vector<dist::GroupPtr> split_groups(nn::Module& root, const std::vector<torch::Tensor>& params) {
  std::unordered_map<const c10::TensorImpl*, dist::GroupPtr> group_of;
  for (const auto& r : parameter_records(root))
    if (r.sharding) group_of[r.param.unsafeGetTensorImpl()] = r.sharding->norm_group();
  std::vector<dist::GroupPtr> groups;
  groups.reserve(params.size());
  for (const auto& p : params) {
    auto it = group_of.find(p.unsafeGetTensorImpl());
    groups.push_back(it == group_of.end() ? nullptr : it->second);
  }
  return groups;
}

const std::vector<std::string>& train_step_losses() {
  static const std::vector<std::string> losses{"cross_entropy", "mse"};
  return losses;
}

namespace {

void check_loss(const std::string& name) {
  const auto& known = train_step_losses();
  if (std::find(known.begin(), known.end(), name) != known.end()) return;
  std::string list;
  for (const auto& l : known) list += (list.empty() ? "" : ", ") + l;
  TORCH_CHECK(false, "train_step: unknown loss '", name, "' (expected one of ", list, ")");
}

// An exact fingerprint of a tensor (on its device): its values (integers as they are, floating
// point by the bits of its float64 value) weighted by position, so that reordered rows differ,
// summed as integers below 2^32 each (no overflow below 2^31 elements, and the same whatever the
// reduction order), and its shape's FNV-1a hash: { values, shape }.
torch::Tensor fingerprint(const torch::Tensor& t) {
  constexpr int64_t kPrime = 65521;
  auto flat = t.detach().reshape({-1});
  if (flat.is_floating_point()) flat = flat.to(torch::kFloat64).contiguous().view(torch::kInt32);
  flat = flat.to(torch::kInt64);
  auto weights = torch::arange(flat.numel(), flat.options()).remainder_(kPrime).add_(1);
  uint64_t shape = 1469598103934665603ull;
  for (int64_t size : t.sizes()) shape = (shape ^ static_cast<uint64_t>(size)) * 1099511628211ull;
  auto shape_code = torch::full({}, static_cast<int64_t>(shape >> 1), flat.options());
  return torch::stack({flat.remainder(kPrime).mul_(weights).sum(), shape_code});
}

// Refuses a step whose ranks in `group` were given different batches (`who` names the ranks,
// `why` says why they need the same one): compares the inputs' and targets' fingerprints, one
// small all-reduce. A batch split by rank instead of by the mesh's data coordinate trains on
// without any error otherwise.
void agree_on_batch(const dist::GroupPtr& group, const torch::Tensor& x, const torch::Tensor& y, const char* who,
                    const char* why) {
  if (!group || group->size() == 1 || group->planned()) return;
  auto mine = torch::cat({fingerprint(x), fingerprint(y)}).to(dist::World::instance().device());
  auto spread = torch::cat({mine, -mine});  // the largest and the negated smallest over the ranks
  group->all_reduce(spread, dist::ReduceOp::Max);
  auto v = spread.cpu();
  const int64_t* h = v.data_ptr<int64_t>();  // x values, x shape, y values, y shape; then negated
  auto differ = [&](int i) { return h[i] != -h[i + 4]; };
  const bool inputs = differ(0) || differ(1), targets = differ(2) || differ(3);
  TORCH_CHECK(!inputs && !targets, "train_step: ", who, " were given different ",
              inputs ? (targets ? "inputs and targets" : "inputs") : "targets", ": ", why, ", so they must be given "
              "the same batch (split the data by the mesh's data coordinate, as pt.data.text { ..., mesh = mesh } "
              "does, not by rank)");
}

}  // namespace

// ---- The composer ----------------------------------------------------------------------------

namespace {

// This rank's initial values of the meta tensor `t` (its slice of a split one), on `device`.
torch::Tensor local_initial(const nn::Module& root, const nn::MetaTensor& t, const torch::Device& device) {
  const auto* s = t.owner->sharding_of(t.local);
  auto full = nn::initial_tensor(root, *t.init, s ? c10::IntArrayRef(s->shape) : t.meta.sizes());
  return (s ? local_part(full, *s, s->group->rank()) : full).to(device, t.meta.scalar_type());
}

}  // namespace

void materialize_local(nn::Module& root, const nn::InitPlan& plan) {
  const auto device = dist::World::instance().device();
  nn::materialize(root, device, [&](const nn::MetaTensor& t) { return local_initial(root, t, device); }, &plan);
}

void materialize_deferred(nn::Module& root, const nn::InitPlan& plan, DeferredValues& out) {
  const auto device = dist::World::instance().device();
  nn::materialize(root, device, [&](const nn::MetaTensor& t) {
    if (!t.meta.requires_grad()) return local_initial(root, t, device);
    auto empty = torch::empty(t.meta.sizes(), t.meta.options().device(device).requires_grad(false));
    release_storage(empty);
    // The recipe holds what it reads: the owner (the tree keeps it), the plan's entry (a copy).
    out[empty.storage().unsafeGetStorageImpl()] = [&root, owner = t.owner, local = t.local, meta = t.meta,
                                                    init = *t.init, device] {
      nn::MetaTensor m{"", owner, local, meta, &init};
      return local_initial(root, m, device);
    };
    return empty;
  }, &plan, /*check_memory=*/false);
}

namespace {

// Stages balanced by measured time are timed on the serial tree, before anything splits it: one
// unit at a time (a deferred model allocates one unit for its run), averaged over the ranks so
// that every rank cuts alike. The planner cannot time meta tensors: it splits by parameter count
// and says so.
void time_stages(nn::Module& tree, const dist::Mesh& mesh, PipelineOptions& p) {
  if (p.balance.method != "time" || mesh.size("pipeline") == 1) return;
  if (util::planning()) {
    p.balance.method = "parameters";
    if (mesh.rank() == 0)
      std::cerr << "partrain plan: balance 'time' is measured when the run starts; this plan splits the stages by "
                   "parameter count\n";
    return;
  }
  TORCH_CHECK(p.sample.defined() && p.sample.dim() >= 1 && p.sample.size(0) >= p.microbatches,
              "parallelize: balance 'time' times the blocks on a sample: give sample = one step's input batch "
              "(at least microbatches=", p.microbatches, " rows)", p.sample.defined() ? ", got one of shape " : "",
              p.sample.defined() ? c10::str(p.sample.sizes()) : "");
  p.balance.costs = time_pipeline_units(tree, p, p.sample.chunk(p.microbatches, 0)[0], mesh.group("world"));
  p.sample = torch::Tensor();  // the user's batch is not kept
}

}  // namespace

void RecomputeOptions::validate() const {
  TORCH_CHECK(mode == "none" || mode == "block", "parallelize: recompute must be 'block' or 'none', got ", mode);
  TORCH_CHECK(mode == "none" || !blocks.empty(), "parallelize: recompute = 'block' needs the container of the "
              "model's blocks");
}

namespace {

// Tells every ContextSplit module of the tree the context group and mode. A tree with no
// attention that splits, and no forward of its own written in Lua (which can call
// pt.cp.attention), is refused: its attention would see this rank's rows alone.
void split_context(nn::Module& tree, const dist::GroupPtr& group, c10::optional<ContextMode> asked) {
  const int c = group ? group->size() : 1;
  TORCH_CHECK(!asked || c > 1, "parallelize: context = \"", to_string(*asked), "\" splits attention over the mesh's ",
              "context ranks, but the mesh has context=1: make it with pt.mesh { context = c }, or drop the option");
  if (c == 1) return;
  const ContextMode mode = asked.value_or(ContextMode::Ring);
  ContextAttentionOptions o;
  o.group = group;
  o.mode = mode;
  int attending = 0;
  for (auto& [path, m] : tree.modules()) {
    auto* split = dynamic_cast<ContextSplit*>(m.get());
    if (!split) continue;
    if (split->attends()) {
      const auto heads = m->attribute("heads");
      const auto kv_heads = m->attribute("kv_heads");
      if (heads) {
        auto why = context_mode_refusal(mode, static_cast<int64_t>(*heads),
                                        static_cast<int64_t>(kv_heads.value_or(*heads)), group->size());
        TORCH_CHECK(why.empty(), "parallelize: ", path.empty() ? m->type() : path, ": ", why);
      }
      ++attending;
    }
    split->split_context(o);
  }
  TORCH_CHECK(attending > 0 || tree.forward_replaced_in_tree(), "parallelize: ", tree.type(),
              " cannot split its sequence over context=", group->size(),
              ": none of its modules computes attention over a split sequence (GPT-2's and LLaMA's do; a module "
              "written in Lua calls pt.cp.attention)");
}

// Tells every MoE block the expert group (its experts are cut to this rank's E/e) and the ranks
// that split the batch (its load-balancing counts are summed there). A mesh with expert ranks
// and no MoE block is refused, as are what is not built for experts yet.
void split_experts(nn::Module& tree, const dist::Mesh& mesh, int zero_stage) {
  const int e = mesh.size("expert");
  auto blocks = moe_blocks(tree);
  TORCH_CHECK(e == 1 || !blocks.empty() || mesh.size("pipeline") > 1, "parallelize: the mesh has expert=", e,
              ", but ", tree.type(), " has no mixture-of-experts block (pt.nn.MoE, or pt.models.llama { experts = E })"
              " whose experts could split over it");
  const auto& l = mesh.layout();
  TORCH_CHECK(e == 1 || zero_stage == 0 || l.zero == l.data * l.context, "parallelize: ZeRO-", zero_stage, " with expert=", e,
              " needs zero groups of every data rank (pt.mesh { zero = 0 }), got zero=", l.zero,
              ": expert and dense parameters are sharded in groups of their own");
  for (auto& [path, block] : blocks) {
    try {
      block->split_experts(mesh.group("expert"), mesh.group("data_context"), mesh.group("tensor"),
                           mesh.group("expert_tensor"));
    } catch (const c10::Error& err) {
      TORCH_CHECK(false, "parallelize: ", path, ": ", err.what_without_backtrace());
    }
  }
}

// Expert parameters (this rank's part of each block's stacked experts), for data parallelism's
// buckets of their own.
std::vector<torch::Tensor> expert_params(nn::Module& tree) {
  std::vector<torch::Tensor> out;
  for (auto& [path, block] : moe_blocks(tree))
    if (block->expert_size() > 1)
      for (const auto& p : block->child("experts")->parameters()) out.push_back(p);
  return out;
}

}  // namespace

void ParallelizeOptions::validate(const dist::Mesh& mesh) const {
  const int pp = mesh.size("pipeline");
  TORCH_CHECK(pp == 1 || pipeline, "parallelize: the mesh has pipeline=", pp, ", but no pipeline schedule was given");
  TORCH_CHECK(pp == 1 || data_parallel.grad_accumulation == 1, "parallelize: grad_accumulation=",
              data_parallel.grad_accumulation, " with a pipeline: a pipeline step already accumulates over its "
              "micro-batches (one gradient sync a step); raise microbatches instead");
  if (pp > 1) pipeline->validate(mesh);
  // ZeRO-3 frees a unit's gathered weights after its backward: a split one's W would find them gone.
  const bool splits = pp > 1 && std::any_of(pipeline->plan.begin(), pipeline->plan.end(), [](const auto& list) {
    return std::any_of(list.begin(), list.end(), [](const PipeAction& a) { return a.op == PipeOp::Weight; });
  });
  TORCH_CHECK(!splits || zero_stage_of(zero, mesh) < 3, "parallelize: schedule '", pipeline->schedule,
              "' splits backward (W actions), which ZeRO-3 does not run yet: its gathered weights are freed after B; "
              "use ZeRO-2 or a schedule without W");
  auto dp = data_parallel;  // as ZeRO will set it (its stage, its bucket size)
  zero_data_parallel(zero_stage_of(zero, mesh), zero, mesh, /*pipeline=*/nullptr, dp);
  dp.validate();
  recompute.validate();
}

std::shared_ptr<ParallelModel> ParallelModel::parallelize(nn::ModulePtr root, std::shared_ptr<dist::Mesh> mesh,
                                                          ParallelizeOptions options) {
  TORCH_CHECK(root, "parallelize: no model");
  TORCH_CHECK(mesh, "parallelize: no mesh");
  TORCH_CHECK(!of(*root), "this ", root->type(), " is already data-parallel (parallelized once): parallelize a fresh "
              "model");
  options.validate(*mesh);  // every option, before anything changes
  std::shared_ptr<ParallelModel> model(new ParallelModel());
  model->root_ = std::move(root);
  model->mesh_ = std::move(mesh);
  model->policy_ = std::move(options.policy);
  auto& tree = *model->root_;
  const auto& on = *model->mesh_;

  // The order follows torchtitan's parallelize: the parallelisms that change what a rank holds
  // come first, the ones that only move gradients last.
  // 0. Pipeline stages balanced by time are timed on the serial tree, before anything splits it.
  if (options.pipeline) time_stages(tree, on, *options.pipeline);
  //    A model built deferred is initialized as its serial tree says (each tensor's layer, the
  //    initializations its build asked for, a tie's first name): captured before 1 and 2 change it.
  const auto init_plan = util::planning() ? nn::InitPlan() : nn::init_plan(tree);
  // 1. Tensor and sequence parallelism, by the policy: layers are replaced by their parallel
  //    forms, cut from the serial weights. Everything after sees the split tree.
  if (options.tensor_parallel) options.tensor_parallel(tree, on);
  // 2. Pipeline parallelism cuts the tree into stages, before anything keeps a list of
  //    parameters: this rank keeps its stages' modules only.
  if (on.size("pipeline") > 1) model->pipeline_ = Pipeline::cut(tree, on, std::move(*options.pipeline));
  //    Context parallelism: the modules that compute over the sequence (the attentions, the
  //    models' positions and dropout) learn the context group; it changes no parameter.
  split_context(tree, on.group("context"), options.context);
  //    Expert parallelism: each MoE block keeps its experts of this expert rank (a split of its
  //    stacked experts along dimension 0); tokens travel to them by all-to-all.
  split_experts(tree, on, zero_stage_of(options.zero, on));
  // 3. A model built deferred (on the meta device) gets its tensors now, only those this rank
  //    holds: each initialized by name as the serial model (the logical tensor, then this rank's
  //    slice of a split one), one at a time. The planner keeps them on the meta device.
  //    Under ZeRO-3 a trainable parameter gets only its shape here: its values are made a unit
  //    at a time when ZeRO-3 takes its shards (5), so the model is never whole on any rank.
  const int stage = zero_stage_of(options.zero, on);
  DeferredValues deferred;
  if (!util::planning() && nn::has_meta(tree)) {
    if (stage == 3) materialize_deferred(tree, init_plan, deferred);
    else materialize_local(tree, init_plan);
    if (model->pipeline_) model->pipeline_->rebind(tree);  // its ties held the meta tensors
  }
  // 4. The records: one per parameter, from the tree as the policy left it. A tie between tensors
  //    split differently is refused here.
  model->records_ = parameter_records(tree);
  // 5. Data parallelism over the data group: parameters broadcast from data rank 0, gradient hooks
  //    over the unit's parameters as they now are (split or whole). It comes after the split so
  //    that its buckets hold this rank's parts. ZeRO rides on it: its buckets split into the zero
  //    group's parts (ZeRO-2 reduce-scatters them); the optimizer made for the model keeps its
  //    parts only (make_optimizer).
  auto dp = options.data_parallel;
  if (model->pipeline_) dp.pipeline.tied = model->pipeline_->tied_params();
  dp.broadcast_parameters = deferred.empty();  // made by name: alike on every rank, and not yet
  dp.experts.params = expert_params(tree);
  if (!dp.experts.params.empty()) {
    dp.experts.group = on.group("expert_data");
    if (stage > 0) dp.experts.zero = dp.experts.group;  // ZeRO-1: experts split over their own replicas
  }
  zero_data_parallel(stage, options.zero, on, model->pipeline_.get(), dp);
  std::vector<std::string> units;  // ZeRO-3's unit modules, in forward order
  if (stage == 3) {
    units = options.zero->units.empty() ? default_units(tree, options.zero->blocks) : options.zero->units;
    dp.zero.units = unit_params(tree, units);
  }
  model->overlap_sync_param_ = stage > 0 && options.zero && options.zero->overlap_sync_param;
  if (options.zero) model->allgather_bucket_mb_ = options.zero->allgather_bucket_size;
  //    Every parameter is replicated over the context ranks too: gradients are synced (and ZeRO
  //    shards) over data x context.
  model->data_parallel_ = DataParallel::attach(tree, model->mesh_->group("data_context"), dp);
  model->note_flat_slots();
  //    ZeRO-3 keeps 1/z of each bucket's parameters and frees the rest: each unit is gathered when
  //    its forward (or backward) needs it. Under a pipeline a stage's units stay gathered over its
  //    micro-batches unless reshard_after_forward asks otherwise.
  if (stage == 3) {
    FsdpOptions f;
    f.reshard_after_forward = options.zero->reshard_after_forward.value_or(!model->pipeline_);
    f.prefetch = options.zero->prefetch;
    model->fsdp_ = Fsdp::attach(tree, model->data_parallel_, units, f, [&deferred](const torch::Tensor& p) {
      auto it = deferred.find(p.storage().unsafeGetStorageImpl());
      return it == deferred.end() ? torch::Tensor() : it->second();
    });
  }
  // 6. Activation checkpointing last: it wraps the blocks' forwards as every parallelism above
  //    left them (their layers split, their gradients hooked), and changes no parameter.
  //    A pipeline runs its stages' blocks one by one: it checkpoints each itself.
  if (options.recompute.mode == "block") {
    if (model->pipeline_) model->pipeline_->set_recompute(true);
    else recompute_blocks(tree, options.recompute.blocks);
  }
  //    The policy's probe forwards routed tokens too: the MoE blocks' counts start from here.
  for (auto& [path, block] : moe_blocks(tree)) block->take_stats();
  // 7. Only once everything succeeded does the tree know its owner.
  tree.set_parallel_owner(model);
  for (auto& [path, m] : tree.modules()) m->set_parallel_tree(model);
  auto& all = models();
  all.erase(std::remove_if(all.begin(), all.end(), [](const auto& w) { return w.expired(); }), all.end());
  all.push_back(model);
  return model;
}

ParallelModel::~ParallelModel() { --live_; }

std::vector<std::weak_ptr<ParallelModel>>& ParallelModel::models() {
  static std::vector<std::weak_ptr<ParallelModel>> all;
  return all;
}

std::vector<std::shared_ptr<ParallelModel>> ParallelModel::alive() {
  std::vector<std::shared_ptr<ParallelModel>> out;
  for (const auto& w : models())
    if (auto m = w.lock()) out.push_back(std::move(m));
  return out;
}

std::shared_ptr<ParallelModel> ParallelModel::owner(const torch::Tensor& param, std::string* name) {
  if (!param.defined()) return nullptr;
  for (const auto& w : models())
    if (auto model = w.lock())
      for (const auto& r : model->records_)
        if (r.param.defined() && r.param.unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) {
          if (name) *name = r.name;
          return model;
        }
  return nullptr;
}

std::shared_ptr<ParallelModel> ParallelModel::owner(const std::vector<torch::Tensor>& params,
                                                    const std::string& what) {
  // Every live model's parameters by tensor, once: a lookup a parameter, not a scan.
  std::unordered_map<const c10::TensorImpl*, std::pair<std::shared_ptr<ParallelModel>, const std::string*>> index;
  for (const auto& w : models())
    if (auto model = w.lock())
      for (const auto& r : model->records_)
        if (r.param.defined()) index.emplace(r.param.unsafeGetTensorImpl(), std::make_pair(model, &r.name));
  auto owner_of = [&](const torch::Tensor& param, std::string* name) -> std::shared_ptr<ParallelModel> {
    auto it = param.defined() ? index.find(param.unsafeGetTensorImpl()) : index.end();
    if (it == index.end()) return nullptr;
    if (name) *name = *it->second.second;
    return it->second.first;
  };
  std::shared_ptr<ParallelModel> found;
  size_t first = 0;  // the position of found's first parameter
  std::string first_name;
  for (size_t i = 0; i < params.size(); ++i) {
    std::string name;
    auto model = owner_of(params[i], &name);
    if (!model || found == model) continue;
    TORCH_CHECK(!found, what, ": the parameters #", first + 1, " ('", first_name, "') and #", i + 1, " ('", name,
                "') belong to two parallelized models: one optimizer (or clipping) a model");
    found = model;
    first = i;
    first_name = name;
  }
  if (!found) return nullptr;
  for (size_t i = 0; i < params.size(); ++i)
    TORCH_CHECK(!params[i].defined() || owner_of(params[i], nullptr) == found, what, ": parameter #", i + 1, " of the table is "
                "not one of the parallelized model's (#", first + 1, " '", first_name, "' is): its gradient would not "
                "be synced over the model's ranks; list the model's parameters only, or make the optimizer from the "
                "model");
  return found;
}

void ParallelModel::note_flat_slots() {
  if (!data_parallel_) return;
  const auto& params = data_parallel_->params();
  for (auto& r : records_)
    for (size_t k = 0; k < params.size(); ++k)
      if (params[k].is_same(r.param)) {
        auto [buffer, offset] = data_parallel_->flat_slot(k);
        r.flat_buffer = static_cast<int64_t>(buffer);
        r.flat_offset = offset;
      }
}

const ParameterRecord* ParallelModel::record(const std::string& name) const {
  for (const auto& r : records_) {
    if (r.name == name) return &r;
    for (const auto& alias : r.aliases)
      if (alias == name) return &r;
  }
  return nullptr;
}

void ParallelModel::set_master(const torch::Tensor& param, const torch::Tensor& master) {
  for (auto& r : records_)
    if (r.param.is_same(param)) r.master = master;
}

// ---- The training step -----------------------------------------------------------------------

torch::Tensor ParallelModel::loss(const torch::Tensor& output, const torch::Tensor& targets,
                                  const TrainStepOptions& options, const std::string& reduction) const {
  if (options.loss == "cross_entropy") {
    if (auto* head = vocab_head_of(*root_)) {
      // (..., V/t) logits of this rank's vocabulary columns: the loss without gathering them.
      TORCH_CHECK(output.dim() >= 1 && output.size(-1) == head->out / head->group->size(), "train_step: the model's "
                  "output ", output.sizes(), " is not its vocabulary head's split logits (..., ",
                  head->out / head->group->size(), ")");
      return vocab_parallel_cross_entropy(output, targets, head->group, head->logical_out, options.ignore_index,
                                          reduction);
    }
    // On a device, where the batch check (check_batch: the model families, chains of built-in
    // layers) read the targets this step, the loss does not stop the stream again each
    // micro-batch. A model it could not check (a Lua module, a replaced forward) and the CPU,
    // where the read costs little, check here.
    const bool check_ids = targets.is_cpu() || !targets_checked_;
    // The serial loss takes (N, C) and (N): flatten leading dimensions as a language model has them.
    if (output.dim() > 2 && targets.dim() == output.dim() - 1)
      return nn::cross_entropy(output.reshape({-1, output.size(-1)}), targets.reshape({-1}), options.ignore_index,
                               reduction, check_ids);
    return nn::cross_entropy(output, targets, options.ignore_index, reduction, check_ids);
  }
  check_loss(options.loss);
  if (auto* head = vocab_head_of(*root_)) {
    // Split logits: each rank holds its vocabulary columns. mse compares the whole (..., V) with
    // the targets, as the serial model does (each rank's slice alone gave each rank its own loss).
    auto whole = gather_from_tensor_region(output, head->group);
    return nn::mse(whole.narrow(-1, 0, head->logical_out), targets, reduction);
  }
  return nn::mse(output, targets, reduction);
}

torch::Tensor ParallelModel::counted(const torch::Tensor& y, const TrainStepOptions& options, bool refused,
                                     bool& any_refused) const {
  auto f64 = y.options().dtype(torch::kFloat64);
  if (!y.is_meta()) f64 = f64.device(dist::World::instance().device());
  auto count = refused                            ? torch::zeros({}, f64)
               : options.loss == "cross_entropy" ? y.ne(options.ignore_index).sum().to(f64)
                                                 : torch::full({}, static_cast<double>(y.numel()), f64);
  any_refused = refused;
  const auto& group = data_parallel_ ? data_parallel_->group() : nullptr;
  if (!group || group->size() == 1) return count;
  auto both = torch::stack({count, torch::full({}, refused ? 1.0 : 0.0, f64)});
  group->all_reduce(both);
  if (!both.is_meta() && !group->planned()) any_refused = both[1].item<double>() > 0;
  return both[0];
}

torch::Tensor ParallelModel::train_step(const torch::Tensor& x, const torch::Tensor& y,
                                        const TrainStepOptions& options) {
  util::startup_mark_once("first train_step");
  TORCH_CHECK(x.defined() && y.defined(), "train_step: the inputs and targets must be tensors");
  // A replica's ranks must hold the same batch (compared first, so that every check below refuses
  // on all of them or on none); then what the first stage's forward or the last stage's loss
  // would refuse is refused on each of them: they refuse together, before anything is sent.
  if (pipeline_) pipeline_->check_runnable();  // its group may hold a failed step's messages
  if (mesh_) {
    agree_on_batch(mesh_->group("tensor"), x, y, "the tensor-parallel ranks of this model",
                   "each computes its part of every layer from the same batch");
    agree_on_batch(mesh_->group("pipeline"), x, y, "the ranks of this pipeline",
                   "the first stage reads the inputs and the last the targets");
  }
  const int n = options.accumulate;
  TORCH_CHECK(n >= 1, "train_step: accumulate must be >= 1, got ", n);
  if (n > 1 && data_parallel_)
    TORCH_CHECK(data_parallel_->options().grad_accumulation == 1, "train_step: accumulate=", n,
                " and parallelize's grad_accumulation=", data_parallel_->options().grad_accumulation,
                " both split the batch: use one of them");
  check_loss(options.loss);  // before any work
  if (data_parallel_) data_parallel_->check_accumulation();
  // The step trains (dropout on) and leaves the model in the mode it found it in: a model put in
  // eval() for evaluation between steps stays so.
  struct RestoreMode {
    nn::Module& m;
    bool training;
    ~RestoreMode() { m.train(training); }
  } mode{*root_, root_->is_training()};
  if (pipeline_)
    TORCH_CHECK(n == 1, "train_step: accumulate=", n, " on a pipeline: its micro-batches are parallelize's "
                "microbatches=", pipeline_->options().microbatches);
  // What this rank's batch makes it refuse: the replica's ranks hold the same batch (agreed
  // above) and refuse it together; the other data replicas learn of it from the count's
  // all-reduce below and refuse the step too, instead of waiting in the gradient sync.
  std::exception_ptr refused;
  try {
    TORCH_CHECK(x.dim() >= 1 && y.dim() >= 1 && x.size(0) == y.size(0), "train_step: the inputs and targets must be "
                "batches of the same size, got ", x.sizes(), " and ", y.sizes());
    TORCH_CHECK(x.size(0) % n == 0, "train_step: accumulate=", n, " does not divide the batch of ", x.size(0));
    if (pipeline_) {
      const int m = pipeline_->options().microbatches;
      TORCH_CHECK(x.size(0) % m == 0, "train_step: microbatches=", m, " does not divide the batch of ", x.size(0));
    }
    targets_checked_ = root_->check_batch(x, y, options.loss, options.ignore_index);
  } catch (...) {
    refused = std::current_exception();
  }
  bool any_refused = false;
  auto count = counted(y, options, refused != nullptr, any_refused);
  if (refused) std::rethrow_exception(refused);
  TORCH_CHECK(!any_refused, "train_step: another data-parallel replica's batch was refused (its ranks say why); no "
              "replica ran this step, so they stay in step");
  sync_params();  // overlap_sync_param: the last step's parameters, before the forward reads them
  auto scaler = loss_scaler();
  const double scale = scaler ? scaler->scale() : 1.0;  // loss scaling: backward from loss x scale
  // The router losses of MoE blocks: each micro-batch's weighs 1 / micro-batches, scaled alike.
  RouterLossWeight router_losses(scale / (pipeline_ ? pipeline_->options().microbatches : n));
  // Serial training's loss is the mean over the global batch's counted targets (cross-entropy's
  // not ignore_index; every element for mse). Micro-batches and data ranks may hold different
  // counts (padding), so their own means must not weigh alike: each backward starts from its
  // micro-batch's loss summed over its targets, times data / count (count over the global
  // batch), and the data-parallel mean of the gradients is then serial training's gradient.
  // Nothing counted at all: the loss is NaN and the gradients zero, as serial training's.
  const double data = data_parallel_ ? static_cast<double>(data_parallel_->group()->size()) : 1.0;
  // The sync leaves data parallelism's gradient counts to the loss's all-reduce below; leaving,
  // the passes are the sync's again (a pipeline's or the micro-batches' below set them).
  DataParallel::StepScope scope(data_parallel_.get());
  auto weight = count.clamp_min(1).reciprocal().mul_(data);
  // The sum over this rank's micro-batches, then over the data ranks: the global batch's mean.
  auto global_mean = [&](torch::Tensor sum, torch::ScalarType dtype) {
    if (data > 1) {
      // The loss's all-reduce carries data parallelism's gradient counts for the sync this step
      // made (DataParallel::settle_unused): no collective of their own.
      const bool counts = data_parallel_->unsettled();
      sum = sum.reshape({1}).to(torch::kFloat64);
      if (counts) sum = torch::cat({sum, data_parallel_->used_counts().to(sum.device())});
      sum = sum.contiguous();
      data_parallel_->group()->all_reduce(sum);
      if (counts) data_parallel_->settle_unused(sum.narrow(0, 1, sum.numel() - 1));
      sum = sum.narrow(0, 0, 1).squeeze(0);
    }
    return (sum / count.to(sum.device())).to(dtype);
  };
  if (pipeline_) {
    // ZeRO-3: the stage's units stay gathered over the step's micro-batches (unless
    // reshard_after_forward was asked for), freed at its end however it ends.
    Fsdp::StepHold hold(fsdp_.get());
    auto sum = pipeline_->train_step(
        x, y, [&](const torch::Tensor& out, const torch::Tensor& t) { return loss(out, t, options, "sum"); }, weight,
        data_parallel_.get(), scale, fsdp_.get());
    return global_mean(sum, pipeline_->loss_dtype());
  }
  root_->train();
  auto xs = x.chunk(n, 0), ys = y.chunk(n, 0);
  const int context = mesh_ ? mesh_->size("context") : 1;
  torch::Tensor total;
  auto dtype = torch::kFloat32;  // the loss's
  events::train_step_begins();  // the tracer (--trace) records its forwards, backwards and sync
  for (int i = 0; i < n; ++i) {
    // Only the last micro-batch's backward syncs: the others accumulate into .grad locally.
    if (data_parallel_) data_parallel_->next_pass({i == n - 1});
    events::forward_begins();
    torch::Tensor l;
    {
      TraceSpan span(TraceKind::Forward, i);
      const auto attended = context_attention_calls();
      auto out = root_->forward(std::vector<torch::Tensor>{xs[i]});
      // Every context rank runs the same forward: all of them refuse here, before any backward.
      TORCH_CHECK(context == 1 || context_attention_calls() > attended, "train_step: the mesh splits each sequence "
                  "over context=", context, ", but ", root_->type(), "'s forward computed no context attention: "
                  "its attention saw this rank's rows of the sequence alone (a module written in Lua calls "
                  "pt.cp.attention)");
      l = loss(out, ys[i], options, "sum");
    }
    events::forward_ends();
    {
      TraceSpan span(TraceKind::Backward, i);
      auto from = l * weight.to(l.device(), l.scalar_type());
      (scale != 1.0 ? from * scale : from).backward();
    }
    // ZeRO-2 reduces every micro-batch: a pass that backward left to this thread ends here.
    if (data_parallel_) data_parallel_->complete();
    auto sum = l.detach().to(torch::kFloat64);
    total = total.defined() ? total + sum : sum;
    dtype = l.scalar_type();
  }
  if (data_parallel_) {
    TraceSpan span(TraceKind::Sync);
    data_parallel_->complete();  // a sync deferred to this thread (thread-bound hooks)
  }
  events::train_step_ends("rank " + std::to_string(dist::World::instance().rank()));
  return global_mean(total, dtype);
}

}  // namespace partrain::parallel
