// The rendezvous store's server (see store.hpp; its wire in store_wire.hpp): one thread and one
// poll() loop, serving only connections that first present the job's secret.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <list>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/dist/store.hpp"
#include "engine/dist/store_wire.hpp"

namespace partrain::dist {

using namespace wire;

namespace {

constexpr size_t kMaxRequest = kMaxStoreValue + 2 * kMaxStoreKey + 64;  // one request, buffered
constexpr size_t kMaxPending = 256ull * 1024 * 1024;  // answers a client has not read yet
constexpr size_t kMaxConnections = 4096;
// Connections that have not presented the secret yet: a client sends it as soon as it connects,
// so they are allowed little time and few places, per peer address and in all. A new connection
// that finds no place takes the oldest one's (of its peer, else of all), which is answered 'B'
// (busy: the client tries again) and closed. Idle connections held by another process (4096 of
// them had been allowed 10 s each) so never keep a node or a rank out.
constexpr auto kHelloWithin = std::chrono::seconds(3);
constexpr size_t kMaxUnauthed = 256;
constexpr size_t kMaxUnauthedPerPeer = 64;

bool timing_safe_equal(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// A peer's address without its port ("127.0.0.1", "::1"): connections are counted per address.
std::string address_text(const sockaddr_storage& sa) {
  char text[INET6_ADDRSTRLEN] = "?";
  if (sa.ss_family == AF_INET)
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(sa).sin_addr, text, sizeof text);
  else if (sa.ss_family == AF_INET6)
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(sa).sin6_addr, text, sizeof text);
  return text;
}

// A request as it came: its operation and the fields that operation has.
struct Request {
  uint8_t op = 0;
  std::string k, v, w;  // a key, a value, and compareSet's desired value
  uint64_t n64 = 0;     // a wait's timeout in ms (UINT64_MAX: a queuePop that does not wait), add's addend
  std::vector<std::string> keys, values;
};

// A request's list of keys (check, wait, multiGet).
bool read_keys(Reader& r, std::vector<std::string>& keys) {
  uint32_t n = 0;
  if (!r.u32(n)) return false;
  if (n > kMaxStoreKeys) {
    r.bad = true;
    return false;
  }
  for (uint32_t i = 0; i < n; ++i) {
    std::string key;
    if (!r.str(key, kMaxStoreKey)) return false;
    keys.push_back(std::move(key));
  }
  return true;
}

// multiSet's keys and values, in pairs.
bool read_pairs(Reader& r, std::vector<std::string>& keys, std::vector<std::string>& values) {
  uint32_t n = 0;
  bool whole = r.u32(n);
  if (whole && n > kMaxStoreKeys) r.bad = true, whole = false;
  for (uint32_t i = 0; whole && i < n; ++i) {
    std::string key, val;
    whole = r.str(key, kMaxStoreKey) && r.str(val, kMaxStoreValue);
    keys.push_back(std::move(key));
    values.push_back(std::move(val));
  }
  return whole;
}

// Reads the fields of a request of a known operation (q.op); false when they are not all there
// yet, and r.bad when a length is over its bound.
bool read_fields(Reader& r, Request& q) {
  switch (q.op) {
    case kSet:
    case kAppend:
    case kQueuePush: return r.str(q.k, kMaxStoreKey) && r.str(q.v, kMaxStoreValue);
    case kGet:
    case kAdd: return r.str(q.k, kMaxStoreKey) && r.u64(q.n64);
    case kCompareSet: return r.str(q.k, kMaxStoreKey) && r.str(q.v, kMaxStoreValue) && r.str(q.w, kMaxStoreValue);
    case kDelete:
    case kQueueLen: return r.str(q.k, kMaxStoreKey);
    case kCheck: return read_keys(r, q.keys);
    case kNumKeys:
    case kListKeys: return true;
    case kWait:
    case kMultiGet: return read_keys(r, q.keys) && r.u64(q.n64);
    case kQueuePop: {
      uint8_t blocking = 0;
      const bool whole = r.str(q.k, kMaxStoreKey) && r.u8(blocking) && r.u64(q.n64);
      if (whole && !blocking) q.n64 = UINT64_MAX;  // marks "do not wait"
      return whole;
    }
    case kMultiSet: return read_pairs(r, q.keys, q.values);
  }
  return false;
}

}  // namespace

struct StoreServer::State {
  std::string secret;
  int listen_fd = -1;
  int wake[2] = {-1, -1};  // a byte written here ends the loop
  std::thread thread;

  // What a blocked request waits for.
  struct Pending {
    uint8_t op = 0;
    std::vector<std::string> keys;
    bool has_deadline = false;
    Clock::time_point deadline;
  };
  struct Conn {
    int fd = -1;
    bool authed = false;
    bool dead = false;
    Clock::time_point hello_deadline;
    std::string peer;  // its address, without the port
    std::string in, out;
    std::optional<Pending> pending;
  };
  std::list<Conn> conns;  // oldest first
  Clock::time_point listen_rest_until{};  // out of descriptors: no accepting until then
  std::unordered_map<std::string, std::string> kv;
  std::unordered_map<std::string, std::deque<std::string>> queues;
  size_t bytes = 0;  // keys and values held

  void send(Conn& c, const std::string& bytes_out) {
    c.out += bytes_out;
    flush(c);
  }
  void flush(Conn& c) {
    while (!c.out.empty() && !c.dead) {
      ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (n <= 0) {
        c.dead = true;
        break;
      }
      c.out.erase(0, size_t(n));
    }
    if (c.out.size() > kMaxPending) c.dead = true;  // a client that never reads its answers
  }
  static std::string status(char s) { return std::string(1, s); }
  static std::string value(const std::string& v) {
    std::string b(1, 'V');
    put_str(b, v);
    return b;
  }
  static std::string integer(int64_t v) {
    std::string b(1, 'I');
    put_u64(b, uint64_t(v));
    return b;
  }
  static std::string error(const std::string& why) {
    std::string b(1, 'E');
    put_str(b, why);
    return b;
  }

  bool has_all(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return kv.count(k) > 0; });
  }
  // Stores `v` under `k` unless the server would then hold more than its bound.
  bool store(const std::string& k, std::string v, Conn& c) {
    auto it = kv.find(k);
    size_t old = it == kv.end() ? 0 : k.size() + it->second.size();
    if (bytes - old + k.size() + v.size() > kMaxStoreBytes) {
      send(c, error("the rendezvous store is full (" + std::to_string(kMaxStoreBytes) + " bytes)"));
      return false;
    }
    bytes = bytes - old + k.size() + v.size();
    kv[k] = std::move(v);
    return true;
  }

  // Answers a blocked request if it can now be answered; true if it was.
  bool try_answer(Conn& c) {
    auto& p = *c.pending;
    if (p.op == kQueuePop) {
      auto it = queues.find(p.keys[0]);
      if (it == queues.end() || it->second.empty()) return false;
      std::string v = std::move(it->second.front());
      it->second.pop_front();
      bytes -= v.size();
      send(c, value(v));
    } else {
      if (!has_all(p.keys)) return false;
      if (p.op == kGet) {
        send(c, value(kv[p.keys[0]]));
      } else if (p.op == kMultiGet) {
        std::string b(1, 'L');
        put_u32(b, uint32_t(p.keys.size()));
        for (const auto& k : p.keys) put_str(b, kv[k]);
        send(c, b);
      } else {
        send(c, status('K'));
      }
    }
    c.pending.reset();
    return true;
  }

  void block(Conn& c, uint8_t op, std::vector<std::string> keys, uint64_t timeout_ms) {
    Pending p;
    p.op = op;
    p.keys = std::move(keys);
    p.has_deadline = timeout_ms > 0;
    if (p.has_deadline) p.deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    c.pending = std::move(p);
    try_answer(c);
  }

  // Handles one whole request at the front of c.in; false when it is not all there yet.
  bool handle(Conn& c) {
    Reader r{c.in};
    Request q;
    if (!r.u8(q.op)) return false;
    if (q.op < kSet || q.op > kListKeys) {  // not our protocol
      c.dead = true;
      return false;
    }
    const bool whole = read_fields(r, q);
    if (r.bad) c.dead = true;
    if (!whole) return false;
    c.in.erase(0, r.at);
    answer(c, q);
    return true;
  }

  // Answers a whole request, or blocks it until it can be answered.
  void answer(Conn& c, Request& q) {
    switch (q.op) {
      case kSet:
        if (store(q.k, std::move(q.v), c)) send(c, status('K'));
        break;
      case kAppend: append(c, q.k, q.v); break;
      case kGet: block(c, kGet, {q.k}, q.n64); break;
      case kAdd: add(c, q.k, int64_t(q.n64)); break;
      case kCompareSet: compare_set(c, q.k, q.v, q.w); break;
      case kDelete: remove(c, q.k); break;
      case kCheck: send(c, std::string{'B', char(has_all(q.keys) ? 1 : 0)}); break;
      case kNumKeys: send(c, integer(int64_t(kv.size()))); break;
      case kListKeys: list_keys(c); break;
      case kWait: block(c, kWait, std::move(q.keys), q.n64); break;
      case kMultiGet: block(c, kMultiGet, std::move(q.keys), q.n64); break;
      case kMultiSet: {
        bool ok = true;
        for (size_t i = 0; i < q.keys.size() && ok; ++i) ok = store(q.keys[i], std::move(q.values[i]), c);
        if (ok) send(c, status('K'));
        break;
      }
      case kQueuePush: queue_push(c, q.k, std::move(q.v)); break;
      case kQueuePop: queue_pop(c, q.k, q.n64); break;
      case kQueueLen: {
        auto it = queues.find(q.k);
        send(c, integer(it == queues.end() ? 0 : int64_t(it->second.size())));
        break;
      }
    }
  }

  void append(Conn& c, const std::string& k, const std::string& v) {
    auto it = kv.find(k);
    std::string joined = it == kv.end() ? v : it->second + v;
    if (joined.size() > kMaxStoreValue) {
      send(c, error("appending to '" + k + "' would make it longer than " + std::to_string(kMaxStoreValue) + " bytes"));
      return;
    }
    if (store(k, std::move(joined), c)) send(c, status('K'));
  }

  void add(Conn& c, const std::string& k, int64_t addend) {
    int64_t now = 0;
    auto it = kv.find(k);
    if (it != kv.end()) {
      const std::string& text = it->second;
      char* end = nullptr;
      errno = 0;
      long long x = text.empty() ? 0 : std::strtoll(text.c_str(), &end, 10);
      if (text.empty() || errno || !end || *end || text.size() > 24) {
        send(c, error("add on '" + k + "': its value is not an integer"));
        return;
      }
      now = x;
    }
    now += addend;
    if (store(k, std::to_string(now), c)) send(c, integer(now));
  }

  // c10d's semantics: no key and an empty expected value, or the expected value: set the desired
  // one. The answer is the value now held (the expected one when there is no key).
  void compare_set(Conn& c, const std::string& k, const std::string& expected, const std::string& desired) {
    auto it = kv.find(k);
    if (it == kv.end()) {
      if (expected.empty()) {
        if (store(k, desired, c)) send(c, value(desired));
      } else {
        send(c, value(expected));
      }
    } else if (it->second == expected) {
      if (store(k, desired, c)) send(c, value(desired));
    } else {
      send(c, value(it->second));
    }
  }

  void remove(Conn& c, const std::string& k) {
    auto it = kv.find(k);
    bool had = it != kv.end();
    if (had) {
      bytes -= it->first.size() + it->second.size();
      kv.erase(it);
    }
    send(c, std::string{'B', char(had ? 1 : 0)});
  }

  void list_keys(Conn& c) {
    std::string b(1, 'L');
    put_u32(b, uint32_t(std::min(kv.size(), kMaxStoreKeys)));
    size_t i = 0;
    for (const auto& [key, val] : kv)
      if (i++ < kMaxStoreKeys) put_str(b, key);
    send(c, b);
  }

  void queue_push(Conn& c, const std::string& k, std::string v) {
    if (bytes + v.size() > kMaxStoreBytes) {
      send(c, error("the rendezvous store is full"));
      return;
    }
    bytes += v.size();
    queues[k].push_back(std::move(v));
    send(c, status('K'));
  }

  void queue_pop(Conn& c, const std::string& k, uint64_t timeout_ms) {
    if (timeout_ms == UINT64_MAX) {  // not blocking: now or an error
      auto it = queues.find(k);
      if (it == queues.end() || it->second.empty()) {
        send(c, error("the queue '" + k + "' is empty"));
        return;
      }
    }
    block(c, kQueuePop, {k}, timeout_ms == UINT64_MAX ? 0 : timeout_ms);
  }

  // The secret, first of all: until it is presented nothing else is read.
  void hello(Conn& c) {
    Reader r{c.in};
    char magic[8];
    if (c.in.size() < sizeof magic) return;
    std::memcpy(magic, c.in.data(), sizeof magic);
    if (std::memcmp(magic, kMagic, sizeof magic) != 0) {
      c.dead = true;
      return;
    }
    r.at = sizeof magic;
    std::string presented;
    if (!r.str(presented, kMaxSecret)) {
      if (r.bad) c.dead = true;
      return;
    }
    if (!timing_safe_equal(presented, secret)) {
      c.dead = true;  // closed before it can read or write any key
      return;
    }
    c.in.erase(0, r.at);
    c.authed = true;
    send(c, status('K'));
  }

  void process(Conn& c) {
    if (!c.authed) hello(c);
    while (c.authed && !c.dead && !c.pending && handle(c)) {
    }
  }

  // Reads what the connection has sent, handling each whole request as it comes.
  void receive(Conn& c) {
    char buf[65536];
    while (!c.dead) {
      ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (n <= 0) {
        c.dead = true;
        break;
      }
      // Before the secret, only the hello's bytes are kept; after it, one request's.
      size_t cap = c.authed ? kMaxRequest : sizeof kMagic + 4 + kMaxSecret;
      c.in.append(buf, size_t(n));
      if (!c.pending) process(c);
      if (c.in.size() > cap) c.dead = true;  // a request longer than any allowed
    }
  }

  static bool unauthed(const Conn& c) { return !c.authed && !c.dead; }
  size_t unauthed_of(const std::string* peer) const {
    return size_t(std::count_if(conns.begin(), conns.end(),
                                [&](const Conn& c) { return unauthed(c) && (!peer || c.peer == *peer); }));
  }

  // Makes a place for a new connection: the oldest connection (of `peer`, or of any) that has not
  // presented the secret is read once more (its hello may be in by now), and if it still has not,
  // answered 'B' and closed at once. False when there is none.
  bool evict_oldest_unauthed(const std::string* peer) {
    for (auto& c : conns) {
      if (!unauthed(c) || (peer && c.peer != *peer)) continue;
      receive(c);
      if (c.authed || c.dead) continue;  // it made it in (or left): the next oldest
      char busy = 'B';
      if (::send(c.fd, &busy, 1, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
      }
      ::close(c.fd);  // nothing unread: the client sees 'B', then the end
      c.fd = -1;
      c.dead = true;
      return true;
    }
    return false;
  }

  // Takes every connection waiting on the listening socket, within the bounds above.
  void accept_all() {
    while (true) {
      sockaddr_storage sa{};
      socklen_t len = sizeof sa;
      int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&sa), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR) continue;
        // Out of descriptors: a stranger's idle connection gives up its own, else the listening
        // socket rests a moment (it would wake poll() at once, again and again).
        if ((errno == EMFILE || errno == ENFILE) && evict_oldest_unauthed(nullptr)) continue;
        if (errno == EMFILE || errno == ENFILE) listen_rest_until = Clock::now() + std::chrono::milliseconds(100);
        return;
      }
      Conn c;
      c.fd = fd;
      c.peer = address_text(sa);
      if (unauthed_of(&c.peer) >= kMaxUnauthedPerPeer) evict_oldest_unauthed(&c.peer);
      if (unauthed_of(nullptr) >= kMaxUnauthed) evict_oldest_unauthed(nullptr);
      if (conns.size() >= kMaxConnections) {  // every place taken by connections that presented the secret
        char busy = 'B';
        if (::send(fd, &busy, 1, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
        }
        ::close(fd);
        continue;
      }
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      c.hello_deadline = Clock::now() + kHelloWithin;
      conns.push_back(std::move(c));
    }
  }

  void answer_blocked() {
    for (auto& c : conns)
      if (c.pending && !c.dead && try_answer(c)) process(c);
  }

  void loop() {
    while (true) {
      const bool listening = Clock::now() >= listen_rest_until;
      std::vector<pollfd> fds{{wake[0], POLLIN, 0}, {listen_fd, short(listening ? POLLIN : 0), 0}};
      std::vector<Conn*> who{nullptr, nullptr};
      auto next = listening ? Clock::time_point::max() : listen_rest_until;
      for (auto& c : conns) {
        fds.push_back({c.fd, short(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
        who.push_back(&c);
        if (!c.authed) next = std::min(next, c.hello_deadline);
        if (c.pending && c.pending->has_deadline) next = std::min(next, c.pending->deadline);
      }
      int wait_ms = -1;
      if (next != Clock::time_point::max()) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count() + 1;
        wait_ms = int(std::clamp<int64_t>(left, 0, 60000));
      }
      int got = ::poll(fds.data(), fds.size(), wait_ms);
      if (got < 0 && errno != EINTR) break;
      if (fds[0].revents) break;
      if (fds[1].revents & POLLIN) accept_all();
      for (size_t i = 2; i < fds.size(); ++i) {
        Conn& c = *who[i];  // closed already if a new connection took its place
        if (fds[i].revents & POLLOUT) flush(c);
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) receive(c);
      }
      auto now = Clock::now();
      for (auto& c : conns) {
        if (unauthed(c) && now >= c.hello_deadline) {  // 'B' as for a place taken: it may try again
          char busy = 'B';
          if (::send(c.fd, &busy, 1, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
          }
          c.dead = true;
        }
        if (c.pending && c.pending->has_deadline && now >= c.pending->deadline && !c.dead) {
          c.pending.reset();
          send(c, status('T'));
          process(c);
        }
      }
      answer_blocked();
      for (auto it = conns.begin(); it != conns.end();) {
        if (it->dead) {
          if (it->fd >= 0) ::close(it->fd);
          it = conns.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& c : conns) ::close(c.fd);
    conns.clear();
  }
};

StoreServer::StoreServer(const StoreOptions& o) : state_(new State) {
  auto& s = *state_;
  s.secret = o.secret;
  TORCH_CHECK(o.secret.size() <= kMaxSecret, "the rendezvous secret is longer than ", kMaxSecret, " bytes");
  const std::string where = o.host + ":" + std::to_string(o.port);
  if (o.listen_fd >= 0) {
    int listening = 0;
    socklen_t n = sizeof listening;
    TORCH_CHECK(getsockopt(o.listen_fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &n) == 0 && listening,
                "PARTRAIN_RDZV_FD=", o.listen_fd, " is not a listening socket (the launcher passes rank 0 the "
                "store's socket; do not set it by hand)");
    s.listen_fd = o.listen_fd;
    fcntl(s.listen_fd, F_SETFD, FD_CLOEXEC);
  } else {
    addrinfo* found = resolve(o.host, o.port);
    std::string why = "no address";
    for (addrinfo* a = found; a; a = a->ai_next) {
      int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      int one = 1;
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) {
        s.listen_fd = fd;
        break;
      }
      why = errno_text();
      ::close(fd);
    }
    freeaddrinfo(found);
    TORCH_CHECK(s.listen_fd >= 0, "cannot serve the rendezvous at ", where, ": ", why,
                why.find("in use") != std::string::npos ? " (another process holds the port: choose another "
                                                          "--master-port, or leave it out to take a free one)"
                                                        : "");
  }
  sockaddr_storage sa{};
  socklen_t len = sizeof sa;
  getsockname(s.listen_fd, reinterpret_cast<sockaddr*>(&sa), &len);
  port_ = ntohs(sa.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&sa)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&sa)->sin_port);
  fcntl(s.listen_fd, F_SETFL, fcntl(s.listen_fd, F_GETFL) | O_NONBLOCK);
  TORCH_CHECK(pipe2(s.wake, O_CLOEXEC) == 0, "pipe: ", errno_text());
  s.thread = std::thread([&s] { s.loop(); });
}

StoreServer::~StoreServer() {
  auto& s = *state_;
  char b = 1;
  if (::write(s.wake[1], &b, 1) < 0) {
  }
  if (s.thread.joinable()) s.thread.join();
  ::close(s.wake[0]);
  ::close(s.wake[1]);
  ::close(s.listen_fd);
}

}  // namespace partrain::dist
