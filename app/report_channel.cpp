// A rank's end of what its launcher shares with it: the report pipe its fatal error goes
// through, the rendezvous secret's pipe, and the collective ledger the launcher maps.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <regex>
#include <sstream>

#include "app/launch_ranks.hpp"
#include "engine/dist/ledger.hpp"
#include "engine/dist/store.hpp"

namespace partrain::app {

namespace {

using detail::kMaxReport;

int report_fd = -1;  // in a rank: the write end of its report pipe

// Where the kernel keeps this process's environment as exec gave it (/proc/PID/stat's env_start
// and env_end): what /proc/PID/environ shows, whatever setenv and unsetenv did since.
std::pair<uintptr_t, uintptr_t> environment_block() {
  std::ifstream stat("/proc/self/stat");
  std::string all((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  auto close = all.rfind(')');
  if (close == std::string::npos) return {0, 0};
  std::istringstream fields(all.substr(close + 2));
  std::string field;
  uintptr_t start = 0, end = 0;
  for (int i = 3; fields >> field; ++i) {  // field 3 is the state; env_start is 50, env_end 51
    if (i == 50) start = std::strtoull(field.c_str(), nullptr, 10);
    if (i == 51) end = std::strtoull(field.c_str(), nullptr, 10);
  }
  return {start, end};
}

// The rendezvous secret stays out of /proc/PID/environ: a PARTRAIN_RDZV_SECRET this process was
// started with (torchrun's ranks, a launcher given one) is moved into a copy that setenv keeps,
// and its bytes in the block exec wrote are overwritten. The ranks a launcher forks inherit that
// block, so a forked rank's environ no longer shows its launcher's secret either.
void hide_environment_secret() {
  char* value = std::getenv("PARTRAIN_RDZV_SECRET");
  if (!value) return;
  const auto [start, end] = environment_block();
  const auto at = reinterpret_cast<uintptr_t>(value);
  if (start == 0 || at < start || at >= end) return;  // not in the block: set by this process
  const size_t name = std::strlen("PARTRAIN_RDZV_SECRET=");
  if (at - start < name) return;
  const std::string copy = value;
  setenv("PARTRAIN_RDZV_SECRET", copy.c_str(), 1);  // environ points at the copy from here on
  std::memset(value - name, 0, std::min<size_t>(name + copy.size(), end - (at - name)));
}

// The secret the launcher gives a rank: through a pipe (PARTRAIN_RDZV_SECRET_FD) it wrote and
// closed before starting the rank, read and closed here, never through the environment exec
// passes (an exec'd rank's /proc/self/environ is readable by its script). The rank reads it as
// PARTRAIN_RDZV_SECRET from this process's environment, which main drops before the script.
void take_secret_pipe() {
  const char* v = std::getenv("PARTRAIN_RDZV_SECRET_FD");
  if (!v) return;
  char* end = nullptr;
  long fd = std::strtol(v, &end, 10);
  unsetenv("PARTRAIN_RDZV_SECRET_FD");
  struct stat st;
  if (!end || *end || fd < 3 || fd > INT_MAX || fstat(int(fd), &st) != 0 || !S_ISFIFO(st.st_mode)) return;
  std::string secret;
  char buf[256];
  while (secret.size() <= dist::kMaxSecret) {
    ssize_t n = read(int(fd), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    secret.append(buf, size_t(n));
  }
  close(int(fd));
  if (!secret.empty()) setenv("PARTRAIN_RDZV_SECRET", secret.c_str(), 1);
  std::fill(secret.begin(), secret.end(), '\0');
}

}  // namespace

void adopt_report_channel() {
  hide_environment_secret();
  // In a rank (the launcher's, torchrun's): a write to a closed pipe or socket (a peer that was
  // stopped, a command's pipe that ended) fails with EPIPE, which the caller reports as an error,
  // instead of killing the rank with SIGPIPE, for which the launcher named it as the rank that
  // failed. A handler rather than SIG_IGN: exec puts the default back, so the script's own
  // commands (`yes | head`) still end on SIGPIPE as they expect.
  struct sigaction pipe_now {};
  if (std::getenv("RANK") && std::getenv("WORLD_SIZE") && sigaction(SIGPIPE, nullptr, &pipe_now) == 0 &&
      pipe_now.sa_handler == SIG_DFL) {
    struct sigaction sa {};
    sa.sa_handler = detail::ignore_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGPIPE, &sa, nullptr);
  }
  const char* v = std::getenv("PARTRAIN_REPORT_FD");
  if (!v) return;
  unsetenv("PARTRAIN_REPORT_FD");
  char* end = nullptr;
  long fd = std::strtol(v, &end, 10);
  struct stat st;
  if (!end || *end || fd < 3 || fd > INT_MAX || fstat(int(fd), &st) != 0 || !S_ISFIFO(st.st_mode)) return;
  fcntl(int(fd), F_SETFD, FD_CLOEXEC);
  report_fd = int(fd);
  take_secret_pipe();
  if (const char* l = std::getenv("PARTRAIN_LEDGER_FD")) {
    unsetenv("PARTRAIN_LEDGER_FD");
    long lfd = std::strtol(l, &end, 10);
    if (end && !*end && lfd >= 3 && lfd <= INT_MAX && fstat(int(lfd), &st) == 0 && S_ISREG(st.st_mode) &&
        st.st_size == static_cast<off_t>(sizeof(dist::ledger::Region))) {
      dist::ledger::attach(int(lfd));  // the mapping outlives the descriptor
      close(int(lfd));
    }
  }
}

bool report_failure(const std::string& message) {
  if (report_fd < 0) return false;
  // A collective that failed names its group, "failed on rank N:", and a timeout says so; the
  // REPL's channel and joining the rendezvous (not serving it) fail when a peer does. These are
  // consequences, unless no other rank failed first.
  static const std::regex collective(R"(failed on rank \d+: |rendezvous at \S+ failed: |the REPL lost rank 0)");
  static const std::regex timeout(R"(failed on rank \d+: .*([Tt]imed out|[Tt]imeout))");
  const char* kind = "error";
  if (std::regex_search(message, collective)) kind = std::regex_search(message, timeout) ? "timeout" : "collective";
  std::string bytes = std::to_string(detail::monotonic_ns()) + " " + kind + "\n" + message.substr(0, kMaxReport - 64);
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    ssize_t n = write(report_fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    p += n;
    left -= size_t(n);
  }
  close(report_fd);
  report_fd = -1;
  // The launcher says a rank's own error once for the job; a failed collective or a timeout (a
  // consequence, whose per-rank details the hang diagnosis reads) the rank still says itself.
  return left == 0 && std::string(kind) == "error";
}

}  // namespace partrain::app
