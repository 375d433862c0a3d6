// partrain plan --auto and --calibrate (see auto.hpp).
#include "app/auto.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>

#include <torch/torch.h>

#include "app/parity.hpp"
#include "app/tools.hpp"
#include "engine/util/files.hpp"
#include "engine/util/text.hpp"
#include "bindings/host.hpp"
#include "engine/plan/plan.hpp"

namespace partrain::app {

namespace {

int fail(const std::string& message) {
  std::cerr << "partrain: plan: " << message << std::endl;
  return 1;
}

// `s` as a Lua string literal.
std::string lua_quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') out += '\\', out += static_cast<char>(c);
    else if (c < 32 || c == 127) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\%03d", c);
      out += escaped;
    }
    else out += static_cast<char>(c);
  }
  return out + "\"";
}

std::string lua_list(const std::vector<std::string>& words) {
  std::string out = "{";
  for (const auto& w : words) out += lua_quote(w) + ",";
  return out + "}";
}

// A word as a POSIX shell (and partrain parity) reads it back.
std::string shell_quote(const std::string& s) {
  bool plain = !s.empty();
  for (char c : s) plain = plain && (std::isalnum(static_cast<unsigned char>(c)) || std::strchr("-_./=:,+@%", c));
  if (plain) return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string join(const std::vector<std::string>& words) {
  std::string out;
  for (const auto& w : words) out += (out.empty() ? "" : " ") + shell_quote(w);
  return out;
}

// Lines of the string `code` evaluates to in `host` (a list joined by newlines), or none.
std::vector<std::string> eval_lines(lua::Host& host, const std::string& code) {
  std::string text, error;
  std::vector<std::string> lines;
  if (!host.eval(code, &text, &error) || text.empty() || text == "nil") return lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// --verify: a layout (its flags and the ranks it runs on) trained against the serial run.
bool verify(const AutoOptions& o, const std::string& what, const std::vector<std::string>& flags, int ranks) {
  std::vector<std::string> common{o.script};
  common.insert(common.end(), o.args.begin(), o.args.end());
  common.insert(common.end(), o.verify_args.begin(), o.verify_args.end());
  common.insert(common.end(), {"--steps", std::to_string(o.verify_steps)});
  std::string serial = join(common);
  std::vector<std::string> sharded{"--nproc-per-node", std::to_string(ranks), "--threads", "1", "--timeout", "300"};
  sharded.insert(sharded.end(), common.begin(), common.end());
  sharded.insert(sharded.end(), flags.begin(), flags.end());
  std::string layout = join(sharded);
  std::cout << "\nverify " << what << " on " << ranks << " CPU rank(s), " << o.verify_steps
            << " steps against the serial run:\n" << std::flush;
  std::ostringstream tol_text;
  tol_text << o.verify_tol;
  const std::string tol = tol_text.str();
  std::vector<std::string> words{"partrain", "parity", serial, layout, "--tol", tol};
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  return run_parity(static_cast<int>(words.size()), argv.data(), 2) == 0;
}

}  // namespace

void add_auto_flags(CLI::App& app, AutoFlags& f, AutoOptions& o) {
  app.add_flag("--auto", f.automatic, "search the layouts the script can take (tensor, pipeline and schedule, "
               "context, expert, ZeRO, recompute) for the fastest that fits, planning each (docs/plan.md)");
  app.add_option("--device", f.device, "with --auto: h100, h200, a100, cpu, or a device table file "
                 "(--calibrate writes one); default h100");
  app.add_option("--top", f.top, "with --auto: layouts to print, 1-100 (default 5)");
  app.add_option("--save-config", o.save_config, "with --auto: write the winner as a config file "
                 "for the script (script.lua --config FILE)")->check(non_empty("the file to write"));
  app.add_flag("--verify", o.verify, "with --auto: train the winner and the runner-up on CPU ranks "
               "for a few steps against the serial run (partrain parity)");
  app.add_option("--verify-args", f.verify_args, "with --verify: arguments added to the script's for the "
                 "verification runs (a smaller model: \"--dim 64 --layers 4\")");
  app.add_option("--verify-steps", f.verify_steps, "with --verify: steps to train, 1-1000 (default 5)");
  app.add_option("--verify-tol", f.verify_tol, "with --verify: the largest relative loss difference (default 1e-5)");
  app.add_option("--calibrate", f.calibrate, "measure this machine with --nproc-per-node ranks (default 1) and "
                 "write its device table to this file, for --auto --device FILE")->check(non_empty("the file to write"));
}

std::string check_auto_flags(const CLI::App& app, const AutoFlags& f, AutoOptions& o, bool one_layout, bool json) {
  for (const char* flag : {"--device", "--top", "--save-config", "--verify", "--verify-args", "--verify-steps",
                           "--verify-tol"})
    if (!f.automatic && app.count(flag)) return std::string(flag) + " is --auto's, which is not given";
  for (const char* flag : {"--verify-args", "--verify-steps", "--verify-tol"})
    if (!o.verify && app.count(flag)) return std::string(flag) + " is --verify's, which is not given";
  if (f.automatic && one_layout)
    return "--save and --pipeline-search plan one layout; --auto searches many (give one of them)";
  if (o.verify && json) return "--verify prints the training runs' verdicts, which --json's output cannot hold (give one of them)";
  std::string bad;
  if (app.count("--top")) bad = parse_count("--top", f.top, 1, 100, o.top);
  if (bad.empty() && app.count("--verify-steps")) bad = parse_count("--verify-steps", f.verify_steps, 1, 1000, o.verify_steps);
  if (bad.empty() && app.count("--verify-tol")) bad = parse_seconds("--verify-tol", f.verify_tol, 0, 1, false, o.verify_tol);
  if (bad.empty() && app.count("--verify-args")) {
    std::string why;
    if (!split_words(f.verify_args, o.verify_args, why)) bad = "--verify-args: " + why;
  }
  if (bad.empty() && !o.save_config.empty() && util::is_plain_dir(o.save_config))
    bad = "--save-config '" + o.save_config + "' is a folder; give a file name";
  if (bad.empty() && !o.save_config.empty() && !writable_beside(o.save_config))
    bad = "--save-config '" + o.save_config + "': its folder does not exist";
  return bad;
}

int run_auto(const AutoOptions& o) {
  at::set_num_threads(1);
  plan::set_planning(true);
  plan::count_flops();
  lua::Host host;
  std::ostringstream code;
  code << "local core = require 'partrain.core'\n"
       << "__auto = require('partrain.auto').main {\n"
       << "  script = " << lua_quote(o.script) << ", args = " << lua_list(o.args) << ",\n"
       << "  world = " << o.world << ", nproc = " << o.nproc << ", top = " << o.top << ",\n"
       << "  device = " << (o.device.empty() ? "nil" : lua_quote(o.device)) << ",\n"
       << "  device_memory = " << (o.device_memory > 0 ? std::to_string(o.device_memory) : "nil") << ",\n"
       << "  json = " << (o.json ? "true" : "false") << ", verbose = " << (o.verbose ? "true" : "false") << ",\n"
       << "  config = " << (o.save_config.empty() ? "nil" : lua_quote(o.save_config)) << ",\n"
       << "  plan = function(args, ranks)\n"
       << "    return core.plan.layout { script = " << lua_quote(o.script) << ", args = args, world = " << o.world
       << ", nproc = " << o.nproc << ", ranks = ranks }\n"
       << "  end,\n"
       << "}\n";
  std::string error;
  const bool ok = host.run_string(code.str(), "=(plan --auto)", &error);
  std::cout << std::flush;
  if (!ok) {  // the search's own errors say "partrain plan --auto: ..."
    std::string message = error.substr(0, error.find("\nstack traceback:"));
    const std::string own = "partrain plan --auto: ";
    if (auto at = message.find(own); at != std::string::npos) message = message.substr(at + own.size());
    return fail("--auto: " + message);
  }
  std::string status;
  host.eval("return __auto and __auto.status or 1", &status, &error);
  if (status != "0") {
    std::string message;
    host.eval("return __auto and __auto.message or ''", &message, &error);
    if (!message.empty()) std::cerr << "partrain: plan --auto: " << message << std::endl;
    return 1;
  }
  if (!o.verify) return 0;
  bool all = true;
  for (int i = 1; i <= 2; ++i) {
    std::string at = "__auto.layouts[" + std::to_string(i) + "]";
    auto flags = eval_lines(host, "return " + at + " and table.concat(" + at + ".flags, '\\n')");
    auto ranks = eval_lines(host, "return " + at + " and " + at + ".verify_ranks");
    auto text = eval_lines(host, "return " + at + " and " + at + ".text");
    if (text.empty()) continue;
    const std::string what = (i == 1 ? "the winner, " : "the runner-up, ") + text[0];
    const int n = ranks.empty() ? 0 : std::atoi(ranks[0].c_str());
    if (n < 1 || n > 8) {
      std::cout << "\nverify " << what << ": not verified: it needs "
                << (ranks.empty() ? std::string("?") : ranks[0]) << " ranks, more than the 8 a CPU check runs\n";
      continue;
    }
    all = verify(o, what, flags, n) && all;
  }
  return all ? 0 : 1;
}

int run_calibrate(const std::string& path, int nproc) {
  std::string self;
  try {
    self = self_path();
  } catch (const std::exception& e) {
    return fail("--calibrate: " + util::message_of(e));
  }
  const std::string script = lua::find_paths().lua + "/partrain/calibrate.lua";
  std::vector<std::string> words{self, "--nproc-per-node", std::to_string(nproc), "--threads", "1", "--timeout", "300",
                                 script, "--out", path};
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  std::cout << std::flush;
  pid_t pid = ::fork();
  if (pid < 0) return fail(std::string("--calibrate: fork: ") + std::strerror(errno));
  if (pid == 0) {
    ::execv(self.c_str(), argv.data());
    _exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return fail("--calibrate: the measuring run failed");
  return 0;
}

}  // namespace partrain::app
