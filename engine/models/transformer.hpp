// What the transformer families (GPT-2, LLaMA) check and find alike: sequence parallelism on for
// all of a region's layers or for none, the group a sequence-parallel model splits over, and an
// output head that alone may split the vocabulary.
#pragma once

#include <string>
#include <vector>

#include "engine/dist/process_group.hpp"
#include "engine/nn/module.hpp"

namespace partrain::models {

/// The most blocks a transformer family builds: beyond any model trained (GPT-3 has 96), and a
/// bound that a mistyped count (2^32 + 1) meets at once rather than after hours of building.
constexpr int64_t kMaxLayers = 65536;

/// The layers of a sequence-parallel region must agree: a norm that sees T/t positions without
/// summing its gradients over the group (or one that sums them while seeing all T) trains
/// differently from the serial model without any error. Fails naming the layers that are on and off.
void check_sequence(const nn::Module& root, const std::string& path, const std::vector<std::string>& layers);

/// The tensor group of the first sequence-parallel norm under `root`, or null when none is.
dist::GroupPtr sequence_group(nn::Module& root);

/// Only `head` may be a vocabulary head (P.vocab_head), and its logits split only as one.
void check_vocab_head(const nn::Module& root, const std::string& path, const std::string& head);

/// Token ids a language model (`model` names it in messages: "GPT2") of `vocab` tokens and `seq`
/// positions can embed after `offset` cached ones: (B, T) integers with offset + T <= seq and,
/// when `values`, each in [0, vocab) (reading them syncs a GPU: the forward scans them on the
/// CPU only, as LibTorch's own index check there would only say "index out of range").
void check_token_ids(const std::string& model, const nn::Tensor& ids, int64_t vocab, int64_t seq, int64_t offset,
                     bool values);

/// A language model's training batch (nn::Module::check_batch): ids as check_token_ids with
/// their values (not on the meta device, where partrain plan has none), a sequence that splits
/// over `sequence` (the sequence-parallel group, or null), and targets for `loss`: cross_entropy
/// takes integer class ids of the ids' shape, each in [0, vocab) or ignore_index; mse takes
/// floating targets of the logits' shape (B, T, vocab).
/// Returns whether it read the targets' class ids (cross_entropy).
bool check_lm_batch(const std::string& model, const nn::Tensor& ids, const nn::Tensor& targets, int64_t vocab,
                    int64_t seq, const std::string& loss, int64_t ignore_index, const dist::GroupPtr& sequence);

}  // namespace partrain::models
