// Process groups and the mesh in Lua: pt.dist (this rank, the world, the collectives) and
// pt.mesh { tensor = t, context = c, pipeline = p, data = d, zero = z }. Parallelisms: bindings/parallel.cpp.
#include <map>
#include <sstream>

#include "bindings/lua.hpp"
#include "engine/dist/mesh.hpp"
#include "engine/optim/optim.hpp"
#include "engine/plan/plan.hpp"

namespace partrain::lua {

using dist::GroupPtr;
using MeshPtr = std::shared_ptr<dist::Mesh>;
using WorkPtr = std::shared_ptr<dist::Work>;

#define PT_WORK_MT "partrain.Work"

namespace {

GroupPtr& group(const Args& a, int i) { return ud_check<GroupPtr>(a, i, PT_GROUP_MT, "process group"); }
MeshPtr& mesh(const Args& a, int i) { return ud_check<MeshPtr>(a, i, PT_MESH_MT, "mesh"); }
int push_group(const Args& a, const GroupPtr& g) { return lua::push_group(a.L, g); }


dist::World& world() {
  auto& w = dist::World::instance();
  if (!w.initialized()) w.init(dist::world_options_from_env());
  return w;
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
       dist::AgreedCall agreed(!async);
       return finish(a, group(a, 1)->all_reduce(a.tensor(2), op, async), async, 2); }},
    {"broadcast", [](Args& a) {  // broadcast(t [, root = 0] [, { async = false }])
       int root = a.is_number(3) ? a.int32(3) : 0;
       bool async = async_option(a, a.is_number(3) ? 4 : 3, "broadcast");
       dist::AgreedCall agreed(!async);
       return finish(a, group(a, 1)->broadcast(a.tensor(2), root, async), async, 2); }},
    {"all_gather", [](Args& a) {  // all_gather(t [, { async = false }]): parts [, work]
       bool async = async_option(a, 3, "all_gather");
       dist::AgreedCall agreed(!async);
       std::vector<torch::Tensor> parts;
       auto w = group(a, 1)->all_gather(a.tensor(2), parts, async);
       a.ret(parts);
       if (!async) return 1;
       ud_push(a.L, std::make_shared<dist::Work>(w), PT_WORK_MT);
       return 2; }},
    {"reduce_scatter", [](Args& a) {  // reduce_scatter(output, { inputs... } [, op] [, { async }])
       auto op = dist::parse_reduce_op(a.is_string(4) ? a.string(4) : "sum");
       bool async = async_option(a, a.is_string(4) ? 5 : 4, "reduce_scatter");
       dist::AgreedCall agreed(!async);
       return finish(a, group(a, 1)->reduce_scatter(a.tensor(2), a.tensors(3), op, async), async, 2); }},
    // reduce_scatter_flat(flat [, op] [, { async = false }]): this rank's part (a view) [, work].
    // async: left in flight (Gloo: one all-to-all; NCCL: its own), the part holds the reduction
    // once the work is waited for.
    {"reduce_scatter_flat", [](Args& a) {
       auto op = dist::parse_reduce_op(a.is_string(3) ? a.string(3) : "sum");
       bool async = async_option(a, a.is_string(3) ? 4 : 3, "reduce_scatter_flat");
       dist::AgreedCall agreed(!async);
       auto& flat = a.tensor(2);
       if (!async) return a.ret(group(a, 1)->reduce_scatter_flat(flat, op));
       auto inbox = group(a, 1)->needs_inbox() ? torch::empty_like(flat) : torch::Tensor();
       auto w = group(a, 1)->start_reduce_scatter_flat(flat, op, inbox);
       const int64_t part = flat.numel() / group(a, 1)->size();
       a.ret(flat.narrow(0, group(a, 1)->rank() * part, part));
       ud_push(a.L, std::make_shared<dist::Work>(w), PT_WORK_MT);
       return 2; }},
    {"all_gather_flat", [](Args& a) {  // all_gather_flat(flat): in place, returns it
       dist::AgreedCall agreed;
       group(a, 1)->all_gather_flat(a.tensor(2));
       lua_pushvalue(a.L, 2);
       return 1; }},
    {"send", [](Args& a) {
       bool async = async_option(a, 4, "send");
       return finish(a, group(a, 1)->send(a.tensor(2), a.int32(3), async, /*tag=*/0, /*described=*/true), async, 0); }},
    {"recv", [](Args& a) {
       bool async = async_option(a, 4, "recv");
       return finish(a, group(a, 1)->recv(a.tensor(2), a.int32(3), async, /*tag=*/0, /*described=*/true), async, 2); }},
    // send_recv(t, dst, into, src [, tag = 0]): sends t to group rank dst while receiving into
    // `into` from group rank src (a ring step: every rank sends and receives at once), with
    // send's and recv's dtype and element count check; waits and returns `into`.
    {"send_recv", [](Args& a) {
       auto& into = a.tensor(4);
       group(a, 1)->send_recv(a.tensor(2), a.int32(3), into, a.int32(5), a.int32(6, 0), /*described=*/true).wait();
       lua_pushvalue(a.L, 4);
       return 1; }},
    // all_to_all(t): slice j of t's dim 0 to rank j; a new tensor. all_to_all(t, { n0, n1, ... }):
    // n_j rows of t to rank j (counts exchanged first); the rows that arrived, rank after rank, and
    // their counts.
    {"all_to_all", [](Args& a) {
       if (a.is_table(3)) {
         std::vector<int64_t> splits;
         const int n = static_cast<int>(lua_objlen(a.L, 3));
         for (int i = 1; i <= n; ++i) {
           lua_rawgeti(a.L, 3, i);
           if (!lua_isnumber(a.L, -1)) a.fail(3, "all_to_all: the row counts must be numbers, one a rank");
           splits.push_back(static_cast<int64_t>(lua_tonumber(a.L, -1)));
           lua_pop(a.L, 1);
         }
         a.list_only(3, n, "row counts");
         std::vector<int64_t> arrived;
         auto out = group(a, 1)->all_to_all_rows(a.tensor(2), splits, &arrived);
         a.ret(out);
         lua_createtable(a.L, static_cast<int>(arrived.size()), 0);
         for (size_t i = 0; i < arrived.size(); ++i) {
           lua_pushnumber(a.L, static_cast<double>(arrived[i]));
           lua_rawseti(a.L, -2, static_cast<int>(i + 1));
         }
         return 2;
       }
       dist::AgreedCall agreed;
       torch::Tensor out;
       group(a, 1)->all_to_all_single(out, a.tensor(2));
       return a.ret(out); }},
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
    {"wait", [](Args& a) { ud_check<WorkPtr>(a, 1, PT_WORK_MT, "work")->wait(); return a.ret(); }},
    {"done", [](Args& a) { return a.ret(ud_check<WorkPtr>(a, 1, PT_WORK_MT, "work")->done()); }},
    {nullptr, nullptr}};

const Function kMeshMethods[] = {
    {"rank", [](Args& a) { return a.ret(double(mesh(a, 1)->rank())); }},
    {"size", [](Args& a) { return a.ret(double(mesh(a, 1)->size(a.string(2)))); }},
    {"group", [](Args& a) { return push_group(a, mesh(a, 1)->group(a.string(2))); }},
    {"coord", [](Args& a) {
       const auto& c = mesh(a, 1)->coord();
       lua_createtable(a.L, 0, 5);
       lua_pushnumber(a.L, c.tensor); lua_setfield(a.L, -2, "tensor");
       lua_pushnumber(a.L, c.context); lua_setfield(a.L, -2, "context");
       lua_pushnumber(a.L, c.data); lua_setfield(a.L, -2, "data");
       lua_pushnumber(a.L, c.pipeline); lua_setfield(a.L, -2, "pipeline");
       lua_pushnumber(a.L, c.expert); lua_setfield(a.L, -2, "expert");
       return 1; }},
    {"ranks", [](Args& a) {  // ranks(kind [, rank]): members of that rank's group of kind
       auto& m = mesh(a, 1);
       return push_ints(a.L, m->layout().group_of(a.string(2), a.int32(3, m->rank()))); }},
    {"__tostring", [](Args& a) { return a.ret(mesh(a, 1)->describe()); }},
    {nullptr, nullptr}};

const Function kDist[] = {
    {"rank", [](Args& a) { return a.ret(double(world().rank())); }},
    {"world_size", [](Args& a) { return a.ret(double(world().size())); }},
    {"local_rank", [](Args& a) { return a.ret(double(world().options().local_rank)); }},
    {"local_world_size", [](Args& a) { return a.ret(double(world().options().local_world_size)); }},
    {"world", [](Args& a) { return push_group(a, world().world()); }},
    {"barrier", [](Args& a) { world().world()->barrier(); return a.ret(); }},
    // new_group(ranks [, name = "group[0,1,2]"]): a group of those global ranks, in that order;
    // nil on the ranks outside it. Every rank makes the same groups in the same order.
    {"new_group", [](Args& a) {
       if (!a.is_table(1)) a.expected(1, "table of ranks");
       std::vector<int> ranks;
       for (int64_t r : a.ints(1)) {
         if (r < 0 || r >= world().size())
           a.fail(1, "rank " + std::to_string(r) + " is outside the world of " + std::to_string(world().size()));
         ranks.push_back(static_cast<int>(r));
       }
       return push_group(a, world().new_group(a.string(2, "group[" + dist::join_ranks(ranks) + "]"), ranks)); }},
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
       m.tensor = o.int32("tensor", m.tensor);
       m.context = o.int32("context", m.context);
       m.pipeline = o.int32("pipeline", m.pipeline);
       m.data = o.int32("data", m.data);
       m.zero = o.int32("zero", m.zero);
       m.expert = o.int32("expert", m.expert);
       o.finish();
       ud_push(a.L, std::make_shared<dist::Mesh>(m, world()), PT_MESH_MT);
       return 1; }},
    {nullptr, nullptr}};

}  // namespace

int push_group(lua_State* L, const dist::GroupPtr& g) {
  if (!g) {
    lua_pushnil(L);
    return 1;
  }
  ud_push(L, g, PT_GROUP_MT);
  return 1;
}

std::shared_ptr<dist::Mesh>* mesh_test(lua_State* L, int idx) { return ud_test<MeshPtr>(L, idx, PT_MESH_MT); }

const dist::Mesh* mesh_at(lua_State* L, int idx) {
  auto* m = ud_test<MeshPtr>(L, idx, PT_MESH_MT);
  return m ? m->get() : nullptr;
}

bool mesh_data_shard(lua_State* L, int idx, int64_t* rank, int64_t* count, int64_t* context_rank,
                     int64_t* context_count) {
  auto* m = ud_test<MeshPtr>(L, idx, PT_MESH_MT);
  if (!m) return false;
  *rank = (*m)->coord().data;
  *count = (*m)->layout().data;
  if (context_rank) *context_rank = (*m)->coord().context;
  if (context_count) *context_count = (*m)->layout().context;
  return true;
}

namespace {

// The user's script line running now on this thread, if a partrain function is running on it.
void lua_call_site(char* buf, size_t n) {
  if (lua_State* L = active_state(nullptr)) user_location(L, buf, n);
}

}  // namespace

void open_dist(lua_State* L, int core) {
  dist::set_call_site_provider(lua_call_site);
  new_metatable<GroupPtr>(L, PT_GROUP_MT, kGroupMethods, /*keep=*/false);
  new_metatable<WorkPtr>(L, PT_WORK_MT, kWorkMethods, /*keep=*/false);
  new_metatable<MeshPtr>(L, PT_MESH_MT, kMeshMethods, /*keep=*/false);
  set_library(L, core, "dist", kDist);
  open_parallel(L, core);  // the parallelisms over these groups
}

}  // namespace partrain::lua
