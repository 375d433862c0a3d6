// The rendezvous store: a small key-value server over TCP that binds one address (loopback for a
// run on one machine) and serves only connections that first present the job's secret, and its
// client, a c10d::Store that ProcessGroupGloo (and the REPL, and the world's arrivals) use.
// c10d's TCPStore can neither bind one address nor check a secret.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace partrain::dist {

/// What RendezvousStore::wait throws when its keys are not all set within its timeout (any other
/// failure is another error): a caller that waits in slices tells the two apart by type.
struct StoreTimeout : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Bounds of what crosses the wire, checked before anything is allocated.
constexpr size_t kMaxStoreKey = 64 * 1024;            ///< bytes of a key
constexpr size_t kMaxStoreValue = 64 * 1024 * 1024;   ///< bytes of a value
constexpr size_t kMaxStoreKeys = 64 * 1024;           ///< keys in one request (check, wait, multiGet)
constexpr size_t kMaxStoreBytes = 1024ull * 1024 * 1024;  ///< bytes the server holds in all
constexpr size_t kMaxSecret = 1024;                   ///< bytes of the secret
constexpr size_t kMinSecret = 16;                     ///< 128 bits

struct StoreOptions {
  std::string host = "127.0.0.1";  ///< where the server listens and the clients connect
  int port = 0;                    ///< its port (server: 0 picks a free one)
  /// What every connection presents before anything else; empty: none asked (torchrun without
  /// PARTRAIN_RDZV_SECRET).
  std::string secret;
  std::chrono::milliseconds timeout{300000};  ///< get() and wait() without a timeout of their own
  /// Server only: a socket already bound and listening (the launcher's, so that ranks never find
  /// the port closed), taken over; -1: bind host:port.
  int listen_fd = -1;
};

/// The server: one thread, one poll() loop, no sleeps; blocked gets and waits are answered as
/// soon as their keys are set, or with a timeout at their deadline. A connection that does not
/// present the secret first is closed before it can read or write a key; those that have not yet
/// are bounded (per peer address and in all, for a few seconds each), the oldest making way for a
/// new one, so idle strangers cannot keep a rank or a node out.
class StoreServer {
 public:
  explicit StoreServer(const StoreOptions& options);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;
  int port() const { return port_; }

 private:
  struct State;
  std::unique_ptr<State> state_;
  int port_ = 0;
};

/// A client: one connection, one request at a time (a mutex orders threads). Errors name the
/// store's address and what failed.
class RendezvousStore : public c10d::Store {
 public:
  /// Connects to host:port and presents the secret, retrying a refused connection (a store not
  /// yet served) and a busy one (no place yet for a connection without the secret) until
  /// `deadline`; past it, or when the server closes the connection without a word (a wrong
  /// secret), throws.
  RendezvousStore(const StoreOptions& options, std::chrono::steady_clock::time_point deadline);
  ~RendezvousStore() override;

  // c10d::Store's interface.
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

  // What LibTorch 2.x added to c10d::Store, in its exact signatures (2.x makes clone() pure).
  // Declared without `override` on purpose: they override where the base has them and are plain
  // methods where it does not, so one class builds against both (see compat.hpp).
  c10::intrusive_ptr<c10d::Store> clone();
  void append(const std::string& key, const std::vector<uint8_t>& value);
  std::vector<std::vector<uint8_t>> multiGet(const std::vector<std::string>& keys);
  void multiSet(const std::vector<std::string>& keys, const std::vector<std::vector<uint8_t>>& values);
  bool hasExtendedApi() const;
  void queuePush(const std::string& key, const std::vector<uint8_t>& value);
  std::vector<uint8_t> queuePop(const std::string& key, bool block);
  int64_t queueLen(const std::string& key);
  std::vector<std::string> listKeys();

  /// "127.0.0.1:29500", for messages.
  std::string where() const;

 private:
  std::string request(const std::string& bytes, std::chrono::milliseconds wait);
  bool present_secret(std::chrono::steady_clock::time_point deadline);
  StoreOptions options_;
  std::mutex mutex_;
  int fd_ = -1;
};

/// 32 random bytes from /dev/urandom as 64 hex digits: a job's secret.
std::string new_secret();

}  // namespace partrain::dist
