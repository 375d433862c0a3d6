// Built-in model families (see models.hpp).
#include "engine/models/models.hpp"

#include "engine/models/registry.hpp"
#include "engine/nn/init.hpp"
#include "engine/util/step_events.hpp"

namespace partrain::models {

namespace {
// A Sequential that reports its type as "MLP", so policies can target it.
class Mlp : public nn::Sequential {
 public:
  Mlp() { rename("MLP"); }
  // The activation changes the function and no shape; sizes, bias and whether there is a
  // dropout are pinned by the parameters' shapes and names, and its probability may change
  // when a run resumes.
  std::vector<nn::ConfigField> config() const override {
    for (const auto& [name, child] : children_named())
      if (dynamic_cast<const nn::Activation*>(child.get())) return {{"activation", 0, true, child->type()}};
    return {};  // two sizes: one Linear, no activation
  }
};
}  // namespace

nn::ModulePtr mlp(const MlpOptions& o) {
  TORCH_CHECK(o.sizes.size() >= 2, "mlp needs at least two sizes (input and output), got ",
              o.sizes.size());
  // NaN or a negative probability had built no Dropout at all, without a word.
  TORCH_CHECK(o.dropout >= 0 && o.dropout < 1, "mlp: dropout must be in [0, 1), got ", o.dropout);
  return nn::build_initialized([&] {  // each weight by its name, as a deferred build has it
    auto model = std::make_shared<Mlp>();
    for (size_t i = 0; i + 1 < o.sizes.size(); ++i) {
      nn::LinearOptions linear(o.sizes[i], o.sizes[i + 1]);
      linear.bias = o.bias;
      model->append(std::make_shared<nn::Linear>(linear));
      if (i + 2 < o.sizes.size()) {
        model->append(nn::make_activation(o.activation));
        if (o.dropout > 0) model->append(std::make_shared<nn::Dropout>(o.dropout));
      }
    }
    return nn::ModulePtr(model);
  }, o.dtype);
}

Family mlp_family() {
  Family f;
  f.name = "mlp";
  f.type = "MLP";
  f.default_policy = "policies.mlp";
  f.build = [](OptionReader& r) {
    MlpOptions o;
    o.sizes = r.integers("sizes", {});
    o.activation = r.string("activation", o.activation);
    o.dropout = r.number("dropout", o.dropout);
    o.bias = r.boolean("bias", o.bias);
    o.dtype = nn::model_dtype(r.string("dtype", "float32"));
    return mlp(o);
  };
  return f;  // no Hugging Face layout
}

torch::Tensor classification_loss(nn::Module& model, optim::Optimizer& optimizer, const torch::Tensor& inputs,
                                  const torch::Tensor& targets) {
  events::forward_begins();
  auto loss = nn::cross_entropy(model.forward({inputs}), targets);
  events::forward_ends();
  optimizer.zero_grad();
  loss.backward();
  return loss;
}

double classification_step(nn::Module& model, optim::Optimizer& optimizer, const torch::Tensor& inputs,
                           const torch::Tensor& targets) {
  auto loss = classification_loss(model, optimizer, inputs, targets);
  optimizer.step();
  return loss.item<double>();
}

}  // namespace partrain::models
