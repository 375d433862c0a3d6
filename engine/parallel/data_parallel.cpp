// Data parallelism with bucketed, overlapped gradient all-reduce (see data_parallel.hpp).
#include "engine/parallel/data_parallel.hpp"

#include <algorithm>

#include "engine/compat.hpp"

namespace partrain::parallel {

using Clock = std::chrono::steady_clock;

std::vector<std::vector<size_t>> bucket_layout(const std::vector<BucketParam>& params, int64_t cap_bytes) {
  std::vector<std::vector<size_t>> buckets;
  int64_t bytes = 0;
  for (size_t k = params.size(); k-- > 0;) {
    const auto& p = params[k];
    bool fresh = buckets.empty() || bytes >= cap_bytes;
    if (!fresh) {
      const auto& first = params[buckets.back().front()];
      fresh = first.dtype != p.dtype || first.device != p.device || first.whole != p.whole;
    }
    if (fresh) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().push_back(k);
    bytes += p.bytes;
  }
  return buckets;
}

DataParallel::DataParallel(dist::GroupPtr group, const DataParallelOptions& options)
    : group_(std::move(group)), options_(options) {
  TORCH_CHECK(group_, "data parallelism needs a data group");
  TORCH_CHECK(options.bucket_cap_mb > 0, "bucket_cap_mb must be positive, got ", options.bucket_cap_mb);
  TORCH_CHECK(options.grad_accumulation >= 1, "grad_accumulation must be >= 1, got ", options.grad_accumulation);
  TORCH_CHECK(options.reduce != dist::ReduceOp::Product, "reduce 'product' makes no sense for gradients");
  TORCH_CHECK(options.zero_stage >= 0 && options.zero_stage <= 2, "ZeRO stage ", options.zero_stage,
              " is not supported: stages 0, 1, 2");
  TORCH_CHECK(options.zero_stage != 2 || options.reduce == dist::ReduceOp::Mean ||
                  options.reduce == dist::ReduceOp::Sum,
              "ZeRO-2 reduce-scatters gradients: reduce must be 'mean' or 'sum', got '", to_string(options.reduce), "'");
}

std::shared_ptr<DataParallel> DataParallel::attach(nn::Module& model, dist::GroupPtr group,
                                                   const DataParallelOptions& options) {
  std::shared_ptr<DataParallel> dp(new DataParallel(std::move(group), options));
  auto& g = *dp->group_;
  {
    // Every rank starts from data rank 0's weights (smp's broadcast_buffers).
    torch::NoGradGuard no_grad;
    for (auto& p : model.parameters()) {
      auto data = p.data();
      g.broadcast(data, 0);
    }
    if (options.broadcast_buffers)
      for (auto& b : model.buffers()) g.broadcast(b, 0);
  }
  // A tied tensor (GPT-2's wte = lm_head) once: one slot in the buffers, one gradient hook. Two
  // slots would reduce it twice and, under ZeRO, step two masters of it that need not agree.
  for (auto& p : model.parameters())
    if (p.requires_grad() &&
        std::none_of(dp->params_.begin(), dp->params_.end(), [&](const torch::Tensor& q) { return q.is_same(p); }))
      dp->params_.push_back(p);
  TORCH_CHECK(!dp->params_.empty(), "data parallelism: the model has no trainable parameters");

  std::vector<BucketParam> sizes;
  for (const auto& p : dp->params_)
    sizes.push_back({p.numel() * static_cast<int64_t>(p.element_size()), p.scalar_type(), p.device(),
                     std::any_of(options.whole.begin(), options.whole.end(), [&](const auto& w) { return w.is_same(p); })});
  const auto cap = static_cast<int64_t>(options.bucket_cap_mb * 1024 * 1024);
  dp->bucket_of_.resize(dp->params_.size());
  dp->slot_of_.resize(dp->params_.size());
  for (const auto& members : bucket_layout(sizes, cap)) {
    auto& b = dp->buckets_.emplace_back();
    b.whole = sizes[members.front()].whole;
    for (size_t k : members) {
      dp->bucket_of_[k] = dp->buckets_.size() - 1;
      dp->slot_of_[k] = b.params.size();
      b.offsets.push_back(b.params.empty() ? 0 : b.offsets.back() + dp->params_[b.params.back()].numel());
      b.params.push_back(k);
    }
  }
  // One flat buffer per (dtype, device), the buckets laid end to end in it, each padded to a
  // multiple of the zero group's size so that it splits into equal parts.
  const int64_t parts = dp->zero_size();
  std::vector<std::pair<torch::ScalarType, torch::Device>> keys;
  std::vector<int64_t> lengths;
  for (auto& b : dp->buckets_) {
    const auto& last = dp->params_[b.params.back()];
    b.numel = b.offsets.back() + last.numel();
    // Under ZeRO gradients are reduced in float32 by default (float64 ones stay float64).
    auto own = last.scalar_type();
    auto fallback = options.zero_stage > 0 && own != torch::kFloat64 ? torch::kFloat32 : own;
    std::pair<torch::ScalarType, torch::Device> key{options.reduce_dtype.value_or(fallback), last.device()};
    auto it = std::find(keys.begin(), keys.end(), key);
    b.buffer = static_cast<size_t>(it - keys.begin());
    if (it == keys.end()) {
      keys.push_back(key);
      lengths.push_back(0);
    }
    b.start = lengths[b.buffer];
    lengths[b.buffer] += (b.numel + parts - 1) / parts * parts;
  }
  for (size_t i = 0; i < keys.size(); ++i)
    dp->buffers_.push_back(torch::zeros({lengths[i]}, torch::TensorOptions().dtype(keys[i].first).device(keys[i].second)));
  for (auto& b : dp->buckets_) {
    b.flat = dp->buffers_[b.buffer].narrow(0, b.start, (b.numel + parts - 1) / parts * parts);
    dp->stats_.bytes += b.flat.numel() * static_cast<int64_t>(b.flat.element_size());
  }
  // The hooks hold the object weakly: a model dropped by its user does not stay synced.
  std::weak_ptr<DataParallel> weak = dp;
  for (size_t k = 0; k < dp->params_.size(); ++k)
    dp->accumulators_.push_back(compat::on_grad_accumulated(dp->params_[k], [weak, k] {
      if (auto self = weak.lock()) self->on_grad_ready(k);
    }));
  return dp;
}

void DataParallel::on_grad_ready(size_t index) {
  if (!in_backward_) {  // the first gradient of a backward pass
    in_backward_ = true;
    ++passes_;
    syncing_ = sync_enabled_ && passes_ % options_.grad_accumulation == 0;
    if (syncing_) {
      for (auto& b : buckets_) {
        b.pending = static_cast<int>(b.params.size());
        b.ready = false;
      }
      next_launch_ = 0;
      launched_any_ = false;
    }
    std::weak_ptr<DataParallel> weak = shared_from_this();
    compat::at_end_of_backward([weak] {
      if (auto self = weak.lock()) self->finish();
    });
  }
  if (!syncing_) return;
  auto& b = buckets_[bucket_of_[index]];
  const auto& p = params_[index];
  auto slice = b.flat.narrow(0, b.offsets[slot_of_[index]], p.numel());
  const auto& grad = p.grad();
  if (!grad.defined()) slice.zero_();
  else if (grad.data_ptr() != slice.data_ptr()) slice.copy_(grad.reshape({-1}));  // not already in place
  if (--b.pending == 0) {
    b.ready = true;
    if (!thread_bound()) launch_ready();  // thread-bound hooks: launched at the end, on their thread
  }
}

void DataParallel::set_pre_hook(Hook hook, bool bound) {
  pre_hook_ = std::move(hook);
  pre_bound_ = pre_hook_ && bound;
  if (pre_bound_) hook_thread_ = std::this_thread::get_id();
}

void DataParallel::set_post_hook(Hook hook, bool bound) {
  post_hook_ = std::move(hook);
  post_bound_ = post_hook_ && bound;
  if (post_bound_) hook_thread_ = std::this_thread::get_id();
}

void DataParallel::complete() {
  if (pending_finish_ && std::this_thread::get_id() == hook_thread_) {
    pending_finish_ = false;
    finish_here();
  }
}

// Launches ready buckets strictly in bucket order, so every rank issues the same collectives in
// the same order even if gradients arrive in a different one.
void DataParallel::launch_ready() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready) {
    auto& b = buckets_[next_launch_];
    int index = static_cast<int>(next_launch_++);
    if (!launched_any_) {
      first_launch_ = Clock::now();
      launched_any_ = true;
    }
    // Mean: pre-divide by everyone who contributed (ranks x accumulated passes), then sum.
    if (options_.reduce == dist::ReduceOp::Mean)
      b.flat.div_(static_cast<double>(group_->size()) * options_.grad_accumulation);
    if (pre_hook_) pre_hook_(index, b.flat);
    auto op = options_.reduce == dist::ReduceOp::Mean ? dist::ReduceOp::Sum : options_.reduce;
    if (options_.zero_stage == 2 && zero_size() > 1 && !b.whole) {
      // ZeRO-2: this rank's part of the bucket is reduced over the zero group (a ring on Gloo,
      // run here: it completes before backward goes on), then over the other zero groups.
      auto shard = options_.zero_group->reduce_scatter_flat(b.flat, op);
      if (options_.zero_across) b.work = options_.zero_across->all_reduce(shard, op, /*async=*/true);
      else b.work = dist::Work();
    } else {
      b.work = group_->all_reduce(b.flat, op, /*async=*/true);
    }
  }
}

void DataParallel::finish() {
  in_backward_ = false;
  if (!syncing_) return;
  syncing_ = false;
  if (thread_bound() && std::this_thread::get_id() != hook_thread_) {
    pending_finish_ = true;  // backward ran on another thread: complete() finishes on the hooks' thread
    return;
  }
  finish_here();
}

void DataParallel::finish_here() {
  // Parameters that got no gradient this pass count as zeros (every rank must send every bucket).
  for (size_t k = 0; k < params_.size(); ++k) {
    auto& b = buckets_[bucket_of_[k]];
    if (b.ready) continue;
    if (!params_[k].grad().defined())
      b.flat.narrow(0, b.offsets[slot_of_[k]], params_[k].numel()).zero_();
  }
  for (auto& b : buckets_)
    if (!b.ready) {
      // Gradients that did arrive were copied by their hooks; fill the rest and launch.
      for (size_t s = 0; s < b.params.size(); ++s) {
        const auto& p = params_[b.params[s]];
        auto slice = b.flat.narrow(0, b.offsets[s], p.numel());
        if (p.grad().defined() && p.grad().data_ptr() != slice.data_ptr()) slice.copy_(p.grad().reshape({-1}));
      }
      b.ready = true;
    }
  launch_ready();
  auto backward_end = Clock::now();
  for (auto& b : buckets_)
    if (b.work.done()) ++stats_.buckets_done_early;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    auto& b = buckets_[i];
    b.work.wait();
    if (!post_hook_) continue;
    // Under ZeRO-2 only this rank's part of a reduce-scattered bucket holds reduced gradients:
    // the hook gets that part (a view; the rest of the bucket is scratch until gather_shards).
    if (options_.zero_stage == 2 && zero_size() > 1 && !b.whole) {
      const int64_t part = b.flat.numel() / zero_size();
      auto shard = b.flat.narrow(0, options_.zero_group->rank() * part, part);
      post_hook_(static_cast<int>(i), shard);
    } else {
      post_hook_(static_cast<int>(i), b.flat);
    }
  }
  auto done = Clock::now();
  stats_.syncs += 1;
  stats_.last_sync_seconds = std::chrono::duration<double>(done - first_launch_).count();
  stats_.last_exposed_seconds = std::chrono::duration<double>(done - backward_end).count();
  stats_.sync_seconds += stats_.last_sync_seconds;
  stats_.exposed_seconds += stats_.last_exposed_seconds;
  // Each .grad becomes a view of its bucket: no copy back, and no new gradient memory a step
  // (DDP's gradient_as_bucket_view). The next sync overwrites the bucket, so a .grad kept across
  // steps changes with it.
  for (size_t k = 0; k < params_.size(); ++k) {
    auto& b = buckets_[bucket_of_[k]];
    auto slice = b.flat.narrow(0, b.offsets[slot_of_[k]], params_[k].numel()).view(params_[k].sizes());
    if (slice.scalar_type() == params_[k].scalar_type()) params_[k].mutable_grad() = slice;
    else if (params_[k].grad().defined()) params_[k].mutable_grad().copy_(slice);  // a reduce dtype of its own
    else params_[k].mutable_grad() = slice.to(params_[k].scalar_type());
  }
  passes_ = 0;
}

void DataParallel::gather_shards() {
  if (options_.zero_stage != 2 || zero_size() == 1) return;
  for (auto& b : buckets_)
    if (!b.whole) options_.zero_group->all_gather_flat(b.flat);
  for (size_t k = 0; k < params_.size(); ++k) {  // gradients kept in a dtype of their own take theirs
    auto& b = buckets_[bucket_of_[k]];
    if (b.flat.scalar_type() != params_[k].scalar_type() && params_[k].grad().defined())
      params_[k].mutable_grad().copy_(b.flat.narrow(0, b.offsets[slot_of_[k]], params_[k].numel()).view(params_[k].sizes()));
  }
}

}  // namespace partrain::parallel
