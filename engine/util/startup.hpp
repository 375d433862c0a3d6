// Start-up timestamps: with PARTRAIN_STARTUP_TRACE=1 each process prints, on stderr, when it
// reached each phase of its start (process start, main, rendezvous, groups, script, first step),
// so that the seconds between `partrain` and a first training step can be accounted for.
#pragma once

#include <string>

namespace partrain::util {

/// Whether PARTRAIN_STARTUP_TRACE=1 (read once).
bool startup_trace_on();

/// Prints "partrain startup: +S.SSS s <who>: <phase>" on stderr when the trace is on; nothing
/// otherwise. S counts from the start of the job: PARTRAIN_STARTUP_T0 (monotonic ns, set by the
/// launcher for its ranks), else this process's own start. The first mark also prints when the
/// process itself started.
void startup_mark(const std::string& phase);

/// Like startup_mark, once per process for a given `phase` (a first step, say).
void startup_mark_once(const char* phase);

/// Who marks: "launcher", "rank N". Set once the process knows.
void startup_set_who(const std::string& who);

/// The job's time zero (see startup_mark), for the launcher to hand to its ranks.
long long startup_t0_ns();

/// Monotonic nanoseconds now (CLOCK_MONOTONIC), the clock of PARTRAIN_STARTUP_T0.
long long monotonic_ns();

}  // namespace partrain::util
