// Appending JSON lines and rewriting a JSON-lines file without the records a resumed run repeats.
#include "engine/util/jsonl.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "engine/util/files.hpp"

namespace partrain::util {

// The deepest nesting of brackets in a JSON text (outside strings), counted before parsing.
int json_depth(const std::string& text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      deepest = std::max(deepest, ++depth);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return deepest;
}


JsonLines::JsonLines(const std::string& path, const std::string& what) : path_(path), what_(what) {
  TORCH_CHECK(!path.empty(), "the ", what, " has an empty name");
  // The rule of every file partrain writes, whoever names it (--metrics, pt.metrics(path), an
  // example's --metrics): never through a symbolic link, never into anything but a regular file,
  // and never onto a file that is not already JSON lines (a script or a JSON file given by mistake).
  auto refused = may_replace(path, [](const std::string& head) { return !head.empty() && head[0] == '{'; },
                             "a JSON-lines " + what);
  TORCH_CHECK(refused.empty(), "the ", what, " ", refused);
  // O_NONBLOCK: opening a FIFO for writing must not wait for a reader; it is refused below.
  // O_NOFOLLOW: a link planted between the check above and this open is not followed either.
  int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW, 0644);
  if (fd < 0) {
    int err = errno;
    TORCH_CHECK(err != ELOOP, "the ", what, " '", path, "' is a symbolic link; partrain writes only regular files, "
                "never through a link");
    TORCH_CHECK(err != EISDIR, "the ", what, " '", path, "' is a folder; a regular file was expected");
    TORCH_CHECK(false, "cannot open the ", what, " '", path, "' for appending: ", std::strerror(err));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    TORCH_CHECK(false, "the ", what, " '", path, "' is not a regular file (a FIFO, a socket or a device); "
                "a regular file was expected");
  }
  int fl = ::fcntl(fd, F_GETFL);
  if (fl >= 0) ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  fd_ = fd;
}

JsonLines::~JsonLines() { close(); }

void JsonLines::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void JsonLines::append(const std::string& line) {
  TORCH_CHECK(fd_ >= 0, "the ", what_, " '", path_, "' is closed");
  TORCH_CHECK(line.find('\n') == std::string::npos, "a record of the ", what_, " must be one line");
  std::string bytes = line + '\n';
  // One write(): on a regular file opened O_APPEND it lands whole (short writes only when the
  // disk fills, and then the rest follows at once).
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "writing the ", what_, " '", path_, "': ", std::strerror(errno));
    done += static_cast<size_t>(n);
  }
}

size_t drop_records(const std::string& path, double drop_from, const std::string& what, uint64_t max_bytes) {
  if (::access(path.c_str(), F_OK) != 0) return 0;
  std::string text = read_regular(path, what, max_bytes);
  std::string kept;
  kept.reserve(text.size());
  size_t dropped = 0, start = 0, number = 0;
  while (start < text.size()) {
    ++number;
    size_t nl = text.find('\n', start);
    bool complete = nl != std::string::npos;
    std::string line = text.substr(start, complete ? nl - start : std::string::npos);
    start = complete ? nl + 1 : text.size();
    bool keep = false;
    if (complete) {
      // A whole line that is no record: not a file of these records (a script or notes given by
      // mistake), which rewriting would destroy. Only a last line cut short by a crash is dropped.
      auto j = json_depth(line) <= kMaxJsonDepth ? nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false)
                                                 : nlohmann::json(nlohmann::json::value_t::discarded);
      TORCH_CHECK(j.is_object(), "the ", what, " '", path, "' has a line ", number, " that is not a JSON record (",
                  line.substr(0, 40), line.size() > 40 ? "..." : "", "): it is not a file of partrain's records, and "
                  "is left as it is; name another file");
      keep = true;
      if (keep && drop_from >= 0 && j.contains("step") && j["step"].is_number())
        keep = j["step"].get<double>() < drop_from;
    }
    if (!complete && !line.empty() && json_depth(line) <= kMaxJsonDepth &&
        !nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false).is_discarded())
      // A whole JSON value without its newline was not cut short by a crash (a record lands with
      // its newline in one write, and no prefix of a record parses): a JSON file given by mistake.
      TORCH_CHECK(false, "the ", what, " '", path, "' ends with a JSON value on a line without its newline (",
                  line.substr(0, 40), line.size() > 40 ? "..." : "", "): it is not a file of partrain's records, and "
                  "is left as it is; name another file");
    if (keep) kept += line + '\n';
    else if (complete || !line.empty()) ++dropped;
  }
  if (dropped > 0) write_atomic(path, kept);
  return dropped;
}

}  // namespace partrain::util
