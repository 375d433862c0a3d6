// The mixture-of-experts block and its expert parallelism (see moe.hpp).
#include "engine/parallel/moe.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

#include "engine/nn/grouped.hpp"
#include "engine/parallel/group_holder.hpp"
#include "engine/parallel/recompute.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/util/planning.hpp"

namespace partrain::parallel {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

void MoEOptions::validate(const std::string& who) const {
  TORCH_CHECK(dim > 0 && hidden > 0 && experts > 0, who, " needs positive sizes: dim=", dim, " hidden=", hidden,
              " experts=", experts);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, who, ": top_k=", top_k, " must be between 1 and experts=", experts,
              " (each token goes to top_k different experts)");
  TORCH_CHECK(std::isfinite(aux_loss) && aux_loss >= 0 && std::isfinite(z_loss) && z_loss >= 0, who,
              ": aux_loss and z_loss are coefficients >= 0, got ", aux_loss, " and ", z_loss);
  TORCH_CHECK(std::isfinite(capacity_factor) && capacity_factor >= 0, who, ": capacity_factor must be >= 0 (0: ",
              "dropless), got ", capacity_factor);
}

// ---- The experts ------------------------------------------------------------------------------

GroupedExperts::GroupedExperts(int64_t experts, int64_t dim, int64_t hidden)
    : nn::Module("MoEExperts"), experts(experts), dim(dim), hidden(hidden), local(experts), first(0) {
  const auto o = nn::parameter_options();
  for (const char* name : {"w1", "w3"}) {
    auto t = torch::empty({experts, hidden, dim}, o);
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    if (!t.is_meta()) reset_tensor(name, t, gen);
    register_parameter(name, t);
  }
  auto t = torch::empty({experts, dim, hidden}, o);
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  if (!t.is_meta()) reset_tensor("w2", t, gen);
  register_parameter("w2", t);
}

void GroupedExperts::reset_tensor(const std::string& name, Tensor& t, at::Generator& gen) const {
  TORCH_CHECK(name == "w1" || name == "w2" || name == "w3", "MoEExperts has no tensor '", name, "'");
  // Each expert's matrix as nn.Linear(in, out) makes it: U(-1/sqrt(in), 1/sqrt(in)).
  const double in = static_cast<double>(name == "w2" ? hidden : dim);
  torch::NoGradGuard no_grad;
  t.uniform_(-1.0 / std::sqrt(in), 1.0 / std::sqrt(in), gen);
}

Tensor GroupedExperts::compute(const Tensor& rows, const std::vector<int64_t>& counts) {
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == local, "MoEExperts: ", counts.size(), " counts for ", local,
              " experts");
  // Split over tensor ranks: each computes its slice of the hidden width from whole rows (their
  // gradient summed over the ranks in backward) and the partial outputs are summed (Megatron's
  // column then row split, per expert).
  auto x = tensor_ ? copy_to_tensor_region(rows, tensor_) : rows;
  // [T, dim] @ [E, dim, hidden] (the [E, hidden, dim] stack read transposed), per expert's rows.
  auto gate = nn::grouped_matmul(x, param("w1").transpose(1, 2), counts);
  auto up = nn::grouped_matmul(x, param("w3").transpose(1, 2), counts);
  auto y = nn::grouped_matmul(at::silu(gate) * up, param("w2").transpose(1, 2), counts);
  return tensor_ ? reduce_from_tensor_region(y, tensor_) : y;
}

void GroupedExperts::split_tensor(const dist::GroupPtr& tensor, const dist::GroupPtr& both) {
  const int t = tensor ? tensor->size() : 1;
  if (t == 1) return;
  TORCH_CHECK(hidden % t == 0, "tensor parallelism inside the experts: hidden=", hidden, " is not divisible by the "
              "mesh's tensor=", t);
  tensor_ = tensor;
  for (const char* name : {"w1", "w3", "w2"}) {
    const int64_t d = std::string(name) == "w2" ? 2 : 1;  // the hidden width's dimension
    const auto& held = param(name);
    std::vector<int64_t> shape{experts, d == 1 ? hidden : dim, d == 1 ? dim : hidden};
    auto it = std::find_if(shardings_.begin(), shardings_.end(), [&](const auto& e) { return e.first == name; });
    if (it == shardings_.end()) shardings_.emplace_back(name, Sharding::split(tensor, d, shape));
    else it->second = it->second.within(d, tensor, both);
    torch::NoGradGuard no_grad;
    const int64_t each = held.size(d) / t;
    auto sizes = held.sizes().vec();
    sizes[d] = each;
    auto mine = held.is_meta() ? torch::empty(sizes, held.options())
                               : held.narrow(d, each * tensor->rank(), each).clone();
    replace_tensor(name, mine.set_requires_grad(held.requires_grad()));
  }
}

void GroupedExperts::split(const dist::GroupPtr& group) {
  const int e = group ? group->size() : 1;
  TORCH_CHECK(experts % e == 0, "expert parallelism: experts=", experts, " is not divisible by the mesh's expert=", e,
              " (each expert rank holds experts/expert of them)");
  if (e == 1) return;
  local = experts / e;
  first = local * group->rank();
  for (const char* name : {"w1", "w3", "w2"}) {
    const auto& full = param(name);
    std::vector<int64_t> shape(full.sizes().begin(), full.sizes().end());
    shardings_.emplace_back(name, Sharding::split(group, 0, shape));
    torch::NoGradGuard no_grad;
    // A deferred model's meta stack becomes a meta tensor of this rank's shape: materialization
    // cuts the logical tensor by the sharding.
    auto mine = full.is_meta() ? torch::empty({local, shape[1], shape[2]}, full.options())
                               : full.narrow(0, first, local).clone();
    replace_tensor(name, mine.set_requires_grad(full.requires_grad()));
  }
}

const Sharding* GroupedExperts::sharding_of(const std::string& name) const {
  for (const auto& [n, s] : shardings_)
    if (n == name) return &s;
  return nullptr;
}

std::string GroupedExperts::extra_repr() const {
  std::ostringstream s;
  s << "experts=" << experts << ", dim=" << dim << ", hidden=" << hidden;
  if (local != experts) s << ", holding " << first << "-" << first + local - 1;
  return s.str();
}

// ---- The all-to-all of unequal row counts, differentiable --------------------------------------

namespace {

struct AllToAllV : torch::autograd::Function<AllToAllV> {
  static Tensor forward(AutogradContext* ctx, Tensor x, c10::intrusive_ptr<GroupHolder> group,
                        std::vector<int64_t> in_splits, std::vector<int64_t> out_splits) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(group);
    ctx->saved_data["in"] = in_splits;
    ctx->saved_data["out"] = out_splits;
    Tensor out;
    group->group->all_to_all_single(out, x.contiguous(), out_splits, in_splits);
    return out;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto group = c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule());
    auto in = ctx->saved_data["in"].toIntVector(), out = ctx->saved_data["out"].toIntVector();
    Tensor back;
    group->group->all_to_all_single(back, grads[0].contiguous(), in, out);  // the splits swapped
    return {back, Tensor(), Tensor(), Tensor()};
  }
};

// The block's output unchanged; its backward also starts the router losses' backward from
// `weight` (Megatron's MoEAuxLossAutoScaler): the losses need not be returned by every forward.
struct AttachAux : torch::autograd::Function<AttachAux> {
  static Tensor forward(AutogradContext* ctx, Tensor y, Tensor aux, double weight) {
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["aux"] = aux.detach();  // its dtype and device
    return y;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto aux = ctx->saved_data["aux"].toTensor();
    return {grads[0], torch::full_like(aux, ctx->saved_data["weight"].toDouble()), Tensor()};
  }
};

thread_local double router_loss_weight = 1.0;

std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (auto x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
  return s;
}

}  // namespace

Tensor all_to_all_rows(const Tensor& x, const dist::GroupPtr& group, const std::vector<int64_t>& in_splits,
                       const std::vector<int64_t>& out_splits) {
  return AllToAllV::apply(x, c10::make_intrusive<GroupHolder>(group), in_splits, out_splits);
}

RouterLossWeight::RouterLossWeight(double weight) : saved_(router_loss_weight) { router_loss_weight = weight; }
RouterLossWeight::~RouterLossWeight() { router_loss_weight = saved_; }
double RouterLossWeight::current() { return router_loss_weight; }

// ---- The block --------------------------------------------------------------------------------

MoE::MoE(const MoEOptions& o) : nn::Unary("MoE"), options(o) {
  o.validate("MoE");
  nn::LinearOptions g(o.dim, o.experts);
  g.bias = false;
  set_child("gate", std::make_shared<nn::Linear>(g));
  set_child("experts", std::make_shared<GroupedExperts>(o.experts, o.dim, o.hidden));
  stats_.routed.assign(o.experts, 0.0);
}

c10::optional<double> MoE::attribute(const std::string& name) const {
  if (name == "experts") return static_cast<double>(options.experts);
  if (name == "expert") return static_cast<double>(expert_size());
  if (name == "top_k") return static_cast<double>(options.top_k);
  if (name == "aux_loss") return options.aux_loss;
  if (name == "z_loss") return options.z_loss;
  if (name == "capacity_factor") return options.capacity_factor;
  if (name == "normalize") return options.normalize ? 1 : 0;
  if (name == "tensor_parallel") return tensor_parallel ? 1 : 0;
  return c10::nullopt;
}

void MoE::set_attribute(const std::string& name, double value) {
  TORCH_CHECK(name != "experts" && name != "expert", "MoE: ", name, " is read-only (the experts are the stacked "
              "tensors' first dimension; the expert size is the mesh's)");
  auto o = options;
  if (name == "top_k") {
    TORCH_CHECK(value == std::floor(value), "MoE: top_k must be an integer, got ", value);
    o.top_k = static_cast<int64_t>(value);
  } else if (name == "aux_loss") {
    o.aux_loss = value;
  } else if (name == "z_loss") {
    o.z_loss = value;
  } else if (name == "capacity_factor") {
    o.capacity_factor = value;
  } else if (name == "normalize") {
    TORCH_CHECK(value == 0 || value == 1, "MoE: normalize must be 0 or 1, got ", value);
    o.normalize = value == 1;
  } else if (name == "tensor_parallel") {
    TORCH_CHECK(value == 0 || value == 1, "MoE: tensor_parallel must be 0 or 1, got ", value);
    TORCH_CHECK(!dynamic_cast<const GroupedExperts&>(*child("experts")).tensor_group(), "MoE: its experts are split "
                "over the tensor ranks already");
    tensor_parallel = value == 1;
    return;
  } else {
    TORCH_CHECK(false, "MoE has no attribute '", name, "' (it has experts, expert, top_k, aux_loss, z_loss, "
                "capacity_factor, normalize, tensor_parallel)");
  }
  o.validate("MoE");
  options = o;
}

std::string MoE::extra_repr() const {
  std::ostringstream s;
  s << "experts=" << options.experts << ", top_k=" << options.top_k;
  if (!options.normalize) s << ", unnormalized";
  if (options.capacity_factor > 0) s << ", capacity_factor=" << options.capacity_factor;
  else s << ", dropless";
  if (router_) s << ", router " << router_where_;
  if (expert_size() > 1) s << ", expert=" << expert_size();
  if (tensor_parallel) s << ", tensor_parallel";
  return s.str();
}

void MoE::check(const std::string& path) const {
  auto gate = child("gate"), experts = child("experts");
  TORCH_CHECK(gate && experts, path, ": MoE needs its gate and experts");
  auto* e = dynamic_cast<const GroupedExperts*>(experts.get());
  TORCH_CHECK(e, path, ".experts must be the stacked experts (MoEExperts), got ", experts->type());
  TORCH_CHECK(e->experts == options.experts && e->dim == options.dim, path, ": the experts (", e->experts, " of width ",
              e->dim, ") do not match the block's experts=", options.experts, " dim=", options.dim);
  auto out = gate->output_features();
  TORCH_CHECK(!out || out->width < 0 || (out->width == options.experts && out->parts == 1), path,
              ": the gate must give one whole logit per expert (", options.experts, "), got ", out->describe());
}

void MoE::set_router(RouterFn fn, std::string where) {
  router_ = std::move(fn);
  router_where_ = std::move(where);
}

void MoE::split_experts(const dist::GroupPtr& expert, const dist::GroupPtr& replicas, const dist::GroupPtr& tensor,
                        const dist::GroupPtr& both) {
  auto* e = dynamic_cast<GroupedExperts*>(child("experts").get());
  TORCH_CHECK(e, "MoE: its experts are not the stacked experts (MoEExperts)");
  e->split(expert);
  if (tensor_parallel) e->split_tensor(tensor, both);
  expert_ = expert && expert->size() > 1 ? expert : nullptr;
  replicas_ = replicas && replicas->size() > 1 ? replicas : nullptr;
}

MoEStats MoE::take_stats() {
  auto s = stats_;
  stats_ = MoEStats();
  stats_.routed.assign(options.experts, 0.0);
  return s;
}

Routing MoE::route(const Tensor& logits, const Tensor& x) {
  const auto& o = options;
  const int64_t N = logits.size(0);
  // Mixtral's router, in float32 at least: softmax over all experts, the k largest, renormalised.
  auto probs = at::softmax(logits.to(logits.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32), -1);
  if (!router_) {
    auto [w, idx] = probs.topk(o.top_k, -1);
    if (o.normalize) w = w / w.sum(-1, /*keepdim=*/true);
    return {w, idx, probs};
  }
  auto r = router_(*this, logits, x);
  const std::string who = "MoE router " + router_where_;
  TORCH_CHECK(r.weights.defined() && r.indices.defined(), who, " must return weights and indices");
  TORCH_CHECK(r.weights.is_floating_point() && r.weights.dim() == 2 && r.weights.size(0) == N &&
                  r.weights.size(1) == o.top_k,
              who, " returned weights of shape ", r.weights.sizes(), " and dtype ", r.weights.dtype(),
              ": expected floating [", N, ", ", o.top_k, "] (tokens x top_k)");
  TORCH_CHECK(r.indices.scalar_type() == torch::kInt64 && r.indices.dim() == 2 && r.indices.size(0) == N &&
                  r.indices.size(1) == o.top_k,
              who, " returned indices of shape ", r.indices.sizes(), " and dtype ", r.indices.dtype(),
              ": expected int64 [", N, ", ", o.top_k, "] (tokens x top_k)");
  if (r.probs.defined()) {
    TORCH_CHECK(r.probs.is_floating_point() && r.probs.dim() == 2 && r.probs.size(0) == N &&
                    r.probs.size(1) == o.experts,
                who, " returned probabilities of shape ", r.probs.sizes(), ": expected floating [", N, ", ",
                o.experts, "] (tokens x experts)");
  } else {
    r.probs = probs;
  }
  r.weights = r.weights.to(probs.scalar_type());
  r.probs = r.probs.to(probs.scalar_type());
  return r;
}

namespace {

// The host's one read of a forward: the routed count per expert, and whether the router or the
// logits went wrong (the checks ride on the read that sizes the dispatch). Meta tensors (the
// planner) read nothing: a balanced routing.
std::vector<int64_t> routed_counts(const Tensor& logits, const Routing& r, int64_t E, const std::string& who) {
  const int64_t N = r.indices.size(0), k = r.indices.size(1), S = N * k;
  std::vector<int64_t> routed(E);
  for (int64_t i = 0; i < E; ++i) routed[i] = S / E + (i < S % E ? 1 : 0);
  if (logits.is_meta()) return routed;
  auto flat = r.indices.reshape({-1});
  auto in_range = flat.ge(0).logical_and(flat.lt(E));
  auto counts = at::bincount(flat.masked_fill(in_range.logical_not(), 0), {}, E).to(torch::kInt64);
  auto sorted = std::get<0>(r.indices.sort(-1));
  auto repeated = k > 1 ? sorted.narrow(1, 1, k - 1).eq(sorted.narrow(1, 0, k - 1)).any()
                        : torch::zeros({}, in_range.options());
  auto flags = torch::stack({in_range.logical_not().any(), repeated, logits.isfinite().logical_not().any(),
                             r.weights.isfinite().logical_not().any()})
                   .to(torch::kInt64);
  // One read: the flags, then the counts.
  auto read = torch::cat({flags, counts}).cpu();
  const auto* f = read.data_ptr<int64_t>();
  TORCH_CHECK(!f[2], "MoE: the router's logits are not finite (NaN or inf) for some of the ", N, " tokens: the "
              "gate's weights or its inputs have diverged");
  TORCH_CHECK(!f[0], who, " returned expert indices out of range: they must be in [0, ", E, ")");
  TORCH_CHECK(!f[1], who, " returned the same expert twice for a token: each of its top_k=", k,
              " choices must be a different expert");
  TORCH_CHECK(!f[3], who, " returned weights that are not finite (NaN or inf)");
  routed.assign(f + 4, f + 4 + E);
  return routed;
}

// Which slots go to their experts, in expert order, and how many each expert takes (`kept`).
// Dropless: all of them, stable by slot within an expert. With a capacity, each expert takes at
// most ceil(cf * N * k / E) of this rank's slots, the most probable first (ties: the earlier
// token). Returns the slots' order; `dropped` counts the rest.
Tensor dispatch_order(const Routing& r, const std::vector<int64_t>& routed, double capacity_factor,
                      std::vector<int64_t>& kept, int64_t& dropped) {
  const int64_t N = r.indices.size(0), k = r.indices.size(1), E = static_cast<int64_t>(routed.size());
  auto flat = r.indices.reshape({-1});
  kept = routed;
  dropped = 0;
  if (capacity_factor <= 0)
    return flat.is_meta() ? torch::arange(N * k, flat.options()) : std::get<1>(flat.sort(/*stable=*/true, 0, false));
  const auto cap = static_cast<int64_t>(std::ceil(capacity_factor * static_cast<double>(N * k) / E));
  if (flat.is_meta()) {  // the planner's balanced routing: each expert's first `cap` slots kept
    int64_t T = 0;
    for (int64_t e = 0; e < E; ++e) {
      kept[e] = std::min(routed[e], cap);
      dropped += routed[e] - kept[e];
      T += kept[e];
    }
    return torch::arange(T, flat.options());
  }
  auto score = r.probs.gather(1, r.indices).reshape({-1});
  auto by_score = std::get<1>(score.neg().sort(/*stable=*/true, 0, false));
  auto by_expert = std::get<1>(flat.index_select(0, by_score).sort(/*stable=*/true, 0, false));
  auto ranked = by_score.index_select(0, by_expert);  // by expert, then by score
  std::vector<int64_t> keep;
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    kept[e] = std::min(routed[e], cap);
    for (int64_t i = 0; i < kept[e]; ++i) keep.push_back(start + i);
    dropped += routed[e] - kept[e];
    start += routed[e];
  }
  return ranked.index_select(0, torch::tensor(keep, torch::kInt64).to(ranked.device()));
}

}  // namespace

Tensor MoE::experts_forward(const Tensor& sorted_x, const std::vector<int64_t>& kept) {
  auto* experts = dynamic_cast<GroupedExperts*>(child("experts").get());
  if (!expert_) return experts->compute(sorted_x, kept);
  // Expert parallelism: the rows for expert rank j's experts go to j, their counts first.
  const int e = expert_->size();
  const int64_t E = options.experts, E_local = experts->local;
  const auto device = sorted_x.device();
  std::vector<int64_t> send(e, 0);
  for (int64_t i = 0; i < E; ++i) send[i / E_local] += kept[i];
  Tensor arrived;
  expert_->all_to_all_single(arrived, torch::tensor(kept, torch::kInt64).to(device));
  // from[src * E_local + l]: rank src's rows for my l-th expert (planned: balanced).
  const int64_t total = std::accumulate(kept.begin(), kept.end(), int64_t{0});
  std::vector<int64_t> from(static_cast<size_t>(e * E_local), total / E);
  if (!sorted_x.is_meta() && !expert_->planned()) {
    auto a = arrived.cpu();
    from.assign(a.data_ptr<int64_t>(), a.data_ptr<int64_t>() + e * E_local);
  }
  std::vector<int64_t> recv(e, 0), local(E_local, 0);
  for (int src = 0; src < e; ++src)
    for (int64_t l = 0; l < E_local; ++l) {
      recv[src] += from[src * E_local + l];
      local[l] += from[src * E_local + l];
    }
  auto got = all_to_all_rows(sorted_x, expert_, send, recv);
  // [source][local expert] -> [local expert][source], and back after the experts.
  std::vector<int64_t> perm, offset(e, 0);
  for (int src = 1; src < e; ++src) offset[src] = offset[src - 1] + recv[src - 1];
  for (int64_t l = 0; l < E_local; ++l)
    for (int src = 0; src < e; ++src) {
      int64_t at = offset[src];
      for (int64_t m = 0; m < l; ++m) at += from[src * E_local + m];
      for (int64_t i = 0; i < from[src * E_local + l]; ++i) perm.push_back(at + i);
    }
  std::vector<int64_t> inverse(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inverse[perm[i]] = static_cast<int64_t>(i);
  auto index = [&](const std::vector<int64_t>& v) { return torch::tensor(v, torch::kInt64).to(device); };
  auto y = experts->compute(got.index_select(0, index(perm)), local);
  return all_to_all_rows(y.index_select(0, index(inverse)), expert_, recv, send);
}

Tensor MoE::router_losses(const Tensor& y, const Tensor& logits, const Routing& r,
                          const std::vector<int64_t>& routed) {
  // Global over the ranks that split the batch: the routed counts, tokens, probability sums and
  // z terms summed there once (they carry no gradient); each rank's share of the losses then
  // adds up to the serial ones.
  const auto& o = options;
  const int64_t E = o.experts, k = o.top_k, N = r.indices.size(0);
  auto probs_sum = r.probs.sum(0);  // [E], with its gradient
  auto z_sum = at::logsumexp(logits.to(r.probs.scalar_type()), -1).square().sum();
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64).device(y.device());
  auto global = torch::cat({torch::tensor(routed, torch::kFloat64).to(y.device()),
                            torch::full({1}, static_cast<double>(N), f64), probs_sum.detach().to(f64),
                            z_sum.detach().to(f64).reshape({1})});
  if (replicas_) replicas_->all_reduce(global);
  // The planner's meta tensors hold no counts: the exchange is recorded, the loss keeps its shape.
  const bool read = !global.is_meta();
  auto g = read ? global.cpu() : global;
  const auto* gp = read ? g.data_ptr<double>() : nullptr;
  const double n = read ? std::max(gp[E], 1.0) : static_cast<double>(N);
  // aux = coef * E * sum_e f_e * P_e, f_e = c_e / (N k) and P_e the mean probability.
  auto f = g.narrow(0, 0, E).div(n * static_cast<double>(k)).to(r.probs.options());
  auto loss = (f * probs_sum).sum() * (o.aux_loss * static_cast<double>(E) / n) + z_sum * (o.z_loss / n);
  if (read && !replaying_checkpoint()) {
    double balance = 0;
    for (int64_t i = 0; i < E; ++i) balance += gp[i] / (n * k) * gp[E + 1 + i] / n;
    stats_.aux += o.aux_loss * static_cast<double>(E) * balance;
    stats_.z += o.z_loss * gp[2 * E + 1] / n;
  }
  if (!torch::GradMode::is_enabled()) return y;
  // Each rank's share weighs as its cross-entropy does: data parallelism's mean divides by them.
  const double replicas = replicas_ ? replicas_->size() : 1;
  return AttachAux::apply(y, loss, replicas * RouterLossWeight::current());
}

Tensor MoE::forward(const Tensor& x) {
  const auto& o = options;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == o.dim, "MoE: expected inputs of ", o.dim, " features, got ", x.sizes());
  const int64_t E = o.experts, k = o.top_k;
  auto x2 = x.reshape({-1, o.dim});
  const int64_t N = x2.size(0), S = N * k;
  auto logits = child("gate")->forward({x2});
  auto r = route(logits, x2);
  const auto routed = routed_counts(logits, r, E, router_ ? "MoE router " + router_where_ : "MoE");
  std::vector<int64_t> kept;
  int64_t dropped = 0;
  auto order = dispatch_order(r, routed, o.capacity_factor, kept, dropped);
  const int64_t T = std::accumulate(kept.begin(), kept.end(), int64_t{0});
  if (util::planning() && expert_)  // what the planner predicts the exchanges from (balanced)
    util::note_expert_exchange({E, k, N, T, o.dim, static_cast<int64_t>(x2.element_size()), expert_size(),
                                torch::GradMode::is_enabled() && x2.requires_grad()});
  // Each slot's token (rows repeated k times, so that the gather's backward adds no two rows
  // into one: deterministic on CUDA too), in expert order, through the experts.
  auto slots = x2.unsqueeze(1).expand({N, k, o.dim}).reshape({S, o.dim});
  auto sorted_y = experts_forward(slots.index_select(0, order), kept);
  // Back to the slots (a dropped slot reads the zero row past the end), weighted, and the k
  // choices of each token summed in a fixed order.
  auto position = torch::full({S}, T, order.options());
  position.index_put_({order}, torch::arange(T, order.options()));
  auto zero = torch::zeros({1, o.dim}, sorted_y.options());
  auto y_slots = torch::cat({sorted_y, zero}).index_select(0, position).view({N, k, o.dim});
  auto y = (y_slots * r.weights.to(y_slots.scalar_type()).unsqueeze(-1)).sum(1);
  if (is_training() && (o.aux_loss > 0 || o.z_loss > 0)) y = router_losses(y, logits, r, routed);
  if (!x.is_meta() && !replaying_checkpoint()) {
    for (int64_t i = 0; i < E; ++i) stats_.routed[i] += static_cast<double>(routed[i]);
    stats_.dropped += static_cast<double>(dropped);
    stats_.slots += static_cast<double>(S);
    ++stats_.forwards;
  }
  return y.view(x.sizes());
}

std::vector<std::pair<std::string, MoE*>> moe_blocks(nn::Module& root) {
  std::vector<std::pair<std::string, MoE*>> out;
  for (auto& [path, m] : root.modules())
    if (auto* b = dynamic_cast<MoE*>(m.get())) out.emplace_back(path, b);
  return out;
}

}  // namespace partrain::parallel
