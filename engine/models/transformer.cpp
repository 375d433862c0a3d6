// Checks and lookups the transformer families share (see transformer.hpp).
#include "engine/models/transformer.hpp"

#include "engine/nn/functional.hpp"
#include "engine/parallel/tensor_parallel.hpp"

namespace partrain::models {

void check_sequence(const nn::Module& root, const std::string& path, const std::vector<std::string>& layers) {
  std::string on, off;
  for (const auto& name : layers) {
    auto m = root.find(name);
    auto split = m ? m->sequence_split() : c10::nullopt;
    if (!split) continue;
    (*split ? on : off) += (*split ? on : off).empty() ? name : ", " + name;
  }
  if (on.empty() || off.empty()) return;
  std::string all;
  for (const auto& n : layers) all += (all.empty() ? "" : ", ") + n;
  TORCH_CHECK(false, path, ": sequence parallelism must be on for all of ", all, " or for none: it is on for ", on,
              " and off for ", off);
}

dist::GroupPtr sequence_group(nn::Module& root) {
  for (const auto& [path, m] : root.modules())
    if (auto* norm = dynamic_cast<const parallel::ParallelLayerNorm*>(m.get()); norm && norm->sequence_parallel)
      return norm->group;
  return nullptr;
}

void check_vocab_head(const nn::Module& root, const std::string& path, const std::string& head) {
  // Logits split anywhere else would be read as whole features by the next layer, and the loss
  // would take the real output for split logits.
  for (const auto& [name, m] : const_cast<nn::Module&>(root).modules()) {
    auto* column = dynamic_cast<const parallel::ColumnParallelLinear*>(m.get());
    if (column && column->vocab_head)
      TORCH_CHECK(name == head, path, ": P.vocab_head fits only ", root.type(), "'s output head ", head, ", not ", name);
  }
  auto out = root.child(head)->output_features();
  auto* column = dynamic_cast<const parallel::ColumnParallelLinear*>(root.child(head).get());
  TORCH_CHECK(!out || out->parts == 1 || (column && column->vocab_head), path, ": ", head, " gives ", out->describe(),
              ": split logits need P.vocab_head {} (the loss then comes from pt.loss_fn(model)), or gather them "
              "with gather_output = true");
}

void check_token_ids(const std::string& model, const nn::Tensor& ids, int64_t vocab, int64_t seq, int64_t offset,
                     bool values) {
  TORCH_CHECK(ids.dim() == 2 && !ids.is_floating_point() && !ids.is_complex() && ids.scalar_type() != torch::kBool,
              model, " expects int64 token ids (B, T), got ", ids.sizes(), " ", ids.dtype());
  TORCH_CHECK(offset + ids.size(1) <= seq, model, ": sequence of ", offset + ids.size(1), " tokens is longer than seq=",
              seq);
  if (!values || ids.numel() == 0) return;
  auto [lo, hi] = nn::extremes(ids);
  TORCH_CHECK(lo >= 0 && hi < vocab, model, ": token id ", lo < 0 ? lo : hi, " is out of range for vocab=", vocab,
              " (ids are 0 to ", vocab - 1, ")");
}

bool check_lm_batch(const std::string& model, const nn::Tensor& ids, const nn::Tensor& targets, int64_t vocab,
                    int64_t seq, const std::string& loss, int64_t ignore_index, const dist::GroupPtr& sequence) {
  check_token_ids(model, ids, vocab, seq, 0, /*values=*/!ids.is_meta());  // partrain plan: shapes only
  if (sequence) parallel::check_sequence_parts(ids.size(1), sequence->size());
  if (loss == "mse") {
    TORCH_CHECK(targets.is_floating_point() && targets.dim() == 3 && targets.size(0) == ids.size(0) &&
                    targets.size(1) == ids.size(1) && targets.size(2) == vocab,
                "train_step: loss mse compares ", model, "'s logits (", ids.size(0), ", ", ids.size(1), ", ", vocab,
                ") with floating targets of that shape, got ", targets.sizes(), " ", targets.dtype());
    return false;
  }
  if (loss != "cross_entropy") return false;  // train_step refuses an unknown loss itself
  TORCH_CHECK(!targets.is_floating_point() && !targets.is_complex() && targets.scalar_type() != torch::kBool,
              "train_step: cross_entropy expects integer class ids as targets, got ", targets.dtype());
  TORCH_CHECK(targets.sizes() == ids.sizes(), "train_step: ", model, " predicts a token at each of the input's ",
              ids.sizes(), " positions, so its targets must have that shape, got ", targets.sizes());
  const auto outside = nn::class_id_outside(targets, vocab, ignore_index);
  TORCH_CHECK(!outside, "train_step: target ", outside.value_or(0), " is out of range for ", model, "'s vocab=", vocab,
              " ", nn::class_range(vocab, ignore_index));
  return true;
}

}  // namespace partrain::models
