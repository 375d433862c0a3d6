// Start-up timestamps (see startup.hpp).
#include "engine/util/startup.hpp"

#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

namespace partrain::util {

namespace {

std::mutex mark_mutex;
std::string who_ = "partrain";
bool first_mark = true;

// When this process started, in CLOCK_MONOTONIC nanoseconds: /proc/self/stat's start time (clock
// ticks since boot) against CLOCK_BOOTTIME, which counts from boot too, minus the suspend time
// that CLOCK_MONOTONIC leaves out. -1 when it cannot tell.
long long process_start_ns() {
  std::ifstream stat("/proc/self/stat");
  std::string all((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  auto close = all.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream rest(all.substr(close + 2));
  std::string field;
  // Fields from the 3rd (state); starttime is the 22nd.
  for (int i = 3; i < 22 && (rest >> field); ++i) {
  }
  unsigned long long ticks = 0;
  if (!(rest >> ticks)) return -1;
  long hz = sysconf(_SC_CLK_TCK);
  timespec boot, mono;
  clock_gettime(CLOCK_BOOTTIME, &boot);
  clock_gettime(CLOCK_MONOTONIC, &mono);
  long long boot_ns = (long long)boot.tv_sec * 1000000000 + boot.tv_nsec;
  long long mono_ns = (long long)mono.tv_sec * 1000000000 + mono.tv_nsec;
  long long started_since_boot = (long long)(ticks * (1000000000ull / (unsigned long long)hz));
  return mono_ns - (boot_ns - started_since_boot);
}

long long t0_ns() {
  static long long t0 = [] {
    const char* v = std::getenv("PARTRAIN_STARTUP_T0");
    if (v && *v) {
      char* end = nullptr;
      long long x = std::strtoll(v, &end, 10);
      if (end && !*end && x > 0) return x;
    }
    long long s = process_start_ns();
    return s > 0 ? s : monotonic_ns();
  }();
  return t0;
}

void print(const std::string& who, const std::string& phase, long long at_ns) {
  std::fprintf(stderr, "partrain startup: %+.3f s %s: %s\n", double(at_ns - t0_ns()) / 1e9, who.c_str(),
               phase.c_str());
  std::fflush(stderr);
}

}  // namespace

long long monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long long)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

long long startup_t0_ns() { return t0_ns(); }

bool startup_trace_on() {
  static bool on = [] {
    const char* v = std::getenv("PARTRAIN_STARTUP_TRACE");
    return v && std::string(v) == "1";
  }();
  return on;
}

void startup_set_who(const std::string& who) {
  std::lock_guard<std::mutex> lock(mark_mutex);
  who_ = who;
  static pid_t named = getpid();
  if (named != getpid()) first_mark = true;  // a forked rank: its first mark says when it began
  named = getpid();
}

void startup_mark(const std::string& phase) {
  if (!startup_trace_on()) return;
  long long now = monotonic_ns();
  std::lock_guard<std::mutex> lock(mark_mutex);
  if (first_mark) {
    first_mark = false;
    long long started = process_start_ns();
    if (started > 0) print(who_, "process started (pid " + std::to_string(getpid()) + ")", started);
  }
  print(who_, phase, now);
}

void startup_mark_once(const char* phase) {
  if (!startup_trace_on()) return;
  static std::mutex once_mutex;
  static std::set<std::string> done;
  {
    std::lock_guard<std::mutex> lock(once_mutex);
    if (!done.insert(phase).second) return;
  }
  startup_mark(phase);
}

}  // namespace partrain::util
