// GoogleTest for the engine alone (no Lua): the module tree, layers, optimizers, data, the collective ledger,
// process groups of one rank and planned ones.
#include <gtest/gtest.h>
#include <zlib.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <vector>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>

#include <cereal/archives/binary.hpp>
#include <cereal/types/string.hpp>
#include <cereal/types/vector.hpp>
#include <sstream>

#include "engine/ckpt/ckpt.hpp"
#include "engine/data/data.hpp"
#include "engine/dist/ledger.hpp"
#include "engine/dist/process_group.hpp"
#include "engine/models/gpt2.hpp"
#include "engine/models/models.hpp"
#include "engine/nn/layers.hpp"
#include "engine/optim/optim.hpp"
#include "engine/util/tensor_memory.hpp"
#include "engine/util/memory.hpp"
#include "engine/util/text.hpp"
#include "tests/engine/testing.hpp"

using namespace partrain;
using torch::Tensor;

using testing_util::error_of;
using testing_util::temp_path;

TEST(ModuleTree, DottedNamesFindAndReplace) {
  auto inner = std::make_shared<nn::Sequential>(
      std::vector<nn::ModulePtr>{std::make_shared<nn::Linear>(nn::LinearOptions(4, 4))});
  nn::Sequential root({std::make_shared<nn::Linear>(nn::LinearOptions(2, 4)), inner});
  std::vector<std::string> names;
  for (const auto& p : root.named_parameters()) names.push_back(p.key());
  EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias", "1.0.weight", "1.0.bias"}));
  ASSERT_TRUE(root.find("1.0"));
  EXPECT_EQ(root.find("1.0")->type(), "Linear");
  EXPECT_EQ(root.find("1.7"), nullptr) << "a path that matches nothing";
  root.find("1")->set_child("0", std::make_shared<nn::LayerNorm>(nn::LayerNormOptions(4)));
  EXPECT_EQ(root.find("1.0")->type(), "LayerNorm") << "set_child replaces an existing child";
  EXPECT_EQ(root.forward({torch::randn({3, 2})}).sizes(), (std::vector<int64_t>{3, 4}));
}

TEST(ModuleTree, ChildLookupsFollowEveryChangeOfTheChildren) {
  auto root = std::make_shared<nn::Sequential>(
      std::vector<nn::ModulePtr>{std::make_shared<nn::Linear>(nn::LinearOptions(2, 2))});
  auto first = root->child("0");
  ASSERT_TRUE(first);
  EXPECT_EQ(root->child("1"), nullptr) << "no such child yet";
  nn::TreeSnapshot snapshot(*root, 1 << 20);
  auto norm = std::make_shared<nn::LayerNorm>(nn::LayerNormOptions(2));
  root->set_child("0", norm);
  EXPECT_EQ(root->child("0"), norm) << "a replaced child is seen at once";
  root->set_child("1", std::make_shared<nn::Linear>(nn::LinearOptions(2, 3)));
  ASSERT_TRUE(root->child("1")) << "an added child is seen at once";
  EXPECT_EQ(root->child("1")->type(), "Linear");
  EXPECT_TRUE(snapshot.restore().empty());
  EXPECT_EQ(root->child("0"), first) << "a restored tree gives back the child it had";
  EXPECT_EQ(root->child("1"), nullptr) << "a restored tree has no child added after the snapshot";
}

TEST(ModuleTree, LoadStateDictNamesEveryProblem) {
  nn::Linear a(nn::LinearOptions(3, 2)), b(nn::LinearOptions(3, 2));
  nn::TensorMap state = a.state_dict();
  b.load_state_dict(state);
  EXPECT_TRUE(b.weight().equal(a.weight())) << "weights copied";
  state.erase("bias");
  state["weight"] = torch::zeros({2, 2});
  state["extra"] = torch::zeros({1});
  std::string msg = error_of([&] { b.load_state_dict(state); });
  EXPECT_NE(msg.find("'weight' has shape [2, 2] but the model expects [2, 3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing 'bias'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unexpected 'extra'"), std::string::npos) << msg;
}

TEST(ModuleTree, RefusedLoadStateDictChangesNothing) {
  nn::Linear a(nn::LinearOptions(3, 2)), b(nn::LinearOptions(3, 2));
  auto weight = b.weight().clone(), bias = b.bias().clone();
  nn::TensorMap state = a.state_dict();   // a good weight and bias...
  state["extra"] = torch::zeros({1});      // ...and one key too many
  EXPECT_FALSE(error_of([&] { b.load_state_dict(state); }).empty());
  EXPECT_TRUE(b.weight().equal(weight)) << "the weight was copied although the load was refused";
  EXPECT_TRUE(b.bias().equal(bias)) << "the bias was copied although the load was refused";
}

TEST(Layers, LinearReadsAReplacedWeight) {
  nn::Linear l(nn::LinearOptions(3, 2));
  auto x = torch::randn({4, 3});
  EXPECT_TRUE(l.forward(x).allclose(x.matmul(l.weight().t()) + l.bias()));
  l.set_parameter("weight", torch::ones({2, 3}));
  EXPECT_TRUE(l.forward(x).allclose(x.sum(1, true).expand({4, 2}) + l.bias()))
      << "forward must use the parameter now in the slot";
  EXPECT_NE(error_of([&] { l.forward(torch::randn({4, 5})); }).find("expects input (..., 3)"), std::string::npos);
}

TEST(Layers, LinearWithoutBiasHasAnEmptySlot) {
  nn::LinearOptions o(3, 2);
  o.bias = false;
  nn::Linear l(o);
  EXPECT_TRUE(l.has_slot("bias"));
  EXPECT_FALSE(l.bias().defined());
  EXPECT_EQ(l.parameters().size(), 1u);
}

TEST(Layers, ReprShowsTheTree) {
  auto model = models::mlp({{4, 8, 2}});
  EXPECT_EQ(model->type(), "MLP");
  EXPECT_EQ(model->repr(), "MLP(\n  (0): Linear(in=4, out=8)\n  (1): ReLU()\n  (2): Linear(in=8, out=2)\n)");
  EXPECT_NE(error_of([] { nn::make_activation("Swish"); }).find("unknown activation 'Swish'"), std::string::npos);
}

TEST(ModuleTree, SnapshotPutsBackChildrenParametersContentsAndFlags) {
  auto model = models::mlp({{4, 8, 2}});
  auto first = model->find("0");
  Tensor weight = first->param("weight"), before = weight.detach().clone();
  nn::TreeSnapshot snapshot(*model, /*copy_limit=*/1 << 20);
  model->set_child("0", std::make_shared<nn::Linear>(nn::LinearOptions(4, 8)));
  model->find("2")->set_parameter("extra", torch::zeros({3}));
  {
    torch::NoGradGuard no_grad;
    weight.mul_(3);
  }
  model->find("2")->param("bias").requires_grad_(false);
  model->find("2")->replace_forward([](nn::Module&, const std::vector<Tensor>& x) { return x[0]; });
  model->eval();
  EXPECT_TRUE(snapshot.restore().empty()) << "everything was put back";
  EXPECT_EQ(model->find("0"), first) << "the same child object";
  EXPECT_TRUE(model->find("0")->param("weight").is_same(weight)) << "the same parameter object";
  EXPECT_TRUE(weight.equal(before)) << "its contents, changed in place, restored";
  EXPECT_FALSE(model->find("2")->has_slot("extra")) << "an added parameter is gone";
  EXPECT_TRUE(model->find("2")->param("bias").requires_grad());
  EXPECT_FALSE(model->find("2")->forward_replaced());
  EXPECT_TRUE(model->is_training() && model->find("0")->is_training());
  // Without a copy, contents changed in place cannot come back, and restore() says which.
  nn::TreeSnapshot no_copy(*model, /*copy_limit=*/0);
  {
    torch::NoGradGuard no_grad;
    weight.add_(1);
  }
  EXPECT_EQ(no_copy.restore(), (std::vector<std::string>{"0.weight"}));
}

TEST(Policy, Gpt2AttentionRefusesHeadsThatDoNotMakeItsWidth) {
  models::Gpt2Options o;
  o.vocab = 16, o.seq = 4, o.dim = 8, o.heads = 2, o.layers = 1;
  auto model = models::gpt2(o);
  nn::check_tree(*model);  // the serial model is consistent
  model->find("h.0.attn")->set_attribute("heads", 1);
  std::string msg = error_of([&] { nn::check_tree(*model); });
  EXPECT_NE(msg.find("h.0.attn: 1 heads of 4 features make 4, but c_attn gives 8 features of q here"),
            std::string::npos) << msg;
  msg = error_of([&] { model->forward({torch::zeros({1, 4}, torch::kInt64)}); });
  EXPECT_NE(msg.find("1 heads of 4 need q, k and v of 12 features from c_attn, got 24"), std::string::npos) << msg;
}

TEST(Policy, ChainsRefuseLayersWhoseFeaturesDisagree) {
  nn::Sequential chain({std::make_shared<nn::Linear>(nn::LinearOptions(4, 8)), nn::make_activation("ReLU"),
                        std::make_shared<nn::Linear>(nn::LinearOptions(8, 2))});
  chain.check("chain");
  chain.set_child("2", std::make_shared<nn::Linear>(nn::LinearOptions(6, 2)));
  std::string msg = error_of([&] { chain.check("chain"); });
  EXPECT_NE(msg.find("chain: 0 (Linear) gives 8 whole features, but 2 (Linear) takes 6 whole features"),
            std::string::npos) << msg;
  chain.find("0")->set_parameter("weight", torch::zeros({8, 3}));
  msg = error_of([&] { chain.find("0")->check("chain.0"); });
  EXPECT_NE(msg.find("chain.0: Linear(4, 8) holds a weight of [8, 3], not [8, 4]"), std::string::npos) << msg;
}

TEST(Optim, SchedulesGiveDocumentedRates) {
  optim::ScheduleOptions s;
  s.kind = "cosine";
  s.warmup = 4;
  s.total = 104;
  s.min_lr = 0.0;
  EXPECT_DOUBLE_EQ(optim::scheduled_lr(s, 1.0, 0), 0.25);
  EXPECT_DOUBLE_EQ(optim::scheduled_lr(s, 1.0, 3), 1.0);
  EXPECT_NEAR(optim::scheduled_lr(s, 1.0, 54), 0.5, 1e-12);
  EXPECT_DOUBLE_EQ(optim::scheduled_lr(s, 1.0, 104), 0.0);
  s.total = 3;
  EXPECT_NE(error_of([&] { optim::validate(s); }).find("needs total > warmup"), std::string::npos);
}

TEST(Optim, SgdStepMatchesFormulaAndClips) {
  auto w = torch::tensor({1.0, 2.0}).set_requires_grad(true);
  optim::OptimizerOptions o;
  o.kind = "sgd";
  o.lr = 0.5;
  o.clip_grad_norm = 1.0;
  optim::Optimizer opt({w}, o);
  (w * torch::tensor({3.0, 4.0})).sum().backward();  // grad (3, 4), norm 5
  EXPECT_NEAR(opt.step(), 5.0, 1e-6);
  EXPECT_TRUE(w.allclose(torch::tensor({1.0 - 0.5 * 0.6, 2.0 - 0.5 * 0.8})));
  o.kind = "lion";
  EXPECT_NE(error_of([&] { optim::Optimizer({w}, o); }).find("unknown optimizer 'lion'"), std::string::npos);
}

TEST(Data, IdxReadsGzipAndPlainAndRefusesDamage) {
  const unsigned char idx[] = {0, 0, 0x08, 2, 0, 0, 0, 2, 0, 0, 0, 3, 1, 2, 3, 4, 5, 6};
  std::string plain = temp_path(".idx"), gz = temp_path(".idx.gz");
  std::ofstream(plain, std::ios::binary).write(reinterpret_cast<const char*>(idx), sizeof(idx));
  gzFile f = gzopen(gz.c_str(), "wb");
  gzwrite(f, idx, sizeof(idx));
  gzclose(f);
  for (const auto& path : {plain, gz}) {
    auto t = data::read_idx(path);
    EXPECT_EQ(t.sizes(), (std::vector<int64_t>{2, 3})) << path;
    EXPECT_EQ(t.scalar_type(), torch::kUInt8);
    EXPECT_EQ(t.sum().item<int64_t>(), 21);
  }
  std::ofstream(plain, std::ios::binary).write(reinterpret_cast<const char*>(idx), sizeof(idx) - 2);
  EXPECT_NE(error_of([&] { data::read_idx(plain); }).find("is truncated"), std::string::npos);
  // A gzip stream cut inside its trailer inflates to all the data, but its checksum was never
  // read: gzread calls that an end of file, and the reader must not.
  std::string zipped;
  {
    std::ifstream in(gz, std::ios::binary);
    zipped.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::ofstream(gz, std::ios::binary | std::ios::trunc).write(zipped.data(), static_cast<std::streamsize>(zipped.size() - 3));
  EXPECT_NE(error_of([&] { data::read_idx(gz); }).find("is cut short"), std::string::npos);
  // A dimension of 0 makes an empty tensor, however large the others: no data follows.
  const unsigned char empty[] = {0, 0, 0x0D, 2, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0};
  std::ofstream(plain, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(empty), sizeof(empty));
  EXPECT_EQ(data::read_idx(plain).sizes(), (std::vector<int64_t>{4294967295, 0}));
  // ... but not when the others multiply past what LibTorch counts in int64.
  const unsigned char past[] = {0, 0, 0x08, 4, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 2, 0, 0, 0, 0};
  std::ofstream(plain, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(past), sizeof(past));
  EXPECT_NE(error_of([&] { data::read_idx(plain); }).find("are past what a tensor can count"), std::string::npos);
  // A plain file promising 4 GiB in 12 bytes is refused by its size, before anything is allocated.
  const unsigned char promise[] = {0, 0, 0x08, 2, 0, 1, 0, 0, 0, 0, 0xff, 0xff};
  std::ofstream(plain, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(promise), sizeof(promise));
  EXPECT_NE(error_of([&] { data::read_idx(plain); }).find("header says 4294901760 bytes of data, file has 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { data::read_idx("/no/such/file.idx"); }).find("cannot read the dataset file '/no/such/file.idx'"),
            std::string::npos);
  std::remove(plain.c_str());
  std::remove(gz.c_str());
}

// A NaN in a message reads "nan", as Lua writes it, wherever it stands as a number.
TEST(Messages, NanStandingAloneReadsWithoutSign) {
  const double nan = -std::numeric_limits<double>::quiet_NaN();
  std::ostringstream made;
  made << "got " << nan << ", (" << nan << ") [" << nan << "]";
  ASSERT_NE(made.str().find("-nan"), std::string::npos) << "this C++ library writes a signed NaN as " << made.str();
  EXPECT_EQ(util::message_of(std::invalid_argument(made.str())), "got nan, (nan) [nan]");
  try {
    TORCH_CHECK(false, "eps must be finite, got ", nan);
  } catch (const c10::Error& e) {
    EXPECT_EQ(util::message_of(e), "eps must be finite, got nan");
  }
  // Words and names that hold "-nan" are left as they are.
  const std::string names = "file 'a-nan.txt', 'x/-nan' and not-nan-at-all: -nano";
  EXPECT_EQ(util::message_of(std::runtime_error(names)), names);
  EXPECT_EQ(util::unsigned_nan("{-nan}: -nan:\n-nan"), "{nan}: nan:\nnan");
}

// The memory guard's limit: a container's cgroup (v1 or v2, on its own folder or one above it,
// as a container sees it) when smaller than the machine, the machine otherwise.
TEST(Memory, CgroupLimitsBelowTheMachineCount) {
  const std::string root = temp_path("-cgroup"), proc = root + "/cgroup";
  auto write = [](const std::string& path, const std::string& text) {
    std::system(("mkdir -p '" + path.substr(0, path.rfind('/')) + "'").c_str());
    std::ofstream(path) << text;
  };
  const double machine = util::memory_limit(root + "/none").bytes;
  ASSERT_GT(machine, 0);
  EXPECT_NE(util::memory_limit(root + "/none").what.find("this machine's"), std::string::npos);
  // Limits below the machine's memory, whatever its size: an eighth, a quarter, ...
  auto part = [&](int eighths) { return static_cast<int64_t>(machine / 8) * eighths; };
  auto text = [&](int eighths) { return std::to_string(part(eighths)) + "\n"; };
  // v1, on the process's own cgroup.
  write(proc, "9:pids:/\n4:memory:/docker/abc\n1:cpu,cpuacct:/\n");
  write(root + "/memory/docker/abc/memory.limit_in_bytes", text(1));
  auto limit = util::memory_limit(proc, root);
  EXPECT_EQ(limit.bytes, part(1));
  EXPECT_NE(limit.what.find("of memory its cgroup allows"), std::string::npos) << limit.what;
  // v1 as a container sees it: its own cgroup at the mount's root; "unlimited" above it.
  std::system(("rm -r '" + root + "/memory/docker'").c_str());
  write(root + "/memory/memory.limit_in_bytes", text(2));
  EXPECT_EQ(util::memory_limit(proc, root).bytes, part(2));
  write(root + "/memory/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_EQ(util::memory_limit(proc, root).bytes, machine);
  // v1 with the memory controller mounted together with another, at a folder named by both.
  std::system(("rm -r '" + root + "/memory'").c_str());
  write(proc, "9:pids:/\n5:cpu,memory:/job\n");
  write(root + "/cpu,memory/job/memory.limit_in_bytes", text(3));
  EXPECT_EQ(util::memory_limit(proc, root).bytes, part(3));
  write(proc, "5:memory,../x:/job\n");  // a controller list that would climb out is not a folder
  EXPECT_EQ(util::memory_limit(proc, root).bytes, machine);
  // v2: "max" on the own folder, a number on the parent; the smallest along the path counts.
  write(proc, "0::/user.slice/job\n");
  write(root + "/user.slice/job/memory.max", "max\n");
  write(root + "/user.slice/memory.max", text(3));
  write(root + "/memory.max", text(4));
  EXPECT_EQ(util::memory_limit(proc, root).bytes, part(3));
  // A path that climbs out, or a file that is no number, is ignored.
  write(proc, "0::/../escape\n");
  EXPECT_EQ(util::memory_limit(proc, root).bytes, machine);
  write(proc, "0::/user.slice\n");
  write(root + "/user.slice/memory.max", "12 GB\n");
  EXPECT_EQ(util::memory_limit(proc, root).bytes, part(4));
  std::system(("rm -r '" + root + "'").c_str());
}

// A dataset whose sample i is the number i, to see exactly which samples a loader hands out.
class Counting : public data::Dataset {
 public:
  explicit Counting(int64_t n) : n_(n) {}
  int64_t size() const override { return n_; }
  std::vector<Tensor> batch(const std::vector<int64_t>& indices) const override {
    return {torch::tensor(indices, torch::kInt64)};
  }
  std::string describe() const override { return "counting"; }

 private:
  int64_t n_;
};

TEST(Data, LoaderIsDeterministicAndShardsPartitionTheGlobalBatch) {
  auto ds = std::make_shared<Counting>(100);
  data::LoaderOptions o;
  o.batch = 8;
  o.seed = 5;
  data::Loader a(ds, o), b(ds, o);
  for (int i = 0; i < 30; ++i) ASSERT_TRUE(a.next()[0].equal(b.next()[0])) << "batch " << i;
  EXPECT_EQ(a.epoch(), 2) << "12 batches an epoch: 30 batches reach epoch 2";
  EXPECT_FALSE(a.order(0) == a.order(1)) << "each epoch reshuffles";

  data::Loader serial(ds, o);
  std::vector<data::Loader> ranks;
  for (int r = 0; r < 4; ++r) {
    auto ro = o;
    ro.shard_rank = r;
    ro.shard_count = 4;
    ranks.emplace_back(ds, ro);
  }
  for (int step = 0; step < 15; ++step) {
    std::vector<Tensor> parts;
    for (auto& l : ranks) parts.push_back(l.next()[0]);
    ASSERT_TRUE(torch::cat(parts).equal(serial.next()[0])) << "step " << step;
  }
  o.shard_count = 3;
  EXPECT_NE(error_of([&] { data::Loader(ds, o); }).find("batch=8 does not divide into shard_count=3"),
            std::string::npos);
}

TEST(Data, TextWindowsShiftTargetsByOne) {
  std::string path = temp_path(".txt");
  std::ofstream(path) << "0123456789";
  data::Text text({path, 4});
  EXPECT_EQ(text.size(), 2);  // (10 - 1) / 4
  auto b = text.batch({1});
  EXPECT_TRUE(b[0].equal(torch::tensor({{'4', '5', '6', '7'}}, torch::kInt64)));
  EXPECT_TRUE(b[1].equal(torch::tensor({{'5', '6', '7', '8'}}, torch::kInt64)));
  EXPECT_NE(error_of([&] { data::Text({path, 20}); }).find("fewer than seq+1"), std::string::npos);
  std::remove(path.c_str());
}

TEST(Models, MlpLearnsFashionMnist) {
  torch::manual_seed(0);
  auto model = models::mlp({{784, 64, 10}});
  optim::OptimizerOptions o;
  o.lr = 0.1;
  o.momentum = 0.9;
  optim::Optimizer opt(model->parameters(), o);
  data::LoaderOptions lo;
  lo.batch = 64;
  data::Loader loader(std::make_shared<data::Mnist>(data::MnistOptions{}), lo);
  double first = 0, last = 0;
  for (int step = 0; step < 200; ++step) {
    auto b = loader.next();
    auto loss = nn::cross_entropy(model->forward({b[0]}), b[1]);
    opt.zero_grad();
    loss.backward();
    opt.step();
    if (step < 20) first += loss.item<double>() / 20;
    if (step >= 180) last += loss.item<double>() / 20;
  }
  EXPECT_LT(last, 0.6 * first) << "mean loss of the last 20 steps vs the first 20";
}

// A manifest of format 2, written here byte by byte as that format laid it out (a count of equal
// parts where format 3 stores their sizes): read as that many equal sizes; a count that does not
// divide the dimension is refused naming the tensor.
namespace {
// Format 2 (`fused`: a count of equal parts) or, with `version` 3, format 3 (the parts' sizes,
// no pipeline layout); one 6x2 float tensor in one piece.
std::string manifest_v2(int64_t fused, uint32_t version = 2) {
  std::ostringstream payload(std::ios::binary);
  {
    cereal::BinaryOutputArchive ar(payload);
    ar(int64_t{1}, int32_t{2}, int32_t{2}, int32_t{1}, int32_t{1}, int32_t{1});  // step, world, tensor, data, pipeline, zero
    ar(std::string("Sequential"), std::string(""), std::string(""), int64_t{0}, int64_t{-1}, std::string("{}"), false);
    ar(cereal::make_size_tag(uint64_t{1}));  // one tensor
    ar(std::string("model/0.weight"), std::string("Float"), std::vector<int64_t>{6, 2}, int32_t{0});
    if (version == 2) ar(fused);
    else ar(std::vector<int64_t>{});
    ar(cereal::make_size_tag(uint64_t{1}));  // one piece: all of it, in file 0
    ar(int32_t{0}, uint64_t{0}, uint64_t{48}, std::vector<int64_t>{0, 0}, std::vector<int64_t>{6, 2}, uint32_t{0});
    ar(cereal::make_size_tag(uint64_t{1}));  // one file
    ar(std::string("rank-00000.bin"), uint64_t{48}, uint32_t{0});
    ar(std::vector<std::string>{});
  }
  std::string body = payload.str();
  std::ostringstream out(std::ios::binary);
  {
    cereal::BinaryOutputArchive ar(out);
    ar(std::string("partrain-checkpoint"), version, uint64_t(body.size()),
       uint32_t(crc32(0L, reinterpret_cast<const Bytef*>(body.data()), static_cast<uInt>(body.size()))));
  }
  return out.str() + body;
}
}  // namespace

TEST(Ckpt, FormatTwoManifestsReadAsEqualParts) {
  std::string tag = temp_path("_tag");
  ::mkdir(tag.c_str(), 0755);
  auto write = [&](int64_t fused) {
    std::string bytes = manifest_v2(fused);
    std::ofstream(tag + "/manifest.bin", std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size());
  };
  write(3);
  auto m = ckpt::read_manifest(tag);
  EXPECT_EQ(m.version, 2u);
  ASSERT_EQ(m.tensors.size(), 1u);
  EXPECT_EQ(m.tensors[0].parts, (std::vector<int64_t>{2, 2, 2}));
  write(1);
  EXPECT_TRUE(ckpt::read_manifest(tag).tensors[0].parts.empty());
  write(4);  // 6 rows are not 4 equal parts
  EXPECT_NE(error_of([&] { ckpt::read_manifest(tag); }).find("has tensor 'model/0.weight' split on dimension 0"),
            std::string::npos);
  std::remove((tag + "/manifest.bin").c_str());
  ::rmdir(tag.c_str());
}

// Format 3 (before the pipeline layout) reads with an empty layout; format 4 writes one.
TEST(Ckpt, FormatThreeManifestsReadWithoutPipelineLayout) {
  std::string tag = temp_path("_tag3");
  ::mkdir(tag.c_str(), 0755);
  std::string bytes = manifest_v2(1, 3);
  std::ofstream(tag + "/manifest.bin", std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size());
  auto m = ckpt::read_manifest(tag);
  EXPECT_EQ(m.version, 3u);
  EXPECT_TRUE(m.stages.bounds.empty() && m.stages.blocks.empty() && m.stages.chunks == 1) << "format 3 has no layout";
  ASSERT_EQ(m.tensors.size(), 1u);
  EXPECT_TRUE(m.tensors[0].parts.empty());
  // A layout that does not fit the pipeline size is refused, naming it.
  m.pipeline = 2;  // world 2: tensor 1 x data 1 x pipeline 2
  m.tensor = 1;
  m.version = ckpt::kFormatVersion;
  m.stages = {"1f1b", 1, "h", {"wte"}, {"ln_f"}, {0, 2, 1}};
  EXPECT_NE(error_of([&] { ckpt::validate(m, "m"); }).find("has pipeline stage bounds [0, 2, 1]"), std::string::npos);
  m.stages.bounds = {0, 1, 2};
  EXPECT_NO_THROW(ckpt::validate(m, "m")) << "1f1b, blocks h.0 | h.1";
  std::remove((tag + "/manifest.bin").c_str());
  ::rmdir(tag.c_str());
}

// An MLP's activation is recorded as text (format 9); a text that is not printable, or too long
// for a setting's name, is refused as damage before any message shows it.
TEST(Ckpt, ConfigurationTextIsRecordedAndBounded) {
  models::MlpOptions o;
  o.sizes = {3, 4, 2};
  o.activation = "Tanh";
  auto model = models::mlp(o);
  const std::string dir = temp_path("_config_text");
  ckpt::State state;
  state.model = model.get();
  state.step = 1;
  ckpt::save(dir, state, {});
  auto m = ckpt::read_manifest(dir + "/step-00000001");
  ASSERT_EQ(m.config.size(), 1u);
  EXPECT_EQ(m.config[0].name, "activation");
  EXPECT_EQ(m.config[0].text, "Tanh");
  m.config[0].text = "Ta" + std::string(1, '\x1b') + "nh";
  EXPECT_NE(error_of([&] { ckpt::validate(m, "m"); }).find("a printable text"), std::string::npos);
  m.config[0].text = std::string(65, 'x');
  EXPECT_NE(error_of([&] { ckpt::validate(m, "m"); }).find("a printable text"), std::string::npos);
  m.config[0].text = "GELU";
  EXPECT_NO_THROW(ckpt::validate(m, "m"));
  std::system(("rm -rf '" + dir + "'").c_str());
}

// A parameter Adam skipped on a step (no gradient) keeps its own step count in the manifest; a
// count for a parameter without state, a second count, or one past the optimizer's is refused.
TEST(Ckpt, StepCountsAreOfParametersWithStateWithinTheOptimizers) {
  auto model = std::make_shared<nn::Linear>(nn::LinearOptions(2, 2));
  optim::OptimizerOptions o;
  o.kind = "adamw";
  optim::Optimizer opt(model->parameters(/*recurse=*/true), o);
  auto weight = model->param("weight"), bias = model->param("bias");
  for (int step = 1; step <= 2; ++step) {
    weight.mutable_grad() = torch::ones_like(weight);
    bias.mutable_grad() = step == 1 ? torch::ones_like(bias) : torch::Tensor();  // bias: step 1 only
    opt.step();
  }
  EXPECT_EQ(opt.param_steps(weight), 2);
  EXPECT_EQ(opt.param_steps(bias), 1);
  const std::string dir = temp_path("_steps");
  ckpt::State state;
  state.model = model.get();
  state.optimizer = &opt;
  state.step = 2;
  ckpt::save(dir, state, {});
  auto m = ckpt::read_manifest(dir + "/step-00000002");
  ASSERT_EQ(m.param_steps.size(), 1u) << "only the parameter that stepped fewer times";
  EXPECT_EQ(m.param_steps[0].name, "bias");
  EXPECT_EQ(m.param_steps[0].steps, 1);
  m.param_steps[0].steps = 3;
  EXPECT_NE(error_of([&] { ckpt::validate(m, "m"); }).find("has step count 3 for 'bias' of an optimizer (adamw) after 2"),
            std::string::npos);
  m.param_steps = {{"bias", 1}, {"bias", 1}};
  EXPECT_NE(error_of([&] { ckpt::validate(m, "m"); }).find("a step count for 'bias', which has no optimizer state or "
                                                            "another count"), std::string::npos);
  m.param_steps = {{"nothing", 1}};
  EXPECT_NE(error_of([&] { ckpt::validate(m, "m"); }).find("a step count for 'nothing'"), std::string::npos);
  m.param_steps = {{"weight", 0}};
  EXPECT_NO_THROW(ckpt::validate(m, "m"));
  std::system(("rm -rf '" + dir + "'").c_str());
}

// ---- The collective ledger -----------------------------------------------------------------

namespace ledger = partrain::dist::ledger;

namespace {
const ledger::GroupCopy* ledger_group(const ledger::Copy& copy, const std::string& key) {
  for (const auto& g : copy.groups)
    if (g.key == key) return &g;
  return nullptr;
}
}  // namespace

TEST(Ledger, RecordsCallsStatesAndChannelsAndReadsThemBack) {
  ledger::Book book("world", "test:states", {0, 1, 2}, 1);
  ledger::SiteOverride site("train.lua:42");
  auto ar = book.start(ledger::Op::AllReduce, 1, int(torch::kFloat), 4, 16);
  book.set(ar, ledger::State::Waiting);
  book.set(ar, ledger::State::Completed);
  book.set(ar, ledger::State::Waiting);  // a completed call stays completed
  auto sent = book.start(ledger::Op::Send, 0, int(torch::kDouble), 3, 24, /*peer=*/2, /*tag=*/5);
  book.start(ledger::Op::Send, 0, int(torch::kDouble), 3, 24, 2, 5);
  auto got = book.start(ledger::Op::Recv, 0, int(torch::kDouble), 3, 24, 0, 5);
  book.set(got, ledger::State::TimedOut);
  auto copy = ledger::read(ledger::region());
  ASSERT_TRUE(copy.valid);
  EXPECT_EQ(copy.pid, int(getpid()));
  const auto* g = ledger_group(copy, "test:states");
  ASSERT_NE(g, nullptr) << "the group's slot is in the block";
  EXPECT_EQ(g->name, "world");
  EXPECT_EQ(g->ranks, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(g->describe(), "group 'world' (ranks 0,1,2)");
  EXPECT_EQ(g->collectives, 1) << "sends and receives are numbered on their channels, not as collectives";
  ASSERT_EQ(g->calls_kept.size(), 4u);
  const auto& first = g->calls_kept[0];
  EXPECT_EQ(first.state, ledger::State::Completed) << "completed is final";
  EXPECT_EQ(first.describe(), "all_reduce(sum) of 4 float32 (16 B)");
  EXPECT_EQ(first.site, "train.lua:42");
  EXPECT_GT(first.ended_ns, 0);
  EXPECT_EQ(g->calls_kept[1].call, sent);
  EXPECT_EQ(g->calls_kept[1].describe(), "send of 3 float64 (24 B) to rank 2 (tag 5)");
  EXPECT_EQ(g->calls_kept[2].seq, 1) << "the second message on the channel";
  EXPECT_EQ(g->calls_kept[3].state, ledger::State::TimedOut);
  ASSERT_NE(g->channel(2, 5), nullptr);
  EXPECT_EQ(g->channel(2, 5)->sent, 2);
  ASSERT_NE(g->channel(0, 5), nullptr);
  EXPECT_EQ(g->channel(0, 5)->received, 1);
  EXPECT_EQ(g->channel(1, 5), nullptr);
}

TEST(Ledger, TheRingKeepsTheLastCallsAndLongSitesAreCut) {
  ledger::Book book("data[0,1]", "test:ring", {0, 1}, 0);
  const std::string long_site = std::string(300, 'x') + ".lua:7";
  ledger::SiteOverride site(long_site.c_str());
  for (int i = 0; i < ledger::kEntries + 10; ++i) book.start(ledger::Op::Barrier, 0, -1, 0, 0);
  const auto snapshot = ledger::read(ledger::region());  // kept: g points into it
  const auto* g = ledger_group(snapshot, "test:ring");
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->collectives, ledger::kEntries + 10);
  ASSERT_EQ(g->calls_kept.size(), size_t(ledger::kEntries)) << "a fixed ring";
  EXPECT_EQ(g->calls_kept.front().seq, 10) << "the oldest kept is the eleventh";
  EXPECT_EQ(g->calls_kept.back().seq, ledger::kEntries + 9);
  EXPECT_EQ(g->calls_kept.back().site.size(), size_t(ledger::kSite - 1)) << "a site longer than its field is cut";
}

TEST(Ledger, ACallCostsLessThanTwoMicroseconds) {
  // What every collective adds: its entry started, then waiting, then completed (the script line
  // is asked of the Lua boundary as before the ledger existed; here it is given).
  ledger::Book book("world", "test:cost", {0, 1}, 0);
  ledger::SiteOverride site("train.lua:42");
  const int n = 200000;
  auto begin = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    auto t = book.start(ledger::Op::AllReduce, 1, int(torch::kFloat), 1000, 4000);
    book.set(t, ledger::State::Waiting);
    book.set(t, ledger::State::Completed);
  }
  double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - begin).count() / n;
  std::printf("ledger: %.0f ns a call (start, waiting, completed)\n", ns);
  EXPECT_LT(ns, 2000) << "bookkeeping that must stay small beside a collective (milliseconds on this machine)";
}

TEST(Ledger, AnAllToAllIsACollectiveNamedAsSuch) {
  ledger::Book book("context", "test:all_to_all", {0, 1}, 0);
  book.start(ledger::Op::AllToAll, 0, int(torch::kFloat), 8, 32);
  const auto copy = ledger::read(ledger::region());
  const auto* g = ledger_group(copy, "test:all_to_all");
  ASSERT_NE(g, nullptr);
  ASSERT_EQ(g->calls_kept.size(), 1u);
  EXPECT_EQ(g->calls_kept[0].op, ledger::Op::AllToAll) << "read back, not taken for an unknown op";
  EXPECT_TRUE(g->calls_kept[0].collective()) << "numbered with the group's collectives";
  EXPECT_EQ(g->calls_kept[0].describe(), "all_to_all of 8 float32 (32 B)");
}

// ---- Process groups without peers ------------------------------------------------------------

namespace {
dist::GroupPtr group_without_peers(const std::string& name, std::vector<int> ranks, bool planned) {
  dist::GroupOptions o;
  o.name = name;
  o.ranks = std::move(ranks);
  o.planned = planned;
  return dist::ProcessGroup::create(o, 0, nullptr);
}
}  // namespace

TEST(ProcessGroup, AGroupOfOneExchangesWithItself) {
  auto solo = group_without_peers("solo", {0}, false);
  Tensor into = torch::zeros({2, 3});
  auto out = torch::arange(6, torch::kFloat32);
  solo->send_recv(out, 0, into, 0).wait();
  EXPECT_TRUE(into.equal(out.view({2, 3}))) << "send_recv copies what it sends into what it receives into";
  Tensor gathered;
  auto in = torch::arange(4, torch::kFloat64).view({2, 2});
  solo->all_to_all_single(gathered, in).wait();
  EXPECT_TRUE(gathered.equal(in)) << "all_to_all_single makes the output and copies the input";
  EXPECT_FALSE(gathered.is_alias_of(in));
  EXPECT_TRUE(solo->traffic().empty()) << "a group of one moves nothing";
  EXPECT_EQ(error_of([&] { solo->send_recv(out, 1, into, 0); }),
            "send_recv on group 'solo' (ranks 0): bad destination 1 (a group of one has only group rank 0)");
  EXPECT_NE(error_of([&] { solo->send_recv(out, 0, into, -1); }).find("bad source -1"), std::string::npos);
  Tensor three = torch::zeros({3});
  EXPECT_NE(error_of([&] { solo->send_recv(out, 0, three, 0); })
                .find("it sends 6 float32 elements to itself; the tensor received into holds 3 float32"),
            std::string::npos);
  Tensor elsewhere = torch::empty({6}, torch::TensorOptions().device(torch::kMeta));
  EXPECT_NE(error_of([&] { solo->send_recv(out, 0, elsewhere, 0); })
                .find("send_recv on group 'solo' (ranks 0): the tensor sent is on cpu and the one received into on meta"),
            std::string::npos);
  Tensor strided = torch::zeros({3, 2}).t();
  EXPECT_NE(error_of([&] { solo->send_recv(out, 0, strided, 0); }).find("send_recv on group 'solo' (ranks 0): the tensor must be contiguous"),
            std::string::npos);
  Tensor wrong = torch::zeros({2, 2}, torch::kFloat32);
  EXPECT_NE(error_of([&] { solo->all_to_all_single(wrong, in); })
                .find("all_to_all on group 'solo' (ranks 0): the output must have the input's shape [2, 2], dtype float64"),
            std::string::npos);
  Tensor same = in;
  EXPECT_NE(error_of([&] { solo->all_to_all_single(same, in); }).find("must not share the input's memory"),
            std::string::npos);
}

TEST(ProcessGroup, APlannedGroupRecordsExchangesAndMovesNothing) {
  auto planned = group_without_peers("planned", {0, 1}, true);
  Tensor into = torch::full({4}, 7.0);
  planned->send_recv(torch::ones({4}), 1, into, 1).wait();
  EXPECT_TRUE(into.equal(torch::full({4}, 7.0))) << "the tensor received into is left as it is";
  Tensor out = torch::full({4, 3}, 7.0);
  planned->all_to_all_single(out, torch::ones({4, 3})).wait();
  EXPECT_TRUE(out.equal(torch::full({4, 3}, 7.0)));
  auto traffic = planned->traffic();
  EXPECT_EQ(traffic["send_recv"].calls, 1);
  EXPECT_EQ(traffic["send_recv"].bytes, 16) << "the bytes sent";
  EXPECT_EQ(traffic["all_to_all"].calls, 1);
  EXPECT_EQ(traffic["all_to_all"].bytes, 48) << "the input's bytes";
  EXPECT_NE(error_of([&] { planned->send_recv(torch::ones({4}), 0, into, 1); })
                .find("bad destination 0 (expected another group rank than this one, 0, in 0..1)"),
            std::string::npos);
  Tensor odd = torch::ones({3});
  EXPECT_NE(error_of([&] { planned->all_to_all_single(out, odd); }).find("needs a tensor whose dim 0 is a multiple of 2"),
            std::string::npos);
}

// ---- The CPU heap -----------------------------------------------------------------------------

#if defined(__GLIBC__)
namespace {

// Bytes free inside the heap after 8 tensors of 4 MiB were made, touched and freed: memory kept for
// the next tensors rather than handed back to the system.
size_t heap_free_after_tensors() {
  util::install_allocators();
  {
    std::vector<Tensor> ts;
    for (int i = 0; i < 8; ++i) ts.push_back(torch::ones({1 << 20}));  // 4 MiB of float32 each
  }
  return mallinfo2().fordblks;
}

// Sets (value non-null) or clears an environment variable for a scope.
struct EnvFor {
  std::string name;
  std::optional<std::string> before;
  EnvFor(const char* n, const char* value) : name(n) {
    if (const char* was = std::getenv(n)) before = was;
    if (value) setenv(n, value, 1);
    else unsetenv(n);
  }
  ~EnvFor() {
    if (before) setenv(name.c_str(), before->c_str(), 1);
    else unsetenv(name.c_str());
  }
};

}  // namespace

TEST(Heap, FreedTensorMemoryStaysInTheHeapUnlessTheSystemsMallocIsChosen) {
  {
    EnvFor a("PARTRAIN_MALLOC", nullptr), b("GLIBC_TUNABLES", nullptr), c("MALLOC_TRIM_THRESHOLD_", nullptr),
        d("MALLOC_MMAP_THRESHOLD_", nullptr), e("MALLOC_TOP_PAD_", nullptr);
    EXPECT_TRUE(util::keeps_freed_memory());
    EXPECT_EQ(util::malloc_setting_problem(), "");
    {
      EnvFor kept("PARTRAIN_MALLOC", "kept");
      EXPECT_TRUE(util::keeps_freed_memory());
      EXPECT_EQ(util::malloc_setting_problem(), "");
    }
    {
      EnvFor system("PARTRAIN_MALLOC", "system");
      EXPECT_FALSE(util::keeps_freed_memory());
      EXPECT_EQ(util::malloc_setting_problem(), "");
    }
    for (const char* own : {"GLIBC_TUNABLES", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_"}) {
      EnvFor glibc(own, "1");
      EXPECT_FALSE(util::keeps_freed_memory()) << own << " set: glibc's own setting must be left alone";
      EnvFor kept("PARTRAIN_MALLOC", "kept");
      EXPECT_TRUE(util::keeps_freed_memory()) << own << " set with PARTRAIN_MALLOC=kept: what was asked for wins";
    }
    {
      EnvFor typo("PARTRAIN_MALLOC", "sytem");
      EXPECT_NE(util::malloc_setting_problem().find("PARTRAIN_MALLOC='sytem' is not a choice: kept"), std::string::npos)
          << util::malloc_setting_problem();
    }
  }
  // The effect, each in a fresh process (the heap's settings are made once, at the first tensor):
  // with partrain's setting the 32 MiB freed stay in the heap; with glibc's own they go back.
  const std::string style = GTEST_FLAG_GET(death_test_style);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  constexpr size_t kFreed = size_t(32) << 20;
  EXPECT_EXIT(
      {
        EnvFor a("PARTRAIN_MALLOC", nullptr);
        const size_t kept = heap_free_after_tensors();
        std::fprintf(stderr, "kept %zu\n", kept);
        std::exit(kept >= kFreed ? 0 : 1);
      },
      testing::ExitedWithCode(0), "");
  EXPECT_EXIT(
      {
        EnvFor a("PARTRAIN_MALLOC", "system");
        const size_t kept = heap_free_after_tensors();
        std::fprintf(stderr, "kept %zu\n", kept);
        std::exit(kept < kFreed ? 0 : 1);
      },
      testing::ExitedWithCode(0), "");
  GTEST_FLAG_SET(death_test_style, style);  // the other tests' own
}
#endif
