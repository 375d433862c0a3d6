// The partrain command: runs Lua training scripts on the engine (`partrain train.lua`), single
// chunks (`-e`), and, with --nproc-per-node, launches one process per rank like torchrun. Under
// torchrun or SLURM (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) it runs as that one rank.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "app/launcher.hpp"
#include "app/tools.hpp"
#include "bindings/host.hpp"
#include "engine/compat.hpp"
#include "engine/dist/world.hpp"
#include "engine/plan/plan.hpp"

namespace {

int fail(const std::string& message) {
  std::cerr << "partrain: " << message << std::endl;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  partrain::plan::install_allocators();  // before any tensor, so mem() counts them all
  CLI::App app{"partrain: distributed training on LibTorch, driven by Lua.\n\n"
               "  partrain script.lua [args...]                  run a training script\n"
               "  partrain --nproc-per-node 4 script.lua [args]  run it as 4 local ranks\n"
               "  partrain -e 'lua code'                         run a chunk of Lua\n"
               "  partrain -i script.lua                         run it, then open the REPL\n"
               "  partrain [--nproc-per-node 4] repl             open the REPL (on every rank)\n"
               "  partrain plan --world 8 script.lua [args]      what each of 8 ranks would hold (no processes)\n"
               "  partrain ckpt inspect|verify|convert|export    look after checkpoints (partrain ckpt --help)\n",
               "partrain"};
  app.set_version_flag("--version", std::string("partrain ") + PARTRAIN_VERSION + " (LibTorch " +
                                        partrain::compat::torch_version() + ", LuaJIT)");
  std::vector<std::string> chunks;
  int threads = 0;
  int timeout = 0;
  std::string script;
  std::vector<std::string> script_args;
  partrain::app::LaunchOptions launch;
  int nproc = 0;
  app.add_option("-e,--execute", chunks, "run this Lua code (before the script, if any)")->allow_extra_args(false);
  bool interactive = false;
  app.add_flag("-i,--interactive", interactive, "after the script (or -e), open the REPL in its globals: rank 0 reads, "
               "every rank runs each chunk, outputs come back grouped by rank");
  app.add_option("--threads", threads, "intra-op threads for LibTorch (default: all cores; with "
                 "--nproc-per-node, cores / local ranks)")->check(CLI::PositiveNumber);
  app.add_option("--nproc-per-node", nproc, "ranks to start on this machine (launcher mode)")
      ->check(CLI::PositiveNumber);
  app.add_option("--nnodes", launch.nnodes, "machines taking part (default 1)");
  app.add_option("--node-rank", launch.node_rank, "this machine's index, 0..nnodes-1 (default 0)");
  app.add_option("--master-addr", launch.master_addr, "host where rank 0 serves the rendezvous "
                 "(default 127.0.0.1)");
  app.add_option("--master-port", launch.master_port, "its port (default: a free one; required with --nnodes > 1)");
  app.add_flag("--tee", launch.tee, "show every rank's stdout, each line prefixed with its rank");
  app.add_option("--timeout", timeout, "seconds a collective or the rendezvous may wait before "
                 "failing (default 300)")->check(CLI::PositiveNumber);
  bool check_collectives = false;
  app.add_flag("--check-collectives", check_collectives, "before every collective, check that all ranks of its "
               "group call the same one (debugging; costs a small all-gather each)");
  std::string plan_file, plan_mode = "match";
  app.add_option("--plan", plan_file, "check the run against this saved plan (partrain plan --save) at its first "
                 "optimizer step");
  app.add_option("--plan-mode", plan_mode, "with --plan: match (fail on any difference), override (write this "
                 "run's plan over it) or moo (match if it agrees, otherwise override)")
      ->check(CLI::IsMember({"match", "override", "moo"}));
  app.add_option("script", script, "the Lua script to run; the arguments after it reach it as `arg`");

  // partrain's own flags come before the script; everything from the script on is the script's.
  int split = partrain::app::split_at_script(app, 1, argc, argv);
  // `partrain plan ...` (a file called plan, if there is one, is still a script).
  if (split < argc && std::string(argv[split]) == "plan" && access("plan", F_OK) != 0) {
    if (split != 1) return fail("plan takes no partrain flags before it: partrain plan --world N script.lua");
    return partrain::app::run_plan(argc, argv, split + 1);
  }
  if (split < argc && std::string(argv[split]) == "ckpt" && access("ckpt", F_OK) != 0) {
    if (split != 1) return fail("ckpt takes no partrain flags before it: partrain ckpt inspect DIR");
    return partrain::app::run_ckpt(argc, argv, split + 1);
  }
  if (split < argc) {
    script = argv[split];
    for (int i = split + 1; i < argc; ++i) script_args.emplace_back(argv[i]);
  }
  try {
    app.parse(split, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;  // --help is a success; any mistake exits 1, as every error does
  }

  // `partrain repl`: the REPL alone (a file called repl, if there is one, is still a script).
  if (script == "repl" && script_args.empty() && access("repl", F_OK) != 0) {
    script.clear();
    interactive = true;
  }
  if (chunks.empty() && script.empty() && !interactive) {
    std::cerr << app.help() << std::endl;
    return fail("nothing to run: give a script or -e CODE");
  }
  if (check_collectives) setenv("PARTRAIN_CHECK_COLLECTIVES", "1", 1);  // ranks inherit it
  if (!plan_file.empty()) {
    setenv("PARTRAIN_PLAN", plan_file.c_str(), 1);
    setenv("PARTRAIN_PLAN_MODE", plan_mode.c_str(), 1);
  } else if (app.count("--plan-mode")) {
    return fail("--plan-mode needs --plan FILE");
  }
  bool launcher_flags = app.count("--nnodes") || app.count("--node-rank") || app.count("--master-addr") ||
                        app.count("--master-port") || app.count("--tee");
  if (launcher_flags && nproc == 0) return fail("--nnodes, --node-rank, --master-addr, --master-port and --tee "
                                                "need --nproc-per-node");

  // Launcher mode: start the ranks, each running this same command without the launcher flags.
  if (nproc > 0) {
    launch.nproc_per_node = nproc;
    launch.threads = threads;
    launch.interactive = interactive;
    if (timeout > 0) launch.timeout = timeout;
    std::vector<std::string> child;
    if (interactive) child.push_back("-i");
    for (const auto& c : chunks) {
      child.push_back("-e");
      child.push_back(c);
    }
    if (!script.empty()) child.push_back(script);
    child.insert(child.end(), script_args.begin(), script_args.end());
    try {
      return partrain::app::launch(launch, child);
    } catch (const std::exception& e) {
      return fail(e.what());
    }
  }

  if (threads > 0) at::set_num_threads(threads);
  if (timeout > 0) setenv("PARTRAIN_TIMEOUT", std::to_string(timeout).c_str(), 1);
  std::string where;  // "rank N: " in messages once there are several ranks
  try {
    // One rank of several (started by the launcher, torchrun or SLURM): join the others first,
    // so a rendezvous problem shows before the script runs.
    auto world_options = partrain::dist::world_options_from_env();
    if (world_options.world_size > 1) {
      where = "rank " + std::to_string(world_options.rank) + ": ";
      partrain::dist::World::instance().init(world_options);
    }
  } catch (const std::exception& e) {
    return fail(where + partrain::compat::message_of(e));
  }

  try {
    partrain::lua::Host host;
    std::string error;
    for (size_t i = 0; i < chunks.size(); ++i)
      if (!host.run_string(chunks[i], "=(command line)", &error)) return fail(where + error);
    if (!script.empty() && !host.run_file(script, script_args, &error)) return fail(where + error);
    if (interactive && !host.run_string("require('partrain.repl').loop(_G, 'partrain ' .. require('partrain').version .. "
                                        "' REPL on ' .. require('partrain').dist.world_size() .. ' rank(s): every "
                                        "chunk runs on every rank; shards(), mesh(), mem(), on(rank, fn), exit()')",
                                        "=(repl)", &error))
      return fail(where + error);
    std::fflush(stdout);
    partrain::dist::World::instance().shutdown();  // wait for the others before leaving
  } catch (const std::exception& e) {
    return fail(where + partrain::compat::message_of(e));
  }
  return 0;
}
