// The LuaJIT host: the Lua state with partrain's library loaded (open_core), its limits and its
// answers to the launcher, and running scripts (see host.hpp). Arguments and options are read in
// args.cpp, errors located and guarded in guard.cpp.
#include "bindings/host.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "bindings/lua.hpp"
#include "engine/dist/ledger.hpp"
#include "engine/dist/world.hpp"
#include "engine/plan/plan.hpp"
#include "engine/util/files.hpp"
#include "engine/util/text.hpp"

namespace partrain::lua {

// ---- Host ----------------------------------------------------------------------------------

namespace {

bool is_dir(const std::string& p) { return !p.empty() && access(p.c_str(), F_OK) == 0; }

std::string exe_dir() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  std::string path(buf, n);
  return path.substr(0, path.find_last_of('/'));
}

std::string dir_of(const std::string& file) {
  auto slash = file.find_last_of('/');
  return slash == std::string::npos ? "." : file.substr(0, slash);
}

// The backstop of partrain.policy's bounded calls. Lua's hooks interrupt user code past its time
// limit, but not code they cannot reach: a loop in an xpcall message handler (LuaJIT runs the
// handler of an error raised by a hook with hooks off) or a long C call. A deadline armed here
// ends the process with its message once it has passed, so such code is an error, not a hang.
class Deadlines {
 public:
  using Clock = std::chrono::steady_clock;
  static Deadlines& instance() {
    static auto* d = new Deadlines();  // never destroyed: its thread may outlive static destructors
    return *d;
  }
  int64_t arm(double seconds, std::string message) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!started_) {
      std::thread([this] { watch(); }).detach();
      started_ = true;
    }
    const auto at = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    armed_[++next_] = {at, std::move(message)};
    changed_.notify_all();
    return next_;
  }
  void note(int64_t token, std::string message) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = armed_.find(token); it != armed_.end()) it->second.second = std::move(message);
  }
  void disarm(int64_t token) {
    std::lock_guard<std::mutex> lock(mutex_);
    armed_.erase(token);
    changed_.notify_all();
  }

 private:
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      if (armed_.empty()) {
        changed_.wait(lock);
        continue;
      }
      auto first = armed_.begin();
      for (auto it = armed_.begin(); it != armed_.end(); ++it)
        if (it->second.first < first->second.first) first = it;
      if (Clock::now() >= first->second.first) dist::fatal_exit(first->second.second);
      changed_.wait_until(lock, first->second.first);
    }
  }
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<int64_t, std::pair<Clock::time_point, std::string>> armed_;
  int64_t next_ = 0;
  bool started_ = false;
};

const Function kDeadlines[] = {
    // _deadline_arm(seconds, message) -> token: the process ends with `message` once `seconds` pass.
    // A limit past 1e9 s (about 30 years: none, in effect) is held there, in the clock's range.
    {"_deadline_arm", [](Args& a) {
       const double seconds = a.number(1);
       if (!(seconds > 0)) a.fail(1, "seconds > 0 expected");
       return a.ret(double(Deadlines::instance().arm(std::min(seconds, 1e9), a.string(2)))); }},
    {"_deadline_note", [](Args& a) {  // _deadline_note(token, message): the message it would end with
       Deadlines::instance().note(a.integer(1), a.string(2));
       return a.ret(); }},
    {"_deadline_disarm", [](Args& a) {
       Deadlines::instance().disarm(a.integer(1));
       return a.ret(); }},
    {nullptr, nullptr}};

// A state's allocator behind a budget (core._memory_budget): while a budget is set, an
// allocation that would take the state more than its limit past where it stood when the budget
// began fails, which Lua raises as "not enough memory". A config file's one string.rep or
// table.concat of gigabytes is so stopped before it is made, where a check between instructions
// would come after it. Every call goes on to the state's own allocator.
struct Budget {
  lua_Alloc inner = nullptr;
  void* inner_ud = nullptr;
  int64_t used = 0;    ///< bytes allocated less bytes freed since the budget began
  int64_t limit = -1;  ///< -1: no budget
  bool refused = false;
};

void* budgeted_alloc(void* ud, void* ptr, size_t osize, size_t nsize) {
  auto* b = static_cast<Budget*>(ud);
  const int64_t grow = static_cast<int64_t>(nsize) - (ptr ? static_cast<int64_t>(osize) : 0);
  if (b->limit >= 0 && grow > 0 && b->used + grow > b->limit) {
    b->refused = true;
    return nullptr;
  }
  void* out = b->inner(b->inner_ud, ptr, osize, nsize);
  if (out || nsize == 0) b->used += grow;
  return out;
}

// The state's Budget, its allocator wrapped the first time one is asked for.
Budget* budget_of(lua_State* L) {
  void* ud = nullptr;
  lua_Alloc f = lua_getallocf(L, &ud);
  if (f == budgeted_alloc) return static_cast<Budget*>(ud);
  auto* b = new Budget;  // deleted by ~Host after lua_close, the allocator's last call
  b->inner = f;
  b->inner_ud = ud;
  lua_setallocf(L, budgeted_alloc, b);
  return b;
}

int open_core(lua_State* L) {
  lua_newtable(L);
  int core = lua_gettop(L);
  open_tensor(L, core);
  open_nn(L, core);
  open_optim(L, core);
  open_data(L, core);
  open_dist(L, core);
  open_policy(L, core);
  open_plan(L, core);
  open_repl(L, core);
  open_ckpt(L, core);
  open_files(L, core);
  set_functions(L, core, kDeadlines);
  // core._where(): the user's file:line running now (the first frame outside partrain's Lua), as
  // engine errors name it; "" when there is none.
  lua_pushcfunction(L, [](lua_State* S) {
    std::string where = user_location(S);
    lua_pushlstring(S, where.data(), where.size());
    return 1;
  });
  lua_setfield(L, core, "_where");
  // core._raise(msg [, level = 1]): raises msg at the user's line, as engine errors are located,
  // even where the caller of partrain's function is pcall itself (`pcall(pt.log, 5)`), whose
  // frame Lua's error levels name nothing for. Without a user frame (under an engine callback),
  // where error(msg, level) in the calling function would. Like error, it raises anything but a
  // string or number unchanged.
  lua_pushcfunction(L, [](lua_State* S) {
    const int level = luaL_optint(S, 2, 1);
    lua_settop(S, 1);
    if (!lua_isstring(S, 1)) return lua_error(S);
    bool is_user = false;
    bool located = false;  // at the user's line already (an engine error passed on)
    {
      std::string where = user_location(S, &is_user) + ": ";
      located = is_user && std::strncmp(lua_tostring(S, 1), where.c_str(), where.size()) == 0;
      if (is_user && !located) lua_pushlstring(S, where.data(), where.size());
    }  // nothing of C++ is left to destroy when lua_error unwinds
    if (located) return lua_error(S);
    if (!is_user) {
      if (level > 0) luaL_where(S, level);
      else lua_pushliteral(S, "");
    }
    lua_pushvalue(S, 1);
    lua_concat(S, 2);
    return lua_error(S);
  });
  lua_setfield(L, core, "_raise");
  // core._memory_budget(bytes): from now on, allocations that would take this state more than
  // `bytes` past where it stands fail ("not enough memory"). core._memory_budget(): no budget
  // again; returns whether an allocation was refused under the one that ends.
  lua_pushcfunction(L, [](lua_State* S) {
    Budget* b = budget_of(S);
    if (lua_isnoneornil(S, 1)) {
      bool refused = b->refused;
      b->limit = -1;
      b->refused = false;
      lua_pushboolean(S, refused);
      return 1;
    }
    const double bytes = luaL_checknumber(S, 1);
    luaL_argcheck(S, bytes >= 0 && bytes < 0x1p62, 1, "a number of bytes");
    b->used = 0;
    b->refused = false;
    b->limit = static_cast<int64_t>(bytes);
    return 0;
  });
  lua_setfield(L, core, "_memory_budget");
  // core._key_text(k): a table key as messages show it ('name', [3], [a string of 900 bytes]).
  lua_pushcfunction(L, [](lua_State* S) {
    luaL_checkany(S, 1);
    {
      std::string text = key_text(S, 1);
      lua_pushlstring(S, text.data(), text.size());
    }
    return 1;
  });
  lua_setfield(L, core, "_key_text");
  // core._unyielding(fn, ...): fn(...) behind a C frame, so a coroutine.yield inside it is an
  // error rather than a way out that leaves the caller's limits armed.
  lua_pushcfunction(L, [](lua_State* S) {
    luaL_checktype(S, 1, LUA_TFUNCTION);
    lua_call(S, lua_gettop(S) - 1, LUA_MULTRET);
    return lua_gettop(S);
  });
  lua_setfield(L, core, "_unyielding");
  lua_pushstring(L, PARTRAIN_VERSION);
  lua_setfield(L, core, "version");
  return 1;
}

}  // namespace

namespace {

// The launcher's question "which Lua line is this rank on?" (SIGUSR1, sent only once the ledger's
// line_ready says this handler is in place). The handler sets a one-shot hook (lua_sethook is
// safe in a signal handler: lua.c's Ctrl-C does the same); at the next Lua instruction the
// interpreter runs, the hook writes the user's line into the ledger and puts back any hook the
// script had. LuaJIT runs no hooks inside compiled traces, and none while C code runs, so a rank
// spinning in a compiled loop, or inside a long C call, does not answer: the launcher says so.
std::atomic<lua_State*> asked_state{nullptr};
lua_Hook saved_hook = nullptr;
int saved_mask = 0, saved_count = 0;

void answer_line(lua_State* L, lua_Debug*) {
  char where[dist::ledger::kSite];
  user_location(L, where, sizeof where, /*first=*/0);
  lua_sethook(L, saved_hook, saved_mask, saved_count);
  dist::ledger::set_line(where[0] ? where : "(no Lua line)");
}

void on_line_request(int) {
  lua_State* L = asked_state.load();
  if (!L) return;
  if (lua_gethook(L) != answer_line) {
    saved_hook = lua_gethook(L);
    saved_mask = lua_gethookmask(L);
    saved_count = lua_gethookcount(L);
  }
  lua_sethook(L, answer_line, LUA_MASKCOUNT | LUA_MASKLINE, 1);
}

// Under the launcher (which shares the ledger), answers its SIGUSR1 with the Lua line of `L`.
void answer_line_requests(lua_State* L) {
  if (!dist::ledger::shared()) return;
  struct sigaction sa {};
  sa.sa_handler = on_line_request;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  asked_state = L;
  if (sigaction(SIGUSR1, &sa, nullptr) == 0) dist::ledger::region()->line_ready = 1;
}

// A number's status as the system will report it: LuaJIT truncates it to an int and the system
// keeps its low 8 bits, so os.exit(256) and os.exit(0.5) end with status 0 and must count as
// ending; one outside an int's range is 1 (LuaJIT's conversion of it depends on the machine).
int exit_status_of(double n) {
  if (!(n > -2147483649.0 && n < 2147483648.0)) return 1;
  return static_cast<int>(static_cast<int64_t>(n)) & 0xff;
}

// os.exit with a successful status (none, true, 0, or a number the system reports as 0) first
// ends this rank's part of the run as the script's end does: rank 0 waits there for the others,
// whose store it serves (World::shutdown), and the others say they are done, so rank 0 does not
// wait for them in vain. Then it exits as Lua's own os.exit does, which stays in the registry.
int exit_after_run(Args& a) {
  lua_State* L = a.L;
  if (!a.none(1) && !lua_isboolean(L, 1) && lua_isnumber(L, 1)) {
    lua_pushinteger(L, exit_status_of(lua_tonumber(L, 1)));  // the status that will be seen, passed as it is
    lua_replace(L, 1);
  }
  const bool success = a.none(1) || (lua_isboolean(L, 1) ? lua_toboolean(L, 1) != 0
                                                          : lua_isnumber(L, 1) && lua_tonumber(L, 1) == 0);
  if (success) dist::World::instance().shutdown();
  lua_getfield(L, LUA_REGISTRYINDEX, "partrain.os_exit");
  lua_insert(L, 1);
  lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
  return lua_gettop(L);
}

void replace_os_exit(lua_State* L) {
  lua_getglobal(L, "os");
  lua_getfield(L, -1, "exit");
  lua_setfield(L, LUA_REGISTRYINDEX, "partrain.os_exit");
  static const Function exit{"os.exit", exit_after_run};
  push_function(L, exit);
  lua_setfield(L, -2, "exit");
  lua_pop(L, 1);
}

// The state whose garbage is collected before the first training step's memory is noted.
std::atomic<lua_State*> collected_state{nullptr};

void collect_before_first_step() {
  if (lua_State* L = collected_state.load()) lua_gc(L, LUA_GCCOLLECT, 0);
}

void stop_answering(lua_State* L) {
  if (asked_state.load() != L) return;
  dist::ledger::region()->line_ready = 0;  // the launcher stops asking; a late signal finds no state
  asked_state = nullptr;
}

}  // namespace

Paths find_paths() {
  std::vector<Paths> candidates;
  if (const char* home = std::getenv("PARTRAIN_HOME"))
    candidates.push_back({std::string(home) + "/lua", home});
  std::string exe = exe_dir();
  if (!exe.empty()) candidates.push_back({exe + "/../share/partrain/lua", exe + "/../share/partrain"});
  candidates.push_back({std::string(PARTRAIN_SOURCE_DIR) + "/bindings/lua", PARTRAIN_SOURCE_DIR});
  for (const auto& c : candidates)
    if (is_dir(c.lua + "/partrain/init.lua")) return c;
  return candidates.back();
}

Host::Host() : L_(luaL_newstate()), alive_(std::make_shared<bool>(true)) {
  if (!L_) throw std::runtime_error("cannot create a Lua state (out of memory)");
  luaL_openlibs(L_);
  // The host's liveness flag, for engine objects that hold Lua references (Lua-defined modules).
  lua_pushlightuserdata(L_, &alive_);  // a std::shared_ptr<bool>*
  lua_setfield(L_, LUA_REGISTRYINDEX, "partrain.alive");
  lua_pushlightuserdata(L_, L_);
  lua_setfield(L_, LUA_REGISTRYINDEX, "partrain.main");
  // The traceback function, fetched once: a script that replaces `debug` keeps its tracebacks.
  lua_getglobal(L_, "debug");
  lua_getfield(L_, -1, "traceback");
  lua_setfield(L_, LUA_REGISTRYINDEX, "partrain.traceback");
  lua_pop(L_, 1);

  Paths paths = find_paths();
  lua_getglobal(L_, "package");
  std::string path = paths.lua + "/?.lua;" + paths.lua + "/?/init.lua;" + paths.policies +
                     "/?.lua;" + paths.policies + "/?/init.lua;";
  lua_getfield(L_, -1, "path");
  path += lua_tostring(L_, -1);
  lua_pop(L_, 1);
  lua_pushstring(L_, path.c_str());
  lua_setfield(L_, -2, "path");
  // The C half of the library, loaded by partrain/init.lua as require "partrain.core".
  lua_getfield(L_, -1, "preload");
  lua_pushcfunction(L_, open_core);
  lua_setfield(L_, -2, "partrain.core");
  lua_pop(L_, 2);
  answer_line_requests(L_);
  replace_os_exit(L_);
  collected_state = L_;
  plan::set_before_first_step(collect_before_first_step);
}

Host::~Host() {
  stop_answering(L_);
  lua_State* mine = L_;
  if (collected_state.compare_exchange_strong(mine, nullptr)) plan::set_before_first_step(nullptr);
  *alive_ = false;
  void* ud = nullptr;
  Budget* budget = lua_getallocf(L_, &ud) == budgeted_alloc ? static_cast<Budget*>(ud) : nullptr;
  // Finalizers run inside lua_close while the state is still usable; mark it dying after.
  lua_close(L_);
  delete budget;
}

void Host::set_arg_table(const std::string& script, const std::vector<std::string>& args) {
  lua_createtable(L_, static_cast<int>(args.size()), 2);
  lua_pushstring(L_, "partrain");
  lua_rawseti(L_, -2, -1);
  lua_pushstring(L_, script.c_str());
  lua_rawseti(L_, -2, 0);
  for (size_t i = 0; i < args.size(); ++i) {
    lua_pushstring(L_, args[i].c_str());
    lua_rawseti(L_, -2, static_cast<int>(i + 1));
  }
  lua_setglobal(L_, "arg");
}

namespace {

constexpr uint64_t kMaxScriptBytes = 64ull << 20;  // a Lua script; more is not a script

// Loads Lua source (never bytecode: LuaJIT does not verify it, and a bytecode file can crash
// it) as a chunk named `name`. On failure leaves nothing on the stack and sets `error`.
bool load_source(lua_State* L, const std::string& code, const std::string& name, std::string* error) {
  if (luaL_loadbufferx(L, code.data(), code.size(), name.c_str(), "t") == 0) return true;
  *error = lua_tostring(L, -1);
  lua_pop(L, 1);
  if (code.compare(0, 3, "\x1bLJ") == 0)
    *error = (name[0] == '@' || name[0] == '=' ? name.substr(1) : name) + ": LuaJIT bytecode; partrain runs Lua source only";
  return false;
}

// A script's source: a regular file of bounded size, read once (a FIFO or a folder is refused,
// never waited on), with a #! first line blanked (its line still counts).
bool read_script(const std::string& path, std::string* code, std::string* error) {
  try {
    *code = util::read_regular(path, "script", kMaxScriptBytes);
  } catch (const std::exception& e) {
    *error = message_of(e);
    return false;
  }
  if (!code->empty() && (*code)[0] == '#') code->erase(0, std::min(code->find('\n'), code->size()));
  return true;
}

}  // namespace

bool check_script(const std::string& path, std::string* error) {
  std::string code;
  if (!read_script(path, &code, error)) return false;
  lua_State* L = luaL_newstate();
  if (!L) {
    *error = "cannot create a Lua state (out of memory)";
    return false;
  }
  bool ok = load_source(L, code, "@" + path, error);
  lua_close(L);
  return ok;
}

bool Host::run_file(const std::string& path, const std::vector<std::string>& args,
                    std::string* error) {
  std::string code;
  if (!read_script(path, &code, error)) return false;
  set_arg_table(path, args);
  // The script's own folder comes first on package.path, so it can require its neighbours.
  std::string dir = dir_of(path);
  lua_getglobal(L_, "package");
  lua_getfield(L_, -1, "path");
  std::string p = dir + "/?.lua;" + dir + "/?/init.lua;" + lua_tostring(L_, -1);
  lua_pop(L_, 1);
  lua_pushstring(L_, p.c_str());
  lua_setfield(L_, -2, "path");
  lua_pop(L_, 1);

  if (!load_source(L_, code, "@" + path, error)) return false;
  for (const auto& a : args) lua_pushstring(L_, a.c_str());
  return pcall(L_, static_cast<int>(args.size()), 0, error, /*traceback=*/true);
}

bool Host::run_string(const std::string& code, const std::string& chunkname, std::string* error) {
  if (!load_source(L_, code, chunkname, error)) return false;
  return pcall(L_, 0, 0, error, /*traceback=*/true);
}

bool Host::eval(const std::string& code, std::string* result, std::string* error) {
  if (!load_source(L_, code, "=eval", error)) return false;
  if (!pcall(L_, 0, 1, error, true)) return false;
  lua_getglobal(L_, "tostring");
  lua_insert(L_, -2);
  if (!pcall(L_, 1, 1, error)) return false;
  *result = lua_isstring(L_, -1) ? lua_tostring(L_, -1) : "(tostring returned no string)";
  lua_pop(L_, 1);
  return true;
}

}  // namespace partrain::lua
