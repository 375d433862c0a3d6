// Sharded checkpoints keyed by logical tensor, written atomically, and loadable under any layout.
//
// A checkpoint is a folder per tag (DIR/step-00000010) holding a manifest (cereal, binary), a
// summary for people, and one data file per writing rank. Every stored piece is a box of a
// logical tensor (the serial model's shape, never padding), so loading under another mesh reads
// the pieces that overlap what the rank now holds. DIR/newest names the newest complete tag.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace partrain::nn {
class Module;
}
namespace partrain::optim {
class Optimizer;
}
namespace partrain::data {
class Loader;
}
namespace partrain::dist {
class Mesh;
}

namespace partrain::ckpt {

constexpr uint32_t kFormatVersion = 1;

/// A box of a logical tensor stored in one data file.
struct Piece {
  int32_t file = 0;               ///< index into Manifest::files
  uint64_t offset = 0, bytes = 0;  ///< where in the file
  std::vector<int64_t> start, size;  ///< the box: per dimension, first index and extent
  uint32_t crc32 = 0;                ///< of the piece's bytes, checked whenever it is read
};

/// A logical tensor: "model/<parameter>" or "optim/<parameter>/<slot>".
struct TensorEntry {
  std::string name, dtype;
  std::vector<int64_t> shape;  ///< logical
  int32_t dim = -1;            ///< the dimension it was split on when saved (-1: whole)
  int64_t fused = 1;           ///< fused parts of that dimension (q, k, v: 3)
  std::vector<Piece> pieces;
};

struct FileEntry {
  std::string name;
  uint64_t bytes = 0;
  uint32_t crc32 = 0;  ///< zlib's CRC-32 of the whole file
};

struct Manifest {
  uint32_t version = kFormatVersion;
  int64_t step = 0;
  int32_t world = 1, tensor = 1, data = 1, pipeline = 1, zero = 1;  ///< the layout that saved it
  std::string model_type, policy, optimizer;  ///< optimizer: its kind ("" when none was saved)
  int64_t optimizer_steps = 0;
  int64_t samples_seen = -1;  ///< the data position as a global sample index (-1: none saved)
  std::string user_json;      ///< the user's table, as JSON
  bool full = false;          ///< one consolidated set of logical tensors (else per-rank shards)
  std::vector<TensorEntry> tensors;
  std::vector<FileEntry> files;
  std::vector<std::string> rng;  ///< each saving rank's CPU generator state
  const TensorEntry* find(const std::string& name) const;
};

/// What a save stores and a load fills.
struct State {
  nn::Module* model = nullptr;
  optim::Optimizer* optimizer = nullptr;  ///< may be null
  data::Loader* data = nullptr;           ///< may be null
  const dist::Mesh* mesh = nullptr;       ///< null: data parallel over the world (or one rank)
  int64_t step = 0;
  std::string user_json = "{}";
  std::string policy;
};

struct SaveOptions {
  std::string tag;   ///< default: step-<step, 8 digits>
  bool full = false;  ///< consolidate: rank 0 writes every logical tensor whole
  int num_kept = 0;   ///< keep only the newest this many tags (0: all)
};

/// Saves collectively (every rank of the world calls it). Writes DIR/<tag>.tmp, flushes every
/// file to disk, renames it to DIR/<tag>, then points DIR/newest at it. Returns the tag.
std::string save(const std::string& dir, const State& state, const SaveOptions& options);

struct Loaded {
  std::string tag;
  int64_t step = 0;
  std::string user_json;
};
/// Loads `tag` (default: the newest) into `state`'s model, optimizer, data loader and RNG,
/// whatever layout saved it. Verifies magic, version, sizes and checksums of what it reads; any
/// damage or mismatch is an error naming the file and tensor. Collective: all ranks fail together.
Loaded load(const std::string& dir, const std::string& tag, State& state);

/// The tag DIR/newest names ("" when DIR holds no checkpoint).
std::string newest(const std::string& dir);
/// The complete tags in DIR, oldest first.
std::vector<std::string> tags(const std::string& dir);
/// Reads and checks a tag folder's manifest (magic, version).
Manifest read_manifest(const std::string& tag_dir);
/// Every problem with a tag folder (missing or altered files, pieces outside their files or not
/// covering their tensors), one a line; empty when it is sound.
std::vector<std::string> verify(const std::string& tag_dir);
/// For people: step, layout, data position, files and every tensor with its pieces.
std::string describe(const Manifest& manifest);
/// A logical tensor assembled from its pieces.
torch::Tensor read_tensor(const std::string& tag_dir, const Manifest& manifest, const TensorEntry& entry);
/// Group rank `r`'s part of a tensor split as `s` (padding rows zero), read from the pieces that
/// overlap it only.
torch::Tensor read_part(const std::string& tag_dir, const Manifest& manifest, const TensorEntry& entry,
                        const std::vector<int64_t>& local_shape, int64_t dim,
                        const std::vector<std::pair<int64_t, int64_t>>& slices);
/// Rewrites a checkpoint as a run at tensor x data would have saved it (offline resharding).
void convert(const std::string& src_tag_dir, const std::string& dst_dir, int tensor, int data);

// ---- safetensors (Hugging Face) ------------------------------------------------------------

/// Writes logical tensors as a .safetensors file. With `hf_gpt2`, Conv1D weights (c_attn, c_proj,
/// c_fc) are stored transposed, [in, out], as Hugging Face's GPT-2 has them.
void write_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors, bool hf_gpt2);
/// Reads a .safetensors file (checking its header against its size); `hf_gpt2` transposes the
/// Conv1D weights back to [out, in] and drops a "transformer." prefix.
std::map<std::string, torch::Tensor> read_safetensors(const std::string& path, bool hf_gpt2);

}  // namespace partrain::ckpt
