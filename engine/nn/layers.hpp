// The serial building blocks: Linear, Embedding, LayerNorm, Dropout, Sequential, activations and
// losses. Parallel layers are built from these by slicing their initialized weights.
#pragma once

#include <functional>

#include "engine/nn/module.hpp"

namespace partrain::nn {

/// The options new layers make their parameters with: LibTorch's defaults (float32 on the CPU)
/// unless changed. The planner sets the meta device, so models are built without memory.
const torch::TensorOptions& parameter_options();
void set_parameter_options(const torch::TensorOptions& options);

struct LinearOptions {
  LinearOptions(int64_t in, int64_t out) : in(in), out(out) {}
  int64_t in;         ///< input features
  int64_t out;        ///< output features
  bool bias = true;   ///< add a learned bias
};

/// y = x W^T + b, with W of shape [out, in] (PyTorch's layout) and LibTorch's default init.
class Linear : public Unary {
 public:
  explicit Linear(const LinearOptions& options);
  /// weight and bias: U(-1/sqrt(in), 1/sqrt(in)), as the constructor (LibTorch's default)
  void reset_tensor(const std::string& name, Tensor& t, at::Generator& gen) const override;
  Tensor forward(const Tensor& x) override;  // (..., in) -> (..., out)
  std::string extra_repr() const override;
  void check(const std::string& path) const override;  // weight [out, in], bias [out]
  c10::optional<Features> input_features() const override { return Features{options.in}; }
  c10::optional<Features> output_features() const override { return Features{options.out}; }
  c10::optional<bool> sequence_split() const override { return false; }
  const Tensor& weight() const { return param("weight"); }  // [out, in]
  const Tensor& bias() const { return param("bias"); }      // [out] or undefined
  LinearOptions options;
};

struct EmbeddingOptions {
  EmbeddingOptions(int64_t count, int64_t dim) : count(count), dim(dim) {}
  int64_t count;  ///< rows of the table (vocabulary size)
  int64_t dim;    ///< width of each row
};

/// A lookup table: ids (...) -> rows (..., dim); weight [count, dim] ~ N(0, 1).
class Embedding : public Unary {
 public:
  explicit Embedding(const EmbeddingOptions& options);
  /// weight: N(0, 1), as the constructor
  void reset_tensor(const std::string& name, Tensor& t, at::Generator& gen) const override;
  Tensor forward(const Tensor& ids) override;
  std::string extra_repr() const override;
  void check(const std::string& path) const override;  // weight [count, dim]
  c10::optional<Features> output_features() const override { return Features{options.dim}; }
  const Tensor& weight() const { return param("weight"); }  // [count, dim]
  EmbeddingOptions options;
};

struct LayerNormOptions {
  explicit LayerNormOptions(int64_t dim) : dim(dim) {}
  int64_t dim;                 ///< size of the normalized last dimension
  double eps = 1e-5;           ///< added to the variance
  bool affine = true;          ///< learn weight and bias
};

/// Normalizes the last dimension: (..., dim) -> (..., dim).
class LayerNorm : public Unary {
 public:
  explicit LayerNorm(const LayerNormOptions& options);
  /// weight 1, bias 0
  void reset_tensor(const std::string& name, Tensor& t, at::Generator& gen) const override;
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  void check(const std::string& path) const override;  // weight and bias [dim] when affine
  c10::optional<Features> input_features() const override { return Features{options.dim}; }
  c10::optional<Features> output_features() const override { return Features{options.dim}; }
  c10::optional<bool> sequence_split() const override { return false; }
  const Tensor& weight() const { return param("weight"); }  // [dim] or undefined
  const Tensor& bias() const { return param("bias"); }      // [dim] or undefined
  LayerNormOptions options;
};

struct RMSNormOptions {
  explicit RMSNormOptions(int64_t dim) : dim(dim) {}
  int64_t dim;            ///< size of the normalized last dimension
  double eps = 1e-6;      ///< added to the mean square (LLaMA's rms_norm_eps)
  bool affine = true;     ///< learn a weight (no bias: RMSNorm has none)
};

/// Root-mean-square norm of the last dimension (LLaMA's; nn::rms_norm): (..., dim) -> (..., dim).
class RMSNorm : public Unary {
 public:
  explicit RMSNorm(const RMSNormOptions& options);
  /// weight 1
  void reset_tensor(const std::string& name, Tensor& t, at::Generator& gen) const override;
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  void check(const std::string& path) const override;  // weight [dim] when affine
  c10::optional<Features> input_features() const override { return Features{options.dim}; }
  c10::optional<Features> output_features() const override { return Features{options.dim}; }
  c10::optional<bool> sequence_split() const override { return false; }
  const Tensor& weight() const { return param("weight"); }  // [dim] or undefined
  RMSNormOptions options;
};

/// Returns its input (a placeholder where a layer is switched off).
class Identity : public Unary {
 public:
  Identity() : Unary("Identity") {}
  Tensor forward(const Tensor& x) override { return x; }
  bool elementwise() const override { return true; }
};

/// Holds children without running them: ModuleList's are "0", "1", ... in order, ModuleDict's
/// named by the user. A forward that uses them is the parent's; calling one directly is an error.
class ModuleContainer : public Module {
 public:
  explicit ModuleContainer(std::string type) : Module(std::move(type)) {}
  void append(ModulePtr layer);  ///< the next free index as its name
  size_t size() const { return children_named().size(); }
  Tensor forward(const std::vector<Tensor>& inputs) override;
};

/// Zeroes elements with probability p in training mode and rescales the rest; identity in eval.
class Dropout : public Unary {
 public:
  explicit Dropout(double p);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override { return "p=" + std::to_string(p); }
  bool elementwise() const override { return true; }
  double p;
};

/// Children "0", "1", ... applied in order.
class Sequential : public Module {
 public:
  explicit Sequential(std::vector<ModulePtr> layers = {});
  void append(ModulePtr layer);
  size_t size() const { return children_named().size(); }
  Tensor forward(const std::vector<Tensor>& inputs) override;
  /// Each layer takes the features the one before gives (check_chain).
  void check(const std::string& path) const override;
  c10::optional<Features> input_features() const override;   // the first layer's
  c10::optional<Features> output_features() const override;  // the last layer's
  /// Where its ends say their widths (Linear layers, not an Embedding or a forward replaced in
  /// the chain): inputs (batch, ..., in) of floating point numbers; cross_entropy's targets class
  /// ids below the last layer's width (or ignore_index), one for each input row; mse's targets the
  /// output's shape.
  bool check_batch(const Tensor& x, const Tensor& y, const std::string& loss, int64_t ignore_index) override;
};

/// A parameter-free elementwise module (ReLU, GELU, Tanh, Sigmoid, SiLU, Softmax, LogSoftmax).
class Activation : public Unary {
 public:
  Activation(std::string type, std::function<Tensor(const Tensor&)> fn);
  Tensor forward(const Tensor& x) override { return fn_(x); }
  /// ReLU, GELU, Tanh, Sigmoid, SiLU act on each feature alone; Softmax and LogSoftmax need them whole.
  bool elementwise() const override { return type() != "Softmax" && type() != "LogSoftmax"; }
  c10::optional<Features> input_features() const override {
    if (elementwise()) return c10::nullopt;
    return Features{};
  }

 private:
  std::function<Tensor(const Tensor&)> fn_;
};

/// Makes an activation module by name: "ReLU", "GELU", "GELUTanh", "Tanh", "Sigmoid", "SiLU",
/// "Softmax", "LogSoftmax" (the last two over dimension `dim`). Unknown names are an error.
ModulePtr make_activation(const std::string& name, int64_t dim = -1);

/// Cross-entropy of logits (N, C) or (..., C) against class ids (N) or (...): reduction "mean"
/// (over the counted targets) or "sum". Targets equal to `ignore_index` do not count. bfloat16
/// and float16 logits are computed in float32 (the loss comes back float32). A class id outside
/// 0..C-1 is refused naming it (`check_ids`: one read of the targets' extremes; a caller that
/// checked the batch already passes false).
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100,
                     const std::string& reduction = "mean", bool check_ids = true);
/// Squared error, reduction "mean" (over the elements) or "sum" (in float32 for bfloat16 and
/// float16 inputs).
Tensor mse(const Tensor& prediction, const Tensor& target, const std::string& reduction = "mean");

}  // namespace partrain::nn
