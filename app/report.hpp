// `partrain report`: one self-contained HTML page (inline SVG, no script, nothing fetched) drawing
// one or more runs' metrics files on shared axes, with their headers, plans, per-rank memory and a
// pipeline timeline (docs/observability.md).
#pragma once

#include <string>
#include <vector>

#include "app/metrics.hpp"

namespace partrain::app {

/// What goes on a report page besides the runs.
struct ReportOptions {
  std::string title = "partrain run report";  ///< the page's heading
  std::string trace_path;                     ///< a Chrome trace (partrain --trace) to draw as a timeline; "" for none
  std::vector<std::string> notes;             ///< lines shown under the heading (parity's verdict)
  std::string experts_layer;                  ///< the heat map's block (its path, or a prefix ending at a dot); "": all
};

/// The page, as HTML text. Every string from a file is escaped; the trace, when given, is read
/// bounded (raises naming it when it is not a Chrome trace).
std::string report_html(const std::vector<Metrics>& runs, const ReportOptions& options);

/// The heat map of each run's experts records (pt.metrics.experts): a row a block's expert, a
/// column a record, coloured by the expert's load over its block's mean (report_experts.cpp).
/// "" when no run has experts records.
std::string expert_heatmaps(const std::vector<Metrics>& runs, const ReportOptions& options);

/// `s` for HTML text and attribute values: &, <, >, " and ' escaped, control bytes blanked.
std::string html_escape(const std::string& s);

/// Whether a file's first bytes are those of a page report_html writes (what -o may replace).
bool is_report_page(const std::string& head);

/// `partrain report ...`; argv[first] is the first word after `report`. Returns the exit status.
int run_report(int argc, char** argv, int first);

}  // namespace partrain::app
