// The Lua boundary's shared pieces: the one userdata pattern, the argument reader that turns bad
// arguments into C++ exceptions, and the guard that turns every C++ exception into a Lua error
// without skipping a destructor. Only bindings/ includes this header (and lua.hpp).
#pragma once

#include <lua.hpp>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "engine/nn/module.hpp"
#include "engine/util/text.hpp"

namespace partrain::dist {
class Mesh;
class ProcessGroup;
using GroupPtr = std::shared_ptr<ProcessGroup>;
}
namespace partrain::optim {
class Optimizer;
}

namespace partrain::nn {
struct InitOp;
}

namespace partrain::parallel {
class DataParallel;
}

namespace partrain::lua {

// ---- Metatable names, one a userdata type --------------------------------------------------
#define PT_TENSOR_MT "partrain.Tensor"
#define PT_MODULE_MT "partrain.Module"
#define PT_OPTIMIZER_MT "partrain.Optimizer"
#define PT_LOADER_MT "partrain.Loader"
#define PT_GROUP_MT "partrain.Group"
#define PT_MESH_MT "partrain.Mesh"

/// A Lua error that already carries its location (and maybe a traceback): re-raised unchanged.
struct Rethrow : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The message of any exception the engine or LibTorch throws, without C++ backtraces.
std::string message_of(const std::exception& e);

// ---- The userdata pattern ------------------------------------------------------------------
// A userdata holds a T by value (placement new); __gc runs ~T. `test` returns nullptr when the
// value at idx is not a T; ud_check (after Args, below) throws a Lua-style "bad argument" message.

template <class T>
T* ud_test(lua_State* L, int idx, const char* mt) {
  void* p = lua_touserdata(L, idx);
  if (!p || !lua_getmetatable(L, idx)) return nullptr;
  lua_getfield(L, LUA_REGISTRYINDEX, mt);
  bool same = lua_rawequal(L, -1, -2);
  lua_pop(L, 2);
  return same ? static_cast<T*>(p) : nullptr;
}

template <class T>
void ud_push(lua_State* L, T value, const char* mt) {
  void* p = lua_newuserdata(L, sizeof(T));
  new (p) T(std::move(value));
  lua_getfield(L, LUA_REGISTRYINDEX, mt);
  lua_setmetatable(L, -2);
}

// The finalizer: a closure over its metatable, so a script calling __gc by hand on the wrong
// value does nothing, and the metatable is cleared so a finalized value (still reachable through
// a weak-keyed table) reads as a plain userdata instead of freed memory.
template <class T>
int ud_gc(lua_State* L) {
  if (!lua_getmetatable(L, 1) || !lua_rawequal(L, -1, lua_upvalueindex(1))) return 0;
  lua_pop(L, 1);
  static_cast<T*>(lua_touserdata(L, 1))->~T();
  lua_pushnil(L);
  lua_setmetatable(L, 1);
  return 0;
}

// ---- Arguments -----------------------------------------------------------------------------

/// Reads a C function's arguments; every mistake throws with Lua's own wording:
/// "bad argument #2 to 'matmul' (tensor expected, got nil)".
class Args {
 public:
  Args(lua_State* L, const char* name) : L(L), name_(name) {}
  lua_State* const L;
  const char* name() const { return name_; }

  int top() const { return lua_gettop(L); }
  bool none(int i) const { return lua_isnoneornil(L, i); }
  bool is_number(int i) const { return lua_type(L, i) == LUA_TNUMBER; }
  bool is_table(int i) const { return lua_type(L, i) == LUA_TTABLE; }
  bool is_string(int i) const { return lua_type(L, i) == LUA_TSTRING; }
  bool is_tensor(int i) const { return ud_test<torch::Tensor>(L, i, PT_TENSOR_MT) != nullptr; }

  [[noreturn]] void fail(int i, const std::string& what) const;
  [[noreturn]] void expected(int i, const char* what) const;
  /// Refuses argument i, a list of n `what` ("tensors"), when its table has a stray key.
  void list_only(int i, int n, const char* what) const;

  torch::Tensor& tensor(int i) const;
  /// The tensor at i for what reads only its shape and type (no values): also a ZeRO-3
  /// parameter whose unit is not gathered, which tensor() refuses.
  torch::Tensor& tensor_shape(int i) const;
  /// Refuses argument i when `t` is a ZeRO-3 parameter whose unit is not gathered (no values to
  /// read); `element` names a table's element in the message.
  void check_values(int i, const torch::Tensor& t, const std::string& element = "") const;
  /// A tensor, or a number turned into a 0-dim tensor like `like`.
  torch::Tensor tensor_or_number(int i, const torch::Tensor& like) const;
  double number(int i) const;
  double number(int i, double fallback) const { return none(i) ? fallback : number(i); }
  int64_t integer(int i) const;
  int64_t integer(int i, int64_t fallback) const { return none(i) ? fallback : integer(i); }
  /// An integer that fits in 32 bits (a size, a rank, a count the engine holds as int): larger
  /// ones are refused as given, never cut to their low bits (2^32 + 1 is not 1).
  int int32(int i) const;
  int int32(int i, int fallback) const { return none(i) ? fallback : int32(i); }
  bool boolean(int i) const;
  bool boolean(int i, bool fallback) const { return none(i) ? fallback : boolean(i); }
  std::string string(int i) const;
  std::string string(int i, const std::string& fallback) const {
    return none(i) ? fallback : string(i);
  }
  at::Scalar scalar(int i) const;
  /// Integers from a table at i ({2, 3}) or from the numbers i, i+1, ... ; `end` is set to the
  /// first index after them.
  std::vector<int64_t> ints(int i, int* end = nullptr) const;
  /// One dimension or a table of them.
  std::vector<int64_t> dims(int i) const;
  /// A table of tensors; `values`: each is read (a ZeRO-3 parameter outside its gather is refused,
  /// as tensor(i) refuses it), else only their shapes and flags are (an optimizer's parameters).
  std::vector<torch::Tensor> tensors(int i, bool values = true) const;
  std::shared_ptr<nn::Module>& module(int i) const;

  int ret() const { return 0; }
  int ret(const torch::Tensor& t) const;
  int ret(const std::vector<torch::Tensor>& ts) const;  // as a Lua array
  int ret(double x) const { lua_pushnumber(L, x); return 1; }
  int ret(bool b) const { lua_pushboolean(L, b); return 1; }
  int ret(const std::string& s) const { lua_pushlstring(L, s.data(), s.size()); return 1; }
  int ret(const std::shared_ptr<nn::Module>& m) const;

 private:
  const char* name_;
};

/// The T in the userdata at argument `i` of metatable `mt`, or a "bad argument" error naming `what`.
template <class T>
T& ud_check(const Args& a, int i, const char* mt, const char* what) {
  auto* p = ud_test<T>(a.L, i, mt);
  if (!p) a.expected(i, what);
  return *p;
}

/// Reads an options table field by field; finish() rejects keys nobody read, listing the ones
/// that exist: "unknown option 'biass' for Linear (expected: bias)".
class Options {
 public:
  /// The table at `idx` (absent or nil reads as empty) configures `what`.
  Options(const Args& args, int idx, std::string what);
  bool has(const char* key);
  double number(const char* key, double fallback);
  int64_t integer(const char* key, int64_t fallback);
  /// As integer(), refusing one that does not fit in 32 bits.
  int int32(const char* key, int fallback);
  bool boolean(const char* key, bool fallback);
  std::string string(const char* key, const std::string& fallback);
  std::vector<int64_t> ints(const char* key, std::vector<int64_t> fallback);
  std::vector<double> numbers(const char* key, std::vector<double> fallback);
  std::vector<std::string> strings(const char* key, std::vector<std::string> fallback);
  /// A nested options table, read by the same rules; its keys are named "outer.inner".
  Options table(const char* key);
  /// Pushes the raw value of `key` (recording the key) and returns true; false, pushing nothing,
  /// when it is nil.
  bool push(const char* key);
  /// Names accepted by another reader of the same table (the Lua layer above): listed as
  /// expected, and not refused.
  void also(const std::vector<std::string>& keys);
  void finish();
  lua_State* state() const { return L; }

 private:
  Options(lua_State* L, int idx, std::string what, std::string prefix);
  [[noreturn]] void wrong(const char* key, const char* expected);
  lua_State* L;
  int idx_;
  std::string what_, prefix_;
  std::vector<std::string> known_;
};

// ---- Functions -----------------------------------------------------------------------------

using Body = int (*)(Args&);
struct Function {
  const char* name;
  Body body;
};

/// Pushes `fn` as a Lua C function: arguments read through Args, exceptions raised as Lua errors
/// prefixed with the calling Lua file:line.
void push_function(lua_State* L, const Function& fn);
/// Sets every function of `fns` (terminated by {nullptr, nullptr}) into the table at `table`.
void set_functions(lua_State* L, int table, const Function* fns);

/// Sets a new table of `fns` as field `name` of the table at `table`.
void set_library(lua_State* L, int table, const char* name, const Function* fns);

/// Creates the metatable `mt` for userdata holding a T, leaves it on the stack, and sets its
/// `__gc` to ~T. With `methods`, `__index` is a table of them and their `__tostring` (if any)
/// becomes the metatable's. With keep = false the metatable is popped.
template <class T>
void new_metatable(lua_State* L, const char* mt, const Function* methods = nullptr, bool keep = true) {
  luaL_newmetatable(L, mt);
  lua_pushvalue(L, -1);
  lua_pushcclosure(L, ud_gc<T>, 1);
  lua_setfield(L, -2, "__gc");
  if (!methods) return;
  lua_newtable(L);
  set_functions(L, -1, methods);
  lua_getfield(L, -1, "__tostring");
  lua_setfield(L, -3, "__tostring");
  lua_setfield(L, -2, "__index");
  if (!keep) lua_pop(L, 1);
}

/// The state's main thread (a coroutine may be gone by the time an engine object needs Lua).
lua_State* main_thread(lua_State* L);

/// The Lua thread running the innermost partrain C function (a coroutine, maybe), or `fallback`
/// outside of one: engine callbacks into Lua run on it.
lua_State* active_state(lua_State* fallback);

/// "file:line" of the innermost Lua frame above the running C function that is not in partrain's
/// own Lua library (a user's script or policy), so errors and collectives name the user's line;
/// the innermost library line when every frame is the library's (then `is_user` is false); ""
/// when none is Lua.
std::string user_location(lua_State* L, bool* is_user = nullptr);
/// The same into `buf` (`n` bytes, terminated), allocating nothing (every collective asks), from
/// stack level `first` (1 above a C function; 0 in a hook, the function running). Returns
/// whether the line is the user's.
bool user_location(lua_State* L, char* buf, size_t n, int first = 1);

/// The key at stack index k as a message shows it: 'name' (a short printable string), [3], or
/// what it is ([a boolean], [a string of 900 bytes]); never the raw bytes of a long or
/// unprintable string. `prefix` goes before the name ('schedule.kind', schedule.[3]).
std::string key_text(lua_State* L, int k, const std::string& prefix = "");
/// The first key of the table at `t` that reading it as a list of n elements would skip (a name,
/// or an index outside 1..n after a hole), as key_text shows it; "" when there is none. A list
/// with such a key would lose it silently: { 2, 3, dtype = "float64" } is no shape.
std::string stray_key(lua_State* L, int t, int n);
/// Throws "<what>, but the table also has the key <key>" when the table at `t` has a stray key
/// (see stray_key): for a list read by partrain's own readers.
void refuse_stray_key(lua_State* L, int t, int n, const std::string& what);

/// A Lua value held in the registry for as long as an engine object needs it; released when
/// dropped unless the state has closed first. Calls go through active_state(main()).
class LuaRef {
 public:
  LuaRef(lua_State* L, int index) : L_(main_thread(L)) {
    lua_getfield(L, LUA_REGISTRYINDEX, "partrain.alive");
    alive_ = *static_cast<std::shared_ptr<bool>*>(lua_touserdata(L, -1));
    lua_pop(L, 1);
    lua_pushvalue(L, index);
    ref_ = luaL_ref(L, LUA_REGISTRYINDEX);
  }
  LuaRef(const LuaRef&) = delete;
  LuaRef& operator=(const LuaRef&) = delete;
  ~LuaRef() {
    if (*alive_) luaL_unref(L_, LUA_REGISTRYINDEX, ref_);  // the main thread lives as long as the state
  }
  bool alive() const { return *alive_; }
  lua_State* main() const { return L_; }
  void push(lua_State* L) const { lua_rawgeti(L, LUA_REGISTRYINDEX, ref_); }

 private:
  lua_State* L_;
  std::shared_ptr<bool> alive_;
  int ref_ = LUA_NOREF;
};

/// Calls the function below nargs arguments in protected mode. On error returns false and sets
/// `error` to the message (with a traceback when `traceback`); the stack holds the results on
/// success, nothing on failure.
bool pcall(lua_State* L, int nargs, int nresults, std::string* error, bool traceback = false);

// ---- Per-area registration (each in its own file) ------------------------------------------
void open_tensor(lua_State* L, int core);
void open_nn(lua_State* L, int core);
void open_optim(lua_State* L, int core);
void open_data(lua_State* L, int core);
void open_dist(lua_State* L, int core);
void open_parallel(lua_State* L, int core);  // called by open_dist
void open_plan(lua_State* L, int core);
void open_repl(lua_State* L, int core);
void open_ckpt(lua_State* L, int core);
void open_files(lua_State* L, int core);
void open_policy(lua_State* L, int core);   // core.tp._apply_split (policy_loader.cpp); after open_dist

/// The name (as in `named`) of a tensor a live optimizer steps, or "": replacing it would leave
/// that optimizer stepping the old tensor. Optimizers the script dropped are collected first.
std::string held_by_optimizer(lua_State* L, const torch::OrderedDict<std::string, torch::Tensor>& named);

/// The module an optimizer was made from (or the parallelized model whose parameters it was made
/// from), or nullptr: one made from a table of other tensors, or whose model is gone.
nn::ModulePtr model_of_optimizer(const optim::Optimizer* opt);

/// Pushes a process group (nil for none).
int push_group(lua_State* L, const dist::GroupPtr& g);
/// The mesh at idx, as its owning pointer, or nullptr.
std::shared_ptr<dist::Mesh>* mesh_test(lua_State* L, int idx);
/// When the value at idx is a mesh: this rank's data index and the data size (and, when asked,
/// its context index and the context size).
bool mesh_data_shard(lua_State* L, int idx, int64_t* rank, int64_t* count, int64_t* context_rank = nullptr,
                     int64_t* context_count = nullptr);
/// The mesh at idx, or nullptr when the value there is not one.
const dist::Mesh* mesh_at(lua_State* L, int idx);

/// Pushes a Lua array of numbers (a shape, a list of ranks).
template <class Ints>
int push_ints(lua_State* L, const Ints& xs) {
  lua_createtable(L, static_cast<int>(xs.size()), 0);
  int i = 0;
  for (auto x : xs) {
    lua_pushnumber(L, static_cast<double>(x));
    lua_rawseti(L, -2, ++i);
  }
  return 1;
}

/// Pushes a tensor (a new userdata each time).
void push_tensor(lua_State* L, torch::Tensor t);
/// Pushes a module, reusing the userdata already made for it so identity holds in Lua.
void push_module(lua_State* L, const std::shared_ptr<nn::Module>& m);
/// Parses a dtype name ("float32", "float", "int64", "long", "bool", ...); throws on others.
c10::ScalarType parse_dtype(const std::string& name);
bool is_dtype_name(const std::string& name);
using util::dtype_name;

/// Argument 1's in-place initialization, already done: recorded too when argument 1 is a meta
/// tensor of a deferred build (not the planner's), to be replayed when it is materialized
/// (nn::init_). Returns argument 1.
int record_init(Args& a, const char* what, const nn::InitOp& op);
/// Refuses `what` on argument 1 when it is a meta tensor of a deferred build: it reads another
/// tensor's values, which materialization cannot replay.
void refuse_deferred(Args& a, const char* what);

}  // namespace partrain::lua
