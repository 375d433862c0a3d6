// Process groups: the ranks that talk to each other, and the collectives they run. A thin layer
// over c10d (Gloo on CPU, NCCL on CUDA) that names the group and the operation in every error,
// bounds every wait by a timeout, and runs groups of one rank without any communication.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/torch.h>


#include "engine/dist/ledger.hpp"
#include "engine/util/text.hpp"

namespace partrain::dist {

using torch::Tensor;

/// How a reduction combines values across ranks. Mean (also called avg) is a sum divided by the
/// group's size, computed here because Gloo has no average.
enum class ReduceOp { Sum, Mean, Min, Max, Product };
ReduceOp parse_reduce_op(const std::string& name);  // "sum", "mean", "avg", "min", "max", "product"
std::string to_string(ReduceOp op);
/// "0,1,3": ranks as groups' names and messages list them.
std::string join_ranks(const std::vector<int>& ranks);
using util::dtype_name;

class ProcessGroup;

/// A collective in flight. wait() blocks until it completes or the group's timeout passes, and
/// then throws with the group and operation in the message.
class Work {
 public:
  Work() = default;
  /// `ticket`: the call's entry in the group's ledger (-1: none), moved to waiting, completed,
  /// failed or timed out as the wait goes.
  Work(std::shared_ptr<const ProcessGroup> group, std::string op, c10::intrusive_ptr<c10d::Work> work,
       std::function<void()> after = {}, int64_t ticket = -1);
  void wait();
  bool done() const;
  /// Calls `fn` once the collective has completed (on the thread that completes it; at once when
  /// there is none). Nothing where the backend gives no completion future.
  void when_done(std::function<void()> fn) const;

 private:
  std::shared_ptr<const ProcessGroup> group_;
  std::string op_;
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> after_;  // runs once the collective has completed (e.g. the mean's divide)
  int64_t ticket_ = -1;
  // A second operation that completes with this one, waited for after it and before `after_`
  // (send_recv's send, with its own ledger entry); null for most.
  std::shared_ptr<Work> also_;
  friend class ProcessGroup;
};

/// Whether every collective first checks that all ranks of its group are calling the same one:
/// the group's call number, the operation and its reduce op, the dtype, the shape and the script
/// line it was called from. A debugging aid that costs one small all-gather each. On by default
/// when PARTRAIN_CHECK_COLLECTIVES=1 (partrain --check-collectives).
void set_check_collectives(bool on);
bool check_collectives();

/// While one lives on this thread, the collectives started are checked as above even with the
/// check off, but without the script line (ranks may reach one collective from different lines):
/// every rank of the group must call the same operation with the same dtype, shape and root, in
/// the same place of the sequence of checked calls. What pt.dist's blocking collectives do, so
/// that a size that differs between ranks is an error, not a result partly made of another
/// rank's numbers.
class AgreedCall {
 public:
  explicit AgreedCall(bool on = true);  // off: nothing (an async call is not checked)
  ~AgreedCall();
  AgreedCall(const AgreedCall&) = delete;
  AgreedCall& operator=(const AgreedCall&) = delete;

 private:
  bool on_;
};

/// Where a collective is called from, for messages, the check above and the ledger: a function the
/// Lua boundary installs that writes the user's script line running now ("train.lua:42") into
/// `buf` (at most `n` bytes with the terminating zero), or "" when it cannot tell (another
/// thread, no script). It allocates nothing. The engine alone has none.
using CallSiteFn = void (*)(char* buf, size_t n);
void set_call_site_provider(CallSiteFn fn);
std::string call_site();
void call_site_into(char* buf, size_t n);

/// Makes a Gloo error raised on one of its own threads (where nothing can catch it: a peer sent
/// more bytes than this rank's tensor holds, because the ranks disagree on a collective's shape
/// or dtype) end the process with a message naming the rank, the collective this rank was in and
/// its script line, and exit status 1, instead of std::terminate's SIGABRT; `rank` is the rank
/// its messages (and fatal_exit's) name. Installed by World::init for worlds of more than one rank.
void install_terminate_handler(int rank);
/// Called with the terminate handler's message before the process exits (the launcher's report
/// channel, so that it can name the rank that failed first); none by default.
void set_fatal_reporter(void (*report)(const std::string& message));
/// Ends the process now, from any thread, with "partrain: rank N: <message>" on stderr (and to the
/// reporter above) and exit status 1: for work that cannot be stopped any other way.
[[noreturn]] void fatal_exit(const std::string& message);

/// A check that collectives call every few milliseconds while they wait, installed by the REPL
/// while it runs a chunk: when it returns true (Ctrl-C), the wait ends with an error saying
/// "interrupted". Without one (nullptr, the default) a wait runs to the group's timeout.
void set_wait_interrupt(bool (*interrupted)());

struct GroupOptions {
  std::string name;                               ///< shown in errors: "data", "tensor[pp=0,dp=1]"
  std::vector<int> ranks;                         ///< global ranks, in group-rank order
  std::chrono::milliseconds timeout{300000};      ///< every collective's bound
  std::string backend = "gloo";                   ///< "gloo" or "nccl"
  /// A planned group (the planner's virtual ranks): its collectives are recorded in traffic()
  /// and run nothing; outputs keep their shapes (all_gather returns size() tensors).
  bool planned = false;
};

class ProcessGroup : public std::enable_shared_from_this<ProcessGroup> {
 public:
  /// Builds the group for `global_rank`, which must be one of options.ranks. Groups of more
  /// than one rank rendezvous through `store` under `store_prefix` (default: the name).
  static std::shared_ptr<ProcessGroup> create(const GroupOptions& options, int global_rank,
                                              c10::intrusive_ptr<c10d::Store> store,
                                              const std::string& store_prefix = "");
  ~ProcessGroup();

  const std::string& name() const { return options_.name; }
  const std::vector<int>& ranks() const { return options_.ranks; }
  int rank() const { return rank_; }  ///< this process's index in the group
  int size() const { return static_cast<int>(options_.ranks.size()); }
  std::chrono::milliseconds timeout() const { return options_.timeout; }
  std::string describe() const;  ///< "group 'data' (ranks 0,2)"
  bool planned() const { return options_.planned; }
  const std::string& backend() const { return options_.backend; }  ///< "gloo" or "nccl"

  /// In place; every rank ends with the reduction of everyone's tensor.
  Work all_reduce(Tensor& t, ReduceOp op = ReduceOp::Sum, bool async = false) const;
  /// In place; every rank ends with the tensor of group rank `root`.
  Work broadcast(Tensor& t, int root = 0, bool async = false) const;
  /// Everyone's tensor, in group-rank order, into `out` (resized to size() tensors like t).
  Work all_gather(const Tensor& t, std::vector<Tensor>& out, bool async = false) const;
  std::vector<Tensor> all_gather(const Tensor& t) const;
  /// Slice r of the reduction of everyone's `inputs` (a list of size() equal tensors) lands on
  /// rank r in `output`.
  Work reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs, ReduceOp op = ReduceOp::Sum,
                      bool async = false) const;
  /// Reduce-scatter over a flat tensor in place: `flat` (n,), n a multiple of size(), is read as
  /// size() contiguous parts; rank r's part r ends as the reduction of everyone's part r (the other
  /// parts are left as scratch). Returns that part, a view of `flat`. NCCL runs its native one;
  /// Gloo, which has none, a ring: size() - 1 steps, each sending one part to the next rank and
  /// combining the part received from the previous one, so every rank moves (size()-1)/size() of
  /// `flat` once.
  Tensor reduce_scatter_flat(Tensor& flat, ReduceOp op = ReduceOp::Sum) const;
  /// The same reduce-scatter, left in flight: this rank's part of `flat` holds the reduction once
  /// the work is waited for, and neither `flat` nor `inbox` may be touched before. NCCL runs its
  /// native one and takes no inbox (pass an undefined tensor; needs_inbox() is false); Gloo one
  /// all-to-all on its own threads (every rank's part r lands in `inbox`, of flat's size, dtype
  /// and device: the same bytes as the ring, in one round trip), combined into the part in
  /// group-rank order when the work is waited for. On two CPU ranks 13
  /// reduce-scatters of 1 MiB took 24 ms as rings (each one round trip a step, on the caller's
  /// thread between backward's buckets).
  Work start_reduce_scatter_flat(Tensor& flat, ReduceOp op, Tensor& inbox) const;
  bool needs_inbox() const { return options_.backend != "nccl"; }
  /// All-gather over a flat tensor in place: rank r's part r of `flat` (read as above) ends on
  /// every rank. NCCL: native; Gloo: a ring of size() - 1 steps of one part each.
  void all_gather_flat(Tensor& flat) const;
  /// The same gather started and left in flight: `mine` (every rank's part, of flat's length /
  /// size()) ends at part r of `flat` on every rank once the work completes. Both tensors must be
  /// contiguous and stay alive until then. Gloo and NCCL: one all-gather into the flat tensor.
  Work start_all_gather_flat(Tensor& flat, const Tensor& mine) const;
  /// Point to point, to or from group rank `dst`/`src`. Messages between two ranks with the same
  /// `tag` arrive in the order they were sent; different tags are separate channels (a pipeline's
  /// activations and gradients).
  /// With `described`, a small header (dtype and element count) travels beside the tensor, on a
  /// channel of its own, and the receive refuses a tensor of another dtype or size (point to
  /// point itself carries none: a smaller send partly fills the receive, another dtype is
  /// reinterpreted). What pt.dist's send and recv use; a pipeline sends its own headers.
  Work send(const Tensor& t, int dst, bool async = false, int tag = 0, bool described = false) const;
  Work recv(Tensor& t, int src, bool async = false, int tag = 0, bool described = false) const;
  /// A ring step (ring attention): sends `out` to group rank `dst` while receiving `in` from group
  /// rank `src`, on the channel `tag` as send and recv use it, always left in flight: the work
  /// covers both halves (wait() waits for the receive, then the send), and neither tensor may be
  /// touched before. dst and src are other ranks (or both 0 in a group of one, which copies `out`
  /// into `in`); they may be the same rank (a ring of two). Gloo posts the two as separate
  /// operations; NCCL batches them in one group (ncclGroupStart/End, as torch's batch_isend_irecv
  /// does), without which two ranks whose sends each wait for the other's receive deadlock. So on
  /// NCCL the peer's side should be a send_recv too: c10d may run batched point-to-point on
  /// another communicator than single sends and receives. `described` as for recv: a header beside
  /// each tensor, compared on the receiving side when the work is waited for. The ledger has a
  /// send and a recv entry; traffic() counts "send_recv" with out's bytes (what this rank sends).
  /// A planned group records it and leaves `in` as it is.
  Work send_recv(const Tensor& out, int dst, Tensor& in, int src, int tag = 0, bool described = false) const;
  /// DeepSpeed-Ulysses' exchange: `in` (n, ...), n a multiple of size(), is read as size() equal
  /// slices of dim 0; rank r's slice j lands in slice r of `out` on rank j. `out` must have in's
  /// shape, dtype and device and not share its memory; undefined, it is made so. A collective
  /// (c10d's all-to-all with equal splits, both backends), counted in traffic() as "all_to_all"
  /// with the input's bytes. A group of one copies `in` into `out`; a planned group records it.
  Work all_to_all_single(Tensor& out, const Tensor& in, bool async = false) const;
  /// The same with rows of unequal counts (an expert's tokens): `in_splits[j]` rows of `in`, in
  /// rank order, go to rank j, and `out_splits[j]` rows arrive from rank j, in rank order
  /// (every rank's in_splits[me] must be this rank's out_splits[j]: all_to_all_rows exchanges
  /// them first). `out` is made with sum(out_splits) rows when undefined. A rank may send or
  /// receive no rows and still takes part. Checked by --check-collectives on dtype and trailing
  /// shape (the row counts differ by design); counted as "all_to_all" with the input's bytes.
  Work all_to_all_single(Tensor& out, const Tensor& in, const std::vector<int64_t>& out_splits,
                         const std::vector<int64_t>& in_splits, bool async = false) const;
  /// Rows to every rank, their counts exchanged first (an equal all-to-all of one count a rank):
  /// returns the rows that arrived, rank after rank, and their counts in `out_splits` when given.
  Tensor all_to_all_rows(const Tensor& in, const std::vector<int64_t>& in_splits,
                         std::vector<int64_t>* out_splits = nullptr) const;
  Work barrier(bool async = false) const;
  /// Runs `wait` recorded in the ledger as a barrier at the current call site, though no
  /// collective runs: how rank 0's wait for the others at the end of the run shows in a hang
  /// summary. An exception from `wait` marks the entry timed out and passes on.
  void recorded_wait(const std::function<void()>& wait) const;

  /// What this group's collectives moved since creation (or reset_traffic): calls and bytes by
  /// operation. Bytes count the whole message: an all-reduce's tensor, an all-gather's gathered
  /// output, a reduce-scatter's input. Groups of one rank move nothing.
  struct Traffic {
    int64_t calls = 0, bytes = 0;
  };
  std::map<std::string, Traffic> traffic() const;
  void reset_traffic() const;

  /// The group's name in the rendezvous store: unique in the world and the same on every member.
  const std::string& key() const { return store_prefix_; }
  /// The c10d operations this group has started (the --check-collectives all-gathers included)
  /// since it was made or renewed. Members that agree on it are at the same point of the
  /// group's sequence of collectives.
  int64_t started() const { return started_; }
  /// Replaces the group's c10d backend with a fresh one (a new rendezvous under a new store
  /// prefix). Every member must call it, in the order the groups were made. After an interrupted
  /// collective (Ctrl-C in the REPL) members can be at different points of the old backend's
  /// sequence; the fresh one starts them level. The old backend is kept alive, never destroyed:
  /// an abandoned collective may still be pending in it until its timeout.
  void renew();
  /// How many times renew() has replaced the backend: what an abandoned exchange left queued in
  /// an earlier one cannot reach the current one.
  int renewals() const { return renewals_; }

 private:
  // An all-reduce recorded under `op` (reduce_scatter on Gloo is one).
  Work reduce(Tensor& t, ReduceOp op, bool async, const char* name) const;
  void record(const char* op, int64_t bytes) const;
  // `t` as Gloo can move it unchanged (bfloat16 viewed as float16: the same bytes).
  Tensor bytes_for_gloo(const Tensor& t) const;
  // Point to point over Gloo hands the transport the tensor's address as host memory: a CUDA
  // tensor goes through a host copy. What to send (`t` itself, or its copy on the host), and
  // where to receive `t` (itself, or a host buffer copied into `t` by host_received).
  bool stages_on_host(const Tensor& t) const { return options_.backend != "nccl" && t.is_cuda(); }
  Tensor host_to_send(const Tensor& t) const { return stages_on_host(t) ? t.cpu() : t; }
  Tensor host_to_receive(const Tensor& t) const {
    return stages_on_host(t) ? torch::empty(t.sizes(), t.options().device(torch::kCPU)) : t;
  }
  bool recorded_only() const { return !impl_ && options_.planned && size() > 1; }  // a planned group's collective
  mutable std::mutex traffic_mutex_;
  mutable std::map<std::string, Traffic> traffic_;
  explicit ProcessGroup(GroupOptions options, int rank);
  Work start(const std::string& op, c10::intrusive_ptr<c10d::Work> work, std::function<void()> after = {},
             int64_t ticket = -1) const;
  // Launches a c10d collective, naming `op` if launching fails, and waits unless `async`.
  // `ticket`: its ledger entry.
  Work run(const std::string& op, const std::function<c10::intrusive_ptr<c10d::Work>()>& launch, bool async,
           std::function<void()> after = {}, int64_t ticket = -1) const;
  [[noreturn]] void fail(const std::string& op, const std::string& why) const;
  void check(const Tensor& t, const std::string& op) const;
  // Refuses a peer `peer` that is not another group rank (0 in a group of one), as `what`
  // ("destination", "source") of `op`.
  void check_peer(int peer, const char* what, const std::string& op) const;
  // check(), and that `flat` is 1-D of a length size() divides; returns that of a part.
  int64_t flat_part(const Tensor& flat, const std::string& op) const;
  // Records the call about to run in the ledger (`lop`, `reduce` = 1 + ReduceOp or 0, and for
  // send/recv the peer's group rank and the tag) and returns its ticket (-1 in a group of one),
  // notes it for the terminate handler's message and, with check_collectives(), all-gathers (call
  // number, op, dtype, shape, call site) and fails on a mismatch naming each rank's call.
  // Point-to-point calls (collective = false) are only recorded and noted.
  int64_t verify(int op_code, const std::string& op, const Tensor& t, ledger::Op lop, bool collective = true,
                 int64_t root = 0, int reduce = 0, int peer = -1, int tag = 0) const;
  // The ledger's state for a call (see Work).
  void ledger_set(int64_t ticket, ledger::State state) const {
    if (book_) book_->set(ticket, state);
  }
  std::unique_ptr<ledger::Book> book_;  // null for a group of one or a planned group
  mutable int64_t sequence_ = 0;
  mutable std::atomic<int64_t> started_{0};
  c10::intrusive_ptr<c10d::Store> store_;  // kept for renew()
  std::string store_prefix_;
  int renewals_ = 0;

  GroupOptions options_;
  int rank_;
  struct Impl;
  std::unique_ptr<Impl> impl_;  // null for a group of one
  friend class Work;
};

using GroupPtr = std::shared_ptr<ProcessGroup>;

/// Everyone's bytes, in group-rank order (an all-gather of the lengths, then of the padded
/// bytes). A null group or a group of one returns {mine}.
std::vector<std::string> all_gather_strings(const GroupPtr& group, const std::string& mine);
/// Whether `mine` is true on any rank of the group (an all-reduce of one flag), so that every
/// rank can act alike: all of them fail when one does. A null group or a group of one: `mine`.
bool any_rank(const GroupPtr& group, bool mine);

}  // namespace partrain::dist
