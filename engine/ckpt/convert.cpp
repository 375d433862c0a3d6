// Converting a checkpoint to another layout offline (`partrain ckpt convert`): every tensor read
// whole, then written as the new layout's ranks (tensor, data and pipeline) would hold it. See ckpt.hpp.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <map>
#include <memory>
#include <set>

#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/internal.hpp"
#include "engine/parallel/pipeline.hpp"
#include "engine/parallel/sharding.hpp"

namespace partrain::ckpt {

using namespace internal;

namespace {

// "h.3.attn.c_attn.weight" -> "h"; "optim/h.3.x/exp_avg" is named by its parameter first.
std::string top_of(const std::string& param) { return param.substr(0, param.find('.')); }
// The block number after the container ("h.3.attn..." -> "3"), or "" when the second part is not one.
std::string block_of(const std::string& param) {
  auto dot = param.find('.');
  if (dot == std::string::npos) return "";
  auto rest = param.substr(dot + 1);
  auto index = rest.substr(0, rest.find('.'));
  bool digits = !index.empty() && index.size() <= 9 &&
                std::all_of(index.begin(), index.end(), [](unsigned char c) { return std::isdigit(c); });
  return digits ? index : "";
}
// The parameter a tensor entry belongs to: "model/<p>" or "optim/<p>/<slot>".
std::string param_of(const std::string& name) {
  if (name.rfind("model/", 0) == 0) return name.substr(6);
  auto rest = name.substr(6);
  return rest.substr(0, rest.find_last_of('/'));
}

// Which pipeline rank (of `pp`, one chunk a rank) holds each parameter of `m`, and the layout the
// new manifest records. The blocks' container, first and last modules come from the pipeline
// the checkpoint records, else from its tensor names (see ckpt.hpp).
std::map<std::string, int> stage_of_params(const Manifest& m, int pp, PipelineLayout* layout) {
  const std::string where = "convert --pipeline " + std::to_string(pp) + ": ";
  PipelineLayout l;
  if (!m.stages.bounds.empty()) {
    l.blocks = m.stages.blocks;
    l.first = m.stages.first;
    l.last = m.stages.last;
  } else {
    std::set<std::string> numbered, plain;  // top-level names followed by a block number, or not
    for (const auto& e : m.tensors) {
      auto p = param_of(e.name);
      (block_of(p).empty() ? plain : numbered).insert(top_of(p));
    }
    std::vector<std::string> containers;
    for (const auto& t : numbered)
      if (!plain.count(t)) containers.push_back(t);
    TORCH_CHECK(containers.size() == 1, where, "cannot tell the blocks of the ", m.model_type, " in this checkpoint from "
                "its tensor names (expected one top-level module whose every tensor is '<name>.<block>.', found ",
                containers.size(), ")");
    l.blocks = containers.front();
    bool seen_blocks = false;
    for (const auto& e : m.tensors) {
      if (e.name.rfind("model/", 0) != 0) continue;
      auto top = top_of(param_of(e.name));
      if (top == l.blocks) seen_blocks = true;
      else if (!seen_blocks && std::find(l.first.begin(), l.first.end(), top) == l.first.end()) l.first.push_back(top);
      else if (seen_blocks && std::find(l.last.begin(), l.last.end(), top) == l.last.end() &&
               std::find(l.first.begin(), l.first.end(), top) == l.first.end())
        l.last.push_back(top);
    }
  }
  // The blocks in number order, then the uniform split of them into pp stages.
  std::vector<int64_t> numbers;
  for (const auto& e : m.tensors) {
    auto p = param_of(e.name);
    if (top_of(p) != l.blocks) continue;
    auto b = block_of(p);
    TORCH_CHECK(!b.empty(), where, "tensor '", e.name, "' sits in the blocks' container '", l.blocks,
                "' but in no numbered block");
    numbers.push_back(std::stoll(b));
  }
  std::sort(numbers.begin(), numbers.end());
  numbers.erase(std::unique(numbers.begin(), numbers.end()), numbers.end());
  try {
    l.bounds = parallel::split_stages(std::vector<int64_t>(numbers.size(), 1), pp, parallel::StageBalance{});
  } catch (const c10::Error& err) {
    TORCH_CHECK(false, where, "the checkpoint's '", l.blocks, "' ", err.what_without_backtrace());
  }
  std::map<std::string, int> stage;
  for (const auto& e : m.tensors) {
    auto p = param_of(e.name);
    auto top = top_of(p);
    int s;
    if (top == l.blocks) {
      auto k = std::lower_bound(numbers.begin(), numbers.end(), std::stoll(block_of(p))) - numbers.begin();
      s = static_cast<int>(std::upper_bound(l.bounds.begin(), l.bounds.end(), k) - l.bounds.begin() - 1);
    } else if (std::find(l.first.begin(), l.first.end(), top) != l.first.end()) {
      s = 0;
    } else if (std::find(l.last.begin(), l.last.end(), top) != l.last.end()) {
      s = pp - 1;
    } else {
      TORCH_CHECK(false, where, "tensor '", e.name, "' belongs to '", top, "', which is neither the blocks ('", l.blocks,
                  "') nor a first or last stage's module");
    }
    stage[e.name] = s;
  }
  if (pp > 1) *layout = l;
  return stage;
}

}  // namespace

void convert(const std::string& src_tag_dir, const std::string& dst_dir, int tensor, int data, int pipeline) {
  TORCH_CHECK(tensor >= 1 && data >= 1 && pipeline >= 1, "convert: --tensor, --data and --pipeline must be at least 1");
  TORCH_CHECK(int64_t(tensor) * data * pipeline <= (int64_t(1) << 20), "convert: tensor ", tensor, " x data ", data,
              " x pipeline ", pipeline, " is more than 2^20 ranks");
  auto problems = verify(src_tag_dir);
  TORCH_CHECK(problems.empty(), "convert: '", src_tag_dir, "' is damaged: ", problems.front());
  Manifest src = read_manifest(src_tag_dir);
  Manifest m = src;
  m.version = kFormatVersion;
  m.world = tensor * data * pipeline;
  m.tensor = tensor;
  m.data = m.zero = data;
  m.pipeline = pipeline;
  m.stages = PipelineLayout{};
  const auto stage = pipeline > 1 ? stage_of_params(src, pipeline, &m.stages) : std::map<std::string, int>{};
  m.full = false;
  m.files.clear();
  m.rng.clear();  // generator states belong to the ranks that saved them
  m.cuda_rng.clear();
  std::string tag = src_tag_dir.substr(src_tag_dir.find_last_of('/') + 1);
  check_tag(tag);
  std::string problem;
  TORCH_CHECK(existing(dst_dir, tag, &problem) != Existing::Valid, "convert: ", refuse_existing(dst_dir, tag));
  std::string tmp = scratch_folder(dst_dir, tag);
  // Rank r of the tensor group at data 0 of the stage holding a tensor writes its slices; tensor
  // rank 0 there the whole tensors. Files are keyed by global rank ((stage x data) x tensor + r).
  std::map<int, std::unique_ptr<DataFile>> files;
  auto file = [&](int r) -> DataFile& {
    auto& f = files[r];
    if (!f) {
      char name[32];
      std::snprintf(name, sizeof name, "rank-%05d.bin", r);
      f = std::make_unique<DataFile>(join_path(tmp, name));
    }
    return *f;
  };
  for (auto& e : m.tensors) {
    const TensorEntry* original = src.find(e.name);
    auto full = read_tensor(src_tag_dir, src, *original);
    e.pieces.clear();
    const int base = pipeline > 1 ? stage.at(e.name) * data * tensor : 0;
    if (e.dim < 0 || tensor == 1) {
      add_pieces(file(base), e, full, nullptr, base);
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
        p.file = base + r;
        auto part = full.narrow(e.dim, start, length);
        p.bytes = static_cast<uint64_t>(part.nbytes());
        p.offset = file(base + r).write(part, &p.crc32);
        p.start = at;
        p.size = size;
        e.pieces.push_back(p);
      }
    }
  }
  // Files in rank order; pieces name them by position.
  std::map<int, int32_t> position;
  for (auto& [r, f] : files) {
    char name[32];
    std::snprintf(name, sizeof name, "rank-%05d.bin", r);
    position[r] = static_cast<int32_t>(m.files.size());
    m.files.push_back(f->finish(name));
  }
  for (auto& e : m.tensors)
    for (auto& p : e.pieces) p.file = position.at(p.file);
  validate(m, join_path(tmp, "manifest.bin"));
  write_manifest(tmp, m);
  std::vector<std::string> notes;
  commit(dst_dir, tag, tmp, 0, false, &notes);
}

}  // namespace partrain::ckpt
