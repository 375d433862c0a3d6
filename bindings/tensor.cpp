// Tensors in Lua: one userdata type over at::Tensor and table-driven op lists, so adding an op
// is one line. Dimensions and indices count from 0 as in PyTorch (negative counts from the end);
// Lua tables that come back (shape, totable) are ordinary 1-based Lua arrays.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <iomanip>
#include <limits>
#include <sstream>

#include "bindings/lua.hpp"
#include "engine/compat.hpp"
#include "engine/dist/world.hpp"
#include "engine/nn/init.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/plan/plan.hpp"
#include "engine/util/text.hpp"
#include "engine/util/step_events.hpp"

namespace partrain::lua {

using torch::Tensor;

// ---- dtypes, devices, conversions ----------------------------------------------------------

namespace {

struct DtypeName {
  const char* name;
  c10::ScalarType type;
};
const DtypeName kDtypes[] = {
    {"float32", torch::kFloat32}, {"float", torch::kFloat32},   {"float64", torch::kFloat64},
    {"double", torch::kFloat64},  {"float16", torch::kFloat16}, {"half", torch::kFloat16},
    {"bfloat16", torch::kBFloat16}, {"bf16", torch::kBFloat16}, {"fp16", torch::kFloat16},
    {"fp32", torch::kFloat32},    {"fp64", torch::kFloat64},    {"int64", torch::kInt64},   {"long", torch::kInt64},
    {"int32", torch::kInt32},     {"int", torch::kInt32},       {"int16", torch::kInt16},
    {"int8", torch::kInt8},       {"uint8", torch::kUInt8},     {"bool", torch::kBool},
};

torch::Device parse_device(const std::string& name) {
  try {
    return torch::Device(name);
  } catch (const std::exception&) {
    throw std::invalid_argument("unknown device or dtype '" + name +
                                "' (devices: cpu, cuda, cuda:N; dtypes: float32, float64, "
                                "float16, bfloat16, int64, int32, int16, int8, uint8, bool)");
  }
}

// Reads {dtype=, device=, requires_grad=} at `idx` into tensor options.
torch::TensorOptions creation_options(const Args& a, int idx, const char* what,
                                      c10::ScalarType dtype = torch::kFloat32) {
  Options o(a, idx, what);
  auto opts = torch::TensorOptions().dtype(dtype);
  if (o.has("dtype")) opts = opts.dtype(parse_dtype(o.string("dtype", "")));
  if (o.has("device")) opts = opts.device(parse_device(o.string("device", "")));
  if (plan::planning()) opts = opts.device(torch::kMeta);  // shapes only: no memory while planning
  opts = opts.requires_grad(o.boolean("requires_grad", false));
  o.finish();
  return opts;
}

// A shape given as numbers or a table at 1, then an optional options table.
std::pair<std::vector<int64_t>, torch::TensorOptions> shape_and_options(const Args& a) {
  int end = 1;
  auto shape = a.ints(1, &end);
  if (!a.none(end) && !a.is_table(end)) a.expected(end, "options table or dimension");
  return {shape, creation_options(a, end, a.name())};
}

// Nested tables of numbers or booleans -> shape and values.
void flatten_table(lua_State* L, int idx, size_t depth, std::vector<int64_t>& shape,
                   std::vector<double>& values, bool& all_bools) {
  int n = static_cast<int>(lua_objlen(L, idx));
  if (depth > 32) throw std::invalid_argument("tensor(): tables nested more than 32 deep");
  if (depth == shape.size()) {
    // Once a number has been seen the shape is complete: a deeper table is ragged.
    if (!values.empty()) throw std::invalid_argument("tensor(): ragged nested table");
    shape.push_back(n);
  } else if (shape[depth] != n)
    throw std::invalid_argument("tensor(): ragged nested table (a row of " + std::to_string(n) +
                                " where " + std::to_string(shape[depth]) + " came before)");
  for (int k = 1; k <= n; ++k) {
    lua_rawgeti(L, idx, k);
    int t = lua_type(L, -1);
    if (t == LUA_TTABLE) {
      flatten_table(L, lua_gettop(L), depth + 1, shape, values, all_bools);
    } else if (t == LUA_TNUMBER || t == LUA_TBOOLEAN) {
      if (shape.size() != depth + 1) throw std::invalid_argument("tensor(): ragged nested table");
      double x = t == LUA_TBOOLEAN ? (lua_toboolean(L, -1) ? 1 : 0) : lua_tonumber(L, -1);
      all_bools = all_bools && t == LUA_TBOOLEAN;
      values.push_back(x);
    } else {
      std::string got = luaL_typename(L, -1);
      lua_pop(L, 1);
      throw std::invalid_argument("tensor(): elements must be numbers or booleans, got " + got);
    }
    lua_pop(L, 1);
  }
  std::string stray = stray_key(L, idx, n);
  if (!stray.empty()) throw std::invalid_argument("tensor(): nested tables are lists of elements, but one also has the key " + stray);
}

void push_table_of(lua_State* L, const Tensor& t, int64_t dim, const double* data,
                   const int64_t* strides, bool as_bool, int64_t offset) {
  int64_t n = t.size(dim);
  lua_createtable(L, static_cast<int>(n), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t at = offset + i * strides[dim];
    if (dim + 1 == t.dim()) {
      if (as_bool) lua_pushboolean(L, data[at] != 0);
      else lua_pushnumber(L, data[at]);
    } else {
      push_table_of(L, t, dim + 1, data, strides, as_bool, at);
    }
    lua_rawseti(L, -2, static_cast<int>(i + 1));
  }
}

int push_totable(const Args& a, const Tensor& t) {
  bool as_bool = t.scalar_type() == torch::kBool;
  if (t.dim() == 0) return as_bool ? a.ret(t.item<bool>()) : a.ret(t.item<double>());
  auto d = t.detach().to(torch::kCPU, torch::kFloat64).contiguous();
  push_table_of(a.L, d, 0, d.data_ptr<double>(), d.strides().data(), as_bool, 0);
  return 1;
}


int push_item(const Args& a, const Tensor& t) {
  if (t.numel() != 1)
    throw std::invalid_argument("item() needs a tensor of one element, got shape " +
                                c10::str(t.sizes()));
  if (t.scalar_type() == torch::kBool) return a.ret(t.item<bool>());
  return a.ret(t.item<double>());
}

// Methods whose first argument may be a number and second a tensor (metamethods): both become
// tensors of the tensor operand's options.
std::pair<Tensor, Tensor> operands(const Args& a) {
  if (a.is_number(1)) {
    const Tensor& r = a.tensor(2);
    return {a.tensor_or_number(1, r), r};
  }
  const Tensor& l = a.tensor(1);
  return {l, a.tensor_or_number(2, l)};
}

Tensor to(const Args& a) {
  const Tensor& t = a.tensor(1);
  if (a.is_tensor(2)) return t.to(a.tensor(2).options().requires_grad(false));
  std::string s = a.string(2);
  if (is_dtype_name(s)) return t.to(parse_dtype(s));
  return t.to(parse_device(s));
}

// Ops that read across the vocabulary refuse vocabulary-split logits (a P.vocab_head's output):
// on this rank's columns alone their answer would be silently wrong. `dim`: the dimension the op
// works across (nullopt: all of them). (max() and min() of everything stay allowed: comparing two
// split tensors by their largest difference is each rank's own business.)
void refuse_split_logits(const Args& a, const char* op, c10::optional<int64_t> dim) {
  if (!parallel::split_logits_marked()) return;
  const Tensor& t = a.tensor(1);
  auto s = parallel::split_logits_of(t);
  if (!s) return;
  if (dim && t.dim() > 0 && t.size(-1) == s->local) {
    int64_t d = *dim < 0 ? *dim + t.dim() : *dim;
    if (d != t.dim() - 1) return;  // across another dimension: each vocabulary column on its own
  }
  throw std::invalid_argument(std::string(op) + " over vocabulary-split logits: this rank holds " +
                              std::to_string(s->local) + " of the " + std::to_string(s->padded) +
                              " vocabulary columns (the output of a P.vocab_head), so the answer would be this "
                              "rank's alone; gather them first with pt.tp.gather_logits(logits), or use "
                              "pt.loss_fn(model) for the loss");
}

// ---- The op tables -------------------------------------------------------------------------
// One line an op: read the arguments, call ATen, return. Methods take the tensor as argument 1.

#define T(i) a.tensor(i)

// True when argument 1 is a meta tensor of a deferred build: the planner's are meta too, but are
// never materialized.
bool deferred_meta(const Args& a) {
  const auto& t = a.tensor(1);
  return t.is_meta() && !plan::planning();
}

}  // namespace

int record_init(Args& a, const char* what, const nn::InitOp& op) {
  if (deferred_meta(a)) {
    try {
      nn::init_(a.tensor(1), op);
    } catch (const c10::Error& e) {
      a.fail(1, std::string(what) + ": " + e.what_without_backtrace());
    }
  }
  lua_settop(a.L, 1);
  return 1;
}

void refuse_deferred(Args& a, const char* what) {
  if (deferred_meta(a))
    a.fail(1, std::string(what) + " on a meta tensor of a deferred build cannot be replayed when the model is "
           "materialized (its values come from its name's generator): initialize it with numbers (pt.nn.init, fill_, "
           "mul_, ...), or load the values after pt.parallelize (a checkpoint, import_safetensors)");
}

namespace {

const Function kMethods[] = {
    // shape and type
    // (shape and type read no values: a ZeRO-3 parameter not gathered answers them too)
    {"size", [](Args& a) {
       const auto& t = a.tensor_shape(1);
       return a.none(2) ? push_ints(a.L, t.sizes()) : a.ret(double(t.size(a.integer(2)))); }},
    {"dim", [](Args& a) { return a.ret(double(a.tensor_shape(1).dim())); }},
    {"dropout", [](Args& a) {  // dropout(p [, training = true])
       double p = a.number(2);
       if (p < 0 || p >= 1) a.fail(2, "dropout probability in [0, 1) expected");
       return a.ret(at::dropout(T(1), p, a.boolean(3, true))); }},
    {"numel", [](Args& a) { return a.ret(double(a.tensor_shape(1).numel())); }},
    {"element_size", [](Args& a) { return a.ret(double(a.tensor_shape(1).element_size())); }},  // bytes per element
    {"type", [](Args& a) { return a.ret(dtype_name(a.tensor_shape(1).scalar_type())); }},
    {"is_contiguous", [](Args& a) { return a.ret(a.tensor_shape(1).is_contiguous()); }},
    {"to", [](Args& a) { return a.ret(to(a)); }},
    {"float", [](Args& a) { return a.ret(T(1).to(torch::kFloat32)); }},
    {"double", [](Args& a) { return a.ret(T(1).to(torch::kFloat64)); }},
    {"half", [](Args& a) { return a.ret(T(1).to(torch::kFloat16)); }},
    {"bfloat16", [](Args& a) { return a.ret(T(1).to(torch::kBFloat16)); }},
    {"long", [](Args& a) { return a.ret(T(1).to(torch::kInt64)); }},
    {"int", [](Args& a) { return a.ret(T(1).to(torch::kInt32)); }},
    {"bool", [](Args& a) { return a.ret(T(1).to(torch::kBool)); }},
    {"cpu", [](Args& a) { return a.ret(T(1).cpu()); }},
    {"cuda", [](Args& a) { return a.ret(T(1).to(torch::Device(torch::kCUDA))); }},
    {"item", [](Args& a) { return push_item(a, T(1)); }},
    {"totable", [](Args& a) { return push_totable(a, T(1)); }},
    {"tostring", [](Args& a) { std::ostringstream s; s << T(1); return a.ret(s.str()); }},
    // views and copies
    {"view", [](Args& a) { return a.ret(T(1).view(a.ints(2))); }},
    {"reshape", [](Args& a) { return a.ret(T(1).reshape(a.ints(2))); }},
    {"transpose", [](Args& a) { return a.ret(T(1).transpose(a.integer(2), a.integer(3))); }},
    {"t", [](Args& a) { return a.ret(T(1).t()); }},
    {"permute", [](Args& a) { return a.ret(T(1).permute(a.ints(2))); }},
    {"contiguous", [](Args& a) { return a.ret(T(1).contiguous()); }},
    {"narrow", [](Args& a) { return a.ret(T(1).narrow(a.integer(2), a.integer(3), a.integer(4))); }},
    {"select", [](Args& a) { return a.ret(T(1).select(a.integer(2), a.integer(3))); }},
    {"index_select", [](Args& a) { return a.ret(T(1).index_select(a.integer(2), T(3))); }},
    {"gather", [](Args& a) { return a.ret(T(1).gather(a.integer(2), T(3))); }},
    {"unsqueeze", [](Args& a) { return a.ret(T(1).unsqueeze(a.integer(2))); }},
    {"squeeze", [](Args& a) { return a.ret(a.none(2) ? T(1).squeeze() : T(1).squeeze(a.integer(2))); }},
    {"flatten", [](Args& a) { return a.ret(T(1).flatten(a.integer(2, 0), a.integer(3, -1))); }},
    {"expand", [](Args& a) { return a.ret(T(1).expand(a.ints(2))); }},
    {"repeat_", [](Args& a) { return a.ret(T(1).repeat(a.ints(2))); }},
    {"chunk", [](Args& a) { return a.ret(T(1).chunk(a.integer(2), a.integer(3, 0))); }},
    {"split", [](Args& a) { return a.ret(a.is_table(2) ? T(1).split_with_sizes(a.ints(2), a.integer(3, 0)) : T(1).split(a.integer(2), a.integer(3, 0))); }},
    {"unbind", [](Args& a) { return a.ret(T(1).unbind(a.integer(2, 0))); }},  // a Lua array of slices
    {"flip", [](Args& a) { return a.ret(T(1).flip(a.dims(2))); }},
    // repeat_interleave(repeats [, dim]): repeats a number or a 1-D integer tensor (one count each)
    {"repeat_interleave", [](Args& a) {
       c10::optional<int64_t> dim = a.none(3) ? c10::nullopt : c10::optional<int64_t>(a.integer(3));
       if (a.is_number(2)) {
         int64_t n = a.integer(2);
         if (n < 0) a.fail(2, "repeats must be >= 0, got " + std::to_string(n));
         return a.ret(T(1).repeat_interleave(n, dim));
       }
       return a.ret(T(1).repeat_interleave(T(2), dim)); }},
    // scatter(dim, index, src or value): a copy with src's (or the value) at index along dim
    {"scatter", [](Args& a) {
       if (a.is_number(4)) return a.ret(T(1).scatter(a.integer(2), T(3), a.scalar(4)));
       return a.ret(T(1).scatter(a.integer(2), T(3), T(4))); }},
    {"scatter_add", [](Args& a) { return a.ret(T(1).scatter_add(a.integer(2), T(3), T(4))); }},
    {"clone", [](Args& a) { return a.ret(T(1).clone()); }},
    {"detach", [](Args& a) { return a.ret(T(1).detach()); }},
    {"tril", [](Args& a) { return a.ret(T(1).tril(a.integer(2, 0))); }},
    {"triu", [](Args& a) { return a.ret(T(1).triu(a.integer(2, 0))); }},
    {"masked_fill", [](Args& a) { return a.ret(T(1).masked_fill(T(2), a.scalar(3))); }},
    {"where", [](Args& a) { return a.ret(torch::where(T(2), T(1), a.tensor_or_number(3, T(1)))); }},
    // arithmetic
    {"add", [](Args& a) { auto [l, r] = operands(a); return a.ret(l.add(r, a.none(3) ? at::Scalar(1) : a.scalar(3))); }},
    {"sub", [](Args& a) { auto [l, r] = operands(a); return a.ret(l.sub(r)); }},
    {"mul", [](Args& a) { auto [l, r] = operands(a); return a.ret(l.mul(r)); }},
    {"div", [](Args& a) { auto [l, r] = operands(a); return a.ret(l.div(r)); }},
    {"pow", [](Args& a) { return a.ret(a.is_number(2) ? T(1).pow(a.scalar(2)) : T(1).pow(T(2))); }},
    {"neg", [](Args& a) { return a.ret(T(1).neg()); }},
    {"abs", [](Args& a) { return a.ret(T(1).abs()); }},
    {"exp", [](Args& a) { return a.ret(T(1).exp()); }},
    {"log", [](Args& a) { return a.ret(T(1).log()); }},
    {"sqrt", [](Args& a) { return a.ret(T(1).sqrt()); }},
    {"rsqrt", [](Args& a) { return a.ret(T(1).rsqrt()); }},
    {"sin", [](Args& a) { return a.ret(T(1).sin()); }},
    {"cos", [](Args& a) { return a.ret(T(1).cos()); }},
    {"sign", [](Args& a) { return a.ret(T(1).sign()); }},
    {"clamp", [](Args& a) { return a.ret(T(1).clamp(a.none(2) ? c10::optional<at::Scalar>() : a.scalar(2), a.none(3) ? c10::optional<at::Scalar>() : a.scalar(3))); }},
    {"maximum", [](Args& a) { return a.ret(T(1).maximum(T(2))); }},
    {"minimum", [](Args& a) { return a.ret(T(1).minimum(T(2))); }},
    {"matmul", [](Args& a) { return a.ret(T(1).matmul(T(2))); }},
    {"mm", [](Args& a) { return a.ret(T(1).mm(T(2))); }},
    {"bmm", [](Args& a) { return a.ret(T(1).bmm(T(2))); }},
    {"outer", [](Args& a) { return a.ret(T(1).outer(T(2))); }},
    // reductions: () over everything, (dim or {dims}[, keepdim])
    {"sum", [](Args& a) { return a.ret(a.none(2) ? T(1).sum() : T(1).sum(a.dims(2), a.boolean(3, false))); }},
    {"mean", [](Args& a) { return a.ret(a.none(2) ? T(1).mean() : T(1).mean(a.dims(2), a.boolean(3, false))); }},
    {"prod", [](Args& a) { return a.ret(a.none(2) ? T(1).prod() : T(1).prod(a.integer(2), a.boolean(3, false))); }},
    // var and std: (), or (dim or {dims} [, unbiased = true] [, keepdim = false]) as in PyTorch 1.x
    {"var", [](Args& a) { return a.ret(a.none(2) ? T(1).var() : T(1).var(a.dims(2), a.boolean(3, true), a.boolean(4, false))); }},
    {"std", [](Args& a) { return a.ret(a.none(2) ? T(1).std() : T(1).std(a.dims(2), a.boolean(3, true), a.boolean(4, false))); }},
    {"norm", [](Args& a) { return a.ret(T(1).norm(a.number(2, 2.0))); }},
    {"max", [](Args& a) { if (a.none(2)) return a.ret(T(1).max()); refuse_split_logits(a, "max", a.integer(2)); auto [v, i] = T(1).max(a.integer(2), a.boolean(3, false)); a.ret(v); return 1 + a.ret(i); }},
    {"min", [](Args& a) { if (a.none(2)) return a.ret(T(1).min()); refuse_split_logits(a, "min", a.integer(2)); auto [v, i] = T(1).min(a.integer(2), a.boolean(3, false)); a.ret(v); return 1 + a.ret(i); }},
    {"argmax", [](Args& a) { refuse_split_logits(a, "argmax", a.none(2) ? c10::nullopt : c10::optional<int64_t>(a.integer(2))); return a.ret(a.none(2) ? T(1).argmax() : T(1).argmax(a.integer(2), a.boolean(3, false))); }},
    {"argmin", [](Args& a) { refuse_split_logits(a, "argmin", a.none(2) ? c10::nullopt : c10::optional<int64_t>(a.integer(2))); return a.ret(a.none(2) ? T(1).argmin() : T(1).argmin(a.integer(2), a.boolean(3, false))); }},
    {"cumsum", [](Args& a) { refuse_split_logits(a, "cumsum", a.integer(2)); return a.ret(T(1).cumsum(a.integer(2))); }},
    {"logsumexp", [](Args& a) {  // logsumexp(dim or {dims} [, keepdim = false])
       auto dims = a.dims(2);
       refuse_split_logits(a, "logsumexp", dims.size() == 1 ? c10::optional<int64_t>(dims[0]) : c10::nullopt);
       return a.ret(T(1).logsumexp(dims, a.boolean(3, false))); }},
    // sort([dim = -1] [, descending = false]) -> values, indices (a stable sort); argsort the indices
    {"sort", [](Args& a) { refuse_split_logits(a, "sort", a.integer(2, -1)); auto [v, i] = T(1).sort(/*stable=*/true, a.integer(2, -1), a.boolean(3, false)); a.ret(v); return 1 + a.ret(i); }},
    {"argsort", [](Args& a) { refuse_split_logits(a, "argsort", a.integer(2, -1)); return a.ret(std::get<1>(T(1).sort(/*stable=*/true, a.integer(2, -1), a.boolean(3, false)))); }},
    {"isnan", [](Args& a) { return a.ret(T(1).isnan()); }},
    {"isinf", [](Args& a) { return a.ret(T(1).isinf()); }},
    {"isfinite", [](Args& a) { return a.ret(T(1).isfinite()); }},
    {"all", [](Args& a) { return a.ret(T(1).all()); }},
    {"any", [](Args& a) { return a.ret(T(1).any()); }},
    {"topk", [](Args& a) { refuse_split_logits(a, "topk", a.integer(3, -1)); auto [v, i] = T(1).topk(a.integer(2), a.integer(3, -1)); a.ret(v); return 1 + a.ret(i); }},
    {"multinomial", [](Args& a) { refuse_split_logits(a, "multinomial", -1); return a.ret(T(1).multinomial(a.integer(2), a.boolean(3, false))); }},
    // comparisons (elementwise, to bool tensors)
    {"eq", [](Args& a) { auto [l, r] = operands(a); return a.ret(l.eq(r)); }},
    {"ne", [](Args& a) { auto [l, r] = operands(a); return a.ret(l.ne(r)); }},
    {"lt", [](Args& a) { auto [l, r] = operands(a); return a.ret(l.lt(r)); }},
    {"le", [](Args& a) { auto [l, r] = operands(a); return a.ret(l.le(r)); }},
    {"gt", [](Args& a) { auto [l, r] = operands(a); return a.ret(l.gt(r)); }},
    {"ge", [](Args& a) { auto [l, r] = operands(a); return a.ret(l.ge(r)); }},
    {"logical_not", [](Args& a) { return a.ret(T(1).logical_not()); }},
    {"logical_and", [](Args& a) { return a.ret(T(1).logical_and(T(2))); }},
    {"logical_or", [](Args& a) { return a.ret(T(1).logical_or(T(2))); }},
    {"logical_xor", [](Args& a) { return a.ret(T(1).logical_xor(T(2))); }},
    {"equal", [](Args& a) { return a.ret(T(1).equal(T(2))); }},
    {"allclose", [](Args& a) { return a.ret(T(1).allclose(T(2), a.number(3, 1e-5), a.number(4, 1e-8))); }},
    // activations
    {"relu", [](Args& a) { return a.ret(T(1).relu()); }},
    {"gelu", [](Args& a) { return a.ret(a.string(2, "none") == "tanh" ? at::gelu(T(1), "tanh") : at::gelu(T(1))); }},
    {"tanh", [](Args& a) { return a.ret(T(1).tanh()); }},
    {"sigmoid", [](Args& a) { return a.ret(T(1).sigmoid()); }},
    {"silu", [](Args& a) { return a.ret(at::silu(T(1))); }},
    {"softmax", [](Args& a) { refuse_split_logits(a, "softmax", a.integer(2)); return a.ret(T(1).softmax(a.integer(2))); }},
    {"log_softmax", [](Args& a) { refuse_split_logits(a, "log_softmax", a.integer(2)); return a.ret(T(1).log_softmax(a.integer(2))); }},
    // in place
    // Done on a deferred build's meta tensor too, they are also recorded and replayed when it is
    // materialized (bindings: record_init); what reads another tensor's values cannot be, and is
    // refused there.
    {"fill_", [](Args& a) {
       if (!a.is_number(2)) refuse_deferred(a, "fill_ with a value that is not a number");
       T(1).fill_(a.scalar(2));  // a boolean into a bool tensor, ...
       return record_init(a, "fill_", {nn::InitOp::Kind::constant, a.is_number(2) ? a.number(2) : 0}); }},
    {"zero_", [](Args& a) { T(1).zero_(); return record_init(a, "zero_", {nn::InitOp::Kind::constant, 0}); }},
    {"copy_", [](Args& a) {
       refuse_deferred(a, "copy_ (of another tensor's values)");
       return a.ret(T(1).copy_(T(2))); }},
    {"add_", [](Args& a) {
       if (!a.is_number(2)) refuse_deferred(a, "add_ of a tensor");
       T(1).add_(a.tensor_or_number(2, T(1)));
       return record_init(a, "add_", {nn::InitOp::Kind::add, a.is_number(2) ? a.number(2) : 0}); }},
    {"mul_", [](Args& a) {
       if (!a.is_number(2)) refuse_deferred(a, "mul_ by a tensor");
       T(1).mul_(a.tensor_or_number(2, T(1)));
       return record_init(a, "mul_", {nn::InitOp::Kind::mul, a.is_number(2) ? a.number(2) : 1}); }},
    {"uniform_", [](Args& a) {
       T(1).uniform_(a.number(2, 0), a.number(3, 1));
       return record_init(a, "uniform_", {nn::InitOp::Kind::uniform, a.number(2, 0), a.number(3, 1)}); }},
    {"normal_", [](Args& a) {
       T(1).normal_(a.number(2, 0), a.number(3, 1));
       return record_init(a, "normal_", {nn::InitOp::Kind::normal, a.number(2, 0), a.number(3, 1)}); }},
    // autograd
    {"backward", [](Args& a) {
       events::forward_ends();  // the first step's activations: what its forward left allocated
       if (a.none(2)) T(1).backward(); else T(1).backward(T(2));
       return a.ret(); }},
    {"requires_grad_", [](Args& a) { return a.ret(T(1).requires_grad_(a.boolean(2, true))); }},
    {"retain_grad", [](Args& a) { T(1).retain_grad(); return a.ret(); }},
    {nullptr, nullptr}};

// Metamethods: arithmetic accepts a number on either side.
const Function kMeta[] = {
    {"__add", [](Args& a) { auto [l, r] = operands(a); return a.ret(l + r); }},
    {"__sub", [](Args& a) { auto [l, r] = operands(a); return a.ret(l - r); }},
    {"__mul", [](Args& a) { auto [l, r] = operands(a); return a.ret(l * r); }},
    {"__div", [](Args& a) { auto [l, r] = operands(a); return a.ret(l / r); }},
    {"__pow", [](Args& a) { auto [l, r] = operands(a); return a.ret(l.pow(r)); }},
    {"__unm", [](Args& a) { return a.ret(-T(1)); }},
    {"__len", [](Args& a) { return a.ret(double(T(1).dim() ? T(1).size(0) : 0)); }},
    {"__tostring", [](Args& a) {
       std::ostringstream s;
       const Tensor& t = T(1);
       if (!t.defined()) return a.ret(std::string("tensor(undefined)"));
       s << "tensor(" << t.sizes() << ", " << dtype_name(t.scalar_type());
       if (!t.device().is_cpu()) s << ", " << t.device();
       if (t.requires_grad()) s << ", requires_grad";
       s << ")";
       if (t.numel() > 1000) return a.ret(s.str());
       if (t.numel() == 0) return a.ret(s.str());
       std::ostringstream body;
       body << t;  // ATen's text ends with a "[ CPUFloatType{2,3} ]" line the header already says
       std::string text = body.str();
       auto last = text.rfind("\n[");
       if (last != std::string::npos) text.resize(last);
       return a.ret(s.str() + "\n" + util::unsigned_nan(text)); }},
    // Fields that are not methods: shape, dtype, device, grad, requires_grad, is_leaf.
    {"__field", [](Args& a) {
       const Tensor& t = a.tensor_shape(1);  // (grad is a tensor of its own)
       if (a.is_number(2)) throw std::invalid_argument("tensors are not indexed with []: use t:select(dim, i) or t:narrow(dim, start, length)");
       std::string key = a.string(2);
       if (key == "shape") return push_ints(a.L, t.sizes());
       if (key == "dtype") return a.ret(dtype_name(t.scalar_type()));
       if (key == "device") return a.ret(t.device().str());
       if (key == "grad") return a.ret(t.grad());
       if (key == "requires_grad") return a.ret(t.requires_grad());
       if (key == "is_leaf") return a.ret(t.is_leaf());
       throw std::invalid_argument("tensor has no method or field '" + key + "'"); }},
    {"__newindex", [](Args& a) {
       Tensor& t = T(1);
       std::string key = a.string(2);
       if (key == "requires_grad") t.requires_grad_(a.boolean(3));
       else if (key == "grad") t.mutable_grad() = a.none(3) ? Tensor() : T(3);
       else throw std::invalid_argument("cannot set field '" + key + "' of a tensor (settable: requires_grad, grad)");
       return a.ret(); }},
    {nullptr, nullptr}};

// Module-level functions: pt.zeros, pt.cat, ...
const Function kFunctions[] = {
    // device(): where this rank computes ("cpu", "cuda:1"): models and batches are put there.
    {"device", [](Args& a) { return a.ret(dist::World::instance().device().str()); }},
    {"tensor", [](Args& a) {
       if (a.is_number(1) || lua_type(a.L, 1) == LUA_TBOOLEAN) {
         auto opts = creation_options(a, 2, "tensor", a.is_number(1) ? torch::kFloat32 : torch::kBool);
         return a.ret(torch::scalar_tensor(a.scalar(1), opts.requires_grad(false)).set_requires_grad(opts.requires_grad()));
       }
       if (!a.is_table(1)) a.expected(1, "table of numbers");
       std::vector<int64_t> shape;
       std::vector<double> values;
       bool bools = true;
       flatten_table(a.L, 1, 0, shape, values, bools);
       // Lua cannot tell 1.0 from 1, so numbers make float32 (as torch.Tensor did in Torch7);
       // ask for {dtype = "int64"} (or call :long()) for integer tensors such as class ids.
       auto dtype = bools && !values.empty() ? torch::kBool : torch::kFloat32;
       auto opts = creation_options(a, 2, "tensor", dtype);
       // Into an integer dtype, each number as it is: NaN, infinity, a fraction or one out of the
       // dtype's range had become another number (1.5 -> 1, 2^63 -> -2^63, NaN -> -9.2e18).
       const auto type = c10::typeMetaToScalarType(opts.dtype());
       if (c10::isIntegralType(type, /*includeBool=*/false)) {
         double lo = 0, hi = 0;
         AT_DISPATCH_INTEGRAL_TYPES(type, "tensor", [&] {
           lo = static_cast<double>(std::numeric_limits<scalar_t>::min());
           hi = static_cast<double>(std::numeric_limits<scalar_t>::max());
         });
         for (size_t k = 0; k < values.size(); ++k) {
           const double x = values[k];
           if (!(x == std::trunc(x) && x >= lo && x <= hi && x < 0x1p63)) {
             std::ostringstream got;
             if (x != x) got << "NaN";
             else got << std::setprecision(17) << x;
             a.fail(1, "element " + std::to_string(k + 1) + " is " + got.str() + ", not an integer " +
                           std::string(c10::toString(type)) + " holds");
           }
         }
       }
       auto t = torch::tensor(values, torch::kFloat64).reshape(shape).to(opts.dtype()).to(opts.device());
       return a.ret(t.set_requires_grad(opts.requires_grad())); }},
    {"zeros", [](Args& a) { auto [s, o] = shape_and_options(a); return a.ret(torch::zeros(s, o)); }},
    {"ones", [](Args& a) { auto [s, o] = shape_and_options(a); return a.ret(torch::ones(s, o)); }},
    {"empty", [](Args& a) { auto [s, o] = shape_and_options(a); return a.ret(torch::empty(s, o)); }},
    {"randn", [](Args& a) { auto [s, o] = shape_and_options(a); return a.ret(torch::randn(s, o)); }},
    {"rand", [](Args& a) { auto [s, o] = shape_and_options(a); return a.ret(torch::rand(s, o)); }},
    {"full", [](Args& a) {
       auto shape = a.dims(1);
       return a.ret(torch::full(shape, a.scalar(2), creation_options(a, 3, "full"))); }},
    {"randint", [](Args& a) {  // randint(low, high, shape[, options])
       auto opts = creation_options(a, 4, "randint", torch::kInt64);
       return a.ret(torch::randint(a.integer(1), a.integer(2), a.dims(3), opts)); }},
    {"arange", [](Args& a) {  // arange(end) | arange(start, end[, step])[, options]
       int opt = 2;
       at::Scalar start = 0, end, step = 1;
       if (a.is_number(2)) {
         start = a.scalar(1); end = a.scalar(2); opt = 3;
         if (a.is_number(3)) { step = a.scalar(3); opt = 4; }
       } else {
         end = a.scalar(1);
       }
       bool integral = start.isIntegral(false) && end.isIntegral(false) && step.isIntegral(false);
       auto opts = creation_options(a, opt, "arange", integral ? torch::kInt64 : torch::kFloat32);
       return a.ret(torch::arange(start, end, step, opts)); }},
    {"linspace", [](Args& a) { return a.ret(torch::linspace(a.scalar(1), a.scalar(2), a.integer(3), creation_options(a, 4, "linspace"))); }},
    {"eye", [](Args& a) { return a.ret(torch::eye(a.integer(1), creation_options(a, 2, "eye"))); }},
    {"zeros_like", [](Args& a) { return a.ret(torch::zeros_like(T(1))); }},
    {"ones_like", [](Args& a) { return a.ret(torch::ones_like(T(1))); }},
    {"randn_like", [](Args& a) { return a.ret(torch::randn_like(T(1))); }},
    {"cat", [](Args& a) { return a.ret(torch::cat(a.tensors(1), a.integer(2, 0))); }},
    {"stack", [](Args& a) { return a.ret(torch::stack(a.tensors(1), a.integer(2, 0))); }},
    {"einsum", [](Args& a) {  // einsum(equation, t1, t2, ...) or einsum(equation, { t1, t2, ... })
       std::string equation = a.string(1);
       std::vector<Tensor> operands;
       if (a.is_table(2)) operands = a.tensors(2);
       else
         for (int i = 2; i <= a.top(); ++i) operands.push_back(T(i));
       if (operands.empty()) a.fail(2, "einsum needs at least one tensor");
       return a.ret(torch::einsum(equation, operands)); }},
    {"where", [](Args& a) { return a.ret(torch::where(T(1), T(2), a.tensor_or_number(3, T(2)))); }},
    {"manual_seed", [](Args& a) { torch::manual_seed(static_cast<uint64_t>(a.integer(1))); return a.ret(); }},
    {"is_tensor", [](Args& a) { return a.ret(a.is_tensor(1)); }},
    {"get_threads", [](Args& a) { return a.ret(double(at::get_num_threads())); }},
    {"set_threads", [](Args& a) {
       int64_t n = a.integer(1);
       if (n < 1 || n > 1024) a.fail(1, "threads must be 1 to 1024, got " + std::to_string(n));
       at::set_num_threads(static_cast<int>(n));
       return a.ret(); }},
    {"cuda_available", [](Args& a) { return a.ret(compat::cuda_available()); }},
    {"now", [](Args& a) {  // seconds on a monotonic clock, for timing
       auto t = std::chrono::steady_clock::now().time_since_epoch();
       return a.ret(std::chrono::duration<double>(t).count()); }},
    {"unix_time", [](Args& a) {  // seconds since 1970 (wall clock), for records read outside the run
       auto t = std::chrono::system_clock::now().time_since_epoch();
       return a.ret(std::chrono::duration<double>(t).count()); }},
    {"cpu_time", [](Args& a) {  // CPU seconds this process has used (all threads)
       timespec ts{};
       clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
       return a.ret(double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec)); }},
    {"grad_enabled", [](Args& a) { return a.ret(torch::GradMode::is_enabled()); }},
    {"no_grad", [](Args& a) {  // no_grad(fn, ...): runs fn with autograd off, returns its results
       if (lua_type(a.L, 1) != LUA_TFUNCTION) a.expected(1, "function");
       int base = lua_gettop(a.L);
       std::string error;
       bool ok;
       {
         torch::NoGradGuard guard;
         ok = pcall(a.L, base - 1, LUA_MULTRET, &error);
       }
       if (!ok) throw Rethrow(error);
       return lua_gettop(a.L); }},  // fn and its arguments were replaced by its results
    {nullptr, nullptr}};

#undef T

// pt.cuda: the CUDA devices this LibTorch sees. On a build without CUDA is_available() is false
// and device_count() 0, synchronize() does nothing (there is nothing queued to wait for), and
// the rest raise "CUDA is not available in this build". [device] is an index, "cuda:N" or a
// device string; none: the current device.
int cuda_index(Args& a, int i, const char* name) {
  if (!compat::kBuiltWithCuda)
    throw std::runtime_error(std::string("pt.cuda.") + name + ": CUDA is not available in this build (LibTorch " +
                             compat::torch_version() + " without CUDA)");
  if (a.none(i)) return compat::cuda_current_device();
  if (a.is_number(i)) return a.int32(i);
  auto spec = a.string(i);
  torch::Device d = parse_device(spec);
  if (!d.is_cuda()) a.fail(i, "a CUDA device expected, got '" + spec + "'");
  return d.has_index() ? d.index() : compat::cuda_current_device();
}

const Function kCuda[] = {
    {"is_available", [](Args& a) { return a.ret(compat::kBuiltWithCuda && compat::cuda_available()); }},
    {"device_count", [](Args& a) { return a.ret(double(compat::kBuiltWithCuda ? compat::cuda_device_count() : 0)); }},
    {"current_device", [](Args& a) { cuda_index(a, 1, "current_device"); return a.ret(double(compat::cuda_current_device())); }},
    {"device_name", [](Args& a) { return a.ret(compat::cuda_device_name(cuda_index(a, 1, "device_name"))); }},
    {"synchronize", [](Args& a) {
       if (!compat::kBuiltWithCuda || !compat::cuda_available()) return a.ret();  // nothing queued to wait for
       compat::synchronize(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(cuda_index(a, 1, "synchronize"))));
       return a.ret(); }},
    // memory_stats([device]): { allocated, reserved, peak_allocated, peak_reserved } in bytes
    {"memory_stats", [](Args& a) {
       auto m = compat::cuda_memory(cuda_index(a, 1, "memory_stats"));
       lua_createtable(a.L, 0, 4);
       auto set = [&](const char* k, int64_t v) { lua_pushnumber(a.L, double(v)); lua_setfield(a.L, -2, k); };
       set("allocated", m.allocated); set("reserved", m.reserved);
       set("peak_allocated", m.peak_allocated); set("peak_reserved", m.peak_reserved);
       return 1; }},
    {"reset_peak_memory_stats", [](Args& a) { compat::cuda_reset_peak(cuda_index(a, 1, "reset_peak_memory_stats")); return a.ret(); }},
    {nullptr, nullptr}};

}  // namespace

bool is_dtype_name(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return true;
  return false;
}

c10::ScalarType parse_dtype(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.type;
  throw std::invalid_argument("unknown dtype '" + name +
                              "' (expected float32, float64, float16, bfloat16, int64, int32, "
                              "int16, int8, uint8 or bool)");
}

// Lua sees a tensor as a small userdata, so its collector never feels the megabytes behind it:
// activations and batches would pile up until a collection happened to run, and every step would
// write into fresh, cold memory. So a tensor handed to Lua counts as that many bytes allocated:
// the collector takes incremental steps in proportion (every 64 KiB, LUA_GCSTEP's unit being
// KiB), never a full collection in one push. One push advances it by at most a quarter of Lua's
// own heap (at least 1 MiB), so a tensor far larger than the heap costs a slice of a cycle, not
// a whole one; a cycle still ends every few such tensors, which bounds the memory they hold.
namespace {
thread_local size_t bytes_since_step = 0;
constexpr size_t kStepBytes = size_t(64) << 10;
}  // namespace

void push_tensor(lua_State* L, Tensor t) {
  if (t.defined()) bytes_since_step += static_cast<size_t>(t.numel()) * t.element_size();
  ud_push(L, std::move(t), PT_TENSOR_MT);
  if (bytes_since_step >= kStepBytes) {
    size_t heap_kb = static_cast<size_t>(lua_gc(L, LUA_GCCOUNT, 0));
    size_t kb = std::min(bytes_since_step >> 10, std::max<size_t>(heap_kb / 4, 1024));
    bytes_since_step = 0;
    lua_gc(L, LUA_GCSTEP, static_cast<int>(kb));
  }
}

void open_tensor(lua_State* L, int core) {
  new_metatable<Tensor>(L, PT_TENSOR_MT);  // its __index is set below
  int mt = lua_gettop(L);
  set_functions(L, mt, kMeta);
  lua_newtable(L);
  int methods = lua_gettop(L);
  set_functions(L, methods, kMethods);
  lua_pushvalue(L, methods);
  lua_setfield(L, mt, "__index");  // partrain/init.lua puts a function here that tries __field too
  lua_setfield(L, core, "Tensor");  // the method table, so Lua can add methods
  lua_setfield(L, core, "Tensor_mt");
  set_functions(L, core, kFunctions);
  set_library(L, core, "cuda", kCuda);
}

}  // namespace partrain::lua
