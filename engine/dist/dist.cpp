// Process groups over c10d, the world and its rendezvous, and the device mesh
// (see process_group.hpp, world.hpp, mesh.hpp).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <sstream>

#define PARTRAIN_COMPAT_C10D  // this file talks to c10d: pull its headers into compat.hpp
#include "engine/compat.hpp"
#include "engine/dist/mesh.hpp"
#include "engine/util/startup.hpp"
#include "engine/util/text.hpp"

namespace partrain::dist {

// ---- Reduce ops ----------------------------------------------------------------------------

ReduceOp parse_reduce_op(const std::string& name) {
  if (name == "sum") return ReduceOp::Sum;
  if (name == "mean" || name == "avg") return ReduceOp::Mean;
  if (name == "min") return ReduceOp::Min;
  if (name == "max") return ReduceOp::Max;
  if (name == "product" || name == "prod") return ReduceOp::Product;
  TORCH_CHECK(false, "unknown reduce op '", name, "' (expected sum, mean, avg, min, max or product)");
}

std::string to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Mean: return "mean";
    case ReduceOp::Min: return "min";
    case ReduceOp::Max: return "max";
    case ReduceOp::Product: return "product";
  }
  return "?";
}

namespace {

c10d::ReduceOp c10d_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Mean: return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case ReduceOp::Min: return c10d::ReduceOp(c10d::ReduceOp::MIN);
    case ReduceOp::Max: return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case ReduceOp::Product: return c10d::ReduceOp(c10d::ReduceOp::PRODUCT);
  }
  return c10d::ReduceOp(c10d::ReduceOp::SUM);
}

std::string join(const std::vector<int>& xs) {
  std::string s;
  for (size_t i = 0; i < xs.size(); ++i) s += (i ? "," : "") + std::to_string(xs[i]);
  return s;
}

}  // namespace

// ---- Checking that ranks agree on the collective -------------------------------------------

namespace {
bool& check_flag() {
  static bool on = [] {
    const char* v = std::getenv("PARTRAIN_CHECK_COLLECTIVES");
    return v && std::string(v) == "1";
  }();
  return on;
}
}  // namespace

void set_check_collectives(bool on) { check_flag() = on; }
bool check_collectives() { return check_flag(); }

namespace {
thread_local int agreed_calls = 0;  // AgreedCall objects alive on this thread
}  // namespace

AgreedCall::AgreedCall(bool on) : on_(on) { agreed_calls += on; }
AgreedCall::~AgreedCall() { agreed_calls -= on_; }

// ---- Call sites and the last collective ----------------------------------------------------

namespace {

std::atomic<CallSiteFn> site_provider{nullptr};

// The collective this process started last, as text, for the terminate handler (which runs on
// whichever thread Gloo failed on, so it is copied under a lock rather than shared).
std::mutex last_call_mutex;
char last_call[768] = "";
std::atomic<int> this_rank{-1};
std::atomic<void (*)(const std::string&)> fatal_reporter{nullptr};

void note_call(const std::string& text) {
  std::lock_guard<std::mutex> lock(last_call_mutex);
  std::snprintf(last_call, sizeof last_call, "%s", text.c_str());
}


// "float32 [4, 3]" (or "no tensor").
std::string describe_tensor(const Tensor& t) {
  if (!t.defined()) return "no tensor";
  std::ostringstream s;
  s << dtype_name(t.scalar_type()) << " [";
  for (int64_t d = 0; d < t.dim(); ++d) s << (d ? ", " : "") << t.size(d);
  s << "]";
  return s.str();
}

// FNV-1a, so ranks can compare call sites in a fixed-size record.
int64_t hash_text(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return static_cast<int64_t>(h >> 1);
}

// Reports `msg` ("partrain: ..."), writes it to stderr and ends the process with status 1.
[[noreturn]] void end_process(std::string msg) {
  if (auto report = fatal_reporter.load()) report(msg.substr(std::string("partrain: ").size()));
  msg += "\n";
  if (::write(STDERR_FILENO, msg.data(), msg.size()) < 0) {
  }
  std::fflush(stdout);
  _exit(1);
}

[[noreturn]] void on_terminate() {
  std::string what;
  if (auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      what = x.what();
    } catch (...) {
      what = "an exception of unknown type";
    }
  }
  if (what.empty()) std::abort();  // terminate without an exception: a real bug, keep the core dump
  char call[sizeof last_call] = "";
  if (last_call_mutex.try_lock()) {
    std::memcpy(call, last_call, sizeof call);
    last_call_mutex.unlock();
  }
  auto trim = what.find("\nException raised from");  // c10's C++ backtrace: not for users
  if (trim != std::string::npos) what.resize(trim);
  bool gloo = what.find("gloo") != std::string::npos || what.find("enforce fail") != std::string::npos;
  std::string rank = this_rank >= 0 ? "rank " + std::to_string(this_rank.load()) + ": " : "";
  std::string msg = "partrain: " + rank;
  if (gloo)
    msg += "a collective failed because the ranks disagree on it: a peer sent more data than this rank's "
           "tensor holds (their shapes or dtypes differ). Gloo said: " + what;
  else
    msg += "a background thread failed: " + what;
  if (call[0]) msg += "\n  this rank's last collective: " + std::string(call);
  if (gloo)
    msg += "\n  Every rank of a group must run the same collectives in the same order, with the same shapes and "
           "dtypes; run with --check-collectives to see each rank's call.";
  end_process(msg);
}

}  // namespace

void fatal_exit(const std::string& message) {
  end_process("partrain: " + (this_rank >= 0 ? "rank " + std::to_string(this_rank.load()) + ": " : std::string()) +
              message);
}

// ---- Waiting -------------------------------------------------------------------------------

namespace {

std::atomic<bool (*)()> wait_interrupt{nullptr};

// Waits for `work` up to `timeout`. With an interrupt check installed the wait goes in slices,
// asking the check between them, so that Ctrl-C in the REPL ends a wait no peer will answer;
// a collective that completes within the first slice costs nothing more.
void wait_for(c10d::Work& work, std::chrono::milliseconds timeout) {
  auto interrupted = wait_interrupt.load();
  if (!interrupted) {
    work.wait(timeout);
    return;
  }
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  while (true) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    try {
      work.wait(std::max(std::chrono::milliseconds(1), std::min(left, std::chrono::milliseconds(50))));
      return;
    } catch (const std::exception&) {
      if (work.isCompleted()) {  // it ended meanwhile, or with its own error: that outcome
        work.wait();
        return;
      }
      if (Clock::now() >= deadline) throw;
    }
    if (interrupted()) throw std::runtime_error("interrupted while waiting for the other ranks (Ctrl-C)");
  }
}

}  // namespace

void set_call_site_provider(CallSiteFn fn) { site_provider = fn; }

void call_site_into(char* buf, size_t n) {
  if (n == 0) return;
  buf[0] = '\0';
  if (CallSiteFn fn = site_provider.load()) fn(buf, n);
  buf[n - 1] = '\0';
}

std::string call_site() {
  char buf[ledger::kSite];
  call_site_into(buf, sizeof buf);
  return buf;
}

void install_terminate_handler() { std::set_terminate(on_terminate); }
void set_fatal_reporter(void (*report)(const std::string& message)) { fatal_reporter = report; }

void set_wait_interrupt(bool (*interrupted)()) { wait_interrupt = interrupted; }

// ---- Work ----------------------------------------------------------------------------------

Work::Work(std::shared_ptr<const ProcessGroup> group, std::string op, c10::intrusive_ptr<c10d::Work> work,
           std::function<void()> after, int64_t ticket)
    : group_(std::move(group)), op_(std::move(op)), work_(std::move(work)), after_(std::move(after)), ticket_(ticket) {}

bool Work::done() const {
  if (!work_) return true;
  if (!work_->isCompleted()) return false;
  if (!work_->exception()) group_->ledger_set(ticket_, ledger::State::Completed);  // a failure: wait() says so
  return true;
}

void Work::wait() {
  if (work_) {
    group_->ledger_set(ticket_, ledger::State::Waiting);
    try {
      wait_for(*work_, group_->timeout());
    } catch (const std::exception& e) {
      work_.reset();
      std::string why = util::message_of(e);
      const bool timed_out = why.find("timed out") != std::string::npos || why.find("Timed out") != std::string::npos;
      group_->ledger_set(ticket_, timed_out ? ledger::State::TimedOut : ledger::State::Failed);
      if (timed_out)
        why += " (waited " + std::to_string(group_->timeout().count() / 1000) +
               " s; a peer may be stalled or dead; raise the limit with --timeout)";
      group_->fail(op_, why);
    }
    work_.reset();
    group_->ledger_set(ticket_, ledger::State::Completed);
  }
  if (after_) {
    auto after = std::move(after_);
    after_ = nullptr;
    after();
  }
}

// ---- ProcessGroup --------------------------------------------------------------------------

struct ProcessGroup::Impl {
  c10::intrusive_ptr<compat::C10dGroup> group;
};

ProcessGroup::ProcessGroup(GroupOptions options, int rank) : options_(std::move(options)), rank_(rank) {}
ProcessGroup::~ProcessGroup() = default;

std::shared_ptr<ProcessGroup> ProcessGroup::create(const GroupOptions& options, int global_rank,
                                                   c10::intrusive_ptr<c10d::Store> store,
                                                   const std::string& store_prefix) {
  auto it = std::find(options.ranks.begin(), options.ranks.end(), global_rank);
  TORCH_CHECK(it != options.ranks.end(), "rank ", global_rank, " is not in group '", options.name,
              "' (ranks ", join(options.ranks), ")");
  int rank = static_cast<int>(it - options.ranks.begin());
  std::shared_ptr<ProcessGroup> group(new ProcessGroup(options, rank));
  group->store_ = store;
  group->store_prefix_ = store_prefix.empty() ? options.name : store_prefix;
  if (options.ranks.size() > 1 && !options.planned) {
    TORCH_CHECK(store, "group '", options.name, "' needs a rendezvous store");
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("group/" + group->store_prefix_, store);
    group->impl_ = std::make_unique<Impl>();
    try {
      group->impl_->group = compat::make_c10d_group(options.backend, prefixed, rank,
                                                    static_cast<int>(options.ranks.size()), options.timeout);
    } catch (const std::exception& e) {
      group->fail("rendezvous", util::message_of(e));
    }
    group->book_ = std::make_unique<ledger::Book>(options.name, group->store_prefix_, options.ranks, rank);
  }
  return group;
}

void ProcessGroup::renew() {
  if (!impl_) return;
  // Never destroyed: destroying a Gloo group waits for its pending collectives.
  static auto* retired = new std::vector<c10::intrusive_ptr<compat::C10dGroup>>();
  std::string prefix = "group/" + store_prefix_ + "/renewed/" + std::to_string(++renewals_);
  c10::intrusive_ptr<compat::C10dGroup> fresh;
  try {
    fresh = compat::make_c10d_group(options_.backend, c10::make_intrusive<c10d::PrefixStore>(prefix, store_), rank_,
                                    size(), options_.timeout);
  } catch (const std::exception& e) {
    fail("rendezvous (renewing the group)", util::message_of(e));
  }
  retired->push_back(std::move(impl_->group));
  impl_->group = std::move(fresh);
  started_ = 0;
  sequence_ = 0;  // the check's call numbers start level too
  if (book_) book_->restart();
}

std::string ProcessGroup::describe() const {
  return "group '" + options_.name + "' (ranks " + join(options_.ranks) + ")";
}

void ProcessGroup::fail(const std::string& op, const std::string& why) const {
  TORCH_CHECK(false, op, " on ", describe(), " failed on rank ", options_.ranks[rank_], ": ", why);
}

namespace {
// Whether `t` cannot travel as it is on `backend` (bfloat16 on Gloo): it goes as float32.
bool lacks_bfloat16(const Tensor& t, const std::string& backend) {
  return t.scalar_type() == torch::kBFloat16 && backend == "gloo";
}
}  // namespace

void ProcessGroup::check(const Tensor& t, const std::string& op) const {
  TORCH_CHECK(t.defined(), op, " on ", describe(), ": the tensor is undefined");
  TORCH_CHECK(t.is_contiguous(), op, " on ", describe(), ": the tensor must be contiguous");
}

Work ProcessGroup::start(const std::string& op, c10::intrusive_ptr<c10d::Work> work,
                         std::function<void()> after, int64_t ticket) const {
  return Work(shared_from_this(), op, std::move(work), std::move(after), ticket);
}

Work ProcessGroup::run(const std::string& op, const std::function<c10::intrusive_ptr<c10d::Work>()>& launch,
                       bool async, std::function<void()> after, int64_t ticket) const {
  Work w;
  try {
    ++started_;
    w = start(op, launch(), std::move(after), ticket);
  } catch (const std::exception& e) {
    ledger_set(ticket, ledger::State::Failed);
    fail(op, util::message_of(e));
  }
  if (!async) w.wait();
  return w;
}

namespace {
const char* op_names[] = {"?", "all_reduce(sum)", "all_reduce(mean)", "all_reduce(min)", "all_reduce(max)",
                          "all_reduce(product)", "broadcast", "all_gather", "barrier"};
constexpr int kRecord = 16;  // call, op, dtype, ndim, 7 dims and a fold of any more, site, root, reduce, 1 spare
}  // namespace

int64_t ProcessGroup::verify(int op_code, const std::string& op, const Tensor& t, ledger::Op lop, bool collective,
                             int64_t root, int reduce, int peer, int tag) const {
  if (!impl_) return -1;
  const bool full_check = check_collectives();
  const bool checking = collective && (full_check || agreed_calls > 0);
  char site_text[ledger::kSite];
  ledger::fill_site(site_text);  // the script's line, or the end-of-run barrier's "(end of run)"
  const int64_t ticket =
      book_ ? book_->start(lop, reduce, t.defined() ? static_cast<int>(t.scalar_type()) : -1, t.defined() ? t.numel() : 0,
                           t.defined() ? static_cast<int64_t>(t.nbytes()) : 0,
                           peer >= 0 ? options_.ranks[peer] : -1, tag, site_text)
            : -1;
  std::string site = site_text;
  std::string mine_text = std::string(op_code >= 1 && op_code <= 8 ? op_names[op_code] : op.c_str()) +
                          (op_code == 6 ? " from group rank " + std::to_string(root) : "") +
                          (t.defined() ? " of " + describe_tensor(t) : "") + (site.empty() ? "" : " at " + site);
  note_call(mine_text + " on " + describe());
  if (!checking) return ticket;
  int64_t seq = sequence_++;
  auto mine = torch::zeros({kRecord}, torch::kInt64);
  auto* m = mine.data_ptr<int64_t>();
  m[0] = seq;
  m[1] = op_code;
  m[2] = t.defined() ? int64_t(t.scalar_type()) : -1;
  m[3] = t.defined() ? t.dim() : -1;
  for (int64_t d = 0; t.defined() && d < t.dim(); ++d) {
    if (d < 7) m[4 + d] = t.size(d);
    else m[11] = m[11] * 1000003 + t.size(d);
  }
  m[12] = full_check ? hash_text(site) : 0;  // an agreed call may come from another line
  m[13] = root;
  m[14] = reduce;  // the reduce-scatters' op codes are one for every reduce op
  // Built on the host, exchanged on this rank's device (NCCL takes device tensors only), read
  // back on the host.
  const auto device = World::instance().device();
  auto gather = [&](const Tensor& host) {
    auto in = host.to(device);
    std::vector<std::vector<Tensor>> outputs(1);
    for (int i = 0; i < size(); ++i) outputs[0].push_back(torch::empty_like(in));
    std::vector<Tensor> inputs{in};
    try {
      ++started_;
      ledger_set(ticket, ledger::State::Waiting);
      auto w = impl_->group->allgather(outputs, inputs);
      wait_for(*w, options_.timeout);
      ledger_set(ticket, ledger::State::Started);
    } catch (const std::exception& e) {
      std::string why = util::message_of(e);
      ledger_set(ticket, why.find("imed out") != std::string::npos ? ledger::State::TimedOut : ledger::State::Failed);
      fail(op + " (checking that every rank calls it)", why);
    }
    for (auto& out : outputs[0]) out = out.cpu();
    return outputs[0];
  };
  auto all = gather(mine);
  bool same = true;
  for (const auto& other : all) same = same && other.equal(mine);
  if (same) return ticket;
  // Every rank saw the same records, so every rank is here: gather each one's description (its
  // length first, then the padded bytes) and name the difference.
  mine_text += " (call " + std::to_string(seq) + " on this group)";
  auto lengths = gather(torch::tensor({static_cast<int64_t>(mine_text.size())}, torch::kInt64));
  int64_t longest = 1;
  for (const auto& l : lengths) longest = std::max(longest, l.item<int64_t>());
  auto padded = torch::zeros({longest}, torch::kUInt8);
  std::memcpy(padded.data_ptr<uint8_t>(), mine_text.data(), mine_text.size());
  auto texts = gather(padded);
  std::ostringstream msg;
  msg << "the ranks called different collectives:";
  for (int r = 0; r < size(); ++r)
    msg << "\n  rank " << options_.ranks[r] << ": "
        << std::string(reinterpret_cast<const char*>(texts[r].data_ptr<uint8_t>()), lengths[r].item<int64_t>());
  msg << "\n  Every rank of a group must run the same collectives in the same order, with the same shapes and "
      << (full_check ? "dtypes, from the same script line."
                     : "dtypes (pt.dist's collectives check this; --check-collectives checks every collective, and "
                       "the script line).");
  ledger_set(ticket, ledger::State::Failed);
  fail(op, msg.str());
}

void ProcessGroup::record(const char* op, int64_t bytes) const {
  std::lock_guard<std::mutex> lock(traffic_mutex_);
  auto& t = traffic_[op];
  ++t.calls;
  t.bytes += bytes;
}

std::map<std::string, ProcessGroup::Traffic> ProcessGroup::traffic() const {
  std::lock_guard<std::mutex> lock(traffic_mutex_);
  return traffic_;
}

void ProcessGroup::reset_traffic() const {
  std::lock_guard<std::mutex> lock(traffic_mutex_);
  traffic_.clear();
}

Tensor ProcessGroup::bytes_for_gloo(const Tensor& t) const {
  // Gloo moves no bfloat16; float16 has its size, and a broadcast or gather copies bits unchanged.
  return options_.backend == "gloo" && t.scalar_type() == torch::kBFloat16 ? t.view(torch::kHalf) : t;
}

Work ProcessGroup::all_reduce(Tensor& t, ReduceOp op, bool async) const {
  return reduce(t, op, async, "all_reduce");
}

Work ProcessGroup::reduce(Tensor& t, ReduceOp op, bool async, const char* name) const {
  check(t, name);
  // The reduce-scatter of stacked inputs is agreed on as itself (code 11), not as the all-reduce
  // that carries it: a rank's all-reduce of the same shape is another call.
  const bool scatter = std::strcmp(name, "reduce_scatter") == 0;
  const std::string label = scatter ? "reduce_scatter(" + to_string(op) + ")" : name;
  const int64_t ticket = verify(scatter ? 11 : 1 + static_cast<int>(op), label, t,
                                scatter ? ledger::Op::ReduceScatter : ledger::Op::AllReduce, true, 0, 1 + static_cast<int>(op));
  // What travels: over Gloo a bfloat16 tensor is summed as float32 and rounded once, written back
  // when the collective completes (Gloo's own bfloat16 sum would round at every step of its ring).
  Tensor wire = lacks_bfloat16(t, options_.backend) ? t.to(torch::kFloat32) : t;
  std::function<void()> after;
  const bool mean = op == ReduceOp::Mean && size() > 1;
  if (mean || !wire.is_same(t))
    after = [t, wire, mean, n = size()]() mutable {
      if (mean) wire.div_(n);
      if (!wire.is_same(t)) t.copy_(wire);
    };
  if (recorded_only()) record(name, static_cast<int64_t>(t.nbytes()));
  if (!impl_) return Work();
  record(name, static_cast<int64_t>(t.nbytes()));
  std::vector<Tensor> ts{wire};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d_op(op);
  o.timeout = options_.timeout;
  return run(std::string(name) + "(" + to_string(op) + ")", [&] { return impl_->group->allreduce(ts, o); }, async, after,
             ticket);
}

Work ProcessGroup::broadcast(Tensor& t, int root, bool async) const {
  check(t, "broadcast");
  TORCH_CHECK(root >= 0 && root < size(), "broadcast on ", describe(), ": root ", root, " is not a group rank (0..",
              size() - 1, ")");
  const int64_t ticket = verify(6, "broadcast", t, ledger::Op::Broadcast, true, root);
  if (recorded_only()) record("broadcast", static_cast<int64_t>(t.nbytes()));
  if (!impl_) return Work();
  record("broadcast", static_cast<int64_t>(t.nbytes()));
  Tensor wire = lacks_bfloat16(t, options_.backend) ? t.to(torch::kFloat32) : t;  // exact both ways
  std::vector<Tensor> ts{wire};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  o.timeout = options_.timeout;
  std::function<void()> after;
  if (!wire.is_same(t)) after = [t, wire]() mutable { t.copy_(wire); };
  return run("broadcast", [&] { return impl_->group->broadcast(ts, o); }, async, after, ticket);
}

Work ProcessGroup::all_gather(const Tensor& t, std::vector<Tensor>& out, bool async) const {
  check(t, "all_gather");
  const int64_t ticket = verify(7, "all_gather", t, ledger::Op::AllGather);
  out.clear();
  if (recorded_only()) {
    record("all_gather", static_cast<int64_t>(t.nbytes()) * size());
    for (int i = 0; i < size(); ++i) out.push_back(torch::empty_like(t));
    return Work();
  }
  if (!impl_) {
    out.push_back(t.clone());
    return Work();
  }
  record("all_gather", static_cast<int64_t>(t.nbytes()) * size());
  // Gloo divides by the bytes each rank gives: empty tensors meet with a byte each instead.
  auto byte = [&] { return torch::zeros({1}, t.options().dtype(torch::kUInt8)); };
  const bool empty = t.numel() == 0;
  std::vector<std::vector<Tensor>> outputs(1);
  for (int i = 0; i < size(); ++i) {
    out.push_back(torch::empty_like(t));
    outputs[0].push_back(empty ? byte() : bytes_for_gloo(out.back()));  // views of `out`: filled when the work completes
  }
  std::vector<Tensor> inputs{empty ? byte() : bytes_for_gloo(t)};
  return run("all_gather", [&] { return impl_->group->allgather(outputs, inputs); }, async, {}, ticket);
}

std::vector<Tensor> ProcessGroup::all_gather(const Tensor& t) const {
  std::vector<Tensor> out;
  all_gather(t, out, false);
  return out;
}

Work ProcessGroup::reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs, ReduceOp op, bool async) const {
  TORCH_CHECK(static_cast<int>(inputs.size()) == size(), "reduce_scatter on ", describe(), ": needs ", size(),
              " inputs (one a rank), got ", inputs.size());
  for (const auto& in : inputs)
    TORCH_CHECK(in.sizes().equals(output.sizes()), "reduce_scatter on ", describe(),
                ": every input must have the output's shape ", output.sizes(), ", got ", in.sizes());
  // Gloo has no reduce-scatter: reduce everything and keep this rank's part. It moves size()
  // times the bytes a ring reduce-scatter would; NCCL builds can use the native one.
  Tensor all = torch::stack(inputs);
  Work w = reduce(all, op, /*async=*/true, "reduce_scatter");
  Work done(shared_from_this(), "reduce_scatter", c10::intrusive_ptr<c10d::Work>(), [w, all, output, r = rank_]() mutable {
    w.wait();
    output.copy_(all[r]);
  });
  if (!async) done.wait();
  return done;
}

namespace {
// The channel the rings' sends use, apart from any tag a caller gives its own point-to-point.
constexpr int kRingTag = ledger::kRingTag;

// acc = op(acc, other), in place, for a ring step's partial reduction (Mean sums, divided at the end).
void combine(Tensor& acc, const Tensor& other, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Mean: acc.add_(other); break;
    case ReduceOp::Min: torch::minimum_out(acc, acc, other); break;
    case ReduceOp::Max: torch::maximum_out(acc, acc, other); break;
    case ReduceOp::Product: acc.mul_(other); break;
  }
}
}  // namespace

int64_t ProcessGroup::flat_part(const Tensor& flat, const std::string& op) const {
  check(flat, op);
  TORCH_CHECK(flat.dim() == 1 && flat.numel() % size() == 0, op, " on ", describe(), ": needs a flat tensor whose ",
              "length is a multiple of ", size(), ", got shape ", flat.sizes());
  return flat.numel() / size();
}

Tensor ProcessGroup::reduce_scatter_flat(Tensor& flat, ReduceOp op) const {
  const int64_t part = flat_part(flat, "reduce_scatter");
  const int p = size();
  auto part_of = [&](int r) { return flat.narrow(0, ((r % p) + p) % p * part, part); };
  Tensor mine = part_of(rank_);
  if (p == 1) return mine;
  if (!needs_inbox() && impl_) {  // NCCL: its own, waited for here
    Tensor none;
    start_reduce_scatter_flat(flat, op, none).wait();
    return mine;
  }
  const int64_t ticket =
      verify(9, "reduce_scatter(" + to_string(op) + ")", flat, ledger::Op::ReduceScatter, true, 0, 1 + static_cast<int>(op));
  // The ring: at step s rank r sends part r-s-1 to r+1 and combines part r-s-2 from r-1 into its
  // own copy; after p-1 steps part r has passed through every rank and ends on rank r. The ledger
  // has the reduce-scatter and each step's send and receive.
  const int next = (rank_ + 1) % p, prev = (rank_ + p - 1) % p;
  Tensor incoming = torch::empty_like(mine);
  try {
    for (int s = 0; s < p - 1; ++s) {
      Work sent = send(part_of(rank_ - s - 1), next, /*async=*/true, kRingTag);
      recv(incoming, prev, /*async=*/false, kRingTag);
      auto acc = part_of(rank_ - s - 2);
      combine(acc, incoming, op);
      sent.wait();
    }
  } catch (...) {
    ledger_set(ticket, ledger::State::Failed);
    throw;
  }
  ledger_set(ticket, ledger::State::Completed);
  if (op == ReduceOp::Mean) mine.div_(p);
  return mine;
}

Work ProcessGroup::start_reduce_scatter_flat(Tensor& flat, ReduceOp op, Tensor& inbox) const {
  const int64_t part = flat_part(flat, "reduce_scatter");
  const int p = size();
  TORCH_CHECK(!needs_inbox() || (inbox.defined() && inbox.is_contiguous() && inbox.sizes().equals(flat.sizes()) &&
                                  inbox.scalar_type() == flat.scalar_type() && inbox.device() == flat.device()),
              "reduce_scatter on ", describe(), ": the inbox must be a contiguous tensor of the flat tensor's shape ",
              flat.sizes(), ", dtype and device");
  Tensor mine = flat.narrow(0, rank_ * part, part);
  if (p == 1) return Work();
  // Agreed on, and in the ledger, as the ring's reduce-scatter is: the same call.
  const int64_t ticket =
      verify(9, "reduce_scatter(" + to_string(op) + ")", flat, ledger::Op::ReduceScatter, true, 0, 1 + static_cast<int>(op));
  if (recorded_only()) record("reduce_scatter", static_cast<int64_t>(flat.nbytes()));
  if (!impl_) return Work();
  record("reduce_scatter", static_cast<int64_t>(flat.nbytes()));  // as the blocking one records it
  const std::string name = "reduce_scatter(" + to_string(op) + ")";
  if (!needs_inbox()) {  // NCCL
    std::vector<Tensor> out{torch::empty_like(mine)};
    std::vector<std::vector<Tensor>> in{flat.chunk(p)};
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d_op(op == ReduceOp::Mean ? ReduceOp::Sum : op);
    o.timeout = options_.timeout;
    return run(name, [&] { return impl_->group->reduce_scatter(out, in, o); }, /*async=*/true,
               [mine, got = out[0], op, p]() mutable {
                 mine.copy_(got);
                 if (op == ReduceOp::Mean) mine.div_(p);
               },
               ticket);
  }
  std::vector<int64_t> equal;  // equal splits: part j of `flat` goes to rank j
  c10d::AllToAllOptions o;
  o.timeout = options_.timeout;
  auto wire_in = bytes_for_gloo(flat), wire_out = bytes_for_gloo(inbox);
  return run(name, [&] { return impl_->group->alltoall_base(wire_out, wire_in, equal, equal, o); }, /*async=*/true,
             [mine, inbox, op, p, part]() mutable {
               // Every rank's part r, combined in group-rank order (the same order on every rank).
               mine.copy_(inbox.narrow(0, 0, part));
               for (int j = 1; j < p; ++j) combine(mine, inbox.narrow(0, j * part, part), op);
               if (op == ReduceOp::Mean) mine.div_(p);
             },
             ticket);
}

void ProcessGroup::all_gather_flat(Tensor& flat) const {
  const int64_t part = flat_part(flat, "all_gather");
  const int p = size();
  if (p == 1) return;
  auto part_of = [&](int r) { return flat.narrow(0, ((r % p) + p) % p * part, part); };
  const int64_t ticket = verify(10, "all_gather(flat)", flat, ledger::Op::AllGather);
  if (options_.backend == "nccl" && impl_) {
    record("all_gather", static_cast<int64_t>(flat.nbytes()));
    std::vector<std::vector<Tensor>> out{flat.chunk(p)};
    std::vector<Tensor> in{part_of(rank_).clone()};
    run("all_gather", [&] { return impl_->group->allgather(out, in); }, /*async=*/false, {}, ticket);
    return;
  }
  // The ring: at step s rank r passes on part r-s (its own first, then the one it just got).
  const int next = (rank_ + 1) % p, prev = (rank_ + p - 1) % p;
  try {
    for (int s = 0; s < p - 1; ++s) {
      Work sent = send(part_of(rank_ - s), next, /*async=*/true, kRingTag);
      Tensor into = part_of(rank_ - s - 1);
      recv(into, prev, /*async=*/false, kRingTag);
      sent.wait();
    }
  } catch (...) {
    ledger_set(ticket, ledger::State::Failed);
    throw;
  }
  ledger_set(ticket, ledger::State::Completed);
}

namespace {
// A described send's header: its own channel beside the tensor's (tags below it are the caller's).
constexpr int kHeaderTag = 1 << 24;
}  // namespace

Work ProcessGroup::send(const Tensor& t, int dst, bool async, int tag, bool described) const {
  check(t, "send");
  TORCH_CHECK(dst >= 0 && dst < size() && dst != rank_, "send on ", describe(), ": bad destination ", dst);
  TORCH_CHECK(tag >= 0 && tag < kHeaderTag, "send on ", describe(), ": tag must be in [0, 2^24), got ", tag);
  if (impl_ || recorded_only()) record("send", static_cast<int64_t>(t.nbytes()));
  if (recorded_only()) return Work();
  const int64_t ticket =
      verify(0, "send to group rank " + std::to_string(dst), t, ledger::Op::Send, /*collective=*/false, 0, 0, dst, tag);
  std::function<void()> after;
  if (described && impl_) {
    // Posted first and waited last, never alone: a rank that sends before it receives (a ring)
    // must not block on its header.
    std::vector<Tensor> header{
        torch::tensor({int64_t(t.scalar_type()), t.numel()}, torch::kInt64).to(World::instance().device())};
    auto sent = impl_->group->send(header, dst, kHeaderTag + tag);
    after = [sent, header, timeout = options_.timeout] { wait_for(*sent, timeout); };
  }
  std::vector<Tensor> ts{t};
  return run("send", [&] { return impl_->group->send(ts, dst, tag); }, async, std::move(after), ticket);
}

Work ProcessGroup::recv(Tensor& t, int src, bool async, int tag, bool described) const {
  check(t, "recv");
  TORCH_CHECK(src >= 0 && src < size() && src != rank_, "recv on ", describe(), ": bad source ", src);
  TORCH_CHECK(tag >= 0 && tag < kHeaderTag, "recv on ", describe(), ": tag must be in [0, 2^24), got ", tag);
  if (impl_ || recorded_only()) record("recv", static_cast<int64_t>(t.nbytes()));
  if (recorded_only()) return Work();
  const int64_t ticket =
      verify(0, "recv from group rank " + std::to_string(src), t, ledger::Op::Recv, /*collective=*/false, 0, 0, src, tag);
  std::function<void()> after;
  if (described && impl_) {
    std::vector<Tensor> header{torch::zeros({2}, torch::kInt64).to(World::instance().device())};
    auto got = impl_->group->recv(header, src, kHeaderTag + tag);
    after = [got, header, timeout = options_.timeout, dtype = t.scalar_type(), numel = t.numel(), src,
             where = describe()] {
      wait_for(*got, timeout);
      auto h = header[0].cpu();
      const auto sent_dtype = static_cast<c10::ScalarType>(h[0].item<int64_t>());
      const int64_t sent_numel = h[1].item<int64_t>();
      TORCH_CHECK(sent_dtype == dtype && sent_numel == numel, "recv from group rank ", src, " on ", where,
                  ": it sent ", sent_numel, " ", dtype_name(sent_dtype), " elements; this tensor holds ", numel, " ",
                  dtype_name(dtype), " (a send and its recv must agree in dtype and element count)");
    };
  }
  std::vector<Tensor> ts{t};
  return run("recv", [&] { return impl_->group->recv(ts, src, tag); }, async, std::move(after), ticket);
}

Work ProcessGroup::barrier(bool async) const {
  const int64_t ticket = verify(8, "barrier", Tensor(), ledger::Op::Barrier);
  if (!impl_) return Work();
  c10d::BarrierOptions o;
  o.timeout = options_.timeout;
  return run("barrier", [&] { return impl_->group->barrier(o); }, async, {}, ticket);
}

void ProcessGroup::recorded_wait(const std::function<void()>& wait) const {
  char site[ledger::kSite];
  ledger::fill_site(site);
  const int64_t ticket = book_ ? book_->start(ledger::Op::Barrier, 0, -1, 0, 0, -1, 0, site) : -1;
  ledger_set(ticket, ledger::State::Waiting);
  try {
    wait();
  } catch (...) {
    ledger_set(ticket, ledger::State::TimedOut);
    throw;
  }
  ledger_set(ticket, ledger::State::Completed);
}

std::vector<std::string> all_gather_strings(const GroupPtr& group, const std::string& mine) {
  if (!group || group->size() == 1) return {mine};
  const auto device = World::instance().device();  // exchanged there, read on the host
  auto length = torch::tensor({static_cast<int64_t>(mine.size())}, torch::kInt64).to(device);
  auto lengths = group->all_gather(length);
  for (auto& l : lengths) l = l.cpu();
  int64_t longest = 1;
  for (const auto& l : lengths) longest = std::max(longest, l.item<int64_t>());
  auto padded = torch::zeros({longest}, torch::kUInt8);
  if (!mine.empty()) std::memcpy(padded.data_ptr<uint8_t>(), mine.data(), mine.size());
  padded = padded.to(device);
  auto all = group->all_gather(padded);
  for (auto& part : all) part = part.cpu();
  std::vector<std::string> out;
  for (size_t r = 0; r < all.size(); ++r)
    out.emplace_back(reinterpret_cast<const char*>(all[r].data_ptr<uint8_t>()), lengths[r].item<int64_t>());
  return out;
}

bool any_rank(const GroupPtr& group, bool mine) {
  if (!group || group->size() == 1) return mine;
  auto flag = torch::tensor({mine ? 1 : 0}, torch::kInt32).to(World::instance().device());
  group->all_reduce(flag, ReduceOp::Max);
  return flag.item<int>() != 0;
}

// ---- World ---------------------------------------------------------------------------------

namespace {

// The variable's value, or nullptr.
const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int env_int(const char* name, int fallback, int lo, int hi) {
  const char* v = env(name);
  if (!v) return fallback;
  char* end = nullptr;
  errno = 0;
  long x = std::strtol(v, &end, 10);
  // strtol skips leading spaces and takes a sign: "' 0'" and "+1" are not the integers written.
  TORCH_CHECK(std::isdigit(static_cast<unsigned char>(v[0])) && end && *end == '\0' && errno == 0 && x >= lo && x <= hi,
              "environment variable ", name, "='", v, "' is not an integer in [", lo, ", ", hi, "]");
  return static_cast<int>(x);
}

// PARTRAIN_BACKEND, else the device's own: NCCL for CUDA where partrain has it, Gloo otherwise.
std::string backend_for(const WorldOptions& o) {
  if (const char* b = env("PARTRAIN_BACKEND")) return b;
#ifdef PARTRAIN_WITH_NCCL
  if (resolve_device(o.device, o.local_rank).is_cuda()) return "nccl";
#else
  (void)o;
#endif
  return "gloo";
}

}  // namespace

namespace {
// The CUDA index a spec names: -1 for cpu (or none given), local_rank for "cuda".
int device_index_of(const std::string& spec, int local_rank) {
  const std::string expected = " (expected cpu, cuda or cuda:N)";
  if (spec.empty() || spec == "cpu") return -1;
  TORCH_CHECK(spec.rfind("cuda", 0) == 0, "unknown device '", spec, "'", expected);
  if (spec == "cuda") return local_rank;
  const std::string digits = spec.substr(4 + (spec.size() > 4 && spec[4] == ':' ? 1 : 0));
  bool ok = spec.size() > 5 && spec[4] == ':' && digits.size() <= 4 &&
            digits.find_first_not_of("0123456789") == std::string::npos;
  TORCH_CHECK(ok, "unknown device '", spec, "'", expected);
  return std::stoi(digits);
}
}  // namespace

void check_device_spec(const std::string& spec) {
  int index = device_index_of(spec, 0);
  if (index < 0) return;
#ifndef PARTRAIN_WITH_CUDA
  // A CPU build never starts CUDA (compat::cuda_available is false there): refused now.
  resolve_device(spec, 0);
#else
  // Asking the CUDA runtime would start it in the launcher; the driver's devices tell whether
  // there can be a GPU at all (/dev/nvidiactl, or /dev/dxg under WSL2). Where they are, the ranks
  // check the index against the devices.
  struct stat st {};
  TORCH_CHECK(::stat("/dev/nvidiactl", &st) == 0 || ::stat("/dev/dxg", &st) == 0, "device '", spec,
              "' needs CUDA, but this machine has no NVIDIA GPU driver (no /dev/nvidiactl; use --device cpu)");
#endif
}

torch::Device resolve_device(const std::string& spec, int local_rank) {
  if (spec.empty() && !compat::cuda_available()) return torch::kCPU;
  int index = device_index_of(spec.empty() ? "cuda" : spec, local_rank);
  if (index < 0) return torch::kCPU;
  TORCH_CHECK(compat::cuda_available(), "device '", spec, "' needs CUDA, but ",
              "this LibTorch sees no CUDA device (use --device cpu)");
  int count = compat::cuda_device_count();
  // No spec: cuda:<local rank>, as "cuda" says; on fewer devices than local ranks, --device names one.
  TORCH_CHECK(index < count, "device '", spec.empty() ? "cuda" : spec, "' is cuda:", index, " but this machine has ",
              count, " CUDA device(s)",
              spec.empty() || spec == "cuda" ? " (one a local rank: start fewer ranks a node, or give --device cuda:0)"
                                             : "");
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

WorldOptions world_options_from_env() {
  WorldOptions o;
  bool has_rank = env("RANK") != nullptr, has_world = env("WORLD_SIZE") != nullptr;
  TORCH_CHECK(has_rank == has_world, "RANK and WORLD_SIZE must be set together (only ",
              has_rank ? "RANK" : "WORLD_SIZE", " is set)");
  if (env("PARTRAIN_TIMEOUT")) o.timeout = std::chrono::seconds(env_int("PARTRAIN_TIMEOUT", 300, 1, 7 * 24 * 3600));
  if (const char* d = std::getenv("PARTRAIN_DEVICE")) {
    o.device = d;
    try {
      resolve_device(o.device, 0);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "PARTRAIN_DEVICE: ", e.what_without_backtrace());
    }
  }
  if (const char* secret = env("PARTRAIN_RDZV_SECRET")) {  // never printed
    o.secret = secret;
    TORCH_CHECK(o.secret.size() >= kMinSecret && o.secret.size() <= kMaxSecret, "environment variable "
                "PARTRAIN_RDZV_SECRET holds ", o.secret.size(), " bytes (expected ", kMinSecret, " to ", kMaxSecret,
                ": 128 bits or more)");
  }
  if (env("PARTRAIN_RDZV_FD")) o.listen_fd = env_int("PARTRAIN_RDZV_FD", -1, 3, 1 << 20);
  if (!has_rank) {
    o.backend = backend_for(o);
    return o;
  }
  o.world_size = env_int("WORLD_SIZE", 1, 1, 1 << 20);
  o.rank = env_int("RANK", 0, 0, o.world_size - 1);
  o.local_rank = env_int("LOCAL_RANK", o.rank, 0, o.world_size - 1);
  o.local_world_size = env_int("LOCAL_WORLD_SIZE", o.world_size, 1, o.world_size);
  if (o.world_size > 1) {
    TORCH_CHECK(env("MASTER_ADDR"), "RANK=", o.rank, " and WORLD_SIZE=", o.world_size,
                " are set but MASTER_ADDR is not: set MASTER_ADDR and MASTER_PORT to where rank 0 "
                "serves the rendezvous (as torchrun does)");
    TORCH_CHECK(env("MASTER_PORT"), "RANK=", o.rank, " and WORLD_SIZE=", o.world_size,
                " are set but MASTER_PORT is not");
    o.master_addr = env("MASTER_ADDR");
    o.master_port = env_int("MASTER_PORT", 29500, 1, 65535);
  }
  o.backend = backend_for(o);
  return o;
}

World& World::instance() {
  static World world;
  return world;
}

namespace {
// The ranks in [first, n) whose key(rank) `store` lacks, as "rank 2" or "ranks 1, 3" ("" when it
// has them all), and how many.
std::pair<std::string, int> ranks_without(c10d::Store& store, int first, int n, std::string (*key)(int)) {
  std::string list;
  int count = 0;
  for (int r = first; r < n; ++r)
    if (!store.check({key(r)})) list += (count++ ? ", " : "") + std::to_string(r);
  return {count ? (count == 1 ? "rank " : "ranks ") + list : list, count};
}

std::string arrived_key(int rank) { return "partrain/arrived/" + std::to_string(rank); }
}  // namespace

void World::init(const WorldOptions& options) {
  TORCH_CHECK(!initialized_, "the world is already initialized");
  options_ = options;
  // The device first: a bad one is refused before any rank waits on the rendezvous.
  device_ = options.planned ? torch::Device(torch::kCPU) : resolve_device(options.device, options.local_rank);
  compat::use_device(*device_);  // before the groups: NCCL binds to the current device
  groups_.clear();
  if (options.world_size > 1 && !options.planned) {
    this_rank = options.rank;
    install_terminate_handler();
    // One deadline for all of it: a rank that never comes is named within one timeout, and a
    // lone rank does not wait a second timeout after the first.
    const auto deadline = std::chrono::steady_clock::now() + options.timeout;
    StoreOptions so;
    so.host = options.master_addr;
    so.port = options.master_port;
    so.secret = options.secret;
    so.timeout = options.timeout;
    const auto where = options.master_addr + ":" + std::to_string(options.master_port);
    util::startup_mark("rendezvous: " + std::string(options.rank == 0 ? "serving and joining " : "joining ") + where);
    try {
      if (options.rank == 0) {
        so.listen_fd = options.listen_fd;
        server_ = std::make_unique<StoreServer>(so);
        so.listen_fd = -1;
      } else if (options.listen_fd >= 0) {
        ::close(options.listen_fd);  // only rank 0 serves
      }
      store_ = c10::make_intrusive<RendezvousStore>(so, deadline);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "rendezvous at ", where, (options.rank == 0 ? " (serving it)" : ""),
                  " failed: ", util::message_of(e),
                  options.rank == 0 ? std::string()
                                    : " (rank 0 serves the rendezvous: it never started serving it within the timeout, "
                                      "or the address is wrong)");
    }
    // Every rank says it has arrived and waits for the others: a rank that never comes is named.
    std::vector<std::string> arrivals;
    for (int r = 0; r < options.world_size; ++r) arrivals.push_back(arrived_key(r));
    try {
      store_->set(arrivals[options.rank], std::vector<uint8_t>{1});
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      store_->wait(arrivals, std::max(left, std::chrono::milliseconds(1)));
    } catch (const std::exception& e) {
      std::pair<std::string, int> missing;
      try {
        missing = ranks_without(*store_, 0, options.world_size, arrived_key);
      } catch (const std::exception&) {
        missing = {};  // the store itself is gone (rank 0 ended): say what failed
      }
      TORCH_CHECK(false, "rendezvous at ", where, " failed: ",
                  missing.second == 0
                      ? util::message_of(e) + (options.rank == 0 ? "" : " (rank 0, which serves the "
                                                 "rendezvous, is gone: its error says which ranks never arrived)")
                      : missing.first + (missing.second == 1 ? " has" : " have") + " not arrived within the timeout of " +
                                        std::to_string(options.timeout.count() / 1000) + " s (world of " +
                                        std::to_string(options.world_size) + "; raise it with --timeout)");
    }
  }
  std::vector<int> all(options.world_size);
  for (int i = 0; i < options.world_size; ++i) all[i] = i;
  util::startup_mark("rendezvous: every rank arrived");
  GroupOptions g{"world", all, options.timeout, options.backend, options.planned};
  world_ = ProcessGroup::create(g, options.rank, store_);
  groups_.push_back(world_);
  initialized_ = true;
  util::startup_mark("group 'world' created");
}

torch::Device World::device() const {
  if (!device_) {
    if (initialized_) {
      device_ = options_.planned ? torch::Device(torch::kCPU) : resolve_device(options_.device, options_.local_rank);
    } else {
      auto o = world_options_from_env();
      device_ = resolve_device(o.device, o.local_rank);
    }
    compat::use_device(*device_);
  }
  return *device_;
}

GroupPtr World::world() const {
  TORCH_CHECK(initialized_, "the world is not initialized");
  return world_;
}

GroupPtr World::new_group(const std::string& name, const std::vector<int>& ranks) {
  TORCH_CHECK(initialized_, "the world is not initialized");
  for (int r : ranks)
    TORCH_CHECK(r >= 0 && r < options_.world_size, "group '", name, "': rank ", r, " is outside the world of ",
                options_.world_size);
  // A unique store prefix even when names repeat (a second mesh, say).
  std::string unique = std::to_string(groups_made_++) + ":" + name;
  if (std::find(ranks.begin(), ranks.end(), options_.rank) == ranks.end()) return nullptr;
  auto group = ProcessGroup::create(GroupOptions{name, ranks, options_.timeout, options_.backend, options_.planned},
                                    options_.rank, store_, unique);
  groups_.push_back(group);
  if (ranks.size() > 1) util::startup_mark("group '" + name + "' created");
  return group;
}

std::vector<GroupPtr> World::groups() const {
  std::vector<GroupPtr> alive;
  for (const auto& w : groups_)
    if (auto g = w.lock()) alive.push_back(g);
  return alive;
}

void World::shutdown() {
  if (!initialized_) return;
  if (world_ && world_->size() > 1 && store_) end_of_run();
  world_.reset();
  store_.reset();
  server_.reset();
  groups_.clear();
  initialized_ = false;
}

// Each rank says in the store that its script has ended and leaves; rank 0, which serves the
// store, waits for all of them first. So a rank may end early (os.exit(0)) and rank 0 may work
// on alone (an evaluation, an export) for as long as it likes: no rank waits for another at the
// end under a timeout. Under the launcher, which ends the run when a rank fails, rank 0's wait has
// no time limit; a rank started by hand has no launcher to watch the others, so there the wait is
// bounded by the timeout.
void World::end_of_run() {
  const int n = options_.world_size;
  try {
    store_->set(ended_key(options_.rank), std::vector<uint8_t>{1});  // rank 0's too: a REPL's ranks watch it
  } catch (const std::exception&) {
    if (options_.rank == 0) throw;
    // The store is gone: rank 0 has ended, so nobody waits for this rank's word.
  }
  if (options_.rank != 0) return;
  std::vector<std::string> others;
  for (int r = 1; r < n; ++r) others.push_back(ended_key(r));
  ledger::SiteOverride site(ledger::kEndOfRun);  // no script line: the script has returned
  const bool watched = ledger::shared();          // a launcher watches every rank
  world_->recorded_wait([&] {
    if (watched) {
      // In slices, each a fresh request: a store wait's timer is finite.
      while (true) {
        try {
          store_->wait(others, std::chrono::minutes(10));
          return;
        } catch (const StoreTimeout&) {
        }
      }
    }
    try {
      store_->wait(others, options_.timeout);
    } catch (const StoreTimeout&) {
      TORCH_CHECK(false, "rank 0 ended its script and waited ", options_.timeout.count() / 1000, " s for ",
                  ranks_without(*store_, 1, n, ended_key).first, " to end (rank 0 serves the ranks' store, so it "
                  "leaves last; with no launcher watching the ranks, this wait is bounded: raise it with --timeout)");
    }
  });
}

// ---- Layout and Mesh -----------------------------------------------------------------------

Layout::Layout(const MeshOptions& o, int world) : tensor(o.tensor), data(o.data), pipeline(o.pipeline) {
  TORCH_CHECK(o.tensor >= 1 && o.pipeline >= 1 && o.data >= 0, "mesh sizes must be positive: tensor=", o.tensor,
              " pipeline=", o.pipeline, " data=", o.data);
  int unit = o.tensor * o.pipeline;
  // What to start instead, when the world is one of too few ranks: the launcher's flag.
  auto start_with = [](int ranks) {
    return " (start it with partrain --nproc-per-node " + std::to_string(ranks) + ")";
  };
  if (data == 0) {
    TORCH_CHECK(world % unit == 0, "mesh: tensor=", o.tensor, " x pipeline=", o.pipeline, " = ", unit,
                " does not divide the world of ", world, " ranks", world < unit ? start_with(unit) : "");
    data = world / unit;
  }
  TORCH_CHECK(unit * data == world, "mesh: tensor=", o.tensor, " x data=", data, " x pipeline=", o.pipeline, " = ",
              unit * data, " ranks, but the world has ", world, world < unit * data ? start_with(unit * data) : "");
  zero = o.zero <= 0 ? data : o.zero;  // <= 0: the whole data group (InternLM's zero1); unset (1): off
  TORCH_CHECK(zero <= data && data % zero == 0, "mesh: zero=", o.zero, " does not divide the data size ", data,
              " (zero <= 0: the whole data group; 1: off; n: groups of n data ranks)");
}

Coord Layout::coord(int rank) const {
  TORCH_CHECK(rank >= 0 && rank < world(), "rank ", rank, " is outside the mesh of ", world());
  return Coord{rank % tensor, (rank / tensor) % data, rank / (tensor * data)};
}

const std::vector<std::string>& Layout::kinds() {
  static const std::vector<std::string> k{"world", "tensor", "data", "pipeline", "unit", "zero"};
  return k;
}

std::vector<int> Layout::group_of(const std::string& kind, int rank) const {
  Coord c = coord(rank);
  std::vector<int> out;
  if (kind == "world") {
    for (int r = 0; r < world(); ++r) out.push_back(r);
  } else if (kind == "tensor") {
    for (int t = 0; t < tensor; ++t) out.push_back(rank_of({t, c.data, c.pipeline}));
  } else if (kind == "data") {
    for (int d = 0; d < data; ++d) out.push_back(rank_of({c.tensor, d, c.pipeline}));
  } else if (kind == "pipeline") {
    for (int p = 0; p < pipeline; ++p) out.push_back(rank_of({c.tensor, c.data, p}));
  } else if (kind == "unit") {
    for (int p = 0; p < pipeline; ++p)
      for (int t = 0; t < tensor; ++t) out.push_back(rank_of({t, c.data, p}));
  } else if (kind == "zero") {
    int first = c.data / zero * zero;
    for (int d = first; d < first + zero; ++d) out.push_back(rank_of({c.tensor, d, c.pipeline}));
  } else if (kind == "zero_across") {
    for (int d = c.data % zero; d < data; d += zero) out.push_back(rank_of({c.tensor, d, c.pipeline}));
  } else {
    TORCH_CHECK(false, "unknown group kind '", kind, "' (expected world, tensor, data, pipeline, unit or zero)");
  }
  return out;
}

std::vector<std::vector<int>> Layout::groups(const std::string& kind) const {
  // Every rank's group, each once, in the order of its lowest rank.
  std::vector<std::vector<int>> out;
  for (int r = 0; r < world(); ++r) {
    auto g = group_of(kind, r);
    if (std::find(out.begin(), out.end(), g) == out.end()) out.push_back(g);
  }
  return out;
}

Mesh::Mesh(const MeshOptions& options, World& world)
    : layout_(options, world.size()), rank_(world.rank()), coord_(layout_.coord(world.rank())) {
  // Every rank makes every group of every kind in the same order; it keeps the ones it is in.
  for (const auto& kind : Layout::kinds()) {
    if (kind == "world") {
      groups_[kind] = world.world();
      continue;
    }
    for (const auto& ranks : layout_.groups(kind)) {
      std::string name = kind + "[" + join(ranks) + "]";
      if (auto g = world.new_group(name, ranks)) groups_[kind] = g;
    }
  }
  // Hierarchical ZeRO only: shards all-reduced across the zero groups.
  if (layout_.zero > 1 && layout_.zero < layout_.data)
    for (const auto& ranks : layout_.groups("zero_across")) {
      std::string name = "zero_across[" + join(ranks) + "]";
      if (auto g = world.new_group(name, ranks)) zero_across_ = g;
    }
}

const GroupPtr& Mesh::group(const std::string& kind) const {
  auto it = groups_.find(kind);
  TORCH_CHECK(it != groups_.end(), "unknown group kind '", kind,
              "' (expected world, tensor, data, pipeline, unit or zero)");
  return it->second;
}

std::string Mesh::describe() const {
  std::ostringstream s;
  s << "mesh tensor=" << layout_.tensor << " data=" << layout_.data << " pipeline=" << layout_.pipeline
    << " zero=" << layout_.zero << " (world " << layout_.world() << "); rank " << rank_ << " at tensor="
    << coord_.tensor << " data=" << coord_.data << " pipeline=" << coord_.pipeline;
  for (const auto& kind : Layout::kinds()) {
    if ((kind == "zero" && layout_.zero == 1) || (kind == "pipeline" && layout_.pipeline == 1)) continue;  // nothing runs
    s << "\n  " << kind << ": ranks " << join(group(kind)->ranks());
  }
  return s.str();
}

}  // namespace partrain::dist
