// Sharding as a value: the slice walker and the copies between logical tensors and rank parts
// (see sharding.hpp).
#include "engine/parallel/sharding.hpp"

#include <algorithm>
#include <numeric>
#include <sstream>

#include "engine/nn/module.hpp"

namespace partrain::parallel {

Sharding Sharding::split(dist::GroupPtr group, int ranks, int64_t dim, std::vector<int64_t> shape,
                         std::vector<int64_t> parts, int64_t padded) {
  TORCH_CHECK(ranks >= 1, "a sharding needs at least one rank, got ", ranks);
  TORCH_CHECK(!group || group->size() == ranks, "a sharding over ", ranks, " ranks given a group of ", group->size());
  TORCH_CHECK(dim >= 0 && dim < static_cast<int64_t>(shape.size()), "a sharding of a tensor of shape ",
              c10::IntArrayRef(shape), " cannot split dimension ", dim);
  const int64_t logical = shape[dim];
  if (parts.empty()) parts = {logical};
  for (auto p : parts) TORCH_CHECK(p > 0, "a sharding's parts must be positive, got ", c10::IntArrayRef(parts));
  TORCH_CHECK(std::accumulate(parts.begin(), parts.end(), int64_t{0}) == logical, "a sharding's parts ",
              c10::IntArrayRef(parts), " do not add up to dimension ", dim, "'s size ", logical);
  if (padded == 0) padded = logical;
  if (parts.size() > 1) {
    TORCH_CHECK(padded == logical, "a sharding of several parts ", c10::IntArrayRef(parts), " cannot be padded");
    for (auto p : parts)
      TORCH_CHECK(p % ranks == 0, "a part of ", p, " (of parts ", c10::IntArrayRef(parts),
                  ") does not split into tensor=", ranks, " equal slices");
  }
  TORCH_CHECK(padded >= logical && padded % ranks == 0, "a sharding of dimension ", dim, " (size ", logical,
              ") padded to ", padded, " does not split into tensor=", ranks, " equal slices");
  Sharding s;
  s.group = std::move(group);
  s.ranks = ranks;
  s.dim = dim;
  s.shape = std::move(shape);
  s.parts = std::move(parts);
  s.padded = padded;
  return s;
}

std::vector<Slice> Sharding::slices(int r) const {
  TORCH_CHECK(r >= 0 && r < ranks, "rank ", r, " is outside a sharding over tensor=", ranks);
  std::vector<Slice> out;
  if (parts.size() <= 1) {  // one part: rank r's rows of the padded dimension, padding dropped
    const int64_t each = padded / ranks, start = r * each, end = std::min(start + each, shape[dim]);
    if (end > start) out.emplace_back(start, end - start);
    return out;
  }
  int64_t offset = 0;
  for (auto size : parts) {  // each part contributes its r-th slice
    const int64_t each = size / ranks;
    out.emplace_back(offset + r * each, each);
    offset += size;
  }
  return out;
}

std::vector<int64_t> Sharding::local_shape() const {
  auto local = shape;
  local[dim] = (parts.size() <= 1 ? padded : shape[dim]) / ranks;
  if (inner_dim >= 0) local[inner_dim] /= inner_ranks;
  return local;
}

Sharding Sharding::within(int64_t d, dist::GroupPtr g, dist::GroupPtr all) const {
  TORCH_CHECK(g && d >= 0 && d < static_cast<int64_t>(shape.size()) && d != dim && inner_dim < 0,
              "a sharding split on dimension ", dim, " cannot be split again on dimension ", d);
  TORCH_CHECK(shape[d] % g->size() == 0, "dimension ", d, " of size ", shape[d], " does not split into tensor=",
              g->size(), " equal slices");
  Sharding s = *this;
  s.inner_dim = d;
  s.inner_ranks = g->size();
  s.inner_group = std::move(g);
  s.both = std::move(all);
  return s;
}

Sharding Sharding::outer() const {
  Sharding s = *this;
  s.inner_dim = -1;
  s.inner_group = nullptr;
  s.inner_ranks = 1;
  s.both = nullptr;
  return s;
}

int64_t Sharding::equal_parts() const {
  TORCH_CHECK(std::all_of(parts.begin(), parts.end(), [&](int64_t p) { return p == parts.front(); }),
              "a tensor split in parts of unequal sizes ", c10::IntArrayRef(parts),
              " cannot be described by a count of equal parts");
  return static_cast<int64_t>(parts.size());
}

std::string Sharding::describe() const {
  std::ostringstream s;
  s << "split on dimension " << dim << " over tensor=" << ranks;
  if (parts.size() > 1) {
    s << " (parts ";
    for (size_t i = 0; i < parts.size(); ++i) s << (i ? "+" : "") << parts[i];
    s << ")";
  }
  if (padded != shape[dim]) s << " (padded to " << padded << ")";
  if (inner_dim >= 0) s << ", each part on dimension " << inner_dim << " over tensor=" << inner_ranks;
  return s.str();
}

Tensor local_part(const Tensor& full, const Sharding& s, int r) {
  TORCH_CHECK(full.sizes().equals(s.shape), "a split tensor's logical shape is ", c10::IntArrayRef(s.shape),
              ", got ", full.sizes());
  if (s.inner_dim >= 0) return inner_part(local_part(full, s.outer(), r), s);
  auto local = torch::zeros(s.local_shape(), full.options().requires_grad(false));
  int64_t offset = 0;
  for (auto [start, length] : s.slices(r)) {
    local.narrow(s.dim, offset, length).copy_(full.narrow(s.dim, start, length));
    offset += length;
  }
  return local;
}

Tensor assemble(const std::vector<Tensor>& parts, const Sharding& s) {
  TORCH_CHECK(static_cast<int>(parts.size()) == s.ranks, "assembling a tensor split over tensor=", s.ranks, " from ",
              parts.size(), " parts");
  TORCH_CHECK(!parts.empty() && parts[0].defined(), "assembling a split tensor from no parts");
  auto full = torch::empty(s.shape, parts[0].options().requires_grad(false));
  for (int r = 0; r < s.ranks; ++r) {
    TORCH_CHECK(parts[r].sizes().equals(s.local_shape()), "rank ", r, "'s part has shape ", parts[r].sizes(),
                ", not the local shape ", c10::IntArrayRef(s.local_shape()));
    int64_t offset = 0;
    for (auto [start, length] : s.slices(r)) {
      full.narrow(s.dim, start, length).copy_(parts[r].narrow(s.dim, offset, length));
      offset += length;
    }
  }
  return full;
}

Tensor gather_full(const Tensor& local, const Sharding& s) {
  TORCH_CHECK(s.group, "gathering a split tensor needs its group");
  if (s.inner_dim >= 0) return gather_full(gather_inner(local, s), s.outer());
  return assemble(s.group->all_gather(local.detach().contiguous()), s);
}

Tensor gather_inner(const Tensor& local, const Sharding& s) {
  if (s.inner_dim < 0) return local;
  TORCH_CHECK(s.inner_group, "gathering a split tensor needs its inner group");
  return torch::cat(s.inner_group->all_gather(local.detach().contiguous()), s.inner_dim);
}

Tensor inner_part(const Tensor& outer_local, const Sharding& s) {
  if (s.inner_dim < 0) return outer_local;
  const int64_t each = outer_local.size(s.inner_dim) / s.inner_ranks;
  const int r = s.inner_group ? s.inner_group->rank() : 0;
  return outer_local.narrow(s.inner_dim, r * each, each).contiguous();
}

c10::optional<Sharding> sharding_of(const nn::Module& root, const std::string& name) {
  const nn::Module* holder = &root;
  std::string leaf = name;
  std::shared_ptr<nn::Module> found;
  if (auto dot = name.rfind('.'); dot != std::string::npos) {
    found = root.find(name.substr(0, dot));
    if (!found) return c10::nullopt;
    holder = found.get();
    leaf = name.substr(dot + 1);
  }
  const Sharding* s = holder->sharding_of(leaf);
  if (!s) return c10::nullopt;
  return *s;
}

Tensor shard(const Tensor& full, int64_t dim, int rank, int parts, const std::string& what) {
  TORCH_CHECK(parts >= 1 && rank >= 0 && rank < parts, what, ": part ", rank, " of ", parts,
              " (a part is 0 to parts - 1)");
  TORCH_CHECK(full.size(dim) % parts == 0, what, ": size ", full.size(dim), " does not split into tensor=", parts,
              " equal parts");
  const int64_t each = full.size(dim) / parts;
  return full.narrow(dim, rank * each, each).contiguous();
}

}  // namespace partrain::parallel
