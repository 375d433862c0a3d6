// The local launcher behind `partrain --nproc-per-node N script.lua`: starts N ranks of this
// machine with torchrun's environment (forked from the launcher, which has LibTorch loaded
// already; exec'd where forking is unsafe), forwards their output, and when one fails stops the rest
// and says which rank failed first and how: each rank reports its fatal error, with the time it
// happened, through a pipe; the earliest error, or a death by a signal the launcher did not
// send, is the cause; when the first failures are collective timeouts (or, with a hang timeout,
// no rank progresses), the ranks' collective ledgers, which the launcher maps, say which rank the
// others wait for and where each one is. SIGUSR1 makes it print every rank's ledger.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace partrain::app {

struct LaunchOptions {
  int nproc_per_node = 1;         ///< ranks on this machine
  int nnodes = 1;                 ///< machines
  int node_rank = 0;              ///< this machine's index
  std::string master_addr;        ///< where rank 0 serves the rendezvous; default 127.0.0.1
  int master_port = 0;            ///< its port; 0: a free one (one machine only)
  bool tee = false;               ///< every rank's stdout, each line prefixed with its rank
  int threads = 0;                ///< intra-op threads a rank; 0: cores / local ranks
  int timeout = 300;              ///< seconds a collective or the rendezvous may wait
  double grace = 5.0;             ///< seconds between TERM and KILL when stopping ranks
  /// The REPL: rank 0 keeps the terminal (stdin, stdout, stderr, and the foreground process
  /// group, so Ctrl-C reaches every rank and the launcher ignores it).
  bool interactive = false;
  /// torchrun's --max-restarts: when a rank fails, stop the others and start every rank again,
  /// up to this many times (0: never); ranks see PARTRAIN_RESTART_COUNT (and torchrun's
  /// TORCHELASTIC_RESTART_COUNT). Over several nodes every node's launcher restarts together,
  /// agreed through node 0's control store (control.hpp).
  int max_restarts = 0;
  double restart_backoff = 1.0;  ///< seconds between stopping the ranks and starting them again
  /// --node-timeout, with --nnodes > 1: seconds without a heartbeat from a node's launcher after
  /// which the others declare it lost and end the job.
  double node_timeout = 30;
  /// Seconds without any change in any rank's collective ledger, while a rank waits in a call,
  /// after which the launcher names the rank the others wait for and stops the run; 0: off (a
  /// hang then ends at the collectives' --timeout).
  double hang_timeout = 0;
  /// --rdzv-secret-file: the job's rendezvous secret, the same file on every node (needed with
  /// --nnodes > 1); empty: one made from /dev/urandom for this job (or PARTRAIN_RDZV_SECRET).
  std::string secret_file;
  /// Start each rank by exec'ing partrain again rather than by fork() (PARTRAIN_EXEC_RANKS=1);
  /// also chosen when forking is unsafe: the launcher has a thread or has asked CUDA anything.
  bool exec_ranks = false;
};

/// What a rank runs: the rank's part of `partrain` (the script, -e chunks, the REPL) with its
/// intra-op threads, returning its exit status. A forked rank calls it directly.
using RankMain = std::function<int(int threads)>;

/// The bounds of the launcher's numbers, shared with the command line's checks.
constexpr int kMaxLocalRanks = 1024;  ///< --nproc-per-node
constexpr int kMaxNodes = 1024;       ///< --nnodes
constexpr int kMaxTimeout = 7 * 24 * 3600;  ///< --timeout, seconds (as PARTRAIN_TIMEOUT)
constexpr int kMaxRestarts = 1000;          ///< --max-restarts
constexpr double kMaxBackoff = 3600;        ///< --restart-backoff, seconds
constexpr double kMaxHangTimeout = kMaxTimeout;  ///< --hang-timeout, seconds
/// --node-timeout, seconds: a heartbeat is sent about once a second and node 0 looks about once a
/// second, so two looks can fall with no beat between them: below 3 s a live node could be lost.
constexpr double kMinNodeTimeout = 3;
constexpr double kMaxNodeTimeout = kMaxTimeout;

/// Checks the options; a bad value is an error naming the flag.
void validate(const LaunchOptions& options);

/// At start-up, in every partrain process: moves a PARTRAIN_RDZV_SECRET it was started with out
/// of the environment block /proc/PID/environ shows, and in a rank (RANK, WORLD_SIZE) makes a
/// broken pipe or socket an EPIPE error rather than a death by SIGPIPE. In a rank the launcher
/// started, also takes the report pipe named by PARTRAIN_REPORT_FD (made close-on-exec, so the
/// script's own children do not hold it), reads the rendezvous secret from the pipe named by
/// PARTRAIN_RDZV_SECRET_FD, and maps the collective ledger the launcher shares
/// (PARTRAIN_LEDGER_FD). Call once, before any collective.
void adopt_report_channel();
/// In such a rank: tells the launcher this rank's fatal error, with the monotonic time of now,
/// before the rank exits (and so before its sockets close and its peers fail). Elsewhere it
/// does nothing.
/// Returns whether the launcher has it and says it (a rank's own error, not a failed collective
/// or a timeout): then the rank need not, and a user's error is one message, not one a rank.
bool report_failure(const std::string& message);

/// Starts every local rank and waits for all of them. Each rank is forked from the launcher,
/// which has LibTorch loaded already, and runs `rank_main`; with exec_ranks (or when forking is
/// unsafe) it runs `partrain child_args` instead (partrain's arguments for one rank: flags,
/// script, script arguments). Returns the exit status for the launcher: 0 when every rank
/// succeeded.
int launch(const LaunchOptions& options, const std::vector<std::string>& child_args, const RankMain& rank_main);

/// The secret in `path` (--rdzv-secret-file): a regular file no other user can read, 16 to 1024
/// bytes once its trailing white space is dropped. Anything else is an error naming the file.
std::string read_secret_file(const std::string& path);

}  // namespace partrain::app
