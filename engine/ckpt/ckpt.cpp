// Sharded checkpoints: saving, loading with resharding, choosing the tag to resume from, and
// verifying. See ckpt.hpp; converting is in convert.cpp, safetensors in safetensors.cpp.
#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/internal.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <csignal>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <set>
#include <sstream>

#include <cereal/archives/binary.hpp>
#include <cereal/types/string.hpp>
#include <cereal/types/vector.hpp>
#include <nlohmann/json.hpp>

#include "engine/compat.hpp"
#include "engine/data/data.hpp"
#include "engine/dist/mesh.hpp"
#include "engine/nn/module.hpp"
#include "engine/optim/optim.hpp"
#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/util/bounded_archive.hpp"
#include "engine/util/files.hpp"
#include "engine/util/text.hpp"

namespace partrain::ckpt {

template <class Archive>
void serialize(Archive& ar, Piece& p) {
  ar(p.file, p.offset, p.bytes, p.start, p.size, p.crc32);
}
// The format version a manifest being read was written in: format 2 stored a count of equal
// parts where format 3 stores their sizes. Set only around reading one manifest (manifest()).
thread_local uint32_t reading_format = kFormatVersion;

template <class Archive>
void serialize(Archive& ar, TensorEntry& e) {
  ar(e.name, e.dtype, e.shape, e.dim);
  if (Archive::is_loading::value && reading_format == 2) {
    int64_t fused = 1;
    ar(fused);
    e.parts.clear();
    // Equal parts of the split dimension; validate() refuses a count that does not divide it.
    if (e.dim >= 0 && static_cast<size_t>(e.dim) < e.shape.size() && fused > 1 && fused <= 4096 &&
        e.shape[e.dim] % fused == 0)
      e.parts.assign(static_cast<size_t>(fused), e.shape[e.dim] / fused);
    else if (fused != 1)
      e.parts.assign(1, 0);  // no such part: refused by validate(), naming the tensor
  } else {
    ar(e.parts);
  }
  ar(e.pieces);
}
template <class Archive>
void serialize(Archive& ar, FileEntry& f) {
  ar(f.name, f.bytes, f.crc32);
}
template <class Archive>
void serialize(Archive& ar, PipelineLayout& p) {
  ar(p.schedule, p.chunks, p.blocks, p.first, p.last, p.bounds);
}
template <class Archive>
void serialize(Archive& ar, ConfigEntry& c) {
  ar(c.name, c.value);
  if (!Archive::is_loading::value || reading_format >= 9) ar(c.text);
}
template <class Archive>
void serialize(Archive& ar, ParamSteps& p) {
  ar(p.name, p.steps);
}
template <class Archive>
void serialize(Archive& ar, Manifest& m) {
  ar(m.step, m.world, m.tensor, m.data, m.pipeline, m.zero, m.model_type, m.policy, m.optimizer, m.optimizer_steps,
     m.samples_seen, m.user_json, m.full, m.tensors, m.files, m.rng);
  if (!Archive::is_loading::value || reading_format >= 4) ar(m.stages);
  if (!Archive::is_loading::value || reading_format >= 5) ar(m.loss_scale);
  if (!Archive::is_loading::value || reading_format >= 6) ar(m.cuda_rng);
  if (!Archive::is_loading::value || reading_format >= 7) ar(m.config);
  if (!Archive::is_loading::value || reading_format >= 8) ar(m.param_steps);
}

const TensorEntry* Manifest::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

namespace internal {

// ---- Damage, and failing together -----------------------------------------------------------

// A checkpoint that is damaged (as opposed to one that does not fit the model being loaded):
// a load without a tag falls back past it.
struct Damaged : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Runs `fn`, turning any error it raises into Damaged.
template <class Fn>
void as_damage(Fn&& fn) {
  try {
    fn();
  } catch (const Damaged&) {
    throw;
  } catch (const std::exception& e) {
    throw Damaged(util::message_of(e));
  }
}

// Runs `fn` on every rank and fails on all of them if it failed on any: a rank that failed
// reports its own error, the others the first failing rank's. Damage stays damage when every
// failing rank saw damage.
void together(const dist::GroupPtr& group, const std::string& what, const std::function<void()>& fn) {
  std::string error;
  bool damaged = false;
  try {
    fn();
  } catch (const Damaged& e) {
    error = e.what();
    damaged = true;
  } catch (const std::exception& e) {
    error = util::message_of(e);
  }
  if (!dist::any_rank(group, !error.empty())) return;
  auto all = dist::all_gather_strings(group, error.empty() ? std::string() : (damaged ? "D" : "E") + error);
  bool all_damage = true;
  std::string first;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    all_damage = all_damage && all[r][0] == 'D';
    if (first.empty()) first = what + " failed on rank " + std::to_string(r) + ": " + all[r].substr(1);
  }
  std::string message = error.empty() ? first : error;
  if (all_damage) throw Damaged(message);
  TORCH_CHECK(false, message);
}

// ---- Files ---------------------------------------------------------------------------------

const char kMagic[] = "partrain-checkpoint";
constexpr size_t kMagicLength = sizeof kMagic - 1;
// The manifest file: u64 magic length, magic, u32 version, u64 payload length, u32 CRC-32 of
// the payload, payload (cereal binary). Versions 1 and 2 share the first 31 bytes.
constexpr size_t kVersionEnd = 8 + kMagicLength + 4;
constexpr size_t kHeaderBytes = kVersionEnd + 8 + 4;
constexpr uint64_t kMaxManifestBytes = 256ull << 20;
constexpr uint64_t kMaxNewestBytes = 1024;
// Bounds on what a manifest may claim (far beyond any real run, far below any harm).
constexpr int64_t kMaxCount = int64_t(1) << 53;        // steps, samples: exact in a Lua number
constexpr uint64_t kMaxFileBytes = uint64_t(1) << 52;  // of one data file
constexpr int kMaxWorld = 1 << 20;


std::string join(const std::string& dir, const std::string& name) { return dir + "/" + name; }

bool exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

std::string hex32(uint32_t x) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", x);
  return buf;
}

uint32_t crc_of(const void* data, size_t n) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  const Bytef* p = static_cast<const Bytef*>(data);
  while (n > 0) {  // zlib takes uInt lengths
    uInt chunk = static_cast<uInt>(std::min<size_t>(n, 1u << 30));
    crc = ::crc32(crc, p, chunk);
    p += chunk;
    n -= chunk;
  }
  return static_cast<uint32_t>(crc);
}

void make_dirs(const std::string& path) {
  for (size_t i = 1; i <= path.size(); ++i)
    if (i == path.size() || path[i] == '/') {
      std::string prefix = path.substr(0, i);
      if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST)
        TORCH_CHECK(false, "cannot make the folder '", prefix, "': ", std::strerror(errno));
    }
  struct stat st;
  TORCH_CHECK(::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "'", path, "' is not a folder");
}

// Removes a file, a link (never what it points to) or a folder and everything in it.
void remove_all(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    if (DIR* d = ::opendir(path.c_str())) {
      while (auto* e = ::readdir(d)) {
        std::string n = e->d_name;
        if (n != "." && n != "..") remove_all(join(path, n));
      }
      ::closedir(d);
    }
    ::rmdir(path.c_str());
  } else {
    ::unlink(path.c_str());
  }
}

// Renames `from` to `to`, never replacing what is at `to`.
void rename_new(const std::string& from, const std::string& to) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return;
  int err = errno;
  if (err == EINVAL && !exists(to) && std::rename(from.c_str(), to.c_str()) == 0) return;  // no RENAME_NOREPLACE here
  TORCH_CHECK(false, "cannot rename '", from, "' to '", to, "': ", std::strerror(err == EINVAL ? errno : err));
}

// Swaps two folders in one step, so that `b` is never missing (two renames where the file
// system cannot swap).
void exchange(const std::string& a, const std::string& b, const std::string& spare) {
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) return;
  TORCH_CHECK(errno == EINVAL, "cannot swap '", a, "' and '", b, "': ", std::strerror(errno));
  remove_all(spare);
  rename_new(b, spare);
  rename_new(a, b);
  rename_new(spare, a);
}

// A test hook: PARTRAIN_CKPT_CRASH_AT=<point> kills the process (as kill -9 would) there.
void crash_point(const char* point) {
  const char* at = std::getenv("PARTRAIN_CKPT_CRASH_AT");
  if (at && std::strcmp(at, point) == 0) std::raise(SIGKILL);
}

// Reads exactly `n` bytes at `offset` of an open file.
bool read_at(int fd, char* out, uint64_t n, uint64_t offset) {
  uint64_t done = 0;
  while (done < n) {
    ssize_t r = ::pread(fd, out + done, static_cast<size_t>(std::min<uint64_t>(n - done, 1u << 30)),
                        static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    done += static_cast<uint64_t>(r);
  }
  return true;
}

// A data file of a tag folder: a regular file, not a link, of the size the manifest records.
int open_data_file(const std::string& tag_dir, const FileEntry& f) {
  std::string path = join(tag_dir, f.name);
  TORCH_CHECK(exists(path), "data file '", path, "' is missing");
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

// ---- Tensors and pieces --------------------------------------------------------------------

const std::map<std::string, c10::ScalarType>& dtypes() {
  static const std::map<std::string, c10::ScalarType> types = {
      {"Float", torch::kFloat32}, {"Double", torch::kFloat64}, {"Half", torch::kFloat16},
      {"BFloat16", torch::kBFloat16}, {"Long", torch::kInt64}, {"Int", torch::kInt32},
      {"Byte", torch::kUInt8}, {"Bool", torch::kBool}};
  return types;
}

c10::ScalarType parse_dtype(const std::string& name) {
  auto it = dtypes().find(name);
  TORCH_CHECK(it != dtypes().end(), "unknown dtype '", name, "' in the checkpoint");
  return it->second;
}

// The number of elements of a box; -1 when it exceeds kMaxElements (or a size is negative).
int64_t volume(const std::vector<int64_t>& size) {
  int64_t n = 1;
  for (auto s : size) {
    if (s < 0) return -1;
    if (s == 0) return 0;
  }
  for (auto s : size) {
    if (s > kMaxElements / n) return -1;
    n *= s;
  }
  return n;
}

std::string shape_text(const std::vector<int64_t>& v) {
  std::string t = "[";
  for (size_t i = 0; i < v.size(); ++i) t += (i ? ", " : "") + std::to_string(v[i]);
  return t + "]";
}

// A configuration value as people write it: the shorter of %.6g and %.17g that reads back exactly.
std::string value_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  if (std::strtod(buf, nullptr) != v) std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

// "a GPT2", "an MLP": a model type with its article, an acronym read letter by letter.
std::string with_article(const std::string& type) {
  const bool acronym = type.size() > 1 && std::isupper(static_cast<unsigned char>(type[0])) &&
                       std::isupper(static_cast<unsigned char>(type[1]));
  const bool vowel = !type.empty() && (std::strchr("AEIOUaeiou", type[0]) ||
                                       (acronym && std::strchr("FHLMNRSX", type[0])));
  return (vowel ? "an " : "a ") + type;
}

// A recorded setting as it is written in a model's options: the name, or the number.
std::string setting_text(double value, const std::string& text) { return text.empty() ? value_text(value) : text; }

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

// The model's parameters, each once (a tied one under its first name), in module order.
std::vector<std::pair<std::string, torch::Tensor>> unique_named(const nn::Module& model) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : model.named_parameters(true))
    if (item.value().defined() && seen.insert(item.value().unsafeGetTensorImpl()).second)
      out.emplace_back(item.key(), item.value());
  return out;
}

// This rank's parameters with their logical names (what checkpoints key them by), each once, in
// module order. On a pipeline rank a tensor tied across stages takes the serial model's first
// name (GPT-2's last stage holds wte.weight as lm_head.weight); `first` says whether this rank
// is the first pipeline rank holding it (the one that saves it).
struct Held {
  std::string logical, local;
  torch::Tensor param;
  bool first = true;
};
std::vector<Held> held(const nn::Module& model) {
  auto owner = parallel::ParallelModel::of(model);
  const parallel::Pipeline* pipe = owner ? owner->pipeline().get() : nullptr;
  std::vector<Held> out;
  for (auto& [name, p] : unique_named(model)) {
    if (!pipe) out.push_back({name, name, p, true});
    else out.push_back({pipe->logical_name(name), name, p, pipe->first_holder(p)});
  }
  return out;
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

std::string to_bytes(RankPart& part) {
  std::ostringstream out(std::ios::binary);
  {
    cereal::BinaryOutputArchive ar(out);
    ar(part);
  }
  return out.str();
}

RankPart part_from(const std::string& bytes) {
  RankPart p;
  util::BoundedInputArchive ar(bytes.data(), bytes.size());
  ar(p);
  return p;
}

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

torch::Tensor bytes_tensor(const std::string& bytes) {
  auto t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  if (!bytes.empty()) std::memcpy(t.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  return t;
}

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

// ---- The manifest file ---------------------------------------------------------------------

std::string manifest_bytes(const Manifest& m) {
  std::ostringstream payload(std::ios::binary);
  {
    cereal::BinaryOutputArchive ar(payload);
    ar(const_cast<Manifest&>(m));
  }
  std::string body = payload.str();
  std::ostringstream out(std::ios::binary);
  {
    cereal::BinaryOutputArchive ar(out);
    uint64_t length = body.size();
    uint32_t crc = crc_of(body.data(), body.size());
    ar(std::string(kMagic), kFormatVersion, length, crc);  // always the current layout
  }
  std::string head = out.str();
  TORCH_CHECK(head.size() == kHeaderBytes, "internal: manifest header of ", head.size(), " bytes");
  return head + body;
}

void write_manifest(const std::string& tag_dir, const Manifest& m) {
  util::write_new(join(tag_dir, "manifest.bin"), manifest_bytes(m));
  util::write_new(join(tag_dir, "summary.txt"), describe(m));
  util::fsync_path(tag_dir);
}

// ---- newest --------------------------------------------------------------------------------
//
// DIR/newest is two lines: the tag, then "crc32 <8 hex digits>" of the tag's bytes.

struct NewestState {
  bool present = false;
  std::string tag;      // when intact
  std::string problem;  // when present but not intact
};

NewestState read_newest(const std::string& dir) {
  NewestState s;
  std::string path = join(dir, "newest");
  if (!exists(path)) return s;
  s.present = true;
  std::string text;
  try {
    text = util::read_regular(path, "'newest' file", kMaxNewestBytes, util::Links::Refuse);
  } catch (const std::exception& e) {
    s.problem = util::message_of(e);
    return s;
  }
  auto bad = [&](const std::string& why) {
    s.problem = "'" + path + "' is damaged (" + why + ")";
    return s;
  };
  auto eol = text.find('\n');
  if (eol == std::string::npos) return bad(text.empty() ? "it is empty" : "it has no checksum line");
  std::string tag = text.substr(0, eol), rest = text.substr(eol + 1);
  if (rest.size() != 15 || rest.compare(0, 6, "crc32 ") != 0 || rest[14] != '\n') return bad("it has no checksum line");
  if (rest.substr(6, 8) != hex32(crc_of(tag.data(), tag.size()))) return bad("its checksum does not match");
  if (!util::safe_name(tag) || tag == "newest") return bad("it names '" + tag + "', which is not a tag");
  s.tag = tag;
  return s;
}

void write_newest(const std::string& dir, const std::string& tag) {
  util::write_atomic(join(dir, "newest"), tag + "\ncrc32 " + hex32(crc_of(tag.data(), tag.size())) + "\n");
}

// ---- Tag folders ---------------------------------------------------------------------------

struct TagState {
  std::string name;
  bool valid = false;
  int64_t step = -1;
  std::string problem;  // when not valid
};

struct Folder {
  bool exists = false;
  NewestState newest;
  std::vector<TagState> tags;     // valid and damaged, in directory order
  std::vector<std::string> aside;  // <tag>~damaged... folders a save set aside
  std::vector<std::string> scratch;  // .<tag>.tmp folders of interrupted saves
};

// Whether a folder without a manifest holds what a checkpoint holds (else it is not one).
bool looks_like_checkpoint(const std::string& path) {
  bool found = false;
  if (DIR* d = ::opendir(path.c_str())) {
    while (auto* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n == "summary.txt" || (n.rfind("rank-", 0) == 0 && n.size() > 9 && n.compare(n.size() - 4, 4, ".bin") == 0))
        found = true;
    }
    ::closedir(d);
  }
  return found;
}

// The state of DIR/<name> as a tag: a real folder with a valid manifest, or why not.
TagState tag_state(const std::string& dir, const std::string& name) {
  TagState t;
  t.name = name;
  std::string path = join(dir, name);
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    t.problem = "'" + path + "' does not exist";
  } else if (S_ISLNK(st.st_mode)) {
    t.problem = "'" + path + "' is a symbolic link; a checkpoint tag must be a real folder";
  } else if (!S_ISDIR(st.st_mode)) {
    t.problem = "'" + path + "' is not a folder";
  } else {
    try {
      t.step = read_manifest(path).step;
      t.valid = true;
    } catch (const std::exception& e) {
      t.problem = util::message_of(e);
    }
  }
  return t;
}

Folder scan(const std::string& dir) {
  Folder f;
  DIR* d = ::opendir(dir.c_str());
  if (!d) {
    TORCH_CHECK(errno == ENOENT, "cannot read the checkpoint folder '", dir, "': ", std::strerror(errno));
    return f;
  }
  f.exists = true;
  std::vector<std::string> names;
  while (auto* e = ::readdir(d)) names.emplace_back(e->d_name);
  ::closedir(d);
  std::sort(names.begin(), names.end());
  f.newest = read_newest(dir);
  for (const auto& n : names) {
    if (n == "." || n == ".." || n == "newest") continue;
    std::string path = join(dir, n);
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) continue;
    if (n[0] == '.') {
      if (S_ISDIR(st.st_mode) && n.size() > 5 && n.compare(n.size() - 4, 4, ".tmp") == 0) f.scratch.push_back(n);
      continue;
    }
    if (!util::safe_name(n)) {
      if (n.find("~damaged") != std::string::npos) f.aside.push_back(n);
      continue;
    }
    if (S_ISLNK(st.st_mode)) {
      struct stat target;
      if (::stat(path.c_str(), &target) == 0 && S_ISDIR(target.st_mode)) f.tags.push_back(tag_state(dir, n));
      continue;
    }
    if (!S_ISDIR(st.st_mode)) continue;  // a user's file beside the tags
    if (!exists(join(path, "manifest.bin")) && !looks_like_checkpoint(path)) continue;  // a user's folder
    f.tags.push_back(tag_state(dir, n));
  }
  return f;
}

Choice choose_in(const Folder& f, const std::string& dir) {
  Choice c;
  c.found = f.newest.present || !f.tags.empty();
  std::vector<const TagState*> valid;
  for (const auto& t : f.tags)
    if (t.valid) valid.push_back(&t);
  const std::string& named = f.newest.tag;
  std::sort(valid.begin(), valid.end(), [&](const TagState* a, const TagState* b) {
    if (a->step != b->step) return a->step > b->step;
    if ((a->name == named) != (b->name == named)) return a->name == named;
    return a->name > b->name;
  });
  for (const auto* t : valid) c.tags.push_back(t->name);
  if (!c.found) return c;
  const std::string newest_path = join(dir, "newest");
  auto taking = [&]() {
    return valid.empty() ? std::string("no tag in it is valid")
                         : "taking '" + valid.front()->name + "' (step " + std::to_string(valid.front()->step) +
                               "), the valid checkpoint with the highest step";
  };
  if (!f.newest.present) {
    c.notes.push_back("'" + newest_path + "' is missing; " + taking());
  } else if (!f.newest.problem.empty()) {
    c.notes.push_back(f.newest.problem + "; " + taking());
  } else {
    auto it = std::find_if(f.tags.begin(), f.tags.end(), [&](const TagState& t) { return t.name == named; });
    if (it == f.tags.end()) {
      c.notes.push_back("'" + newest_path + "' names '" + named + "', which is not a checkpoint in '" + dir + "'; " +
                        taking());
    } else if (!it->valid) {
      c.notes.push_back("'" + newest_path + "' names '" + named + "', which is damaged: " + it->problem + "; " +
                        (valid.empty() ? taking() : "falling back to " + taking().substr(7)));
    } else if (valid.front()->name != named) {
      c.notes.push_back("'" + newest_path + "' names '" + named + "' (step " + std::to_string(it->step) + "), but '" +
                        valid.front()->name + "' (step " + std::to_string(valid.front()->step) +
                        ") is complete and newer (a save stopped before it updated 'newest'); taking it");
    }
  }
  if (!c.notes.empty())  // a fallback: say what else was passed over
    for (const auto& t : f.tags)
      if (!t.valid && t.name != named) c.notes.push_back("skipped the damaged tag '" + t.name + "': " + t.problem);
  return c;
}

void check_tag(const std::string& tag) {
  TORCH_CHECK(util::safe_name(tag) && tag != "newest", "bad checkpoint tag '", tag,
              "': a tag is 1-128 characters from A-Z a-z 0-9 . _ -, not starting with '.' or '-', and not 'newest'");
}

}  // namespace internal

using namespace internal;

// ---- Checking a manifest -------------------------------------------------------------------

void validate(const Manifest& m, const std::string& path) {
  auto bad = [&](const std::string& what) { TORCH_CHECK(false, "the checkpoint manifest '", path, "' ", what); };
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
  // The pipeline layout: for information only, but shaped as a pipeline of this size has it.
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

  std::set<std::string> file_names;
  for (const auto& f : m.files) {
    if (!util::safe_name(f.name) || f.name == "manifest.bin" || f.name == "summary.txt")
      bad("names a data file '" + (printable(f.name, 256) ? f.name : "?") + "' that is not a plain file name");
    if (!file_names.insert(f.name).second) bad("lists the data file '" + f.name + "' twice");
    if (f.bytes > kMaxFileBytes) bad("says '" + f.name + "' has " + std::to_string(f.bytes) + " bytes");
  }

  // Each tensor: its pieces inside it, of its dtype's size, tiling it exactly.
  std::set<std::string> names;
  std::vector<std::vector<const Piece*>> by_file(m.files.size());
  for (const auto& e : m.tensors) {
    if (!printable(e.name, 1024) || (e.name.rfind("model/", 0) != 0 && e.name.rfind("optim/", 0) != 0) ||
        e.name.size() < 7)
      bad("has a tensor name that is not 'model/...' or 'optim/...'");
    if (!names.insert(e.name).second) bad("lists tensor '" + e.name + "' twice");
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
    // Volumes add up: no overlap means an exact tiling. Pieces cut along one dimension (how
    // partrain writes them) are checked in order; others pairwise, and not too many of them.
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
  // Optimizer state: known slots of the saved optimizer, shaped as their parameter, all of them.
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
  // Step counts: of parameters with state, within the optimizer's, each named once.
  std::set<std::string> counted;
  for (const auto& p : m.param_steps) {
    const std::string name = printable(p.name, 1024) ? "'" + p.name + "'" : "a parameter";
    if (!slots_of.count(p.name) || !counted.insert(p.name).second)
      bad("has a step count for " + name + ", which has no optimizer state or another count");
    if (m.optimizer == "sgd" || p.steps < 0 || p.steps > m.optimizer_steps)
      bad("has step count " + std::to_string(p.steps) + " for " + name + " of an optimizer (" + m.optimizer +
          ") after " + std::to_string(m.optimizer_steps) + " step(s)");
  }
  // Each data file: its pieces tile it exactly, and its CRC-32 is theirs combined.
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

Manifest read_manifest(const std::string& tag_dir) {
  std::string path = join(tag_dir, "manifest.bin");
  TORCH_CHECK(exists(path), "the checkpoint manifest '", path, "' is missing");
  std::string bytes = util::read_regular(path, "checkpoint manifest", kMaxManifestBytes, util::Links::Refuse);
  auto bad = [&](const std::string& why) { TORCH_CHECK(false, "the checkpoint manifest '", path, "' ", why); };
  if (bytes.size() < kVersionEnd) bad("is truncated (" + std::to_string(bytes.size()) + " bytes)");
  uint64_t magic_length = 0;
  std::memcpy(&magic_length, bytes.data(), 8);
  if (magic_length != kMagicLength || bytes.compare(8, kMagicLength, kMagic) != 0)
    bad("is not a partrain checkpoint manifest");
  uint32_t version = 0;
  std::memcpy(&version, bytes.data() + 8 + kMagicLength, 4);
  if (version == 1)
    bad("has format version 1, which has no checksum of its own; this partrain reads versions " +
        std::to_string(kOldestReadableFormat) + " to " + std::to_string(kFormatVersion) +
        " (load it with the partrain that saved it and save it again)");
  if (version < kOldestReadableFormat || version > kFormatVersion)
    bad("has format version " + std::to_string(version) + "; this partrain reads versions " +
        std::to_string(kOldestReadableFormat) + " to " + std::to_string(kFormatVersion));
  if (bytes.size() < kHeaderBytes) bad("is truncated (" + std::to_string(bytes.size()) + " bytes)");
  uint64_t length = 0;
  uint32_t crc = 0;
  std::memcpy(&length, bytes.data() + kVersionEnd, 8);
  std::memcpy(&crc, bytes.data() + kVersionEnd + 8, 4);
  if (length != bytes.size() - kHeaderBytes)
    bad("is damaged: its header says " + std::to_string(length) + " bytes follow, the file has " +
        std::to_string(bytes.size() - kHeaderBytes) + " (truncated or extended)");
  if (crc_of(bytes.data() + kHeaderBytes, length) != crc) bad("fails its checksum (its bytes were altered)");
  Manifest m;
  try {
    util::BoundedInputArchive ar(bytes.data() + kHeaderBytes, length);
    struct Format {  // the layout of this manifest's entries, for serialize(TensorEntry)
      explicit Format(uint32_t v) { reading_format = v; }
      ~Format() { reading_format = kFormatVersion; }
    } format(version);
    ar(m);
    if (ar.left() != 0) bad("has " + std::to_string(ar.left()) + " bytes after its contents");
  } catch (const cereal::Exception& e) {
    bad(std::string("is damaged: ") + e.what());
  }
  m.version = version;
  validate(m, path);
  return m;
}

// ---- Saving --------------------------------------------------------------------------------

namespace internal {

Existing existing(const std::string& dir, const std::string& tag, std::string* problem, bool full) {
  std::string path = join(dir, tag);
  if (!exists(path)) return Existing::None;
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
  return "'" + join(dir, tag) + "' already holds a valid checkpoint; save with overwrite = true to replace it, or " +
         "under another tag";
}

// Moves a finished `tmp` folder to DIR/<tag>, points DIR/newest at it, and keeps `num_kept`.
// Whatever is at DIR/<tag> is never lost: a valid checkpoint is refused (or, with `overwrite`,
// replaced only once the new one is in place), anything else is set aside as <tag>~damaged.
void commit(const std::string& dir, const std::string& tag, const std::string& tmp, int num_kept, bool overwrite,
            std::vector<std::string>* notes) {
  std::string final_dir = join(dir, tag);
  std::string problem;
  bool replaced = false;
  switch (existing(dir, tag, &problem, /*full=*/!overwrite)) {
    case Existing::None:
      rename_new(tmp, final_dir);
      break;
    case Existing::Valid:
      if (!overwrite) {
        remove_all(tmp);
        TORCH_CHECK(false, refuse_existing(dir, tag));
      }
      exchange(tmp, final_dir, join(dir, "." + tag + ".old"));  // the old one is now at tmp
      replaced = true;
      break;
    case Existing::Damaged: {
      std::string aside = final_dir + "~damaged";
      for (int i = 2; exists(aside); ++i) aside = final_dir + "~damaged-" + std::to_string(i);
      rename_new(final_dir, aside);
      notes->push_back("'" + final_dir + "' was damaged (" + problem + "); it is kept as '" + aside + "'");
      rename_new(tmp, final_dir);
      break;
    }
  }
  util::fsync_path(dir);
  crash_point("renamed");
  write_newest(dir, tag);
  if (replaced) remove_all(tmp);
  if (num_kept > 0) {
    auto all = tags(dir);
    for (size_t i = 0; i + num_kept < all.size(); ++i)
      if (all[i] != tag) remove_all(join(dir, all[i]));
  }
}

// Makes DIR (when missing) and a fresh scratch folder DIR/.<tag>.tmp for a save of `tag`.
std::string scratch_folder(const std::string& dir, const std::string& tag) {
  make_dirs(dir);
  std::string tmp = join(dir, "." + tag + ".tmp");
  remove_all(tmp);  // an interrupted save's (a link there is removed, never followed)
  TORCH_CHECK(::mkdir(tmp.c_str(), 0755) == 0, "cannot make the folder '", tmp, "': ", std::strerror(errno));
  return tmp;
}

}  // namespace internal

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
  const std::string tmp = join(dir, "." + tag + ".tmp");

  together(group, "preparing the checkpoint folder", [&] {
    if (rank != 0) return;
    std::string problem;
    if (!options.overwrite && exists(join(dir, tag)) && existing(dir, tag, &problem) == Existing::Valid)
      TORCH_CHECK(false, refuse_existing(dir, tag));
    scratch_folder(dir, tag);
  });  // together() has synchronized the ranks: the folder exists for all of them

  // Each rank writes what it alone holds: split tensors from data rank 0 of each tensor group,
  // whole ones from rank (tensor 0, data 0), of the first pipeline stage holding them (every
  // stage saves its own). `full`: every tensor gathered whole, written by rank 0 (by tensor 0,
  // data 0 of each stage under a pipeline).
  auto owner = parallel::ParallelModel::of(*state.model);
  const parallel::Pipeline* pipe = owner ? owner->pipeline().get() : nullptr;
  const dist::Mesh* mesh = pipe ? owner->mesh().get() : state.mesh;  // a pipeline's stages are its mesh's
  dist::Coord coord = mesh ? mesh->coord() : dist::Coord{0, rank, 0};
  std::string mine;
  together(group, "writing the checkpoint's data", [&] {
    RankPart part;
    char name[32];
    std::snprintf(name, sizeof name, "rank-%05d.bin", rank);
    std::unique_ptr<DataFile> file;
    auto store = [&](const std::string& key, const torch::Tensor& t, const c10::optional<parallel::Sharding>& s,
                     bool first) {
      torch::Tensor value = t;
      const parallel::Sharding* split = s ? &*s : nullptr;
      // Who writes a split tensor's slices is read from the mesh (data rank 0 of each tensor
      // group): without one, a rank would be taken for a data-parallel copy and its slices lost.
      TORCH_CHECK(!split || split->ranks == 1 || state.mesh, "'", key, "' is split over tensor=", split ? split->ranks : 1,
                  " but the save was given no mesh: pass mesh = <the mesh it was split over> (pt.parallelize's "
                  "models carry theirs)");
      const bool stage = pipe ? first : coord.pipeline == 0;
      bool writer = stage && coord.data == 0 && (split || coord.tensor == 0);
      if (options.full) {
        if (split) value = parallel::gather_full(t, *split);  // collective: every rank, same order
        split = nullptr;
        writer = pipe ? stage && coord.data == 0 && coord.tensor == 0 : rank == 0;
      }
      if (!writer) return false;
      if (!file) file = std::make_unique<DataFile>(join(tmp, name));
      part.tensors.push_back(entry_for(key, value, split));  // full: value is already logical
      add_pieces(*file, part.tensors.back(), value, split, -1);
      return true;
    };
    for (const auto& h : held(*state.model)) {
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
    mine = to_bytes(part);
  });
  crash_point("data");
  auto parts = dist::all_gather_strings(group, mine);

  Saved saved{tag, {}};
  together(group, "finishing the checkpoint", [&] {
    if (rank != 0) return;
    Manifest m;
    m.step = state.step;
    m.world = group ? group->size() : 1;
    if (state.mesh) {
      m.tensor = state.mesh->layout().tensor;
      m.data = state.mesh->layout().data;
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
    std::map<std::string, size_t> index;
    std::map<std::string, int64_t> param_steps;  // a split parameter's slices' writers all report it
    for (const auto& bytes : parts) {
      RankPart part = part_from(bytes);
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
    validate(m, join(tmp, "manifest.bin"));  // what a load will demand, checked before it is written
    write_manifest(tmp, m);
    crash_point("manifest");
    commit(dir, tag, tmp, options.num_kept, options.overwrite, &saved.notes);
  });
  return saved;
}

// ---- Reading -------------------------------------------------------------------------------

std::string newest(const std::string& dir) { return read_newest(dir).tag; }

std::vector<std::string> tags(const std::string& dir) {
  Folder f = scan(dir);
  std::vector<std::pair<int64_t, std::string>> found;
  for (const auto& t : f.tags)
    if (t.valid) found.emplace_back(t.step, t.name);
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [step, n] : found) out.push_back(n);
  return out;
}

Choice choose(const std::string& dir) { return choose_in(scan(dir), dir); }

namespace {

// One piece's bytes, read from its open data file and checked against its CRC-32.
torch::Tensor read_piece(const std::string& tag_dir, const Manifest& m, const TensorEntry& e, const Piece& p) {
  const auto& f = m.files[p.file];
  std::string path = join(tag_dir, f.name);
  auto piece = torch::empty(p.size, torch::TensorOptions().dtype(parse_dtype(e.dtype)));
  TORCH_CHECK(p.bytes == piece.nbytes(), "tensor '", e.name, "': its piece in '", path, "' has the wrong size");
  int fd = open_data_file(tag_dir, f);
  char* out = static_cast<char*>(piece.data_ptr());
  bool whole = read_at(fd, out, p.bytes, p.offset);
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
    std::string path = join(tag_dir, f.name);
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
        truncated = !read_at(fd, buf.data(), n, p->offset + done);
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
    std::string path = join(dir, t->name);
    if (!t->valid) {
      out.push_back({path, t->problem, true});
      continue;
    }
    auto problems = verify(path);
    if (problems.empty()) out.push_back({path, "ok (step " + std::to_string(t->step) + ")", false});
    for (const auto& p : problems) out.push_back({path, p, true});
  }
  const std::string newest_path = join(dir, "newest");
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
    out.push_back({join(dir, a), "set aside by a save that found it damaged (kept for inspection; not a tag)", false});
  for (const auto& s : f.scratch)
    out.push_back({join(dir, s), "an interrupted save's scratch folder (ignored; the next save of its tag removes it)",
                   false});
  return out;
}

std::string describe(const Manifest& m) {
  std::ostringstream s;
  auto shape = [](const std::vector<int64_t>& v) {
    std::string t;
    for (size_t i = 0; i < v.size(); ++i) t += (i ? "x" : "") + std::to_string(v[i]);
    return v.empty() ? std::string("scalar") : t;
  };
  s << "partrain checkpoint, format " << m.version << "\n"
    << "step " << m.step << "; saved by " << m.world << " rank(s): tensor " << m.tensor << " x data " << m.data
    << " x pipeline " << m.pipeline << ", zero " << m.zero << (m.full ? "; full (consolidated)" : "; partial (per-rank shards)")
    << "\nmodel " << m.model_type << (m.policy.empty() ? "" : ", policy " + m.policy);
  if (!m.optimizer.empty()) s << "; optimizer " << m.optimizer << " after " << m.optimizer_steps << " step(s)";
  if (!m.param_steps.empty()) {
    s << "\nparameters that stepped fewer times (no gradient on the others):";
    for (size_t i = 0; i < m.param_steps.size(); ++i)
      s << (i ? ", " : " ") << m.param_steps[i].name << " " << m.param_steps[i].steps;
  }
  if (!m.config.empty()) {
    s << "\nmodel config:";
    for (size_t i = 0; i < m.config.size(); ++i)
      s << (i ? ", " : " ") << m.config[i].name << "=" << setting_text(m.config[i].value, m.config[i].text);
  }
  if (m.loss_scale.size() == 4)
    s << "\nloss scale " << m.loss_scale[0] << " (" << int64_t(m.loss_scale[1]) << " good step(s) since the last change, "
      << int64_t(m.loss_scale[3]) << " step(s) skipped)";
  if (!m.stages.bounds.empty()) {
    // Virtual stage v (chunk v / pipeline of pipeline rank v % pipeline) holds blocks [b[v], b[v+1]).
    const auto& st = m.stages;
    auto list = [](const std::vector<std::string>& v) {
      std::string t;
      for (const auto& n : v) t += (t.empty() ? "" : ",") + n;
      return t;
    };
    s << "\npipeline: " << (st.schedule.empty() ? std::string("schedule not recorded") : "schedule " + st.schedule)
      << ", " << st.chunks << " chunk(s) a rank";
    for (size_t v = 0; v + 1 < st.bounds.size(); ++v) {
      s << "\n  stage " << v << " (pipeline rank " << v % m.pipeline << "): " << st.blocks << "." << st.bounds[v];
      if (st.bounds[v + 1] - 1 > st.bounds[v]) s << "-" << st.blocks << "." << st.bounds[v + 1] - 1;
      if (v == 0 && !st.first.empty()) s << " + " << list(st.first);
      if (v + 2 == st.bounds.size() && !st.last.empty()) s << " + " << list(st.last);
    }
  }
  s << "\ndata position: " << (m.samples_seen < 0 ? std::string("none") : std::to_string(m.samples_seen) + " samples")
    << "\nuser: " << m.user_json << "\n\nfiles:\n";
  uint64_t total = 0;
  for (const auto& f : m.files) {
    s << "  " << f.name << "  " << f.bytes << " bytes  crc32 " << hex32(f.crc32) << "\n";
    total += f.bytes;
  }
  s << "  total " << total << " bytes\n\ntensors:\n";
  for (const auto& e : m.tensors) {
    uint64_t bytes = 0;
    for (const auto& p : e.pieces) bytes += p.bytes;
    s << "  " << e.name << "  " << e.dtype << " " << shape(e.shape);
    if (e.dim >= 0) {
      s << "  split on " << e.dim;
      if (!e.parts.empty()) {
        s << " (parts ";
        for (size_t i = 0; i < e.parts.size(); ++i) s << (i ? "+" : "") << e.parts[i];
        s << ")";
      }
    }
    s << "  " << e.pieces.size() << " piece(s), " << bytes << " bytes:";
    for (const auto& p : e.pieces) {
      s << " [" << (p.file >= 0 && p.file < static_cast<int32_t>(m.files.size()) ? m.files[p.file].name : "?");
      if (e.dim >= 0 && static_cast<size_t>(e.dim) < p.start.size())
        s << " " << p.start[e.dim] << ":" << p.start[e.dim] + p.size[e.dim];
      s << "]";
    }
    s << "\n";
  }
  return s.str();
}

// ---- Loading -------------------------------------------------------------------------------

namespace {

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

// Loads one tag in two steps, each collective: every rank reads and checks all it needs, then,
// only when every rank has, every rank changes `state`. A rank whose own reads were sound must
// not apply a checkpoint another rank refused. Damaged when the checkpoint is damaged, another
// error when it does not fit what is being loaded.
Loaded load_tag(const std::string& dir, const std::string& tag, State& state, const dist::GroupPtr& group, int rank) {
  Loaded loaded;
  const auto every_name = model_names(state, group);
  const std::string tag_dir = join(dir, tag);
  // What the first step reads and the second applies: the manifest, this rank's parameters, and
  // their values and optimizer state.
  Manifest m;
  std::vector<Held> params;
  std::vector<torch::Tensor> values;
  std::vector<std::map<std::string, torch::Tensor>> slots;
  std::vector<int64_t> steps;  // each parameter's state's step count; -1: the optimizer's
  bool with_optimizer = false;
  together(group, "loading the checkpoint", [&] {
    check_tag(tag);
    TORCH_CHECK(exists(tag_dir), "no checkpoint '", tag, "' in '", dir, "'");
    as_damage([&] {
      TORCH_CHECK(util::is_plain_dir(tag_dir), "'", tag_dir, "' is not a folder (a symbolic link or a file); ",
                  "a checkpoint tag must be a real folder");
      m = read_manifest(tag_dir);
      for (const auto& f : m.files) ::close(open_data_file(tag_dir, f));  // sizes first: a truncated file names itself
    });
    // This rank's parameters only: on a pipeline stage, what the stage holds.
    params = held(*state.model);
    for (const auto& e : m.tensors)
      TORCH_CHECK(e.name.rfind("model/", 0) != 0 || every_name.count(e.name.substr(6)), "the checkpoint '", tag_dir,
                  "' holds tensor '", e.name.substr(6), "', which the model has no parameter for");
    with_optimizer = state.optimizer && !m.optimizer.empty();
    if (with_optimizer)
      TORCH_CHECK(m.optimizer == state.optimizer->options().kind, "the checkpoint '", tag_dir, "' holds ",
                  m.optimizer, " state; the optimizer given is ", state.optimizer->options().kind);
    // The settings that change what the model computes and no shape (GPT-2's heads) are those it
    // was saved with, where the checkpoint records them (format 7 on).
    if (m.model_type == state.model->type())
      for (const auto& f : state.model->config()) {
        auto saved =
            std::find_if(m.config.begin(), m.config.end(), [&](const ConfigEntry& c) { return c.name == f.name; });
        if (!f.fixed || saved == m.config.end() || (saved->text == f.text && saved->value == f.value)) continue;
        const std::string was = setting_text(saved->value, saved->text);
        TORCH_CHECK(false, "the checkpoint '", tag_dir, "' was saved by ", with_article(m.model_type), " with ", f.name,
                    "=", was, "; this one has ", f.name, "=", setting_text(f.value, f.text),
                    ", which computes another function with the same shapes: build it with ", f.name, "=", was);
      }
    for (const auto& [name, local, p, first] : params) {
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
        loaded.notes.push_back("the data position, " + std::to_string(m.samples_seen) + " samples, is not a whole " +
                               "number of this loader's batches of " + std::to_string(state.data->options().batch) +
                               " into its epoch (another batch size saved it): the data resumes at " +
                               std::to_string(lands) + ", and " + std::to_string(m.samples_seen - lands) +
                               " samples are seen again");
    }
    // Read everything.
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
          auto part = s ? read_part(tag_dir, m, t, s->local_shape(), s->dim, s->slices(s->group->rank()))
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
  });
  // Every rank has read and checked all it needs (together() fails them all when one failed):
  // only now does any rank change its state. The step count before the parameters' states
  // (Adam's bias correction reads it).
  together(group, "applying the checkpoint", [&] {
    torch::NoGradGuard no_grad;
    if (state.data && m.samples_seen >= 0) state.data->seek(m.samples_seen);
    if (with_optimizer) state.optimizer->set_steps_taken(m.optimizer_steps);
    if (with_optimizer && state.optimizer->loss_scaler() && m.loss_scale.size() == 4) {
      const auto& ls = m.loss_scale;  // a checkpoint without it leaves the scaler as it is
      state.optimizer->loss_scaler()->set_state({ls[0], int64_t(ls[1]), int64_t(ls[2]), int64_t(ls[3])});
    }
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].param.copy_(values[i]);
      if (with_optimizer) state.optimizer->set_param_state(params[i].param, slots[i], steps[i]);  // none: cleared
    }
    if (rank < static_cast<int>(m.rng.size()) && !m.rng[rank].empty()) {
      try {
        auto generator = at::detail::getDefaultCPUGenerator();
        generator.set_state(bytes_tensor(m.rng[rank]));
      } catch (const std::exception&) {
        // another LibTorch's generator format: keep this run's state
      }
    }
    // The CUDA generator: restored on a CUDA rank that finds one; a checkpoint and a run that
    // disagree on CUDA load all the same, with a note (the CPU state above still holds).
    auto& notes = loaded.notes;
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
    loaded.tag = tag;
    loaded.step = m.step;
    loaded.user_json = m.user_json;
  });
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
      notes.push_back("'" + join(dir, c.tags[i]) + "' cannot be loaded: " + e.what() +
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
