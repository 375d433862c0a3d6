// How the launchers of a job over several machines (--nnodes > 1) agree: node 0's launcher serves
// a control store for the job's whole life (from a helper process it forks, so that the launcher
// keeps no thread and can still fork its ranks), and through it every node's launcher beats a
// heartbeat, meets the others before each start of the ranks (learning the port of that start's
// rank rendezvous), and agrees on how each start ended: the first node to say wins, so every
// node restarts, or gives up, for the same reason.
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <sys/types.h>

#include "engine/dist/store.hpp"

namespace partrain::app {

/// A listening TCP socket (close-on-exec) bound to `addr`:`port` only (port 0: a free one), or -1
/// with `why` saying what bind or listen answered. An address that does not resolve is an error.
int listen_on(const std::string& addr, int port, std::string& why);

struct ControlOptions {
  int nnodes = 2;             ///< --nnodes
  int node_rank = 0;          ///< --node-rank
  std::string host;           ///< --master-addr: node 0's address
  int port = 0;               ///< --master-port: where node 0's launcher serves the control store
  std::string secret;         ///< the job's rendezvous secret: the control store asks for it too
  double join_timeout = 300;  ///< --timeout: seconds the nodes may take to meet
  double node_timeout = 30;   ///< --node-timeout: seconds without a heartbeat after which a node is lost
  /// What must be the same on every node ("--nnodes 2 --nproc-per-node 2 --max-restarts 1"),
  /// flag and value pairs: checked against node 0's as each node joins.
  std::string settings;
};

/// How one start of the ranks ended, as every node agrees.
struct Verdict {
  enum Kind {
    Ok,       ///< every node's ranks succeeded
    Failed,   ///< a rank failed (`cause` says which and how): a restart may follow
    Lost,     ///< node `node` stopped beating, or its store went away: the job ends
    Stopped,  ///< node `node` ended the job (interrupted, or the nodes disagree): it ends
  };
  Kind kind = Ok;
  int node = 0;        ///< the node it is about
  std::string cause;   ///< one line
};

/// One node's part in the agreement. Every call is quick (a few store requests); the launcher
/// calls poll() about every 100 ms whatever else it does, and so beats the heartbeat.
class NodeControl {
 public:
  /// Node 0: serves the store on host:port and connects to it. Other nodes: connect, retrying
  /// until join_timeout, and compare their settings with node 0's: a difference throws, naming
  /// both values (and, while the first meeting is open, stops the job on every node). Either then
  /// beats its first heartbeat.
  explicit NodeControl(const ControlOptions& options);
  ~NodeControl();
  NodeControl(const NodeControl&) = delete;
  NodeControl& operator=(const NodeControl&) = delete;

  /// Beats the heartbeat (once a second) and returns `attempt`'s verdict once there is one:
  /// proposed by a node, or found here (node 0: a node silent for node_timeout; another node:
  /// node 0 silent, or its store gone).
  std::optional<Verdict> poll(int attempt);
  /// Proposes how `attempt` ended and returns the agreed verdict: the first proposal wins.
  Verdict propose(int attempt, const Verdict& verdict);
  /// This node's ranks all succeeded: the last node to say so makes the verdict Ok.
  void succeeded(int attempt);
  /// Arrives at the meeting before `attempt` (node 0 first publishes `rank_port`, the port its
  /// rank 0 serves that start's rendezvous on).
  void arrive(int attempt, int rank_port);
  /// Once every node has arrived, the rank rendezvous's port; nullopt until then, or when the
  /// meeting failed (poll() then has the verdict).
  std::optional<int> met(int attempt);
  /// After the final verdict: node 0 waits until every node that is not lost has read it (at
  /// most node_timeout); the others say they have.
  void leave();

  int node() const { return o_.node_rank; }
  /// "node 0's launcher at HOST:PORT", for messages.
  std::string store_where() const;

 private:
  std::optional<Verdict> fail_store(int attempt, const std::exception& e);
  void check_settings();
  void beat(std::optional<Verdict>& found);

  ControlOptions o_;
  c10::intrusive_ptr<dist::RendezvousStore> store_;
  pid_t helper_ = -1;  ///< node 0: the process serving the store
  int lifeline_ = -1;  ///< node 0: the helper ends when this closes
  using Clock = std::chrono::steady_clock;
  struct Watch {
    int64_t beats = 0;
    Clock::time_point since;  ///< when `beats` was last seen to change
  };
  std::vector<Watch> watch_;  ///< node 0 watches every node; another node watches node 0
  Clock::time_point next_beat_{}, next_check_{};
  std::optional<Clock::time_point> meet_deadline_;
  std::map<int, Verdict> verdicts_;
};

}  // namespace partrain::app
