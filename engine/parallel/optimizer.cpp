// The optimizer of a parallel model, made and wired in one place: ZeRO's or a plain one, masters
// in the records, loss scaling with the mesh agreeing on overflows, clipping by the global norm
// over tensor groups and pipeline stages, and the step's check on data parallelism's sync.
#include <algorithm>
#include <cmath>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>

#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/zero.hpp"

namespace partrain::parallel {

namespace {

std::string number(double x) {
  std::ostringstream s;
  s << x;
  return s.str();
}

// The norm clipping measures for `params` of `model`: split parameters over their tensor group
// (found in the model's tree), then over the pipeline's stages (a tied tensor once).
std::function<double(const std::vector<torch::Tensor>&)> model_norm(const std::shared_ptr<ParallelModel>& model,
                                                                     const std::vector<torch::Tensor>& params) {
  auto groups = split_groups(model->module(), params);
  if (model->pipeline()) {
    std::weak_ptr<Pipeline> pipeline = model->pipeline();
    return [pipeline, groups](const std::vector<torch::Tensor>& ps) {
      auto p = pipeline.lock();
      TORCH_CHECK(p, "clipping: the pipelined model this optimizer was made for is gone");
      return p->grad_norm(ps, groups);
    };
  }
  if (std::none_of(groups.begin(), groups.end(), [](const auto& g) { return g != nullptr; })) return {};
  return [groups](const std::vector<torch::Tensor>& ps) { return global_grad_norm(ps, groups); };
}

}  // namespace

void check_max_norm(double max_norm) {
  // NaN had passed once and clipped nothing.
  if (!(max_norm > 0) || !std::isfinite(max_norm))
    throw std::invalid_argument("max_norm must be a finite number > 0, got " + std::to_string(max_norm));
}

std::vector<std::shared_ptr<optim::Optimizer>> ParallelModel::optimizers() const {
  std::vector<std::shared_ptr<optim::Optimizer>> out;
  for (const auto& w : optimizers_)
    if (auto o = w.lock()) out.push_back(o);
  return out;
}

std::shared_ptr<optim::Optimizer> ParallelModel::make_optimizer(const optim::OptimizerOptions& options,
                                                                c10::optional<std::vector<torch::Tensor>> params) {
  const int zero = zero_stage();
  // One optimizer with loss scaling a model, and no other beside it: train_step scales the loss
  // by one scale, which every optimizer of the model's gradients must undo.
  const bool scaled = options.loss_scale.kind != "none";
  for (const auto& other : optimizers())
    if (scaled || other->loss_scaler())
      throw std::invalid_argument(std::string("the model already has an optimizer, and ") +
                                  (scaled ? "this one" : "that one") + " scales the loss: train_step scales it by one "
                                  "scale, which every optimizer of the model would have to undo; use one optimizer "
                                  "(with param groups as tables of parameters: one optimizer a table is the limit "
                                  "with loss scaling)");
  std::shared_ptr<optim::Optimizer> opt;
  if (zero > 0) {
    // ZeRO's optimizer keeps this rank's shard of every bucket: it is the model's whole.
    if (params)
      throw std::invalid_argument("a model parallelized with ZeRO-" + std::to_string(zero) + " gets one optimizer of "
                                  "all its parameters (its shard of the gradients, masters and state), not one of " +
                                  std::to_string(params->size()) + " of them");
    opt = make_zero_optimizer(shared_from_this(), options);
  } else {
    if (!params) {
      params.emplace();
      for (const auto& p : nn::unique_parameters(*root_))
        if (p.requires_grad()) params->push_back(p);
    }
    if (params->empty())
      throw std::invalid_argument("no trainable parameters to optimize (the " + root_->type() + "'s, or the ones given)");
    opt = std::make_shared<optim::Optimizer>(*params, options);
    for (const auto& p : opt->params())
      if (auto master = opt->master(p); master.defined()) set_master(p, master);
    if (auto norm = model_norm(shared_from_this(), opt->params())) opt->set_grad_norm(std::move(norm));
  }
  if (opt->loss_scaler()) {
    set_loss_scaler(opt->loss_scaler());
    opt->set_overflow_group(mesh_->group("world"));
  }
  if (std::weak_ptr<DataParallel> dp = data_parallel_; !dp.expired())
    opt->add_step_check([dp] {
      auto d = dp.lock();
      if (!d) return;
      TORCH_CHECK(d->synced(), "optimizer step on unsynced gradients: ", d->passes_since_sync(),
                  " backward pass(es) since the last sync, and grad_accumulation=", d->options().grad_accumulation,
                  " syncs on every ", d->options().grad_accumulation, "th: step after the last micro-batch");
      // A hand-written loop's sync (train_step settles its own on the loss's all-reduce): the
      // parameters no data rank gave a gradient are left without one.
      d->settle_unused();
    });
  optimizers_.erase(std::remove_if(optimizers_.begin(), optimizers_.end(), [](const auto& w) { return w.expired(); }),
                    optimizers_.end());
  optimizers_.push_back(opt);
  return opt;
}

double ParallelModel::clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm) {
  return parallel::clip_grad_norm(params, max_norm, root_.get());
}

void use_split_norm(optim::Optimizer& opt, nn::Module& tree) {
  auto groups = split_groups(tree, opt.params());
  if (std::any_of(groups.begin(), groups.end(), [](const auto& g) { return g != nullptr; }))
    opt.set_grad_norm([groups](const std::vector<torch::Tensor>& ps) { return global_grad_norm(ps, groups); });
}

double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm, nn::Module* tree,
                      const std::string& what) {
  check_max_norm(max_norm);
  // Split parameters are found in the tree of the parallel model they belong to (given, or found
  // from the parameters, one index for all of them); the tensors of no model count whole.
  auto model = tree ? ParallelModel::of(*tree) : ParallelModel::owner(params, what);
  // Reduce-scattered gradients (ZeRO-2; ZeRO-1 unless reduce_scatter = false) never reach .grad:
  // scaling .grad would clip nothing the optimizer reads. A module of such a model counts too.
  auto holder = model ? model : tree ? tree->parallel_tree() : nullptr;
  if (holder && holder->zero_stage() > 0 && holder->data_parallel() && holder->data_parallel()->scatters())
    for (const auto& p : params)
      if (std::string name; ParallelModel::owner(p, &name) == holder)  // the refusal names the first
        throw std::invalid_argument("parameter '" + name + "' belongs to a model parallelized with ZeRO-" +
                                    std::to_string(holder->zero_stage()) + ", whose gradients are reduce-scattered "
                                    "and never reach .grad; clip with the optimizer's own option instead: "
                                    "pt.optim.adamw(model, { clip_grad_norm = " + number(max_norm) + " }) "
                                    "(OptimizerOptions::clip_grad_norm in C++)");
  auto norm = model ? model_norm(model, params) : nullptr;
  const double total = norm ? norm(params)
                            : global_grad_norm(params, tree ? split_groups(*tree, params) : std::vector<dist::GroupPtr>{});
  const double scale = max_norm / (total + 1e-6);
  if (scale < 1)
    for (const auto& p : params)
      if (p.grad().defined()) p.mutable_grad().mul_(scale);
  return total;
}

}  // namespace partrain::parallel
