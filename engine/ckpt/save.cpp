// Saving a checkpoint: each rank writes its data file into a scratch folder, rank 0 writes the
// manifest, and the folder takes the tag's place without ever losing what was there.
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>

#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/internal.hpp"
#include "engine/ckpt/serialize.hpp"
#include "engine/compat.hpp"
#include "engine/data/data.hpp"
#include "engine/dist/mesh.hpp"
#include "engine/nn/module.hpp"
#include "engine/optim/optim.hpp"
#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/pipeline.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/util/bounded_archive.hpp"
#include "engine/util/files.hpp"

namespace partrain::ckpt {

namespace internal {

namespace {

// A test hook: PARTRAIN_CKPT_CRASH_AT=<point> kills the process (as kill -9 would) there.
void crash_point(const char* point) {
  const char* at = std::getenv("PARTRAIN_CKPT_CRASH_AT");
  if (at && std::strcmp(at, point) == 0) std::raise(SIGKILL);
}

}  // namespace

DataFile::DataFile(std::string path) : path_(std::move(path)) {
  fd_ = util::create_new(path_);
  crc_ = ::crc32(0L, Z_NULL, 0);
}

DataFile::~DataFile() {
  if (fd_ >= 0) ::close(fd_);
}

uint64_t DataFile::write(const torch::Tensor& t, uint32_t* crc) {
  auto cpu = t.detach().to(torch::kCPU).contiguous();
  const char* p = static_cast<const char*>(cpu.data_ptr());
  size_t n = cpu.nbytes();
  uint64_t at = offset_;
  *crc = crc_of(p, n);
  crc_ = ::crc32_combine(crc_, *crc, static_cast<z_off_t>(n));  // the file's, without a second pass
  util::write_all(fd_, p, n, path_);
  offset_ += n;
  return at;
}

FileEntry DataFile::finish(const std::string& name) {
  TORCH_CHECK(::fsync(fd_) == 0, "flushing '", path_, "' to disk failed: ", std::strerror(errno));
  ::close(fd_);
  fd_ = -1;
  return {name, offset_, static_cast<uint32_t>(crc_)};
}

// Appends `local` (this rank's part of a tensor split as `s`, or the whole tensor) as pieces.
void add_pieces(DataFile& file, TensorEntry& e, const torch::Tensor& local, const parallel::Sharding* s, int32_t file_index) {
  auto whole = [&](const torch::Tensor& t, std::vector<int64_t> start, std::vector<int64_t> size) {
    Piece p;
    p.file = file_index;
    p.bytes = static_cast<uint64_t>(t.nbytes());
    p.offset = file.write(t, &p.crc32);
    p.start = std::move(start);
    p.size = std::move(size);
    e.pieces.push_back(std::move(p));
  };
  if (!s) {
    whole(local, std::vector<int64_t>(e.shape.size(), 0), e.shape);
    return;
  }
  int64_t offset = 0;  // local rows: the slices in order, then padding (never stored)
  for (const auto& [start, length] : s->slices(s->group->rank())) {
    std::vector<int64_t> at(e.shape.size(), 0), size = e.shape;
    at[s->dim] = start;
    size[s->dim] = length;
    whole(local.narrow(s->dim, offset, length), at, size);
    offset += length;
  }
}

Existing existing(const std::string& dir, const std::string& tag, std::string* problem, bool full) {
  std::string path = join_path(dir, tag);
  if (!util::exists(path)) return Existing::None;
  TagState t = tag_state(dir, tag);
  if (!t.valid) {
    *problem = t.problem;
    return Existing::Damaged;
  }
  if (!full) return Existing::Valid;
  auto problems = verify(path);
  if (problems.empty()) return Existing::Valid;
  *problem = problems.front();
  return Existing::Damaged;
}

std::string refuse_existing(const std::string& dir, const std::string& tag) {
  return "'" + join_path(dir, tag) + "' already holds a valid checkpoint; save with overwrite = true to replace it, or " +
         "under another tag";
}

// Moves a finished `tmp` folder to DIR/<tag>, points DIR/newest at it, and keeps `num_kept`.
// Whatever is at DIR/<tag> is never lost: a valid checkpoint is refused (or, with `overwrite`,
// replaced only once the new one is in place), anything else is set aside as <tag>~damaged.
void commit(const std::string& dir, const std::string& tag, const std::string& tmp, int num_kept, bool overwrite,
            std::vector<std::string>* notes) {
  std::string final_dir = join_path(dir, tag);
  std::string problem;
  bool replaced = false;
  switch (existing(dir, tag, &problem, /*full=*/!overwrite)) {
    case Existing::None:
      util::rename_new(tmp, final_dir);
      break;
    case Existing::Valid:
      if (!overwrite) {
        util::remove_all(tmp);
        TORCH_CHECK(false, refuse_existing(dir, tag));
      }
      util::exchange(tmp, final_dir, join_path(dir, "." + tag + ".old"));  // the old one is now at tmp
      replaced = true;
      break;
    case Existing::Damaged: {
      std::string aside = final_dir + "~damaged";
      for (int i = 2; util::exists(aside); ++i) aside = final_dir + "~damaged-" + std::to_string(i);
      util::rename_new(final_dir, aside);
      notes->push_back("'" + final_dir + "' was damaged (" + problem + "); it is kept as '" + aside + "'");
      util::rename_new(tmp, final_dir);
      break;
    }
  }
  util::fsync_path(dir);
  crash_point("renamed");
  write_newest(dir, tag);
  if (replaced) util::remove_all(tmp);
  if (num_kept > 0) {
    auto all = tags(dir);
    for (size_t i = 0; i + num_kept < all.size(); ++i)
      if (all[i] != tag) util::remove_all(join_path(dir, all[i]));
  }
}

// Makes DIR (when missing) and a fresh scratch folder DIR/.<tag>.tmp for a save of `tag`.
std::string scratch_folder(const std::string& dir, const std::string& tag) {
  util::make_dirs(dir);
  std::string tmp = join_path(dir, "." + tag + ".tmp");
  util::remove_all(tmp);  // an interrupted save's (a link there is removed, never followed)
  TORCH_CHECK(::mkdir(tmp.c_str(), 0755) == 0, "cannot make the folder '", tmp, "': ", std::strerror(errno));
  return tmp;
}

}  // namespace internal

using namespace internal;

namespace {

TensorEntry entry_for(const std::string& name, const torch::Tensor& t, const parallel::Sharding* s) {
  TensorEntry e;
  e.name = name;
  e.dtype = c10::toString(t.scalar_type());
  e.shape = s ? s->shape : t.sizes().vec();
  if (s) {
    e.dim = static_cast<int32_t>(s->dim);
    if (s->parts.size() > 1) e.parts = s->parts;
  }
  return e;
}

// What one rank sends rank 0 after writing its file.
struct RankPart {
  std::vector<TensorEntry> tensors;
  FileEntry file;  // name empty: the rank wrote nothing
  std::string rng, cuda_rng;  // cuda_rng: empty on a CPU rank
  std::vector<ParamSteps> steps;  // the parameters it wrote whose state took fewer steps
  template <class Archive>
  void serialize(Archive& ar) {
    ar(tensors, file, rng, cuda_rng, steps);
  }
};

std::string rng_state() {
  auto state = at::detail::getDefaultCPUGenerator().get_state();
  return std::string(reinterpret_cast<const char*>(state.data_ptr<uint8_t>()), state.numel());
}

// This rank's CUDA generator state (its device's), or nothing on a CPU rank.
std::string cuda_rng_state() {
  const auto& device = dist::World::instance().device();
  if (!device.is_cuda()) return "";
  auto state = compat::cuda_rng_state(device).contiguous();
  return std::string(reinterpret_cast<const char*>(state.data_ptr<uint8_t>()), state.numel());
}

// Writes this rank's data file into `tmp` and returns what it sends rank 0. Each rank writes what
// it alone holds: split tensors from data rank 0 of each tensor group (experts from each expert
// rank of the first expert_data place), whole ones from rank (tensor 0, data 0), of the first
// pipeline stage holding them (every stage saves its own).
// `full`: every tensor gathered whole, written by rank 0 (by tensor 0, data 0 of each stage under
// a pipeline).
std::string write_part(const State& state, const SaveOptions& options, const std::string& tmp, int rank,
                       const parallel::Pipeline* pipe, const dist::Coord& coord) {
  RankPart part;
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.bin", rank);
  std::unique_ptr<DataFile> file;
  auto store = [&](const std::string& key, const torch::Tensor& t, const c10::optional<parallel::Sharding>& s,
                   bool first) {
    torch::Tensor value = t;
    const parallel::Sharding* split = s ? &*s : nullptr;
    // Experts split over tensor ranks too: their slices put together over the tensor group (a
    // collective: every rank, same order), written as the split over the expert group alone.
    c10::optional<parallel::Sharding> outer;
    if (split && split->inner_dim >= 0 && !options.full) {
      value = parallel::gather_inner(t, *split);
      outer = split->outer();
      split = &*outer;
    }
    // Who writes a split tensor's slices is read from the mesh (data rank 0 of each tensor
    // group): without one, a rank would be taken for a data-parallel copy and its slices lost.
    // Context ranks hold the same parameters as their context rank 0, which writes them.
    TORCH_CHECK(!split || split->ranks == 1 || state.mesh, "'", key, "' is split over tensor=", split ? split->ranks : 1,
                " but the save was given no mesh: pass mesh = <the mesh it was split over> (pt.parallelize's "
                "models carry theirs)");
    const bool stage = pipe ? first : coord.pipeline == 0;
    bool writer = stage && coord.data == 0 && coord.context == 0 && (split || coord.tensor == 0);
    // Experts split over the expert group: each expert rank at the first place of expert_data
    // writes its experts (tensor rank 0: they are whole over the tensor ranks).
    if (split && split->ranks > 1 && state.mesh && split->group == state.mesh->group("expert")) {
      const auto& l = state.mesh->layout();
      writer = stage && coord.context + l.context * coord.data < l.expert && coord.tensor == 0;
    }
    if (options.full) {
      if (split) value = parallel::gather_full(t, *split);  // collective: every rank, same order
      split = nullptr;
      writer = pipe ? stage && coord.data == 0 && coord.context == 0 && coord.tensor == 0 : rank == 0;
    }
    if (!writer) return false;
    if (!file) file = std::make_unique<DataFile>(join_path(tmp, name));
    part.tensors.push_back(entry_for(key, value, split));  // full: value is already logical
    add_pieces(*file, part.tensors.back(), value, split, -1);
    return true;
  };
  // ZeRO-3: each parameter's unit is gathered when the parameter is reached (the unit before it
  // freed), on every rank of the zero group in the same order, writer or not (a collective): a
  // rank holds its shards and one unit, never the whole model.
  parallel::Fsdp::Access access(parallel::ParallelModel::fsdp_of(*state.model), /*writeback=*/false);
  for (const auto& h : held(*state.model)) {
    access.touch(h.param);
    auto s = parallel::sharding_of(*state.model, h.local);
    const bool wrote = store("model/" + h.logical, h.param, s, h.first);
    if (!state.optimizer) continue;
    for (const auto& [slot, t] : state.optimizer->param_state(h.param))
      store("optim/" + h.logical + "/" + slot, t, s, h.first);
    const int64_t steps = state.optimizer->param_steps(h.param);
    if (wrote && steps >= 0 && steps != state.optimizer->steps_taken()) part.steps.push_back({h.logical, steps});
  }
  if (file) part.file = file->finish(name);
  part.rng = rng_state();
  part.cuda_rng = cuda_rng_state();
  return util::to_bytes(part);
}

// Adds every rank's part (`parts`, in rank order) to `m`: its data file, its tensors' pieces
// (a split tensor's from all its writers), its generator states and its parameters' step counts.
void add_parts(Manifest& m, const std::vector<std::string>& parts) {
  std::map<std::string, size_t> index;
  std::map<std::string, int64_t> param_steps;  // a split parameter's slices' writers all report it
  for (const auto& bytes : parts) {
    auto part = util::from_bytes<RankPart>(bytes);
    for (const auto& p : part.steps) param_steps[p.name] = p.steps;
    int32_t file = -1;
    if (!part.file.name.empty()) {
      file = static_cast<int32_t>(m.files.size());
      m.files.push_back(part.file);
    }
    for (auto& e : part.tensors) {
      for (auto& p : e.pieces) p.file = file;
      auto it = index.find(e.name);
      if (it == index.end()) {
        index[e.name] = m.tensors.size();
        m.tensors.push_back(std::move(e));
      } else {
        auto& into = m.tensors[it->second].pieces;
        into.insert(into.end(), e.pieces.begin(), e.pieces.end());
      }
    }
    m.rng.push_back(std::move(part.rng));
    m.cuda_rng.push_back(std::move(part.cuda_rng));
  }
  for (const auto& [name, steps] : param_steps) m.param_steps.push_back({name, steps});
  // Only a run that used CUDA stores its states: a CPU run's manifest holds none.
  if (std::all_of(m.cuda_rng.begin(), m.cuda_rng.end(), [](const auto& r) { return r.empty(); })) m.cuda_rng.clear();
}

// The manifest of a save of `state` by `group`, with every rank's part.
Manifest manifest_of(const State& state, const SaveOptions& options, const dist::GroupPtr& group,
                     const parallel::Pipeline* pipe, const std::vector<std::string>& parts) {
  Manifest m;
  m.step = state.step;
  m.world = group ? group->size() : 1;
  if (state.mesh) {
    m.tensor = state.mesh->layout().tensor;
    // Context ranks hold the same parameters as data replicas do: the checkpoint counts them
    // among its data ranks, and loads without them (or with others) alike.
    m.data = state.mesh->layout().data * state.mesh->layout().context;
    m.pipeline = state.mesh->layout().pipeline;
    m.zero = state.mesh->layout().zero;
    if (pipe && m.pipeline > 1) {
      const auto& o = pipe->options();
      m.stages = {o.schedule, o.chunks, o.blocks, o.first, o.last, pipe->bounds()};
    }
  } else {
    m.data = m.zero = m.world;
  }
  m.model_type = state.model->type();
  for (const auto& f : state.model->config()) m.config.push_back({f.name, f.value, f.text});
  m.policy = state.policy;
  if (state.optimizer) {
    m.optimizer = state.optimizer->options().kind;
    m.optimizer_steps = state.optimizer->steps_taken();
  }
  if (state.optimizer && state.optimizer->loss_scaler()) {
    const auto& ls = state.optimizer->loss_scaler()->state();
    m.loss_scale = {ls.scale, double(ls.good_steps), double(ls.hysteresis), double(ls.skipped)};
  }
  m.samples_seen = state.data ? state.data->samples_seen() : -1;
  m.user_json = state.user_json;
  m.full = options.full;
  add_parts(m, parts);
  return m;
}

}  // namespace

Saved save(const std::string& dir, const State& state, const SaveOptions& options) {
  TORCH_CHECK(state.model, "checkpoint save: no model given");
  TORCH_CHECK(state.step >= 0 && state.step <= kMaxCount, "checkpoint save: step must be >= 0, got ", state.step);
  auto& world = dist::World::instance();
  dist::GroupPtr group = world.initialized() ? world.world() : nullptr;
  const int rank = group ? world.rank() : 0;
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(state.step));
  const std::string tag = options.tag.empty() ? buf : options.tag;
  check_tag(tag);
  const std::string tmp = join_path(dir, "." + tag + ".tmp");

  together(group, "preparing the checkpoint folder", [&] {
    if (rank != 0) return;
    std::string problem;
    if (!options.overwrite && util::exists(join_path(dir, tag)) && existing(dir, tag, &problem) == Existing::Valid)
      TORCH_CHECK(false, refuse_existing(dir, tag));
    scratch_folder(dir, tag);
  });  // together() has synchronized the ranks: the folder exists for all of them

  // Who writes what: see write_part().
  auto owner = parallel::ParallelModel::of(*state.model);
  const parallel::Pipeline* pipe = owner ? owner->pipeline().get() : nullptr;
  const dist::Mesh* mesh = pipe ? owner->mesh().get() : state.mesh;  // a pipeline's stages are its mesh's
  dist::Coord coord = mesh ? mesh->coord() : dist::Coord{0, rank, 0};
  std::string mine;
  together(group, "writing the checkpoint's data",
           [&] { mine = write_part(state, options, tmp, rank, pipe, coord); });
  crash_point("data");
  auto parts = dist::all_gather_strings(group, mine);

  Saved saved{tag, {}};
  together(group, "finishing the checkpoint", [&] {
    if (rank != 0) return;
    Manifest m = manifest_of(state, options, group, pipe, parts);
    validate(m, join_path(tmp, "manifest.bin"));  // what a load will demand, checked before it is written
    write_manifest(tmp, m);
    crash_point("manifest");
    commit(dir, tag, tmp, options.num_kept, options.overwrite, &saved.notes);
  });
  return saved;
}

}  // namespace partrain::ckpt
