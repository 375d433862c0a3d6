// `partrain plan --auto`: the fastest layout that fits, searched over what the script can take
// (partrain/auto.lua enumerates, plans representative ranks through core.plan.layout, predicts
// and ranks), then, with --verify, the winner and the runner-up trained against the serial run;
// and `partrain plan --calibrate FILE`, which measures this machine as a device table
// (partrain/calibrate.lua). docs/plan.md, "Automatic layouts".
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace partrain::app {

struct AutoOptions {
  std::string script;
  std::vector<std::string> args;
  int world = 1, nproc = 1;
  std::string device;          ///< a shipped device's name or a device table file ("": the search's default)
  int64_t device_memory = 0;   ///< bytes a rank (0: the device's)
  int top = 5;
  bool json = false, verbose = false;
  std::string save_config;     ///< write the winner as a pt.args config file ("": no)
  bool verify = false;
  std::vector<std::string> verify_args;  ///< appended to the script's arguments for the verification runs
  int verify_steps = 5;
  double verify_tol = 1e-5;
};

/// The plan command's flags for --auto and --calibrate, as given.
struct AutoFlags {
  bool automatic = false;
  std::string device, top, verify_args, verify_steps, verify_tol, calibrate;
};
/// Adds --auto, --device, --top, --save-config, --verify, --verify-args, --verify-steps,
/// --verify-tol and --calibrate to the plan command.
void add_auto_flags(CLI::App& app, AutoFlags& flags, AutoOptions& o);
/// Reads the flags into `o` once parsed: "" or what is wrong (a flag of --auto's without it, of
/// --verify's without it, --auto with one layout's flags (`one_layout`: --save, --pipeline-search),
/// --verify with --json, a value out of range, a config file that cannot be written).
std::string check_auto_flags(const CLI::App& app, const AutoFlags& flags, AutoOptions& o, bool one_layout, bool json);

/// Runs the search; returns the exit status (1: nothing fits, bad input or a verification failed).
int run_auto(const AutoOptions& o);

/// Measures this machine with `nproc` ranks of one thread and writes its device table to `path`.
int run_calibrate(const std::string& path, int nproc);

}  // namespace partrain::app
