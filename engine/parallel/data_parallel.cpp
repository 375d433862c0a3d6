// Data parallelism with bucketed, overlapped gradient all-reduce (see data_parallel.hpp).
#include "engine/parallel/data_parallel.hpp"

#include <algorithm>
#include <cmath>
#include <utility>
#include "engine/util/autograd.hpp"


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
      fresh = first.dtype != p.dtype || first.device != p.device || first.whole != p.whole || first.chunk != p.chunk ||
              first.unit != p.unit || first.expert != p.expert;
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

void DataParallelOptions::validate() const {
  const auto& options = *this;
  TORCH_CHECK(options.bucket_cap_mb > 0 && std::isfinite(options.bucket_cap_mb),
              "bucket_cap_mb must be a finite number > 0, got ", options.bucket_cap_mb);
  TORCH_CHECK(options.grad_accumulation >= 1, "grad_accumulation must be >= 1, got ", options.grad_accumulation);
  TORCH_CHECK(options.reduce != dist::ReduceOp::Product, "reduce 'product' makes no sense for gradients");
  TORCH_CHECK(options.zero.stage >= 0 && options.zero.stage <= 3, "ZeRO stage ", options.zero.stage,
              " is not supported: stages 0, 1, 2, 3");
  TORCH_CHECK(options.zero.stage < 2 || options.reduce == dist::ReduceOp::Mean ||
                  options.reduce == dist::ReduceOp::Sum,
              "ZeRO-", options.zero.stage, " reduce-scatters gradients: reduce must be 'mean' or 'sum', got '",
              to_string(options.reduce), "'");
  TORCH_CHECK(options.experts.params.empty() || options.experts.group, "data parallelism: expert parameters need "
              "their group");
  TORCH_CHECK(options.experts.params.empty() || options.zero.stage == 0 || (options.experts.zero && !options.zero.across),
              "ZeRO with expert parallelism needs the experts' zero group, and zero groups of every data rank");
}

DataParallel::DataParallel(dist::GroupPtr group, const DataParallelOptions& options)
    : group_(std::move(group)), options_(options) {
  TORCH_CHECK(group_, "data parallelism needs a data group");
  options.validate();
}

std::shared_ptr<DataParallel> DataParallel::attach(nn::Module& model, dist::GroupPtr group,
                                                   const DataParallelOptions& options) {
  std::shared_ptr<DataParallel> dp(new DataParallel(std::move(group), options));
  auto& g = *dp->group_;
  auto holds = [](const std::vector<torch::Tensor>& list, const torch::Tensor& p) {
    return std::any_of(list.begin(), list.end(), [&](const auto& t) { return t.is_same(p); });
  };
  {
    // Every rank starts from data rank 0's weights (smp's broadcast_buffers); an expert rank from
    // the first of the ranks holding its experts.
    torch::NoGradGuard no_grad;
    if (options.broadcast_parameters)
      for (auto& p : model.parameters()) {
        auto data = p.data();
        (holds(options.experts.params, p) ? *options.experts.group : g).broadcast(data, 0);
      }
    if (options.broadcast_buffers)
      for (auto& b : model.buffers()) g.broadcast(b, 0);
  }
  // A tied tensor (GPT-2's wte = lm_head) once: one slot in the buffers, one gradient hook. Two
  // slots would reduce it twice and, under ZeRO, step two masters of it that need not agree.
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const auto& p = item.value();
    if (p.requires_grad() && dp->index_of_.emplace(p.unsafeGetTensorImpl(), dp->params_.size()).second)
      dp->params_.push_back(p);
  }
  TORCH_CHECK(!dp->params_.empty(), "data parallelism: the model has no trainable parameters");
  std::vector<BucketParam> sizes;
  for (const auto& p : dp->params_) {
    int chunk = 0, unit = 0;
    for (size_t c = 0; c < options.pipeline.chunks.size(); ++c)
      if (holds(options.pipeline.chunks[c], p)) chunk = static_cast<int>(c);
    for (size_t u = 0; u < options.zero.units.size(); ++u)
      if (holds(options.zero.units[u], p)) unit = static_cast<int>(u) + 1;
    sizes.push_back({p.numel() * static_cast<int64_t>(p.element_size()), p.scalar_type(), p.device(),
                     holds(options.pipeline.whole, p), chunk, unit, holds(options.experts.params, p)});
  }
  // Bytes a bucket; a cap past 2^62 bytes is one bucket of everything (and stays an int64).
  const auto cap = static_cast<int64_t>(std::min(options.bucket_cap_mb * 1024 * 1024, 0x1p62));
  dp->bucket_of_.resize(dp->params_.size());
  dp->slot_of_.resize(dp->params_.size());
  for (const auto& members : bucket_layout(sizes, cap)) {
    auto& b = dp->buckets_.emplace_back();
    b.whole = sizes[members.front()].whole;
    b.chunk = sizes[members.front()].chunk;
    b.unit = sizes[members.front()].unit;
    b.expert = sizes[members.front()].expert;
    for (size_t k : members) {
      dp->bucket_of_[k] = dp->buckets_.size() - 1;
      dp->slot_of_[k] = b.params.size();
      b.offsets.push_back(b.params.empty() ? 0 : b.offsets.back() + dp->params_[b.params.back()].numel());
      b.params.push_back(k);
    }
  }
  // One flat buffer per (dtype, device), the buckets laid end to end in it, each padded to a
  // multiple of its zero group's size so that it splits into equal parts.
  std::vector<std::pair<torch::ScalarType, torch::Device>> keys;
  std::vector<int64_t> lengths, shard_lengths;  // per flat buffer: its length, and its shard's
  for (auto& b : dp->buckets_) {
    const int64_t parts = dp->parts(b);
    const auto& last = dp->params_[b.params.back()];
    b.numel = b.offsets.back() + last.numel();
    b.padded = (b.numel + parts - 1) / parts * parts;
    std::pair<torch::ScalarType, torch::Device> key{dp->reduce_dtype_for(last.scalar_type()), last.device()};
    auto it = std::find(keys.begin(), keys.end(), key);
    b.buffer = static_cast<size_t>(it - keys.begin());
    if (it == keys.end()) {
      keys.push_back(key);
      lengths.push_back(0);
      shard_lengths.push_back(0);
    }
    b.start = lengths[b.buffer];
    b.shard_start = shard_lengths[b.buffer];  // every bucket before it gave its part (experts': of their group)
    lengths[b.buffer] += b.padded;
    shard_lengths[b.buffer] += b.padded / parts;
  }
  for (const auto& [dtype, device] : keys)
    dp->buffer_options_.push_back(torch::TensorOptions().dtype(dtype).device(device));
  // Reduce-scattering: pooled scratch (ZeRO-2) or inboxes (ZeRO-1) of the longest bucket a
  // buffer, none until the first backward takes some.
  dp->scratch_length_.assign(keys.size(), 0);
  dp->pool_.resize(keys.size());
  dp->free_.resize(keys.size());
  if (dp->scatters())
    for (const auto& b : dp->buckets_)
      if (!b.whole) dp->scratch_length_[b.buffer] = std::max(dp->scratch_length_[b.buffer], b.padded);
  if (dp->sharded()) {
    // ZeRO-2: the shards (1/n of each buffer) and the tied buckets whole.
    for (size_t i = 0; i < keys.size(); ++i)
      dp->shards_.push_back(torch::zeros({shard_lengths[i]}, dp->buffer_options_[i]));
    for (auto& b : dp->buckets_)
      if (b.whole) b.flat = torch::zeros({b.padded}, dp->buffer_options_[b.buffer]);
  } else {
    for (size_t i = 0; i < keys.size(); ++i) dp->buffers_.push_back(torch::zeros({lengths[i]}, dp->buffer_options_[i]));
    for (auto& b : dp->buckets_) b.flat = dp->buffers_[b.buffer].narrow(0, b.start, b.padded);
  }
  for (auto& b : dp->buckets_)
    dp->stats_.bytes += b.padded * static_cast<int64_t>(c10::elementSize(keys[b.buffer].first));
  dp->filled_.assign(dp->params_.size(), 0);
  dp->used_.assign(dp->params_.size(), 0);
  dp->unused_.assign(dp->params_.size(), 1);  // no gradient yet
  // Expert parameters count as used too: each rank's experts differ, so their counts summed over
  // the data group say nothing (and the grouped compute gives every expert a gradient, zero or not).
  for (const auto& p : dp->params_)
    dp->tied_.push_back(holds(options.pipeline.tied, p) || holds(options.experts.params, p));
  // The hooks hold the object weakly: a model dropped by its user does not stay synced.
  std::weak_ptr<DataParallel> weak = dp;
  for (size_t k = 0; k < dp->params_.size(); ++k)
    dp->accumulators_.push_back(util::on_grad_accumulated(dp->params_[k], [weak, k] {
      if (auto self = weak.lock()) self->on_grad_ready(k);
    }));
  return dp;
}

void DataParallel::begin_pass() {
  check_accumulation();
  TORCH_CHECK(!pending_finish_, "data parallelism: a backward pass began before the last one's gradient reduction "
              "finished; with bucket hooks written in Lua that runs on the script's thread: call "
              "pt.data_parallel(model):synced() between backward passes (model:train_step does)");
  drop_in_flight();
  in_backward_ = true;
  ++passes_;
  syncing_ = sync_enabled_ && passes_ % options_.grad_accumulation == 0;
  // The buckets this pass reduces: all of them on a sync; under ZeRO-2 every pass reduces those
  // of its chunk into the shard (nothing stays behind in .grad), and the tied buckets, whose
  // gradients do accumulate in .grad, on a sync only.
  pass_.clear();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    auto& b = buckets_[i];
    b.in_pass = sharded() && !b.whole ? chunk_ < 0 || b.chunk == chunk_ : syncing_;
    if (!b.in_pass) continue;
    b.pending = static_cast<int>(b.params.size());
    b.ready = false;
    for (size_t k : b.params) filled_[k] = 0;
    pass_.push_back(i);
  }
  next_launch_ = 0;
  launched_any_ = false;
  std::weak_ptr<DataParallel> weak = shared_from_this();
  util::at_end_of_backward([weak] {
    if (auto self = weak.lock()) self->end_pass();
  });
}

void DataParallel::on_grad_ready(size_t index) {
  if (!in_backward_) begin_pass();  // the first gradient of a backward pass
  auto& b = buckets_[bucket_of_[index]];
  // A bucket this pass does not reduce keeps accumulating in .grad (a parameter outside the
  // pass's chunk is taken in by its own chunk's next pass).
  if (!b.in_pass || b.ready || filled_[index]) return;
  fill(b, slot_of_[index]);
  if (--b.pending == 0) {
    b.ready = true;
    if (bucket_done_) bucket_done_(bucket_of_[index]);
    if (!thread_bound()) launch_ready();  // thread-bound hooks: launched at the end, on their thread
  }
}

void DataParallel::fill(Bucket& b, size_t slot) {
  const size_t k = b.params[slot];
  if (!b.flat.defined()) take_scratch(b);
  auto& p = params_[k];
  auto slice = b.flat.narrow(0, b.offsets[slot], p.numel());
  const auto& grad = p.grad();
  if (grad.defined()) used_[k] = 1;
  if (!grad.defined()) slice.zero_();  // no gradient this pass counts as zeros (every rank sends every bucket)
  else if (grad.data_ptr() != slice.data_ptr()) slice.copy_(grad.reshape({-1}));  // not already in place
  // Reduce-scattered (ZeRO-2, ZeRO-1's default): the gradient is in the bucket now; autograd's
  // tensor goes.
  if (scatters() && !b.whole && grad.defined()) p.mutable_grad() = torch::Tensor();
  filled_[k] = 1;
}

int DataParallel::take_pooled(size_t buffer) {
  auto& spare = free_[buffer];
  if (spare.empty()) {
    pool_[buffer].push_back(torch::empty({scratch_length_[buffer]}, buffer_options_[buffer]));
    spare.push_back(static_cast<int>(pool_[buffer].size()) - 1);
  }
  const int taken = spare.back();
  spare.pop_back();
  return taken;
}

void DataParallel::take_scratch(Bucket& b) {
  b.scratch = take_pooled(b.buffer);
  b.flat = pool_[b.buffer][b.scratch].narrow(0, 0, b.padded);
  b.flat.narrow(0, b.numel, b.padded - b.numel).zero_();  // the padding sums to zeros
}

void DataParallel::give_back_scratch(Bucket& b) {
  free_[b.buffer].push_back(b.scratch);
  b.scratch = -1;
  b.flat = torch::Tensor();
}

bool DataParallel::in_flight_scatters() const {
  return scatters() && (!sharded() || options_.zero.overlap_comm);
}

torch::Tensor DataParallel::take_inbox(Bucket& b) {
  // At most kInboxes of this buffer out: the oldest completes (in launch order, the same on
  // every rank) and gives its inbox back.
  auto out = [&] {
    return std::count_if(inboxes_out_.begin(), inboxes_out_.end(),
                         [&](size_t i) { return buckets_[i].buffer == b.buffer; });
  };
  while (static_cast<size_t>(out()) >= kInboxes) {
    auto oldest = std::find_if(inboxes_out_.begin(), inboxes_out_.end(),
                               [&](size_t i) { return buckets_[i].buffer == b.buffer; });
    await_bucket(*oldest);
  }
  if (!zero_group(b)->needs_inbox()) return {};  // NCCL's own reduce-scatter takes none
  b.inbox = take_pooled(b.buffer);
  return pool_[b.buffer][b.inbox].narrow(0, 0, b.padded);
}

void DataParallel::await_bucket(size_t i) {
  auto& b = buckets_[i];
  b.work.wait();
  auto it = std::find(inboxes_out_.begin(), inboxes_out_.end(), i);
  if (it == inboxes_out_.end()) return;
  inboxes_out_.erase(it);
  if (b.inbox >= 0) free_[b.buffer].push_back(b.inbox);
  b.inbox = -1;
  reduce_across(i);
}

void DataParallel::reduce_across(size_t i) {
  // This rank's part of the bucket, reduced over the zero group: then over the other zero groups
  // (hierarchical ZeRO); ZeRO-2 adds it into the shard and gives the scratch back.
  auto& b = buckets_[i];
  const int64_t n = b.padded / parts(b);
  auto part = b.flat.narrow(0, part_rank(b) * n, n);
  if (options_.zero.across) options_.zero.across->all_reduce(part, wire_op());
  if (sharded()) {
    shard_of(i).add_(part);
    give_back_scratch(b);
  }
}

dist::ReduceOp DataParallel::wire_op() const {
  // A mean is divided before the reduction (by ranks x accumulated passes), then summed.
  return options_.reduce == dist::ReduceOp::Mean ? dist::ReduceOp::Sum : options_.reduce;
}

void DataParallel::drop_in_flight() {
  // A pass that failed part way (a hook that raised, a wait interrupted or timed out) leaves its
  // reduce-scatters in flight, settled by nobody: nothing of theirs may reach this pass. Their
  // results are not combined, and their pooled tensors are replaced, not reused (the collective
  // may still be writing into them; its work holds them until it ends).
  auto fresh = [&](size_t buffer, int index) {
    pool_[buffer][index] = torch::empty({scratch_length_[buffer]}, buffer_options_[buffer]);
    free_[buffer].push_back(index);
  };
  for (size_t i : inboxes_out_) {
    auto& b = buckets_[i];
    b.work = dist::Work();
    if (b.inbox >= 0) fresh(b.buffer, b.inbox);
    b.inbox = -1;
    if (sharded() && b.scratch >= 0) {
      fresh(b.buffer, b.scratch);
      b.scratch = -1;
      b.flat = torch::Tensor();
    }
  }
  inboxes_out_.clear();
}

void DataParallel::await_inboxes() {
  while (!inboxes_out_.empty()) await_bucket(inboxes_out_.front());
}

torch::Tensor DataParallel::shard_of(size_t i) const {
  const auto& b = buckets_[i];
  TORCH_CHECK(sharded(), "data parallelism: bucket ", i, " has no shard without ZeRO-2");
  return shards_[b.buffer].narrow(0, b.shard_start, b.padded / parts(b));
}

torch::ScalarType DataParallel::reduce_dtype_for(torch::ScalarType param_dtype) const {
  // Under ZeRO gradients are reduced in float32 by default (float64 ones stay float64).
  auto fallback = options_.zero.stage > 0 && param_dtype != torch::kFloat64 ? torch::kFloat32 : param_dtype;
  return options_.reduce_dtype.value_or(fallback);
}

torch::Tensor DataParallel::bucket_grad(const torch::Tensor& param) const {
  const auto it = index_of_.find(param.unsafeGetTensorImpl());
  if (it == index_of_.end()) return {};
  const size_t k = it->second;
  const auto& b = buckets_[bucket_of_[k]];
  if ((scatters() && !b.whole) || !b.flat.defined()) return {};
  return b.flat.narrow(0, b.offsets[slot_of_[k]], param.numel()).view(param.sizes());
}

torch::Tensor DataParallel::reduced_part(size_t i) const {
  const auto& b = buckets_[i];
  if (sharded() && !b.whole) return shard_of(i);
  const int64_t part = b.padded / parts(b);
  return b.flat.narrow(0, part_rank(b) * part, part);
}

std::vector<torch::Tensor> DataParallel::held() const {
  std::vector<torch::Tensor> out(buffers_.begin(), buffers_.end());
  out.insert(out.end(), shards_.begin(), shards_.end());
  for (const auto& b : buckets_)
    if (sharded() && b.whole) out.push_back(b.flat);
  for (const auto& pool : pool_) out.insert(out.end(), pool.begin(), pool.end());
  return out;
}

int64_t DataParallel::held_bytes() const {
  int64_t bytes = 0;
  for (const auto& t : held()) bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

int64_t DataParallel::scratch_bytes() const {
  int64_t bytes = 0;
  for (const auto& pool : pool_)
    for (const auto& t : pool) bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

int64_t DataParallel::planned_scratch_bytes() const {
  // Per flat buffer, tensors of its longest bucket: under ZeRO-2 the bucket filling; with
  // reduce-scatters in flight up to kInboxes buckets (no more than the buffer has) each holding
  // an inbox, and under ZeRO-2 their scratch.
  int64_t bytes = 0;
  for (size_t i = 0; i < scratch_length_.size(); ++i) {
    const int64_t buckets = std::count_if(buckets_.begin(), buckets_.end(),
                                          [&](const Bucket& b) { return b.buffer == i && !b.whole; });
    const int64_t in_flight = in_flight_scatters() ? std::min<int64_t>(kInboxes, buckets) : 0;
    const int64_t inboxes = options_.zero.group && options_.zero.group->needs_inbox() ? in_flight : 0;
    const int64_t tensors = sharded() ? std::min<int64_t>(1 + in_flight, buckets) + inboxes : inboxes;
    bytes += tensors * scratch_length_[i] *
             static_cast<int64_t>(c10::elementSize(c10::typeMetaToScalarType(buffer_options_[i].dtype())));
  }
  return bytes;
}

void DataParallel::check_accumulation() const {
  TORCH_CHECK(!parts_hold_sync_, "data parallelism: a backward pass after a synced one, with no zero_grad between "
              "them: ZeRO-1 keeps only this rank's part of the reduced gradients, in the gradient buckets, and this "
              "pass's reduce-scatter would replace them where serial training adds to them. Call opt:zero_grad() "
              "after opt:step(); to accumulate over several batches use train_step's accumulate, parallelize's "
              "grad_accumulation, or zero = { stage = 1, reduce_scatter = false }");
}

void DataParallel::zero_grad() {
  parts_hold_sync_ = false;
  // A hand-written loop's sync left its counts' all-reduce in flight: done with here (every rank
  // zeroes), so that a step after zero_grad does not settle the gradients zeroed.
  take_pending_counts();
  unsettled_ = false;
  // No parameter has a gradient until a pass gives it one: a step before the next sync skips
  // every parameter, as serial training does with no gradients.
  std::fill(used_.begin(), used_.end(), 0);
  unused_.assign(params_.size(), 1);
  for (auto& p : params_) p.mutable_grad() = torch::Tensor();
  torch::NoGradGuard no_grad;
  for (auto& s : shards_) s.zero_();
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
    end_pass_here();
  }
}

// Launches the pass's ready buckets strictly in bucket order, so every rank issues the same
// collectives in the same order even if gradients arrive in a different one.
void DataParallel::launch_ready() {
  while (next_launch_ < pass_.size() && buckets_[pass_[next_launch_]].ready) {
    const size_t i = pass_[next_launch_++];
    auto& b = buckets_[i];
    const int index = static_cast<int>(i);
    if (!launched_any_) {
      first_launch_ = Clock::now();
      launched_any_ = true;
    }
    // Mean: pre-divide by everyone who contributed (ranks x accumulated passes), then sum.
    if (options_.reduce == dist::ReduceOp::Mean)
      b.flat.div_(static_cast<double>(group_->size()) * options_.grad_accumulation);
    if (pre_hook_) pre_hook_(index, b.flat);
    const auto op = wire_op();
    if (in_flight_scatters() && !b.whole) {
      // ZeRO-1 (ZeRO-2 with overlap_comm): this rank's part of the bucket is reduced over the zero
      // group in flight (Gloo's threads run it beside backward, into a pooled inbox), then over
      // the other zero groups when settled. ZeRO-1 leaves it in the bucket's part r, where the
      // optimizer reads it; ZeRO-2 adds it into the shard and gives the scratch back.
      auto inbox = take_inbox(b);
      b.work = zero_group(b)->start_reduce_scatter_flat(b.flat, op, inbox);
      inboxes_out_.push_back(i);
    } else if (scatters() && !b.whole) {
      // ZeRO-2: reduced over the zero group here (a ring on Gloo: it completes before backward
      // goes on, so that the scratch is free for the next bucket), then finished at once.
      zero_group(b)->reduce_scatter_flat(b.flat, op);
      reduce_across(i);
      b.work = dist::Work();
    } else {
      b.work = (b.expert ? options_.experts.group : group_)->all_reduce(b.flat, op, /*async=*/true);
    }
  }
}

void DataParallel::end_pass() {
  in_backward_ = false;
  if (!syncing_ && pass_.empty()) return;
  if (thread_bound() && std::this_thread::get_id() != hook_thread_) {
    pending_finish_ = true;  // backward ran on another thread: complete() finishes on the hooks' thread
    return;
  }
  end_pass_here();
}

void DataParallel::end_pass_here() {
  // Gradients that did arrive were copied by their hooks; the parameters that got none this pass
  // count as zeros, and the rest of the pass's buckets launch.
  for (size_t i : pass_) {
    auto& b = buckets_[i];
    if (b.ready) continue;
    for (size_t s = 0; s < b.params.size(); ++s)
      if (!filled_[b.params[s]]) fill(b, s);
    b.ready = true;
    if (bucket_done_) bucket_done_(i);
  }
  launch_ready();
  pass_.clear();
  if (!syncing_) {  // ZeRO-2's passes before the sync's: reduced into the shard, no more
    await_inboxes();
    return;
  }
  syncing_ = false;

  parts_hold_sync_ = scatters() && !sharded() &&
                     std::any_of(buckets_.begin(), buckets_.end(), [](const Bucket& b) { return !b.whole; });
  auto backward_end = Clock::now();
  for (auto& b : buckets_)
    if (b.work.done()) ++stats_.buckets_done_early;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    auto& b = buckets_[i];
    await_bucket(i);
    if (!post_hook_) continue;
    // Only this rank's part of a reduce-scattered bucket holds reduced gradients: the hook gets
    // that part (a view of the shard under ZeRO-2, of the bucket under ZeRO-1).
    auto reduced = !scatters() || b.whole ? b.flat : reduced_part(i);
    post_hook_(static_cast<int>(i), reduced);
  }
  auto done = Clock::now();
  stats_.syncs += 1;
  stats_.last_sync_seconds = launched_any_ ? std::chrono::duration<double>(done - first_launch_).count() : 0;
  stats_.last_exposed_seconds = std::chrono::duration<double>(done - backward_end).count();
  stats_.sync_seconds += stats_.last_sync_seconds;
  stats_.exposed_seconds += stats_.last_exposed_seconds;
  // Which parameters got a gradient here since the last sync: settle_unused() finds, with the
  // other data ranks' counts, those that got none anywhere. With reduce-scattered buckets the
  // counts go on until zero_grad (ZeRO's optimizer's comes here): a gradient an earlier pass left
  // in the shard (two train_steps an opt:step()) has no .grad for the next pass's fill to see.
  // Elsewhere a .grad kept from an earlier pass is seen by the fill, and counts.
  synced_used_ = used_;
  if (!scatters()) std::fill(used_.begin(), used_.end(), 0);
  unsettled_ = true;
  // Each .grad becomes a view of its bucket: no copy back, and no new gradient memory a step
  // (DDP's gradient_as_bucket_view). The next sync overwrites the bucket, so a .grad kept across
  // steps changes with it. A reduce-scattered bucket's parameters have no .grad
  // (sync_shard_grad gathers them).
  for (size_t k = 0; k < params_.size(); ++k) {
    auto& b = buckets_[bucket_of_[k]];
    if (scatters() && !b.whole) continue;
    auto slice = b.flat.narrow(0, b.offsets[slot_of_[k]], params_[k].numel()).view(params_[k].sizes());
    if (slice.scalar_type() == params_[k].scalar_type()) params_[k].mutable_grad() = slice;
    else if (params_[k].grad().defined()) params_[k].mutable_grad().copy_(slice);  // a reduce dtype of its own
    else params_[k].mutable_grad() = slice.to(params_[k].scalar_type());
  }
  passes_ = 0;
  if (group_->size() == 1) {
    settle_unused(used_counts());  // this rank's counts are the group's
  } else if (!counts_elsewhere_) {
    // A hand-written loop's sync: the counts' all-reduce runs behind it while the script goes on
    // to opt:step(), which settles them (train_step carries them on its loss's all-reduce).
    counts_ = used_counts().to(buffer_options_.front().device());
    counts_work_ = group_->all_reduce(counts_, dist::ReduceOp::Sum, /*async=*/true);
  }
}

torch::Tensor DataParallel::used_counts() const {
  return torch::tensor(std::vector<double>(synced_used_.begin(), synced_used_.end()), torch::kFloat64);
}

void DataParallel::settle_unused(const torch::Tensor& counts) {
  if (!unsettled_) return;
  unsettled_ = false;
  if (counts.is_meta() || group_->planned()) {  // partrain plan: nothing to read; every parameter steps
    unused_.assign(params_.size(), 0);
    return;
  }
  auto summed = counts.to(torch::kCPU, torch::kFloat64).contiguous();
  TORCH_CHECK(summed.numel() == static_cast<int64_t>(params_.size()), "data parallelism: ", summed.numel(),
              " gradient counts for ", params_.size(), " parameters");
  const double* n = summed.data_ptr<double>();
  unused_.assign(params_.size(), 0);
  for (size_t k = 0; k < params_.size(); ++k) {
    // A parameter tied across pipeline stages counts as used: each stage sees only its own
    // holder's use before the tie's gradients are summed over the pipeline, and the stages must
    // step their copies alike (the sum, zeros where no stage used it).
    if (n[k] != 0 || tied_[k]) continue;
    unused_[k] = 1;  // ZeRO's optimizer leaves this parameter's shard pieces without a gradient
    params_[k].mutable_grad() = torch::Tensor();
  }
}

torch::Tensor DataParallel::take_pending_counts() {
  if (!counts_.defined()) return torch::Tensor();
  counts_work_.wait();
  return std::exchange(counts_, torch::Tensor());
}

void DataParallel::settle_unused() {
  if (auto pending = take_pending_counts(); pending.defined()) settle_unused(pending);
  if (!unsettled_) return;
  auto counts = used_counts();
  if (group_->size() > 1) {
    counts = counts.to(buffer_options_.front().device());
    group_->all_reduce(counts, dist::ReduceOp::Sum);
  }
  settle_unused(counts);
}

void DataParallel::gather_shards() {
  if (!scatters()) return;
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    auto& b = buckets_[i];
    if (b.whole) continue;  // whole already: .grad views it
    const int64_t r = part_rank(b), part = b.padded / parts(b);
    if (sharded()) {  // ZeRO-2: the shard into scratch; ZeRO-1's bucket holds its part r already
      take_scratch(b);
      b.flat.narrow(0, r * part, part).copy_(shard_of(i));
    }
    zero_group(b)->all_gather_flat(b.flat);
    for (size_t s = 0; s < b.params.size(); ++s) {
      auto& p = params_[b.params[s]];
      auto slice = b.flat.narrow(0, b.offsets[s], p.numel()).view(p.sizes());
      p.mutable_grad() = slice.to(p.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
    }
    if (sharded()) give_back_scratch(b);
  }
}

}  // namespace partrain::parallel
