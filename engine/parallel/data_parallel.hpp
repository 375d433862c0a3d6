// Data parallelism: every rank of the data group holds the whole (or its tensor-parallel part of
// the) model and a slice of the batch; gradients are averaged (or summed, ...) across the group.
// Gradients are packed into buckets in reverse parameter order; each bucket's all-reduce starts
// the moment its last gradient is accumulated, so communication overlaps the rest of backward.
// The buckets are laid out in one flat gradient buffer per (dtype, device), each padded to a
// multiple of the zero group's size: under ZeRO a rank's shard of a bucket is its part r of the
// bucket. Without ZeRO-2 the buffers are allocated whole and the buckets are views of them. Under
// ZeRO-2 they are not: a rank keeps one shard buffer per (dtype, device), its parts r of the
// buckets laid end to end, and a bucket's full length is scratch taken from a small pool when its
// first gradient of a backward pass arrives, reduce-scattered over the zero group when it is
// complete, added into the shard and given back; each parameter's .grad is released once copied.
//
// Why not c10d's Reducer: its comm hooks are C++-only (partrain's bucket hooks are Lua functions), and ZeRO needs a
// reduce-scatter path per bucket that it does not have.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/dist/process_group.hpp"
#include "engine/nn/module.hpp"

namespace partrain::parallel {

/// ZeRO's split of the buckets (zero_data_parallel sets it from ZeroOptions and the mesh). Stage
/// 0 all-reduces whole buckets over the data group; 1, 2 and 3 reduce-scatter each bucket over
/// `group` (then all-reduce the part over `across` when the zero group is smaller than the data
/// group), 1 into the bucket's own part r (or all-reduces it whole with reduce_scatter off), 2
/// and 3 into the shard buffer, the bucket being scratch. Stage 3 shards the parameters too
/// (fsdp.hpp): its buckets close at `units` boundaries.
struct ZeroSplit {
  int stage = 0;
  /// Stage 3: the parameters of each unit (a bucket never holds two units' parameters; those of
  /// no unit are the root unit's).
  std::vector<std::vector<torch::Tensor>> units;
  dist::GroupPtr group;   ///< the ranks splitting each bucket; null: none (one part)
  dist::GroupPtr across;  ///< hierarchical ZeRO's other zero groups' peers; null: none
  /// Stage 1: reduce-scatter each bucket over `group` into its own part r (the bucket stays
  /// whole-sized), not all-reduce it; its parameters' .grad go (gather_shards brings them back).
  bool reduce_scatter = true;
  /// Stage 2: each bucket's reduce-scatter is left in flight beside backward (stage 1's always
  /// are), holding its scratch and an inbox until it completes: more buckets of scratch, less
  /// waiting. DeepSpeed's overlap_comm.
  bool overlap_comm = false;
};

/// What a pipeline rank's parameters are to the buckets (the composer sets it from the Pipeline).
struct PipelineParts {
  /// Tied across pipeline stages, under any zero stage: each stage sees only its own holder's use
  /// before the tie's gradients are summed over the pipeline, so they count as used
  /// (settle_unused), and the stages step their copies alike.
  std::vector<torch::Tensor> tied;
  /// Reduced whole over the data group even under ZeRO-2: the ties across stages (summed over the
  /// pipeline after the sync) and the tensors two chunks of this rank share.
  std::vector<torch::Tensor> whole;
  /// This rank's parameters by chunk (empty: one chunk holds everything). Buckets never span two
  /// chunks, and under ZeRO-2 a backward pass reduces the buckets of its chunk only (next_pass).
  std::vector<std::vector<torch::Tensor>> chunks;
};

/// Expert parallelism's parameters: each rank holds some experts, the same ones as the ranks of
/// `group` (the mesh's expert_data). Their buckets are reduced over `group` alone, still divided by
/// the whole data group's size under a mean: each rank's expert gradients hold every data rank's
/// tokens already (the all-to-all brought them). They are broadcast over `group` alone.
struct ExpertParts {
  std::vector<torch::Tensor> params;
  dist::GroupPtr group;
  /// ZeRO-1: the ranks that split each expert bucket (expert_data: the zero group holds every
  /// data rank); null without ZeRO.
  dist::GroupPtr zero;
};

struct DataParallelOptions {
  double bucket_cap_mb = 25.0;                  ///< bytes of gradient a bucket holds (MiB)
  dist::ReduceOp reduce = dist::ReduceOp::Mean; ///< how ranks' gradients combine (Cube's reducer_op)
  int grad_accumulation = 1;                    ///< backward passes a sync: sync on every k-th only
  bool broadcast_buffers = true;                ///< copy buffers from data rank 0 at start, with parameters
  /// Copy parameters from data rank 0 at start; off where every rank made them alike and they
  /// hold no values yet (ZeRO-3's deferred initialization).
  bool broadcast_parameters = true;
  /// The gradient buffer's dtype; undefined: each parameter's own.
  c10::optional<torch::ScalarType> reduce_dtype;
  ZeroSplit zero;          ///< ZeRO's shards of the buckets
  PipelineParts pipeline;  ///< a pipeline rank's ties and chunks
  ExpertParts experts;     ///< expert parallelism's parameters and their group

  /// Throws naming the option whose value does not fit (bucket size, accumulation, the reduce op
  /// and what ZeRO-2 allows of it).
  void validate() const;
};

/// What the bucket layout needs to know of a parameter.
struct BucketParam {
  int64_t bytes = 0;
  torch::ScalarType dtype = torch::kFloat32;
  torch::Device device = torch::kCPU;
  bool whole = false;  ///< reduced whole even under ZeRO-2 (kept in buckets of its own)
  int chunk = 0;       ///< the pipeline chunk of this rank it belongs to
  int unit = 0;        ///< ZeRO-3's unit (0: the root unit)
  bool expert = false; ///< an expert-parallel parameter (reduced over ExpertParts::group)
};
/// The buckets for `params` (in parameter order): lists of parameter indices, in reverse parameter
/// order (roughly the order backward produces gradients), a bucket closed once it holds at least
/// `cap_bytes` and wherever dtype, device, `whole`, chunk, unit or `expert` changes. Every parameter is in exactly
/// one bucket.
std::vector<std::vector<size_t>> bucket_layout(const std::vector<BucketParam>& params, int64_t cap_bytes);

/// A bucket: some parameters' gradients laid end to end in one flat tensor.
struct Bucket {
  std::vector<size_t> params;    ///< indices into DataParallel::params(), in the order laid out
  std::vector<int64_t> offsets;  ///< where each starts in `flat`
  /// (padded,) the bucket's gradients: a view of its flat buffer. Under ZeRO-2 (sharded()) a view
  /// of pooled scratch while a backward pass fills and reduces it, undefined otherwise; a `whole`
  /// bucket's is a tensor of its own there.
  torch::Tensor flat;
  int64_t numel = 0;             ///< the gradients' length, before padding to the zero group
  int64_t padded = 0;            ///< its length padded to a multiple of the zero group's size
  size_t buffer = 0;             ///< which flat buffer (DataParallel::buffer_options())
  int64_t start = 0;             ///< where the bucket starts in its flat buffer's layout
  int64_t shard_start = 0;       ///< where this rank's part r of it starts in the shard buffer
  bool whole = false;            ///< all-reduced whole under ZeRO-2 too (DataParallelOptions::whole)
  int chunk = 0;                 ///< the pipeline chunk its parameters belong to
  int unit = 0;                  ///< ZeRO-3's unit its parameters belong to (0: the root unit)
  bool expert = false;           ///< holds expert-parallel parameters: reduced over their group
  int pending = 0;               ///< gradients still to arrive this pass
  bool ready = false;
  bool in_pass = false;          ///< reduced by the backward pass running now
  int scratch = -1;              ///< ZeRO-2: which pooled scratch tensor `flat` views (-1: none)
  int inbox = -1;                ///< which pooled tensor its reduce-scatter in flight receives into (-1: none)
  dist::Work work;
};

struct DataParallelStats {
  int64_t syncs = 0;               ///< backward passes that synced
  int64_t bytes = 0;               ///< gradient bytes all-reduced a sync
  double sync_seconds = 0;         ///< first bucket launched -> all done, summed over syncs
  double exposed_seconds = 0;      ///< end of backward -> all done: what backward did not hide
  int64_t buckets_done_early = 0;  ///< buckets already complete when backward ended
  double last_sync_seconds = 0;    ///< the latest sync alone
  double last_exposed_seconds = 0;
};

class DataParallel : public std::enable_shared_from_this<DataParallel> {
 public:
  /// Broadcasts `model`'s parameters (and buffers) from data rank 0 and installs the gradient
  /// hooks. The model keeps working exactly like the serial one.
  static std::shared_ptr<DataParallel> attach(nn::Module& model, dist::GroupPtr group,
                                              const DataParallelOptions& options);

  /// Called with (bucket index, flat gradients) before a bucket's all-reduce and after the sync
  /// has finished (Cube's register_reducer_pre_hook / post_hook). Either may change the tensor.
  /// Under ZeRO-2 a reduce-scattered bucket's post-hook gets this rank's part of it only.
  using Hook = std::function<void(int, torch::Tensor&)>;
  /// A `thread_bound` hook (one written in Lua) runs only on the thread that set it: while one is
  /// set, buckets are not launched from the gradient hooks (autograd may run them on its own
  /// threads, as on CUDA) but together at the end of backward when that runs on this thread, or
  /// else by complete() (train_step, an optimizer's check). C++ hooks run inline.
  void set_pre_hook(Hook hook, bool thread_bound = false);
  void set_post_hook(Hook hook, bool thread_bound = false);

  /// Whether every finished backward pass has been synced (an optimizer may step). Completes a
  /// sync deferred to this thread first (see set_pre_hook).
  bool synced() {
    complete();
    return passes_ == 0;
  }
  /// Runs the end of a sync that a backward on another thread left to the hooks' thread; does
  /// nothing when none is pending or when called on another thread.
  void complete();
  /// What the backward passes from now on are, as a step of several says (until the next call).
  struct Pass {
    /// Whether a pass ends with the sync (post-hooks, synced()); false: it only accumulates into
    /// .grad, as DDP's no_sync (train_step's micro-batches but the last). Under ZeRO-2 every pass
    /// reduces its buckets into the shard all the same (nothing is left in .grad to accumulate).
    bool syncs = true;
    /// The pipeline chunk of this rank it covers (-1: every chunk). Under ZeRO-2 a pass reduces
    /// that chunk's buckets only, the same on every rank of the zero group.
    int chunk = -1;
  };
  void next_pass(Pass pass) {
    sync_enabled_ = pass.syncs;
    chunk_ = pass.chunk;
  }
  /// A train_step's span on `dp` (null: nothing): on leaving, by return or exception, every
  /// pass syncs over every chunk again (next_pass({})). With `carries_counts` the step's sync
  /// leaves the used counts to the step's loss all-reduce (settle_unused(counts)) until then.
  class StepScope {
   public:
    explicit StepScope(DataParallel* dp, bool carries_counts = true) : dp_(dp), counts_(dp && carries_counts) {
      if (counts_) dp_->counts_elsewhere_ = true;
    }
    ~StepScope() {
      if (!dp_) return;
      dp_->next_pass({});
      if (counts_) dp_->counts_elsewhere_ = false;
    }
    StepScope(const StepScope&) = delete;
    StepScope& operator=(const StepScope&) = delete;

   private:
    DataParallel* dp_;
    bool counts_;
  };
  /// ZeRO-2 and 3 over more than one rank: gradients are kept as this rank's shard only.
  bool sharded() const { return options_.zero.stage >= 2 && zero_size() > 1; }
  /// Whether buckets (but those reduced whole) are reduce-scattered: ZeRO-2 and 3, and ZeRO-1
  /// with zero.reduce_scatter. Their parameters keep no .grad after the sync.
  bool scatters() const {
    return zero_size() > 1 && (options_.zero.stage >= 2 || (options_.zero.stage == 1 && options_.zero.reduce_scatter));
  }
  /// Called with a bucket's index once every gradient of it has arrived in a backward pass (or
  /// counted as zeros at its end): ZeRO-3 frees the unit's gathered parameters then.
  void set_bucket_done(std::function<void(size_t)> fn) { bucket_done_ = std::move(fn); }
  /// The position of `param` in params(), or -1.
  int64_t index_of(const torch::Tensor& param) const {
    auto it = index_of_.find(param.unsafeGetTensorImpl());
    return it == index_of_.end() ? -1 : static_cast<int64_t>(it->second);
  }
  /// The bucket parameter k (of params()) is in.
  size_t bucket_of(size_t k) const { return bucket_of_[k]; }
  /// Clears every parameter's .grad and, under ZeRO-2, zeroes the shards (what backward passes
  /// have added up since).
  void zero_grad();
  /// A parameter that got no gradient on any data rank since the last sync keeps no .grad, as
  /// serial training leaves it, so the optimizer skips it (counted as zeros in the buckets,
  /// AdamW's moments and decay had moved it). used_counts(): this rank's count a parameter
  /// (float64, 1 or 0) for the last sync (with reduce-scattered buckets, since zero_grad: a
  /// gradient waiting in the shard has no .grad to see); settle_unused(counts) takes their sum
  /// over the data group (train_step carries it on the loss's all-reduce) and drops the .grad of
  /// those at 0, once a sync; unused(k) then says so on every rank alike (ZeRO's optimizer skips
  /// them). A parameter tied across pipeline stages always counts as used. zero_grad makes every
  /// parameter unused until the next settled sync. settle_unused() all-reduces the counts itself
  /// (a hand-written loop's step).
  torch::Tensor used_counts() const;
  void settle_unused(const torch::Tensor& counts);
  void settle_unused();
  bool unsettled() const { return unsettled_; }
  /// Whether parameter k (of params()) got no gradient on any data rank in the sync last settled
  /// (or none since zero_grad, or no sync yet).
  bool unused(size_t k) const { return k < unused_.size() && unused_[k]; }
  int passes_since_sync() const { return passes_; }
  const DataParallelOptions& options() const { return options_; }
  const dist::GroupPtr& group() const { return group_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  /// The flat gradient buffers, one per (dtype, device): every bucket is a view of one. Empty
  /// under ZeRO-2, where no rank holds them whole (shards()).
  const std::vector<torch::Tensor>& buffers() const { return buffers_; }
  /// Each flat buffer's dtype and device (allocated or not).
  const std::vector<torch::TensorOptions>& buffer_options() const { return buffer_options_; }
  /// ZeRO-2: one shard buffer per flat buffer, this rank's parts of its buckets end to end
  /// (Bucket::shard_start); the reductions of backward passes add up in it. Empty otherwise.
  const std::vector<torch::Tensor>& shards() const { return shards_; }
  /// ZeRO-2: bucket `i`'s part in the shard buffer (a view).
  torch::Tensor shard_of(size_t i) const;
  /// This rank's part r of bucket `i` as the sync left it (a view): under ZeRO-2 of a bucket not
  /// reduced whole, its part in the shard buffer; else part r of the bucket itself (reduced
  /// there by the reduce-scatter or the all-reduce).
  torch::Tensor reduced_part(size_t i) const;
  /// Refuses a backward pass that would reduce again while the last sync's gradients live only
  /// in the buckets' parts (ZeRO-1 reduce-scattering, no zero_grad since): its reduce-scatter
  /// would overwrite them, where serial training adds the new gradients to the old.
  void check_accumulation() const;
  /// The slice of a whole-reduced bucket (not reduce-scattered) that holds `param`'s gradient,
  /// shaped as the parameter and in the bucket's dtype: where the optimizer reads it under ZeRO,
  /// and where .grad is only a copy when the bucket's dtype is not the parameter's. Undefined
  /// for a parameter this object does not sync or whose bucket is reduce-scattered.
  torch::Tensor bucket_grad(const torch::Tensor& param) const;
  /// The dtype the buckets reduce a gradient of `param_dtype` in: `reduce_dtype`, or float32
  /// under ZeRO (float64 stays float64), or the parameter's own.
  torch::ScalarType reduce_dtype_for(torch::ScalarType param_dtype) const;
  /// Every gradient tensor this object holds now: the flat buffers, or under ZeRO-2 the shards,
  /// the whole buckets and the scratch pool (its high-water mark: the pool never shrinks); under
  /// ZeRO-1 reduce-scattering the pool holds the reduce-scatters' inboxes.
  std::vector<torch::Tensor> held() const;
  /// Bytes of held(), and of the scratch pool alone.
  int64_t held_bytes() const;
  int64_t scratch_bytes() const;
  /// ZeRO-2: the scratch of one bucket, the longest, per flat buffer: the least a backward takes.
  /// Reduce-scatters in flight (ZeRO-1's; ZeRO-2's with overlap_comm): kInboxes inboxes more (on Gloo;
  /// NCCL takes none), and under ZeRO-2 the scratch of the kInboxes buckets in flight.
  int64_t planned_scratch_bytes() const;
  /// Where parameter k's gradient sits: (buffer, offset in it).
  std::pair<size_t, int64_t> flat_slot(size_t k) const {
    const auto& b = buckets_[bucket_of_[k]];
    return {b.buffer, b.start + b.offsets[slot_of_[k]]};
  }
  /// The zero group's size (1 without ZeRO): how many parts each bucket splits into.
  int zero_size() const { return options_.zero.group ? options_.zero.group->size() : 1; }
  /// The group bucket `b` splits over under ZeRO: the expert zero group for an expert bucket,
  /// else the zero group (null without ZeRO); its size and this rank's place in it.
  const dist::GroupPtr& zero_group(const Bucket& b) const {
    return b.expert && options_.experts.zero ? options_.experts.zero : options_.zero.group;
  }
  int parts(const Bucket& b) const { return zero_group(b) ? zero_group(b)->size() : 1; }
  int part_rank(const Bucket& b) const { return zero_group(b) ? zero_group(b)->rank() : 0; }
  /// When buckets are reduce-scattered (scatters(): ZeRO-2, ZeRO-1 unless zero.reduce_scatter is
  /// off): gathers every bucket's reduced parts over the zero group into newly allocated .grad
  /// tensors, so that each .grad is the whole reduced gradient (Cube's sync_shard_grad). Does
  /// nothing otherwise.
  void gather_shards();
  const std::vector<torch::Tensor>& params() const { return params_; }
  const DataParallelStats& stats() const { return stats_; }
  void reset_stats() {
    auto bytes = stats_.bytes;  // a property of the buckets, not a count
    stats_ = DataParallelStats();
    stats_.bytes = bytes;
  }

 private:
  DataParallel(dist::GroupPtr group, const DataParallelOptions& options);

  // A sync's phases, each named once:
  //   begin_pass     a backward pass starts (the first gradient hook of the pass): which buckets
  //                  it reduces (pass_), whether it is the sync's (syncing_);
  //   on_grad_ready  a parameter's gradient is ready: fill copies it into its bucket, and a
  //                  complete bucket launches (launch_ready) its all-reduce or reduce-scatter;
  //   end_pass       backward ended (its callback): end_pass_here on the hooks' thread, or left
  //                  pending for complete() when the hooks must run on another thread;
  //   end_pass_here  the buckets that got no gradient are filled with zeros and launched; on the
  //                  sync's pass every bucket is awaited (await_bucket, which finishes a
  //                  reduce-scattered part over the other zero groups: reduce_across) and the
  //                  post-hooks run; the used counts are left for settle_unused;
  //   settle_unused  the counts summed over the data group: parameters no rank used lose .grad.
  // ZeRO-2's reduce-scatters left in flight hold inboxes, awaited oldest first (await_inboxes)
  // or dropped after a pass that failed part way (drop_in_flight).
  void begin_pass();
  void on_grad_ready(size_t index);
  void fill(Bucket& b, size_t slot);  // parameter b.params[slot]'s gradient into the bucket
  void launch_ready();
  void end_pass();
  void end_pass_here();
  void await_bucket(size_t i);   // waits for bucket i's reduction and completes it
  void reduce_across(size_t i);  // bucket i's part, reduced over the zero group: the rest of its way
  void await_inboxes();          // every bucket's that holds an inbox, oldest first
  void drop_in_flight();         // ... or abandons them, after a pass that failed part way
  void take_scratch(Bucket& b);
  void give_back_scratch(Bucket& b);
  int take_pooled(size_t buffer);
  bool in_flight_scatters() const;  // buckets' reduce-scatters are left in flight
  torch::Tensor take_inbox(Bucket& b);
  dist::ReduceOp wire_op() const;  // the op the collectives run (a mean is divided before)
  bool thread_bound() const { return pre_bound_ || post_bound_; }

  dist::GroupPtr group_;
  DataParallelOptions options_;
  std::vector<torch::Tensor> params_;
  std::vector<char> used_;          // parameter -> it got a gradient on this rank since the last sync
  std::vector<char> synced_used_;   // ... as the last sync left it, until settled
  bool unsettled_ = false;          // a sync's counts not yet settled (settle_unused)
  // By parameter: no gradient on any data rank in the last settled sync, or none since zero_grad
  // (every one after it, and before the first sync).
  std::vector<char> unused_;
  std::vector<char> tied_;          // by parameter: tied across pipeline stages (always counts as used)
  bool counts_elsewhere_ = false;   // train_step carries the counts on its loss's all-reduce
  // The counts a hand-written loop's sync left in flight, waited for (undefined when none).
  torch::Tensor take_pending_counts();
  // A hand-written loop's counts, all-reduced behind the sync (undefined: none in flight).
  torch::Tensor counts_;
  dist::Work counts_work_;
  std::unordered_map<const c10::TensorImpl*, size_t> index_of_;  // parameter -> its position in params_
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keep the hooks installed
  std::vector<size_t> bucket_of_, slot_of_;  // parameter -> bucket, position in it
  std::vector<Bucket> buckets_;
  std::vector<torch::Tensor> buffers_;
  std::vector<torch::TensorOptions> buffer_options_;
  std::vector<torch::Tensor> shards_;             // ZeRO-2: one per flat buffer
  std::vector<int64_t> scratch_length_;           // reduce-scattering: the longest bucket, per flat buffer
  std::vector<std::vector<torch::Tensor>> pool_;  // ZeRO-2: scratch, ZeRO-1: inboxes, per flat buffer
  std::vector<std::vector<int>> free_;            // ... and those not in use
  std::vector<char> filled_;                      // parameter -> its gradient is in its bucket this pass
  std::vector<size_t> pass_;                      // the buckets this backward pass reduces, in order
  // The buckets whose reduce-scatter is in flight holding an inbox, oldest first. At most
  // kInboxes a buffer: the next waits for the oldest, so the inboxes stay two buckets.
  std::vector<size_t> inboxes_out_;
  static constexpr size_t kInboxes = 2;
  int chunk_ = -1;
  size_t next_launch_ = 0;  // into pass_
  bool in_backward_ = false, syncing_ = false;
  // ZeRO-1 reduce-scattering: a sync left the reduced gradients only in the buckets' parts, and
  // zero_grad has not run since (a second sync would overwrite them: check_accumulation).
  bool parts_hold_sync_ = false;
  int passes_ = 0;
  std::chrono::steady_clock::time_point first_launch_;
  bool launched_any_ = false;
  Hook pre_hook_, post_hook_;
  std::function<void(size_t)> bucket_done_;
  bool pre_bound_ = false, post_bound_ = false, pending_finish_ = false, sync_enabled_ = true;
  std::thread::id hook_thread_;
  DataParallelStats stats_;
};

}  // namespace partrain::parallel
