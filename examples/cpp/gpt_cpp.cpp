// GPT-2 trained from C++ alone: the engine without Lua. Builds a small GPT-2, splits it the way
// policies/gpt2.lua does (heads and MLP column/row-parallel, the vocabulary split in the embedding
// and the tied head), makes it data parallel through the composer, and trains it with
// ParallelModel::train_step on random tokens that every run draws alike.
//
// A process joins the world from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT); without them it is a world of one, a serial run:
//   RANK=0 WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 build/gpt_cpp --tensor 2 &  ... (ranks 1..3)
//   build/gpt_cpp                                  # serial, the same data: the reference
// Rank 0 prints "step N loss L" a line, the loss of the global batch.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "engine/dist/mesh.hpp"
#include "engine/models/gpt2.hpp"
#include "engine/optim/optim.hpp"
#include "engine/parallel/parallel_model.hpp"

using namespace partrain;

namespace {

// Replaces the module at `path` with make(serial), where serial is the module there, a `Serial`.
template <class Serial, class Make>
void replace(nn::Module& root, const std::string& path, Make make) {
  auto* serial = dynamic_cast<Serial*>(root.find(path).get());
  TORCH_CHECK(serial, "gpt_cpp policy: no layer of the expected type at ", path);
  auto dot = path.rfind('.');
  nn::Module* parent = dot == std::string::npos ? &root : root.find(path.substr(0, dot)).get();
  parent->set_child(dot == std::string::npos ? path : path.substr(dot + 1), make(*serial));
}

// policies/gpt2.lua without sequence parallelism, in C++: the tensor-parallel step of the composer.
void gpt2_policy(nn::Module& model, const dist::Mesh& mesh, int64_t layers) {
  const auto& g = mesh.group("tensor");
  parallel::align_to_first_rank(model, g);  // every rank cuts the same serial model
  auto norm = [&](nn::LayerNorm& s) { return std::make_shared<parallel::ParallelLayerNorm>(s, g, false); };
  for (int64_t i = 0; i < layers; ++i) {
    const std::string block = "h." + std::to_string(i) + ".";
    auto attn = model.find(block + "attn");
    attn->set_attribute("heads", *attn->attribute("heads") / g->size());  // heads this rank computes
    replace<nn::LayerNorm>(model, block + "ln_1", norm);
    replace<nn::Linear>(model, block + "attn.c_attn", [&](nn::Linear& s) {  // q, k, v of a head together
      return std::make_shared<parallel::ColumnParallelLinear>(s, g, int64_t{3});
    });
    replace<nn::Linear>(model, block + "attn.c_proj",
                        [&](nn::Linear& s) { return std::make_shared<parallel::RowParallelLinear>(s, g); });
    replace<nn::LayerNorm>(model, block + "ln_2", norm);
    replace<nn::Linear>(model, block + "mlp.c_fc",
                        [&](nn::Linear& s) { return std::make_shared<parallel::ColumnParallelLinear>(s, g); });
    replace<nn::Linear>(model, block + "mlp.c_proj",
                        [&](nn::Linear& s) { return std::make_shared<parallel::RowParallelLinear>(s, g); });
  }
  replace<nn::Embedding>(model, "wte",
                         [&](nn::Embedding& s) { return std::make_shared<parallel::VocabParallelEmbedding>(s, g); });
  replace<nn::LayerNorm>(model, "ln_f", norm);
  replace<nn::Linear>(model, "lm_head", [&](nn::Linear& s) {  // the vocabulary head: split logits
    return std::make_shared<parallel::ColumnParallelLinear>(s, g, int64_t{1}, false, false, /*pad=*/true);
  });
  model.find("lm_head")->set_parameter("weight", model.find("wte")->param("weight"));  // tied again
  nn::check_tree(model);
}

int flag(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  return fallback;
}

}  // namespace

int main(int argc, char** argv) try {
  const int tensor = flag(argc, argv, "--tensor", 1), steps = flag(argc, argv, "--steps", 5);
  const int batch = flag(argc, argv, "--batch", 8), accumulate = flag(argc, argv, "--accumulate", 1);
  at::set_num_threads(1);
  auto& world = dist::World::instance();
  world.init(dist::world_options_from_env());

  models::Gpt2Options g;
  g.vocab = 64, g.seq = 16, g.dim = 32, g.heads = 4, g.layers = 2;
  torch::manual_seed(1);  // the same serial model on every rank and in the serial run
  auto model = models::gpt2(g);
  auto mesh = std::make_shared<dist::Mesh>(dist::MeshOptions{tensor}, world);
  parallel::ParallelizeOptions options;
  options.policy = "gpt2 (C++)";
  if (tensor > 1)
    options.tensor_parallel = [&](nn::Module& m, const dist::Mesh& on) { gpt2_policy(m, on, g.layers); };
  auto pm = parallel::ParallelModel::parallelize(model, mesh, options);

  optim::OptimizerOptions o;
  o.kind = "adamw";
  o.lr = 1e-3;
  optim::Optimizer opt(pm->module().parameters(), o);
  const int data = mesh->layout().data, d = mesh->coord().data;
  TORCH_CHECK(batch % data == 0, "--batch ", batch, " does not split over data=", data);
  const int64_t local = batch / data;
  for (int step = 1; step <= steps; ++step) {
    torch::manual_seed(100 + step);  // the global batch, alike everywhere; this rank takes its rows
    auto tokens = torch::randint(0, g.vocab, {batch, g.seq + 1}, torch::kInt64);
    auto x = tokens.narrow(1, 0, g.seq).narrow(0, d * local, local).contiguous();
    auto y = tokens.narrow(1, 1, g.seq).narrow(0, d * local, local).contiguous();
    auto loss = pm->train_step(x, y, {"cross_entropy", accumulate});
    opt.step();
    opt.zero_grad();
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
