// Initialization that does not depend on build order: every tensor of a model is drawn from a
// generator seeded by (the model's base seed, the tensor's dotted name), so a model built on the
// meta device (no memory) and materialized later, whole or one pipeline stage or tensor shard at a
// time, gets exactly the weights of the same model built the normal way.
#pragma once

#include <functional>
#include <unordered_map>

#include "engine/nn/layers.hpp"

namespace partrain::nn {

/// Builds a model with `build` on the meta device, gives it a base seed drawn from the global
/// generator, then (unless parameter_options() are already on the meta device: a deferred build
/// or the planner) materializes it where parameter_options() say. What the built-in families use,
/// so that their serial models equal their deferred ones.
/// `dtype`: the parameters' dtype (initialized in float32, then cast); default: parameter_options()'s.
ModulePtr build_initialized(const std::function<ModulePtr()>& build,
                            c10::optional<torch::ScalarType> dtype = c10::nullopt);

/// The dtype a model's `dtype` option names: "float32", "float64", "bfloat16" or "float16" (or
/// "fp32", "fp64", "bf16", "fp16"); anything else is an error naming the value.
torch::ScalarType model_dtype(const std::string& name);

/// Draws a base seed from the global generator (pt.manual_seed fixes it) and gives it to `root`.
void draw_init_seed(Module& root);

/// The logical tensor called `name` in `root` (its canonical name: a tied tensor's first name in
/// tree order), of `shape`, as initialization makes it: float32 on the CPU, filled by the root's
/// init_tensor or else by `owner`'s reset_tensor(`local`) from the generator of (seed, name).
Tensor initial_tensor(const Module& root, const std::string& name, at::IntArrayRef shape, const Module& owner,
                      const std::string& local);

/// One meta tensor to materialize: where it sits and what it is.
struct MetaTensor {
  std::string name;       ///< its canonical dotted name (seeds its generator)
  const Module* owner;    ///< the module holding it
  std::string local;      ///< its name in `owner`
  Tensor meta;            ///< the meta tensor (its shape, dtype, requires_grad)
};

/// Allocates every meta parameter of `root` and initializes it by name, one tensor at a time
/// (peak memory: one tensor), ties kept. A meta buffer is refused by name (LibTorch cannot give
/// a buffer a new tensor object). `make` turns a meta tensor into its real value; the
/// default is initial_tensor in the meta tensor's shape and dtype on `device`. `canonical` maps a
/// dotted name to the name that seeds it (the ties the tree had before a pipeline cut dropped the
/// other names); names not in it are canonical in the tree as it is. Throws, naming the tensor,
/// when root has no init seed.
void materialize(Module& root, torch::Device device,
                 const std::function<Tensor(const MetaTensor&)>& make = nullptr,
                 const std::unordered_map<std::string, std::string>& canonical = {});

/// For each tensor of a tied group, the group's first name in tree order (what materialize seeds
/// it by); names of untied tensors are left out.
std::unordered_map<std::string, std::string> canonical_names(const Module& root);

/// Whether any parameter or buffer of `root` is on the meta device.
bool has_meta(const Module& root);

}  // namespace partrain::nn
