// The node of partrain's model tree: a type name policies match on, named children and parameters
// with dotted paths, and an optional C++ forward. Built-in layers and Lua-defined modules are both
// Modules, so the sharder, the checkpointer and the REPL see one kind of tree.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace partrain::nn {

using torch::Tensor;
using TensorMap = std::map<std::string, Tensor>;

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
  /// Adds a parameter (trainable) or replaces the one already called `name`.
  void set_parameter(const std::string& name, const Tensor& value);
  /// Adds a buffer (saved and moved, not trained) or replaces the one already called `name`.
  void set_buffer(const std::string& name, const Tensor& value);

  /// Parameters and buffers by dotted name.
  TensorMap state_dict() const;
  /// Copies `state` into the module's tensors. With `strict`, a missing or unexpected key is an
  /// error; a shape mismatch always is. Every problem is named in one message.
  void load_state_dict(const TensorMap& state, bool strict = true);

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
};

using ModulePtr = std::shared_ptr<Module>;

/// The module's parameters, each once even when shared (a tied weight, a reused submodule).
std::vector<Tensor> unique_parameters(const torch::nn::Module& module);

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
