// The applier of planned policies: one layer at a time (apply_split, which the Lua sharder calls
// for each `replace` entry), or a whole plan (apply_policy, a C++ program's tensor-parallel step).
#include "engine/parallel/policy.hpp"

#include <sstream>
#include <stdexcept>

#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/util/text.hpp"

namespace partrain::parallel {

namespace {

// The serial layer a split needs, or an error naming what it is and what the kind needs.
template <class Layer>
const Layer& serial_as(const nn::Module& serial, const LayerSplit& split, const char* needs) {
  auto* layer = dynamic_cast<const Layer*>(&serial);
  if (!layer)
    throw std::invalid_argument("P." + split.kind + " needs a " + needs + ", and " + split.path + " is a " +
                                serial.type());
  return *layer;
}

// "where: " when a plan says where, else "policy NAME: ".
std::string at(const std::string& where, const PolicyPlan& plan) {
  return (where.empty() ? "policy " + (plan.name.empty() ? std::string("?") : plan.name) : where) + ": ";
}

// The ties as the sharder lists them in messages: "a = b; c = d", or "none".
std::string list_ties(const std::vector<std::vector<std::string>>& groups) {
  std::string out;
  for (const auto& g : groups) {
    if (!out.empty()) out += "; ";
    for (size_t i = 0; i < g.size(); ++i) out += (i ? " = " : "") + g[i];
  }
  return out.empty() ? "none" : out;
}

// The module at a dotted path ("" the root), or nullptr.
nn::Module* module_at(nn::Module& root, const std::string& path) { return path.empty() ? &root : root.find(path).get(); }

// A dotted name split into its owner's path and its last component.
std::pair<std::string, std::string> split_name(const std::string& name) {
  auto dot = name.rfind('.');
  if (dot == std::string::npos) return {"", name};
  return {name.substr(0, dot), name.substr(dot + 1)};
}

// The parameter at a dotted name: its owner and slot, or an error naming the tie.
std::pair<nn::Module*, std::string> parameter_slot(nn::Module& root, const std::string& name, size_t index,
                                                   const PolicyPlan& plan) {
  auto [path, slot] = split_name(name);
  auto* owner = module_at(root, path);
  if (!owner || !owner->has_slot(slot) || !owner->param(slot).defined())
    throw std::invalid_argument(at(plan.where, plan) + "ties[" + std::to_string(index + 1) + "]: '" + name +
                                "' is not a parameter of " + root.type());
  return {owner, slot};
}

}  // namespace

nn::ModulePtr build_split(const nn::Module& serial, const LayerSplit& split, const dist::GroupPtr& group,
                          const SplitOptions& options) {
  const bool sequence = split.sequence_parallel.value_or(options.sequence_parallel);
  if (split.kind == "column") {
    if (!split.parts.empty() && split.fused != 1)
      throw std::invalid_argument("P.column takes fused or parts, not both (" + split.path + ")");
    const auto& linear = serial_as<nn::Linear>(serial, split, "Linear");
    auto column = split.parts.empty()
                      ? std::make_shared<ColumnParallelLinear>(linear, group, split.fused, split.gather_output, sequence)
                      : std::make_shared<ColumnParallelLinear>(linear, group, split.parts, split.gather_output, sequence);
    column->sequence_overlap = sequence && options.sequence_overlap;
    return column;
  }
  if (split.kind == "row")
    return std::make_shared<RowParallelLinear>(serial_as<nn::Linear>(serial, split, "Linear"), group,
                                               split.input_is_parallel, sequence);
  if (split.kind == "norm") {
    if (auto* rms = dynamic_cast<const nn::RMSNorm*>(&serial))
      return std::make_shared<ParallelLayerNorm>(*rms, group, sequence);
    return std::make_shared<ParallelLayerNorm>(serial_as<nn::LayerNorm>(serial, split, "LayerNorm or RMSNorm"), group,
                                               sequence, options.fused_norm);
  }
  if (split.kind == "vocab_embedding")
    return std::make_shared<VocabParallelEmbedding>(serial_as<nn::Embedding>(serial, split, "Embedding"), group);
  if (split.kind == "vocab_head") {  // the vocabulary split, padded like the embedding; the whole policy's sequence setting
    auto head = std::make_shared<ColumnParallelLinear>(serial_as<nn::Linear>(serial, split, "Linear"), group, int64_t{1},
                                                       false, options.sequence_parallel, /*pad=*/true);
    head->sequence_overlap = options.sequence_parallel && options.sequence_overlap;
    return head;
  }
  throw std::invalid_argument("a split of kind '" + split.kind + "' (" + split.path +
                              ") is not one of column, row, norm, vocab_embedding, vocab_head");
}

void apply_split(nn::Module& root, const LayerSplit& split, const dist::GroupPtr& group, const SplitOptions& options) {
  auto serial = split.path.empty() ? nullptr : root.find(split.path);
  if (!serial) throw std::invalid_argument("no module '" + split.path + "' in " + root.type());
  auto [parent, name] = split_name(split.path);
  module_at(root, parent)->set_child(name, build_split(*serial, split, group, options));
}

void apply_policy(nn::Module& root, const PolicyPlan& plan, const dist::Mesh& mesh) {
  const auto& group = mesh.group("tensor");
  if (group->size() == 1) return;  // nothing splits over one rank
  align_to_first_rank(root, group);  // one serial model to cut: tensor rank 0's
  const auto serial_ties = nn::tied_parameters(root);
  // The declared ties the serial model holds: made again after the split.
  std::vector<Tie> ties;
  for (size_t i = 0; i < plan.ties.size(); ++i) {
    const auto& t = plan.ties[i];
    auto [a_owner, a_slot] = parameter_slot(root, t.param, i, plan);
    auto [b_owner, b_slot] = parameter_slot(root, t.to, i, plan);
    if (a_owner->param(a_slot).is_same(b_owner->param(b_slot))) ties.push_back(t);
  }
  std::vector<nn::Module*> owners;
  for (const auto& a : plan.attributes) {
    auto* owner = module_at(root, a.module);
    if (!owner) throw std::invalid_argument(at(a.where, plan) + "attributes: no module '" + a.module + "' in " + root.type());
    try {
      owner->set_attribute(a.name, a.value);
    } catch (const std::exception& e) {
      throw std::invalid_argument(at(a.where, plan) + util::message_of(e));
    }
    owners.push_back(owner);
  }
  for (const auto& s : plan.splits) {
    try {
      apply_split(root, s, group, plan.options);
    } catch (const std::exception& e) {
      throw std::invalid_argument(at(s.where, plan) + "P." + s.kind + " on " + s.path + ": " + util::message_of(e));
    }
  }
  // Two names of one attribute (GPT-2's heads and n_head) set by two entries: the last one wins.
  for (size_t i = 0; i < plan.attributes.size(); ++i) {
    const auto& a = plan.attributes[i];
    auto now = owners[i]->attribute(a.name);
    if (now && *now != a.value) {
      std::ostringstream s;
      s << at(a.where, plan) << "the attribute " << a.name << " of " << owners[i]->type()
        << " is set twice, under two of its names (" << a.name << " ends " << *now << ", not " << a.value << ")";
      throw std::invalid_argument(s.str());
    }
  }
  for (size_t i = 0; i < ties.size(); ++i) {  // P.tie: the slot holds that very tensor
    auto [owner, slot] = parameter_slot(root, ties[i].param, i, plan);
    auto [to_owner, to_slot] = parameter_slot(root, ties[i].to, i, plan);
    owner->set_parameter(slot, to_owner->param(to_slot), /*share=*/true);
  }
  // Every layer's invariants, ties split alike, and the ties of the serial model.
  try {
    nn::check_tree(root);
    parameter_records(root);
  } catch (const std::exception& e) {
    throw std::invalid_argument(at(plan.where, plan) + "policy " + plan.name + " splits " + root.type() +
                                " wrong: " + util::message_of(e));
  }
  const auto after = nn::tied_parameters(root);
  if (after != serial_ties)
    throw std::invalid_argument(at(plan.where, plan) + "policy " + plan.name + " changes which parameters are tied: the serial " +
                                root.type() + " ties " + list_ties(serial_ties) + ", the sharded one " + list_ties(after) +
                                (after.size() < serial_ties.size() ? " (declare them in the policy's ties)" : ""));
}

}  // namespace partrain::parallel
