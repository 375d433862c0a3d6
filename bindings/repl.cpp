// What the SPMD REPL (partrain/repl.lua) needs from C: line editing with history and completion
// (GNU readline), evaluation that Ctrl-C interrupts (lua.c's way: a signal handler installs a
// hook that raises an error at the next Lua instruction; a collective waiting for a peer ends
// too), the channel that hands chunks and outputs between ranks through the rendezvous store
// (never a collective, so waiting for input has no deadline), and the process's memory.
#include <poll.h>
#include <signal.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include <readline/history.h>
#include <readline/readline.h>

#include "bindings/host.hpp"
#include "bindings/lua.hpp"
#include "engine/compat.hpp"
#include "engine/dist/world.hpp"
#include "engine/plan/plan.hpp"
#include "engine/util/files.hpp"

namespace partrain::lua {

namespace {

bool interactive_run = false;  // partrain -i or partrain repl (set_interactive)

// ---- Interrupting an evaluation ------------------------------------------------------------

lua_State* volatile interrupt_target = nullptr;  // the state evaluating, while one is
volatile sig_atomic_t interrupted_at_prompt = 0;
volatile sig_atomic_t interrupt_pending = 0;     // Ctrl-C during the evaluation

void interrupt_hook(lua_State* L, lua_Debug*) {
  lua_sethook(L, nullptr, 0, 0);
  luaL_error(L, "interrupted");
}

void on_sigint(int) {
  if (lua_State* L = interrupt_target) {
    interrupt_pending = 1;
    lua_sethook(L, interrupt_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1);
  } else {
    interrupted_at_prompt = 1;
  }
}

// Asked by a collective while it waits during an evaluation: Ctrl-C ends the wait (a peer that
// was interrupted before reaching the collective will never answer). The hook comes off first,
// so that the collective's error, not a second "interrupted", reaches the chunk.
bool wait_interrupted() {
  if (!interrupt_pending) return false;
  if (lua_State* L = interrupt_target) lua_sethook(L, nullptr, 0, 0);
  return true;
}

// SIGINT goes to on_sigint while a REPL runs (repl_signals(true)), on every rank: a session is
// never ended by Ctrl-C. Outside it (a script after a breakpoint) Ctrl-C acts as before.
struct sigaction saved_sigint;
int sigint_depth = 0;  // nested REPLs (a breakpoint inside a chunk)

void hold_sigint(bool on) {
  if (on && sigint_depth++ == 0) {
    struct sigaction sa {};
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &saved_sigint);
  } else if (!on && sigint_depth > 0 && --sigint_depth == 0) {
    sigaction(SIGINT, &saved_sigint, nullptr);
  }
}

// ---- The channel between ranks ---------------------------------------------------------------
// Rank 0 puts chunk n of session s under repl/s/n/chunk; every rank puts its output (and how
// many collectives each of its groups has started) under repl/s/n/out/RANK; rank 0 answers
// with repl/s/n/renew, the groups whose members stopped at different points of their sequence
// (a chunk interrupted between collectives), which every member then renews. All waits poll
// the store with no deadline: an idle prompt or a long chunk on one rank is not an error.

constexpr size_t kMaxOutput = 1 << 20;  // bytes of one rank's output for one chunk

c10d::Store& store() {
  auto s = dist::World::instance().store();
  TORCH_CHECK(s, "the REPL has no rendezvous store (a world of one needs none)");
  return *s;
}

std::string key(int64_t session, int64_t n, const std::string& what) {
  return "repl/" + std::to_string(session) + "/" + std::to_string(n) + "/" + what;
}

void put(const std::string& k, const std::string& value) {
  store().set(k, std::vector<uint8_t>(value.begin(), value.end()));
}

// Waits for `k`, which rank `from` sets, without a deadline (an idle prompt or a long chunk is
// no error), unless `from` ends its process first (os.exit in a chunk): then nothing. A store
// that stops answering means rank 0 (its server) has ended.
std::optional<std::string> take(const std::string& k, int from) {
  const std::string ended = dist::World::ended_key(from);
  try {
    while (true) {
      try {
        store().wait({k}, std::chrono::milliseconds(200));
        auto v = store().get(k);
        return std::string(v.begin(), v.end());
      } catch (const dist::StoreTimeout&) {
      }
      if (store().check({ended})) return std::nullopt;
    }
  } catch (const std::exception& e) {
    throw std::runtime_error("the REPL lost rank 0, which serves the rendezvous store (it has ended?): " +
                             message_of(e));
  }
}

// A rank's posting: its output's length, the output, then a line a group: key, collectives
// started, members.
std::string posting(const std::string& output) {
  std::string out = output.size() > kMaxOutput
                        ? output.substr(0, kMaxOutput) + "\n... (output cut at " + std::to_string(kMaxOutput) + " bytes)\n"
                        : output;
  std::string s = std::to_string(out.size()) + "\n" + out;
  for (const auto& g : dist::World::instance().groups()) {
    if (g->size() < 2) continue;
    s += g->key() + "\t" + std::to_string(g->started()) + "\t";
    for (size_t i = 0; i < g->ranks().size(); ++i) s += (i ? "," : "") + std::to_string(g->ranks()[i]);
    s += "\n";
  }
  return s;
}

struct Posting {
  std::string output;
  std::map<std::string, std::pair<int64_t, std::string>> groups;  // key -> (started, members)
};

Posting parse_posting(const std::string& s) {
  Posting p;
  size_t nl = s.find('\n');
  size_t len = std::stoull(s.substr(0, nl));
  p.output = s.substr(nl + 1, len);
  std::istringstream rest(s.substr(nl + 1 + len));
  std::string line;
  while (std::getline(rest, line)) {
    auto t1 = line.find('\t'), t2 = line.find('\t', t1 + 1);
    p.groups[line.substr(0, t1)] = {std::stoll(line.substr(t1 + 1, t2 - t1 - 1)), line.substr(t2 + 1)};
  }
  return p;
}

// Rank 0: the groups to renew. A group is renewed when every member posted it and they have
// started different numbers of collectives on it.
std::string groups_to_renew(const std::vector<Posting>& all) {
  std::set<std::string> keys;
  for (const auto& p : all)
    for (const auto& g : p.groups) keys.insert(g.first);
  std::string out;
  for (const auto& k : keys) {
    std::string members;
    std::set<int64_t> counts;
    size_t posted = 0;
    for (const auto& p : all) {
      auto it = p.groups.find(k);
      if (it == p.groups.end()) continue;
      members = it->second.second;
      counts.insert(it->second.first);
      ++posted;
    }
    size_t size = std::count(members.begin(), members.end(), ',') + 1;
    if (posted == size && counts.size() > 1) out += k + "\n";
  }
  return out;
}

// ---- History and completion ----------------------------------------------------------------

// The history file is read and written only when it is a regular file or absent: a FIFO or a
// device planted there would block readline or be clobbered. Said once a process.
bool history_usable(const std::string& path) {
  if (::access(path.c_str(), F_OK) != 0 || util::is_regular(path)) return true;
  static bool told = false;
  if (!told) std::fprintf(stderr, "partrain: the REPL keeps no history: '%s' is not a regular file\n", path.c_str());
  told = true;
  return false;
}

std::unique_ptr<LuaRef> completer;      // fn(word) -> { candidates }
std::vector<std::string> candidates;

char* next_candidate(const char*, int state) {
  static size_t i;
  if (state == 0) i = 0;
  return i < candidates.size() ? strdup(candidates[i++].c_str()) : nullptr;
}

char** complete(const char* text, int, int) {
  rl_attempted_completion_over = 1;  // no file names
  candidates.clear();
  if (!completer || !completer->alive()) return nullptr;
  lua_State* L = completer->main();
  int top = lua_gettop(L);
  completer->push(L);
  lua_pushstring(L, text);
  if (pcall(L, 1, 1, nullptr) && lua_istable(L, -1)) {
    for (int i = 1;; ++i) {
      lua_rawgeti(L, -1, i);
      if (!lua_isstring(L, -1)) break;
      candidates.emplace_back(lua_tostring(L, -1));
      lua_pop(L, 1);
    }
  }
  lua_settop(L, top);
  return rl_completion_matches(text, next_candidate);
}

// Ctrl-C while reading. readline's own signal handling is off (rl_catch_signals = 0): SIGINT
// reaches on_sigint, and the line is abandoned at once (an empty line is accepted; repl_readline
// then reports the interrupt), without waiting for a key. The flag is looked at between short
// polls, not only when read() returns EINTR: the signal may land on another thread of the process
// (Gloo's), or between readline showing the prompt and this function starting to wait.
int read_key(FILE* in) {
  int fd = fileno(in);
  while (true) {
    if (interrupted_at_prompt) {
      rl_replace_line("", 0);
      return '\n';
    }
    struct pollfd p {};
    p.fd = fd;
    p.events = POLLIN;
    int ready = ::poll(&p, 1, 100);
    if (ready < 0 && errno != EINTR) return EOF;
    if (ready <= 0) continue;
    unsigned char c;
    ssize_t n = ::read(fd, &c, 1);
    if (n == 1) return c;
    if (n == 0) return EOF;
    if (errno != EINTR && errno != EAGAIN) return EOF;
  }
}

const Function kRepl[] = {
    {"repl_isatty", [](Args& a) { return a.ret(isatty(STDIN_FILENO) == 1 && isatty(STDOUT_FILENO) == 1); }},
    {"repl_start", [](Args& a) {  // repl_start(history_file, completer)
       std::string history = a.string(1);
       if (lua_type(a.L, 2) != LUA_TFUNCTION) a.expected(2, "completion function");
       completer = std::make_unique<LuaRef>(a.L, 2);
       rl_readline_name = "partrain";
       rl_attempted_completion_function = complete;
       rl_basic_word_break_characters = const_cast<char*>(" \t\n\"\\'`@$><=;|&{(,[+-*/%^~#");
       rl_catch_signals = 0;
       rl_getc_function = read_key;
       using_history();
       if (history_usable(history)) read_history(history.c_str());  // a missing file is fine: the first session
       return a.ret(); }},
    {"repl_stop", [](Args& a) {  // repl_stop(history_file): saves the history (the last 1000 lines)
       std::string history = a.string(1);
       if (history_usable(history)) {
         write_history(history.c_str());
         history_truncate_file(history.c_str(), 1000);
       }
       completer.reset();
       return a.ret(); }},
    {"repl_readline", [](Args& a) {  // a line; "\0interrupt" after Ctrl-C; nil at end of input
       interrupted_at_prompt = 0;
       char* line = readline(a.string(1).c_str());
       if (interrupted_at_prompt) {
         std::free(line);
         return a.ret(std::string("\0interrupt", 10));
       }
       if (!line) {
         std::fputs("\n", stdout);
         lua_pushnil(a.L);
         return 1;
       }
       std::string s(line);
       std::free(line);
       return a.ret(s); }},
    {"repl_add_history", [](Args& a) { add_history(a.string(1).c_str()); return a.ret(); }},
    {"repl_try", [](Args& a) {  // repl_try(fn): true, results... | false, message with traceback
       lua_State* L = a.L;
       if (lua_type(L, 1) != LUA_TFUNCTION) a.expected(1, "function");
       lua_settop(L, 1);
       // Chunks typed at the prompt run interpreted, so the hook reaches even a tight loop.
       lua_getglobal(L, "jit");
       if (lua_istable(L, -1)) {
         lua_getfield(L, -1, "off");
         lua_pushvalue(L, 1);
         lua_pushboolean(L, 1);
         lua_pcall(L, 2, 0, 0);
       }
       lua_settop(L, 1);
       struct Target {  // evaluation ends however this frame is left; an outer one (a
                        // breakpoint's REPL inside a chunk) is interruptible again after it
         lua_State* outer;
         explicit Target(lua_State* L) : outer(interrupt_target) {
           interrupt_pending = 0;
           interrupt_target = L;
           dist::set_wait_interrupt(wait_interrupted);
         }
         ~Target() {
           if (lua_State* L = interrupt_target) lua_sethook(L, nullptr, 0, 0);
           interrupt_target = outer;
           interrupt_pending = 0;
           if (!outer) dist::set_wait_interrupt(nullptr);
         }
       } target(L);
       std::string error;
       if (!pcall(L, 0, LUA_MULTRET, &error, /*traceback=*/true)) {
         lua_pushboolean(L, 0);
         lua_pushlstring(L, error.data(), error.size());
         return 2;
       }
       lua_pushboolean(L, 1);
       lua_insert(L, 1);
       return lua_gettop(L); }},
    {"repl_signals", [](Args& a) {  // repl_signals(on): Ctrl-C interrupts chunks instead of ending the process
       hold_sigint(a.boolean(1));
       return a.ret(); }},
    {"repl_interactive", [](Args& a) { return a.ret(interactive_run); }},
    // Why rank 0 cannot read the terminal, or nil: reading it from a background process group
    // (under timeout(1), or `cmd &`) would stop the process, and the run would hang.
    {"repl_terminal_problem", [](Args& a) {
       if (isatty(STDIN_FILENO) != 1) return a.ret();
       pid_t fg = tcgetpgrp(STDIN_FILENO);
       if (fg < 0 || fg == getpgrp()) return a.ret();
       return a.ret(std::string("partrain runs in a background process group and cannot read the terminal (under "
                                "timeout, use timeout --foreground; or run it in the foreground)")); }},
    // Why pt.breakpoint() cannot stop here whatever the terminal, or nil.
    {"repl_breakpoint_problem", [](Args& a) {
       if (plan::planning()) return a.ret(std::string("partrain plan does not stop at breakpoints"));
       auto& w = dist::World::instance();
       if (w.initialized() && w.size() > 1 && !interactive_run)
         return a.ret(std::string("run with partrain -i to stop here (only then does rank 0 read the terminal)"));
       return a.ret(); }},
    // The channel (see above). repl_session(): a new session's number, the same on every rank
    // (every rank opens REPLs in the same order: they are collective).
    {"repl_session", [](Args& a) {
       static int64_t sessions = 0;
       return a.ret(double(++sessions)); }},
    // rank 0: repl_publish(session, n, code | nil for the end). For a chunk, it then waits, up to
    // --timeout, until every rank has taken it: a rank that never reaches the REPL (a
    // breakpoint only some ranks pass) is an error naming it, not a wait without end.
    {"repl_publish", [](Args& a) {
       int64_t session = a.integer(1), n = a.integer(2);
       bool chunk = a.is_string(3);
       put(key(session, n, "chunk"), chunk ? "c" + a.string(3) : std::string("e"));
       if (!chunk) return a.ret();
       auto& world = dist::World::instance();
       std::vector<std::string> took;
       for (int r = 1; r < world.size(); ++r) took.push_back(key(session, n, "took/" + std::to_string(r)));
       std::string missing;
       try {
         store().wait(took, world.options().timeout);  // answered as soon as the last rank takes it
       } catch (const std::exception&) {
         for (int r = 1; r < world.size(); ++r)
           if (!store().check({took[r - 1]})) missing += (missing.empty() ? "" : ",") + std::to_string(r);
       }
       TORCH_CHECK(missing.empty(), "rank(s) ", missing, " did not reach the REPL within --timeout (",
                   world.options().timeout.count() / 1000, " s): every rank must reach it (a pt.breakpoint() that only "
                   "some ranks pass stops only those)");
       return a.ret(); }},
    {"repl_receive", [](Args& a) {  // other ranks: repl_receive(session, n) -> code | nil at the end
       int64_t session = a.integer(1), n = a.integer(2);
       auto v = take(key(session, n, "chunk"), 0);  // rank 0 gone: the session is over
       if (!v || v->empty() || (*v)[0] != 'c') return a.ret();
       put(key(session, n, "took/" + std::to_string(dist::World::instance().rank())), "");
       return a.ret(v->substr(1)); }},
    // repl_exchange(session, n, output, exit): every rank posts its output and whether the chunk
    // called exit(); rank 0 gets { output of rank 0, of rank 1, ... }, the others nil, and every
    // rank gets whether to leave (exit() on any rank ends the REPL on all). Groups left at
    // different points of their collectives are renewed.
    {"repl_exchange", [](Args& a) {
       int64_t session = a.integer(1), n = a.integer(2);
       std::string output = a.string(3);
       bool leave = a.boolean(4);
       auto& world = dist::World::instance();
       put(key(session, n, "out/" + std::to_string(world.rank())), (leave ? "x" : "-") + posting(output));
       std::vector<Posting> all;
       std::string verdict;
       if (world.rank() == 0) {
         for (int r = 0; r < world.size(); ++r) {
           // A rank that ended its process in the chunk (os.exit) leaves the others no world to
           // go on in: the session ends on every rank.
           std::string p = take(key(session, n, "out/" + std::to_string(r)), r)
                               .value_or("x" + posting("rank " + std::to_string(r) + " ended its process (os.exit) "
                                                       "in this chunk; the REPL ends on every rank\n"));
           leave = leave || p[0] == 'x';
           all.push_back(parse_posting(p.substr(1)));
         }
         verdict = (leave ? "x" : "-") + groups_to_renew(all);
         put(key(session, n, "renew"), verdict);
         if (n > 1) {  // every rank has read chunk n - 1 and its verdict: it posted chunk n's output
           store().deleteKey(key(session, n - 1, "chunk"));
           store().deleteKey(key(session, n - 1, "renew"));
           for (int r = 0; r < world.size(); ++r) {
             store().deleteKey(key(session, n - 1, "out/" + std::to_string(r)));
             store().deleteKey(key(session, n - 1, "took/" + std::to_string(r)));
           }
         }
       } else {
         verdict = take(key(session, n, "renew"), 0).value_or("x");  // rank 0 gone: leave
       }
       leave = verdict[0] == 'x';
       std::set<std::string> keys;
       std::istringstream lines(verdict.substr(1));
       for (std::string k; std::getline(lines, k);) keys.insert(k);
       for (const auto& g : world.groups())  // in the order they were made, as every member does
         if (keys.count(g->key())) g->renew();
       if (world.rank() == 0) {
         lua_createtable(a.L, static_cast<int>(all.size()), 0);
         for (size_t r = 0; r < all.size(); ++r) {
           lua_pushlstring(a.L, all[r].output.data(), all[r].output.size());
           lua_rawseti(a.L, -2, static_cast<int>(r + 1));
         }
       } else {
         lua_pushnil(a.L);
       }
       lua_pushboolean(a.L, leave);
       return 2; }},
    {"string_to_tensor", [](Args& a) {  // the bytes of a string as a uint8 tensor
       size_t n = 0;
       const char* s = luaL_checklstring(a.L, 1, &n);
       auto t = torch::empty({static_cast<int64_t>(n)}, torch::kUInt8);
       if (n) std::memcpy(t.data_ptr<uint8_t>(), s, n);
       return a.ret(t); }},
    {"tensor_to_string", [](Args& a) {
       auto t = a.tensor(1).to(torch::kCPU, torch::kUInt8).contiguous();
       lua_pushlstring(a.L, reinterpret_cast<const char*>(t.data_ptr<uint8_t>()), static_cast<size_t>(t.numel()));
       return 1; }},
    // { resident, resident_peak, allocated, allocated_peak }: this process's resident memory and
    // the bytes LibTorch's tensors hold on the CPU, in bytes; on a CUDA rank also device_allocated,
    // device_allocated_peak, device_reserved, device_reserved_peak (the caching allocator's).
    {"memory", [](Args& a) {
       std::ifstream status("/proc/self/status");
       std::string line;
       double resident = 0, peak = 0;
       while (std::getline(status, line)) {
         std::istringstream in(line);
         std::string key;
         double kb = 0;
         in >> key >> kb;
         if (key == "VmRSS:") resident = kb * 1024;
         if (key == "VmHWM:") peak = kb * 1024;
       }
       auto cpu = util::memory(c10::kCPU);
       lua_createtable(a.L, 0, 4);
       lua_pushnumber(a.L, resident); lua_setfield(a.L, -2, "resident");
       lua_pushnumber(a.L, peak); lua_setfield(a.L, -2, "resident_peak");
       lua_pushnumber(a.L, double(cpu.allocated)); lua_setfield(a.L, -2, "allocated");
       lua_pushnumber(a.L, double(cpu.peak)); lua_setfield(a.L, -2, "allocated_peak");
       // A rank on a CUDA device: its tensors' bytes there, from the caching allocator.
       const auto& device = dist::World::instance().device();
       if (device.is_cuda()) {
         auto m = compat::cuda_memory(device.index());
         lua_pushnumber(a.L, double(m.allocated)); lua_setfield(a.L, -2, "device_allocated");
         lua_pushnumber(a.L, double(m.peak_allocated)); lua_setfield(a.L, -2, "device_allocated_peak");
         lua_pushnumber(a.L, double(m.reserved)); lua_setfield(a.L, -2, "device_reserved");
         lua_pushnumber(a.L, double(m.peak_reserved)); lua_setfield(a.L, -2, "device_reserved_peak");
       }
       return 1; }},
    {"reset_peak", [](Args& a) {
       util::reset_peak(c10::kCPU);
       const auto& device = dist::World::instance().device();
       if (device.is_cuda()) compat::cuda_reset_peak(device.index());
       return a.ret(); }},
    {nullptr, nullptr}};

}  // namespace

void open_repl(lua_State* L, int core) { set_functions(L, core, kRepl); }

void set_interactive(bool on) { interactive_run = on; }

}  // namespace partrain::lua
