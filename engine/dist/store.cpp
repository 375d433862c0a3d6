// The rendezvous store's server and client (see store.hpp).
//
// The wire: every integer big-endian; a string is a u32 length then its bytes. A connection
// opens with "PTRDZV01", u32 n and the n bytes of the secret; the server answers 'K', or 'B'
// (busy: no place for a connection without the secret yet; try again) and closes, or, for a
// wrong secret, closes the connection saying nothing. Then requests, one at a time: a u8 operation and its fields; each answer is a
// u8 status ('K' done, 'V' a string, 'I' a u64, 'B' a u8, 'L' u32 n strings, 'T' timed out,
// 'E' an error string) and its fields. Every length is checked against store.hpp's bounds before
// anything is allocated for it.
#include "engine/dist/store.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <optional>
#include <thread>
#include <unordered_map>

#include <c10/util/Exception.h>

namespace partrain::dist {

namespace {

using Clock = std::chrono::steady_clock;

constexpr char kMagic[8] = {'P', 'T', 'R', 'D', 'Z', 'V', '0', '1'};
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

enum Op : uint8_t {
  kSet = 1, kGet, kAdd, kCompareSet, kDelete, kCheck, kNumKeys, kWait, kAppend, kMultiGet, kMultiSet,
  kQueuePush, kQueuePop, kQueueLen, kListKeys
};

void put_u32(std::string& b, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) b.push_back(char((v >> s) & 0xff));
}
void put_u64(std::string& b, uint64_t v) {
  for (int s = 56; s >= 0; s -= 8) b.push_back(char((v >> s) & 0xff));
}
void put_str(std::string& b, const std::string& s) {
  put_u32(b, uint32_t(s.size()));
  b += s;
}
std::string str_of(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

// Reads fields from a buffer that may hold only part of a request: each getter returns false
// when the bytes are not all there yet, and marks `bad` when a length is over its bound.
struct Reader {
  const std::string& b;
  size_t at = 0;
  bool bad = false;
  bool u8(uint8_t& v) {
    if (at + 1 > b.size()) return false;
    v = uint8_t(b[at++]);
    return true;
  }
  bool u32(uint32_t& v) {
    if (at + 4 > b.size()) return false;
    v = 0;
    for (int i = 0; i < 4; ++i) v = (v << 8) | uint8_t(b[at++]);
    return true;
  }
  bool u64(uint64_t& v) {
    if (at + 8 > b.size()) return false;
    v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | uint8_t(b[at++]);
    return true;
  }
  bool str(std::string& s, size_t max) {
    uint32_t n;
    size_t start = at;
    if (!u32(n)) return false;
    if (n > max) {
      bad = true;
      return false;
    }
    if (at + n > b.size()) {
      at = start;
      return false;
    }
    s.assign(b, at, n);
    at += n;
    return true;
  }
};

bool timing_safe_equal(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::string errno_text() { return std::strerror(errno); }

// The addresses `host` resolves to, as TCP endpoints on `port`.
addrinfo* resolve(const std::string& host, int port) {
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  int err = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  TORCH_CHECK(err == 0, "cannot resolve the rendezvous address '", host, "': ", gai_strerror(err));
  return found;
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

}  // namespace

std::string new_secret() {
  unsigned char raw[32];
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open /dev/urandom for the rendezvous secret: ", errno_text());
  size_t got = 0;
  while (got < sizeof raw) {
    ssize_t n = ::read(fd, raw + got, sizeof raw - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += size_t(n);
  }
  ::close(fd);
  TORCH_CHECK(got == sizeof raw, "cannot read 32 bytes from /dev/urandom for the rendezvous secret");
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (unsigned char c : raw) {
    s.push_back(hex[c >> 4]);
    s.push_back(hex[c & 15]);
  }
  return s;
}

// ---- The server ----------------------------------------------------------------------------

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
    uint8_t op;
    if (!r.u8(op)) return false;
    std::string k, v, w;
    uint64_t n64 = 0;
    uint32_t n = 0;
    std::vector<std::string> keys;
    auto read_keys = [&]() -> bool {
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
    };
    bool whole = false;
    switch (op) {
      case kSet:
      case kAppend:
      case kQueuePush: whole = r.str(k, kMaxStoreKey) && r.str(v, kMaxStoreValue); break;
      case kGet: whole = r.str(k, kMaxStoreKey) && r.u64(n64); break;
      case kAdd: whole = r.str(k, kMaxStoreKey) && r.u64(n64); break;
      case kCompareSet: whole = r.str(k, kMaxStoreKey) && r.str(v, kMaxStoreValue) && r.str(w, kMaxStoreValue); break;
      case kDelete:
      case kQueueLen: whole = r.str(k, kMaxStoreKey); break;
      case kCheck: whole = read_keys(); break;
      case kNumKeys:
      case kListKeys: whole = true; break;
      case kWait:
      case kMultiGet: whole = read_keys() && r.u64(n64); break;
      case kQueuePop: {
        uint8_t blocking = 0;
        whole = r.str(k, kMaxStoreKey) && r.u8(blocking) && r.u64(n64);
        if (whole && !blocking) n64 = UINT64_MAX;  // marks "do not wait"
        break;
      }
      case kMultiSet: {
        std::vector<std::string> values;
        whole = r.u32(n);
        if (whole && n > kMaxStoreKeys) r.bad = true, whole = false;
        for (uint32_t i = 0; whole && i < n; ++i) {
          std::string key, val;
          whole = r.str(key, kMaxStoreKey) && r.str(val, kMaxStoreValue);
          keys.push_back(std::move(key));
          values.push_back(std::move(val));
        }
        if (whole) {
          c.in.erase(0, r.at);
          bool ok = true;
          for (size_t i = 0; i < keys.size() && ok; ++i) ok = store(keys[i], std::move(values[i]), c);
          if (ok) send(c, status('K'));
          return true;
        }
        break;
      }
      default: c.dead = true; return false;  // not our protocol
    }
    if (r.bad) c.dead = true;
    if (!whole) return false;
    c.in.erase(0, r.at);
    switch (op) {
      case kSet:
        if (store(k, std::move(v), c)) send(c, status('K'));
        break;
      case kAppend: {
        auto it = kv.find(k);
        std::string joined = it == kv.end() ? v : it->second + v;
        if (joined.size() > kMaxStoreValue) {
          send(c, error("appending to '" + k + "' would make it longer than " + std::to_string(kMaxStoreValue) + " bytes"));
          break;
        }
        if (store(k, std::move(joined), c)) send(c, status('K'));
        break;
      }
      case kGet: block(c, kGet, {k}, n64); break;
      case kAdd: {
        int64_t now = 0;
        auto it = kv.find(k);
        if (it != kv.end()) {
          const std::string& text = it->second;
          char* end = nullptr;
          errno = 0;
          long long x = text.empty() ? 0 : std::strtoll(text.c_str(), &end, 10);
          if (text.empty() || errno || !end || *end || text.size() > 24) {
            send(c, error("add on '" + k + "': its value is not an integer"));
            break;
          }
          now = x;
        }
        now += int64_t(n64);
        if (store(k, std::to_string(now), c)) send(c, integer(now));
        break;
      }
      case kCompareSet: {
        // c10d's semantics: no key and an empty expected value, or the expected value: set the
        // desired one. The answer is the value now held (the expected one when there is no key).
        auto it = kv.find(k);
        if (it == kv.end()) {
          if (v.empty()) {
            if (store(k, w, c)) send(c, value(w));
          } else {
            send(c, value(v));
          }
        } else if (it->second == v) {
          if (store(k, w, c)) send(c, value(w));
        } else {
          send(c, value(it->second));
        }
        break;
      }
      case kDelete: {
        auto it = kv.find(k);
        bool had = it != kv.end();
        if (had) {
          bytes -= it->first.size() + it->second.size();
          kv.erase(it);
        }
        send(c, std::string{'B', char(had ? 1 : 0)});
        break;
      }
      case kCheck: send(c, std::string{'B', char(has_all(keys) ? 1 : 0)}); break;
      case kNumKeys: send(c, integer(int64_t(kv.size()))); break;
      case kListKeys: {
        std::string b(1, 'L');
        put_u32(b, uint32_t(std::min(kv.size(), kMaxStoreKeys)));
        size_t i = 0;
        for (const auto& [key, val] : kv)
          if (i++ < kMaxStoreKeys) put_str(b, key);
        send(c, b);
        break;
      }
      case kWait: block(c, kWait, std::move(keys), n64); break;
      case kMultiGet: block(c, kMultiGet, std::move(keys), n64); break;
      case kQueuePush: {
        if (bytes + v.size() > kMaxStoreBytes) {
          send(c, error("the rendezvous store is full"));
          break;
        }
        bytes += v.size();
        queues[k].push_back(std::move(v));
        send(c, status('K'));
        break;
      }
      case kQueuePop: {
        if (n64 == UINT64_MAX) {  // not blocking: now or an error
          auto it = queues.find(k);
          if (it == queues.end() || it->second.empty()) {
            send(c, error("the queue '" + k + "' is empty"));
            break;
          }
        }
        block(c, kQueuePop, {k}, n64 == UINT64_MAX ? 0 : n64);
        break;
      }
      case kQueueLen: {
        auto it = queues.find(k);
        send(c, integer(it == queues.end() ? 0 : int64_t(it->second.size())));
        break;
      }
    }
    return true;
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

// ---- The client ----------------------------------------------------------------------------

namespace {

// Reads exactly n bytes before `deadline` (none: nullopt). False when the connection closed.
void read_exact(int fd, char* p, size_t n, std::optional<Clock::time_point> deadline, const std::string& where,
                const char* what) {
  while (n > 0) {
    int wait_ms = -1;
    if (deadline) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - Clock::now()).count();
      TORCH_CHECK(left > 0, "the rendezvous store at ", where, " did not answer ", what, " in time");
      wait_ms = int(std::min<int64_t>(left, 60000));
    }
    pollfd pf{fd, POLLIN, 0};
    int got = ::poll(&pf, 1, wait_ms);
    if (got < 0 && errno == EINTR) continue;
    if (got == 0) continue;
    ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    TORCH_CHECK(r > 0, "the rendezvous store at ", where, " closed the connection (",
                r == 0 ? std::string("rank 0, which serves it, has ended?") : errno_text(), ") while ", what);
    p += r;
    n -= size_t(r);
  }
}

void write_all(int fd, const std::string& bytes, const std::string& where) {
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    ssize_t n = ::send(fd, p, left, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "cannot write to the rendezvous store at ", where, ": ", errno_text(),
                " (rank 0, which serves it, has ended?)");
    p += n;
    left -= size_t(n);
  }
}

}  // namespace

RendezvousStore::RendezvousStore(const StoreOptions& options, Clock::time_point deadline)
    : c10d::Store(options.timeout), options_(options) {
  const std::string at = where();
  // Connect; a refused connection means the server is not up yet, and a busy one ('B', or reset
  // before it read the secret) that it had no place for this connection yet: try again, waiting a
  // little longer each time (1 ms to 100 ms), until the deadline. (Under partrain's launcher the
  // listening socket exists before any rank starts, so a refusal never happens there.)
  auto pause = std::chrono::milliseconds(1);
  std::string why;
  int busy = 0;
  while (true) {
    addrinfo* found = resolve(options.host, options.port);
    for (addrinfo* a = found; a && fd_ < 0; a = a->ai_next) {
      int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
        fd_ = fd;
      } else {
        why = errno_text();
        ::close(fd);
      }
    }
    freeaddrinfo(found);
    if (fd_ >= 0) {
      if (present_secret(deadline)) return;
      ++busy;
      why = "it had no place for a connection that has not presented the secret yet (" + std::to_string(busy) +
            (busy == 1 ? " try" : " tries") + "): other processes hold many connections to it without presenting one";
    }
    TORCH_CHECK(Clock::now() + pause < deadline, "cannot connect to the rendezvous store at ", at, ": ", why);
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(100));
  }
}

// Presents the secret on the new connection fd_: true once the server accepts it; false, with
// the connection closed, when the server was busy (the caller tries again); throws when it closed
// the connection without a word (a wrong secret) or did not answer by the deadline.
bool RendezvousStore::present_secret(Clock::time_point deadline) {
  const std::string at = where();
  int one = 1;
  setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  std::string hello(kMagic, sizeof kMagic);
  put_str(hello, options_.secret);
  char answer = 0;
  try {
    // A reset while writing or reading: the server closed the connection before reading the
    // secret (a place was made for a newer connection), not a judgement of the secret.
    const ssize_t sent = ::send(fd_, hello.data(), hello.size(), MSG_NOSIGNAL);
    if (sent < 0 && (errno == ECONNRESET || errno == EPIPE)) answer = 'B';
    else if (sent != ssize_t(hello.size())) write_all(fd_, hello.substr(size_t(std::max<ssize_t>(sent, 0))), at);
    if (answer != 'B') {
      pollfd pf{fd_, POLLIN, 0};
      while (true) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
        TORCH_CHECK(left > 0, "the rendezvous store at ", at, " did not answer presenting the secret in time");
        int got = ::poll(&pf, 1, int(std::min<int64_t>(left, 60000)));
        if (got < 0 && errno == EINTR) continue;
        if (got == 0) continue;
        ssize_t r = ::recv(fd_, &answer, 1, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && errno == ECONNRESET) answer = 'B';
        else TORCH_CHECK(r == 1, "the rendezvous store at ", at, " closed the connection before accepting this "
                         "process: it did not present the job's secret (PARTRAIN_RDZV_SECRET, or --rdzv-secret-file, "
                         "must be the same for every rank of the job), or rank 0, which serves the store, has ended",
                         r < 0 ? " (" + errno_text() + ")" : std::string());
        break;
      }
    }
    TORCH_CHECK(answer == 'K' || answer == 'B', "the rendezvous store at ", at, " answered the secret with '", answer,
                "'");
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
  if (answer == 'K') return true;
  ::close(fd_);
  fd_ = -1;
  return false;
}

RendezvousStore::~RendezvousStore() {
  if (fd_ >= 0) ::close(fd_);
}

std::string RendezvousStore::where() const { return options_.host + ":" + std::to_string(options_.port); }

// Sends a request and reads the answer's status and fields into the returned string (status
// first). `wait`: how long the server may take (0: no limit); the answer may take that plus a
// margin, and any answer that is not waited for, the store's timeout.
std::string RendezvousStore::request(const std::string& bytes, std::chrono::milliseconds wait) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::string at = where();
  TORCH_CHECK(fd_ >= 0, "the connection to the rendezvous store at ", at, " is closed");
  std::optional<Clock::time_point> deadline;
  if (wait.count() > 0) deadline = Clock::now() + wait + std::chrono::seconds(30);
  else if (wait.count() < 0) deadline = Clock::now() + std::max(timeout_, std::chrono::milliseconds(30000));
  // A request that fails half-way (a timeout, a bad answer) leaves the connection out of step:
  // the next request would read this one's answer. It is closed; later requests say so.
  std::string out;
  try {
    write_all(fd_, bytes, at);
    char status = 0;
    read_exact(fd_, &status, 1, deadline, at, "waiting for its answer");
    out.assign(1, status);
    auto u32 = [&]() {
      char b[4];
      read_exact(fd_, b, 4, deadline, at, "reading its answer");
      uint32_t v = 0;
      for (char c : b) v = (v << 8) | uint8_t(c);
      return v;
    };
    auto str = [&](size_t max) {
      uint32_t n = u32();
      TORCH_CHECK(n <= max, "the rendezvous store at ", at, " sent ", n, " bytes where at most ", max, " may come");
      std::string s(n, '\0');
      read_exact(fd_, s.data(), n, deadline, at, "reading its answer");
      return s;
    };
    switch (status) {
      case 'K':
      case 'T': break;
      case 'V': out += str(kMaxStoreValue); break;
      case 'E': out += str(kMaxStoreKey + 256); break;
      case 'I': {
        char b[8];
        read_exact(fd_, b, 8, deadline, at, "reading its answer");
        out.append(b, 8);
        break;
      }
      case 'B': {
        char b;
        read_exact(fd_, &b, 1, deadline, at, "reading its answer");
        out.push_back(b);
        break;
      }
      case 'L': {
        uint32_t n = u32();
        TORCH_CHECK(n <= kMaxStoreKeys, "the rendezvous store at ", at, " sent a list of ", n, " values");
        put_u32(out, n);
        for (uint32_t i = 0; i < n; ++i) put_str(out, str(kMaxStoreValue));
        break;
      }
      default:
        TORCH_CHECK(false, "the rendezvous store at ", at, " sent an answer partrain does not know ('", status, "')");
    }
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
  if (out[0] == 'E') TORCH_CHECK(false, "the rendezvous store at ", at, ": ", out.substr(1));
  return out;
}

namespace {
std::string key_list(const std::vector<std::string>& keys) {
  std::string s;
  for (size_t i = 0; i < keys.size() && i < 4; ++i) s += (i ? ", " : "") + keys[i];
  if (keys.size() > 4) s += ", ... (" + std::to_string(keys.size()) + " keys)";
  return s;
}
void check_key(const std::string& key) {
  TORCH_CHECK(key.size() <= kMaxStoreKey, "a rendezvous store key is longer than ", kMaxStoreKey, " bytes");
}
void check_keys(const std::vector<std::string>& keys) {
  TORCH_CHECK(keys.size() <= kMaxStoreKeys, "more than ", kMaxStoreKeys, " keys in one store request");
  for (const auto& k : keys) check_key(k);
}
void check_value(size_t n) {
  TORCH_CHECK(n <= kMaxStoreValue, "a rendezvous store value of ", n, " bytes is over the bound of ", kMaxStoreValue);
}
std::string with_keys(Op op, const std::vector<std::string>& keys) {
  std::string b(1, char(op));
  put_u32(b, uint32_t(keys.size()));
  for (const auto& k : keys) put_str(b, k);
  return b;
}
int64_t integer_of(const std::string& answer) {
  uint64_t v = 0;
  for (size_t i = 1; i < 9; ++i) v = (v << 8) | uint8_t(answer[i]);
  return int64_t(v);
}
std::vector<std::string> list_of(const std::string& answer) {
  std::string rest = answer.substr(1);
  Reader r{rest};
  uint32_t n = 0;
  r.u32(n);
  std::vector<std::string> out(n);
  for (auto& s : out) r.str(s, kMaxStoreValue);
  return out;
}
}  // namespace

void RendezvousStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  check_key(key);
  check_value(value.size());
  std::string b(1, char(kSet));
  put_str(b, key);
  put_str(b, str_of(value));
  request(b, std::chrono::milliseconds(-1));
}

std::vector<uint8_t> RendezvousStore::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                                 const std::vector<uint8_t>& desired) {
  check_key(key);
  check_value(expected.size());
  check_value(desired.size());
  std::string b(1, char(kCompareSet));
  put_str(b, key);
  put_str(b, str_of(expected));
  put_str(b, str_of(desired));
  return bytes_of(request(b, std::chrono::milliseconds(-1)).substr(1));
}

std::vector<uint8_t> RendezvousStore::get(const std::string& key) {
  check_key(key);
  std::string b(1, char(kGet));
  put_str(b, key);
  put_u64(b, uint64_t(timeout_.count()));
  auto answer = request(b, timeout_);
  TORCH_CHECK(answer[0] != 'T', "timed out after ", timeout_.count(), " ms waiting for key '", key,
              "' in the rendezvous store at ", where());
  return bytes_of(answer.substr(1));
}

int64_t RendezvousStore::add(const std::string& key, int64_t value) {
  check_key(key);
  std::string b(1, char(kAdd));
  put_str(b, key);
  put_u64(b, uint64_t(value));
  return integer_of(request(b, std::chrono::milliseconds(-1)));
}

bool RendezvousStore::deleteKey(const std::string& key) {
  check_key(key);
  std::string b(1, char(kDelete));
  put_str(b, key);
  return request(b, std::chrono::milliseconds(-1))[1] != 0;
}

bool RendezvousStore::check(const std::vector<std::string>& keys) {
  check_keys(keys);
  return request(with_keys(kCheck, keys), std::chrono::milliseconds(-1))[1] != 0;
}

int64_t RendezvousStore::getNumKeys() {
  return integer_of(request(std::string(1, char(kNumKeys)), std::chrono::milliseconds(-1)));
}

void RendezvousStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void RendezvousStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  check_keys(keys);
  std::string b = with_keys(kWait, keys);
  put_u64(b, uint64_t(std::max<int64_t>(0, timeout.count())));
  auto answer = request(b, timeout);
  if (answer[0] == 'T')
    throw StoreTimeout("timed out after " + std::to_string(timeout.count()) + " ms waiting for key(s) " +
                       key_list(keys) + " in the rendezvous store at " + where());
}

c10::intrusive_ptr<c10d::Store> RendezvousStore::clone() {
  auto copy = options_;
  copy.listen_fd = -1;
  copy.timeout = timeout_;
  return c10::make_intrusive<RendezvousStore>(copy, Clock::now() + timeout_);
}

void RendezvousStore::append(const std::string& key, const std::vector<uint8_t>& value) {
  check_key(key);
  check_value(value.size());
  std::string b(1, char(kAppend));
  put_str(b, key);
  put_str(b, str_of(value));
  request(b, std::chrono::milliseconds(-1));
}

std::vector<std::vector<uint8_t>> RendezvousStore::multiGet(const std::vector<std::string>& keys) {
  check_keys(keys);
  std::string b = with_keys(kMultiGet, keys);
  put_u64(b, uint64_t(timeout_.count()));
  auto answer = request(b, timeout_);
  TORCH_CHECK(answer[0] != 'T', "timed out after ", timeout_.count(), " ms waiting for key(s) ", key_list(keys),
              " in the rendezvous store at ", where());
  std::vector<std::vector<uint8_t>> out;
  for (const auto& v : list_of(answer)) out.push_back(bytes_of(v));
  return out;
}

void RendezvousStore::multiSet(const std::vector<std::string>& keys, const std::vector<std::vector<uint8_t>>& values) {
  TORCH_CHECK(keys.size() == values.size(), "multiSet: ", keys.size(), " keys but ", values.size(), " values");
  check_keys(keys);
  std::string b(1, char(kMultiSet));
  put_u32(b, uint32_t(keys.size()));
  size_t total = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    check_value(values[i].size());
    total += keys[i].size() + values[i].size();
    check_value(total);  // the server takes one request of at most about a value's bound
    put_str(b, keys[i]);
    put_str(b, str_of(values[i]));
  }
  request(b, std::chrono::milliseconds(-1));
}

bool RendezvousStore::hasExtendedApi() const { return true; }

void RendezvousStore::queuePush(const std::string& key, const std::vector<uint8_t>& value) {
  check_key(key);
  check_value(value.size());
  std::string b(1, char(kQueuePush));
  put_str(b, key);
  put_str(b, str_of(value));
  request(b, std::chrono::milliseconds(-1));
}

std::vector<uint8_t> RendezvousStore::queuePop(const std::string& key, bool block) {
  check_key(key);
  std::string b(1, char(kQueuePop));
  put_str(b, key);
  b.push_back(char(block ? 1 : 0));
  put_u64(b, uint64_t(timeout_.count()));
  auto answer = request(b, block ? timeout_ : std::chrono::milliseconds(-1));
  TORCH_CHECK(answer[0] != 'T', "timed out after ", timeout_.count(), " ms waiting on the queue '", key,
              "' in the rendezvous store at ", where());
  return bytes_of(answer.substr(1));
}

int64_t RendezvousStore::queueLen(const std::string& key) {
  check_key(key);
  std::string b(1, char(kQueueLen));
  put_str(b, key);
  return integer_of(request(b, std::chrono::milliseconds(-1)));
}

std::vector<std::string> RendezvousStore::listKeys() {
  return list_of(request(std::string(1, char(kListKeys)), std::chrono::milliseconds(-1)));
}

}  // namespace partrain::dist
