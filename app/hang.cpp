// Reading a hang from the ranks' collective ledgers (see hang.hpp).
//
// Every rank blocked in a call waits for the ranks that have not come to it: in a collective, the
// members of its group whose ledgers show fewer calls started on that group than its call number
// (or the same call number made as another operation or from another line); in a receive, the peer
// that has sent fewer messages on that channel; in a send, the peer that has posted fewer
// receives. Those "waits for" edges make a graph. A rank at the end of an edge that is not itself
// waiting (stopped, dead, running elsewhere) is the culprit. When every rank at the end of an edge
// waits too (each waits for another: a rank skipped a call and went on to the next), the culprit
// is the one most ranks wait for; between equals, the one waiting at a later line of the same
// file than the call the others wait in (it skipped ahead), or waiting at the end of the run.
// With no edge at all (every rank has made the calls the others wait in), a stopped rank is the
// culprit (stopped inside the call: its ledger says "waiting" too); with none stopped, nobody is.
#include "app/hang.hpp"

#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>

namespace partrain::app::hang {

using dist::ledger::Call;
using dist::ledger::Copy;
using dist::ledger::GroupCopy;
using dist::ledger::Op;
using dist::ledger::State;

std::string name(const RankView& r) {
  return "rank " + std::to_string(r.rank) + " (local rank " + std::to_string(r.local_rank) + ", pid " +
         std::to_string(r.pid) + ")";
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    const char* abbrev = sigabbrev_np(sig);
    return "was killed by signal " + std::to_string(sig) + (abbrev ? std::string(" (SIG") + abbrev + ")" : "");
  }
  return "ended with status " + std::to_string(status);
}

namespace {

std::string seconds(int64_t ns) {
  char buf[32];
  if (ns < 1000000000) std::snprintf(buf, sizeof buf, "%.1f ms", double(ns) / 1e6);
  else std::snprintf(buf, sizeof buf, "%.1f s", double(ns) / 1e9);
  return buf;
}

bool stopped(const RankView& r) { return r.running && (r.state == 'T' || r.state == 't'); }

// The rank's newest call (any state), and its group.
std::pair<const GroupCopy*, const Call*> last_call(const Copy& c, bool completed_only) {
  const GroupCopy* group = nullptr;
  const Call* last = nullptr;
  for (const auto& g : c.groups)
    for (const auto& call : g.calls_kept)
      if ((!completed_only || call.state == State::Completed) && (!last || call.started_ns > last->started_ns)) {
        group = &g;
        last = &call;
      }
  return {group, last};
}

// Where a rank is blocked: the call, its group, and for a ring step the collective it belongs to.
struct Blocked {
  const GroupCopy* group = nullptr;
  const Call* call = nullptr;  // the collective (or the user's send/recv) it waits in
  const Call* step = nullptr;  // the ring's send/recv inside it, if any
};

Blocked blocked_in(const Copy& c) {
  Blocked b;
  for (const auto& g : c.groups)
    for (const auto& call : g.calls_kept)
      if (call.blocked() && (!b.call || call.started_ns > b.call->started_ns)) {
        b.group = &g;
        b.call = &call;
      }
  // Or its newest call failed: it waited there until the peer it waited for went away.
  auto [group, last] = last_call(c, false);
  if (!b.call && last && last->state == State::Failed) {
    b.group = group;
    b.call = last;
  }
  if (b.call && !b.call->collective() && b.call->tag == dist::ledger::kRingTag) {
    // A ring step: the collective around it is the newest one of the group not yet completed.
    const Call* outer = nullptr;
    for (const auto& call : b.group->calls_kept)
      if (call.collective() && call.state != State::Completed && (!outer || call.call > outer->call)) outer = &call;
    if (outer) {
      b.step = b.call;
      b.call = outer;
    }
  }
  return b;
}

// "all_reduce(sum) of 4 float32 (16 B) at t.lua:12 (call 2 on group 'world' (ranks 0,1))"
std::string where(const GroupCopy& g, const Call& c) {
  std::string s = c.describe() + " at " + (c.site.empty() ? "(no script line)" : c.site) + " (";
  if (c.collective()) s += "call " + std::to_string(c.seq) + " on ";
  else if (c.seq >= 0) s += "message " + std::to_string(c.seq) + " of this channel on ";
  else s += "on ";
  return s + g.describe() + ")";
}

// "t.lua:12" -> ("t.lua", 12); (anything, -1) when there is no line.
std::pair<std::string, long> file_line(const std::string& site) {
  auto colon = site.rfind(':');
  if (colon == std::string::npos) return {site, -1};
  char* end = nullptr;
  long line = std::strtol(site.c_str() + colon + 1, &end, 10);
  if (!end || *end) return {site, -1};
  return {site.substr(0, colon), line};
}

// Whether a rank waiting at `mine` has gone past a call at `theirs`: a later line of the same file,
// or the end of the run.
bool ahead(const std::string& mine, const std::string& theirs) {
  if (mine == dist::ledger::kEndOfRun) return true;
  auto [f1, l1] = file_line(mine);
  auto [f2, l2] = file_line(theirs);
  return l1 >= 0 && l2 >= 0 && f1 == f2 && l1 > l2;
}

struct Edge {
  int from, to;
  std::string why;  // what `to` has not done: "has not reached call 3 on group 'world' (ranks 0,1)"
};

const GroupCopy* group_by_key(const Copy& c, const std::string& key) {
  for (const auto& g : c.groups)
    if (g.key == key) return &g;
  return nullptr;
}

const Call* collective_numbered(const GroupCopy& g, int64_t seq) {
  for (const auto& c : g.calls_kept)
    if (c.collective() && c.seq == seq) return &c;
  return nullptr;
}

// What diagnose reads of the ranks: where each is blocked, and who waits for whom.
struct Reading {
  explicit Reading(const std::vector<RankView>& views);
  // Waiting: blocked in a call now, or until that call timed out (the rank may have ended since).
  // A rank that ended otherwise, or is stopped, is not waiting, whatever its ledger's last entry says.
  bool waiting(int i) const {
    return blocked[i].call && !stopped(ranks[i]) &&
           (ranks[i].running || blocked[i].call->state == State::TimedOut || blocked[i].call->state == State::Failed);
  }
  void add_collective_edges(int i);
  void add_peer_edge(int i);
  std::vector<int> most_waited_for() const;
  std::string headline(const std::vector<int>& culprits, bool stalled, bool cycle, const std::string& trigger) const;
  std::string line_of(int i, const std::vector<int>& culprits, int64_t now_ns) const;
  std::string waits_for(int i) const;

  const std::vector<RankView>& ranks;
  const int n;
  std::map<int, int> index;  // global rank -> view
  std::vector<Blocked> blocked;
  std::vector<Edge> edges;
  std::set<int> elsewhere_nodes;  // members on other nodes: their launchers hold their ledgers
};

Reading::Reading(const std::vector<RankView>& views) : ranks(views), n(static_cast<int>(views.size())), blocked(n) {
  for (int i = 0; i < n; ++i) index[ranks[i].rank] = i;
  for (int i = 0; i < n; ++i)
    if (ranks[i].ledger.valid) blocked[i] = blocked_in(ranks[i].ledger);
  for (int i = 0; i < n; ++i) {
    if (!waiting(i)) continue;
    if (blocked[i].call->collective()) add_collective_edges(i);
    else add_peer_edge(i);
  }
}

// Rank i waits in a collective: for the members of its group that have not made that call, or
// made it as another operation or from another line.
void Reading::add_collective_edges(int i) {
  const GroupCopy& g = *blocked[i].group;
  const Call& c = *blocked[i].call;
  for (int member : g.ranks) {
    if (member == ranks[i].rank) continue;
    auto it = index.find(member);
    if (it == index.end()) {
      elsewhere_nodes.insert(member);
      continue;
    }
    const RankView& q = ranks[it->second];
    const GroupCopy* qg = q.ledger.valid ? group_by_key(q.ledger, g.key) : nullptr;
    if (!qg) {
      edges.push_back({i, it->second, "has no record of " + g.describe()});
      continue;
    }
    if (qg->collectives <= c.seq) {
      edges.push_back({i, it->second, "has not reached call " + std::to_string(c.seq) + " on " + g.describe() +
                                          " (it has made " + std::to_string(qg->collectives) + ")"});
      continue;
    }
    const Call* theirs = collective_numbered(*qg, c.seq);
    if (theirs && (theirs->op != c.op || theirs->reduce != c.reduce || theirs->site != c.site))
      edges.push_back({i, it->second, "made call " + std::to_string(c.seq) + " on " + g.describe() + " as " +
                                          theirs->describe() + " at " + theirs->site});
  }
}

// Rank i waits in a send or a receive: for the peer that has not posted its receive, or not sent.
void Reading::add_peer_edge(int i) {
  const GroupCopy& g = *blocked[i].group;
  const Call& c = *blocked[i].call;
  auto it = index.find(c.peer);
  if (it == index.end()) {
    elsewhere_nodes.insert(c.peer);
    return;
  }
  const RankView& q = ranks[it->second];
  const GroupCopy* qg = q.ledger.valid ? group_by_key(q.ledger, g.key) : nullptr;
  const auto* ch = qg ? qg->channel(ranks[i].rank, c.tag) : nullptr;
  const int64_t done = !ch ? 0 : c.op == Op::Send ? ch->received : ch->sent;
  if (c.seq >= 0 && done <= c.seq)
    edges.push_back({i, it->second,
                     std::string(c.op == Op::Send ? "has not posted the receive for" : "has not sent") + " message " +
                         std::to_string(c.seq) + " (tag " + std::to_string(c.tag) + ") " +
                         (c.op == Op::Send ? "from" : "to") + " rank " + std::to_string(ranks[i].rank) + " (it has " +
                         (c.op == Op::Send ? "posted " : "sent ") + std::to_string(done) + ")"});
}

// When every rank waited for waits too: first the ranks that went past the call a rank waiting
// for them is in, then the most waited for.
std::vector<int> Reading::most_waited_for() const {
  std::map<int, std::set<int>> waiters;
  for (const auto& e : edges) waiters[e.to].insert(e.from);
  std::map<int, std::set<int>> pool;
  for (const auto& [t, w] : waiters) {
    bool past = false;
    for (int from : w) past = past || ahead(blocked[t].call->site, blocked[from].call->site);
    if (past) pool[t] = w;
  }
  if (pool.empty()) pool = waiters;
  size_t most = 0;
  for (const auto& [t, w] : pool) most = std::max(most, w.size());
  std::vector<int> culprits;
  for (const auto& [t, w] : pool)
    if (w.size() == most) culprits.push_back(t);
  return culprits;
}

std::string Reading::headline(const std::vector<int>& culprits, bool stalled, bool cycle,
                              const std::string& trigger) const {
  std::string who;
  for (size_t k = 0; k < culprits.size(); ++k) who += (k ? ", " : "") + name(ranks[culprits[k]]);
  const bool many = culprits.size() > 1;
  if (stalled) {
    std::string list;
    int count = 0;
    for (int i = 0; i < n; ++i)
      if (waiting(i)) list += std::string(count++ ? ", " : "") + std::to_string(ranks[i].rank);
    return (count > 1 ? "ranks " + list + " each waited" : "rank " + list + " waited") + " in a call that " +
           "every rank it needs had made when " + trigger + ", and none progressed: the ledgers cannot " +
           "tell which rank holds the others up (one may be blocked in C code inside the call, or the " +
           "network between them stalled)";
  }
  if (cycle) {
    const Blocked& b = blocked[culprits.front()];
    std::string skipped_call;
    for (const auto& e : edges)
      if (e.to == culprits.front() && blocked[e.from].call) {
        skipped_call = blocked[e.from].call->describe() + " at " + blocked[e.from].call->site;
        break;
      }
    return who + (many ? " are the ranks" : " is the rank") + " the others waited for: " +
           (many ? "each waits in another call" : "it never made the call they wait in (" + skipped_call +
                                                      ") and waits in " + b.call->describe() + " at " +
                                                      b.call->site + " instead") +
           (many ? " (the ledgers cannot tell which skipped a call)" : "");
  }
  if (!ranks[culprits.front()].running) {
    const RankView& first = ranks[culprits.front()];
    return who + (many ? " had" : " had already") + " ended (" + describe_status(first.status) + ") when " +
           trigger + ": " + (many ? "they are the ranks" : "it is the rank") + " the others waited for";
  }
  std::string said = who + (many ? " were" : " was") + " still running, with no error, when " + trigger + ": " +
                     (many ? "they are the ranks" : "it is the rank") + " the others waited for";
  for (int c : culprits)
    if (stopped(ranks[c]))
      said += " (rank " + std::to_string(ranks[c].rank) + " was stopped: SIGSTOP, Ctrl-Z or a debugger)";
  return said;
}

// "; it waits for rank 1, which has not reached call 3 ...": the ranks rank i waits for, those with
// the same reason named together.
std::string Reading::waits_for(int i) const {
  std::vector<std::pair<std::string, std::vector<int>>> reasons;
  std::set<int> targets_of;
  for (const auto& e : edges) {
    if (e.from != i || !targets_of.insert(e.to).second) continue;
    auto it = std::find_if(reasons.begin(), reasons.end(), [&](const auto& r) { return r.first == e.why; });
    if (it == reasons.end()) reasons.push_back({e.why, {ranks[e.to].rank}});
    else it->second.push_back(ranks[e.to].rank);
  }
  std::string whys;
  for (const auto& [why, who] : reasons) {
    std::string list;
    for (size_t k = 0; k < who.size(); ++k) list += (k ? ", " : "") + std::to_string(who[k]);
    whys += std::string(whys.empty() ? "" : "; ") + (who.size() > 1 ? "ranks " + list + ", which each " : "rank " + list + ", which ") + why;
  }
  return whys.empty() ? "" : "; it waits for " + whys;
}

// Rank i's line of the details: where it waits and for whom, or how it is and its last call.
std::string Reading::line_of(int i, const std::vector<int>& culprits, int64_t now_ns) const {
  const RankView& r = ranks[i];
  std::string s = "  rank " + std::to_string(r.rank) + ": ";
  const Blocked& b = blocked[i];
  const bool is_culprit = std::find(culprits.begin(), culprits.end(), i) != culprits.end();
  if (waiting(i)) {
    const State st = b.step ? b.step->state : b.call->state;
    const Call& timed = b.step ? *b.step : *b.call;
    s += std::string(st == State::TimedOut ? "timed out" : st == State::Failed ? "failed" : "waiting") + " in " +
         where(*b.group, *b.call);
    if (b.step) s += ", at its ring step " + b.step->describe();
    s += st == State::TimedOut || st == State::Failed
             ? " after " + seconds(std::max<int64_t>(0, timed.ended_ns - timed.started_ns))
             : " for " + seconds(std::max<int64_t>(0, now_ns - timed.started_ns));
    s += waits_for(i);
    if (!r.running) s += "; then it " + describe_status(r.status);
    return s + "\n";
  }
  if (!r.running) s += describe_status(r.status) + "; ";
  else if (stopped(r)) s += "stopped (process state " + std::string(1, r.state) + ": SIGSTOP, Ctrl-Z or a debugger); ";
  if (!r.ledger.valid) {
    s += "(no ledger yet: it is starting, or shares none with the launcher)";
  } else {
    if (r.running && !stopped(r)) s += "running, not in any collective or send/recv; ";
    auto [g, last] = last_call(r.ledger, false);
    if (last) s += "its last call: " + where(*g, *last) + ", " + dist::ledger::state_name(last->state);
    else s += "it has made no collective or send/recv";
    if (stopped(r)) s += "; a stopped rank cannot say its Lua line";
    else if (r.running && is_culprit)
      s += r.line_fresh ? "; its Lua line now: " + r.ledger.line
                        : "; its Lua line could not be read: it did not answer within a second (LuaJIT runs no "
                          "hooks inside compiled loops or while C code runs)";
  }
  return s + "\n";
}

}  // namespace

bool in_script_call(const Copy& ledger) {
  if (!ledger.valid) return false;
  const Call* call = blocked_in(ledger).call;
  return call && call->site != dist::ledger::kEndOfRun;
}

Diagnosis diagnose(const std::vector<RankView>& ranks, const std::string& trigger, int64_t now_ns) {
  Diagnosis d;
  const Reading g(ranks);
  const int n = g.n;
  // No rank is behind another: every call a rank waits in has been made by every rank it needs.
  // A stopped rank is then the one holding the others up (stopped inside the call they wait in,
  // its ledger says "waiting" as theirs do); with none, the ledgers cannot tell (a rank blocked in
  // C code inside the call, a stalled network), and every waiting rank is listed with no culprit.
  bool stalled = false;
  if (g.edges.empty()) {
    bool any_waiting = false;
    for (int i = 0; i < n; ++i) {
      if (stopped(ranks[i])) d.culprits.push_back(i);
      any_waiting = any_waiting || g.waiting(i);
    }
    if (d.culprits.empty() && !any_waiting) return d;
    stalled = d.culprits.empty();
  }

  // Culprits: at the end of an edge and not waiting themselves.
  std::set<int> targets;
  for (const auto& e : g.edges) targets.insert(e.to);
  for (int t : targets)
    if (!g.waiting(t)) d.culprits.push_back(t);
  bool cycle = false;
  if (d.culprits.empty() && !stalled) {
    cycle = true;
    d.culprits = g.most_waited_for();
  }
  d.headline = g.headline(d.culprits, stalled, cycle, trigger);

  // The details: the culprits first, then every rank waiting, then the rest.
  std::set<int> shown;
  for (int c : d.culprits) {
    d.details += g.line_of(c, d.culprits, now_ns);
    shown.insert(c);
  }
  for (int i = 0; i < n; ++i)
    if (!shown.count(i) && g.waiting(i)) {
      d.details += g.line_of(i, d.culprits, now_ns);
      shown.insert(i);
    }
  for (int i = 0; i < n; ++i)
    if (!shown.count(i)) d.details += g.line_of(i, d.culprits, now_ns);
  if (!g.elsewhere_nodes.empty()) {
    std::string list;
    for (int r : g.elsewhere_nodes) list += (list.empty() ? "" : ",") + std::to_string(r);
    d.details += "  (ranks " + list + " run on other nodes: their launchers have their ledgers)\n";
  }
  return d;
}

std::string dump(const std::vector<RankView>& ranks, int64_t now_ns, size_t tail) {
  std::string s;
  for (const auto& r : ranks) {
    s += "  " + name(r) + ": ";
    if (!r.running) s += describe_status(r.status);
    else if (stopped(r)) s += "stopped (process state " + std::string(1, r.state) + ")";
    else s += "running";
    if (!r.ledger.valid) {
      s += "; no ledger yet (starting)\n";
      continue;
    }
    Blocked b = blocked_in(r.ledger);
    if (r.running && !stopped(r) && b.call)
      s += "; waiting in " + where(*b.group, *b.call) + " for " + seconds(std::max<int64_t>(0, now_ns - b.call->started_ns));
    else if (r.running && !stopped(r) && r.line_fresh)
      s += "; its Lua line now: " + r.ledger.line;
    s += "\n";
    for (const auto& g : r.ledger.groups) {
      s += "    " + g.describe() + ": " + std::to_string(g.collectives) + " collectives";
      for (const auto& c : g.channels)
        if (c.tag != dist::ledger::kRingTag)
          s += "; with rank " + std::to_string(c.peer) + " tag " + std::to_string(c.tag) + ": " + std::to_string(c.sent) +
               " sent, " + std::to_string(c.received) + " received";
      if (g.calls_kept.empty()) {
        s += "\n";
        continue;
      }
      size_t from = g.calls_kept.size() > tail ? g.calls_kept.size() - tail : 0;
      s += "; the last " + std::to_string(g.calls_kept.size() - from) + ":\n";
      for (size_t k = from; k < g.calls_kept.size(); ++k) {
        const Call& c = g.calls_kept[k];
        s += "      " + (c.collective() ? "call " + std::to_string(c.seq) : "message " + std::to_string(c.seq)) + ": " +
             c.describe() + " at " + (c.site.empty() ? "(no script line)" : c.site) + ", " +
             dist::ledger::state_name(c.state);
        if (c.ended_ns > c.started_ns) {
          char buf[32];
          std::snprintf(buf, sizeof buf, " in %.3f ms", double(c.ended_ns - c.started_ns) / 1e6);
          s += buf;
        }
        s += "\n";
      }
    }
  }
  return s;
}

}  // namespace partrain::app::hang
