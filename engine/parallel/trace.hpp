// The step trace (`partrain --trace FILE`): every rank records what its first training steps ran
// (forwards, backwards, sends, receives and the wait inside each receive) as timestamps into a
// vector, and rank 0 writes them all as Chrome trace JSON, one row a rank (docs/pipeline.md).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace partrain::parallel {

/// What a traced step records, and where it goes.
struct TraceOptions {
  std::string path;  ///< the JSON file rank 0 writes (replaced atomically after every traced step)
  int steps = 3;     ///< how many training steps, from the first, are recorded
};

/// The kinds of event a row shows; each is one Chrome "X" (complete) event, named like the
/// schedule's actions ("F3.c0", "SEND_F3.c0->1", "RECV_B3.c0<-1"; "wait" inside a receive).
/// ZeRO-3's unit gathers ("GATHER u3": from its start to its completion, `mb` the unit) go on a
/// row of their own a rank ("rank r: ZeRO-3 gathers"), beside the compute they overlap. So do
/// ring attention's exchanges ("KV2": the key/value block passed at ring step 2, "DKV2": a block's
/// gradient passed on in backward, each from its start to its completion), while each step's
/// attention block ("ATTN2") goes on the rank's own row, inside the forward or backward.
enum class TraceKind { Step, Forward, Backward, Weight, SendActivation, SendGradient, RecvActivation, RecvGradient, Wait, Sync,
                       Gather, RingPass, RingGradient, RingBlock };

/// This process's step trace. Off unless configured (from PARTRAIN_TRACE and PARTRAIN_TRACE_STEPS,
/// which `partrain --trace FILE --trace-steps K` sets for every rank, or by configure()).
/// Whether a file's first bytes are those of a trace StepTrace writes (what --trace may replace).
bool is_trace_head(const std::string& head);

class StepTrace {
 public:
  using Clock = std::chrono::steady_clock;

  static StepTrace& instance();
  void configure(TraceOptions options);
  const TraceOptions& options() const { return options_; }
  /// The file this process writes: the path, or after a restart (PARTRAIN_RESTART_COUNT = n > 0)
  /// the path with ".restart<n>" before its extension ("trace.restart1.json"), so that a restarted
  /// attempt, whose first steps are not the run's, keeps the first attempt's trace and says which
  /// it is. "" when off.
  std::string file() const;

  /// Called by every rank at the start of a training step; returns whether this step is
  /// recorded. The first recorded step puts the ranks on one time axis: the world group gathers
  /// each rank's wall-clock start, and time 0 is the earliest (events are then timed with the
  /// steady clock from there), so the rows' timestamps compare across ranks.
  bool begin_step();
  bool active() const { return active_; }
  /// Training steps recorded so far (begun while tracing).
  int recorded() const { return step_; }
  /// Records an event of this step that ran from `start` to now (nothing when inactive).
  /// `mb`/`chunk` are -1 where they do not apply; `peer` is the other rank of a transfer.
  void record(TraceKind kind, Clock::time_point start, int mb = -1, int chunk = -1, int peer = -1);
  /// The same for an event that ended at `end` (a collective that completed on another thread).
  void record_span(TraceKind kind, Clock::time_point start, Clock::time_point end, int mb = -1);
  /// Called by every rank at the end of a recorded step (the step event itself is added here):
  /// the world group gathers every rank's events and rank 0 rewrites the file with all the
  /// recorded steps so far. `row` names this rank's row ("rank 1: pipeline stage 1").
  void end_step(const std::string& row);

 private:
  StepTrace();
  struct Event {
    TraceKind kind;
    int64_t start_ns, dur_ns;  // from time 0 (the earliest rank's start)
    int step, mb, chunk, peer;
  };
  std::string events_json(int rank) const;

  TraceOptions options_;
  bool active_ = false;
  int step_ = 0;  // training steps begun
  Clock::time_point zero_, step_start_;
  int64_t offset_ns_ = 0;  // this rank's start after the earliest rank's
  std::vector<Event> events_;
  std::vector<std::string> gathered_;  // rank 0: every rank's events so far, as JSON fragments
};

/// Records one event from its construction to its end (when the trace is active).
class TraceSpan {
 public:
  TraceSpan(TraceKind kind, int mb = -1, int chunk = -1, int peer = -1)
      : kind_(kind), mb_(mb), chunk_(chunk), peer_(peer), on_(StepTrace::instance().active()) {
    if (on_) start_ = StepTrace::Clock::now();
  }
  ~TraceSpan() {
    if (on_) StepTrace::instance().record(kind_, start_, mb_, chunk_, peer_);
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  TraceKind kind_;
  int mb_, chunk_, peer_;
  bool on_;
  StepTrace::Clock::time_point start_;
};

}  // namespace partrain::parallel
