// Checks and lookups the transformer families share (see transformer.hpp).
#include "engine/models/transformer.hpp"

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

}  // namespace partrain::models
