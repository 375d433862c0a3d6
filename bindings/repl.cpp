// What the SPMD REPL (partrain/repl.lua) needs from C: line editing with history and completion
// (GNU readline), evaluation that Ctrl-C interrupts (lua.c's way: a signal handler installs a
// hook that raises an error at the next Lua instruction), strings as byte tensors to send them
// between ranks, and the process's memory.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include <readline/history.h>
#include <readline/readline.h>

#include "bindings/lua.hpp"
#include "engine/plan/plan.hpp"

namespace partrain::lua {

namespace {

// ---- Interrupting an evaluation ------------------------------------------------------------

lua_State* volatile interrupt_target = nullptr;  // the state evaluating, while one is
volatile sig_atomic_t interrupted_at_prompt = 0;

void interrupt_hook(lua_State* L, lua_Debug*) {
  lua_sethook(L, nullptr, 0, 0);
  luaL_error(L, "interrupted");
}

void on_sigint(int) {
  if (lua_State* L = interrupt_target) lua_sethook(L, interrupt_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1);
  else interrupted_at_prompt = 1;
}

// SIGINT goes to on_sigint from the first REPL call on: a REPL session is never ended by Ctrl-C.
void install_sigint() {
  static bool installed = false;
  if (installed) return;
  installed = true;
  struct sigaction sa {};
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
}

// ---- Completion ----------------------------------------------------------------------------

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

// Ctrl-C while reading: readline calls this after the signal; the line is abandoned.
int on_signal_event() {
  if (!interrupted_at_prompt) return 0;
  rl_replace_line("", 0);
  rl_done = 1;
  return 0;
}

const Function kRepl[] = {
    {"repl_isatty", [](Args& a) { return a.ret(isatty(STDIN_FILENO) == 1 && isatty(STDOUT_FILENO) == 1); }},
    {"repl_start", [](Args& a) {  // repl_start(history_file, completer)
       install_sigint();
       std::string history = a.string(1);
       if (lua_type(a.L, 2) != LUA_TFUNCTION) a.expected(2, "completion function");
       completer = std::make_unique<LuaRef>(a.L, 2);
       rl_readline_name = "partrain";
       rl_attempted_completion_function = complete;
       rl_basic_word_break_characters = const_cast<char*>(" \t\n\"\\'`@$><=;|&{(,[+-*/%^~#");
       rl_signal_event_hook = on_signal_event;
       using_history();
       read_history(history.c_str());  // a missing file is fine: the first session
       return a.ret(); }},
    {"repl_stop", [](Args& a) {  // repl_stop(history_file): saves the history (the last 1000 lines)
       std::string history = a.string(1);
       write_history(history.c_str());
       history_truncate_file(history.c_str(), 1000);
       completer.reset();
       return a.ret(); }},
    {"repl_readline", [](Args& a) {  // a line; "\0interrupt" after Ctrl-C; nil at end of input
       install_sigint();
       interrupted_at_prompt = 0;
       char* line = readline(a.string(1).c_str());
       if (interrupted_at_prompt) {
         std::free(line);
         std::fputs("\n", stdout);
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
       install_sigint();
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
       struct Target {  // evaluation ends however this frame is left
         explicit Target(lua_State* L) { interrupt_target = L; }
         ~Target() {
           if (lua_State* L = interrupt_target) lua_sethook(L, nullptr, 0, 0);
           interrupt_target = nullptr;
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
    // the bytes LibTorch's tensors hold on the CPU, in bytes.
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
       auto cpu = plan::memory(c10::kCPU);
       lua_createtable(a.L, 0, 4);
       lua_pushnumber(a.L, resident); lua_setfield(a.L, -2, "resident");
       lua_pushnumber(a.L, peak); lua_setfield(a.L, -2, "resident_peak");
       lua_pushnumber(a.L, double(cpu.allocated)); lua_setfield(a.L, -2, "allocated");
       lua_pushnumber(a.L, double(cpu.peak)); lua_setfield(a.L, -2, "allocated_peak");
       return 1; }},
    {"reset_peak", [](Args& a) { plan::reset_peak(c10::kCPU); return a.ret(); }},
    {nullptr, nullptr}};

}  // namespace

void open_repl(lua_State* L, int core) { set_functions(L, core, kRepl); }

}  // namespace partrain::lua
