// ZeRO-3, fully sharded data parallelism: each rank of a zero group keeps 1/z of every parameter,
// and a unit's parameters exist whole only while the unit computes (FSDP2's fully_shard,
// DeepSpeed's stage 3).
//
// A unit is a module (a transformer block) whose parameters are gathered together; the root unit
// holds every parameter no unit module holds (GPT-2's embeddings, final norm and tied head). Each
// of data parallelism's buckets belongs to one unit (bucket_layout closes buckets at unit
// boundaries; under stage 3 a unit is one bucket of each dtype), and a bucket's parameters are
// views of one flat buffer laid out as the bucket's gradients are. This rank keeps part r of that
// buffer (the shard); the buffer's storage is allocated and all-gathered over the zero group when
// the unit is needed, and freed after: the parameter tensors stay the same objects (autograd's
// accumulators, data parallelism's hooks, the optimizer's records see no change) while their
// storage comes and goes, as FSDP1 frees its flat parameter's storage.
//
// The life of a unit in a step (reshard_after_forward on):
//   forward   its module's forward gathers it (waiting for a prefetch started earlier), starts
//             the gather of the next `prefetch` units, runs, and frees it again; a hook on its
//             output is left for backward;
//   backward  the hook gathers it again before its gradients are computed and prefetches the
//             units before it; when every gradient of the unit has reached its bucket (which
//             reduce-scatters them into the gradient shard, as ZeRO-2 does) the unit is freed.
// The root unit is gathered when the model's forward begins and freed when its gradients are
// done. With reshard_after_forward off a unit stays gathered from its forward to its backward
// (more memory, one gather fewer). Under a pipeline every unit of the stage is gathered once a
// step and freed at its end unless reshard_after_forward asks for a gather every micro-batch.
// Under activation checkpointing the replayed forward gathers the unit and keeps it for the
// backward that follows.
//
// Parameters are read outside the model's forward only through an Access (checkpoints): a unit
// at a time, written back into the shard when the access changes them. The optimizer steps the
// shards (zero.cpp: the float32 master is the shard itself for float32 parameters) and frees
// every gathered unit, whose values are then stale.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/parallel/data_parallel.hpp"

namespace partrain::parallel {

struct FsdpOptions {
  /// Frees a unit after its forward and gathers it again for backward (FSDP2's name); off: keeps
  /// it gathered from forward to backward.
  bool reshard_after_forward = true;
  /// How many units ahead a gather is started while one computes (forward: the next ones;
  /// backward: the ones before). 0: each unit is gathered when it is reached.
  int prefetch = 1;
};

/// The modules at `paths` (dotted, in the order forward runs them) as ZeRO-3's units, and their
/// trainable parameters each (a tied tensor in the first unit holding it). Refuses a path that
/// names no module, a unit inside another and a parameter two units hold, naming them.
std::vector<std::vector<torch::Tensor>> unit_params(nn::Module& root, const std::vector<std::string>& paths);

/// The default units of `root`: the children of the container `blocks` (a policy's pipeline
/// blocks: GPT-2's "h", LLaMA's "layers"), or, when blocks is empty, every direct child of the
/// root that holds trainable parameters.
std::vector<std::string> default_units(nn::Module& root, const std::string& blocks);

/// Releases `t`'s storage (its shape stays; its values are gone until it is allocated again).
void release_storage(const torch::Tensor& t);

/// What ZeRO-3 holds on this rank, in bytes.
struct FsdpBytes {
  int64_t shards = 0;        ///< the parameter shards (1/z of every sharded parameter, padded)
  int64_t whole = 0;         ///< parameters kept whole (ties across pipeline stages)
  int64_t gathered = 0;      ///< units gathered now
  int64_t peak_gathered = 0; ///< the most gathered at once since attach (or reset_peak)
  int64_t largest_unit = 0;  ///< the largest unit's gathered bytes (the root's included)
  int64_t root_unit = 0;     ///< the root unit's gathered bytes
  int64_t gathers = 0;       ///< gathers started since attach
  int64_t pooled = 0;        ///< freed gather buffers kept for the next gathers (CPU)
};

class Fsdp : public std::enable_shared_from_this<Fsdp> {
 public:
  /// Shards `dp`'s buckets (built with zero.units and stage 3) over its zero group: the modules at
  /// `paths` become units, their forwards wrapped; the root's forward gathers the root unit.
  /// Every parameter's values are kept (part r of each bucket in the shard), then freed.
  /// `initial` (if given) makes a parameter's values where it holds none (a deferred model,
  /// materialize_deferred): a unit's are made when its shard is taken, one unit at a time.
  static std::shared_ptr<Fsdp> attach(nn::Module& root, std::shared_ptr<DataParallel> dp,
                                      const std::vector<std::string>& paths, const FsdpOptions& options,
                                      const std::function<torch::Tensor(const torch::Tensor&)>& initial = nullptr);

  const FsdpOptions& options() const { return options_; }
  /// Units: 0 is the root unit, then the unit modules in forward order.
  size_t units() const { return units_.size(); }
  const std::string& unit_name(size_t u) const { return units_[u].name; }
  /// The unit bucket `i` belongs to; -1 for a bucket kept whole.
  int unit_of_bucket(size_t i) const { return stores_[i].unit; }
  bool gathered(size_t u) const { return units_[u].state != State::Sharded; }

  /// Starts unit u's gather (nothing when it is gathered or on its way).
  void gather(size_t u);
  /// Waits until unit u is gathered, starting its gather first if none was.
  void wait(size_t u);
  /// Frees unit u's gathered storage (after its gather completes, if one is in flight).
  void reshard(size_t u);
  void reshard_all();
  /// Gathers every unit (in order) and waits.
  void gather_all();

  /// Part r of bucket i, in the parameters' dtype: what this rank keeps of them.
  torch::Tensor shard_of(size_t i) const { return stores_[i].shard; }
  /// One shard buffer per flat gradient buffer (DataParallel::buffer_options()), its buckets' parts
  /// end to end at Bucket::shard_start, when its buckets' parameters are of the buffer's dtype
  /// (undefined otherwise: each bucket then has a shard of its own). The optimizer steps it as
  /// its master when the dtypes agree.
  torch::Tensor shard_buffer(size_t buffer) const {
    return buffer < shard_buffers_.size() ? shard_buffers_[buffer] : torch::Tensor();
  }

  /// A pipeline's step: every unit stays gathered until release (unless reshard_after_forward was
  /// asked for explicitly), then all are freed.
  void hold(bool on);
  bool holding() const { return hold_; }
  /// hold(true) for a step's span (nothing for a null Fsdp), hold(false) on leaving it.
  class StepHold {
   public:
    explicit StepHold(Fsdp* fsdp) : fsdp_(fsdp) {
      if (fsdp_) fsdp_->hold(true);
    }
    ~StepHold() {
      try {
        if (fsdp_) fsdp_->hold(false);
      } catch (...) {
        // a gather that failed raised where it was waited for
      }
    }
    StepHold(const StepHold&) = delete;
    StepHold& operator=(const StepHold&) = delete;

   private:
    Fsdp* fsdp_;
  };

  /// Reads and writes of parameters outside the forward (checkpoints): touch(p) before each use
  /// gathers p's unit (freeing the unit touched before); with `writeback`, a unit's part r is
  /// copied back into the shard before it is freed, so what was written into the parameters
  /// stays. Every rank of the zero group must touch the same units in the same order. The units
  /// gathered when it began are gathered again at its end (from the shards, as written): a
  /// forward's root unit, which its backward reads without gathering it.
  class Access {
   public:
    Access(std::shared_ptr<Fsdp> fsdp, bool writeback);
    ~Access();
    void touch(const torch::Tensor& param);
    Access(const Access&) = delete;
    Access& operator=(const Access&) = delete;

   private:
    void finish();
    std::shared_ptr<Fsdp> fsdp_;
    bool writeback_;
    int current_ = -1;
    std::vector<size_t> restore_;  // the units gathered when it began
  };

  /// Every unit gathered for the scope's span (a whole-model read or write: a state dict),
  /// written back into the shards at its end with `writeback`, then freed, but for the units
  /// gathered when it began, gathered again from the shards. Null: nothing.
  class Gathered {
   public:
    Gathered(std::shared_ptr<Fsdp> fsdp, bool writeback);
    ~Gathered();
    Gathered(const Gathered&) = delete;
    Gathered& operator=(const Gathered&) = delete;

   private:
    std::shared_ptr<Fsdp> fsdp_;
    bool writeback_;
    std::vector<size_t> restore_;
  };

  /// Copies unit u's gathered part r into its shard (the values written into its parameters).
  void write_back(size_t u);
  /// The units gathered (or on their way) now, in order.
  std::vector<size_t> gathered_units() const;
  /// Gathers the units `us` (as gathered_units gave them) and waits.
  void regather(const std::vector<size_t>& us);

  FsdpBytes bytes() const;
  void reset_peak() { peak_ = gathered_bytes_; }

  // Called by the hooks: the unit's forward begins/ends, its backward begins, and data
  // parallelism says a bucket's gradients are all in (then a unit may be freed).
  void before_forward(size_t u);
  torch::Tensor after_forward(size_t u, torch::Tensor out);
  void before_backward(size_t u);
  void bucket_done(size_t i);

 private:
  enum class State { Sharded, Gathering, Gathered };
  // A traced gather's completion, noted by the thread that completes its last collective.
  struct Completion {
    std::atomic<int> left{0};
    std::atomic<int64_t> end_ns{0};  // steady clock, since its epoch
  };
  struct Unit {
    std::string name;
    std::vector<size_t> buckets;  // its buckets (sharded ones)
    State state = State::Sharded;
    std::vector<dist::Work> works;
    std::chrono::steady_clock::time_point started;  // a traced gather's start
    std::shared_ptr<Completion> completion;         // ... and its end (null: not traced)
    size_t done = 0;  // buckets whose gradients are in, this pass
    int64_t bytes = 0;
  };
  struct Store {
    int unit = -1;
    torch::Tensor gathered;  // (padded,) the parameters' flat buffer; its storage comes and goes
    torch::Tensor shard;     // (padded / z,) part r
  };
  explicit Fsdp(std::shared_ptr<DataParallel> dp, const FsdpOptions& options);
  void prefetch(size_t u, int direction);
  void guard_inner_modules(nn::Module& root);                // refuse a unit's inner module run while it is freed
  void expect_gathered(size_t u, const std::string& path);  // ... the check itself
  void allocate(const torch::Tensor& gathered);  // a unit buffer's storage, from the pool if one is kept
  void release(const torch::Tensor& gathered);   // ... and back, or to the allocator

  std::shared_ptr<DataParallel> dp_;
  dist::GroupPtr zero_;
  FsdpOptions options_;
  std::vector<Unit> units_;
  std::vector<Store> stores_;  // by bucket
  std::vector<torch::Tensor> shard_buffers_;
  int64_t whole_bytes_ = 0, gathered_bytes_ = 0, peak_ = 0, gathers_ = 0, pooled_bytes_ = 0;
  std::unordered_map<size_t, std::vector<at::DataPtr>> pool_;  // CPU: freed buffers by bytes
  bool hold_ = false;
};

}  // namespace partrain::parallel
