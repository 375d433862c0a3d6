// This file records training steps and writes them as Chrome trace JSON (see trace.hpp).
#include "engine/parallel/trace.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include <c10/util/Exception.h>

#include "engine/dist/world.hpp"
#include "engine/util/planning.hpp"
#include "engine/util/step_events.hpp"
#include "engine/util/files.hpp"

namespace partrain::parallel {

bool is_trace_head(const std::string& head) { return head.rfind("{\"displayTimeUnit\"", 0) == 0; }

namespace {

constexpr int kMaxTraceSteps = 1000;  // a trace of more steps would be too large to open

const char* kind_prefix(TraceKind k) {
  switch (k) {
    case TraceKind::Forward: return "F";
    case TraceKind::Backward: return "B";
    case TraceKind::Weight: return "W";
    case TraceKind::SendActivation: return "SEND_F";
    case TraceKind::SendGradient: return "SEND_B";
    case TraceKind::RecvActivation: return "RECV_F";
    case TraceKind::RecvGradient: return "RECV_B";
    case TraceKind::Wait: return "wait";
    case TraceKind::Sync: return "sync";
    case TraceKind::Step: return "step";
    case TraceKind::Gather: return "GATHER u";
    case TraceKind::RingPass: return "KV";
    case TraceKind::RingGradient: return "DKV";
    case TraceKind::RingBlock: return "ATTN";
  }
  return "?";
}

// Events on the rank's second row (its communication beside its compute).
bool beside(TraceKind k) { return k == TraceKind::Gather || k == TraceKind::RingPass || k == TraceKind::RingGradient; }

const char* kind_category(TraceKind k) {
  switch (k) {
    case TraceKind::Forward: return "forward";
    case TraceKind::Backward: return "backward";
    case TraceKind::Weight: return "weight";
    case TraceKind::SendActivation:
    case TraceKind::SendGradient: return "send";
    case TraceKind::RecvActivation:
    case TraceKind::RecvGradient: return "recv";
    case TraceKind::Wait: return "wait";
    case TraceKind::Sync: return "sync";
    case TraceKind::Step: return "step";
    case TraceKind::Gather: return "gather";
    case TraceKind::RingPass:
    case TraceKind::RingGradient: return "exchange";
    case TraceKind::RingBlock: return "attention";
  }
  return "?";
}

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out + "\"";
}

// The launcher's restart count for this attempt (0: the first; a malformed value reads as 0).
int restart_count() {
  const char* text = std::getenv("PARTRAIN_RESTART_COUNT");
  if (!text || !*text) return 0;
  char* end = nullptr;
  const long n = std::strtol(text, &end, 10);
  return *end || n < 0 || n > 1000000 ? 0 : static_cast<int>(n);
}

std::string micros(int64_t ns) {  // microseconds with three decimals, as Chrome's ts and dur
  char buf[32];
  std::snprintf(buf, sizeof buf, "%lld.%03lld", static_cast<long long>(ns / 1000), static_cast<long long>(ns % 1000));
  return buf;
}

}  // namespace

StepTrace& StepTrace::instance() {
  static StepTrace trace;
  return trace;
}

namespace {
// The tracer listens to every train_step from the start of the process. The tracer itself is
// made at the first step, after the command has set PARTRAIN_TRACE for the ranks it forks.
class TraceObserver final : public events::StepObserver {
  void train_step_begins() override { StepTrace::instance().begin_step(); }
  void train_step_ends(const std::string& row) override { StepTrace::instance().end_step(row); }
};
const bool observing = [] {
  static TraceObserver observer;
  events::observe(&observer);
  return true;
}();
}  // namespace

StepTrace::StepTrace() {
  TraceOptions o;
  if (const char* path = std::getenv("PARTRAIN_TRACE")) o.path = path;
  if (const char* steps = std::getenv("PARTRAIN_TRACE_STEPS")) {
    char* end = nullptr;
    long n = std::strtol(steps, &end, 10);
    TORCH_CHECK(*steps && !*end && n >= 1 && n <= kMaxTraceSteps, "PARTRAIN_TRACE_STEPS='", steps,
                "' is not a step count from 1 to ", kMaxTraceSteps);
    o.steps = static_cast<int>(n);
  }
  configure(std::move(o));
}

void StepTrace::configure(TraceOptions options) {
  TORCH_CHECK(options.steps >= 1 && options.steps <= kMaxTraceSteps, "trace: steps=", options.steps,
              " (expected 1 to ", kMaxTraceSteps, ")");
  TORCH_CHECK(options.path.empty() || !util::is_plain_dir(options.path), "trace: '", options.path,
              "' is a folder (expected the JSON file to write)");
  options_ = std::move(options);
  step_ = 0;
  active_ = false;
  events_.clear();
  gathered_.clear();
}

std::string StepTrace::file() const {
  const int attempt = restart_count();
  if (options_.path.empty() || attempt == 0) return options_.path;
  const auto slash = options_.path.find_last_of('/');
  const auto dot = options_.path.find_last_of('.');
  const bool has_ext = dot != std::string::npos && (slash == std::string::npos || dot > slash + 1);
  const std::string stem = has_ext ? options_.path.substr(0, dot) : options_.path;
  return stem + ".restart" + std::to_string(attempt) + (has_ext ? options_.path.substr(dot) : "");
}

bool StepTrace::begin_step() {
  active_ = false;
  events_.clear();  // what a failed step left
  if (options_.path.empty() || util::planning() || step_ >= options_.steps) return false;
  if (step_++ == 0) {
    // The rows share one time axis: wall-clock time (the same clock for every process on a
    // machine, NTP-close across machines) from the earliest rank's start, measured from here on
    // with the steady clock.
    zero_ = Clock::now();
    auto wall = std::chrono::duration_cast<std::chrono::nanoseconds>(
                    std::chrono::system_clock::now().time_since_epoch()).count();
    int64_t earliest = wall;
    for (const auto& w : dist::all_gather_strings(dist::World::instance().world(), std::to_string(wall)))
      earliest = std::min<int64_t>(earliest, std::stoll(w));
    offset_ns_ = wall - earliest;
  }
  active_ = true;
  step_start_ = Clock::now();
  return true;
}

void StepTrace::record(TraceKind kind, Clock::time_point start, int mb, int chunk, int peer) {
  if (!active_) return;
  auto ns = [&](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t - zero_).count();
  };
  auto begin = ns(start) + offset_ns_;
  events_.push_back({kind, begin, ns(Clock::now()) + offset_ns_ - begin, step_, mb, chunk, peer});
}

void StepTrace::record_span(TraceKind kind, Clock::time_point start, Clock::time_point end, int mb) {
  if (!active_) return;
  auto ns = [&](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t - zero_).count();
  };
  auto begin = ns(start) + offset_ns_;
  events_.push_back({kind, begin, std::max<int64_t>(0, ns(end) - ns(start)), step_, mb, -1, -1});
}

std::string StepTrace::events_json(int rank) const {
  std::ostringstream out;
  // ZeRO-3's gathers and ring attention's exchanges: a row of their own below the ranks' (tid
  // world + rank), named here for what it holds.
  const int world = dist::World::instance().size();
  auto any = [&](auto pred) { return std::any_of(events_.begin(), events_.end(), pred); };
  const bool gathers = any([](const Event& e) { return e.kind == TraceKind::Gather; });
  const bool passes = any([](const Event& e) { return e.kind == TraceKind::RingPass || e.kind == TraceKind::RingGradient; });
  if (gathers || passes) {
    const std::string what = gathers && passes ? "ZeRO-3 gathers, ring exchanges" : gathers ? "ZeRO-3 gathers"
                                                                                               : "ring exchanges";
    out << ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":" << world + rank << ",\"args\":{\"name\":"
        << quoted("rank " + std::to_string(rank) + ": " + what) << "}},\n{\"name\":\"thread_sort_index\",\"ph\":"
        << "\"M\",\"pid\":0,\"tid\":" << world + rank << ",\"args\":{\"sort_index\":" << world + rank << "}}";
  }
  for (const auto& e : events_) {
    std::string name = kind_prefix(e.kind);
    if (e.kind == TraceKind::Step) {
      name += " " + std::to_string(e.step);
    } else if (e.mb >= 0) {
      name += std::to_string(e.mb);
      if (e.chunk >= 0) name += ".c" + std::to_string(e.chunk);
      if (e.kind == TraceKind::SendActivation || e.kind == TraceKind::SendGradient) name += "->" + std::to_string(e.peer);
      if (e.kind == TraceKind::RecvActivation || e.kind == TraceKind::RecvGradient) name += "<-" + std::to_string(e.peer);
    }
    out << ",\n{\"name\":" << quoted(name) << ",\"cat\":\"" << kind_category(e.kind) << "\",\"ph\":\"X\",\"ts\":"
        << micros(e.start_ns) << ",\"dur\":" << micros(e.dur_ns) << ",\"pid\":0,\"tid\":"
        << (beside(e.kind) ? world + rank : rank)
        << ",\"args\":{\"step\":" << e.step;
    if (e.mb >= 0) out << ",\"mb\":" << e.mb;
    if (e.chunk >= 0) out << ",\"chunk\":" << e.chunk;
    if (e.peer >= 0) out << ",\"peer\":" << e.peer;
    out << "}}";
  }
  return out.str();
}

void StepTrace::end_step(const std::string& row) {
  if (!active_) return;
  record(TraceKind::Step, step_start_);
  active_ = false;
  auto& world = dist::World::instance();
  const int rank = world.rank();
  // Every rank's row name and events, gathered on the world group (all ranks take part; rank 0 keeps them).
  auto all = dist::all_gather_strings(world.world(), row + "\n" + events_json(rank));
  events_.clear();
  if (rank != 0) return;
  gathered_.resize(all.size());
  std::ostringstream json;
  json << "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"producer\":\"partrain\",\"steps\":" << step_
       << ",\"restart\":" << restart_count() << "},\"traceEvents\":[\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0,\"args\":{\"name\":\"partrain\"}}";
  for (size_t r = 0; r < all.size(); ++r) {
    auto cut = all[r].find('\n');
    gathered_[r] += all[r].substr(cut + 1);
    json << ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":" << r << ",\"args\":{\"name\":"
         << quoted(all[r].substr(0, cut)) << "}},\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":0,\"tid\":" << r
         << ",\"args\":{\"sort_index\":" << r << "}}";
  }
  for (const auto& events : gathered_) json << events;
  json << "\n]}\n";
  const std::string path = file();
  TORCH_CHECK(!util::is_plain_dir(path), "trace: '", path, "' is a folder (expected the JSON file to write)");
  auto refused = util::may_replace(path, is_trace_head, "a trace partrain wrote");
  TORCH_CHECK(refused.empty(), "trace: ", refused);
  util::write_atomic(path, json.str());
}

}  // namespace partrain::parallel
