// The planner's hooks and a run's check against a saved plan in Lua (core.plan, used by
// partrain/plan.lua at the first optimizer step).
#include "bindings/lua.hpp"
#include "engine/dist/world.hpp"
#include "engine/optim/optim.hpp"
#include "engine/plan/plan.hpp"

namespace partrain::lua {

namespace {

dist::World& world() {
  auto& w = dist::World::instance();
  if (!w.initialized()) w.init(dist::world_options_from_env());
  return w;
}

// The table of optimizers at 2 (or nothing).
std::vector<const optim::Optimizer*> optimizers_at(const Args& a) {
  std::vector<const optim::Optimizer*> optimizers;
  if (!a.none(2)) {
    if (!a.is_table(2)) a.expected(2, "table of optimizers");
    for (int i = 1;; ++i) {
      lua_rawgeti(a.L, 2, i);
      if (lua_isnil(a.L, -1)) { lua_pop(a.L, 1); break; }
      auto* o = ud_test<std::shared_ptr<optim::Optimizer>>(a.L, -1, PT_OPTIMIZER_MT);
      lua_pop(a.L, 1);
      if (!o) a.fail(2, "table of optimizers expected");
      optimizers.push_back(o->get());
    }
    a.list_only(2, static_cast<int>(optimizers.size()), "optimizers");
  }
  return optimizers;
}

// The model, its optimizers (a table) and its mesh (or nil) at 1, 2, 3, as this rank's plan.
plan::RankPlan rank_plan(const Args& a, const dist::Mesh** mesh_out) {
  auto& model = a.module(1);
  const auto optimizers = optimizers_at(a);
  const dist::Mesh* m = a.none(3) ? nullptr : mesh_at(a.L, 3);
  if (!a.none(3) && !m) a.expected(3, "mesh");
  *mesh_out = m;
  return plan::describe(world().rank(), *model, optimizers, m);
}

const Function kPlan[] = {
    {"planning", [](Args& a) { return a.ret(plan::planning()); }},
    {"record", [](Args& a) {  // record(model, optimizers, mesh|nil): this virtual rank's plan
       const dist::Mesh* m = nullptr;
       auto r = rank_plan(a, &m);
       plan::record(std::move(r), plan::layout_of(m));
       return a.ret(); }},
    {"check", [](Args& a) {  // check(model, optimizers, mesh|nil, path, mode) -> what it did
       const dist::Mesh* m = nullptr;
       auto r = rank_plan(a, &m);
       return a.ret(plan::check(r, plan::layout_of(m), a.string(4), a.string(5))); }},
    // held(model, optimizers) -> { params, grads, scratch, optimizer, master, zero_stage, zero_group,
    // param_shard, gathered, peak_gathered, largest_unit, root_unit, pooled } (the last six ZeRO-3's,
    // 0 below; pooled: freed gather buffers kept for the next gathers, beside params)
    {"held", [](Args& a) {
       auto h = plan::held(*a.module(1), optimizers_at(a));
       lua_createtable(a.L, 0, 12);
       lua_pushnumber(a.L, double(h.params)); lua_setfield(a.L, -2, "params");
       lua_pushnumber(a.L, double(h.grads)); lua_setfield(a.L, -2, "grads");
       lua_pushnumber(a.L, double(h.scratch)); lua_setfield(a.L, -2, "scratch");
       lua_pushnumber(a.L, double(h.optimizer)); lua_setfield(a.L, -2, "optimizer");
       lua_pushnumber(a.L, double(h.master)); lua_setfield(a.L, -2, "master");
       lua_pushnumber(a.L, h.zero_stage); lua_setfield(a.L, -2, "zero_stage");
       lua_pushnumber(a.L, h.zero_group); lua_setfield(a.L, -2, "zero_group");
       lua_pushnumber(a.L, double(h.param_shard)); lua_setfield(a.L, -2, "param_shard");
       lua_pushnumber(a.L, double(h.gathered)); lua_setfield(a.L, -2, "gathered");
       lua_pushnumber(a.L, double(h.peak_gathered)); lua_setfield(a.L, -2, "peak_gathered");
       lua_pushnumber(a.L, double(h.largest_unit)); lua_setfield(a.L, -2, "largest_unit");
       lua_pushnumber(a.L, double(h.root_unit)); lua_setfield(a.L, -2, "root_unit");
       lua_pushnumber(a.L, double(h.pooled)); lua_setfield(a.L, -2, "pooled");
       return 1; }},
    {"first_step", [](Args& a) {  // { begun, forward_done, activations }
       const auto& f = plan::first_step();
       lua_createtable(a.L, 0, 3);
       lua_pushboolean(a.L, f.begun); lua_setfield(a.L, -2, "begun");
       lua_pushboolean(a.L, f.forward_done); lua_setfield(a.L, -2, "forward_done");
       if (f.activations >= 0) { lua_pushnumber(a.L, double(f.activations)); lua_setfield(a.L, -2, "activations"); }
       return 1; }},
    {nullptr, nullptr}};

}  // namespace

void open_plan(lua_State* L, int core) { set_library(L, core, "plan", kPlan); }

}  // namespace partrain::lua
