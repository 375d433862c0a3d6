// GoogleTest for the Lua host: Lua and C++ drive the same engine to the same numbers, and the
// boundary turns every failure into a Lua error without crashing.
#include <gtest/gtest.h>

#include <sstream>

#include "bindings/host.hpp"
#include "engine/data/data.hpp"
#include "engine/models/models.hpp"
#include "engine/optim/optim.hpp"

using namespace partrain;

namespace {

std::vector<double> parse_numbers(const std::string& text) {
  std::vector<double> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stod(item));
  return out;
}

std::string run(lua::Host& host, const std::string& code) {
  std::string result, error;
  EXPECT_TRUE(host.eval(code, &result, &error)) << error;
  return result;
}

std::string error_of(lua::Host& host, const std::string& code) {
  std::string result, error;
  EXPECT_FALSE(host.eval(code, &result, &error)) << "expected an error from: " << code;
  return error;
}

}  // namespace

TEST(Host, MlpTrainedFromLuaAndFromCppGivesTheSameLosses) {
  const int steps = 30;
  at::set_num_threads(1);
  // C++.
  torch::manual_seed(11);
  auto model = models::mlp({{784, 64, 10}});
  optim::OptimizerOptions o;
  o.lr = 0.05;
  o.momentum = 0.9;
  optim::Optimizer opt(model->parameters(), o);
  data::LoaderOptions lo;
  lo.batch = 32;
  lo.seed = 4;
  data::Loader loader(std::make_shared<data::Mnist>(data::MnistOptions{}), lo);
  std::vector<double> cpp;
  for (int step = 0; step < steps; ++step) {
    auto b = loader.next();
    cpp.push_back(models::classification_step(*model, opt, b[0], b[1]));  // forward, loss, backward, step
  }
  // Lua.
  lua::Host host;
  auto text = run(host, R"(
    local pt = require "partrain"
    pt.manual_seed(11)
    local model = pt.models.mlp { sizes = { 784, 64, 10 } }
    local opt = pt.optim.sgd(model, { lr = 0.05, momentum = 0.9 })
    local data = pt.data.mnist { batch = 32, seed = 4 }
    local losses = {}
    for step = 1, )" + std::to_string(steps) + R"( do
      local x, y = data:next()
      local loss = pt.nn.cross_entropy(model(x), y)
      opt:zero_grad()
      loss:backward()
      opt:step()
      losses[step] = string.format("%.17g", loss:item())
    end
    return table.concat(losses, ",")
  )");
  auto lua = parse_numbers(text);
  ASSERT_EQ(lua.size(), cpp.size());
  for (int i = 0; i < steps; ++i)
    EXPECT_EQ(lua[i], cpp[i]) << "step " << i << ": the same ops in the same order are bitwise equal";
}

TEST(Host, EngineExceptionsBecomeLuaErrorsWithTheLine) {
  lua::Host host;
  auto error = error_of(host, "local pt = require 'partrain'\nlocal x = pt.ones(2, 3):matmul(pt.ones(4, 5))\nreturn x");
  EXPECT_NE(error.find("eval:2: mat1 and mat2 shapes cannot be multiplied"), std::string::npos) << error;
  EXPECT_EQ(error.find("Exception raised from"), std::string::npos) << "no C++ backtrace in messages";
  // The state is still usable afterwards.
  EXPECT_EQ(run(host, "return require('partrain').ones(3):sum():item()"), "3");
}

TEST(Host, LuaModulesRunInsideEngineContainers) {
  lua::Host host;
  auto out = run(host, R"(
    local pt = require "partrain"
    local Double = pt.nn.Module "Double"
    function Double:forward(x) return x * 2 end
    local seq = pt.nn.Sequential(pt.nn.Linear(2, 2), Double(), Double())
    local x = pt.randn(3, 2)
    local lin = seq:get("0")
    return (seq(x) - lin(x) * 4):abs():max():item()
  )");
  EXPECT_EQ(out, "0");
}

TEST(Host, ManyFailingCallsDoNotLeakOrCrash) {
  lua::Host host;
  auto out = run(host, R"(
    local pt = require "partrain"
    local Bad = pt.nn.Module "Bad"
    function Bad:forward(x) error("no") end
    local seq = pt.nn.Sequential(Bad())
    local failures = 0
    for _ = 1, 2000 do
      if not pcall(seq, pt.ones(1)) then failures = failures + 1 end
      if not pcall(pt.ones(2).matmul, pt.ones(2), 3) then failures = failures + 1 end
    end
    collectgarbage()
    return failures
  )");
  EXPECT_EQ(out, "4000");
}
