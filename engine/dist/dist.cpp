// Process groups over c10d (see process_group.hpp): their collectives, each checked, recorded in
// the ledger and bounded by the group's timeout; the flat ones ZeRO uses are flat.cpp, context
// parallelism's exchanges exchange.cpp, the world world.cpp, the mesh mesh.cpp.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <sstream>

#include "engine/dist/c10d_group.hpp"
#include "engine/dist/world.hpp"
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

std::string join_ranks(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? "," : "") + std::to_string(ranks[i]);
  return s;
}

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
}  // namespace

// With an interrupt check installed the wait goes in slices, asking the check between them, so
// that Ctrl-C in the REPL ends a wait no peer will answer; a collective that completes within
// the first slice costs nothing more.
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

void install_terminate_handler(int rank) {
  this_rank = rank;
  std::set_terminate(on_terminate);
}
void set_fatal_reporter(void (*report)(const std::string& message)) { fatal_reporter = report; }

void set_wait_interrupt(bool (*interrupted)()) { wait_interrupt = interrupted; }

// ---- Work ----------------------------------------------------------------------------------

Work::Work(std::shared_ptr<const ProcessGroup> group, std::string op, c10::intrusive_ptr<c10d::Work> work,
           std::function<void()> after, int64_t ticket)
    : group_(std::move(group)), op_(std::move(op)), work_(std::move(work)), after_(std::move(after)), ticket_(ticket) {}

bool Work::done() const {
  if (also_ && !also_->done()) return false;
  if (!work_) return true;
  if (!work_->isCompleted()) return false;
  if (!work_->exception()) group_->ledger_set(ticket_, ledger::State::Completed);  // a failure: wait() says so
  return true;
}

void Work::when_done(std::function<void()> fn) const {
  if (also_) fn = [also = also_, fn = std::move(fn)] { also->when_done(fn); };  // this one, then the other
  if (!work_) {
    fn();
    return;
  }
  try {
    work_->getFuture()->addCallback([fn = std::move(fn)](c10::ivalue::Future&) { fn(); });
  } catch (const std::exception&) {
    // a backend without completion futures: the caller learns of the completion when it waits
  }
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
  if (also_) {
    also_->wait();
    also_.reset();
  }
  if (after_) {
    auto after = std::move(after_);
    after_ = nullptr;
    after();
  }
}

// ---- ProcessGroup --------------------------------------------------------------------------

ProcessGroup::ProcessGroup(GroupOptions options, int rank) : options_(std::move(options)), rank_(rank) {}
ProcessGroup::~ProcessGroup() = default;

std::shared_ptr<ProcessGroup> ProcessGroup::create(const GroupOptions& options, int global_rank,
                                                   c10::intrusive_ptr<c10d::Store> store,
                                                   const std::string& store_prefix) {
  auto it = std::find(options.ranks.begin(), options.ranks.end(), global_rank);
  TORCH_CHECK(it != options.ranks.end(), "rank ", global_rank, " is not in group '", options.name,
              "' (ranks ", join_ranks(options.ranks), ")");
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
  return "group '" + options_.name + "' (ranks " + join_ranks(options_.ranks) + ")";
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

Tensor header_of(const Tensor& t, const torch::Device& device) {
  return torch::tensor({int64_t(t.scalar_type()), t.numel()}, torch::kInt64).to(device);
}

void check_header(const Tensor& header, c10::ScalarType dtype, int64_t numel, const std::string& what) {
  auto h = header.cpu();
  const auto sent_dtype = static_cast<c10::ScalarType>(h[0].item<int64_t>());
  const int64_t sent_numel = h[1].item<int64_t>();
  TORCH_CHECK(sent_dtype == dtype && sent_numel == numel, what, ": it sent ", sent_numel, " ", dtype_name(sent_dtype),
              " elements; this tensor holds ", numel, " ", dtype_name(dtype),
              " (a send and its recv must agree in dtype and element count)");
}

void ProcessGroup::check_peer(int peer, const char* what, const std::string& op) const {
  if (size() == 1) {
    TORCH_CHECK(peer == 0, op, " on ", describe(), ": bad ", what, " ", peer, " (a group of one has only group rank 0)");
    return;
  }
  TORCH_CHECK(peer >= 0 && peer < size() && peer != rank_, op, " on ", describe(), ": bad ", what, " ", peer,
              " (expected another group rank than this one, ", rank_, ", in 0..", size() - 1, ")");
}

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
    std::vector<Tensor> header{header_of(t, World::instance().device())};
    auto sent = impl_->group->send(header, dst, kHeaderTag + tag);
    after = [sent, header, timeout = options_.timeout] { wait_for(*sent, timeout); };
  }
  std::vector<Tensor> ts{host_to_send(t)};
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
    after = [got, header, timeout = options_.timeout, dtype = t.scalar_type(), numel = t.numel(),
             what = "recv from group rank " + std::to_string(src) + " on " + describe()] {
      wait_for(*got, timeout);
      check_header(header[0], dtype, numel, what);
    };
  }
  std::vector<Tensor> ts{host_to_receive(t)};
  if (stages_on_host(t)) {  // staged on the host: into `t` once it has arrived (and its header checked)
    after = [checked = std::move(after), host = ts[0], t]() mutable {
      if (checked) checked();
      t.copy_(host);
    };
  }
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

}  // namespace partrain::dist
