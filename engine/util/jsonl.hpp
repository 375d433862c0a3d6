// Files of JSON lines (one JSON object a line) that a run appends to as it goes, such as the
// metrics file: each line lands with one write() on an O_APPEND descriptor, so a killed process
// leaves every completed line, and at most a torn last one that readers and drop_records skip.
#pragma once

#include <cstdint>
#include <string>

namespace partrain::util {

/// How deep any JSON text partrain reads may nest. nlohmann's parser recurses once a level, so a
/// line of a few hundred thousand brackets (well below any size bound) overflows the stack: every
/// reader checks json_depth first.
constexpr int kMaxJsonDepth = 64;

/// The deepest nesting of brackets in a JSON text (outside strings), counted before parsing.
int json_depth(const std::string& text);

/// An open JSON-lines file, appended to one line at a time.
class JsonLines {
 public:
  /// Opens `path` for appending, creating it (mode 0644) when it does not exist. Refuses, naming
  /// the path and `what` ("metrics file"), anything that exists and is not a regular file (a
  /// folder, a FIFO, a device), and never blocks on a FIFO.
  JsonLines(const std::string& path, const std::string& what);
  ~JsonLines();
  JsonLines(const JsonLines&) = delete;
  JsonLines& operator=(const JsonLines&) = delete;

  /// Appends `line` and a newline with a single write(); `line` must hold no newline.
  void append(const std::string& line);
  void close();
  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }

 private:
  std::string path_, what_;
  int fd_ = -1;
};

/// Rewrites the JSON-lines file at `path`, keeping the complete lines that parse as JSON objects
/// and whose "step" (when they have one) is below `drop_from` (drop_from < 0: every step stays),
/// so a resumed run's records never repeat a step and a torn last line is not continued. The
/// rewrite is atomic (write_atomic) and happens only when a line is dropped. A file of more than
/// `max_bytes` is refused; a missing file is left missing. Returns how many lines were dropped.
size_t drop_records(const std::string& path, double drop_from, const std::string& what, uint64_t max_bytes);

}  // namespace partrain::util
