// Reading a run's metrics file (JSONL: a run header, step records, memory and plan records, as
// docs/observability.md describes), bounded however long the run was, for `partrain report` and
// `partrain parity`.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace partrain::app {

/// One numeric field of the step records, as (step, value) points in step order. NaN stands for
/// a value logged as null, NaN or an infinity (a gap in a chart).
struct Series {
  std::vector<std::pair<double, double>> points;
  int64_t seen = 0;      ///< records that held the field (points holds at most ReadOptions::max_points)
  int64_t stride = 1;    ///< points keeps every stride-th of them (and the last)
  std::pair<double, double> last{0, 0};
};

/// The experts records of a file (pt.metrics.experts): each MoE block's load per expert at each
/// record, over the block's mean load (1: an even share), for the report's heat map.
struct ExpertLoad {
  struct Column {
    double step = 0;
    std::vector<double> load;  ///< a row a block's expert, the blocks in turn (NaN: the block routed none)
  };
  std::vector<std::string> layers;  ///< the blocks' paths
  std::vector<int64_t> experts;     ///< experts of each block
  std::vector<Column> columns;      ///< in step order; at most ReadOptions::max_expert_columns, evenly spaced
  int64_t seen = 0;                 ///< records read (of the newest layout of blocks)
  int64_t stride = 1;               ///< columns keeps every stride-th record (and the last)
  int64_t restarts = 0;             ///< records whose blocks differed from the ones before (the map restarts)
  Column last;
};

/// What a metrics file says about one run (or one run and its resumptions).
struct Metrics {
  std::string path;                       ///< the metrics file read
  std::string name;                       ///< how reports name it (the argument as given)
  nlohmann::json header;                  ///< the newest run header (null when there is none)
  int runs = 0;                           ///< run headers seen: 1 + the resumptions
  std::map<std::string, Series> series;   ///< numeric step fields ("loss", "lr", ...), downsampled
  std::vector<std::string> order;         ///< series names in the order first seen
  std::vector<double> memory;             ///< the newest memory record: peak bytes of each rank
  int64_t memory_step = -1;               ///< its step (-1: none, or not given)
  std::string plan;                       ///< the newest plan record's text
  ExpertLoad experts;                     ///< the experts records
  int64_t steps = 0;                      ///< step records read
  double first_step = 0, last_step = 0;   ///< the smallest and largest step logged
  double first_time = 0, last_time = 0;   ///< unix seconds of the first and last record
  bool torn_tail = false;                 ///< the last line was cut short (a run killed mid-write): skipped
  int64_t fields_dropped = 0;             ///< numeric fields past ReadOptions::max_series, not charted
  /// With ReadOptions::exact_losses: every step record's (step, loss, line), in file order.
  struct Loss {
    int64_t step;
    double loss;
    int64_t line;
  };
  std::vector<Loss> losses;
};

/// How much of a metrics file is kept.
struct ReadOptions {
  size_t max_points = 2000;                     ///< points a series keeps (evenly spaced, and the last)
  size_t max_series = 32;                       ///< numeric fields charted (the first seen)
  uint64_t max_file_bytes = uint64_t(4) << 30;  ///< a larger file is refused
  size_t max_line_bytes = size_t(16) << 20;     ///< a longer line is refused
  bool exact_losses = false;                    ///< keep every step's loss (for parity)
  int64_t max_exact = 2000000;                  ///< at most this many of them
  int64_t up_to_step = -1;                      ///< with exact_losses: only steps <= this (-1: all)
  size_t max_ranks = 65536;                     ///< ranks a memory record may list
  size_t max_expert_cells = 65536;              ///< experts (over all blocks) an experts record may list
  size_t max_expert_columns = 512;              ///< experts records kept (evenly spaced, and the last)
  size_t max_expert_values = size_t(4) << 20;   ///< ... and at most this many loads in all
};

/// The metrics file `path` names: `path` itself, or `path`/metrics.jsonl when `path` is a folder
/// (a run folder). Raises when neither is there.
std::string metrics_file_of(const std::string& path);

/// Reads a metrics file (only a regular one), streaming it line by line. Raises, naming the file
/// and line, on a line that is not a JSON object, a step that is not a number, or a memory or
/// run record of the wrong shape; a torn last line (no newline, not JSON) is skipped and noted.
Metrics read_metrics(const std::string& path, const std::string& name, const ReadOptions& options = {});

}  // namespace partrain::app
