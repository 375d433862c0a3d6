// The planner's hooks and a run's check against a saved plan in Lua (core.plan, used by
// partrain/plan.lua at the first optimizer step).
#include "bindings/plan_run.hpp"

#include <unistd.h>

#include <chrono>

#include "bindings/host.hpp"
#include "bindings/lua.hpp"
#include "engine/dist/world.hpp"
#include "engine/optim/optim.hpp"
#include "engine/parallel/pipeline.hpp"
#include "engine/plan/plan.hpp"
#include "engine/util/tensor_memory.hpp"
#include "engine/util/text.hpp"

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


// LibTorch's "Could not run 'aten::op' with arguments from the 'Meta' backend" lists every
// backend the operator has; the planner says the one thing that matters.
std::string shorten_missing_meta_kernel(const std::string& error) {
  auto at = error.find("Could not run 'aten::");
  if (at == std::string::npos || error.find("'Meta' backend", at) == std::string::npos) return error;
  auto name_end = error.find('\'', at + 13);
  std::string op = error.substr(at + 13, name_end - at - 13);
  std::string shorter = error.substr(0, at) + "the operator " + op +
                        " has no meta kernel in this LibTorch, so it cannot be planned (it runs in real runs)";
  auto trace = error.find("\nstack traceback:");
  if (trace != std::string::npos) shorter += error.substr(trace);
  return shorter;
}

// The script's options as pt.args resolved them in `host`: "name\tkind\tvalue-as-Lua" lines.
void read_options(Host& host, Planned* out) {
  std::string text, error;
  const char* code =
      "local a = package.loaded['partrain.args']; local lines = {}\n"
      "for k, kind in pairs(a and a.declared or {}) do\n"
      "  local v = a.resolved and a.resolved[k]\n"
      "  lines[#lines + 1] = k .. '\\t' .. kind .. '\\t' .. (type(v) == 'string' and ('%q'):format(v) or tostring(v))\n"
      "end\n"
      "return table.concat(lines, '\\n')";
  if (!host.eval(code, &text, &error)) return;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(at, end - at);
    auto t1 = line.find('\t'), t2 = line.find('\t', t1 == std::string::npos ? 0 : t1 + 1);
    if (t1 != std::string::npos && t2 != std::string::npos) {
      out->kinds[line.substr(0, t1)] = line.substr(t1 + 1, t2 - t1 - 1);
      out->values[line.substr(0, t1)] = line.substr(t2 + 1);
    }
    at = end + 1;
  }
}

}  // namespace

bool plan_ranks(const PlanRequest& request, Planned* out, std::string* error) {
  std::vector<int> ranks = request.ranks;
  if (ranks.empty())
    for (int r = 0; r < request.world; ++r) ranks.push_back(r);
  plan::recorded() = plan::Plan{};
  parallel::forget_planned_shapes();  // another layout's shapes are not this one's
  bool first = true;
  for (int rank : ranks) {
    std::string where = "rank " + std::to_string(rank) + " of " + std::to_string(request.world) + ": ";
    try {
      dist::WorldOptions o;
      o.rank = rank;
      o.world_size = request.world;
      o.local_rank = rank % request.nproc;
      o.local_world_size = request.nproc;
      o.planned = true;
      dist::World::instance().init(o);
      plan::reset_first_step();
      util::reset_peak(c10::kMeta);
      const int64_t base = util::memory(c10::kMeta).allocated;
      size_t before = plan::recorded().ranks.size();
      {
        Host host;
        std::string failed;
        bool ok = (request.verbose && rank == 0) ||
                  host.run_string("print = function() end; io.write = function() end", "=(plan)", &failed);
        ok = ok && host.run_file(request.script, request.args, &failed);
        if (first) read_options(host, out);
        first = false;
        if (plan::recorded().ranks.size() == before) {
          if (!ok) {
            dist::World::instance().shutdown();
            *error = where + shorten_missing_meta_kernel(failed);
            return false;
          }
          // Nothing to plan: the script, not partrain's own Lua, is what to look at.
          if (!host.run_string("require('partrain.plan').at_end()", "=(plan)", &failed)) {
            dist::World::instance().shutdown();
            *error = where + "'" + request.script + "' " + failed.substr(0, failed.find("\nstack traceback:"));
            return false;
          }
        }
        if (plan::recorded().ranks.size() > before)
          plan::recorded().ranks.back().run_peak_bytes = util::memory(c10::kMeta).peak - base;
      }
      dist::World::instance().shutdown();
    } catch (const std::exception& e) {
      if (dist::World::instance().initialized()) dist::World::instance().shutdown();
      *error = where + util::message_of(e);
      return false;
    }
  }
  out->plan = plan::recorded();
  out->plan.script = request.script;
  out->plan.nproc_per_node = request.nproc;
  return true;
}

namespace {

void set_number(lua_State* L, const char* key, double v) { lua_pushnumber(L, v); lua_setfield(L, -2, key); }
void set_string(lua_State* L, const char* key, const std::string& v) {
  lua_pushlstring(L, v.data(), v.size());
  lua_setfield(L, -2, key);
}

// A rank's plan as the layout search reads it (docs/plan.md, "Automatic layouts").
void push_rank(lua_State* L, const plan::RankPlan& r) {
  lua_createtable(L, 0, 16);
  set_number(L, "rank", r.rank);
  lua_createtable(L, 0, 5);
  set_number(L, "tensor", r.tensor);
  set_number(L, "data", r.data);
  set_number(L, "pipeline", r.pipeline);
  set_number(L, "context", r.context);
  set_number(L, "expert", r.expert);
  lua_setfield(L, -2, "coord");
  set_number(L, "param_bytes", double(r.param_bytes));
  set_number(L, "grad_bytes", double(r.grad_bytes));
  set_number(L, "optimizer_bytes", double(r.optimizer_bytes));
  set_number(L, "master_bytes", double(r.master_bytes));
  set_number(L, "model_state_bytes", double(r.model_state_bytes()));
  set_number(L, "activation_bytes", double(r.activation_bytes));
  set_number(L, "peak_bytes", double(r.peak_bytes()));
  set_number(L, "zero_stage", r.zero_stage);
  set_number(L, "zero_group", r.zero_group);
  set_number(L, "flops", r.flops);
  set_number(L, "ops", double(r.ops));
  set_number(L, "run_peak_bytes", double(r.run_peak_bytes));
  lua_createtable(L, static_cast<int>(r.collectives.size()), 0);
  for (size_t i = 0; i < r.collectives.size(); ++i) {
    const auto& c = r.collectives[i];
    lua_createtable(L, 0, 6);
    set_string(L, "group", c.group);
    set_string(L, "op", c.op);
    set_number(L, "calls", double(c.calls));
    set_number(L, "bytes", double(c.bytes));
    set_number(L, "size", c.size);
    set_number(L, "nodes", c.nodes);
    lua_rawseti(L, -2, static_cast<int>(i + 1));
  }
  lua_setfield(L, -2, "collectives");
  if (r.stage.present) {
    const auto& s = r.stage;
    lua_createtable(L, 0, 8);
    set_string(L, "schedule", s.schedule);
    set_number(L, "microbatches", s.microbatches);
    set_number(L, "stages", s.stages);
    set_number(L, "in_flight", double(s.in_flight));
    set_number(L, "activation_peak", double(s.activation_peak));
    set_number(L, "bubble", s.bubble);
    lua_createtable(L, static_cast<int>(s.chunks.size()), 0);
    for (size_t i = 0; i < s.chunks.size(); ++i) {
      const auto& c = s.chunks[i];
      lua_createtable(L, 0, 7);
      set_number(L, "stage", c.stage);
      set_number(L, "first_block", double(c.first_block));
      set_number(L, "end_block", double(c.end_block));
      set_number(L, "activation_bytes", double(c.activation_bytes));
      set_number(L, "gradient_bytes", double(c.gradient_bytes));
      set_number(L, "backward_bytes", double(c.backward_bytes));
      set_number(L, "pending_bytes", double(c.pending_bytes));
      lua_rawseti(L, -2, static_cast<int>(i + 1));
    }
    lua_setfield(L, -2, "chunks");
    lua_createtable(L, static_cast<int>(s.peers.size()), 0);
    for (size_t i = 0; i < s.peers.size(); ++i) {
      const auto& p = s.peers[i];
      lua_createtable(L, 0, 6);
      set_number(L, "peer", p.peer);
      set_number(L, "pipeline_peer", p.pipeline_peer);
      set_number(L, "sends", double(p.sends));
      set_number(L, "send_bytes", double(p.send_bytes));
      set_number(L, "recvs", double(p.recvs));
      set_number(L, "recv_bytes", double(p.recv_bytes));
      lua_rawseti(L, -2, static_cast<int>(i + 1));
    }
    lua_setfield(L, -2, "p2p");
    lua_setfield(L, -2, "stage");
  }
}

// layout { script, args, world, nproc, ranks } -> plan table, or nil and the refusal.
int plan_layout(Args& a) {
  TORCH_CHECK(plan::planning(), "core.plan.layout plans on virtual ranks: it runs under partrain plan --auto only");
  Options o(a, 1, "core.plan.layout");
  PlanRequest request;
  request.script = o.string("script", "");
  request.args = o.strings("args", {});
  request.world = o.int32("world", 1);
  request.nproc = o.int32("nproc", request.world);
  for (auto r : o.ints("ranks", {})) request.ranks.push_back(static_cast<int>(r));
  o.finish();
  TORCH_CHECK(request.world >= 1 && request.nproc >= 1 && request.world % request.nproc == 0,
              "core.plan.layout: world ", request.world, " and nproc ", request.nproc, ": nproc must divide world");
  for (int r : request.ranks)
    TORCH_CHECK(r >= 0 && r < request.world, "core.plan.layout: rank ", r, " is not in a world of ", request.world);
  Planned planned;
  std::string failed;
  auto start = std::chrono::steady_clock::now();
  if (!plan_ranks(request, &planned, &failed)) {
    lua_pushnil(a.L);
    failed = failed.substr(0, failed.find("\nstack traceback:"));
    lua_pushlstring(a.L, failed.data(), failed.size());
    return 2;
  }
  const auto& p = planned.plan;
  lua_createtable(a.L, 0, 12);
  set_number(a.L, "world", p.world);
  set_number(a.L, "nproc", p.nproc_per_node);
  set_number(a.L, "tensor", p.tensor);
  set_number(a.L, "data", p.data);
  set_number(a.L, "pipeline", p.pipeline);
  set_number(a.L, "context", p.context);
  set_number(a.L, "expert", p.expert);
  set_number(a.L, "zero", p.zero);
  set_number(a.L, "seconds", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  lua_newtable(a.L);
  for (const auto& [name, kind] : planned.kinds) set_string(a.L, name.c_str(), kind);
  lua_setfield(a.L, -2, "declared");
  lua_newtable(a.L);
  for (const auto& [name, value] : planned.values) {
    // Each value as the Lua source it was written as (a number, a boolean or a quoted string).
    if (luaL_loadstring(a.L, ("return " + value).c_str()) == 0 && lua_pcall(a.L, 0, 1, 0) == 0)
      lua_setfield(a.L, -2, name.c_str());
    else
      lua_pop(a.L, 1);
  }
  lua_setfield(a.L, -2, "options");
  lua_createtable(a.L, static_cast<int>(p.ranks.size()), 0);
  for (size_t i = 0; i < p.ranks.size(); ++i) {
    push_rank(a.L, p.ranks[i]);
    lua_rawseti(a.L, -2, static_cast<int>(i + 1));
  }
  lua_setfield(a.L, -2, "ranks");
  return 1;
}

const Function kPlan[] = {
    {"layout", plan_layout},
    {"planning", [](Args& a) { return a.ret(plan::planning()); }},
    // count() -> flops, operators: counts from now on (slowing every operator a little) and
    // returns the totals so far (partrain plan --calibrate reads a step's as the planner does)
    {"count", [](Args& a) {
       plan::count_flops();
       lua_pushnumber(a.L, plan::counted_flops());
       lua_pushnumber(a.L, double(plan::counted_ops()));
       return 2; }},
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
