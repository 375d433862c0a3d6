// Planned policies between Lua and the engine: the sharder's one layer builder (core.tp._apply_split,
// which calls parallel::apply_split) and load_policy, which plans a policy file for a C++ model and
// reads the plan into a parallel::PolicyPlan. Both read the sharder's tables with the readers here.
#include "bindings/policy_loader.hpp"

#include <stdexcept>

#include "bindings/host.hpp"
#include "bindings/lua.hpp"

namespace partrain::lua {

namespace {

// A split as the sharder gives it (sharder.lua's layer_split), at `idx`.
parallel::LayerSplit read_split(const Args& a, int idx) {
  Options o(a, idx, "a planned split");
  parallel::LayerSplit s;
  s.path = o.string("path", "");
  s.kind = o.string("kind", "");
  s.where = o.string("where", "");
  s.fused = o.integer("fused", s.fused);
  s.parts = o.ints("parts", {});
  s.gather_output = o.boolean("gather_output", s.gather_output);
  s.input_is_parallel = o.boolean("input_is_parallel", s.input_is_parallel);
  if (o.has("sequence_parallel")) s.sequence_parallel = o.boolean("sequence_parallel", false);
  o.finish();
  return s;
}

// The configuration layers are built with (sharder.lua's split_options), at `idx`.
parallel::SplitOptions read_split_options(const Args& a, int idx) {
  Options o(a, idx, "the split options");
  parallel::SplitOptions s;
  s.sequence_parallel = o.boolean("sequence_parallel", s.sequence_parallel);
  s.sequence_overlap = o.boolean("sequence_overlap", s.sequence_overlap);
  s.fused_norm = o.boolean("fused_norm", s.fused_norm);
  o.finish();
  return s;
}

// Calls read(index) for each element of the list in field `key` of the table at `idx`.
template <class Read>
void each_of(const Args& a, int idx, const char* key, Read read) {
  lua_State* L = a.L;
  lua_getfield(L, idx, key);
  if (!lua_istable(L, -1)) throw std::logic_error(std::string("a planned policy's ") + key + " is not a list");
  const int list = lua_gettop(L);
  for (int i = 1; i <= static_cast<int>(lua_objlen(L, list)); ++i) {
    lua_rawgeti(L, list, i);
    read(lua_gettop(L));
    lua_settop(L, list);
  }
  lua_pop(L, 1);
}

// The plan S.plan_file returns, at `idx`.
parallel::PolicyPlan read_plan(const Args& a, int idx) {
  parallel::PolicyPlan plan;
  Options o(a, idx, "a planned policy");
  plan.name = o.string("name", "");
  plan.where = o.string("where", "");
  each_of(a, idx, "splits", [&](int i) { plan.splits.push_back(read_split(a, i)); });
  each_of(a, idx, "attributes", [&](int i) {
    Options at(a, i, "a planned attribute");
    parallel::AttributeSetting s;
    s.module = at.string("module", "");
    s.name = at.string("name", "");
    s.value = at.number("value", 0);
    s.where = at.string("where", "");
    at.finish();
    plan.attributes.push_back(std::move(s));
  });
  each_of(a, idx, "ties", [&](int i) {
    Options t(a, i, "a planned tie");
    plan.ties.push_back({t.string("param", ""), t.string("to", "")});
    t.finish();
  });
  for (const char* key : {"splits", "attributes", "ties"}) o.has(key);  // read above
  if (o.push("options")) {
    plan.options = read_split_options(a, lua_gettop(a.L));
    lua_pop(a.L, 1);
  }
  o.finish();
  return plan;
}

const Function kPolicy[] = {
    // _apply_split(model, split, group, options): the layer at split.path replaced by its
    // parallel form (parallel::apply_split), as the sharder applies each replace entry.
    {"_apply_split", [](Args& a) {
       auto& root = a.module(1);
       auto split = read_split(a, 2);
       auto& group = ud_check<dist::GroupPtr>(a, 3, PT_GROUP_MT, "process group");
       auto options = read_split_options(a, 4);
       // An optimizer stepping the old layer's tensors would go on stepping them, not the new ones.
       if (auto old = split.path.empty() ? nullptr : root->find(split.path)) {
         auto held = held_by_optimizer(a.L, old->named_parameters(/*recurse=*/true));
         if (!held.empty())
           throw std::invalid_argument("cannot replace " + split.path + ": a live optimizer steps its parameter '" + held +
                                       "', and would go on stepping the old tensor; change the model before making "
                                       "its optimizer (or make a new optimizer after)");
       }
       parallel::apply_split(*root, split, group, options);
       return a.ret(); }},
    {nullptr, nullptr}};

}  // namespace

void open_policy(lua_State* L, int core) {
  lua_getfield(L, core, "tp");
  set_functions(L, lua_gettop(L), kPolicy);
  lua_pop(L, 1);
}

parallel::PolicyPlan load_policy(const nn::ModulePtr& model, const std::string& policy_file, const dist::Mesh& mesh,
                                 const PolicyConfig& config) {
  TORCH_CHECK(model, "load_policy: no model");
  Host host;
  lua_State* L = host.state();
  std::string error;
  lua_getglobal(L, "require");
  lua_pushstring(L, "partrain.sharder");
  if (!pcall(L, 1, 1, &error)) throw std::runtime_error("load_policy: partrain's Lua library does not load: " + error);
  lua_getfield(L, -1, "plan_file");
  push_module(L, model);
  lua_pushlstring(L, policy_file.data(), policy_file.size());
  ud_push(L, std::make_shared<dist::Mesh>(mesh), PT_MESH_MT);
  lua_createtable(L, 0, 5);
  lua_pushboolean(L, config.sequence_parallel); lua_setfield(L, -2, "sequence_parallel");
  lua_pushboolean(L, config.sequence_overlap); lua_setfield(L, -2, "sequence_overlap");
  lua_pushboolean(L, config.fused_norm); lua_setfield(L, -2, "fused_norm");
  lua_pushboolean(L, config.flash_attention); lua_setfield(L, -2, "flash_attention");
  lua_pushnumber(L, config.policy_timeout); lua_setfield(L, -2, "policy_timeout");
  if (!pcall(L, 4, 1, &error)) throw std::invalid_argument(error);
  Args args(L, "load_policy");
  return read_plan(args, lua_gettop(L));
}

std::string shipped_policy(const std::string& name) { return find_paths().policies + "/policies/" + name + ".lua"; }

}  // namespace partrain::lua
