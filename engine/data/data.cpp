// Datasets and the loader (see data.hpp).
#include "engine/data/data.hpp"

#include "engine/compat.hpp"
#include "engine/util/zigzag.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>

#include "engine/util/files.hpp"

namespace partrain::data {

namespace {

std::string errno_text() { return std::strerror(errno); }

// The most data an IDX file may hold once inflated: far above MNIST's 47 MB, far below a gzip bomb.
constexpr size_t kMaxInflated = size_t(4) << 30;

// A gzip or plain file (zlib reads both) read front to back: a regular file only (a FIFO or a
// device would block or never end). Each read is checked: a damaged stream is an error, and so is
// one cut short, which gzread itself reports as a plain end of file.
class Inflating {
 public:
  explicit Inflating(const std::string& path) : path_(path) {
    int fd = util::open_regular(path, "dataset file");
    struct stat st {};
    if (::fstat(fd, &st) == 0) file_bytes_ = static_cast<uint64_t>(st.st_size);
    file_ = gzdopen(fd, "rb");
    if (!file_) ::close(fd);
    TORCH_CHECK(file_, "cannot open '", path, "': ", errno_text());
  }
  ~Inflating() { gzclose(file_); }
  Inflating(const Inflating&) = delete;
  Inflating& operator=(const Inflating&) = delete;

  /// Reads up to `count` bytes into `out`; fewer only at the end of the data.
  size_t read(uint8_t* out, size_t count) {
    size_t got = 0;
    while (got < count) {
      const unsigned ask = static_cast<unsigned>(std::min<size_t>(count - got, 1u << 30));
      const int n = gzread(file_, out + got, ask);
      int err = Z_OK;
      const char* message = gzerror(file_, &err);
      TORCH_CHECK(n >= 0, "cannot read '", path_, "': ", message);
      TORCH_CHECK(err != Z_BUF_ERROR, "'", path_, "' is cut short: its gzip stream ends before its checksum (",
                  message, ")");
      if (n == 0) break;
      got += static_cast<size_t>(n);
    }
    return got;
  }

  /// Whether the file is read as it is (no gzip magic), known after the first read: then its
  /// size bounds what it can hold.
  bool plain() { return gzdirect(file_) == 1; }
  uint64_t file_bytes() const { return file_bytes_; }

  /// Counts the bytes left (none are kept), stopping once past `limit`.
  size_t skip_rest(size_t limit) {
    uint8_t chunk[1 << 16];
    size_t total = 0, n;
    while (total <= limit && (n = read(chunk, sizeof chunk)) > 0) total += n;
    return total;
  }

 private:
  std::string path_;
  gzFile file_ = nullptr;
  uint64_t file_bytes_ = 0;
};

uint32_t big_endian(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | uint32_t(p[3]);
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

Tensor read_idx(const std::string& path) {
  // Read as a stream, straight into the tensor: the header first, then exactly the data it
  // promises (bounded before anything is allocated), then a check that nothing follows.
  Inflating in(path);
  uint8_t head[4 + 4 * 255];
  const size_t got = in.read(head, 4);
  TORCH_CHECK(got == 4 && head[0] == 0 && head[1] == 0, "'", path, "' is not an IDX file (bad magic number)");
  torch::ScalarType type;
  size_t width;
  switch (head[2]) {
    case 0x08: type = torch::kUInt8; width = 1; break;
    case 0x09: type = torch::kInt8; width = 1; break;
    case 0x0B: type = torch::kInt16; width = 2; break;
    case 0x0C: type = torch::kInt32; width = 4; break;
    case 0x0D: type = torch::kFloat32; width = 4; break;
    case 0x0E: type = torch::kFloat64; width = 8; break;
    default: TORCH_CHECK(false, "'", path, "' has unknown IDX element type 0x", std::hex, int(head[2]));
  }
  const size_t ndim = head[3];
  TORCH_CHECK(ndim >= 1 && in.read(head + 4, 4 * ndim) == 4 * ndim, "'", path, "' is truncated (header)");
  std::vector<int64_t> shape;
  for (size_t d = 0; d < ndim; ++d) shape.push_back(big_endian(&head[4 + 4 * d]));
  // A dimension of 0 anywhere makes an empty tensor, whatever the others say; the others must
  // still make sizes and strides a tensor can count (LibTorch multiplies them in int64).
  int64_t extent = 1;
  for (int64_t d : shape)
    TORCH_CHECK(!__builtin_mul_overflow(extent, std::max<int64_t>(d, 1), &extent), "'", path,
                "' is corrupt: its dimensions ", c10::IntArrayRef(shape), " are past what a tensor can count");
  size_t bytes = std::count(shape.begin(), shape.end(), 0) ? 0 : width;
  for (size_t d = 0; d < ndim && bytes > 0; ++d)
    TORCH_CHECK(!__builtin_mul_overflow(bytes, static_cast<size_t>(shape[d]), &bytes) && bytes <= kMaxInflated,
                "'", path, "' is corrupt or not a dataset partrain reads: its header promises more than ",
                kMaxInflated >> 30, " GiB of data");
  // A plain file's size bounds its data before anything is allocated (a gzip stream's does not).
  const uint64_t header = 4 + 4 * ndim;
  if (in.plain() && in.file_bytes() >= header)
    TORCH_CHECK(bytes == in.file_bytes() - header, "'", path, "' is truncated or too long: header says ", bytes,
                " bytes of data, file has ", in.file_bytes() - header);
  Tensor out;
  try {
    out = torch::empty(shape, torch::TensorOptions().dtype(type));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "'", path, "' promises ", bytes, " bytes of data, which cannot be allocated: ",
                e.what_without_backtrace());
  }
  auto* data = static_cast<uint8_t*>(out.data_ptr());
  const size_t held = in.read(data, bytes);
  // What follows is counted up to a bound, not inflated to its end (a small file can inflate to
  // gigabytes of zeros).
  constexpr size_t kCounted = size_t(1) << 20;
  const size_t more = held == bytes ? in.skip_rest(kCounted) : 0;
  TORCH_CHECK(held == bytes && more == 0, "'", path, "' is truncated or too long: header says ", bytes,
              " bytes of data, file has ", held + more, more > kCounted ? " or more" : "");
  // IDX stores multi-byte values big-endian.
  if (width > 1)
    for (size_t i = 0; i < bytes; i += width) std::reverse(data + i, data + i + width);
  return out;
}

// ---- Mnist ----------------------------------------------------------------------------------

Mnist::Mnist(const MnistOptions& o) : options(o) {
  TORCH_CHECK(o.split == "train" || o.split == "test", "mnist split must be 'train' or 'test', got '",
              o.split, "'");
  std::string prefix = o.root + "/" + (o.split == "train" ? "train" : "t10k");
  auto raw_images = read_idx(prefix + "-images-idx3-ubyte.gz");
  auto raw_labels = read_idx(prefix + "-labels-idx1-ubyte.gz");
  // MNIST's files hold unsigned bytes: pixels 0-255 and class ids. Another IDX type scaled by 1/255
  // would train on numbers of another range without a word.
  for (const auto& [file, t] : {std::pair{"images", &raw_images}, std::pair{"labels", &raw_labels}})
    TORCH_CHECK(t->scalar_type() == torch::kUInt8, "MNIST ", file, " in '", o.root, "' hold ", t->scalar_type(),
                " values, not unsigned bytes (IDX type 0x08): read other IDX files with pt.data.read_idx");
  TORCH_CHECK(raw_images.dim() == 3 && raw_labels.dim() == 1 &&
                  raw_images.size(0) == raw_labels.size(0),
              "MNIST files in '", o.root, "' disagree: images ", raw_images.sizes(), ", labels ",
              raw_labels.sizes());
  images = raw_images.reshape({raw_images.size(0), raw_images.size(1) * raw_images.size(2)}).to(torch::kFloat32).div_(255.0);  // (N, 784)
  labels = raw_labels.to(torch::kInt64);                                                 // (N)
}

std::vector<Tensor> Mnist::batch(const std::vector<int64_t>& indices) const {
  auto idx = torch::tensor(indices, torch::kInt64);
  return {images.index_select(0, idx), labels.index_select(0, idx)};
}

std::string Mnist::describe() const {
  std::ostringstream s;
  s << "mnist(" << options.root << ", " << options.split << ", " << size() << " samples of " << images.size(1) << ")";
  return s.str();
}

// ---- Text -----------------------------------------------------------------------------------

namespace {
constexpr int32_t kLlmcMagic = 20240520;  // llm.c's token files: 256 int32s, then the tokens
constexpr int64_t kLlmcHeader = 256 * 4;
int64_t width_of(TextOptions::Storage s) {
  return s == TextOptions::Storage::UInt8 ? 1 : s == TextOptions::Storage::UInt16 ? 2 : 4;
}
const char* name_of(TextOptions::Storage s) {
  return s == TextOptions::Storage::UInt8 ? "uint8" : s == TextOptions::Storage::UInt16 ? "uint16" : "int32";
}
int32_t read_i32(const uint8_t* p) {  // little-endian
  return static_cast<int32_t>(uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24);
}
}  // namespace

Text::Text(const TextOptions& o) : options(o) {
  TORCH_CHECK(o.seq > 0, "token corpus: seq must be positive, got ", o.seq);
  TORCH_CHECK(o.header >= -1, "token corpus: header must be -1 (detect llm.c's), 0 or a number of bytes, got ",
              o.header);
  TORCH_CHECK(o.begin >= 0 && o.begin < o.end && o.end <= 1, "token corpus: the part used [", o.begin, ", ", o.end,
              ") must lie in [0, 1] and not be empty");
  int fd = util::open_regular(o.path, "text corpus");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    auto err = errno_text();
    ::close(fd);
    TORCH_CHECK(false, "cannot stat '", o.path, "': ", err);
  }
  length_ = static_cast<size_t>(st.st_size);
  if (length_ == 0) {
    ::close(fd);
    TORCH_CHECK(false, "token corpus '", o.path, "' is empty");
  }
  {
    void* p = ::mmap(nullptr, length_, PROT_READ, MAP_PRIVATE, fd, 0);
    auto err = errno_text();
    ::close(fd);
    TORCH_CHECK(p != MAP_FAILED, "cannot map '", o.path, "': ", err);
    data_ = static_cast<const uint8_t*>(p);
  }
  const int64_t size = static_cast<int64_t>(length_), width = width_of(o.dtype);
  auto fail = [&](const std::string& why) {
    ::munmap(const_cast<uint8_t*>(data_), length_);
    data_ = nullptr;
    TORCH_CHECK(false, "token corpus '", o.path, "' ", why);
  };
  header_ = o.header;
  int64_t stated = -1;  // the token count a header states
  if (o.header == -1) header_ = size >= 4 && read_i32(data_) == kLlmcMagic ? kLlmcHeader : 0;
  if (header_ == kLlmcHeader && size >= kLlmcHeader && read_i32(data_) == kLlmcMagic) {
    if (read_i32(data_ + 4) != 1) fail("has llm.c's header with version " + std::to_string(read_i32(data_ + 4)) +
                                       " (expected 1: uint16 tokens)");
    if (o.dtype != TextOptions::Storage::UInt16) fail("has llm.c's header, whose tokens are uint16: read it with dtype = \"uint16\"");
    stated = read_i32(data_ + 8);
    if (stated < 0) fail("has llm.c's header stating " + std::to_string(stated) + " tokens (expected a count >= 0)");
  }
  if (header_ > size) fail("has " + std::to_string(size) + " bytes, fewer than its header of " + std::to_string(header_));
  if ((size - header_) % width != 0)
    fail("holds " + std::to_string(size - header_) + " bytes after its header, not a whole number of " +
         std::to_string(width) + "-byte tokens");
  const int64_t count = (size - header_) / width;
  if (stated >= 0 && stated != count)
    fail("states " + std::to_string(stated) + " tokens in its header but holds " + std::to_string(count));
  first_ = static_cast<int64_t>(o.begin * static_cast<double>(count));
  last_ = o.end >= 1 ? count : static_cast<int64_t>(o.end * static_cast<double>(count));
  if (last_ - first_ < o.seq + 1)
    fail("has " + std::to_string(last_ - first_) + " tokens in the part used, fewer than seq+1 = " +
         std::to_string(o.seq + 1));
}

Text::~Text() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), length_);
}

int64_t Text::size() const { return (tokens() - 1) / options.seq; }

std::vector<Tensor> Text::batch(const std::vector<int64_t>& indices) const {
  const int64_t seq = options.seq, n = static_cast<int64_t>(indices.size());
  const int64_t width = width_of(options.dtype);
  // uint16 travels as int16 (LibTorch's uint16 has few kernels): the bits, read back unsigned.
  auto storage = options.dtype == TextOptions::Storage::UInt8    ? torch::kUInt8
                 : options.dtype == TextOptions::Storage::UInt16 ? torch::kInt16
                                                                 : torch::kInt32;
  auto window = torch::empty({n, seq + 1}, torch::TensorOptions().dtype(storage));
  auto* dst = static_cast<uint8_t*>(window.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(indices[i] >= 0 && indices[i] < size(), "text sample ", indices[i], " out of range");
    std::memcpy(dst + i * (seq + 1) * width, data_ + header_ + (first_ + indices[i] * seq) * width, (seq + 1) * width);
  }
  auto tokens = window.to(torch::kInt64);
  if (options.dtype == TextOptions::Storage::UInt16) tokens = tokens.bitwise_and(0xffff);
  if (options.dtype == TextOptions::Storage::Int32)
    TORCH_CHECK(tokens.min().item<int64_t>() >= 0, "token corpus '", options.path, "' holds a negative token id");
  return {tokens.narrow(1, 0, seq).contiguous(), tokens.narrow(1, 1, seq).contiguous()};
}

std::string Text::slice(int64_t offset, int64_t count) const {
  TORCH_CHECK(offset >= 0 && count >= 0 && offset + count <= bytes(), "slice [", offset, ", ",
              offset + count, ") is outside the corpus of ", bytes(), " bytes");
  return std::string(reinterpret_cast<const char*>(data_) + offset, count);
}

std::string Text::describe() const {
  std::ostringstream s;
  if (options.dtype == TextOptions::Storage::UInt8 && header_ == 0 && first_ == 0 && last_ == bytes()) {
    s << "text(" << options.path << ", " << length_ << " bytes, " << size() << " samples of " << options.seq << ")";
    return s.str();
  }
  s << "tokens(" << options.path << ", " << name_of(options.dtype) << ", " << tokens() << " tokens";
  if (options.begin > 0 || options.end < 1) s << " [" << options.begin << ", " << options.end << ")";
  s << ", " << size() << " samples of " << options.seq << ")";
  return s.str();
}

// ---- Loader ---------------------------------------------------------------------------------

Loader::Loader(std::shared_ptr<Dataset> dataset, LoaderOptions o)
    : dataset_(std::move(dataset)), options_(o) {
  TORCH_CHECK(dataset_, "loader needs a dataset");
  TORCH_CHECK(o.batch > 0, "batch must be positive, got ", o.batch);
  TORCH_CHECK(o.shard_count >= 1, "shard_count must be 1 or more (the data-parallel slices), got ", o.shard_count);
  TORCH_CHECK(o.shard_rank >= 0 && o.shard_rank < o.shard_count,
              "shard_rank=", o.shard_rank, " must be in [0, shard_count=", o.shard_count, ")");
  TORCH_CHECK(o.context_count >= 1 && o.context_count <= (1 << 20),
              "context_count must be 1 or more (the context-parallel ranks), got ", o.context_count);
  TORCH_CHECK(o.context_rank >= 0 && o.context_rank < o.context_count, "context_rank=", o.context_rank,
              " must be in [0, context_count=", o.context_count, ")");
  TORCH_CHECK(o.batch % o.shard_count == 0, "batch=", o.batch,
              " does not divide into shard_count=", o.shard_count, " equal slices");
  TORCH_CHECK(o.drop_last || o.shard_count == 1 || dataset_->size() % o.batch == 0,
              "drop_last=false with shard_count=", o.shard_count, ": the last batch of ", dataset_->size() % o.batch,
              " samples would split into unequal slices; use drop_last=true or an unsharded loader");
  TORCH_CHECK(!o.drop_last || dataset_->size() >= o.batch, "batch=", o.batch, " is larger than ",
              dataset_->describe());
  start_epoch(0);
}

int64_t Loader::batches_per_epoch() const {
  int64_t n = dataset_->size(), b = options_.batch;
  return options_.drop_last ? n / b : (n + b - 1) / b;
}

std::vector<int64_t> Loader::order(int64_t epoch) const {
  std::vector<int64_t> order(dataset_->size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  if (!options_.shuffle) return order;
  // Fisher-Yates on mt19937_64, whose output sequence the C++ standard fixes, so the order is
  // the same on every platform and library version.
  std::mt19937_64 rng(splitmix64(options_.seed ^ splitmix64(static_cast<uint64_t>(epoch))));
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng() % i]);
  return order;
}

void Loader::start_epoch(int64_t epoch) {
  TORCH_CHECK(epoch >= 0, "epoch must be >= 0, got ", epoch);
  // samples_seen() counts epoch * samples_per_epoch: past int64 it had wrapped to nonsense.
  const int64_t per_epoch = std::max<int64_t>(samples_per_epoch(), 1);
  TORCH_CHECK(epoch <= std::numeric_limits<int64_t>::max() / per_epoch - 1, "epoch ", epoch, " is past what the ",
              "loader can count (", std::numeric_limits<int64_t>::max() / per_epoch - 1, " epochs of ", per_epoch, " samples)");
  epoch_ = epoch;
  position_ = 0;
  order_ = order(epoch);
}

std::vector<Tensor> Loader::next() {
  if (!has_next()) start_epoch(epoch_ + 1);
  int64_t begin = position_ * options_.batch;
  int64_t end = std::min<int64_t>(begin + options_.batch, static_cast<int64_t>(order_.size()));
  ++position_;
  // This rank's slice of the global batch [begin, end).
  int64_t total = end - begin, n = options_.shard_count, r = options_.shard_rank;
  int64_t lo = begin + total * r / n, hi = begin + total * (r + 1) / n;
  std::vector<int64_t> indices(order_.begin() + lo, order_.begin() + hi);
  auto batch = dataset_->batch(indices);  // read on the host...
  if (options_.context_count > 1) {        // ...this rank's chunks of each sequence...
    const int c = static_cast<int>(options_.context_count);
    for (size_t i = 0; i < batch.size(); ++i) {
      auto& t = batch[i];
      TORCH_CHECK(t.dim() >= 2, "loader: context=", c, " splits each sample's sequence (dimension 2), but batch tensor ",
                  i + 1, " has shape ", t.sizes(), " (no sequence)");
      TORCH_CHECK(t.size(1) % (2 * c) == 0, "loader: context=", c, " splits each sequence into 2*context = ", 2 * c,
                  " equal chunks, but batch tensor ", i + 1, " has sequences of ", t.size(1),
                  " positions: make the sequence length a multiple of ", 2 * c);
      t = t.index_select(1, util::zigzag_index(t.size(1), c, static_cast<int>(options_.context_rank)));
    }
  }
  for (auto& t : batch) t = compat::to_device(t, options_.device);  // ...used on the rank's device
  return batch;
}

int64_t Loader::samples_per_epoch() const {
  return options_.drop_last ? batches_per_epoch() * options_.batch : dataset_->size();
}

int64_t Loader::samples_seen() const {
  return epoch_ * samples_per_epoch() + std::min<int64_t>(position_ * options_.batch, dataset_->size());
}

void Loader::seek(int64_t samples) {
  TORCH_CHECK(samples >= 0, "data position must be >= 0, got ", samples);
  const int64_t per_epoch = samples_per_epoch();
  TORCH_CHECK(per_epoch > 0, "cannot seek in an empty dataset");
  start_epoch(samples / per_epoch);
  position_ = (samples % per_epoch) / options_.batch;
}

int64_t Loader::seek_lands_at(int64_t samples) const {
  const int64_t per_epoch = samples_per_epoch();
  if (samples < 0 || per_epoch <= 0) return samples;
  return samples / per_epoch * per_epoch + (samples % per_epoch) / options_.batch * options_.batch;
}

int64_t Loader::seek_next_after(int64_t samples) const {
  const int64_t per_epoch = samples_per_epoch();
  if (samples < 0 || per_epoch <= 0) return samples;
  // The next batch's start, or the epoch's end where the last batch is short (drop_last=false).
  const int64_t lands = seek_lands_at(samples);
  int64_t epoch_end, next;
  if (__builtin_add_overflow(samples - samples % per_epoch, per_epoch, &epoch_end)) epoch_end = INT64_MAX;
  if (__builtin_add_overflow(lands, options_.batch, &next)) next = INT64_MAX;
  return std::min(next, epoch_end);
}

void Loader::set_place(int64_t epoch, int64_t position) {
  TORCH_CHECK(position >= 0 && position <= batches_per_epoch(), "loader: position ", position, " is not within an ",
              "epoch of ", batches_per_epoch(), " batches");
  start_epoch(epoch);
  position_ = position;
}

}  // namespace partrain::data
