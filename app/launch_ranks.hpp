// One start of this node's ranks, shared by the launcher's files: what the launcher knows of each
// rank, and the start's three steps (start them, watch them, say how the start ended).
#pragma once

#include <signal.h>
#include <sys/types.h>
#include <time.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "app/control.hpp"
#include "app/hang.hpp"
#include "app/launcher.hpp"
#include "engine/dist/ledger.hpp"

namespace partrain::app::detail {

using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC: the ranks' report times use it too

/// Set by the launcher's handlers (launch_start.cpp): the signal that asked it to stop (TERM,
/// or Ctrl-C outside the REPL), and SIGUSR1's request to print every rank's ledger.
extern volatile sig_atomic_t interrupted;
extern volatile sig_atomic_t dump_asked;
inline void ignore_signal(int) {}  // unlike SIG_IGN, not inherited by the ranks through exec

constexpr size_t kMaxReport = 16 * 1024;  // bytes of a rank's report the launcher keeps

inline int64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// What a rank reported before it exited: when, what kind of failure, and its message.
struct Report {
  enum Kind { Error, Collective, Timeout };
  int64_t at_ns = 0;
  Kind kind = Error;
  std::string message;
};

struct Rank {
  int rank = 0, local_rank = 0;
  pid_t pid = -1;
  int out = -1, err = -1, report_fd = -1;  // read ends of the child's stdout, stderr and report pipe
  std::string out_line, err_line;           // partial lines
  std::string report_bytes;
  std::deque<std::string> last_err;
  std::optional<Report> report;
  bool running = false;
  int status = 0;
  int64_t ended_ns = 0;       // when it was reaped
  bool ended_stopping = false;  // reaped after the launcher began stopping the ranks
  const dist::ledger::Region* ledger = nullptr;  // its collective ledger, mapped read-only
  bool line_asked = false;      // the launcher has asked its Lua line (SIGUSR1) ...
  uint64_t line_asked_at = 0;   // ... when its ledger's line_answers was this
};

// How one start of the ranks ended: the launcher's exit status, the failure in one line (empty
// on success), and whether the user interrupted it (never restarted).
struct Outcome {
  int status = 0;
  std::string cause;
  bool interrupted = false;
  /// Over several nodes: only collectives failed here, most likely because of a failure on
  /// another node; what would have been said of it is in `details`, said only if no other
  /// node's failure comes first.
  bool consequence = false;
  std::string details;
};

// What one start of the ranks shares: the rendezvous secret, and on node 0 the store's
// listening socket (handed to rank 0; closed in the launcher once rank 0 has it).
struct StartContext {
  std::string secret;
  int listen_fd = -1;
};

// The launcher's signal handlers (once the dispositions it was started with are saved, for the
// forked ranks): TERM and Ctrl-C stop the ranks, a rank's end wakes the wait, USR1 dumps ledgers.
void take_signals(const LaunchOptions& o);

struct StartPlan;  // how this start's ranks are started (launch_start.cpp)
struct RankPipes;  // one rank's pipes and shared descriptors (launch_start.cpp)

// One start of this node's ranks (`attempt`: how many restarts came before). Over several nodes
// (`control`), watching beats this node's heartbeat meanwhile, and stops the ranks as soon as the
// nodes' verdict on this start says another node failed or was lost. The ranks' ledgers stay
// mapped until it ends (a dead rank's is still read).
class LocalRanks {
 public:
  LocalRanks(const LaunchOptions& o, int attempt, NodeControl* control);
  ~LocalRanks();
  LocalRanks(const LocalRanks&) = delete;
  LocalRanks& operator=(const LocalRanks&) = delete;

  /// Starts every local rank (launch_start.cpp), forked to run `rank_main` or exec'd to run
  /// `partrain child_args`.
  void start(const std::vector<std::string>& child_args, const RankMain& rank_main, StartContext& context);
  /// Forwards their output, reaps them, and stops them all once one fails, the user interrupts,
  /// the nodes' verdict says so, or (--hang-timeout) none progresses (launch_watch.cpp).
  void watch();
  /// Which rank failed first and how, said on stderr, and the outcome (launch_diagnose.cpp).
  Outcome diagnose() const;

 private:
  // Starting (launch_start.cpp).
  void start_rank(int local, const StartPlan& plan, const RankMain& rank_main, StartContext& context);
  [[noreturn]] void become_rank(const Rank& r, const StartPlan& plan, const RankPipes& pipes,
                                const RankMain& rank_main, const StartContext& context) const;
  void set_rank_environment(const Rank& r, const RankPipes& pipes, const StartContext& context) const;
  // Watching (launch_watch.cpp).
  void relay();
  void relay_stdout(Rank& r, std::string& line, const char* buf, ssize_t n, bool eof, size_t scanned);
  void drop_held_pipes();
  void reap();
  void judge();
  void settle_collective();
  void watch_progress();
  void stop_all(int sig);
  void begin_stopping();
  void ask_lines();
  std::vector<hang::RankView> views() const;
  bool open_fds() const;
  std::string prefix(const Rank& r) const;
  // A cause: an error a rank reported as its own, a death by a signal the launcher did not send,
  // or a failing exit without a report.
  bool is_cause(const Rank& r) const;
  // Saying how it ended (launch_diagnose.cpp).
  Outcome hang_outcome(int first_collective) const;
  Outcome missing_outcome(int first_collective) const;
  Outcome failure_outcome(const Rank& r, bool consequence) const;
  std::string other_errors(const Rank& r) const;

  const LaunchOptions& o;
  const int attempt;
  NodeControl* const control;
  const int world;
  std::vector<Rank> ranks;
  int running = 0;  // ranks not yet reaped

  // The terminal. A live progress line (pt.progress) reaches it through rank 0's pipe: rank 0 is
  // told its output ends on one (and its width), and its partial lines that rewrite in place
  // (\r) pass through as they come.
  bool live_terminal = false;
  int columns = 0;
  bool live_partial = false;  // rank 0's live line is on the screen, without its newline

  // Stopping. How long, after the first collective failure, the launcher waits for the other
  // ranks' own reports before stopping them: ranks in the same collective time out together, so
  // a rank still running without a report by then was not in it.
  std::chrono::milliseconds settle;
  bool stopping = false;
  std::optional<Clock::time_point> settle_until;
  std::vector<std::pair<int, char>> missing;  // ranks still running, without a report, when the settling
                                              // ended, and their process state then
  Clock::time_point kill_at;

  // The ledgers: what they said of a hang, and the hang timeout's and the dump's clocks.
  std::optional<hang::Diagnosis> diagnosis;  // the ledgers' account of a hang, taken before stopping
  bool hung = false;                         // the hang timeout ended the run
  std::optional<Clock::time_point> dump_at, hang_asked_at;
  Clock::time_point lines_asked;
  uint64_t last_progress = 0;
  Clock::time_point progress_at;
  std::chrono::milliseconds hang_timeout;
};

}  // namespace partrain::app::detail
