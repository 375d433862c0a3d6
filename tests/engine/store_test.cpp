// GoogleTest for the rendezvous store (engine/dist/store.hpp): c10d's key-value semantics, waits
// answered when the key is set (not polled), the secret checked before any key, idle strangers
// never keeping a client out, and Gloo groups rendezvousing through it.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <thread>

#define PARTRAIN_COMPAT_C10D
#include "engine/compat.hpp"
#include "engine/dist/store.hpp"
#include "tests/engine/testing.hpp"

using namespace partrain;
using Clock = std::chrono::steady_clock;
using testing_util::error_of;

namespace {

std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
std::string text(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

struct Served {
  dist::StoreOptions options;
  std::unique_ptr<dist::StoreServer> server;
  explicit Served(const std::string& secret = dist::new_secret()) {
    options.secret = secret;
    options.timeout = std::chrono::seconds(5);
    server = std::make_unique<dist::StoreServer>(options);
    options.port = server->port();
  }
  c10::intrusive_ptr<dist::RendezvousStore> client(const std::string& secret) const {
    auto o = options;
    o.secret = secret;
    return c10::make_intrusive<dist::RendezvousStore>(o, Clock::now() + std::chrono::seconds(5));
  }
  c10::intrusive_ptr<dist::RendezvousStore> client() const { return client(options.secret); }
};

}  // namespace

TEST(RendezvousStore, KeysFollowC10dSemantics) {
  Served served;
  auto store = served.client();
  store->set("a", bytes("1"));
  EXPECT_EQ(text(store->get("a")), "1");
  EXPECT_EQ(store->add("n", 5), 5) << "add starts from 0";
  EXPECT_EQ(store->add("n", -2), 3);
  EXPECT_EQ(text(store->get("n")), "3") << "add keeps a decimal string, as TCPStore does";
  store->set("word", bytes("x"));
  EXPECT_NE(error_of([&] { store->add("word", 1); }).find("not an integer"), std::string::npos);
  // compareSet: no key and an empty expected value sets; a wrong expected value returns the current one.
  EXPECT_EQ(text(store->compareSet("c", {}, bytes("first"))), "first");
  EXPECT_EQ(text(store->compareSet("c", bytes("wrong"), bytes("second"))), "first");
  EXPECT_EQ(text(store->compareSet("c", bytes("first"), bytes("second"))), "second");
  EXPECT_EQ(text(store->compareSet("none", bytes("x"), bytes("y"))), "x") << "no key: the expected value comes back";
  EXPECT_TRUE(store->check({"a", "n", "c"}));
  EXPECT_FALSE(store->check({"a", "missing"}));
  int64_t keys = store->getNumKeys();
  EXPECT_TRUE(store->deleteKey("a"));
  EXPECT_FALSE(store->deleteKey("a"));
  EXPECT_EQ(store->getNumKeys(), keys - 1);
  store->append("log", bytes("ab"));
  store->append("log", bytes("cd"));
  EXPECT_EQ(text(store->get("log")), "abcd");
  store->multiSet({"m1", "m2"}, {bytes("x"), bytes("")});
  auto got = store->multiGet({"m1", "m2"});
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(text(got[0]), "x");
  EXPECT_EQ(text(got[1]), "") << "an empty value is a value";
  store->queuePush("q", bytes("one"));
  store->queuePush("q", bytes("two"));
  EXPECT_EQ(store->queueLen("q"), 2);
  EXPECT_EQ(text(store->queuePop("q", false)), "one");
  EXPECT_EQ(text(store->queuePop("q", true)), "two");
  EXPECT_NE(error_of([&] { store->queuePop("q", false); }).find("empty"), std::string::npos);
  EXPECT_TRUE(store->hasExtendedApi());
  auto copy = store->clone();  // another connection to the same keys
  EXPECT_EQ(text(copy->get("m1")), "x");
}

TEST(RendezvousStore, WaitsEndWhenTheKeyIsSetOrAtTheirTimeout) {
  Served served;
  auto waiter = served.client(), setter = served.client();
  auto t0 = Clock::now();
  auto waited = std::async(std::launch::async, [&] {
    waiter->wait({"late", "later"}, std::chrono::seconds(5));
    return Clock::now();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  setter->set("late", bytes("1"));
  auto set_at = Clock::now();
  setter->set("later", bytes("2"));
  auto done = waited.get();
  EXPECT_LT(done - set_at, std::chrono::milliseconds(200)) << "answered as the key is set (bound allows a loaded machine)";
  EXPECT_GE(done - t0, std::chrono::milliseconds(200));
  // A get blocks until its key exists too.
  auto value = std::async(std::launch::async, [&] { return text(waiter->get("soon")); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  setter->set("soon", bytes("here"));
  EXPECT_EQ(value.get(), "here");
  // A wait that times out says which keys, at its timeout, and leaves the connection usable.
  t0 = Clock::now();
  auto why = error_of([&] { waiter->wait({"never"}, std::chrono::milliseconds(300)); });
  auto took = Clock::now() - t0;
  EXPECT_NE(why.find("timed out after 300 ms waiting for key(s) never"), std::string::npos) << why;
  EXPECT_GE(took, std::chrono::milliseconds(300));
  EXPECT_LT(took, std::chrono::milliseconds(2000));
  EXPECT_TRUE(waiter->check({"soon"}));
}

TEST(RendezvousStore, AClientWithoutTheSecretIsRefused) {
  Served served;
  auto why = error_of([&] { served.client(std::string(64, '0')); });
  EXPECT_NE(why.find("closed the connection before accepting this process: it did not present the job's secret"),
            std::string::npos)
      << why;
  why = error_of([&] { served.client(""); });
  EXPECT_NE(why.find("before accepting this process"), std::string::npos) << why;
  // The store still serves the job.
  auto store = served.client();
  store->set("k", bytes("v"));
  EXPECT_EQ(text(store->get("k")), "v");
  EXPECT_EQ(store->getNumKeys(), 1) << "the refused clients wrote nothing";
}

// Connections that never present the secret (another local process holding them) had each
// taken one of the server's 4096 places for 10 s; past 4096 a client was closed at once and told
// its secret was wrong. They now get 64 places per address, the oldest making way for a new one.
TEST(RendezvousStore, IdleStrangersNeverKeepAClientOut) {
  constexpr int kIdle = 4500;
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  if (files.rlim_max != RLIM_INFINITY && files.rlim_max < kIdle + 1000) GTEST_SKIP() << "too few descriptors allowed";
  const rlimit before = files;
  files.rlim_cur = files.rlim_max == RLIM_INFINITY ? kIdle + 1000 : files.rlim_max;
  setrlimit(RLIMIT_NOFILE, &files);
  Served served;
  std::vector<int> idle;
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_port = htons(uint16_t(served.options.port));
  inet_pton(AF_INET, "127.0.0.1", &at.sin_addr);
  for (int i = 0; i < kIdle; ++i) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&at), sizeof at), 0) << "connection " << i;
    idle.push_back(fd);
  }
  const auto t0 = Clock::now();
  auto store = served.client();  // presents the secret at once: it keeps its place
  store->set("k", bytes("v"));
  EXPECT_EQ(text(store->get("k")), "v");
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
  auto why = error_of([&] { served.client(std::string(64, '0')); });
  EXPECT_NE(why.find("it did not present the job's secret"), std::string::npos)
      << "a wrong secret is still told so among the strangers: " << why;
  // The server closed all but the newest of them, each with 'B' (busy: try again).
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  int closed = 0, busy = 0;
  for (int fd : idle) {
    pollfd pf{fd, POLLIN, 0};
    char c = 0;
    if (poll(&pf, 1, 0) == 1) {
      ++closed;
      busy += recv(fd, &c, 1, MSG_DONTWAIT) == 1 && c == 'B';
    }
    close(fd);
  }
  EXPECT_GE(closed, kIdle - 64) << "the server kept more idle connections than its bound";
  EXPECT_GE(busy, closed - 64) << "those closed were told 'B' (busy), not left to guess";
  setrlimit(RLIMIT_NOFILE, &before);
}

TEST(RendezvousStore, AStoreNotServedIsAnErrorAtTheDeadline) {
  dist::StoreOptions o;
  {
    dist::StoreServer probe(o);  // a port that was free a moment ago
    o.port = probe.port();
  }
  auto t0 = Clock::now();
  auto why = error_of([&] { dist::RendezvousStore(o, Clock::now() + std::chrono::milliseconds(300)); });
  EXPECT_NE(why.find("cannot connect to the rendezvous store at 127.0.0.1:" + std::to_string(o.port)), std::string::npos)
      << why;
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(1500));
}

TEST(RendezvousStore, GlooGroupsRendezvousThroughIt) {
  Served served;
  auto run = [&](int rank) {
    auto store = c10::make_intrusive<c10d::PrefixStore>("group/test", served.client());
    auto group = compat::make_c10d_group("gloo", store, rank, 2, std::chrono::seconds(10));
    std::vector<torch::Tensor> t{torch::full({3}, double(rank + 1), torch::kFloat64)};
    group->allreduce(t)->wait();
    return t[0];
  };
  auto other = std::async(std::launch::async, run, 1);
  auto mine = run(0);
  EXPECT_TRUE(mine.equal(torch::full({3}, 3.0, torch::kFloat64)));
  EXPECT_TRUE(other.get().equal(mine));
}
