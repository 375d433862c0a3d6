// Saying how a start of the ranks ended: which rank failed first and how (its error, its last
// stderr lines, or the ledgers' account of a hang), once for the job, and the launcher's status.
#include <sys/wait.h>

#include <algorithm>
#include <iostream>
#include <sstream>

#include "app/launch_ranks.hpp"

namespace partrain::app::detail {

namespace {

using hang::describe_status;

// The first `max` lines of `text`, indented, and a count of the rest.
std::string indented(const std::string& text, size_t max, const std::string& indent = "  ") {
  std::istringstream in(text);
  std::string line, out;
  size_t n = 0, more = 0;
  while (std::getline(in, line)) {
    if (n < max) out += indent + line + "\n";
    else ++more;
    ++n;
  }
  if (more) out += indent + "... (" + std::to_string(more) + " more lines above, in its stderr)\n";
  return out;
}

std::string name(const Rank& r) {
  return "rank " + std::to_string(r.rank) + " (local rank " + std::to_string(r.local_rank) + ", pid " +
         std::to_string(r.pid) + ")";
}

}  // namespace

// The culprit: the earliest cause; else, when the first failure is a collective timeout, the
// ranks it waited for; else the earliest collective failure.
Outcome LocalRanks::diagnose() const {
  auto when = [](const Rank& r) { return r.report ? r.report->at_ns : r.ended_ns; };
  int culprit = -1;
  for (size_t i = 0; i < ranks.size(); ++i)
    if (is_cause(ranks[i]) && (culprit < 0 || when(ranks[i]) < when(ranks[culprit]))) culprit = int(i);
  int first_collective = -1;
  for (size_t i = 0; i < ranks.size(); ++i)
    if (ranks[i].report && ranks[i].report->kind != Report::Error &&
        (first_collective < 0 || ranks[i].report->at_ns < ranks[first_collective].report->at_ns))
      first_collective = int(i);

  if (culprit < 0 && diagnosis && (!diagnosis->culprits.empty() || (hung && !diagnosis->headline.empty())))
    return hang_outcome(first_collective);
  if (culprit < 0 && first_collective >= 0 && ranks[first_collective].report->kind == Report::Timeout &&
      !missing.empty())
    return missing_outcome(first_collective);
  // Over several nodes a failed collective alone is most likely another node's failure seen
  // from here: what it says is kept for when no other node's failure comes first.
  const bool consequence = culprit < 0 && first_collective >= 0 && o.nnodes > 1;
  if (culprit < 0) culprit = first_collective;
  if (culprit >= 0) return failure_outcome(ranks[culprit], consequence);
  bool sigint = std::any_of(ranks.begin(), ranks.end(), [&](const Rank& r) {
    return o.interactive && WIFSIGNALED(r.status) && WTERMSIG(r.status) == SIGINT;
  });
  if (interrupted || sigint) {
    int sig = interrupted ? int(interrupted) : SIGINT;
    std::cerr << "partrain: interrupted (" << (sig == SIGINT ? "Ctrl-C" : "signal " + std::to_string(sig))
              << "); stopped all ranks\n";
    return {128 + sig, "interrupted", true};
  }
  return {};
}

// A hang the ledgers explain: the rank(s) the others waited for, and where every rank was (or,
// past --hang-timeout, the ranks that waited with no culprit the ledgers can name).
Outcome LocalRanks::hang_outcome(int first_collective) const {
  std::ostringstream say;
  say << "partrain: " << diagnosis->headline << "; all ranks were stopped. Where each rank was, from the ranks' "
      << "collective ledgers:\n" << diagnosis->details;
  if (first_collective >= 0) {
    const Rank& r = ranks[first_collective];
    say << "  The first " << (r.report->kind == Report::Timeout ? "timeout" : "failure") << ", on rank " << r.rank
        << ":\n" << indented(r.report->message, 6, "    ");
  }
  if (diagnosis->culprits.empty()) {
    std::cerr << say.str();
    std::ostringstream cause;
    cause << "no rank made progress for " << o.hang_timeout << " s (--hang-timeout)";
    return {1, cause.str()};
  }
  const Rank& c = ranks[diagnosis->culprits.front()];
  Outcome out{1, name(c) + (hung ? " stopped making progress (--hang-timeout)"
                                 : " stopped making progress (the others timed out waiting for it)")};
  // Over several nodes, a rank the ledgers blame that itself failed in a collective (a peer's
  // connection gone) most likely follows another node's failure, as below: kept until none comes.
  if (o.nnodes > 1 && c.report && c.report->kind != Report::Error) {
    out.consequence = true;
    out.details = say.str();
  } else {
    std::cerr << say.str();
  }
  return out;
}

// The first failure a collective timeout, and ranks still running without a report when the
// others had timed out: they are the ranks the others waited for.
Outcome LocalRanks::missing_outcome(int first_collective) const {
  const Rank& waited = ranks[first_collective];
  std::cerr << "partrain: ";
  for (size_t k = 0; k < missing.size(); ++k) std::cerr << (k ? ", " : "") << name(ranks[missing[k].first]);
  std::cerr << (missing.size() > 1 ? " were" : " was") << " still running, with no error, when the other ranks timed "
            << "out waiting in a collective: " << (missing.size() > 1 ? "they are" : "it is")
            << " the rank the others waited for";
  for (const auto& [i, state] : missing)
    if (state == 'T' || state == 't') std::cerr << " (rank " << ranks[i].rank << " was stopped: SIGSTOP, Ctrl-Z or a debugger)";
  std::cerr << "; all ranks were stopped. The first timeout, on rank " << waited.rank << ":\n"
            << indented(waited.report->message, 6);
  return {1, name(ranks[missing.front().first]) + " stopped making progress (the others timed out waiting for it)"};
}

// Rank `r` failed first: how it ended, its error (or its last stderr lines), and the others'
// own errors.
Outcome LocalRanks::failure_outcome(const Rank& r, bool consequence) const {
  std::ostringstream say;
  say << "partrain: " << name(r) << " failed first: it " << describe_status(r.status)
      << "; the other ranks were stopped";
  if (r.report) {
    say << ". Its error:\n" << indented(r.report->message, 12) << other_errors(r);
  } else if (!r.last_err.empty()) {
    say << ". The last lines of its stderr:\n";
    for (const auto& l : r.last_err) say << "  " << l << '\n';
  } else if (o.interactive && r.rank == 0) {
    say << " (its stderr went to the terminal, above)\n";
  } else {
    say << " (it wrote nothing to stderr)\n";
  }
  std::string why = describe_status(r.status);
  if (r.report) {
    auto line = r.report->message.substr(0, r.report->message.find('\n'));
    why = "failed: " + (line.size() > 200 ? line.substr(0, 200) + "..." : line);
  }
  Outcome out{1, name(r) + " " + why};
  if (consequence) {
    out.consequence = true;
    out.details = say.str();
  } else {
    std::cerr << say.str();
  }
  return out;
}

// The other ranks' own errors (not the collectives that failed because `r` did), once each: the
// same error on every rank is one message.
std::string LocalRanks::other_errors(const Rank& r) const {
  auto first_line = [](const std::string& m) {
    auto line = m.substr(0, m.find('\n'));
    return line.substr(line.find(": ") == std::string::npos ? 0 : line.find(": ") + 2);  // without "rank N: "
  };
  std::vector<int> same;
  std::vector<std::pair<std::string, std::vector<int>>> others;
  for (const auto& x : ranks) {
    if (&x == &r || !x.report || x.report->kind != Report::Error) continue;
    auto line = first_line(x.report->message);
    if (line == first_line(r.report->message)) {
      same.push_back(x.rank);
      continue;
    }
    auto it = std::find_if(others.begin(), others.end(), [&](const auto& e) { return e.first == line; });
    if (it == others.end()) others.push_back({line, {x.rank}});
    else it->second.push_back(x.rank);
  }
  auto list = [](const std::vector<int>& v) {
    std::string s;
    for (size_t k = 0; k < v.size(); ++k) s += (k ? "," : "") + std::to_string(v[k]);
    return s;
  };
  std::ostringstream say;
  if (!same.empty()) say << "  (rank" << (same.size() > 1 ? "s " : " ") << list(same) << " failed with the same error)\n";
  for (size_t k = 0; k < others.size() && k < 4; ++k)
    say << "  rank" << (others[k].second.size() > 1 ? "s " : " ") << list(others[k].second) << " failed too: "
        << (others[k].first.size() > 200 ? others[k].first.substr(0, 200) + "..." : others[k].first) << "\n";
  return say.str();
}

}  // namespace partrain::app::detail
