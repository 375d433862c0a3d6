// What the checkpoint files share inside engine/ckpt (ckpt.cpp, convert.cpp, safetensors.cpp):
// bounds on what a file may claim, data files, and the steps of a save. Not for use elsewhere.
#pragma once

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "engine/ckpt/ckpt.hpp"
#include "engine/util/jsonl.hpp"

namespace partrain::parallel {
struct Sharding;
}

namespace partrain::ckpt::internal {

constexpr int kMaxRank = 16;                        // dimensions of a tensor
constexpr int64_t kMaxElements = int64_t(1) << 48;  // of one tensor
using util::kMaxJsonDepth;                          // of the user table and of a safetensors header
using util::json_depth;

std::string join(const std::string& dir, const std::string& name);
uint32_t crc_of(const void* data, size_t n);
/// The number of elements of `size`, or -1 when it passes kMaxElements.
int64_t volume(const std::vector<int64_t>& size);
/// Reads exactly `n` bytes at `offset` of an open file.
bool read_at(int fd, char* out, uint64_t n, uint64_t offset);
void check_tag(const std::string& tag);

// A data file written front to back into a fresh folder, its CRC-32 kept as it goes.
class DataFile {
 public:
  explicit DataFile(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
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
    *crc = crc_of(p, n);
    crc_ = ::crc32_combine(crc_, *crc, static_cast<z_off_t>(n));  // the file's, without a second pass
    while (n > 0) {
      ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
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

/// Appends `local` (this rank's part of a tensor split as `s`, or the whole tensor) as pieces.
void add_pieces(DataFile& file, TensorEntry& e, const torch::Tensor& local, const parallel::Sharding* s,
                int32_t file_index);
void write_manifest(const std::string& tag_dir, const Manifest& m);

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
