// Ring and all-to-all attention over a context group (see context_parallel.hpp).
#include "engine/parallel/context_parallel.hpp"

#include <atomic>
#include <cmath>
#include <limits>
#include <optional>

#include "engine/nn/functional.hpp"
#include "engine/parallel/group_holder.hpp"
#include "engine/parallel/trace.hpp"
#include "engine/util/planning.hpp"
#include "engine/util/text.hpp"
#include "engine/util/zigzag.hpp"

namespace partrain::parallel {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

ContextMode parse_context_mode(const std::string& name) {
  if (name == "ring") return ContextMode::Ring;
  if (name == "all_to_all" || name == "a2a" || name == "ulysses") return ContextMode::AllToAll;
  TORCH_CHECK(false, "context parallelism: unknown mode '", name, "' (expected \"ring\" or \"all_to_all\")");
}

const char* to_string(ContextMode mode) { return mode == ContextMode::Ring ? "ring" : "all_to_all"; }

std::string context_mode_refusal(ContextMode mode, int64_t heads, int64_t kv_heads, int c) {
  if (mode != ContextMode::AllToAll || c <= 1) return "";
  std::ostringstream why;
  if (heads % c != 0)
    why << "all_to_all attention scatters the heads over context=" << c << ", but " << heads
        << " query heads do not divide by " << c << " (use mode=\"ring\")";
  else if (kv_heads % c != 0 && c % kv_heads != 0)
    why << "all_to_all attention scatters the heads over context=" << c << ", but " << kv_heads
        << " key/value heads neither divide by " << c << " nor divide it (use mode=\"ring\")";
  return why.str();
}

// ---- Layout ----------------------------------------------------------------------------------

Tensor zigzag_index(int64_t length, int c, int r) { return util::zigzag_index(length, c, r); }

Tensor context_positions(int64_t local, const dist::GroupPtr& group) {
  const int c = group ? group->size() : 1;
  if (c == 1) return torch::arange(local, torch::TensorOptions().dtype(torch::kInt64));
  TORCH_CHECK(local % 2 == 0, "context parallelism: this rank holds ", local,
              " positions, not an even number (one early and one late chunk of equal length)");
  return zigzag_index(local * c, c, group->rank());
}

Tensor split_context(const Tensor& x, const dist::GroupPtr& group, int64_t dim) {
  const int c = group ? group->size() : 1;
  if (c == 1) return x;
  TORCH_CHECK(dim >= -x.dim() && dim < x.dim(), "split_context: dimension ", dim, " of a tensor of shape ", x.sizes());
  dim = dim < 0 ? dim + x.dim() : dim;
  auto index = zigzag_index(x.size(dim), c, group->rank()).to(x.device());
  return x.index_select(dim, index);
}

Tensor sequence_rows(int64_t rows, const dist::GroupPtr& context, int64_t parts, int64_t part) {
  return context_positions(rows * parts, context).narrow(0, part * rows, rows);
}

Tensor sequence_dropout(const Tensor& x, double p, bool training, const dist::GroupPtr& context, int64_t parts,
                        int64_t part) {
  const int c = context ? context->size() : 1;
  if (c == 1) return nn::dropout_part(x, p, training, 1, parts, part);
  const int64_t length = x.size(1) * parts * c;
  return nn::dropout_rows(x, p, training, 1, length, sequence_rows(x.size(1), context, parts, part).to(x.device()));
}

// ---- Blocks ----------------------------------------------------------------------------------

namespace {

torch::ScalarType accumulation(const Tensor& q) {
  return c10::promoteTypes(q.scalar_type(), torch::kFloat32);
}

bool fused_applies(const Tensor& q, const Tensor& v) {
  const auto t = q.scalar_type();
  return q.device().is_cpu() && q.size(-1) == v.size(-1) &&
         (t == torch::kFloat32 || t == torch::kFloat64 || t == torch::kBFloat16 || t == torch::kHalf);
}

// Keys and values of `kv_heads` heads repeated for `heads` query heads (grouped-query attention).
Tensor widen_heads(const Tensor& x, int64_t heads) {
  return x.size(1) == heads ? x : x.repeat_interleave(heads / x.size(1), 1);
}

// The block's scores, masked top-left when causal, in the accumulation dtype.
Tensor block_scores(const Tensor& q, const Tensor& k, bool causal, double scale) {
  const auto acc = accumulation(q);
  auto s = q.to(acc).matmul(widen_heads(k, q.size(1)).to(acc).transpose(-2, -1)) * scale;
  if (causal) {
    auto allowed = torch::ones({q.size(2), k.size(2)}, q.options().dtype(torch::kBool)).tril();
    s = s.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  }
  return s;
}

// Sums the gradient of repeated key/value heads back onto the `kv_heads` heads.
Tensor narrow_heads(const Tensor& g, int64_t kv_heads) {
  if (g.size(1) == kv_heads) return g;
  return g.view({g.size(0), kv_heads, g.size(1) / kv_heads, g.size(2), g.size(3)}).sum(2);
}

}  // namespace

AttentionBlock attention_block(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                               bool fused) {
  const auto acc = accumulation(q);
  if (fused && fused_applies(q, v)) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, {}, scale);
    return {out.to(acc), lse.to(acc)};
  }
  auto s = block_scores(q, k, causal, scale);
  auto lse = s.logsumexp(-1);
  auto out = (s - lse.unsqueeze(-1)).exp().matmul(widen_heads(v, q.size(1)).to(acc));
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_block_backward(const Tensor& grad, const Tensor& q, const Tensor& k,
                                                            const Tensor& v, const Tensor& out, const Tensor& lse,
                                                            bool causal, double scale, bool fused) {
  const auto acc = accumulation(q);
  if (fused && fused_applies(q, v)) {
    auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad.to(q.scalar_type()), q, k, v, out.to(q.scalar_type()), lse.contiguous(), 0.0,
        causal, {}, scale);
    return {dq.to(acc), dk.to(acc), dv.to(acc)};
  }
  const int64_t heads = q.size(1), kv_heads = k.size(1);
  auto s = block_scores(q, k, causal, scale);
  auto p = (s - lse.to(acc).unsqueeze(-1)).exp();
  auto g = grad.to(acc);
  auto rows = (g * out.to(acc)).sum(-1, true);  // rowsum(dO * O): of the whole attention's output
  auto wide_k = widen_heads(k, heads).to(acc), wide_v = widen_heads(v, heads).to(acc);
  auto ds = p * (g.matmul(wide_v.transpose(-2, -1)) - rows);
  auto dq = ds.matmul(wide_k) * scale;
  auto dk = narrow_heads(ds.transpose(-2, -1).matmul(q.to(acc)) * scale, kv_heads);
  auto dv = narrow_heads(p.transpose(-2, -1).matmul(g), kv_heads);
  return {dq, dk, dv};
}

void merge_attention(Tensor& out, Tensor& lse, const Tensor& out_b, const Tensor& lse_b) {
  if (!out.defined()) {
    out = out_b.clone();
    lse = lse_b.clone();
    return;
  }
  // out' = out e^(lse - lse') + out_b e^(lse_b - lse') with lse' = logaddexp(lse, lse_b), in the
  // stable form: out -= sigmoid(lse_b - lse) (out - out_b); lse -= logsigmoid(lse - lse_b).
  out.sub_(torch::sigmoid(lse_b - lse).unsqueeze(-1) * (out - out_b));
  lse.sub_(torch::log_sigmoid(lse - lse_b));
}

// ---- The ring --------------------------------------------------------------------------------

namespace {

class GroupRing : public RingLink {
 public:
  explicit GroupRing(dist::GroupPtr group) : group_(std::move(group)) {}
  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }
  std::function<void()> pass(const Tensor& out, Tensor& in, Channel channel, int step) override {
    const int c = size(), r = rank();
    const auto start = StepTrace::Clock::now();
    // The first pass of each attention carries a header (dtype and size): ranks holding different
    // lengths fail there, naming both, rather than mixing partial blocks.
    auto work = std::make_shared<dist::Work>(
        group_->send_recv(out, (r + 1) % c, in, (r + c - 1) % c, channel, /*described=*/channel == Keys && step == 0));
    if (!StepTrace::instance().active()) return [work] { work->wait(); };
    // Traced: the exchange from its start to its completion (on the thread that completes it),
    // recorded once it has been waited for.
    auto end = std::make_shared<std::atomic<int64_t>>(0);
    work->when_done([end] { end->store(StepTrace::Clock::now().time_since_epoch().count()); });
    const auto kind = channel == Keys ? TraceKind::RingPass : TraceKind::RingGradient;
    return [work, end, start, kind, step] {
      work->wait();
      const int64_t at = end->load();
      StepTrace::instance().record_span(
          kind, start, at > 0 ? StepTrace::Clock::time_point(StepTrace::Clock::duration(at)) : StepTrace::Clock::now(),
          step);
    };
  }

 private:
  dist::GroupPtr group_;
};

// k and v as one message; unpack views it back.
Tensor pack(const Tensor& k, const Tensor& v) { return torch::cat({k.reshape(-1), v.reshape(-1)}); }
std::pair<Tensor, Tensor> unpack(const Tensor& flat, const Tensor& k, const Tensor& v) {
  return {flat.narrow(0, 0, k.numel()).view(k.sizes()), flat.narrow(0, k.numel(), v.numel()).view(v.sizes())};
}

// Which block rank r works on at step i of c, with s = (r - i) mod c the owner of the keys it
// holds: the causal diagonal (step 0), everything (not causal), the owner's early keys against
// all of r's queries (s < r: chunk s precedes both of r's chunks, chunk 2c-1-s follows both), or
// r's late queries against all the owner's keys (s > r: both of s's chunks follow chunk r and
// precede chunk 2c-1-r). Every step after the first is half a square: the load is balanced.
enum class Part { Diagonal, All, EarlyKeys, LateQueries };
Part part_at(int i, int r, int c, bool causal) {
  if (!causal) return Part::All;
  if (i == 0) return Part::Diagonal;
  return (r + c - i) % c < r ? Part::EarlyKeys : Part::LateQueries;
}

// The key/value blocks going around the ring: the one held at step i, and the next one arriving
// from the previous rank while step i computes (none after the last step).
class KeysInFlight {
 public:
  KeysInFlight(c10::intrusive_ptr<RingLink> link, Tensor first) : link_(std::move(link)), held_(std::move(first)) {}
  /// The block held at step i, its pass to the next rank started.
  const Tensor& start(int i) {
    if (i < link_->size() - 1) {
      next_ = torch::empty_like(held_);
      arrived_ = link_->pass(held_, next_, RingLink::Keys, i);
    }
    return held_;
  }
  /// Waits for the next block, which is then the one held.
  void finish() {
    if (!arrived_) return;
    arrived_();
    arrived_ = nullptr;
    held_ = next_;
  }

 private:
  c10::intrusive_ptr<RingLink> link_;
  Tensor held_, next_;
  std::function<void()> arrived_;
};

struct Ring : torch::autograd::Function<Ring> {
  static Tensor forward(AutogradContext* ctx, Tensor q, Tensor k, Tensor v, c10::intrusive_ptr<RingLink> link,
                        bool causal, double scale) {
    const int c = link->size(), r = link->rank();
    const int64_t n = q.size(2) / 2;
    Tensor out, lse;
    KeysInFlight keys(link, pack(k, v));
    for (int i = 0; i < c; ++i) {
      auto [kb, vb] = unpack(keys.start(i), k, v);
      std::optional<TraceSpan> span(std::in_place, TraceKind::RingBlock, i);  // under the exchange started above
      switch (part_at(i, r, c, causal)) {
        case Part::Diagonal:
        case Part::All: {
          auto b = attention_block(q, kb, vb, causal, scale);
          merge_attention(out, lse, b.out, b.lse);
          break;
        }
        case Part::EarlyKeys: {
          auto b = attention_block(q, kb.narrow(2, 0, n), vb.narrow(2, 0, n), false, scale);
          merge_attention(out, lse, b.out, b.lse);
          break;
        }
        case Part::LateQueries: {
          auto b = attention_block(q.narrow(2, n, n), kb, vb, false, scale);
          auto o = out.narrow(2, n, n), l = lse.narrow(2, n, n);
          merge_attention(o, l, b.out, b.lse);
          break;
        }
      }
      span.reset();
      keys.finish();
    }
    auto result = out.to(q.scalar_type());
    ctx->save_for_backward({q, k, v, result, lse});
    ctx->saved_data["link"] = c10::IValue::make_capsule(link);
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    return result;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto link = c10::static_intrusive_pointer_cast<RingLink>(ctx->saved_data["link"].toCapsule());
    const bool causal = ctx->saved_data["causal"].toBool();
    const double scale = ctx->saved_data["scale"].toDouble();
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const int c = link->size(), r = link->rank();
    const int64_t n = q.size(2) / 2;
    const auto acc = accumulation(q);
    auto grad = grads[0];
    auto dq = torch::zeros(q.sizes(), q.options().dtype(acc));
    KeysInFlight keys(link, pack(k, v));
    Tensor grads_in;
    std::function<void()> grads_arrived;
    for (int i = 0; i < c; ++i) {
      auto [kb, vb] = unpack(keys.start(i), k, v);
      // This step's gradient of the keys/values held, into zeroed accumulators of their shape.
      auto dk = torch::zeros(k.sizes(), k.options().dtype(acc)), dv = torch::zeros(v.sizes(), v.options().dtype(acc));
      std::optional<TraceSpan> span(std::in_place, TraceKind::RingBlock, i);
      switch (part_at(i, r, c, causal)) {
        case Part::Diagonal:
        case Part::All: {
          auto [a, b, e] = attention_block_backward(grad, q, kb, vb, out, lse, causal, scale);
          dq.add_(a);
          dk.copy_(b);
          dv.copy_(e);
          break;
        }
        case Part::EarlyKeys: {
          auto [a, b, e] =
              attention_block_backward(grad, q, kb.narrow(2, 0, n), vb.narrow(2, 0, n), out, lse, false, scale);
          dq.add_(a);
          dk.narrow(2, 0, n).copy_(b);
          dv.narrow(2, 0, n).copy_(e);
          break;
        }
        case Part::LateQueries: {
          auto [a, b, e] = attention_block_backward(grad.narrow(2, n, n), q.narrow(2, n, n), kb, vb,
                                                    out.narrow(2, n, n), lse.narrow(2, n, n).contiguous(), false,
                                                    scale);
          dq.narrow(2, n, n).add_(a);
          dk.copy_(b);
          dv.copy_(e);
          break;
        }
      }
      span.reset();
      // The gradient of source s's keys/values so far: what arrived from the previous rank (the
      // sum of the steps before) plus this step's, passed on towards the owner.
      auto sum = pack(dk, dv);
      if (i > 0) {
        grads_arrived();
        sum.add_(grads_in);
      }
      if (c == 1) {
        grads_in = sum;
      } else {
        grads_in = torch::empty_like(sum);
        grads_arrived = link->pass(sum, grads_in, RingLink::Grads, i);
      }
      keys.finish();
    }
    if (c > 1) grads_arrived();
    auto [gk, gv] = unpack(grads_in, k, v);
    return {dq.to(q.scalar_type()), gk.to(k.scalar_type()), gv.to(v.scalar_type()), Tensor(), Tensor(), Tensor()};
  }
};

void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, const char* who) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, who,
              ": expects q, k, v of shape (batch, heads, positions, head size), got ", q.sizes(), ", ", k.sizes(),
              ", ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), who, ": k ", k.sizes(), " and v ", v.sizes(), " differ");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3), who, ": q ", q.sizes(),
              " and k ", k.sizes(), " differ in batch, positions or head size");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, who, ": ", q.size(1),
              " query heads are not a multiple of ", k.size(1), " key/value heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), who, ": q, k and v differ in dtype (",
              util::dtype_name(q.scalar_type()), ", ", util::dtype_name(k.scalar_type()), ", ",
              util::dtype_name(v.scalar_type()), ")");
}

}  // namespace

c10::intrusive_ptr<RingLink> ring_of(const dist::GroupPtr& group) {
  TORCH_CHECK(group, "ring attention: no context group");
  return c10::make_intrusive<GroupRing>(group);
}

Tensor ring_attention(const Tensor& q, const Tensor& k, const Tensor& v, const c10::intrusive_ptr<RingLink>& link,
                      bool causal, double scale) {
  check_qkv(q, k, v, "ring attention");
  TORCH_CHECK(q.size(2) % 2 == 0, "ring attention: this rank holds ", q.size(2),
              " positions, not an even number (one early and one late chunk of equal length)");
  return Ring::apply(q, k, v, link, causal, scale);
}

// ---- All-to-all (Ulysses) --------------------------------------------------------------------

namespace {

// The group an autograd context keeps for its backward.
// The all-to-all of equal parts along dimension 0 is its own transpose: its backward is itself.
struct AllToAll : torch::autograd::Function<AllToAll> {
  static Tensor forward(AutogradContext* ctx, Tensor x, c10::intrusive_ptr<GroupHolder> group) {
    auto out = exchange(x, *group->group);
    ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(group));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto group = c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule());
    return {exchange(grads[0], *group->group), Tensor()};
  }
  static Tensor exchange(const Tensor& x, const dist::ProcessGroup& g) {
    auto in = x.contiguous();
    auto out = torch::empty_like(in);
    g.all_to_all_single(out, in);
    return out;
  }
};

// The order of all ranks' rows, rank after rank (each in the zigzag layout), as positions of the
// whole sequence; its inverse puts the gathered rows in sequence order.
Tensor rank_major_positions(int64_t length, int c) {
  std::vector<Tensor> parts;
  for (int j = 0; j < c; ++j) parts.push_back(zigzag_index(length, c, j));
  return torch::cat(parts);
}

// (B, h, L, d) this rank's rows of all heads -> (B, h/c, c*L, d) all rows of its heads, in order.
Tensor sequence_to_heads(const Tensor& x, const dist::GroupPtr& g, const Tensor& inverse) {
  const int c = g->size();
  const int64_t B = x.size(0), h = x.size(1), L = x.size(2), d = x.size(3);
  auto parts = x.reshape({B, c, h / c, L, d}).permute({1, 0, 2, 3, 4});  // dim 0: the destination
  auto got = AllToAll::apply(parts, c10::make_intrusive<GroupHolder>(g));  // dim 0: the source
  auto rows = got.permute({1, 2, 0, 3, 4}).reshape({B, h / c, c * L, d});
  return rows.index_select(2, inverse);
}

// The inverse: (B, h/c, c*L, d) -> (B, h, L, d).
Tensor heads_to_sequence(const Tensor& y, const dist::GroupPtr& g, const Tensor& order) {
  const int c = g->size();
  const int64_t B = y.size(0), hc = y.size(1), L = y.size(2) / c, d = y.size(3);
  auto parts = y.index_select(2, order).reshape({B, hc, c, L, d}).permute({2, 0, 1, 3, 4});
  auto got = AllToAll::apply(parts, c10::make_intrusive<GroupHolder>(g));  // (c source, B, h/c, L, d)
  return got.permute({1, 0, 2, 3, 4}).reshape({B, c * hc, L, d});
}

Tensor all_to_all_attention(const Tensor& q, const Tensor& k, const Tensor& v, const ContextAttentionOptions& o,
                            double scale) {
  const auto& g = o.group;
  const int c = g->size();
  auto refusal = context_mode_refusal(ContextMode::AllToAll, q.size(1), k.size(1), c);
  TORCH_CHECK(refusal.empty(), "context attention: ", refusal);
  Tensor kk = k, vv = v;
  if (k.size(1) < c) {  // fewer key/value heads than ranks: each serves c / kv_heads ranks
    kk = k.repeat_interleave(c / k.size(1), 1);
    vv = v.repeat_interleave(c / v.size(1), 1);
  }
  const int64_t length = q.size(2) * c;
  auto order = rank_major_positions(length, c).to(q.device());
  auto inverse = torch::argsort(order);
  nn::AttentionOptions a;
  a.causal = o.causal;
  a.scale = scale;
  auto y = nn::scaled_dot_product_attention(sequence_to_heads(q, g, inverse), sequence_to_heads(kk, g, inverse),
                                            sequence_to_heads(vv, g, inverse), a);
  return heads_to_sequence(y, g, order);
}

}  // namespace

namespace {
thread_local int64_t attention_calls = 0;
}  // namespace

int64_t context_attention_calls() { return attention_calls; }

Tensor context_attention(const Tensor& q, const Tensor& k, const Tensor& v, const ContextAttentionOptions& o) {
  check_qkv(q, k, v, "context attention");
  const double scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  TORCH_CHECK(std::isfinite(scale), "context attention: scale must be a finite number, got ", scale);
  if (!o.group || o.group->size() == 1) {
    nn::AttentionOptions a;
    a.causal = o.causal;
    a.scale = scale;
    return nn::scaled_dot_product_attention(q, k, v, a);
  }
  TORCH_CHECK(q.size(2) % 2 == 0, "context attention: this rank holds ", q.size(2),
              " positions, not an even number (each rank holds one early and one late chunk of equal length)");
  ++attention_calls;
  if (util::planning()) {  // the planner predicts either mode's exchanges from these shapes
    const bool backward = torch::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
    util::note_context_attention({q.size(0), q.size(1), k.size(1), q.size(2), q.size(3),
                                  static_cast<int64_t>(q.element_size()), o.group->size(),
                                  o.mode == ContextMode::Ring, backward});
  }
  if (o.mode == ContextMode::AllToAll) return all_to_all_attention(q, k, v, o, scale);
  return Ring::apply(q, k, v, ring_of(o.group), o.causal, scale);
}

}  // namespace partrain::parallel
