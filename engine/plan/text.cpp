// A plan as people read it: what a mismatch with a saved plan shows, to_text, fit_verdict and to_json.
#include "engine/plan/plan.hpp"

#include <algorithm>
#include <cstdio>
#include <initializer_list>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace partrain::plan {

// ---- Comparing -----------------------------------------------------------------------------

namespace {

template <class T>
std::string list(const std::vector<T>& v, const char* sep = "x") {
  std::ostringstream s;
  for (size_t i = 0; i < v.size(); ++i) s << (i ? sep : "") << v[i];
  return v.empty() ? "scalar" : s.str();
}

std::string slices_text(const Shard& s) {
  if (s.dim < 0) return "whole";
  std::ostringstream t;
  for (size_t i = 0; i < s.slices.size(); ++i)
    t << (i ? "+" : "") << s.slices[i].first << ":" << s.slices[i].first + s.slices[i].second;
  return t.str();
}

// A name read from a plan file as a message shows it: as it is when short and printable, else
// its first 40 bytes (unprintable ones as '?') and its length. A damaged or foreign plan can
// hold a name of megabytes, which a mismatch had printed whole.
std::string name_text(const std::string& name) {
  bool plain = name.size() <= 80;
  for (char c : name) plain = plain && c >= 0x20 && c < 0x7f;
  if (plain) return name;
  std::string head = name.substr(0, 40);
  for (auto& c : head)
    if (c < 0x20 || c >= 0x7f) c = '?';
  return head + "... (" + std::to_string(name.size()) + " bytes)";
}

// A shard as a mismatch shows it, in at most 300 bytes (a damaged plan's shape can hold
// thousands of dimensions).
std::string shard_text(const Shard& s) {
  std::ostringstream t;
  t << name_text(s.dtype) << " " << list(s.shape) << " local " << list(s.local_shape);
  if (s.dim >= 0) t << " split on " << s.dim << " [" << slices_text(s) << "] over ranks " << list(s.group, ",");
  std::string text = t.str();
  return text.size() > 300 ? text.substr(0, 300) + "..." : text;
}

// The expert group's all-to-alls: their bytes follow the routing, which depends on the data, so a
// run is compared with its plan by their calls (the plan's bytes are a balanced routing's).
bool routed(const Collective& c) { return c.group.rfind("expert[", 0) == 0 && c.op == "all_to_all"; }

bool same_collectives(const std::vector<Collective>& planned, const std::vector<Collective>& actual) {
  if (planned.size() != actual.size()) return false;
  for (size_t i = 0; i < planned.size(); ++i) {
    const auto &p = planned[i], &a = actual[i];
    if (p.group != a.group || p.op != a.op || p.calls != a.calls || (!routed(p) && p.bytes != a.bytes)) return false;
  }
  return true;
}

}  // namespace

std::string differences(const RankPlan& planned, const RankPlan& actual) {
  std::ostringstream d;
  int shown = 0, hidden = 0;  // at most 8 tensors named, then a count
  if (planned.tensor != actual.tensor || planned.data != actual.data || planned.pipeline != actual.pipeline ||
      planned.context != actual.context || planned.expert != actual.expert)
    d << "  coordinates: planned tensor " << planned.tensor << ", context " << planned.context << ", data "
      << planned.data << ", pipeline " << planned.pipeline << ", expert " << planned.expert << "; this run "
      << actual.tensor << ", " << actual.context << ", " << actual.data << ", " << actual.pipeline << ", "
      << actual.expert << "\n";
  std::map<std::string, const Shard*> mine;
  for (const auto& s : actual.shards) mine[s.name] = &s;
  for (const auto& s : planned.shards) {
    auto it = mine.find(s.name);
    bool differs = it == mine.end() || !(s == *it->second);
    if (differs && shown == 8) ++hidden;
    else if (it == mine.end())
      d << "  " << name_text(s.name) << ": planned (" << shard_text(s) << "), missing in this run\n";
    else if (differs)
      d << "  " << name_text(s.name) << ": planned " << shard_text(s) << "; this run " << shard_text(*it->second)
        << "\n";
    if (differs && shown < 8) ++shown;
    if (it != mine.end()) mine.erase(it);
  }
  for (const auto& [name, s] : mine) {
    if (shown == 8) {
      ++hidden;
      continue;
    }
    d << "  " << name << ": not in the plan (" << shard_text(*s) << ")\n";
    ++shown;
  }
  if (hidden) d << "  ... and " << hidden << " more tensor(s)\n";
  auto bytes = [&](const char* what, int64_t p, int64_t a) {
    if (p != a) d << "  " << what << " bytes: planned " << p << ", this run " << a << "\n";
  };
  bytes("parameter", planned.param_bytes, actual.param_bytes);
  bytes("gradient", planned.grad_bytes, actual.grad_bytes);
  bytes("optimizer", planned.optimizer_bytes, actual.optimizer_bytes);
  bytes("master-weight", planned.master_bytes, actual.master_bytes);
  if (planned.zero_stage != actual.zero_stage || planned.zero_group != actual.zero_group)
    d << "  ZeRO: planned stage " << planned.zero_stage << " over " << planned.zero_group << " rank(s); this run stage "
      << actual.zero_stage << " over " << actual.zero_group << "\n";
  if (!same_collectives(planned.collectives, actual.collectives)) {
    // The first 16, then a count; the plan's bytes of a routed all-to-all are a balanced routing's.
    auto text = [](const std::vector<Collective>& cs, bool plan) {
      std::ostringstream t;
      for (size_t i = 0; i < cs.size() && i < 16; ++i)
        t << " " << name_text(cs[i].group) << " " << name_text(cs[i].op) << " x" << cs[i].calls << " ("
          << (plan && routed(cs[i]) ? "balanced " : "") << cs[i].bytes << " B)";
      if (cs.size() > 16) t << " and " << cs.size() - 16 << " more";
      return cs.empty() ? std::string(" none") : t.str();
    };
    d << "  collectives in the first step: planned" << text(planned.collectives, true) << "; this run"
      << text(actual.collectives, false) << "\n";
  }
  return d.str();
}

// ---- Showing -------------------------------------------------------------------------------

namespace {

std::string human(int64_t bytes) {
  if (bytes < 0) return "-";
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double x = static_cast<double>(bytes);
  int u = 0;
  while (x >= 1024 && u < 4) {
    x /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", x, units[u]);
  return buf;
}

// "0-3", "0,2", "0-1,4-5", and runs with a stride as "1,9..57" (1, 9, 17, ..., 57).
std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream s;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i + 1;
    int step = j < ranks.size() ? ranks[j] - ranks[i] : 1;
    while (j + 1 < ranks.size() && ranks[j + 1] - ranks[j] == step) ++j;
    s << (i ? "," : "");
    if (j < ranks.size() && j - i >= 2) {  // three or more evenly spaced
      if (step == 1) s << ranks[i] << "-" << ranks[j];
      else s << ranks[i] << "," << ranks[i + 1] << ".." << ranks[j];
      i = j + 1;
    } else {
      s << ranks[i];
      i = i + 1;
    }
  }
  return s.str();
}

// Rows of text keyed by content, in first-seen order, with the ranks that share each.
struct Grouped {
  std::vector<std::string> order;
  std::map<std::string, std::vector<int>> ranks;
  void add(const std::string& text, int rank) {
    auto& r = ranks[text];
    if (r.empty()) order.push_back(text);
    r.push_back(rank);
  }
};

// Rows grouped by content, each led by the ranks that share it.
std::string grouped_rows(const Grouped& rows) {
  std::ostringstream out;
  char line[512];
  for (const auto& text : rows.order) {
    std::snprintf(line, sizeof line, "  %-14s ", rank_list(rows.ranks.at(text)).c_str());
    out << line << text << "\n";
  }
  return out.str();
}

std::string kind_of(const std::string& group) { return group.substr(0, group.find('[')); }

std::string join(const std::vector<std::string>& v, const char* sep = ",") {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

// "h.0-2 + wte,wpe": a chunk's blocks and the first or last modules it holds.
std::string chunk_text(const StagePlan& st, const StageChunk& c) {
  std::string t = st.blocks + "." + std::to_string(c.first_block);
  if (c.end_block - c.first_block > 1) t += "-" + std::to_string(c.end_block - 1);
  if (c.first && !st.first.empty()) t = join(st.first) + " + " + t;
  if (c.last && !st.last.empty()) t += " + " + join(st.last);
  return "stage " + std::to_string(c.stage) + ": " + t;
}

// The pipeline's stages, activations under the schedule and point-to-point traffic, by rank.
std::string stages_text(const Plan& plan) {
  std::ostringstream out;
  const StagePlan* any = nullptr;
  for (const auto& r : plan.ranks)
    if (r.stage.present) any = &r.stage;
  if (!any) return "";
  char line[512], bubble[32];
  std::snprintf(bubble, sizeof bubble, "%.4f", any->bubble);
  out << "\npipeline stages: schedule " << any->schedule << ", " << any->microbatches << " micro-batches, "
      << any->stages << " stages; predicted bubble " << (any->bubble < 0 ? std::string("-") : bubble)
      << " (a forward 1 unit, a backward 2 or a split B and W 1 each, transfers free)\n";
  std::snprintf(line, sizeof line, "  %-14s %-6s %-11s %-11s %-9s %-12s %s\n", "ranks", "stage", "act./mb", "grad in/mb",
                "in flight", "peak act.", "chunks");
  out << line;
  Grouped stages;
  for (const auto& r : plan.ranks) {
    if (!r.stage.present) continue;
    std::string acts, grads, chunks;
    for (const auto& c : r.stage.chunks) {
      acts += (acts.empty() ? "" : ",") + human(c.activation_bytes);
      grads += (grads.empty() ? "" : ",") + human(c.gradient_bytes);
      chunks += (chunks.empty() ? "" : "; ") + chunk_text(r.stage, c);
    }
    std::snprintf(line, sizeof line, "%-6d %-11s %-11s %-9s %-12s %s", r.pipeline, acts.c_str(), grads.c_str(),
                  r.stage.in_flight < 0 ? "-" : std::to_string(r.stage.in_flight).c_str(),
                  human(r.stage.activation_peak).c_str(), chunks.c_str());
    stages.add(line, r.rank);
  }
  out << grouped_rows(stages);
  out << "\npoint-to-point per training step (messages to and from pipeline ranks; bytes include headers)\n";
  Grouped p2p;
  for (const auto& r : plan.ranks) {
    if (!r.stage.present) continue;
    std::string text;
    for (const auto& t : r.stage.peers) {
      std::string part = "pipeline rank " + std::to_string(t.pipeline_peer) + ":";
      if (t.sends) part += " send x" + std::to_string(t.sends) + " " + human(t.send_bytes);
      if (t.recvs) part += std::string(t.sends ? "," : "") + " recv x" + std::to_string(t.recvs) + " " + human(t.recv_bytes);
      text += (text.empty() ? "" : "; ") + part;
    }
    p2p.add(text.empty() ? "none" : text, r.rank);
  }
  out << grouped_rows(p2p);
  return out.str();
}

}  // namespace

namespace {

// What would make a layout that does not fit fit, from what dominates its largest rank.
std::string remedies(const Plan& plan, const RankPlan& r, int64_t device) {
  std::vector<std::string> tries;
  const int64_t sharded = r.grad_bytes + r.optimizer_bytes + r.master_bytes;
  // Gradients sync over data x context (every parameter is replicated over the context ranks),
  // and ZeRO shards over the same ranks.
  const int replicas = plan.data * plan.context;
  if (r.zero_stage < 2 && replicas > 1) {
    // ZeRO-2 keeps 1/replicas of the gradients, optimizer state and masters (the buckets aside).
    const int64_t saved = sharded - sharded / replicas;
    tries.push_back("ZeRO-2 over the " + std::to_string(replicas) +
                    (plan.context > 1 ? " data x context ranks" : " data ranks") + " (zero = { stage = 2 }; about " +
                    human(saved) + " less)");
  } else if (r.zero_stage == 2 && r.zero_group > 1) {
    // ZeRO-3 keeps 1/z of the parameters too, and gathers a few blocks at a time (not counted
    // here: a block is small beside the model when there are many).
    const int64_t saved = r.param_bytes - r.param_bytes / r.zero_group;
    tries.push_back("ZeRO-3 over the " + std::to_string(r.zero_group) + " zero ranks (zero = { stage = 3 }; up to " +
                    human(saved) + " less, less the blocks gathered at once)");
  }
  if (r.activation_bytes > r.model_state_bytes() / 2)
    tries.push_back(std::string("activation recompute or ") + (plan.pipeline > 1 ? "smaller micro-batches" : "a smaller batch a rank") +
                    " (activations are " + human(r.activation_bytes) + ")");
  tries.push_back(plan.pipeline > 1 ? "more pipeline stages or a larger tensor size"
                                    : "a pipeline (--pipeline 2 or more) or a larger tensor size");
  if (r.peak_bytes() > 4 * device) tries.push_back("more ranks");
  std::string out;
  for (size_t i = 0; i < tries.size(); ++i) out += (i == 0 ? "" : i + 1 == tries.size() ? " or " : ", ") + tries[i];
  return out;
}

}  // namespace

std::string fit_verdict(const Plan& plan, int64_t device, const std::string& source) {
  if (plan.ranks.empty() || device <= 0) return "";
  const RankPlan* top = &plan.ranks.front();
  std::vector<int> all, over;
  for (const auto& r : plan.ranks) {
    all.push_back(r.rank);
    if (r.peak_bytes() > device) over.push_back(r.rank);
    if (r.peak_bytes() > top->peak_bytes()) top = &r;
  }
  const std::string of = " of " + human(device) + " (" + source + ")";
  if (over.empty())
    return "fits: peak " + human(top->peak_bytes()) + of + " on ranks " + rank_list(all) + " (the most on rank " +
           std::to_string(top->rank) + ")";
  return "does not fit: ranks " + rank_list(over) + " need up to " + human(top->peak_bytes()) + of + " (rank " +
         std::to_string(top->rank) + ": model state " + human(top->model_state_bytes()) + " + activations " +
         human(std::max<int64_t>(top->activation_bytes, 0)) + "); try " + remedies(plan, *top, device);
}

namespace {

// The ZeRO stage the plan's ranks run (0: none).
int zero_stage_of(const Plan& plan) { return plan.ranks.empty() ? 0 : plan.ranks.front().zero_stage; }

// The layout, how long planning took and, given the device's memory, whether the plan fits.
std::string header_text(const Plan& plan, const TextOptions& options) {
  std::ostringstream out;
  out << "plan of " << plan.script << " on " << plan.world << " virtual rank(s) (" << plan.world / plan.nproc_per_node
      << " node(s) x " << plan.nproc_per_node << "): " << layout_text(plan)
      << (plan.zero > 1 ? ", zero groups of " + std::to_string(plan.zero) : "");
  const int stage = zero_stage_of(plan);
  if (stage > 0) out << ", ZeRO-" << stage << " over " << plan.ranks.front().zero_group << " rank(s)";
  out << "\n";
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.2f", plan.seconds);
  out << "planned in " << secs << " s; tensor memory allocated on the CPU while planning: peak "
      << human(plan.cpu_peak_bytes) << "\n";
  if (options.device_memory > 0) out << fit_verdict(plan, options.device_memory, options.device_source) << "\n";
  return out.str();
}

// The shard map: each logical tensor and who holds which part of it (only a count unless
// options.shards).
std::string shards_text(const Plan& plan, const TextOptions& options) {
  std::ostringstream out;
  std::vector<std::string> names;
  std::map<std::string, const Shard*> first;
  std::map<std::string, Grouped> holders;
  for (const auto& r : plan.ranks)
    for (const auto& s : r.shards) {
      if (!first.count(s.name)) {
        names.push_back(s.name);
        first[s.name] = &s;
      }
      holders[s.name].add(slices_text(s), r.rank);
    }
  size_t width = 9;
  for (const auto& n : names) width = std::max(width, n.size());
  char line[512];
  if (!options.shards) {
    out << "\nshards: " << names.size() << " logical tensors (partrain plan -v lists the slices each rank holds)\n";
    names.clear();
  } else {
    out << "\nshards: logical tensors and the slices ranks hold\n";
  }
  std::snprintf(line, sizeof line, "  %-*s  %-16s %-7s %-11s %s\n", static_cast<int>(width), "parameter", "shape",
                "split", "bytes/rank", "held by");
  if (options.shards) out << line;
  for (const auto& n : names) {
    const Shard& s = *first[n];
    std::string held;
    const auto& g = holders[n];
    if (g.order.size() == 1 && g.order[0] == "whole" && g.ranks.at("whole").size() == plan.ranks.size()) {
      held = "every rank (whole)";
    } else {
      for (const auto& text : g.order)
        held += (held.empty() ? "" : "; ") + std::string("ranks ") + rank_list(g.ranks.at(text)) + " [" + text + "]";
    }
    std::snprintf(line, sizeof line, "  %-*s  %-16s %-7s %-11s ", static_cast<int>(width), n.c_str(),
                  list(s.shape).c_str(), s.dim < 0 ? "-" : std::to_string(s.dim).c_str(), human(s.bytes).c_str());
    out << line << held << "\n";
  }
  return out.str();
}

// Memory per rank, ranks with the same figures together.
std::string memory_text(const Plan& plan) {
  std::ostringstream out;
  out << "\nmemory per rank (model state = parameters + gradients + optimizer state + master weights; peak = model "
         "state + activations)\n";
  const int stage = zero_stage_of(plan);
  if (stage == 1)
    out << "  ZeRO-1: optimizer state and float32 master weights are this rank's shard; gradients are the whole flat "
           "buffer (backward accumulates into it) plus the float32 shard the update reads\n";
  if (stage == 2)
    out << "  ZeRO-2: optimizer state, float32 master weights and gradients are this rank's shard; gradients are the "
           "shard (what the update reads) plus the scratch of the buckets backward is reducing (and any tie across "
           "pipeline stages, reduced whole)\n";
  if (stage == 3) {
    out << "  ZeRO-3: parameters, gradients, optimizer state and float32 master weights are this rank's shard; "
           "parameters are the shard (a float32 parameter's shard is its master, counted here, not under masters) "
           "and the units gathered at once: ";
    const auto& r = plan.ranks.front();
    out << (r.gathers_all ? "every unit (reshard_after_forward off, a pipeline's default: each stays gathered "
                            "from its forward to its backward)"
                          : "the root unit and the largest 1 + prefetch consecutive blocks (one computes, the next "
                            "on their way)")
        << "\n";
  }
  const bool staged = plan.pipeline > 1;
  char line[512];
  std::snprintf(line, sizeof line, "  %-14s %-12s %-12s %-12s %-12s %-12s %-12s %s\n", "ranks", "parameters",
                "gradients", "optimizer", "masters", "model state", "peak",
                staged ? "activations (peak under the schedule)" : "activations (first step)");
  out << line;
  Grouped memory;
  for (const auto& r : plan.ranks) {
    std::snprintf(line, sizeof line, "%-12s %-12s %-12s %-12s %-12s %-12s %s", human(r.param_bytes).c_str(),
                  human(r.grad_bytes).c_str(), human(r.optimizer_bytes).c_str(), human(r.master_bytes).c_str(),
                  human(r.model_state_bytes()).c_str(), human(r.peak_bytes()).c_str(),
                  r.activation_bytes < 0 ? "- (no forward before the first step)" : human(r.activation_bytes).c_str());
    memory.add(line, r.rank);
  }
  out << grouped_rows(memory);
  if (stage == 3) {
    out << "  parameters under ZeRO-3: the shard (and any parameter kept whole) + the units gathered at once\n";
    Grouped split;
    for (const auto& r : plan.ranks)
      split.add(human(r.param_shard_bytes) + " + " + human(r.gather_bytes), r.rank);
    out << grouped_rows(split);
  }
  return out.str();
}

// Collectives in a step, by group kind.
std::string collectives_text(const Plan& plan) {
  std::ostringstream out;
  out << "\ncollectives per training step (bytes: whole messages)\n";
  Grouped comms;
  for (const auto& r : plan.ranks) {
    std::map<std::string, Collective> by_kind;
    for (const auto& c : r.collectives) {
      auto& k = by_kind[kind_of(c.group) + " " + c.op];
      k.calls += c.calls;
      k.bytes += c.bytes;
    }
    std::string text;
    // A planned expert group's all-to-alls moved a balanced routing's rows (a run's, its own).
    const bool balanced = r.expert_plan.forwards > 0;
    for (const auto& [what, c] : by_kind)
      text += (text.empty() ? "" : "; ") + what + " x" + std::to_string(c.calls) + " " + human(c.bytes) +
              (balanced && what == "expert all_to_all" ? " (balanced routing)" : "");
    comms.add(text.empty() ? "none" : text, r.rank);
  }
  out << grouped_rows(comms);
  return out.str();
}

// "4x4x8x4": a shape.
std::string dims(std::initializer_list<int64_t> sizes) { return list(std::vector<int64_t>(sizes)); }

// Context parallelism: how each sequence is split, the step's attention calls over the context
// group, and what each mode would move in a step, predicted from the calls' shapes.
std::string context_text(const Plan& plan) {
  const int c = plan.context;
  std::ostringstream out;
  out << "\ncontext parallelism: each sequence split over " << c << " context ranks, context rank r holding chunks r "
      << "and " << 2 * c - 1 << "-r of " << 2 * c << " (moves: bytes a rank sends the others a step; an all-to-all "
      << "also keeps 1/" << c << " of its input on the rank, which the collectives table counts)\n";
  Grouped rows;
  for (const auto& r : plan.ranks) {
    const auto& p = r.context_plan;
    if (p.calls == 0) {
      rows.add("no context attention in the first step", r.rank);
      continue;
    }
    std::ostringstream row;
    row << p.mode << ": " << p.calls << " attention call(s) a step of q " << dims({p.batch, p.heads, p.rows, p.head_size})
        << " and k, v " << dims({p.batch, p.kv_heads, p.rows, p.head_size})
        << " (batch x heads x positions x head size, " << p.element_size << "-byte elements)\n" << std::string(17, ' ');
    const int64_t ring = p.ring_bytes, a2a = p.all_to_all_sent(c);
    row << "context " << c << ": ring moves " << human(ring) << " a step, ";
    if (!p.all_to_all_refusal.empty()) {
      row << "all_to_all cannot run: " << p.all_to_all_refusal;
    } else {
      row << "all_to_all " << human(a2a) << " (it splits the " << p.heads << " query heads " << c << " ways); "
          << (ring < a2a ? "ring moves less" : a2a < ring ? "all_to_all moves less" : "both move the same");
    }
    rows.add(row.str(), r.rank);
  }
  out << grouped_rows(rows);
  return out.str();
}

// Expert parallelism: the share of the stacked experts a rank holds, and the MoE forwards'
// all-to-alls over the expert group, their bytes predicted for a balanced and the worst routing.
std::string expert_text(const Plan& plan) {
  const int e = plan.expert;
  std::ostringstream out;
  out << "\nexpert parallelism: each block's experts split over expert groups of " << e << " ranks (moves: bytes a "
      << "rank sends the others a step; the routing decides them, so they are predicted for a balanced routing, T/E "
      << "rows an expert, and the worst, every routed row to another rank)\n";
  Grouped rows;
  for (const auto& r : plan.ranks) {
    const auto& p = r.expert_plan;
    if (p.experts == 0) {
      rows.add("no mixture-of-experts block", r.rank);
      continue;
    }
    std::ostringstream row;
    const std::string pad = "\n" + std::string(17, ' ');
    const int64_t first = r.expert * p.local;
    row << "experts " << first << (p.local > 1 ? "-" + std::to_string(first + p.local - 1) : "") << " of "
        << p.experts << " in each of " << p.blocks << " block(s): " << human(p.param_bytes) << " of the "
        << human(p.stacked_bytes) << " stacked (gradients " << human(p.grad_bytes) << ", optimizer state "
        << human(p.optimizer_bytes) << "; in the memory table)";
    if (p.forwards == 0) {
      row << pad << "no MoE forward over the expert group in the first step";
    } else {
      const int64_t f = p.forwards;
      row << pad << f << " MoE forward(s) a step of " << p.tokens << " tokens, top_k " << p.top_k << ": "
          << p.slots << " routed rows of " << p.dim << " (" << p.element_size << "-byte elements); all_to_all x"
          << p.all_to_alls << " a step: counts x" << f << " " << human(p.count_bytes) << ", rows x"
          << p.all_to_alls - f << " " << human(p.balanced_bytes) << " balanced"
          << pad << "a forward and its backward: balanced moves " << human(p.balanced_sent / f) << ", worst "
          << human(p.worst_sent / f) << "; the step: balanced " << human(p.balanced_sent) << ", worst "
          << human(p.worst_sent);
    }
    rows.add(row.str(), r.rank);
  }
  out << grouped_rows(rows);
  return out.str();
}

}  // namespace

std::string layout_text(const Plan& plan) {
  return "tensor " + std::to_string(plan.tensor) + (plan.context > 1 ? " x context " + std::to_string(plan.context) : "") +
         " x data " + std::to_string(plan.data) + " x pipeline " + std::to_string(plan.pipeline) +
         (plan.expert > 1 ? ", expert " + std::to_string(plan.expert) : "");
}

std::string to_text(const Plan& plan, const TextOptions& options) {
  std::string out = header_text(plan, options) + shards_text(plan, options) + memory_text(plan);
  if (plan.pipeline > 1) out += stages_text(plan);
  if (plan.context > 1) out += context_text(plan);
  if (plan.expert > 1) out += expert_text(plan);
  return out + collectives_text(plan);
}

std::string to_json(const Plan& plan) {
  using nlohmann::json;
  json ranks = json::array();
  for (const auto& r : plan.ranks) {
    json shards = json::array();
    for (const auto& s : r.shards) {
      json slices = json::array();
      for (const auto& [start, length] : s.slices) slices.push_back({start, length});
      shards.push_back({{"name", s.name}, {"dtype", s.dtype}, {"shape", s.shape}, {"local_shape", s.local_shape},
                        {"dim", s.dim < 0 ? json(nullptr) : json(s.dim)}, {"slices", slices}, {"group", s.group},
                        {"bytes", s.bytes}});
    }
    json comms = json::array();
    for (const auto& c : r.collectives)
      comms.push_back({{"group", c.group}, {"op", c.op}, {"calls", c.calls}, {"bytes", c.bytes}});
    json stage = nullptr;
    if (r.stage.present) {
      const auto& st = r.stage;
      json chunks = json::array(), peers = json::array();
      for (const auto& c : st.chunks)
        chunks.push_back({{"stage", c.stage}, {"blocks", {c.first_block, c.end_block}}, {"first", c.first},
                          {"last", c.last}, {"activation_bytes", c.activation_bytes < 0 ? json(nullptr) : json(c.activation_bytes)},
                          {"gradient_bytes", c.gradient_bytes},
                          {"backward_bytes", c.backward_bytes < 0 ? json(nullptr) : json(c.backward_bytes)},
                          {"pending_bytes", c.pending_bytes}});
      for (const auto& t : st.peers)
        peers.push_back({{"peer", t.peer}, {"pipeline_peer", t.pipeline_peer}, {"sends", t.sends},
                         {"send_bytes", t.send_bytes}, {"recvs", t.recvs}, {"recv_bytes", t.recv_bytes}});
      stage = {{"pipeline_rank", r.pipeline}, {"schedule", st.schedule}, {"microbatches", st.microbatches},
               {"stages", st.stages}, {"blocks", st.blocks}, {"first", st.first}, {"last", st.last},
               {"chunks", chunks}, {"in_flight", st.in_flight < 0 ? json(nullptr) : json(st.in_flight)},
               {"activation_peak_bytes", st.activation_peak < 0 ? json(nullptr) : json(st.activation_peak)},
               {"bubble", st.bubble < 0 ? json(nullptr) : json(st.bubble)}, {"p2p", peers}};
    }
    json context = nullptr;
    if (r.context_plan.calls > 0) {
      const auto& p = r.context_plan;
      context = {{"mode", p.mode}, {"calls", p.calls}, {"batch", p.batch}, {"heads", p.heads},
                 {"kv_heads", p.kv_heads}, {"rows", p.rows}, {"head_size", p.head_size},
                 {"element_size", p.element_size}, {"ring_bytes", p.ring_bytes},
                 {"all_to_all_refusal", p.all_to_all_refusal.empty() ? json(nullptr) : json(p.all_to_all_refusal)}};
      // What all_to_all would move (null where it cannot run).
      const bool runs = p.all_to_all_refusal.empty();
      context["all_to_all_bytes"] = runs ? json(p.all_to_all_bytes) : json(nullptr);
      context["all_to_all_sent_bytes"] = runs ? json(p.all_to_all_sent(plan.context)) : json(nullptr);
    }
    json expert = nullptr;
    if (r.expert_plan.experts > 0) {
      const auto& p = r.expert_plan;
      expert = {{"experts", p.experts}, {"local", p.local}, {"blocks", p.blocks}, {"top_k", p.top_k},
                {"forwards", p.forwards},
                {"tokens", p.tokens}, {"slots", p.slots}, {"dim", p.dim}, {"element_size", p.element_size},
                {"all_to_all_calls", p.all_to_alls}, {"count_bytes", p.count_bytes},
                {"balanced_bytes", p.balanced_bytes}, {"balanced_sent_bytes", p.balanced_sent},
                {"worst_sent_bytes", p.worst_sent}, {"param_bytes", p.param_bytes},
                {"stacked_bytes", p.stacked_bytes}, {"grad_bytes", p.grad_bytes},
                {"optimizer_bytes", p.optimizer_bytes}};
    }
    ranks.push_back({{"rank", r.rank},
                     {"coord", {{"tensor", r.tensor}, {"context", r.context}, {"data", r.data}, {"pipeline", r.pipeline},
                                {"expert", r.expert}}},
                     {"param_bytes", r.param_bytes},
                     {"grad_bytes", r.grad_bytes},
                     {"optimizer_bytes", r.optimizer_bytes},
                     {"master_bytes", r.master_bytes},
                     {"zero", {{"stage", r.zero_stage}, {"group", r.zero_group}}},
                     {"zero3", r.zero_stage == 3 ? json{{"param_shard_bytes", r.param_shard_bytes},
                                                        {"gather_bytes", r.gather_bytes},
                                                        {"gathers_all", r.gathers_all}}
                                                  : json(nullptr)},
                     {"model_state_bytes", r.model_state_bytes()},
                     {"activation_bytes", r.activation_bytes < 0 ? json(nullptr) : json(r.activation_bytes)},
                     {"collectives", comms},
                     {"pipeline", stage},
                     {"context", context},
                     {"expert", expert},
                     {"shards", shards}});
  }
  json j = {{"script", plan.script},
            {"world", plan.world},
            {"nproc_per_node", plan.nproc_per_node},
            {"mesh", {{"tensor", plan.tensor}, {"context", plan.context}, {"data", plan.data}, {"pipeline", plan.pipeline},
                      {"zero", plan.zero}, {"expert", plan.expert}}},
            {"seconds", plan.seconds},
            {"cpu_peak_bytes", plan.cpu_peak_bytes},
            {"ranks", ranks}};
  return j.dump(1);
}

}  // namespace partrain::plan
