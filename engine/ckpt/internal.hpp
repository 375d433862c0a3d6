// What the checkpoint files share inside engine/ckpt: bounds on what a manifest may claim, the
// state of a checkpoint folder, failing together across ranks, data files and the steps of a
// save. Not for use elsewhere.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/ckpt/ckpt.hpp"
#include "engine/dist/process_group.hpp"
#include "engine/util/files.hpp"
#include "engine/util/jsonl.hpp"
#include "engine/util/text.hpp"

namespace partrain::parallel {
struct Sharding;
}

namespace partrain::ckpt::internal {

// ---- Bounds on what a manifest may claim (far beyond any real run, far below any harm) --------

constexpr int kMaxRank = 16;                           // dimensions of a tensor
constexpr int64_t kMaxElements = int64_t(1) << 48;     // of one tensor
constexpr int64_t kMaxCount = int64_t(1) << 53;        // steps, samples: exact in a Lua number
constexpr uint64_t kMaxFileBytes = uint64_t(1) << 52;  // of one data file
constexpr int kMaxWorld = 1 << 20;
using util::kMaxJsonDepth;  // of the user table and of a safetensors header
using util::json_depth;
using util::join_path;

// ---- The manifest's contents (manifest.cpp) ---------------------------------------------------

uint32_t crc_of(const void* data, size_t n);
/// A CRC-32 as 8 hex digits.
std::string hex32(uint32_t x);
/// The number of elements of `size`, or -1 when it passes kMaxElements (or a size is negative).
int64_t volume(const std::vector<int64_t>& size);
/// The dtypes a checkpoint stores, by the names it records them under.
const std::map<std::string, c10::ScalarType>& dtypes();
c10::ScalarType parse_dtype(const std::string& name);
/// "[2, 3]".
std::string shape_text(const std::vector<int64_t>& v);
/// "a GPT2", "an MLP": a model type with its article, an acronym read letter by letter.
std::string with_article(const std::string& type);
/// A recorded setting as it is written in a model's options: the name, or the number.
std::string setting_text(double value, const std::string& text);
void check_tag(const std::string& tag);
/// Writes TAG_DIR/manifest.bin and its summary.txt, and flushes the folder.
void write_manifest(const std::string& tag_dir, const Manifest& m);

// ---- The checkpoint folder (folder.cpp) -------------------------------------------------------
//
// DIR/newest is two lines: the tag, then "crc32 <8 hex digits>" of the tag's bytes.

struct NewestState {
  bool present = false;
  std::string tag;      // when intact
  std::string problem;  // when present but not intact
};

struct TagState {
  std::string name;
  bool valid = false;
  int64_t step = -1;
  std::string problem;  // when not valid
};

struct Folder {
  bool exists = false;
  NewestState newest;
  std::vector<TagState> tags;        // valid and damaged, in directory order
  std::vector<std::string> aside;    // <tag>~damaged... folders a save set aside
  std::vector<std::string> scratch;  // .<tag>.tmp folders of interrupted saves
};

void write_newest(const std::string& dir, const std::string& tag);
/// The state of DIR/<name> as a tag: a real folder with a valid manifest, or why not.
TagState tag_state(const std::string& dir, const std::string& name);
/// What DIR holds: its 'newest' file, its tags (valid or damaged), and what saves left beside them.
Folder scan(const std::string& dir);
/// The tags of `f` (the folder DIR) a load without a tag tries, in order, and why.
Choice choose_in(const Folder& f, const std::string& dir);

// ---- Damage, and failing together (ranks.cpp) -------------------------------------------------

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

/// Runs `fn` on every rank and fails on all of them if it failed on any: a rank that failed
/// reports its own error, the others the first failing rank's. Damage stays damage when every
/// failing rank saw damage.
void together(const dist::GroupPtr& group, const std::string& what, const std::function<void()>& fn);

// This rank's parameters with their logical names (what checkpoints key them by), each once, in
// module order. On a pipeline rank a tensor tied across stages takes the serial model's first
// name (GPT-2's last stage holds wte.weight as lm_head.weight); `first` says whether this rank
// is the first pipeline rank holding it (the one that saves it).
struct Held {
  std::string logical, local;
  torch::Tensor param;
  bool first = true;
};
std::vector<Held> held(const nn::Module& model);

// ---- Data files (save.cpp, load.cpp) ----------------------------------------------------------

// A data file written front to back into a fresh folder, its CRC-32 kept as it goes.
class DataFile {
 public:
  explicit DataFile(std::string path);
  ~DataFile();
  DataFile(const DataFile&) = delete;
  DataFile& operator=(const DataFile&) = delete;
  // Appends the tensor's bytes; returns where they start, and their own CRC-32 in `crc`.
  uint64_t write(const torch::Tensor& t, uint32_t* crc);
  FileEntry finish(const std::string& name);

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t offset_ = 0;
  unsigned long crc_;  // zlib's uLong
};

/// Appends `local` (this rank's part of a tensor split as `s`, or the whole tensor) as pieces.
void add_pieces(DataFile& file, TensorEntry& e, const torch::Tensor& local, const parallel::Sharding* s,
                int32_t file_index);
/// Opens a data file of a tag folder: a regular file, not a link, of the size the manifest records.
int open_data_file(const std::string& tag_dir, const FileEntry& f);

// ---- The steps of a save (save.cpp) -----------------------------------------------------------

// What is at DIR/<tag> before a save puts a checkpoint there. A valid manifest is enough when
// the save overwrites it anyway (`full`: false); otherwise every byte is checked, since a valid
// checkpoint is refused and a damaged one kept aside.
enum class Existing { None, Valid, Damaged };
Existing existing(const std::string& dir, const std::string& tag, std::string* problem, bool full = true);
std::string refuse_existing(const std::string& dir, const std::string& tag);
/// Moves a finished `tmp` folder to DIR/<tag>, points DIR/newest at it, and keeps `num_kept`.
void commit(const std::string& dir, const std::string& tag, const std::string& tmp, int num_kept, bool overwrite,
            std::vector<std::string>* notes);
/// Makes DIR (when missing) and a fresh scratch folder DIR/.<tag>.tmp for a save of `tag`.
std::string scratch_folder(const std::string& dir, const std::string& tag);

}  // namespace partrain::ckpt::internal
