// The node of partrain's model tree: a type name policies match on, named children and parameters
// with dotted paths, and an optional C++ forward. Built-in layers and Lua-defined modules are both
// Modules, so the sharder, the checkpointer and the REPL see one kind of tree.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/torch.h>

namespace partrain::parallel {
struct Sharding;
class ParallelModel;
}

namespace partrain::nn {

using torch::Tensor;
using TensorMap = std::map<std::string, Tensor>;

/// How the last dimension (the features) of a layer's input or output is laid out across a tensor
/// group: whole, or split into `parts` equal slices, one a rank. The checks that run after a
/// policy compare what one layer gives with what the next one takes.
struct Features {
  int64_t width = -1;  ///< the logical (serial, padded) number of features; -1: any
  int64_t parts = 1;   ///< 1: whole on every rank; t: split over t ranks (width / t here)
  int64_t fused = 1;   ///< the width is this many equal parts (q, k, v), each split on its own
  /// The same layout (a width of -1 matches any width).
  bool matches(const Features& o) const {
    return (width < 0 || o.width < 0 || width == o.width) && parts == o.parts && fused == o.fused;
  }
  /// "64 features split over tensor=2 (32 here)", "64 whole features", ...
  std::string describe() const;
};

/// One setting of a model's configuration (GPT-2's heads, ...), as a checkpoint records it.
struct ConfigField {
  std::string name;
  double value = 0;  ///< a boolean as 0 or 1
  /// Whether it changes what the model computes without changing the name or shape of any
  /// parameter (attention heads), so that only the recorded value tells a checkpoint saved with
  /// another one: a load refuses it. Settings that the shapes already pin (dim, layers) or that
  /// a run may change when it resumes (dropout) are not fixed.
  bool fixed = false;
  /// A setting that is a name (an MLP's activation) rather than a number: compared as text, and
  /// `value` unused. Empty for a number.
  std::string text;
};

class Module : public torch::nn::Module {
 public:
  /// `type` is the module's class name as users and policies see it ("Linear", "GPT2Block").
  explicit Module(std::string type);

  const std::string& type() const { return type_; }

  /// Runs the module. The base class has no forward of its own and says so.
  virtual Tensor forward(const std::vector<Tensor>& inputs);
  /// A named numeric setting that a policy may read or change (an attention module's heads, a
  /// dropout probability), or nullopt.
  virtual c10::optional<double> attribute(const std::string& name) const;
  /// Changes it; a name the module does not have, or a value it cannot take, is an error naming
  /// the module.
  virtual void set_attribute(const std::string& name, double value);
  /// The names attribute() knows (an attention module's "heads", ...), for messages and undo.
  virtual std::vector<std::string> attribute_names() const { return {}; }
  /// The configuration a model family's root was built with (the serial model's, whatever a
  /// policy changed in its layers), which checkpoints record and a load compares; empty: none.
  virtual std::vector<ConfigField> config() const { return {}; }
  /// Checks the invariants that tie this module's sizes and its children's together (an
  /// attention module: its heads x head size = its width); a policy can break them. Throws a
  /// message naming the module by `path`. Called on every module of a tree after a policy.
  virtual void check(const std::string& path) const;
  /// The features the forward takes and gives along the last dimension, when the module knows
  /// them (linear layers, norms, chains of them), for check(); nullopt: unknown.
  virtual c10::optional<Features> input_features() const { return c10::nullopt; }
  virtual c10::optional<Features> output_features() const { return c10::nullopt; }
  /// Whether the forward works on each feature alone (ReLU, GELU, Dropout): it passes split
  /// features through unchanged.
  virtual bool elementwise() const { return false; }
  /// Whether the input arrives, or the output leaves, split along the sequence (sequence
  /// parallelism), where the module says; nullopt: it does not say.
  virtual c10::optional<bool> sequence_split() const { return c10::nullopt; }
  /// How this module's own parameter `name` is split across a tensor group, when this module
  /// split it (a tensor-parallel layer); nullptr for a whole parameter. The module tree is where
  /// every consumer (checkpoints, planner, clipping, the REPL) finds it: parallel::sharding_of.
  virtual const parallel::Sharding* sharding_of(const std::string& name) const { return nullptr; }
  /// Initializes `t`, the logical (serial) tensor of this module's own parameter or buffer `name`
  /// (float32 on the CPU), from `gen`, as this layer type initializes it: what its constructor
  /// does, in distribution. The base class knows no parameters and says so, naming the module.
  virtual void reset_tensor(const std::string& name, Tensor& t, at::Generator& gen) const;
  /// A model's say over its whole tree, asked of the root before the owning layer: fills `t`
  /// (the logical tensor at dotted `path`, float32 on the CPU) from `gen` and returns true, or
  /// returns false to leave it to the layer (GPT-2's family initialization answers here).
  virtual bool init_tensor(const std::string& path, Tensor& t, at::Generator& gen) const { return false; }
  /// The base seed that initialization by name (nn::initial_tensor) mixes with each tensor's
  /// name: drawn once from the global generator when the model is built; nullopt until then.
  c10::optional<uint64_t> init_seed() const { return init_seed_; }
  void set_init_seed(uint64_t seed) { init_seed_ = seed; }
  /// Puts `value` in this module's own parameter slot `name` (a new tensor object, not new data
  /// in the old one: a meta tensor's data cannot be swapped for real data), or in its buffer
  /// `name` (new data: a meta buffer is refused, naming it).
  void replace_tensor(const std::string& name, const Tensor& value);
  /// Whether this model provides its pipeline stage ends (stage_in, stage_out). Without them, a
  /// pipeline's first stage applies the policy's `first` modules in order before its blocks, and
  /// the last stage its `last` modules after them: the model is taken to be a chain.
  virtual bool has_stage_ends() const { return false; }
  /// The first stage's forward before its blocks (GPT-2: the embeddings' sum) and the last
  /// stage's after them (GPT-2: ln_f, lm_head). forward(x) is stage_out(blocks(stage_in(x))).
  virtual Tensor stage_in(const Tensor& x);
  virtual Tensor stage_out(const Tensor& x);
  /// Checks a training batch before any of it runs: `x` for the model's forward, `y` for the
  /// loss `loss` ("cross_entropy" or "mse"; `ignore_index` the targets cross_entropy skips).
  /// Raises what the first stage's forward or the last stage's loss would raise, so that on a
  /// pipeline every rank refuses a bad batch before anything is sent, instead of one stage
  /// failing while the others wait for it. Returns whether it read the targets' class ids (the
  /// loss then need not read them again on a device). The base class checks nothing.
  virtual bool check_batch(const Tensor& x, const Tensor& y, const std::string& loss, int64_t ignore_index) {
    return false;
  }
  /// The parallelized model this module is the root of (parallel::ParallelModel), or nullptr.
  /// Held weakly: the parallelized model owns the tree, not the other way round.
  std::shared_ptr<parallel::ParallelModel> parallel_owner() const { return owner_.lock(); }
  void set_parallel_owner(std::weak_ptr<parallel::ParallelModel> owner) { owner_ = std::move(owner); }
  /// The parallelized model whose tree this module is in (the root or any module below it), or
  /// nullptr: its buckets, records and optimizer hold this module's tensors.
  std::shared_ptr<parallel::ParallelModel> parallel_tree() const { return tree_.lock(); }
  void set_parallel_tree(std::weak_ptr<parallel::ParallelModel> owner) { tree_ = std::move(owner); }
  /// The settings shown after the type when the tree is printed ("in=784, out=256").
  virtual std::string extra_repr() const { return ""; }
  /// The tree as text, one module a line, in the style of PyTorch's repr.
  std::string repr() const;
  Tensor operator()(const Tensor& x) { return forward(std::vector<Tensor>{x}); }

  /// A forward that takes this module's place (a policy's method replacement, ShardFormer's
  /// method_replacement): called with the module and its inputs whenever the tree runs it.
  using ForwardFn = std::function<Tensor(Module& self, const std::vector<Tensor>& inputs)>;
  /// Installs `fn` in place of the module's own forward; an empty `fn` restores it.
  void replace_forward(ForwardFn fn) { replaced_ = std::move(fn); }
  bool forward_replaced() const { return static_cast<bool>(replaced_); }
  /// The replacement installed now (empty: none), for a wrapper that calls it in turn.
  const ForwardFn& replaced_forward() const { return replaced_; }
  /// Whether this module's forward or any module's below it was replaced: what it takes and
  /// gives may then not be what its layers' sizes say.
  virtual bool forward_replaced_in_tree() const;
  /// The module's own forward, even when replaced (a replacement may call it).
  Tensor own_forward(const std::vector<Tensor>& inputs);

  /// The direct child called `name`, or nullptr.
  std::shared_ptr<Module> child(const std::string& name) const;
  /// The descendant at a dotted path ("h.0.attn"), or nullptr; "" is this module.
  std::shared_ptr<Module> find(const std::string& path) const;
  /// Adds `child` under `name`, or replaces the child already there.
  void set_child(const std::string& name, std::shared_ptr<Module> child);
  /// Every module of the tree with its dotted path, this one first as "".
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> modules();
  /// The direct children in registration order.
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_named() const;

  /// This module's own parameter or buffer called `name` (not recursive), or an undefined tensor.
  Tensor own_tensor(const std::string& name) const;
  /// This module's parameter `name` (undefined for an empty slot). Layers read their weights
  /// through this on every forward, so replacing a parameter (a policy slicing it) takes effect.
  const Tensor& param(const std::string& name) const { return parameters_[name]; }
  /// Whether `name` is a parameter slot of this module, even an empty one (Linear's bias when
  /// bias=false): reading it gives nothing rather than an error.
  bool has_slot(const std::string& name) const { return parameters_.contains(name); }
  /// Adds a parameter (trainable) or replaces the one already called `name`. With `share`, the
  /// slot holds `value` itself as it is (a tie to another module's parameter: a frozen one stays
  /// frozen and still the same tensor); without, a tensor that does not require grad is made a
  /// trainable one sharing its storage.
  void set_parameter(const std::string& name, const Tensor& value, bool share = false);
  /// Adds a buffer (saved and moved, not trained) or replaces the one already called `name`.
  void set_buffer(const std::string& name, const Tensor& value);

  /// Parameters and buffers by dotted name.
  TensorMap state_dict() const;
  /// Copies `state` into the module's tensors. With `strict`, a missing or unexpected key is an
  /// error; a shape mismatch always is. Every problem is named in one message, and then nothing
  /// is copied (all or nothing).
  void load_state_dict(const TensorMap& state, bool strict = true);

  /// This module's own slots (not its children's): children, parameters and buffers as objects,
  /// attributes, the replaced forward and the training flag. The undo record of a policy.
  struct Slots {
    std::vector<std::pair<std::string, std::shared_ptr<Module>>> children;
    std::vector<std::pair<std::string, Tensor>> parameters;  // undefined for an empty slot
    std::vector<std::pair<std::string, Tensor>> buffers;
    std::vector<std::pair<std::string, double>> attributes;
    ForwardFn replaced;
    bool training = true;
  };
  Slots save_slots() const;
  /// Puts the slots back: the same child and tensor objects in the same order (children and
  /// parameters added since are dropped; a buffer added since stays: LibTorch cannot remove one),
  /// the attributes, the forward. The training flag is left to the caller (train() recurses).
  void restore_slots(const Slots& slots);
  /// Drops every child after the first `n` (a probe's slice; restore_slots puts them back).
  void keep_children(size_t n);

 protected:
  /// For overrides of forward(inputs): when the forward was replaced (and not bypassed by
  /// own_forward), runs the replacement into `out` and returns true.
  bool run_replacement(const std::vector<Tensor>& inputs, Tensor& out);
  /// Throws unless exactly `n` inputs were given; names the module in the message.
  void expect_inputs(const std::vector<Tensor>& inputs, size_t n) const;
  /// Changes the type name (for subclasses that specialize a generic module).
  void rename(std::string type) { type_ = std::move(type); }

 private:
  std::string type_;
  ForwardFn replaced_;
  bool bypass_ = false;  // inside own_forward
  std::weak_ptr<parallel::ParallelModel> owner_, tree_;
  c10::optional<uint64_t> init_seed_;
  // child()'s index, name -> child: built from LibTorch's children dict (which only hands out
  // copies) at the first lookup, and dropped whenever this module's children change (set_child,
  // restore_slots: the only ways partrain changes them). Like the rest of the tree, it is not
  // for changing and reading from two threads at once.
  mutable std::unordered_map<std::string, std::shared_ptr<Module>> child_index_;
  mutable bool child_index_built_ = false;
};

using ModulePtr = std::shared_ptr<Module>;

/// The module's parameters, each once even when shared (a tied weight, a reused submodule).
std::vector<Tensor> unique_parameters(const torch::nn::Module& module);
/// Names that share one parameter tensor (a tied weight), each group sorted, groups in order.
std::vector<std::vector<std::string>> tied_parameters(const torch::nn::Module& module);

/// Calls check(path) on every module of the tree, the root first.
void check_tree(Module& root);
/// Checks that each of `layers`, run in this order, takes the features the one before it gives
/// (width, whole or split, fused parts); elementwise layers pass features through, and a layer
/// that does not know its features starts the chain anew. `owner` names the chain in messages.
void check_chain(const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& layers,
                 const std::string& owner);

/// A whole tree as it is now, to put back exactly: the undo record of a policy that fails half-way.
/// Holds every module's slots and every tensor's data, requires_grad and version.
class TreeSnapshot {
 public:
  /// Keeps a copy of the tensors' contents when they hold at most `copy_limit` bytes in all;
  /// without it, contents changed in place cannot be put back (restore() names them).
  TreeSnapshot(Module& root, int64_t copy_limit);
  /// Puts the tree back as it was. Returns the names of tensors whose contents were changed in
  /// place and could not be restored (no copy was kept); empty when everything is back.
  std::vector<std::string> restore();

 private:
  struct TensorState {
    std::string name;
    Tensor handle;  // the slot's tensor object
    Tensor data;    // a shallow alias of its data then (set_data swaps it)
    Tensor copy;    // its contents, when copies are kept
    uint32_t version;
    bool requires_grad;
  };
  std::vector<std::pair<std::shared_ptr<Module>, Module::Slots>> modules_;  // pre-order
  std::vector<TensorState> tensors_;
};

/// A module whose forward takes one tensor: the usual case for layers.
class Unary : public Module {
 public:
  using Module::Module;
  virtual Tensor forward(const Tensor& x) = 0;
  Tensor forward(const std::vector<Tensor>& inputs) override {
    if (Tensor out; run_replacement(inputs, out)) return out;
    expect_inputs(inputs, 1);
    return forward(inputs[0]);
  }
};

}  // namespace partrain::nn
