// Optimizers and learning-rate schedules in Lua: thin userdata over the engine's optimizer; the
// per-step work (schedule, clipping, the update) stays in C++.
#include <cstring>

#include <algorithm>
#include <unordered_map>

#include "bindings/lua.hpp"
#include "engine/models/models.hpp"
#include "engine/optim/optim.hpp"
#include "engine/parallel/data_parallel.hpp"
#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/parallel/zero.hpp"
#include "engine/plan/plan.hpp"
#include "engine/util/text.hpp"

namespace partrain::lua {

using OptimizerPtr = std::shared_ptr<optim::Optimizer>;

namespace {

// loss_scale = <number> | "dynamic", loss_scale_options = { init_scale, scale_factor, scale_window,
// min_scale, delayed_shift, consecutive_hysteresis } (smp's DistributedOptimizer's names).
optim::LossScaleOptions read_loss_scale(Args& a, Options& t, const std::string& kind) {
  optim::LossScaleOptions o;
  if (t.push("loss_scale")) {
    int type = lua_type(a.L, -1);
    if (type == LUA_TNUMBER) {
      o.kind = "static";
      o.scale = lua_tonumber(a.L, -1);
    } else if (type == LUA_TSTRING && std::string(lua_tostring(a.L, -1)) == "dynamic") {
      o.kind = "dynamic";
    } else {
      std::string got = type == LUA_TSTRING ? "'" + std::string(lua_tostring(a.L, -1)) + "'" : luaL_typename(a.L, -1);
      lua_pop(a.L, 1);
      throw std::invalid_argument("option 'loss_scale' for " + kind + " must be a number (a static scale) or "
                                  "\"dynamic\", got " + got);
    }
    lua_pop(a.L, 1);
  }
  if (t.has("loss_scale_options")) {
    if (o.kind != "dynamic")
      throw std::invalid_argument("option 'loss_scale_options' for " + kind + " configures a dynamic scale: it needs "
                                  "loss_scale = \"dynamic\"");
    Options d = t.table("loss_scale_options");
    o.init_scale = d.number("init_scale", o.init_scale);
    o.scale_factor = d.number("scale_factor", o.scale_factor);
    o.scale_window = d.integer("scale_window", o.scale_window);
    o.min_scale = d.number("min_scale", o.min_scale);
    o.delayed_shift = d.integer("delayed_shift", o.delayed_shift);
    o.consecutive_hysteresis = d.boolean("consecutive_hysteresis", o.consecutive_hysteresis);
    d.finish();
  }
  try {
    optim::validate(o);
  } catch (const std::exception& e) {
    throw std::invalid_argument(kind + ": " + util::message_of(e));
  }
  return o;
}

optim::ScheduleOptions read_schedule(Options& t) {
  optim::ScheduleOptions s;
  s.kind = t.string("kind", s.kind);
  s.warmup = t.integer("warmup", s.warmup);
  s.total = t.integer("total", s.total);
  s.min_lr = t.number("min_lr", s.min_lr);
  t.finish();
  return s;
}

// pt.optim.<kind>(module or params, { lr = ..., ... })
// The optimizers made for each model, for the REPL's mem(). Keyed by address, with the model
// held weakly beside them: a freed model's address reused by another must not inherit them.
struct ModelOptimizers {
  std::weak_ptr<nn::Module> model;
  std::vector<std::weak_ptr<optim::Optimizer>> optimizers;
};
std::unordered_map<const nn::Module*, ModelOptimizers>& optimizers_of() {
  static std::unordered_map<const nn::Module*, ModelOptimizers> registry;
  return registry;
}

// Every optimizer made from Lua, held weakly: pt.parallelize refuses a model whose parameters
// one that is still alive steps (it would go on stepping the tensors the model had then).
std::vector<std::weak_ptr<optim::Optimizer>>& all_optimizers() {
  static std::vector<std::weak_ptr<optim::Optimizer>> all;
  return all;
}

// The parameters pt.optim.<kind> steps: the module's trainable ones (a frozen one,
// requires_grad = false, is left out, as data parallelism and ZeRO leave it out), or the table's,
// each of which must be trainable. `model`: the module given, else null.
std::vector<torch::Tensor> optimizer_params(Args& a, const std::string& what, nn::ModulePtr& model) {
  std::vector<torch::Tensor> params;
  if (auto* m = ud_test<nn::ModulePtr>(a.L, 1, PT_MODULE_MT)) {
    model = *m;
    for (const auto& p : nn::unique_parameters(*model))
      if (p.requires_grad()) params.push_back(p);
    if (params.empty())
      throw std::invalid_argument(what + ": the " + model->type() + " has no trainable parameters (every one has "
                                  "requires_grad = false)");
  } else if (a.is_table(1)) {
    params = a.tensors(1, /*values=*/false);  // its shapes: a ZeRO-3 parameter has no values now
    for (size_t i = 0; i < params.size(); ++i)
      if (params[i].defined() && (!params[i].requires_grad() || !params[i].is_leaf()))
        throw std::invalid_argument(what + ": parameter #" + std::to_string(i + 1) + " of the table " +
                                    (params[i].is_leaf() ? "is frozen (requires_grad = false)" : "is not a leaf tensor "
                                    "(computed from others)") + ": an optimizer steps trainable leaf tensors only");
  } else {
    a.expected(1, "module or table of parameters");
  }
  return params;
}

// pt.optim.<kind>'s options table (argument 2).
optim::OptimizerOptions read_optimizer_options(Args& a, const std::string& kind) {
  optim::OptimizerOptions o;
  o.kind = kind;
  if (kind == "adamw") o.weight_decay = 0.01;  // PyTorch's AdamW default
  Options t(a, 2, kind);
  o.lr = t.number("lr", kind == "sgd" ? 0.01 : 1e-3);
  o.weight_decay = t.number("weight_decay", o.weight_decay);
  o.clip_grad_norm = t.number("clip_grad_norm", 0.0);
  if (kind == "sgd") {
    o.momentum = t.number("momentum", o.momentum);
    o.dampening = t.number("dampening", o.dampening);
    o.nesterov = t.boolean("nesterov", o.nesterov);
  } else {
    auto betas = t.numbers("betas", {o.beta1, o.beta2});
    if (betas.size() != 2) throw std::invalid_argument("option 'betas' for " + kind + " must hold two numbers");
    o.beta1 = betas[0];
    o.beta2 = betas[1];
    o.eps = t.number("eps", o.eps);
  }
  if (kind == "adamw" && t.push("fused")) {  // fused = true | false | "auto"
    int type = lua_type(a.L, -1);
    bool is_auto = type == LUA_TSTRING && std::string(lua_tostring(a.L, -1)) == "auto";
    std::string got = type == LUA_TSTRING ? "'" + std::string(lua_tostring(a.L, -1)) + "'" : luaL_typename(a.L, -1);
    if (type == LUA_TBOOLEAN) o.fused = lua_toboolean(a.L, -1) ? "on" : "off";
    else if (is_auto) o.fused = "auto";
    lua_pop(a.L, 1);
    if (type != LUA_TBOOLEAN && !is_auto)
      throw std::invalid_argument("option 'fused' for adamw must be true, false or \"auto\", got " + got);
  }
  if (t.has("schedule")) {
    Options s = t.table("schedule");
    o.schedule = read_schedule(s);
  }
  o.loss_scale = read_loss_scale(a, t, kind);
  t.finish();
  return o;
}

// Records `opt` as one of `model`'s (the REPL's mem()) and of all made from Lua.
void register_optimizer(const std::shared_ptr<optim::Optimizer>& opt, const nn::ModulePtr& model) {
  if (model) {
    auto& entry = optimizers_of()[model.get()];
    if (entry.model.lock() != model) entry = ModelOptimizers{model, {}};
    auto& mine = entry.optimizers;
    mine.erase(std::remove_if(mine.begin(), mine.end(), [](const auto& w) { return w.expired(); }), mine.end());
    mine.push_back(opt);
  }
  auto& all = all_optimizers();
  all.erase(std::remove_if(all.begin(), all.end(), [](const auto& w) { return w.expired(); }), all.end());
  all.push_back(opt);
}

int make_optimizer(Args& a, const std::string& kind) {
  const std::string what = "pt.optim." + kind;
  nn::ModulePtr model;  // the module given, or the parallelized model the table's parameters are of
  auto params = optimizer_params(a, what, model);
  const auto o = read_optimizer_options(a, kind);
  // A table of a parallelized model's parameters (param groups, a subset) is wired to the model
  // as an optimizer made from the model is: clipping's norm over its groups and stages, loss
  // scaling in its train_step, its masters. Without that the table's optimizer clipped by each
  // rank's own norm and stepped loss-scaled gradients unscaled, exit 0.
  // A module of a parallelized model (not its root) counts as a table of its parameters.
  const bool whole = model && parallel::ParallelModel::of(*model);
  auto pm = whole   ? parallel::ParallelModel::of(*model)
            : model ? model->parallel_tree()
                    : parallel::ParallelModel::owner(params, what);
  if (pm && !whole) {
    if (pm->zero_stage() > 0) {  // a plain optimizer over a ZeRO model's parameters would miss its shards
      std::string name;
      parallel::ParallelModel::owner(params.front(), &name);
      throw std::invalid_argument(what + ": parameter '" + name + "' belongs to a model parallelized with ZeRO-" +
                                  std::to_string(pm->zero_stage()) + ", whose optimizer must be made from the model "
                                  "itself (" + what + "(model, ...)): it keeps this rank's shard of the gradients, "
                                  "master weights and state");
    }
    model = pm->root();
  }
  // The parallelized model makes and wires its optimizer (engine/parallel/optimizer.cpp): ZeRO's
  // or a plain one, masters, loss scaling, clipping's norm, the step's sync check. Optimizers the
  // script dropped are collected first, so that they do not count as the model's.
  std::shared_ptr<optim::Optimizer> opt;
  if (pm) {
    if (!pm->optimizers().empty()) lua_gc(a.L, LUA_GCCOLLECT, 0);
    try {
      opt = pm->make_optimizer(o, whole ? c10::nullopt : c10::make_optional(params));
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(what + ": " + e.what());
    }
  } else {
    opt = std::make_shared<optim::Optimizer>(params, o);
    if (model) parallel::use_split_norm(*opt, *model);  // a tree of parallel layers no model owns
  }
  register_optimizer(opt, model);
  ud_push(a.L, opt, PT_OPTIMIZER_MT);
  return 1;
}

// The first optimizer step calls partrain.plan's at_first_step(opt) before it updates anything:
// the planner records the rank there and stops the script; a run given a plan checks it there.
bool first_step_pending() {
  static bool pending = plan::planning() || std::getenv("PARTRAIN_PLAN") != nullptr;
  return pending && !plan::first_step().hooked;
}

// Both calls are protected: an error raised in them (the planner's stop, a failed plan check, a
// replaced hook that raises) comes back as a Rethrow, which dispatch raises unchanged once the
// C++ frames are left, never a longjmp across them.
void at_first_step(lua_State* L, int opt) {
  if (!first_step_pending()) return;
  plan::first_step_hooked();
  std::string error;
  lua_getglobal(L, "require");
  lua_pushstring(L, "partrain.plan");
  if (!pcall(L, 1, 1, &error)) throw Rethrow(error);
  lua_getfield(L, -1, "at_first_step");
  lua_remove(L, -2);
  lua_pushvalue(L, opt);
  if (!pcall(L, 1, 0, &error)) throw Rethrow(error);
}

OptimizerPtr& optimizer(const Args& a, int i) {
  auto* o = ud_test<OptimizerPtr>(a.L, i, PT_OPTIMIZER_MT);
  if (!o) a.expected(i, "optimizer");
  return *o;
}

const Function kOptimizerMethods[] = {
    {"step", [](Args& a) {  // the norm before clipping (nil without clipping); nil, "skipped" for a skipped step
       at_first_step(a.L, 1);
       auto& opt = optimizer(a, 1);
       double norm = opt->step();
       if (opt->last_step_skipped()) { lua_pushnil(a.L); lua_pushstring(a.L, "skipped"); return 2; }
       if (norm < 0) { lua_pushnil(a.L); return 1; }
       return a.ret(norm); }},
    {"scale_loss", [](Args& a) {  // loss x the loss scale (the loss itself without loss scaling)
       auto& opt = optimizer(a, 1);
       const auto& loss = a.tensor(2);
       return a.ret(opt->loss_scaler() ? opt->loss_scaler()->scale_loss(loss) : loss); }},
    {"loss_scale", [](Args& a) {  // the scale the next backward uses; nil without loss scaling
       auto& opt = optimizer(a, 1);
       if (!opt->loss_scaler()) { lua_pushnil(a.L); return 1; }
       return a.ret(opt->loss_scaler()->scale()); }},
    {"skipped_steps", [](Args& a) {
       auto& opt = optimizer(a, 1);
       return a.ret(double(opt->loss_scaler() ? opt->loss_scaler()->skipped() : 0)); }},
    {"master_bytes", [](Args& a) { return a.ret(double(optimizer(a, 1)->master_bytes())); }},
    {"master", [](Args& a) {  // the float32 master of a parameter, or nil
       auto m = optimizer(a, 1)->master(a.tensor(2));
       if (!m.defined()) { lua_pushnil(a.L); return 1; }
       return a.ret(m); }},
    {"zero_grad", [](Args& a) { optimizer(a, 1)->zero_grad(); return a.ret(); }},
    // opt:classification_step(model, inputs, targets): forward, cross-entropy, backward and the
    // update in one C++ call; returns the loss.
    {"classification_step", [](Args& a) {
       auto& opt = *optimizer(a, 1);
       auto& model = *a.module(2);
       if (first_step_pending()) {  // the first: forward and backward here, then the hook, then the update
         auto loss = models::classification_loss(model, opt, a.tensor(3), a.tensor(4));
         at_first_step(a.L, 1);
         opt.step();
         return a.ret(loss.item<double>());
       }
       return a.ret(models::classification_step(model, opt, a.tensor(3), a.tensor(4))); }},
    {"lr", [](Args& a) { return a.ret(optimizer(a, 1)->lr()); }},
    {"set_lr", [](Args& a) { optimizer(a, 1)->set_lr(a.number(2)); return a.ret(); }},
    {"steps", [](Args& a) { return a.ret(double(optimizer(a, 1)->steps_taken())); }},
    {"kind", [](Args& a) { return a.ret(optimizer(a, 1)->options().kind); }},
    // fused(): whether steps run LibTorch's fused AdamW kernel (fused = true, or "auto" where it is)
    {"fused", [](Args& a) { return a.ret(optimizer(a, 1)->fused()); }},
    {"state_bytes", [](Args& a) { return a.ret(double(optimizer(a, 1)->state_bytes())); }},
    // opt:sync_shard_grad(): when the buckets are reduce-scattered (ZeRO-2; ZeRO-1 unless
    // reduce_scatter = false), every .grad made whole (the reduced parts gathered over the zero
    // group) before it is read; a no-op otherwise.
    {"sync_shard_grad", [](Args& a) { parallel::sync_shard_grad(*optimizer(a, 1)); return a.ret(); }},
    // opt:zero(): nil without ZeRO, else { stage, group, master_bytes, state_bytes,
    // shard_grad_bytes, grad_buffer_bytes, scratch_bytes, gathers, gather_buffer_bytes,
    // gathers_in_flight, pieces } of this rank (under ZeRO-2 the shard is part of
    // grad_buffer_bytes, scratch_bytes the scratch pool's part; gathers: the all-gathers of
    // updated parameters a step makes, gather_buffer_bytes the buffer they use; gathers_in_flight:
    // overlap_sync_param's all-gathers not yet waited for; pieces: the tensors the update steps:
    // the masters cut at parameters' ends, and at 128 Ki elements on the CPU). ZeRO-3 adds
    // param_shard_bytes (the parameters' shards), shared_master_bytes (of master_bytes, those
    // that are the shards themselves: float32 parameters), gathered_bytes (units gathered now),
    // peak_gathered_bytes (the most at once so far), largest_unit_bytes and root_unit_bytes (a
    // unit's gathered bytes); 0 below stage 3.
    {"zero", [](Args& a) {
       auto z = parallel::zero_bytes(*optimizer(a, 1));
       if (!z) { lua_pushnil(a.L); return 1; }
       lua_createtable(a.L, 0, 17);
       auto set = [&](const char* k, double v) { lua_pushnumber(a.L, v); lua_setfield(a.L, -2, k); };
       set("stage", z->stage); set("group", z->group); set("master_bytes", double(z->master));
       set("state_bytes", double(z->state)); set("shard_grad_bytes", double(z->shard_grad));
       set("grad_buffer_bytes", double(z->grad_buffer)); set("scratch_bytes", double(z->scratch));
       set("gathers_in_flight", z->gathers_in_flight); set("pieces", z->pieces);
       set("gathers", z->gathers); set("gather_buffer_bytes", double(z->gather_buffer));
       set("param_shard_bytes", double(z->param_shard)); set("shared_master_bytes", double(z->shared_master));
       set("gathered_bytes", double(z->gathered)); set("peak_gathered_bytes", double(z->peak_gathered));
       set("largest_unit_bytes", double(z->largest_unit)); set("root_unit_bytes", double(z->root_unit));
       return 1; }},
    {"__tostring", [](Args& a) {
       auto& o = optimizer(a, 1);
       return a.ret(o->options().kind + "(lr=" + std::to_string(o->lr()) + ", " +
                    std::to_string(o->params().size()) + " parameters, step " +
                    std::to_string(o->steps_taken()) + ")"); }},
    {nullptr, nullptr}};

}  // namespace

std::string held_by_optimizer(lua_State* L, const torch::OrderedDict<std::string, torch::Tensor>& named) {
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  for (const auto& item : named) names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  auto find = [&]() -> std::string {
    for (const auto& w : all_optimizers())
      if (auto o = w.lock())
        for (const auto& p : o->params())
          if (auto it = names.find(p.unsafeGetTensorImpl()); it != names.end()) return it->second;
    return "";
  };
  auto name = find();
  if (name.empty()) return name;
  lua_gc(L, LUA_GCCOLLECT, 0);  // one the script dropped and Lua has not collected yet
  return find();
}

nn::ModulePtr model_of_optimizer(const optim::Optimizer* opt) {
  for (const auto& [key, entry] : optimizers_of())
    for (const auto& w : entry.optimizers)
      if (w.lock().get() == opt)
        if (auto m = entry.model.lock()) return m;
  return nullptr;
}

namespace {

const Function kOptim[] = {
    {"model_of", [](Args& a) {  // model_of(opt): the model it was made for, or nil
       if (auto m = model_of_optimizer(optimizer(a, 1).get())) push_module(a.L, m);
       else lua_pushnil(a.L);
       return 1; }},
    {"holding", [](Args& a) {  // holding(model): the name of a parameter a live optimizer steps, or nil
       auto name = held_by_optimizer(a.L, a.module(1)->named_parameters(/*recurse=*/true));
       if (name.empty()) lua_pushnil(a.L);
       else lua_pushstring(a.L, name.c_str());
       return 1; }},
    {"of", [](Args& a) {  // of(model): the optimizers made for it that are still alive
       auto& all = optimizers_of();
       auto it = all.find(a.module(1).get());
       lua_newtable(a.L);
       int n = 0;
       if (it != all.end() && it->second.model.lock() == a.module(1))
         for (const auto& w : it->second.optimizers)
           if (auto o = w.lock()) { ud_push(a.L, o, PT_OPTIMIZER_MT); lua_rawseti(a.L, -2, ++n); }
       return 1; }},
    {"sgd", [](Args& a) { return make_optimizer(a, "sgd"); }},
    {"adam", [](Args& a) { return make_optimizer(a, "adam"); }},
    {"adamw", [](Args& a) { return make_optimizer(a, "adamw"); }},
    {"scheduled_lr", [](Args& a) {  // scheduled_lr(schedule, lr, step)
       Options t(a, 1, "schedule");
       auto s = read_schedule(t);
       optim::validate(s);
       return a.ret(optim::scheduled_lr(s, a.number(2), a.integer(3))); }},
    {nullptr, nullptr}};

}  // namespace

void open_optim(lua_State* L, int core) {
  new_metatable<OptimizerPtr>(L, PT_OPTIMIZER_MT, kOptimizerMethods, /*keep=*/false);
  set_library(L, core, "optim", kOptim);
}

}  // namespace partrain::lua
