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

/// One in-place initialization of a whole tensor (pt.nn.init's functions, and a tensor's own
/// fill_, zero_, add_, mul_, uniform_, normal_ with numbers). Done at once on a real tensor; asked
/// of a meta tensor (a deferred build), it is recorded and replayed when the tensor is
/// materialized, drawing from that tensor's generator of (seed, name).
struct InitOp {
  enum class Kind { normal, uniform, constant, add, mul, xavier_uniform, xavier_normal, kaiming_uniform,
                    kaiming_normal, trunc_normal };
  Kind kind;
  /// normal: mean, std; uniform: low, high; constant, add, mul: the value; xavier: gain;
  /// kaiming: gain, then b = 1 for fan_out (0: fan_in); trunc_normal: mean, std, low, high.
  double a = 0, b = 0, c = 0, d = 0;
  /// Whether it sets every element whatever the tensor held (the layer's own initialization is
  /// then not needed first).
  bool overwrites() const { return kind != Kind::add && kind != Kind::mul; }
};

/// Applies `op` to `t` under no_grad, drawing from `gen` (none: the global generator). The fans
/// of xavier and kaiming are PyTorch's (dimension 1 / dimension 0, times the rest).
void apply_init(Tensor& t, const InitOp& op, c10::optional<at::Generator> gen = c10::nullopt);

/// Applies `op` to `t` now, or, when `t` is a meta tensor, records it for materialization
/// (init_plan). A view of a meta tensor is refused: what is replayed is a whole tensor's.
void init_(Tensor& t, const InitOp& op);

/// The initializations recorded for meta tensor `t` (init_), in order; empty for any other.
std::vector<InitOp> recorded_inits(const Tensor& t);

/// How one meta tensor of a tree gets its values: captured from the tree as it was built, before
/// tensor parallelism replaces its layers or a pipeline cut drops a tie's other names.
struct TensorInit {
  std::string name;                      ///< its canonical name (a tie's first in tree order): seeds it
  std::shared_ptr<const Module> owner;   ///< the module holding it under that name (its reset_tensor)
  std::string local;                     ///< its name in `owner`
  std::vector<InitOp> ops;               ///< what the build asked of it after the layer's own init
};
/// Every dotted name of a meta tensor of `root` (a tie's every name) to how it is initialized.
using InitPlan = std::unordered_map<std::string, TensorInit>;
InitPlan init_plan(Module& root);

/// The logical tensor `init` describes in `root`, of `shape`, as initialization makes it: float32
/// on the CPU, drawn from the generator of (root's seed, init.name): the root's init_tensor, or
/// else the owner's reset_tensor (skipped when the first recorded op sets every element), then
/// the recorded ops in order.
Tensor initial_tensor(const Module& root, const TensorInit& init, at::IntArrayRef shape);

/// One meta tensor to materialize: where it sits and what it is.
struct MetaTensor {
  std::string name;          ///< its dotted name in the tree as it is now
  const Module* owner;       ///< the module holding it now
  std::string local;         ///< its name in `owner`
  Tensor meta;               ///< the meta tensor (its shape, dtype, requires_grad)
  const TensorInit* init;    ///< how it is initialized
};

/// Allocates every meta parameter of `root` and initializes it by name, one tensor at a time
/// (peak memory: one tensor), ties kept. A meta buffer is refused by name (LibTorch cannot give
/// a buffer a new tensor object). `make` turns a meta tensor into its real value; the
/// default is initial_tensor in the meta tensor's shape and dtype on `device`. `plan`: how each
/// tensor is initialized, captured before the tree changed (a pipeline cut, tensor parallelism);
/// null: init_plan(root). Throws, naming the tensor, when root has no init seed. `check_memory`:
/// refuses a tree whose tensors would not fit this process's CPU memory (off where `make` does
/// not keep them: ZeRO-3 keeps 1/z of each).
void materialize(Module& root, torch::Device device,
                 const std::function<Tensor(const MetaTensor&)>& make = nullptr, const InitPlan* plan = nullptr,
                 bool check_memory = true);

/// Whether any parameter or buffer of `root` is on the meta device.
bool has_meta(const Module& root);

}  // namespace partrain::nn
