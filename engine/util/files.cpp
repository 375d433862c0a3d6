// Safe file access (see files.hpp).
#include "engine/util/files.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

#include <c10/util/Exception.h>

namespace partrain::util {

namespace {

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

std::string dir_of(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

int open_regular(const std::string& path, const std::string& what, Links links) {
  // O_NONBLOCK: opening a FIFO for reading must not wait for a writer; it is refused below.
  int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | (links == Links::Refuse ? O_NOFOLLOW : 0);
  int fd = ::open(path.c_str(), flags);
  if (fd < 0) {
    int err = errno;
    if (err == ELOOP && links == Links::Refuse)
      TORCH_CHECK(false, "the ", what, " '", path, "' is a symbolic link; partrain reads only regular files there");
    TORCH_CHECK(false, "cannot read the ", what, " '", path, "': ", std::strerror(err));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    mode_t mode = st.st_mode;
    ::close(fd);
    TORCH_CHECK(false, "the ", what, " '", path, "' is ", kind_of(mode), "; a regular file was expected");
  }
  int fl = ::fcntl(fd, F_GETFL);
  if (fl >= 0) ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  return fd;
}

bool is_regular(const std::string& path, Links links) {
  struct stat st;
  int r = links == Links::Refuse ? ::lstat(path.c_str(), &st) : ::stat(path.c_str(), &st);
  return r == 0 && S_ISREG(st.st_mode);
}

bool is_plain_dir(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string read_regular(const std::string& path, const std::string& what, uint64_t max_bytes, Links links) {
  int fd = open_regular(path, what, links);
  struct stat st;
  ::fstat(fd, &st);
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    TORCH_CHECK(false, "the ", what, " '", path, "' has ", st.st_size, " bytes; at most ", max_bytes, " are expected");
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < out.size()) {
    ssize_t n = ::read(fd, &out[done], out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  // A file that grew while it was read: take only what was sized (and checked) above.
  ::close(fd);
  TORCH_CHECK(done == out.size(), "reading the ", what, " '", path, "' stopped after ", done, " of ", out.size(),
              " bytes");
  return out;
}

bool safe_name(const std::string& name) {
  if (name.empty() || name.size() > 128 || name[0] == '.' || name[0] == '-') return false;
  for (char c : name)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
          c == '-'))
      return false;
  return true;
}

void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

std::string join_path(const std::string& dir, const std::string& name) { return dir + "/" + name; }

bool exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

std::vector<std::string> list_dir(const std::string& path, int* error) {
  std::vector<std::string> names;
  DIR* d = ::opendir(path.c_str());
  if (error) *error = d ? 0 : errno;
  if (!d) return names;
  while (auto* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(std::move(n));
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
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

void remove_all(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    for (const auto& n : list_dir(path)) remove_all(join_path(path, n));
    ::rmdir(path.c_str());
  } else {
    ::unlink(path.c_str());
  }
}

void rename_new(const std::string& from, const std::string& to) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return;
  int err = errno;
  if (err == EINVAL && !exists(to) && std::rename(from.c_str(), to.c_str()) == 0) return;  // no RENAME_NOREPLACE here
  TORCH_CHECK(false, "cannot rename '", from, "' to '", to, "': ", std::strerror(err == EINVAL ? errno : err));
}

void exchange(const std::string& a, const std::string& b, const std::string& spare) {
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) return;
  TORCH_CHECK(errno == EINVAL, "cannot swap '", a, "' and '", b, "': ", std::strerror(errno));
  remove_all(spare);
  rename_new(b, spare);
  rename_new(a, b);
  rename_new(spare, a);
}

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

int create_new(const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "cannot write '", path, "': ", std::strerror(errno));
  return fd;
}

void write_all(int fd, const char* data, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    TORCH_CHECK(w > 0, "writing '", path, "' failed: ", std::strerror(errno));
    data += w;
    n -= static_cast<size_t>(w);
  }
}

namespace {

// Writes all of `bytes` to `fd`, flushes it to disk and closes it; an error names `path`. The
// caller removes the file on error.
void write_sync_close(int fd, const std::string& path, const std::string& bytes) {
  try {
    write_all(fd, bytes.data(), bytes.size(), path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  bool synced = ::fsync(fd) == 0;
  int err = errno;
  ::close(fd);
  TORCH_CHECK(synced, "flushing '", path, "' to disk failed: ", std::strerror(err));
}

}  // namespace

std::string may_replace(const std::string& path, const std::function<bool(const std::string&)>& ours,
                        const std::string& kind) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return "";
  if (!S_ISREG(st.st_mode)) return "'" + path + "' is " + kind_of(st.st_mode) + ", not a file to write " + kind + " to";
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
  std::string head(64, '\0');
  ssize_t n = fd >= 0 ? ::read(fd, head.data(), head.size()) : -1;
  if (fd >= 0) ::close(fd);
  head.resize(n > 0 ? static_cast<size_t>(n) : 0);
  if (st.st_size == 0 || ours(head)) return "";
  return "'" + path + "' exists and is not " + kind + " (a file given by mistake is not replaced: remove it, or "
         "name another)";
}

void write_new(const std::string& path, const std::string& bytes) {
  int fd = create_new(path);
  try {
    write_sync_close(fd, path, bytes);
  } catch (...) {
    ::unlink(path.c_str());
    throw;
  }
}

void write_atomic(const std::string& path, const std::string& bytes) {
  // The rename would put a regular file in place of whatever is there: a device (/dev/null), a
  // FIFO, a link (its target left as it was), a folder. Only a regular file is replaced.
  if (struct stat st; ::lstat(path.c_str(), &st) == 0)
    TORCH_CHECK(S_ISREG(st.st_mode), "cannot write '", path, "': it is ", kind_of(st.st_mode),
                ", and only a regular file (or a new one) is written there");
  static thread_local std::mt19937_64 random{std::random_device{}()};
  std::string dir = dir_of(path), name = path.substr(path.find_last_of('/') + 1);
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
    char suffix[24];
    std::snprintf(suffix, sizeof suffix, "%016llx", static_cast<unsigned long long>(random()));
    tmp = dir + "/." + name + "." + suffix + ".tmp";  // hidden: never taken for a checkpoint tag
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) break;
  }
  TORCH_CHECK(fd >= 0, "cannot write '", path, "' (its temporary '", tmp, "'): ", std::strerror(errno));
  try {
    write_sync_close(fd, path, bytes);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, "cannot rename '", tmp, "' to '", path, "': ", std::strerror(err));
  }
  fsync_path(dir);
}

}  // namespace partrain::util
