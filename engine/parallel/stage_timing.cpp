// Timing a model's pipeline units to balance stages by measured time (see stage_timing.hpp).
#include "engine/parallel/stage_timing.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "engine/compat.hpp"
#include "engine/dist/world.hpp"
#include "engine/nn/init.hpp"
#include "engine/parallel/pipeline.hpp"
#include "engine/parallel/probe.hpp"
#include "engine/util/step_events.hpp"

namespace partrain::parallel {

namespace {

using Clock = std::chrono::steady_clock;
using Named = std::vector<std::pair<std::string, nn::ModulePtr>>;

// The meta tensors of a unit's modules given real values (initialized by name, as materialize
// would) for as long as this lives, then the meta tensors put back: ties to modules outside the
// unit come back as they were, and nothing of the unit stays allocated.
class Allocated {
 public:
  Allocated(nn::Module& root, const Named& modules, torch::Device device) {
    const auto plan = nn::init_plan(root);
    for (const auto& [prefix, top] : modules)
      for (const auto& [path, m] : top->modules()) {
        auto visit = [&, &path = path, &m = m](const std::string& local, const torch::Tensor& t, bool parameter) {
          if (!t.defined() || !t.is_meta()) return;
          auto name = prefix + (path.empty() ? "" : "." + path) + "." + local;
          auto value = nn::initial_tensor(root, plan.at(name), t.sizes()).to(device, t.scalar_type());
          if (parameter) value = value.detach().requires_grad_(t.requires_grad());
          m->replace_tensor(local, value);
          saved_.push_back({m, local, t});
        };
        for (const auto& p : m->named_parameters(/*recurse=*/false)) visit(p.key(), p.value(), true);
        for (const auto& b : m->named_buffers(/*recurse=*/false)) visit(b.key(), b.value(), false);
      }
  }
  ~Allocated() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) it->module->replace_tensor(it->local, it->meta);
  }
  Allocated(const Allocated&) = delete;
  Allocated& operator=(const Allocated&) = delete;

 private:
  struct Saved {
    nn::ModulePtr module;
    std::string local;
    torch::Tensor meta;
  };
  std::vector<Saved> saved_;
};

std::vector<torch::Tensor> trainable(const Named& modules) {
  std::vector<torch::Tensor> out;
  for (const auto& [name, m] : modules)
    for (const auto& p : m->parameters(/*recurse=*/true))
      if (p.requires_grad() && std::none_of(out.begin(), out.end(), [&](const auto& q) { return q.is_same(p); }))
        out.push_back(p);
  return out;
}

}  // namespace

std::vector<int64_t> time_pipeline_units(nn::Module& root, const PipelineOptions& options, const torch::Tensor& sample,
                                         const dist::GroupPtr& group, int repeats) {
  TORCH_CHECK(repeats >= 1, "stage timing: ", repeats, " repeats (expected at least 1)");
  TORCH_CHECK(sample.defined(), "pipeline: balance 'time' needs a sample micro-batch to time the blocks on");
  auto blocks = root.find(options.blocks);
  TORCH_CHECK(blocks && !options.blocks.empty(), "pipeline: the policy's blocks '", options.blocks,
              "' is not a module of ", root.type());
  const bool ends = root.has_stage_ends();
  auto children = [&](const std::vector<std::string>& names) {
    Named out;
    for (const auto& n : names) {
      auto c = root.child(n);
      TORCH_CHECK(c, "pipeline: the policy's module '", n, "' is not a child of ", root.type());
      out.emplace_back(n, c);
    }
    return out;
  };
  // The units in model order: their modules (what is allocated and differentiated) and how they
  // run on the previous unit's output.
  struct Unit {
    Named modules;
    std::function<torch::Tensor(const torch::Tensor&)> run;
  };
  std::vector<Unit> units;
  auto first = children(options.first), last = children(options.last);
  auto chain = [](Named ms) {
    return [ms](const torch::Tensor& x) {
      auto y = x;
      for (const auto& [name, m] : ms) y = m->forward({y});
      return y;
    };
  };
  units.push_back({first, ends ? std::function<torch::Tensor(const torch::Tensor&)>(
                                     [&root](const torch::Tensor& x) { return root.stage_in(x); })
                               : chain(first)});
  for (const auto& [name, b] : blocks->children_named())
    units.push_back({{{options.blocks + "." + name, b}}, [b = b](const torch::Tensor& x) { return b->forward({x}); }});
  units.push_back({last, ends ? std::function<torch::Tensor(const torch::Tensor&)>(
                                    [&root](const torch::Tensor& x) { return root.stage_out(x); })
                              : chain(last)});

  const auto device = dist::World::instance().device();
  events::Aside aside;  // the timed forwards are not the script's first step
  RngGuard rng({device});  // dropout in the timed runs must not move the training's random numbers
  std::vector<double> micros;
  torch::Tensor x = sample.to(device);
  for (auto& unit : units) {
    Allocated allocated(root, unit.modules, device);
    auto params = trainable(unit.modules);
    std::vector<double> runs;
    torch::Tensor out;
    for (int r = 0; r <= repeats; ++r) {  // run 0 warms up
      auto in = x.is_floating_point() ? x.detach().requires_grad_(true) : x;
      auto inputs = params;
      if (in.requires_grad()) inputs.push_back(in);
      compat::synchronize(device);
      auto start = Clock::now();
      out = unit.run(in);
      if (out.requires_grad() && !inputs.empty())
        torch::autograd::grad({out}, inputs, {torch::ones_like(out)}, /*retain_graph=*/false,
                              /*create_graph=*/false, /*allow_unused=*/true);
      compat::synchronize(device);
      if (r > 0) runs.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    }
    std::nth_element(runs.begin(), runs.begin() + runs.size() / 2, runs.end());
    micros.push_back(runs[runs.size() / 2]);
    x = out.detach();
  }
  if (group && group->size() > 1) {  // every rank must split alike: the mean of their medians
    auto t = torch::tensor(micros, torch::kFloat64).to(device);
    group->all_reduce(t);
    t = (t / group->size()).cpu();
    for (size_t i = 0; i < micros.size(); ++i) micros[i] = t[static_cast<int64_t>(i)].item<double>();
  }
  std::vector<int64_t> out;
  for (double m : micros) out.push_back(std::max<int64_t>(1, std::llround(m)));
  return out;
}

}  // namespace partrain::parallel
