// Sharded checkpoints: saving, loading with resharding, verifying, converting, safetensors.
// See ckpt.hpp.
#include "engine/ckpt/ckpt.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
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
#include "engine/parallel/tensor_parallel.hpp"

namespace partrain::ckpt {

template <class Archive>
void serialize(Archive& ar, Piece& p) {
  ar(p.file, p.offset, p.bytes, p.start, p.size, p.crc32);
}
template <class Archive>
void serialize(Archive& ar, TensorEntry& e) {
  ar(e.name, e.dtype, e.shape, e.dim, e.fused, e.pieces);
}
template <class Archive>
void serialize(Archive& ar, FileEntry& f) {
  ar(f.name, f.bytes, f.crc32);
}
template <class Archive>
void serialize(Archive& ar, Manifest& m) {
  ar(m.step, m.world, m.tensor, m.data, m.pipeline, m.zero, m.model_type, m.policy, m.optimizer, m.optimizer_steps,
     m.samples_seen, m.user_json, m.full, m.tensors, m.files, m.rng);
}

const TensorEntry* Manifest::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

namespace {

const char kMagic[] = "partrain-checkpoint";

// ---- Files ---------------------------------------------------------------------------------

std::string join(const std::string& dir, const std::string& name) { return dir + "/" + name; }

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

void make_dirs(const std::string& path) {
  for (size_t i = 1; i <= path.size(); ++i)
    if (i == path.size() || path[i] == '/') {
      std::string prefix = path.substr(0, i);
      if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST)
        TORCH_CHECK(false, "cannot make the folder '", prefix, "': ", std::strerror(errno));
    }
}

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

void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

void rename_or_fail(const std::string& from, const std::string& to) {
  TORCH_CHECK(std::rename(from.c_str(), to.c_str()) == 0, "cannot rename '", from, "' to '", to,
              "': ", std::strerror(errno));
}

// A test hook: PARTRAIN_CKPT_CRASH_AT=<point> kills the process (as kill -9 would) there.
void crash_point(const char* point) {
  const char* at = std::getenv("PARTRAIN_CKPT_CRASH_AT");
  if (at && std::strcmp(at, point) == 0) std::raise(SIGKILL);
}

// A data file written front to back, its CRC-32 kept as it goes.
class DataFile {
 public:
  explicit DataFile(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    TORCH_CHECK(fd_ >= 0, "cannot write '", path_, "': ", std::strerror(errno));
    crc_ = ::crc32(0L, Z_NULL, 0);
  }
  ~DataFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  // Appends the tensor's bytes; returns where they start, and their own CRC-32 in `crc`.
  uint64_t write(const torch::Tensor& t, uint32_t* crc) {
    auto cpu = t.detach().to(torch::kCPU).contiguous();
    const char* p = static_cast<const char*>(cpu.data_ptr());
    size_t n = cpu.nbytes();
    uint64_t at = offset_;
    uLong own = ::crc32(::crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(p), static_cast<uInt>(n));
    *crc = static_cast<uint32_t>(own);
    crc_ = ::crc32_combine(crc_, own, static_cast<z_off_t>(n));  // the file's, without a second pass
    while (n > 0) {
      ssize_t w = ::write(fd_, p, n);
      TORCH_CHECK(w > 0, "writing '", path_, "' failed: ", std::strerror(errno));
      p += w;
      n -= static_cast<size_t>(w);
      offset_ += static_cast<uint64_t>(w);
    }
    return at;
  }
  FileEntry finish(const std::string& name) {
    TORCH_CHECK(::fsync(fd_) == 0, "flushing '", path_, "' to disk failed: ", std::strerror(errno));
    ::close(fd_);
    fd_ = -1;
    return {name, offset_, static_cast<uint32_t>(crc_)};
  }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t offset_ = 0;
  uLong crc_;
};

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  TORCH_CHECK(out, "cannot write '", path, "': ", std::strerror(errno));
  out << text;
  out.flush();
  TORCH_CHECK(out, "writing '", path, "' failed");
  out.close();
  fsync_path(path);
}

uint32_t file_crc(const std::string& path, uint64_t* size) {
  int fd = ::open(path.c_str(), O_RDONLY);
  TORCH_CHECK(fd >= 0, "cannot read '", path, "': ", std::strerror(errno));
  uLong crc = ::crc32(0L, Z_NULL, 0);
  std::vector<char> buf(1 << 20);
  uint64_t total = 0;
  ssize_t n;
  while ((n = ::read(fd, buf.data(), buf.size())) > 0) {
    crc = ::crc32(crc, reinterpret_cast<const Bytef*>(buf.data()), static_cast<uInt>(n));
    total += static_cast<uint64_t>(n);
  }
  ::close(fd);
  *size = total;
  return static_cast<uint32_t>(crc);
}

// "" when the file is as the manifest says, else what is wrong.
std::string check_file(const std::string& tag_dir, const FileEntry& f) {
  std::string path = join(tag_dir, f.name);
  if (!exists(path)) return "data file '" + path + "' is missing";
  uint64_t size = 0;
  uint32_t crc = file_crc(path, &size);
  if (size != f.bytes)
    return "data file '" + path + "' has " + std::to_string(size) + " bytes; the manifest says " +
           std::to_string(f.bytes) + " (truncated or overwritten)";
  if (crc != f.crc32) return "data file '" + path + "' fails its checksum (its bytes were altered)";
  return "";
}

// ---- Tensors and pieces --------------------------------------------------------------------

c10::ScalarType parse_dtype(const std::string& name) {
  static const std::map<std::string, c10::ScalarType> types = {
      {"Float", torch::kFloat32}, {"Double", torch::kFloat64}, {"Half", torch::kFloat16},
      {"BFloat16", torch::kBFloat16}, {"Long", torch::kInt64}, {"Int", torch::kInt32},
      {"Byte", torch::kUInt8}, {"Bool", torch::kBool}};
  auto it = types.find(name);
  TORCH_CHECK(it != types.end(), "unknown dtype '", name, "' in the checkpoint");
  return it->second;
}

int64_t volume(const std::vector<int64_t>& size) {
  int64_t n = 1;
  for (auto s : size) n *= s;
  return n;
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

TensorEntry entry_for(const std::string& name, const torch::Tensor& t, const parallel::Sharding* s) {
  TensorEntry e;
  e.name = name;
  e.dtype = c10::toString(t.scalar_type());
  e.shape = s ? s->shape : t.sizes().vec();
  if (s) {
    e.dim = static_cast<int32_t>(s->dim);
    e.fused = s->fused;
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

// What one rank sends rank 0 after writing its file.
struct RankPart {
  std::vector<TensorEntry> tensors;
  FileEntry file;  // name empty: the rank wrote nothing
  std::string rng;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(tensors, file, rng);
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
  std::istringstream in(bytes, std::ios::binary);
  RankPart p;
  cereal::BinaryInputArchive ar(in);
  ar(p);
  return p;
}

std::string rng_state() {
  auto state = at::detail::getDefaultCPUGenerator().get_state();
  return std::string(reinterpret_cast<const char*>(state.data_ptr<uint8_t>()), state.numel());
}

// Runs `fn` on every rank and fails on all of them if it failed on any.
void together(const dist::GroupPtr& group, const std::string& what, const std::function<void()>& fn) {
  std::string error;
  try {
    fn();
  } catch (const std::exception& e) {
    error = compat::message_of(e);
  }
  bool any = dist::any_rank(group, !error.empty());
  if (!error.empty()) TORCH_CHECK(false, error);
  TORCH_CHECK(!any, what, " failed on another rank (see its message)");
}

void write_manifest(const std::string& tag_dir, const Manifest& m) {
  std::string path = join(tag_dir, "manifest.bin");
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out, "cannot write '", path, "': ", std::strerror(errno));
    cereal::BinaryOutputArchive ar(out);
    ar(std::string(kMagic), m.version, const_cast<Manifest&>(m));
    out.flush();
    TORCH_CHECK(out, "writing '", path, "' failed");
  }
  fsync_path(path);
  write_text(join(tag_dir, "summary.txt"), describe(m));
  fsync_path(tag_dir);
}

// Moves a finished `tmp` folder to DIR/<tag>, points DIR/newest at it, and keeps `num_kept`.
void commit(const std::string& dir, const std::string& tag, const std::string& tmp, int num_kept) {
  std::string final_dir = join(dir, tag);
  if (exists(final_dir)) {  // saving a tag again: the old one goes only once the new one is in place
    remove_all(final_dir + ".old");
    rename_or_fail(final_dir, final_dir + ".old");
  }
  rename_or_fail(tmp, final_dir);
  fsync_path(dir);
  crash_point("renamed");
  write_text(join(dir, "newest.tmp"), tag + "\n");
  rename_or_fail(join(dir, "newest.tmp"), join(dir, "newest"));
  fsync_path(dir);
  remove_all(final_dir + ".old");
  if (num_kept > 0) {
    auto all = tags(dir);
    for (size_t i = 0; i + num_kept < all.size(); ++i)
      if (all[i] != tag) remove_all(join(dir, all[i]));
  }
}

void check_tag(const std::string& tag) {
  TORCH_CHECK(!tag.empty() && tag.find('/') == std::string::npos && tag[0] != '.' && tag != "newest" &&
                  tag.size() < 200 && tag.find(".tmp") == std::string::npos,
              "bad checkpoint tag '", tag, "': a plain folder name, not 'newest', without '/' or '.tmp'");
}

}  // namespace

// ---- Saving --------------------------------------------------------------------------------

std::string save(const std::string& dir, const State& state, const SaveOptions& options) {
  TORCH_CHECK(state.model, "checkpoint save: no model given");
  auto& world = dist::World::instance();
  dist::GroupPtr group = world.initialized() ? world.world() : nullptr;
  const int rank = group ? world.rank() : 0;
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(state.step));
  const std::string tag = options.tag.empty() ? buf : options.tag;
  check_tag(tag);
  const std::string tmp = join(dir, tag + ".tmp");

  together(group, "preparing the checkpoint folder", [&] {
    if (rank == 0) {
      make_dirs(dir);
      remove_all(tmp);
      make_dirs(tmp);
    }
  });  // together() has synchronized the ranks: the folder exists for all of them

  // Each rank writes what it alone holds: split tensors from data rank 0 of each tensor group,
  // whole ones from rank (tensor 0, data 0). `full`: rank 0 writes every tensor gathered whole.
  dist::Coord coord = state.mesh ? state.mesh->coord() : dist::Coord{0, rank, 0};
  std::string mine;
  together(group, "writing the checkpoint's data", [&] {
    RankPart part;
    char name[32];
    std::snprintf(name, sizeof name, "rank-%05d.bin", rank);
    std::unique_ptr<DataFile> file;
    auto store = [&](const std::string& key, const torch::Tensor& t, const c10::optional<parallel::Sharding>& s) {
      torch::Tensor value = t;
      const parallel::Sharding* split = s ? &*s : nullptr;
      bool writer = split ? coord.data == 0 && coord.pipeline == 0
                          : coord.data == 0 && coord.tensor == 0 && coord.pipeline == 0;
      if (options.full) {
        if (split) value = parallel::gather_full(t, *split);  // collective: every rank, same order
        split = nullptr;
        writer = rank == 0;
      }
      if (!writer) return;
      if (!file) file = std::make_unique<DataFile>(join(tmp, name));
      part.tensors.push_back(entry_for(key, value, split));  // full: value is already logical
      add_pieces(*file, part.tensors.back(), value, split, -1);
    };
    for (const auto& [pname, p] : unique_named(*state.model)) {
      auto s = parallel::sharding_of(p);
      store("model/" + pname, p, s);
      if (state.optimizer)
        for (const auto& [slot, t] : state.optimizer->param_state(p)) store("optim/" + pname + "/" + slot, t, s);
    }
    if (file) part.file = file->finish(name);
    part.rng = rng_state();
    mine = to_bytes(part);
  });
  crash_point("data");
  auto parts = dist::all_gather_strings(group, mine);

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
    } else {
      m.data = m.zero = m.world;
    }
    m.model_type = state.model->type();
    m.policy = state.policy;
    if (state.optimizer) {
      m.optimizer = state.optimizer->options().kind;
      m.optimizer_steps = state.optimizer->steps_taken();
    }
    m.samples_seen = state.data ? state.data->samples_seen() : -1;
    m.user_json = state.user_json;
    m.full = options.full;
    std::map<std::string, size_t> index;
    for (const auto& bytes : parts) {
      RankPart part = part_from(bytes);
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
    }
    write_manifest(tmp, m);
    crash_point("manifest");
    commit(dir, tag, tmp, options.num_kept);
  });
  return tag;
}

// ---- Reading -------------------------------------------------------------------------------

std::string newest(const std::string& dir) {
  std::ifstream in(join(dir, "newest"));
  std::string tag;
  if (!in || !std::getline(in, tag)) return "";
  return tag;
}

std::vector<std::string> tags(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (auto* e = ::readdir(d)) {
      std::string n = e->d_name;
      bool scratch = n.size() > 4 && (n.compare(n.size() - 4, 4, ".tmp") == 0 || n.compare(n.size() - 4, 4, ".old") == 0);
      if (n[0] == '.' || scratch) continue;
      std::string manifest = join(join(dir, n), "manifest.bin");
      if (!exists(manifest)) continue;
      int64_t step = 0;
      try {
        step = read_manifest(join(dir, n)).step;
      } catch (const std::exception&) {
        step = -1;  // damaged: listed first, so pruning drops it before good ones
      }
      found.emplace_back(step, n);
    }
    ::closedir(d);
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [step, n] : found) out.push_back(n);
  return out;
}

Manifest read_manifest(const std::string& tag_dir) {
  std::string path = join(tag_dir, "manifest.bin");
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "cannot read the checkpoint manifest '", path, "': ", std::strerror(errno));
  Manifest m;
  std::string magic;
  try {
    cereal::BinaryInputArchive ar(in);
    ar(magic);
    TORCH_CHECK(magic == kMagic, "'", path, "' is not a partrain checkpoint manifest");
    ar(m.version);
    TORCH_CHECK(m.version == kFormatVersion, "the checkpoint manifest '", path, "' has format version ", m.version,
                "; this partrain reads version ", kFormatVersion);
    ar(m);
  } catch (const cereal::Exception& e) {
    TORCH_CHECK(false, "the checkpoint manifest '", path, "' is damaged or truncated (", e.what(), ")");
  } catch (const std::length_error&) {
    TORCH_CHECK(false, "the checkpoint manifest '", path, "' is damaged");
  } catch (const std::bad_alloc&) {
    TORCH_CHECK(false, "the checkpoint manifest '", path, "' is damaged");
  }
  return m;
}

namespace {

// One piece's bytes, checked against the manifest: inside its tensor and file, and its CRC-32.
torch::Tensor read_piece(const std::string& tag_dir, const Manifest& m, const TensorEntry& e, const Piece& p) {
  auto dtype = parse_dtype(e.dtype);
  TORCH_CHECK(p.file >= 0 && p.file < static_cast<int32_t>(m.files.size()), "tensor '", e.name,
              "' names a data file the manifest does not list");
  const auto& f = m.files[p.file];
  std::string path = join(tag_dir, f.name);
  TORCH_CHECK(p.start.size() == e.shape.size() && p.size.size() == e.shape.size(), "tensor '", e.name,
              "' has a piece of the wrong rank in '", path, "'");
  for (size_t d = 0; d < e.shape.size(); ++d)
    TORCH_CHECK(p.start[d] >= 0 && p.size[d] >= 0 && p.start[d] + p.size[d] <= e.shape[d], "tensor '", e.name,
                "' has a piece outside its shape in '", path, "'");
  auto piece = torch::empty(p.size, torch::TensorOptions().dtype(dtype));
  TORCH_CHECK(p.bytes == piece.nbytes() && p.offset + p.bytes <= f.bytes, "tensor '", e.name, "': its piece at byte ",
              p.offset, " of '", path, "' does not fit the file");
  int fd = ::open(path.c_str(), O_RDONLY);
  TORCH_CHECK(fd >= 0, "data file '", path, "' is missing or unreadable (tensor '", e.name, "'): ", std::strerror(errno));
  char* out = static_cast<char*>(piece.data_ptr());
  uint64_t done = 0;
  while (done < p.bytes) {
    ssize_t n = ::pread(fd, out + done, p.bytes - done, static_cast<off_t>(p.offset + done));
    if (n <= 0) break;
    done += static_cast<uint64_t>(n);
  }
  ::close(fd);
  TORCH_CHECK(done == p.bytes, "data file '", path, "' is truncated: tensor '", e.name, "' needs bytes ", p.offset,
              "..", p.offset + p.bytes);
  auto crc = ::crc32(::crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(out), static_cast<uInt>(p.bytes));
  TORCH_CHECK(static_cast<uint32_t>(crc) == p.crc32, "data file '", path, "' fails its checksum in tensor '", e.name,
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
  for (const auto& p : e.pieces) {
    // Only pieces cut along `dim` (whole in every other dimension) are read in part; any other
    // piece is read whole and cut here.
    bool along = true;
    for (size_t d = 0; d < e.shape.size(); ++d)
      if (static_cast<int64_t>(d) != dim) along = along && p.start.size() == e.shape.size() && p.start[d] == 0 && p.size[d] == e.shape[d];
    if (!along || p.start.size() != e.shape.size()) {
      auto full = read_tensor(tag_dir, m, e);
      int64_t offset = 0;
      for (const auto& [start, length] : slices) {
        local.narrow(dim, offset, length).copy_(full.narrow(dim, start, length));
        offset += length;
      }
      return local;
    }
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
  Manifest m;
  try {
    m = read_manifest(tag_dir);
  } catch (const std::exception& e) {
    problems.push_back(compat::message_of(e));
    return problems;
  }
  for (const auto& f : m.files) {
    auto p = check_file(tag_dir, f);
    if (!p.empty()) problems.push_back(p);
  }
  for (const auto& e : m.tensors) {
    int64_t covered = 0;
    for (const auto& p : e.pieces) {
      bool inside = p.file >= 0 && p.file < static_cast<int32_t>(m.files.size()) && p.size.size() == e.shape.size() &&
                    p.offset + p.bytes <= m.files[p.file].bytes;
      for (size_t d = 0; inside && d < e.shape.size(); ++d)
        inside = p.start[d] >= 0 && p.start[d] + p.size[d] <= e.shape[d];
      if (!inside) problems.push_back("tensor '" + e.name + "' has a piece outside its shape or file");
      covered += volume(p.size);
    }
    if (covered != volume(e.shape))
      problems.push_back("tensor '" + e.name + "': its pieces cover " + std::to_string(covered) + " of " +
                         std::to_string(volume(e.shape)) + " elements");
  }
  return problems;
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
  s << "\ndata position: " << (m.samples_seen < 0 ? std::string("none") : std::to_string(m.samples_seen) + " samples")
    << "\nuser: " << m.user_json << "\n\nfiles:\n";
  uint64_t total = 0;
  for (const auto& f : m.files) {
    char crc[16];
    std::snprintf(crc, sizeof crc, "%08x", f.crc32);
    s << "  " << f.name << "  " << f.bytes << " bytes  crc32 " << crc << "\n";
    total += f.bytes;
  }
  s << "  total " << total << " bytes\n\ntensors:\n";
  for (const auto& e : m.tensors) {
    uint64_t bytes = 0;
    for (const auto& p : e.pieces) bytes += p.bytes;
    s << "  " << e.name << "  " << e.dtype << " " << shape(e.shape);
    if (e.dim >= 0) s << "  split on " << e.dim << (e.fused > 1 ? " (" + std::to_string(e.fused) + " fused parts)" : "");
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

Loaded load(const std::string& dir, const std::string& tag_in, State& state) {
  TORCH_CHECK(state.model, "checkpoint load: no model given");
  auto& world = dist::World::instance();
  dist::GroupPtr group = world.initialized() ? world.world() : nullptr;
  const int rank = group ? world.rank() : 0;
  Loaded loaded;
  together(group, "loading the checkpoint", [&] {
    std::string tag = tag_in.empty() ? newest(dir) : tag_in;
    TORCH_CHECK(!tag.empty(), "no checkpoint in '", dir, "' (it has no 'newest' file)");
    std::string tag_dir = join(dir, tag);
    TORCH_CHECK(exists(tag_dir), "no checkpoint '", tag, "' in '", dir, "'");
    Manifest m = read_manifest(tag_dir);
    // Each data file's size first (a truncated file names itself before any tensor does); every
    // piece's checksum as it is read.
    for (const auto& f : m.files) {
      struct stat st;
      std::string path = join(tag_dir, f.name);
      TORCH_CHECK(::stat(path.c_str(), &st) == 0, "data file '", path, "' is missing");
      TORCH_CHECK(static_cast<uint64_t>(st.st_size) == f.bytes, "data file '", path, "' has ", st.st_size,
                  " bytes; the manifest says ", f.bytes, " (truncated or overwritten)");
    }
    auto params = unique_named(*state.model);
    std::set<std::string> wanted;
    for (const auto& [name, p] : params) wanted.insert("model/" + name);
    for (const auto& e : m.tensors)
      TORCH_CHECK(e.name.rfind("model/", 0) != 0 || wanted.count(e.name), "the checkpoint '", tag_dir,
                  "' holds tensor '", e.name.substr(6), "', which the model has no parameter for");
    if (state.optimizer && !m.optimizer.empty())
      TORCH_CHECK(m.optimizer == state.optimizer->options().kind, "the checkpoint '", tag_dir, "' holds ",
                  m.optimizer, " state; the optimizer given is ", state.optimizer->options().kind);
    torch::NoGradGuard no_grad;
    // The step count first: the parameters' states are set as of it (Adam's bias correction).
    if (state.optimizer && !m.optimizer.empty()) state.optimizer->set_steps_taken(m.optimizer_steps);
    for (const auto& [name, p] : params) {
      auto s = parallel::sharding_of(p);
      const TensorEntry* e = m.find("model/" + name);
      TORCH_CHECK(e, "the checkpoint '", tag_dir, "' has no tensor '", name, "' (a parameter of the model)");
      auto logical = s ? s->shape : p.sizes().vec();
      TORCH_CHECK(e->shape == logical, "tensor '", name, "' in '", tag_dir, "' has shape ", c10::IntArrayRef(e->shape),
                  "; the model's is ", c10::IntArrayRef(logical));
      auto read = [&](const TensorEntry& t) {
        auto part = s ? read_part(tag_dir, m, t, s->local_shape(), s->dim, s->slices(s->group->rank()))
                      : read_tensor(tag_dir, m, t);
        return part.to(p.options().requires_grad(false));
      };
      p.copy_(read(*e));
      if (state.optimizer && !m.optimizer.empty()) {
        std::map<std::string, torch::Tensor> slots;
        std::string prefix = "optim/" + name + "/";
        for (const auto& t : m.tensors)
          if (t.name.rfind(prefix, 0) == 0) slots[t.name.substr(prefix.size())] = read(t);
        if (!slots.empty()) state.optimizer->set_param_state(p, slots);
      }
    }
    if (state.data && m.samples_seen >= 0) state.data->seek(m.samples_seen);
    if (rank < static_cast<int>(m.rng.size()) && !m.rng[rank].empty()) {
      auto bytes = torch::empty({static_cast<int64_t>(m.rng[rank].size())}, torch::kUInt8);
      std::memcpy(bytes.data_ptr<uint8_t>(), m.rng[rank].data(), m.rng[rank].size());
      try {
        auto generator = at::detail::getDefaultCPUGenerator();
        generator.set_state(bytes);
      } catch (const std::exception&) {
        // another LibTorch's generator format: keep this run's state
      }
    }
    loaded = {tag, m.step, m.user_json};
  });
  return loaded;
}

// ---- Converting ----------------------------------------------------------------------------

void convert(const std::string& src_tag_dir, const std::string& dst_dir, int tensor, int data) {
  TORCH_CHECK(tensor >= 1 && data >= 1, "convert: --tensor and --data must be at least 1");
  auto problems = verify(src_tag_dir);
  TORCH_CHECK(problems.empty(), "convert: '", src_tag_dir, "' is damaged: ", problems.front());
  Manifest src = read_manifest(src_tag_dir);
  Manifest m = src;
  m.world = tensor * data;
  m.tensor = tensor;
  m.data = m.zero = data;
  m.pipeline = 1;
  m.full = false;
  m.files.clear();
  m.rng.clear();  // generator states belong to the ranks that saved them
  std::string tag = src_tag_dir.substr(src_tag_dir.find_last_of('/') + 1);
  check_tag(tag);
  std::string tmp = join(dst_dir, tag + ".tmp");
  make_dirs(dst_dir);
  remove_all(tmp);
  make_dirs(tmp);
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
    const int64_t logical = e.shape[e.dim];
    for (int r = 0; r < tensor; ++r) {
      std::vector<std::pair<int64_t, int64_t>> slices;
      if (e.fused > 1) {
        const int64_t part = logical / e.fused, each = part / tensor;
        TORCH_CHECK(part % tensor == 0, "convert: tensor ", tensor, " does not divide the ", e.fused, " fused parts of ",
                    e.name, " (", part, " each)");
        for (int64_t j = 0; j < e.fused; ++j) slices.emplace_back(j * part + r * each, each);
      } else {
        const int64_t each = (logical + tensor - 1) / tensor, start = r * each, end = std::min(start + each, logical);
        if (end > start) slices.emplace_back(start, end - start);
      }
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
  write_manifest(tmp, m);
  commit(dst_dir, tag, tmp, 0);
}

// ---- safetensors ---------------------------------------------------------------------------

namespace {

bool is_conv1d(const std::string& name) {
  for (const char* suffix : {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"}) {
    std::string s = suffix;
    if (name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) return true;
  }
  return false;
}

const std::map<c10::ScalarType, std::string>& safetensors_types() {
  static const std::map<c10::ScalarType, std::string> types = {
      {torch::kFloat32, "F32"}, {torch::kFloat64, "F64"}, {torch::kFloat16, "F16"}, {torch::kBFloat16, "BF16"},
      {torch::kInt64, "I64"},   {torch::kInt32, "I32"},   {torch::kUInt8, "U8"},    {torch::kBool, "BOOL"}};
  return types;
}

}  // namespace

void write_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors, bool hf_gpt2) {
  nlohmann::json header = {{"__metadata__", {{"format", "pt"}, {"producer", "partrain"}}}};
  std::vector<torch::Tensor> blobs;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {  // std::map: sorted names, as safetensors writes them
    auto value = t.detach().to(torch::kCPU);
    if (hf_gpt2 && is_conv1d(name)) value = value.t();
    value = value.contiguous();
    auto type = safetensors_types().find(value.scalar_type());
    TORCH_CHECK(type != safetensors_types().end(), "safetensors: tensor '", name, "' has unsupported dtype ",
                value.scalar_type());
    header[name] = {{"dtype", type->second}, {"shape", value.sizes().vec()},
                    {"data_offsets", {offset, offset + value.nbytes()}}};
    offset += value.nbytes();
    blobs.push_back(value);
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text += ' ';  // data starts 8-byte aligned
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out, "cannot write '", tmp, "': ", std::strerror(errno));
    uint64_t n = text.size();
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));  // little-endian
    out.write(reinterpret_cast<const char*>(len), 8);
    out << text;
    for (const auto& b : blobs) out.write(static_cast<const char*>(b.data_ptr()), static_cast<std::streamsize>(b.nbytes()));
    out.flush();
    TORCH_CHECK(out, "writing '", tmp, "' failed");
  }
  fsync_path(tmp);
  rename_or_fail(tmp, path);
}

std::map<std::string, torch::Tensor> read_safetensors(const std::string& path, bool hf_gpt2) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  TORCH_CHECK(in, "cannot read '", path, "': ", std::strerror(errno));
  const uint64_t size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  unsigned char len[8] = {};
  TORCH_CHECK(size >= 8 && in.read(reinterpret_cast<char*>(len), 8), "'", path, "' is not a safetensors file (too short)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  TORCH_CHECK(n <= size - 8 && n < (100u << 20), "'", path, "' is not a safetensors file (header of ", n, " bytes)");
  std::string text(n, '\0');
  in.read(&text[0], static_cast<std::streamsize>(n));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "'", path, "': the safetensors header is not JSON (", e.what(), ")");
  }
  TORCH_CHECK(header.is_object(), "'", path, "': the safetensors header is not an object");
  const uint64_t data_start = 8 + n, data_bytes = size - data_start;
  std::map<c10::ScalarType, std::string> types = safetensors_types();
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    try {
      std::string dtype = info.at("dtype").get<std::string>();
      auto shape = info.at("shape").get<std::vector<int64_t>>();
      auto offsets = info.at("data_offsets").get<std::vector<uint64_t>>();
      auto type = std::find_if(types.begin(), types.end(), [&](const auto& kv) { return kv.second == dtype; });
      TORCH_CHECK(type != types.end(), "unsupported dtype ", dtype);
      auto t = torch::empty(shape, torch::TensorOptions().dtype(type->first));
      TORCH_CHECK(offsets.size() == 2 && offsets[0] <= offsets[1] && offsets[1] <= data_bytes &&
                      offsets[1] - offsets[0] == t.nbytes(),
                  "its data_offsets do not fit its shape and the file");
      in.seekg(static_cast<std::streamoff>(data_start + offsets[0]));
      in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
      TORCH_CHECK(in, "the file is truncated");
      std::string key = name;
      if (hf_gpt2 && key.rfind("transformer.", 0) == 0) key = key.substr(12);
      if (hf_gpt2 && is_conv1d(key)) t = t.t().contiguous();
      out[key] = t;
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "'", path, "': tensor '", name, "': ", compat::message_of(e));
    }
  }
  return out;
}

}  // namespace partrain::ckpt
