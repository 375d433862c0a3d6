// Converting a checkpoint to another layout offline (`partrain ckpt convert`): every tensor read
// whole, then written as the new layout's ranks would hold it. See ckpt.hpp.
#include <algorithm>
#include <cstdio>
#include <memory>

#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/internal.hpp"
#include "engine/parallel/sharding.hpp"

namespace partrain::ckpt {

using namespace internal;

void convert(const std::string& src_tag_dir, const std::string& dst_dir, int tensor, int data) {
  TORCH_CHECK(tensor >= 1 && data >= 1, "convert: --tensor and --data must be at least 1");
  auto problems = verify(src_tag_dir);
  TORCH_CHECK(problems.empty(), "convert: '", src_tag_dir, "' is damaged: ", problems.front());
  Manifest src = read_manifest(src_tag_dir);
  Manifest m = src;
  m.version = kFormatVersion;
  m.world = tensor * data;
  m.tensor = tensor;
  m.data = m.zero = data;
  m.pipeline = 1;
  m.full = false;
  m.files.clear();
  m.rng.clear();  // generator states belong to the ranks that saved them
  std::string tag = src_tag_dir.substr(src_tag_dir.find_last_of('/') + 1);
  check_tag(tag);
  std::string problem;
  TORCH_CHECK(existing(dst_dir, tag, &problem) != Existing::Valid, "convert: ", refuse_existing(dst_dir, tag));
  std::string tmp = scratch_folder(dst_dir, tag);
  // Rank r of the new layout's tensor group (data 0) writes its slices; rank 0 the whole tensors.
  std::vector<std::unique_ptr<DataFile>> files(tensor);
  auto file = [&](int r) -> DataFile& {
    if (!files[r]) {
      char name[32];
      std::snprintf(name, sizeof name, "rank-%05d.bin", r);
      files[r] = std::make_unique<DataFile>(join(tmp, name));
    }
    return *files[r];
  };
  for (auto& e : m.tensors) {
    const TensorEntry* original = src.find(e.name);
    auto full = read_tensor(src_tag_dir, src, *original);
    e.pieces.clear();
    if (e.dim < 0 || tensor == 1) {
      add_pieces(file(0), e, full, nullptr, 0);
      continue;
    }
    // The new layout's split, from the sizes the checkpoint recorded: a dimension of one part that
    // the new tensor size does not divide is padded (as a vocabulary is); parts must divide.
    const int64_t logical = e.shape[e.dim];
    const int64_t padded = e.parts.empty() && logical % tensor != 0 ? (logical + tensor - 1) / tensor * tensor : 0;
    parallel::Sharding split;
    try {
      split = parallel::Sharding::split(nullptr, tensor, e.dim, e.shape, e.parts, padded);
    } catch (const c10::Error& err) {
      TORCH_CHECK(false, "convert: ", e.name, " cannot be split over tensor ", tensor, ": ", err.what_without_backtrace());
    }
    for (int r = 0; r < tensor; ++r) {
      const auto slices = split.slices(r);
      for (const auto& [start, length] : slices) {
        std::vector<int64_t> at(e.shape.size(), 0), size = e.shape;
        at[e.dim] = start;
        size[e.dim] = length;
        Piece p;
        p.file = r;
        auto part = full.narrow(e.dim, start, length);
        p.bytes = static_cast<uint64_t>(part.nbytes());
        p.offset = file(r).write(part, &p.crc32);
        p.start = at;
        p.size = size;
        e.pieces.push_back(p);
      }
    }
  }
  // Files in rank order; pieces name them by position.
  std::vector<int32_t> position(tensor, -1);
  for (int r = 0; r < tensor; ++r)
    if (files[r]) {
      char name[32];
      std::snprintf(name, sizeof name, "rank-%05d.bin", r);
      position[r] = static_cast<int32_t>(m.files.size());
      m.files.push_back(files[r]->finish(name));
    }
  for (auto& e : m.tensors)
    for (auto& p : e.pieces) p.file = position[p.file];
  validate(m, join(tmp, "manifest.bin"));
  write_manifest(tmp, m);
  std::vector<std::string> notes;
  commit(dst_dir, tag, tmp, 0, false, &notes);
}

}  // namespace partrain::ckpt
