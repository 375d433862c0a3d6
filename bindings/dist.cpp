// Process groups, the mesh and data parallelism in Lua: pt.dist (this rank, the world, the
// collectives), pt.mesh { tensor = t, pipeline = p, data = d, zero = z }, and pt.parallelize.
#include <map>
#include <sstream>

#include "bindings/lua.hpp"
#include "engine/dist/mesh.hpp"
#include "engine/optim/optim.hpp"
#include "engine/parallel/data_parallel.hpp"
#include "engine/parallel/probe.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/plan/plan.hpp"

namespace partrain::lua {

using dist::GroupPtr;
using MeshPtr = std::shared_ptr<dist::Mesh>;
using WorkPtr = std::shared_ptr<dist::Work>;
using DataParallelPtr = std::shared_ptr<parallel::DataParallel>;
using ProbePtr = std::shared_ptr<parallel::ProbeRecord>;

#define PT_GROUP_MT "partrain.Group"
#define PT_WORK_MT "partrain.Work"
#define PT_MESH_MT "partrain.Mesh"
#define PT_DP_MT "partrain.DataParallel"
#define PT_PROBE_MT "partrain.ProbeRecord"

namespace {

// Which data-parallel state belongs to which model (the model object is returned unchanged).
std::map<const nn::Module*, std::weak_ptr<parallel::DataParallel>>& data_parallel_registry() {
  static std::map<const nn::Module*, std::weak_ptr<parallel::DataParallel>> registry;
  return registry;
}

template <class T>
T& check(const Args& a, int i, const char* mt, const char* what) {
  auto* p = ud_test<T>(a.L, i, mt);
  if (!p) a.expected(i, what);
  return *p;
}
GroupPtr& group(const Args& a, int i) { return check<GroupPtr>(a, i, PT_GROUP_MT, "process group"); }
MeshPtr& mesh(const Args& a, int i) { return check<MeshPtr>(a, i, PT_MESH_MT, "mesh"); }
DataParallelPtr& data_parallel(const Args& a, int i) {
  return check<DataParallelPtr>(a, i, PT_DP_MT, "data-parallel handle");
}

int push_group(const Args& a, const GroupPtr& g) {
  if (!g) { lua_pushnil(a.L); return 1; }
  ud_push(a.L, g, PT_GROUP_MT);
  return 1;
}


dist::World& world() {
  auto& w = dist::World::instance();
  if (!w.initialized()) w.init(dist::world_options_from_env());
  return w;
}

// Runs a Lua function stored in the registry as a bucket hook: fn(bucket_index, flat_grads).
parallel::DataParallel::Hook lua_hook(lua_State* L, int fn_idx) {
  auto fn = std::make_shared<LuaRef>(L, fn_idx);
  return [fn](int bucket, torch::Tensor& flat) {
    TORCH_CHECK(fn->alive(), "a reducer hook outlived its Lua state");
    lua_State* S = active_state(fn->main());
    fn->push(S);
    lua_pushnumber(S, bucket);
    push_tensor(S, flat);
    std::string error;
    if (!pcall(S, 2, 1, &error)) throw Rethrow(error);
    // A hook may return a replacement for the bucket's tensor (same shape).
    if (auto* t = ud_test<torch::Tensor>(S, -1, PT_TENSOR_MT)) {
      TORCH_CHECK(t->sizes().equals(flat.sizes()), "a reducer hook returned shape ", t->sizes(),
                  " for a bucket of shape ", flat.sizes());
      if (!t->is_same(flat)) flat.copy_(*t);
    }
    lua_pop(S, 1);
  };
}

// Reads { async = bool } at idx.
bool async_option(const Args& a, int idx, const char* what) {
  Options o(a, idx, what);
  bool async = o.boolean("async", false);
  o.finish();
  return async;
}

// Returns a Work handle for async calls, else the argument at `result` (0: nothing).
int finish(const Args& a, const dist::Work& w, bool async, int result) {
  if (async) {
    ud_push(a.L, std::make_shared<dist::Work>(w), PT_WORK_MT);
    return 1;
  }
  if (result == 0) return 0;
  lua_pushvalue(a.L, result);
  return 1;
}

const Function kGroupMethods[] = {
    {"rank", [](Args& a) { return a.ret(double(group(a, 1)->rank())); }},
    {"size", [](Args& a) { return a.ret(double(group(a, 1)->size())); }},
    {"ranks", [](Args& a) { return push_ints(a.L, group(a, 1)->ranks()); }},
    {"name", [](Args& a) { return a.ret(group(a, 1)->name()); }},
    {"all_reduce", [](Args& a) {  // all_reduce(t [, op = "sum"] [, { async = false }])
       auto op = dist::parse_reduce_op(a.is_string(3) ? a.string(3) : "sum");
       bool async = async_option(a, a.is_string(3) ? 4 : 3, "all_reduce");
       return finish(a, group(a, 1)->all_reduce(a.tensor(2), op, async), async, 2); }},
    {"broadcast", [](Args& a) {  // broadcast(t [, root = 0] [, { async = false }])
       int root = a.is_number(3) ? static_cast<int>(a.integer(3)) : 0;
       bool async = async_option(a, a.is_number(3) ? 4 : 3, "broadcast");
       return finish(a, group(a, 1)->broadcast(a.tensor(2), root, async), async, 2); }},
    {"all_gather", [](Args& a) {  // all_gather(t [, { async = false }]): parts [, work]
       bool async = async_option(a, 3, "all_gather");
       std::vector<torch::Tensor> parts;
       auto w = group(a, 1)->all_gather(a.tensor(2), parts, async);
       a.ret(parts);
       if (!async) return 1;
       ud_push(a.L, std::make_shared<dist::Work>(w), PT_WORK_MT);
       return 2; }},
    {"reduce_scatter", [](Args& a) {  // reduce_scatter(output, { inputs... } [, op] [, { async }])
       auto op = dist::parse_reduce_op(a.is_string(4) ? a.string(4) : "sum");
       bool async = async_option(a, a.is_string(4) ? 5 : 4, "reduce_scatter");
       return finish(a, group(a, 1)->reduce_scatter(a.tensor(2), a.tensors(3), op, async), async, 2); }},
    {"send", [](Args& a) {
       bool async = async_option(a, 4, "send");
       return finish(a, group(a, 1)->send(a.tensor(2), static_cast<int>(a.integer(3)), async), async, 0); }},
    {"recv", [](Args& a) {
       bool async = async_option(a, 4, "recv");
       return finish(a, group(a, 1)->recv(a.tensor(2), static_cast<int>(a.integer(3)), async), async, 2); }},
    {"barrier", [](Args& a) {
       bool async = async_option(a, 2, "barrier");
       return finish(a, group(a, 1)->barrier(async), async, 0); }},
    {"traffic", [](Args& a) {  // { [op] = { calls =, bytes = } } since creation or reset_traffic
       auto traffic = group(a, 1)->traffic();
       lua_createtable(a.L, 0, static_cast<int>(traffic.size()));
       for (const auto& [op, t] : traffic) {
         lua_createtable(a.L, 0, 2);
         lua_pushnumber(a.L, double(t.calls)); lua_setfield(a.L, -2, "calls");
         lua_pushnumber(a.L, double(t.bytes)); lua_setfield(a.L, -2, "bytes");
         lua_setfield(a.L, -2, op.c_str());
       }
       return 1; }},
    {"reset_traffic", [](Args& a) { group(a, 1)->reset_traffic(); return a.ret(); }},
    {"__tostring", [](Args& a) { return a.ret(group(a, 1)->describe()); }},
    {nullptr, nullptr}};

const Function kWorkMethods[] = {
    {"wait", [](Args& a) { check<WorkPtr>(a, 1, PT_WORK_MT, "work")->wait(); return a.ret(); }},
    {"done", [](Args& a) { return a.ret(check<WorkPtr>(a, 1, PT_WORK_MT, "work")->done()); }},
    {nullptr, nullptr}};

const Function kMeshMethods[] = {
    {"rank", [](Args& a) { return a.ret(double(mesh(a, 1)->rank())); }},
    {"size", [](Args& a) { return a.ret(double(mesh(a, 1)->size(a.string(2)))); }},
    {"group", [](Args& a) { return push_group(a, mesh(a, 1)->group(a.string(2))); }},
    {"coord", [](Args& a) {
       const auto& c = mesh(a, 1)->coord();
       lua_createtable(a.L, 0, 3);
       lua_pushnumber(a.L, c.tensor); lua_setfield(a.L, -2, "tensor");
       lua_pushnumber(a.L, c.data); lua_setfield(a.L, -2, "data");
       lua_pushnumber(a.L, c.pipeline); lua_setfield(a.L, -2, "pipeline");
       return 1; }},
    {"ranks", [](Args& a) {  // ranks(kind [, rank]): members of that rank's group of kind
       auto& m = mesh(a, 1);
       return push_ints(a.L, m->layout().group_of(a.string(2), static_cast<int>(a.integer(3, m->rank())))); }},
    {"__tostring", [](Args& a) { return a.ret(mesh(a, 1)->describe()); }},
    {nullptr, nullptr}};

const Function kDataParallelMethods[] = {
    {"set_pre_hook", [](Args& a) { data_parallel(a, 1)->set_pre_hook(lua_hook(a.L, 2)); return a.ret(); }},
    {"set_post_hook", [](Args& a) { data_parallel(a, 1)->set_post_hook(lua_hook(a.L, 2)); return a.ret(); }},
    {"synced", [](Args& a) { return a.ret(data_parallel(a, 1)->synced()); }},
    {"buckets", [](Args& a) { return a.ret(double(data_parallel(a, 1)->buckets().size())); }},
    {"stats", [](Args& a) {
       const auto& s = data_parallel(a, 1)->stats();
       lua_createtable(a.L, 0, 5);
       lua_pushnumber(a.L, double(s.syncs)); lua_setfield(a.L, -2, "syncs");
       lua_pushnumber(a.L, double(s.bytes)); lua_setfield(a.L, -2, "bytes");
       lua_pushnumber(a.L, s.sync_seconds); lua_setfield(a.L, -2, "sync_seconds");
       lua_pushnumber(a.L, s.exposed_seconds); lua_setfield(a.L, -2, "exposed_seconds");
       lua_pushnumber(a.L, double(s.buckets_done_early)); lua_setfield(a.L, -2, "buckets_done_early");
       lua_pushnumber(a.L, s.last_sync_seconds); lua_setfield(a.L, -2, "last_sync_seconds");
       lua_pushnumber(a.L, s.last_exposed_seconds); lua_setfield(a.L, -2, "last_exposed_seconds");
       return 1; }},
    {"reset_stats", [](Args& a) { data_parallel(a, 1)->reset_stats(); return a.ret(); }},
    {nullptr, nullptr}};

template <class T>
T& layer(const Args& a, int i, const char* what) {
  auto* m = dynamic_cast<T*>(a.module(i).get());
  if (!m) a.fail(i, std::string(what) + " expected, got " + a.module(i)->type());
  return *m;
}

// The tensor-parallel building blocks; the policy sharder composes them.
const Function kTensorParallel[] = {
    {"column", [](Args& a) {  // column(linear, group [, { fused = 1, gather_output = false }])
       Options o(a, 3, "column");
       int64_t fused = o.integer("fused", 1);
       bool gather = o.boolean("gather_output", false);
       bool sequence = o.boolean("sequence_parallel", false);
       bool overlap = o.boolean("sequence_overlap", false);
       bool pad = o.boolean("pad", false);
       o.finish();
       if (overlap && !sequence) a.fail(3, "sequence_overlap needs sequence_parallel");
       auto column = std::make_shared<parallel::ColumnParallelLinear>(layer<nn::Linear>(a, 1, "Linear"), group(a, 2),
                                                                      fused, gather, sequence, pad);
       column->sequence_overlap = overlap;
       return a.ret(nn::ModulePtr(column)); }},
    {"row", [](Args& a) {  // row(linear, group [, { input_is_parallel = true }])
       Options o(a, 3, "row");
       bool parallel_input = o.boolean("input_is_parallel", true);
       bool sequence = o.boolean("sequence_parallel", false);
       o.finish();
       return a.ret(nn::ModulePtr(std::make_shared<parallel::RowParallelLinear>(
           layer<nn::Linear>(a, 1, "Linear"), group(a, 2), parallel_input, sequence))); }},
    {"vocab_embedding", [](Args& a) {
       return a.ret(nn::ModulePtr(std::make_shared<parallel::VocabParallelEmbedding>(
           layer<nn::Embedding>(a, 1, "Embedding"), group(a, 2)))); }},
    {"layer_norm", [](Args& a) {  // layer_norm(ln, group [, { sequence_parallel = false, fused = true }])
       Options o(a, 3, "layer_norm");
       bool sequence = o.boolean("sequence_parallel", false);
       bool fused = o.boolean("fused", true);
       o.finish();
       return a.ret(nn::ModulePtr(std::make_shared<parallel::ParallelLayerNorm>(
           layer<nn::LayerNorm>(a, 1, "LayerNorm"), group(a, 2), sequence, fused))); }},
    {"cross_entropy", [](Args& a) {  // cross_entropy(local_logits, targets, group, vocab [, { ignore_index }])
       Options o(a, 5, "cross_entropy");
       int64_t ignore = o.integer("ignore_index", -100);
       o.finish();
       return a.ret(parallel::vocab_parallel_cross_entropy(a.tensor(1), a.tensor(2), group(a, 3), a.integer(4), ignore)); }},
    {"split_logits", [](Args& a) {  // split_logits(t): nil, or { group, vocab, padded, local }
       auto s = parallel::split_logits_of(a.tensor(1));
       if (!s) { lua_pushnil(a.L); return 1; }
       lua_createtable(a.L, 0, 4);
       push_group(a, s->group); lua_setfield(a.L, -2, "group");
       lua_pushnumber(a.L, double(s->vocab)); lua_setfield(a.L, -2, "vocab");
       lua_pushnumber(a.L, double(s->padded)); lua_setfield(a.L, -2, "padded");
       lua_pushnumber(a.L, double(s->local)); lua_setfield(a.L, -2, "local");
       return 1; }},
    {"gather_logits", [](Args& a) {  // gather_logits(t): whole logits from vocabulary-split ones (a collective)
       auto& t = a.tensor(1);
       auto s = parallel::split_logits_of(t);
       if (!s) return a.ret(t);  // whole already
       return a.ret(parallel::gather_split_logits(t, *s)); }},
    {"_align", [](Args& a) {  // _align(model, group): group rank 0's weights everywhere; whether they differed
       return a.ret(parallel::align_to_first_rank(*a.module(1), group(a, 2))); }},
    {"_probe", [](Args& a) {  // _probe(model, { inputs... }): a probe record (see engine/parallel/probe.hpp)
       auto record = parallel::run_probe(*a.module(1), a.tensors(2));
       ud_push(a.L, std::make_shared<parallel::ProbeRecord>(std::move(record)), PT_PROBE_MT);
       return 1; }},
    {"_probe_compare", [](Args& a) {  // _probe_compare(serial, sharded, vocab_head): nil, or what differs
       auto* serial = ud_test<ProbePtr>(a.L, 1, PT_PROBE_MT);
       auto* sharded = ud_test<ProbePtr>(a.L, 2, PT_PROBE_MT);
       if (!serial) a.expected(1, "probe record");
       if (!sharded) a.expected(2, "probe record");
       auto d = parallel::compare_probes(**serial, **sharded, a.boolean(3, false));
       if (d.empty()) { lua_pushnil(a.L); return 1; }
       return a.ret(d); }},
    {"_probe_input", [](Args& a) {  // _probe_input(shape, high (0: floats), dtype, device)
       return a.ret(parallel::probe_input(a.ints(1), a.integer(2), parse_dtype(a.string(3)), torch::Device(a.string(4)))); }},
    {"copy_to", [](Args& a) { return a.ret(parallel::copy_to_tensor_region(a.tensor(1), group(a, 2))); }},
    {"reduce_from", [](Args& a) { return a.ret(parallel::reduce_from_tensor_region(a.tensor(1), group(a, 2))); }},
    {"gather_from", [](Args& a) { return a.ret(parallel::gather_from_tensor_region(a.tensor(1), group(a, 2))); }},
    {"scatter_to", [](Args& a) { return a.ret(parallel::scatter_to_tensor_region(a.tensor(1), group(a, 2))); }},
    {"gather_sequence", [](Args& a) { return a.ret(parallel::gather_sequence(a.tensor(1), group(a, 2))); }},
    {"reduce_scatter_sequence", [](Args& a) { return a.ret(parallel::reduce_scatter_sequence(a.tensor(1), group(a, 2))); }},
    {"split_sequence", [](Args& a) { return a.ret(parallel::split_sequence(a.tensor(1), group(a, 2))); }},
    {"is_sharded", [](Args& a) { return a.ret(parallel::sharded_over(a.tensor(1)) != nullptr); }},
    {"_gather_full", [](Args& a) {  // _gather_full(p, t): t (laid out like p) at its logical shape
       auto s = parallel::sharding_of(a.tensor(1));
       if (!s) a.fail(1, "split parameter expected");
       auto& t = a.tensor(2);
       if (!t.sizes().equals(a.tensor(1).sizes())) a.fail(2, "a tensor shaped like the parameter expected");
       return a.ret(parallel::gather_full(t, *s)); }},
    {"sharding", [](Args& a) {  // sharding(p): nil for a whole parameter, else how it is split
       auto s = parallel::sharding_of(a.tensor(1));
       if (!s) { lua_pushnil(a.L); return 1; }
       lua_createtable(a.L, 0, 8);
       lua_pushnumber(a.L, double(s->dim)); lua_setfield(a.L, -2, "dim");
       push_ints(a.L, s->shape); lua_setfield(a.L, -2, "shape");
       push_ints(a.L, s->local_shape()); lua_setfield(a.L, -2, "local_shape");
       lua_pushnumber(a.L, double(s->fused)); lua_setfield(a.L, -2, "fused");
       lua_pushnumber(a.L, double(s->padded)); lua_setfield(a.L, -2, "padded");
       push_group(a, s->group); lua_setfield(a.L, -2, "group");
       // slices[r + 1] = { {start, length}, ... } of the logical dim, for group rank r
       lua_createtable(a.L, s->group->size(), 0);
       for (int r = 0; r < s->group->size(); ++r) {
         auto slices = s->slices(r);
         lua_createtable(a.L, static_cast<int>(slices.size()), 0);
         for (size_t i = 0; i < slices.size(); ++i) {
           push_ints(a.L, std::vector<int64_t>{slices[i].first, slices[i].second});
           lua_rawseti(a.L, -2, static_cast<int>(i + 1));
         }
         lua_rawseti(a.L, -2, r + 1);
       }
       lua_setfield(a.L, -2, "slices");
       return 1; }},
    {"shard", [](Args& a) {  // shard(t, dim, rank, parts)
       return a.ret(parallel::shard(a.tensor(1), a.integer(2), static_cast<int>(a.integer(3)),
                                    static_cast<int>(a.integer(4)), "shard")); }},
    {nullptr, nullptr}};

const Function kDist[] = {
    {"rank", [](Args& a) { return a.ret(double(world().rank())); }},
    {"world_size", [](Args& a) { return a.ret(double(world().size())); }},
    {"local_rank", [](Args& a) { return a.ret(double(world().options().local_rank)); }},
    {"local_world_size", [](Args& a) { return a.ret(double(world().options().local_world_size)); }},
    {"world", [](Args& a) { return push_group(a, world().world()); }},
    {"barrier", [](Args& a) { world().world()->barrier(); return a.ret(); }},
    {"check_collectives", [](Args& a) {  // check_collectives([on]) -> whether it was on
       bool was = dist::check_collectives();
       if (!a.none(1)) dist::set_check_collectives(a.boolean(1));
       return a.ret(was); }},
    {"_first_error", [](Args& a) {  // _first_error(message or ""): the lowest rank's non-empty message, or nil
       auto all = dist::all_gather_strings(world().world(), a.string(1));
       for (size_t r = 0; r < all.size(); ++r)
         if (!all[r].empty()) {
           a.ret(all[r]);
           lua_pushnumber(a.L, double(r));
           return 2;
         }
       lua_pushnil(a.L);
       return 1; }},
    {"mesh", [](Args& a) {
       Options o(a, 1, "mesh");
       dist::MeshOptions m;
       m.tensor = static_cast<int>(o.integer("tensor", m.tensor));
       m.pipeline = static_cast<int>(o.integer("pipeline", m.pipeline));
       m.data = static_cast<int>(o.integer("data", m.data));
       m.zero = static_cast<int>(o.integer("zero", m.zero));
       o.finish();
       ud_push(a.L, std::make_shared<dist::Mesh>(m, world()), PT_MESH_MT);
       return 1; }},
    {"data_parallel", [](Args& a) {  // data_parallel(model, mesh, opts): attaches DP, returns its handle
       auto& model = a.module(1);
       auto& m = mesh(a, 2);
       Options o(a, 3, "parallelize");
       parallel::DataParallelOptions d;
       d.bucket_cap_mb = o.number("bucket_cap_mb", d.bucket_cap_mb);
       d.reduce = dist::parse_reduce_op(o.string("reduce", "mean"));
       d.grad_accumulation = static_cast<int>(o.integer("grad_accumulation", d.grad_accumulation));
       d.broadcast_buffers = o.boolean("broadcast_buffers", d.broadcast_buffers);
       o.finish();
       auto& registry = data_parallel_registry();
       auto existing = registry.find(model.get());
       if (existing != registry.end() && !existing->second.expired())
         throw std::invalid_argument("this " + model->type() + " is already data-parallel");
       auto dp = parallel::DataParallel::attach(*model, m->group("data"), d);
       registry[model.get()] = dp;
       ud_push(a.L, dp, PT_DP_MT);
       return 1; }},
    {nullptr, nullptr}};

}  // namespace

std::shared_ptr<parallel::DataParallel> data_parallel_of(const nn::Module* model) {
  auto& registry = data_parallel_registry();
  auto it = registry.find(model);
  return it == registry.end() ? nullptr : it->second.lock();
}

const dist::Mesh* mesh_at(lua_State* L, int idx) {
  auto* m = ud_test<MeshPtr>(L, idx, PT_MESH_MT);
  return m ? m->get() : nullptr;
}

bool mesh_data_shard(lua_State* L, int idx, int64_t* rank, int64_t* count) {
  auto* m = ud_test<MeshPtr>(L, idx, PT_MESH_MT);
  if (!m) return false;
  *rank = (*m)->coord().data;
  *count = (*m)->layout().data;
  return true;
}

namespace {

// The user's script line running now on this thread, if a partrain function is running on it.
std::string lua_call_site() {
  lua_State* L = active_state(nullptr);
  return L ? user_location(L) : std::string();
}

}  // namespace

void open_dist(lua_State* L, int core) {
  dist::set_call_site_provider(lua_call_site);
  new_metatable<GroupPtr>(L, PT_GROUP_MT, kGroupMethods, /*keep=*/false);
  new_metatable<WorkPtr>(L, PT_WORK_MT, kWorkMethods, /*keep=*/false);
  new_metatable<MeshPtr>(L, PT_MESH_MT, kMeshMethods, /*keep=*/false);
  new_metatable<DataParallelPtr>(L, PT_DP_MT, kDataParallelMethods, /*keep=*/false);
  new_metatable<ProbePtr>(L, PT_PROBE_MT);  // opaque: no methods
  lua_pop(L, 1);
  set_library(L, core, "dist", kDist);
  set_library(L, core, "tp", kTensorParallel);
}

}  // namespace partrain::lua
