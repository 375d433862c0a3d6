// Reading metrics files (see metrics.hpp).
#include "app/metrics.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>

#include <c10/util/Exception.h>

#include "engine/util/files.hpp"
#include "engine/util/jsonl.hpp"

namespace partrain::app {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// JSON has no NaN or infinity, but writers produce them (Python's NaN, Lua's nan and inf): read
// each such bare word outside a string as null, so the record still loads and the value is a gap.
void nonfinite_to_null(std::string& line) {
  static const char* const words[] = {"-Infinity", "Infinity", "-NaN", "NaN", "-nan", "nan", "-inf", "inf"};
  bool in_string = false;
  for (size_t i = 0; i < line.size(); ++i) {
    char c = line[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
      continue;
    }
    if (c != '-' && c != 'N' && c != 'I' && c != 'n' && c != 'i') continue;
    for (const char* w : words) {
      size_t n = std::strlen(w);
      if (line.compare(i, n, w) != 0) continue;
      bool ends = i + n == line.size() || !std::isalnum(static_cast<unsigned char>(line[i + n]));
      if (!ends) continue;
      line.replace(i, n, "null");
      i += 3;
      break;
    }
  }
}

std::string shown(const std::string& line) {
  std::string s = line.size() > 60 ? line.substr(0, 60) + "..." : line;
  for (auto& c : s)
    if (static_cast<unsigned char>(c) < 0x20) c = ' ';
  return s;
}

// Keeps at most `max` evenly spaced points of a series: every stride-th value seen, the stride
// doubling (and every other kept point dropped) whenever the points outgrow `max`.
void add_point(Series& s, double step, double value, size_t max) {
  if (s.seen % s.stride == 0) s.points.emplace_back(step, value);
  ++s.seen;
  s.last = {step, value};
  if (s.points.size() > max) {
    size_t kept = 0;
    for (size_t i = 0; i < s.points.size(); i += 2) s.points[kept++] = s.points[i];
    s.points.resize(kept);
    s.stride *= 2;
  }
}

double number_or_nan(const nlohmann::json& v) {
  if (!v.is_number()) return kNaN;
  double d = v.get<double>();
  return std::isfinite(d) ? d : kNaN;
}

// An experts record (pt.metrics.experts) as a column of the heat map: each block's routed counts
// over their mean. Kept as add_point keeps a series' points; a record whose blocks differ from
// the ones before (another model in the same file) starts the map again.
void add_experts(ExpertLoad& x, const nlohmann::json& record, const std::string& where, const ReadOptions& options) {
  auto layers = record.find("layers"), routed = record.find("routed");
  TORCH_CHECK(layers != record.end() && layers->is_array() && routed != record.end() && routed->is_array() &&
                  routed->size() == layers->size(),
              where, ": an experts record needs \"layers\": [block paths] and \"routed\": [[slots routed to each expert]",
              " of each block]");
  std::vector<std::string> paths;
  std::vector<int64_t> experts;
  ExpertLoad::Column column;
  size_t cells = 0;
  for (size_t i = 0; i < layers->size(); ++i) {
    const auto& path = (*layers)[i];
    const auto& row = (*routed)[i];
    TORCH_CHECK(path.is_string(), where, ": an experts record's layers must be strings (block paths), not ",
                path.type_name());
    TORCH_CHECK(row.is_array() && !row.empty(), where, ": an experts record's routed[", i,
                "] must be a list of numbers (slots routed to each expert)");
    cells += row.size();
    TORCH_CHECK(cells <= options.max_expert_cells, where, ": an experts record of more than ",
                options.max_expert_cells, " experts; at most that many are read");
    double total = 0;
    std::vector<double> counts;
    for (const auto& v : row) {
      TORCH_CHECK(v.is_number() || v.is_null(), where, ": an experts record's routed counts must be numbers, not ",
                  v.type_name());
      counts.push_back(number_or_nan(v));
      total += counts.back();
    }
    const double mean = total / static_cast<double>(counts.size());
    for (double c : counts) column.load.push_back(mean > 0 ? c / mean : kNaN);
    paths.push_back(path.get<std::string>());
    experts.push_back(static_cast<int64_t>(row.size()));
  }
  auto step = record.find("step");
  column.step = step != record.end() ? number_or_nan(*step) : kNaN;
  if (!std::isfinite(column.step)) return;  // a record without a step has no column to go in
  if (paths != x.layers || experts != x.experts) {
    if (!x.layers.empty()) ++x.restarts;
    x.layers = std::move(paths);
    x.experts = std::move(experts);
    x.columns.clear();
    x.seen = 0;
    x.stride = 1;
  }
  const size_t max = std::max<size_t>(2, std::min(options.max_expert_columns, options.max_expert_values /
                                                                                  std::max<size_t>(cells, 1)));
  if (x.seen % x.stride == 0) x.columns.push_back(column);
  ++x.seen;
  x.last = std::move(column);
  if (x.columns.size() > max) {
    size_t kept = 0;
    for (size_t i = 0; i < x.columns.size(); i += 2, ++kept)
      if (kept != i) x.columns[kept] = std::move(x.columns[i]);  // never moved onto itself: that empties it
    x.columns.resize(kept);
    x.stride *= 2;
  }
}

// Reads a file line by line into `on_line(line, number, complete)`; `complete` is false for a last
// line without its newline. Never holds more than one line (bounded by max_line) at a time.
template <typename F>
void for_each_line(const std::string& path, const ReadOptions& options, F&& on_line) {
  int fd = util::open_regular(path, "metrics file");
  struct stat st;
  ::fstat(fd, &st);
  if (static_cast<uint64_t>(st.st_size) > options.max_file_bytes) {
    ::close(fd);
    TORCH_CHECK(false, "the metrics file '", path, "' has ", st.st_size, " bytes; at most ", options.max_file_bytes,
                " are read (report on a copy cut to its last lines: tail -n 1000000)");
  }
  std::string buffer(size_t(1) << 20, '\0'), line;
  int64_t number = 0;
  uint64_t total = 0;
  try {
    for (;;) {
      ssize_t n = ::read(fd, &buffer[0], buffer.size());
      if (n < 0 && errno == EINTR) continue;
      TORCH_CHECK(n >= 0, "cannot read the metrics file '", path, "': ", std::strerror(errno));
      if (n == 0) break;
      total += static_cast<uint64_t>(n);
      TORCH_CHECK(total <= options.max_file_bytes, "the metrics file '", path, "' grew past ",
                  options.max_file_bytes, " bytes while it was read");
      size_t from = 0;
      for (;;) {
        auto nl = static_cast<const char*>(std::memchr(buffer.data() + from, '\n', static_cast<size_t>(n) - from));
        size_t end = nl ? static_cast<size_t>(nl - buffer.data()) : static_cast<size_t>(n);
        TORCH_CHECK(line.size() + (end - from) <= options.max_line_bytes, path, ":", number + 1, ": a line longer than ",
                    options.max_line_bytes, " bytes; a metrics record is one short JSON object a line");
        line.append(buffer, from, end - from);
        if (!nl) break;
        on_line(line, ++number, true);
        line.clear();
        from = end + 1;
      }
    }
    if (!line.empty()) on_line(line, ++number, false);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

}  // namespace

std::string metrics_file_of(const std::string& path) {
  if (util::is_plain_dir(path)) {
    std::string file = path + (path.back() == '/' ? "" : "/") + "metrics.jsonl";
    struct stat st;
    TORCH_CHECK(::lstat(file.c_str(), &st) != 0 || util::is_regular(file), "the run folder '", path, "' holds a ",
                "metrics.jsonl that is not a regular file (a link, a FIFO or a device); a run writes a regular one");
    TORCH_CHECK(util::is_regular(file), "the run folder '", path, "' holds no metrics.jsonl (a run folder holds the "
                "metrics file a run wrote: partrain --metrics ", file, " ...)");
    return file;
  }
  struct stat st;
  TORCH_CHECK(::stat(path.c_str(), &st) == 0, "there is no metrics file or run folder '", path, "'");
  return path;
}

Metrics read_metrics(const std::string& path, const std::string& name, const ReadOptions& options) {
  Metrics m;
  m.path = path;
  m.name = name;
  bool any_time = false;
  for_each_line(path, options, [&](std::string& line, int64_t number, bool complete) {
    auto where = [&] { return path + ":" + std::to_string(number); };
    if (line.find_first_not_of(" \t\r") == std::string::npos) return;  // a blank line
    nonfinite_to_null(line);
    TORCH_CHECK(util::json_depth(line) <= util::kMaxJsonDepth, where(), ": a JSON value nested deeper than ",
                util::kMaxJsonDepth, " levels (a metrics file holds flat records: one JSON object a line)");
    auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_discarded()) {
      if (!complete) {  // a run killed while writing its last line
        m.torn_tail = true;
        return;
      }
      TORCH_CHECK(false, where(), ": not a JSON object: '", shown(line), "' (a metrics file holds one JSON object a line)");
    }
    TORCH_CHECK(record.is_object(), where(), ": not a JSON object: '", shown(line),
                "' (a metrics file holds one JSON object a line)");
    if (auto t = record.find("time"); t != record.end() && t->is_number() && std::isfinite(t->get<double>())) {
      if (!any_time) m.first_time = t->get<double>();
      m.last_time = t->get<double>();
      any_time = true;
    }
    auto event = record.find("event");
    if (event != record.end()) {
      TORCH_CHECK(event->is_string(), where(), ": \"event\" is ", event->type_name(), "; a string was expected");
      const auto& kind = event->get_ref<const std::string&>();
      if (kind == "run") {
        m.header = record;
        ++m.runs;
      } else if (kind == "memory") {
        auto ranks = record.find("ranks");
        TORCH_CHECK(ranks != record.end() && ranks->is_array(), where(),
                    ": a memory record needs \"ranks\": [bytes of rank 0, rank 1, ...]");
        TORCH_CHECK(ranks->size() <= options.max_ranks, where(), ": a memory record of ", ranks->size(),
                    " ranks; at most ", options.max_ranks, " are read");
        std::vector<double> bytes;
        for (const auto& b : *ranks) {
          TORCH_CHECK(b.is_number() || b.is_null(), where(), ": a memory record's ranks must be numbers of bytes, not ",
                      b.type_name());
          bytes.push_back(number_or_nan(b));
        }
        m.memory = std::move(bytes);
        auto step = record.find("step");
        double at = step != record.end() ? number_or_nan(*step) : kNaN;
        m.memory_step = at >= 0 && at < 9e15 ? static_cast<int64_t>(at) : -1;
      } else if (kind == "experts") {
        add_experts(m.experts, record, where(), options);
      } else if (kind == "plan") {
        auto text = record.find("text");
        TORCH_CHECK(text != record.end() && text->is_string(), where(), ": a plan record needs \"text\": a string");
        m.plan = text->get<std::string>();
      }
      return;  // other events: for other readers
    }
    auto step_it = record.find("step");
    TORCH_CHECK(step_it != record.end(), where(), ": a record with neither \"event\" nor \"step\": '", shown(line), "'");
    TORCH_CHECK(step_it->is_number() && std::isfinite(step_it->get<double>()), where(), ": \"step\" is ",
                step_it->dump().substr(0, 40), "; a number was expected");
    double step = step_it->get<double>();
    m.first_step = m.steps == 0 ? step : std::min(m.first_step, step);
    m.last_step = m.steps == 0 ? step : std::max(m.last_step, step);
    ++m.steps;
    for (const auto& [key, value] : record.items()) {
      if (key == "step" || key == "time" || !(value.is_number() || value.is_null())) continue;
      auto s = m.series.find(key);
      if (s == m.series.end()) {
        if (m.series.size() >= options.max_series) {
          ++m.fields_dropped;
          continue;
        }
        s = m.series.emplace(key, Series{}).first;
        m.order.push_back(key);
      }
      add_point(s->second, step, number_or_nan(value), options.max_points);
    }
    if (options.exact_losses && (options.up_to_step < 0 || step <= static_cast<double>(options.up_to_step))) {
      auto loss = record.find("loss");
      if (loss != record.end() && (loss->is_number() || loss->is_null())) {
        TORCH_CHECK(step == std::floor(step) && step >= 0 && step < 9e15, where(), ": \"step\" ", step,
                    " is not a whole number of steps");
        TORCH_CHECK(static_cast<int64_t>(m.losses.size()) < options.max_exact, path, ": more than ", options.max_exact,
                    " losses to compare; compare fewer steps (--steps N)");
        m.losses.push_back({static_cast<int64_t>(step), number_or_nan(*loss), number});
      }
    }
  });
  // The last value of each series belongs on the chart even when the stride skipped it; a file
  // holding several runs' records out of order is drawn in step order.
  for (auto& [key, s] : m.series) {
    if ((s.seen - 1) % s.stride != 0) s.points.push_back(s.last);
    std::stable_sort(s.points.begin(), s.points.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
  }
  auto& x = m.experts;
  if (x.seen > 0 && (x.seen - 1) % x.stride != 0) x.columns.push_back(x.last);
  std::stable_sort(x.columns.begin(), x.columns.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  return m;
}

}  // namespace partrain::app
