// The partrain command: runs Lua training scripts on the engine (`partrain train.lua`), single
// chunks (`-e`), and prints its version and flags. Launcher, REPL, plan and ckpt build on it.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "bindings/host.hpp"
#include "engine/compat.hpp"

namespace {

int fail(const std::string& message) {
  std::cerr << "partrain: " << message << std::endl;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"partrain: distributed training on LibTorch, driven by Lua.\n\n"
               "  partrain script.lua [args...]    run a training script\n"
               "  partrain -e 'lua code'           run a chunk of Lua\n",
               "partrain"};
  app.set_version_flag("--version", std::string("partrain ") + PARTRAIN_VERSION + " (LibTorch " +
                                        partrain::compat::torch_version() + ", LuaJIT)");
  std::vector<std::string> chunks;
  int threads = 0;
  std::string script;
  std::vector<std::string> script_args;
  app.add_option("-e,--execute", chunks, "run this Lua code (before the script, if any)")
      ->allow_extra_args(false);
  app.add_option("--threads", threads,
                 "intra-op threads for LibTorch (default: all cores)")
      ->check(CLI::PositiveNumber);
  app.add_option("script", script, "the Lua script to run; the arguments after it reach it as `arg`");

  // partrain's own flags come before the script; everything from the script on is the script's,
  // even words that look like partrain flags (`train.lua --help` asks the script for help).
  int split = 1;
  while (split < argc) {
    std::string word = argv[split];
    if (word.empty() || word[0] != '-' || word == "-") break;
    ++split;
    auto* option = word.rfind("--", 0) == 0 ? app.get_option_no_throw(word.substr(0, word.find('=')))
                                            : app.get_option_no_throw(word.substr(0, 2));
    bool inline_value = word.find('=') != std::string::npos || (word[1] != '-' && word.size() > 2);
    if (option && option->get_items_expected_min() > 0 && !inline_value && split < argc) ++split;  // its value
  }
  if (split < argc) {
    script = argv[split];
    for (int i = split + 1; i < argc; ++i) script_args.emplace_back(argv[i]);
  }
  try {
    app.parse(split, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  if (chunks.empty() && script.empty()) {
    std::cerr << app.help() << std::endl;
    return fail("nothing to run: give a script or -e CODE");
  }
  if (threads > 0) at::set_num_threads(threads);

  try {
    partrain::lua::Host host;
    std::string error;
    for (size_t i = 0; i < chunks.size(); ++i)
      if (!host.run_string(chunks[i], "=(command line)", &error)) return fail(error);
    if (!script.empty() && !host.run_file(script, script_args, &error)) return fail(error);
    std::fflush(stdout);
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  return 0;
}
