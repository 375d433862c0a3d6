// The meta kernels LibTorch's C++ library lacks, so that planning can run a model on meta tensors.
#include "engine/plan/meta_kernels.hpp"

#include <array>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ExpandUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <torch/torch.h>

namespace partrain::plan {

// ---- Meta kernels --------------------------------------------------------------------------
// Shapes only: what the CPU kernel would return, without computing it. Registered only for the
// operators the running LibTorch has no meta kernel for in C++ (PyTorch registers several of its
// meta kernels from Python, in torch/_meta_registrations.py, which a C++ program never loads).

namespace meta {

using at::Tensor;

Tensor index_select(const Tensor& self, int64_t dim, const Tensor& index) {
  auto sizes = self.sizes().vec();
  if (!sizes.empty()) sizes[c10::maybe_wrap_dim(dim, self.dim())] = index.numel();
  return at::empty(sizes, self.options());
}

Tensor embedding_dense_backward(const Tensor& grad, const Tensor&, int64_t num_weights, int64_t, bool) {
  return at::empty({num_weights, grad.size(-1)}, grad.options());
}

std::tuple<Tensor, Tensor, Tensor> native_layer_norm(const Tensor& input, at::IntArrayRef normalized,
                                                     const c10::optional<Tensor>&, const c10::optional<Tensor>&,
                                                     double) {
  auto stat = input.sizes().vec();
  for (size_t i = stat.size() - normalized.size(); i < stat.size(); ++i) stat[i] = 1;
  bool reduced = input.scalar_type() == at::kHalf || input.scalar_type() == at::kBFloat16;
  auto stat_options = input.options().dtype(reduced ? at::kFloat : input.scalar_type());
  return std::make_tuple(at::empty(input.sizes(), input.options()), at::empty(stat, stat_options),
                         at::empty(stat, stat_options));
}

std::tuple<Tensor, Tensor, Tensor> native_layer_norm_backward(const Tensor&, const Tensor& input, at::IntArrayRef,
                                                              const Tensor&, const Tensor&,
                                                              const c10::optional<Tensor>& weight,
                                                              const c10::optional<Tensor>& bias,
                                                              std::array<bool, 3> mask) {
  Tensor dx, dw, db;
  if (mask[0]) dx = at::empty(input.sizes(), input.options());
  if (mask[1] && weight && weight->defined()) dw = at::empty(weight->sizes(), weight->options());
  if (mask[2] && bias && bias->defined()) db = at::empty(bias->sizes(), bias->options());
  return std::make_tuple(dx, dw, db);
}

Tensor where(const Tensor& condition, const Tensor& self, const Tensor& other) {
  auto shape = at::infer_size(at::infer_size(condition.sizes(), self.sizes()), other.sizes());
  return at::empty(shape, self.options().dtype(at::result_type(self, other)));
}

// log_sigmoid's forward: the result and the CPU kernel's buffer, both of self's shape (context
// attention merges partial softmaxes with it).
std::tuple<Tensor, Tensor> log_sigmoid_forward(const Tensor& self) {
  return std::make_tuple(at::empty_like(self), at::empty_like(self));
}

Tensor log_sigmoid_backward(const Tensor& grad, const Tensor& self, const Tensor&) {
  return at::empty(at::infer_size(grad.sizes(), self.sizes()), self.options());
}

// An elementwise operator's out= form: `out` takes the broadcast shape of the tensor arguments.
void elementwise_out(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  size_t n = op.schema().arguments().size();
  auto args = torch::jit::last(*stack, n);
  at::Tensor out = args[n - 1].toTensor();
  std::vector<int64_t> shape;
  for (size_t i = 0; i + 1 < n; ++i)
    if (args[i].isTensor()) shape = at::infer_size(shape, args[i].toTensor().sizes());
  out.resize_(shape);
  torch::jit::drop(*stack, n);
  stack->push_back(out);
}

// An operator whose one result has the shape and type of its first tensor argument (a
// functional elementwise operator), or is that argument (its in-place form).
void like_first(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  size_t n = op.schema().arguments().size();
  auto args = torch::jit::last(*stack, n);
  at::Tensor first;
  for (const auto& a : args)
    if (a.isTensor()) {
      first = a.toTensor();
      break;
    }
  bool in_place = !op.schema().name().empty() && op.schema().name().back() == '_';
  at::Tensor result = in_place ? first : at::empty_like(first);
  torch::jit::drop(*stack, n);
  stack->push_back(result);
}

void install() {
  static torch::Library library(torch::Library::IMPL, "aten", c10::DispatchKey::Meta, __FILE__, __LINE__);
  static bool done = [] {
    auto missing = [](const char* name, const char* overload) {
      auto op = c10::Dispatcher::singleton().findSchema({name, overload});
      return op && !op->hasKernelForDispatchKey(c10::DispatchKey::Meta);
    };
    if (missing("aten::index_select", "")) library.impl("index_select", TORCH_FN(index_select));
    if (missing("aten::embedding_dense_backward", ""))
      library.impl("embedding_dense_backward", TORCH_FN(embedding_dense_backward));
    if (missing("aten::native_layer_norm", "")) library.impl("native_layer_norm", TORCH_FN(native_layer_norm));
    if (missing("aten::native_layer_norm_backward", ""))
      library.impl("native_layer_norm_backward", TORCH_FN(native_layer_norm_backward));
    if (missing("aten::where", "self")) library.impl("where.self", TORCH_FN(where));
    for (const char* name : {"relu", "relu_", "threshold_backward"})
      if (missing((std::string("aten::") + name).c_str(), ""))
        library.impl(name, torch::CppFunction::makeFromBoxedFunction<&like_first>());
    // where's out= form: scaled_dot_product_attention's math path masks with it on meta tensors.
    if (missing("aten::where", "self_out"))
      library.impl("where.self_out", torch::CppFunction::makeFromBoxedFunction<&elementwise_out>());
    // Context attention's plain blocks: logsumexp takes abs (its out= form) of the row maxima.
    if (missing("aten::abs", "out"))
      library.impl("abs.out", torch::CppFunction::makeFromBoxedFunction<&elementwise_out>());
    if (missing("aten::log_sigmoid_forward", ""))
      library.impl("log_sigmoid_forward", TORCH_FN(log_sigmoid_forward));
    if (missing("aten::log_sigmoid_backward", ""))
      library.impl("log_sigmoid_backward", TORCH_FN(log_sigmoid_backward));
    for (const char* name : {"logical_or", "logical_and", "logical_xor", "logical_not"})
      if (missing((std::string("aten::") + name).c_str(), "out")) {
        std::string overload = std::string(name) + ".out";
        library.impl(overload.c_str(), torch::CppFunction::makeFromBoxedFunction<&elementwise_out>());
      }
    return true;
  }();
  (void)done;
}

}  // namespace meta

}  // namespace partrain::plan
