// The world (see world.hpp): this process's place among the ranks, read from torchrun's
// variables, its device, the rendezvous every rank joins, and the end of the run.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "engine/compat.hpp"
#include "engine/dist/world.hpp"
#include "engine/util/startup.hpp"
#include "engine/util/text.hpp"

namespace partrain::dist {

namespace {

// The variable's value, or nullptr.
const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int env_int(const char* name, int fallback, int lo, int hi) {
  const char* v = env(name);
  if (!v) return fallback;
  char* end = nullptr;
  errno = 0;
  long x = std::strtol(v, &end, 10);
  // strtol skips leading spaces and takes a sign: "' 0'" and "+1" are not the integers written.
  TORCH_CHECK(std::isdigit(static_cast<unsigned char>(v[0])) && end && *end == '\0' && errno == 0 && x >= lo && x <= hi,
              "environment variable ", name, "='", v, "' is not an integer in [", lo, ", ", hi, "]");
  return static_cast<int>(x);
}

// PARTRAIN_BACKEND, else the device's own: NCCL for CUDA where partrain has it, Gloo otherwise.
std::string backend_for(const WorldOptions& o) {
  if (const char* b = env("PARTRAIN_BACKEND")) return b;
#ifdef PARTRAIN_WITH_NCCL
  if (resolve_device(o.device, o.local_rank).is_cuda()) return "nccl";
#else
  (void)o;
#endif
  return "gloo";
}

}  // namespace

namespace {
// The CUDA index a spec names: -1 for cpu (or none given), local_rank for "cuda".
int device_index_of(const std::string& spec, int local_rank) {
  const std::string expected = " (expected cpu, cuda or cuda:N)";
  if (spec.empty() || spec == "cpu") return -1;
  TORCH_CHECK(spec.rfind("cuda", 0) == 0, "unknown device '", spec, "'", expected);
  if (spec == "cuda") return local_rank;
  const std::string digits = spec.substr(4 + (spec.size() > 4 && spec[4] == ':' ? 1 : 0));
  bool ok = spec.size() > 5 && spec[4] == ':' && digits.size() <= 4 &&
            digits.find_first_not_of("0123456789") == std::string::npos;
  TORCH_CHECK(ok, "unknown device '", spec, "'", expected);
  return std::stoi(digits);
}
}  // namespace

void check_device_spec(const std::string& spec) {
  int index = device_index_of(spec, 0);
  if (index < 0) return;
#ifndef PARTRAIN_WITH_CUDA
  // A CPU build never starts CUDA (compat::cuda_available is false there): refused now.
  resolve_device(spec, 0);
#else
  // Asking the CUDA runtime would start it in the launcher; the driver's devices tell whether
  // there can be a GPU at all (/dev/nvidiactl, or /dev/dxg under WSL2). Where they are, the ranks
  // check the index against the devices.
  struct stat st {};
  TORCH_CHECK(::stat("/dev/nvidiactl", &st) == 0 || ::stat("/dev/dxg", &st) == 0, "device '", spec,
              "' needs CUDA, but this machine has no NVIDIA GPU driver (no /dev/nvidiactl; use --device cpu)");
#endif
}

torch::Device resolve_device(const std::string& spec, int local_rank) {
  if (spec.empty() && !compat::cuda_available()) return torch::kCPU;
  int index = device_index_of(spec.empty() ? "cuda" : spec, local_rank);
  if (index < 0) return torch::kCPU;
  TORCH_CHECK(compat::cuda_available(), "device '", spec, "' needs CUDA, but ",
              "this LibTorch sees no CUDA device (use --device cpu)");
  int count = compat::cuda_device_count();
  // No spec: cuda:<local rank>, as "cuda" says; on fewer devices than local ranks, --device names one.
  TORCH_CHECK(index < count, "device '", spec.empty() ? "cuda" : spec, "' is cuda:", index, " but this machine has ",
              count, " CUDA device(s)",
              spec.empty() || spec == "cuda" ? " (one a local rank: start fewer ranks a node, or give --device cuda:0)"
                                             : "");
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

WorldOptions world_options_from_env() {
  WorldOptions o;
  bool has_rank = env("RANK") != nullptr, has_world = env("WORLD_SIZE") != nullptr;
  TORCH_CHECK(has_rank == has_world, "RANK and WORLD_SIZE must be set together (only ",
              has_rank ? "RANK" : "WORLD_SIZE", " is set)");
  if (env("PARTRAIN_TIMEOUT")) o.timeout = std::chrono::seconds(env_int("PARTRAIN_TIMEOUT", 300, 1, 7 * 24 * 3600));
  if (const char* d = std::getenv("PARTRAIN_DEVICE")) {
    o.device = d;
    try {
      resolve_device(o.device, 0);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "PARTRAIN_DEVICE: ", e.what_without_backtrace());
    }
  }
  if (const char* secret = env("PARTRAIN_RDZV_SECRET")) {  // never printed
    o.secret = secret;
    TORCH_CHECK(o.secret.size() >= kMinSecret && o.secret.size() <= kMaxSecret, "environment variable "
                "PARTRAIN_RDZV_SECRET holds ", o.secret.size(), " bytes (expected ", kMinSecret, " to ", kMaxSecret,
                ": 128 bits or more)");
  }
  if (env("PARTRAIN_RDZV_FD")) o.listen_fd = env_int("PARTRAIN_RDZV_FD", -1, 3, 1 << 20);
  if (!has_rank) {
    o.backend = backend_for(o);
    return o;
  }
  o.world_size = env_int("WORLD_SIZE", 1, 1, 1 << 20);
  o.rank = env_int("RANK", 0, 0, o.world_size - 1);
  o.local_rank = env_int("LOCAL_RANK", o.rank, 0, o.world_size - 1);
  o.local_world_size = env_int("LOCAL_WORLD_SIZE", o.world_size, 1, o.world_size);
  if (o.world_size > 1) {
    TORCH_CHECK(env("MASTER_ADDR"), "RANK=", o.rank, " and WORLD_SIZE=", o.world_size,
                " are set but MASTER_ADDR is not: set MASTER_ADDR and MASTER_PORT to where rank 0 "
                "serves the rendezvous (as torchrun does)");
    TORCH_CHECK(env("MASTER_PORT"), "RANK=", o.rank, " and WORLD_SIZE=", o.world_size,
                " are set but MASTER_PORT is not");
    o.master_addr = env("MASTER_ADDR");
    o.master_port = env_int("MASTER_PORT", 29500, 1, 65535);
  }
  o.backend = backend_for(o);
  return o;
}

World& World::instance() {
  static World world;
  return world;
}

namespace {
// The ranks in [first, n) whose key(rank) `store` lacks, as "rank 2" or "ranks 1, 3" ("" when it
// has them all), and how many.
std::pair<std::string, int> ranks_without(c10d::Store& store, int first, int n, std::string (*key)(int)) {
  std::string list;
  int count = 0;
  for (int r = first; r < n; ++r)
    if (!store.check({key(r)})) list += (count++ ? ", " : "") + std::to_string(r);
  return {count ? (count == 1 ? "rank " : "ranks ") + list : list, count};
}

std::string arrived_key(int rank) { return "partrain/arrived/" + std::to_string(rank); }
}  // namespace

void World::init(const WorldOptions& options) {
  TORCH_CHECK(!initialized_, "the world is already initialized");
  options_ = options;
  // The device first: a bad one is refused before any rank waits on the rendezvous.
  device_ = options.planned ? torch::Device(torch::kCPU) : resolve_device(options.device, options.local_rank);
  compat::use_device(*device_);  // before the groups: NCCL binds to the current device
  groups_.clear();
  if (options.world_size > 1 && !options.planned) {
    install_terminate_handler(options.rank);
    // One deadline for all of it: a rank that never comes is named within one timeout, and a
    // lone rank does not wait a second timeout after the first.
    const auto deadline = std::chrono::steady_clock::now() + options.timeout;
    StoreOptions so;
    so.host = options.master_addr;
    so.port = options.master_port;
    so.secret = options.secret;
    so.timeout = options.timeout;
    const auto where = options.master_addr + ":" + std::to_string(options.master_port);
    util::startup_mark("rendezvous: " + std::string(options.rank == 0 ? "serving and joining " : "joining ") + where);
    try {
      if (options.rank == 0) {
        so.listen_fd = options.listen_fd;
        server_ = std::make_unique<StoreServer>(so);
        so.listen_fd = -1;
      } else if (options.listen_fd >= 0) {
        ::close(options.listen_fd);  // only rank 0 serves
      }
      store_ = c10::make_intrusive<RendezvousStore>(so, deadline);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "rendezvous at ", where, (options.rank == 0 ? " (serving it)" : ""),
                  " failed: ", util::message_of(e),
                  options.rank == 0 ? std::string()
                                    : " (rank 0 serves the rendezvous: it never started serving it within the timeout, "
                                      "or the address is wrong)");
    }
    // Every rank says it has arrived and waits for the others: a rank that never comes is named.
    std::vector<std::string> arrivals;
    for (int r = 0; r < options.world_size; ++r) arrivals.push_back(arrived_key(r));
    try {
      store_->set(arrivals[options.rank], std::vector<uint8_t>{1});
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      store_->wait(arrivals, std::max(left, std::chrono::milliseconds(1)));
    } catch (const std::exception& e) {
      std::pair<std::string, int> missing;
      try {
        missing = ranks_without(*store_, 0, options.world_size, arrived_key);
      } catch (const std::exception&) {
        missing = {};  // the store itself is gone (rank 0 ended): say what failed
      }
      TORCH_CHECK(false, "rendezvous at ", where, " failed: ",
                  missing.second == 0
                      ? util::message_of(e) + (options.rank == 0 ? "" : " (rank 0, which serves the "
                                                 "rendezvous, is gone: its error says which ranks never arrived)")
                      : missing.first + (missing.second == 1 ? " has" : " have") + " not arrived within the timeout of " +
                                        std::to_string(options.timeout.count() / 1000) + " s (world of " +
                                        std::to_string(options.world_size) + "; raise it with --timeout)");
    }
  }
  std::vector<int> all(options.world_size);
  for (int i = 0; i < options.world_size; ++i) all[i] = i;
  util::startup_mark("rendezvous: every rank arrived");
  GroupOptions g{"world", all, options.timeout, options.backend, options.planned};
  world_ = ProcessGroup::create(g, options.rank, store_);
  groups_.push_back(world_);
  initialized_ = true;
  util::startup_mark("group 'world' created");
}

torch::Device World::device() const {
  if (!device_) {
    if (initialized_) {
      device_ = options_.planned ? torch::Device(torch::kCPU) : resolve_device(options_.device, options_.local_rank);
    } else {
      auto o = world_options_from_env();
      device_ = resolve_device(o.device, o.local_rank);
    }
    compat::use_device(*device_);
  }
  return *device_;
}

GroupPtr World::world() const {
  TORCH_CHECK(initialized_, "the world is not initialized");
  return world_;
}

GroupPtr World::new_group(const std::string& name, const std::vector<int>& ranks) {
  TORCH_CHECK(initialized_, "the world is not initialized");
  for (int r : ranks)
    TORCH_CHECK(r >= 0 && r < options_.world_size, "group '", name, "': rank ", r, " is outside the world of ",
                options_.world_size);
  for (size_t i = 0; i < ranks.size(); ++i)
    TORCH_CHECK(std::find(ranks.begin(), ranks.begin() + i, ranks[i]) == ranks.begin() + i, "group '", name,
                "': rank ", ranks[i], " is listed twice");
  // A unique store prefix even when names repeat (a second mesh, say).
  std::string unique = std::to_string(groups_made_++) + ":" + name;
  if (std::find(ranks.begin(), ranks.end(), options_.rank) == ranks.end()) return nullptr;
  auto group = ProcessGroup::create(GroupOptions{name, ranks, options_.timeout, options_.backend, options_.planned},
                                    options_.rank, store_, unique);
  groups_.push_back(group);
  if (ranks.size() > 1) util::startup_mark("group '" + name + "' created");
  return group;
}

std::vector<GroupPtr> World::groups() const {
  std::vector<GroupPtr> alive;
  for (const auto& w : groups_)
    if (auto g = w.lock()) alive.push_back(g);
  return alive;
}

void World::shutdown() {
  if (!initialized_) return;
  if (world_ && world_->size() > 1 && store_) end_of_run();
  world_.reset();
  store_.reset();
  server_.reset();
  groups_.clear();
  initialized_ = false;
}

// Each rank says in the store that its script has ended and leaves; rank 0, which serves the
// store, waits for all of them first. So a rank may end early (os.exit(0)) and rank 0 may work
// on alone (an evaluation, an export) for as long as it likes: no rank waits for another at the
// end under a timeout. Under the launcher, which ends the run when a rank fails, rank 0's wait has
// no time limit; a rank started by hand has no launcher to watch the others, so there the wait is
// bounded by the timeout.
void World::end_of_run() {
  const int n = options_.world_size;
  try {
    store_->set(ended_key(options_.rank), std::vector<uint8_t>{1});  // rank 0's too: a REPL's ranks watch it
  } catch (const std::exception&) {
    if (options_.rank == 0) throw;
    // The store is gone: rank 0 has ended, so nobody waits for this rank's word.
  }
  if (options_.rank != 0) return;
  std::vector<std::string> others;
  for (int r = 1; r < n; ++r) others.push_back(ended_key(r));
  ledger::SiteOverride site(ledger::kEndOfRun);  // no script line: the script has returned
  const bool watched = ledger::shared();          // a launcher watches every rank
  world_->recorded_wait([&] {
    if (watched) {
      // In slices, each a fresh request: a store wait's timer is finite.
      while (true) {
        try {
          store_->wait(others, std::chrono::minutes(10));
          return;
        } catch (const StoreTimeout&) {
        }
      }
    }
    try {
      store_->wait(others, options_.timeout);
    } catch (const StoreTimeout&) {
      TORCH_CHECK(false, "rank 0 ended its script and waited ", options_.timeout.count() / 1000, " s for ",
                  ranks_without(*store_, 1, n, ended_key).first, " to end (rank 0 serves the ranks' store, so it "
                  "leaves last; with no launcher watching the ranks, this wait is bounded: raise it with --timeout)");
    }
  });
}

}  // namespace partrain::dist
