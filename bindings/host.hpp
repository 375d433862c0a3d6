// The LuaJIT host: one Lua state with the partrain library loaded, running scripts and chunks
// with tracebacks on error. The CLI and the C++ tests use it; it hides lua.hpp from them.
#pragma once

#include <memory>
#include <string>
#include <vector>

struct lua_State;

namespace partrain::lua {

/// Where partrain's Lua library and policies live: $PARTRAIN_HOME, the install prefix next to
/// the executable, or the source tree the executable was built from.
struct Paths {
  std::string lua;       ///< folder holding partrain/init.lua
  std::string policies;  ///< folder whose parent makes `require "policies.x"` work
};
Paths find_paths();

/// Reads and compiles (without running) the script at `path`: false, with the message, when it
/// cannot be read, is not Lua source, or has a syntax error. The launcher asks once, before it
/// starts ranks that would each fail the same way.
bool check_script(const std::string& path, std::string* error);

/// Whether this run was asked for the REPL (partrain -i, partrain repl): under the launcher only
/// then does rank 0 read the terminal, so only then does pt.breakpoint() stop.
void set_interactive(bool on);

class Host {
 public:
  Host();
  ~Host();
  Host(const Host&) = delete;
  Host& operator=(const Host&) = delete;

  /// Runs a script file with `args` as its `arg` table and `...`. Returns true on success;
  /// otherwise `error` holds the message and traceback.
  bool run_file(const std::string& path, const std::vector<std::string>& args, std::string* error);
  /// Runs a chunk of Lua code named `chunkname` in messages.
  bool run_string(const std::string& code, const std::string& chunkname, std::string* error);
  /// Runs a chunk and returns its first result converted with tostring (for tests).
  bool eval(const std::string& code, std::string* result, std::string* error);

  lua_State* state() { return L_; }

 private:
  void set_arg_table(const std::string& script, const std::vector<std::string>& args);
  lua_State* L_;
  std::shared_ptr<bool> alive_;
};

}  // namespace partrain::lua
