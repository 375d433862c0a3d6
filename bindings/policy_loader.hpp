// Sharding policies written in Lua, for C++ programs: load_policy runs partrain's sharder on a
// policy file (policies/gpt2.lua, or one of yours) to plan it for a C++ model, and gives the plan
// as data, which parallel::apply_policy applies (engine/parallel/policy.hpp). Like host.hpp, it
// hides lua.hpp from its users.
//
//   auto plan = partrain::lua::load_policy(model, partrain::lua::shipped_policy("gpt2"), *mesh);
//   options.tensor_parallel = [&](nn::Module& m, const dist::Mesh& on) { parallel::apply_policy(m, plan, on); };
#pragma once

#include <string>

#include "engine/dist/mesh.hpp"
#include "engine/nn/module.hpp"
#include "engine/parallel/policy.hpp"

namespace partrain::lua {

/// The sharding configuration a policy is planned with: P.config's switches (docs/policies.md),
/// those that mean something without Lua.
struct PolicyConfig {
  bool sequence_parallel = false;  ///< activations stay split along the sequence between regions
  bool sequence_overlap = false;   ///< with sequence_parallel: overlap the all-gather with the matmul
  bool fused_norm = true;          ///< LayerNorm as one fused kernel (false: in steps, a reference)
  bool flash_attention = false;    ///< what the policy sets on attention (GPT-2's flash_attention)
  double policy_timeout = 60;      ///< seconds the policy's modules(cfg) may take
};

/// Plans the policy that the Lua file `policy_file` returns for `model` over the tensor group of
/// `mesh` (as pt.parallelize's sharder does: the policy's modules(cfg) with `config`, its targets,
/// matches, sizes and conflicts checked), without changing the model, and returns the plan. Runs
/// in a Lua state of its own, closed on return. Every rank plans alike; nothing is communicated.
/// Refused, with a message naming the policy's file:line: any error planning raises, and what is
/// code rather than data: a preprocess, a postprocess (declare ties with the policy's `ties`),
/// a `methods` entry (a Lua forward: GPT-2's under sequence_parallel).
parallel::PolicyPlan load_policy(const nn::ModulePtr& model, const std::string& policy_file, const dist::Mesh& mesh,
                                 const PolicyConfig& config = {});

/// The file of the policy partrain ships as `name` ("gpt2": .../policies/gpt2.lua), where
/// partrain's Lua library is found (find_paths(): $PARTRAIN_HOME, the install prefix next to the
/// executable, or the source tree partrain was built from).
std::string shipped_policy(const std::string& name);

}  // namespace partrain::lua
