// The launchers' agreement across nodes (see control.hpp).
//
// The keys, all in the control store node 0's launcher serves (never seen by a rank):
//   alive/<node>    a counter its launcher adds 1 to every second: its heartbeat
//   claimed/<node>  how many launchers have joined as that node: a second one is refused
//   node/<node>     the settings every node must share, set once
//   port/<k>        the port node 0's rank 0 serves start k's rendezvous on
//   arrived/<k>     how many nodes have arrived at the meeting before start k
//   ok/<k>          how many nodes' ranks all succeeded in start k
//   end/<k>         start k's verdict, "<kind> <node>\n<cause>": set by compareSet, so the
//                   first node to say how the start ended is the one every node hears
//   left            how many nodes other than node 0 have read the final verdict
#include "app/control.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <thread>
#include "engine/util/text.hpp"


namespace partrain::app {

int listen_on(const std::string& addr, int port, std::string& why) {
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  int err = getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (err != 0) throw std::runtime_error("cannot resolve --master-addr '" + addr + "': " + gai_strerror(err));
  int fd = -1;
  why = "no address";
  for (addrinfo* a = found; a && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 1024) != 0) {
      why = std::strerror(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  return fd;
}

namespace {

constexpr auto kBeatEvery = std::chrono::seconds(1);
constexpr auto kCheckEvery = std::chrono::milliseconds(200);  // how often a verdict is looked for
constexpr size_t kMaxCause = 1024;                            // bytes of a verdict's cause kept

const char* kind_name(Verdict::Kind k) {
  switch (k) {
    case Verdict::Ok: return "ok";
    case Verdict::Failed: return "failed";
    case Verdict::Lost: return "lost";
    case Verdict::Stopped: return "stopped";
  }
  return "stopped";
}

std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
std::string text(const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); }

// One line of at most kMaxCause bytes, control characters as '?': what crosses the store is
// printed, so another node's text is never a terminal escape.
std::string one_line(const std::string& s) {
  std::string out = s.substr(0, kMaxCause);
  for (char& c : out)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = c == '\n' || c == '\t' ? ' ' : '?';
  return out;
}

std::string encode(const Verdict& v) {
  return std::string(kind_name(v.kind)) + " " + std::to_string(v.node) + "\n" + one_line(v.cause);
}

// A verdict from the store, read strictly: anything else is a verdict that stops the job.
Verdict decode(const std::string& s, int nnodes) {
  Verdict v;
  auto nl = s.find('\n');
  std::istringstream head(s.substr(0, nl));
  std::string kind;
  int node = -1;
  head >> kind >> node;
  bool known = kind == "ok" || kind == "failed" || kind == "lost" || kind == "stopped";
  if (nl == std::string::npos || !head || !known || node < 0 || node >= nnodes) {
    v.kind = Verdict::Stopped;
    v.node = 0;
    v.cause = "the control store holds a verdict partrain cannot read ('" + one_line(s.substr(0, 80)) + "')";
    return v;
  }
  v.kind = kind == "ok" ? Verdict::Ok : kind == "failed" ? Verdict::Failed : kind == "lost" ? Verdict::Lost : Verdict::Stopped;
  v.node = node;
  v.cause = one_line(s.substr(nl + 1));
  return v;
}

std::string key(const char* what, int n) { return std::string(what) + "/" + std::to_string(n); }

std::string seconds(double s) {
  std::ostringstream out;
  out << s;
  return out.str();
}

// The listening socket of the control store, on host:port (that address only).
int bind_control(const std::string& host, int port) {
  std::string why;
  int fd = listen_on(host, port, why);
  if (fd < 0)
    throw std::runtime_error("node 0 cannot serve the job's control store at " + host + ":" + std::to_string(port) +
                             " (--master-addr, --master-port): " + why +
                             (why.find("in use") != std::string::npos ? " (another process holds the port: choose "
                                                                        "another --master-port on every node)"
                                                                      : ""));
  return fd;
}

// The helper node 0's launcher forks: it serves the store on `listen_fd` until the launcher's
// end of `lifeline` closes (the launcher ended, however it ended: the kernel closes it), and
// dies with the launcher in any case (PR_SET_PDEATHSIG). It is forked while the launcher has
// one thread, and touches no LibTorch and no CUDA: only sockets, memory and its server thread.
[[noreturn]] void serve_control(int listen_fd, int lifeline, pid_t launcher, const std::string& secret) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != launcher) _exit(1);
  signal(SIGINT, SIG_IGN);  // Ctrl-C reaches the launcher, which ends the job and then this
  signal(SIGTERM, SIG_IGN);
  signal(SIGPIPE, SIG_IGN);
  int null = open("/dev/null", O_RDWR);  // holds no pipe of the launcher's open (a test's capture)
  for (int fd = 0; fd < 3; ++fd) dup2(null, fd);
  if (null > 2) close(null);
  try {
    dist::StoreOptions so;
    so.secret = secret;
    so.listen_fd = listen_fd;
    dist::StoreServer server(so);
    char b;
    while (read(lifeline, &b, 1) < 0 && errno == EINTR) {
    }
  } catch (...) {
    _exit(1);
  }
  _exit(0);
}

}  // namespace

NodeControl::NodeControl(const ControlOptions& options) : o_(options), watch_(options.nnodes) {
  const auto node_timeout = std::chrono::milliseconds(static_cast<int64_t>(o_.node_timeout * 1000));
  dist::StoreOptions so;
  so.host = o_.host;
  so.port = o_.port;
  so.secret = o_.secret;
  // A request unanswered for this long (at least the client's 30 s) means node 0 is gone.
  so.timeout = node_timeout;
  if (o_.node_rank == 0) {
    int fd = bind_control(o_.host, o_.port);
    int pipe_fds[2];
    if (pipe2(pipe_fds, O_CLOEXEC) != 0) {
      close(fd);
      throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
    }
    const pid_t launcher = getpid();
    std::fflush(nullptr);
    pid_t pid = fork();
    if (pid < 0) {
      close(fd);
      close(pipe_fds[0]);
      close(pipe_fds[1]);
      throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    }
    if (pid == 0) {
      close(pipe_fds[1]);
      serve_control(fd, pipe_fds[0], launcher, o_.secret);
    }
    close(fd);  // the helper holds it: connections queue on it until it serves them
    close(pipe_fds[0]);
    helper_ = pid;
    lifeline_ = pipe_fds[1];
  }
  // Node 0's store is its own helper, listening already: 10 s is plenty (a helper that died at
  // start refuses connections, which would otherwise be retried for the whole --timeout).
  const double reach = o_.node_rank == 0 ? std::min(o_.join_timeout, 10.0) : o_.join_timeout;
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(reach * 1000));
  try {
    store_ = c10::make_intrusive<dist::RendezvousStore>(so, deadline);
  } catch (const std::exception& e) {
    std::string m = util::message_of(e);
    if (o_.node_rank == 0) throw std::runtime_error("node 0 cannot reach its own control store: " + m);
    if (m.find("did not present the job's secret") != std::string::npos)
      m = "it closed the connection without accepting this node's secret (--rdzv-secret-file must hold the same "
          "secret on every node)";
    throw std::runtime_error("node " + std::to_string(o_.node_rank) + " cannot join the job through " + store_where() +
                             " (--master-addr, --master-port; waited at most --timeout " + seconds(o_.join_timeout) +
                             " s): " + m);
  }
  // The settings every node must share (--nnodes among them: a node counting another number of
  // nodes waits for a meeting that never fills, or starts its ranks in a world of the wrong
  // size) are compared with node 0's as a node joins, before it claims its place or arrives.
  if (o_.node_rank != 0) check_settings();
  // Each node rank joins once: a second launcher given the same --node-rank (a typo, a machine
  // started twice) is refused here, before it could arrive at a meeting and start ranks that
  // take the first one's places in the job's rendezvous, which would end the job.
  if (o_.node_rank != 0 && store_->add(key("claimed", o_.node_rank), 1) > 1)
    throw std::runtime_error("node " + std::to_string(o_.node_rank) + " cannot join the job through " + store_where() +
                             ": a launcher with --node-rank " + std::to_string(o_.node_rank) +
                             " has joined it already (every machine needs its own --node-rank, 1.." +
                             std::to_string(o_.nnodes - 1) + " besides node 0; a job one of whose launchers "
                             "stopped is started again on every node)");
  store_->set(key("node", o_.node_rank), bytes(o_.settings));
  std::optional<Verdict> none;
  beat(none);
}

NodeControl::~NodeControl() {
  store_.reset();
  if (helper_ > 0) {
    close(lifeline_);  // the helper ends at once
    int status;
    for (int i = 0; i < 200 && waitpid(helper_, &status, WNOHANG) == 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (waitpid(helper_, &status, WNOHANG) == 0) {
      kill(helper_, SIGKILL);
      waitpid(helper_, &status, 0);
    }
  }
}

namespace {

// "--nnodes 3 --nproc-per-node 2" -> {("--nnodes", "3"), ("--nproc-per-node", "2")}
std::vector<std::pair<std::string, std::string>> flags_of(const std::string& settings) {
  std::istringstream in(settings);
  std::vector<std::pair<std::string, std::string>> out;
  std::string flag, value;
  while (in >> flag >> value) out.emplace_back(flag, value);
  return out;
}

}  // namespace

// A joining node's settings against node 0's (set as node 0 starts its store: waited for). On a
// difference this node is refused at once, naming each flag's two values; and while the first
// meeting is still open it also ends the job, since a node 0 waiting for this node would wait out
// --timeout. A node that cannot belong to node 0's job at all (a node rank past node 0's --nnodes),
// or that comes after the meeting, leaves the job undisturbed.
void NodeControl::check_settings() {
  const std::string theirs = one_line(text(store_->get(key("node", 0))));
  if (theirs == o_.settings) return;
  const std::string me = "node " + std::to_string(o_.node_rank);
  std::string diff;
  int their_nnodes = o_.nnodes;
  const auto mine = flags_of(o_.settings);
  for (const auto& [flag, value] : flags_of(theirs)) {
    if (flag == "--nnodes") their_nnodes = std::atoi(value.c_str());
    auto it = std::find_if(mine.begin(), mine.end(), [&](const auto& m) { return m.first == flag; });
    if (it == mine.end() || it->second != value)
      diff += std::string(diff.empty() ? "" : ", ") + flag + " " + (it == mine.end() ? "(none)" : it->second) +
              " on " + me + " but " + flag + " " + value + " on node 0";
  }
  if (diff.empty()) diff = "'" + o_.settings + "' on " + me + " but '" + theirs + "' on node 0";
  Verdict v;
  v.kind = Verdict::Stopped;
  v.node = o_.node_rank;
  v.cause = "the nodes disagree: " + diff + " (every node needs the same)";
  const bool in_job = o_.node_rank < their_nnodes;
  const bool meeting_open =
      in_job && store_->add(key("arrived", 0), 0) < their_nnodes && !store_->check({key("end", 0)});
  std::string ended;
  if (meeting_open && propose(0, v).node == o_.node_rank) ended = "; the job was stopped on every node";
  throw std::runtime_error(me + " cannot join the job through " + store_where() + ": " + diff +
                           " (every node needs the same --nnodes, --nproc-per-node and --max-restarts)" + ended);
}

std::string NodeControl::store_where() const {
  return "node 0's launcher at " + o_.host + ":" + std::to_string(o_.port);
}

// The store failed under this node: on another node, node 0 (its host) is lost; on node 0, the
// helper serving it ended.
std::optional<Verdict> NodeControl::fail_store(int attempt, const std::exception& e) {
  Verdict v;
  v.kind = o_.node_rank == 0 ? Verdict::Stopped : Verdict::Lost;
  v.node = 0;
  if (o_.node_rank == 0) {
    v.cause = "the process serving the job's control store ended (" + one_line(util::message_of(e)) + ")";
  } else {
    std::string m = util::message_of(e);
    bool closed = m.find("closed the connection") != std::string::npos || m.find("cannot write") != std::string::npos;
    v.cause = "the job's control store, which " + store_where() + " serves, " +
              (closed ? std::string("closed the connection: that launcher has ended")
                      : "stopped answering (" + one_line(m.substr(0, m.find(" (rank 0"))) + ")");
  }
  verdicts_[attempt] = v;
  return v;
}

// The heartbeat, and the watch on the others' (node 0 watches every node, another node watches
// node 0): a node whose count has not changed for node_timeout is lost.
void NodeControl::beat(std::optional<Verdict>& found) {
  const auto now = Clock::now();
  if (now < next_beat_) return;
  next_beat_ = now + kBeatEvery;
  store_->add(key("alive", o_.node_rank), 1);
  const auto limit = std::chrono::milliseconds(static_cast<int64_t>(o_.node_timeout * 1000));
  for (int n = 0; n < o_.nnodes; ++n) {
    if (n == o_.node_rank || (o_.node_rank != 0 && n != 0)) continue;
    int64_t beats = store_->add(key("alive", n), 0);
    Watch& w = watch_[n];
    if (beats != w.beats) {
      w.beats = beats;
      w.since = now;
    } else if (beats > 0 && now - w.since >= limit && !found) {
      Verdict v;
      v.kind = Verdict::Lost;
      v.node = n;
      v.cause = "its launcher sent no heartbeat for " + seconds(o_.node_timeout) + " s (--node-timeout)";
      found = v;
    }
  }
}

std::optional<Verdict> NodeControl::poll(int attempt) {
  try {
    std::optional<Verdict> lost;
    beat(lost);
    auto known = verdicts_.find(attempt);
    if (known != verdicts_.end()) return known->second;
    if (lost) return propose(attempt, *lost);
    const auto now = Clock::now();
    if (now < next_check_) return std::nullopt;
    next_check_ = now + kCheckEvery;
    const std::string k = key("end", attempt);
    if (!store_->check({k})) return std::nullopt;
    Verdict v = decode(text(store_->get(k)), o_.nnodes);
    verdicts_[attempt] = v;
    return v;
  } catch (const std::exception& e) {
    return fail_store(attempt, e);
  }
}

Verdict NodeControl::propose(int attempt, const Verdict& verdict) {
  auto known = verdicts_.find(attempt);
  if (known != verdicts_.end()) return known->second;
  try {
    const std::string k = key("end", attempt);
    Verdict v = decode(text(store_->compareSet(k, {}, bytes(encode(verdict)))), o_.nnodes);
    verdicts_[attempt] = v;
    return v;
  } catch (const std::exception& e) {
    return *fail_store(attempt, e);
  }
}

void NodeControl::succeeded(int attempt) {
  try {
    if (store_->add(key("ok", attempt), 1) >= o_.nnodes) {
      Verdict ok;
      ok.node = o_.node_rank;
      propose(attempt, ok);
    }
  } catch (const std::exception& e) {
    fail_store(attempt, e);
  }
}

void NodeControl::arrive(int attempt, int rank_port) {
  try {
    if (o_.node_rank == 0) store_->set(key("port", attempt), bytes(std::to_string(rank_port)));
    store_->add(key("arrived", attempt), 1);
    meet_deadline_ = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.join_timeout * 1000));
  } catch (const std::exception& e) {
    fail_store(attempt, e);
  }
}

std::optional<int> NodeControl::met(int attempt) {
  if (verdicts_.count(attempt)) return std::nullopt;
  try {
    int64_t arrived = store_->add(key("arrived", attempt), 0);
    if (arrived < o_.nnodes) {
      // Node 0 ends a meeting some node never came to (one that came and went is lost sooner).
      if (o_.node_rank == 0 && meet_deadline_ && Clock::now() >= *meet_deadline_) {
        std::string missing;
        int count = 0;
        for (int n = 1; n < o_.nnodes; ++n)
          if (store_->add(key("alive", n), 0) == 0) missing += (count++ ? ", " : "") + std::to_string(n);
        Verdict v;
        v.kind = Verdict::Stopped;
        v.cause = (count == 0 ? std::string("not every node arrived")
                              : (count == 1 ? "node " : "nodes ") + missing + " did not arrive") +
                  " within --timeout " + seconds(o_.join_timeout) + " s (" + std::to_string(arrived) + " of " +
                  std::to_string(o_.nnodes) + " nodes came)";
        propose(attempt, v);
      }
      return std::nullopt;
    }
    if (o_.node_rank == 0) return std::stoi(text(store_->get(key("port", attempt))));
    std::string port = text(store_->get(key("port", attempt)));
    char* end = nullptr;
    long p = std::strtol(port.c_str(), &end, 10);
    if (port.empty() || *end || p < 1 || p > 65535) {
      Verdict v;
      v.kind = Verdict::Stopped;
      v.cause = "the control store holds no port for the rank rendezvous ('" + one_line(port.substr(0, 16)) + "')";
      propose(attempt, v);
      return std::nullopt;
    }
    return int(p);
  } catch (const std::exception& e) {
    fail_store(attempt, e);
    return std::nullopt;
  }
}

void NodeControl::leave() {
  try {
    if (o_.node_rank != 0) {
      store_->add("left", 1);
      return;
    }
    // Node 0 serves the store: it stays until every node still beating has read the verdict.
    // Each node's heartbeat is read afresh first: this launcher's last look may be a while old
    // (it looks once a second, when it polls), and a node it has not seen beat since, or not at
    // all, would otherwise count as gone, and lose the store before reading the verdict.
    next_beat_ = Clock::time_point{};
    std::optional<Verdict> fresh;
    beat(fresh);
    const auto until = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.node_timeout * 1000));
    const auto limit = std::chrono::milliseconds(static_cast<int64_t>(o_.node_timeout * 1000));
    while (Clock::now() < until) {
      int gone = 0;
      for (int n = 1; n < o_.nnodes; ++n)
        if (watch_[n].beats == 0 || Clock::now() - watch_[n].since >= limit) ++gone;
      if (store_->add("left", 0) >= o_.nnodes - 1 - gone) return;
      std::optional<Verdict> ignored;
      beat(ignored);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } catch (const std::exception&) {
    // Leaving: a store already gone changes nothing.
  }
}

}  // namespace partrain::app
