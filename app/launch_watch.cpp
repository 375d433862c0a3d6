// Watching a node's ranks once started: their output passed on, their reports and ends collected,
// and every rank stopped when one fails, the user interrupts, the nodes say so, or none progresses.
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>

#include "app/launch_ranks.hpp"
#include "engine/util/startup.hpp"

namespace partrain::app::detail {

namespace {

bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }

// How much of a line without its newline waits for the rest: past it the part is relayed as a
// piece, so a long line, or progress redrawn with \r and never ended, costs the launcher linear
// time and bounded memory (holding 240 MB of \r updates for a newline had taken 35 s and 667 MB).
constexpr size_t kRelayPiece = size_t(1) << 16;
// A rank's last stderr lines kept for the failure summary, and the bytes kept of each.
constexpr size_t kKeptLines = 20;
constexpr size_t kKeptLineBytes = 2048;

void remember(std::deque<std::string>* keep, const std::string& line) {
  if (!keep) return;
  keep->push_back(line.size() <= kKeptLineBytes ? line
                                                : line.substr(0, kKeptLineBytes) + "... (" +
                                                      std::to_string(line.size()) + " bytes)");
  while (keep->size() > kKeptLines) keep->pop_front();
}

// Writes complete lines from `buffer` to `to`, each with `prefix`; with `flush_partial`, or once
// the rest reaches kRelayPiece bytes, the rest too (a line without its newline: tagged, it is
// ended; untagged, left as the rank wrote it). `scanned`: how many leading bytes of the buffer
// are known to hold no newline (what was there before the last read), so that small reads after
// a long unended line do not search it again and again.
void emit_lines(std::string& buffer, std::ostream& to, const std::string& prefix, bool flush_partial,
                std::deque<std::string>* keep = nullptr, size_t scanned = 0) {
  size_t start = 0, nl;
  while ((nl = buffer.find('\n', std::max(start, scanned))) != std::string::npos) {
    std::string line = buffer.substr(start, nl - start);
    to << prefix << line << '\n';
    remember(keep, line);
    start = nl + 1;
  }
  buffer.erase(0, start);
  if ((flush_partial || buffer.size() >= kRelayPiece) && !buffer.empty()) {
    to << prefix << buffer;
    if (!prefix.empty()) to << '\n';  // a tagged line ends; an untagged stream passes through as written
    remember(keep, buffer);
    buffer.clear();
  }
  to.flush();
}

// A report on the wire: "<monotonic ns> <kind>\n<message>". Parsed once its first line is in.
void parse_report(Rank& r) {
  auto nl = r.report_bytes.find('\n');
  if (nl == std::string::npos) return;
  std::istringstream head(r.report_bytes.substr(0, nl));
  Report rep;
  std::string kind;
  if (!(head >> rep.at_ns >> kind)) return;
  rep.kind = kind == "timeout" ? Report::Timeout : kind == "collective" ? Report::Collective : Report::Error;
  rep.message = r.report_bytes.substr(nl + 1);
  r.report = rep;
}

// "R" (state letter) of /proc/PID/stat: T when stopped (SIGSTOP, Ctrl-Z), t when traced.
char process_state(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string all((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  auto close = all.rfind(')');
  return close != std::string::npos && close + 2 < all.size() ? all[close + 2] : '?';
}

}  // namespace

void LocalRanks::watch() {
  progress_at = Clock::now();
  while (running > 0 || open_fds()) {
    relay();
    drop_held_pipes();
    reap();
    if (control) {  // the heartbeat goes on while the ranks stop, too
      auto verdict = control->poll(attempt);
      if (verdict && verdict->kind != Verdict::Ok) begin_stopping();
    }
    if (stopping) {
      if (Clock::now() >= kill_at) {
        stop_all(SIGKILL);
        kill_at = Clock::now() + std::chrono::hours(1);
      }
      continue;
    }
    // kill -USR1 <launcher>: every rank's ledger, half a second after asking for their lines.
    if (dump_asked) {
      dump_asked = 0;
      ask_lines();
      dump_at = Clock::now() + std::chrono::milliseconds(500);
    }
    if (dump_at && Clock::now() >= *dump_at) {
      dump_at.reset();
      std::cerr << "partrain: the ranks' collective ledgers (kill -USR1 " << getpid() << "; the run goes on):\n"
                << hang::dump(views(), monotonic_ns(), 8) << std::flush;
    }
    judge();
  }
}

// Forwards output and collects reports.
void LocalRanks::relay() {
  std::vector<pollfd> fds;
  std::vector<std::pair<int, int>> owners;  // (rank index, 0 stdout | 1 stderr | 2 report)
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i].out >= 0) { fds.push_back({ranks[i].out, POLLIN, 0}); owners.emplace_back(i, 0); }
    if (ranks[i].err >= 0) { fds.push_back({ranks[i].err, POLLIN, 0}); owners.emplace_back(i, 1); }
    if (ranks[i].report_fd >= 0) { fds.push_back({ranks[i].report_fd, POLLIN, 0}); owners.emplace_back(i, 2); }
  }
  // SIGCHLD (no SA_RESTART) ends the wait as soon as a rank ends; the limit only bounds a
  // signal that came between the reaping below and this call.
  poll(fds.empty() ? nullptr : fds.data(), fds.size(), 100);
  for (size_t k = 0; k < fds.size(); ++k) {
    if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    Rank& r = ranks[owners[k].first];
    int which = owners[k].second;
    char buf[65536];
    ssize_t n = read(fds[k].fd, buf, sizeof(buf));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    bool eof = n <= 0;
    if (which == 2) {
      if (n > 0 && r.report_bytes.size() < kMaxReport)
        r.report_bytes.append(buf, std::min<size_t>(n, kMaxReport - r.report_bytes.size()));
      parse_report(r);
    } else {
      std::string& line = which == 1 ? r.err_line : r.out_line;
      const size_t scanned = line.size();  // no newline in it: searched when it came
      if (n > 0) line.append(buf, n);
      if (which == 1) {
        if (live_partial && line.find('\n', scanned) != std::string::npos) {  // clear the live line; it is drawn again
          std::cout << "\r\x1b[K" << std::flush;
          live_partial = false;
        }
        emit_lines(line, std::cerr, prefix(r), eof, &r.last_err, scanned);
      } else if (r.rank == 0 || o.tee) {
        relay_stdout(r, line, buf, n, eof, scanned);
      } else {
        line.clear();  // only rank 0's stdout by default
      }
    }
    if (eof) {
      close(fds[k].fd);
      (which == 0 ? r.out : which == 1 ? r.err : r.report_fd) = -1;
    }
  }
}

// Rank 0's stdout (or, with --tee, any rank's), and on a terminal rank 0's live line.
void LocalRanks::relay_stdout(Rank& r, std::string& line, const char* buf, ssize_t n, bool eof, size_t scanned) {
  emit_lines(line, std::cout, o.tee ? prefix(r) : "", eof && !live_partial, nullptr, scanned);
  if (!(live_terminal && r.rank == 0)) return;
  // What is left has no \r before this read's bytes (a \r there would have been shown).
  const size_t fresh = line.size() - std::min(line.size(), size_t(std::max<ssize_t>(n, 0)));
  if (line.find('\r', fresh) != std::string::npos) {  // a live line: shown as it is drawn
    std::cout << line << std::flush;
    line.clear();
    live_partial = true;
  } else if (n > 0 && buf[n - 1] == '\n') {
    live_partial = false;
  }
  if (eof && live_partial) {
    std::cout << line << '\n' << std::flush;
    line.clear();
    live_partial = false;
  }
}

// A rank's output pipes stay open while a process it started holds them (`os.execute("cmd &")`,
// or a command left running when a time limit's backstop ended the rank): a second after the
// rank ended, all it wrote has been read, and the run does not wait for that process.
void LocalRanks::drop_held_pipes() {
  for (auto& r : ranks) {
    if (r.running || (r.out < 0 && r.err < 0) || monotonic_ns() - r.ended_ns < 1000000000) continue;
    if (r.err >= 0) emit_lines(r.err_line, std::cerr, prefix(r), true, &r.last_err);
    if (r.out >= 0 && (r.rank == 0 || o.tee)) emit_lines(r.out_line, std::cout, o.tee ? prefix(r) : "", !live_partial);
    for (int* fd : {&r.out, &r.err}) {
      if (*fd >= 0) close(*fd);
      *fd = -1;
    }
  }
}

void LocalRanks::reap() {
  for (auto& r : ranks) {
    if (!r.running) continue;
    int status;
    if (waitpid(r.pid, &status, WNOHANG) == r.pid) {
      r.running = false;
      r.status = status;
      r.ended_ns = monotonic_ns();
      r.ended_stopping = stopping;
      --running;
      util::startup_mark("rank " + std::to_string(r.rank) + " ended");
      if (r.report_fd >= 0) {  // what it reported is all in the pipe now
        ssize_t n;
        char buf[4096];
        while ((n = read(r.report_fd, buf, sizeof buf)) > 0)
          if (r.report_bytes.size() < kMaxReport)
            r.report_bytes.append(buf, std::min<size_t>(n, kMaxReport - r.report_bytes.size()));
        parse_report(r);
        close(r.report_fd);
        r.report_fd = -1;
      }
    }
  }
}

// Whether to stop the ranks now: a cause or an interrupt at once; a failed collective once the
// others have had their say; and with --hang-timeout, a run in which no ledger moves.
void LocalRanks::judge() {
  bool cause = false, collective = false, sigint = false;
  for (const auto& r : ranks) {
    cause = cause || is_cause(r);
    collective = collective || (r.report && r.report->kind != Report::Error);
    sigint = sigint || (!r.running && o.interactive && WIFSIGNALED(r.status) && WTERMSIG(r.status) == SIGINT);
  }
  if (cause || interrupted || sigint) {
    begin_stopping();
  } else if (collective) {
    settle_collective();
  } else if (o.hang_timeout > 0) {
    watch_progress();
  }
}

// After the first failed collective: the other ranks' reports, or their ledgers, then the
// ledgers' account of who the others waited for, taken before the ranks are stopped.
void LocalRanks::settle_collective() {
  if (!settle_until) {
    settle_until = Clock::now() + settle;
    lines_asked = Clock::now();
    ask_lines();  // the ranks not in the collective say where they are while the others report
  }
  bool all_heard = std::all_of(ranks.begin(), ranks.end(), [](const Rank& r) { return !r.running || r.report; });
  // The ledgers tell sooner: once the ranks asked have had a second to answer, ranks without a
  // report that are in no call will not report (nor will rank 0 waiting for the others at the
  // end of the run: that wait has no time limit); those in one will, within moments.
  if (!all_heard && Clock::now() >= lines_asked + std::chrono::seconds(1))
    all_heard = std::all_of(ranks.begin(), ranks.end(), [](const Rank& r) {
      if (!r.running || r.report) return true;
      auto ledger = dist::ledger::read(r.ledger);
      return ledger.valid && !hang::in_script_call(ledger);
    });
  if (all_heard || Clock::now() >= *settle_until) {
    for (size_t i = 0; i < ranks.size(); ++i)
      if (ranks[i].running && !ranks[i].report) missing.emplace_back(int(i), process_state(ranks[i].pid));
    bool timeouts = std::any_of(ranks.begin(), ranks.end(),
                                [](const Rank& r) { return r.report && r.report->kind == Report::Timeout; });
    diagnosis = hang::diagnose(views(), timeouts ? "the other ranks timed out waiting in a collective"
                                                 : "the other ranks' collectives failed",
                               monotonic_ns());
    begin_stopping();
  }
}

// No change in any ledger for --hang-timeout while a rank waits in a call of its script, or
// is stopped: a hang, whatever the ledgers say of who waits for whom (a rank stopped inside
// the call the others wait in leaves every ledger "waiting" in it). The ranks are asked for
// their lines, and a second later, unless a ledger moved meanwhile, the run is stopped.
void LocalRanks::watch_progress() {
  uint64_t progress = 0;
  for (const auto& r : ranks)
    if (r.ledger) progress += r.ledger->progress.load();
  if (progress != last_progress) {
    last_progress = progress;
    progress_at = Clock::now();
    hang_asked_at.reset();
  } else if (Clock::now() - progress_at >= hang_timeout) {
    if (!hang_asked_at) {
      const auto now = views();
      const bool stuck = std::any_of(now.begin(), now.end(), [](const hang::RankView& v) {
        return v.running && (hang::in_script_call(v.ledger) || v.state == 'T' || v.state == 't');
      });
      if (stuck) {
        ask_lines();
        hang_asked_at = Clock::now();
      } else {
        progress_at = Clock::now();  // nobody waits in the script: long work without calls is no hang
      }
    } else if (Clock::now() - *hang_asked_at >= std::chrono::seconds(1)) {
      std::ostringstream trigger;
      trigger << "no rank had made progress for " << o.hang_timeout << " s (--hang-timeout)";
      diagnosis = hang::diagnose(views(), trigger.str(), monotonic_ns());
      if (diagnosis->headline.empty()) {  // the waiting rank ended or went on meanwhile
        diagnosis.reset();
        progress_at = Clock::now();
        hang_asked_at.reset();
      } else {
        hung = true;
        begin_stopping();
      }
    }
  }
}

// TERM goes to the ranks that have not reported (one that has is already on its way out, and
// must end by its own exit, not by the launcher's signal); KILL, after the grace, to all.
void LocalRanks::stop_all(int sig) {
  for (auto& r : ranks)
    if (r.running && !(sig == SIGTERM && r.report)) {
      kill(o.interactive ? r.pid : -r.pid, sig);
      if (sig == SIGTERM) kill(o.interactive ? r.pid : -r.pid, SIGCONT);  // a stopped rank must see it
    }
}

void LocalRanks::begin_stopping() {
  if (stopping) return;
  stopping = true;
  stop_all(SIGTERM);
  kill_at = Clock::now() + std::chrono::milliseconds(static_cast<int>(o.grace * 1000));
}

bool LocalRanks::is_cause(const Rank& r) const {
  if (r.report) return r.report->kind == Report::Error;
  if (r.running || !failed(r.status)) return false;
  if (WIFSIGNALED(r.status)) {
    int sig = WTERMSIG(r.status);
    if (o.interactive && sig == SIGINT) return false;  // Ctrl-C at the terminal: an interrupt
    // Killed by the launcher's TERM or KILL, or by a write to a peer the launcher stopped.
    return !(r.ended_stopping && (sig == SIGTERM || sig == SIGKILL || sig == SIGPIPE));
  }
  return !r.ended_stopping;
}

std::string LocalRanks::prefix(const Rank& r) const {
  return world > 1 ? "[rank " + std::to_string(r.rank) + "] " : std::string();
}

bool LocalRanks::open_fds() const {
  return std::any_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.out >= 0 || r.err >= 0 || r.report_fd >= 0; });
}

// The ledgers: asking the running ranks for their Lua lines (SIGUSR1 to the probe thread of a
// rank whose ledger says it answers; the answer is in its ledger a moment later), and what the
// launcher knows of each. Never to the thread running Lua: a signal there cuts a sleep, a poll
// or a select short (none is restarted), and the rank would go on from where it waited.
void LocalRanks::ask_lines() {
  for (auto& r : ranks) {
    if (!r.running || !r.ledger || r.ledger->line_ready.load() != 1) continue;
    const int32_t tid = r.ledger->probe_tid.load(std::memory_order_acquire);
    if (tid <= 0) continue;
    r.line_asked_at = r.ledger->line_answers.load();
    r.line_asked = true;
    syscall(SYS_tgkill, r.pid, tid, SIGUSR1);
  }
}

std::vector<hang::RankView> LocalRanks::views() const {
  std::vector<hang::RankView> v;
  for (const auto& r : ranks) {
    hang::RankView x;
    x.rank = r.rank;
    x.local_rank = r.local_rank;
    x.pid = r.pid;
    x.running = r.running;
    x.status = r.status;
    x.state = r.running ? process_state(r.pid) : '?';
    x.ledger = dist::ledger::read(r.ledger);
    x.line_fresh = x.ledger.valid && r.line_asked && x.ledger.line_answers > r.line_asked_at;
    v.push_back(std::move(x));
  }
  return v;
}

}  // namespace partrain::app::detail
