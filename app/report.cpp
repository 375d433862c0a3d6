// partrain report (see report.hpp): metrics files in, one HTML page of SVG charts out.
#include "app/report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>

#include "app/tools.hpp"
#include "engine/util/files.hpp"
#include "engine/util/jsonl.hpp"
#include "engine/util/text.hpp"

namespace partrain::app {

namespace {

// Each file's colour (and, past the palette, a dash pattern too): the same file, the same colour
// on every chart. Tests look for these exact colours in a rendered page.
const char* const kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"};
constexpr size_t kColours = sizeof(kPalette) / sizeof(kPalette[0]);
constexpr size_t kMaxRuns = 32;                       // files on one page
constexpr uint64_t kMaxTraceBytes = uint64_t(64) << 20;
constexpr size_t kMaxBoxes = 50000;                   // timeline boxes drawn
constexpr size_t kMaxConfigRows = 300;
constexpr size_t kMaxOtherCharts = 12;

// The chart area, in SVG units (the page scales nothing: 1 unit = 1 CSS pixel).
constexpr double kWidth = 1000, kHeight = 300, kLeft = 84, kRight = 16, kTop = 14, kBottom = 40;

std::string colour(size_t i) { return kPalette[i % kColours]; }
std::string dash(size_t i) {
  static const char* const dashes[] = {"", "6 3", "2 3", "8 3 2 3"};
  return dashes[(i / kColours) % 4];
}

std::string escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default:
        // Control bytes have no place in a page (a NUL would end it for some readers).
        if (static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t') out += ' ';
        else out += c;
    }
  }
  return out;
}

std::string fixed(double v, int decimals = 1) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

std::string sig(double v, int digits) {
  if (v == 0) return "0";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*g", std::clamp(digits, 1, 15), v);
  return buf;
}

std::string bytes_text(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (std::fabs(b) >= 1024 && u < 5) b /= 1024, ++u;
  return sig(b, 4) + " " + units[u];
}

std::string utc(double unix_seconds) {
  if (!(unix_seconds > 0 && unix_seconds < 1e11)) return "";
  std::time_t t = static_cast<std::time_t>(unix_seconds);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

// An axis from lo to hi with tick values at 1, 2 or 5 times a power of ten. Works from halves so
// that a span of two huge values does not overflow.
struct Axis {
  double lo = 0, hi = 1;
  std::vector<double> ticks;
  double step = 0;  ///< between ticks (0: ticks at lo and hi only)
  double at(double v, double from, double to) const {
    double t = (v / 2 - lo / 2) / (hi / 2 - lo / 2);
    return from + t * (to - from);
  }
  /// A tick's label: plain decimals as fine as the tick step, exponents for huge or tiny values.
  std::string label(double v) const {
    if (v == 0) return "0";
    double biggest = std::max(std::fabs(lo), std::fabs(hi));
    if (step > 0 && biggest < 1e9 && step >= 1e-6) return fixed(v, std::max(0, -static_cast<int>(std::floor(std::log10(step)))));
    int digits = step > 0 ? static_cast<int>(std::floor(std::log10(biggest)) - std::floor(std::log10(step))) + 2 : 4;
    return sig(v, digits);
  }
};

Axis make_axis(double lo, double hi, bool integral) {
  Axis a;
  if (!(std::isfinite(lo) && std::isfinite(hi))) lo = 0, hi = 1;
  if (lo == hi) {  // one point, or a constant series: a band around it
    double pad = lo == 0 ? 1 : std::fabs(lo) * 0.05;
    if (integral) pad = std::max(pad, 1.0);
    lo -= pad, hi += pad;
  } else if (!integral) {
    double pad = (hi / 2 - lo / 2) * 0.1;
    lo -= pad, hi += pad;
    if (!std::isfinite(lo)) lo = -std::numeric_limits<double>::max();
    if (!std::isfinite(hi)) hi = std::numeric_limits<double>::max();
  }
  a.lo = lo, a.hi = hi;
  double span = (hi / 2 - lo / 2) * 2;
  if (!std::isfinite(span) || span <= 0) {
    a.ticks = {lo, hi};
    return a;
  }
  double raw = span / 6;
  double mag = std::pow(10, std::floor(std::log10(raw)));
  double f = raw / mag;
  a.step = (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
  if (integral) a.step = std::max(a.step, 1.0);
  double first = std::ceil(lo / a.step);
  for (int k = 0; k < 20; ++k) {
    double v = (first + k) * a.step;
    if (v > hi + a.step * 1e-9) break;
    a.ticks.push_back(std::fabs(v) < a.step * 1e-9 ? 0 : v);
  }
  return a;
}

// An axis of sizes or durations: it starts at 0, not below.
Axis from_zero(Axis a) {
  a.lo = 0;
  a.ticks.erase(std::remove_if(a.ticks.begin(), a.ticks.end(), [](double t) { return t < 0; }), a.ticks.end());
  return a;
}

struct Line {
  std::string label, colour, dash;
  size_t file = 0;
  const Series* series = nullptr;
};

// The axes' frame, grid and tick labels for a chart of kWidth x kHeight; `y_unit` follows each y label.
void frame(std::ostringstream& svg, const Axis& x, const Axis& y, const std::string& x_label,
           const std::string& y_unit = "") {
  double x0 = kLeft, x1 = kWidth - kRight, y0 = kHeight - kBottom, y1 = kTop;
  svg << "<rect x=\"" << x0 << "\" y=\"" << y1 << "\" width=\"" << x1 - x0 << "\" height=\"" << y0 - y1
      << "\" fill=\"#fff\" stroke=\"#999\"/>\n";
  for (double t : y.ticks) {
    double py = y.at(t, y0, y1);
    svg << "<line x1=\"" << x0 << "\" x2=\"" << x1 << "\" y1=\"" << fixed(py) << "\" y2=\"" << fixed(py)
        << "\" stroke=\"#eee\"/><text x=\"" << x0 - 6 << "\" y=\"" << fixed(py + 4)
        << "\" text-anchor=\"end\" class=\"tick\">" << escape(y.label(t) + (y_unit.empty() ? "" : " " + y_unit)) << "</text>\n";
  }
  for (double t : x.ticks) {
    double px = x.at(t, x0, x1);
    svg << "<line y1=\"" << y0 << "\" y2=\"" << y0 + 5 << "\" x1=\"" << fixed(px) << "\" x2=\"" << fixed(px)
        << "\" stroke=\"#999\"/><text x=\"" << fixed(px) << "\" y=\"" << y0 + 18
        << "\" text-anchor=\"middle\" class=\"tick\">" << escape(x.label(t)) << "</text>\n";
  }
  svg << "<text x=\"" << (x0 + x1) / 2 << "\" y=\"" << kHeight - 4 << "\" text-anchor=\"middle\" class=\"axis\">"
      << escape(x_label) << "</text>\n";
}

std::string legend(const std::vector<Line>& lines) {
  std::ostringstream html;
  html << "<div class=\"legend\">";
  for (const auto& l : lines)
    html << "<span><i style=\"border-top:3px " << (l.dash.empty() ? "solid" : "dashed") << " " << l.colour
         << "\"></i>" << escape(l.label) << "</span>";
  html << "</div>\n";
  return html.str();
}

// A line chart of `lines` against the step, gaps where a value is missing (null, NaN).
std::string line_chart(const std::string& title, const std::string& field, const std::vector<Line>& lines) {
  double xlo = std::numeric_limits<double>::infinity(), xhi = -xlo, ylo = xlo, yhi = -xlo;
  size_t finite = 0;
  for (const auto& l : lines)
    for (const auto& [s, v] : l.series->points) {
      if (!std::isfinite(v)) continue;
      xlo = std::min(xlo, s), xhi = std::max(xhi, s), ylo = std::min(ylo, v), yhi = std::max(yhi, v);
      ++finite;
    }
  std::ostringstream html;
  html << "<section class=\"chart\"><h2>" << escape(title) << "</h2>\n" << legend(lines);
  if (finite == 0) {
    html << "<p class=\"note\">no finite values of <code>" << escape(field) << "</code> to draw</p></section>\n";
    return html.str();
  }
  Axis x = make_axis(xlo, xhi, true), y = make_axis(ylo, yhi, false);
  html << "<svg width=\"" << kWidth << "\" height=\"" << kHeight << "\" viewBox=\"0 0 " << kWidth << " " << kHeight
       << "\" role=\"img\">\n";
  std::ostringstream svg;
  frame(svg, x, y, "step");
  double x0 = kLeft, x1 = kWidth - kRight, y0 = kHeight - kBottom, y1 = kTop;
  for (const auto& l : lines) {
    std::string d;
    std::vector<std::pair<double, double>> lone;  // points with no finite neighbour: drawn as dots
    const auto& pts = l.series->points;
    for (size_t i = 0; i < pts.size(); ++i) {
      if (!std::isfinite(pts[i].second)) continue;
      double px = x.at(pts[i].first, x0, x1), py = y.at(pts[i].second, y0, y1);
      bool joined = i > 0 && std::isfinite(pts[i - 1].second);
      d += (joined ? "L" : "M") + fixed(px) + " " + fixed(py);
      bool next = i + 1 < pts.size() && std::isfinite(pts[i + 1].second);
      if (!joined && !next) lone.emplace_back(px, py);
    }
    svg << "<path class=\"series\" data-file=\"" << l.file << "\" data-field=\"" << escape(field) << "\" d=\"" << d
        << "\" fill=\"none\" stroke=\"" << l.colour << "\" stroke-width=\"2\" stroke-linejoin=\"round\""
        << (l.dash.empty() ? "" : " stroke-dasharray=\"" + l.dash + "\"") << "><title>" << escape(l.label)
        << "</title></path>\n";
    for (const auto& [px, py] : lone)
      svg << "<circle class=\"series\" data-file=\"" << l.file << "\" cx=\"" << fixed(px) << "\" cy=\"" << fixed(py)
          << "\" r=\"4\" fill=\"" << l.colour << "\"/>\n";
  }
  html << svg.str() << "</svg></section>\n";
  return html.str();
}

// Bars of each rank's peak bytes (the newest memory record of each file), a group a rank.
std::string memory_chart(const std::vector<Metrics>& runs) {
  size_t ranks = 0;
  double top = 0;
  std::vector<Line> lines;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i].memory.empty()) continue;
    ranks = std::max(ranks, runs[i].memory.size());
    for (double b : runs[i].memory)
      if (std::isfinite(b)) top = std::max(top, b);
    lines.push_back({runs[i].name + (runs[i].memory_step >= 0 ? " (step " + std::to_string(runs[i].memory_step) + ")" : ""),
                     colour(i), "", i, nullptr});
  }
  std::ostringstream html;
  html << "<section class=\"chart\"><h2>Peak memory per rank</h2>\n";
  if (lines.empty()) {
    html << "<p class=\"note\">no memory records</p></section>\n";
    return html.str();
  }
  html << legend(lines);
  Axis x;
  x.lo = -0.5, x.hi = static_cast<double>(ranks) - 0.5;
  size_t every = std::max<size_t>(1, (ranks + 15) / 16);
  for (size_t r = 0; r < ranks; r += every) x.ticks.push_back(static_cast<double>(r));
  x.step = 1;
  // The axis counts in the unit of the largest bar (GiB, MiB, ...), with round ticks in it.
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  double unit = 1;
  while (top / unit >= 1024 && u < 5) unit *= 1024, ++u;
  Axis y = from_zero(make_axis(0, top > 0 ? top / unit : 1, false));
  std::ostringstream svg;
  frame(svg, x, y, "rank", units[u]);
  double x0 = kLeft, x1 = kWidth - kRight, y0 = kHeight - kBottom, y1 = kTop;
  double group = (x1 - x0) / static_cast<double>(ranks);
  double bar = group * 0.8 / static_cast<double>(lines.size());
  size_t k = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i].memory.empty()) continue;
    for (size_t r = 0; r < runs[i].memory.size(); ++r) {
      double b = runs[i].memory[r];
      if (!std::isfinite(b)) continue;
      double px = x0 + group * (static_cast<double>(r) + 0.1) + bar * static_cast<double>(k);
      double py = y.at(b / unit, y0, y1);
      svg << "<rect class=\"bar\" data-file=\"" << i << "\" x=\"" << fixed(px, 2) << "\" y=\"" << fixed(py)
          << "\" width=\"" << fixed(std::max(bar, 0.5), 2) << "\" height=\"" << fixed(y0 - py) << "\" fill=\""
          << colour(i) << "\" fill-opacity=\"0.55\"><title>" << escape(runs[i].name) << ": rank " << r << ": "
          << bytes_text(b) << "</title></rect>\n";
    }
    ++k;
  }
  html << "<svg width=\"" << kWidth << "\" height=\"" << kHeight << "\" viewBox=\"0 0 " << kWidth << " " << kHeight
       << "\" role=\"img\">\n" << svg.str() << "</svg></section>\n";
  return html.str();
}

// `e[key]` when it is a string, else "" (a trace from elsewhere may hold anything there).
std::string string_at(const nlohmann::json& e, const char* key) {
  auto it = e.find(key);
  return it != e.end() && it->is_string() ? it->get<std::string>() : std::string();
}

std::string value_text(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_null()) return "";
  std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return s.size() > 400 ? s.substr(0, 400) + "..." : s;
}

// The runs side by side: a column a file; config values that differ between files stand out.
std::string header_table(const std::vector<Metrics>& runs) {
  std::ostringstream html;
  html << "<section><h2>Runs</h2><table class=\"runs\"><tr><th></th>";
  for (size_t i = 0; i < runs.size(); ++i)
    html << "<th><i class=\"swatch\" style=\"background:" << colour(i) << "\"></i>" << escape(runs[i].name) << "</th>";
  html << "</tr>\n";
  auto row = [&](const std::string& name, auto&& cell) {
    std::vector<std::string> cells;
    bool any = false;
    for (const auto& m : runs) {
      cells.push_back(cell(m));
      any = any || !cells.back().empty();
    }
    if (!any) return;
    bool differ = std::any_of(cells.begin(), cells.end(), [&](const auto& c) { return c != cells[0]; });
    html << "<tr><th>" << escape(name) << "</th>";
    for (const auto& c : cells) html << "<td" << (differ && runs.size() > 1 ? " class=\"differs\"" : "") << ">"
                                     << escape(c) << "</td>";
    html << "</tr>\n";
  };
  auto field = [](const Metrics& m, const char* key) -> std::string {
    if (!m.header.is_object() || !m.header.contains(key)) return "";
    return value_text(m.header[key]);
  };
  row("metrics file", [](const Metrics& m) { return m.path; });
  row("script", [&](const Metrics& m) { return field(m, "script"); });
  row("started", [](const Metrics& m) {
    return m.header.is_object() && m.header.contains("time") && m.header["time"].is_number()
               ? utc(m.header["time"].get<double>()) : "";
  });
  row("runs (1 + resumptions)", [](const Metrics& m) { return m.runs > 1 ? std::to_string(m.runs) : ""; });
  row("world", [&](const Metrics& m) { return field(m, "world"); });
  row("mesh", [](const Metrics& m) -> std::string {
    if (!m.header.is_object() || !m.header.contains("mesh") || !m.header["mesh"].is_object()) return "";
    // In the mesh's own order (pipeline x data x context x tensor), then any other dimension;
    // expert last and apart, since it splits data x context rather than multiplying the world.
    const auto& mesh = m.header["mesh"];
    const std::vector<std::string> order{"pipeline", "data", "context", "tensor", "expert"};
    std::string s;
    for (const auto& k : order)
      if (mesh.contains(k) && k != "expert") s += (s.empty() ? "" : " x ") + k + " " + value_text(mesh[k]);
    for (const auto& [k, v] : mesh.items())
      if (std::find(order.begin(), order.end(), k) == order.end())
        s += (s.empty() ? "" : " x ") + k + " " + value_text(v);
    if (mesh.contains("expert")) s += (s.empty() ? "" : ", ") + std::string("expert ") + value_text(mesh["expert"]);
    return s;
  });
  row("device", [&](const Metrics& m) { return field(m, "device"); });
  row("peak TFLOPS", [&](const Metrics& m) { return field(m, "peak_tflops"); });
  row("step records", [](const Metrics& m) {
    return std::to_string(m.steps) + (m.steps ? " (steps " + sig(m.first_step, 15) + " to " + sig(m.last_step, 15) + ")" : "");
  });
  row("final loss", [](const Metrics& m) {
    auto s = m.series.find("loss");
    return s == m.series.end() ? std::string() : sig(s->second.last.second, 7);
  });
  row("wall time", [](const Metrics& m) {
    return m.last_time > m.first_time ? fixed(m.last_time - m.first_time, 1) + " s" : std::string();
  });
  row("notes", [](const Metrics& m) {
    std::string s;
    if (m.torn_tail) s += "the last line was cut short (the run stopped while writing it) and is skipped. ";
    if (m.fields_dropped) s += "fields past the first 32 are not charted. ";
    for (const auto& [k, v] : m.series)
      if (v.stride > 1) {
        s += "charts show one record in every " + std::to_string(v.stride) + ". ";
        break;
      }
    return s;
  });
  // The config, key by key across files.
  std::vector<std::string> keys;
  std::set<std::string> seen;
  for (const auto& m : runs)
    if (m.header.is_object() && m.header.contains("config") && m.header["config"].is_object())
      for (const auto& [k, v] : m.header["config"].items())
        if (seen.insert(k).second && keys.size() < kMaxConfigRows) keys.push_back(k);
  for (const auto& k : keys)
    row("config." + k, [&](const Metrics& m) -> std::string {
      if (!m.header.is_object() || !m.header.contains("config") || !m.header["config"].is_object()) return "";
      const auto& c = m.header["config"];
      return c.contains(k) ? value_text(c[k]) : "";
    });
  html << "</table></section>\n";
  return html.str();
}

// The pipeline timeline from a Chrome trace: a lane a rank, a box an event (forwards, backwards,
// transfers, waits), the whole of each step as a frame behind them.
std::string timeline(const std::string& path) {
  std::string text = util::read_regular(path, "trace (--trace)", kMaxTraceBytes);
  TORCH_CHECK(util::json_depth(text) <= util::kMaxJsonDepth, "the trace '", path, "' nests deeper than ",
              util::kMaxJsonDepth, " levels (expected the Chrome trace partrain --trace writes)");
  auto trace = nlohmann::json::parse(text, nullptr, false);
  TORCH_CHECK(!trace.is_discarded(), "the trace '", path, "' is not JSON (expected the Chrome trace partrain --trace writes)");
  const nlohmann::json* events = trace.is_array() ? &trace : nullptr;
  if (trace.is_object() && trace.contains("traceEvents") && trace["traceEvents"].is_array()) events = &trace["traceEvents"];
  TORCH_CHECK(events, "the trace '", path, "' has no traceEvents list (expected the Chrome trace partrain --trace writes)");
  struct Box {
    double ts, dur;
    std::string name, cat;
  };
  std::map<double, std::vector<Box>> lanes;
  std::map<double, std::string> lane_names;
  size_t boxes = 0, dropped = 0;
  double t0 = std::numeric_limits<double>::infinity(), t1 = -t0;
  for (const auto& e : *events) {
    if (!e.is_object()) continue;
    auto ph = string_at(e, "ph");
    double tid = e.contains("tid") && e["tid"].is_number() ? e["tid"].get<double>() : 0;
    if (ph == "M" && string_at(e, "name") == "thread_name" && e.contains("args") && e["args"].is_object()) {
      lane_names[tid] = string_at(e["args"], "name");
      continue;
    }
    if (ph != "X" || !e.contains("ts") || !e["ts"].is_number() || !e.contains("dur") || !e["dur"].is_number()) continue;
    double ts = e["ts"].get<double>(), dur = e["dur"].get<double>();
    if (!std::isfinite(ts) || !std::isfinite(dur) || dur < 0) continue;
    if (boxes >= kMaxBoxes || (lanes.size() >= 4096 && !lanes.count(tid))) {
      ++dropped;
      continue;
    }
    lanes[tid].push_back({ts, dur, string_at(e, "name"), string_at(e, "cat")});
    t0 = std::min(t0, ts), t1 = std::max(t1, ts + dur);
    ++boxes;
  }
  std::ostringstream html;
  html << "<section class=\"chart\"><h2>Pipeline timeline</h2>\n<p class=\"note\">" << escape(path) << ": "
       << boxes << " events" << (dropped ? " (" + std::to_string(dropped) + " more not drawn)" : "") << "</p>\n";
  if (lanes.empty()) {
    html << "<p class=\"note\">the trace holds no complete events</p></section>\n";
    return html.str();
  }
  static const std::map<std::string, std::string> fills = {
      {"forward", "#4e9a06"}, {"backward", "#f57900"}, {"weight", "#ce5c00"}, {"send", "#729fcf"},
      {"recv", "#babdb6"},    {"wait", "#888a85"},     {"sync", "#ad7fa8"},  {"gather", "#c4a000"}};
  html << "<div class=\"legend\">";
  for (const char* k : {"forward", "backward", "weight", "send", "recv", "wait", "sync", "gather"})
    html << "<span><i class=\"swatch\" style=\"background:" << fills.at(k) << "\"></i>" << k << "</span>";
  html << "</div>\n";
  const double lane_h = 28, top = 10, left = 150, right = 16;
  double height = top + lane_h * static_cast<double>(lanes.size()) + 40;
  Axis x = from_zero(make_axis(0, (t1 - t0) / 1000, false));  // milliseconds from the first event
  html << "<svg width=\"" << kWidth << "\" height=\"" << height << "\" viewBox=\"0 0 " << kWidth << " " << height
       << "\" role=\"img\">\n";
  double x0 = left, x1 = kWidth - right, y_axis = top + lane_h * static_cast<double>(lanes.size());
  for (double t : x.ticks) {
    double px = x.at(t, x0, x1);
    html << "<line x1=\"" << fixed(px) << "\" x2=\"" << fixed(px) << "\" y1=\"" << top << "\" y2=\"" << y_axis + 5
         << "\" stroke=\"#eee\"/><text x=\"" << fixed(px) << "\" y=\"" << y_axis + 18
         << "\" text-anchor=\"middle\" class=\"tick\">" << escape(x.label(t)) << "</text>\n";
  }
  html << "<text x=\"" << (x0 + x1) / 2 << "\" y=\"" << height - 4 << "\" text-anchor=\"middle\" class=\"axis\">"
       << "milliseconds</text>\n";
  size_t lane = 0;
  for (auto& [tid, list] : lanes) {
    double y = top + lane_h * static_cast<double>(lane++);
    auto name = lane_names.count(tid) ? lane_names[tid] : "tid " + sig(tid, 10);
    html << "<text x=\"" << x0 - 6 << "\" y=\"" << fixed(y + lane_h / 2 + 4) << "\" text-anchor=\"end\" class=\"tick\">"
         << escape(name.size() > 24 ? name.substr(0, 24) + "..." : name) << "</text>\n";
    std::stable_sort(list.begin(), list.end(), [](const Box& a, const Box& b) { return a.dur > b.dur; });  // outer first
    for (const auto& b : list) {
      double bx = x.at((b.ts - t0) / 1000, x0, x1), bw = std::max(0.5, x.at((b.ts + b.dur - t0) / 1000, x0, x1) - bx);
      bool frame_box = b.cat == "step";
      auto fill = fills.find(b.cat);
      double inset = frame_box ? 1 : b.cat == "wait" ? 9 : 4;
      html << "<rect x=\"" << fixed(bx, 2) << "\" y=\"" << fixed(y + inset) << "\" width=\"" << fixed(bw, 2)
           << "\" height=\"" << fixed(lane_h - 2 * inset) << "\" fill=\""
           << (frame_box ? "none" : fill != fills.end() ? fill->second : "#cccccc") << "\""
           << (frame_box ? " stroke=\"#555\" stroke-dasharray=\"3 2\"" : "") << "><title>" << escape(b.name) << " ("
           << fixed(b.dur / 1000, 3) << " ms)</title></rect>\n";
      if (!frame_box && b.cat != "wait" && bw > 7.0 * static_cast<double>(b.name.size()) + 4)
        html << "<text x=\"" << fixed(bx + bw / 2) << "\" y=\"" << fixed(y + lane_h / 2 + 4)
             << "\" text-anchor=\"middle\" class=\"box\">" << escape(b.name) << "</text>\n";
    }
  }
  html << "</svg></section>\n";
  return html.str();
}

const char* const kStyle = R"(<style>
body { font: 14px/1.4 "DejaVu Sans", Helvetica, Arial, sans-serif; margin: 16px 24px; color: #222; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 18px 0 4px; }
.note { color: #555; margin: 2px 0; } .verdict { font-weight: bold; }
table.runs { border-collapse: collapse; } table.runs th, table.runs td { border: 1px solid #ddd; padding: 2px 8px;
  text-align: left; vertical-align: top; max-width: 420px; overflow-wrap: anywhere; }
table.runs th { background: #f6f6f6; font-weight: normal; color: #444; } td.differs { background: #fff3c4; }
.legend span { margin-right: 18px; white-space: nowrap; }
.legend i { display: inline-block; width: 22px; height: 0; margin-right: 6px; vertical-align: middle; }
i.swatch { display: inline-block; width: 12px; height: 12px; margin-right: 6px; vertical-align: middle; border: 0; }
svg text.tick { font-size: 11px; fill: #444; } svg text.axis { font-size: 12px; fill: #444; }
svg text.box { font-size: 10px; fill: #fff; }
pre { background: #f6f6f6; padding: 8px; overflow-x: auto; font-size: 12px; }
</style>
)";

}  // namespace

std::string html_escape(const std::string& s) { return escape(s); }

bool is_report_page(const std::string& head) { return head.rfind("<!DOCTYPE html>", 0) == 0; }

std::string report_html(const std::vector<Metrics>& runs, const ReportOptions& options) {
  std::ostringstream html;
  html << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>" << escape(options.title)
       << "</title>\n" << kStyle << "</head><body>\n<h1>" << escape(options.title) << "</h1>\n";
  for (const auto& n : options.notes) html << "<p class=\"verdict\">" << escape(n) << "</p>\n";
  html << "<p class=\"note\">made by partrain " << escape(PARTRAIN_VERSION) << " from " << runs.size()
       << " metrics file(s)</p>\n";
  html << header_table(runs);

  auto lines_of = [&](const std::string& field) {
    std::vector<Line> lines;
    for (size_t i = 0; i < runs.size(); ++i) {
      auto s = runs[i].series.find(field);
      if (s != runs[i].series.end()) lines.push_back({runs[i].name, colour(i), dash(i), i, &s->second});
    }
    return lines;
  };
  html << line_chart("Loss", "loss", lines_of("loss"));
  struct Chart {
    const char* field;
    const char* title;
  };
  for (auto [field, title] : {Chart{"lr", "Learning rate"}, Chart{"tokens_per_s", "Tokens per second"}}) {
    auto lines = lines_of(field);
    if (lines.empty()) html << "<section class=\"chart\"><h2>" << title << "</h2><p class=\"note\">no run logs <code>"
                            << field << "</code></p></section>\n";
    else html << line_chart(title, field, lines);
  }
  html << memory_chart(runs);
  // Mixture of experts: the load heat maps, then the router's step fields where a run logs them.
  html << expert_heatmaps(runs, options);
  const Chart router[] = {{"moe_aux_loss", "Router load-balancing loss (moe_aux_loss)"},
                          {"moe_dropped_fraction", "Slots dropped by the capacity (moe_dropped_fraction)"},
                          {"moe_max_over_mean", "Busiest expert's load over the mean (moe_max_over_mean)"}};
  for (auto [field, title] : router)
    if (auto lines = lines_of(field); !lines.empty()) html << line_chart(title, field, lines);
  // Every other numeric field a run logs, a chart each, in the order first seen.
  std::vector<std::string> others;
  auto charted = [&](const std::string& f) {
    return f == "loss" || f == "lr" || f == "tokens_per_s" ||
           std::any_of(std::begin(router), std::end(router), [&](const Chart& c) { return f == c.field; });
  };
  for (const auto& m : runs)
    for (const auto& f : m.order)
      if (!charted(f) && std::find(others.begin(), others.end(), f) == others.end() && others.size() < kMaxOtherCharts)
        others.push_back(f);
  for (const auto& f : others) html << line_chart(f, f, lines_of(f));
  if (!options.trace_path.empty()) html << timeline(options.trace_path);
  for (size_t i = 0; i < runs.size(); ++i)
    if (!runs[i].plan.empty())
      html << "<section><h2>Plan: " << escape(runs[i].name) << "</h2><pre>" << escape(runs[i].plan) << "</pre></section>\n";
  html << "</body></html>\n";
  return html.str();
}

int run_report(int argc, char** argv, int first) {
  CLI::App app{"partrain report: one self-contained HTML page of a run's metrics (or several runs' on shared axes).\n\n"
               "  partrain report RUN_DIR_OR_METRICS_FILE... [-o report.html] [--trace trace.json] [--title TEXT]\n"
               "                  [--experts-layer PATH]\n\n"
               "A run folder holds metrics.jsonl (partrain --metrics DIR/metrics.jsonl) and, optionally,\n"
               "trace.json (partrain --trace), drawn as the pipeline timeline.\n",
               "partrain report"};
  std::vector<std::string> inputs;
  std::string out = "report.html", trace, title = "partrain run report";
  app.add_option("runs", inputs, "metrics files (JSONL) or run folders holding metrics.jsonl")->required();
  app.add_option("-o,--output", out, "the HTML file to write (default report.html)");
  app.add_option("--trace", trace, "a Chrome trace (partrain --trace) to draw as the pipeline timeline")
      ->check(non_empty("a trace file"));
  app.add_option("--title", title, "the page's heading");
  std::string experts_layer;
  app.add_option("--experts-layer", experts_layer,
                 "the MoE block whose experts the load heat map draws (its path, or a prefix such as layers.3); "
                 "default: every block")
      ->check(non_empty("a block path"));
  std::vector<char*> args{argv[0]};
  for (int i = first; i < argc; ++i) args.push_back(argv[i]);
  try {
    app.parse(static_cast<int>(args.size()), args.data());
  } catch (const CLI::ParseError& e) {
    return parse_failed(app, e);
  }
  auto fail = [](const std::string& message) {
    std::cerr << "partrain: report: " << message << std::endl;
    return 1;
  };
  if (inputs.size() > kMaxRuns)
    return fail(std::to_string(inputs.size()) + " metrics files; a page overlays at most " + std::to_string(kMaxRuns));
  if (out.empty()) return fail("-o is empty (expected the HTML file to write)");
  if (util::is_plain_dir(out)) return fail("-o '" + out + "' is a folder; give a file name");
  if (!writable_beside(out)) return fail("-o '" + out + "': its folder does not exist");
  if (auto refused = util::may_replace(out, is_report_page, "an HTML report"); !refused.empty())
    return fail("-o " + refused);
  try {
    std::vector<Metrics> runs;
    for (const auto& input : inputs) {
      runs.push_back(read_metrics(metrics_file_of(input), input));
      TORCH_CHECK(runs.back().steps > 0, "the metrics file '", runs.back().path,
                  "' holds no step records (pt.log { step = ..., loss = ... } writes them)");
    }
    ReportOptions options;
    options.title = title;
    options.trace_path = trace;
    options.experts_layer = experts_layer;
    if (trace.empty())  // a run folder's own trace
      for (const auto& input : inputs)
        if (util::is_plain_dir(input) && util::is_regular(input + "/trace.json")) {
          options.trace_path = input + "/trace.json";
          break;
        }
    util::write_atomic(out, report_html(runs, options));
    int64_t steps = 0;
    for (const auto& m : runs) steps += m.steps;
    std::cout << "wrote " << out << " (" << runs.size() << " run(s), " << steps << " step records"
              << (options.trace_path.empty() ? "" : ", the timeline of " + options.trace_path) << ")" << std::endl;
    return 0;
  } catch (const std::exception& e) {
    return fail(util::message_of(e));
  }
}

}  // namespace partrain::app
