// The report's heat map of experts' load (see report.hpp): a row an MoE block's expert, a column
// an experts record, each cell coloured by the expert's load over its block's mean on a diverging
// scale around 1 (blue: idle, white: an even share, red: overloaded).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "app/report.hpp"

namespace partrain::app {

namespace {

constexpr size_t kMaxRows = 256;      // rows drawn (blocks x experts); past it, the first blocks that fit
constexpr size_t kMaxCells = 16384;   // cells drawn: columns are thinned to fit
constexpr double kWidth = 1000, kLeft = 230, kRight = 16, kTop = 8, kAxis = 34;
// Each cell's colour saturates at 4x the mean (red) and at a quarter of it or none (blue).
constexpr double kSaturate = 4;

std::string fixed(double v, int decimals = 1) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

/// The colour of a load over the mean: log2(load) / log2(kSaturate), clamped to [-1, 1], from
/// white (#f7f7f7, at 1) to red (#b2182b, 4x and more) or blue (#2166ac, a quarter and less; none).
/// Grey (#d9d9d9) where the block routed nothing.
std::string heat_colour(double load) {
  if (!std::isfinite(load)) return "#d9d9d9";
  double t = load <= 0 ? -1 : std::clamp(std::log2(load) / std::log2(kSaturate), -1.0, 1.0);
  const int white[] = {0xf7, 0xf7, 0xf7}, red[] = {0xb2, 0x18, 0x2b}, blue[] = {0x21, 0x66, 0xac};
  const int* end = t >= 0 ? red : blue;
  double a = std::fabs(t);
  char buf[8];
  int c[3];
  for (int i = 0; i < 3; ++i) c[i] = static_cast<int>(std::lround(white[i] + (end[i] - white[i]) * a));
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", c[0], c[1], c[2]);
  return buf;
}

// The scale under a map: swatches from a quarter of the mean to 4x, labelled.
std::string scale() {
  std::ostringstream html;
  html << "<svg width=\"" << kWidth << "\" height=\"34\" viewBox=\"0 0 " << kWidth << " 34\" role=\"img\">\n";
  const int steps = 17;
  const double w = 20;
  for (int i = 0; i < steps; ++i) {
    double load = std::pow(kSaturate, -1 + 2.0 * i / (steps - 1));
    html << "<rect class=\"scale\" x=\"" << fixed(kLeft + w * i) << "\" y=\"2\" width=\"" << w
         << "\" height=\"12\" fill=\"" << heat_colour(load) << "\"/>\n";
  }
  const std::pair<int, const char*> labels[] = {{0, "&#8804; 1/4"}, {4, "1/2"}, {8, "1 (the mean)"}, {12, "2"},
                                                {16, "&#8805; 4"}};
  for (auto [i, text] : labels)
    html << "<text x=\"" << fixed(kLeft + w * i + w / 2) << "\" y=\"28\" text-anchor=\"middle\" class=\"tick\">"
         << text << "</text>\n";
  html << "<text x=\"" << kLeft - 8 << "\" y=\"12\" text-anchor=\"end\" class=\"tick\">load / block mean</text>\n"
       << "</svg>\n";
  return html.str();
}

// One run's map: the rows of `blocks` (indices into x.layers), the columns thinned to fit.
std::string heatmap(const ExpertLoad& x, size_t file, const std::vector<size_t>& blocks) {
  std::vector<size_t> first_row(x.layers.size() + 1, 0);  // each block's first row in a column
  for (size_t b = 0; b < x.layers.size(); ++b) first_row[b + 1] = first_row[b] + static_cast<size_t>(x.experts[b]);
  size_t rows = 0;
  for (size_t b : blocks) rows += static_cast<size_t>(x.experts[b]);
  const size_t shown = std::min(x.columns.size(), std::max<size_t>(1, kMaxCells / std::max<size_t>(rows, 1)));
  std::vector<size_t> cols;  // evenly spaced, the first and the last among them
  for (size_t i = 0; i < shown; ++i)
    cols.push_back(shown == 1 ? x.columns.size() - 1 : i * (x.columns.size() - 1) / (shown - 1));
  const double row_h = std::clamp(240.0 / static_cast<double>(rows), 3.0, 16.0);
  const double height = kTop + row_h * static_cast<double>(rows) + kAxis;
  const double col_w = (kWidth - kLeft - kRight) / static_cast<double>(cols.size());
  std::ostringstream svg;
  svg << "<svg class=\"heatmap\" data-file=\"" << file << "\" width=\"" << kWidth << "\" height=\"" << fixed(height)
      << "\" viewBox=\"0 0 " << kWidth << " " << fixed(height) << "\" role=\"img\">\n";
  double y = kTop;
  for (size_t b : blocks) {
    const auto& path = x.layers[b];
    std::string label = path.size() > 30 ? "..." + path.substr(path.size() - 27) : path;
    svg << "<text x=\"4\" y=\"" << fixed(y + std::min(row_h, 12.0)) << "\" class=\"tick\">" << html_escape(label)
        << "</text>\n";
    for (int64_t e = 0; e < x.experts[b]; ++e, y += row_h) {
      if (row_h >= 9)
        svg << "<text x=\"" << kLeft - 6 << "\" y=\"" << fixed(y + row_h - 2) << "\" text-anchor=\"end\" class=\"tick\">"
            << e << "</text>\n";
      for (size_t c = 0; c < cols.size(); ++c) {
        const auto& column = x.columns[cols[c]];
        double load = column.load[first_row[b] + static_cast<size_t>(e)];
        std::string value = std::isfinite(load) ? num(load) : "none routed";
        svg << "<rect class=\"heat\" data-file=\"" << file << "\" data-layer=\"" << html_escape(path)
            << "\" data-expert=\"" << e << "\" data-step=\"" << num(column.step) << "\" data-load=\"" << value
            << "\" x=\"" << fixed(kLeft + col_w * static_cast<double>(c), 2) << "\" y=\"" << fixed(y, 2)
            << "\" width=\"" << fixed(col_w + 0.3, 2) << "\" height=\"" << fixed(row_h + 0.3, 2) << "\" fill=\""
            << heat_colour(load) << "\"><title>" << html_escape(path) << ", expert " << e << ", step "
            << num(column.step) << ": " << (std::isfinite(load) ? num(load) + " x the mean" : value)
            << "</title></rect>\n";
      }
    }
    svg << "<line x1=\"0\" x2=\"" << kWidth - kRight << "\" y1=\"" << fixed(y) << "\" y2=\"" << fixed(y)
        << "\" stroke=\"#999\"/>\n";
  }
  // Step labels: every few columns from the first, and the last (the one before it left out
  // when they would touch).
  const size_t every = std::max<size_t>(1, (cols.size() + 7) / 8), last = cols.size() - 1;
  for (size_t c = 0; c <= last; ++c) {
    if (c != last && (c % every != 0 || (c != 0 && last - c < every))) continue;
    svg << "<text x=\"" << fixed(kLeft + col_w * (static_cast<double>(c) + 0.5)) << "\" y=\"" << fixed(y + 16)
        << "\" text-anchor=\"middle\" class=\"tick\">" << num(x.columns[cols[c]].step) << "</text>\n";
  }
  svg << "<text x=\"" << (kLeft + kWidth - kRight) / 2 << "\" y=\"" << fixed(height - 2)
      << "\" text-anchor=\"middle\" class=\"axis\">step</text>\n</svg>\n";
  std::string notes;
  if (static_cast<int64_t>(cols.size()) < x.seen)  // thinned when read, or here to bound the cells
    notes += "<p class=\"note\">" + std::to_string(cols.size()) + " of " + std::to_string(x.seen) +
             " records drawn, evenly spaced.</p>\n";
  return svg.str() + notes;
}

// The blocks of `x` a map draws: those `want` names (a path, or a prefix ending before a dot),
// else all, up to kMaxRows rows.
std::vector<size_t> chosen_blocks(const ExpertLoad& x, const std::string& want, std::string& note) {
  std::vector<size_t> blocks;
  size_t rows = 0, left_out = 0;
  for (size_t b = 0; b < x.layers.size(); ++b) {
    const auto& path = x.layers[b];
    if (!want.empty() && path != want && path.rfind(want + ".", 0) != 0) continue;
    if (rows + static_cast<size_t>(x.experts[b]) > kMaxRows && !blocks.empty()) {
      ++left_out;
      continue;
    }
    blocks.push_back(b);
    rows += static_cast<size_t>(x.experts[b]);
  }
  if (blocks.empty() && !want.empty())
    note = "no MoE block is named '" + want + "' (blocks: " + x.layers.front() +
           (x.layers.size() > 1 ? " ... " + x.layers.back() : "") + ")";
  else if (left_out)
    note = std::to_string(left_out) + " more block(s) not drawn (at most " + std::to_string(kMaxRows) +
           " rows); choose one with --experts-layer PATH";
  return blocks;
}

}  // namespace

std::string expert_heatmaps(const std::vector<Metrics>& runs, const ReportOptions& options) {
  std::ostringstream html;
  bool any = false;
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto& x = runs[i].experts;
    if (x.columns.empty()) continue;
    any = true;
    html << "<section class=\"chart experts\"><h2>Expert load: " << html_escape(runs[i].name) << "</h2>\n"
         << "<p class=\"note\">each expert's routed slots (before capacity drops) over its block's mean, "
         << "summed over every rank, a column an experts record</p>\n" << scale();
    if (x.restarts)
      html << "<p class=\"note\">the file's blocks changed " << x.restarts << " time(s); the newest are drawn</p>\n";
    std::string note;
    auto blocks = chosen_blocks(x, options.experts_layer, note);
    if (!note.empty()) html << "<p class=\"note\">" << html_escape(note) << "</p>\n";
    if (!blocks.empty()) html << heatmap(x, i, blocks);
    html << "</section>\n";
  }
  return any ? html.str() : std::string();
}

}  // namespace partrain::app
