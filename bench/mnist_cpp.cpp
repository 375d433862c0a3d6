// The MNIST training loop of bench/mnist_loop.lua written directly in C++ against the engine:
// the baseline that measures what driving the loop from Lua costs.
#include <chrono>
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <string>

#include "engine/data/data.hpp"
#include "engine/models/models.hpp"
#include "engine/optim/optim.hpp"

using namespace partrain;

int main(int argc, char** argv) {
  int steps = argc > 1 ? std::atoi(argv[1]) : 300;
  int batch = argc > 2 ? std::atoi(argv[2]) : 64;
  int threads = argc > 3 ? std::atoi(argv[3]) : 1;
  int64_t hidden = argc > 4 ? std::atoi(argv[4]) : 256;  // widths hidden, hidden/2
  at::set_num_threads(threads);
  torch::manual_seed(1);
  auto model = models::mlp({{784, hidden, std::max<int64_t>(1, hidden / 2), 10}});
  optim::OptimizerOptions o;
  o.kind = "sgd";
  o.lr = 0.05;
  o.momentum = 0.9;
  optim::Optimizer opt(model->parameters(), o);
  data::LoaderOptions lo;
  lo.batch = batch;
  lo.seed = 1;
  data::Loader loader(std::make_shared<data::Mnist>(data::MnistOptions{}), lo);

  auto cpu = [] {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  };
  double cpu_start = cpu();
  auto start = std::chrono::steady_clock::now();
  double loss_sum = 0;
  for (int step = 0; step < steps; ++step) {
    auto b = loader.next();
    loss_sum += models::classification_step(*model, opt, b[0], b[1]);
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("cpp steps %d seconds %.4f cpu %.4f mean_loss %.6f\n", steps, seconds, cpu() - cpu_start,
              loss_sum / steps);
  return 0;
}
