// Generation with a key/value cache (see generate.hpp).
#include "engine/models/generate.hpp"

#include <cmath>
#include <limits>

#include "engine/models/gpt2.hpp"
#include "engine/models/llama.hpp"
#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/tensor_parallel.hpp"

namespace partrain::models {

namespace {
thread_local KvCache* active = nullptr;

struct Activate {
  explicit Activate(KvCache* c) : previous(active) { active = c; }
  ~Activate() { active = previous; }
  KvCache* previous;
};

// The longest context the model takes.
int64_t context_of(const nn::Module& model) {
  if (auto* g = dynamic_cast<const Gpt2*>(&model)) return g->options.seq;
  if (auto* l = dynamic_cast<const Llama*>(&model)) return l->options.seq;
  TORCH_CHECK(false, "generate needs a GPT2 or a Llama model (pt.models.gpt2, pt.models.llama), got a ", model.type());
}

// The next token of each row from the last position's logits (B, V).
Tensor pick(Tensor logits, const GenerateOptions& o) {
  // In float64: a float64 model's near-tie is decided in its own precision, and a tiny
  // temperature or top_p stays in range where float32 would overflow.
  logits = logits.to(torch::kFloat64);
  if (o.temperature == 0) return logits.argmax(-1, true);
  // Shifted so that the largest is 0 first: the same distribution, and a temperature as small as
  // 1e-310 sends the others to -inf rather than the largest to +inf (inf - inf: NaN).
  logits = (logits - logits.amax(-1, true)) / o.temperature;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  if (o.top_k > 0 && o.top_k < logits.size(-1)) {
    auto kth = std::get<0>(logits.topk(o.top_k, -1)).narrow(-1, o.top_k - 1, 1);
    logits = logits.masked_fill(logits < kth, neg_inf);
  }
  if (o.top_p < 1) {
    auto [sorted, order] = logits.sort(/*stable=*/true, -1, /*descending=*/true);
    auto cumulative = sorted.softmax(-1).cumsum(-1);
    // Drop a token once the ones before it already reach top_p (the most likely always stays).
    auto drop = (cumulative - sorted.softmax(-1)) >= o.top_p;
    logits = logits.scatter(-1, order, sorted.masked_fill(drop, neg_inf));
  }
  return logits.softmax(-1).multinomial(1);
}
}  // namespace

KvCache* KvCache::current() { return active; }

std::pair<Tensor, Tensor> KvCache::extend(const nn::Module& attention, const Tensor& k, const Tensor& v) {
  // One entry a use within a forward: a block that appears twice in the model keeps two.
  auto& entry = kv[{&attention, uses[&attention]++}];
  if (entry.first.defined()) {
    entry.first = torch::cat({entry.first, k}, 2);
    entry.second = torch::cat({entry.second, v}, 2);
  } else {
    entry = {k, v};
  }
  return entry;
}

Tensor generate(nn::Module& model, const Tensor& ids, const GenerateOptions& o) {
  TORCH_CHECK(ids.dim() == 2 && !ids.is_floating_point() && ids.size(1) > 0,
              "generate expects a prompt of int64 ids (B, T) with T >= 1, got ", ids.sizes(), " ", ids.dtype());
  TORCH_CHECK(o.max_new >= 0, "generate: max_new must be >= 0, got ", o.max_new);
  TORCH_CHECK(o.temperature >= 0 && std::isfinite(o.temperature), "generate: temperature must be a finite number >= 0, got ",
              o.temperature);
  TORCH_CHECK(o.top_k >= 0, "generate: top_k must be >= 0, got ", o.top_k);
  TORCH_CHECK(o.top_p > 0 && o.top_p <= 1, "generate: top_p must be in (0, 1], got ", o.top_p);
  const int64_t context = context_of(model);
  TORCH_CHECK(ids.size(1) + o.max_new <= context, "generate: ", ids.size(1), " prompt tokens + ", o.max_new,
              " new ones pass the model's seq=", context, " (it has no positions beyond)");
  auto owner = parallel::ParallelModel::of(model);
  TORCH_CHECK(!(owner && owner->pipeline()), "generate: the model is cut into pipeline stages, and a stage cannot "
              "generate alone (it runs only through model:train_step)");
  const int split = owner && owner->mesh() ? owner->mesh()->size("context") : 1;
  TORCH_CHECK(split == 1, "generate: the model splits its sequences over context=", split, ", and generation "
              "extends one sequence a token at a time: generate with a model parallelized without context (a "
              "checkpoint of this one loads into it)");
  const int experts = owner && owner->mesh() ? owner->mesh()->size("expert") : 1;
  TORCH_CHECK(experts == 1 || parallel::moe_blocks(model).empty(), "generate: the model's experts are split over "
              "expert=", experts, " ranks, and a token reaches its experts' rank by an all-to-all that every one of "
              "them must join: generate with a model whose experts are not split (a checkpoint of this one loads "
              "into it)");
  for (const auto& [path, m] : model.modules()) {
    auto* norm = dynamic_cast<const parallel::ParallelLayerNorm*>(m.get());
    TORCH_CHECK(!(norm && norm->sequence_parallel), "generate: the model is sequence-parallel (", path,
                "), and one new position cannot be split along the sequence: parallelize it without "
                "sequence_parallel to generate");
  }
  torch::NoGradGuard no_grad;
  const bool training = model.is_training();
  model.eval();
  struct Restore {
    nn::Module& m;
    bool training;
    ~Restore() { m.train(training); }
  } restore{model, training};

  KvCache cache;
  Activate on(o.cache ? &cache : nullptr);
  Tensor tokens = ids;
  Tensor input = ids;
  for (int64_t step = 0; step < o.max_new; ++step) {
    cache.uses.clear();
    auto logits = model.forward(std::vector<Tensor>{input}).select(1, -1);  // (B, V or V/t)
    auto split = parallel::split_logits_of(logits);
    if (split) logits = parallel::gather_split_logits(logits, *split);
    auto next = pick(logits, o).to(tokens.scalar_type());
    // A split model's ranks must continue alike whatever their generators hold: tensor rank 0's draw.
    if (split) split->group->broadcast(next, 0);
    tokens = torch::cat({tokens, next}, 1);
    if (o.cache) {
      cache.offset += input.size(1);
      input = next;
    } else {
      input = tokens;
    }
  }
  return tokens;
}

}  // namespace partrain::models
