// Loading a checkpoint, resharded to the model's layout: reading tensors whole or in part, and a
// load in two collective steps (read and check everything, then apply), past damaged tags.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <sstream>

#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/internal.hpp"
#include "engine/compat.hpp"
#include "engine/data/data.hpp"
#include "engine/nn/module.hpp"
#include "engine/optim/optim.hpp"
#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/util/files.hpp"

namespace partrain::ckpt {

int internal::open_data_file(const std::string& tag_dir, const FileEntry& f) {
  std::string path = join_path(tag_dir, f.name);
  TORCH_CHECK(util::exists(path), "data file '", path, "' is missing");
  int fd = util::open_regular(path, "data file", util::Links::Refuse);
  struct stat st;
  ::fstat(fd, &st);
  if (static_cast<uint64_t>(st.st_size) != f.bytes) {
    ::close(fd);
    TORCH_CHECK(false, "data file '", path, "' has ", st.st_size, " bytes; the manifest says ", f.bytes,
                " (truncated or overwritten)");
  }
  return fd;
}

using namespace internal;

namespace {

// One piece's bytes, read from its open data file and checked against its CRC-32.
torch::Tensor read_piece(const std::string& tag_dir, const Manifest& m, const TensorEntry& e, const Piece& p) {
  const auto& f = m.files[p.file];
  std::string path = join_path(tag_dir, f.name);
  auto piece = torch::empty(p.size, torch::TensorOptions().dtype(parse_dtype(e.dtype)));
  TORCH_CHECK(p.bytes == piece.nbytes(), "tensor '", e.name, "': its piece in '", path, "' has the wrong size");
  int fd = open_data_file(tag_dir, f);
  char* out = static_cast<char*>(piece.data_ptr());
  bool whole = util::read_at(fd, out, p.bytes, p.offset);
  ::close(fd);
  TORCH_CHECK(whole, "data file '", path, "' is truncated: tensor '", e.name, "' needs bytes ", p.offset, "..",
              p.offset + p.bytes);
  TORCH_CHECK(crc_of(out, p.bytes) == p.crc32, "data file '", path, "' fails its checksum in tensor '", e.name,
              "' (bytes ", p.offset, "..", p.offset + p.bytes, " were altered)");
  return piece;
}

}  // namespace

torch::Tensor read_tensor(const std::string& tag_dir, const Manifest& m, const TensorEntry& e) {
  auto full = torch::empty(e.shape, torch::TensorOptions().dtype(parse_dtype(e.dtype)));
  for (const auto& p : e.pieces) {
    auto piece = read_piece(tag_dir, m, e, p);
    auto target = full;
    for (size_t d = 0; d < e.shape.size(); ++d) target = target.narrow(d, p.start[d], p.size[d]);
    target.copy_(piece);
  }
  return full;
}

torch::Tensor read_part(const std::string& tag_dir, const Manifest& m, const TensorEntry& e,
                        const std::vector<int64_t>& local_shape, int64_t dim,
                        const std::vector<std::pair<int64_t, int64_t>>& slices) {
  auto local = torch::zeros(local_shape, torch::TensorOptions().dtype(parse_dtype(e.dtype)));
  // Only pieces cut along `dim` (whole in every other dimension) are read in part; if any other
  // piece is there, the tensor is read whole and cut here.
  bool along = true;
  for (const auto& p : e.pieces)
    for (size_t d = 0; d < e.shape.size(); ++d)
      if (static_cast<int64_t>(d) != dim) along = along && p.start[d] == 0 && p.size[d] == e.shape[d];
  if (!along) {
    auto full = read_tensor(tag_dir, m, e);
    int64_t offset = 0;
    for (const auto& [start, length] : slices) {
      local.narrow(dim, offset, length).copy_(full.narrow(dim, start, length));
      offset += length;
    }
    return local;
  }
  for (const auto& p : e.pieces) {
    int64_t offset = 0;
    torch::Tensor piece;
    for (const auto& [start, length] : slices) {
      int64_t lo = std::max(start, p.start[dim]), hi = std::min(start + length, p.start[dim] + p.size[dim]);
      if (hi > lo) {
        if (!piece.defined()) piece = read_piece(tag_dir, m, e, p);
        local.narrow(dim, offset + lo - start, hi - lo).copy_(piece.narrow(dim, lo - p.start[dim], hi - lo));
      }
      offset += length;
    }
  }
  return local;
}

namespace {

torch::Tensor bytes_tensor(const std::string& bytes) {
  auto t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  if (!bytes.empty()) std::memcpy(t.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  return t;
}

// The logical names of every parameter of the model, on every rank: this rank's own, and under a
// pipeline every stage's (gathered over the world), so that a tensor of the checkpoint no stage
// holds is refused. Collective when the model is pipelined.
std::set<std::string> model_names(const State& state, const dist::GroupPtr& group) {
  std::set<std::string> names;
  for (const auto& h : held(*state.model)) names.insert(h.logical);
  auto owner = parallel::ParallelModel::of(*state.model);
  if (!owner || !owner->pipeline() || !group) return names;
  std::string mine;
  for (const auto& n : names) mine += n + "\n";
  for (const auto& all : dist::all_gather_strings(group, mine)) {
    std::istringstream lines(all);
    for (std::string n; std::getline(lines, n);) names.insert(n);
  }
  return names;
}

// What the first step of a load reads and the second applies: the manifest, this rank's
// parameters, and their values and optimizer state.
struct Reading {
  Manifest m;
  std::vector<Held> params;
  std::vector<torch::Tensor> values;
  std::vector<std::map<std::string, torch::Tensor>> slots;
  std::vector<int64_t> steps;  // each parameter's state's step count; -1: the optimizer's
  bool with_optimizer = false;
};

// Refuses a checkpoint saved with settings of the model that change what it computes and no
// shape (GPT-2's heads): a model is loaded with those it was saved with, where the checkpoint
// records them (format 7 on).
void check_settings(const Manifest& m, const nn::Module& model, const std::string& tag_dir) {
  if (m.model_type != model.type()) return;
  for (const auto& f : model.config()) {
    auto saved =
        std::find_if(m.config.begin(), m.config.end(), [&](const ConfigEntry& c) { return c.name == f.name; });
    if (!f.fixed || saved == m.config.end() || (saved->text == f.text && saved->value == f.value)) continue;
    const std::string was = setting_text(saved->value, saved->text);
    TORCH_CHECK(false, "the checkpoint '", tag_dir, "' was saved by ", with_article(m.model_type), " with ", f.name,
                "=", was, "; this one has ", f.name, "=", setting_text(f.value, f.text),
                ", which computes another function with the same shapes: build it with ", f.name, "=", was);
  }
}

// Refuses a checkpoint that does not fit what is being loaded: a tensor the model has no
// parameter for, another optimizer, other settings, a parameter missing or of another shape, a
// data position the loader cannot seek. Notes a data position that lands elsewhere.
void check_fits(const Reading& r, const State& state, const std::set<std::string>& every_name,
                const std::string& tag_dir, std::vector<std::string>* notes) {
  const Manifest& m = r.m;
  for (const auto& e : m.tensors)
    TORCH_CHECK(e.name.rfind("model/", 0) != 0 || every_name.count(e.name.substr(6)), "the checkpoint '", tag_dir,
                "' holds tensor '", e.name.substr(6), "', which the model has no parameter for");
  if (r.with_optimizer)
    TORCH_CHECK(m.optimizer == state.optimizer->options().kind, "the checkpoint '", tag_dir, "' holds ",
                m.optimizer, " state; the optimizer given is ", state.optimizer->options().kind);
  check_settings(m, *state.model, tag_dir);
  for (const auto& [name, local, p, first] : r.params) {
    auto s = parallel::sharding_of(*state.model, local);
    const TensorEntry* e = m.find("model/" + name);
    TORCH_CHECK(e, "the checkpoint '", tag_dir, "' has no tensor '", name, "' (a parameter of the model)");
    auto logical = s ? s->shape : p.sizes().vec();
    TORCH_CHECK(e->shape == logical, "tensor '", name, "' in '", tag_dir, "' has shape ", c10::IntArrayRef(e->shape),
                "; the model's is ", c10::IntArrayRef(logical));
  }
  // What Loader::seek() refuses, checked here: nothing below can refuse.
  TORCH_CHECK(!state.data || m.samples_seen < 0 || state.data->batches_per_epoch() > 0, "the checkpoint '", tag_dir,
              "' holds a data position (", m.samples_seen, " samples), but the data loader given has no batch to ",
              "seek in (an empty dataset, or fewer samples than a batch with drop_last)");
  if (state.data && m.samples_seen >= 0) {
    const int64_t lands = state.data->seek_lands_at(m.samples_seen);
    if (lands != m.samples_seen)
      notes->push_back("the data position, " + std::to_string(m.samples_seen) + " samples, is not a whole " +
                       "number of this loader's batches of " + std::to_string(state.data->options().batch) +
                       " into its epoch (another batch size saved it): the data resumes at " +
                       std::to_string(lands) + ", and " + std::to_string(m.samples_seen - lands) +
                       " samples are seen again");
  }
}

// Reads this rank's parameters' values and optimizer state (the checkpoint's damage as Damaged).
void read_values(Reading& r, const State& state, const std::string& tag_dir) {
  const Manifest& m = r.m;
  const auto& params = r.params;
  const bool with_optimizer = r.with_optimizer;
  auto& values = r.values;
  auto& slots = r.slots;
  auto& steps = r.steps;
  torch::NoGradGuard no_grad;
  values.resize(params.size());
  slots.resize(params.size());
  steps.assign(params.size(), -1);
  if (with_optimizer) {
    std::map<std::string, int64_t> counted;
    for (const auto& p : m.param_steps) counted[p.name] = p.steps;
    for (size_t i = 0; i < params.size(); ++i) {
      auto it = counted.find(params[i].logical);
      if (it == counted.end()) continue;
      steps[i] = it->second;
    }
  }
  as_damage([&] {
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& [name, local, p, first] = params[i];
      auto s = parallel::sharding_of(*state.model, local);
      auto read = [&](const TensorEntry& t, const torch::TensorOptions& options) {
        // Split both ways: the part of the outer split, then this rank's inner slice of it.
        auto part = s ? parallel::inner_part(read_part(tag_dir, m, t, s->outer().local_shape(), s->dim,
                                                       s->slices(s->group->rank())), *s)
                      : read_tensor(tag_dir, m, t);
        return part.to(options);
      };
      values[i] = read(*m.find("model/" + name), p.options().requires_grad(false));
      if (with_optimizer) {
        // The state in the optimizer's dtype (float32 for a low-precision parameter's), masters too.
        std::string prefix = "optim/" + name + "/";
        for (const auto& t : m.tensors)
          if (t.name.rfind(prefix, 0) == 0)
            slots[i][t.name.substr(prefix.size())] = read(t, state.optimizer->state_options(p));
      }
    }
  });
}

// Restores this rank's generators: the CPU one where its state is of this LibTorch's format, the
// CUDA one on a CUDA rank that finds one; a checkpoint and a run that disagree on CUDA load all
// the same, with a note (the CPU state still holds).
void restore_generators(const Manifest& m, int rank, std::vector<std::string>& notes) {
  if (rank < static_cast<int>(m.rng.size()) && !m.rng[rank].empty()) {
    try {
      auto generator = at::detail::getDefaultCPUGenerator();
      generator.set_state(bytes_tensor(m.rng[rank]));
    } catch (const std::exception&) {
      // another LibTorch's generator format: keep this run's state
    }
  }
  const auto& device = dist::World::instance().device();
  const bool saved_cuda = rank < static_cast<int>(m.cuda_rng.size()) && !m.cuda_rng[rank].empty();
  if (saved_cuda && device.is_cuda()) {
    try {
      compat::set_cuda_rng_state(device, bytes_tensor(m.cuda_rng[rank]));
    } catch (const std::exception& e) {
      notes.push_back("rank " + std::to_string(rank) + "'s CUDA generator state was not restored (" +
                      util::message_of(e) + "): it keeps this run's");
    }
  } else if (saved_cuda) {
    notes.push_back("the checkpoint holds CUDA generator states; this run computes on " + device.str() +
                    ": they are ignored");
  } else if (device.is_cuda()) {
    notes.push_back("the checkpoint holds no CUDA generator state (" +
                    (m.version < 6 ? "format " + std::to_string(m.version) + ", from before they were saved"
                                   : std::string("saved on the CPU")) +
                    "); " + device.str() + " keeps this run's");
  }
}

// Changes `state` to what `r` read: the data position, the optimizer's step count and loss
// scale, the parameters and their optimizer state, the generators.
void apply(const Reading& r, const std::string& tag, State& state, int rank, Loaded& loaded) {
  const Manifest& m = r.m;
  const auto& params = r.params;
  const bool with_optimizer = r.with_optimizer;
  const auto& values = r.values;
  const auto& slots = r.slots;
  const auto& steps = r.steps;
  torch::NoGradGuard no_grad;
  if (state.data && m.samples_seen >= 0) state.data->seek(m.samples_seen);
  if (with_optimizer) state.optimizer->set_steps_taken(m.optimizer_steps);
  if (with_optimizer && state.optimizer->loss_scaler() && m.loss_scale.size() == 4) {
    const auto& ls = m.loss_scale;  // a checkpoint without it leaves the scaler as it is
    state.optimizer->loss_scaler()->set_state({ls[0], int64_t(ls[1]), int64_t(ls[2]), int64_t(ls[3])});
  }
  {
    // ZeRO-3: each parameter's unit is gathered when the parameter is reached and written back
    // into this rank's shard when the next unit is (every rank of the zero group in the same
    // order): one unit gathered at a time. The optimizer takes its master from the written value.
    parallel::Fsdp::Access access(parallel::ParallelModel::fsdp_of(*state.model), /*writeback=*/true);
    for (size_t i = 0; i < params.size(); ++i) {
      access.touch(params[i].param);
      params[i].param.copy_(values[i]);
      if (with_optimizer) state.optimizer->set_param_state(params[i].param, slots[i], steps[i]);  // none: cleared
    }
  }
  restore_generators(m, rank, loaded.notes);
  loaded.tag = tag;
  loaded.step = m.step;
  loaded.user_json = m.user_json;
}

// Loads one tag in two steps, each collective: every rank reads and checks all it needs, then,
// only when every rank has, every rank changes `state`. A rank whose own reads were sound must
// not apply a checkpoint another rank refused. Damaged when the checkpoint is damaged, another
// error when it does not fit what is being loaded.
Loaded load_tag(const std::string& dir, const std::string& tag, State& state, const dist::GroupPtr& group, int rank) {
  Loaded loaded;
  const auto every_name = model_names(state, group);
  const std::string tag_dir = join_path(dir, tag);
  Reading r;
  together(group, "loading the checkpoint", [&] {
    check_tag(tag);
    TORCH_CHECK(util::exists(tag_dir), "no checkpoint '", tag, "' in '", dir, "'");
    as_damage([&] {
      TORCH_CHECK(util::is_plain_dir(tag_dir), "'", tag_dir, "' is not a folder (a symbolic link or a file); ",
                  "a checkpoint tag must be a real folder");
      r.m = read_manifest(tag_dir);
      for (const auto& f : r.m.files) ::close(open_data_file(tag_dir, f));  // sizes first: a truncated file names itself
    });
    // This rank's parameters only: on a pipeline stage, what the stage holds.
    r.params = held(*state.model);
    r.with_optimizer = state.optimizer && !r.m.optimizer.empty();
    check_fits(r, state, every_name, tag_dir, &loaded.notes);
    read_values(r, state, tag_dir);
  });
  // Every rank has read and checked all it needs (together() fails them all when one failed):
  // only now does any rank change its state. The step count before the parameters' states
  // (Adam's bias correction reads it).
  together(group, "applying the checkpoint", [&] { apply(r, tag, state, rank, loaded); });
  return loaded;
}

// A load without a tag: the tags choose() gives, in order, past damaged ones. False when DIR
// holds no checkpoint at all.
bool load_newest(const std::string& dir, State& state, Loaded* out) {
  auto& world = dist::World::instance();
  dist::GroupPtr group = world.initialized() ? world.world() : nullptr;
  const int rank = group ? world.rank() : 0;
  Choice c;
  together(group, "finding the checkpoint to load", [&] { c = choose(dir); });
  // Every rank must try the same tags (they read the same folder; a shared file system can lag).
  std::string mine;
  for (const auto& t : c.tags) mine += t + "\n";
  auto all = dist::all_gather_strings(group, mine);
  for (size_t r = 1; r < all.size(); ++r)
    TORCH_CHECK(all[r] == all[0], "the ranks see different checkpoints in '", dir, "' (rank 0 and rank ", r,
                " disagree): is it on a file system they all share?");
  if (!c.found) return false;
  std::vector<std::string> notes = c.notes;
  for (size_t i = 0; i < c.tags.size(); ++i) {
    try {
      *out = load_tag(dir, c.tags[i], state, group, rank);
      out->notes.insert(out->notes.begin(), notes.begin(), notes.end());
      return true;
    } catch (const Damaged& e) {
      notes.push_back("'" + join_path(dir, c.tags[i]) + "' cannot be loaded: " + e.what() +
                      (i + 1 < c.tags.size() ? "; falling back to '" + c.tags[i + 1] + "'" : ""));
    }
  }
  std::string why;
  for (const auto& n : notes) why += "\n  " + n;
  TORCH_CHECK(false, "no valid checkpoint in '", dir, "':", why);
}

}  // namespace

Loaded load(const std::string& dir, const std::string& tag, State& state) {
  TORCH_CHECK(state.model, "checkpoint load: no model given");
  if (!tag.empty()) {
    auto& world = dist::World::instance();
    dist::GroupPtr group = world.initialized() ? world.world() : nullptr;
    return load_tag(dir, tag, state, group, group ? world.rank() : 0);
  }
  Loaded loaded;
  TORCH_CHECK(load_newest(dir, state, &loaded), "no checkpoint in '", dir, "' (no 'newest' file and no tag folders)");
  return loaded;
}

bool resume(const std::string& dir, State& state, Loaded* loaded) {
  TORCH_CHECK(state.model, "checkpoint resume: no model given");
  return load_newest(dir, state, loaded);
}

}  // namespace partrain::ckpt
