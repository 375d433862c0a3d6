// Data parallelism: every rank of the data group holds the whole (or its tensor-parallel part of
// the) model and a slice of the batch; gradients are averaged (or summed, ...) across the group.
// Gradients are packed into buckets in reverse parameter order; each bucket's all-reduce starts
// the moment its last gradient is accumulated, so communication overlaps the rest of backward.
// The buckets are views of one flat gradient buffer per (dtype, device), each padded to a multiple
// of the zero group's size: under ZeRO a rank's shard of a bucket is its part r of the bucket, and
// with ZeRO-2 a bucket is reduce-scattered over the zero group instead of all-reduced.
//
// Why not c10d's Reducer: its constructor and hooks differ between LibTorch 1.13 and 2.x, its
// comm hooks are C++-only (partrain's bucket hooks are Lua functions), and ZeRO needs a
// reduce-scatter path per bucket that it does not have.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "engine/dist/process_group.hpp"
#include "engine/nn/module.hpp"

namespace partrain::parallel {

struct DataParallelOptions {
  double bucket_cap_mb = 25.0;                  ///< bytes of gradient a bucket holds (MiB)
  dist::ReduceOp reduce = dist::ReduceOp::Mean; ///< how ranks' gradients combine (Cube's reducer_op)
  int grad_accumulation = 1;                    ///< backward passes a sync: sync on every k-th only
  bool broadcast_buffers = true;                ///< copy buffers from data rank 0 at start, with parameters
  /// ZeRO: 0 or 1 reduce whole buckets over the data group (1 shards the optimizer state only);
  /// 2 reduce-scatters each bucket over `zero_group` (then all-reduces the shard over
  /// `zero_across` when the zero group is smaller than the data group).
  int zero_stage = 0;
  dist::GroupPtr zero_group;   ///< the ranks splitting each bucket; null: none (one part)
  dist::GroupPtr zero_across;  ///< hierarchical ZeRO's other zero groups' peers; null: none
  /// The gradient buffer's dtype; undefined: each parameter's own.
  c10::optional<torch::ScalarType> reduce_dtype;
  /// Parameters whose buckets are all-reduced whole over the data group even under ZeRO-2: those
  /// tied across pipeline stages, whose gradients are summed over the pipeline after the sync.
  std::vector<torch::Tensor> whole;
};

/// What the bucket layout needs to know of a parameter.
struct BucketParam {
  int64_t bytes = 0;
  torch::ScalarType dtype = torch::kFloat32;
  torch::Device device = torch::kCPU;
  bool whole = false;  ///< reduced whole even under ZeRO-2 (kept in buckets of its own)
};
/// The buckets for `params` (in parameter order): lists of parameter indices, in reverse parameter
/// order (roughly the order backward produces gradients), a bucket closed once it holds at least
/// `cap_bytes` and wherever dtype, device or `whole` changes. Every parameter is in exactly one bucket.
std::vector<std::vector<size_t>> bucket_layout(const std::vector<BucketParam>& params, int64_t cap_bytes);

/// A bucket: some parameters' gradients laid end to end in one flat tensor.
struct Bucket {
  std::vector<size_t> params;    ///< indices into DataParallel::params(), in the order laid out
  std::vector<int64_t> offsets;  ///< where each starts in `flat`
  torch::Tensor flat;            ///< (padded,) the bucket's gradients: a view of its flat buffer
  int64_t numel = 0;             ///< the gradients' length, before padding to the zero group
  size_t buffer = 0;             ///< which flat buffer (DataParallel::buffers())
  int64_t start = 0;             ///< where `flat` starts in it
  bool whole = false;            ///< all-reduced whole under ZeRO-2 too (DataParallelOptions::whole)
  int pending = 0;               ///< gradients still to arrive this pass
  bool ready = false;
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
  /// Whether the next backward passes sync (true) or only accumulate into .grad (false; train_step
  /// turns it off for all but the last micro-batch, as DDP's no_sync).
  void set_sync(bool on) { sync_enabled_ = on; }
  int passes_since_sync() const { return passes_; }
  const DataParallelOptions& options() const { return options_; }
  const dist::GroupPtr& group() const { return group_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  /// The flat gradient buffers, one per (dtype, device): every bucket is a view of one.
  const std::vector<torch::Tensor>& buffers() const { return buffers_; }
  /// Where parameter k's gradient sits: (buffer, offset in it).
  std::pair<size_t, int64_t> flat_slot(size_t k) const {
    const auto& b = buckets_[bucket_of_[k]];
    return {b.buffer, b.start + b.offsets[slot_of_[k]]};
  }
  /// The zero group's size (1 without ZeRO): how many parts each bucket splits into.
  int zero_size() const { return options_.zero_group ? options_.zero_group->size() : 1; }
  /// ZeRO-2: gathers every bucket's reduced shards over the zero group, so that each .grad is the
  /// whole reduced gradient (Cube's sync_shard_grad). Does nothing otherwise.
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
  void on_grad_ready(size_t index);
  void launch_ready();
  void finish();
  void finish_here();
  bool thread_bound() const { return pre_bound_ || post_bound_; }

  dist::GroupPtr group_;
  DataParallelOptions options_;
  std::vector<torch::Tensor> params_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keep the hooks installed
  std::vector<size_t> bucket_of_, slot_of_;  // parameter -> bucket, position in it
  std::vector<Bucket> buckets_;
  std::vector<torch::Tensor> buffers_;
  size_t next_launch_ = 0;
  bool in_backward_ = false, syncing_ = false;
  int passes_ = 0;
  std::chrono::steady_clock::time_point first_launch_;
  bool launched_any_ = false;
  Hook pre_hook_, post_hook_;
  bool pre_bound_ = false, post_bound_ = false, pending_finish_ = false, sync_enabled_ = true;
  std::thread::id hook_thread_;
  DataParallelStats stats_;
};

}  // namespace partrain::parallel
