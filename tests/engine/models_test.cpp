// GoogleTest for the model-family registry: the built-in families are found by name and by their
// root's type, build from options, map their tensor names to Hugging Face's and back, and an
// unknown family is refused with the known ones named.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "engine/models/registry.hpp"
#include "engine/nn/functional.hpp"

using namespace partrain;

namespace {

// Options from a map; records which keys the builder asked for.
class MapOptions final : public models::OptionReader {
 public:
  std::map<std::string, double> numbers;
  std::map<std::string, std::vector<int64_t>> lists;
  std::vector<std::string> read;
  int64_t integer(const char* key, int64_t fallback) override {
    read.push_back(key);
    return numbers.count(key) ? static_cast<int64_t>(numbers[key]) : fallback;
  }
  double number(const char* key, double fallback) override {
    read.push_back(key);
    return numbers.count(key) ? numbers[key] : fallback;
  }
  bool boolean(const char* key, bool fallback) override {
    read.push_back(key);
    return fallback;
  }
  std::string string(const char* key, const std::string& fallback) override {
    read.push_back(key);
    return fallback;
  }
  std::vector<int64_t> integers(const char* key, std::vector<int64_t> fallback) override {
    read.push_back(key);
    return lists.count(key) ? lists[key] : fallback;
  }
};

}  // namespace

TEST(ModelRegistry, FindsGpt2AndMlpByNameAndByType) {
  const auto& gpt2 = models::family("gpt2");
  EXPECT_EQ(gpt2.type, "GPT2");
  EXPECT_EQ(gpt2.default_policy, "policies.gpt2");
  EXPECT_TRUE(gpt2.has_hf()) << "GPT-2 has a Hugging Face layout";
  const auto& mlp = models::family("mlp");
  EXPECT_EQ(mlp.type, "MLP");
  EXPECT_EQ(mlp.default_policy, "policies.mlp");
  EXPECT_FALSE(mlp.has_hf()) << "the MLP has no Hugging Face layout";
  EXPECT_EQ(models::family_of_type("GPT2"), &gpt2);
  EXPECT_EQ(models::family_of_type("MLP"), &mlp);
  EXPECT_EQ(models::family_of_type("Linear"), nullptr) << "a layer is no family's root";
}

TEST(ModelRegistry, BuildsEachFamilyFromItsOptions) {
  MapOptions g;
  g.numbers = {{"vocab", 16}, {"seq", 8}, {"dim", 8}, {"heads", 2}, {"layers", 3}};
  auto model = models::family("gpt2").build(g);
  EXPECT_EQ(model->type(), "GPT2");
  EXPECT_TRUE(model->find("h.2.attn.c_attn")) << "three blocks";
  EXPECT_EQ(model->find("wte")->own_tensor("weight").size(0), 16) << "the vocab option reached the model";
  MapOptions m;
  m.lists["sizes"] = {4, 3, 2};
  auto mlp = models::family("mlp").build(m);
  EXPECT_EQ(mlp->type(), "MLP");
  EXPECT_NE(std::find(m.read.begin(), m.read.end(), "sizes"), m.read.end()) << "the builder read 'sizes'";
}

TEST(ModelRegistry, MapsGpt2NamesToHuggingFaceAndBack) {
  const auto& hf = models::family("gpt2").hf;
  for (std::string name : {"wte.weight", "h.0.attn.c_attn.weight", "h.11.mlp.c_proj.bias", "ln_f.weight"}) {
    EXPECT_EQ(hf.from_hf(hf.to_hf(name)), name) << "round trip of " << name;
    EXPECT_EQ(hf.from_hf("transformer." + hf.to_hf(name)), name) << "GPT2LMHeadModel's prefix on " << name;
  }
  EXPECT_TRUE(hf.transposed("h.3.attn.c_attn.weight")) << "Conv1D weights are [in, out] there";
  EXPECT_TRUE(hf.transposed("h.3.mlp.c_fc.weight"));
  EXPECT_FALSE(hf.transposed("h.3.attn.c_attn.bias")) << "biases are not transposed";
  EXPECT_FALSE(hf.transposed("wte.weight")) << "embeddings are not Conv1D";
  EXPECT_TRUE(hf.ignored("h.0.attn.bias")) << "the causal-mask buffer is computed, not imported";
  EXPECT_FALSE(hf.ignored("h.0.attn.c_attn.bias"));
  ASSERT_EQ(hf.tied.size(), 1u);
  EXPECT_EQ(hf.tied[0], std::make_pair(std::string("lm_head.weight"), std::string("wte.weight")));
}

TEST(ModelRegistry, MapsMixtralExpertsToSlicesOfTheStackedTensorsAndBack) {
  const auto& hf = models::family("llama").hf;
  ASSERT_TRUE(hf.sliced && hf.slice_name);
  auto s = hf.sliced("model.layers.3.block_sparse_moe.experts.12.w2.weight");
  ASSERT_TRUE(s) << "a Hugging Face expert is a slice";
  EXPECT_EQ(s->name, "layers.3.block_sparse_moe.experts.w2");
  EXPECT_EQ(s->index, 12);
  EXPECT_EQ(hf.slice_name("layers.3.block_sparse_moe.experts.w2", 12),
            "model.layers.3.block_sparse_moe.experts.12.w2.weight") << "and back";
  s = hf.sliced("layers.0.block_sparse_moe.experts.0.w1.weight");
  ASSERT_TRUE(s) << "without the model. prefix too";
  EXPECT_EQ(s->name, "layers.0.block_sparse_moe.experts.w1");
  EXPECT_EQ(s->index, 0);
  for (std::string other : {"model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.mlp.gate_proj.weight",
                            "model.layers.0.block_sparse_moe.experts.01.w1.weight",
                            "model.layers.0.block_sparse_moe.experts.-1.w1.weight",
                            "model.layers.0.block_sparse_moe.experts.1.w4.weight",
                            "model.layers.0.block_sparse_moe.experts.1.w1.bias",
                            "model.layers.0.block_sparse_moe.experts.1234567890123456789.w1.weight",
                            "model.layers.0.xblock_sparse_moe.experts.1.w1.weight"})
    EXPECT_FALSE(hf.sliced(other)) << other << " is no expert slice";
  EXPECT_FALSE(hf.slice_name("layers.0.block_sparse_moe.gate.weight", 0)) << "the gate is one tensor";
  EXPECT_FALSE(hf.slice_name("layers.0.mlp.up_proj.weight", 0));
  EXPECT_EQ(hf.slice_noun, "expert");
  EXPECT_FALSE(models::family("gpt2").hf.sliced) << "GPT-2 stacks nothing";
}

TEST(ModelRegistry, RefusesAnUnknownFamilyNamingTheKnownOnes) {
  try {
    models::family("mamba");
    FAIL() << "an unknown family was found";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()), "unknown model family 'mamba' (known: mlp, gpt2, llama)");
  }
}

TEST(DropoutPart, EachPartIsThatSliceOfTheWholeTensorsDropoutAndTheGeneratorAdvancesAlike) {
  // Attention weights of 4 heads split 2 ways along dimension 1: what each part's rank computes
  // (from the same generator state) is that slice of the whole tensor's at::dropout, and after it
  // the generator is where the whole tensor's dropout leaves it.
  torch::manual_seed(3);
  auto whole = torch::rand({2, 4, 5, 5}, torch::kFloat64) + 0.5;
  torch::manual_seed(11);
  auto want = at::dropout(whole, 0.3, /*train=*/true);
  auto after = torch::rand({1}, torch::kFloat64);
  for (int64_t part = 0; part < 2; ++part) {
    torch::manual_seed(11);
    auto got = nn::dropout_part(whole.narrow(1, 2 * part, 2), 0.3, /*training=*/true, 1, 2, part);
    EXPECT_TRUE(got.equal(want.narrow(1, 2 * part, 2))) << "part " << part;
    EXPECT_TRUE(torch::rand({1}, torch::kFloat64).equal(after)) << "the generator after part " << part;
  }
  // The two parts drop different elements (one mask drawn per rank would repeat itself).
  EXPECT_FALSE(want.narrow(1, 0, 2).eq(0).equal(want.narrow(1, 2, 2).eq(0)));
  // Unsplit, or evaluating: at::dropout itself.
  torch::manual_seed(11);
  EXPECT_TRUE(nn::dropout_part(whole, 0.3, true, 1, 1, 0).equal(want));
  EXPECT_TRUE(nn::dropout_part(whole, 0.3, /*training=*/false, 1, 2, 0).equal(whole));
}
