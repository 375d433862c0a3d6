// What a save and a load share about the ranks: failing together, and which parameters this rank
// holds under which names.
#include <set>

#include "engine/ckpt/internal.hpp"
#include "engine/nn/module.hpp"
#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/pipeline.hpp"

namespace partrain::ckpt::internal {

namespace {

// The model's parameters, each once (a tied one under its first name), in module order.
std::vector<std::pair<std::string, torch::Tensor>> unique_named(const nn::Module& model) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : model.named_parameters(true))
    if (item.value().defined() && seen.insert(item.value().unsafeGetTensorImpl()).second)
      out.emplace_back(item.key(), item.value());
  return out;
}

}  // namespace

void together(const dist::GroupPtr& group, const std::string& what, const std::function<void()>& fn) {
  std::string error;
  bool damaged = false;
  try {
    fn();
  } catch (const Damaged& e) {
    error = e.what();
    damaged = true;
  } catch (const std::exception& e) {
    error = util::message_of(e);
  }
  if (!dist::any_rank(group, !error.empty())) return;
  auto all = dist::all_gather_strings(group, error.empty() ? std::string() : (damaged ? "D" : "E") + error);
  bool all_damage = true;
  std::string first;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    all_damage = all_damage && all[r][0] == 'D';
    if (first.empty()) first = what + " failed on rank " + std::to_string(r) + ": " + all[r].substr(1);
  }
  std::string message = error.empty() ? first : error;
  if (all_damage) throw Damaged(message);
  TORCH_CHECK(false, message);
}

std::vector<Held> held(const nn::Module& model) {
  auto owner = parallel::ParallelModel::of(model);
  const parallel::Pipeline* pipe = owner ? owner->pipeline().get() : nullptr;
  std::vector<Held> out;
  for (auto& [name, p] : unique_named(model)) {
    if (!pipe) out.push_back({name, name, p, true});
    else out.push_back({pipe->logical_name(name), name, p, pipe->first_holder(p)});
  }
  return out;
}

}  // namespace partrain::ckpt::internal
