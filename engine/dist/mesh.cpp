// The device mesh (see mesh.hpp): the layout's arithmetic, and the groups of every axis made
// from the world.
#include <algorithm>
#include <sstream>

#include "engine/dist/mesh.hpp"

namespace partrain::dist {

Layout::Layout(const MeshOptions& o, int world) : tensor(o.tensor), data(o.data), pipeline(o.pipeline) {
  TORCH_CHECK(o.tensor >= 1 && o.pipeline >= 1 && o.data >= 0, "mesh sizes must be positive: tensor=", o.tensor,
              " pipeline=", o.pipeline, " data=", o.data);
  int unit = o.tensor * o.pipeline;
  // What to start instead, when the world is one of too few ranks: the launcher's flag.
  auto start_with = [](int ranks) {
    return " (start it with partrain --nproc-per-node " + std::to_string(ranks) + ")";
  };
  if (data == 0) {
    TORCH_CHECK(world % unit == 0, "mesh: tensor=", o.tensor, " x pipeline=", o.pipeline, " = ", unit,
                " does not divide the world of ", world, " ranks", world < unit ? start_with(unit) : "");
    data = world / unit;
  }
  TORCH_CHECK(unit * data == world, "mesh: tensor=", o.tensor, " x data=", data, " x pipeline=", o.pipeline, " = ",
              unit * data, " ranks, but the world has ", world, world < unit * data ? start_with(unit * data) : "");
  zero = o.zero <= 0 ? data : o.zero;  // <= 0: the whole data group (InternLM's zero1); unset (1): off
  TORCH_CHECK(zero <= data && data % zero == 0, "mesh: zero=", o.zero, " does not divide the data size ", data,
              " (zero <= 0: the whole data group; 1: off; n: groups of n data ranks)");
}

Coord Layout::coord(int rank) const {
  TORCH_CHECK(rank >= 0 && rank < world(), "rank ", rank, " is outside the mesh of ", world());
  return Coord{rank % tensor, (rank / tensor) % data, rank / (tensor * data)};
}

const std::vector<std::string>& Layout::kinds() {
  static const std::vector<std::string> k{"world", "tensor", "data", "pipeline", "unit", "zero"};
  return k;
}

std::vector<int> Layout::group_of(const std::string& kind, int rank) const {
  Coord c = coord(rank);
  std::vector<int> out;
  if (kind == "world") {
    for (int r = 0; r < world(); ++r) out.push_back(r);
  } else if (kind == "tensor") {
    for (int t = 0; t < tensor; ++t) out.push_back(rank_of({t, c.data, c.pipeline}));
  } else if (kind == "data") {
    for (int d = 0; d < data; ++d) out.push_back(rank_of({c.tensor, d, c.pipeline}));
  } else if (kind == "pipeline") {
    for (int p = 0; p < pipeline; ++p) out.push_back(rank_of({c.tensor, c.data, p}));
  } else if (kind == "unit") {
    for (int p = 0; p < pipeline; ++p)
      for (int t = 0; t < tensor; ++t) out.push_back(rank_of({t, c.data, p}));
  } else if (kind == "zero") {
    int first = c.data / zero * zero;
    for (int d = first; d < first + zero; ++d) out.push_back(rank_of({c.tensor, d, c.pipeline}));
  } else if (kind == "zero_across") {
    for (int d = c.data % zero; d < data; d += zero) out.push_back(rank_of({c.tensor, d, c.pipeline}));
  } else {
    TORCH_CHECK(false, "unknown group kind '", kind, "' (expected world, tensor, data, pipeline, unit or zero)");
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
    for (const auto& ranks : layout_.groups(kind)) {
      std::string name = kind + "[" + join_ranks(ranks) + "]";
      if (auto g = world.new_group(name, ranks)) groups_[kind] = g;
    }
  }
  // Hierarchical ZeRO only: shards all-reduced across the zero groups.
  if (layout_.zero > 1 && layout_.zero < layout_.data)
    for (const auto& ranks : layout_.groups("zero_across")) {
      std::string name = "zero_across[" + join_ranks(ranks) + "]";
      if (auto g = world.new_group(name, ranks)) zero_across_ = g;
    }
}

const GroupPtr& Mesh::group(const std::string& kind) const {
  auto it = groups_.find(kind);
  TORCH_CHECK(it != groups_.end(), "unknown group kind '", kind,
              "' (expected world, tensor, data, pipeline, unit or zero)");
  return it->second;
}

std::string Mesh::describe() const {
  std::ostringstream s;
  s << "mesh tensor=" << layout_.tensor << " data=" << layout_.data << " pipeline=" << layout_.pipeline
    << " zero=" << layout_.zero << " (world " << layout_.world() << "); rank " << rank_ << " at tensor="
    << coord_.tensor << " data=" << coord_.data << " pipeline=" << coord_.pipeline;
  for (const auto& kind : Layout::kinds()) {
    if ((kind == "zero" && layout_.zero == 1) || (kind == "pipeline" && layout_.pipeline == 1)) continue;  // nothing runs
    s << "\n  " << kind << ": ranks " << join_ranks(group(kind)->ranks());
  }
  return s.str();
}

}  // namespace partrain::dist
