// Sharding policies as plain data, and the one applier that builds them: a planned policy (what
// the Lua sharder plans from policies/*.lua, or what a C++ program writes) is a list of layers to
// split, attributes to set and parameters to tie again; apply_split builds one layer, for the Lua
// sharder and for C++ programs alike, and apply_policy applies a whole plan as the composer's
// tensor-parallel step (ParallelizeOptions::tensor_parallel).
#pragma once

#include <string>
#include <vector>

#include "engine/dist/mesh.hpp"
#include "engine/nn/module.hpp"

namespace partrain::parallel {

/// The configuration that decides how a split layer is built (the sharder's P.config, those of
/// its switches that reach the layers).
struct SplitOptions {
  /// Activations between the tensor-parallel regions stay split along the sequence: column
  /// layers all-gather it, row layers reduce-scatter it, norms see T/t positions.
  bool sequence_parallel = false;
  /// With sequence_parallel: a column layer overlaps its all-gather with its matmul.
  bool sequence_overlap = false;
  /// LayerNorm as one fused kernel (false: mean and variance in steps, a reference).
  bool fused_norm = true;
};

/// One layer a policy replaces by its parallel form (a `replace` entry of a policy, matched).
struct LayerSplit {
  std::string path;  ///< dotted path of the serial layer in the model ("h.0.attn.c_attn")
  /// "column" (a Linear's outputs split), "row" (its inputs split), "norm" (a LayerNorm or
  /// RMSNorm in the parallel region), "vocab_embedding" (an Embedding's vocabulary split),
  /// "vocab_head" (the output Linear split along the vocabulary, padded like the embedding).
  std::string kind;
  int64_t fused = 1;             ///< column: the output is this many equal parts (q, k, v: 3)
  std::vector<int64_t> parts;    ///< column: the output's part sizes, each split (empty: `fused`)
  bool gather_output = false;    ///< column: all-gather the whole output after
  bool input_is_parallel = true; ///< row: the input arrives split (false: the layer takes its slice)
  /// column, row, norm: sequence parallelism for this layer; nullopt: SplitOptions' setting.
  c10::optional<bool> sequence_parallel;
  std::string where;  ///< where the policy says it (file:line), which errors begin with; "": none
};

/// One numeric attribute a policy sets (GPT-2's attention heads divided by the tensor size).
struct AttributeSetting {
  std::string module;  ///< dotted path of the module holding it ("" the root)
  std::string name;    ///< the attribute (nn::Module::attribute)
  double value = 0;    ///< the new value (a boolean as 1 or 0)
  std::string where;   ///< where the policy says it (file:line); "": none
};

/// Two parameters the serial model holds as one tensor, which splitting separates: after the
/// split `param`'s slot holds `to`'s tensor again (P.tie(model, param, to)). A pair the serial
/// model does not tie is left as it is (LLaMA ties its head to its embedding only with tie = 1).
struct Tie {
  std::string param;  ///< dotted name of the parameter that takes the other's tensor ("lm_head.weight")
  std::string to;     ///< dotted name of the parameter it takes ("wte.weight")
};

/// A policy planned for one model, as data: everything apply_policy does to it.
struct PolicyPlan {
  std::string name;                         ///< the policy's name, for messages and the records
  std::string where;                        ///< where the policy was declared (file:line); "": none
  std::vector<AttributeSetting> attributes; ///< set first, in order
  std::vector<LayerSplit> splits;           ///< built in order (every rank alike)
  std::vector<Tie> ties;                    ///< made again after the splits
  SplitOptions options;                     ///< how the layers are built
};

/// The parallel form of `serial` as `split` says, over `group` (the layer at split.path; `serial`
/// is left untouched). A kind that does not fit the module, or an unknown kind, is an error
/// naming both.
nn::ModulePtr build_split(const nn::Module& serial, const LayerSplit& split, const dist::GroupPtr& group,
                          const SplitOptions& options);

/// Replaces the layer at split.path in `root` by its parallel form (build_split): exactly what the
/// Lua sharder does for each `replace` entry. A path with no module is an error naming it.
void apply_split(nn::Module& root, const LayerSplit& split, const dist::GroupPtr& group, const SplitOptions& options);

/// Applies `plan` to `root` over the mesh's tensor group, as the Lua sharder applies the policy
/// it planned: every rank of the group first takes tensor rank 0's weights (one serial model to
/// cut), then the attributes are set, the layers split in order and the serial model's ties made
/// again; then every module's invariants are checked, and the parameters tied after must be
/// those tied before. A tensor group of one rank leaves the model as it is. Errors begin with the
/// entry's file:line when the plan has one. Not a transaction: a failure leaves the tree half
/// split (ParallelModel::parallelize has not made the model its own yet; drop it).
void apply_policy(nn::Module& root, const PolicyPlan& plan, const dist::Mesh& mesh);

}  // namespace partrain::parallel
