// partrain parity (see parity.hpp): two runs' losses compared step by step.
#include "app/parity.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <sstream>

#include <c10/util/Exception.h>

#include "app/metrics.hpp"
#include "app/report.hpp"
#include "app/tools.hpp"
#include "engine/util/files.hpp"
#include "engine/util/text.hpp"

extern char** environ;

namespace partrain::app {

namespace {

constexpr double kDefaultTol = 1e-5;
constexpr double kTiny = 1e-12;  // relative differences of values this close to 0 are taken as absolute

enum Status { kAgree = 0, kDiverged = 1, kUsage = 2, kCommandFailed = 3 };

int say(int status, const std::string& message) {
  std::cerr << "partrain: parity: " << message << std::endl;
  return status;
}

const char* const kHelp =
    "partrain parity: whether two runs' losses agree, step by step.\n\n"
    "  partrain parity A B [--steps N] [--tol T] [-o report.html]\n\n"
    "A and B are each a metrics file (or a run folder holding metrics.jsonl), or one quoted partrain\n"
    "command line, run with this partrain and PARTRAIN_METRICS set to a file of its own:\n"
    "  partrain parity \"examples/gpt/train.lua --steps 20\" \\\n"
    "                  \"--nproc-per-node 4 examples/gpt/train.lua --steps 20 --tensor 2\"\n\n"
    "  --steps N   compare the steps up to N only (the commands run as written)\n"
    "  --tol T     the largest relative difference |a-b|/max(|a|,|b|) allowed (default 1e-05)\n"
    "  -o FILE     also write the report page of both runs (partrain report) to FILE\n\n"
    "Exit status: 0 within the tolerance, 1 diverged, 2 a usage error or inputs that cannot be\n"
    "compared (no common steps), 3 a command that failed (its output's file is named).\n";

// One side of the comparison: a metrics file to read, or a command to run first.
struct Side {
  std::string label;                ///< "A" or "B"
  std::string arg;                  ///< as given
  std::vector<std::string> command; ///< empty: arg is a metrics file or run folder
  std::string metrics, log;         ///< the file to read; a command's output
};

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// A metrics input is one word naming a folder, or anything else there that is not a Lua script
// (a FIFO or a device is then refused by the reader, by name); anything else is a command. A
// FIFO named m.jsonl had been "no metrics file", and one named run2 had been run as a script.
bool is_metrics_input(const std::string& arg) {
  if (arg.find_first_of(" \t\n'\"\\") != std::string::npos) return false;
  struct stat st;
  if (::lstat(arg.c_str(), &st) != 0) return false;
  return S_ISDIR(st.st_mode) || !ends_with(arg, ".lua");
}

std::string joined(const std::vector<std::string>& words) {
  std::string s;
  for (const auto& w : words) {
    bool plain = !w.empty() && w.find_first_of(" \t\n'\"\\$`") == std::string::npos;
    s += (s.empty() ? "" : " ") + (plain ? w : "'" + w + "'");
  }
  return s;
}


// The last lines of a command's output, for a failure message.
std::string tail_of(const std::string& path, size_t lines) {
  std::string text;
  try {  // its last 64 KiB, however long the output
    int fd = util::open_regular(path, "command output");
    struct stat st;
    off_t size = ::fstat(fd, &st) == 0 ? st.st_size : 0, from = std::max<off_t>(0, size - 65536);
    text.resize(static_cast<size_t>(size - from));
    ssize_t n = ::pread(fd, &text[0], text.size(), from);
    ::close(fd);
    text.resize(n > 0 ? static_cast<size_t>(n) : 0);
  } catch (const std::exception&) {
    return "";
  }
  while (!text.empty() && text.back() == '\n') text.pop_back();
  size_t begin = text.size();
  for (size_t n = 0; n < lines && begin > 0; ++n) {
    auto nl = text.rfind('\n', begin - 1);
    begin = nl == std::string::npos ? 0 : nl;
  }
  if (begin < text.size() && text[begin] == '\n') ++begin;
  std::string tail = text.substr(begin);
  return tail.size() > 4000 ? tail.substr(tail.size() - 4000) : tail;
}

// Runs `partrain <command>` with PARTRAIN_METRICS=side.metrics, its output into side.log.
// Returns "" or why it failed.
std::string run_command(const Side& side) {
  std::string self = self_path();
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e)
    if (std::strncmp(*e, "PARTRAIN_METRICS=", 17) != 0) env_strings.emplace_back(*e);
  env_strings.push_back("PARTRAIN_METRICS=" + side.metrics);
  std::vector<char*> envp, argv{const_cast<char*>(self.c_str())};
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> words = side.command;
  for (auto& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  int log = ::open(side.log.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  TORCH_CHECK(log >= 0, "cannot create '", side.log, "': ", std::strerror(errno));
  std::cout.flush();
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) {
    ::close(log);
    TORCH_CHECK(false, "cannot start a process: ", std::strerror(errno));
  }
  if (pid == 0) {  // the child: only async-signal-safe calls until exec
    int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) ::dup2(null, 0);
    ::dup2(log, 1);
    ::dup2(log, 2);
    ::execve(self.c_str(), argv.data(), envp.data());
    _exit(127);
  }
  ::close(log);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
  return WIFEXITED(status) ? "exit status " + std::to_string(WEXITSTATUS(status))
                           : "killed by signal " + std::to_string(WTERMSIG(status));
}

double relative(double a, double b) {
  if (std::isnan(a) && std::isnan(b)) return 0;  // both runs lost the value the same way
  if (!std::isfinite(a) || !std::isfinite(b)) return a == b ? 0 : std::numeric_limits<double>::infinity();
  return std::fabs(a - b) / std::max({std::fabs(a), std::fabs(b), kTiny});
}

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

// A folder of its own for the commands' metrics and output, removed when all went well.
struct Scratch {
  std::string dir;
  bool keep = false;
  ~Scratch() {
    if (dir.empty() || keep) return;
    for (const char* f : {"A.jsonl", "A.log", "B.jsonl", "B.log"}) ::unlink((dir + "/" + f).c_str());
    ::rmdir(dir.c_str());
  }
};

}  // namespace

bool split_words(const std::string& line, std::vector<std::string>& words, std::string& error) {
  words.clear();
  std::string word;
  bool in_word = false;
  for (size_t i = 0; i < line.size(); ++i) {
    char c = line[i];
    if (c == ' ' || c == '\t' || c == '\n') {
      if (in_word) words.push_back(word);
      word.clear();
      in_word = false;
      continue;
    }
    in_word = true;
    if (c == '\'') {
      auto end = line.find('\'', i + 1);
      if (end == std::string::npos) return error = "an unclosed ' in: " + line, false;
      word += line.substr(i + 1, end - i - 1);
      i = end;
    } else if (c == '"') {
      size_t j = i + 1;
      for (; j < line.size() && line[j] != '"'; ++j) {
        if (line[j] == '\\' && j + 1 < line.size() && std::strchr("\"\\$`\n", line[j + 1])) ++j;
        word += line[j];
      }
      if (j >= line.size()) return error = "an unclosed \" in: " + line, false;
      i = j;
    } else if (c == '\\') {
      if (i + 1 >= line.size()) return error = "a lone \\ at the end of: " + line, false;
      word += line[++i];
    } else {
      word += c;
    }
  }
  if (in_word) words.push_back(word);
  return true;
}

namespace {

// What `partrain parity` was asked: the two runs and the flags, checked.
struct Options {
  std::string a, b;          ///< the two runs, as given
  int64_t steps = -1;        ///< compare the steps up to this one only; -1: all
  double tol = kDefaultTol;  ///< the largest relative difference allowed
  std::string out;           ///< the report page to write; "" for none
};

constexpr int kGoOn = -1;  // a step's result when the command goes on to the next step

// The flags and the two runs, as words; returns kGoOn, or the exit status (the help printed, or
// a usage error said).
int read_words(int argc, char** argv, int first, std::vector<std::string>& positional, std::string& steps_text,
               std::string& tol_text, std::string& out) {
  bool only_positional = false;
  for (int i = first; i < argc; ++i) {
    std::string w = argv[i];
    bool flag = !only_positional && w.size() > 1 && w[0] == '-' && w.find_first_of(" \t\n") == std::string::npos;
    if (!flag) {
      positional.push_back(w);
      continue;
    }
    if (w == "--") {
      only_positional = true;
      continue;
    }
    if (w == "-h" || w == "--help") {
      std::cout << kHelp;
      return 0;
    }
    std::string name = w.substr(0, w.find('=')), value;
    if (name != "--steps" && name != "--tol" && name != "-o" && name != "--output")
      return say(kUsage, "unknown flag '" + w.substr(0, 80) + "' (partrain parity --help lists them; quote a "
                         "command line as one argument)");
    if (w.find('=') != std::string::npos) {
      value = w.substr(w.find('=') + 1);
    } else {
      if (i + 1 >= argc) return say(kUsage, name + " needs a value");
      value = argv[++i];
    }
    // An empty value had read as the flag not given (-o "" wrote no page, exit 0).
    if (value.empty()) return say(kUsage, name + " is empty (expected " +
                                              (name == "--steps" ? "a number of steps" : name == "--tol" ? "a relative difference" : "the HTML file to write") + ")");
    (name == "--steps" ? steps_text : name == "--tol" ? tol_text : out) = value;
  }
  return kGoOn;
}

// The command line into `o`, every value checked; returns kGoOn, or the exit status.
int parse_options(int argc, char** argv, int first, Options& o) {
  std::vector<std::string> positional;
  std::string steps_text, tol_text;
  if (int status = read_words(argc, argv, first, positional, steps_text, tol_text, o.out); status != kGoOn)
    return status;
  if (positional.size() != 2)
    return say(kUsage, "expected two runs to compare, A and B (metrics files or quoted partrain command lines), got " +
                           std::to_string(positional.size()) + " (partrain parity --help)");
  o.a = positional[0];
  o.b = positional[1];
  if (!steps_text.empty()) {
    int n = 0;
    std::string bad = parse_count("--steps", steps_text, 1, INT_MAX, n);
    if (!bad.empty()) return say(kUsage, bad);
    o.steps = n;
  }
  if (!tol_text.empty()) {
    char* end = nullptr;
    o.tol = std::strtod(tol_text.c_str(), &end);
    if (tol_text.empty() || !end || *end || !std::isfinite(o.tol) || o.tol < 0)
      return say(kUsage, "--tol '" + tol_text.substr(0, 40) + "' is not a number >= 0 (a relative difference, e.g. 1e-5)");
  }
  const std::string& out = o.out;
  if (!out.empty() && util::is_plain_dir(out)) return say(kUsage, "-o '" + out + "' is a folder; give a file name");
  if (!out.empty() && !writable_beside(out)) return say(kUsage, "-o '" + out + "': its folder does not exist");
  if (!out.empty())
    if (auto refused = util::may_replace(out, is_report_page, "an HTML report"); !refused.empty())
      return say(kUsage, "-o " + refused);
  return kGoOn;
}

// Which side is a metrics file and which a command (split into its words, and checked); returns
// kGoOn, or the exit status.
int classify_sides(Side (&sides)[2]) {
  for (auto& side : sides) {
    if (is_metrics_input(side.arg)) {
      side.metrics = metrics_file_of(side.arg);
      continue;
    }
    if ((ends_with(side.arg, ".jsonl") || ends_with(side.arg, ".json")) &&
        side.arg.find_first_of(" \t\n") == std::string::npos)
      return say(kUsage, side.label + ": there is no metrics file '" + side.arg + "'");
    std::string error;
    if (!split_words(side.arg, side.command, error)) return say(kUsage, side.label + ": " + error);
    if (side.command.empty()) return say(kUsage, side.label + " is empty (expected a metrics file or a partrain command line)");
    for (const auto& w : side.command)
      if (w == "--metrics" || w.rfind("--metrics=", 0) == 0)
        return say(kUsage, side.label + ": leave out --metrics: parity gives each command a metrics file of its own");
    if (side.command[0] == "parity" || side.command[0] == "report")
      return say(kUsage, side.label + ": '" + side.command[0] + "' writes no metrics; give a training script");
  }
  return kGoOn;
}

// Runs each side that is a command, its metrics and output in the scratch folder (made on the
// first); returns kGoOn, or the exit status.
int run_commands(Side (&sides)[2], Scratch& scratch) {
  for (auto& side : sides) {
    if (side.command.empty()) continue;
    if (scratch.dir.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/partrain-parity-XXXXXX";
      TORCH_CHECK(::mkdtemp(pattern.data()), "cannot make a folder for the runs' metrics (", pattern, "): ",
                  std::strerror(errno));
      scratch.dir = pattern;
    }
    side.metrics = scratch.dir + "/" + side.label + ".jsonl";
    side.log = scratch.dir + "/" + side.label + ".log";
    std::cout << "parity: " << side.label << ": partrain " << joined(side.command) << std::endl;
    std::string why = run_command(side);
    if (!why.empty()) {
      scratch.keep = true;
      std::string tail = tail_of(side.log, 15);
      return say(kCommandFailed, side.label + " failed (" + why + "): partrain " + joined(side.command) +
                                     "\nits output is in " + side.log + (tail.empty() ? "" : "\nits last lines:\n" + tail));
    }
    if (!util::is_regular(side.metrics)) {
      scratch.keep = true;
      return say(kUsage, side.label + " logged no losses: it wrote no metrics (the script must call pt.log { step "
                         "= ..., loss = ... }); its output is in " + side.log);
    }
  }
  return kGoOn;
}

// Every loss of both, in step order; a step logged twice is ambiguous, so refused. Returns kGoOn,
// or the exit status.
int read_losses(const Side (&sides)[2], int64_t steps, Scratch& scratch, Metrics (&m)[2]) {
  ReadOptions exact;
  exact.exact_losses = true;
  exact.up_to_step = steps;
  for (int k = 0; k < 2; ++k) {
    m[k] = read_metrics(sides[k].metrics, sides[k].label, exact);
    auto& l = m[k].losses;
    if (l.empty()) {
      scratch.keep = !scratch.dir.empty();
      return say(kUsage, sides[k].label + " logged no losses" +
                             (steps > 0 ? " up to step " + std::to_string(steps) : std::string()) + " in " +
                             sides[k].metrics + " (the script must call pt.log { step = ..., loss = ... })");
    }
    std::stable_sort(l.begin(), l.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
    for (size_t i = 1; i < l.size(); ++i)
      if (l[i].step == l[i - 1].step)
        return say(kUsage, sides[k].metrics + ": step " + std::to_string(l[i].step) + " is logged twice (lines " +
                               std::to_string(l[i - 1].line) + " and " + std::to_string(l[i].line) +
                               "); parity compares one loss a step");
  }
  return kGoOn;
}

// The two runs' losses side by side: the steps they share, the largest difference, the first
// beyond the tolerance.
struct Comparison {
  size_t common = 0, only_a = 0, only_b = 0;
  double worst = -1;
  int64_t worst_step = -1, first_bad = -1, first_step = -1, last_step = -1;
  double bad_a = 0, bad_b = 0, bad_rel = 0;  ///< at first_bad
};

// Walks both step-ordered loss lists together, comparing the steps they share.
Comparison compare_losses(const std::vector<Metrics::Loss>& la, const std::vector<Metrics::Loss>& lb, double tol) {
  Comparison c;
  size_t i = 0, j = 0;
  while (i < la.size() && j < lb.size()) {
    if (la[i].step < lb[j].step) {
      ++i, ++c.only_a;
      continue;
    }
    if (lb[j].step < la[i].step) {
      ++j, ++c.only_b;
      continue;
    }
    double rel = relative(la[i].loss, lb[j].loss);
    if (c.first_step < 0) c.first_step = la[i].step;
    c.last_step = la[i].step;
    ++c.common;
    if (rel > c.worst) c.worst = rel, c.worst_step = la[i].step;
    if (!(rel <= tol) && c.first_bad < 0) c.first_bad = la[i].step, c.bad_a = la[i].loss, c.bad_b = lb[j].loss, c.bad_rel = rel;
    ++i, ++j;
  }
  c.only_a += la.size() - i, c.only_b += lb.size() - j;
  return c;
}

// The verdict's lines: what was compared, the largest difference, and agreed or where it diverged.
std::vector<std::string> verdict_of(const Comparison& c, double tol) {
  std::vector<std::string> verdict;
  std::string compared = "compared " + std::to_string(c.common) + " common steps (" + std::to_string(c.first_step) +
                         " to " + std::to_string(c.last_step) + ")";
  if (c.only_a || c.only_b)
    compared += "; " + std::to_string(c.only_a) + " logged by A alone, " + std::to_string(c.only_b) + " by B alone";
  verdict.push_back(compared);
  verdict.push_back("largest relative difference " + num(c.worst) + " at step " + std::to_string(c.worst_step) +
                    " (tolerance " + num(tol) + ")");
  if (c.first_bad >= 0) {
    verdict.push_back("diverged at step " + std::to_string(c.first_bad) + ": A loss " + num(c.bad_a) + ", B loss " +
                      num(c.bad_b) + " (relative difference " + num(c.bad_rel) + " > " + num(tol) + ")");
  } else {
    verdict.push_back("within tolerance: the losses agree at every common step");
  }
  return verdict;
}

// Says what was read and the verdict, writes the report page if asked; returns the exit status.
int report_verdict(const Options& o, const Side (&sides)[2], const Metrics (&m)[2], const Comparison& c, Scratch& scratch) {
  for (int k = 0; k < 2; ++k)
    std::cout << "parity: " << sides[k].label << ": " << m[k].losses.size() << " losses from " << sides[k].metrics
              << std::endl;
  if (c.common == 0) {
    scratch.keep = !scratch.dir.empty();
    return say(kUsage, "A and B have no step in common" + std::string(o.steps > 0 ? " up to step " + std::to_string(o.steps) : "") +
                           " (A logs " + std::to_string(m[0].losses.size()) + " losses, B " + std::to_string(m[1].losses.size()) + ")" +
                           (scratch.keep ? "; their metrics are in " + scratch.dir : ""));
  }
  std::vector<std::string> verdict = verdict_of(c, o.tol);
  int status = c.first_bad >= 0 ? kDiverged : kAgree;
  for (const auto& v : verdict) std::cout << "parity: " << v << std::endl;
  if (!o.out.empty()) {
    std::vector<Metrics> runs;
    for (auto& side : sides)
      runs.push_back(read_metrics(side.metrics, side.label + ": " + (side.command.empty() ? side.arg
                                                                                            : "partrain " + joined(side.command))));
    ReportOptions options;
    options.title = "partrain parity";
    options.notes = verdict;
    util::write_atomic(o.out, report_html(runs, options));
    std::cout << "parity: wrote " << o.out << std::endl;
  }
  if (status != kAgree && !scratch.dir.empty()) {
    scratch.keep = true;
    std::cout << "parity: the runs' metrics and output are kept in " << scratch.dir << std::endl;
  }
  return status;
}

}  // namespace

std::string self_path() {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  TORCH_CHECK(n > 0, "cannot find this partrain's path (/proc/self/exe): ", std::strerror(errno));
  return std::string(buf, static_cast<size_t>(n));
}

int run_parity(int argc, char** argv, int first) {
  Options o;
  if (int status = parse_options(argc, argv, first, o); status != kGoOn) return status;
  Side sides[2] = {{"A", o.a, {}, "", ""}, {"B", o.b, {}, "", ""}};
  Scratch scratch;
  try {
    if (int status = classify_sides(sides); status != kGoOn) return status;
    if (int status = run_commands(sides, scratch); status != kGoOn) return status;
    Metrics m[2];
    if (int status = read_losses(sides, o.steps, scratch, m); status != kGoOn) return status;
    return report_verdict(o, sides, m, compare_losses(m[0].losses, m[1].losses, o.tol), scratch);
  } catch (const std::exception& e) {
    scratch.keep = !scratch.dir.empty();
    return say(kUsage, util::message_of(e));
  }
}

}  // namespace partrain::app
