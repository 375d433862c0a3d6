// Reading what Lua passes in: a C function's arguments (Args) and an options table (Options), each
// wrong type or unknown key a message that names it.
#include "bindings/lua.hpp"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/plan/plan.hpp"

namespace partrain::lua {

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

torch::Tensor& Args::tensor_shape(int i) const {
  auto* t = ud_test<torch::Tensor>(L, i, PT_TENSOR_MT);
  if (!t) expected(i, "tensor");
  return *t;
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
  check_values(i, *t);
  return *t;
}

void Args::check_values(int i, const torch::Tensor& t, const std::string& element) const {
  // ZeRO-3 frees a parameter's storage between uses: its values are there only while its unit is
  // gathered (a kernel would read nothing at all).
  if (t.defined() && !t.is_meta() && t.numel() > 0 && t.has_storage() && !t.storage().data())
    fail(i, element + "this tensor is a parameter sharded by ZeRO-3, whose values exist only while its unit is "
            "gathered: read or change it inside model:gathered(function() ... end), or use model:full_state_dict()");
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

std::vector<torch::Tensor> Args::tensors(int i, bool values) const {
  if (!is_table(i)) expected(i, "table of tensors");
  std::vector<torch::Tensor> out;
  int n = static_cast<int>(lua_objlen(L, i));
  for (int k = 1; k <= n; ++k) {
    lua_rawgeti(L, i, k);
    auto* t = ud_test<torch::Tensor>(L, -1, PT_TENSOR_MT);
    lua_pop(L, 1);
    if (!t) fail(i, "table of tensors expected, element " + std::to_string(k) + " is not a tensor");
    // pt.cat { p1, p2 } of ZeRO-3 parameters outside a gather had read freed storage (SIGSEGV).
    if (values) check_values(i, *t, "element " + std::to_string(k) + ": ");
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

std::vector<std::string> Options::strings(const char* key, std::vector<std::string> fallback) {
  if (!push(key)) return fallback;
  if (lua_type(L, -1) != LUA_TTABLE) wrong(key, "a list of strings");
  std::vector<std::string> out;
  int n = static_cast<int>(lua_objlen(L, -1));
  for (int k = 1; k <= n; ++k) {
    lua_rawgeti(L, -1, k);
    if (lua_type(L, -1) != LUA_TSTRING) {
      std::string got = luaL_typename(L, -1);
      lua_pop(L, 2);
      throw std::invalid_argument("option '" + prefix_ + key + "' for " + what_ + " must be a list of strings, "
                                  "element " + std::to_string(k) + " is a " + got);
    }
    out.emplace_back(lua_tostring(L, -1));
    lua_pop(L, 1);
  }
  refuse_stray_key(L, -1, n, "option '" + prefix_ + key + "' for " + what_ + " must be a list of strings");
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

}  // namespace partrain::lua
