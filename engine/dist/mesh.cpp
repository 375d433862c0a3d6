// The device mesh (see mesh.hpp): the layout's arithmetic, and the groups of every axis made
// from the world.
#include <algorithm>
#include <sstream>

#include "engine/dist/mesh.hpp"

namespace partrain::dist {

namespace {

// " x context=C" where context is split, else nothing: messages read as before without it.
std::string context_term(int context) { return context == 1 ? "" : " x context=" + std::to_string(context); }

}  // namespace

Layout::Layout(const MeshOptions& o, int world)
    : tensor(o.tensor), data(o.data), pipeline(o.pipeline), context(o.context) {
  TORCH_CHECK(o.tensor >= 1 && o.pipeline >= 1 && o.context >= 1 && o.data >= 0 && o.expert >= 1,
              "mesh sizes must be positive: tensor=", o.tensor, " context=", o.context, " pipeline=", o.pipeline,
              " data=", o.data, " expert=", o.expert);
  int unit = o.tensor * o.context * o.pipeline;  // the ranks of one model replica
  // What to start instead, when the world is one of too few ranks: the launcher's flag.
  auto start_with = [](int ranks) {
    return " (start it with partrain --nproc-per-node " + std::to_string(ranks) + ")";
  };
  if (data == 0) {
    TORCH_CHECK(world % unit == 0, "mesh: tensor=", o.tensor, context_term(o.context), " x pipeline=", o.pipeline,
                " = ", unit, " does not divide the world of ", world, " ranks", world < unit ? start_with(unit) : "");
    data = world / unit;
  }
  TORCH_CHECK(unit * data == world, "mesh: tensor=", o.tensor, context_term(o.context), " x data=", data,
              " x pipeline=", o.pipeline, " = ", unit * data, " ranks, but the world has ", world,
              world < unit * data ? start_with(unit * data) : "");
  // Zero groups split data_context, the ranks that hold the same parameters.
  const int replicas = data * context;
  zero = o.zero <= 0 ? replicas : o.zero;  // <= 0: the whole data_context group (InternLM's zero1); unset (1): off
  TORCH_CHECK(zero <= replicas && replicas % zero == 0, "mesh: zero=", o.zero, " does not divide ",
              context == 1 ? "the data size " + std::to_string(data)
                           : "data x context = " + std::to_string(data) + " x " + std::to_string(context) + " = " +
                                 std::to_string(replicas),
              " (zero <= 0: the whole data", context == 1 ? "" : "_context",
              " group; 1: off; n: groups of n consecutive ranks)");
  // Expert groups split data_context too: expert ranks are data ranks, each reading its own rows.
  expert = o.expert;
  TORCH_CHECK(replicas % expert == 0, "mesh: expert=", expert, " does not divide data x context = ",
              context == 1 ? std::to_string(data)
                           : std::to_string(data) + " x " + std::to_string(context) + " = " + std::to_string(replicas),
              " (expert ranks are data ranks: groups of that many consecutive data", context == 1 ? "" : "_context",
              " ranks split the experts)");
}

Coord Layout::coord(int rank) const {
  TORCH_CHECK(rank >= 0 && rank < world(), "rank ", rank, " is outside the mesh of ", world());
  Coord c;
  c.tensor = rank % tensor;
  c.context = (rank / tensor) % context;
  c.data = (rank / (tensor * context)) % data;
  c.pipeline = rank / (tensor * context * data);
  c.expert = (c.context + context * c.data) % expert;  // its place in data_context, within its expert group
  return c;
}

const std::vector<std::string>& Layout::kinds() {
  static const std::vector<std::string> k{"world", "tensor", "context", "data", "data_context", "pipeline", "unit",
                                          "zero", "expert", "expert_data", "expert_tensor"};
  return k;
}

namespace {

// "world, tensor, ..., unit or zero": the kinds, for messages.
std::string kinds_text() {
  const auto& k = Layout::kinds();
  std::string s;
  for (size_t i = 0; i < k.size(); ++i) s += (i == 0 ? "" : i + 1 == k.size() ? " or " : ", ") + k[i];
  return s;
}

}  // namespace

std::vector<int> Layout::group_of(const std::string& kind, int rank) const {
  const Coord c = coord(rank);
  // The rank at c with some coordinates replaced.
  auto at = [&](int t, int x, int d, int p) {
    Coord o;
    o.tensor = t, o.context = x, o.data = d, o.pipeline = p;
    return rank_of(o);
  };
  // The i-th rank of c's data_context group: i = context + C * data, so the order is global-rank order.
  auto replica = [&](int i) { return at(c.tensor, i % context, i / context, c.pipeline); };
  const int place = c.context + context * c.data;  // c's index in its data_context group
  std::vector<int> out;
  if (kind == "world") {
    for (int r = 0; r < world(); ++r) out.push_back(r);
  } else if (kind == "tensor") {
    for (int t = 0; t < tensor; ++t) out.push_back(at(t, c.context, c.data, c.pipeline));
  } else if (kind == "context") {
    for (int x = 0; x < context; ++x) out.push_back(at(c.tensor, x, c.data, c.pipeline));
  } else if (kind == "data") {
    for (int d = 0; d < data; ++d) out.push_back(at(c.tensor, c.context, d, c.pipeline));
  } else if (kind == "data_context") {
    for (int i = 0; i < data * context; ++i) out.push_back(replica(i));
  } else if (kind == "pipeline") {
    for (int p = 0; p < pipeline; ++p) out.push_back(at(c.tensor, c.context, c.data, p));
  } else if (kind == "unit") {
    for (int p = 0; p < pipeline; ++p)
      for (int x = 0; x < context; ++x)
        for (int t = 0; t < tensor; ++t) out.push_back(at(t, x, c.data, p));
  } else if (kind == "zero") {
    for (int i = place / zero * zero; i < place / zero * zero + zero; ++i) out.push_back(replica(i));
  } else if (kind == "zero_across") {
    for (int i = place % zero; i < data * context; i += zero) out.push_back(replica(i));
  } else if (kind == "expert") {
    for (int i = place / expert * expert; i < place / expert * expert + expert; ++i) out.push_back(replica(i));
  } else if (kind == "expert_data") {
    for (int i = place % expert; i < data * context; i += expert) out.push_back(replica(i));
  } else if (kind == "expert_tensor") {
    // Place-major, tensor-minor: the tensor ranks of one place are consecutive global ranks.
    for (int i = place / expert * expert; i < place / expert * expert + expert; ++i)
      for (int t = 0; t < tensor; ++t) out.push_back(at(t, i % context, i / context, c.pipeline));
  } else {
    TORCH_CHECK(false, "unknown group kind '", kind, "' (expected ", kinds_text(), ")");
  }
  return out;
}

std::vector<std::vector<int>> Layout::groups(const std::string& kind) const {
  // Every rank's group, each once, in the order of its lowest rank.
  std::vector<std::vector<int>> out;
  for (int r = 0; r < world(); ++r) {
    auto g = group_of(kind, r);
    if (std::find(out.begin(), out.end(), g) == out.end()) out.push_back(g);
  }
  return out;
}

Mesh::Mesh(const MeshOptions& options, World& world)
    : layout_(options, world.size()), rank_(world.rank()), coord_(layout_.coord(world.rank())) {
  // Every rank makes every group of every kind in the same order; it keeps the ones it is in.
  for (const auto& kind : Layout::kinds()) {
    if (kind == "world") {
      groups_[kind] = world.world();
      continue;
    }
    // Without context parallelism data_context is the data group: the same communicator, not a
    // second one over the same ranks. (With it, it gets its own, even where it has the members of
    // the context group, so that gradient sync and the attention's exchanges never share one.)
    if (kind == "data_context" && layout_.context == 1) {
      groups_[kind] = groups_.at("data");
      continue;
    }
    // Likewise without expert parallelism: the ranks holding the same experts are data_context and
    // expert x tensor is tensor, so expert parameters sync and gather over the dense ones' groups.
    if (kind == "expert_data" && layout_.expert == 1) {
      groups_[kind] = groups_.at("data_context");
      continue;
    }
    if (kind == "expert_tensor" && layout_.expert == 1) {
      groups_[kind] = groups_.at("tensor");
      continue;
    }
    for (const auto& ranks : layout_.groups(kind)) {
      std::string name = kind + "[" + join_ranks(ranks) + "]";
      if (auto g = world.new_group(name, ranks)) groups_[kind] = g;
    }
  }
  // Hierarchical ZeRO only: shards all-reduced across the zero groups.
  if (layout_.zero > 1 && layout_.zero < layout_.data * layout_.context)
    for (const auto& ranks : layout_.groups("zero_across")) {
      std::string name = "zero_across[" + join_ranks(ranks) + "]";
      if (auto g = world.new_group(name, ranks)) zero_across_ = g;
    }
}

const GroupPtr& Mesh::group(const std::string& kind) const {
  auto it = groups_.find(kind);
  TORCH_CHECK(it != groups_.end(), "unknown group kind '", kind, "' (expected ", kinds_text(), ")");
  return it->second;
}

std::string Mesh::describe() const {
  std::ostringstream s;
  s << "mesh tensor=" << layout_.tensor << " context=" << layout_.context << " data=" << layout_.data
    << " pipeline=" << layout_.pipeline << " zero=" << layout_.zero;
  if (layout_.expert > 1) s << " expert=" << layout_.expert;  // absent: the text reads as before experts
  s << " (world " << layout_.world() << "); rank " << rank_ << " at tensor=" << coord_.tensor
    << " context=" << coord_.context << " data=" << coord_.data << " pipeline=" << coord_.pipeline;
  if (layout_.expert > 1) s << " expert=" << coord_.expert;
  for (const auto& kind : Layout::kinds()) {
    // Groups where nothing runs, data_context while it is the data group, and the expert groups
    // while they are groups of one or the dense groups.
    if ((kind == "zero" && layout_.zero == 1) || (kind == "pipeline" && layout_.pipeline == 1) ||
        ((kind == "context" || kind == "data_context") && layout_.context == 1) ||
        (kind.rfind("expert", 0) == 0 && layout_.expert == 1))
      continue;
    s << "\n  " << kind << ": ranks " << join_ranks(group(kind)->ranks());
  }
  return s.str();
}

}  // namespace partrain::dist
