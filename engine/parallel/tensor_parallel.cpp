// Tensor-parallel layers and their communication (see tensor_parallel.hpp).
#include "engine/parallel/tensor_parallel.hpp"

#include <algorithm>
#include <atomic>
#include <limits>
#include <cmath>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "engine/nn/functional.hpp"
#include "engine/util/text.hpp"

namespace partrain::parallel {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void check_sequence_parts(int64_t length, int64_t parts) {
  TORCH_CHECK(length % parts == 0, "sequence parallelism: the sequence of ", length, " does not split into tensor=",
              parts, " equal parts");
}

namespace {

// Autograd contexts hold IValues; groups are found again through this table by address.
int64_t key_of(const dist::GroupPtr& g) {
  static std::mutex mutex;
  static std::unordered_map<int64_t, dist::GroupPtr> groups;
  std::lock_guard<std::mutex> lock(mutex);
  auto key = reinterpret_cast<int64_t>(g.get());
  groups.emplace(key, g);
  return key;
}
const dist::ProcessGroup& group_of(int64_t key) { return *reinterpret_cast<const dist::ProcessGroup*>(key); }

Tensor all_reduce_copy(const Tensor& x, const dist::ProcessGroup& g) {
  auto y = x.contiguous().clone();
  g.all_reduce(y);
  return y;
}

Tensor gather_last(const Tensor& x, const dist::ProcessGroup& g) {
  if (g.size() == 1) return x;
  return torch::cat(g.all_gather(x.contiguous()), -1);
}

Tensor slice_last(const Tensor& x, const dist::ProcessGroup& g) {
  if (g.size() == 1) return x;
  TORCH_CHECK(x.size(-1) % g.size() == 0, "tensor parallelism: the last dimension ", x.size(-1),
              " does not split into ", g.size(), " equal parts");
  return x.chunk(g.size(), -1)[g.rank()].contiguous();
}

Tensor gather_seq(const Tensor& x, const dist::ProcessGroup& g) {
  if (g.size() == 1) return x;
  return torch::cat(g.all_gather(x.contiguous()), 1);
}

Tensor reduce_scatter_seq(const Tensor& x, const dist::ProcessGroup& g) {
  if (g.size() == 1) return x;
  check_sequence_parts(x.size(1), g.size());
  auto parts = x.chunk(g.size(), 1);
  std::vector<Tensor> inputs;
  for (auto& p : parts) inputs.push_back(p.contiguous());
  auto out = torch::empty_like(inputs[0]);
  g.reduce_scatter(out, inputs);
  return out;
}

Tensor split_seq(const Tensor& x, const dist::ProcessGroup& g) {
  if (g.size() == 1) return x;
  check_sequence_parts(x.size(1), g.size());
  return x.chunk(g.size(), 1)[g.rank()].contiguous();
}

Tensor same(const Tensor& x, const dist::ProcessGroup&) { return x.view_as(x); }

// A communication step as an autograd function: `Forward` on the way in, `Backward` (its
// transpose) on the gradient. The group travels in the context as its registry key.
using Step = Tensor (*)(const Tensor&, const dist::ProcessGroup&);
template <Step Forward, Step Backward>
struct Comm : torch::autograd::Function<Comm<Forward, Backward>> {
  static Tensor forward(AutogradContext* ctx, Tensor x, int64_t group) {
    ctx->saved_data["group"] = group;
    return Forward(x, group_of(group));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {Backward(grads[0], group_of(ctx->saved_data["group"].toInt())), Tensor()};
  }
};

using CopyToRegion = Comm<same, all_reduce_copy>;
using ReduceFromRegion = Comm<all_reduce_copy, same>;
using GatherFromRegion = Comm<gather_last, slice_last>;
using ScatterToRegion = Comm<slice_last, gather_last>;
using GatherSequence = Comm<gather_seq, reduce_scatter_seq>;
using ReduceScatterSequence = Comm<reduce_scatter_seq, gather_seq>;
using SplitSequence = Comm<split_seq, gather_seq>;

// Applies F over `g`; a group of one needs no communication (and no autograd node).
template <class F>
Tensor communicate(const Tensor& x, const dist::GroupPtr& g) {
  return g->size() == 1 ? x : F::apply(x, key_of(g));
}

// y = x W^T + b where x arrives split along the sequence (dimension 1): the all-gather of x runs
// while this rank multiplies its own part, and in backward the reduce-scatter of x's gradient
// runs while the weight's gradient is computed (ShardFormer's sequence_overlap).
struct OverlappedSequenceLinear : torch::autograd::Function<OverlappedSequenceLinear> {
  // `bias` is an empty tensor when the layer has none (autograd functions take defined tensors).
  static Tensor forward(AutogradContext* ctx, Tensor x, Tensor weight, Tensor bias, int64_t group) {
    const auto& g = group_of(group);
    if (bias.numel() == 0) bias = Tensor();
    std::vector<Tensor> parts;
    auto gathering = g.all_gather(x.contiguous(), parts, /*async=*/true);
    auto mine = torch::nn::functional::linear(x, weight, bias);
    gathering.wait();
    std::vector<Tensor> outputs;
    for (int r = 0; r < g.size(); ++r)
      outputs.push_back(r == g.rank() ? mine : torch::nn::functional::linear(parts[r], weight, bias));
    auto full_x = torch::cat(parts, 1);
    ctx->save_for_backward({full_x, weight});
    ctx->saved_data["group"] = group;
    ctx->saved_data["bias"] = bias.defined();
    return torch::cat(outputs, 1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& g = group_of(ctx->saved_data["group"].toInt());
    auto saved = ctx->get_saved_variables();
    const auto& full_x = saved[0];
    const auto& weight = saved[1];
    auto grad = grads[0].contiguous();
    // x's gradient: the full-sequence product, reduce-scattered back to sequence parts.
    auto grad_full_x = grad.matmul(weight);
    const int t = g.size();
    std::vector<Tensor> inputs;
    for (auto& c : grad_full_x.chunk(t, 1)) inputs.push_back(c.contiguous());
    auto grad_x = torch::empty_like(inputs[0]);
    auto scattering = g.reduce_scatter(grad_x, inputs, dist::ReduceOp::Sum, /*async=*/true);
    auto flat_grad = grad.reshape({-1, grad.size(-1)});
    auto grad_w = flat_grad.t().matmul(full_x.reshape({-1, full_x.size(-1)}));
    Tensor grad_b = ctx->saved_data["bias"].toBool() ? flat_grad.sum(0) : Tensor();
    scattering.wait();
    return {grad_x, grad_w, grad_b, Tensor()};
  }
};

// Per-sample cross-entropy over a vocabulary split across the group (Megatron's), (N, V/t) -> (N).
// Computed in the logits' dtype promoted to at least float32: float64 logits keep float64.
// Samples whose target is `ignore` give 0 and no gradient.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static Tensor forward(AutogradContext* ctx, Tensor logits, Tensor targets, int64_t group, int64_t vocab,
                        int64_t ignore) {
    const auto& g = group_of(group);
    const int64_t part = logits.size(-1), first = g.rank() * part;
    auto x = logits.detach().to(c10::promoteTypes(logits.scalar_type(), torch::kFloat32));
    // Padding columns (global index >= vocab) take no part: -inf before the max and the exp.
    auto columns = torch::arange(first, first + part, torch::TensorOptions().dtype(torch::kInt64).device(x.device()));
    x = x.masked_fill(columns.ge(vocab), -std::numeric_limits<double>::infinity());
    auto max = std::get<0>(x.max(-1));
    g.all_reduce(max, dist::ReduceOp::Max);
    auto shifted = x - max.unsqueeze(-1);
    auto ignored = targets.eq(ignore);
    auto outside = targets.lt(first).logical_or(targets.ge(first + part)).logical_or(ignored);
    auto local = (targets - first).masked_fill(outside, 0);
    auto predicted = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0);
    g.all_reduce(predicted);
    auto exp = shifted.exp();
    auto sum = exp.sum(-1);
    g.all_reduce(sum);
    ctx->save_for_backward({exp.div_(sum.unsqueeze(-1)), local, outside, ignored});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return (sum.log() - predicted).masked_fill(ignored, 0).to(logits.scalar_type());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto grad = saved[0].clone();  // softmax
    auto hit = saved[2].logical_not().to(grad.scalar_type());
    grad.scatter_add_(-1, saved[1].unsqueeze(-1), -hit.unsqueeze(-1));
    grad.mul_(grads[0].to(grad.scalar_type()).unsqueeze(-1));
    grad.masked_fill_(saved[3].unsqueeze(-1), 0);
    auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

// ---- Vocabulary-split logits -----------------------------------------------------------------
// Marked by storage, with a weak reference beside it (a freed storage's address can be reused).
namespace {
using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;
std::mutex logits_mutex;
std::atomic<bool> logits_ever_marked{false};
std::unordered_map<const c10::StorageImpl*, std::pair<WeakStorage, SplitLogits>>& logits_marks() {
  static std::unordered_map<const c10::StorageImpl*, std::pair<WeakStorage, SplitLogits>> map;
  return map;
}
}  // namespace

void mark_split_logits(const Tensor& logits, const SplitLogits& info) {
  if (!logits.defined() || !logits.has_storage()) return;
  std::lock_guard<std::mutex> lock(logits_mutex);
  auto& marks = logits_marks();
  if (marks.size() >= 64)  // logits of past steps: forget the freed ones
    for (auto it = marks.begin(); it != marks.end();) it = it->second.first.expired() ? marks.erase(it) : std::next(it);
  marks.insert_or_assign(logits.storage().unsafeGetStorageImpl(),
                         std::make_pair(logits.storage().getWeakStorageImpl(), info));
  logits_ever_marked = true;
}

c10::optional<SplitLogits> split_logits_of(const Tensor& t) {
  if (!logits_ever_marked || !t.defined() || !t.has_storage()) return c10::nullopt;
  std::lock_guard<std::mutex> lock(logits_mutex);
  auto& marks = logits_marks();
  auto it = marks.find(t.storage().unsafeGetStorageImpl());
  if (it == marks.end()) return c10::nullopt;
  if (it->second.first.expired()) {
    marks.erase(it);
    return c10::nullopt;
  }
  return it->second.second;
}

bool split_logits_marked() { return logits_ever_marked; }

Tensor gather_split_logits(const Tensor& local_logits, const SplitLogits& info) {
  TORCH_CHECK(local_logits.dim() >= 1 && local_logits.size(-1) == info.local, "gathering vocabulary-split logits: "
              "expected (..., ", info.local, ") with this rank's ", info.local, " of ", info.padded,
              " columns, got ", local_logits.sizes());
  return gather_from_tensor_region(local_logits, info.group).narrow(-1, 0, info.vocab);
}

nn::TensorMap full_state_dict(const nn::Module& module) {
  nn::TensorMap out;
  std::unordered_map<const c10::TensorImpl*, Tensor> gathered;  // a tied weight is gathered once
  torch::NoGradGuard no_grad;
  for (const auto& [name, t] : module.state_dict()) {  // name order: the same on every rank
    auto s = sharding_of(module, name);
    if (!s) {
      out[name] = t.detach();
      continue;
    }
    auto& full = gathered[t.unsafeGetTensorImpl()];
    if (!full.defined()) full = gather_full(t, *s);
    out[name] = full;
  }
  return out;
}

void load_full_state_dict(nn::Module& module, const nn::TensorMap& state, bool strict) {
  nn::TensorMap local = state;
  for (const auto& [name, t] : module.state_dict()) {
    auto s = sharding_of(module, name);
    auto it = local.find(name);
    if (!s || it == local.end()) continue;
    TORCH_CHECK(it->second.sizes().equals(s->shape), "load_full_state_dict into ", module.type(), ": '", name,
                "' has shape ", it->second.sizes(), " but the model's logical shape is ", c10::IntArrayRef(s->shape));
    it->second = local_part(it->second.to(t.device()), *s, s->group->rank());
  }
  module.load_state_dict(local, strict);
}

double global_grad_norm(const std::vector<Tensor>& params, const std::vector<dist::GroupPtr>& groups) {
  TORCH_CHECK(groups.empty() || groups.size() == params.size(), "global_grad_norm: ", groups.size(),
              " groups for ", params.size(), " parameters");
  // Squared norms summed as tensors (no host sync per parameter): whole parameters together,
  // split ones per group, in first-seen order (the same on every rank).
  Tensor whole;
  std::vector<std::pair<dist::GroupPtr, Tensor>> split;
  auto add = [](Tensor& acc, const Tensor& sq) { acc = acc.defined() ? acc + sq : sq; };
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    if (!p.grad().defined()) continue;
    auto sq = p.grad().detach().to(torch::kFloat64).pow(2).sum();
    auto g = groups.empty() ? nullptr : groups[i];
    if (!g) {
      add(whole, sq);
      continue;
    }
    auto it = std::find_if(split.begin(), split.end(), [&](const auto& e) { return e.first == g; });
    if (it == split.end()) split.emplace_back(g, sq);
    else add(it->second, sq);
  }
  for (auto& [g, sq] : split) {
    auto t = sq.reshape({1}).contiguous();  // on the gradients' device: the rank's
    g->all_reduce(t);
    add(whole, t.squeeze(0));
  }
  return whole.defined() ? std::sqrt(whole.item<double>()) : 0.0;
}

Tensor copy_to_tensor_region(const Tensor& x, const dist::GroupPtr& g) { return communicate<CopyToRegion>(x, g); }
Tensor reduce_from_tensor_region(const Tensor& x, const dist::GroupPtr& g) { return communicate<ReduceFromRegion>(x, g); }
Tensor gather_from_tensor_region(const Tensor& x, const dist::GroupPtr& g) { return communicate<GatherFromRegion>(x, g); }
Tensor scatter_to_tensor_region(const Tensor& x, const dist::GroupPtr& g) { return communicate<ScatterToRegion>(x, g); }
Tensor gather_sequence(const Tensor& x, const dist::GroupPtr& g) { return communicate<GatherSequence>(x, g); }
Tensor reduce_scatter_sequence(const Tensor& x, const dist::GroupPtr& g) {
  return communicate<ReduceScatterSequence>(x, g);
}
Tensor split_sequence(const Tensor& x, const dist::GroupPtr& g) { return communicate<SplitSequence>(x, g); }

bool align_to_first_rank(nn::Module& model, const dist::GroupPtr& group) {
  if (!group || group->size() == 1) return false;
  std::vector<Tensor> tensors = nn::unique_parameters(model);
  for (const auto& b : model.buffers()) tensors.push_back(b);
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(), [](const Tensor& t) { return !t.defined(); }),
                tensors.end());
  if (tensors.empty() || tensors.front().is_meta()) return false;
  torch::NoGradGuard no_grad;
  // Three numbers a tensor (its sum, sum of squares, and a position-weighted sum), the largest and
  // the smallest over the group: equal everywhere when every rank holds the same tensors.
  std::vector<Tensor> sums;
  for (const auto& t : tensors) {
    auto x = t.detach().reshape({-1}).to(torch::kCPU, torch::kFloat64);
    auto w = torch::arange(x.numel(), x.options()).remainder(7).add_(1);
    sums.push_back(torch::stack({x.sum(), x.pow(2).sum(), (x * w).sum()}));
  }
  auto high = torch::cat(sums).nan_to_num(0, 1e300, -1e300), low = high.clone();
  group->all_reduce(high, dist::ReduceOp::Max);
  group->all_reduce(low, dist::ReduceOp::Min);
  if (high.equal(low)) return false;
  for (auto& t : tensors) {
    auto data = t.data();
    group->broadcast(data, 0);
    t.unsafeGetTensorImpl()->bump_version();  // written behind autograd's back: an undo must see it
  }
  return true;
}

// ---- ColumnParallelLinear ------------------------------------------------------------------

namespace {
// `count` equal parts of `out` (q, k, v: 3), or an error naming the sizes.
std::vector<int64_t> equal_parts(int64_t out, int64_t count) {
  TORCH_CHECK(count >= 1 && out % count == 0, "column-parallel linear: fused=", count, " does not divide out=", out);
  return std::vector<int64_t>(static_cast<size_t>(count), out / count);
}
}  // namespace

ColumnParallelLinear::ColumnParallelLinear(const nn::Linear& serial, dist::GroupPtr g, int64_t fused, bool gather,
                                           bool sequence, bool pad)
    : ColumnParallelLinear(serial, std::move(g), equal_parts(serial.options.out, fused), gather, sequence, pad) {}

ColumnParallelLinear::ColumnParallelLinear(const nn::Linear& serial, dist::GroupPtr g, std::vector<int64_t> part_sizes,
                                           bool gather, bool sequence, bool pad)
    : nn::Unary("ColumnParallelLinear"), group(std::move(g)), in(serial.options.in), out(serial.options.out),
      parts(std::move(part_sizes)), logical_out(serial.options.out), gather_output(gather),
      sequence_parallel(sequence) {
  if (parts.empty()) parts = {out};
  const int t = group->size(), r = group->rank();
  int64_t padded = out;
  if (pad && out % t != 0) {
    TORCH_CHECK(parts.size() == 1 && !gather_output, "column-parallel linear: padding works only unfused and ungathered");
    padded = (out + t - 1) / t * t;
  }
  if (padded == out)
    for (auto p : parts)
      TORCH_CHECK(p > 0 && p % t == 0, "column-parallel linear: out=", out,
                  (parts.size() > 1 ? " (a part of " + std::to_string(p) + ")" : std::string()),
                  " does not split into tensor=", t, " equal parts");
  // Rank r's rows: its slice of every part (a head's q, k and v stay on one rank), padding zero.
  auto split = Sharding::split(group, 0, {logical_out, in}, parts, padded);
  out = padded;
  torch::NoGradGuard no_grad;
  // A frozen parameter stays frozen (requires_grad as the serial layer's).
  register_parameter("weight", local_part(serial.weight().detach(), split, r), serial.weight().requires_grad());
  if (serial.bias().defined()) {
    auto bias_split = Sharding::split(group, 0, {logical_out}, parts, padded);
    register_parameter("bias", local_part(serial.bias().detach(), bias_split, r), serial.bias().requires_grad());
    if (t > 1) bias_split_ = bias_split;
  } else {
    register_parameter("bias", Tensor(), false);
  }
  if (t > 1) weight_split_ = split;
  vocab_head = pad;
}

const Sharding* ColumnParallelLinear::sharding_of(const std::string& name) const {
  if (name == "weight" && weight_split_) return &*weight_split_;
  if (name == "bias" && bias_split_) return &*bias_split_;
  return nullptr;
}

namespace {
void check_local_shape(const nn::Module& m, const std::string& path, const char* name, std::vector<int64_t> want) {
  const auto& p = m.param(name);
  if (!p.defined()) return;
  TORCH_CHECK(p.sizes().equals(want), path, ": ", m.type(), " holds a ", name, " of ", p.sizes(), ", not its part ",
              c10::IntArrayRef(want));
}
}  // namespace

void ColumnParallelLinear::check(const std::string& path) const {
  const int64_t t = group->size();
  TORCH_CHECK(param("weight").defined(), path, ": ColumnParallelLinear has no weight");
  check_local_shape(*this, path, "weight", {out / t, in});
  check_local_shape(*this, path, "bias", {out / t});
}

c10::optional<nn::Features> ColumnParallelLinear::output_features() const {
  if (gather_output || group->size() == 1) return nn::Features{out};
  return nn::Features{out, group->size(), static_cast<int64_t>(parts.size())};
}

Tensor ColumnParallelLinear::forward(const Tensor& x) {
  TORCH_CHECK(x.size(-1) == in, "ColumnParallelLinear(", in, ", ", out, ") expects input (..., ", in, "), got ",
              x.sizes());
  Tensor y;
  if (sequence_parallel && sequence_overlap && group->size() > 1) {
    TORCH_CHECK(x.dim() == 3, "ColumnParallelLinear with sequence_overlap expects (B, T/t, ", in, "), got ", x.sizes());
    auto bias = param("bias").defined() ? param("bias") : torch::empty({0}, x.options());
    y = OverlappedSequenceLinear::apply(x, param("weight"), bias, key_of(group));
  } else {
    auto input = sequence_parallel ? gather_sequence(x, group) : copy_to_tensor_region(x, group);
    y = torch::nn::functional::linear(input, param("weight"), param("bias"));
  }
  if (!gather_output) {
    if (vocab_head && group->size() > 1)  // (..., padded/t): losses and sampling must know
      mark_split_logits(y, SplitLogits{group, logical_out, out, out / group->size()});
    return y;
  }
  TORCH_CHECK(parts.size() == 1, "column-parallel linear: gather_output with fused parts would interleave them");
  return gather_from_tensor_region(y, group);
}

std::string ColumnParallelLinear::extra_repr() const {
  std::ostringstream s;
  s << "in=" << in << ", out=" << out << " (" << out / group->size() << " here of tensor=" << group->size() << ")";
  if (parts.size() > 1) {
    bool equal = std::all_of(parts.begin(), parts.end(), [&](int64_t p) { return p == parts.front(); });
    if (equal) s << ", fused=" << parts.size();
    else s << ", parts=" << c10::IntArrayRef(parts);
  }
  if (vocab_head) s << ", vocab_head";
  if (gather_output) s << ", gather_output";
  if (sequence_parallel) s << ", sequence_parallel";
  if (sequence_overlap) s << ", sequence_overlap";
  return s.str();
}

// ---- RowParallelLinear ---------------------------------------------------------------------

RowParallelLinear::RowParallelLinear(const nn::Linear& serial, dist::GroupPtr g, bool parallel_input, bool sequence)
    : nn::Unary("RowParallelLinear"), group(std::move(g)), in(serial.options.in), out(serial.options.out),
      input_is_parallel(parallel_input), sequence_parallel(sequence) {
  torch::NoGradGuard no_grad;
  register_parameter("weight", shard(serial.weight().detach(), 1, group->rank(), group->size(), "row-parallel weight"),
                     serial.weight().requires_grad());
  if (serial.bias().defined())
    register_parameter("bias", serial.bias().detach().clone(), serial.bias().requires_grad());  // whole
  else register_parameter("bias", Tensor(), false);
  if (group->size() > 1) weight_split_ = Sharding::split(group, 1, {out, in});
}

const Sharding* RowParallelLinear::sharding_of(const std::string& name) const {
  return name == "weight" && weight_split_ ? &*weight_split_ : nullptr;
}

Tensor RowParallelLinear::forward(const Tensor& x) {
  auto local = input_is_parallel ? x : scatter_to_tensor_region(x, group);
  const int64_t part = in / group->size();
  TORCH_CHECK(local.size(-1) == part, "RowParallelLinear(", in, ", ", out, ") expects its part of the input (..., ",
              part, "), got ", local.sizes());
  auto partial = torch::nn::functional::linear(local, param("weight"));
  auto y = sequence_parallel ? reduce_scatter_sequence(partial, group) : reduce_from_tensor_region(partial, group);
  if (!param("bias").defined()) return y;
  // Under sequence parallelism each rank adds the bias to its part of the sequence only: the
  // bias's gradient is a partial sum, completed over the group.
  return y + (sequence_parallel ? copy_to_tensor_region(param("bias"), group) : param("bias"));
}

void RowParallelLinear::check(const std::string& path) const {
  TORCH_CHECK(param("weight").defined(), path, ": RowParallelLinear has no weight");
  check_local_shape(*this, path, "weight", {out, in / group->size()});
  check_local_shape(*this, path, "bias", {out});
}

c10::optional<nn::Features> RowParallelLinear::input_features() const {
  if (input_is_parallel && group->size() > 1) return nn::Features{in, group->size(), 1};
  return nn::Features{in};
}

std::string RowParallelLinear::extra_repr() const {
  std::ostringstream s;
  s << "in=" << in << " (" << in / group->size() << " here of tensor=" << group->size() << "), out=" << out;
  if (!input_is_parallel) s << ", splits its input";
  if (sequence_parallel) s << ", sequence_parallel";
  return s.str();
}

// ---- ParallelLayerNorm ---------------------------------------------------------------------

ParallelLayerNorm::ParallelLayerNorm(const nn::LayerNorm& serial, dist::GroupPtr g, bool sequence, bool fused_kernel)
    : nn::Unary("ParallelLayerNorm"), group(std::move(g)), dim(serial.options.dim), eps(serial.options.eps),
      sequence_parallel(sequence), fused(fused_kernel) {
  register_parameter("weight", serial.weight(), serial.weight().defined() && serial.weight().requires_grad());
  register_parameter("bias", serial.bias(), serial.bias().defined() && serial.bias().requires_grad());
}

ParallelLayerNorm::ParallelLayerNorm(const nn::RMSNorm& serial, dist::GroupPtr g, bool sequence)
    : nn::Unary("ParallelRMSNorm"), group(std::move(g)), dim(serial.options.dim), eps(serial.options.eps),
      sequence_parallel(sequence), fused(false), rms(true) {
  register_parameter("weight", serial.weight(), serial.weight().defined() && serial.weight().requires_grad());
}

Tensor ParallelLayerNorm::forward(const Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == dim, "ParallelLayerNorm(", dim, ") expects input (..., ", dim, "), got ",
              x.sizes());
  Tensor w = param("weight"), b = rms ? Tensor() : param("bias");
  if (sequence_parallel) {  // partial gradients, summed over the group in backward
    if (w.defined()) w = copy_to_tensor_region(w, group);
    if (b.defined()) b = copy_to_tensor_region(b, group);
  }
  if (rms) return nn::rms_norm(x, w, eps);
  if (fused) return at::layer_norm(x, {dim}, w, b, eps);
  auto mean = x.mean(-1, true);
  auto centered = x - mean;
  auto y = centered * (centered.pow(2).mean(-1, true) + eps).rsqrt();
  if (w.defined()) y = y * w;
  return b.defined() ? y + b : y;
}

void ParallelLayerNorm::check(const std::string& path) const {
  check_local_shape(*this, path, "weight", {dim});
  if (!rms) check_local_shape(*this, path, "bias", {dim});
}

std::string ParallelLayerNorm::extra_repr() const {
  std::ostringstream s;
  s << "dim=" << dim << ", eps=" << eps << (sequence_parallel ? ", sequence_parallel" : "");
  if (!rms) s << (fused ? ", fused" : ", composed");
  return s.str();
}

// ---- VocabParallelEmbedding ----------------------------------------------------------------

VocabParallelEmbedding::VocabParallelEmbedding(const nn::Embedding& serial, dist::GroupPtr g)
    : nn::Unary("VocabParallelEmbedding"), group(std::move(g)), count(serial.options.count), dim(serial.options.dim) {
  const int t = group->size();
  padded = (count + t - 1) / t * t;  // padding is sound here: those rows are never looked up
  first = group->rank() * (padded / t);
  torch::NoGradGuard no_grad;
  auto full = torch::zeros({padded, dim}, serial.weight().options().requires_grad(false));
  full.narrow(0, 0, count).copy_(serial.weight().detach());
  register_parameter("weight", full.narrow(0, first, padded / t).clone(), serial.weight().requires_grad());
  if (t > 1) weight_split_ = Sharding::split(group, 0, {count, dim}, {}, padded);
}

const Sharding* VocabParallelEmbedding::sharding_of(const std::string& name) const {
  return name == "weight" && weight_split_ ? &*weight_split_ : nullptr;
}

Tensor VocabParallelEmbedding::forward(const Tensor& ids) {
  TORCH_CHECK(!ids.is_floating_point() && ids.scalar_type() != torch::kBool,
              "VocabParallelEmbedding expects integer ids, got ", util::dtype_name(ids.scalar_type()));
  // An id outside the vocabulary is outside every rank's rows: it would embed as zeros on all of
  // them, without an error (a policy's own forward may call this without the model's id check).
  if (ids.numel() > 0 && !ids.is_meta()) {
    auto [lo, hi] = nn::extremes(ids);
    TORCH_CHECK(lo >= 0 && hi < count, "VocabParallelEmbedding: token id ", lo < 0 ? lo : hi,
                " is out of range for the vocabulary of ", count, " (ids are 0 to ", count - 1, ")");
  }
  const int64_t rows = padded / group->size();
  auto outside = ids.lt(first).logical_or(ids.ge(first + rows));
  auto local = (ids - first).masked_fill(outside, 0);
  auto y = torch::nn::functional::embedding(local, param("weight")).masked_fill(outside.unsqueeze(-1), 0);
  return reduce_from_tensor_region(y, group);
}

void VocabParallelEmbedding::check(const std::string& path) const {
  TORCH_CHECK(param("weight").defined(), path, ": VocabParallelEmbedding has no weight");
  check_local_shape(*this, path, "weight", {padded / group->size(), dim});
}

std::string VocabParallelEmbedding::extra_repr() const {
  std::ostringstream s;
  s << "count=" << count << " (padded to " << padded << "; rows " << first << ".." << first + padded / group->size() - 1
    << " here), dim=" << dim;
  return s.str();
}

Tensor vocab_parallel_cross_entropy(const Tensor& local_logits, const Tensor& targets, const dist::GroupPtr& group,
                                    int64_t vocab, int64_t ignore_index, const std::string& reduction) {
  TORCH_CHECK(reduction == "mean" || reduction == "sum", "vocab-parallel cross_entropy: reduction must be 'mean' or "
              "'sum', got '", reduction, "'");
  TORCH_CHECK(local_logits.dim() == targets.dim() + 1 &&
                  local_logits.sizes().slice(0, targets.dim()).equals(targets.sizes()),
              "vocab-parallel cross_entropy expects logits (..., V/t) and targets (...), got ", local_logits.sizes(),
              " and ", targets.sizes());
  TORCH_CHECK(!targets.is_floating_point() && targets.scalar_type() != torch::kBool,
              "vocab-parallel cross_entropy expects integer class ids, got ", util::dtype_name(targets.scalar_type()));
  const int64_t t = group->size(), part = local_logits.size(-1);
  TORCH_CHECK(vocab > 0 && (vocab + t - 1) / t == part, "vocab-parallel cross_entropy: logits of ", part,
              " columns a rank over tensor=", t, " do not hold a vocabulary of ", vocab, " (expected ",
              (vocab + t - 1) / t, " columns a rank)");
  if (!targets.is_meta()) {  // a target outside the vocabulary would silently count as none
    auto bad = targets.ne(ignore_index).logical_and(targets.lt(0).logical_or(targets.ge(vocab)));
    if (bad.any().item<bool>())
      TORCH_CHECK(false, "cross_entropy: target ", targets.masked_select(bad)[0].item<int64_t>(),
                  " is outside the vocabulary [0, ", vocab, ")");
  }
  auto flat = local_logits.reshape({-1, part});
  // bfloat16 and float16 logits: the softmax and the loss in float32, as the serial loss does.
  if (flat.scalar_type() == torch::kBFloat16 || flat.scalar_type() == torch::kHalf) flat = flat.to(torch::kFloat32);
  // Any integer ids, as the serial loss takes them (the kernel below gathers by int64).
  auto flat_targets = targets.reshape({-1}).to(torch::kLong);
  auto losses = VocabParallelCrossEntropy::apply(flat, flat_targets, key_of(group), vocab, ignore_index);
  if (reduction == "sum") return losses.sum();
  auto counted = flat_targets.ne(ignore_index).sum().to(losses.scalar_type());
  return losses.sum() / counted;
}

}  // namespace partrain::parallel
