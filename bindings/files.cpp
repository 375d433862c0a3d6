// Files a script's run reads or appends to through partrain's file rules (engine/util): the
// metrics file (JSON lines, appended a line a write), --config files (read whole, bounded), the
// terminal the live progress line is drawn on, and the GPU models the driver lists.
#include <sys/ioctl.h>
#include <unistd.h>

#include <cstdlib>

#include "bindings/lua.hpp"
#include "engine/util/files.hpp"
#include "engine/util/jsonl.hpp"
#include "engine/util/text.hpp"

namespace partrain::lua {

namespace {

#define PT_JSONL_MT "partrain.JsonLines"
using JsonLinesPtr = std::shared_ptr<util::JsonLines>;

constexpr uint64_t kMaxMetricsBytes = 1ull << 30;  // rewritten in memory on resume: bounded
constexpr uint64_t kMaxConfigBytes = 1ull << 20;   // a table of option values

JsonLinesPtr& jsonl(const Args& a, int i) { return ud_check<JsonLinesPtr>(a, i, PT_JSONL_MT, "JSON-lines file"); }

const Function kJsonLinesMethods[] = {
    {"append", [](Args& a) { jsonl(a, 1)->append(a.string(2)); return a.ret(); }},
    {"close", [](Args& a) { jsonl(a, 1)->close(); return a.ret(); }},
    {"path", [](Args& a) { return a.ret(jsonl(a, 1)->path()); }},
    {nullptr, nullptr}};

const Function kFiles[] = {
    // jsonl_open(path, what) -> a JSON-lines file open for appending (created when missing).
    {"jsonl_open", [](Args& a) {
       ud_push(a.L, std::make_shared<util::JsonLines>(a.string(1), a.string(2, "metrics file")), PT_JSONL_MT);
       return 1; }},
    // jsonl_drop(path, from_step, what) -> lines dropped: records with step >= from_step (every
    // step stays when from_step < 0) and lines that are not whole JSON objects.
    {"jsonl_drop", [](Args& a) {
       return a.ret(double(util::drop_records(a.string(1), a.number(2), a.string(3, "metrics file"), kMaxMetricsBytes))); }},
    // nearest_word(words, word) -> the word of the array `words` nearest to `word`, or nil (pt.args'
    // "did you mean", util::nearest_word's rule).
    {"nearest_word", [](Args& a) {
       luaL_checktype(a.L, 1, LUA_TTABLE);
       std::vector<std::string> words;
       for (int i = 1, n = static_cast<int>(lua_objlen(a.L, 1)); i <= n; ++i) {
         lua_rawgeti(a.L, 1, i);
         if (lua_type(a.L, -1) == LUA_TSTRING) words.emplace_back(lua_tostring(a.L, -1));
         lua_pop(a.L, 1);
       }
       std::string near = util::nearest_word(words, a.string(2));
       return near.empty() ? a.ret() : a.ret(near); }},
    // read_config(path) -> the text of a config file: a regular file of at most 1 MiB.
    {"read_config", [](Args& a) { return a.ret(util::read_regular(a.string(1), "config file", kMaxConfigBytes)); }},
    // stdout_terminal() -> whether stdout is a terminal (under the launcher: whether rank 0's
    // output reaches one, PARTRAIN_STDOUT_TERMINAL=1), and its width in columns (0: unknown).
    {"stdout_terminal", [](Args& a) {
       const char* env = std::getenv("PARTRAIN_STDOUT_TERMINAL");
       bool terminal = isatty(STDOUT_FILENO) == 1 || (env && std::string(env) == "1");
       winsize ws{};
       double columns = ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 ? ws.ws_col : 0;
       if (columns == 0)
         if (const char* c = std::getenv("COLUMNS")) columns = std::atof(c);
       lua_pushboolean(a.L, terminal);
       lua_pushnumber(a.L, columns > 0 && columns < 10000 ? columns : 0);
       return 2; }},
    {nullptr, nullptr}};

}  // namespace

void open_files(lua_State* L, int core) {
  new_metatable<JsonLinesPtr>(L, PT_JSONL_MT, kJsonLinesMethods, /*keep=*/false);
  set_library(L, core, "files", kFiles);
}

}  // namespace partrain::lua
