// ZeRO's distributed optimizer over data parallelism's flat gradient buffers (see zero.hpp).
#include "engine/parallel/zero.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <unordered_map>

#include "engine/parallel/parallel_model.hpp"

namespace partrain::parallel {

int ZeroOptions::validate(const dist::Mesh& mesh) const {
  const int zsize = mesh.size("zero");
  TORCH_CHECK(stage >= 0 && stage <= 3, "zero stage=", stage, " is not supported: stages 0, 1, 2, 3");
  TORCH_CHECK(stage == 0 || zsize > 1, "zero = { stage = ", stage, " } needs zero groups of more than one rank, but "
              "the mesh has zero=", zsize, " (pt.mesh { zero = n }: n > 1 data ranks a group, or <= 0 for the whole "
              "data group)");
  TORCH_CHECK(stage > 0 || !overlap_sync_param, "zero: overlap_sync_param = true overlaps ZeRO's all-gather of the "
              "updated parameters, but the zero stage is 0 (no ZeRO)");
  if (overlap_comm) {
    TORCH_CHECK(stage > 0, "zero: overlap_comm overlaps ZeRO's reduce-scatters with backward, but the zero stage is 0 "
                "(no ZeRO)");
    TORCH_CHECK(stage >= 2 || *overlap_comm, "zero: overlap_comm = false is stage 2's and 3's choice: stage 1 "
                "always leaves its reductions in flight beside backward (its gradient buffer is whole anyway)");
  }
  TORCH_CHECK(stage == 3 || (!reshard_after_forward && prefetch == 1 && units.empty()),
              "zero: ", reshard_after_forward ? "reshard_after_forward" : !units.empty() ? "units" : "prefetch",
              " is stage 3's (parameters sharded and gathered a unit at a time), but the zero stage is ", stage);
  TORCH_CHECK(prefetch >= 0 && prefetch <= 64, "zero: prefetch must be a number of units from 0 to 64, got ", prefetch);
  TORCH_CHECK(stage != 3 || !overlap_sync_param, "zero: overlap_sync_param overlaps the all-gather after the step of "
              "stages 1 and 2; stage 3 gathers parameters before each unit's forward instead (prefetch overlaps them)");
  TORCH_CHECK(allgather_bucket_size > 0 && std::isfinite(allgather_bucket_size),
              "zero: allgather_bucket_size must be a finite number > 0 (MiB), got ", allgather_bucket_size);
  TORCH_CHECK(stage == 1 || reduce_scatter, "zero: reduce_scatter = false keeps gradients whole, which is ZeRO-1's "
              "choice; ", stage >= 2 ? "stages 2 and 3 always reduce-scatter them" : "the zero stage is 0 (no ZeRO)");
  TORCH_CHECK(stage == 0 || reduce_bucket_size >= 0, "zero: reduce_bucket_size must be > 0 (MiB), got ",
              reduce_bucket_size);
  return stage;
}

int zero_stage_of(const c10::optional<ZeroOptions>& zero, const dist::Mesh& mesh) {
  return zero ? zero->validate(mesh) : (mesh.size("zero") > 1 ? 1 : 0);
}

void zero_data_parallel(int stage, const c10::optional<ZeroOptions>& zero, const dist::Mesh& mesh,
                        const Pipeline* pipeline, DataParallelOptions& dp) {
  if (stage == 0) return;
  // A tensor tied across stages has its gradient summed over the pipeline after the sync, which
  // needs it whole: its buckets are all-reduced under ZeRO-2 too.
  if (pipeline) {
    dp.pipeline.whole = pipeline->tied_params();
    // ZeRO-2 reduces one chunk's buckets a backward pass: buckets never span two chunks, and a
    // tensor two of this rank's chunks hold gets gradients in both chunks' passes, so it
    // accumulates in .grad and is reduced whole on the sync like a tie across stages.
    dp.pipeline.chunks = pipeline->chunk_params();
    std::unordered_map<const c10::TensorImpl*, int> held;
    for (const auto& chunk : dp.pipeline.chunks) {
      std::unordered_map<const c10::TensorImpl*, bool> seen;
      for (const auto& p : chunk)
        if (!seen[p.unsafeGetTensorImpl()] && ++held[p.unsafeGetTensorImpl()] == 2) dp.pipeline.whole.push_back(p);
      for (const auto& p : chunk) seen[p.unsafeGetTensorImpl()] = true;
    }
  }
  dp.zero.stage = stage;
  dp.zero.reduce_scatter = !zero || zero->reduce_scatter;
  dp.zero.overlap_comm = stage >= 2 && zero && zero->overlap_comm.value_or(false);
  dp.zero.group = mesh.group("zero");
  dp.zero.across = mesh.zero_across();
  // Stage 3 gathers a unit's parameters as its buckets: one bucket a unit (and dtype), whatever
  // bucket_cap_mb says, unless reduce_bucket_size cuts it.
  if (stage == 3) dp.bucket_cap_mb = 0x1p42;
  if (zero && zero->reduce_bucket_size > 0) dp.bucket_cap_mb = zero->reduce_bucket_size;
}

namespace {

// Where one parameter's elements meet this rank's shard of a bucket.
struct Segment {
  size_t bucket;          // the bucket it lies in
  size_t param;           // index into DataParallel::params()
  int64_t param_offset;   // first element, in the flattened parameter
  size_t master;          // which master (one per flat buffer)
  int64_t master_offset;  // where it sits in that master
  int64_t length;
  size_t first_piece = 0, pieces = 0;  // its pieces in ZeroShards::pieces_, in order
};

// One all-gather of updated parameters after the step: buckets [first, last) of one buffer and
// parameter dtype, whose parts on this rank are master elements [begin, begin + length).
struct Gather {
  size_t first = 0, last = 0;
  int64_t begin = 0, length = 0;
  dist::GroupPtr group;  // the buckets' zero group (the experts' have their own)
};

class ZeroShards : public optim::Distributed {
 public:
  ZeroShards(const std::shared_ptr<ParallelModel>& model)
      : model_(model), dp_(model->data_parallel()), fsdp_(model->fsdp()) {
    const auto& o = dp_->options();
    zero_ = o.zero.group;
    stage_ = o.zero.stage;
    const auto& params = dp_->params();
    // One master per flat buffer: the buffer's buckets' parts r laid end to end, in float32 (or
    // float64 for float64 gradients): the layout of data parallelism's ZeRO-2 shards.
    std::vector<int64_t> length(dp_->buffer_options().size(), 0);
    for (const auto& b : dp_->buckets()) {
      const int64_t part = b.padded / dp_->parts(b), begin = dp_->part_rank(b) * part;
      bucket_master_.push_back(length[b.buffer]);
      for (size_t s = 0; s < b.params.size(); ++s) {
        const int64_t lo = std::max(b.offsets[s], begin);
        const int64_t hi = std::min(b.offsets[s] + params[b.params[s]].numel(), begin + part);
        if (lo < hi)
          segments_.push_back({static_cast<size_t>(&b - dp_->buckets().data()), b.params[s], lo - b.offsets[s], b.buffer,
                               length[b.buffer] + lo - begin, hi - lo});
      }
      length[b.buffer] += part;
    }
    for (size_t i = 0; i < length.size(); ++i) {
      const auto& buffer = dp_->buffer_options()[i];
      auto dtype = buffer.dtype() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
      auto options = torch::TensorOptions().dtype(dtype).device(buffer.device());
      // ZeRO-3: the parameters' shard is the master itself where its dtype is the master's.
      const bool is_shard = fsdp_ && fsdp_->shard_buffer(i).defined() && fsdp_->shard_buffer(i).scalar_type() == dtype;
      masters_.push_back(is_shard ? fsdp_->shard_buffer(i) : torch::zeros({length[i]}, options));
      master_is_shard_.push_back(is_shard);
      // What the optimizer steps: the master in pieces, each a leaf viewing its storage and
      // holding one parameter's elements (or padding), so that a parameter that got no gradient
      // is skipped with its own state and step count, as serial training skips it. On the CPU
      // a piece is at most 128 Ki elements: one AdamW step over a 1.6 M-element tensor took 25
      // ms against 2.1 ms for the same elements in such pieces (every temporary of the update
      // stays in cache).
      const int64_t most = buffer.device().is_cpu() ? kCpuPiece : std::numeric_limits<int64_t>::max();
      auto cut = [&](int64_t begin, int64_t end, size_t segment) {
        for (int64_t at = begin; at < end; at += std::min(most, end - at))
          pieces_.push_back({i, at, segment,
                             masters_[i].narrow(0, at, std::min(most, end - at)).detach().requires_grad_(true)});
      };
      int64_t covered = 0;  // segments lie in their master in order
      for (size_t k = 0; k < segments_.size(); ++k) {
        auto& g = segments_[k];
        if (g.master != i) continue;
        cut(covered, g.master_offset, kPadding);
        g.first_piece = pieces_.size();
        cut(g.master_offset, g.master_offset + g.length, k);
        g.pieces = pieces_.size() - g.first_piece;
        covered = g.master_offset + g.length;
      }
      cut(covered, length[i], kPadding);
      // ZeRO-2: the gradient shard IS data parallelism's shard buffer where the dtypes agree (no
      // copy a step); a buffer of another dtype (reduce_dtype bfloat16) is cast into one of ours.
      const bool shared = dp_->sharded() && dp_->shards()[i].scalar_type() == dtype;
      grads_.push_back(shared ? dp_->shards()[i] : torch::zeros({length[i]}, options));
      shared_.push_back(shared);
    }
    torch::NoGradGuard no_grad;
    for (const auto& s : segments_)
      if (!is_shard(s)) master_part(s).copy_(param_part(s));
    for (const auto& p : params) versions_.push_back(p._version());
    steps_.assign(params.size(), 0);
    stepped_.assign(params.size(), 0);
    groups_ = split_groups(model->module(), params);
    // Experts are split over the expert group, and their zero group over the rest of the data
    // ranks: the norm's sum over every data rank (grad_norm) has every expert's elements once.
    // Experts split over tensor ranks too sum there as well.
    std::unordered_map<const c10::TensorImpl*, dist::GroupPtr> inner;
    for (const auto& rec : parameter_records(model->module()))
      if (rec.sharding && rec.sharding->inner_dim >= 0) inner[rec.param.unsafeGetTensorImpl()] = rec.sharding->inner_group;
    for (size_t k = 0; k < params.size(); ++k)
      if (dp_->buckets()[dp_->bucket_of(k)].expert) {
        auto it = inner.find(params[k].unsafeGetTensorImpl());
        groups_[k] = it == inner.end() ? nullptr : it->second;
      }
    // The all-gathers after the step: runs of consecutive buckets of one buffer whose parts lie
    // end to end in its master, up to allgather_bucket_size of gathered parameters. On Gloo each
    // collective is a round trip between the ranks: the 13 buckets of 1 MiB of a 3 M-parameter
    // GPT-2 gathered one by one took 20 ms on two CPU ranks, in one gather 3 ms.
    const double cap = model->allgather_bucket_mb() * 1024 * 1024;
    const auto& buckets = dp_->buckets();
    for (size_t i = 0; i < buckets.size(); ++i) {
      const auto& b = buckets[i];
      if (param_sharded(i)) continue;  // ZeRO-3: the next forward gathers it
      const int z = dp_->parts(b);
      if (!gathers_.empty() && gathers_.back().last == i) {
        auto& g = gathers_.back();
        const auto dtype = dtype_of(g);
        const double bytes = static_cast<double>(z) * (g.length + b.padded / z) * c10::elementSize(dtype);
        if (buckets[g.last - 1].buffer == b.buffer && params[b.params.front()].scalar_type() == dtype &&
            g.begin + g.length == bucket_master_[i] && bytes <= cap && g.group == dp_->zero_group(b)) {
          g.last = i + 1;
          g.length += b.padded / z;
          continue;
        }
      }
      gathers_.push_back({i, i + 1, bucket_master_[i], b.padded / z, dp_->zero_group(b)});
    }
  }

  /// The optimizer's parameters: the masters' pieces.
  std::vector<torch::Tensor> pieces() const {
    std::vector<torch::Tensor> out;
    for (const auto& q : pieces_) out.push_back(q.tensor);
    return out;
  }

  void prepare() override {
    dp_->settle_unused();  // which parameters got a gradient on no data rank: their pieces get none
    wait_params();  // overlap_sync_param: the last step's gathers, before the parameters are read
    torch::NoGradGuard no_grad;
    auto model = model_.lock();
    TORCH_CHECK(model, "ZeRO: the model this optimizer was made for is gone");
    // A parameter of the master's dtype is its exact copy: take it again (a checkpoint or the user
    // may have written the parameter since). A lower-precision one keeps its master unless it was
    // written since the master was last taken from it or written into it (its version counter
    // moved: pt.ckpt.load without optimizer state, a user's copy_), as Optimizer::refresh_masters.
    const auto& params = dp_->params();
    for (const auto& s : segments_)
      if (!is_shard(s) && (params[s.param].scalar_type() == masters_[s.master].scalar_type() ||
                           params[s.param]._version() != versions_[s.param]))
        master_part(s).copy_(param_part(s));
    for (size_t k = 0; k < params.size(); ++k) versions_[k] = params[k]._version();
    // The gradient shard: this rank's reduced part of each bucket. Under ZeRO-2 backward added
    // the reduce-scattered parts into the shard already (grads_ is it, or takes a cast copy);
    // stage 1 (reduce-scattered into the bucket's part r, or all-reduced whole) and the buckets
    // reduced whole (ties across stages) give their part r.
    const auto& buckets = dp_->buckets();
    for (size_t i = 0; i < buckets.size(); ++i) {
      const auto& b = buckets[i];
      if (shared_[b.buffer] && !b.whole) continue;  // grads_ is the shard buffer itself
      grads_[b.buffer].narrow(0, bucket_master_[i], b.padded / dp_->parts(b)).copy_(dp_->reduced_part(i));
    }
    // A parameter no data rank gave a gradient keeps none, and the optimizer skips its pieces
    // (its moments, weight decay and step count stay), as it skips the parameter in serial
    // training; every rank of the zero group knows it from the same counts.
    for (auto& q : pieces_)
      q.tensor.mutable_grad() = q.segment != kPadding && dp_->unused(segments_[q.segment].param)
                                    ? torch::Tensor()
                                    : grads_[q.master].narrow(0, q.offset, q.tensor.numel());
  }

  double clip(double max_norm) override {
    torch::NoGradGuard no_grad;
    if (max_norm <= 0) return -1;
    auto model = model_.lock();
    TORCH_CHECK(model, "ZeRO: the model this optimizer was made for is gone");
    double norm = grad_norm(*model);
    double scale = max_norm / (norm + 1e-6);  // torch.nn.utils.clip_grad_norm_'s coefficient
    if (scale < 1)
      for (auto& g : grads_) g.mul_(scale);
    return norm;
  }

  void publish() override {
    torch::NoGradGuard no_grad;
    const auto& params = dp_->params();
    const auto& buckets = dp_->buckets();
    for (size_t k = 0; k < params.size(); ++k)  // the same on every rank: the counts are the group's
      if (!dp_->unused(k)) ++steps_[k], stepped_[k] = 1;
    if (fsdp_) {
      // ZeRO-3: the updated parts are the parameters' shards (cast into them where the master is
      // not the shard itself); the units gathered now hold the old values and are freed.
      for (size_t i = 0; i < buckets.size(); ++i)
        if (param_sharded(i) && !master_is_shard_[buckets[i].buffer])
          fsdp_->shard_of(i).copy_(
              masters_[buckets[i].buffer].narrow(0, bucket_master_[i], buckets[i].padded / dp_->parts(buckets[i])));
      fsdp_->reshard_all();
      // The parameters changed without a write through them: a backward still to come over a
      // forward from before the step (its root unit freed here) must refuse, as serial training's
      // in-place step makes autograd refuse ("modified by an inplace operation"), not read freed
      // storage (SIGSEGV). The masters took these values: no change to take back at prepare().
      for (size_t k = 0; k < params.size(); ++k)
        if (param_sharded(dp_->bucket_of(k))) {
          params[k].unsafeGetTensorImpl()->bump_version();
          versions_[k] = params[k]._version();
        }
    }
    if (overlap_) {
      // Each gather's updated parts, cast to the parameters' dtype, all-gathered asynchronously
      // (in the same order on every rank); wait_params() copies them into the parameters.
      for (size_t n = 0; n < gathers_.size(); ++n) {
        const auto& g = gathers_[n];
        InFlight f;
        f.gather = n;
        f.mine = masters_[buckets[g.first].buffer].narrow(0, g.begin, g.length)
                     .to(dtype_of(g), /*non_blocking=*/false, /*copy=*/true);
        f.work = g.group->all_gather(f.mine, f.parts, /*async=*/true);
        in_flight_.push_back(std::move(f));
      }
      return;
    }
    for (const auto& g : gathers_) {
      const int z = g.group->size(), r = g.group->rank();
      // (z x length,) in the parameters' dtype: rank j's updated parts of the run's buckets at j x length.
      auto& scratch = scratch_[dtype_of(g)];
      if (!scratch.defined() || scratch.numel() < z * g.length)
        scratch = torch::empty({z * g.length}, params[buckets[g.first].params.front()].options().requires_grad(false));
      auto flat = scratch.narrow(0, 0, z * g.length);
      flat.narrow(0, r * g.length, g.length).copy_(masters_[buckets[g.first].buffer].narrow(0, g.begin, g.length));
      g.group->all_gather_flat(flat);
      place(g, [&](int j) { return flat.narrow(0, j * g.length, g.length); });
    }
  }

  // overlap_sync_param: completes the all-gathers publish() left in flight, one by one, copying
  // the gathered parts into the parameters. Nothing to do when none are.
  void wait_params() {
    if (in_flight_.empty()) return;
    torch::NoGradGuard no_grad;
    auto pending = std::move(in_flight_);
    in_flight_.clear();
    for (auto& f : pending) {
      f.work.wait();
      place(gathers_[f.gather], [&](int j) { return f.parts[j]; });  // parts in group-rank order
    }
  }

  // Copies a gather's result into the parameters of its buckets: rank j's updated parts
  // (part_of(j), its parts of the buckets end to end) hold elements [j x part, (j + 1) x part) of
  // each bucket. A parameter spans the parts its elements fall in.
  template <typename PartOf>
  void place(const Gather& g, PartOf&& part_of) {
    const auto& params = dp_->params();
    const auto& buckets = dp_->buckets();
    for (size_t i = g.first; i < g.last; ++i) {
      const auto& b = buckets[i];
      const int64_t part = b.padded / dp_->parts(b), at = bucket_master_[i] - g.begin;
      for (size_t s = 0; s < b.params.size(); ++s) {
        auto p = params[b.params[s]].detach();
        auto flat = p.view({-1});
        for (int64_t x = b.offsets[s], end = b.offsets[s] + p.numel(); x < end;) {
          const int64_t j = x / part, within = x - j * part, n = std::min(end - x, part - within);
          flat.narrow(0, x - b.offsets[s], n).copy_(part_of(static_cast<int>(j)).narrow(0, at + within, n));
          x += n;
        }
        versions_[b.params[s]] = p._version();  // the masters' values: not a change to take back
      }
    }
  }
  torch::ScalarType dtype_of(const Gather& g) const {
    return dp_->params()[dp_->buckets()[g.first].params.front()].scalar_type();
  }
  void set_overlap(bool on) { overlap_ = on; }

  // The parameters' .grad go; under ZeRO-2 the shard (what backward passes added up) is zeroed.
  void zero_grad() override {
    dp_->zero_grad();
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < grads_.size(); ++i)
      if (!shared_[i]) grads_[i].zero_();
  }

  std::map<std::string, torch::Tensor> param_state(const optim::Optimizer& opt,
                                                   const torch::Tensor& param) const override {
    const_cast<ZeroShards*>(this)->wait_params();
    std::map<std::string, torch::Tensor> out;
    const auto k = index_of(param);
    if (k < 0) return out;
    const auto& p = dp_->params()[k];
    // Each slot: zeros but for this rank's segments, summed over the zero group: the whole. Every
    // member gathers the same slots: which ones follows from the optimizer and the step counts,
    // which are the same on every rank.
    auto gather = [&](const std::function<torch::Tensor(size_t)>& source) {
      auto full = torch::zeros({p.numel()}, masters_.front().options());
      for (const auto& s : segments_)
        if (static_cast<int64_t>(s.param) == k)
          for_pieces(s, [&](size_t q, int64_t from, int64_t n) { full.narrow(0, s.param_offset + from, n).copy_(source(q)); });
      dp_->zero_group(dp_->buckets()[dp_->bucket_of(k)])->all_reduce(full);
      return full.view(p.sizes());
    };
    if (stepped_[k])  // a parameter that has not stepped yet has no state, as in serial training
      for (const std::string& slot : optim::state_slots(opt.options()))
        out[slot] = gather([&](size_t q) { return opt.local_state(pieces_[q].tensor).at(slot); });
    if (p.scalar_type() != masters_.front().scalar_type())
      out["master"] = gather([&](size_t q) { return pieces_[q].tensor.detach(); });
    return out;
  }

  int64_t param_steps(const optim::Optimizer& opt, const torch::Tensor& param) const override {
    const auto k = index_of(param);
    if (k < 0 || !stepped_[k] || opt.options().kind == "sgd") return -1;  // SGD keeps no count
    return steps_[k];
  }

  void set_param_state(optim::Optimizer& opt, const torch::Tensor& param,
                       const std::map<std::string, torch::Tensor>& slots, int64_t steps) override {
    wait_params();  // a gather still in flight would overwrite what this loads
    torch::NoGradGuard no_grad;
    const auto k = index_of(param);
    if (k < 0) return;
    const auto& p = dp_->params()[k];
    for (const auto& [slot, t] : slots)
      TORCH_CHECK(t.numel() == p.numel(), "ZeRO: state '", slot, "' of a parameter of ", p.numel(), " elements has ",
                  t.numel());
    auto state = slots;
    state.erase("master");
    if (steps < 0) steps = opt.steps_taken();
    for (const auto& s : segments_) {
      if (static_cast<int64_t>(s.param) != k) continue;
      // Each piece holds this parameter's elements alone: its state is the slots' part.
      for_pieces(s, [&](size_t q, int64_t from, int64_t n) {
        std::map<std::string, torch::Tensor> part;
        for (const auto& [slot, t] : state)
          part[slot] = t.reshape({-1}).narrow(0, s.param_offset + from, n).clone();
        opt.set_local_state(pieces_[q].tensor, part, steps);
      });
      auto master = slots.count("master") ? slots.at("master") : p.detach();
      master_part(s).copy_(master.reshape({-1}).narrow(0, s.param_offset, s.length));
    }
    versions_[k] = p._version();  // the master is the one loaded (or the parameter's value)
    stepped_[k] = !state.empty();  // the same on every rank: each loads the same checkpoint
    steps_[k] = state.empty() ? 0 : steps;
  }

  ZeroBytes bytes(const optim::Optimizer& opt) const {
    ZeroBytes b;
    b.stage = stage_;
    b.group = zero_->size();
    for (size_t i = 0; i < masters_.size(); ++i) {
      b.master += static_cast<int64_t>(masters_[i].nbytes());
      if (master_is_shard_[i]) b.shared_master += static_cast<int64_t>(masters_[i].nbytes());
    }
    if (fsdp_) {
      const auto f = fsdp_->bytes();
      b.param_shard = f.shards;
      b.gathered = f.gathered;
      b.peak_gathered = f.peak_gathered;
      b.largest_unit = f.largest_unit;
      b.root_unit = f.root_unit;
    }
    for (const auto& g : grads_) b.shard_grad += static_cast<int64_t>(g.nbytes());
    b.gathers_in_flight = static_cast<int>(in_flight_.size());
    b.gathers = static_cast<int>(gathers_.size());
    for (const auto& [dtype, t] : scratch_) b.gather_buffer += static_cast<int64_t>(t.nbytes());
    b.pieces = static_cast<int>(pieces_.size());
    b.grad_buffer = dp_->held_bytes();
    b.scratch = dp_->scratch_bytes();
    for (size_t i = 0; i < grads_.size(); ++i)
      if (shared_[i]) b.shared_grad += static_cast<int64_t>(grads_[i].nbytes());
    b.state = opt.state_bytes();
    return b;
  }

  void sync_grad() const { dp_->gather_shards(); }

 private:
  torch::Tensor master_part(const Segment& s) const { return masters_[s.master].narrow(0, s.master_offset, s.length); }
  // Calls f(piece, offset in the segment, length) for each of the segment's pieces, in order.
  template <typename F>
  void for_pieces(const Segment& s, F&& f) const {
    for (size_t q = s.first_piece; q < s.first_piece + s.pieces; ++q)
      f(q, pieces_[q].offset - s.master_offset, pieces_[q].tensor.numel());
  }

  // The parameter's elements of a segment: under ZeRO-3 its shard's (the parameter itself is
  // freed between uses), else the parameter's.
  torch::Tensor param_part(const Segment& s) const {
    if (param_sharded(s.bucket))
      return fsdp_->shard_of(s.bucket).narrow(0, s.master_offset - bucket_master_[s.bucket], s.length);
    return dp_->params()[s.param].detach().reshape({-1}).narrow(0, s.param_offset, s.length);
  }
  bool param_sharded(size_t bucket) const { return fsdp_ && fsdp_->unit_of_bucket(bucket) >= 0; }
  // Whether the segment's master part is ZeRO-3's parameter shard itself (nothing to copy).
  bool is_shard(const Segment& s) const { return master_is_shard_[s.master] && param_sharded(s.bucket); }
  int64_t index_of(const torch::Tensor& param) const {
    const auto& params = dp_->params();
    for (size_t k = 0; k < params.size(); ++k)
      if (params[k].is_same(param)) return static_cast<int64_t>(k);
    return -1;
  }

  // The global L2 norm of the gradients: squares per parameter from this rank's segments, summed
  // over the zero group (each element is in one rank's shard); then as global_grad_norm and
  // Pipeline::grad_norm: whole parameters as they are, split ones over their tensor group, the
  // stages over the pipeline group, a tensor tied across stages once.
  double grad_norm(ParallelModel& model) const {
    const auto& params = dp_->params();
    auto options = torch::TensorOptions().dtype(torch::kFloat64).device(masters_.front().device());
    auto sq = torch::zeros({static_cast<int64_t>(params.size())}, options);
    // Each segment's norm in the gradients' dtype (as torch's clip_grad_norm_ takes a parameter's),
    // squared in float64 and added into its parameter's: a few operations a segment, not a copy.
    std::vector<torch::Tensor> norms;
    torch::Tensor none;  // a parameter without a gradient adds nothing (its part may hold an old one)
    for (const auto& s : segments_) {
      if (dp_->unused(s.param)) {
        if (!none.defined()) none = torch::zeros({}, masters_.size() > 1 ? options : grads_.front().options());
        norms.push_back(none);
        continue;
      }
      auto n = grads_[s.master].narrow(0, s.master_offset, s.length).norm(2);
      norms.push_back(masters_.size() > 1 ? n.to(options) : n);  // masters of two dtypes or devices: one for the stack
    }
    if (!norms.empty()) {
      if (!segment_param_.defined()) {  // each segment's parameter, made once
        std::vector<int64_t> of;
        for (const auto& s : segments_) of.push_back(static_cast<int64_t>(s.param));
        segment_param_ = torch::tensor(of, torch::kLong).to(options.device());
      }
      sq.index_add_(0, segment_param_, torch::stack(norms).to(torch::kFloat64).pow(2));
    }
    zero_->all_reduce(sq);
    const auto& pipeline = model.pipeline();
    auto whole = torch::zeros({1}, options);
    std::vector<std::pair<dist::GroupPtr, torch::Tensor>> split;
    for (size_t k = 0; k < params.size(); ++k) {
      if (pipeline && !pipeline->first_holder(params[k])) continue;  // its other holder counts it
      auto v = sq.narrow(0, static_cast<int64_t>(k), 1);
      const auto& g = groups_[k];
      if (!g) {
        whole += v;
        continue;
      }
      auto it = std::find_if(split.begin(), split.end(), [&](const auto& e) { return e.first == g; });
      if (it == split.end()) split.emplace_back(g, v.clone());
      else it->second += v;
    }
    for (auto& [g, v] : split) {
      g->all_reduce(v);
      whole += v;
    }
    if (pipeline) pipeline->group()->all_reduce(whole);
    return std::sqrt(whole.item<double>());
  }

  std::weak_ptr<ParallelModel> model_;
  std::shared_ptr<DataParallel> dp_;
  std::shared_ptr<Fsdp> fsdp_;          // ZeRO-3's shards of the parameters (null below stage 3)
  std::vector<bool> master_is_shard_;   // by master: ZeRO-3's parameter shard buffer itself
  dist::GroupPtr zero_;
  int stage_ = 0;
  std::vector<Segment> segments_;
  std::vector<Gather> gathers_;
  mutable torch::Tensor segment_param_;  // (segments,) each segment's parameter index, for the norm
  std::vector<int64_t> bucket_master_;  // where each bucket's part starts in its master
  std::vector<torch::Tensor> masters_;  // (shard,) one per flat buffer, in float32 or float64
  // Each parameter's version counter when its master part was last taken from it or written into
  // it (by index into DataParallel::params()): a lower-precision parameter written since then
  // gives its master its value at the next step.
  std::vector<int64_t> versions_;
  // How many steps each parameter (by index into DataParallel::params()) has taken, and whether
  // it has optimizer state: one that got no gradient on a step is skipped, as in serial training.
  // Two vectors: a checkpoint may hold a parameter's state as of step 0 (ckpt::validate takes it).
  std::vector<int64_t> steps_;
  std::vector<char> stepped_;
  static constexpr size_t kPadding = static_cast<size_t>(-1);
  struct Piece {
    size_t master = 0;
    int64_t offset = 0;      // where it starts in its master
    size_t segment = 0;      // the segment it is part of (kPadding: the padding after a bucket's parameters)
    torch::Tensor tensor;    // a leaf viewing masters_[master]: what the optimizer steps
  };
  static constexpr int64_t kCpuPiece = int64_t{1} << 17;
  std::vector<Piece> pieces_;          // every master's, master by master, in order
  std::vector<torch::Tensor> grads_;    // (shard,) their gradients
  std::vector<bool> shared_;            // grads_[i] is data parallelism's shard buffer i itself
  std::vector<dist::GroupPtr> groups_;  // each parameter's tensor group when split, else null
  std::map<torch::ScalarType, torch::Tensor> scratch_;  // the all-gather's buffer, by parameter dtype
  // overlap_sync_param: the all-gathers publish() started and nothing has waited for yet.
  struct InFlight {
    size_t gather = 0;                // index into gathers_
    torch::Tensor mine;               // (length,) this rank's updated parts, kept alive while they are sent
    std::vector<torch::Tensor> parts; // (length,) each rank's, filled when the work completes
    dist::Work work;
  };
  bool overlap_ = false;
  std::vector<InFlight> in_flight_;
};

}  // namespace

std::shared_ptr<optim::Optimizer> make_zero_optimizer(const std::shared_ptr<ParallelModel>& model,
                                                      const optim::OptimizerOptions& options) {
  TORCH_CHECK(model && model->data_parallel(), "ZeRO: the model is not parallelized");
  const auto& o = model->data_parallel()->options();
  TORCH_CHECK(o.zero.stage >= 1 && o.zero.group && o.zero.group->size() > 1,
              "ZeRO: the model was parallelized without a zero stage over zero groups of more than one rank");
  auto shards = std::make_shared<ZeroShards>(model);
  auto opt = std::make_shared<optim::Optimizer>(shards->pieces(), options);
  opt->set_distributed(shards);
  if (model->overlap_sync_param()) {
    shards->set_overlap(true);
    std::weak_ptr<ZeroShards> weak = shards;
    model->set_param_wait([weak] {
      if (auto s = weak.lock()) s->wait_params();
    });
  }
  return opt;
}

c10::optional<ZeroBytes> zero_bytes(const optim::Optimizer& opt) {
  auto* z = dynamic_cast<const ZeroShards*>(opt.distributed().get());
  if (!z) return c10::nullopt;
  return z->bytes(opt);
}

void sync_shard_grad(const optim::Optimizer& opt) {
  if (auto* z = dynamic_cast<const ZeroShards*>(opt.distributed().get())) z->sync_grad();
}

}  // namespace partrain::parallel
