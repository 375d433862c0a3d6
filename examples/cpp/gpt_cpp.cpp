// GPT-2 trained from C++: builds a small GPT-2, splits it by policies/gpt2.lua (heads and MLP
// column/row-parallel, the vocabulary split in the embedding and the tied head), which the Lua
// library's policy loader plans for this model and parallel::apply_policy applies, makes it data
// parallel (with ZeRO if asked) through the composer, and trains it with
// ParallelModel::train_step and the optimizer the model makes, on random tokens that every run
// draws alike.
//
// A process joins the world from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT); without them it is a world of one, a serial run:
//   RANK=0 WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 build/gpt_cpp --tensor 2 &  ... (ranks 1..3)
//   build/gpt_cpp                                  # serial, the same data: the reference
// Flags: --tensor T, --zero S (ZeRO stage over the data group), --steps, --batch, --accumulate,
// --policy FILE (default: the policies/gpt2.lua partrain ships, found as its Lua library is).
// Rank 0 prints "step N loss L" a line, the loss of the global batch.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "bindings/policy_loader.hpp"
#include "engine/dist/mesh.hpp"
#include "engine/models/gpt2.hpp"
#include "engine/optim/optim.hpp"
#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/policy.hpp"

using namespace partrain;

namespace {

const char* text_flag(int argc, char** argv, const char* name, const char* fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return fallback;
}

int flag(int argc, char** argv, const char* name, int fallback) {
  const char* text = text_flag(argc, argv, name, nullptr);
  return text ? std::atoi(text) : fallback;
}

}  // namespace

int main(int argc, char** argv) try {
  const int tensor = flag(argc, argv, "--tensor", 1), steps = flag(argc, argv, "--steps", 5);
  const int batch = flag(argc, argv, "--batch", 8), accumulate = flag(argc, argv, "--accumulate", 1);
  const int zero = flag(argc, argv, "--zero", 0);
  at::set_num_threads(1);
  auto& world = dist::World::instance();
  world.init(dist::world_options_from_env());

  models::Gpt2Options g;
  g.vocab = 64, g.seq = 16, g.dim = 32, g.heads = 4, g.layers = 2;
  torch::manual_seed(1);  // the same serial model on every rank and in the serial run
  auto model = models::gpt2(g);
  dist::MeshOptions layout;
  layout.tensor = tensor;
  layout.zero = zero > 0 ? 0 : 1;  // ZeRO's groups: the whole data group
  auto mesh = std::make_shared<dist::Mesh>(layout, world);
  parallel::ParallelizeOptions options;
  parallel::PolicyPlan plan;
  if (tensor > 1) {  // the policy's rules, planned for this model by the Lua library, applied by the engine
    const char* file = text_flag(argc, argv, "--policy", nullptr);
    plan = lua::load_policy(model, file ? file : lua::shipped_policy("gpt2"), *mesh);
    options.policy = plan.name;
    options.tensor_parallel = [&](nn::Module& m, const dist::Mesh& on) { parallel::apply_policy(m, plan, on); };
  }
  if (zero > 0) {
    parallel::ZeroOptions z;
    z.stage = zero;
    options.zero = z;
  }
  auto pm = parallel::ParallelModel::parallelize(model, mesh, options);

  optim::OptimizerOptions o;
  o.kind = "adamw";
  o.lr = 1e-3;
  auto opt = pm->make_optimizer(o);  // plain, or ZeRO's over the data group
  const int data = mesh->layout().data, d = mesh->coord().data;
  TORCH_CHECK(batch % data == 0, "--batch ", batch, " does not split over data=", data);
  const int64_t local = batch / data;
  for (int step = 1; step <= steps; ++step) {
    torch::manual_seed(100 + step);  // the global batch, alike everywhere; this rank takes its rows
    auto tokens = torch::randint(0, g.vocab, {batch, g.seq + 1}, torch::kInt64);
    auto x = tokens.narrow(1, 0, g.seq).narrow(0, d * local, local).contiguous();
    auto y = tokens.narrow(1, 1, g.seq).narrow(0, d * local, local).contiguous();
    auto loss = pm->train_step(x, y, {"cross_entropy", accumulate});
    opt->step();
    opt->zero_grad();
    auto global = loss.detach().reshape({1}).clone();
    mesh->group("data")->all_reduce(global, dist::ReduceOp::Mean);
    if (world.rank() == 0) std::printf("step %d loss %.9f\n", step, global.item<double>());
  }
  std::fflush(stdout);
  world.shutdown();
  return 0;
} catch (const c10::Error& e) {
  std::fprintf(stderr, "gpt_cpp: %s\n", e.what_without_backtrace());
  return 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "gpt_cpp: %s\n", e.what());
  return 1;
}
