// Files a script's run reads or appends to through partrain's file rules (engine/util): the
// metrics file (JSON lines, appended a line a write), --config files (read whole, bounded), the
// terminal the live progress line is drawn on, and the GPU models the driver lists.
#include <sys/ioctl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "bindings/lua.hpp"
#include "engine/util/files.hpp"
#include "engine/util/jsonl.hpp"

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
    // gpu_models() -> the model names NVIDIA's driver lists (/proc/driver/nvidia/gpus/*/information,
    // "Model: NVIDIA H100 80GB HBM3"), without initializing CUDA; {} without the driver.
    {"gpu_models", [](Args& a) {
       std::vector<std::string> models;
       std::error_code ec;
       for (const auto& gpu : std::filesystem::directory_iterator("/proc/driver/nvidia/gpus", ec)) {
         // A /proc file: its size reads as 0, so read a bounded prefix rather than read_regular.
         std::ifstream in(gpu.path() / "information");
         std::string info(4096, '\0');
         in.read(&info[0], static_cast<std::streamsize>(info.size()));
         info.resize(static_cast<size_t>(in.gcount()));
         auto at = info.find("Model:");
         if (at == std::string::npos) continue;
         auto end = info.find('\n', at);
         std::string model = info.substr(at + 6, end == std::string::npos ? std::string::npos : end - at - 6);
         model.erase(0, model.find_first_not_of(" \t"));
         models.push_back(model);
       }
       lua_createtable(a.L, static_cast<int>(models.size()), 0);
       for (size_t i = 0; i < models.size(); ++i) {
         lua_pushlstring(a.L, models[i].data(), models[i].size());
         lua_rawseti(a.L, -2, static_cast<int>(i + 1));
       }
       return 1; }},
    {nullptr, nullptr}};

}  // namespace

void open_files(lua_State* L, int core) {
  new_metatable<JsonLinesPtr>(L, PT_JSONL_MT, kJsonLinesMethods, /*keep=*/false);
  set_library(L, core, "files", kFiles);
}

}  // namespace partrain::lua
