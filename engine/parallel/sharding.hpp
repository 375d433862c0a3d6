// How a split parameter's logical (serial) tensor is divided across the ranks of a tensor group,
// as a value: the split dimension, the logical shape, the parts the dimension is made of (q, k and
// v of unequal sizes, as grouped-query attention has them), the padding, and the one walker of
// the slices a rank holds. Layers that split a parameter hold one; checkpoints, the planner, the
// REPL and clipping read it through the module tree (sharding_of(root, name)).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/dist/process_group.hpp"

namespace partrain::nn {
class Module;
}

namespace partrain::parallel {

using torch::Tensor;

/// A range of the logical split dimension: (start, length).
using Slice = std::pair<int64_t, int64_t>;

struct Sharding {
  /// Splits dimension `dim` of a tensor of logical shape `shape` over `group` (of `ranks` ranks:
  /// the group's size; a group may be null where only sizes matter, as in the planner's
  /// arithmetic and the unit tests). `parts`: the sizes the dimension is made of, each split across
  /// the group on its own (empty: one part, the whole dimension). `padded`: with one part, the
  /// dimension padded with zero rows up to this multiple of `ranks` (0: no padding). Sizes that
  /// do not fit are an error naming them.
  static Sharding split(dist::GroupPtr group, int ranks, int64_t dim, std::vector<int64_t> shape,
                        std::vector<int64_t> parts = {}, int64_t padded = 0);
  /// The same over `group`, with `ranks` its size.
  static Sharding split(const dist::GroupPtr& group, int64_t dim, std::vector<int64_t> shape,
                        std::vector<int64_t> parts = {}, int64_t padded = 0) {
    return split(group, group->size(), dim, std::move(shape), std::move(parts), padded);
  }

  dist::GroupPtr group;        ///< the tensor group (null: sizes only)
  int ranks = 1;               ///< the group's size
  int64_t dim = 0;             ///< the split dimension
  std::vector<int64_t> shape;  ///< the logical shape: what a serial model has, without padding
  std::vector<int64_t> parts;  ///< the sizes `dim` is made of, in order (their sum: shape[dim])
  int64_t padded = 0;          ///< `dim`'s size padded to a multiple of `ranks` (== shape[dim] if none)
  /// Split both ways (an MoE block's experts under expert x tensor parallelism): each rank's part
  /// along `dim` is split again along `inner_dim` into `inner_ranks` equal slices over
  /// `inner_group`; -1: not. `both`: the ranks of both splits, where a squared norm sums.
  int64_t inner_dim = -1;
  dist::GroupPtr inner_group;
  int inner_ranks = 1;
  dist::GroupPtr both;

  /// Adds the inner split: `dim` (not this one's) over `group`, `both` the two groups' ranks.
  Sharding within(int64_t dim, dist::GroupPtr group, dist::GroupPtr both) const;
  /// The same without the inner split: what the ranks of one inner group hold together.
  Sharding outer() const;
  /// The ranks a squared norm of the parameter sums over: `both`, or `group`.
  const dist::GroupPtr& norm_group() const { return inner_dim >= 0 ? both : group; }

  /// The ranges of the logical `dim` that group rank `r` holds, in the order of its local rows:
  /// its slice of every part. Local rows past their total are padding (one part only).
  std::vector<Slice> slices(int r) const;
  /// The local shape on every rank (padding included).
  std::vector<int64_t> local_shape() const;
  /// How many parts of equal size `dim` is made of (q, k, v of one size: 3). An error when the
  /// parts differ in size: a format that records only a count cannot hold them.
  int64_t equal_parts() const;
  /// "split on dimension 0 over tensor=2 (parts 64+16+16)", for messages.
  std::string describe() const;
  /// The same split: the same group, dimension, logical shape, parts and padding.
  bool operator==(const Sharding& o) const {
    return group == o.group && ranks == o.ranks && dim == o.dim && shape == o.shape && parts == o.parts &&
           padded == o.padded && inner_dim == o.inner_dim && inner_group == o.inner_group &&
           inner_ranks == o.inner_ranks;
  }
  bool operator!=(const Sharding& o) const { return !(*this == o); }
};

/// Group rank `r`'s part of the logical tensor `full` (padding rows zero). No communication.
Tensor local_part(const Tensor& full, const Sharding& s, int r);
/// The logical tensor put together from every rank's part, `parts[r]` being group rank r's
/// (what an all-gather returns). No communication.
Tensor assemble(const std::vector<Tensor>& parts, const Sharding& s);
/// The logical tensor assembled from every rank's part: an all-gather over the group (first
/// over the inner group when split both ways).
Tensor gather_full(const Tensor& local, const Sharding& s);
/// Split both ways: this rank's part put together over the inner group (an all-gather there),
/// the part of s.outer(); `local` itself otherwise.
Tensor gather_inner(const Tensor& local, const Sharding& s);
/// Split both ways: this rank's inner slice of its part of s.outer(); `outer_local` otherwise.
Tensor inner_part(const Tensor& outer_local, const Sharding& s);

/// How the parameter at dotted `name` of `root` is split: asked of the module that holds it
/// (nn::Module::sharding_of), so a tied tensor answers as the holder named. nullopt for a whole
/// (replicated) parameter, or a name `root` does not have.
c10::optional<Sharding> sharding_of(const nn::Module& root, const std::string& name);

/// The rows [first, first + n) of a tensor's dimension `dim` for rank r of t equal parts;
/// an error naming `what` when t does not divide the size.
Tensor shard(const Tensor& full, int64_t dim, int rank, int parts, const std::string& what);

}  // namespace partrain::parallel
