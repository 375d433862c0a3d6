// The world: this process's place among all ranks (read from torchrun's variables), the
// rendezvous store, and the groups made from it. A process started without those variables is a
// world of one, and every collective is then a no-op, so scripts run unchanged without a launcher.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "engine/dist/process_group.hpp"
#include "engine/dist/store.hpp"

namespace partrain::dist {

struct WorldOptions {
  int rank = 0;                                  ///< RANK
  int world_size = 1;                            ///< WORLD_SIZE
  int local_rank = 0;                            ///< LOCAL_RANK
  int local_world_size = 1;                      ///< LOCAL_WORLD_SIZE
  std::string master_addr = "127.0.0.1";         ///< MASTER_ADDR: where rank 0 serves the store
  int master_port = 29500;                       ///< MASTER_PORT
  std::chrono::milliseconds timeout{300000};     ///< PARTRAIN_TIMEOUT (seconds): store and collectives
  /// PARTRAIN_DEVICE (--device): "cpu", "cuda" (cuda:<local rank>) or "cuda:N"; empty: cuda:<local
  /// rank> when CUDA is present, else cpu.
  std::string device;
  std::string backend = "gloo";                  ///< PARTRAIN_BACKEND: "gloo" (CPU) or "nccl" (CUDA)
  /// PARTRAIN_RDZV_SECRET: what every rank presents to the rendezvous store (the launcher makes
  /// one a job); empty: none (torchrun, SLURM), and the store asks for none.
  std::string secret;
  /// PARTRAIN_RDZV_FD, rank 0 only: the listening socket the launcher bound for the store; -1:
  /// rank 0 binds master_addr:master_port itself.
  int listen_fd = -1;
  /// A virtual rank of the planner: no rendezvous, and every group is planned (records its
  /// collectives, runs none).
  bool planned = false;
};

/// The device a rank computes on, from its spec (see WorldOptions::device) and its local rank.
/// An unknown device, or cuda without a CUDA device to match, is an error naming the value.
torch::Device resolve_device(const std::string& spec, int local_rank);
/// Checks a device spec (cpu, cuda, cuda:N) without starting a CUDA runtime: what the launcher
/// checks, since the ranks it forks must find CUDA untouched. In a CUDA build, that the NVIDIA
/// driver's devices exist (each rank checks its index); in a CPU build, that a cuda device cannot be.
void check_device_spec(const std::string& spec);

/// Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
/// PARTRAIN_TIMEOUT, PARTRAIN_DEVICE and PARTRAIN_BACKEND as torchrun and SLURM wrappers set them
/// (the device's spec is checked here). Without RANK and WORLD_SIZE: a world
/// of one. A variable that is malformed, out of range or missing while RANK is set is an error
/// naming it.
WorldOptions world_options_from_env();

class World {
 public:
  /// The process's world (one a process).
  static World& instance();

  /// Joins the world: rank 0 serves the store at master_addr:master_port (that address only),
  /// everyone connects presenting the secret, and the world group forms; all of it within one
  /// timeout. Does nothing for a world of one. Call once.
  void init(const WorldOptions& options);
  bool initialized() const { return initialized_; }
  const WorldOptions& options() const { return options_; }
  int rank() const { return options_.rank; }
  int size() const { return options_.world_size; }
  /// This rank's device: groups, the engine's own collectives, loaders and new modules allocate there.
  /// Before init, the device PARTRAIN_DEVICE names for this process (resolved once).
  torch::Device device() const;
  GroupPtr world() const;
  /// The rendezvous store (null in a world of one or a planned world), for side channels that
  /// must not be collectives: the REPL hands out chunks through it, with no deadline.
  c10::intrusive_ptr<c10d::Store> store() const { return store_; }

  /// Makes a group of `ranks` named `name`. Every rank must make the same groups in the same
  /// order; ranks outside `ranks` get nullptr.
  GroupPtr new_group(const std::string& name, const std::vector<int>& ranks);

  /// The groups made so far that are still alive, the world group first.
  std::vector<GroupPtr> groups() const;

  /// Ends this rank's part of the run, then drops the groups and the store: each rank says so in
  /// the store; rank 0, which serves it, waits until every rank has (without a time limit under
  /// the launcher, which ends the run if a rank fails; else within the timeout). Call it on every
  /// rank after its last collective.
  void shutdown();
  /// The store key a rank sets once its script has ended (shutdown(), or os.exit(0) mid-script):
  /// who waits in the store for that rank can see it is gone.
  static std::string ended_key(int rank) { return "partrain/ended/" + std::to_string(rank); }

 private:
  World() = default;
  bool initialized_ = false;
  WorldOptions options_;
  mutable std::optional<torch::Device> device_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::unique_ptr<StoreServer> server_;  // rank 0's
  GroupPtr world_;
  int groups_made_ = 0;
  void end_of_run();
  std::vector<std::weak_ptr<ProcessGroup>> groups_;
};

}  // namespace partrain::dist
