// Datasets and the batch loader: an IDX reader (gzip or plain) for MNIST-style data, a
// memory-mapped token corpus (bytes of text, or pre-tokenized ids), and a loader with a seeded, reproducible shuffle that
// can hand each data-parallel rank its slice of the global batch.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace partrain::data {

using torch::Tensor;

/// Reads an IDX file (gzip-compressed or not) into a tensor of the stored type and shape.
/// Missing, truncated or malformed files are errors that name the file.
Tensor read_idx(const std::string& path);

/// A finite, indexable set of samples; batch() stacks the samples at `indices`.
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  /// Returns the batch as tensors whose first dimension is indices.size() (inputs, targets).
  virtual std::vector<Tensor> batch(const std::vector<int64_t>& indices) const = 0;
  virtual std::string describe() const = 0;
};

struct MnistOptions {
  std::string root = "/usr/share/datasets/fashion-mnist";  ///< folder of the four IDX files
  std::string split = "train";                             ///< "train" or "test"
};

/// MNIST-format images as float (N, 784) scaled to [0, 1] and labels as int64 (N).
class Mnist : public Dataset {
 public:
  explicit Mnist(const MnistOptions& options);
  int64_t size() const override { return labels.size(0); }
  std::vector<Tensor> batch(const std::vector<int64_t>& indices) const override;
  std::string describe() const override;
  Tensor images, labels;
  MnistOptions options;
};

struct TextOptions {
  std::string path;   ///< the corpus file
  int64_t seq = 128;  ///< tokens per sample
  /// How tokens are stored: uint8 (bytes: a text corpus), uint16 or int32 (little-endian, a
  /// pre-tokenized corpus: llm.c's and nanoGPT's .bin files).
  enum class Storage { UInt8, UInt16, Int32 } dtype = Storage::UInt8;
  /// Bytes before the first token: -1 reads llm.c's header when the file starts with its magic
  /// number (256 int32s: 20240520, version 1, token count) and none otherwise; 0 none; n > 0 skips n.
  int64_t header = 0;
  /// The part of the tokens used, as fractions [begin, end) of them (a train/validation split).
  double begin = 0, end = 1;
};

/// A token corpus, memory-mapped: bytes (a text file) or pre-tokenized ids. Sample i is the window
/// starting at token i*seq of the part used: inputs are its seq tokens, targets the same shifted
/// by one; both int64 (B, seq).
class Text : public Dataset {
 public:
  explicit Text(const TextOptions& options);
  ~Text() override;
  Text(const Text&) = delete;
  Text& operator=(const Text&) = delete;
  int64_t size() const override;
  std::vector<Tensor> batch(const std::vector<int64_t>& indices) const override;
  std::string describe() const override;
  int64_t bytes() const { return static_cast<int64_t>(length_); }
  /// Tokens in the part used.
  int64_t tokens() const { return last_ - first_; }
  /// Bytes [offset, offset+count) of the file.
  std::string slice(int64_t offset, int64_t count) const;
  TextOptions options;

 private:
  const uint8_t* data_ = nullptr;
  size_t length_ = 0;
  int64_t first_ = 0, last_ = 0;  // the tokens used: [first_, last_) of the file's tokens
  int64_t header_ = 0;            // bytes before token 0
};

struct LoaderOptions {
  int64_t batch = 32;         ///< global batch size (all data-parallel ranks together)
  bool shuffle = true;        ///< reshuffle every epoch from (seed, epoch)
  uint64_t seed = 0;          ///< the shuffle's seed
  bool drop_last = true;      ///< skip a last batch smaller than `batch`
  int64_t shard_rank = 0;     ///< this rank's slice of each global batch...
  int64_t shard_count = 1;    ///< ...out of this many equal slices
  /// Context parallelism: each sample's sequence (dimension 2 of every batch tensor) split over
  /// `context_count` ranks, this one keeping its early and late chunk (util/zigzag.hpp).
  int64_t context_rank = 0;
  int64_t context_count = 1;
  torch::Device device = torch::kCPU;  ///< where batches land (the rank's device)
};

/// Walks a dataset in batches, epoch after epoch. Given the same options it yields the same
/// batches; a rank with shard (r, n) gets slice r of the n equal slices of each global batch, and
/// with context (q, c) its two chunks of each sample's sequence: positions chunk q and chunk
/// 2c-1-q of 2c equal chunks. Targets shifted by one are made whole before the split, so a
/// chunk's last target is the next chunk's first token.
class Loader {
 public:
  Loader(std::shared_ptr<Dataset> dataset, LoaderOptions options);

  /// The next batch (this rank's slice); moves to the next epoch when one ends.
  std::vector<Tensor> next();
  /// Whether the current epoch has batches left.
  bool has_next() const { return position_ < batches_per_epoch(); }
  /// Starts the next epoch (or epoch `epoch`) from its first batch.
  void start_epoch(int64_t epoch);

  int64_t batches_per_epoch() const;
  int64_t epoch() const { return epoch_; }
  int64_t position() const { return position_; }
  /// Global samples consumed since epoch 0 began.
  int64_t samples_seen() const;
  /// Goes to where samples_seen() == `samples` (a checkpoint's data position): the same batches
  /// follow as after that many samples, whatever the data-parallel size.
  void seek(int64_t samples);
  /// Where seek(`samples`) lands, as samples_seen() then: `samples` itself, or fewer when it is
  /// not a whole number of this loader's batches into its epoch (a run resumed with another
  /// batch size: the batch that holds it is taken again).
  int64_t seek_lands_at(int64_t samples) const;
  /// The first place past `samples` that seek() reaches exactly: the next batch's start, or the
  /// end of the epoch (the next one's start) when the batch holding `samples` ends it.
  int64_t seek_next_after(int64_t samples) const;
  /// Goes back to batch `position` of `epoch` exactly (what pt.evaluate puts back after using
  /// the loader: an epoch's end stays its end, where seek(samples_seen()) would begin the next).
  void set_place(int64_t epoch, int64_t position);
  /// The order in which `epoch` visits the dataset.
  std::vector<int64_t> order(int64_t epoch) const;
  const LoaderOptions& options() const { return options_; }
  Dataset& dataset() { return *dataset_; }

 private:
  int64_t samples_per_epoch() const;  // what one epoch visits: whole batches only with drop_last
  std::shared_ptr<Dataset> dataset_;
  LoaderOptions options_;
  int64_t epoch_ = 0;
  int64_t position_ = 0;  // batches consumed in this epoch
  std::vector<int64_t> order_;
};

}  // namespace partrain::data
