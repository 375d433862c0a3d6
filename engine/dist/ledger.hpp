// The collective ledger: each rank's record, per process group, of its last collective and
// point-to-point calls (sequence number, operation, element count, bytes, dtype, peer, the script
// line, and whether the call is running, waiting, done or failed), kept in a fixed block of memory
// that the launcher maps too, so that it can say where every rank is even when a rank is stuck in a
// collective, stopped (SIGSTOP) or dead. The launcher asks a rank for its Lua line by signalling
// a thread of the rank that does nothing else, so the question never interrupts the rank's own
// work (a sleep, a read, a poll in C code).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace partrain::dist::ledger {

constexpr uint32_t kMagic = 0x5244474c;  // "LGDR"
constexpr uint32_t kLayout = 2;          // bumped when the block's layout changes
constexpr int kGroups = 64;              // groups a rank records; later ones are not recorded
constexpr int kEntries = 64;             // calls kept per group, a ring
constexpr int kSite = 96;                // bytes of a call's "file:line"
constexpr int kName = 64;                // bytes of a group's name and of its key
constexpr int kRanks = 256;              // members listed per group (a larger group lists its first 256)
constexpr int kChannels = 16;            // point-to-point (peer, tag) channels counted per group
constexpr int32_t kRingTag = 0x7a00;     // the tag of the sends and receives inside ring collectives
constexpr const char* kEndOfRun = "(end of run)";  // the site of rank 0's wait for the others at the end

/// What a call is. Collectives are numbered in their group; sends and receives on their channel.
enum class Op : uint8_t { None, AllReduce, Broadcast, AllGather, ReduceScatter, Barrier, Send, Recv, AllToAll };
constexpr Op kLastOp = Op::AllToAll;  // what a reader accepts
/// Where a call is: launched (an async call nobody waits on yet), a thread blocked waiting on it,
/// done, failed, or given up at the group's timeout.
enum class State : uint8_t { Empty, Started, Waiting, Completed, Failed, TimedOut };

const char* op_name(Op op);        // "all_reduce", ..., "recv", "all_to_all"
const char* state_name(State s);   // "started", "waiting", "completed", "failed", "timed out"

// ---- The shared block (plain data: the launcher reads it from another process) ---------------

struct Entry {
  int64_t call;       ///< the group's entry number (its ring slot is call % kEntries); -1: empty
  int64_t seq;        ///< collectives: the call number in the group; send/recv: the k-th on its channel
  int64_t numel, bytes;
  int64_t started_ns, ended_ns;  ///< CLOCK_MONOTONIC; ended 0 while running
  int32_t peer;       ///< send/recv: the other rank (global); -1 for collectives
  int32_t tag;        ///< send/recv: the channel's tag
  uint8_t op, state;  ///< Op, State
  uint8_t reduce;     ///< all_reduce / reduce_scatter: 1 + the ReduceOp; 0: none
  int8_t dtype;       ///< c10::ScalarType, -1: none
  char site[kSite];   ///< the user's script line ("train.lua:42"), "" when unknown
};

/// Messages exchanged with one peer on one tag: how many sends and receives this rank started.
struct Channel {
  int32_t peer, tag;
  int64_t sent, received;
};

struct Group {
  std::atomic<uint32_t> version;  ///< seqlock over the rest: odd while being written
  int32_t size, rank, listed;     ///< members, this rank's index, members listed in `ranks`
  char name[kName];               ///< "world", "data[0,2]"
  char key[kName];                ///< unique in the world and the same on every member
  int32_t ranks[kRanks];
  int64_t collectives;            ///< collectives started
  int64_t calls;                  ///< entries written
  int32_t channels;               ///< channels in use
  Channel channel[kChannels];
  Entry entries[kEntries];
};

struct Region {
  uint32_t magic, layout;
  int32_t rank, pid;
  std::atomic<uint32_t> groups;        ///< slots taken
  std::atomic<uint32_t> line_ready;    ///< 1 once the rank answers SIGUSR1 with its Lua line
  /// The thread the launcher sends SIGUSR1 to (0: none, and the launcher does not ask): it only
  /// waits for signals, so the handler runs there and no system call of the rank's is cut short.
  std::atomic<int32_t> probe_tid;
  std::atomic<uint64_t> progress;      ///< bumped at every change: the launcher's sign of progress
  std::atomic<uint32_t> line_version;  ///< seqlock over line and line_ns
  std::atomic<uint64_t> line_answers;  ///< bumped when a new line is in
  int64_t line_ns;
  char line[kSite];
  Group group[kGroups];
};

// ---- In a rank ---------------------------------------------------------------------------------

/// Takes the block the launcher shares (a memfd, PARTRAIN_LEDGER_FD) and starts the probe thread
/// the launcher signals (Region::probe_tid). Without one, the first recorded call makes a private
/// block. Returns false, changing nothing, when `fd` cannot be mapped.
bool attach(int fd);
/// This process's block (made private on first use when none was attached).
Region* region();
/// Whether the block is the launcher's (it can then ask this rank for its Lua line).
bool shared();

/// Writes this thread's current script line (the provider's answer) into `site` (kSite bytes).
void fill_site(char* site);
/// A call site given in place of the script's while this object lives (the end-of-run barrier).
class SiteOverride {
 public:
  explicit SiteOverride(const char* site);
  ~SiteOverride();
 private:
  const char* previous_;
};

/// Records the rank's Lua line now (answering the launcher's SIGUSR1); safe from any thread, not
/// from a signal handler.
void set_line(const char* line);

/// One group's part of the ledger, owned by its ProcessGroup. Calls are recorded under a mutex
/// held only while an entry is written, never while a collective waits; no allocation per call.
class Book {
 public:
  Book(const std::string& name, const std::string& key, const std::vector<int>& ranks, int rank);
  /// Records a call starting; returns its ticket for set(), -1 when the group has no slot.
  /// `peer` (global rank) and `tag` for send/recv, -1 otherwise; `site` (kSite bytes) when the
  /// caller has it already, else it is asked for (fill_site).
  int64_t start(Op op, int reduce, int dtype, int64_t numel, int64_t bytes, int peer = -1, int tag = 0,
                const char* site = nullptr);
  /// Moves the call of `ticket` to `state` (ignored once the ring has reused its slot, or when the
  /// call is already completed, failed or timed out).
  void set(int64_t ticket, State state);
  /// The group's numbering starts again (ProcessGroup::renew).
  void restart();

 private:
  Group* g_ = nullptr;
  std::mutex mutex_;
};

// ---- In the launcher ---------------------------------------------------------------------------

/// A consistent copy of a rank's block, with every size bounded and every string terminated.
struct Call {
  Op op = Op::None;
  State state = State::Empty;
  int reduce = 0, dtype = -1, peer = -1, tag = 0;
  int64_t call = 0, seq = 0, numel = 0, bytes = 0, started_ns = 0, ended_ns = 0;
  std::string site;
  bool collective() const { return op != Op::Send && op != Op::Recv; }
  bool blocked() const { return state == State::Waiting || state == State::TimedOut; }
  /// "all_reduce(sum) of 4 float32 (16 B)", "send of 8 float32 (32 B) to rank 1 (tag 0)"
  std::string describe() const;
};
struct GroupCopy {
  std::string name, key;
  int size = 0, rank = 0;
  std::vector<int> ranks;  ///< the listed members (all when size <= kRanks)
  int64_t collectives = 0, calls = 0;
  std::vector<Channel> channels;
  std::vector<Call> calls_kept;  ///< oldest first
  std::string describe() const;  ///< "group 'world' (ranks 0,1)"
  const Channel* channel(int peer, int tag) const;
};
struct Copy {
  bool valid = false;
  int rank = -1, pid = 0;
  uint64_t progress = 0, line_answers = 0;
  bool line_ready = false;
  int64_t line_ns = 0;
  std::string line;
  std::vector<GroupCopy> groups;
};
/// Reads `r` (mapped from a rank that may be running, stopped or dead).
Copy read(const Region* r);

}  // namespace partrain::dist::ledger
