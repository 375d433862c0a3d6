// The launcher's plan of a job (see launcher.hpp): its options checked, its secret, and the starts
// of its ranks, restarted on one node or agreed on with the other nodes; one start's steps are
// launch_start.cpp, launch_watch.cpp and launch_diagnose.cpp, and a rank's end report_channel.cpp.
#include "app/launcher.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <thread>

#include "app/control.hpp"
#include "app/launch_ranks.hpp"
#include "engine/dist/store.hpp"
#include "engine/util/files.hpp"
#include "engine/util/startup.hpp"

namespace partrain::app {

using detail::Clock;
using detail::interrupted;
using detail::Outcome;
using detail::StartContext;

namespace {

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


int port_of(int fd) {
  sockaddr_storage sa{};
  socklen_t len = sizeof sa;
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  return ntohs(sa.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&sa)->sin6_port
                                        : reinterpret_cast<sockaddr_in*>(&sa)->sin_port);
}

// One start of this node's ranks: started, watched until every one has ended, and said.
Outcome run_ranks(const LaunchOptions& o, const std::vector<std::string>& child_args, const RankMain& rank_main,
                  StartContext& start, int attempt, NodeControl* control) {
  detail::LocalRanks ranks(o, attempt, control);
  ranks.start(child_args, rank_main, start);
  ranks.watch();
  return ranks.diagnose();
}

}  // namespace

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


// The verdict of a node whose launcher was interrupted (Ctrl-C or TERM).
Verdict stopped_by_signal(int node) {
  Verdict v;
  v.kind = Verdict::Stopped;
  v.node = node;
  v.cause = "its launcher was interrupted (" +
            std::string(interrupted == SIGINT ? "Ctrl-C" : "signal " + std::to_string(int(interrupted))) + ")";
  return v;
}

void close_rank_socket(StartContext& start) {
  if (start.listen_fd >= 0) close(start.listen_fd);
  start.listen_fd = -1;
}

// The last word on every node: what ended the job, and the status.
int end_job(NodeControl& control, const LaunchOptions& o, StartContext& start, const Verdict& v, int attempt) {
  const int me = o.node_rank;
  close_rank_socket(start);
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
}

// Meets the other nodes before start `attempt`; node 0 brings the port of that start's rank
// rendezvous, which `port` receives. Returns the verdict that ended the meeting instead, if one did.
std::optional<Verdict> meet(NodeControl& control, const LaunchOptions& o, StartContext& start, int attempt,
                            std::optional<int>& port) {
  int rank_port = 0;
  if (o.node_rank == 0) {
    start.listen_fd = listen_socket(o.master_addr, 0);
    rank_port = port_of(start.listen_fd);
  }
  control.arrive(attempt, rank_port);
  std::optional<Verdict> verdict;
  while (!(port = control.met(attempt))) {
    if ((verdict = control.poll(attempt))) break;
    if (interrupted) {
      verdict = control.propose(attempt, stopped_by_signal(o.node_rank));
      break;
    }
    poll(nullptr, 0, 50);
  }
  return verdict;
}

// How did this start end? Another node may have said already; else this node says, except
// that a failed collective alone waits a while for the failure it most likely follows from
// (a rank of another node, or a lost node, which node 0 names within --node-timeout).
Verdict agree_on_end(NodeControl& control, const LaunchOptions& o, const Outcome& out, int attempt) {
  const int me = o.node_rank;
  std::optional<Verdict> verdict = control.poll(attempt);
  if (!verdict && (out.interrupted || interrupted)) {
    verdict = control.propose(attempt, stopped_by_signal(me));
  } else if (!verdict && out.status == 0) {
    control.succeeded(attempt);
    while (!(verdict = control.poll(attempt))) {
      if (interrupted) verdict = control.propose(attempt, stopped_by_signal(me));
      else poll(nullptr, 0, 50);
    }
  } else if (!verdict) {
    if (out.consequence) {
      const auto until = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(
                                            (o.node_timeout + o.grace + 2) * 1000));
      while (!(verdict = control.poll(attempt)) && !interrupted && Clock::now() < until) poll(nullptr, 0, 50);
    }
    if (!verdict && interrupted) {
      verdict = control.propose(attempt, stopped_by_signal(me));
    } else if (!verdict) {
      Verdict failed;
      failed.kind = Verdict::Failed;
      failed.node = me;
      failed.cause = out.cause;
      verdict = control.propose(attempt, failed);
    }
  }
  return *verdict;
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
  detail::take_signals(o);
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
  for (int attempt = 0;; ++attempt) {
    std::optional<int> port;
    if (auto met = meet(control, o, start, attempt, port)) return end_job(control, o, start, *met, attempt);
    o.master_port = *port;
    Outcome out = run_ranks(o, child_args, rank_main, start, attempt, &control);
    close_rank_socket(start);
    const Verdict verdict = agree_on_end(control, o, out, attempt);
    if (out.consequence && verdict.kind == Verdict::Failed && verdict.node == me) std::cerr << out.details;
    if (verdict.kind != Verdict::Failed || attempt >= o.max_restarts) return end_job(control, o, start, verdict, attempt);
    std::cerr << "partrain: restart " << attempt + 1 << " of " << o.max_restarts << ": node " << verdict.node << "'s "
              << verdict.cause << "; starting the ranks of all " << o.nnodes << " nodes again in "
              << o.restart_backoff << " s\n";
    // The back-off, heartbeats on; a node interrupted (or lost) meanwhile ends the job.
    if (!pause_with(control, attempt + 1, o.restart_backoff))
      return end_job(control, o, start, control.propose(attempt + 1, stopped_by_signal(me)), attempt);
  }
}

// The job's secret: the file's (every node reads the same), else one made now, else none.
std::string job_secret(const LaunchOptions& o) {
  const char* from_env = std::getenv("PARTRAIN_RDZV_SECRET");
  if (!o.secret_file.empty()) return read_secret_file(o.secret_file);
  if (from_env && *from_env) {
    std::string secret = from_env;
    if (secret.size() < dist::kMinSecret || secret.size() > dist::kMaxSecret)
      throw std::invalid_argument("environment variable PARTRAIN_RDZV_SECRET holds " +
                                  std::to_string(secret.size()) + " bytes (expected 16 to " +
                                  std::to_string(dist::kMaxSecret) + ": 128 bits or more)");
    return secret;
  }
  if (o.nnodes > 1)
    throw std::invalid_argument("--nnodes " + std::to_string(o.nnodes) + " needs --rdzv-secret-file FILE: the same "
                                "secret on every node (a file only you can read, e.g. made by head -c 32 /dev/urandom "
                                "| xxd -p -c 64 > FILE; chmod 600 FILE)");
  return dist::new_secret();
}

// torchrun's --max-restarts on one node: a failed start stops every rank, waits the back-off and
// starts them all again; scripts that resume from their checkpoints continue from the newest.
// The status is the last start's.
int launch_node(LaunchOptions o, const std::vector<std::string>& child_args, const RankMain& rank_main,
                StartContext& start) {
  const int port = o.master_port;  // as given: 0 takes a free one each start
  for (int attempt = 0;; ++attempt) {
    if (o.node_rank == 0) {  // a fresh store each start (a free port each time unless one is given)
      start.listen_fd = listen_socket(o.master_addr, port);
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
  StartContext start;
  start.secret = job_secret(o);
  if (o.nnodes > 1) return launch_nodes(o, child_args, rank_main, start);
  return launch_node(o, child_args, rank_main, start);
}

}  // namespace partrain::app
