// ZeRO-3's gathered units (see fsdp.hpp).
#include "engine/parallel/fsdp.hpp"

#include <algorithm>
#include <unordered_map>

#include "engine/parallel/recompute.hpp"
#include "engine/parallel/trace.hpp"

namespace partrain::parallel {

namespace {

// A tensor's storage released (its shape and the tensors viewing it stay) and allocated again:
// the parameters keep their TensorImpl, their version counter and every hook, while the bytes
// exist only when the unit is gathered.
}  // namespace

void release_storage(const torch::Tensor& t) {
  auto* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

namespace {

int64_t bytes_of(const torch::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

}  // namespace

std::vector<std::vector<torch::Tensor>> unit_params(nn::Module& root, const std::vector<std::string>& paths) {
  std::vector<std::vector<torch::Tensor>> out;
  std::unordered_map<const c10::TensorImpl*, std::string> owner;
  for (size_t i = 0; i < paths.size(); ++i) {
    const auto& path = paths[i];
    auto m = root.find(path);
    TORCH_CHECK(m && !path.empty(), "zero: unit '", path, "' is not a module of ", root.type(),
                path.empty() ? " (the root holds what no unit holds already)" : "");
    for (size_t j = 0; j < i; ++j)
      TORCH_CHECK(path.rfind(paths[j] + ".", 0) != 0 && paths[j].rfind(path + ".", 0) != 0 && paths[j] != path,
                  "zero: units '", paths[j], "' and '", path, "' overlap: a unit holds another's parameters");
    auto& params = out.emplace_back();
    for (const auto& item : m->named_parameters(/*recurse=*/true)) {
      const auto& p = item.value();
      if (!p.requires_grad()) continue;
      auto [it, fresh] = owner.emplace(p.unsafeGetTensorImpl(), path + "." + item.key());
      if (!fresh) {
        if (it->second.rfind(path + ".", 0) == 0) continue;  // tied within this unit
        TORCH_CHECK(false, "zero: '", it->second, "' and '", path, ".", item.key(), "' are one tensor held by two "
                    "units: make the modules holding it one unit, or leave them to the root");
      }
      params.push_back(p);
    }
  }
  // A unit's tensor held outside every unit too (tied to a module the root runs): the root's
  // forward read it while its unit was freed, and a backward saving it read freed storage.
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    auto it = owner.find(item.value().unsafeGetTensorImpl());
    if (it == owner.end()) continue;
    const bool inside = std::any_of(paths.begin(), paths.end(),
                                    [&](const std::string& path) { return item.key().rfind(path + ".", 0) == 0; });
    TORCH_CHECK(inside, "zero: '", it->second, "' and '", item.key(), "' are one tensor held by a unit and outside "
                "every unit (by the root unit): make the modules holding it one unit, or leave them to the root");
  }
  return out;
}

std::vector<std::string> default_units(nn::Module& root, const std::string& blocks) {
  std::vector<std::string> out;
  if (!blocks.empty()) {
    auto container = root.find(blocks);
    TORCH_CHECK(container, "zero: the blocks '", blocks, "' are not a module of ", root.type());
    for (const auto& [name, child] : container->children_named()) out.push_back(blocks + "." + name);
    return out;
  }
  for (const auto& [name, child] : root.children_named()) {
    auto params = child->parameters();
    if (std::any_of(params.begin(), params.end(), [](const auto& p) { return p.requires_grad(); })) out.push_back(name);
  }
  return out;
}

Fsdp::Fsdp(std::shared_ptr<DataParallel> dp, const FsdpOptions& options)
    : dp_(std::move(dp)), zero_(dp_->options().zero.group), options_(options) {}

std::shared_ptr<Fsdp> Fsdp::attach(nn::Module& root, std::shared_ptr<DataParallel> dp,
                                   const std::vector<std::string>& paths, const FsdpOptions& options,
                                   const std::function<torch::Tensor(const torch::Tensor&)>& initial) {
  TORCH_CHECK(dp && dp->options().zero.stage == 3 && dp->zero_size() > 1,
              "ZeRO-3: data parallelism was not set up for stage 3 over a zero group of more than one rank");
  TORCH_CHECK(options.prefetch >= 0, "zero: prefetch must be >= 0 (units gathered ahead), got ", options.prefetch);
  std::shared_ptr<Fsdp> f(new Fsdp(dp, options));
  const auto& params = dp->params();
  const auto& buckets = dp->buckets();
  const auto& units = dp->options().zero.units;
  TORCH_CHECK(units.size() == paths.size(), "ZeRO-3: ", paths.size(), " unit names for ", units.size(), " units");
  f->units_.push_back({"(root)"});
  for (const auto& p : paths) f->units_.push_back({p});
  // The shard buffers: one per flat buffer whose (sharded) buckets hold parameters of its dtype.
  // Each bucket splits over its own zero group (experts over theirs).
  std::vector<bool> shareable(dp->buffer_options().size(), true);
  std::vector<int64_t> length(dp->buffer_options().size(), 0);
  for (const auto& b : buckets) {
    length[b.buffer] = std::max(length[b.buffer], b.shard_start + b.padded / dp->parts(b));
    if (!b.whole && params[b.params.front()].scalar_type() != dp->buffer_options()[b.buffer].dtype())
      shareable[b.buffer] = false;
  }
  for (size_t i = 0; i < shareable.size(); ++i)
    f->shard_buffers_.push_back(shareable[i] ? torch::zeros({length[i]}, dp->buffer_options()[i]) : torch::Tensor());
  torch::NoGradGuard no_grad;
  f->stores_.resize(buckets.size());
  for (size_t i = 0; i < buckets.size(); ++i) {
    const auto& b = buckets[i];
    auto& s = f->stores_[i];
    if (b.whole) {  // kept whole: a tie across pipeline stages, summed over the pipeline after the sync
      for (size_t k : b.params) {
        auto p = params[k];
        auto made = initial ? initial(p) : torch::Tensor();
        if (made.defined()) p.set_data(made.view(p.sizes()));
        f->whole_bytes_ += bytes_of(p);
      }
      continue;
    }
    s.unit = b.unit;  // the layout closed the buckets at unit boundaries
    const auto& first = params[b.params.front()];
    const int64_t part = b.padded / dp->parts(b), r = dp->part_rank(b);
    s.gathered = torch::zeros({b.padded}, first.options().requires_grad(false));
    s.shard = f->shard_buffers_[b.buffer].defined() ? f->shard_buffers_[b.buffer].narrow(0, b.shard_start, part)
                                                    : torch::zeros({part}, s.gathered.options());
    for (size_t slot = 0; slot < b.params.size(); ++slot) {
      auto p = params[b.params[slot]];
      auto view = s.gathered.narrow(0, b.offsets[slot], p.numel());
      auto made = initial ? initial(p) : torch::Tensor();  // a deferred parameter's values, made now
      view.copy_((made.defined() ? made : p.detach()).reshape({-1}));
      // The parameter becomes a view of the flat buffer: the same tensor object, its own version
      // counter (the gathers write the buffer, not the parameter), its storage the buffer's.
      p.set_data(view.view(p.sizes()));
    }
    s.shard.copy_(s.gathered.narrow(0, r * part, part));
    auto& unit = f->units_[s.unit];
    unit.buckets.push_back(i);
    unit.bytes += bytes_of(s.gathered);
    f->release(s.gathered);
  }
  // The root's forward gathers the root unit (and starts the first unit's); each unit's forward its own.
  std::weak_ptr<Fsdp> weak = f;
  auto wrap = [&](nn::Module& m, size_t u) {
    auto previous = m.replaced_forward();
    m.replace_forward([weak, u, previous](nn::Module& self, const std::vector<torch::Tensor>& inputs) {
      auto fsdp = weak.lock();
      if (fsdp) fsdp->before_forward(u);
      auto out = previous ? previous(self, inputs) : self.own_forward(inputs);
      return fsdp ? fsdp->after_forward(u, out) : out;
    });
  };
  wrap(root, 0);
  for (size_t u = 1; u < f->units_.size(); ++u) wrap(*root.find(f->units_[u].name), u);
  f->guard_inner_modules(root);
  dp->set_bucket_done([weak](size_t i) {
    if (auto fsdp = weak.lock()) fsdp->bucket_done(i);
  });
  return f;
}

// A module holding sharded parameters below a unit's entry (or the root's, outside every unit),
// called on its own while its unit is freed (model.h[1].mlp.c_fc(x) between steps), would read
// released storage: it is refused naming the unit and the ways to run it; one on its way is
// waited for.
void Fsdp::guard_inner_modules(nn::Module& root) {
  std::weak_ptr<Fsdp> weak = shared_from_this();
  for (auto& [path, m] : root.modules()) {
    if (path.empty()) continue;
    bool holds = false;
    for (const auto& p : m->named_parameters(/*recurse=*/false))
      holds = holds || (p.value().requires_grad() && dp_->index_of(p.value()) >= 0);
    if (!holds) continue;
    size_t unit = 0;
    for (size_t u = 1; u < units_.size(); ++u)
      if (path == units_[u].name || path.rfind(units_[u].name + ".", 0) == 0) unit = u;
    if (unit > 0 && path == units_[unit].name) continue;  // the unit's entry gathers it
    auto previous = m->replaced_forward();
    m->replace_forward([weak, unit, path = path, previous](nn::Module& self, const std::vector<torch::Tensor>& inputs) {
      if (auto fsdp = weak.lock()) fsdp->expect_gathered(unit, path);
      return previous ? previous(self, inputs) : self.own_forward(inputs);
    });
  }
}

void Fsdp::expect_gathered(size_t u, const std::string& path) {
  auto& unit = units_[u];
  if (unit.state == State::Gathering) wait(u);
  TORCH_CHECK(unit.state == State::Gathered, "ZeRO-3: '", path, "' holds parameters of ",
              u == 0 ? std::string("the root unit") : "unit '" + unit.name + "'",
              ", which exist only while it is gathered: run ", u == 0 ? std::string("the model") : "the unit or the model",
              ", or call it inside model:gathered(function() ... end)");
}

void Fsdp::gather(size_t u) {
  auto& unit = units_[u];
  if (unit.state != State::Sharded) return;
  for (size_t i : unit.buckets) {
    auto& s = stores_[i];
    allocate(s.gathered);
    unit.works.push_back(dp_->zero_group(dp_->buckets()[i])->start_all_gather_flat(s.gathered, s.shard));
  }
  // --trace: the gather's span on the rank's gather row, from now to its last collective's end.
  unit.completion.reset();
  if (StepTrace::instance().active() && !unit.works.empty()) {
    unit.started = std::chrono::steady_clock::now();
    auto done = std::make_shared<Completion>();
    done->left = static_cast<int>(unit.works.size());
    unit.completion = done;
    for (auto& w : unit.works)
      w.when_done([done] {
        if (--done->left == 0) done->end_ns = std::chrono::steady_clock::now().time_since_epoch().count();
      });
  }
  unit.state = State::Gathering;
  gathered_bytes_ += unit.bytes;
  peak_ = std::max(peak_, gathered_bytes_);
  ++gathers_;
}

void Fsdp::wait(size_t u) {
  auto& unit = units_[u];
  if (unit.state == State::Sharded) gather(u);
  if (unit.state != State::Gathering) return;
  auto works = std::move(unit.works);
  unit.works.clear();
  unit.state = State::Gathered;  // (a failed wait leaves it gathered: reshard frees it)
  for (auto& w : works) w.wait();
  if (auto done = std::move(unit.completion)) {
    const int64_t end = done->end_ns.load();
    const auto now = std::chrono::steady_clock::now();
    StepTrace::instance().record_span(
        TraceKind::Gather, unit.started,
        end > 0 ? std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(end)) : now,
        static_cast<int>(u));
  }
}

void Fsdp::reshard(size_t u) {
  auto& unit = units_[u];
  if (unit.state == State::Sharded) return;
  if (unit.state == State::Gathering) wait(u);  // the gather still writes into the storage
  for (size_t i : unit.buckets) release(stores_[i].gathered);
  unit.state = State::Sharded;
  unit.done = 0;
  gathered_bytes_ -= unit.bytes;
}

// On the CPU a freed gather buffer is kept for the next gather of its size, at most the buffers
// the gathers of a step hold at once (the root unit's and 1 + prefetch units'): LibTorch's CPU
// allocator hands every free back to malloc, whose heap grew step after step (glibc raises its
// mmap threshold after the first frees of buffers this size, then serves them from arenas that
// fragment: a rank's resident memory went 1.1 -> 2.6 GB over 4 steps). CUDA's caching allocator
// pools on its own, with the streams' bookkeeping.
void Fsdp::allocate(const torch::Tensor& t) {
  auto* s = t.storage().unsafeGetStorageImpl();
  const auto nbytes = static_cast<size_t>(bytes_of(t));
  auto& kept = pool_[nbytes];
  if (!kept.empty()) {
    s->set_data_ptr_noswap(std::move(kept.back()));
    kept.pop_back();
    pooled_bytes_ -= static_cast<int64_t>(nbytes);
  } else {
    TORCH_CHECK(s->allocator(), "ZeRO-3: a parameter buffer has no allocator to gather into");
    s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  }
  s->set_nbytes(nbytes);
}

void Fsdp::release(const torch::Tensor& t) {
  auto* s = t.storage().unsafeGetStorageImpl();
  const auto nbytes = static_cast<size_t>(bytes_of(t));
  auto& kept = pool_[nbytes];
  if (t.device().is_cpu() && s->data() && kept.size() < static_cast<size_t>(options_.prefetch) + 1) {
    kept.push_back(s->set_data_ptr(at::DataPtr(nullptr, t.device())));
    pooled_bytes_ += static_cast<int64_t>(nbytes);
  } else {
    s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  }
  s->set_nbytes(0);
}

void Fsdp::reshard_all() {
  for (size_t u = 0; u < units_.size(); ++u) reshard(u);
}

void Fsdp::gather_all() {
  for (size_t u = 0; u < units_.size(); ++u) gather(u);
  for (size_t u = 0; u < units_.size(); ++u) wait(u);
}

void Fsdp::write_back(size_t u) {
  torch::NoGradGuard no_grad;
  const auto& buckets = dp_->buckets();
  for (size_t i : units_[u].buckets) {
    const int64_t part = buckets[i].padded / dp_->parts(buckets[i]), r = dp_->part_rank(buckets[i]);
    stores_[i].shard.copy_(stores_[i].gathered.narrow(0, r * part, part));
  }
}

void Fsdp::hold(bool on) {
  hold_ = on;
  if (on) wait(0);  // a stage's first and last modules are the root unit's, run outside its forward
  else reshard_all();
}

void Fsdp::prefetch(size_t u, int direction) {
  for (int k = 1; k <= options_.prefetch; ++k) {
    const int64_t next = static_cast<int64_t>(u) + direction * k;
    if (next < 1 || next >= static_cast<int64_t>(units_.size())) break;
    gather(static_cast<size_t>(next));
  }
}

void Fsdp::before_forward(size_t u) {
  const bool replay = replaying_checkpoint();
  if (u != 0) wait(0);  // a unit run on its own still finds the root's parameters
  wait(u);
  // Forward prefetches the units after this one; a checkpointed block's replay runs in backward,
  // where the ones before it come next.
  prefetch(u == 0 ? 0 : u, replay ? -1 : 1);
}

torch::Tensor Fsdp::after_forward(size_t u, torch::Tensor out) {
  if (u == 0) return out;  // the root unit stays gathered until its gradients are in
  const bool replay = replaying_checkpoint();
  if (options_.reshard_after_forward && !replay) reshard(u);
  if (torch::GradMode::is_enabled() && out.defined() && out.requires_grad()) {
    std::weak_ptr<Fsdp> weak = shared_from_this();
    out.register_hook([weak, u](const torch::Tensor& grad) {
      if (auto fsdp = weak.lock()) fsdp->before_backward(u);
      return grad;
    });
  }
  return out;
}

void Fsdp::before_backward(size_t u) {
  wait(u);
  prefetch(u, -1);
}

void Fsdp::bucket_done(size_t i) {
  const int u = stores_[i].unit;
  if (u < 0) return;
  auto& unit = units_[u];
  if (++unit.done < unit.buckets.size()) return;
  unit.done = 0;
  if (hold_ && (u == 0 || !options_.reshard_after_forward)) return;  // a pipeline step keeps it
  reshard(u);
}

FsdpBytes Fsdp::bytes() const {
  FsdpBytes b;
  for (const auto& t : shard_buffers_)
    if (t.defined()) b.shards += bytes_of(t);
  for (size_t i = 0; i < stores_.size(); ++i)  // shards of their own (no shared buffer)
    if (stores_[i].unit >= 0 && !shard_buffers_[dp_->buckets()[i].buffer].defined()) b.shards += bytes_of(stores_[i].shard);
  b.whole = whole_bytes_;
  b.gathered = gathered_bytes_;
  b.peak_gathered = peak_;
  for (const auto& u : units_) b.largest_unit = std::max(b.largest_unit, u.bytes);
  b.root_unit = units_.front().bytes;
  b.gathers = gathers_;
  b.pooled = pooled_bytes_;
  return b;
}

std::vector<size_t> Fsdp::gathered_units() const {
  std::vector<size_t> out;
  for (size_t u = 0; u < units_.size(); ++u)
    if (units_[u].state != State::Sharded) out.push_back(u);
  return out;
}

void Fsdp::regather(const std::vector<size_t>& us) {
  for (size_t u : us) gather(u);
  for (size_t u : us) wait(u);
}

// A whole-model read between a forward and its backward (a state dict, a checkpoint, a look
// inside model:gathered) must leave the forward's root unit gathered: its backward reads the
// root's parameters, saved by autograd, without gathering them (a unit's backward gathers its
// own), and a kernel reading their freed storage was killed by SIGSEGV. The units gathered
// before are gathered again from the shards: what the scope wrote, each rank its part r, is
// what they then hold, alike on every rank.
Fsdp::Gathered::Gathered(std::shared_ptr<Fsdp> fsdp, bool writeback) : fsdp_(std::move(fsdp)), writeback_(writeback) {
  if (!fsdp_) return;
  restore_ = fsdp_->gathered_units();
  fsdp_->gather_all();
}

Fsdp::Gathered::~Gathered() {
  if (!fsdp_) return;
  try {
    if (writeback_)
      for (size_t u = 0; u < fsdp_->units(); ++u) fsdp_->write_back(u);
    fsdp_->reshard_all();
    fsdp_->regather(restore_);
  } catch (...) {
    // a failed gather's error was raised where it was waited for
  }
}

Fsdp::Access::Access(std::shared_ptr<Fsdp> fsdp, bool writeback) : fsdp_(std::move(fsdp)), writeback_(writeback) {
  if (!fsdp_) return;
  restore_ = fsdp_->gathered_units();
  fsdp_->reshard_all();  // one unit at a time from here
}

Fsdp::Access::~Access() {
  try {
    finish();
    if (fsdp_) fsdp_->regather(restore_);
  } catch (...) {
    // a failed gather's error was raised where it was waited for
  }
}

void Fsdp::Access::finish() {
  if (!fsdp_ || current_ < 0) return;
  if (writeback_) fsdp_->write_back(static_cast<size_t>(current_));
  fsdp_->reshard(static_cast<size_t>(current_));
  current_ = -1;
}

void Fsdp::Access::touch(const torch::Tensor& param) {
  if (!fsdp_) return;
  const int64_t k = fsdp_->dp_->index_of(param);
  const int unit = k < 0 ? -1 : fsdp_->stores_[fsdp_->dp_->bucket_of(static_cast<size_t>(k))].unit;
  if (unit < 0 || unit == current_) return;  // kept whole, not trainable, or gathered already
  finish();
  fsdp_->wait(static_cast<size_t>(unit));
  current_ = unit;
}

}  // namespace partrain::parallel
