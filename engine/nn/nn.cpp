// The model tree and the serial layers (see module.hpp and layers.hpp).
#include <algorithm>
#include <cmath>
#include <sstream>
#include <unordered_set>

#include "engine/nn/functional.hpp"
#include "engine/nn/layers.hpp"
#include "engine/util/text.hpp"

namespace partrain::nn {

namespace F = torch::nn::functional;

// ---- Module ---------------------------------------------------------------------------------

Module::Module(std::string type) : torch::nn::Module(type), type_(std::move(type)) {}

Tensor Module::forward(const std::vector<Tensor>& inputs) {
  if (Tensor out; run_replacement(inputs, out)) return out;
  TORCH_CHECK(false, "module of type ", type_, " has no forward");
}

bool Module::run_replacement(const std::vector<Tensor>& inputs, Tensor& out) {
  if (!replaced_ || bypass_) return false;
  auto fn = replaced_;  // the replacement may replace itself
  out = fn(*this, inputs);
  return true;
}

Tensor Module::own_forward(const std::vector<Tensor>& inputs) {
  struct Bypass {
    bool& flag;
    bool before;
    ~Bypass() { flag = before; }
  } bypass{bypass_, bypass_};
  bypass_ = true;
  return forward(inputs);
}

c10::optional<double> Module::attribute(const std::string&) const { return c10::nullopt; }

void Module::check(const std::string&) const {}

bool Module::forward_replaced_in_tree() const {
  if (forward_replaced()) return true;
  for (const auto& [name, child] : children_named())
    if (child->forward_replaced_in_tree()) return true;
  return false;
}

std::string Features::describe() const {
  std::ostringstream s;
  if (width < 0) return "features of any width, whole";
  if (parts == 1) {
    s << width << " whole features";
  } else {
    s << width << " features split over tensor=" << parts << " (" << width / parts << " here";
    if (fused > 1) s << ", a slice of each of " << fused << " fused parts";
    s << ")";
  }
  return s.str();
}

void Module::set_attribute(const std::string& name, double) {
  TORCH_CHECK(false, type_, " has no attribute '", name, "'");
}

Module::Slots Module::save_slots() const {
  Slots s;
  s.children = children_named();
  for (const auto& p : parameters_) s.parameters.emplace_back(p.key(), p.value());
  for (const auto& b : named_buffers(/*recurse=*/false)) s.buffers.emplace_back(b.key(), b.value());
  for (const auto& name : attribute_names())
    if (auto v = attribute(name)) s.attributes.emplace_back(name, *v);
  s.replaced = replaced_;
  s.training = is_training();
  return s;
}

void Module::restore_slots(const Slots& s) {
  for (const auto& [name, _] : children_named()) unregister_module(name);
  for (const auto& [name, child] : s.children) register_module(name, child);
  child_index_built_ = false;
  parameters_.clear();
  for (const auto& [name, t] : s.parameters) parameters_.insert(name, t);
  for (const auto& [name, value] : s.attributes)
    if (attribute(name) != value) set_attribute(name, value);
  replaced_ = s.replaced;
}

void Module::keep_children(size_t n) {
  auto children = children_named();
  for (size_t i = n; i < children.size(); ++i) unregister_module(children[i].first);
  child_index_built_ = false;
}

void Module::expect_inputs(const std::vector<Tensor>& inputs, size_t n) const {
  TORCH_CHECK(inputs.size() == n, type_, " takes ", n, " input", n == 1 ? "" : "s", ", got ",
              inputs.size());
  for (size_t i = 0; i < n; ++i)
    TORCH_CHECK(inputs[i].defined(), type_, ": input ", i + 1, " is an undefined tensor");
}

std::string Module::repr() const {
  std::ostringstream out;
  out << type_ << "(" << extra_repr();
  auto children = children_named();
  if (!children.empty()) {
    out << "\n";
    for (const auto& [name, child] : children) {
      std::string text = child->repr(), indented;
      for (char c : text) indented += c == '\n' ? std::string("\n  ") : std::string(1, c);
      out << "  (" << name << "): " << indented << "\n";
    }
  }
  out << ")";
  return out.str();
}

std::shared_ptr<Module> Module::child(const std::string& name) const {
  if (!child_index_built_) {
    child_index_.clear();
    for (const auto& item : named_children())
      child_index_.emplace(item.key(), std::dynamic_pointer_cast<Module>(item.value()));
    child_index_built_ = true;
  }
  auto it = child_index_.find(name);
  return it == child_index_.end() ? nullptr : it->second;
}

std::shared_ptr<Module> Module::find(const std::string& path) const {
  if (path.empty())  // this module itself, when it is owned by a shared_ptr
    return std::const_pointer_cast<Module>(
        std::dynamic_pointer_cast<const Module>(weak_from_this().lock()));
  std::stringstream parts(path);
  std::string part;
  std::getline(parts, part, '.');
  std::shared_ptr<Module> node = child(part);
  while (node && std::getline(parts, part, '.')) node = node->child(part);
  return node;
}

std::vector<Tensor> unique_parameters(const torch::nn::Module& module) {
  std::vector<Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : module.parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  return out;
}

std::vector<std::vector<std::string>> tied_parameters(const torch::nn::Module& module) {
  std::map<const c10::TensorImpl*, std::vector<std::string>> names;
  std::vector<const c10::TensorImpl*> order;
  for (const auto& p : module.named_parameters()) {
    auto& list = names[p.value().unsafeGetTensorImpl()];
    if (list.empty()) order.push_back(p.value().unsafeGetTensorImpl());
    list.push_back(p.key());
  }
  std::vector<std::vector<std::string>> out;
  for (auto* impl : order) {
    auto& list = names[impl];
    if (list.size() < 2) continue;
    std::sort(list.begin(), list.end());
    out.push_back(list);
  }
  return out;
}

void check_tree(Module& root) {
  for (const auto& [path, m] : root.modules()) m->check(path.empty() ? root.type() : path);
}

void check_chain(const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& layers, const std::string& owner) {
  c10::optional<Features> given;  // what the previous layer gives
  std::string from, from_type;
  for (const auto& [name, layer] : layers) {
    if (!layer) continue;
    if (layer->elementwise()) continue;
    auto takes = layer->input_features();
    if (given && takes && !given->matches(*takes)) {
      std::ostringstream msg;
      msg << owner << ": " << from << " (" << from_type << ") gives " << given->describe() << ", but " << name << " ("
          << layer->type() << ") takes " << takes->describe();
      if (given->parts > 1 && takes->parts == 1) msg << ": split " << name << "'s input too (P.row) or gather " << from
                                                     << "'s output (gather_output = true)";
      else if (given->parts == 1 && takes->parts > 1) msg << ": " << name << " expects its part of a split input "
                                                          << "(split " << from << " with P.column, or set "
                                                          << "input_is_parallel = false)";
      else if (given->fused != takes->fused) msg << ": a fused split (fused = " << given->fused
                                                 << ") keeps parts apart that " << name << " reads as one";
      TORCH_CHECK(false, msg.str());
    }
    given = layer->output_features();
    from = name;
    from_type = layer->type();
  }
}

TreeSnapshot::TreeSnapshot(Module& root, int64_t copy_limit) {
  for (const auto& [path, m] : root.modules()) modules_.emplace_back(m, m->save_slots());
  std::unordered_set<const c10::TensorImpl*> seen;
  int64_t bytes = 0;
  for (const auto& [path, m] : root.modules()) {
    auto add = [&](const std::string& name, const Tensor& t) {
      if (!t.defined() || !seen.insert(t.unsafeGetTensorImpl()).second) return;
      tensors_.push_back({path.empty() ? name : path + "." + name, t, t.variable_data(), Tensor(),
                          static_cast<uint32_t>(t._version()), t.requires_grad()});
      bytes += t.numel() * t.element_size();
    };
    for (const auto& p : m->named_parameters(/*recurse=*/false)) add(p.key(), p.value());
    for (const auto& b : m->named_buffers(/*recurse=*/false)) add(b.key(), b.value());
  }
  if (bytes <= copy_limit) {
    torch::NoGradGuard no_grad;
    for (auto& t : tensors_)
      if (!t.handle.is_meta()) t.copy = t.data.clone();
  }
}

std::vector<std::string> TreeSnapshot::restore() {
  for (auto& [m, slots] : modules_) m->restore_slots(slots);
  for (auto& [m, slots] : modules_) m->train(slots.training);  // pre-order: each overrides its parent's
  std::vector<std::string> lost;
  torch::NoGradGuard no_grad;
  for (auto& t : tensors_) {
    // Data swapped under the same tensor object (set_data): point it back at the old data.
    bool moved = t.handle.storage().unsafeGetStorageImpl() != t.data.storage().unsafeGetStorageImpl() ||
                 !t.handle.sizes().equals(t.data.sizes()) || !t.handle.strides().equals(t.data.strides()) ||
                 t.handle.storage_offset() != t.data.storage_offset() || t.handle.dtype() != t.data.dtype();
    if (moved) t.handle.set_data(t.data);
    if (static_cast<uint32_t>(t.handle._version()) != t.version) {
      if (t.copy.defined()) t.handle.detach().copy_(t.copy);
      else lost.push_back(t.name);
    }
    if (t.handle.requires_grad() != t.requires_grad) t.handle.requires_grad_(t.requires_grad);
  }
  return lost;
}

void Module::set_child(const std::string& name, std::shared_ptr<Module> module) {
  TORCH_CHECK(module, "cannot set child '", name, "' of ", type_, " to nothing");
  for (const auto& item : module->named_modules("", /*include_self=*/true))
    TORCH_CHECK(item.value().get() != this, "cannot put ", module->type(), " under ", type_, " as '", name,
                "': the tree would contain itself");
  if (child(name))
    replace_module(name, module);
  else
    register_module(name, module);
  child_index_built_ = false;
}

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::modules() {
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> out;
  for (const auto& item : named_modules("", /*include_self=*/true))
    out.emplace_back(item.key(), std::dynamic_pointer_cast<Module>(item.value()));
  return out;
}

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::children_named() const {
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> out;
  for (const auto& item : named_children())
    out.emplace_back(item.key(), std::dynamic_pointer_cast<Module>(item.value()));
  return out;
}

Tensor Module::own_tensor(const std::string& name) const {
  // The parameters straight from their dict (an empty slot is no tensor); buffers only through a
  // copy, kept alive while it is read.
  if (const auto* p = parameters_.find(name); p && p->defined()) return *p;
  auto buffers = named_buffers(/*recurse=*/false);
  if (const auto* b = buffers.find(name)) return *b;
  return {};
}

void Module::set_parameter(const std::string& name, const Tensor& value, bool share) {
  TORCH_CHECK(value.defined(), "parameter '", name, "' of ", type_, " must be a tensor");
  TORCH_CHECK(!named_buffers(false).find(name), type_, " already has a buffer called '", name, "'");
  TORCH_CHECK(value.is_leaf(), "parameter '", name, "' of ", type_, " must be a leaf tensor (one computed from "
              "others would not be trained); detach it first");
  // The caller's tensor is left as it was: the parameter shares its storage.
  Tensor p = value.requires_grad() || share ? value : value.detach().requires_grad_(true);
  if (auto* existing = parameters_.find(name)) *existing = p;
  else register_parameter(name, p, /*requires_grad=*/p.requires_grad());
}

void Module::reset_tensor(const std::string& name, Tensor&, at::Generator&) const {
  TORCH_CHECK(false, type_, " cannot initialize its tensor '", name, "' by itself (a module written in Lua, or one "
              "whose tensors only its model knows): build it normally rather than deferred");
}

Tensor Module::stage_in(const Tensor&) { TORCH_CHECK(false, type_, " has no stage ends of its own"); }
Tensor Module::stage_out(const Tensor&) { TORCH_CHECK(false, type_, " has no stage ends of its own"); }

void Module::replace_tensor(const std::string& name, const Tensor& value) {
  if (auto* p = parameters_.find(name)) {
    *p = value;
    return;
  }
  // LibTorch keeps buffers to itself: their data can be swapped (set_buffer), their objects not,
  // and a meta tensor's data cannot become real data.
  auto buffers = named_buffers(/*recurse=*/false);
  TORCH_CHECK(buffers.find(name), type_, " has no parameter or buffer called '", name, "'");
  TORCH_CHECK(!buffers[name].is_meta(), type_, "'s buffer '", name, "' is on the meta device: a buffer cannot be "
              "materialized (make it with a real tensor, pt.zeros(...), even inside pt.deferred)");
  set_buffer(name, value);
}

void Module::set_buffer(const std::string& name, const Tensor& value) {
  TORCH_CHECK(!parameters_.find(name), type_, " already has a parameter called '", name, "'");
  auto buffers = named_buffers(false);
  if (auto* existing = buffers.find(name)) existing->set_data(value);  // the same tensor object, new data
  else register_buffer(name, value);
}

TensorMap Module::state_dict() const {
  TensorMap out;
  for (const auto& p : named_parameters()) out[p.key()] = p.value();
  for (const auto& b : named_buffers()) out[b.key()] = b.value();
  return out;
}

void Module::load_state_dict(const TensorMap& state, bool strict) {
  TensorMap own = state_dict();
  std::vector<std::string> problems;
  std::vector<std::pair<Tensor, Tensor>> copies;  // all or nothing: copied once everything checks
  torch::NoGradGuard no_grad;
  for (auto& [name, target] : own) {
    auto it = state.find(name);
    if (it == state.end()) {
      if (strict) problems.push_back("missing '" + name + "'");
      continue;
    }
    if (!it->second.sizes().equals(target.sizes())) {
      std::ostringstream msg;
      msg << "'" << name << "' has shape " << it->second.sizes() << " but the model expects "
          << target.sizes();
      problems.push_back(msg.str());
      continue;
    }
    copies.emplace_back(target, it->second);
  }
  if (strict)
    for (const auto& [name, _] : state)
      if (!own.count(name)) problems.push_back("unexpected '" + name + "'");
  if (!problems.empty()) {
    std::ostringstream msg;
    msg << "load_state_dict into " << type_ << " (nothing was loaded): ";
    for (size_t i = 0; i < problems.size(); ++i) msg << (i ? "; " : "") << problems[i];
    TORCH_CHECK(false, msg.str());
  }
  for (auto& [target, value] : copies) target.copy_(value);
}

// ---- Layers ---------------------------------------------------------------------------------

namespace {
torch::TensorOptions& parameter_options_storage() {
  static torch::TensorOptions options;
  return options;
}
}  // namespace

const torch::TensorOptions& parameter_options() { return parameter_options_storage(); }
void set_parameter_options(const torch::TensorOptions& options) { parameter_options_storage() = options; }


Linear::Linear(const LinearOptions& o) : Unary("Linear"), options(o) {
  TORCH_CHECK(o.in > 0 && o.out > 0, "Linear needs positive sizes, got in=", o.in, " out=", o.out);
  auto& w = register_parameter("weight", torch::empty({o.out, o.in}, parameter_options()));
  torch::nn::init::kaiming_uniform_(w, std::sqrt(5.0));  // LibTorch's default
  if (o.bias) {
    double bound = 1.0 / std::sqrt(static_cast<double>(o.in));
    auto& b = register_parameter("bias", torch::empty({o.out}, parameter_options()));
    torch::nn::init::uniform_(b, -bound, bound);
  } else {
    register_parameter("bias", Tensor(), /*requires_grad=*/false);  // an empty slot
  }
}

void Linear::reset_tensor(const std::string& name, Tensor& t, at::Generator& gen) const {
  // kaiming_uniform_(a = sqrt(5)) and the bias's bound are both U(-1/sqrt(in), 1/sqrt(in)).
  TORCH_CHECK(name == "weight" || name == "bias", "Linear has no tensor '", name, "'");
  double bound = 1.0 / std::sqrt(static_cast<double>(options.in));
  t.uniform_(-bound, bound, gen);
}

namespace {
// A deferred model's weights hold no values until materialized; LibTorch's own error is a
// dispatcher dump. Meta inputs (the planner's shapes-only runs) are fine.
void refuse_meta(const Tensor& weight, const Tensor& input, const std::string& layer) {
  TORCH_CHECK(!weight.defined() || !weight.is_meta() || input.is_meta(), layer, "'s weight is on the meta device ",
              "(built inside pt.deferred) and holds no values yet: call model:materialize() first, or let ",
              "pt.parallelize materialize this rank's part");
}
}  // namespace

Tensor Linear::forward(const Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == options.in, "Linear(", options.in, ", ", options.out,
              ") expects input (..., ", options.in, "), got ", x.sizes());
  const auto& w = weight();
  refuse_meta(w, x, "Linear(" + std::to_string(options.in) + ", " + std::to_string(options.out) + ")");
  if (x.scalar_type() != w.scalar_type()) {
    const auto held = util::dtype_name(w.scalar_type()), given = util::dtype_name(x.scalar_type());
    TORCH_CHECK(false, "Linear(", options.in, ", ", options.out, ") holds ", held, " weights; its input is ", given,
                ": convert the input (x:to(\"", held, "\"))",
                x.is_floating_point() ? " or the model (model:to(\"" + given + "\"))" : std::string());
  }
  return F::linear(x, w, bias());
}

namespace {
// "h.0.attn.c_attn: Linear(16, 48) holds a weight of [24, 16], not [48, 16]"
void check_shape(const Module& m, const std::string& path, const char* name, const Tensor& t,
                 std::vector<int64_t> want, const std::string& what) {
  if (!t.defined()) return;
  TORCH_CHECK(t.sizes().equals(want), path, ": ", what, " holds a ", name, " of ", t.sizes(), ", not ",
              c10::IntArrayRef(want), " (", m.type(), ")");
}
}  // namespace

void Linear::check(const std::string& path) const {
  std::string what = "Linear(" + std::to_string(options.in) + ", " + std::to_string(options.out) + ")";
  TORCH_CHECK(weight().defined(), path, ": ", what, " has no weight");
  check_shape(*this, path, "weight", weight(), {options.out, options.in}, what);
  check_shape(*this, path, "bias", bias(), {options.out}, what);
}

std::string Linear::extra_repr() const {
  std::ostringstream s;
  s << "in=" << options.in << ", out=" << options.out << (options.bias ? "" : ", bias=false");
  return s.str();
}

Embedding::Embedding(const EmbeddingOptions& o) : Unary("Embedding"), options(o) {
  TORCH_CHECK(o.count > 0 && o.dim > 0, "Embedding needs positive sizes, got count=", o.count,
              " dim=", o.dim);
  register_parameter("weight", torch::randn({o.count, o.dim}, parameter_options()));
}

void Embedding::reset_tensor(const std::string& name, Tensor& t, at::Generator& gen) const {
  TORCH_CHECK(name == "weight", "Embedding has no tensor '", name, "'");
  t.normal_(0, 1, gen);
}

Tensor Embedding::forward(const Tensor& ids) {
  refuse_meta(weight(), ids, "Embedding(" + std::to_string(options.count) + ", " + std::to_string(options.dim) + ")");
  TORCH_CHECK(!ids.is_floating_point() && ids.scalar_type() != torch::kBool, "Embedding expects integer ids, got ",
              util::dtype_name(ids.scalar_type()));
  // On the CPU, where reading them costs little, ids out of range are named (LibTorch says "index
  // out of range in self"). On a GPU that read would stop the stream at every lookup; the model
  // families and train_step's batch check read them once a step instead.
  if (ids.is_cpu() && ids.numel() > 0) {
    const auto [lo, hi] = extremes(ids);
    TORCH_CHECK(lo >= 0 && hi < options.count, "Embedding(", options.count, ", ", options.dim, "): id ",
                lo < 0 ? lo : hi, " is out of range (ids are 0 to ", options.count - 1, ")");
  }
  return F::embedding(ids, weight());
}

void Embedding::check(const std::string& path) const {
  std::string what = "Embedding(" + std::to_string(options.count) + ", " + std::to_string(options.dim) + ")";
  TORCH_CHECK(weight().defined(), path, ": ", what, " has no weight");
  check_shape(*this, path, "weight", weight(), {options.count, options.dim}, what);
}

std::string Embedding::extra_repr() const {
  return "count=" + std::to_string(options.count) + ", dim=" + std::to_string(options.dim);
}

LayerNorm::LayerNorm(const LayerNormOptions& o) : Unary("LayerNorm"), options(o) {
  TORCH_CHECK(o.dim > 0, "LayerNorm needs a positive dim, got ", o.dim);
  TORCH_CHECK(o.eps >= 0 && std::isfinite(o.eps), "LayerNorm: eps must be a finite number >= 0, got ", o.eps);
  if (o.affine) {
    register_parameter("weight", torch::ones({o.dim}, parameter_options()));
    register_parameter("bias", torch::zeros({o.dim}, parameter_options()));
  } else {
    register_parameter("weight", Tensor(), false);
    register_parameter("bias", Tensor(), false);
  }
}

void LayerNorm::reset_tensor(const std::string& name, Tensor& t, at::Generator&) const {
  TORCH_CHECK(name == "weight" || name == "bias", "LayerNorm has no tensor '", name, "'");
  t.fill_(name == "weight" ? 1.0 : 0.0);
}

Tensor LayerNorm::forward(const Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == options.dim, "LayerNorm(", options.dim,
              ") expects input (..., ", options.dim, "), got ", x.sizes());
  return at::layer_norm(x, {options.dim}, weight(), bias(), options.eps);
}

void LayerNorm::check(const std::string& path) const {
  std::string what = "LayerNorm(" + std::to_string(options.dim) + ")";
  check_shape(*this, path, "weight", weight(), {options.dim}, what);
  check_shape(*this, path, "bias", bias(), {options.dim}, what);
}

std::string LayerNorm::extra_repr() const {
  std::ostringstream s;
  s << "dim=" << options.dim << ", eps=" << options.eps << (options.affine ? "" : ", affine=false");
  return s.str();
}

RMSNorm::RMSNorm(const RMSNormOptions& o) : Unary("RMSNorm"), options(o) {
  TORCH_CHECK(o.dim > 0, "RMSNorm needs a positive dim, got ", o.dim);
  TORCH_CHECK(o.eps >= 0 && std::isfinite(o.eps), "RMSNorm: eps must be a finite number >= 0, got ", o.eps);
  if (o.affine) register_parameter("weight", torch::ones({o.dim}, parameter_options()));
  else register_parameter("weight", Tensor(), false);
}

void RMSNorm::reset_tensor(const std::string& name, Tensor& t, at::Generator&) const {
  TORCH_CHECK(name == "weight", "RMSNorm has no tensor '", name, "'");
  t.fill_(1.0);
}

Tensor RMSNorm::forward(const Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == options.dim, "RMSNorm(", options.dim, ") expects input (..., ",
              options.dim, "), got ", x.sizes());
  return rms_norm(x, weight(), options.eps);
}

void RMSNorm::check(const std::string& path) const {
  check_shape(*this, path, "weight", weight(), {options.dim}, "RMSNorm(" + std::to_string(options.dim) + ")");
}

std::string RMSNorm::extra_repr() const {
  std::ostringstream s;
  s << "dim=" << options.dim << ", eps=" << options.eps << (options.affine ? "" : ", affine=false");
  return s.str();
}

void ModuleContainer::append(ModulePtr layer) {
  size_t index = size();
  while (child(std::to_string(index))) ++index;
  set_child(std::to_string(index), std::move(layer));
}

Tensor ModuleContainer::forward(const std::vector<Tensor>& inputs) {
  if (Tensor out; run_replacement(inputs, out)) return out;
  TORCH_CHECK(false, type(), " holds modules but does not run them: call its children from the parent's forward "
              "(for _, m in ipairs(list:children()) do x = m(x) end)");
}

Dropout::Dropout(double p) : Unary("Dropout"), p(p) {
  TORCH_CHECK(p >= 0 && p < 1, "Dropout probability must be in [0, 1), got ", p);
}

Tensor Dropout::forward(const Tensor& x) { return at::dropout(x, p, is_training()); }

Sequential::Sequential(std::vector<ModulePtr> layers) : Module("Sequential") {
  for (auto& layer : layers) append(std::move(layer));
}

void Sequential::append(ModulePtr layer) {
  size_t index = size();
  while (child(std::to_string(index))) ++index;  // a name taken by add(name, m) is not reused
  set_child(std::to_string(index), std::move(layer));
}

Tensor Sequential::forward(const std::vector<Tensor>& inputs) {
  if (Tensor out; run_replacement(inputs, out)) return out;
  auto layers = children_named();
  TORCH_CHECK(!layers.empty(), "Sequential has no layers to run");
  Tensor x = layers.front().second->forward(inputs);
  for (size_t i = 1; i < layers.size(); ++i) x = layers[i].second->forward(std::vector<Tensor>{x});
  return x;
}

void Sequential::check(const std::string& path) const { check_chain(children_named(), path); }

c10::optional<Features> Sequential::input_features() const {
  for (const auto& [name, layer] : children_named())
    if (!layer->elementwise()) return layer->input_features();
  return c10::nullopt;
}

c10::optional<Features> Sequential::output_features() const {
  auto layers = children_named();
  for (auto it = layers.rbegin(); it != layers.rend(); ++it)
    if (!it->second->elementwise()) return it->second->output_features();
  return c10::nullopt;
}

bool Sequential::check_batch(const Tensor& x, const Tensor& y, const std::string& loss, int64_t ignore_index) {
  // What the first layer's forward and the loss would refuse part-way (on one pipeline stage or
  // one data replica, the others waiting for it), refused before anything runs.
  if (forward_replaced_in_tree()) return false;
  const auto in = input_features(), out = output_features();
  const bool takes = in && in->width > 0 && in->parts == 1;  // the input's width, whole
  if (takes)
    TORCH_CHECK(x.is_floating_point() && x.dim() >= 2 && x.size(-1) == in->width, type(), " takes inputs (batch, ..., ",
                in->width, ") of floating point numbers, got ", x.sizes(), " ", util::dtype_name(x.scalar_type()));
  if (!out || out->width <= 0 || out->parts != 1) return false;  // split outputs: the loss checks its own
  const int64_t width = out->width;
  auto rows = takes ? x.sizes().slice(0, x.dim() - 1).vec() : std::vector<int64_t>{};
  if (loss == "mse") {
    auto want = rows;
    want.push_back(width);
    std::ostringstream shape;
    if (takes) shape << c10::IntArrayRef(want);
    else shape << "(..., " << width << ")";
    TORCH_CHECK(y.is_floating_point() && (takes ? y.sizes().vec() == want : y.dim() >= 1 && y.size(-1) == width),
                "train_step: loss mse compares ", type(), "'s outputs ", shape.str(),
                " with floating targets of that shape, got ", y.sizes(), " ", util::dtype_name(y.scalar_type()));
    return false;
  }
  if (loss != "cross_entropy") return false;  // train_step refuses an unknown loss itself
  TORCH_CHECK(!y.is_floating_point() && !y.is_complex() && y.scalar_type() != torch::kBool,
              "train_step: cross_entropy expects integer class ids as targets, got ", util::dtype_name(y.scalar_type()));
  if (takes)
    TORCH_CHECK(y.sizes().vec() == rows, "train_step: ", type(), " gives ", width, " class scores for each of the ",
                "input's ", c10::IntArrayRef(rows), " rows, so its targets must have that shape, got ", y.sizes());
  const auto outside = class_id_outside(y, width, ignore_index);
  TORCH_CHECK(!outside, "train_step: target ", outside.value_or(0), " is out of range for ", type(), "'s ", width,
              " classes ", class_range(width, ignore_index));
  return true;
}

Activation::Activation(std::string type, std::function<Tensor(const Tensor&)> fn)
    : Unary(std::move(type)), fn_(std::move(fn)) {}

ModulePtr make_activation(const std::string& name, int64_t dim) {
  using Fn = std::function<Tensor(const Tensor&)>;
  Fn fn;
  if (name == "ReLU") fn = [](const Tensor& x) { return at::relu(x); };
  else if (name == "GELU") fn = [](const Tensor& x) { return at::gelu(x); };
  else if (name == "GELUTanh") fn = [](const Tensor& x) { return at::gelu(x, "tanh"); };
  else if (name == "Tanh") fn = [](const Tensor& x) { return at::tanh(x); };
  else if (name == "Sigmoid") fn = [](const Tensor& x) { return at::sigmoid(x); };
  else if (name == "SiLU") fn = [](const Tensor& x) { return at::silu(x); };
  else if (name == "Softmax") fn = [dim](const Tensor& x) { return at::softmax(x, dim); };
  else if (name == "LogSoftmax") fn = [dim](const Tensor& x) { return at::log_softmax(x, dim); };
  else
    TORCH_CHECK(false, "unknown activation '", name,
                "' (expected ReLU, GELU, GELUTanh, Tanh, Sigmoid, SiLU, Softmax or LogSoftmax)");
  return std::make_shared<Activation>(name, fn);
}

// ---- Losses ---------------------------------------------------------------------------------

namespace {
bool is_low_precision(const Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf;
}

// Whether the reduction named is "sum" (else "mean"; any other is refused).
bool summed(const std::string& what, const std::string& reduction) {
  TORCH_CHECK(reduction == "mean" || reduction == "sum", what, ": reduction must be 'mean' or 'sum', got '", reduction,
              "'");
  return reduction == "sum";
}
}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index, const std::string& reduction,
                     bool check_ids) {
  TORCH_CHECK(logits.dim() >= 1 && logits.dim() == targets.dim() + 1,
              "cross_entropy expects logits (..., C) and targets (...), got ", logits.sizes(),
              " and ", targets.sizes());
  TORCH_CHECK(!targets.is_floating_point() && targets.scalar_type() != torch::kBool,
              "cross_entropy expects integer class ids, got ", util::dtype_name(targets.scalar_type()));
  auto flat = logits.reshape({-1, logits.size(-1)});  // (N, C)
  // Any integer ids, as the embedding takes them: LibTorch's kernel reads int64 alone.
  const auto ids = targets.scalar_type() == torch::kLong ? targets : targets.to(torch::kLong);
  if (is_low_precision(flat)) flat = flat.to(torch::kFloat32);  // the softmax and the loss in float32
  const auto outside = check_ids ? class_id_outside(ids, flat.size(1), ignore_index) : c10::nullopt;
  TORCH_CHECK(!outside, "cross_entropy: target ", outside.value_or(0), " is out of range for ", flat.size(1),
              " classes ", class_range(flat.size(1), ignore_index));
  auto options = F::CrossEntropyFuncOptions().ignore_index(ignore_index);
  if (summed("cross_entropy", reduction)) options.reduction(torch::kSum);
  return F::cross_entropy(flat, ids.reshape({-1}), options);
}

Tensor mse(const Tensor& prediction, const Tensor& target, const std::string& reduction) {
  TORCH_CHECK(prediction.sizes().equals(target.sizes()), "mse expects equal shapes, got ",
              prediction.sizes(), " and ", target.sizes());
  auto options = F::MSELossFuncOptions();
  if (summed("mse", reduction)) options.reduction(torch::kSum);
  // A low-precision loss is taken in float32: its sum of squares would round in bfloat16.
  if (is_low_precision(prediction) || is_low_precision(target))
    return F::mse_loss(prediction.to(torch::kFloat32), target.to(torch::kFloat32), options);
  return F::mse_loss(prediction, target, options);
}

}  // namespace partrain::nn
