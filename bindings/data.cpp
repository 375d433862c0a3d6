// Data loaders in Lua (pt.data.mnist, pt.data.text) and byte conversions: thin userdata over the
// engine's loaders; batching stays in C++, and batches land on the rank's device.
#include <cstring>

#include "bindings/lua.hpp"
#include "engine/data/data.hpp"
#include "engine/dist/world.hpp"

namespace partrain::lua {

using LoaderPtr = std::shared_ptr<data::Loader>;

namespace {

data::LoaderOptions read_loader(Options& t) {
  data::LoaderOptions o;
  o.batch = t.integer("batch", o.batch);
  o.shuffle = t.boolean("shuffle", o.shuffle);
  o.seed = static_cast<uint64_t>(t.integer("seed", static_cast<int64_t>(o.seed)));
  o.drop_last = t.boolean("drop_last", o.drop_last);
  o.shard_rank = t.integer("shard_rank", o.shard_rank);
  o.shard_count = t.integer("shard_count", o.shard_count);
  o.device = dist::World::instance().device();  // batches land on this rank's device
  // mesh = m: this rank reads its data-parallel slice; the ranks of one unit read the same one.
  if (t.push("mesh")) {
    bool is_mesh = mesh_data_shard(t.state(), -1, &o.shard_rank, &o.shard_count);
    lua_pop(t.state(), 1);
    if (!is_mesh) throw std::invalid_argument("option 'mesh' must be a mesh made by pt.mesh");
  }
  return o;
}

LoaderPtr& loader(const Args& a, int i) {
  auto* l = ud_test<LoaderPtr>(a.L, i, PT_LOADER_MT);
  if (!l) a.expected(i, "loader");
  return *l;
}

int push_batch(const Args& a, const std::vector<torch::Tensor>& batch) {
  for (const auto& t : batch) push_tensor(a.L, t);
  return static_cast<int>(batch.size());
}

const Function kLoaderMethods[] = {
    {"next", [](Args& a) { return push_batch(a, loader(a, 1)->next()); }},
    {"has_next", [](Args& a) { return a.ret(loader(a, 1)->has_next()); }},
    {"start_epoch", [](Args& a) { auto& l = loader(a, 1); l->start_epoch(a.integer(2, l->epoch() + 1)); return a.ret(); }},
    {"epoch", [](Args& a) { return a.ret(double(loader(a, 1)->epoch())); }},
    {"position", [](Args& a) { return a.ret(double(loader(a, 1)->position())); }},
    {"batches_per_epoch", [](Args& a) { return a.ret(double(loader(a, 1)->batches_per_epoch())); }},
    {"samples_seen", [](Args& a) { return a.ret(double(loader(a, 1)->samples_seen())); }},
    {"size", [](Args& a) { return a.ret(double(loader(a, 1)->dataset().size())); }},
    {"batch_size", [](Args& a) { return a.ret(double(loader(a, 1)->options().batch)); }},
    {"__tostring", [](Args& a) {
       auto& l = loader(a, 1);
       return a.ret("loader(" + l->dataset().describe() + ", batch " + std::to_string(l->options().batch) +
                    ", epoch " + std::to_string(l->epoch()) + ", batch " + std::to_string(l->position()) +
                    "/" + std::to_string(l->batches_per_epoch()) + ")"); }},
    {nullptr, nullptr}};

const Function kData[] = {
    {"mnist", [](Args& a) {
       Options t(a, 1, "mnist");
       data::MnistOptions m;
       m.root = t.string("root", m.root);
       m.split = t.string("split", m.split);
       auto o = read_loader(t);
       t.finish();
       ud_push(a.L, std::make_shared<data::Loader>(std::make_shared<data::Mnist>(m), o), PT_LOADER_MT);
       return 1; }},
    {"text", [](Args& a) {
       Options t(a, 1, "text");
       data::TextOptions x;
       x.path = t.string("path", "");
       if (x.path.empty()) throw std::invalid_argument("text needs option 'path' (the corpus file)");
       x.seq = t.integer("seq", x.seq);
       auto o = read_loader(t);
       t.finish();
       ud_push(a.L, std::make_shared<data::Loader>(std::make_shared<data::Text>(x), o), PT_LOADER_MT);
       return 1; }},
    {"read_idx", [](Args& a) { return a.ret(data::read_idx(a.string(1))); }},
    {"encode", [](Args& a) {  // bytes of a string -> int64 tensor
       std::string s = a.string(1);
       auto t = torch::empty({static_cast<int64_t>(s.size())}, torch::kUInt8);
       std::memcpy(t.data_ptr<uint8_t>(), s.data(), s.size());
       return a.ret(t.to(torch::kInt64)); }},
    {"decode", [](Args& a) {  // int tensor of byte values -> string
       auto t = a.tensor(1).reshape({-1}).to(torch::kInt64).contiguous();
       std::string s(static_cast<size_t>(t.numel()), '\0');
       const int64_t* p = t.data_ptr<int64_t>();
       for (int64_t i = 0; i < t.numel(); ++i) s[i] = static_cast<char>(p[i] & 0xff);
       return a.ret(s); }},
    {nullptr, nullptr}};

}  // namespace

void open_data(lua_State* L, int core) {
  new_metatable<LoaderPtr>(L, PT_LOADER_MT, kLoaderMethods, /*keep=*/false);
  set_library(L, core, "data", kData);
}

}  // namespace partrain::lua
