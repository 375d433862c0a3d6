// The collective ledger (see ledger.hpp): the shared block, the per-group books that write it,
// and the bounded reader the launcher uses.
#include "engine/dist/ledger.hpp"

#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>

#include <c10/core/ScalarType.h>

#include "engine/dist/process_group.hpp"

namespace partrain::dist::ledger {

static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
              "the ledger's atomics are shared with another process: they must be lock-free");

const char* op_name(Op op) {
  switch (op) {
    case Op::AllReduce: return "all_reduce";
    case Op::Broadcast: return "broadcast";
    case Op::AllGather: return "all_gather";
    case Op::ReduceScatter: return "reduce_scatter";
    case Op::Barrier: return "barrier";
    case Op::Send: return "send";
    case Op::Recv: return "recv";
    case Op::AllToAll: return "all_to_all";
    case Op::None: break;
  }
  return "?";
}

const char* state_name(State s) {
  switch (s) {
    case State::Started: return "started";
    case State::Waiting: return "waiting";
    case State::Completed: return "completed";
    case State::Failed: return "failed";
    case State::TimedOut: return "timed out";
    case State::Empty: break;
  }
  return "?";
}

namespace {

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

std::atomic<Region*> the_region{nullptr};
std::atomic<bool> is_shared{false};
std::mutex region_mutex;

void init_header(Region* r) {
  r->magic = kMagic;
  r->layout = kLayout;
  r->pid = static_cast<int32_t>(getpid());
  const char* rank = std::getenv("RANK");
  r->rank = rank ? std::atoi(rank) : 0;
}

// Copies `text` into a field of `n` bytes, always terminated.
void copy_text(char* field, size_t n, const char* text) {
  size_t len = std::min(std::strlen(text), n - 1);
  std::memcpy(field, text, len);
  field[len] = '\0';
}

// The seqlock's two halves for a writer (who already holds the group's mutex).
void begin_write(std::atomic<uint32_t>& version) {
  version.store(version.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
}
void end_write(std::atomic<uint32_t>& version) {
  version.store(version.load(std::memory_order_relaxed) + 1, std::memory_order_release);
}

thread_local const char* site_override = nullptr;

// The thread the launcher's questions go to: it blocks every signal but SIGUSR1 and waits for
// signals, forever. Sent there (tgkill to probe_tid), the launcher's SIGUSR1 runs the Lua host's
// handler on this thread, which only sets a hook on the Lua state; a signal to the thread running
// Lua instead cut its system calls short whatever SA_RESTART says (sleep, nanosleep, poll and
// select are never restarted), so a rank asked while it slept in C code woke early and went on.
void start_probe_thread(Region* r) {
  sigset_t only_usr1, old;
  sigfillset(&only_usr1);
  sigdelset(&only_usr1, SIGUSR1);
  pthread_sigmask(SIG_SETMASK, &only_usr1, &old);  // the new thread's mask from its first instruction
  try {
    std::thread([r] {
      r->probe_tid.store(static_cast<int32_t>(syscall(SYS_gettid)), std::memory_order_release);
      for (;;) pause();
    }).detach();
  } catch (const std::exception&) {
    // No thread: probe_tid stays 0, and the launcher asks this rank nothing.
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

}  // namespace

bool attach(int fd) {
  void* p = mmap(nullptr, sizeof(Region), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return false;
  std::lock_guard<std::mutex> lock(region_mutex);
  if (the_region.load()) {  // too late: calls are already recorded in a private block
    munmap(p, sizeof(Region));
    return false;
  }
  auto* r = static_cast<Region*>(p);  // zero-filled by the launcher's ftruncate
  init_header(r);
  is_shared = true;
  the_region = r;
  start_probe_thread(r);
  return true;
}

Region* region() {
  if (Region* r = the_region.load(std::memory_order_acquire)) return r;
  std::lock_guard<std::mutex> lock(region_mutex);
  if (Region* r = the_region.load()) return r;
  // Anonymous pages: zero-filled, and only those touched take memory.
  void* p = mmap(nullptr, sizeof(Region), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  auto* r = static_cast<Region*>(p);
  init_header(r);
  the_region.store(r, std::memory_order_release);
  return r;
}

bool shared() { return is_shared.load(); }

void fill_site(char* site) {
  if (site_override) {
    copy_text(site, kSite, site_override);
    return;
  }
  call_site_into(site, kSite);
}

SiteOverride::SiteOverride(const char* site) : previous_(site_override) { site_override = site; }
SiteOverride::~SiteOverride() { site_override = previous_; }

void set_line(const char* line) {
  Region* r = region();
  static std::mutex line_mutex;
  std::lock_guard<std::mutex> lock(line_mutex);
  begin_write(r->line_version);
  copy_text(r->line, kSite, line);
  r->line_ns = now_ns();
  end_write(r->line_version);
  r->line_answers.fetch_add(1, std::memory_order_release);
}

// ---- Book ------------------------------------------------------------------------------------

Book::Book(const std::string& name, const std::string& key, const std::vector<int>& ranks, int rank) {
  Region* r = region();
  uint32_t slot = r->groups.fetch_add(1);
  if (slot >= uint32_t(kGroups)) {  // full: this group goes unrecorded
    r->groups.store(kGroups);
    return;
  }
  g_ = &r->group[slot];
  std::lock_guard<std::mutex> lock(mutex_);
  begin_write(g_->version);
  g_->size = static_cast<int32_t>(ranks.size());
  g_->rank = rank;
  g_->listed = static_cast<int32_t>(std::min<size_t>(ranks.size(), kRanks));
  for (int i = 0; i < g_->listed; ++i) g_->ranks[i] = ranks[i];
  copy_text(g_->name, kName, name.c_str());
  copy_text(g_->key, kName, key.c_str());
  g_->collectives = g_->calls = 0;
  g_->channels = 0;
  for (auto& e : g_->entries) e.call = -1;
  end_write(g_->version);
  r->progress.fetch_add(1, std::memory_order_relaxed);
}

int64_t Book::start(Op op, int reduce, int dtype, int64_t numel, int64_t bytes, int peer, int tag,
                    const char* given_site) {
  if (!g_) return -1;
  char site[kSite];
  if (given_site) copy_text(site, kSite, given_site);
  else fill_site(site);  // outside the lock: it walks the Lua stack
  const int64_t at = now_ns();
  std::lock_guard<std::mutex> lock(mutex_);
  begin_write(g_->version);
  int64_t seq;
  if (op == Op::Send || op == Op::Recv) {
    Channel* c = nullptr;
    for (int i = 0; i < g_->channels && !c; ++i)
      if (g_->channel[i].peer == peer && g_->channel[i].tag == tag) c = &g_->channel[i];
    if (!c && g_->channels < kChannels) {
      c = &g_->channel[g_->channels++];
      *c = Channel{peer, tag, 0, 0};
    }
    seq = c ? (op == Op::Send ? c->sent++ : c->received++) : -1;  // -1: more channels than counted
  } else {
    seq = g_->collectives++;
  }
  const int64_t call = g_->calls++;
  Entry& e = g_->entries[call % kEntries];
  e.call = call;
  e.seq = seq;
  e.numel = numel;
  e.bytes = bytes;
  e.started_ns = at;
  e.ended_ns = 0;
  e.peer = peer;
  e.tag = tag;
  e.op = static_cast<uint8_t>(op);
  e.state = static_cast<uint8_t>(State::Started);
  e.reduce = static_cast<uint8_t>(reduce);
  e.dtype = static_cast<int8_t>(dtype);
  std::memcpy(e.site, site, kSite);
  end_write(g_->version);
  region()->progress.fetch_add(1, std::memory_order_relaxed);
  return call;
}

void Book::set(int64_t ticket, State state) {
  if (!g_ || ticket < 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  Entry& e = g_->entries[ticket % kEntries];
  auto now = static_cast<State>(e.state);
  if (e.call != ticket || now == State::Completed || now == State::Failed || now == State::TimedOut) return;
  begin_write(g_->version);
  e.state = static_cast<uint8_t>(state);
  if (state != State::Waiting && state != State::Started) e.ended_ns = now_ns();
  end_write(g_->version);
  region()->progress.fetch_add(1, std::memory_order_relaxed);
}

void Book::restart() {
  if (!g_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  begin_write(g_->version);
  g_->collectives = 0;
  g_->channels = 0;
  end_write(g_->version);
}

// ---- Reading ---------------------------------------------------------------------------------

namespace {

std::string text_of(const char* field, size_t n) { return std::string(field, strnlen(field, n)); }

std::string dtype_text(int dtype) {
  if (dtype < 0 || dtype >= static_cast<int>(c10::ScalarType::NumOptions)) return "";
  return dtype_name(static_cast<c10::ScalarType>(dtype));
}

// One consistent copy of a seqlocked object; a writer stopped mid-write (its version stays odd)
// yields the last try.
template <class T>
void copy_consistent(const T& from, T& to, const std::atomic<uint32_t>& version) {
  for (int attempt = 0; attempt < 1000; ++attempt) {
    uint32_t before = version.load(std::memory_order_acquire);
    std::memcpy(static_cast<void*>(&to), static_cast<const void*>(&from), sizeof(T));
    std::atomic_thread_fence(std::memory_order_acquire);
    if (!(before & 1) && version.load(std::memory_order_relaxed) == before) return;
  }
}

}  // namespace

std::string Call::describe() const {
  std::string s = op_name(op);
  static const char* reduces[] = {"", "sum", "mean", "min", "max", "product"};
  if (reduce >= 1 && reduce <= 5) s += std::string("(") + reduces[reduce] + ")";
  if (op != Op::Barrier) {
    s += " of " + std::to_string(numel) + " " + dtype_text(dtype);
    s += " (" + std::to_string(bytes) + " B)";
  }
  if (op == Op::Send) s += " to rank " + std::to_string(peer) + " (tag " + std::to_string(tag) + ")";
  if (op == Op::Recv) s += " from rank " + std::to_string(peer) + " (tag " + std::to_string(tag) + ")";
  return s;
}

std::string GroupCopy::describe() const {
  std::string s = "group '" + name + "' (ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? "," : "") + std::to_string(ranks[i]);
  if (size > static_cast<int>(ranks.size())) s += ",... " + std::to_string(size) + " in all";
  return s + ")";
}

const Channel* GroupCopy::channel(int peer, int tag) const {
  for (const auto& c : channels)
    if (c.peer == peer && c.tag == tag) return &c;
  return nullptr;
}

Copy read(const Region* r) {
  Copy out;
  if (!r || r->magic != kMagic || r->layout != kLayout) return out;
  out.valid = true;
  out.rank = r->rank;
  out.pid = r->pid;
  out.progress = r->progress.load(std::memory_order_acquire);
  out.line_ready = r->line_ready.load() == 1;
  out.line_answers = r->line_answers.load(std::memory_order_acquire);
  for (int attempt = 0; attempt < 1000; ++attempt) {
    uint32_t before = r->line_version.load(std::memory_order_acquire);
    char line[kSite];
    std::memcpy(line, r->line, kSite);
    int64_t at = r->line_ns;
    std::atomic_thread_fence(std::memory_order_acquire);
    out.line = text_of(line, kSite);
    out.line_ns = at;
    if (!(before & 1) && r->line_version.load(std::memory_order_relaxed) == before) break;
  }
  const uint32_t groups = std::min<uint32_t>(r->groups.load(std::memory_order_acquire), kGroups);
  auto* g = static_cast<Group*>(::operator new(sizeof(Group)));  // ~11 KB: not on the stack
  for (uint32_t i = 0; i < groups; ++i) {
    copy_consistent(r->group[i], *g, r->group[i].version);
    GroupCopy c;
    c.name = text_of(g->name, kName);
    c.key = text_of(g->key, kName);
    c.size = std::max(0, g->size);
    c.rank = g->rank;
    const int listed = std::clamp(g->listed, 0, kRanks);
    c.ranks.assign(g->ranks, g->ranks + listed);
    c.collectives = g->collectives;
    c.calls = g->calls;
    c.channels.assign(g->channel, g->channel + std::clamp(g->channels, 0, kChannels));
    // The ring, oldest first: the last min(calls, kEntries) entries.
    const int64_t first = std::max<int64_t>(0, g->calls - kEntries);
    for (int64_t k = first; k < g->calls; ++k) {
      const Entry& e = g->entries[((k % kEntries) + kEntries) % kEntries];
      if (e.call != k) continue;
      Call call;
      call.op = e.op <= static_cast<uint8_t>(kLastOp) ? static_cast<Op>(e.op) : Op::None;
      call.state = e.state <= static_cast<uint8_t>(State::TimedOut) ? static_cast<State>(e.state) : State::Empty;
      call.reduce = e.reduce;
      call.dtype = e.dtype;
      call.peer = e.peer;
      call.tag = e.tag;
      call.call = e.call;
      call.seq = e.seq;
      call.numel = e.numel;
      call.bytes = e.bytes;
      call.started_ns = e.started_ns;
      call.ended_ns = e.ended_ns;
      call.site = text_of(e.site, kSite);
      c.calls_kept.push_back(std::move(call));
    }
    out.groups.push_back(std::move(c));
  }
  ::operator delete(g);
  return out;
}

}  // namespace partrain::dist::ledger
