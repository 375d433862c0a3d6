// The partrain subcommands that work without starting ranks: `partrain plan` (a layout's plan,
// docs/plan.md) and `partrain ckpt` (inspecting, verifying, converting and exporting
// checkpoints, docs/checkpoints.md), and the argument split they share with the main command.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace partrain::app {

/// Reads `text`, the value of `flag`, as a whole number in [lo, hi] into `out`. Returns "" or
/// a short message naming the flag, the value and the range.
std::string parse_count(const std::string& flag, const std::string& text, long long lo, long long hi, int& out);

/// Reads `text`, the value of `flag`, as a number of seconds in [lo, hi] written in decimal
/// (digits, a point, an exponent: no sign, hex, spaces, inf or nan) into `out`; 0 is also taken
/// where `zero_is_off`. Returns "" or a short message naming the flag, the value and the range.
std::string parse_seconds(const std::string& flag, const std::string& text, double lo, double hi, bool zero_is_off,
                          double& out);

/// A CLI11 check that an option's value is not empty ("is empty (expected <what>)"): an empty
/// path or name had been taken as the option not given.
CLI::Validator non_empty(const std::string& what);

/// Whether the folder that would hold `path` exists (a file partrain is asked to write).
bool writable_beside(const std::string& path);
/// Why `path` cannot name a file to write, found before the run rather than at its first write:
/// the system's reason when looking it up fails otherwise than for its absence (a name longer
/// than the file system takes, a folder on its way that is a file or cannot be searched); empty
/// when it can.
std::string unusable_name(const std::string& path);

/// A CLI11 parse error as partrain reports it: --help and --version print and succeed (0);
/// any mistake is one short line and status 1.
int parse_failed(CLI::App& app, const CLI::ParseError& e);

/// Splits argv[from..] into the words before the script (flags for `app`) and the script with
/// its arguments: everything from the script on is the script's, even words that look like flags
/// (`train.lua --help` asks the script for help), and after `--` the next word is the script
/// even if it begins with '-'. Returns the index of the script, or argc.
int split_at_script(CLI::App& app, int from, int argc, char** argv);

/// `partrain plan ...`; argv[first] is the first word after `plan`. Returns the exit status.
int run_plan(int argc, char** argv, int first);
/// `partrain ckpt inspect|verify|convert|export ...`; argv[first] is the word after `ckpt`.
int run_ckpt(int argc, char** argv, int first);

}  // namespace partrain::app
