// Text generation for the transformer families (GPT-2, LLaMA): a prompt's ids in, new ids out,
// greedy or sampled (temperature, top-k, top-p), with a key/value cache so each new token runs
// the model on one position instead of the whole context. Works serially and under tensor
// parallelism (vocabulary-split logits are gathered before sampling; every rank draws the same
// token from the same generator state).
#pragma once

#include <map>

#include "engine/nn/module.hpp"

namespace partrain::models {

using torch::Tensor;

/// The keys and values attention modules keep while generating, and the position the next
/// input starts at. Active (KvCache::current) only inside generate().
struct KvCache {
  int64_t offset = 0;                                       ///< positions already cached
  /// (attention module, its n-th use in a forward) -> (k, v), (B, H, S, d): a module that appears
  /// twice in the model (a shared block) runs twice a forward, on other inputs each time.
  std::map<std::pair<const nn::Module*, int>, std::pair<Tensor, Tensor>> kv;
  std::map<const nn::Module*, int> uses;  ///< uses of each module in the forward under way
  /// The cache generate() has made active on this thread, or nullptr.
  static KvCache* current();
  /// Appends k and v (B, H, T, d) for `attention` and returns everything cached for it.
  std::pair<Tensor, Tensor> extend(const nn::Module& attention, const Tensor& k, const Tensor& v);
};

struct GenerateOptions {
  int64_t max_new = 32;       ///< tokens to add
  double temperature = 1.0;   ///< 0: greedy (argmax); otherwise logits / temperature
  int64_t top_k = 0;          ///< keep the k most likely (0: all)
  double top_p = 1.0;         ///< keep the smallest set whose probability reaches p (1: all)
  bool cache = true;          ///< reuse keys and values; false recomputes the whole context a token
};

/// `ids` (B, T) int64 -> (B, T + max_new): the prompt followed by the generated ids. `model` is a
/// GPT2 or a Llama (split or not). Runs in eval mode without gradients; the mode is restored.
Tensor generate(nn::Module& model, const Tensor& ids, const GenerateOptions& options);

}  // namespace partrain::models
