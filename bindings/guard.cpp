// The boundary's guard: every C function runs through dispatch and every call into Lua through
// pcall, so an error reaches the user located at their own line, with their own frames.
#include "bindings/host.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bindings/lua.hpp"

namespace partrain::lua {

std::string message_of(const std::exception& e) { return util::message_of(e); }

// ---- Functions and the guard ---------------------------------------------------------------

namespace {

// The name of partrain's own Lua file a frame runs, relative to where partrain keeps it
// ("partrain/init.lua", "policies/gpt2.lua"), or nullptr when the frame runs someone else's:
// the library and the shipped policies are partrain's, so their errors and collectives are
// named by the user's line that led into them. A user's own policy file is the user's.
const char* library_file(const lua_Debug& ar) {
  static const Paths paths = find_paths();
  static const std::string roots[] = {"@" + paths.lua + "/", "@" + paths.policies + "/"};
  static const char* const folders[] = {"partrain/", "policies/"};
  if (!ar.source) return nullptr;
  for (int i = 0; i < 2; ++i) {
    const std::string& root = roots[i];
    if (std::strncmp(ar.source, root.c_str(), root.size()) != 0) continue;
    const char* rest = ar.source + root.size();
    if (std::strncmp(rest, folders[i], std::strlen(folders[i])) == 0) return rest;
  }
  return nullptr;
}

bool in_library(const lua_Debug& ar) { return library_file(ar) != nullptr; }

thread_local lua_State* active = nullptr;

// Every C function partrain exposes runs through here. The try block holds no Lua call that can
// raise, and lua_error runs only after the handler: every C++ object is destroyed by then.
int dispatch(lua_State* L) {
  auto* fn = static_cast<const Function*>(lua_touserdata(L, lua_upvalueindex(1)));
  struct Active {  // restores the outer thread however this frame is left
    lua_State* outer = active;
    explicit Active(lua_State* L) { active = L; }
    ~Active() { active = outer; }
  };
  try {
    Active scope(L);
    Args args(L, fn->name);
    return fn->body(args);
  } catch (const Rethrow& e) {
    lua_pushstring(L, e.what());
  } catch (const std::exception& e) {
    std::string msg = user_location(L);
    msg = (msg.empty() ? "" : msg + ": ") + message_of(e);
    lua_pushlstring(L, msg.data(), msg.size());
  }
  return lua_error(L);
}

// An error located inside partrain's own Lua library (a check raised at the wrong level, or a
// bug there) is moved to the user's line that led to it, keeping where it was raised:
// "train.lua:7: attempt to index local 'self' (a number value) (raised in partrain/init.lua:90)".
void relocate_library_error(lua_State* L) {
  size_t n;
  const char* text = lua_tolstring(L, 1, &n);
  std::string msg(text, n);
  lua_Debug ar;
  for (int level = 1; level < 32 && lua_getstack(L, level, &ar); ++level) {
    if (!lua_getinfo(L, "Sl", &ar) || !in_library(ar)) continue;
    std::string prefix = std::string(ar.short_src) + ":";
    if (msg.compare(0, prefix.size(), prefix) != 0) continue;
    size_t end = msg.find(": ", prefix.size());
    if (end == std::string::npos) return;
    bool is_user = false;
    std::string user = user_location(L, &is_user);
    if (!is_user) return;  // only library frames: keep the library's line
    msg = user + ": " + msg.substr(end + 2) + " (raised in " + library_file(ar) + ":" +
          msg.substr(prefix.size(), end - prefix.size()) + ")";
    lua_pushlstring(L, msg.data(), msg.size());
    lua_replace(L, 1);
    return;
  }
}

// An error object that is not a string is replaced by its __tostring, called under protection:
// one that raises or returns no text is described by its type instead, where a raise inside the
// handler would have left Lua's bare "error in error handling".
void describe_error_object(lua_State* L) {
  if (lua_isstring(L, 1)) return;
  const char* type = luaL_typename(L, 1);
  if (!luaL_getmetafield(L, 1, "__tostring")) {
    lua_pushfstring(L, "(error object is a %s value)", type);
  } else {
    lua_pushvalue(L, 1);
    int status = lua_pcall(L, 1, 1, 0);
    if (status == 0 && lua_isstring(L, -1)) {
      // its own text
    } else if (status == 0) {
      lua_pushfstring(L, "(error object is a %s value; its __tostring returned a %s)", type,
                      luaL_typename(L, -1));
    } else {
      const char* why = lua_isstring(L, -1) ? lua_tostring(L, -1) : luaL_typename(L, -1);
      lua_pushfstring(L, "(error object is a %s value; its __tostring raised: %s)", type, why);
    }
  }
  lua_replace(L, 1);
  lua_settop(L, 1);
}

// The frames of the user's own code, outermost last, as Lua's traceback writes them; partrain's
// Lua files and C functions are left out (the error already names the user's line). Empty when
// they hold no more than the frame the error names.
std::string user_traceback(lua_State* L) {
  std::vector<std::string> frames;
  lua_Debug ar;
  for (int level = 1; lua_getstack(L, level, &ar) && frames.size() < 24; ++level) {
    if (!lua_getinfo(L, "Snl", &ar) || ar.currentline <= 0 || in_library(ar)) continue;
    std::string what = ar.name && *ar.name ? "in function '" + std::string(ar.name) + "'"
                       : *ar.what == 'm'   ? std::string("in main chunk")
                                           : "in function <" + std::string(ar.short_src) + ":" +
                                                 std::to_string(ar.linedefined) + ">";
    frames.push_back("\t" + std::string(ar.short_src) + ":" + std::to_string(ar.currentline) + ": " + what);
  }
  if (frames.size() <= 1) return "";
  std::string out = "\nstack traceback:";
  for (const auto& f : frames) out += "\n" + f;
  return out;
}

// PARTRAIN_TRACEBACK=1: Lua's whole traceback, partrain's own frames included (for debugging
// partrain itself); otherwise the user's frames only.
bool full_traceback() {
  const char* env = std::getenv("PARTRAIN_TRACEBACK");
  return env && std::string(env) == "1";
}

int traceback_handler(lua_State* L) {
  describe_error_object(L);
  relocate_library_error(L);
  if (!full_traceback() && lua_type(L, 1) == LUA_TSTRING) {
    std::string message = lua_tostring(L, 1);
    message += user_traceback(L);
    lua_pushlstring(L, message.data(), message.size());
    return 1;
  }
  lua_getfield(L, LUA_REGISTRYINDEX, "partrain.traceback");
  lua_pushvalue(L, 1);
  lua_pushinteger(L, 2);
  lua_call(L, 2, 1);
  return 1;
}

int plain_handler(lua_State* L) {
  describe_error_object(L);
  relocate_library_error(L);
  lua_settop(L, 1);
  return 1;
}

}  // namespace

lua_State* active_state(lua_State* fallback) { return active ? active : fallback; }

bool user_location(lua_State* L, char* buf, size_t n, int first) {
  if (n == 0) return false;
  buf[0] = '\0';
  bool fallback = false;
  lua_Debug ar;
  for (int level = first; level < first + 32 && lua_getstack(L, level, &ar); ++level) {
    if (!lua_getinfo(L, "Sl", &ar) || ar.currentline <= 0) continue;  // a C function
    if (in_library(ar)) {
      if (!fallback) std::snprintf(buf, n, "%s:%d", ar.short_src, ar.currentline);
      fallback = true;
      continue;
    }
    std::snprintf(buf, n, "%s:%d", ar.short_src, ar.currentline);
    return true;
  }
  return false;
}

std::string user_location(lua_State* L, bool* is_user) {
  if (is_user) *is_user = false;
  std::string fallback;
  lua_Debug ar;
  for (int level = 1; level < 32 && lua_getstack(L, level, &ar); ++level) {
    if (!lua_getinfo(L, "Sl", &ar) || ar.currentline <= 0) continue;  // a C function
    std::string where = std::string(ar.short_src) + ":" + std::to_string(ar.currentline);
    if (in_library(ar)) {
      if (fallback.empty()) fallback = where;
      continue;
    }
    if (is_user) *is_user = true;
    return where;
  }
  return fallback;
}

lua_State* main_thread(lua_State* L) {
  lua_getfield(L, LUA_REGISTRYINDEX, "partrain.main");
  auto* main = static_cast<lua_State*>(lua_touserdata(L, -1));
  lua_pop(L, 1);
  return main ? main : L;
}

void push_function(lua_State* L, const Function& fn) {
  lua_pushlightuserdata(L, const_cast<Function*>(&fn));
  lua_pushcclosure(L, dispatch, 1);
}

void set_functions(lua_State* L, int table, const Function* fns) {
  table = table < 0 ? lua_gettop(L) + table + 1 : table;
  for (; fns->name; ++fns) {
    push_function(L, *fns);
    lua_setfield(L, table, fns->name);
  }
}

void set_library(lua_State* L, int table, const char* name, const Function* fns) {
  table = table < 0 ? lua_gettop(L) + table + 1 : table;
  lua_newtable(L);
  set_functions(L, -1, fns);
  lua_setfield(L, table, name);
}

bool pcall(lua_State* L, int nargs, int nresults, std::string* error, bool traceback) {
  int base = lua_gettop(L) - nargs;  // the function's index
  lua_pushcfunction(L, traceback ? traceback_handler : plain_handler);
  lua_insert(L, base);
  int status = lua_pcall(L, nargs, nresults, base);
  lua_remove(L, base);
  if (status == 0) return true;
  if (error) *error = lua_isstring(L, -1) ? lua_tostring(L, -1) : "(error without a message)";
  lua_pop(L, 1);
  return false;
}

}  // namespace partrain::lua
