// The device mesh: the world laid out as pipeline x data x context x tensor, tensor fastest
// (Megatron's tp-cp-dp-pp order), with one process group per axis and the derived groups:
// data_context (the data x context ranks of one tensor and pipeline place: where gradients are
// synchronised), unit (one tensor x context x pipeline replica of the model: Cube's plan_ngpus)
// zero (data_context or consecutive parts of it: InternLM's zero1, Cube's zero_ngroups) and the
// expert groups, which split data_context rather than add an axis (expert ranks are data ranks, as
// in Megatron and torchtitan): expert (consecutive parts), expert_data (the strided ranks holding
// the same experts) and expert_tensor (tensor x expert).
// Layout is pure arithmetic, usable without processes.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/dist/world.hpp"

namespace partrain::dist {

struct MeshOptions {
  int tensor = 1;     ///< tensor-parallel size
  int pipeline = 1;   ///< pipeline-parallel size
  int data = 0;       ///< data-parallel size; 0: world / (tensor * context * pipeline)
  int zero = 1;       ///< ranks that split optimizer state (InternLM's zero1): 1 off; n > 1: groups of
                      ///< n consecutive data_context ranks (n divides data * context); <= 0: the
                      ///< whole data_context group
  int context = 1;    ///< context-parallel size: ranks that split each sequence (last, so that
                      ///< { tensor, pipeline, data, zero } initialisers keep their meaning)
  int expert = 1;     ///< expert-parallel size: groups of n consecutive data_context ranks that split
                      ///< the experts (n divides data * context); 1: every rank holds every expert
};

/// A rank's place on each axis (context last, as in MeshOptions), and its place in its expert group.
struct Coord {
  int tensor = 0, data = 0, pipeline = 0, context = 0;
  int expert = 0;  ///< (context + C * data) % expert: which of its expert group's shares of experts it holds
};

/// Which global rank sits where, and which ranks form each group.
class Layout {
 public:
  /// Validates the sizes against `world`; a size that does not fit is an error naming the sizes.
  Layout(const MeshOptions& options, int world);

  int world() const { return tensor * context * data * pipeline; }
  Coord coord(int rank) const;
  int rank_of(const Coord& c) const {
    return c.tensor + tensor * (c.context + context * (c.data + data * c.pipeline));
  }
  /// The members of `rank`'s group of `kind` (one of kinds()), in group-rank order, which is
  /// global-rank order. Also "zero_across": the data_context ranks holding the same shard in every
  /// zero group (what hierarchical ZeRO all-reduces over), not one of kinds().
  std::vector<int> group_of(const std::string& kind, int rank) const;
  /// Every group of `kind`, in a fixed order all ranks agree on.
  std::vector<std::vector<int>> groups(const std::string& kind) const;
  static const std::vector<std::string>& kinds();

  int tensor, data, pipeline, context;
  int zero;    ///< size of each zero group (1: ZeRO off), a divisor of data * context
  int expert;  ///< size of each expert group (1: experts not split), a divisor of data * context
};

class Mesh {
 public:
  /// Lays out the world and makes every group (collectively: all ranks call this together).
  Mesh(const MeshOptions& options, World& world);

  const Layout& layout() const { return layout_; }
  int rank() const { return rank_; }
  const Coord& coord() const { return coord_; }
  int size(const std::string& kind) const { return group(kind)->size(); }
  /// This rank's group of `kind`; an unknown kind is an error listing the kinds.
  const GroupPtr& group(const std::string& kind) const;
  /// The data_context ranks at this rank's place in the other zero groups (hierarchical ZeRO: zero
  /// groups smaller than data_context); null when the zero group is all of data_context or off.
  const GroupPtr& zero_across() const { return zero_across_; }
  /// The layout as text: sizes, this rank's coordinates, and its groups' ranks.
  std::string describe() const;

 private:
  Layout layout_;
  int rank_;
  Coord coord_;
  std::map<std::string, GroupPtr> groups_;
  GroupPtr zero_across_;
};

}  // namespace partrain::dist
