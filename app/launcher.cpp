// The local launcher (see launcher.hpp).
#include "app/launcher.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <optional>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "app/control.hpp"
#include "app/hang.hpp"
#include "engine/compat.hpp"
#include "engine/dist/ledger.hpp"
#include "engine/dist/store.hpp"
#include "engine/util/files.hpp"
#include "engine/util/startup.hpp"

namespace partrain::app {

namespace {

using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC: the ranks' report times use it too

volatile sig_atomic_t interrupted = 0;
void on_signal(int sig) { interrupted = sig; }
volatile sig_atomic_t dump_asked = 0;  // SIGUSR1: print every rank's ledger
void on_dump(int) { dump_asked = 1; }
void ignore_signal(int) {}  // unlike SIG_IGN, not inherited by the ranks through exec
void on_child(int) {}       // wakes poll() when a rank ends, so its end is timed closely

constexpr size_t kMaxReport = 16 * 1024;  // bytes of a rank's report the launcher keeps

int64_t monotonic_ns() {
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

// The ranks' ledgers stay mapped until the start ends (a dead rank's is still read).
struct LedgerMaps {
  std::vector<Rank>& ranks;
  ~LedgerMaps() {
    for (auto& r : ranks)
      if (r.ledger) munmap(const_cast<dist::ledger::Region*>(r.ledger), sizeof(dist::ledger::Region));
  }
};

std::string exe_path() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw std::runtime_error("cannot find the partrain executable (/proc/self/exe)");
  return std::string(buf, n);
}

// The rendezvous store's listening socket, bound before any rank starts (so that no rank finds
// the port closed and retries) and handed to rank 0, which serves the store on it: `addr` only
// (loopback for one machine), on `port` (0: a free one).
int listen_socket(const std::string& addr, int port) {
  std::string why;
  int fd = listen_on(addr, port, why);
  if (fd < 0)
    throw std::runtime_error("rendezvous at " + addr + ":" + std::to_string(port) + " (serving it) failed: " + why +
                             (why.find("in use") != std::string::npos
                                  ? " (another process holds the port: choose another --master-port, or leave it out "
                                    "to take a free one)"
                                  : ""));
  return fd;
}

using hang::describe_status;

int port_of(int fd) {
  sockaddr_storage sa{};
  socklen_t len = sizeof sa;
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  return ntohs(sa.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&sa)->sin6_port
                                        : reinterpret_cast<sockaddr_in*>(&sa)->sin_port);
}

// Threads of this process (/proc/self/task): forking is safe only with one.
int thread_count() {
  DIR* d = opendir("/proc/self/task");
  if (!d) return -1;
  int n = 0;
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  return n;
}

// Why the ranks cannot be forked from this launcher, or "" when they can.
std::string fork_unsafe(const LaunchOptions& o) {
  if (o.exec_ranks) return "PARTRAIN_EXEC_RANKS=1";
  if (compat::cuda_touched()) return "the launcher has initialised CUDA";
  int threads = thread_count();
  if (threads != 1) return "the launcher has " + std::to_string(threads) + " threads";
  return "";
}

// In a forked rank: what exec would have done. Every descriptor marked close-on-exec is closed
// (the other ranks' pipes, the launcher's own files); the report pipe and, in rank 0, the
// store's socket were unmarked and stay.
void close_cloexec_fds() {
  std::vector<int> fds;
  if (DIR* d = opendir("/proc/self/fd")) {
    int own = dirfd(d);
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] == '.') continue;
      int fd = std::atoi(e->d_name);
      if (fd > 2 && fd != own) fds.push_back(fd);
    }
    closedir(d);
  }
  for (int fd : fds) {
    int flags = fcntl(fd, F_GETFD);
    if (flags >= 0 && (flags & FD_CLOEXEC)) close(fd);
  }
}

// The dispositions the launcher found, put back in each forked rank.
struct SavedSignals {
  struct sigaction term {}, intr {}, chld {}, pipe {};
  sigset_t mask;
};
SavedSignals saved_signals;
bool signals_saved = false;

bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }

// How much of a line without its newline waits for the rest: past it the part is relayed as a
// piece, so a long line, or progress redrawn with \r and never ended, costs the launcher linear
// time and bounded memory (holding 240 MB of \r updates for a newline had taken 35 s and 667 MB).
constexpr size_t kRelayPiece = size_t(1) << 16;
// A rank's last stderr lines kept for the failure summary, and the bytes kept of each.
constexpr size_t kKeptLines = 20;
constexpr size_t kKeptLineBytes = 2048;

void remember(std::deque<std::string>* keep, const std::string& line) {
  if (!keep) return;
  keep->push_back(line.size() <= kKeptLineBytes ? line
                                                : line.substr(0, kKeptLineBytes) + "... (" +
                                                      std::to_string(line.size()) + " bytes)");
  while (keep->size() > kKeptLines) keep->pop_front();
}

// Writes complete lines from `buffer` to `to`, each with `prefix`; with `flush_partial`, or once
// the rest reaches kRelayPiece bytes, the rest too (a line without its newline: tagged, it is
// ended; untagged, left as the rank wrote it). `scanned`: how many leading bytes of the buffer
// are known to hold no newline (what was there before the last read), so that small reads after
// a long unended line do not search it again and again.
void emit_lines(std::string& buffer, std::ostream& to, const std::string& prefix, bool flush_partial,
                std::deque<std::string>* keep = nullptr, size_t scanned = 0) {
  size_t start = 0, nl;
  while ((nl = buffer.find('\n', std::max(start, scanned))) != std::string::npos) {
    std::string line = buffer.substr(start, nl - start);
    to << prefix << line << '\n';
    remember(keep, line);
    start = nl + 1;
  }
  buffer.erase(0, start);
  if ((flush_partial || buffer.size() >= kRelayPiece) && !buffer.empty()) {
    to << prefix << buffer;
    if (!prefix.empty()) to << '\n';  // a tagged line ends; an untagged stream passes through as written
    remember(keep, buffer);
    buffer.clear();
  }
  to.flush();
}

// A report on the wire: "<monotonic ns> <kind>\n<message>". Parsed once its first line is in.
void parse_report(Rank& r) {
  auto nl = r.report_bytes.find('\n');
  if (nl == std::string::npos) return;
  std::istringstream head(r.report_bytes.substr(0, nl));
  Report rep;
  std::string kind;
  if (!(head >> rep.at_ns >> kind)) return;
  rep.kind = kind == "timeout" ? Report::Timeout : kind == "collective" ? Report::Collective : Report::Error;
  rep.message = r.report_bytes.substr(nl + 1);
  r.report = rep;
}

// The first `max` lines of `text`, indented, and a count of the rest.
std::string indented(const std::string& text, size_t max, const std::string& indent = "  ") {
  std::istringstream in(text);
  std::string line, out;
  size_t n = 0, more = 0;
  while (std::getline(in, line)) {
    if (n < max) out += indent + line + "\n";
    else ++more;
    ++n;
  }
  if (more) out += indent + "... (" + std::to_string(more) + " more lines above, in its stderr)\n";
  return out;
}

// "R" (state letter) of /proc/PID/stat: T when stopped (SIGSTOP, Ctrl-Z), t when traced.
char process_state(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string all((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  auto close = all.rfind(')');
  return close != std::string::npos && close + 2 < all.size() ? all[close + 2] : '?';
}

int report_fd = -1;  // in a rank: the write end of its report pipe

// A zero-filled block for rank `r`'s collective ledger, mapped read-only here and read-write by
// the rank, so that the launcher reads where the rank is even when it is stopped or dead. Returns
// the descriptor to hand the rank (-1: none; the rank then keeps its ledger to itself).
int share_ledger(Rank& r) {
  int fd = memfd_create("partrain-ledger", MFD_CLOEXEC);
  if (fd < 0) return -1;
  void* p = MAP_FAILED;
  if (ftruncate(fd, sizeof(dist::ledger::Region)) == 0)
    p = mmap(nullptr, sizeof(dist::ledger::Region), PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    return -1;
  }
  r.ledger = static_cast<const dist::ledger::Region*>(p);
  return fd;
}

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

// The read end of a pipe holding `secret` and nothing more (the write end closed), for one rank
// (PARTRAIN_RDZV_SECRET_FD); -1 when there is no secret. A secret is at most 1 KiB: the pipe
// takes it without blocking.
int secret_pipe(const std::string& secret) {
  if (secret.empty()) return -1;
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
  size_t at = 0;
  while (at < secret.size()) {
    ssize_t n = write(fds[1], secret.data() + at, secret.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    at += size_t(n);
  }
  close(fds[1]);
  return fds[0];
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
    sa.sa_handler = ignore_signal;
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
  std::string bytes = std::to_string(monotonic_ns()) + " " + kind + "\n" + message.substr(0, kMaxReport - 64);
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

void validate(const LaunchOptions& o) {
  auto bad = [](const std::string& msg) { throw std::invalid_argument(msg); };
  if (o.nproc_per_node < 1 || o.nproc_per_node > kMaxLocalRanks)
    bad("--nproc-per-node " + std::to_string(o.nproc_per_node) + " is out of range: 1 to " +
        std::to_string(kMaxLocalRanks));
  if (o.nnodes < 1 || o.nnodes > kMaxNodes)
    bad("--nnodes " + std::to_string(o.nnodes) + " is out of range: 1 to " + std::to_string(kMaxNodes));
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    bad("--node-rank " + std::to_string(o.node_rank) + " is not in [0, --nnodes=" + std::to_string(o.nnodes) + ")");
  if (o.master_port < 0 || o.master_port > 65535)
    bad("--master-port " + std::to_string(o.master_port) + " is not a port (1-65535)");
  if (o.nnodes > 1 && o.master_addr.empty()) bad("--nnodes " + std::to_string(o.nnodes) + " needs --master-addr (the host of node 0)");
  if (o.nnodes > 1 && o.master_port == 0) bad("--nnodes " + std::to_string(o.nnodes) + " needs --master-port (all nodes must agree on it)");
  if (o.timeout < 1 || o.timeout > kMaxTimeout)
    bad("--timeout " + std::to_string(o.timeout) + " is out of range: 1 to " + std::to_string(kMaxTimeout) + " seconds");
  if (o.max_restarts < 0 || o.max_restarts > kMaxRestarts)
    bad("--max-restarts " + std::to_string(o.max_restarts) + " is out of range: 0 to " + std::to_string(kMaxRestarts));
  if (!(o.node_timeout >= kMinNodeTimeout && o.node_timeout <= kMaxNodeTimeout))
    bad("--node-timeout " + std::to_string(o.node_timeout) + " is out of range: " +
        std::to_string(int(kMinNodeTimeout)) + " to " +
        std::to_string(int(kMaxNodeTimeout)) + " seconds");
  if (o.max_restarts > 0 && o.interactive) bad("--max-restarts is for scripts, not the REPL (-i)");
  if (!(o.hang_timeout >= 0 && o.hang_timeout <= kMaxHangTimeout))
    bad("--hang-timeout " + std::to_string(o.hang_timeout) + " is out of range: 0 (off) to " +
        std::to_string(int(kMaxHangTimeout)) + " seconds");
  if (!(o.restart_backoff >= 0 && o.restart_backoff <= kMaxBackoff))
    bad("--restart-backoff " + std::to_string(o.restart_backoff) + " is out of range: 0 to " +
        std::to_string(int(kMaxBackoff)) + " seconds");
  if (!o.master_addr.empty()) {
    addrinfo hints{}, *found = nullptr;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int err = getaddrinfo(o.master_addr.c_str(), nullptr, &hints, &found);
    if (err != 0) bad("--master-addr '" + o.master_addr + "' is not an address this machine can resolve (" + gai_strerror(err) + ")");
    freeaddrinfo(found);
  }
}

namespace {

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

// The launcher's signal handlers (once the dispositions it was started with are saved, for the
// forked ranks): TERM and Ctrl-C stop the ranks, a rank's end wakes the wait, USR1 dumps ledgers.
void take_signals(const LaunchOptions& o) {
  if (!signals_saved) {  // what the launcher was started with, for the forked ranks
    sigaction(SIGTERM, nullptr, &saved_signals.term);
    sigaction(SIGINT, nullptr, &saved_signals.intr);
    sigaction(SIGCHLD, nullptr, &saved_signals.chld);
    sigaction(SIGPIPE, nullptr, &saved_signals.pipe);
    sigprocmask(SIG_SETMASK, nullptr, &saved_signals.mask);
    signals_saved = true;
  }
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, nullptr);
  if (o.interactive) sa.sa_handler = ignore_signal;  // Ctrl-C interrupts the ranks' evaluation
  sigaction(SIGINT, &sa, nullptr);
  sa.sa_handler = on_child;  // no SA_RESTART: poll() returns as soon as a rank ends
  sigaction(SIGCHLD, &sa, nullptr);
  sa.sa_handler = on_dump;  // also without SA_RESTART: the dump comes at once
  sigaction(SIGUSR1, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

// What one start of the ranks shares: the rendezvous secret, and on node 0 the store's
// listening socket (handed to rank 0; closed in the launcher once rank 0 has it).
struct StartContext {
  std::string secret;
  int listen_fd = -1;
};

// Starts every local rank once (`attempt`: how many restarts came before) and waits for them.
// Over several nodes (`control`), it beats this node's heartbeat meanwhile, and stops the ranks
// as soon as the nodes' verdict on this start says another node failed or was lost.
Outcome run_ranks(const LaunchOptions& o, const std::vector<std::string>& child_args, const RankMain& rank_main,
                  StartContext& start, int attempt, NodeControl* control) {
  const int world = o.nnodes * o.nproc_per_node;
  const std::string unsafe = fork_unsafe(o);
  const bool forking = unsafe.empty();
  util::startup_mark(forking ? "starting " + std::to_string(o.nproc_per_node) + " rank(s) with fork"
                             : "starting " + std::to_string(o.nproc_per_node) + " rank(s) with exec (" + unsafe + ")");
  const std::string exe = forking ? std::string() : exe_path();

  std::vector<std::string> args{exe, "--threads", std::to_string(o.threads)};
  args.insert(args.end(), child_args.begin(), child_args.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  take_signals(o);

  // Without -i no rank reads a terminal: each rank has its own process group, and reading the
  // terminal from it would stop the rank. Rank 0 keeps a pipe or a file as stdin.
  const bool stdin_is_terminal = isatty(STDIN_FILENO) == 1;
  // A live progress line (pt.progress) reaches the terminal through rank 0's pipe: rank 0 is told
  // its output ends on one (and its width), and its partial lines that rewrite in place (\r) pass
  // through as they come.
  const bool live_terminal = isatty(STDOUT_FILENO) == 1 && !o.tee && !o.interactive;
  winsize ws{};
  const int columns = live_terminal && ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 ? ws.ws_col : 0;
  bool live_partial = false;  // rank 0's live line is on the screen, without its newline

  const pid_t launcher = getpid();
  std::vector<Rank> ranks(o.nproc_per_node);
  LedgerMaps maps{ranks};
  std::fflush(nullptr);  // nothing buffered in the launcher may be written again by a forked rank
  std::cout.flush();
  for (int local = 0; local < o.nproc_per_node; ++local) {
    Rank& r = ranks[local];
    r.local_rank = local;
    r.rank = o.node_rank * o.nproc_per_node + local;
    int out[2], err[2], report[2];
    if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0 || pipe2(report, O_CLOEXEC) != 0)
      throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
    const int ledger_fd = share_ledger(r);
    const int secret_fd = secret_pipe(start.secret);
    pid_t pid = fork();
    if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
      // Its own group, so that stopping it stops its children too; in the REPL the terminal's
      // group, so that Ctrl-C reaches it.
      if (!o.interactive) setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the launcher
      if (getppid() != launcher) _exit(1);
      if (!(o.interactive && r.rank == 0)) {  // in the REPL rank 0 keeps the terminal
        dup2(out[1], STDOUT_FILENO);
        dup2(err[1], STDERR_FILENO);
      }
      bool own_stdin = o.interactive ? r.rank == 0 : local == 0 && !stdin_is_terminal;
      if (!own_stdin) {
        int null = open("/dev/null", O_RDONLY);
        dup2(null, STDIN_FILENO);
        close(null);
      }
      fcntl(report[1], F_SETFD, 0);  // the one pipe end the rank keeps across exec
      setenv("PARTRAIN_REPORT_FD", std::to_string(report[1]).c_str(), 1);
      if (ledger_fd >= 0) {  // and its ledger
        fcntl(ledger_fd, F_SETFD, 0);
        setenv("PARTRAIN_LEDGER_FD", std::to_string(ledger_fd).c_str(), 1);
      }
      setenv("RANK", std::to_string(r.rank).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(local).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node).c_str(), 1);
      setenv("GROUP_RANK", std::to_string(o.node_rank).c_str(), 1);
      setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
      setenv("MASTER_PORT", std::to_string(o.master_port).c_str(), 1);
      if (live_terminal && r.rank == 0) {
        setenv("PARTRAIN_STDOUT_TERMINAL", "1", 1);
        if (columns > 0) setenv("COLUMNS", std::to_string(columns).c_str(), 1);
      } else {
        unsetenv("PARTRAIN_STDOUT_TERMINAL");
      }
      setenv("PARTRAIN_TIMEOUT", std::to_string(o.timeout).c_str(), 1);
      setenv("OMP_NUM_THREADS", std::to_string(o.threads).c_str(), 1);
      setenv("PARTRAIN_RESTART_COUNT", std::to_string(attempt).c_str(), 1);  // and torchrun's names
      setenv("TORCHELASTIC_RESTART_COUNT", std::to_string(attempt).c_str(), 1);
      setenv("TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts).c_str(), 1);
      unsetenv("PARTRAIN_RDZV_SECRET");  // never in an exec'd environment: its script could read it there
      if (secret_fd >= 0) {
        fcntl(secret_fd, F_SETFD, 0);
        setenv("PARTRAIN_RDZV_SECRET_FD", std::to_string(secret_fd).c_str(), 1);
      }
      unsetenv("PARTRAIN_RDZV_FD");
      if (r.rank == 0 && start.listen_fd >= 0) {  // rank 0 serves the store on the launcher's socket
        fcntl(start.listen_fd, F_SETFD, 0);
        setenv("PARTRAIN_RDZV_FD", std::to_string(start.listen_fd).c_str(), 1);
      }
      if (!forking) {
        execv(exe.c_str(), argv.data());
        std::fprintf(stderr, "partrain: cannot start rank %d: %s\n", r.rank, std::strerror(errno));
        _exit(127);
      }
      // Forked: become what exec would have made, then run the rank's code in this process.
      close_cloexec_fds();
      sigaction(SIGTERM, &saved_signals.term, nullptr);
      sigaction(SIGINT, &saved_signals.intr, nullptr);
      sigaction(SIGCHLD, &saved_signals.chld, nullptr);
      sigaction(SIGPIPE, &saved_signals.pipe, nullptr);
      sigprocmask(SIG_SETMASK, &saved_signals.mask, nullptr);
      interrupted = 0;
      util::startup_set_who("rank " + std::to_string(r.rank));
      util::startup_mark("forked by the launcher");
      adopt_report_channel();
      int status = rank_main(o.threads);  // partrain's never returns; another one's status is the rank's
      std::cout.flush();
      std::fflush(nullptr);
      _exit(status);
    }
    close(out[1]);
    close(err[1]);
    close(report[1]);
    if (ledger_fd >= 0) close(ledger_fd);
    if (secret_fd >= 0) close(secret_fd);
    r.pid = pid;
    r.out = out[0];
    r.err = err[0];
    r.report_fd = report[0];
    fcntl(r.report_fd, F_SETFL, O_NONBLOCK);  // drained after the rank ends: never a blocking read
    r.running = true;
    if (r.rank == 0 && start.listen_fd >= 0) {  // rank 0 holds it now; a dead rank 0 must close it
      close(start.listen_fd);
      start.listen_fd = -1;
    }
  }
  util::startup_mark("every rank started");

  // How long, after the first collective failure, the launcher waits for the other ranks' own
  // reports before stopping them: ranks in the same collective time out together, so a rank
  // still running without a report by then was not in it.
  const auto settle = std::chrono::milliseconds(std::min(o.timeout, 5) * 1000);
  bool stopping = false;
  std::optional<Clock::time_point> settle_until;
  std::vector<std::pair<int, char>> missing;  // ranks still running, without a report, when the settling
                                              // ended, and their process state then
  Clock::time_point kill_at;
  // TERM goes to the ranks that have not reported (one that has is already on its way out, and
  // must end by its own exit, not by the launcher's signal); KILL, after the grace, to all.
  auto stop_all = [&](int sig) {
    for (auto& r : ranks)
      if (r.running && !(sig == SIGTERM && r.report)) {
        kill(o.interactive ? r.pid : -r.pid, sig);
        if (sig == SIGTERM) kill(o.interactive ? r.pid : -r.pid, SIGCONT);  // a stopped rank must see it
      }
  };
  auto begin_stopping = [&] {
    if (stopping) return;
    stopping = true;
    stop_all(SIGTERM);
    kill_at = Clock::now() + std::chrono::milliseconds(static_cast<int>(o.grace * 1000));
  };
  // A cause: an error a rank reported as its own, a death by a signal the launcher did not send,
  // or a failing exit without a report.
  auto is_cause = [&](const Rank& r) {
    if (r.report) return r.report->kind == Report::Error;
    if (r.running || !failed(r.status)) return false;
    if (WIFSIGNALED(r.status)) {
      int sig = WTERMSIG(r.status);
      if (o.interactive && sig == SIGINT) return false;  // Ctrl-C at the terminal: an interrupt
      // Killed by the launcher's TERM or KILL, or by a write to a peer the launcher stopped.
      return !(r.ended_stopping && (sig == SIGTERM || sig == SIGKILL || sig == SIGPIPE));
    }
    return !r.ended_stopping;
  };
  auto prefix = [&](const Rank& r) { return world > 1 ? "[rank " + std::to_string(r.rank) + "] " : std::string(); };

  // The ledgers: asking the running ranks for their Lua lines (SIGUSR1 to the probe thread of a
  // rank whose ledger says it answers; the answer is in its ledger a moment later), and what the
  // launcher knows of each. Never to the thread running Lua: a signal there cuts a sleep, a poll
  // or a select short (none is restarted), and the rank would go on from where it waited.
  auto ask_lines = [&] {
    for (auto& r : ranks) {
      if (!r.running || !r.ledger || r.ledger->line_ready.load() != 1) continue;
      const int32_t tid = r.ledger->probe_tid.load(std::memory_order_acquire);
      if (tid <= 0) continue;
      r.line_asked_at = r.ledger->line_answers.load();
      r.line_asked = true;
      syscall(SYS_tgkill, r.pid, tid, SIGUSR1);
    }
  };
  auto views = [&] {
    std::vector<hang::RankView> v;
    for (const auto& r : ranks) {
      hang::RankView x;
      x.rank = r.rank;
      x.local_rank = r.local_rank;
      x.pid = r.pid;
      x.running = r.running;
      x.status = r.status;
      x.state = r.running ? process_state(r.pid) : '?';
      x.ledger = dist::ledger::read(r.ledger);
      x.line_fresh = x.ledger.valid && r.line_asked && x.ledger.line_answers > r.line_asked_at;
      v.push_back(std::move(x));
    }
    return v;
  };
  std::optional<hang::Diagnosis> diagnosis;  // the ledgers' account of a hang, taken before stopping
  bool hung = false;                         // the hang timeout ended the run
  std::optional<Clock::time_point> dump_at, hang_asked_at;
  Clock::time_point lines_asked;
  uint64_t last_progress = 0;
  Clock::time_point progress_at = Clock::now();
  const auto hang_timeout = std::chrono::milliseconds(static_cast<int64_t>(o.hang_timeout * 1000));

  int running = o.nproc_per_node;
  auto open_fds = [&] {
    return std::any_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.out >= 0 || r.err >= 0 || r.report_fd >= 0; });
  };
  while (running > 0 || open_fds()) {
    // Forward output and collect reports.
    std::vector<pollfd> fds;
    std::vector<std::pair<int, int>> owners;  // (rank index, 0 stdout | 1 stderr | 2 report)
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i].out >= 0) { fds.push_back({ranks[i].out, POLLIN, 0}); owners.emplace_back(i, 0); }
      if (ranks[i].err >= 0) { fds.push_back({ranks[i].err, POLLIN, 0}); owners.emplace_back(i, 1); }
      if (ranks[i].report_fd >= 0) { fds.push_back({ranks[i].report_fd, POLLIN, 0}); owners.emplace_back(i, 2); }
    }
    // SIGCHLD (no SA_RESTART) ends the wait as soon as a rank ends; the limit only bounds a
    // signal that came between the reaping below and this call.
    poll(fds.empty() ? nullptr : fds.data(), fds.size(), 100);
    for (size_t k = 0; k < fds.size(); ++k) {
      if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Rank& r = ranks[owners[k].first];
      int which = owners[k].second;
      char buf[65536];
      ssize_t n = read(fds[k].fd, buf, sizeof(buf));
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      bool eof = n <= 0;
      if (which == 2) {
        if (n > 0 && r.report_bytes.size() < kMaxReport)
          r.report_bytes.append(buf, std::min<size_t>(n, kMaxReport - r.report_bytes.size()));
        parse_report(r);
      } else {
        std::string& line = which == 1 ? r.err_line : r.out_line;
        const size_t scanned = line.size();  // no newline in it: searched when it came
        if (n > 0) line.append(buf, n);
        if (which == 1) {
          if (live_partial && line.find('\n', scanned) != std::string::npos) {  // clear the live line; it is drawn again
            std::cout << "\r\x1b[K" << std::flush;
            live_partial = false;
          }
          emit_lines(line, std::cerr, prefix(r), eof, &r.last_err, scanned);
        } else if (r.rank == 0 || o.tee) {
          emit_lines(line, std::cout, o.tee ? prefix(r) : "", eof && !live_partial, nullptr, scanned);
          if (live_terminal && r.rank == 0) {
            // What is left has no \r before this read's bytes (a \r there would have been shown).
            const size_t fresh = line.size() - std::min(line.size(), size_t(std::max<ssize_t>(n, 0)));
            if (line.find('\r', fresh) != std::string::npos) {  // a live line: shown as it is drawn
              std::cout << line << std::flush;
              line.clear();
              live_partial = true;
            } else if (n > 0 && buf[n - 1] == '\n') {
              live_partial = false;
            }
            if (eof && live_partial) {
              std::cout << line << '\n' << std::flush;
              line.clear();
              live_partial = false;
            }
          }
        } else {
          line.clear();  // only rank 0's stdout by default
        }
      }
      if (eof) {
        close(fds[k].fd);
        (which == 0 ? r.out : which == 1 ? r.err : r.report_fd) = -1;
      }
    }
    // A rank's output pipes stay open while a process it started holds them (`os.execute("cmd &")`,
    // or a command left running when a time limit's backstop ended the rank): a second after the
    // rank ended, all it wrote has been read, and the run does not wait for that process.
    for (auto& r : ranks) {
      if (r.running || (r.out < 0 && r.err < 0) || monotonic_ns() - r.ended_ns < 1000000000) continue;
      if (r.err >= 0) emit_lines(r.err_line, std::cerr, prefix(r), true, &r.last_err);
      if (r.out >= 0 && (r.rank == 0 || o.tee)) emit_lines(r.out_line, std::cout, o.tee ? prefix(r) : "", !live_partial);
      for (int* fd : {&r.out, &r.err}) {
        if (*fd >= 0) close(*fd);
        *fd = -1;
      }
    }
    // Reap.
    for (auto& r : ranks) {
      if (!r.running) continue;
      int status;
      if (waitpid(r.pid, &status, WNOHANG) == r.pid) {
        r.running = false;
        r.status = status;
        r.ended_ns = monotonic_ns();
        r.ended_stopping = stopping;
        --running;
        util::startup_mark("rank " + std::to_string(r.rank) + " ended");
        if (r.report_fd >= 0) {  // what it reported is all in the pipe now
          ssize_t n;
          char buf[4096];
          while ((n = read(r.report_fd, buf, sizeof buf)) > 0)
            if (r.report_bytes.size() < kMaxReport)
              r.report_bytes.append(buf, std::min<size_t>(n, kMaxReport - r.report_bytes.size()));
          parse_report(r);
          close(r.report_fd);
          r.report_fd = -1;
        }
      }
    }
    if (control) {  // the heartbeat goes on while the ranks stop, too
      auto verdict = control->poll(attempt);
      if (verdict && verdict->kind != Verdict::Ok) begin_stopping();
    }
    if (stopping) {
      if (Clock::now() >= kill_at) {
        stop_all(SIGKILL);
        kill_at = Clock::now() + std::chrono::hours(1);
      }
      continue;
    }
    // kill -USR1 <launcher>: every rank's ledger, half a second after asking for their lines.
    if (dump_asked) {
      dump_asked = 0;
      ask_lines();
      dump_at = Clock::now() + std::chrono::milliseconds(500);
    }
    if (dump_at && Clock::now() >= *dump_at) {
      dump_at.reset();
      std::cerr << "partrain: the ranks' collective ledgers (kill -USR1 " << getpid() << "; the run goes on):\n"
                << hang::dump(views(), monotonic_ns(), 8) << std::flush;
    }
    bool cause = false, collective = false, sigint = false;
    for (const auto& r : ranks) {
      cause = cause || is_cause(r);
      collective = collective || (r.report && r.report->kind != Report::Error);
      sigint = sigint || (!r.running && o.interactive && WIFSIGNALED(r.status) && WTERMSIG(r.status) == SIGINT);
    }
    if (cause || interrupted || sigint) {
      begin_stopping();
    } else if (collective) {
      if (!settle_until) {
        settle_until = Clock::now() + settle;
        lines_asked = Clock::now();
        ask_lines();  // the ranks not in the collective say where they are while the others report
      }
      bool all_heard = std::all_of(ranks.begin(), ranks.end(), [](const Rank& r) { return !r.running || r.report; });
      // The ledgers tell sooner: once the ranks asked have had a second to answer, ranks without a
      // report that are in no call will not report (nor will rank 0 waiting for the others at the
      // end of the run: that wait has no time limit); those in one will, within moments.
      if (!all_heard && Clock::now() >= lines_asked + std::chrono::seconds(1))
        all_heard = std::all_of(ranks.begin(), ranks.end(), [](const Rank& r) {
          if (!r.running || r.report) return true;
          auto ledger = dist::ledger::read(r.ledger);
          return ledger.valid && !hang::in_script_call(ledger);
        });
      if (all_heard || Clock::now() >= *settle_until) {
        for (size_t i = 0; i < ranks.size(); ++i)
          if (ranks[i].running && !ranks[i].report) missing.emplace_back(int(i), process_state(ranks[i].pid));
        bool timeouts = std::any_of(ranks.begin(), ranks.end(),
                                    [](const Rank& r) { return r.report && r.report->kind == Report::Timeout; });
        diagnosis = hang::diagnose(views(), timeouts ? "the other ranks timed out waiting in a collective"
                                                     : "the other ranks' collectives failed",
                                   monotonic_ns());
        begin_stopping();
      }
    } else if (o.hang_timeout > 0) {
      // No change in any ledger for --hang-timeout while a rank waits in a call of its script, or
      // is stopped: a hang, whatever the ledgers say of who waits for whom (a rank stopped inside
      // the call the others wait in leaves every ledger "waiting" in it). The ranks are asked for
      // their lines, and a second later, unless a ledger moved meanwhile, the run is stopped.
      uint64_t progress = 0;
      for (const auto& r : ranks)
        if (r.ledger) progress += r.ledger->progress.load();
      if (progress != last_progress) {
        last_progress = progress;
        progress_at = Clock::now();
        hang_asked_at.reset();
      } else if (Clock::now() - progress_at >= hang_timeout) {
        if (!hang_asked_at) {
          const auto now = views();
          const bool stuck = std::any_of(now.begin(), now.end(), [](const hang::RankView& v) {
            return v.running && (hang::in_script_call(v.ledger) || v.state == 'T' || v.state == 't');
          });
          if (stuck) {
            ask_lines();
            hang_asked_at = Clock::now();
          } else {
            progress_at = Clock::now();  // nobody waits in the script: long work without calls is no hang
          }
        } else if (Clock::now() - *hang_asked_at >= std::chrono::seconds(1)) {
          std::ostringstream trigger;
          trigger << "no rank had made progress for " << o.hang_timeout << " s (--hang-timeout)";
          diagnosis = hang::diagnose(views(), trigger.str(), monotonic_ns());
          if (diagnosis->headline.empty()) {  // the waiting rank ended or went on meanwhile
            diagnosis.reset();
            progress_at = Clock::now();
            hang_asked_at.reset();
          } else {
            hung = true;
            begin_stopping();
          }
        }
      }
    }
  }

  // The culprit: the earliest cause; else, when the first failure is a collective timeout, the
  // ranks it waited for; else the earliest collective failure.
  auto when = [](const Rank& r) { return r.report ? r.report->at_ns : r.ended_ns; };
  int culprit = -1;
  for (size_t i = 0; i < ranks.size(); ++i)
    if (is_cause(ranks[i]) && (culprit < 0 || when(ranks[i]) < when(ranks[culprit]))) culprit = int(i);
  int first_collective = -1;
  for (size_t i = 0; i < ranks.size(); ++i)
    if (ranks[i].report && ranks[i].report->kind != Report::Error &&
        (first_collective < 0 || ranks[i].report->at_ns < ranks[first_collective].report->at_ns))
      first_collective = int(i);
  auto name = [](const Rank& r) {
    return "rank " + std::to_string(r.rank) + " (local rank " + std::to_string(r.local_rank) + ", pid " +
           std::to_string(r.pid) + ")";
  };

  // A hang the ledgers explain: the rank(s) the others waited for, and where every rank was (or,
  // past --hang-timeout, the ranks that waited with no culprit the ledgers can name).
  if (culprit < 0 && diagnosis && (!diagnosis->culprits.empty() || (hung && !diagnosis->headline.empty()))) {
    std::ostringstream say;
    say << "partrain: " << diagnosis->headline << "; all ranks were stopped. Where each rank was, from the ranks' "
        << "collective ledgers:\n" << diagnosis->details;
    if (first_collective >= 0) {
      const Rank& r = ranks[first_collective];
      say << "  The first " << (r.report->kind == Report::Timeout ? "timeout" : "failure") << ", on rank " << r.rank
          << ":\n" << indented(r.report->message, 6, "    ");
    }
    if (diagnosis->culprits.empty()) {
      std::cerr << say.str();
      std::ostringstream cause;
      cause << "no rank made progress for " << o.hang_timeout << " s (--hang-timeout)";
      return {1, cause.str()};
    }
    const Rank& c = ranks[diagnosis->culprits.front()];
    Outcome out{1, name(c) + (hung ? " stopped making progress (--hang-timeout)"
                                   : " stopped making progress (the others timed out waiting for it)")};
    // Over several nodes, a rank the ledgers blame that itself failed in a collective (a peer's
    // connection gone) most likely follows another node's failure, as below: kept until none comes.
    if (o.nnodes > 1 && c.report && c.report->kind != Report::Error) {
      out.consequence = true;
      out.details = say.str();
    } else {
      std::cerr << say.str();
    }
    return out;
  }
  if (culprit < 0 && first_collective >= 0 && ranks[first_collective].report->kind == Report::Timeout &&
      !missing.empty()) {
    const Rank& waited = ranks[first_collective];
    std::cerr << "partrain: ";
    for (size_t k = 0; k < missing.size(); ++k) std::cerr << (k ? ", " : "") << name(ranks[missing[k].first]);
    std::cerr << (missing.size() > 1 ? " were" : " was") << " still running, with no error, when the other ranks timed "
              << "out waiting in a collective: " << (missing.size() > 1 ? "they are" : "it is")
              << " the rank the others waited for";
    for (const auto& [i, state] : missing)
      if (state == 'T' || state == 't') std::cerr << " (rank " << ranks[i].rank << " was stopped: SIGSTOP, Ctrl-Z or a debugger)";
    std::cerr << "; all ranks were stopped. The first timeout, on rank " << waited.rank << ":\n"
              << indented(waited.report->message, 6);
    return {1, name(ranks[missing.front().first]) + " stopped making progress (the others timed out waiting for it)"};
  }
  // Over several nodes a failed collective alone is most likely another node's failure seen
  // from here: what it says is kept for when no other node's failure comes first.
  const bool consequence = culprit < 0 && first_collective >= 0 && o.nnodes > 1;
  if (culprit < 0) culprit = first_collective;
  if (culprit >= 0) {
    const Rank& r = ranks[culprit];
    std::ostringstream say;
    say << "partrain: " << name(r) << " failed first: it " << describe_status(r.status)
        << "; the other ranks were stopped";
    if (r.report) {
      say << ". Its error:\n" << indented(r.report->message, 12);
      // The other ranks' own errors (not the collectives that failed because this one did), once
      // each: the same error on every rank is one message.
      auto first_line = [](const std::string& m) {
        auto line = m.substr(0, m.find('\n'));
        return line.substr(line.find(": ") == std::string::npos ? 0 : line.find(": ") + 2);  // without "rank N: "
      };
      std::vector<int> same;
      std::vector<std::pair<std::string, std::vector<int>>> others;
      for (const auto& x : ranks) {
        if (&x == &r || !x.report || x.report->kind != Report::Error) continue;
        auto line = first_line(x.report->message);
        if (line == first_line(r.report->message)) {
          same.push_back(x.rank);
          continue;
        }
        auto it = std::find_if(others.begin(), others.end(), [&](const auto& e) { return e.first == line; });
        if (it == others.end()) others.push_back({line, {x.rank}});
        else it->second.push_back(x.rank);
      }
      auto list = [](const std::vector<int>& v) {
        std::string s;
        for (size_t k = 0; k < v.size(); ++k) s += (k ? "," : "") + std::to_string(v[k]);
        return s;
      };
      if (!same.empty()) say << "  (rank" << (same.size() > 1 ? "s " : " ") << list(same) << " failed with the same error)\n";
      for (size_t k = 0; k < others.size() && k < 4; ++k)
        say << "  rank" << (others[k].second.size() > 1 ? "s " : " ") << list(others[k].second) << " failed too: "
            << (others[k].first.size() > 200 ? others[k].first.substr(0, 200) + "..." : others[k].first) << "\n";
    } else if (!r.last_err.empty()) {
      say << ". The last lines of its stderr:\n";
      for (const auto& l : r.last_err) say << "  " << l << '\n';
    } else if (o.interactive && r.rank == 0) {
      say << " (its stderr went to the terminal, above)\n";
    } else {
      say << " (it wrote nothing to stderr)\n";
    }
    std::string why = describe_status(r.status);
    if (r.report) {
      auto line = r.report->message.substr(0, r.report->message.find('\n'));
      why = "failed: " + (line.size() > 200 ? line.substr(0, 200) + "..." : line);
    }
    Outcome out{1, name(r) + " " + why};
    if (consequence) {
      out.consequence = true;
      out.details = say.str();
    } else {
      std::cerr << say.str();
    }
    return out;
  }
  bool sigint = std::any_of(ranks.begin(), ranks.end(), [&](const Rank& r) {
    return o.interactive && WIFSIGNALED(r.status) && WTERMSIG(r.status) == SIGINT;
  });
  if (interrupted || sigint) {
    int sig = interrupted ? int(interrupted) : SIGINT;
    std::cerr << "partrain: interrupted (" << (sig == SIGINT ? "Ctrl-C" : "signal " + std::to_string(sig))
              << "); stopped all ranks\n";
    return {128 + sig, "interrupted", true};
  }
  return {};
}

}  // namespace

std::string read_secret_file(const std::string& path) {
  const std::string what = "rendezvous secret (--rdzv-secret-file)";
  int fd = util::open_regular(path, what);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    throw std::runtime_error("--rdzv-secret-file '" + path + "': " + std::strerror(errno));
  }
  auto fail = [&](const std::string& why) {
    close(fd);
    throw std::invalid_argument("--rdzv-secret-file '" + path + "' " + why);
  };
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", unsigned(st.st_mode & 07777));
  if (st.st_mode & (S_IRGRP | S_IWGRP | S_IROTH | S_IWOTH))
    fail(std::string("can be read or written by users other than its owner (mode ") + mode + "): chmod 600 it");
  if (st.st_size > off_t(dist::kMaxSecret + 64))
    fail("holds " + std::to_string(st.st_size) + " bytes; a secret is 16 to " + std::to_string(dist::kMaxSecret));
  std::string secret(size_t(st.st_size), '\0');
  size_t got = 0;
  while (got < secret.size()) {
    ssize_t n = read(fd, secret.data() + got, secret.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += size_t(n);
  }
  close(fd);
  secret.resize(got);
  while (!secret.empty() && std::isspace(static_cast<unsigned char>(secret.back()))) secret.pop_back();
  if (secret.size() < dist::kMinSecret || secret.size() > dist::kMaxSecret)
    throw std::invalid_argument("--rdzv-secret-file '" + path + "' holds a secret of " + std::to_string(secret.size()) +
                                " bytes (expected 16 to " + std::to_string(dist::kMaxSecret) +
                                ": 128 bits or more, e.g. head -c 32 /dev/urandom | xxd -p -c 64)");
  if (secret.find('\0') != std::string::npos)
    throw std::invalid_argument("--rdzv-secret-file '" + path + "' holds a NUL byte (expected text)");
  return secret;
}

namespace {

std::string plural(int n, const char* one, const char* many) { return std::to_string(n) + " " + (n == 1 ? one : many); }

// Waits `seconds` (heartbeats on, through `control`), unless a signal to the launcher ends the
// wait first; false then.
bool pause_with(NodeControl& control, int attempt, double seconds) {
  const auto until = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  while (!interrupted && Clock::now() < until) {
    if (control.poll(attempt)) return true;  // a verdict on the next start already: it is read next
    poll(nullptr, 0, 50);
  }
  return !interrupted;
}

// Over several nodes (--nnodes > 1) every node's launcher runs this loop in step with the others,
// through node 0's control store (control.hpp): the nodes meet before each start (node 0 has bound
// that start's rank rendezvous on a free port and published it), start their ranks, and agree on
// how the start ended: every node's ranks succeeded; a rank failed (the first node to say so is
// the one every node names; a restart follows while --max-restarts allows); a node was lost (no
// heartbeat for --node-timeout, or, seen from the others, node 0's store gone); or a node stopped
// the job (Ctrl-C or TERM to its launcher). Every node then exits with the same outcome.
int launch_nodes(LaunchOptions o, const std::vector<std::string>& child_args, const RankMain& rank_main,
                 StartContext& start) {
  take_signals(o);
  const int me = o.node_rank;
  ControlOptions co;
  co.nnodes = o.nnodes;
  co.node_rank = me;
  co.host = o.master_addr;
  co.port = o.master_port;
  co.secret = start.secret;
  co.join_timeout = o.timeout;
  co.node_timeout = o.node_timeout;
  co.settings = "--nnodes " + std::to_string(o.nnodes) + " --nproc-per-node " + std::to_string(o.nproc_per_node) +
                " --max-restarts " + std::to_string(o.max_restarts);
  NodeControl control(co);
  auto by_signal = [&] {
    Verdict v;
    v.kind = Verdict::Stopped;
    v.node = me;
    v.cause = "its launcher was interrupted (" +
              std::string(interrupted == SIGINT ? "Ctrl-C" : "signal " + std::to_string(int(interrupted))) + ")";
    return v;
  };
  auto close_rank_socket = [&] {
    if (start.listen_fd >= 0) close(start.listen_fd);
    start.listen_fd = -1;
  };
  // The last word on every node: what ended the job, and the status.
  auto end_with = [&](const Verdict& v, int attempt) {
    close_rank_socket();
    int status = 1;
    const std::string who = "node " + std::to_string(v.node);
    switch (v.kind) {
      case Verdict::Ok:
        status = 0;
        if (attempt > 0) std::cerr << "partrain: finished after " << plural(attempt, "restart", "restarts") << "\n";
        break;
      case Verdict::Failed:
        if (attempt > 0)
          std::cerr << "partrain: giving up after " << plural(attempt, "restart", "restarts") << " (--max-restarts "
                    << o.max_restarts << "): " << who << "'s " << v.cause << "\n";
        else
          std::cerr << "partrain: the job failed: " << who << "'s " << v.cause << "; every node's ranks were stopped\n";
        break;
      case Verdict::Lost:
        if (v.node == me)
          std::cerr << "partrain: this node (" << who << ") was declared lost by the others: " << v.cause
                    << "; its ranks were stopped\n";
        else
          std::cerr << "partrain: " << who << (v.node == 0 ? " (the host of the job's control store)" : "")
                    << " was lost: " << v.cause << "; this node's ranks were stopped, and the job ends (a job "
                    << "cannot go on without one of its nodes: its world size is fixed)\n";
        break;
      case Verdict::Stopped:
        if (v.node == me && interrupted) {
          std::cerr << "partrain: the job was stopped on every node: this node's "
                  << (v.cause.rfind("its ", 0) == 0 ? v.cause.substr(4) : v.cause) << "\n";
          status = 128 + int(interrupted);
        } else {
          std::cerr << "partrain: " << who << " stopped the job: " << v.cause << "; this node's ranks were stopped\n";
        }
        break;
    }
    control.leave();
    return status;
  };
  for (int attempt = 0;; ++attempt) {
    // Meet the others; node 0 brings the port of this start's rank rendezvous.
    int rank_port = 0;
    if (me == 0) {
      start.listen_fd = listen_socket(o.master_addr, 0);
      rank_port = port_of(start.listen_fd);
    }
    control.arrive(attempt, rank_port);
    std::optional<int> port;
    std::optional<Verdict> verdict;
    while (!(port = control.met(attempt))) {
      if ((verdict = control.poll(attempt))) break;
      if (interrupted) {
        verdict = control.propose(attempt, by_signal());
        break;
      }
      poll(nullptr, 0, 50);
    }
    if (verdict) return end_with(*verdict, attempt);
    o.master_port = *port;
    Outcome out = run_ranks(o, child_args, rank_main, start, attempt, &control);
    close_rank_socket();
    // How did this start end? Another node may have said already; else this node says, except
    // that a failed collective alone waits a while for the failure it most likely follows from
    // (a rank of another node, or a lost node, which node 0 names within --node-timeout).
    verdict = control.poll(attempt);
    if (!verdict && (out.interrupted || interrupted)) {
      verdict = control.propose(attempt, by_signal());
    } else if (!verdict && out.status == 0) {
      control.succeeded(attempt);
      while (!(verdict = control.poll(attempt))) {
        if (interrupted) verdict = control.propose(attempt, by_signal());
        else poll(nullptr, 0, 50);
      }
    } else if (!verdict) {
      if (out.consequence) {
        const auto until = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(
                                              (o.node_timeout + o.grace + 2) * 1000));
        while (!(verdict = control.poll(attempt)) && !interrupted && Clock::now() < until) poll(nullptr, 0, 50);
      }
      if (!verdict && interrupted) {
        verdict = control.propose(attempt, by_signal());
      } else if (!verdict) {
        Verdict failed;
        failed.kind = Verdict::Failed;
        failed.node = me;
        failed.cause = out.cause;
        verdict = control.propose(attempt, failed);
      }
    }
    if (out.consequence && verdict->kind == Verdict::Failed && verdict->node == me) std::cerr << out.details;
    if (verdict->kind != Verdict::Failed || attempt >= o.max_restarts) return end_with(*verdict, attempt);
    std::cerr << "partrain: restart " << attempt + 1 << " of " << o.max_restarts << ": node " << verdict->node << "'s "
              << verdict->cause << "; starting the ranks of all " << o.nnodes << " nodes again in "
              << o.restart_backoff << " s\n";
    // The back-off, heartbeats on; a node interrupted (or lost) meanwhile ends the job.
    if (!pause_with(control, attempt + 1, o.restart_backoff)) return end_with(control.propose(attempt + 1, by_signal()), attempt);
  }
}

}  // namespace

int launch(const LaunchOptions& options, const std::vector<std::string>& child_args, const RankMain& rank_main) {
  validate(options);
  util::startup_set_who("launcher");
  util::startup_mark("launcher starts the job");
  if (util::startup_trace_on()) setenv("PARTRAIN_STARTUP_T0", std::to_string(util::startup_t0_ns()).c_str(), 1);
  LaunchOptions o = options;
  if (o.master_addr.empty()) o.master_addr = "127.0.0.1";
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (o.threads <= 0) o.threads = std::max(1, cores / o.nproc_per_node);
  // The job's secret: the file's (every node reads the same), else one made now, else none.
  StartContext start;
  const char* from_env = std::getenv("PARTRAIN_RDZV_SECRET");
  if (!o.secret_file.empty()) {
    start.secret = read_secret_file(o.secret_file);
  } else if (from_env && *from_env) {
    start.secret = from_env;
    if (start.secret.size() < dist::kMinSecret || start.secret.size() > dist::kMaxSecret)
      throw std::invalid_argument("environment variable PARTRAIN_RDZV_SECRET holds " +
                                  std::to_string(start.secret.size()) + " bytes (expected 16 to " +
                                  std::to_string(dist::kMaxSecret) + ": 128 bits or more)");
  } else if (o.nnodes > 1) {
    throw std::invalid_argument("--nnodes " + std::to_string(o.nnodes) + " needs --rdzv-secret-file FILE: the same "
                                "secret on every node (a file only you can read, e.g. made by head -c 32 /dev/urandom "
                                "| xxd -p -c 64 > FILE; chmod 600 FILE)");
  } else {
    start.secret = dist::new_secret();
  }
  if (o.nnodes > 1) return launch_nodes(o, child_args, rank_main, start);
  // torchrun's --max-restarts: a failed start stops every rank, waits the back-off and starts
  // them all again; scripts that resume from their checkpoints continue from the newest. The
  // status is the last start's.
  for (int attempt = 0;; ++attempt) {
    if (o.node_rank == 0) {  // a fresh store each start (a free port each time unless one is given)
      start.listen_fd = listen_socket(o.master_addr, options.master_port);
      o.master_port = port_of(start.listen_fd);
    }
    Outcome out = run_ranks(o, child_args, rank_main, start, attempt, nullptr);
    if (start.listen_fd >= 0) {
      close(start.listen_fd);
      start.listen_fd = -1;
    }
    if (out.status == 0) {
      if (attempt > 0)
        std::cerr << "partrain: finished after " << attempt << (attempt == 1 ? " restart" : " restarts") << "\n";
      return 0;
    }
    if (out.interrupted || interrupted || attempt >= o.max_restarts) {
      if (attempt > 0 && !out.interrupted)
        std::cerr << "partrain: giving up after " << attempt << (attempt == 1 ? " restart" : " restarts")
                  << " (--max-restarts " << o.max_restarts << ")\n";
      return out.status;
    }
    std::cerr << "partrain: restart " << attempt + 1 << " of " << o.max_restarts << ": " << out.cause
              << "; starting all ranks again in " << o.restart_backoff << " s\n";
    // The back-off: one wait that SIGTERM or Ctrl-C ends early.
    auto until = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.restart_backoff * 1000));
    while (!interrupted) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
      if (left <= 0) break;
      poll(nullptr, 0, int(std::min<int64_t>(left, 1000)));
    }
    if (interrupted) {
      std::cerr << "partrain: interrupted during the restart back-off; not restarting\n";
      return 128 + int(interrupted);
    }
  }
}

}  // namespace partrain::app
