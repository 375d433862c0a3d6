// Starting a node's ranks: each forked from the launcher (or exec'd where forking is unsafe) with
// torchrun's environment, its own pipes for stdout, stderr and its report, and a shared ledger.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <stdexcept>

#include "app/launch_ranks.hpp"
#include "app/parity.hpp"
#include "engine/compat.hpp"
#include "engine/util/startup.hpp"

namespace partrain::app::detail {

volatile sig_atomic_t interrupted = 0;
volatile sig_atomic_t dump_asked = 0;  // SIGUSR1: print every rank's ledger

// How this start's ranks are started: forked, or exec'd as partrain with these arguments.
struct StartPlan {
  bool forking = false;
  std::string exe;
  std::vector<std::string> args;
  std::vector<char*> argv;
  bool stdin_is_terminal = false;  // then no rank but the REPL's rank 0 reads it
  pid_t launcher = -1;
};

// One rank's pipes (read end, write end) and the descriptors it shares with the launcher.
struct RankPipes {
  int out[2], err[2], report[2];
  int ledger_fd = -1, secret_fd = -1;
};

namespace {

void on_signal(int sig) { interrupted = sig; }
void on_dump(int) { dump_asked = 1; }
void on_child(int) {}       // wakes poll() when a rank ends, so its end is timed closely

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

LocalRanks::LocalRanks(const LaunchOptions& options, int attempt_, NodeControl* control_)
    : o(options),
      attempt(attempt_),
      control(control_),
      world(options.nnodes * options.nproc_per_node),
      ranks(options.nproc_per_node),
      settle(std::min(options.timeout, 5) * 1000),
      hang_timeout(static_cast<int64_t>(options.hang_timeout * 1000)) {}

LocalRanks::~LocalRanks() {
  for (auto& r : ranks)
    if (r.ledger) munmap(const_cast<dist::ledger::Region*>(r.ledger), sizeof(dist::ledger::Region));
}

void LocalRanks::start(const std::vector<std::string>& child_args, const RankMain& rank_main,
                       StartContext& context) {
  StartPlan plan;
  const std::string unsafe = fork_unsafe(o);
  plan.forking = unsafe.empty();
  util::startup_mark(plan.forking ? "starting " + std::to_string(o.nproc_per_node) + " rank(s) with fork"
                                  : "starting " + std::to_string(o.nproc_per_node) + " rank(s) with exec (" + unsafe + ")");
  plan.exe = plan.forking ? std::string() : self_path();

  plan.args = {plan.exe, "--threads", std::to_string(o.threads)};
  plan.args.insert(plan.args.end(), child_args.begin(), child_args.end());
  for (auto& a : plan.args) plan.argv.push_back(a.data());
  plan.argv.push_back(nullptr);

  take_signals(o);

  // Without -i no rank reads a terminal: each rank has its own process group, and reading the
  // terminal from it would stop the rank. Rank 0 keeps a pipe or a file as stdin.
  plan.stdin_is_terminal = isatty(STDIN_FILENO) == 1;
  live_terminal = isatty(STDOUT_FILENO) == 1 && !o.tee && !o.interactive;
  winsize ws{};
  columns = live_terminal && ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 ? ws.ws_col : 0;

  plan.launcher = getpid();
  std::fflush(nullptr);  // nothing buffered in the launcher may be written again by a forked rank
  std::cout.flush();
  for (int local = 0; local < o.nproc_per_node; ++local) start_rank(local, plan, rank_main, context);
  util::startup_mark("every rank started");
}

void LocalRanks::start_rank(int local, const StartPlan& plan, const RankMain& rank_main, StartContext& context) {
  Rank& r = ranks[local];
  r.local_rank = local;
  r.rank = o.node_rank * o.nproc_per_node + local;
  RankPipes p;
  if (pipe2(p.out, O_CLOEXEC) != 0 || pipe2(p.err, O_CLOEXEC) != 0 || pipe2(p.report, O_CLOEXEC) != 0)
    throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
  p.ledger_fd = share_ledger(r);
  p.secret_fd = secret_pipe(context.secret);
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) become_rank(r, plan, p, rank_main, context);
  close(p.out[1]);
  close(p.err[1]);
  close(p.report[1]);
  if (p.ledger_fd >= 0) close(p.ledger_fd);
  if (p.secret_fd >= 0) close(p.secret_fd);
  r.pid = pid;
  r.out = p.out[0];
  r.err = p.err[0];
  r.report_fd = p.report[0];
  fcntl(r.report_fd, F_SETFL, O_NONBLOCK);  // drained after the rank ends: never a blocking read
  r.running = true;
  ++running;
  if (r.rank == 0 && context.listen_fd >= 0) {  // rank 0 holds it now; a dead rank 0 must close it
    close(context.listen_fd);
    context.listen_fd = -1;
  }
}

// In the child: its process group, its standard streams and environment, then exec, or (forked)
// the rank's code in this process.
void LocalRanks::become_rank(const Rank& r, const StartPlan& plan, const RankPipes& p, const RankMain& rank_main,
                             const StartContext& context) const {
  // Its own group, so that stopping it stops its children too; in the REPL the terminal's
  // group, so that Ctrl-C reaches it.
  if (!o.interactive) setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the launcher
  if (getppid() != plan.launcher) _exit(1);
  if (!(o.interactive && r.rank == 0)) {  // in the REPL rank 0 keeps the terminal
    dup2(p.out[1], STDOUT_FILENO);
    dup2(p.err[1], STDERR_FILENO);
  }
  bool own_stdin = o.interactive ? r.rank == 0 : r.local_rank == 0 && !plan.stdin_is_terminal;
  if (!own_stdin) {
    int null = open("/dev/null", O_RDONLY);
    dup2(null, STDIN_FILENO);
    close(null);
  }
  set_rank_environment(r, p, context);
  if (!plan.forking) {
    execv(plan.exe.c_str(), plan.argv.data());
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

// torchrun's variables, partrain's own, and the descriptors the rank keeps across exec.
void LocalRanks::set_rank_environment(const Rank& r, const RankPipes& p, const StartContext& context) const {
  fcntl(p.report[1], F_SETFD, 0);  // the one pipe end the rank keeps across exec
  setenv("PARTRAIN_REPORT_FD", std::to_string(p.report[1]).c_str(), 1);
  if (p.ledger_fd >= 0) {  // and its ledger
    fcntl(p.ledger_fd, F_SETFD, 0);
    setenv("PARTRAIN_LEDGER_FD", std::to_string(p.ledger_fd).c_str(), 1);
  }
  setenv("RANK", std::to_string(r.rank).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(r.local_rank).c_str(), 1);
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
  if (p.secret_fd >= 0) {
    fcntl(p.secret_fd, F_SETFD, 0);
    setenv("PARTRAIN_RDZV_SECRET_FD", std::to_string(p.secret_fd).c_str(), 1);
  }
  unsetenv("PARTRAIN_RDZV_FD");
  if (r.rank == 0 && context.listen_fd >= 0) {  // rank 0 serves the store on the launcher's socket
    fcntl(context.listen_fd, F_SETFD, 0);
    setenv("PARTRAIN_RDZV_FD", std::to_string(context.listen_fd).c_str(), 1);
  }
}

}  // namespace partrain::app::detail
