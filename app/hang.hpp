// Reading a hang from the ranks' collective ledgers: which rank the others wait for, why (stopped,
// dead, busy elsewhere, or waiting in another call because it skipped one), and where every rank
// is, with the script lines; the launcher prints it when a collective times out or no rank
// progresses, and prints every rank's ledger tail on demand (SIGUSR1).
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "engine/dist/ledger.hpp"

namespace partrain::app::hang {

/// What the launcher knows of one local rank.
struct RankView {
  int rank = 0, local_rank = 0;
  pid_t pid = -1;
  bool running = true;
  int status = 0;              ///< its wait status, once it has ended
  char state = '?';            ///< /proc/PID/stat's state letter while running ('T': stopped)
  dist::ledger::Copy ledger;   ///< invalid when the rank shares none
  bool line_fresh = false;     ///< ledger.line answers the launcher's latest question
};

struct Diagnosis {
  /// Indices into the views; empty: the ledgers do not tell (with a headline: ranks wait in calls
  /// every rank they need has made, none stopped, and none progressed; without one: no rank waits).
  std::vector<int> culprits;
  std::string headline;       ///< "rank 1 (local rank 1, pid 42) ..." (no "partrain: ", no period)
  std::string details;        ///< a line a rank, indented two spaces, each ending in '\n'
};

/// Names the rank(s) the others wait for: one that has not made the call they wait in, or, when
/// every rank has made it, one that is stopped (SIGSTOP inside the call). `trigger` finishes
/// "... when <trigger>": "the other ranks timed out waiting in a collective".
Diagnosis diagnose(const std::vector<RankView>& ranks, const std::string& trigger, int64_t now_ns);

/// Whether the ledger shows its rank blocked in a call its script made (waiting, or just timed
/// out or failed in it); not rank 0's wait for the others at the end of the run, which has no time
/// limit (a rank's long work after the others have ended is no hang).
bool in_script_call(const dist::ledger::Copy& ledger);

/// Every rank's state and its last `tail` calls per group, a line each, indented.
std::string dump(const std::vector<RankView>& ranks, int64_t now_ns, size_t tail);

/// "rank 1 (local rank 1, pid 42)"
std::string name(const RankView& r);
/// "exited with status 1", "was killed by signal 9 (SIGKILL)"
std::string describe_status(int status);

}  // namespace partrain::app::hang
