// Modules in Lua: one userdata type over the engine's module tree, the built-in layers, and
// Lua-defined modules (Torch7 style) whose forward is a Lua function but whose parameters and
// children are real engine nodes, so policies, checkpoints and the REPL see them like any other.
#include <algorithm>
#include <cmath>
#include <sstream>

#include "bindings/lua.hpp"
#include "engine/models/generate.hpp"
#include "engine/models/registry.hpp"
#include "engine/dist/world.hpp"
#include "engine/nn/functional.hpp"
#include "engine/nn/grouped.hpp"
#include "engine/nn/init.hpp"
#include "engine/nn/layers.hpp"
#include "engine/optim/optim.hpp"
#include "engine/parallel/moe.hpp"
#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/plan/plan.hpp"
#include "engine/util/step_events.hpp"

namespace partrain::lua {

using nn::ModulePtr;
using torch::Tensor;

namespace {


// The tensors of `map` as copies when `copy` (views of gathered parameters outlive no gather).
nn::TensorMap owned(nn::TensorMap map, bool copy) {
  if (copy)
    for (auto& [name, t] : map) t = t.detach().clone();
  return map;
}

// Forwards written in Lua that C++ runs, nested: a forward that calls itself (a replaced forward
// calling self(x)) would recurse through C++ until the C stack overflows. Bounded like Lua's own
// C-call depth, with a clean error instead.
constexpr int kMaxLuaForwardDepth = 200;
thread_local int lua_forward_depth = 0;

// Calls the Lua function on top of L's stack (popping it) with a module and tensors, where C++
// needs a tensor back; `what` names the function in errors.
Tensor call_lua_forward(lua_State* L, int top, const ModulePtr& self, const std::vector<Tensor>& inputs,
                        const std::string& what) {
  if (lua_type(L, -1) != LUA_TFUNCTION) {
    lua_settop(L, top);
    TORCH_CHECK(false, what, " is not a function");
  }
  if (lua_forward_depth >= kMaxLuaForwardDepth) {
    lua_settop(L, top);
    TORCH_CHECK(false, "stack overflow: ", what, " runs ", kMaxLuaForwardDepth, " levels deep (does it call itself? "
                "inside a replaced forward, self:own_forward(...) runs the module's own)");
  }
  struct Depth {
    Depth() { ++lua_forward_depth; }
    ~Depth() { --lua_forward_depth; }
  } depth;
  push_module(L, self);
  for (const auto& t : inputs) push_tensor(L, t);
  std::string error;
  if (!pcall(L, static_cast<int>(inputs.size()) + 1, 1, &error)) throw Rethrow(error);
  auto* out = ud_test<Tensor>(L, -1, PT_TENSOR_MT);
  std::string got = luaL_typename(L, -1);
  Tensor result = out ? *out : Tensor();
  lua_settop(L, top);
  TORCH_CHECK(out, what, " returned a ", got, " where its caller needs a tensor");
  return result;
}

// A module defined in Lua. Its class table (methods, forward) and its fields table (plain Lua
// values the user stored on it) live in the registry; parameters and children live in C++.
// Its forward may split attention over a context group itself (pt.cp.attention): the composer
// accepts it under context parallelism, and train_step checks that it did.
class LuaModule : public nn::Module, public parallel::ContextSplit {
 public:
  LuaModule(lua_State* L, std::string type, int class_idx) : nn::Module(std::move(type)), class_(L, class_idx) {
    lua_newtable(L);
    fields_ = std::make_unique<LuaRef>(L, -1);
    lua_pop(L, 1);
  }
  bool attends() const override { return true; }
  void push_class(lua_State* L) const { class_.push(L); }
  void push_fields(lua_State* L) const { fields_->push(L); }

  // Numeric attributes a Lua module declares with self:attribute(name, value): policies read and
  // divide them (P.divide_by_tensor) like a built-in module's, and self.name reads the current value.
  c10::optional<double> attribute(const std::string& name) const override {
    for (const auto& [n, v] : attributes_)
      if (n == name) return v;
    return c10::nullopt;
  }
  void set_attribute(const std::string& name, double value) override {
    for (auto& [n, v] : attributes_)
      if (n == name) {
        v = value;
        return;
      }
    std::string known;
    for (const auto& [n, v] : attributes_) known += (known.empty() ? "" : ", ") + n;
    TORCH_CHECK(false, type(), " has no attribute '", name, "' (", known.empty() ? std::string("it declares none")
                : "it declares " + known, "; declare one with self:attribute(name, value))");
  }
  std::vector<std::string> attribute_names() const override {
    std::vector<std::string> names;
    for (const auto& [n, v] : attributes_) names.push_back(n);
    return names;
  }
  /// Declares `name` (or sets it, when declared already).
  void declare_attribute(const std::string& name, double value) {
    for (auto& [n, v] : attributes_)
      if (n == name) {
        v = value;
        return;
      }
    attributes_.emplace_back(name, value);
  }

  // Called when C++ runs this module (inside a Sequential, say): the Lua forward with tensors.
  Tensor forward(const std::vector<Tensor>& inputs) override {
    if (Tensor out; run_replacement(inputs, out)) return out;
    TORCH_CHECK(class_.alive(), type(), ": the Lua state that defined this module is gone");
    lua_State* L = active_state(class_.main());
    int top = lua_gettop(L);
    push_class(L);
    lua_getfield(L, -1, "forward");
    lua_remove(L, -2);
    if (lua_type(L, -1) != LUA_TFUNCTION) {
      lua_settop(L, top);
      TORCH_CHECK(false, type(), " has no forward method");
    }
    return call_lua_forward(L, top, std::static_pointer_cast<nn::Module>(shared_from_this()), inputs,
                            type() + ":forward");
  }

 private:
  LuaRef class_;
  std::unique_ptr<LuaRef> fields_;
  std::vector<std::pair<std::string, double>> attributes_;  // in declaration order
};

// A Lua function as a module's forward (a policy's method replacement).
nn::Module::ForwardFn lua_forward(lua_State* L, int index) {
  auto fn = std::make_shared<LuaRef>(L, index);
  return [fn](nn::Module& self, const std::vector<Tensor>& inputs) {
    TORCH_CHECK(fn->alive(), self.type(), ": the Lua state that replaced this forward is gone");
    lua_State* L = active_state(fn->main());
    int top = lua_gettop(L);
    fn->push(L);
    return call_lua_forward(L, top, std::static_pointer_cast<nn::Module>(self.shared_from_this()), inputs,
                            "the replaced forward of " + self.type());
  };
}

// A Lua function as an MoE block's router: fn(self, logits, x) -> weights, indices [, probs].
// "file:line" of its definition names it in the block's errors.
void set_lua_router(lua_State* L, int index, parallel::MoE& block) {
  lua_pushvalue(L, index);
  lua_Debug info;
  lua_getinfo(L, ">S", &info);
  const std::string where = std::string(info.short_src) + ":" + std::to_string(info.linedefined);
  auto fn = std::make_shared<LuaRef>(L, index);
  block.set_router([fn, where](parallel::MoE& self, const Tensor& logits, const Tensor& x) {
    TORCH_CHECK(fn->alive(), "MoE: the Lua state that set the router (", where, ") is gone");
    lua_State* L = active_state(fn->main());
    const int top = lua_gettop(L);
    fn->push(L);
    push_module(L, std::static_pointer_cast<nn::Module>(self.shared_from_this()));
    push_tensor(L, logits);
    push_tensor(L, x);
    std::string error;
    if (!pcall(L, 3, 3, &error)) throw Rethrow(error);
    parallel::Routing r;
    const char* names[] = {"weights", "indices", "probs"};
    Tensor* slots[] = {&r.weights, &r.indices, &r.probs};
    for (int i = 0; i < 3; ++i) {
      const int at = top + 1 + i;
      if (lua_isnil(L, at) && i == 2) continue;
      auto* t = ud_test<Tensor>(L, at, PT_TENSOR_MT);
      if (!t) {
        std::string got = luaL_typename(L, at);
        lua_settop(L, top);
        TORCH_CHECK(false, "MoE router ", where, " returned a ", got, " as its ", names[i], " (", i + 1,
                    "th result): it returns weights [tokens, top_k], indices [tokens, top_k] and optionally "
                    "probabilities [tokens, experts]");
      }
      *slots[i] = *t;
    }
    lua_settop(L, top);
    return r;
  }, where);
}

LuaModule* as_lua(const ModulePtr& m) { return dynamic_cast<LuaModule*>(m.get()); }

// The module metatable's array slots: the method table and the weak userdata cache.
constexpr int kMethodsSlot = 1, kModulesSlot = 2;

// Pushes the one userdata of `m`, made and remembered in the weak table at `cache` the first time.
void push_module_via(lua_State* L, int cache, const ModulePtr& m) {
  lua_pushlightuserdata(L, m.get());
  lua_rawget(L, cache);
  if (!lua_isnil(L, -1)) return;
  lua_pop(L, 1);
  ud_push(L, m, PT_MODULE_MT);
  lua_pushlightuserdata(L, m.get());
  lua_pushvalue(L, -2);
  lua_rawset(L, cache);
}

// Parameters from a module or a table of tensors.
// A parameter or module a live optimizer steps is not replaced: the optimizer would go on
// stepping the old tensors while the forward used the new ones (the new layer moved by 0, exit 0).
void refuse_replacing_held(lua_State* L, const nn::Module& parent, const std::string& key) {
  torch::OrderedDict<std::string, Tensor> named;
  std::string what;
  if (auto old = parent.child(key)) {
    named = old->named_parameters(/*recurse=*/true);
    what = "its parameter ";
  } else if (parent.has_slot(key) && parent.param(key).defined()) {
    named.insert(key, parent.param(key));
  }
  if (named.is_empty()) return;
  auto held = held_by_optimizer(L, named);
  if (!held.empty())
    throw std::invalid_argument("cannot replace " + parent.type() + "." + key + ": a live optimizer steps " + what +
                                "'" + held + "', and would go on stepping the old tensor; change the model before "
                                "making its optimizer (or make a new optimizer after)");
}

std::vector<Tensor> params_of(const Args& a, int i) {
  if (auto* m = ud_test<ModulePtr>(a.L, i, PT_MODULE_MT)) return nn::unique_parameters(**m);
  if (a.is_table(i)) return a.tensors(i, /*values=*/false);  // their gradients are read, not their values
  a.expected(i, "module or table of tensors");
}

void push_value(lua_State* L, const Tensor& t) { push_tensor(L, t); }
void push_value(lua_State* L, const ModulePtr& m) { push_module(L, m); }
const std::string& key_of(const torch::OrderedDict<std::string, Tensor>::Item& item) { return item.key(); }
const Tensor& value_of(const torch::OrderedDict<std::string, Tensor>::Item& item) { return item.value(); }
const std::string& key_of(const std::pair<std::string, ModulePtr>& item) { return item.first; }
const ModulePtr& value_of(const std::pair<std::string, ModulePtr>& item) { return item.second; }

// Pushes two arrays, names and values, from (name, tensor or module) items in order.
template <class Items>
int push_named(const Args& a, const Items& items) {
  lua_createtable(a.L, static_cast<int>(items.size()), 0);
  lua_createtable(a.L, static_cast<int>(items.size()), 0);
  int i = 0;
  for (const auto& item : items) {
    ++i;
    lua_pushstring(a.L, key_of(item).c_str());
    lua_rawseti(a.L, -3, i);
    push_value(a.L, value_of(item));
    lua_rawseti(a.L, -2, i);
  }
  return 2;
}

// Pushes {name = tensor}.
void push_tensor_map(lua_State* L, const nn::TensorMap& state) {
  lua_createtable(L, 0, static_cast<int>(state.size()));
  for (const auto& [name, t] : state) {
    push_tensor(L, t);
    lua_setfield(L, -2, name.c_str());
  }
}

// Reads a Lua table {name = tensor} into a map.
nn::TensorMap tensor_map(const Args& a, int i) {
  if (!a.is_table(i)) a.expected(i, "table of tensors by name");
  nn::TensorMap out;
  lua_pushnil(a.L);
  while (lua_next(a.L, i)) {
    auto* t = ud_test<Tensor>(a.L, -1, PT_TENSOR_MT);
    if (lua_type(a.L, -2) != LUA_TSTRING || !t) {
      lua_pop(a.L, 2);
      a.fail(i, "table of tensors by name expected");
    }
    out[lua_tostring(a.L, -2)] = *t;
    lua_pop(a.L, 1);
  }
  return out;
}

// ---- The undo record of a policy: the tree, and the Lua fields of its Lua-defined modules ----

#define PT_SNAPSHOT_MT "partrain.Snapshot"

class Snapshot {
 public:
  Snapshot(lua_State* L, nn::Module& root, int64_t copy_limit) : tree_(root, copy_limit) {
    for (const auto& [path, m] : root.modules()) {
      auto* lm = as_lua(m);
      if (!lm) continue;
      lm->push_fields(L);  // a shallow copy of its fields table
      int fields = lua_gettop(L);
      lua_newtable(L);
      lua_pushnil(L);
      while (lua_next(L, fields)) {
        lua_pushvalue(L, -2);
        lua_insert(L, -2);
        lua_rawset(L, -4);
      }
      fields_.emplace_back(m, std::make_unique<LuaRef>(L, -1));
      lua_pop(L, 2);
    }
  }
  // Puts everything back; pushes the names of tensors that could not be (a Lua array).
  int restore(lua_State* L) {
    auto lost = tree_.restore();
    for (auto& [m, copy] : fields_) {
      as_lua(m)->push_fields(L);
      int fields = lua_gettop(L);
      lua_newtable(L);  // the keys now, then clear them
      int keys = lua_gettop(L), n = 0;
      lua_pushnil(L);
      while (lua_next(L, fields)) {
        lua_pop(L, 1);
        lua_pushvalue(L, -1);
        lua_rawseti(L, keys, ++n);
      }
      for (int i = 1; i <= n; ++i) {
        lua_rawgeti(L, keys, i);
        lua_pushnil(L);
        lua_rawset(L, fields);
      }
      copy->push(L);
      lua_pushnil(L);
      while (lua_next(L, -2)) {
        lua_pushvalue(L, -2);
        lua_insert(L, -2);
        lua_rawset(L, fields);
      }
      lua_settop(L, fields - 1);
    }
    lua_createtable(L, static_cast<int>(lost.size()), 0);
    for (size_t i = 0; i < lost.size(); ++i) {
      lua_pushstring(L, lost[i].c_str());
      lua_rawseti(L, -2, static_cast<int>(i + 1));
    }
    return 1;
  }

 private:
  nn::TreeSnapshot tree_;
  std::vector<std::pair<ModulePtr, std::unique_ptr<LuaRef>>> fields_;
};
using SnapshotPtr = std::shared_ptr<Snapshot>;

const Function kSnapshotMethods[] = {
    {"restore", [](Args& a) {
       auto* s = ud_test<SnapshotPtr>(a.L, 1, PT_SNAPSHOT_MT);
       if (!s) a.expected(1, "snapshot");
       return (*s)->restore(a.L); }},
    {nullptr, nullptr}};

const Function kMethods[] = {
    {"forward", [](Args& a) {
       events::forward_begins();  // a script's forward: the planner's first step begins at the first
       auto& m = a.module(1);
       std::vector<Tensor> inputs;
       for (int i = 2; i <= a.top(); ++i) inputs.push_back(a.tensor(i));
       return a.ret(m->forward(inputs)); }},
    {"own_forward", [](Args& a) {  // the module's own forward, even when a policy replaced it
       auto& m = a.module(1);
       std::vector<Tensor> inputs;
       for (int i = 2; i <= a.top(); ++i) inputs.push_back(a.tensor(i));
       return a.ret(m->own_forward(inputs)); }},
    {"replace_forward", [](Args& a) {  // replace_forward(fn(self, ...) -> tensor) or (nil): restore
       auto& m = a.module(1);
       if (a.none(2)) m->replace_forward({});
       else if (lua_type(a.L, 2) == LUA_TFUNCTION) m->replace_forward(lua_forward(a.L, 2));
       else a.expected(2, "function or nil");
       return a.ret(); }},
    {"forward_replaced", [](Args& a) { return a.ret(a.module(1)->forward_replaced()); }},
    {"type", [](Args& a) { return a.ret(a.module(1)->type()); }},
    {"is_lua", [](Args& a) { return a.ret(as_lua(a.module(1)) != nullptr); }},  // defined in Lua?
    {"parameters", [](Args& a) { return a.ret(nn::unique_parameters(*a.module(1))); }},  // a tied one once
    {"buffers", [](Args& a) { return a.ret(a.module(1)->buffers()); }},
    {"_named_parameters", [](Args& a) { return push_named(a, a.module(1)->named_parameters()); }},
    {"_named_buffers", [](Args& a) { return push_named(a, a.module(1)->named_buffers()); }},
    {"_named_modules", [](Args& a) { return push_named(a, a.module(1)->modules()); }},
    {"_named_children", [](Args& a) { return push_named(a, a.module(1)->children_named()); }},
    {"get", [](Args& a) {
       auto found = a.module(1)->find(a.string(2));
       if (!found) { lua_pushnil(a.L); return 1; }
       return a.ret(found); }},
    {"set", [](Args& a) {  // set(path, module): replaces the module at a dotted path
       auto& root = a.module(1);
       std::string path = a.string(2);
       auto dot = path.find_last_of('.');
       std::string parent_path = dot == std::string::npos ? "" : path.substr(0, dot);
       auto parent = root->find(parent_path);
       if (!parent || path.empty()) a.fail(2, "no module at '" + path + "' in " + root->type());
       refuse_replacing_held(a.L, *parent, dot == std::string::npos ? path : path.substr(dot + 1));
       parent->set_child(dot == std::string::npos ? path : path.substr(dot + 1), a.module(3));
       return a.ret(); }},
    // Under ZeRO-3 the parameters exist whole only while gathered: these read (copies) or write
    // them with every unit gathered for the call (a collective over the zero group).
    {"state_dict", [](Args& a) {  // this rank's tensors (its parts of split ones): smp's local_state_dict
       auto& m = *a.module(1);
       parallel::Fsdp::Gathered gathered(parallel::ParallelModel::fsdp_of(m), /*writeback=*/false);
       push_tensor_map(a.L, owned(m.state_dict(), parallel::ParallelModel::fsdp_of(m) != nullptr));
       return 1; }},
    {"load_state_dict", [](Args& a) {
       auto& m = *a.module(1);
       parallel::Fsdp::Gathered gathered(parallel::ParallelModel::fsdp_of(m), /*writeback=*/true);
       m.load_state_dict(tensor_map(a, 2), a.boolean(3, true));
       return a.ret(); }},
    {"gathered", [](Args& a) {  // gathered(fn): fn() with every ZeRO-3 unit gathered; what it writes is kept
       auto& m = *a.module(1);
       if (lua_type(a.L, 2) != LUA_TFUNCTION) a.expected(2, "function");
       parallel::Fsdp::Gathered gathered(parallel::ParallelModel::fsdp_of(m), /*writeback=*/true);
       lua_pushvalue(a.L, 2);
       std::string error;
       if (!pcall(a.L, 0, LUA_MULTRET, &error)) throw Rethrow(error);
       return lua_gettop(a.L) - 2; }},
    {"full_state_dict", [](Args& a) {  // split tensors gathered to their logical shapes (a collective)
       auto& m = *a.module(1);
       parallel::Fsdp::Gathered gathered(parallel::ParallelModel::fsdp_of(m), /*writeback=*/false);
       push_tensor_map(a.L, owned(parallel::full_state_dict(m), parallel::ParallelModel::fsdp_of(m) != nullptr));
       return 1; }},
    {"load_full_state_dict", [](Args& a) {  // logical tensors in; each rank keeps its parts
       auto& m = *a.module(1);
       parallel::Fsdp::Gathered gathered(parallel::ParallelModel::fsdp_of(m), /*writeback=*/true);
       parallel::load_full_state_dict(m, tensor_map(a, 2), a.boolean(3, true));
       return a.ret(); }},
    {"train", [](Args& a) { a.module(1)->train(a.boolean(2, true)); lua_settop(a.L, 1); return 1; }},
    {"eval", [](Args& a) { a.module(1)->eval(); lua_settop(a.L, 1); return 1; }},
    {"is_training", [](Args& a) { return a.ret(a.module(1)->is_training()); }},
    {"to", [](Args& a) {
       auto& m = a.module(1);
       std::string s = a.string(2);
       if (m->parallel_tree()) {
         // New tensors would leave the data-parallel hooks, the records and the optimizer on the
         // old ones: the replicas drifted apart without an error. A conversion that changes
         // nothing is let through.
         const bool dtype = is_dtype_name(s);
         const auto to_dtype = dtype ? parse_dtype(s) : torch::kFloat32;
         const auto to_device = dtype ? torch::Device(torch::kCPU) : torch::Device(s);
         for (const auto& p : m->parameters()) {
           if (!p.defined()) continue;
           const bool changes = dtype ? p.is_floating_point() && p.scalar_type() != to_dtype : p.device() != to_device;
           if (changes)
             a.fail(1, "to('" + s + "') on a module of a parallelized model: its gradient buckets, records and "
                    "optimizer hold the tensors it has now and would go on with them. Convert before "
                    "pt.parallelize (pt.parallelize(model:to('" + s + "'), ...)), or see docs/precision.md for "
                    "mixed precision");
         }
       }
       if (is_dtype_name(s)) {
         m->to(parse_dtype(s));
       } else {
         m->to(torch::Device(s));
       }
       lua_settop(a.L, 1);
       return 1; }},
    {"zero_grad", [](Args& a) {
       for (auto& p : a.module(1)->parameters()) p.mutable_grad() = Tensor();
       // Under ZeRO-2 the gradients live in data parallelism's shard: zeroed too.
       if (auto pm = parallel::ParallelModel::of(*a.module(1)); pm && pm->data_parallel()) pm->data_parallel()->zero_grad();
       return a.ret(); }},
    {"materialize", [](Args& a) {  // a deferred (meta) model's tensors allocated and initialized by name
       auto& m = a.module(1);
       if (parallel::ParallelModel::of(*m))
         a.fail(1, "a parallelized model was materialized by pt.parallelize (each rank its own part)");
       auto device = a.none(2) ? dist::World::instance().device() : torch::Device(a.string(2));
       nn::materialize(*m, device);
       lua_settop(a.L, 1);
       return 1; }},
    {"is_meta", [](Args& a) { return a.ret(nn::has_meta(*a.module(1))); }},
    {"num_parameters", [](Args& a) {
       int64_t n = 0;
       for (const auto& p : nn::unique_parameters(*a.module(1))) n += p.numel();
       return a.ret(double(n)); }},
    {"attribute", [](Args& a) {  // attribute(name) reads; attribute(name, value) sets (a Lua module declares it)
       if (!a.none(3)) {
         auto& m = a.module(1);
         std::string name = a.string(2);
         double value = a.number(3);
         if (!std::isfinite(value)) a.fail(3, "attribute '" + name + "' must be a finite number");
         if (auto* lm = as_lua(m)) {
           if (m->has_slot(name) || m->child(name))
             a.fail(2, "'" + name + "' is a parameter or child of " + m->type() + ", not an attribute name");
           lm->declare_attribute(name, value);
           lm->push_fields(a.L);  // the attribute answers to self.name from now on, not a field
           lua_pushvalue(a.L, 2);
           lua_pushnil(a.L);
           lua_rawset(a.L, -3);
           lua_pop(a.L, 1);
         } else {
           m->set_attribute(name, value);
         }
         lua_settop(a.L, 1);
         return 1;
       }
       auto v = a.module(1)->attribute(a.string(2));
       if (!v) { lua_pushnil(a.L); return 1; }
       return a.ret(*v); }},
    {"set_attribute", [](Args& a) { a.module(1)->set_attribute(a.string(2), a.number(3)); return a.ret(); }},
    {"set_router", [](Args& a) {  // set_router(fn(self, logits, x) -> weights, indices [, probs]) on an MoE block
       auto m = a.module(1);
       auto* block = dynamic_cast<parallel::MoE*>(m.get());
       if (!block) a.fail(1, "set_router: " + m->type() + " is not an MoE block");
       if (lua_type(a.L, 2) != LUA_TFUNCTION) a.expected(2, "function(self, logits, x)");
       set_lua_router(a.L, 2, *block);
       return a.ret(); }},
    {"_take_moe_stats", [](Args& a) {  // { [path] = { routed = {...}, dropped, slots, aux, z, forwards } }, reset
       lua_newtable(a.L);
       for (auto& [path, block] : parallel::moe_blocks(*a.module(1))) {
         auto st = block->take_stats();
         lua_newtable(a.L);
         lua_newtable(a.L);
         for (size_t i = 0; i < st.routed.size(); ++i) {
           lua_pushnumber(a.L, st.routed[i]);
           lua_rawseti(a.L, -2, static_cast<int>(i) + 1);
         }
         lua_setfield(a.L, -2, "routed");
         const std::pair<const char*, double> fields[] = {{"dropped", st.dropped}, {"slots", st.slots}, {"aux", st.aux},
                                                          {"z", st.z}, {"forwards", double(st.forwards)}};
         for (const auto& [k, v] : fields) {
           lua_pushnumber(a.L, v);
           lua_setfield(a.L, -2, k);
         }
         lua_setfield(a.L, -2, path.c_str());
       }
       return 1; }},

    {"attribute_names", [](Args& a) {
       auto names = a.module(1)->attribute_names();
       lua_createtable(a.L, static_cast<int>(names.size()), 0);
       for (size_t i = 0; i < names.size(); ++i) {
         lua_pushstring(a.L, names[i].c_str());
         lua_rawseti(a.L, -2, static_cast<int>(i + 1));
       }
       return 1; }},
    {"generate", [](Args& a) {  // generate(ids [, { max_new = 32, temperature = 1, top_k = 0, top_p = 1, cache = true }])
       Options t(a, 3, "generate");
       models::GenerateOptions o;
       o.max_new = t.integer("max_new", o.max_new);
       o.temperature = t.number("temperature", o.temperature);
       o.top_k = t.integer("top_k", o.top_k);
       o.top_p = t.number("top_p", o.top_p);
       o.cache = t.boolean("cache", o.cache);
       t.finish();
       return a.ret(models::generate(*a.module(1), a.tensor(2), o)); }},
    {"register_buffer", [](Args& a) { a.module(1)->set_buffer(a.string(2), a.tensor(3)); return a.ret(); }},
    {"register_parameter", [](Args& a) { a.module(1)->set_parameter(a.string(2), a.tensor(3)); return a.ret(); }},
    {"add", [](Args& a) {  // add(module) on a Sequential appends; add(name, module) names it
       auto& m = a.module(1);
       if (auto* seq = dynamic_cast<nn::Sequential*>(m.get()); seq && a.none(3)) seq->append(a.module(2));
       else m->set_child(a.string(2), a.module(3));
       lua_settop(a.L, 1);
       return 1; }},
    {nullptr, nullptr}};

const Function kMeta[] = {
    {"__tostring", [](Args& a) { return a.ret(a.module(1)->repr()); }},
    {"__index", [](Args& a) {
       auto& m = a.module(1);
       lua_State* L = a.L;
       LuaModule* lm = as_lua(m);
       // A replaced forward wins over the class's: the C++ forward below dispatches to it.
       bool replaced = lm && m->forward_replaced() && lua_type(L, 2) == LUA_TSTRING &&
                       std::string(lua_tostring(L, 2)) == "forward";
       if (lm && !replaced) {
         if (lua_type(L, 2) == LUA_TSTRING)
           if (auto v = lm->attribute(lua_tostring(L, 2))) return a.ret(*v);
         lm->push_fields(L);
         lua_pushvalue(L, 2);
         lua_rawget(L, -2);
         if (!lua_isnil(L, -1)) return 1;
         lua_pop(L, 2);
         lm->push_class(L);
         lua_pushvalue(L, 2);
         lua_gettable(L, -2);  // follows the class's parents
         if (!lua_isnil(L, -1)) return 1;
         lua_pop(L, 2);
       }
       // The method table and the userdata cache hang off the module metatable's array slots,
       // reached without a registry lookup by name.
       lua_getmetatable(L, 1);
       int mt = lua_gettop(L);
       lua_rawgeti(L, mt, kMethodsSlot);
       lua_pushvalue(L, 2);
       lua_rawget(L, -2);
       if (!lua_isnil(L, -1)) return 1;
       lua_pop(L, 2);
       std::string key;
       if (lua_type(L, 2) == LUA_TNUMBER) {
         // model.h[0], as PyTorch's ModuleList[0]: a list's children are named "0", "1", ...
         const double n = lua_tonumber(L, 2);
         if (!(n >= 0 && n == std::floor(n) && n < 1e15)) { lua_pushnil(L); return 1; }
         key = std::to_string(static_cast<long long>(n));
       } else if (lua_type(L, 2) == LUA_TSTRING) {
         key = lua_tostring(L, 2);
       } else {
         lua_pushnil(L);
         return 1;
       }
       if (Tensor t = m->own_tensor(key); t.defined()) return a.ret(t);
       if (auto child = m->child(key)) {
         lua_rawgeti(L, mt, kModulesSlot);
         push_module_via(L, lua_gettop(L), child);
         return 1;
       }
       if (lm || m->has_slot(key)) { lua_pushnil(L); return 1; }
       throw std::invalid_argument(m->type() + " has no field, method, parameter or child '" + key + "'"); }},
    {"__newindex", [](Args& a) {
       auto& m = a.module(1);
       std::string key = a.string(2);
       LuaModule* lm = as_lua(m);
       auto forget_field = [&] {  // an engine node now answers to this name, not an old Lua field
         if (!lm) return;
         lm->push_fields(a.L);
         lua_pushvalue(a.L, 2);
         lua_pushnil(a.L);
         lua_rawset(a.L, -3);
         lua_pop(a.L, 1);
       };
       refuse_replacing_held(a.L, *m, key);
       if (auto* child = ud_test<ModulePtr>(a.L, 3, PT_MODULE_MT)) {
         m->set_child(key, *child);
         forget_field();
         return a.ret();
       }
       bool has_param = m->has_slot(key);
       bool has_buffer = m->named_buffers(false).find(key) != nullptr;
       if (auto* t = ud_test<Tensor>(a.L, 3, PT_TENSOR_MT)) {
         if (has_buffer) { m->set_buffer(key, *t); forget_field(); return a.ret(); }
         if (has_param || (t->requires_grad() && t->is_leaf())) { m->set_parameter(key, *t); forget_field(); return a.ret(); }
       }
       if (has_param || has_buffer || m->child(key))
         throw std::invalid_argument("cannot replace " + m->type() + "." + key + " with a " +
                                     luaL_typename(a.L, 3) + " (parameters take tensors, children modules)");
       if (!lm)
         throw std::invalid_argument("cannot set field '" + key + "' on built-in module " + m->type());
       if (lm->attribute(key)) {  // a declared attribute stays one: numbers only
         if (!a.is_number(3))
           throw std::invalid_argument(m->type() + "." + key + " is a numeric attribute (self:attribute), not a " +
                                       luaL_typename(a.L, 3));
         lm->set_attribute(key, a.number(3));
         return a.ret();
       }
       lm->push_fields(a.L);
       lua_pushvalue(a.L, 2);
       lua_pushvalue(a.L, 3);
       lua_rawset(a.L, -3);
       return a.ret(); }},
    {nullptr, nullptr}};

// The rows a group holds, for the grouped matmuls: a table of integers or a 1-D integer tensor.
std::vector<int64_t> group_counts(const Args& a, int i) {
  if (a.is_table(i)) return a.ints(i);
  if (!a.is_tensor(i)) a.expected(i, "table of counts (one integer a group) or 1-D integer tensor");
  const auto& t = a.tensor(i);
  if (t.dim() != 1 || at::isFloatingType(t.scalar_type()) || t.scalar_type() == torch::kBool)
    a.fail(i, "counts must be a 1-D integer tensor, got " + std::string(c10::toString(t.scalar_type())) + " of " +
                  std::to_string(t.dim()) + " dimensions");
  auto host = t.to(torch::kCPU, torch::kInt64).contiguous();
  return {host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel()};
}

// Constructors: pt.nn.Linear(784, 256, {bias = false}), ...
const Function kConstructors[] = {
    {"Linear", [](Args& a) {
       nn::LinearOptions o(a.integer(1), a.integer(2));
       Options t(a, 3, "Linear");
       o.bias = t.boolean("bias", true);
       t.finish();
       return a.ret(ModulePtr(std::make_shared<nn::Linear>(o))); }},
    {"Embedding", [](Args& a) {
       Options(a, 3, "Embedding").finish();
       return a.ret(ModulePtr(std::make_shared<nn::Embedding>(nn::EmbeddingOptions(a.integer(1), a.integer(2))))); }},
    {"LayerNorm", [](Args& a) {
       nn::LayerNormOptions o(a.integer(1));
       Options t(a, 2, "LayerNorm");
       o.eps = t.number("eps", o.eps);
       o.affine = t.boolean("affine", o.affine);
       t.finish();
       return a.ret(ModulePtr(std::make_shared<nn::LayerNorm>(o))); }},
    {"Dropout", [](Args& a) { return a.ret(ModulePtr(std::make_shared<nn::Dropout>(a.number(1, 0.5)))); }},
    {"RMSNorm", [](Args& a) {  // RMSNorm(dim [, { eps = 1e-6, affine = true }])
       nn::RMSNormOptions o(a.integer(1));
       Options t(a, 2, "RMSNorm");
       o.eps = t.number("eps", o.eps);
       o.affine = t.boolean("affine", o.affine);
       t.finish();
       return a.ret(ModulePtr(std::make_shared<nn::RMSNorm>(o))); }},
    {"MoE", [](Args& a) {  // MoE { dim, hidden, experts, top_k = 2, normalize, aux_loss, z_loss, capacity_factor, router }
       parallel::MoEOptions o;
       Options t(a, 1, "MoE");
       o.dim = t.integer("dim", 0);
       o.hidden = t.integer("hidden", 0);
       o.experts = t.integer("experts", o.experts);
       o.top_k = t.integer("top_k", o.top_k);
       o.normalize = t.boolean("normalize", o.normalize);
       o.aux_loss = t.number("aux_loss", o.aux_loss);
       o.z_loss = t.number("z_loss", o.z_loss);
       o.capacity_factor = t.number("capacity_factor", o.capacity_factor);
       const bool routed = t.push("router");
       if (routed && lua_type(a.L, -1) != LUA_TFUNCTION) a.fail(1, "MoE: router must be a function(self, logits, x)");
       auto block = std::make_shared<parallel::MoE>(o);
       if (routed) {
         set_lua_router(a.L, lua_gettop(a.L), *block);
         lua_pop(a.L, 1);
       }
       t.finish();
       return a.ret(ModulePtr(block)); }},
    {"Identity", [](Args& a) {
       if (!a.none(1)) a.fail(1, "Identity takes no arguments");
       return a.ret(ModulePtr(std::make_shared<nn::Identity>())); }},
    {"ModuleList", [](Args& a) {  // ModuleList(m1, m2, ...) or ModuleList({ m1, m2, ... })
       auto list = std::make_shared<nn::ModuleContainer>("ModuleList");
       if (a.is_table(1) && a.top() == 1) {
         int n = static_cast<int>(lua_objlen(a.L, 1));
         for (int i = 1; i <= n; ++i) {
           lua_rawgeti(a.L, 1, i);
           auto* m = ud_test<ModulePtr>(a.L, -1, PT_MODULE_MT);
           if (!m) a.fail(1, "ModuleList: element " + std::to_string(i) + " is a " + luaL_typename(a.L, -1) + ", not a module");
           list->append(*m);
           lua_pop(a.L, 1);
         }
         a.list_only(1, n, "modules");
       } else {
         for (int i = 1; i <= a.top(); ++i) list->append(a.module(i));
       }
       return a.ret(ModulePtr(list)); }},
    {"ModuleDict", [](Args& a) {  // ModuleDict({ name = module, ... }): children in name order
       auto dict = std::make_shared<nn::ModuleContainer>("ModuleDict");
       if (!a.none(1)) {
         if (!a.is_table(1)) a.expected(1, "table of name = module");
         std::vector<std::pair<std::string, ModulePtr>> entries;
         lua_pushnil(a.L);
         while (lua_next(a.L, 1)) {
           if (lua_type(a.L, -2) != LUA_TSTRING) a.fail(1, std::string("ModuleDict: keys must be names, got a ") + luaL_typename(a.L, -2));
           std::string name = lua_tostring(a.L, -2);
           auto* m = ud_test<ModulePtr>(a.L, -1, PT_MODULE_MT);
           if (!m) a.fail(1, "ModuleDict: '" + name + "' is a " + luaL_typename(a.L, -1) + ", not a module");
           if (name.empty() || name.find('.') != std::string::npos)
             a.fail(1, "ModuleDict: '" + name + "' is not a valid child name (non-empty, without dots)");
           entries.emplace_back(name, *m);
           lua_pop(a.L, 1);
         }
         std::sort(entries.begin(), entries.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
         for (auto& [name, m] : entries) dict->set_child(name, m);
       }
       return a.ret(ModulePtr(dict)); }},

    {"Sequential", [](Args& a) {
       std::vector<ModulePtr> layers;
       for (int i = 1; i <= a.top(); ++i) layers.push_back(a.module(i));
       return a.ret(ModulePtr(std::make_shared<nn::Sequential>(layers))); }},
    {"activation", [](Args& a) { return a.ret(nn::make_activation(a.string(1), a.integer(2, -1))); }},
    {"_lua_module", [](Args& a) {  // _lua_module(type, class): a new Lua-defined module
       std::string type = a.string(1);
       if (!a.is_table(2)) a.expected(2, "class table");
       return a.ret(ModulePtr(std::make_shared<LuaModule>(a.L, type, 2))); }},
    {"_defer", [](Args& a) {  // on: new layers' parameters on the meta device; returns whether they were
       bool was = nn::parameter_options().device().is_meta();
       // Off: back on the rank's device (where app/main.cpp put them), not the CPU.
       if (!plan::planning())
         nn::set_parameter_options(nn::parameter_options().device(a.boolean(1) ? torch::Device(torch::kMeta)
                                                                                : dist::World::instance().device()));
       return a.ret(was); }},
    {"_seed_if_unset", [](Args& a) {  // a deferred model's base seed (a built-in family drew its own)
       if (!a.module(1)->init_seed()) nn::draw_init_seed(*a.module(1));
       return a.ret(); }},
    {"is_module", [](Args& a) { return a.ret(ud_test<ModulePtr>(a.L, 1, PT_MODULE_MT) != nullptr); }},
    {"_check", [](Args& a) {  // every module's invariants, and ties between tensors split alike
       nn::check_tree(*a.module(1));
       parallel::parameter_records(*a.module(1));
       return a.ret(); }},
    {"_tie", [](Args& a) {  // _tie(module, name, tensor): the slot holds that very tensor (P.tie)
       a.module(1)->set_parameter(a.string(2), a.tensor(3), /*share=*/true);
       return a.ret(); }},
    {"_ties", [](Args& a) {  // { {name, name, ...}, ... }: names sharing one parameter
       auto groups = nn::tied_parameters(*a.module(1));
       lua_createtable(a.L, static_cast<int>(groups.size()), 0);
       for (size_t i = 0; i < groups.size(); ++i) {
         lua_createtable(a.L, static_cast<int>(groups[i].size()), 0);
         for (size_t j = 0; j < groups[i].size(); ++j) {
           lua_pushstring(a.L, groups[i][j].c_str());
           lua_rawseti(a.L, -2, static_cast<int>(j + 1));
         }
         lua_rawseti(a.L, -2, static_cast<int>(i + 1));
       }
       return 1; }},
    {"_snapshot", [](Args& a) {  // _snapshot(model, copy_limit_bytes): the undo record of a policy
       ud_push(a.L, std::make_shared<Snapshot>(a.L, *a.module(1), a.integer(2)), PT_SNAPSHOT_MT);
       return 1; }},
    {"cross_entropy", [](Args& a) {
       Options t(a, 3, "cross_entropy");
       int64_t ignore = t.integer("ignore_index", -100);
       t.finish();
       const auto& logits = a.tensor(1);
       // Logits split along the vocabulary (a P.vocab_head's): the serial formula would see this
       // rank's columns only; the vocabulary-parallel one gives the serial loss.
       if (auto split = parallel::split_logits_of(logits)) {
         if (logits.dim() < 1 || logits.size(-1) != split->local)
           a.fail(1, "vocabulary-split logits (this rank holds " + std::to_string(split->local) + " of " +
                         std::to_string(split->padded) + " columns) reshaped so that their last dimension is " +
                         (logits.dim() ? std::to_string(logits.size(-1)) : std::string("gone")) +
                         ": keep (..., " + std::to_string(split->local) + ") or use pt.loss_fn(model)");
         return a.ret(parallel::vocab_parallel_cross_entropy(logits, a.tensor(2), split->group, split->vocab, ignore));
       }
       return a.ret(nn::cross_entropy(logits, a.tensor(2), ignore)); }},
    {"mse", [](Args& a) { return a.ret(nn::mse(a.tensor(1), a.tensor(2))); }},
    {"nll_loss", [](Args& a) {  // nll_loss(log_probs, targets [, { ignore_index = -100, reduction = "mean" }])
       Options t(a, 3, "nll_loss");
       int64_t ignore = t.integer("ignore_index", -100);
       std::string reduction = t.string("reduction", "mean");
       t.finish();
       return a.ret(nn::nll_loss(a.tensor(1), a.tensor(2), ignore, reduction)); }},
    {"rms_norm", [](Args& a) {  // rms_norm(x [, weight] [, eps = 1e-6])
       int at = 2;
       Tensor w;
       if (a.is_tensor(2)) { w = a.tensor(2); at = 3; }
       else if (lua_isnil(a.L, 2) && !a.none(3)) at = 3;
       return a.ret(nn::rms_norm(a.tensor(1), w, a.number(at, 1e-6))); }},
    {"scaled_dot_product_attention", [](Args& a) {  // (q, k, v [, { mask, causal, dropout, scale, training }])
       Options t(a, 4, "scaled_dot_product_attention");
       nn::AttentionOptions o;
       if (t.push("mask")) {
         auto* m = ud_test<Tensor>(a.L, -1, PT_TENSOR_MT);
         if (!m) a.fail(4, std::string("scaled_dot_product_attention: mask must be a tensor, got a ") + luaL_typename(a.L, -1));
         o.mask = *m;
         lua_pop(a.L, 1);
       }
       o.causal = t.boolean("causal", false);
       o.dropout = t.number("dropout", 0.0);
       o.training = t.boolean("training", true);
       if (t.has("scale")) o.scale = t.number("scale", 1.0);
       t.finish();
       return a.ret(nn::scaled_dot_product_attention(a.tensor(1), a.tensor(2), a.tensor(3), o)); }},
    {"rotary_tables", [](Args& a) {  // rotary_tables(head_dim, positions [, { base = 10000, dtype = "float32" }]) -> cos, sin
       Options t(a, 3, "rotary_tables");
       double base = t.number("base", 10000.0);
       auto dtype = parse_dtype(t.string("dtype", "float32"));
       t.finish();
       // A count of positions (0, 1, ..., n-1) or a tensor of them.
       if (a.is_number(2) && a.integer(2) < 0)
         a.fail(2, "positions must be a count >= 0 or a tensor of positions, got " + std::to_string(a.integer(2)));
       Tensor positions = a.is_number(2) ? torch::arange(a.integer(2), torch::TensorOptions().dtype(torch::kInt64).device(
                                                 dist::World::instance().device()))
                                         : a.tensor(2);
       auto [cos, sin] = nn::rotary_tables(a.integer(1), positions, base, dtype);
       a.ret(cos);
       return 1 + a.ret(sin); }},
    {"apply_rotary", [](Args& a) { return a.ret(nn::apply_rotary(a.tensor(1), a.tensor(2), a.tensor(3))); }},
    // Experts' grouped matmul (engine/nn/grouped.hpp): (x [T, in] sorted by group, w [G, in, out], counts)
    {"grouped_matmul", [](Args& a) { return a.ret(nn::grouped_matmul(a.tensor(1), a.tensor(2), group_counts(a, 3))); }},
    {"padded_bmm_matmul", [](Args& a) {
       return a.ret(nn::padded_bmm_matmul(a.tensor(1), a.tensor(2), group_counts(a, 3))); }},
    {"looped_matmul", [](Args& a) { return a.ret(nn::looped_matmul(a.tensor(1), a.tensor(2), group_counts(a, 3))); }},
    {"grouped_matmul_path", [](Args& a) { return a.ret(nn::grouped_matmul_path(a.tensor(1), a.tensor(2))); }},

    {"clip_grad_norm", [](Args& a) {  // split parameters' norms add up over their tensor group
       auto params = params_of(a, 1);
       const double max_norm = a.number(2);
       try {
         parallel::check_max_norm(max_norm);
       } catch (const std::invalid_argument& e) {
         a.fail(2, e.what());
       }
       auto* model = ud_test<ModulePtr>(a.L, 1, PT_MODULE_MT);
       try {
         return a.ret(parallel::clip_grad_norm(params, max_norm, model ? model->get() : nullptr, "pt.nn.clip_grad_norm"));
       } catch (const std::invalid_argument& e) {
         a.fail(1, e.what());
       } }},
    {nullptr, nullptr}};

// ---- pt.models: one constructor a registered family ---------------------------------------

// A family builder's options from the Lua table (types checked by Options; keys no builder read
// are refused by finish()).
class TableOptions final : public models::OptionReader {
 public:
  explicit TableOptions(Options& t) : t_(t) {}
  int64_t integer(const char* key, int64_t fallback) override { return t_.integer(key, fallback); }
  double number(const char* key, double fallback) override { return t_.number(key, fallback); }
  bool boolean(const char* key, bool fallback) override { return t_.boolean(key, fallback); }
  std::string string(const char* key, const std::string& fallback) override { return t_.string(key, fallback); }
  std::vector<int64_t> integers(const char* key, std::vector<int64_t> fallback) override {
    return t_.ints(key, std::move(fallback));
  }

 private:
  Options& t_;
};

// pt.models.<family>(options): the family is the function's own name.
int build_model(Args& a) {
  const auto& family = models::family(a.name());
  Options t(a, 1, family.name);
  TableOptions reader(t);
  auto model = family.build(reader);
  t.finish();
  return a.ret(model);
}

// family_of(model) -> { name, type, policy } of the family whose root the model is, or nil.
int family_of(Args& a) {
  const auto* f = models::family_of_type(a.module(1)->type());
  if (!f) { lua_pushnil(a.L); return 1; }
  lua_createtable(a.L, 0, 3);
  lua_pushstring(a.L, f->name.c_str()); lua_setfield(a.L, -2, "name");
  lua_pushstring(a.L, f->type.c_str()); lua_setfield(a.L, -2, "type");
  lua_pushstring(a.L, f->default_policy.c_str()); lua_setfield(a.L, -2, "policy");
  return 1;
}

// The constructors, one a family, with addresses that stay put (closures point at them).
const std::vector<Function>& model_constructors() {
  static const std::vector<Function> fns = [] {
    std::vector<Function> out;
    for (const auto& f : models::families()) out.push_back({f.name.c_str(), build_model});
    out.push_back({nullptr, nullptr});
    return out;
  }();
  return fns;
}

const Function kModelFunctions[] = {
    {"family_of", family_of},
    {nullptr, nullptr}};

}  // namespace

void push_module(lua_State* L, const ModulePtr& m) {
  lua_getfield(L, LUA_REGISTRYINDEX, "partrain.modules");
  push_module_via(L, lua_gettop(L), m);
  lua_remove(L, -2);
}

// pt.nn.init: in-place initializers of a tensor (PyTorch's torch.nn.init), under no_grad, each
// returning the tensor. fan_in / fan_out as PyTorch computes them (dimension 1 / 0 times the rest).
namespace init = torch::nn::init;
Tensor& init_target(Args& a) {
  Tensor& t = a.tensor(1);
  if (!t.is_floating_point()) a.fail(1, "nn.init needs a floating-point tensor, got " + dtype_name(t.scalar_type()));
  return t;
}
init::FanModeType fan_mode(Args& a, const std::string& mode) {
  if (mode == "fan_in") return torch::kFanIn;
  if (mode == "fan_out") return torch::kFanOut;
  a.fail(2, "mode must be 'fan_in' or 'fan_out', got '" + mode + "'");
}
init::NonlinearityType nonlinearity(Args& a, const std::string& name) {
  if (name == "leaky_relu") return torch::kLeakyReLU;
  if (name == "relu") return torch::kReLU;
  if (name == "linear") return torch::kLinear;
  if (name == "tanh") return torch::kTanh;
  if (name == "sigmoid") return torch::kSigmoid;
  a.fail(2, "nonlinearity must be one of leaky_relu, relu, linear, tanh, sigmoid, got '" + name + "'");
}
struct Kaiming {
  double slope;
  init::FanModeType mode;
  init::NonlinearityType nonlinearity;
};
// kaiming_uniform_'s and kaiming_normal_'s options table at argument 2.
Kaiming kaiming_options(Args& a, const char* what) {
  Options o(a, 2, what);
  Kaiming k{o.number("a", 0), fan_mode(a, o.string("mode", "fan_in")),
            nonlinearity(a, o.string("nonlinearity", "leaky_relu"))};
  o.finish();
  return k;
}
// Each initializer done at once, or recorded for a deferred build's meta tensor (record_init).
int initialize(Args& a, const char* what, nn::InitOp op) {
  Tensor& t = init_target(a);
  if (!t.is_meta()) {
    try {
      nn::apply_init(t, op);
    } catch (const c10::Error& e) {
      a.fail(1, std::string(what) + ": " + e.what_without_backtrace());
    }
  }
  return record_init(a, what, op);
}
using Kind = nn::InitOp::Kind;
int kaiming(Args& a, const char* what, Kind kind) {  // (t [, { a = 0, mode = "fan_in", nonlinearity = "leaky_relu" }])
  auto k = kaiming_options(a, what);
  return initialize(a, what, {kind, init::calculate_gain(k.nonlinearity, k.slope),
                              std::holds_alternative<torch::enumtype::kFanOut>(k.mode) ? 1.0 : 0.0});
}
const Function kInit[] = {
    {"normal_", [](Args& a) { return initialize(a, "normal_", {Kind::normal, a.number(2, 0), a.number(3, 1)}); }},
    {"uniform_", [](Args& a) { return initialize(a, "uniform_", {Kind::uniform, a.number(2, 0), a.number(3, 1)}); }},
    {"constant_", [](Args& a) { return initialize(a, "constant_", {Kind::constant, a.number(2)}); }},
    {"zeros_", [](Args& a) { return initialize(a, "zeros_", {Kind::constant, 0}); }},
    {"ones_", [](Args& a) { return initialize(a, "ones_", {Kind::constant, 1}); }},
    {"xavier_uniform_", [](Args& a) { return initialize(a, "xavier_uniform_", {Kind::xavier_uniform, a.number(2, 1)}); }},
    {"xavier_normal_", [](Args& a) { return initialize(a, "xavier_normal_", {Kind::xavier_normal, a.number(2, 1)}); }},
    {"kaiming_uniform_", [](Args& a) { return kaiming(a, "kaiming_uniform_", Kind::kaiming_uniform); }},
    {"kaiming_normal_", [](Args& a) { return kaiming(a, "kaiming_normal_", Kind::kaiming_normal); }},
    {"trunc_normal_", [](Args& a) {  // (t [, mean = 0, std = 1, a = -2, b = 2]): normal, redrawn into [a, b]
       double mean = a.number(2, 0), std = a.number(3, 1), lo = a.number(4, -2), hi = a.number(5, 2);
       if (!(std > 0) || !(lo < hi)) a.fail(3, "trunc_normal_ needs std > 0 and a < b");
       return initialize(a, "trunc_normal_", {Kind::trunc_normal, mean, std, lo, hi}); }},
    {nullptr, nullptr}};

void open_nn(lua_State* L, int core) {
  // The weak cache behind push_module.
  lua_newtable(L);
  lua_newtable(L);
  lua_pushstring(L, "v");
  lua_setfield(L, -2, "__mode");
  lua_setmetatable(L, -2);
  lua_pushvalue(L, -1);
  lua_setfield(L, LUA_REGISTRYINDEX, "partrain.modules");
  int modules = lua_gettop(L);

  lua_newtable(L);
  set_functions(L, -1, kMethods);
  int methods = lua_gettop(L);

  new_metatable<ModulePtr>(L, PT_MODULE_MT);
  set_functions(L, -1, kMeta);
  lua_pushvalue(L, methods);
  lua_rawseti(L, -2, kMethodsSlot);
  lua_pushvalue(L, modules);
  lua_rawseti(L, -2, kModulesSlot);
  lua_setfield(L, core, "Module_mt");
  lua_setfield(L, core, "Module");  // the method table, so Lua can add methods
  lua_pop(L, 1);  // the cache

  set_library(L, core, "nn", kConstructors);
  lua_getfield(L, core, "nn");
  lua_newtable(L);
  set_functions(L, lua_gettop(L), kInit);
  lua_setfield(L, -2, "init");
  lua_pop(L, 1);
  set_library(L, core, "models", model_constructors().data());  // pt.models.mlp, pt.models.gpt2, ...
  set_library(L, core, "model_families", kModelFunctions);
  new_metatable<SnapshotPtr>(L, PT_SNAPSHOT_MT, kSnapshotMethods, /*keep=*/false);
}

}  // namespace partrain::lua
