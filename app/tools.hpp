// The partrain subcommands that work without starting ranks: `partrain plan` (a layout's plan,
// docs/plan.md) and `partrain ckpt` (inspecting, verifying, converting and exporting
// checkpoints, docs/checkpoints.md), and the argument split they share with the main command.
#pragma once

#include <CLI/CLI.hpp>

namespace partrain::app {

/// Splits argv[from..] into the words before the script (flags for `app`) and the script with
/// its arguments: everything from the script on is the script's, even words that look like flags
/// (`train.lua --help` asks the script for help). Returns the index of the script, or argc.
int split_at_script(CLI::App& app, int from, int argc, char** argv);

/// `partrain plan ...`; argv[first] is the first word after `plan`. Returns the exit status.
int run_plan(int argc, char** argv, int first);
/// `partrain ckpt inspect|verify|convert|export ...`; argv[first] is the word after `ckpt`.
int run_ckpt(int argc, char** argv, int first);

}  // namespace partrain::app
