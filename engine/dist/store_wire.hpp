// The rendezvous store's wire, shared by its server (store_server.cpp) and its client (store.cpp).
//
// Every integer big-endian; a string is a u32 length then its bytes. A connection opens with
// "PTRDZV01", u32 n and the n bytes of the secret; the server answers 'K', or 'B' (busy: no place
// for a connection without the secret yet; try again) and closes, or, for a wrong secret, closes
// the connection saying nothing. Then requests, one at a time: a u8 operation and its fields; each
// answer is a u8 status ('K' done, 'V' a string, 'I' a u64, 'B' a u8, 'L' u32 n strings, 'T' timed
// out, 'E' an error string) and its fields. Every length is checked against store.hpp's bounds
// before anything is allocated for it.
#pragma once

#include <netdb.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>

#include <c10/util/Exception.h>

namespace partrain::dist::wire {

using Clock = std::chrono::steady_clock;

constexpr char kMagic[8] = {'P', 'T', 'R', 'D', 'Z', 'V', '0', '1'};

enum Op : uint8_t {
  kSet = 1, kGet, kAdd, kCompareSet, kDelete, kCheck, kNumKeys, kWait, kAppend, kMultiGet, kMultiSet,
  kQueuePush, kQueuePop, kQueueLen, kListKeys
};

inline void put_u32(std::string& b, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) b.push_back(char((v >> s) & 0xff));
}
inline void put_u64(std::string& b, uint64_t v) {
  for (int s = 56; s >= 0; s -= 8) b.push_back(char((v >> s) & 0xff));
}
inline void put_str(std::string& b, const std::string& s) {
  put_u32(b, uint32_t(s.size()));
  b += s;
}

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

inline std::string errno_text() { return std::strerror(errno); }

// The addresses `host` resolves to, as TCP endpoints on `port`.
inline addrinfo* resolve(const std::string& host, int port) {
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  int err = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  TORCH_CHECK(err == 0, "cannot resolve the rendezvous address '", host, "': ", gai_strerror(err));
  return found;
}

}  // namespace partrain::dist::wire
