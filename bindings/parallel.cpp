// Parallelisms in Lua: the engine half of pt.parallelize (the parallelized model a module
// becomes, which answers model:mesh(), model:policy(), model:data_parallel(), model:train_step()
// and its parameter records), the data-parallel handle, and pt.tp, the tensor-parallel building
// blocks the policy sharder composes.
#include <cmath>
#include <sstream>
#include <unordered_map>

#include "bindings/lua.hpp"
#include "engine/dist/mesh.hpp"
#include "engine/parallel/context_parallel.hpp"
#include "engine/parallel/data_parallel.hpp"
#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/recompute.hpp"
#include "engine/parallel/probe.hpp"
#include "engine/nn/functional.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/util/text.hpp"

namespace partrain::lua {

using dist::GroupPtr;
using MeshPtr = std::shared_ptr<dist::Mesh>;
using DataParallelPtr = std::shared_ptr<parallel::DataParallel>;
using ProbePtr = std::shared_ptr<parallel::ProbeRecord>;
using ParallelModelPtr = std::shared_ptr<parallel::ParallelModel>;

#define PT_DP_MT "partrain.DataParallel"
#define PT_PROBE_MT "partrain.ProbeRecord"

namespace {

GroupPtr& group(const Args& a, int i) { return ud_check<GroupPtr>(a, i, PT_GROUP_MT, "process group"); }
DataParallelPtr& data_parallel(const Args& a, int i) {
  return ud_check<DataParallelPtr>(a, i, PT_DP_MT, "data-parallel handle");
}
int push_group(const Args& a, const GroupPtr& g) { return lua::push_group(a.L, g); }

// The model pt.parallelize made last, while it lives (the REPL's helpers show it).
std::weak_ptr<parallel::ParallelModel>& last_parallelized() {
  static std::weak_ptr<parallel::ParallelModel> last;
  return last;
}

// A size in MiB from options: a finite number > 0 (infinity would be cast to a byte count
// undefined). A huge one is one bucket of everything.
double mib(Options& o, const char* key, double fallback, const char* what) {
  const double x = o.number(key, fallback);
  if (!(x > 0) || !std::isfinite(x)) {
    std::ostringstream s;
    s << what << key << " must be a finite number > 0 (MiB), got " << x;
    throw std::invalid_argument(util::unsigned_nan(s.str()));
  }
  return x;
}

// The parallelized model the module at i is the root of, or nullptr.
ParallelModelPtr owner_of(const Args& a, int i) { return parallel::ParallelModel::of(*a.module(i)); }
// The same, or an error saying the model was not parallelized.
ParallelModelPtr owner(const Args& a, int i) {
  auto pm = owner_of(a, i);
  if (!pm) a.fail(i, "a model made parallel by pt.parallelize expected, got a " + a.module(i)->type() + " that is not");
  return pm;
}

// Pushes a model that pt.parallelize made: its module userdata, which holds the parallelized
// model alive as long as Lua holds it.
void push_parallel_model(lua_State* L, const ParallelModelPtr& pm) {
  push_module(L, pm->root());
  auto* ud = ud_test<nn::ModulePtr>(L, -1, PT_MODULE_MT);
  if (ud && ud->get() == pm->root().get()) *ud = nn::ModulePtr(pm, pm->root().get());
}

// { dim, shape, local_shape, parts, fused, padded, group, slices = { [r + 1] = { {start, length}... } }
//   [, inner_dim, inner_group] }
int push_sharding(lua_State* L, const parallel::Sharding& s) {
  lua_createtable(L, 0, 8);
  lua_pushnumber(L, double(s.dim)); lua_setfield(L, -2, "dim");
  push_ints(L, s.shape); lua_setfield(L, -2, "shape");
  push_ints(L, s.local_shape()); lua_setfield(L, -2, "local_shape");
  push_ints(L, s.parts); lua_setfield(L, -2, "parts");
  bool equal = std::all_of(s.parts.begin(), s.parts.end(), [&](int64_t p) { return p == s.parts.front(); });
  if (equal) { lua_pushnumber(L, double(s.parts.size())); lua_setfield(L, -2, "fused"); }
  lua_pushnumber(L, double(s.padded)); lua_setfield(L, -2, "padded");
  lua::push_group(L, s.group); lua_setfield(L, -2, "group");
  if (s.inner_dim >= 0) {  // split both ways (experts x tensor): each part split again over inner_group
    lua_pushnumber(L, double(s.inner_dim)); lua_setfield(L, -2, "inner_dim");
    lua::push_group(L, s.inner_group); lua_setfield(L, -2, "inner_group");
  }
  lua_createtable(L, s.ranks, 0);
  for (int r = 0; r < s.ranks; ++r) {
    auto slices = s.slices(r);
    lua_createtable(L, static_cast<int>(slices.size()), 0);
    for (size_t i = 0; i < slices.size(); ++i) {
      push_ints(L, std::vector<int64_t>{slices[i].first, slices[i].second});
      lua_rawseti(L, -2, static_cast<int>(i + 1));
    }
    lua_rawseti(L, -2, r + 1);
  }
  lua_setfield(L, -2, "slices");
  return 1;
}

// How the parameter `name` of the module at 1 is split (nil when whole); an unknown name is an error.
c10::optional<parallel::Sharding> sharding_at(const Args& a, int model, int name_idx) {
  auto& m = a.module(model);
  auto name = a.string(name_idx);
  auto params = m->named_parameters(/*recurse=*/true);
  if (!params.contains(name)) a.fail(name_idx, "'" + name + "' is not a parameter of this " + m->type());
  return parallel::sharding_of(*m, name);
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

const Function kDataParallelMethods[] = {
    // Lua hooks are bound to this thread: autograd may run on its own threads (CUDA).
    {"set_pre_hook", [](Args& a) { data_parallel(a, 1)->set_pre_hook(lua_hook(a.L, 2), true); return a.ret(); }},
    {"set_post_hook", [](Args& a) { data_parallel(a, 1)->set_post_hook(lua_hook(a.L, 2), true); return a.ret(); }},
    {"synced", [](Args& a) { return a.ret(data_parallel(a, 1)->synced()); }},
    {"buckets", [](Args& a) { return a.ret(double(data_parallel(a, 1)->buckets().size())); }},
    // handle:bucket_bytes(): a table a bucket, in bucket order: { bytes (its padded length in the
    // gradient dtype), whole (all-reduced whole under ZeRO-2: a tie across pipeline stages) }.
    {"bucket_bytes", [](Args& a) {
       const auto& dp = data_parallel(a, 1);
       const auto& buckets = dp->buckets();
       lua_createtable(a.L, static_cast<int>(buckets.size()), 0);
       for (size_t i = 0; i < buckets.size(); ++i) {
         const auto& b = buckets[i];
         lua_createtable(a.L, 0, 2);
         const auto element = c10::elementSize(c10::typeMetaToScalarType(dp->buffer_options()[b.buffer].dtype()));
         lua_pushnumber(a.L, double(b.padded * static_cast<int64_t>(element))); lua_setfield(a.L, -2, "bytes");
         lua_pushboolean(a.L, b.whole); lua_setfield(a.L, -2, "whole");
         lua_rawseti(a.L, -2, static_cast<int>(i + 1));
       }
       return 1; }},
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
// The context group of an options table's `group` field at argument i (required).
GroupPtr context_group(Options& o, const Args& a, int i, const char* what) {
  if (!o.push("group")) a.fail(i, std::string(what) + ": needs { group = mesh:group(\"context\") }");
  auto* g = ud_test<GroupPtr>(a.L, -1, PT_GROUP_MT);
  if (!g) a.fail(i, std::string(what) + ": group must be a process group, got a " + luaL_typename(a.L, -1));
  lua_pop(a.L, 1);
  return *g;
}

// pt.cp: context parallelism's attention and layout, for models written in Lua.
const Function kContextParallel[] = {
    {"attention", [](Args& a) {  // attention(q, k, v, { group, mode = "ring", causal = true, scale })
       Options o(a, 4, "pt.cp.attention");
       parallel::ContextAttentionOptions c;
       c.group = context_group(o, a, 4, "pt.cp.attention");
       try {
         c.mode = parallel::parse_context_mode(o.string("mode", "ring"));
       } catch (const c10::Error& e) {
         a.fail(4, e.what_without_backtrace());
       }
       c.causal = o.boolean("causal", true);
       if (o.has("scale")) c.scale = o.number("scale", 1.0);
       if (o.has("dropout") && o.number("dropout", 0.0) != 0)
         a.fail(4, "pt.cp.attention: dropout on the attention weights is not supported under context parallelism "
                   "(its mask would have to be drawn for the whole sequence); drop the residual branch instead");
       o.finish();
       return a.ret(parallel::context_attention(a.tensor(1), a.tensor(2), a.tensor(3), c)); }},
    {"positions", [](Args& a) {  // positions(local, group) -> the global positions of this rank's rows
       const int64_t local = a.integer(1);
       if (local < 0) a.fail(1, "pt.cp.positions: a count of positions >= 0, got " + std::to_string(local));
       return a.ret(parallel::context_positions(local, group(a, 2)).to(dist::World::instance().device())); }},
    {"split", [](Args& a) {  // split(t, group [, dim = 1]) -> this rank's rows along dim (0-based, as narrow's)
       auto& t = a.tensor(1);
       const int64_t dim = a.integer(3, 1);
       if (dim < -t.dim() || dim >= t.dim())
         a.fail(3, "pt.cp.split: dimension " + std::to_string(dim) + " of a tensor of " + std::to_string(t.dim()) +
                       " dimensions");
       return a.ret(parallel::split_context(t, group(a, 2), dim)); }},
    {"dropout", [](Args& a) {  // dropout(x, p, training, group): x (B, rows, ...) this rank's rows
       return a.ret(parallel::sequence_dropout(a.tensor(1), a.number(2), a.boolean(3), group(a, 4), 1, 0)); }},
    {"zigzag", [](Args& a) {  // zigzag(length, c, r) -> positions (0-based) context rank r (0-based) holds
       const int64_t c = a.integer(2), r = a.integer(3);
       if (c < 1 || c > 1 << 20) a.fail(2, "pt.cp.zigzag: context size must be >= 1, got " + std::to_string(c));
       if (r < 0 || r >= c) a.fail(3, "pt.cp.zigzag: rank must be in 0.." + std::to_string(c - 1) + ", got " + std::to_string(r));
       return a.ret(parallel::zigzag_index(a.integer(1), static_cast<int>(c), static_cast<int>(r))); }},
    {nullptr, nullptr}};

const Function kTensorParallel[] = {
    {"column", [](Args& a) {  // column(linear, group [, { fused = 1 | parts = {...}, gather_output = false }])
       Options o(a, 3, "column");
       int64_t fused = o.integer("fused", 1);
       std::vector<int64_t> parts = o.has("parts") ? o.ints("parts", {}) : std::vector<int64_t>{};
       bool gather = o.boolean("gather_output", false);
       bool sequence = o.boolean("sequence_parallel", false);
       bool overlap = o.boolean("sequence_overlap", false);
       bool pad = o.boolean("pad", false);
       o.finish();
       if (overlap && !sequence) a.fail(3, "sequence_overlap needs sequence_parallel");
       if (!parts.empty() && fused != 1) a.fail(3, "give fused or parts, not both");
       auto& serial = layer<nn::Linear>(a, 1, "Linear");
       auto column = parts.empty()
           ? std::make_shared<parallel::ColumnParallelLinear>(serial, group(a, 2), fused, gather, sequence, pad)
           : std::make_shared<parallel::ColumnParallelLinear>(serial, group(a, 2), parts, gather, sequence, pad);
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
    {"layer_norm", [](Args& a) {  // layer_norm(ln or rms, group [, { sequence_parallel = false, fused = true }])
       Options o(a, 3, "layer_norm");
       bool sequence = o.boolean("sequence_parallel", false);
       bool fused = o.boolean("fused", true);
       o.finish();
       if (auto* rms = dynamic_cast<nn::RMSNorm*>(a.module(1).get()))
         return a.ret(nn::ModulePtr(std::make_shared<parallel::ParallelLayerNorm>(*rms, group(a, 2), sequence)));
       return a.ret(nn::ModulePtr(std::make_shared<parallel::ParallelLayerNorm>(
           layer<nn::LayerNorm>(a, 1, "LayerNorm or RMSNorm"), group(a, 2), sequence, fused))); }},
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
    {"_probe", [](Args& a) {  // _probe(model, { inputs... } [, { reference, slice } [, serial]]): a probe record
       parallel::ProbeOptions options;                // (see engine/parallel/probe.hpp)
       if (!a.none(3)) {
         Options o(a, 3, "_probe");
         options.reference = o.boolean("reference", false);
         options.slice = o.string("slice", "");
         o.finish();
       }
       auto* serial = a.none(4) ? nullptr : ud_test<ProbePtr>(a.L, 4, PT_PROBE_MT);
       if (!a.none(4) && !serial) a.expected(4, "probe record");
       auto record = parallel::run_probe(*a.module(1), a.tensors(2), options, serial ? serial->get() : nullptr);
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
    {"_repeated_blocks", [](Args& a) { return a.ret(parallel::repeated_blocks(*a.module(1))); }},
    {"_probe_input", [](Args& a) {  // _probe_input(shape, high (0: floats), dtype, device)
       return a.ret(parallel::probe_input(a.ints(1), a.integer(2), parse_dtype(a.string(3)), torch::Device(a.string(4)))); }},
    {"copy_to", [](Args& a) { return a.ret(parallel::copy_to_tensor_region(a.tensor(1), group(a, 2))); }},
    {"reduce_from", [](Args& a) { return a.ret(parallel::reduce_from_tensor_region(a.tensor(1), group(a, 2))); }},
    {"gather_from", [](Args& a) { return a.ret(parallel::gather_from_tensor_region(a.tensor(1), group(a, 2))); }},
    {"scatter_to", [](Args& a) { return a.ret(parallel::scatter_to_tensor_region(a.tensor(1), group(a, 2))); }},
    {"gather_sequence", [](Args& a) { return a.ret(parallel::gather_sequence(a.tensor(1), group(a, 2))); }},
    {"reduce_scatter_sequence", [](Args& a) { return a.ret(parallel::reduce_scatter_sequence(a.tensor(1), group(a, 2))); }},
    {"split_sequence", [](Args& a) { return a.ret(parallel::split_sequence(a.tensor(1), group(a, 2))); }},
    {"dropout", [](Args& a) {  // dropout(x, p, training, group [, dim = 1]): this rank's part of the whole mask
       auto g = group(a, 4);
       return a.ret(nn::dropout_part(a.tensor(1), a.number(2), a.boolean(3, true), a.integer(5, 1), g->size(), g->rank())); }},
    {"shard", [](Args& a) {  // shard(t, dim, rank, parts)
       return a.ret(parallel::shard(a.tensor(1), a.integer(2), a.int32(3),
                                    a.int32(4), "shard")); }},
    {nullptr, nullptr}};


// The data-parallel and ZeRO options of pt.parallelize (unknown keys are an error; `also` names
// the options the Lua layer took, listed with these in the error).
void data_parallel_options(const Args& a, int idx, const std::vector<std::string>& also,
                           parallel::ParallelizeOptions& out) {
  Options o(a, idx, "parallelize");
  o.also(also);
  parallel::DataParallelOptions d;
  d.bucket_cap_mb = mib(o, "bucket_cap_mb", d.bucket_cap_mb, "parallelize: ");
  d.reduce = dist::parse_reduce_op(o.string("reduce", "mean"));
  d.grad_accumulation = o.int32("grad_accumulation", d.grad_accumulation);
  d.broadcast_buffers = o.boolean("broadcast_buffers", d.broadcast_buffers);
  if (o.has("reduce_dtype")) {
    auto name = o.string("reduce_dtype", "");
    if (name != "float32" && name != "bfloat16" && name != "float64")
      throw std::invalid_argument("parallelize option 'reduce_dtype' must be 'float32', 'bfloat16' or 'float64', got '" +
                                  name + "'");
    d.reduce_dtype = parse_dtype(name);
  }
  if (o.has("zero")) {
    Options z = o.table("zero");
    parallel::ZeroOptions zero;
    zero.stage = z.int32("stage", 1);  // checked with the rest by ZeroOptions::validate
    if (z.has("reduce_bucket_size")) zero.reduce_bucket_size = mib(z, "reduce_bucket_size", 0, "zero: ");
    zero.overlap_sync_param = z.boolean("overlap_sync_param", zero.overlap_sync_param);
    if (z.has("overlap_comm")) zero.overlap_comm = z.boolean("overlap_comm", false);
    zero.allgather_bucket_size = mib(z, "allgather_bucket_size", zero.allgather_bucket_size, "zero: ");
    zero.reduce_scatter = z.boolean("reduce_scatter", zero.reduce_scatter);
    if (z.has("reshard_after_forward")) zero.reshard_after_forward = z.boolean("reshard_after_forward", true);
    zero.prefetch = z.int32("prefetch", zero.prefetch);
    zero.units = z.strings("units", {});
    zero.blocks = z.string("blocks", "");
    z.finish();
    out.zero = zero;
  }
  // context = "ring" | "all_to_all": how attention splits over the mesh's context group.
  if (o.has("context")) out.context = parallel::parse_context_mode(o.string("context", "ring"));
  o.finish();
  out.data_parallel = d;
}

// The strings of the array at the top of the stack.
std::vector<std::string> string_list(lua_State* L, const char* what) {
  if (!lua_istable(L, -1)) throw std::invalid_argument(std::string("pipeline: ") + what + " must be a list of names");
  std::vector<std::string> out;
  for (int i = 1;; ++i) {
    lua_rawgeti(L, -1, i);
    if (lua_isnil(L, -1)) { lua_pop(L, 1); break; }
    if (lua_type(L, -1) != LUA_TSTRING) throw std::invalid_argument(std::string("pipeline: ") + what + " must be a list of names");
    out.emplace_back(lua_tostring(L, -1));
    lua_pop(L, 1);
  }
  refuse_stray_key(L, -1, static_cast<int>(out.size()), std::string("pipeline: ") + what + " must be a list of names");
  return out;
}

// The pipeline description init.lua's pt.parallelize makes from the policy and the options: the
// policy's blocks, first and last, the balance, and the lowered plan: one flat list a rank of
// (op, mb, chunk, peer) quadruples (peer -1 for compute), and the check's bubble and peaks a rank.
c10::optional<parallel::PipelineOptions> pipeline_options(const Args& a, int idx) {
  if (a.none(idx)) return c10::nullopt;
  Options o(a, idx, "pipeline");
  parallel::PipelineOptions p;
  p.blocks = o.string("blocks", "");
  p.schedule = o.string("schedule", "");
  p.layout = o.string("layout", "interleaved");
  p.chunks = o.int32("chunks", 1);
  p.microbatches = o.int32("microbatches", 1);
  p.balance.method = o.string("balance", "uniform");
  p.balance.sizes = o.ints("sizes", {});
  p.bubble = o.number("bubble", -1);           // the pre-flight check's predictions (for the planner)
  p.peak_in_flight = o.ints("peaks", {});
  lua_State* L = a.L;
  if (o.push("sample")) {  // balance "time": checked a tensor by init.lua
    if (auto* t = ud_test<torch::Tensor>(L, -1, PT_TENSOR_MT)) p.sample = *t;
    lua_pop(L, 1);
  }
  if (o.push("first")) { p.first = string_list(L, "first"); lua_pop(L, 1); }
  if (o.push("last")) { p.last = string_list(L, "last"); lua_pop(L, 1); }
  if (!o.push("plan")) throw std::invalid_argument("pipeline: no plan");
  for (int r = 1;; ++r) {
    lua_rawgeti(L, -1, r);
    if (lua_isnil(L, -1)) { lua_pop(L, 1); break; }
    std::vector<parallel::PipeAction> list;
    for (int i = 1;; i += 4) {
      lua_rawgeti(L, -1, i);
      if (lua_isnil(L, -1)) { lua_pop(L, 1); break; }
      if (lua_type(L, -1) != LUA_TSTRING) throw std::invalid_argument("pipeline: a plan's action must start with its op");
      parallel::PipeAction action;
      action.op = parallel::parse_pipe_op(lua_tostring(L, -1));
      lua_pop(L, 1);
      int* fields[] = {&action.mb, &action.chunk, &action.peer};
      for (int k = 0; k < 3; ++k) {
        lua_rawgeti(L, -1, i + 1 + k);
        if (lua_type(L, -1) != LUA_TNUMBER) throw std::invalid_argument("pipeline: a plan's action needs mb, chunk, peer");
        *fields[k] = static_cast<int>(lua_tointeger(L, -1));
        lua_pop(L, 1);
      }
      list.push_back(action);
    }
    p.plan.push_back(std::move(list));
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  o.finish();
  return p;
}

// model:train_step's options.
parallel::TrainStepOptions train_step_options(const Args& a, int idx) {
  Options o(a, idx, "train_step");
  parallel::TrainStepOptions t;
  t.loss = o.string("loss", t.loss);
  t.accumulate = o.int32("accumulate", t.accumulate);
  if (o.has("ignore_index") && t.loss != "cross_entropy")
    a.fail(idx, "train_step: ignore_index is what cross_entropy skips; loss '" + t.loss + "' counts every element");
  t.ignore_index = o.integer("ignore_index", t.ignore_index);
  o.finish();
  return t;
}

const Function kParallel[] = {
    {"parallelize", [](Args& a) {  // parallelize(model, mesh, policy name|nil, dp options, apply|nil, pipeline|nil,
                                   //             names of the options Lua took|nil, recompute blocks|nil): model
       auto root = a.module(1);
       auto* mesh = mesh_test(a.L, 2);
       if (!mesh) a.expected(2, "mesh");
       parallel::ParallelizeOptions options;
       options.policy = a.string(3, "");
       std::vector<std::string> also;
       if (!a.none(7)) {
         lua_pushvalue(a.L, 7);
         also = string_list(a.L, "the options taken in Lua");
         lua_pop(a.L, 1);
       }
       data_parallel_options(a, 4, also, options);
       options.pipeline = pipeline_options(a, 6);
       if (!a.none(8)) options.recompute = {"block", a.string(8)};  // activation checkpointing, each block
       if (!a.none(5)) {
         if (lua_type(a.L, 5) != LUA_TFUNCTION) a.expected(5, "function");
         lua_State* L = a.L;
         options.tensor_parallel = [L](nn::Module&, const dist::Mesh&) {  // the Lua sharder, on this thread
           lua_pushvalue(L, 5);
           std::string error;
           if (!pcall(L, 0, 0, &error)) throw Rethrow(error);
         };
       }
       auto pm = parallel::ParallelModel::parallelize(root, *mesh, std::move(options));
       last_parallelized() = pm;
       // The script's model object now holds its parallelized model: dropping it frees both.
       a.module(1) = nn::ModulePtr(pm, pm->root().get());
       lua_pushvalue(a.L, 1);
       return 1; }},
    {"mesh", [](Args& a) {  // mesh(model): the mesh it was made parallel over, or nil
       auto pm = owner_of(a, 1);
       if (!pm) { lua_pushnil(a.L); return 1; }
       ud_push(a.L, pm->mesh(), PT_MESH_MT);
       return 1; }},
    {"policy", [](Args& a) {  // policy(model): the name of the policy applied, or nil
       auto pm = owner_of(a, 1);
       if (!pm || pm->policy().empty()) { lua_pushnil(a.L); return 1; }
       return a.ret(pm->policy()); }},
    {"data_parallel", [](Args& a) {  // data_parallel(model): its data-parallel handle, or nil
       auto pm = owner_of(a, 1);
       if (!pm || !pm->data_parallel()) { lua_pushnil(a.L); return 1; }
       ud_push(a.L, pm->data_parallel(), PT_DP_MT);
       return 1; }},
    {"train_step", [](Args& a) {  // train_step(model, x, y [, { loss, accumulate, ignore_index }]): loss
       auto pm = owner(a, 1);
       auto options = train_step_options(a, 4);
       return a.ret(pm->train_step(a.tensor(2), a.tensor(3), options)); }},
    {"records", [](Args& a) {  // records(model): one table a parameter (see docs/parallel.md)
       auto pm = owner_of(a, 1);
       auto records = pm ? pm->records() : parallel::parameter_records(*a.module(1));
       lua_createtable(a.L, static_cast<int>(records.size()), 0);
       for (size_t i = 0; i < records.size(); ++i) {
         const auto& r = records[i];
         lua_createtable(a.L, 0, 8);
         a.ret(r.name); lua_setfield(a.L, -2, "name");
         lua_createtable(a.L, static_cast<int>(r.aliases.size()), 0);
         for (size_t k = 0; k < r.aliases.size(); ++k) { a.ret(r.aliases[k]); lua_rawseti(a.L, -2, static_cast<int>(k + 1)); }
         lua_setfield(a.L, -2, "aliases");
         push_ints(a.L, r.shape); lua_setfield(a.L, -2, "shape");
         push_ints(a.L, r.param.sizes()); lua_setfield(a.L, -2, "local_shape");
         if (r.sharding) { push_sharding(a.L, *r.sharding); lua_setfield(a.L, -2, "sharding"); }
         a.ret(r.device.str()); lua_setfield(a.L, -2, "device");
         a.ret(dtype_name(r.dtype)); lua_setfield(a.L, -2, "dtype");
         a.ret(r.trainable); lua_setfield(a.L, -2, "trainable");
         if (r.master.defined()) { a.ret(dtype_name(r.master.scalar_type())); lua_setfield(a.L, -2, "master_dtype"); }
         lua_rawseti(a.L, -2, static_cast<int>(i + 1));
       }
       return 1; }},
    {"sharding", [](Args& a) {  // sharding(model, name): nil for a whole parameter, else how it is split
       auto s = sharding_at(a, 1, 2);
       if (!s) { lua_pushnil(a.L); return 1; }
       return push_sharding(a.L, *s); }},
    {"gather", [](Args& a) {  // gather(model, name [, t]): the logical tensor of the parameter (or of t laid out like it)
       auto s = sharding_at(a, 1, 2);
       auto param = a.module(1)->named_parameters(/*recurse=*/true)[a.string(2)];
       if (a.none(3)) {
         // Under ZeRO-3 the parameter's values exist while its unit is gathered: gathered for the
         // read (over the zero group, as the gather is over the tensor group), and a copy returned,
         // which outlives it (its freed storage had been all-gathered: SIGSEGV).
         auto pm = a.module(1)->parallel_tree();
         auto fsdp = pm ? pm->fsdp() : nullptr;
         parallel::Fsdp::Access access(fsdp, /*writeback=*/false);
         access.touch(param);
         auto whole = s ? parallel::gather_full(param, *s) : param;
         return a.ret(fsdp ? whole.detach().clone() : whole);
       }
       const torch::Tensor& t = a.tensor(3);
       if (!t.sizes().equals(param.sizes())) a.fail(3, "a tensor shaped like the parameter expected");
       if (!s) return a.ret(t);
       return a.ret(parallel::gather_full(t, *s)); }},
    {"vocab_head", [](Args& a) {  // vocab_head(model): nil, or { group, vocab, path } of its split vocabulary head
       std::string path;
       auto* head = parallel::vocab_head_of(*a.module(1), &path);
       if (!head) { lua_pushnil(a.L); return 1; }
       lua_createtable(a.L, 0, 3);
       push_group(a, head->group); lua_setfield(a.L, -2, "group");
       lua_pushnumber(a.L, double(head->logical_out)); lua_setfield(a.L, -2, "vocab");
       a.ret(path); lua_setfield(a.L, -2, "path");
       return 1; }},
    // pipeline(model): nil without pipeline parallelism, else this rank's stages:
    // { size, rank, schedule, layout, chunks, microbatches, blocks, first, last, bounds, balance, costs,
    // stages, measured } (stages: this rank's virtual stages, by chunk; measured, after the first
    // step: its bytes by chunk, { activations, inputs, gradients, backward, pending, peak }; bounds: split_stages' block
    // boundaries; costs, under balance "time": the measured microseconds of the first part, each
    // block and the last part).
    {"pipeline", [](Args& a) {
       auto pm = owner_of(a, 1);
       if (!pm || !pm->pipeline()) { lua_pushnil(a.L); return 1; }
       const auto& p = *pm->pipeline();
       const auto& o = p.options();
       auto names = [&](const std::vector<std::string>& list) {
         lua_createtable(a.L, static_cast<int>(list.size()), 0);
         for (size_t i = 0; i < list.size(); ++i) { a.ret(list[i]); lua_rawseti(a.L, -2, static_cast<int>(i + 1)); }
       };
       lua_createtable(a.L, 0, 10);
       lua_pushinteger(a.L, p.size()); lua_setfield(a.L, -2, "size");
       lua_pushinteger(a.L, p.rank()); lua_setfield(a.L, -2, "rank");
       a.ret(o.schedule); lua_setfield(a.L, -2, "schedule");
       a.ret(o.layout); lua_setfield(a.L, -2, "layout");
       lua_pushinteger(a.L, o.chunks); lua_setfield(a.L, -2, "chunks");
       lua_pushinteger(a.L, o.microbatches); lua_setfield(a.L, -2, "microbatches");
       a.ret(o.blocks); lua_setfield(a.L, -2, "blocks");
       names(o.first); lua_setfield(a.L, -2, "first");
       names(o.last); lua_setfield(a.L, -2, "last");
       push_ints(a.L, p.bounds()); lua_setfield(a.L, -2, "bounds");
       a.ret(o.balance.method); lua_setfield(a.L, -2, "balance");
       if (!o.balance.costs.empty()) { push_ints(a.L, o.balance.costs); lua_setfield(a.L, -2, "costs"); }
       auto own = p.own_stages();
       push_ints(a.L, std::vector<int64_t>(own.begin(), own.end())); lua_setfield(a.L, -2, "stages");
       if (const auto& m = p.measured(); m.done) {  // the first step's weighing, bytes by chunk
         lua_createtable(a.L, 0, 6);
         push_ints(a.L, m.activations); lua_setfield(a.L, -2, "activations");
         push_ints(a.L, m.inputs); lua_setfield(a.L, -2, "inputs");
         push_ints(a.L, m.gradients); lua_setfield(a.L, -2, "gradients");
         push_ints(a.L, m.backward); lua_setfield(a.L, -2, "backward");
         push_ints(a.L, m.pending); lua_setfield(a.L, -2, "pending");
         lua_pushnumber(a.L, static_cast<double>(m.peak)); lua_setfield(a.L, -2, "peak");
         lua_setfield(a.L, -2, "measured");
       }
       return 1; }},
    // zero3(model): nil below ZeRO-3, else { group (the zero group's global ranks), rank (this
    // rank's place in it), units = { { name, buffers = { { numel (padded to the group), bytes,
    // dtype, params = { { name, offset, numel }, ... } }, ... } }, ... } }: the flat buffer of
    // each bucket a unit gathers, as its parameters lie in it; zero rank r keeps elements
    // [r * numel / size, (r + 1) * numel / size) of each. Unit 1 is the root unit.
    {"zero3", [](Args& a) {
       auto pm = owner_of(a, 1);
       if (!pm || !pm->fsdp() || !pm->data_parallel()) { lua_pushnil(a.L); return 1; }
       const auto& f = *pm->fsdp();
       const auto& dp = *pm->data_parallel();
       const auto& group = dp.options().zero.group;
       std::unordered_map<const c10::TensorImpl*, std::string> names;  // a tied tensor by its first name
       for (const auto& item : pm->module().named_parameters(/*recurse=*/true))
         names.emplace(item.value().unsafeGetTensorImpl(), item.key());
       lua_createtable(a.L, 0, 3);
       push_ints(a.L, std::vector<int64_t>(group->ranks().begin(), group->ranks().end()));
       lua_setfield(a.L, -2, "group");
       lua_pushinteger(a.L, group->rank()); lua_setfield(a.L, -2, "rank");
       lua_createtable(a.L, static_cast<int>(f.units()), 0);
       for (size_t u = 0; u < f.units(); ++u) {
         lua_createtable(a.L, 0, 2);
         a.ret(f.unit_name(u)); lua_setfield(a.L, -2, "name");
         lua_newtable(a.L);
         int n = 0;
         for (size_t i = 0; i < dp.buckets().size(); ++i) {
           if (f.unit_of_bucket(i) != static_cast<int>(u)) continue;
           const auto& b = dp.buckets()[i];
           const auto& first = dp.params()[b.params.front()];
           lua_createtable(a.L, 0, 4);
           lua_pushnumber(a.L, double(b.padded)); lua_setfield(a.L, -2, "numel");
           lua_pushnumber(a.L, double(b.padded * static_cast<int64_t>(first.element_size())));
           lua_setfield(a.L, -2, "bytes");
           a.ret(std::string(c10::toString(first.scalar_type()))); lua_setfield(a.L, -2, "dtype");
           lua_createtable(a.L, static_cast<int>(b.params.size()), 0);
           for (size_t slot = 0; slot < b.params.size(); ++slot) {
             const auto& p = dp.params()[b.params[slot]];
             auto it = names.find(p.unsafeGetTensorImpl());
             lua_createtable(a.L, 0, 3);
             a.ret(it == names.end() ? std::string("?") : it->second); lua_setfield(a.L, -2, "name");
             lua_pushnumber(a.L, double(b.offsets[slot])); lua_setfield(a.L, -2, "offset");
             lua_pushnumber(a.L, double(p.numel())); lua_setfield(a.L, -2, "numel");
             lua_rawseti(a.L, -2, static_cast<int>(slot + 1));
           }
           lua_setfield(a.L, -2, "params");
           lua_rawseti(a.L, -2, ++n);
         }
         lua_setfield(a.L, -2, "buffers");
         lua_rawseti(a.L, -2, static_cast<int>(u + 1));
       }
       lua_setfield(a.L, -2, "units");
       return 1; }},
    {"live", [](Args& a) { return a.ret(double(parallel::ParallelModel::live())); }},
    {"last", [](Args& a) {  // last(): the model pt.parallelize made last, while it lives, or nil
       auto pm = last_parallelized().lock();
       if (!pm) { lua_pushnil(a.L); return 1; }
       push_parallel_model(a.L, pm);
       return 1; }},
    {nullptr, nullptr}};

}  // namespace

void open_parallel(lua_State* L, int core) {
  new_metatable<DataParallelPtr>(L, PT_DP_MT, kDataParallelMethods, /*keep=*/false);
  new_metatable<ProbePtr>(L, PT_PROBE_MT);  // opaque: no methods
  lua_pop(L, 1);
  set_library(L, core, "tp", kTensorParallel);
  set_library(L, core, "cp", kContextParallel);
  set_library(L, core, "parallel", kParallel);
}

}  // namespace partrain::lua
