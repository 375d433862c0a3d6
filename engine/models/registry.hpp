// The built-in model families, one descriptor each (its builder, its Hugging Face names, its
// default policy), registered in one list: pt.models, safetensors import and export, and the
// checkpoint tools find a family here by name or by its root module's type.
//
// Adding a family: write its file in engine/models/ with a `Family <name>_family()` beside its
// builder, and add that call to the list in registry.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "engine/nn/module.hpp"

namespace partrain::models {

/// A builder's options, read by name with a default each. The caller supplies them (the Lua
/// binding reads a table, checking types and refusing keys no builder asked for).
class OptionReader {
 public:
  virtual ~OptionReader() = default;
  virtual int64_t integer(const char* key, int64_t fallback) = 0;
  virtual double number(const char* key, double fallback) = 0;
  virtual bool boolean(const char* key, bool fallback) = 0;
  virtual std::string string(const char* key, const std::string& fallback) = 0;
  virtual std::vector<int64_t> integers(const char* key, std::vector<int64_t> fallback) = 0;
};

/// A Hugging Face tensor that partrain holds as one slice of a stacked tensor: Mixtral's
/// `experts.M.w1.weight` [ffn, dim] is slice M of `experts.w1` [E, ffn, dim].
struct HfSlice {
  std::string name;   ///< partrain's stacked tensor
  int64_t index = 0;  ///< which slice along its dimension 0 (M)
};

/// How a family's tensor names and layouts map onto Hugging Face's (absent: names are kept).
struct HfNames {
  std::string layout;  ///< how messages name the layout: "Hugging Face GPT-2"
  /// partrain's name of a tensor named `hf` in a Hugging Face file.
  std::function<std::string(const std::string& hf)> from_hf;
  /// The name Hugging Face gives partrain's tensor `name`.
  std::function<std::string(const std::string& name)> to_hf;
  /// Whether Hugging Face stores partrain's tensor `name` transposed (GPT-2's Conv1D weights).
  std::function<bool(const std::string& name)> transposed;
  /// Whether a tensor in a Hugging Face file is one partrain computes and an import skips
  /// (GPT-2's causal-mask buffers); may be empty.
  std::function<bool(const std::string& hf)> ignored;
  /// Tied pairs (tensor, the one it is tied to): an export leaves the first out, as Hugging Face
  /// stores only the second; an import fills it from the second, or checks the two agree.
  std::vector<std::pair<std::string, std::string>> tied;
  /// Tensors Hugging Face stores one per index that partrain stacks along a new dimension 0
  /// (Mixtral's experts); both may be empty. `sliced`: the stacked tensor and index a Hugging
  /// Face name holds, or nullopt when it is a tensor of its own. `slice_name`: the Hugging Face
  /// name of slice `index` of partrain's tensor `name`, or nullopt when `name` is not stacked.
  /// An import stacks slices 0..n-1, each present once, of one shape and dtype; an export cuts
  /// the stack back into them.
  std::function<std::optional<HfSlice>(const std::string& hf)> sliced;
  std::function<std::optional<std::string>(const std::string& name, int64_t index)> slice_name;
  std::string slice_noun = "slice";  ///< how messages name one slice ("expert")
};

struct Family {
  std::string name;            ///< pt.models.<name>
  std::string type;            ///< the root module's type name ("GPT2"): how a model shows its family
  std::string default_policy;  ///< the policy module that parallelizes it ("policies.gpt2")
  std::function<nn::ModulePtr(OptionReader&)> build;
  HfNames hf;                  ///< empty `from_hf` when the family has no Hugging Face layout
  bool has_hf() const { return static_cast<bool>(hf.from_hf); }
};

/// Every registered family, in registration order.
const std::vector<Family>& families();
/// The family called `name`; an unknown name is an error listing the known ones.
const Family& family(const std::string& name);
/// The family whose root module has type `type`, or nullptr.
const Family* family_of_type(const std::string& type);

// One descriptor a family, each in its family's file.
Family mlp_family();
Family gpt2_family();
Family llama_family();

}  // namespace partrain::models
