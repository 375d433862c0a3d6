// The partrain command: runs Lua training scripts on the engine (`partrain train.lua`), single
// chunks (`-e`), and, with --nproc-per-node, launches one process per rank like torchrun. Under
// torchrun or SLURM (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) it runs as that one rank.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "app/launcher.hpp"
#include "app/parity.hpp"
#include "app/report.hpp"
#include "app/tools.hpp"
#include "bindings/host.hpp"
#include "engine/compat.hpp"
#include "engine/dist/world.hpp"
#include "engine/nn/layers.hpp"
#include "engine/parallel/trace.hpp"
#include "engine/plan/plan.hpp"
#include "engine/util/files.hpp"
#include "engine/util/startup.hpp"
#include "engine/util/text.hpp"

namespace {

int fail(const std::string& message) {
  std::cerr << "partrain: " << message << std::endl;
  return 1;
}

// A rank's fatal error: told to the launcher (when one started the rank) with the time it
// happened, so that it can name the rank that failed first and say the error once for the job;
// said on stderr when no launcher took it.
int rank_fail(const std::string& message) {
  // A rank that keeps the terminal (rank 0 of the REPL) says it there too: it is the user's view.
  if (partrain::app::report_failure(message) && isatty(STDERR_FILENO) != 1) return 1;
  return fail(message);
}

constexpr int kMaxThreads = 1024;  // --threads: more would only stall the machine

// What one rank runs, from the command line: the same whether the rank was exec'd (main parses
// it from argv) or forked by the launcher (the launcher's parse, inherited).
struct RankRun {
  int threads = 0;                      ///< intra-op threads; 0: LibTorch's default
  int timeout = 0;                      ///< --timeout, seconds; 0: the default
  bool interactive = false;             ///< -i: the REPL after the script
  std::vector<std::string> chunks;      ///< -e chunks, in order
  std::string script;                   ///< empty: none
  std::vector<std::string> script_args;
};

// One rank (or the only process): joins the world when there are several ranks, then runs the
// chunks, the script and the REPL. Returns the exit status.
int run_rank(const RankRun& run) {
  const auto& chunks = run.chunks;
  const auto& script = run.script;
  const bool interactive = run.interactive;
  if (run.threads > 0) at::set_num_threads(run.threads);
  if (run.timeout > 0) setenv("PARTRAIN_TIMEOUT", std::to_string(run.timeout).c_str(), 1);
  partrain::lua::set_interactive(interactive);
  std::string where;  // "rank N: " in messages once there are several ranks
  try {
    // One rank of several (started by the launcher, torchrun or SLURM): join the others first,
    // so a rendezvous problem shows before the script runs.
    auto world_options = partrain::dist::world_options_from_env();
    unsetenv("PARTRAIN_RDZV_SECRET");  // read: the script's own children have no use for it
    unsetenv("PARTRAIN_RDZV_FD");
    if (world_options.world_size > 1) {
      where = "rank " + std::to_string(world_options.rank) + ": ";
      // With -i, Ctrl-C reaches every rank. Outside the REPL it is rank 0's to act on (it ends
      // the run); another rank, still starting or finishing the script, must not die of it.
      if (interactive && world_options.rank != 0) {
        struct sigaction sa {};
        sa.sa_handler = [](int) {};
        sigaction(SIGINT, &sa, nullptr);
      }
      partrain::util::startup_mark("world init begins");
      partrain::dist::World::instance().init(world_options);
      partrain::util::startup_mark("world init ends");
    }
    // Modules built from here on (pt.nn, pt.models) put their parameters on this rank's device.
    partrain::nn::set_parameter_options(torch::TensorOptions().device(partrain::dist::World::instance().device()));
  } catch (const std::exception& e) {
    return rank_fail(where + partrain::util::message_of(e));
  }

  try {
    partrain::lua::Host host;
    std::string error;
    partrain::util::startup_mark("script starts");
    for (size_t i = 0; i < chunks.size(); ++i)
      if (!host.run_string(chunks[i], "=(command line)", &error)) return rank_fail(where + error);
    if (!script.empty() && !host.run_file(script, run.script_args, &error)) return rank_fail(where + error);
    if (interactive) {
      // The REPL returns why it could not read the terminal (a background process group), if so.
      std::string why;
      if (!host.eval("return require('partrain.repl').loop(_G, 'partrain ' .. require('partrain').version .. "
                     "' REPL on ' .. require('partrain').dist.world_size() .. ' rank(s): every chunk runs on "
                     "every rank; shards(), mesh(), mem(), on(rank, fn), exit()')",
                     &why, &error))
        return rank_fail(where + error);
      if (why != "nil") return rank_fail(where + "the REPL cannot start: " + why);
    }
    // --trace records model:train_step; a script that never calls it leaves no file: say so.
    auto& trace = partrain::parallel::StepTrace::instance();
    if (!trace.options().path.empty() && trace.recorded() == 0 && partrain::dist::World::instance().rank() == 0)
      std::cerr << "partrain: --trace: the script ran no model:train_step, so no trace was written to '"
                << trace.file() << "'" << std::endl;
    std::fflush(stdout);
    partrain::util::startup_mark("script ended");
    partrain::dist::World::instance().shutdown();  // wait for the others before leaving
    partrain::util::startup_mark("world shut down");
  } catch (const std::exception& e) {
    return rank_fail(where + partrain::util::message_of(e));
  }
  return 0;
}

// Flushes what the process wrote and ends it without running static destructors: LibTorch's
// deregister every operator it registered (~0.3 s of CPU, and several times that in a forked
// rank, whose every page they touch is copied from the launcher's). Everything partrain writes is
// closed or flushed by then; the world is shut down explicitly.
[[noreturn]] void leave(int status) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  _exit(status);
}

int run_main(int argc, char** argv);

}  // namespace

int main(int argc, char** argv) { leave(run_main(argc, argv)); }

namespace {

// What the command line says: each flag's text as given (checked later, naming the flag), what
// the flags set directly, and the numbers once checked.
struct CommandLine {
  std::vector<std::string> chunks;
  std::string threads_text, timeout_text, nproc_text, nnodes_text, node_rank_text, port_text;
  std::string restarts_text, backoff_text, node_timeout_text, hang_text;
  std::string script;
  std::vector<std::string> script_args;
  bool script_given = false;
  partrain::app::LaunchOptions launch;
  bool interactive = false;
  std::string device;
  bool check_collectives = false;
  std::string plan_file, plan_mode = "match";
  std::string trace_file, trace_steps_text;
  std::string metrics_file;
  bool no_progress = false;
  int threads = 0, timeout = 0, nproc = 0, trace_steps = 3;  ///< checked by check_numbers
};

// What every partrain process does first; a problem with the process's setup, or "".
std::string prepare_process() {
  // Output leaves a line at a time whether it goes to a terminal, a file or the launcher's pipe:
  // a training log shows each step as it is printed (tail -f, or rank 0's lines passed on by the
  // launcher), not in bursts of a buffer's size or at the end of the run.
  std::setvbuf(stdout, nullptr, _IOLBF, BUFSIZ);
  if (const char* rank = std::getenv("RANK")) partrain::util::startup_set_who("rank " + std::string(rank));
  partrain::util::startup_mark("main entered");
  partrain::app::adopt_report_channel();
  partrain::dist::set_fatal_reporter([](const std::string& m) { partrain::app::report_failure(m); });  // Gloo's too
  partrain::util::install_allocators();  // before any tensor, so mem() counts them all
  return partrain::util::malloc_setting_problem();
}

const char* const kUsage =
    "partrain: distributed training on LibTorch, driven by Lua.\n\n"
    "  partrain script.lua [args...]                  run a training script\n"
    "  partrain --nproc-per-node 4 script.lua [args]  run it as 4 local ranks\n"
    "  partrain -e 'lua code'                         run a chunk of Lua\n"
    "  partrain -i script.lua                         run it, then open the REPL\n"
    "  partrain repl [--nproc-per-node 4]             open the REPL (on every rank)\n"
    "  partrain plan --world 8 script.lua [args]      what each of 8 ranks would hold (no processes)\n"
    "  partrain ckpt inspect|verify|convert|export    look after checkpoints (partrain ckpt --help)\n"
    "  partrain report RUN... [-o report.html]        an HTML page of runs' metrics (partrain report --help)\n"
    "  partrain parity A B [--tol T]                  do two runs' losses agree? (partrain parity --help)\n"
    "\n  plan, ckpt, report, parity and repl are always these commands; a script of that name runs as ./plan\n";

void add_flags(CLI::App& app, CommandLine& c) {
  auto& launch = c.launch;
  app.add_option("-e,--execute", c.chunks, "run this Lua code (before the script, if any)")->allow_extra_args(false);
  app.add_flag("-i,--interactive", c.interactive, "after the script (or -e), open the REPL in its globals: rank 0 reads, "
               "every rank runs each chunk, outputs come back grouped by rank");
  app.add_option("--threads", c.threads_text, "intra-op threads for LibTorch, 1-1024 (default: all cores; with "
                 "--nproc-per-node, cores / local ranks)");
  app.add_option("--nproc-per-node", c.nproc_text, "ranks to start on this machine, 1-1024 (launcher mode)");
  app.add_option("--nnodes", c.nnodes_text, "machines taking part, 1-1024 (default 1)");
  app.add_option("--node-rank", c.node_rank_text, "this machine's index, 0..nnodes-1 (default 0)");
  app.add_option("--master-addr", launch.master_addr, "host where rank 0 serves the rendezvous "
                 "(default 127.0.0.1)");
  app.add_option("--master-port", c.port_text, "its port, 1-65535 (default: a free one; required with --nnodes > 1, "
                 "where node 0's launcher then serves the job's control store)");
  app.add_flag("--tee", launch.tee, "show every rank's stdout, each line prefixed with its rank");
  app.add_option("--max-restarts", c.restarts_text, "with --nproc-per-node: when a rank fails, stop the others and "
                 "start every rank again, up to this many times, 0-1000 (default 0); a script resuming from its "
                 "checkpoints continues from the newest");
  app.add_option("--restart-backoff", c.backoff_text, "with --max-restarts: seconds to wait before starting again, "
                 "0-3600 (default 1)");
  app.add_option("--node-timeout", c.node_timeout_text, "with --nnodes > 1: seconds without a heartbeat from a node's "
                 "launcher after which the others declare it lost and end the job, 3-604800 (default 30)");
  app.add_option("--rdzv-secret-file", launch.secret_file, "with --nproc-per-node: the file holding the job's "
                 "rendezvous secret, the same on every node (needed with --nnodes > 1; readable by you alone); "
                 "default: a new one for this job");
  app.add_option("--timeout", c.timeout_text, "seconds a collective or the rendezvous may wait before "
                 "failing, 1-604800 (default 300)");
  app.add_option("--hang-timeout", c.hang_text, "with --nproc-per-node: when no rank's collective ledger changes for "
                 "this many seconds while a rank waits in a call, name the rank the others wait for and stop the "
                 "run, 0-604800 (default 0: off; a hang then ends at --timeout). kill -USR1 <launcher pid> prints "
                 "every rank's ledger");
  app.add_option("--device", c.device, "where each rank computes: cpu, cuda (cuda:<local rank>) or cuda:N "
                 "(default: cuda:<local rank> when CUDA is present, else cpu; PARTRAIN_DEVICE too)");
  app.add_flag("--check-collectives", c.check_collectives, "before every collective, check that all ranks of its "
               "group call the same one (debugging; costs a small all-gather each)");
  app.add_option("--plan", c.plan_file, "check the run against this saved plan (partrain plan --save) at its first "
                 "optimizer step");
  app.add_option("--plan-mode", c.plan_mode, "with --plan: match (fail on any difference), override (write this "
                 "run's plan over it) or moo (match if it agrees, otherwise override)");
  app.add_option("--trace", c.trace_file, "write the first training steps' timeline (forwards, backwards, sends, "
                 "receives, every rank) to this file as Chrome trace JSON (Perfetto, chrome://tracing)");
  app.add_option("--trace-steps", c.trace_steps_text, "with --trace: how many steps from the first, 1-1000 (default 3)");
  app.add_option("--metrics", c.metrics_file, "append the run's metrics to this file as JSON lines (a run header, a "
                 "record for every pt.log step, memory per rank), written by rank 0 (PARTRAIN_METRICS too; "
                 "docs/observability.md)");
  app.add_flag("--no-progress", c.no_progress, "no live progress line from pt.progress (PARTRAIN_PROGRESS=0 too)");
  app.add_option("script", c.script, "the Lua script to run; the arguments after it reach it as `arg`");
}

// PARTRAIN_HOME names an installation: one without partrain's Lua library is a mistake, not a
// reason to use another copy. Checked where Lua runs (a script, -e, the REPL, plan); --help,
// --version, ckpt, report and parity run none.
std::string bad_home() {
  const char* home = std::getenv("PARTRAIN_HOME");
  if (!home || !*home || partrain::util::is_regular(std::string(home) + "/lua/partrain/init.lua")) return "";
  return std::string("PARTRAIN_HOME '") + home + "' is not a partrain installation (it has no " +
         "lua/partrain/init.lua; unset it to use this partrain's own)";
}

// `partrain plan|ckpt|report|parity ...`: the subcommand's status.
int run_subcommand(const std::string& word, int argc, char** argv, int split) {
  if (split != 1)
    return fail(word + " takes no partrain flags before it: partrain " + word +
                (word == "plan" ? " --world N script.lua" : word == "ckpt" ? " inspect DIR"
                 : word == "report" ? " RUN_DIR -o report.html" : " A B"));
  if (word == "plan") {
    if (auto bad = bad_home(); !bad.empty()) return fail(bad);
    return partrain::app::run_plan(argc, argv, split + 1);
  }
  if (word == "ckpt") return partrain::app::run_ckpt(argc, argv, split + 1);
  if (word == "report") return partrain::app::run_report(argc, argv, split + 1);
  return partrain::app::run_parity(argc, argv, split + 1);
}

// Parses partrain's own flags (those before the script, or on either side of `repl`) into `c`,
// and takes the script and its arguments. An exit status when the command line is refused.
std::optional<int> parse_flags(CLI::App& app, CommandLine& c, int argc, char** argv, int split, bool repl) {
  std::vector<char*> flags(argv, argv + split);
  if (repl) {  // `partrain [flags] repl [flags]`: the REPL alone, flags on either side
    int after = partrain::app::split_at_script(app, split + 1, argc, argv);
    if (after < argc)
      return fail("repl takes partrain's flags only, not '" + std::string(argv[after]) +
                  "' (partrain repl --nproc-per-node 2; a script named repl runs as ./repl)");
    flags.insert(flags.end(), argv + split + 1, argv + argc);
  } else if (split < argc) {
    c.script_given = true;
    c.script = argv[split];
    for (int i = split + 1; i < argc; ++i) c.script_args.emplace_back(argv[i]);
  }
  // CLI11 reads `--flag=` (nothing after the '=') as the flag without its value and takes the next
  // word for it: refused here, naming the flag. (-e's code may be anything, a Lua comment too.)
  for (size_t i = 1; i < flags.size(); ++i) {
    const std::string f = flags[i], before = flags[i - 1];
    if (before == "-e" || before == "--execute") continue;
    if (f.size() > 3 && f.rfind("--", 0) == 0 && f.find('=') == f.size() - 1)
      return fail(f.substr(0, f.size() - 1) + " has nothing after its '=' (expected " + f + "VALUE)");
  }
  try {
    app.parse(static_cast<int>(flags.size()), flags.data());
  } catch (const CLI::ParseError& e) {
    return partrain::app::parse_failed(app, e);
  }
  if (repl) c.interactive = true;
  return std::nullopt;
}

// Numbers: each in its range, or a short message naming the flag, the value and the range.
std::string check_numbers(const CLI::App& app, CommandLine& c) {
  auto& launch = c.launch;
  using partrain::app::parse_count;
  std::string bad;
  if (bad.empty() && app.count("--threads")) bad = parse_count("--threads", c.threads_text, 1, kMaxThreads, c.threads);
  if (bad.empty() && app.count("--timeout"))
    bad = parse_count("--timeout", c.timeout_text, 1, partrain::app::kMaxTimeout, c.timeout);
  if (bad.empty() && app.count("--nproc-per-node"))
    bad = parse_count("--nproc-per-node", c.nproc_text, 1, partrain::app::kMaxLocalRanks, c.nproc);
  if (bad.empty() && app.count("--nnodes"))
    bad = parse_count("--nnodes", c.nnodes_text, 1, partrain::app::kMaxNodes, launch.nnodes);
  if (bad.empty() && app.count("--node-rank"))
    bad = parse_count("--node-rank", c.node_rank_text, 0, launch.nnodes - 1, launch.node_rank);
  if (bad.empty() && app.count("--master-port")) bad = parse_count("--master-port", c.port_text, 1, 65535, launch.master_port);
  if (bad.empty() && app.count("--max-restarts"))
    bad = parse_count("--max-restarts", c.restarts_text, 0, partrain::app::kMaxRestarts, launch.max_restarts);
  using partrain::app::parse_seconds;
  if (bad.empty() && app.count("--restart-backoff"))
    bad = parse_seconds("--restart-backoff", c.backoff_text, 0, partrain::app::kMaxBackoff, false, launch.restart_backoff);
  if (bad.empty() && app.count("--hang-timeout")) {
    // At least a second: below it a rank computing between two collectives reads as a hang.
    double v = 0;
    bad = parse_seconds("--hang-timeout", c.hang_text, 1, partrain::app::kMaxHangTimeout, /*zero_is_off=*/true, v);
    if (bad.empty() && !app.count("--nproc-per-node"))
      bad = "--hang-timeout needs the launcher: partrain --nproc-per-node N --hang-timeout S script.lua";
    if (bad.empty()) launch.hang_timeout = v;
  }
  if (bad.empty() && app.count("--node-timeout")) {
    double v = 0;
    bad = parse_seconds("--node-timeout", c.node_timeout_text, partrain::app::kMinNodeTimeout,
                        partrain::app::kMaxNodeTimeout, false, v);
    if (bad.empty() && launch.nnodes < 2)
      bad = "--node-timeout is for jobs over several nodes: it needs --nnodes 2 or more";
    if (bad.empty()) launch.node_timeout = v;
  }
  if (bad.empty() && (app.count("--max-restarts") || app.count("--restart-backoff")) && !app.count("--nproc-per-node"))
    bad = std::string(app.count("--max-restarts") ? "--max-restarts" : "--restart-backoff") +
          " needs the launcher: partrain --nproc-per-node N --max-restarts K script.lua";
  if (bad.empty() && app.count("--master-addr") && launch.master_addr.empty()) bad = "--master-addr is empty";
  if (bad.empty() && app.count("--trace-steps"))
    bad = parse_count("--trace-steps", c.trace_steps_text, 1, 1000, c.trace_steps);
  if (bad.empty() && app.count("--trace-steps") && c.trace_file.empty()) bad = "--trace-steps needs --trace FILE";
  if (bad.empty() && app.count("--trace") && c.trace_file.empty()) bad = "--trace is empty (expected a file to write)";
  if (bad.empty() && app.count("--plan") && c.plan_file.empty()) bad = "--plan is empty (expected a plan file)";
  return bad;
}

// What runs, and the flags that need the launcher: a problem, or "".
std::string check_what_runs(const CLI::App& app, const CommandLine& c) {
  if (c.plan_mode != "match" && c.plan_mode != "override" && c.plan_mode != "moo")
    return "--plan-mode '" + c.plan_mode + "' is not one of match, override, moo";
  if (c.script_given && c.script.empty()) return "the script's name is empty (expected a Lua file to run)";
  if (c.chunks.empty() && c.script.empty() && !c.interactive)
    return "nothing to run: give a script or -e CODE (partrain --help shows how)";
  for (const char* flag : {"--nnodes", "--node-rank", "--master-addr", "--master-port", "--tee", "--rdzv-secret-file"})
    if (app.count(flag) && c.nproc == 0)
      return std::string(flag) + " is for the launcher: it needs --nproc-per-node (partrain --nproc-per-node N " +
             flag + " ... script.lua)";
  if (app.count("--rdzv-secret-file") && c.launch.secret_file.empty())
    return "--rdzv-secret-file is empty (expected the file holding the job's secret)";
  return "";
}

// --plan: in match mode a plan that loads (checked now, not at the first step); in the modes
// that write, never over a file that is not a plan.
std::string check_plan_file(const CommandLine& c) {
  const std::string& plan_file = c.plan_file;
  const std::string& plan_mode = c.plan_mode;
  if (plan_file.empty()) return "";
  if (access(plan_file.c_str(), F_OK) == 0) {
    close(partrain::util::open_regular(plan_file, "plan (--plan)"));
    if (plan_mode == "match") partrain::plan::load(plan_file);
    else if (!partrain::plan::starts_like_plan(plan_file))
      return "--plan '" + plan_file + "' is not a partrain plan; --plan-mode " + plan_mode +
             " would write over it (remove it, or name another file)";
  } else if (plan_mode == "match") {
    return "there is no plan at '" + plan_file + "' (make one with partrain plan --save)";
  } else if (!partrain::app::writable_beside(plan_file)) {
    return "--plan '" + plan_file + "': its folder does not exist";
  }
  return "";
}

// --trace: a file rank 0 can replace (never a folder, a device or a FIFO), in a folder that exists.
std::string check_trace_file(const CommandLine& c) {
  const std::string& trace_file = c.trace_file;
  if (trace_file.empty()) return "";
  if (auto why = partrain::app::unusable_name(trace_file); !why.empty())
    return "--trace '" + trace_file + "': " + why + " (expected the JSON file to write)";
  if (partrain::util::is_plain_dir(trace_file))
    return "--trace '" + trace_file + "' is a folder (expected the JSON file to write)";
  if (access(trace_file.c_str(), F_OK) == 0 && !partrain::util::is_regular(trace_file))
    return "--trace '" + trace_file + "' is not a regular file (expected the JSON file to write)";
  if (!partrain::app::writable_beside(trace_file)) return "--trace '" + trace_file + "': its folder does not exist";
  if (auto refused = partrain::util::may_replace(trace_file, partrain::parallel::is_trace_head,
                                                 "a trace partrain wrote");
      !refused.empty())
    return "--trace " + refused;
  auto slash = trace_file.find_last_of('/');
  auto dir = slash == std::string::npos ? std::string(".") : slash == 0 ? std::string("/") : trace_file.substr(0, slash);
  if (access(dir.c_str(), W_OK) != 0) return "--trace '" + trace_file + "': its folder is not writable";
  setenv("PARTRAIN_TRACE", trace_file.c_str(), 1);  // every rank inherits it
  setenv("PARTRAIN_TRACE_STEPS", std::to_string(c.trace_steps).c_str(), 1);
  return "";
}

// --metrics (or PARTRAIN_METRICS, which it sets): a file rank 0 appends to (never a folder, a
// device or a FIFO), in a folder that exists.
std::string check_metrics_file(const CLI::App& app, CommandLine& c) {
  std::string& metrics_file = c.metrics_file;
  const char* metrics_env = std::getenv("PARTRAIN_METRICS");
  const bool metrics_flag = app.count("--metrics") > 0;
  if (!metrics_flag && !(metrics_env && *metrics_env)) return "";
  const std::string name = metrics_flag ? "--metrics" : "PARTRAIN_METRICS";
  if (!metrics_flag) metrics_file = metrics_env;
  if (metrics_file.empty()) return name + " is empty (expected a file to append JSON lines to)";
  if (auto why = partrain::app::unusable_name(metrics_file); !why.empty())
    return name + " '" + metrics_file + "': " + why + " (expected a file to append JSON lines to)";
  if (partrain::util::is_plain_dir(metrics_file))
    return name + " '" + metrics_file + "' is a folder (expected the JSON-lines file to append to)";
  struct stat st;  // lstat: a dangling link or a link loop is there too, and is no file to append to
  if (lstat(metrics_file.c_str(), &st) == 0 && !partrain::util::is_regular(metrics_file))
    return name + " '" + metrics_file + "' is not a regular file (expected the JSON-lines file to append to)";
  if (!partrain::app::writable_beside(metrics_file)) return name + " '" + metrics_file + "': its folder does not exist";
  // Appended to and, on a resume, rewritten: a file of JSON records only (a script given by
  // mistake had been rewritten to the records alone).
  if (auto refused = partrain::util::may_replace(
          metrics_file, [](const std::string& head) { return !head.empty() && head[0] == '{'; },
          "a JSON-lines metrics file");
      !refused.empty())
    return name + " " + refused;
  setenv("PARTRAIN_METRICS", metrics_file.c_str(), 1);  // every rank inherits it; rank 0 writes
  return "";
}

// Files the command line names: regular files only (a FIFO would hang the run, a folder is
// a mistake), checked before any rank starts.
std::string check_files(const CLI::App& app, CommandLine& c) {
  try {
    if (!c.script.empty()) close(partrain::util::open_regular(c.script, "script"));
    if (auto bad = check_plan_file(c); !bad.empty()) return bad;
    if (auto bad = check_trace_file(c); !bad.empty()) return bad;
    return check_metrics_file(app, c);
  } catch (const std::exception& e) {
    return partrain::util::message_of(e);
  }
}

// --device (or PARTRAIN_DEVICE, which it sets): checked once here, before any rank starts;
// every rank inherits it and resolves its own.
std::string check_device(const CLI::App& app, CommandLine& c) {
  const char* device_env = std::getenv("PARTRAIN_DEVICE");  // empty: the default, as a rank reads it
  if (!app.count("--device") && !(device_env && *device_env)) return "";
  const std::string name = app.count("--device") ? "--device" : "PARTRAIN_DEVICE";
  if (!app.count("--device")) c.device = device_env;
  if (c.device.empty()) return name + " is empty (expected cpu, cuda or cuda:N)";
  try {
    // The launcher must not touch CUDA (its ranks are forked from it): there the spelling only.
    if (c.nproc > 0) partrain::dist::check_device_spec(c.device);
    else partrain::dist::resolve_device(c.device, 0);
  } catch (const std::exception& e) {
    return name + ": " + partrain::util::message_of(e);
  }
  setenv("PARTRAIN_DEVICE", c.device.c_str(), 1);
  return "";
}

// The settings every rank inherits through the environment; a problem, or "".
std::string export_settings(const CLI::App& app, const CommandLine& c) {
  if (c.check_collectives) setenv("PARTRAIN_CHECK_COLLECTIVES", "1", 1);  // ranks inherit it
  if (c.no_progress) setenv("PARTRAIN_PROGRESS", "0", 1);
  if (!c.plan_file.empty()) {
    setenv("PARTRAIN_PLAN", c.plan_file.c_str(), 1);
    setenv("PARTRAIN_PLAN_MODE", c.plan_mode.c_str(), 1);
  } else if (app.count("--plan-mode")) {
    return "--plan-mode needs --plan FILE";
  }
  return "";
}

// Launcher mode: start the ranks, each forked to run the rank's code (or, as a fallback,
// running this same command without the launcher flags).
int launch_ranks(const CommandLine& c, const RankRun& run) {
  partrain::app::LaunchOptions launch = c.launch;
  const std::string& script = c.script;
  launch.nproc_per_node = c.nproc;
  launch.threads = c.threads;
  launch.interactive = c.interactive;
  if (const char* e = std::getenv("PARTRAIN_EXEC_RANKS")) launch.exec_ranks = std::string(e) == "1";
  if (c.timeout > 0) launch.timeout = c.timeout;
  std::vector<std::string> child;
  if (c.interactive) child.push_back("-i");
  for (const auto& chunk : c.chunks) {
    child.push_back("-e");
    child.push_back(chunk);
  }
  if (!script.empty()) {
    // A script whose name looks like a flag or a subcommand must not read as one in the rank.
    bool subcommand = script == "plan" || script == "ckpt" || script == "repl" || script == "report" ||
                      script == "parity";
    child.push_back(script[0] == '-' || subcommand ? "./" + script : script);
  }
  child.insert(child.end(), c.script_args.begin(), c.script_args.end());
  // A script that cannot load fails once here, not once a rank.
  std::string error;
  if (!script.empty() && !partrain::lua::check_script(script, &error)) return fail(error);
  try {
    return partrain::app::launch(launch, child, [run](int rank_threads) {
      RankRun mine = run;
      mine.threads = rank_threads;
      leave(run_rank(mine));  // a forked rank never returns into the launcher's code
      return 0;
    });
  } catch (const std::exception& e) {
    return fail(partrain::util::message_of(e));
  }
}

int run_main(int argc, char** argv) {
  if (auto problem = prepare_process(); !problem.empty()) return fail(problem);
  CLI::App app{kUsage, "partrain"};
  app.set_version_flag("--version", std::string("partrain ") + PARTRAIN_VERSION + " (" +
                                        partrain::compat::build_description() + ", LuaJIT)");
  CommandLine c;
  add_flags(app, c);

  // partrain's own flags come before the script; everything from the script on is the script's.
  // plan, ckpt, report, parity and repl are always subcommands, whatever files the working folder holds.
  int split = partrain::app::split_at_script(app, 1, argc, argv);
  // After `--` the next word is the script, even one named like a subcommand.
  const bool after_dashes = split > 1 && std::string(argv[split - 1]) == "--";
  std::string word = split < argc && !after_dashes ? argv[split] : "";
  if (word == "plan" || word == "ckpt" || word == "report" || word == "parity")
    return run_subcommand(word, argc, argv, split);
  if (auto refused = parse_flags(app, c, argc, argv, split, word == "repl")) return *refused;
  if (auto bad = bad_home(); !bad.empty()) return fail(bad);

  // Each check in turn: the first problem is the one said.
  std::string bad = check_numbers(app, c);
  if (bad.empty()) bad = check_what_runs(app, c);
  if (bad.empty()) bad = check_files(app, c);
  if (bad.empty()) bad = check_device(app, c);
  if (bad.empty()) bad = export_settings(app, c);
  if (!bad.empty()) return fail(bad);

  RankRun run;
  run.threads = c.threads;
  run.timeout = c.timeout;
  run.interactive = c.interactive;
  run.chunks = c.chunks;
  run.script = c.script;
  run.script_args = c.script_args;
  if (c.nproc > 0) return launch_ranks(c, run);
  return run_rank(run);
}

}  // namespace
