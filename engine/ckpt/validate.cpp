// Checking a checkpoint: that a manifest's claims hold together before anything is read from it,
// and that a tag's or a folder's files are whole (every byte against its checksum).
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/internal.hpp"
#include "engine/util/files.hpp"

namespace partrain::ckpt {

using namespace internal;

namespace {

// The slots each optimizer kind stores per parameter.
const std::map<std::string, std::set<std::string>>& optimizer_slots() {
  static const std::map<std::string, std::set<std::string>> slots = {
      {"sgd", {"momentum_buffer"}}, {"adam", {"exp_avg", "exp_avg_sq"}}, {"adamw", {"exp_avg", "exp_avg_sq"}}};
  return slots;
}
// A low-precision parameter's float32 master copy: a slot of any optimizer, saved when it has one.
const char kMasterSlot[] = "master";

bool printable(const std::string& s, size_t max_length) {
  if (s.size() > max_length) return false;
  for (unsigned char c : s)
    if (c < 0x20 || c == 0x7f) return false;
  return true;
}

// Whether two boxes share an element.
bool overlap(const Piece& a, const Piece& b) {
  for (size_t d = 0; d < a.start.size(); ++d) {
    int64_t lo = std::max(a.start[d], b.start[d]), hi = std::min(a.start[d] + a.size[d], b.start[d] + b.size[d]);
    if (hi <= lo) return false;
  }
  return true;
}

// Refuses the manifest at `path`, saying what is wrong with it.
struct Bad {
  const std::string& path;
  void operator()(const std::string& what) const { TORCH_CHECK(false, "the checkpoint manifest '", path, "' ", what); }
};

// The run that saved it: its step, its layout, its names, its optimizer's counts and loss
// scaler, the user's table.
void check_run(const Manifest& m, const Bad& bad) {
  if (m.step < 0 || m.step > kMaxCount) bad("has step " + std::to_string(m.step));
  auto size = [](int32_t n) { return n >= 1 && n <= kMaxWorld; };
  if (!size(m.world) || !size(m.tensor) || !size(m.data) || !size(m.pipeline) || !size(m.zero) ||
      int64_t(m.tensor) * m.data * m.pipeline != m.world || m.data % m.zero != 0)
    bad("has an impossible layout (world " + std::to_string(m.world) + ", tensor " + std::to_string(m.tensor) +
        ", data " + std::to_string(m.data) + ", pipeline " + std::to_string(m.pipeline) + ", zero " +
        std::to_string(m.zero) + ")");
  if (!printable(m.model_type, 256) || !printable(m.policy, 256)) bad("has a model type or policy name that is not a name");
  if (!m.optimizer.empty() && !optimizer_slots().count(m.optimizer))
    bad("names an unknown optimizer '" + (printable(m.optimizer, 64) ? m.optimizer : "?") + "'");
  if (m.optimizer_steps < 0 || m.optimizer_steps > kMaxCount || (m.optimizer.empty() && m.optimizer_steps != 0))
    bad("has optimizer step count " + std::to_string(m.optimizer_steps));
  if (m.samples_seen < -1 || m.samples_seen > kMaxCount) bad("has data position " + std::to_string(m.samples_seen));
  if (!m.loss_scale.empty()) {
    const auto& ls = m.loss_scale;
    auto count = [](double v) { return std::isfinite(v) && v >= 0 && v <= double(kMaxCount) && v == std::floor(v); };
    if (m.optimizer.empty() || ls.size() != 4 || !std::isfinite(ls[0]) || ls[0] <= 0 || !count(ls[1]) ||
        !count(ls[2]) || ls[2] < 1 || !count(ls[3]))
      bad("has a loss scaler state that is not (scale > 0, good steps, hysteresis >= 1, skipped steps)");
  }
  try {
    if (json_depth(m.user_json) > kMaxJsonDepth) throw std::invalid_argument("too deep");
    auto user = nlohmann::json::parse(m.user_json);
    (void)user;
  } catch (const std::exception&) {
    bad("has a user table that is not JSON (nested at most " + std::to_string(kMaxJsonDepth) + " deep)");
  }
}

// The pipeline layout: for information only, but shaped as a pipeline of this size has it.
void check_stages(const Manifest& m, const Bad& bad) {
  const auto& st = m.stages;
  auto names_ok = [](const std::vector<std::string>& list) {
    if (list.size() > 64) return false;
    for (const auto& n : list)
      if (n.empty() || !printable(n, 256)) return false;
    return true;
  };
  if (!printable(st.schedule, 256) || !printable(st.blocks, 256) || !names_ok(st.first) || !names_ok(st.last))
    bad("has a pipeline layout whose schedule or module names are not names");
  if (st.chunks < 1 || st.chunks > 64)
    bad("has a pipeline layout of " + std::to_string(st.chunks) + " chunks a rank (expected 1 to 64)");
  if (m.pipeline == 1 || st.bounds.empty()) {
    if (!st.bounds.empty() || st.chunks != 1 || !st.blocks.empty() || !st.schedule.empty() || !st.first.empty() ||
        !st.last.empty() || (m.pipeline > 1 && m.version >= 4))
      bad("has a pipeline layout (" + std::to_string(st.bounds.size()) + " stage bounds, " +
          std::to_string(st.chunks) + " chunks) that does not fit pipeline " + std::to_string(m.pipeline));
  } else {
    bool ok = st.bounds.size() == static_cast<size_t>(m.pipeline) * st.chunks + 1 && st.bounds.front() == 0 &&
              !st.blocks.empty();
    for (size_t i = 1; ok && i < st.bounds.size(); ++i)
      ok = st.bounds[i] > st.bounds[i - 1] && st.bounds[i] <= kMaxWorld;
    if (!ok)
      bad("has pipeline stage bounds " + (st.bounds.size() <= 64 ? shape_text(st.bounds) : std::string("(too many)")) +
          " that are not " + std::to_string(m.pipeline) + " x " + std::to_string(st.chunks) +
          " stages of at least one block each, from block 0, in the blocks of a named container");
  }
}

// The generator states (at most one a rank) and the model's configuration settings.
void check_rng_and_config(const Manifest& m, const Bad& bad) {
  if (m.rng.size() > static_cast<size_t>(m.world)) bad("has more generator states than ranks");
  for (const auto& r : m.rng)
    if (r.size() > (1u << 20)) bad("has a generator state of " + std::to_string(r.size()) + " bytes");
  if (m.cuda_rng.size() > static_cast<size_t>(m.world)) bad("has more CUDA generator states than ranks");
  for (const auto& r : m.cuda_rng)
    if (r.size() > (1u << 20)) bad("has a CUDA generator state of " + std::to_string(r.size()) + " bytes");
  std::set<std::string> settings;
  if (m.config.size() > 256)
    bad("has " + std::to_string(m.config.size()) + " model configuration settings (at most 256)");
  for (const auto& c : m.config)
    if (c.name.empty() || !printable(c.name, 64) || !settings.insert(c.name).second || !std::isfinite(c.value) ||
        !printable(c.text, 64))
      bad("has a model configuration setting that is not a name, once, with a finite value or a printable text");
}

// The data files: plain names, each once, of a bounded size.
void check_files(const Manifest& m, const Bad& bad) {
  std::set<std::string> file_names;
  for (const auto& f : m.files) {
    if (!util::safe_name(f.name) || f.name == "manifest.bin" || f.name == "summary.txt")
      bad("names a data file '" + (printable(f.name, 256) ? f.name : "?") + "' that is not a plain file name");
    if (!file_names.insert(f.name).second) bad("lists the data file '" + f.name + "' twice");
    if (f.bytes > kMaxFileBytes) bad("says '" + f.name + "' has " + std::to_string(f.bytes) + " bytes");
  }
}

// Pieces that do not overlap: with the volumes adding up (checked before), an exact tiling.
// Pieces cut along one dimension (how partrain writes them) are checked in order; others
// pairwise, and not too many of them.
void check_tiling(const TensorEntry& e, const Bad& bad) {
  auto fail = [&](const std::string& what) { bad("has tensor '" + e.name + "' " + what); };
  std::vector<const Piece*> ps;
  for (const auto& p : e.pieces)
    if (p.bytes > 0) ps.push_back(&p);
  int along = -1;
  bool one_dim = true;
  for (size_t d = 0; d < e.shape.size() && one_dim; ++d)
    for (const auto* p : ps)
      if (p->size[d] != e.shape[d]) {
        if (along >= 0 && along != static_cast<int>(d)) one_dim = false;
        along = static_cast<int>(d);
      }
  if (one_dim && along >= 0) {
    std::sort(ps.begin(), ps.end(), [&](const Piece* a, const Piece* b) { return a->start[along] < b->start[along]; });
    for (size_t i = 0; i + 1 < ps.size(); ++i)
      if (ps[i]->start[along] + ps[i]->size[along] > ps[i + 1]->start[along]) fail("with overlapping pieces");
  } else if (ps.size() > 4096) {
    fail("with " + std::to_string(ps.size()) + " pieces cut along several dimensions (at most 4096)");
  } else {
    for (size_t i = 0; i < ps.size(); ++i)
      for (size_t j = i + 1; j < ps.size(); ++j)
        if (overlap(*ps[i], *ps[j])) fail("with overlapping pieces");
  }
}

// One tensor: its dtype, its shape and split, its pieces inside it, of its dtype's size, in the
// bytes of listed files (added to `by_file`), tiling it exactly.
void check_tensor(const Manifest& m, const TensorEntry& e, const Bad& bad,
                  std::vector<std::vector<const Piece*>>& by_file) {
  auto fail = [&](const std::string& what) { bad("has tensor '" + e.name + "' " + what); };
  auto type = dtypes().find(e.dtype);
  if (type == dtypes().end()) fail("of unknown dtype '" + (printable(e.dtype, 32) ? e.dtype : "?") + "'");
  const int64_t item = static_cast<int64_t>(c10::elementSize(type->second));
  if (e.shape.size() > static_cast<size_t>(kMaxRank)) fail("with " + std::to_string(e.shape.size()) + " dimensions");
  const int64_t total = volume(e.shape);
  if (total < 0) fail("of shape " + shape_text(e.shape) + " (negative or too large)");
  bool parts_fit = e.parts.size() <= 4096 && (e.parts.empty() || e.dim >= 0);
  int64_t parts_total = 0;
  for (int64_t n : e.parts) {
    parts_fit = parts_fit && n >= 1 && n <= (int64_t(1) << 40);
    if (parts_fit) parts_total += n;
  }
  if (e.dim < -1 || e.dim >= static_cast<int32_t>(e.shape.size()) || !parts_fit ||
      (!e.parts.empty() && parts_total != e.shape[e.dim]))
    fail("split on dimension " + std::to_string(e.dim) + " in parts " + shape_text(e.parts) + ", which its shape " +
         shape_text(e.shape) + " does not allow");
  int64_t covered = 0;
  for (const auto& p : e.pieces) {
    if (p.file < 0 || p.file >= static_cast<int32_t>(m.files.size())) fail("with a piece in an unlisted data file");
    if (p.start.size() != e.shape.size() || p.size.size() != e.shape.size()) fail("with a piece of the wrong rank");
    for (size_t d = 0; d < e.shape.size(); ++d)
      if (p.size[d] < 0 || p.size[d] > e.shape[d] || p.start[d] < 0 || p.start[d] > e.shape[d] - p.size[d])
        fail("with a piece outside its shape " + shape_text(e.shape) + " (at " + shape_text(p.start) + ", size " +
             shape_text(p.size) + ")");
    const int64_t n = volume(p.size);
    if (p.bytes != static_cast<uint64_t>(n * item))
      fail("with a piece of " + std::to_string(p.bytes) + " bytes where its box holds " + std::to_string(n * item));
    const auto& f = m.files[p.file];
    if (p.offset > f.bytes || p.bytes > f.bytes - p.offset)
      fail("with a piece at bytes " + std::to_string(p.offset) + "+" + std::to_string(p.bytes) + " outside '" +
           f.name + "' (" + std::to_string(f.bytes) + " bytes)");
    if (p.bytes == 0 && p.crc32 != 0) fail("with an empty piece that has a checksum");
    covered += n;
    if (covered > total) break;
    by_file[p.file].push_back(&p);
  }
  if (covered != total)
    fail("whose pieces cover " + std::to_string(covered) + " of its " + std::to_string(total) + " elements");
  check_tiling(e, bad);
}

// Each tensor: a name under model/ or optim/, once, and its contents (check_tensor).
void check_tensors(const Manifest& m, const Bad& bad, std::vector<std::vector<const Piece*>>& by_file) {
  std::set<std::string> names;
  for (const auto& e : m.tensors) {
    if (!printable(e.name, 1024) || (e.name.rfind("model/", 0) != 0 && e.name.rfind("optim/", 0) != 0) ||
        e.name.size() < 7)
      bad("has a tensor name that is not 'model/...' or 'optim/...'");
    if (!names.insert(e.name).second) bad("lists tensor '" + e.name + "' twice");
    check_tensor(m, e, bad, by_file);
  }
}

// Optimizer state: known slots of the saved optimizer, shaped as their parameter, all of them;
// and step counts of parameters with state, within the optimizer's, each named once.
void check_optimizer_state(const Manifest& m, const Bad& bad) {
  std::map<std::string, std::set<std::string>> slots_of;
  for (const auto& e : m.tensors) {
    if (e.name.rfind("optim/", 0) != 0) continue;
    auto slash = e.name.find_last_of('/');
    std::string param = e.name.substr(6, slash - 6), slot = e.name.substr(slash + 1);
    const TensorEntry* owner = slash > 6 ? m.find("model/" + param) : nullptr;
    if (!owner) bad("has optimizer state '" + e.name + "' for no tensor of the model");
    if (m.optimizer.empty() || (!optimizer_slots().at(m.optimizer).count(slot) && slot != kMasterSlot))
      bad("has optimizer state '" + e.name + "' that " + (m.optimizer.empty() ? "no" : m.optimizer) +
          " optimizer keeps");
    if (owner->shape != e.shape) bad("has optimizer state '" + e.name + "' of shape " + shape_text(e.shape) +
                                     " for a tensor of shape " + shape_text(owner->shape));
    if (slot != kMasterSlot) slots_of[param].insert(slot);  // a master alone (before the first step) is whole
  }
  for (const auto& [param, slots] : slots_of)
    if (slots != optimizer_slots().at(m.optimizer))
      bad("has only part of the " + m.optimizer + " state of '" + param + "'");
  std::set<std::string> counted;
  for (const auto& p : m.param_steps) {
    const std::string name = printable(p.name, 1024) ? "'" + p.name + "'" : "a parameter";
    if (!slots_of.count(p.name) || !counted.insert(p.name).second)
      bad("has a step count for " + name + ", which has no optimizer state or another count");
    if (m.optimizer == "sgd" || p.steps < 0 || p.steps > m.optimizer_steps)
      bad("has step count " + std::to_string(p.steps) + " for " + name + " of an optimizer (" + m.optimizer +
          ") after " + std::to_string(m.optimizer_steps) + " step(s)");
  }
}

// Each data file: its pieces (`by_file`) tile it exactly, and its CRC-32 is theirs combined.
void check_data_files(const Manifest& m, const Bad& bad, std::vector<std::vector<const Piece*>>& by_file) {
  for (size_t i = 0; i < m.files.size(); ++i) {
    auto& ps = by_file[i];
    std::sort(ps.begin(), ps.end(), [](const Piece* a, const Piece* b) { return a->offset < b->offset; });
    uint64_t at = 0;
    uLong crc = ::crc32(0L, Z_NULL, 0);
    for (const auto* p : ps) {
      if (p->bytes == 0) continue;
      if (p->offset != at)
        bad("has pieces that " + std::string(p->offset < at ? "overlap" : "leave a gap") + " at byte " +
            std::to_string(std::min(at, p->offset)) + " of '" + m.files[i].name + "'");
      crc = ::crc32_combine(crc, p->crc32, static_cast<z_off_t>(p->bytes));
      at += p->bytes;
    }
    if (at != m.files[i].bytes)
      bad("has pieces covering " + std::to_string(at) + " of the " + std::to_string(m.files[i].bytes) + " bytes of '" +
          m.files[i].name + "'");
    if (static_cast<uint32_t>(crc) != m.files[i].crc32)
      bad("has a checksum for '" + m.files[i].name + "' that is not its pieces' combined");
  }
}

}  // namespace

void validate(const Manifest& m, const std::string& path) {
  const Bad bad{path};
  check_run(m, bad);
  check_stages(m, bad);
  check_rng_and_config(m, bad);
  check_files(m, bad);
  std::vector<std::vector<const Piece*>> by_file(m.files.size());
  check_tensors(m, bad, by_file);
  check_optimizer_state(m, bad);
  check_data_files(m, bad, by_file);
}

std::vector<std::string> verify(const std::string& tag_dir) {
  std::vector<std::string> problems;
  struct stat st;
  if (::lstat(tag_dir.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {  // as a load refuses it
    problems.push_back("'" + tag_dir + "' is a symbolic link; a checkpoint tag must be a real folder");
    return problems;
  }
  Manifest m;
  try {
    m = read_manifest(tag_dir);
  } catch (const std::exception& e) {
    problems.push_back(util::message_of(e));
    return problems;
  }
  // Each data file read once, front to back: the pieces tile it (validate() made sure), so each
  // piece's CRC-32 and the file's come from the same pass.
  std::vector<std::vector<std::pair<const TensorEntry*, const Piece*>>> by_file(m.files.size());
  for (const auto& e : m.tensors)
    for (const auto& p : e.pieces)
      if (p.bytes > 0) by_file[p.file].emplace_back(&e, &p);
  std::vector<char> buf;
  for (size_t i = 0; i < m.files.size(); ++i) {
    const auto& f = m.files[i];
    std::string path = join_path(tag_dir, f.name);
    int fd = -1;
    try {
      fd = open_data_file(tag_dir, f);
    } catch (const std::exception& e) {
      problems.push_back(util::message_of(e));
      continue;
    }
    auto& ps = by_file[i];
    std::sort(ps.begin(), ps.end(), [](const auto& a, const auto& b) { return a.second->offset < b.second->offset; });
    uLong file_crc = ::crc32(0L, Z_NULL, 0);
    bool truncated = false;
    for (const auto& [e, p] : ps) {
      uLong crc = ::crc32(0L, Z_NULL, 0);
      for (uint64_t done = 0; done < p->bytes && !truncated;) {
        uint64_t n = std::min<uint64_t>(p->bytes - done, 1 << 20);
        buf.resize(n);
        truncated = !util::read_at(fd, buf.data(), n, p->offset + done);
        if (!truncated) crc = ::crc32(crc, reinterpret_cast<const Bytef*>(buf.data()), static_cast<uInt>(n));
        done += n;
      }
      if (truncated) {
        problems.push_back("data file '" + path + "' is truncated: tensor '" + e->name + "' needs bytes " +
                           std::to_string(p->offset) + ".." + std::to_string(p->offset + p->bytes));
        break;
      }
      if (static_cast<uint32_t>(crc) != p->crc32)
        problems.push_back("data file '" + path + "' fails its checksum in tensor '" + e->name + "' (bytes " +
                           std::to_string(p->offset) + ".." + std::to_string(p->offset + p->bytes) +
                           " were altered)");
      file_crc = ::crc32_combine(file_crc, crc, static_cast<z_off_t>(p->bytes));
    }
    ::close(fd);
    if (!truncated && static_cast<uint32_t>(file_crc) != f.crc32 &&
        std::none_of(problems.begin(), problems.end(), [&](const std::string& s) { return s.find(path) != std::string::npos; }))
      problems.push_back("data file '" + path + "' fails its checksum (its bytes were altered)");
  }
  return problems;
}

std::vector<Finding> verify_folder(const std::string& dir) {
  std::vector<Finding> out;
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    out.push_back({dir, ::stat(dir.c_str(), &st) != 0 ? "no such folder" : "not a folder", true});
    return out;
  }
  Folder f = scan(dir);
  Choice c = choose_in(f, dir);
  if (!c.found) {
    out.push_back({dir, "no checkpoint (no 'newest' file and no tag folders)", true});
    return out;
  }
  std::vector<const TagState*> ordered;
  for (const auto& t : f.tags) ordered.push_back(&t);
  std::sort(ordered.begin(), ordered.end(), [](const TagState* a, const TagState* b) {
    return a->valid != b->valid ? a->valid : a->step != b->step ? a->step < b->step : a->name < b->name;
  });
  for (const auto* t : ordered) {
    std::string path = join_path(dir, t->name);
    if (!t->valid) {
      out.push_back({path, t->problem, true});
      continue;
    }
    auto problems = verify(path);
    if (problems.empty()) out.push_back({path, "ok (step " + std::to_string(t->step) + ")", false});
    for (const auto& p : problems) out.push_back({path, p, true});
  }
  const std::string newest_path = join_path(dir, "newest");
  if (!f.newest.present) {
    out.push_back({newest_path, "missing (a resume takes the valid tag with the highest step)", true});
  } else if (!f.newest.problem.empty()) {
    out.push_back({newest_path, f.newest.problem, true});
  } else {
    auto it = std::find_if(f.tags.begin(), f.tags.end(), [&](const TagState& t) { return t.name == f.newest.tag; });
    if (it == f.tags.end()) out.push_back({newest_path, "names '" + f.newest.tag + "', which is not a checkpoint here", true});
    else if (!it->valid) out.push_back({newest_path, "names '" + f.newest.tag + "', which is damaged", true});
    else if (!c.tags.empty() && c.tags.front() != f.newest.tag)
      out.push_back({newest_path, "names '" + f.newest.tag + "'; '" + c.tags.front() +
                                      "' is newer (a save stopped before it updated 'newest'): a resume takes it",
                     false});
    else out.push_back({newest_path, "names '" + f.newest.tag + "'", false});
  }
  for (const auto& a : f.aside)
    out.push_back({join_path(dir, a), "set aside by a save that found it damaged (kept for inspection; not a tag)", false});
  for (const auto& s : f.scratch)
    out.push_back({join_path(dir, s), "an interrupted save's scratch folder (ignored; the next save of its tag removes it)",
                   false});
  return out;
}

}  // namespace partrain::ckpt
