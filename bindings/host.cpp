// The LuaJIT host and the boundary's shared machinery: argument reading, options tables, the
// exception guard and the protected call (see lua.hpp and host.hpp).
#include "bindings/host.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "bindings/lua.hpp"
#include "engine/dist/ledger.hpp"
#include "engine/dist/world.hpp"
#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/plan/plan.hpp"
#include "engine/util/files.hpp"
#include "engine/util/text.hpp"

namespace partrain::lua {

std::string message_of(const std::exception& e) { return util::message_of(e); }

// ---- Args ----------------------------------------------------------------------------------

void Args::fail(int i, const std::string& what) const {
  std::ostringstream msg;
  msg << "bad argument #" << i << " to '" << name_ << "' (" << what << ")";
  throw std::invalid_argument(msg.str());
}

void Args::expected(int i, const char* what) const {
  const char* got = ud_test<torch::Tensor>(L, i, PT_TENSOR_MT)   ? "tensor"
                    : ud_test<nn::ModulePtr>(L, i, PT_MODULE_MT) ? "module"
                                                                 : luaL_typename(L, i);
  fail(i, std::string(what) + " expected, got " + got);
}

torch::Tensor& Args::tensor(int i) const {
  auto* t = ud_test<torch::Tensor>(L, i, PT_TENSOR_MT);
  if (!t) expected(i, "tensor");
  // Planning: a tensor made on the CPU (a batch, say) becomes a meta tensor of its shape the
  // first time it reaches the engine, so it meets the meta model's parameters.
  if (plan::planning() && t->defined() && !t->is_meta()) {
    bool grad = t->requires_grad();
    *t = torch::empty(t->sizes(), t->options().device(torch::kMeta).requires_grad(false));
    if (grad) t->requires_grad_(true);
  }
  return *t;
}

torch::Tensor Args::tensor_or_number(int i, const torch::Tensor& like) const {
  if (!is_number(i)) return tensor(i);
  // A "wrapped number", as PyTorch makes of a Python scalar: int64 * 0.5 promotes to float, and
  // float16 * 3 stays float16.
  auto t = c10::scalar_to_tensor(scalar(i), like.device());
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

double Args::number(int i) const {
  if (!is_number(i)) expected(i, "number");
  return lua_tonumber(L, i);
}

namespace {
// Whether x is a whole number an int64_t holds (casting one that is not is undefined).
bool whole_int64(double x) { return x >= -0x1p63 && x < 0x1p63 && x == std::trunc(x); }
}  // namespace

std::string key_text(lua_State* L, int k, const std::string& prefix) {
  std::ostringstream key;
  switch (lua_type(L, k)) {
    case LUA_TNUMBER: key << prefix << std::setprecision(17) << "[" << lua_tonumber(L, k) << "]"; break;
    case LUA_TSTRING: {
      size_t len;
      const char* text = lua_tolstring(L, k, &len);  // a string already: the traversal is safe
      bool plain = len > 0 && len <= 40;
      for (size_t c = 0; plain && c < len; ++c) plain = text[c] >= 0x20 && text[c] < 0x7f;
      if (plain) key << "'" << prefix << std::string(text, len) << "'";
      else key << prefix << "[a string of " << len << " bytes" << (len > 0 && len <= 40 ? ", not all printable" : "") << "]";
      break;
    }
    default: key << prefix << "[a " << luaL_typename(L, k) << "]";
  }
  return key.str();
}

std::string stray_key(lua_State* L, int t, int n) {
  if (t < 0 && t > LUA_REGISTRYINDEX) t = lua_gettop(L) + t + 1;
  lua_pushnil(L);
  while (lua_next(L, t)) {
    lua_pop(L, 1);  // the value
    if (lua_type(L, -1) == LUA_TNUMBER) {
      double k = lua_tonumber(L, -1);
      if (k >= 1 && k <= n && k == std::trunc(k)) continue;
    }
    std::string key = key_text(L, -1);
    lua_pop(L, 1);  // the key: the traversal ends here
    return key;
  }
  return "";
}

void refuse_stray_key(lua_State* L, int t, int n, const std::string& what) {
  std::string stray = stray_key(L, t, n);
  if (!stray.empty()) throw std::invalid_argument(what + ", but the table also has the key " + stray);
}

void Args::list_only(int i, int n, const char* what) const {
  std::string stray = stray_key(L, i, n);
  if (!stray.empty()) fail(i, std::string("a list of ") + what + " expected, but the table also has the key " + stray);
}

int64_t Args::integer(int i) const {
  if (!is_number(i)) expected(i, "integer");
  double x = lua_tonumber(L, i);
  if (!whole_int64(x)) {
    std::ostringstream msg;
    msg << std::setprecision(17) << "integer expected, got " << x;
    fail(i, msg.str());
  }
  return static_cast<int64_t>(x);
}

int Args::int32(int i) const {
  int64_t v = integer(i);
  if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max())
    fail(i, "integer out of range (-2147483648 to 2147483647), got " + std::to_string(v));
  return static_cast<int>(v);
}

bool Args::boolean(int i) const {
  if (lua_type(L, i) != LUA_TBOOLEAN) expected(i, "boolean");
  return lua_toboolean(L, i);
}

std::string Args::string(int i) const {
  if (!is_string(i)) expected(i, "string");
  size_t n;
  const char* s = lua_tolstring(L, i, &n);
  return std::string(s, n);
}

at::Scalar Args::scalar(int i) const {
  if (lua_type(L, i) == LUA_TBOOLEAN) return at::Scalar(static_cast<bool>(lua_toboolean(L, i)));
  double x = number(i);
  if (x == static_cast<double>(static_cast<int64_t>(x)) && std::abs(x) < 9.0e15)
    return at::Scalar(static_cast<int64_t>(x));
  return at::Scalar(x);
}

std::vector<int64_t> Args::ints(int i, int* end) const {
  std::vector<int64_t> out;
  if (is_table(i)) {
    int n = static_cast<int>(lua_objlen(L, i));
    for (int k = 1; k <= n; ++k) {
      lua_rawgeti(L, i, k);
      bool ok = lua_type(L, -1) == LUA_TNUMBER;
      double x = lua_tonumber(L, -1);
      lua_pop(L, 1);
      if (!ok || !whole_int64(x)) fail(i, "table of integers expected, element " + std::to_string(k) + " is not one");
      out.push_back(static_cast<int64_t>(x));
    }
    list_only(i, n, "integers");
    if (end) *end = i + 1;
    return out;
  }
  int k = i;
  while (is_number(k)) out.push_back(integer(k++));
  if (end) *end = k;
  return out;
}

std::vector<int64_t> Args::dims(int i) const {
  if (is_table(i)) return ints(i);
  return {integer(i)};
}

std::vector<torch::Tensor> Args::tensors(int i) const {
  if (!is_table(i)) expected(i, "table of tensors");
  std::vector<torch::Tensor> out;
  int n = static_cast<int>(lua_objlen(L, i));
  for (int k = 1; k <= n; ++k) {
    lua_rawgeti(L, i, k);
    auto* t = ud_test<torch::Tensor>(L, -1, PT_TENSOR_MT);
    lua_pop(L, 1);
    if (!t) fail(i, "table of tensors expected, element " + std::to_string(k) + " is not a tensor");
    out.push_back(*t);
  }
  list_only(i, n, "tensors");
  return out;
}

std::shared_ptr<nn::Module>& Args::module(int i) const {
  auto* m = ud_test<nn::ModulePtr>(L, i, PT_MODULE_MT);
  if (!m) expected(i, "module");
  // overlap_sync_param: a parallelized model's parameters are complete before Lua touches it.
  if (*m)
    if (auto owner = (*m)->parallel_owner()) owner->sync_params();
  return *m;
}

int Args::ret(const torch::Tensor& t) const {
  if (!t.defined()) {
    lua_pushnil(L);
    return 1;
  }
  // A result computed from vocabulary-split logits with as many elements and the same last
  // dimension (logits / temperature, :float(), :clone()) is split logits too: mark it, so the
  // ops that read across the vocabulary still recognize it. (Views carry the mark already.)
  if (parallel::split_logits_marked() && t.dim() >= 1 && !parallel::split_logits_of(t)) {
    for (int i = 1; i <= top(); ++i) {
      auto* u = ud_test<torch::Tensor>(L, i, PT_TENSOR_MT);
      if (!u || !u->defined() || u->dim() < 1 || u->numel() != t.numel() || u->size(-1) != t.size(-1)) continue;
      if (auto s = parallel::split_logits_of(*u)) {
        parallel::mark_split_logits(t, *s);
        break;
      }
    }
  }
  push_tensor(L, t);
  return 1;
}

int Args::ret(const std::vector<torch::Tensor>& ts) const {
  lua_createtable(L, static_cast<int>(ts.size()), 0);
  for (size_t k = 0; k < ts.size(); ++k) {
    push_tensor(L, ts[k]);
    lua_rawseti(L, -2, static_cast<int>(k + 1));
  }
  return 1;
}

int Args::ret(const std::shared_ptr<nn::Module>& m) const {
  push_module(L, m);
  return 1;
}

// ---- Options -------------------------------------------------------------------------------

Options::Options(const Args& args, int idx, std::string what)
    : Options(args.L, idx, std::move(what), "") {
  if (!args.none(idx) && !args.is_table(idx)) args.expected(idx, "options table");
}

Options::Options(lua_State* L, int idx, std::string what, std::string prefix)
    : L(L),
      idx_(idx != 0 && lua_type(L, idx) == LUA_TTABLE ? (idx > 0 ? idx : lua_gettop(L) + idx + 1) : 0),
      what_(std::move(what)), prefix_(std::move(prefix)) {}

bool Options::push(const char* key) {
  if (std::find(known_.begin(), known_.end(), key) == known_.end()) known_.emplace_back(key);
  if (!idx_) return false;
  lua_pushstring(L, key);
  lua_rawget(L, idx_);  // options are plain data: no metamethods
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    return false;
  }
  return true;
}

void Options::wrong(const char* key, const char* expected) {
  std::string got = luaL_typename(L, -1);
  if (lua_type(L, -1) == LUA_TNUMBER) {
    std::ostringstream s;
    s << std::setprecision(17) << "number " << lua_tonumber(L, -1);
    got = s.str();
  } else if (lua_type(L, -1) == LUA_TSTRING) {
    got = std::string("string '") + lua_tostring(L, -1) + "'";
  }
  lua_pop(L, 1);
  throw std::invalid_argument("option '" + prefix_ + key + "' for " + what_ + " must be " +
                              expected + ", got " + got);
}

bool Options::has(const char* key) {
  if (!push(key)) return false;
  lua_pop(L, 1);
  return true;
}

double Options::number(const char* key, double fallback) {
  if (!push(key)) return fallback;
  if (lua_type(L, -1) != LUA_TNUMBER) wrong(key, "a number");
  double x = lua_tonumber(L, -1);
  lua_pop(L, 1);
  return x;
}

int64_t Options::integer(const char* key, int64_t fallback) {
  if (!push(key)) return fallback;
  double x = lua_tonumber(L, -1);
  if (lua_type(L, -1) != LUA_TNUMBER || !whole_int64(x)) wrong(key, "an integer");
  lua_pop(L, 1);
  return static_cast<int64_t>(x);
}

int Options::int32(const char* key, int fallback) {
  if (!push(key)) return fallback;
  double x = lua_tonumber(L, -1);
  if (lua_type(L, -1) != LUA_TNUMBER || !whole_int64(x) || x < std::numeric_limits<int>::min() ||
      x > std::numeric_limits<int>::max())
    wrong(key, "an integer from -2147483648 to 2147483647");
  lua_pop(L, 1);
  return static_cast<int>(x);
}

bool Options::boolean(const char* key, bool fallback) {
  if (!push(key)) return fallback;
  if (lua_type(L, -1) != LUA_TBOOLEAN) wrong(key, "a boolean");
  bool b = lua_toboolean(L, -1);
  lua_pop(L, 1);
  return b;
}

std::string Options::string(const char* key, const std::string& fallback) {
  if (!push(key)) return fallback;
  if (lua_type(L, -1) != LUA_TSTRING) wrong(key, "a string");
  std::string s = lua_tostring(L, -1);
  lua_pop(L, 1);
  return s;
}

std::vector<double> Options::numbers(const char* key, std::vector<double> fallback) {
  if (!push(key)) return fallback;
  if (lua_type(L, -1) != LUA_TTABLE) wrong(key, "a table of numbers");
  std::vector<double> out;
  int n = static_cast<int>(lua_objlen(L, -1));
  for (int k = 1; k <= n; ++k) {
    lua_rawgeti(L, -1, k);
    bool ok = lua_type(L, -1) == LUA_TNUMBER;
    double x = lua_tonumber(L, -1);
    if (!ok) {
      std::string got = luaL_typename(L, -1);
      lua_pop(L, 2);
      throw std::invalid_argument("option '" + prefix_ + key + "' for " + what_ + " must be a table of numbers, "
                                  "element " + std::to_string(k) + " is a " + got);
    }
    lua_pop(L, 1);
    out.push_back(x);
  }
  refuse_stray_key(L, -1, n, "option '" + prefix_ + key + "' for " + what_ + " must be a list of numbers");
  lua_pop(L, 1);
  return out;
}

std::vector<int64_t> Options::ints(const char* key, std::vector<int64_t> fallback) {
  if (!has(key)) return fallback;
  std::vector<int64_t> out;
  auto xs = numbers(key, {});
  for (size_t k = 0; k < xs.size(); ++k) {
    if (!whole_int64(xs[k])) {
      std::ostringstream got;
      got << std::setprecision(17) << xs[k];
      throw std::invalid_argument("option '" + prefix_ + key + "' for " + what_ + " must be a table of integers, "
                                  "element " + std::to_string(k + 1) + " is " + got.str());
    }
    out.push_back(static_cast<int64_t>(xs[k]));
  }
  return out;
}

Options Options::table(const char* key) {
  if (!push(key)) return Options(L, 0, what_, prefix_ + key + ".");
  if (lua_type(L, -1) != LUA_TTABLE) wrong(key, "a table");
  int abs = lua_gettop(L);  // left on the stack for the nested reader; the caller's frame pops it
  return Options(L, abs, what_, prefix_ + key + ".");
}

void Options::also(const std::vector<std::string>& keys) {
  known_.insert(known_.end(), keys.begin(), keys.end());
}

void Options::finish() {
  if (!idx_) return;
  lua_pushnil(L);
  while (lua_next(L, idx_)) {
    lua_pop(L, 1);
    std::string key = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : "";
    bool known = false;
    for (const auto& k : known_) known = known || k == key;
    if (!known) {
      std::string name = key_text(L, -1, prefix_);  // a long or unprintable name is described, not echoed
      lua_pop(L, 1);
      std::string list;
      for (const auto& k : known_) list += (list.empty() ? "" : ", ") + k;
      throw std::invalid_argument("unknown option " + name + " for " + what_ +
                                  (list.empty() ? " (it takes no options)" : " (expected: " + list + ")"));
    }
  }
}

// ---- Functions and the guard ---------------------------------------------------------------

namespace {

// The name of partrain's own Lua file a frame runs, relative to where partrain keeps it
// ("partrain/init.lua", "policies/gpt2.lua"), or nullptr when the frame runs someone else's:
// the library and the shipped policies are partrain's, so their errors and collectives are
// named by the user's line that led into them. A user's own policy file is the user's.
const char* library_file(const lua_Debug& ar) {
  static const Paths paths = find_paths();
  static const std::string roots[] = {"@" + paths.lua + "/", "@" + paths.policies + "/"};
  static const char* const folders[] = {"partrain/", "policies/"};
  if (!ar.source) return nullptr;
  for (int i = 0; i < 2; ++i) {
    const std::string& root = roots[i];
    if (std::strncmp(ar.source, root.c_str(), root.size()) != 0) continue;
    const char* rest = ar.source + root.size();
    if (std::strncmp(rest, folders[i], std::strlen(folders[i])) == 0) return rest;
  }
  return nullptr;
}

bool in_library(const lua_Debug& ar) { return library_file(ar) != nullptr; }

thread_local lua_State* active = nullptr;

// Every C function partrain exposes runs through here. The try block holds no Lua call that can
// raise, and lua_error runs only after the handler: every C++ object is destroyed by then.
int dispatch(lua_State* L) {
  auto* fn = static_cast<const Function*>(lua_touserdata(L, lua_upvalueindex(1)));
  struct Active {  // restores the outer thread however this frame is left
    lua_State* outer = active;
    explicit Active(lua_State* L) { active = L; }
    ~Active() { active = outer; }
  };
  try {
    Active scope(L);
    Args args(L, fn->name);
    return fn->body(args);
  } catch (const Rethrow& e) {
    lua_pushstring(L, e.what());
  } catch (const std::exception& e) {
    std::string msg = user_location(L);
    msg = (msg.empty() ? "" : msg + ": ") + message_of(e);
    lua_pushlstring(L, msg.data(), msg.size());
  }
  return lua_error(L);
}

// An error located inside partrain's own Lua library (a check raised at the wrong level, or a
// bug there) is moved to the user's line that led to it, keeping where it was raised:
// "train.lua:7: attempt to index local 'self' (a number value) (raised in partrain/init.lua:90)".
void relocate_library_error(lua_State* L) {
  size_t n;
  const char* text = lua_tolstring(L, 1, &n);
  std::string msg(text, n);
  lua_Debug ar;
  for (int level = 1; level < 32 && lua_getstack(L, level, &ar); ++level) {
    if (!lua_getinfo(L, "Sl", &ar) || !in_library(ar)) continue;
    std::string prefix = std::string(ar.short_src) + ":";
    if (msg.compare(0, prefix.size(), prefix) != 0) continue;
    size_t end = msg.find(": ", prefix.size());
    if (end == std::string::npos) return;
    bool is_user = false;
    std::string user = user_location(L, &is_user);
    if (!is_user) return;  // only library frames: keep the library's line
    msg = user + ": " + msg.substr(end + 2) + " (raised in " + library_file(ar) + ":" +
          msg.substr(prefix.size(), end - prefix.size()) + ")";
    lua_pushlstring(L, msg.data(), msg.size());
    lua_replace(L, 1);
    return;
  }
}

// An error object that is not a string is replaced by its __tostring, called under protection:
// one that raises or returns no text is described by its type instead, where a raise inside the
// handler would have left Lua's bare "error in error handling".
void describe_error_object(lua_State* L) {
  if (lua_isstring(L, 1)) return;
  const char* type = luaL_typename(L, 1);
  if (!luaL_getmetafield(L, 1, "__tostring")) {
    lua_pushfstring(L, "(error object is a %s value)", type);
  } else {
    lua_pushvalue(L, 1);
    int status = lua_pcall(L, 1, 1, 0);
    if (status == 0 && lua_isstring(L, -1)) {
      // its own text
    } else if (status == 0) {
      lua_pushfstring(L, "(error object is a %s value; its __tostring returned a %s)", type,
                      luaL_typename(L, -1));
    } else {
      const char* why = lua_isstring(L, -1) ? lua_tostring(L, -1) : luaL_typename(L, -1);
      lua_pushfstring(L, "(error object is a %s value; its __tostring raised: %s)", type, why);
    }
  }
  lua_replace(L, 1);
  lua_settop(L, 1);
}

// The frames of the user's own code, outermost last, as Lua's traceback writes them; partrain's
// Lua files and C functions are left out (the error already names the user's line). Empty when
// they hold no more than the frame the error names.
std::string user_traceback(lua_State* L) {
  std::vector<std::string> frames;
  lua_Debug ar;
  for (int level = 1; lua_getstack(L, level, &ar) && frames.size() < 24; ++level) {
    if (!lua_getinfo(L, "Snl", &ar) || ar.currentline <= 0 || in_library(ar)) continue;
    std::string what = ar.name && *ar.name ? "in function '" + std::string(ar.name) + "'"
                       : *ar.what == 'm'   ? std::string("in main chunk")
                                           : "in function <" + std::string(ar.short_src) + ":" +
                                                 std::to_string(ar.linedefined) + ">";
    frames.push_back("\t" + std::string(ar.short_src) + ":" + std::to_string(ar.currentline) + ": " + what);
  }
  if (frames.size() <= 1) return "";
  std::string out = "\nstack traceback:";
  for (const auto& f : frames) out += "\n" + f;
  return out;
}

// PARTRAIN_TRACEBACK=1: Lua's whole traceback, partrain's own frames included (for debugging
// partrain itself); otherwise the user's frames only.
bool full_traceback() {
  const char* env = std::getenv("PARTRAIN_TRACEBACK");
  return env && std::string(env) == "1";
}

int traceback_handler(lua_State* L) {
  describe_error_object(L);
  relocate_library_error(L);
  if (!full_traceback() && lua_type(L, 1) == LUA_TSTRING) {
    std::string message = lua_tostring(L, 1);
    message += user_traceback(L);
    lua_pushlstring(L, message.data(), message.size());
    return 1;
  }
  lua_getfield(L, LUA_REGISTRYINDEX, "partrain.traceback");
  lua_pushvalue(L, 1);
  lua_pushinteger(L, 2);
  lua_call(L, 2, 1);
  return 1;
}

int plain_handler(lua_State* L) {
  describe_error_object(L);
  relocate_library_error(L);
  lua_settop(L, 1);
  return 1;
}

}  // namespace

lua_State* active_state(lua_State* fallback) { return active ? active : fallback; }

bool user_location(lua_State* L, char* buf, size_t n, int first) {
  if (n == 0) return false;
  buf[0] = '\0';
  bool fallback = false;
  lua_Debug ar;
  for (int level = first; level < first + 32 && lua_getstack(L, level, &ar); ++level) {
    if (!lua_getinfo(L, "Sl", &ar) || ar.currentline <= 0) continue;  // a C function
    if (in_library(ar)) {
      if (!fallback) std::snprintf(buf, n, "%s:%d", ar.short_src, ar.currentline);
      fallback = true;
      continue;
    }
    std::snprintf(buf, n, "%s:%d", ar.short_src, ar.currentline);
    return true;
  }
  return false;
}

std::string user_location(lua_State* L, bool* is_user) {
  if (is_user) *is_user = false;
  std::string fallback;
  lua_Debug ar;
  for (int level = 1; level < 32 && lua_getstack(L, level, &ar); ++level) {
    if (!lua_getinfo(L, "Sl", &ar) || ar.currentline <= 0) continue;  // a C function
    std::string where = std::string(ar.short_src) + ":" + std::to_string(ar.currentline);
    if (in_library(ar)) {
      if (fallback.empty()) fallback = where;
      continue;
    }
    if (is_user) *is_user = true;
    return where;
  }
  return fallback;
}

lua_State* main_thread(lua_State* L) {
  lua_getfield(L, LUA_REGISTRYINDEX, "partrain.main");
  auto* main = static_cast<lua_State*>(lua_touserdata(L, -1));
  lua_pop(L, 1);
  return main ? main : L;
}

void push_function(lua_State* L, const Function& fn) {
  lua_pushlightuserdata(L, const_cast<Function*>(&fn));
  lua_pushcclosure(L, dispatch, 1);
}

void set_functions(lua_State* L, int table, const Function* fns) {
  table = table < 0 ? lua_gettop(L) + table + 1 : table;
  for (; fns->name; ++fns) {
    push_function(L, *fns);
    lua_setfield(L, table, fns->name);
  }
}

void set_library(lua_State* L, int table, const char* name, const Function* fns) {
  table = table < 0 ? lua_gettop(L) + table + 1 : table;
  lua_newtable(L);
  set_functions(L, -1, fns);
  lua_setfield(L, table, name);
}

bool pcall(lua_State* L, int nargs, int nresults, std::string* error, bool traceback) {
  int base = lua_gettop(L) - nargs;  // the function's index
  lua_pushcfunction(L, traceback ? traceback_handler : plain_handler);
  lua_insert(L, base);
  int status = lua_pcall(L, nargs, nresults, base);
  lua_remove(L, base);
  if (status == 0) return true;
  if (error) *error = lua_isstring(L, -1) ? lua_tostring(L, -1) : "(error without a message)";
  lua_pop(L, 1);
  return false;
}

// ---- Host ----------------------------------------------------------------------------------

namespace {

bool is_dir(const std::string& p) { return !p.empty() && access(p.c_str(), F_OK) == 0; }

std::string exe_dir() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  std::string path(buf, n);
  return path.substr(0, path.find_last_of('/'));
}

std::string dir_of(const std::string& file) {
  auto slash = file.find_last_of('/');
  return slash == std::string::npos ? "." : file.substr(0, slash);
}

// The backstop of partrain.policy's bounded calls. Lua's hooks interrupt user code past its time
// limit, but not code they cannot reach: a loop in an xpcall message handler (LuaJIT runs the
// handler of an error raised by a hook with hooks off) or a long C call. A deadline armed here
// ends the process with its message once it has passed, so such code is an error, not a hang.
class Deadlines {
 public:
  using Clock = std::chrono::steady_clock;
  static Deadlines& instance() {
    static auto* d = new Deadlines();  // never destroyed: its thread may outlive static destructors
    return *d;
  }
  int64_t arm(double seconds, std::string message) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!started_) {
      std::thread([this] { watch(); }).detach();
      started_ = true;
    }
    const auto at = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    armed_[++next_] = {at, std::move(message)};
    changed_.notify_all();
    return next_;
  }
  void note(int64_t token, std::string message) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = armed_.find(token); it != armed_.end()) it->second.second = std::move(message);
  }
  void disarm(int64_t token) {
    std::lock_guard<std::mutex> lock(mutex_);
    armed_.erase(token);
    changed_.notify_all();
  }

 private:
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      if (armed_.empty()) {
        changed_.wait(lock);
        continue;
      }
      auto first = armed_.begin();
      for (auto it = armed_.begin(); it != armed_.end(); ++it)
        if (it->second.first < first->second.first) first = it;
      if (Clock::now() >= first->second.first) dist::fatal_exit(first->second.second);
      changed_.wait_until(lock, first->second.first);
    }
  }
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<int64_t, std::pair<Clock::time_point, std::string>> armed_;
  int64_t next_ = 0;
  bool started_ = false;
};

const Function kDeadlines[] = {
    // _deadline_arm(seconds, message) -> token: the process ends with `message` once `seconds` pass.
    // A limit past 1e9 s (about 30 years: none, in effect) is held there, in the clock's range.
    {"_deadline_arm", [](Args& a) {
       const double seconds = a.number(1);
       if (!(seconds > 0)) a.fail(1, "seconds > 0 expected");
       return a.ret(double(Deadlines::instance().arm(std::min(seconds, 1e9), a.string(2)))); }},
    {"_deadline_note", [](Args& a) {  // _deadline_note(token, message): the message it would end with
       Deadlines::instance().note(a.integer(1), a.string(2));
       return a.ret(); }},
    {"_deadline_disarm", [](Args& a) {
       Deadlines::instance().disarm(a.integer(1));
       return a.ret(); }},
    {nullptr, nullptr}};

// A state's allocator behind a budget (core._memory_budget): while a budget is set, an
// allocation that would take the state more than its limit past where it stood when the budget
// began fails, which Lua raises as "not enough memory". A config file's one string.rep or
// table.concat of gigabytes is so stopped before it is made, where a check between instructions
// would come after it. Every call goes on to the state's own allocator.
struct Budget {
  lua_Alloc inner = nullptr;
  void* inner_ud = nullptr;
  int64_t used = 0;    ///< bytes allocated less bytes freed since the budget began
  int64_t limit = -1;  ///< -1: no budget
  bool refused = false;
};

void* budgeted_alloc(void* ud, void* ptr, size_t osize, size_t nsize) {
  auto* b = static_cast<Budget*>(ud);
  const int64_t grow = static_cast<int64_t>(nsize) - (ptr ? static_cast<int64_t>(osize) : 0);
  if (b->limit >= 0 && grow > 0 && b->used + grow > b->limit) {
    b->refused = true;
    return nullptr;
  }
  void* out = b->inner(b->inner_ud, ptr, osize, nsize);
  if (out || nsize == 0) b->used += grow;
  return out;
}

// The state's Budget, its allocator wrapped the first time one is asked for.
Budget* budget_of(lua_State* L) {
  void* ud = nullptr;
  lua_Alloc f = lua_getallocf(L, &ud);
  if (f == budgeted_alloc) return static_cast<Budget*>(ud);
  auto* b = new Budget;  // deleted by ~Host after lua_close, the allocator's last call
  b->inner = f;
  b->inner_ud = ud;
  lua_setallocf(L, budgeted_alloc, b);
  return b;
}

int open_core(lua_State* L) {
  lua_newtable(L);
  int core = lua_gettop(L);
  open_tensor(L, core);
  open_nn(L, core);
  open_optim(L, core);
  open_data(L, core);
  open_dist(L, core);
  open_policy(L, core);
  open_plan(L, core);
  open_repl(L, core);
  open_ckpt(L, core);
  open_files(L, core);
  set_functions(L, core, kDeadlines);
  // core._where(): the user's file:line running now (the first frame outside partrain's Lua), as
  // engine errors name it; "" when there is none.
  lua_pushcfunction(L, [](lua_State* S) {
    std::string where = user_location(S);
    lua_pushlstring(S, where.data(), where.size());
    return 1;
  });
  lua_setfield(L, core, "_where");
  // core._raise(msg [, level = 1]): raises msg at the user's line, as engine errors are located,
  // even where the caller of partrain's function is pcall itself (`pcall(pt.log, 5)`), whose
  // frame Lua's error levels name nothing for. Without a user frame (under an engine callback),
  // where error(msg, level) in the calling function would. Like error, it raises anything but a
  // string or number unchanged.
  lua_pushcfunction(L, [](lua_State* S) {
    const int level = luaL_optint(S, 2, 1);
    lua_settop(S, 1);
    if (!lua_isstring(S, 1)) return lua_error(S);
    bool is_user = false;
    bool located = false;  // at the user's line already (an engine error passed on)
    {
      std::string where = user_location(S, &is_user) + ": ";
      located = is_user && std::strncmp(lua_tostring(S, 1), where.c_str(), where.size()) == 0;
      if (is_user && !located) lua_pushlstring(S, where.data(), where.size());
    }  // nothing of C++ is left to destroy when lua_error unwinds
    if (located) return lua_error(S);
    if (!is_user) {
      if (level > 0) luaL_where(S, level);
      else lua_pushliteral(S, "");
    }
    lua_pushvalue(S, 1);
    lua_concat(S, 2);
    return lua_error(S);
  });
  lua_setfield(L, core, "_raise");
  // core._memory_budget(bytes): from now on, allocations that would take this state more than
  // `bytes` past where it stands fail ("not enough memory"). core._memory_budget(): no budget
  // again; returns whether an allocation was refused under the one that ends.
  lua_pushcfunction(L, [](lua_State* S) {
    Budget* b = budget_of(S);
    if (lua_isnoneornil(S, 1)) {
      bool refused = b->refused;
      b->limit = -1;
      b->refused = false;
      lua_pushboolean(S, refused);
      return 1;
    }
    const double bytes = luaL_checknumber(S, 1);
    luaL_argcheck(S, bytes >= 0 && bytes < 0x1p62, 1, "a number of bytes");
    b->used = 0;
    b->refused = false;
    b->limit = static_cast<int64_t>(bytes);
    return 0;
  });
  lua_setfield(L, core, "_memory_budget");
  // core._key_text(k): a table key as messages show it ('name', [3], [a string of 900 bytes]).
  lua_pushcfunction(L, [](lua_State* S) {
    luaL_checkany(S, 1);
    {
      std::string text = key_text(S, 1);
      lua_pushlstring(S, text.data(), text.size());
    }
    return 1;
  });
  lua_setfield(L, core, "_key_text");
  // core._unyielding(fn, ...): fn(...) behind a C frame, so a coroutine.yield inside it is an
  // error rather than a way out that leaves the caller's limits armed.
  lua_pushcfunction(L, [](lua_State* S) {
    luaL_checktype(S, 1, LUA_TFUNCTION);
    lua_call(S, lua_gettop(S) - 1, LUA_MULTRET);
    return lua_gettop(S);
  });
  lua_setfield(L, core, "_unyielding");
  lua_pushstring(L, PARTRAIN_VERSION);
  lua_setfield(L, core, "version");
  return 1;
}

}  // namespace

namespace {

// The launcher's question "which Lua line is this rank on?" (SIGUSR1, sent only once the ledger's
// line_ready says this handler is in place). The handler sets a one-shot hook (lua_sethook is
// safe in a signal handler: lua.c's Ctrl-C does the same); at the next Lua instruction the
// interpreter runs, the hook writes the user's line into the ledger and puts back any hook the
// script had. LuaJIT runs no hooks inside compiled traces, and none while C code runs, so a rank
// spinning in a compiled loop, or inside a long C call, does not answer: the launcher says so.
std::atomic<lua_State*> asked_state{nullptr};
lua_Hook saved_hook = nullptr;
int saved_mask = 0, saved_count = 0;

void answer_line(lua_State* L, lua_Debug*) {
  char where[dist::ledger::kSite];
  user_location(L, where, sizeof where, /*first=*/0);
  lua_sethook(L, saved_hook, saved_mask, saved_count);
  dist::ledger::set_line(where[0] ? where : "(no Lua line)");
}

void on_line_request(int) {
  lua_State* L = asked_state.load();
  if (!L) return;
  if (lua_gethook(L) != answer_line) {
    saved_hook = lua_gethook(L);
    saved_mask = lua_gethookmask(L);
    saved_count = lua_gethookcount(L);
  }
  lua_sethook(L, answer_line, LUA_MASKCOUNT | LUA_MASKLINE, 1);
}

// Under the launcher (which shares the ledger), answers its SIGUSR1 with the Lua line of `L`.
void answer_line_requests(lua_State* L) {
  if (!dist::ledger::shared()) return;
  struct sigaction sa {};
  sa.sa_handler = on_line_request;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  asked_state = L;
  if (sigaction(SIGUSR1, &sa, nullptr) == 0) dist::ledger::region()->line_ready = 1;
}

// A number's status as the system will report it: LuaJIT truncates it to an int and the system
// keeps its low 8 bits, so os.exit(256) and os.exit(0.5) end with status 0 and must count as
// ending; one outside an int's range is 1 (LuaJIT's conversion of it depends on the machine).
int exit_status_of(double n) {
  if (!(n > -2147483649.0 && n < 2147483648.0)) return 1;
  return static_cast<int>(static_cast<int64_t>(n)) & 0xff;
}

// os.exit with a successful status (none, true, 0, or a number the system reports as 0) first
// ends this rank's part of the run as the script's end does: rank 0 waits there for the others,
// whose store it serves (World::shutdown), and the others say they are done, so rank 0 does not
// wait for them in vain. Then it exits as Lua's own os.exit does, which stays in the registry.
int exit_after_run(Args& a) {
  lua_State* L = a.L;
  if (!a.none(1) && !lua_isboolean(L, 1) && lua_isnumber(L, 1)) {
    lua_pushinteger(L, exit_status_of(lua_tonumber(L, 1)));  // the status that will be seen, passed as it is
    lua_replace(L, 1);
  }
  const bool success = a.none(1) || (lua_isboolean(L, 1) ? lua_toboolean(L, 1) != 0
                                                          : lua_isnumber(L, 1) && lua_tonumber(L, 1) == 0);
  if (success) dist::World::instance().shutdown();
  lua_getfield(L, LUA_REGISTRYINDEX, "partrain.os_exit");
  lua_insert(L, 1);
  lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
  return lua_gettop(L);
}

void replace_os_exit(lua_State* L) {
  lua_getglobal(L, "os");
  lua_getfield(L, -1, "exit");
  lua_setfield(L, LUA_REGISTRYINDEX, "partrain.os_exit");
  static const Function exit{"os.exit", exit_after_run};
  push_function(L, exit);
  lua_setfield(L, -2, "exit");
  lua_pop(L, 1);
}

// The state whose garbage is collected before the first training step's memory is noted.
std::atomic<lua_State*> collected_state{nullptr};

void collect_before_first_step() {
  if (lua_State* L = collected_state.load()) lua_gc(L, LUA_GCCOLLECT, 0);
}

void stop_answering(lua_State* L) {
  if (asked_state.load() != L) return;
  dist::ledger::region()->line_ready = 0;  // the launcher stops asking; a late signal finds no state
  asked_state = nullptr;
}

}  // namespace

Paths find_paths() {
  std::vector<Paths> candidates;
  if (const char* home = std::getenv("PARTRAIN_HOME"))
    candidates.push_back({std::string(home) + "/lua", home});
  std::string exe = exe_dir();
  if (!exe.empty()) candidates.push_back({exe + "/../share/partrain/lua", exe + "/../share/partrain"});
  candidates.push_back({std::string(PARTRAIN_SOURCE_DIR) + "/bindings/lua", PARTRAIN_SOURCE_DIR});
  for (const auto& c : candidates)
    if (is_dir(c.lua + "/partrain/init.lua")) return c;
  return candidates.back();
}

Host::Host() : L_(luaL_newstate()), alive_(std::make_shared<bool>(true)) {
  if (!L_) throw std::runtime_error("cannot create a Lua state (out of memory)");
  luaL_openlibs(L_);
  // The host's liveness flag, for engine objects that hold Lua references (Lua-defined modules).
  lua_pushlightuserdata(L_, &alive_);  // a std::shared_ptr<bool>*
  lua_setfield(L_, LUA_REGISTRYINDEX, "partrain.alive");
  lua_pushlightuserdata(L_, L_);
  lua_setfield(L_, LUA_REGISTRYINDEX, "partrain.main");
  // The traceback function, fetched once: a script that replaces `debug` keeps its tracebacks.
  lua_getglobal(L_, "debug");
  lua_getfield(L_, -1, "traceback");
  lua_setfield(L_, LUA_REGISTRYINDEX, "partrain.traceback");
  lua_pop(L_, 1);

  Paths paths = find_paths();
  lua_getglobal(L_, "package");
  std::string path = paths.lua + "/?.lua;" + paths.lua + "/?/init.lua;" + paths.policies +
                     "/?.lua;" + paths.policies + "/?/init.lua;";
  lua_getfield(L_, -1, "path");
  path += lua_tostring(L_, -1);
  lua_pop(L_, 1);
  lua_pushstring(L_, path.c_str());
  lua_setfield(L_, -2, "path");
  // The C half of the library, loaded by partrain/init.lua as require "partrain.core".
  lua_getfield(L_, -1, "preload");
  lua_pushcfunction(L_, open_core);
  lua_setfield(L_, -2, "partrain.core");
  lua_pop(L_, 2);
  answer_line_requests(L_);
  replace_os_exit(L_);
  collected_state = L_;
  plan::set_before_first_step(collect_before_first_step);
}

Host::~Host() {
  stop_answering(L_);
  lua_State* mine = L_;
  if (collected_state.compare_exchange_strong(mine, nullptr)) plan::set_before_first_step(nullptr);
  *alive_ = false;
  void* ud = nullptr;
  Budget* budget = lua_getallocf(L_, &ud) == budgeted_alloc ? static_cast<Budget*>(ud) : nullptr;
  // Finalizers run inside lua_close while the state is still usable; mark it dying after.
  lua_close(L_);
  delete budget;
}

void Host::set_arg_table(const std::string& script, const std::vector<std::string>& args) {
  lua_createtable(L_, static_cast<int>(args.size()), 2);
  lua_pushstring(L_, "partrain");
  lua_rawseti(L_, -2, -1);
  lua_pushstring(L_, script.c_str());
  lua_rawseti(L_, -2, 0);
  for (size_t i = 0; i < args.size(); ++i) {
    lua_pushstring(L_, args[i].c_str());
    lua_rawseti(L_, -2, static_cast<int>(i + 1));
  }
  lua_setglobal(L_, "arg");
}

namespace {

constexpr uint64_t kMaxScriptBytes = 64ull << 20;  // a Lua script; more is not a script

// Loads Lua source (never bytecode: LuaJIT does not verify it, and a bytecode file can crash
// it) as a chunk named `name`. On failure leaves nothing on the stack and sets `error`.
bool load_source(lua_State* L, const std::string& code, const std::string& name, std::string* error) {
  if (luaL_loadbufferx(L, code.data(), code.size(), name.c_str(), "t") == 0) return true;
  *error = lua_tostring(L, -1);
  lua_pop(L, 1);
  if (code.compare(0, 3, "\x1bLJ") == 0)
    *error = (name[0] == '@' || name[0] == '=' ? name.substr(1) : name) + ": LuaJIT bytecode; partrain runs Lua source only";
  return false;
}

// A script's source: a regular file of bounded size, read once (a FIFO or a folder is refused,
// never waited on), with a #! first line blanked (its line still counts).
bool read_script(const std::string& path, std::string* code, std::string* error) {
  try {
    *code = util::read_regular(path, "script", kMaxScriptBytes);
  } catch (const std::exception& e) {
    *error = message_of(e);
    return false;
  }
  if (!code->empty() && (*code)[0] == '#') code->erase(0, std::min(code->find('\n'), code->size()));
  return true;
}

}  // namespace

bool check_script(const std::string& path, std::string* error) {
  std::string code;
  if (!read_script(path, &code, error)) return false;
  lua_State* L = luaL_newstate();
  if (!L) {
    *error = "cannot create a Lua state (out of memory)";
    return false;
  }
  bool ok = load_source(L, code, "@" + path, error);
  lua_close(L);
  return ok;
}

bool Host::run_file(const std::string& path, const std::vector<std::string>& args,
                    std::string* error) {
  std::string code;
  if (!read_script(path, &code, error)) return false;
  set_arg_table(path, args);
  // The script's own folder comes first on package.path, so it can require its neighbours.
  std::string dir = dir_of(path);
  lua_getglobal(L_, "package");
  lua_getfield(L_, -1, "path");
  std::string p = dir + "/?.lua;" + dir + "/?/init.lua;" + lua_tostring(L_, -1);
  lua_pop(L_, 1);
  lua_pushstring(L_, p.c_str());
  lua_setfield(L_, -2, "path");
  lua_pop(L_, 1);

  if (!load_source(L_, code, "@" + path, error)) return false;
  for (const auto& a : args) lua_pushstring(L_, a.c_str());
  return pcall(L_, static_cast<int>(args.size()), 0, error, /*traceback=*/true);
}

bool Host::run_string(const std::string& code, const std::string& chunkname, std::string* error) {
  if (!load_source(L_, code, chunkname, error)) return false;
  return pcall(L_, 0, 0, error, /*traceback=*/true);
}

bool Host::eval(const std::string& code, std::string* result, std::string* error) {
  if (!load_source(L_, code, "=eval", error)) return false;
  if (!pcall(L_, 0, 1, error, true)) return false;
  lua_getglobal(L_, "tostring");
  lua_insert(L_, -2);
  if (!pcall(L_, 1, 1, error)) return false;
  *result = lua_isstring(L_, -1) ? lua_tostring(L_, -1) : "(tostring returned no string)";
  lua_pop(L_, 1);
  return true;
}

}  // namespace partrain::lua
