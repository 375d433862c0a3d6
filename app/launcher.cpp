// The local launcher (see launcher.hpp).
#include "app/launcher.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstring>
#include <deque>
#include <iostream>
#include <stdexcept>
#include <thread>

namespace partrain::app {

namespace {

using Clock = std::chrono::steady_clock;

volatile sig_atomic_t interrupted = 0;
void on_signal(int sig) { interrupted = sig; }
void ignore_signal(int) {}  // unlike SIG_IGN, not inherited by the ranks through exec

struct Rank {
  int rank = 0, local_rank = 0;
  pid_t pid = -1;
  int out = -1, err = -1;        // read ends of the child's stdout and stderr
  std::string out_line, err_line; // partial lines
  std::deque<std::string> last_err;
  bool running = false;
  int status = 0;
};

std::string exe_path() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw std::runtime_error("cannot find the partrain executable (/proc/self/exe)");
  return std::string(buf, n);
}

int free_port(const std::string& addr) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("cannot open a socket: ") + std::strerror(errno));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = 0;
  if (inet_pton(AF_INET, addr.c_str(), &sa.sin_addr) != 1) sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    throw std::runtime_error("cannot find a free port on " + addr + ": " + std::strerror(errno));
  }
  socklen_t len = sizeof(sa);
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  close(fd);
  return ntohs(sa.sin_port);
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return "was killed by signal " + std::to_string(sig) + (name ? std::string(" (SIG") + name + ")" : "");
  }
  return "ended with status " + std::to_string(status);
}

bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }

// Writes complete lines from `buffer` to `to`, each with `prefix`.
void emit_lines(std::string& buffer, std::ostream& to, const std::string& prefix, bool flush_partial,
                std::deque<std::string>* keep = nullptr) {
  size_t start = 0, nl;
  while ((nl = buffer.find('\n', start)) != std::string::npos) {
    std::string line = buffer.substr(start, nl - start);
    to << prefix << line << '\n';
    if (keep) {
      keep->push_back(line);
      if (keep->size() > 20) keep->pop_front();
    }
    start = nl + 1;
  }
  buffer.erase(0, start);
  if (flush_partial && !buffer.empty()) {
    to << prefix << buffer << '\n';
    if (keep) keep->push_back(buffer);
    buffer.clear();
  }
  to.flush();
}

}  // namespace

void validate(const LaunchOptions& o) {
  auto bad = [](const std::string& msg) { throw std::invalid_argument(msg); };
  if (o.nproc_per_node < 1) bad("--nproc-per-node must be >= 1, got " + std::to_string(o.nproc_per_node));
  if (o.nnodes < 1) bad("--nnodes must be >= 1, got " + std::to_string(o.nnodes));
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    bad("--node-rank " + std::to_string(o.node_rank) + " is not in [0, --nnodes=" + std::to_string(o.nnodes) + ")");
  if (o.master_port < 0 || o.master_port > 65535)
    bad("--master-port " + std::to_string(o.master_port) + " is not a port (1-65535)");
  if (o.nnodes > 1 && o.master_addr.empty()) bad("--nnodes " + std::to_string(o.nnodes) + " needs --master-addr (the host of node 0)");
  if (o.nnodes > 1 && o.master_port == 0) bad("--nnodes " + std::to_string(o.nnodes) + " needs --master-port (all nodes must agree on it)");
  if (o.timeout < 1) bad("--timeout must be >= 1 second, got " + std::to_string(o.timeout));
}

int launch(const LaunchOptions& options, const std::vector<std::string>& child_args) {
  validate(options);
  LaunchOptions o = options;
  if (o.master_addr.empty()) o.master_addr = "127.0.0.1";
  if (o.master_port == 0) o.master_port = free_port(o.master_addr);
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (o.threads <= 0) o.threads = std::max(1, cores / o.nproc_per_node);
  const int world = o.nnodes * o.nproc_per_node;
  const std::string exe = exe_path();

  std::vector<std::string> args{exe, "--threads", std::to_string(o.threads)};
  args.insert(args.end(), child_args.begin(), child_args.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, nullptr);
  if (o.interactive) sa.sa_handler = ignore_signal;  // Ctrl-C interrupts the ranks' evaluation
  sigaction(SIGINT, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  const pid_t launcher = getpid();
  std::vector<Rank> ranks(o.nproc_per_node);
  for (int local = 0; local < o.nproc_per_node; ++local) {
    Rank& r = ranks[local];
    r.local_rank = local;
    r.rank = o.node_rank * o.nproc_per_node + local;
    int out[2], err[2];
    if (pipe(out) != 0 || pipe(err) != 0) throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
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
      if (o.interactive && r.rank != 0) {
        int null = open("/dev/null", O_RDONLY);
        dup2(null, STDIN_FILENO);
        close(null);
      }
      close(out[0]); close(out[1]); close(err[0]); close(err[1]);
      setenv("RANK", std::to_string(r.rank).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(local).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node).c_str(), 1);
      setenv("GROUP_RANK", std::to_string(o.node_rank).c_str(), 1);
      setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
      setenv("MASTER_PORT", std::to_string(o.master_port).c_str(), 1);
      setenv("PARTRAIN_TIMEOUT", std::to_string(o.timeout).c_str(), 1);
      setenv("OMP_NUM_THREADS", std::to_string(o.threads).c_str(), 1);
      execv(exe.c_str(), argv.data());
      std::fprintf(stderr, "partrain: cannot start rank %d: %s\n", r.rank, std::strerror(errno));
      _exit(127);
    }
    close(out[1]);
    close(err[1]);
    r.pid = pid;
    r.out = out[0];
    r.err = err[0];
    r.running = true;
  }

  int culprit = -1;           // the rank whose failure stopped the run
  bool stopping = false;
  Clock::time_point kill_at;
  auto stop_all = [&](int sig) {
    for (auto& r : ranks)
      if (r.running) kill(o.interactive ? r.pid : -r.pid, sig);
  };
  auto prefix = [&](const Rank& r) { return world > 1 ? "[rank " + std::to_string(r.rank) + "] " : std::string(); };

  int running = o.nproc_per_node;
  while (running > 0 || std::any_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.out >= 0 || r.err >= 0; })) {
    // Forward output.
    std::vector<pollfd> fds;
    std::vector<std::pair<int, bool>> owners;  // (rank index, is stderr)
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i].out >= 0) { fds.push_back({ranks[i].out, POLLIN, 0}); owners.emplace_back(i, false); }
      if (ranks[i].err >= 0) { fds.push_back({ranks[i].err, POLLIN, 0}); owners.emplace_back(i, true); }
    }
    if (!fds.empty()) poll(fds.data(), fds.size(), 100);
    else std::this_thread::sleep_for(std::chrono::milliseconds(50));
    for (size_t k = 0; k < fds.size(); ++k) {
      if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Rank& r = ranks[owners[k].first];
      bool is_err = owners[k].second;
      char buf[65536];
      ssize_t n = read(fds[k].fd, buf, sizeof(buf));
      std::string& line = is_err ? r.err_line : r.out_line;
      if (n > 0) line.append(buf, n);
      bool eof = n <= 0;
      if (is_err) {
        emit_lines(line, std::cerr, prefix(r), eof, &r.last_err);
      } else if (r.rank == 0 || o.tee) {
        emit_lines(line, std::cout, o.tee ? prefix(r) : "", eof);
      } else {
        line.clear();  // only rank 0's stdout by default
      }
      if (eof) {
        close(fds[k].fd);
        (is_err ? r.err : r.out) = -1;
      }
    }
    // Reap. Among failures seen together, one killed by a signal we did not send is the cause.
    std::vector<int> failures;
    for (auto& r : ranks) {
      if (!r.running) continue;
      int status;
      if (waitpid(r.pid, &status, WNOHANG) == r.pid) {
        r.running = false;
        r.status = status;
        --running;
        if (failed(status) && !stopping) failures.push_back(r.local_rank);
      }
    }
    if (!failures.empty() && culprit < 0) {
      culprit = failures.front();
      for (int f : failures)
        if (WIFSIGNALED(ranks[f].status)) { culprit = f; break; }
    }
    if ((culprit >= 0 || interrupted) && !stopping) {
      stopping = true;
      stop_all(SIGTERM);
      kill_at = Clock::now() + std::chrono::milliseconds(static_cast<int>(o.grace * 1000));
    }
    if (stopping && Clock::now() >= kill_at) {
      stop_all(SIGKILL);
      kill_at = Clock::now() + std::chrono::hours(1);
    }
  }

  if (culprit >= 0) {
    const Rank& r = ranks[culprit];
    std::cerr << "partrain: rank " << r.rank << " (local rank " << r.local_rank << ", pid " << r.pid << ") "
              << describe_status(r.status) << "; the other ranks were stopped";
    if (!r.last_err.empty()) {
      std::cerr << ". The last lines of its stderr:\n";
      for (const auto& l : r.last_err) std::cerr << "  " << l << '\n';
    } else if (o.interactive && r.rank == 0) {
      std::cerr << " (its stderr went to the terminal, above)\n";
    } else {
      std::cerr << " (it wrote nothing to stderr)\n";
    }
    return 1;
  }
  if (interrupted) {
    std::cerr << "partrain: interrupted (signal " << interrupted << "); stopped all ranks\n";
    return 128 + interrupted;
  }
  return 0;
}

}  // namespace partrain::app
