// The rendezvous store's client, a c10d::Store over one connection (see store.hpp; its wire in
// store_wire.hpp, its server in store_server.cpp), and the job's secret.
#include "engine/dist/store.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <thread>

#include "engine/dist/store_wire.hpp"

namespace partrain::dist {

using namespace wire;

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

// ---- The client ----------------------------------------------------------------------------

namespace {

std::string str_of(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

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
