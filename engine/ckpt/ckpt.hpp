// Sharded checkpoints keyed by logical tensor, written atomically, and loadable under any layout.
//
// A checkpoint is a folder per tag (DIR/step-00000010) holding a manifest (cereal, binary, behind
// a header with its length and CRC-32), a summary for people, and one data file per writing rank.
// Every stored piece is a box of a logical tensor (the serial model's shape, never padding), so
// loading under another mesh reads the pieces that overlap what the rank now holds. DIR/newest
// names the newest complete tag (with its own CRC-32); a load without a tag takes the valid tag
// with the highest step, says why when that is not the one `newest` names, and falls back past
// damaged ones. Every size read from a file is bounded before anything is allocated, and only
// regular files and real folders inside DIR are ever opened.
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

namespace partrain::models {
struct HfNames;
}

namespace partrain::ckpt {

/// 4: the manifest file is a header (magic, version, payload length, CRC-32 of the payload) and
/// the payload; a split tensor records the sizes of the parts its dimension is made of; the
/// pipeline that saved it is recorded (PipelineLayout). Versions 3 (no pipeline layout) and 2
/// (a count of equal parts instead of their sizes) are read; version 1 (no checksum of the
/// manifest) is refused. Version 5 adds the optimizer's loss-scaler state (version 4 has none),
/// version 6 each rank's CUDA generator state, version 7 the model's configuration, version 8 the
/// step counts of parameters whose optimizer state took fewer steps than the optimizer, version 9
/// settings that are names (an MLP's activation) beside the numbers.
constexpr uint32_t kFormatVersion = 9;
/// The oldest format this partrain reads.
constexpr uint32_t kOldestReadableFormat = 2;

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
  /// The sizes the split dimension is made of, each split across the group on its own (q, k and
  /// v: 3 parts, of unequal sizes under grouped-query attention); empty: one part.
  std::vector<int64_t> parts;
  std::vector<Piece> pieces;
};

struct FileEntry {
  std::string name;
  uint64_t bytes = 0;
  uint32_t crc32 = 0;  ///< zlib's CRC-32 of the whole file
};

/// The pipeline stages a checkpoint was saved from, for information (inspect, convert): a load
/// finds every tensor by its logical name, whatever stages saved it or hold it now.
struct PipelineLayout {
  std::string schedule;                  ///< its name ("1f1b"); "" when not known (convert)
  int32_t chunks = 1;                    ///< model chunks a rank
  std::string blocks;                    ///< the container of the blocks ("h")
  std::vector<std::string> first, last;  ///< the root's children on the first and last stages
  /// pipeline x chunks + 1 block indices: virtual stage s holds blocks [bounds[s], bounds[s+1]);
  /// empty without a pipeline.
  std::vector<int64_t> bounds;
};

/// A parameter whose optimizer state took fewer steps than the optimizer (it had no gradient on
/// the others, and Adam skipped it): its bias correction reads its own count.
struct ParamSteps {
  std::string name;  ///< the parameter's logical name
  int64_t steps = 0;
};

/// One setting of the configuration of the model that saved a checkpoint (nn::ConfigField).
struct ConfigEntry {
  std::string name;
  double value = 0;
  std::string text;  ///< a setting that is a name (format 9 on); empty for a number
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
  PipelineLayout stages;         ///< format 4 on; empty bounds: saved without a pipeline
  /// Format 5 on: the optimizer's loss scaler (scale, good steps, hysteresis, skipped steps);
  /// empty when it had none.
  std::vector<double> loss_scale;
  /// Format 6 on: each saving rank's CUDA generator state (of its device), empty for a rank that
  /// computed on the CPU.
  std::vector<std::string> cuda_rng;
  /// Format 7 on: the model's configuration (nn::Module::config(): GPT-2's and LLaMA's options),
  /// shown by inspect; a load refuses a model whose fixed settings (heads) differ from it. Empty
  /// for a model that has none, and before format 7 (nothing is compared).
  std::vector<ConfigEntry> config;
  /// Format 8 on: the parameters whose optimizer state took fewer steps than optimizer_steps;
  /// every other one with state took them all. Before format 8 none is recorded (a load gives
  /// every parameter the optimizer's count).
  std::vector<ParamSteps> param_steps;
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
  std::string tag;         ///< default: step-<step, 8 digits>; else 1-128 of [A-Za-z0-9._-], not 'newest'
  bool full = false;       ///< consolidate: rank 0 writes every logical tensor whole
  int num_kept = 0;        ///< keep only the newest this many valid tags (0: all)
  bool overwrite = false;  ///< replace a valid checkpoint already saved under the tag (else refused)
};

struct Saved {
  std::string tag;
  std::vector<std::string> notes;  ///< what the save did besides saving (a damaged tag set aside)
};
/// Saves collectively (every rank of the world calls it). Writes DIR/.<tag>.tmp, flushes every
/// file to disk, renames it to DIR/<tag>, then points DIR/newest at it. Never writes over a
/// checkpoint: a valid one under the tag is refused unless `overwrite`, a damaged one is moved
/// aside to DIR/<tag>~damaged (kept, named in the notes).
Saved save(const std::string& dir, const State& state, const SaveOptions& options);

struct Loaded {
  std::string tag;
  int64_t step = 0;
  std::string user_json;
  std::vector<std::string> notes;  ///< why this tag and not the one `newest` names, and what was skipped
};
/// Loads `tag` into `state`'s model, optimizer, data loader and RNG, whatever layout saved it.
/// Without a tag, the valid checkpoint with the highest step (see choose()), falling back past a
/// damaged one. Every rank reads and checks everything it needs, and the ranks agree that all of
/// them have, before any rank changes anything, so a failed load leaves the state as it was on
/// every rank. Damage or a mismatch is an error naming the file and the tensor. Collective: all
/// ranks take the same tag or fail together.
Loaded load(const std::string& dir, const std::string& tag, State& state);
/// load(dir, "", state), except that a folder with no checkpoint at all (missing, or holding no
/// `newest` and no tag folder) returns false: a fresh start. A folder whose every checkpoint is
/// damaged is an error, never a fresh start over it.
bool resume(const std::string& dir, State& state, Loaded* loaded);

/// The tag DIR/newest names when the file is intact and names a safe tag, else "".
std::string newest(const std::string& dir);
/// The tags in DIR whose manifests are valid, oldest (lowest step) first.
std::vector<std::string> tags(const std::string& dir);
/// The tags a load without a tag tries, in order: valid manifests by step, highest first (on equal
/// steps the one `newest` names first), with notes on `newest` when it is missing, damaged or
/// not the first. `found`: whether DIR holds anything that looks like a checkpoint.
struct Choice {
  std::vector<std::string> tags;
  std::vector<std::string> notes;
  bool found = false;
};
Choice choose(const std::string& dir);
/// Reads a tag folder's manifest: header, length, CRC-32, then the payload through a bounded
/// parser, then validate().
Manifest read_manifest(const std::string& tag_dir);
/// Checks a parsed manifest as a whole (`path` names it in errors): known dtypes, bounded shapes,
/// pieces inside their tensors and files, tiling each tensor and each file exactly, file CRCs
/// that match their pieces', safe file names, sane step, layout, optimizer and data position.
void validate(const Manifest& manifest, const std::string& path);
/// Every problem with a tag folder (its manifest, missing, altered or misplaced files, every
/// piece's checksum), one a line; empty when it is sound. What load refuses, verify reports.
std::vector<std::string> verify(const std::string& tag_dir);
/// One line of verify_folder's report.
struct Finding {
  std::string path, message;
  bool problem = false;
};
/// A checkpoint folder checked whole: every tag, `newest`, links and other entries where tags
/// live, damaged tags set aside by a save.
std::vector<Finding> verify_folder(const std::string& dir);
/// For people: step, layout, data position, files and every tensor with its pieces.
std::string describe(const Manifest& manifest);
/// A logical tensor assembled from its pieces.
torch::Tensor read_tensor(const std::string& tag_dir, const Manifest& manifest, const TensorEntry& entry);
/// Group rank `r`'s part of a tensor split as `s` (padding rows zero), read from the pieces that
/// overlap it only.
torch::Tensor read_part(const std::string& tag_dir, const Manifest& manifest, const TensorEntry& entry,
                        const std::vector<int64_t>& local_shape, int64_t dim,
                        const std::vector<std::pair<int64_t, int64_t>>& slices);
/// Rewrites a checkpoint as a run at tensor x data x pipeline would have saved it (offline
/// resharding). The stages split the blocks uniformly (one chunk a rank); the blocks' container
/// and the first and last stages' modules come from the pipeline the checkpoint records, else
/// from its tensor names (the one top-level name followed by block numbers; what comes before it
/// in the manifest is first, what comes after is last).
void convert(const std::string& src_tag_dir, const std::string& dst_dir, int tensor, int data, int pipeline = 1);

// ---- safetensors (Hugging Face) ------------------------------------------------------------

/// Writes logical tensors as a .safetensors file. With a model family's Hugging Face names `hf`
/// (models/registry.hpp), tensors take Hugging Face's names, those it stores transposed (GPT-2's
/// Conv1D weights: c_attn, c_proj, c_fc, [in, out]) are written so, and stacked ones are cut into
/// the slices it stores apart (Mixtral's experts.w1 [E, ffn, dim] as E experts.M.w1.weight
/// [ffn, dim]); without, as they are.
void write_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                       const models::HfNames* hf);
/// Reads a .safetensors file, refusing (with the tensor named) anything but a regular file whose
/// header is one JSON object without duplicate keys, each tensor a known dtype, a shape of
/// non-negative integers and integer data_offsets matching it, the tensors' bytes tiling the
/// data exactly (no overlap, hole or trailing byte). With `hf`, names map to partrain's (GPT-2:
/// a "transformer." prefix dropped, refusing a file that has a name both ways), transposed
/// weights turn back to [out, in], and slices stack (Mixtral's experts.M.w1.weight for M = 0..n-1,
/// each once, of one shape and dtype, into experts.w1 [n, ...]; a hole in the numbering, a
/// slice named twice or slices that differ are refused, naming them).
std::map<std::string, torch::Tensor> read_safetensors(const std::string& path, const models::HfNames* hf);
/// Reads Hugging Face's sharded layout from its index (model.safetensors.index.json: a weight_map
/// of tensor name -> file): each file a plain name beside the index, read as read_safetensors
/// reads one, holding exactly the tensors the map puts there.
std::map<std::string, torch::Tensor> read_safetensors_index(const std::string& index_path, const models::HfNames* hf);
/// Writes Hugging Face's sharded layout into the folder `dir`: model-0000N-of-0000M.safetensors
/// files of at most `max_shard_bytes` of tensors each (in name order; a larger tensor alone), and
/// model.safetensors.index.json.
void write_safetensors_sharded(const std::string& dir, const std::map<std::string, torch::Tensor>& tensors,
                               const models::HfNames* hf, int64_t max_shard_bytes);

}  // namespace partrain::ckpt
