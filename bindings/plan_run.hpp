// Running a script on virtual ranks (partrain plan): each rank in a fresh Lua host, on the meta
// device, with planned groups, up to its first optimizer step, recorded as a plan. The plan
// command runs every rank of one layout; the layout search (partrain plan --auto) runs a few
// representative ranks of many.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "engine/plan/plan.hpp"

namespace partrain::lua {

/// What to plan: the script and its arguments, the world (`nproc` ranks a node) and which ranks.
struct PlanRequest {
  std::string script;
  std::vector<std::string> args;
  int world = 1, nproc = 1;
  std::vector<int> ranks;  ///< the global ranks to plan, in this order (empty: all)
  bool verbose = false;    ///< let rank 0's script print (the others stay quiet)
};

/// The plan of the requested ranks, and the script's options as the first planned rank resolved
/// them (pt.args: name -> kind and value as Lua source).
struct Planned {
  plan::Plan plan;
  std::map<std::string, std::string> kinds, values;
};

/// Plans `request` (planning must be on: plan::set_planning(true)). Returns false with `error`
/// ("rank R of N: ...", the script's own message where it refused) when a rank fails.
bool plan_ranks(const PlanRequest& request, Planned* out, std::string* error);

}  // namespace partrain::lua
