// Data loaders in Lua (pt.data.mnist, pt.data.text, pt.data.tokens) and byte conversions: thin userdata over the
// engine's loaders; batching stays in C++, and batches land on the rank's device.
#include <cstring>
#include <iomanip>
#include <sstream>

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
  o.context_rank = t.integer("context_rank", o.context_rank);
  o.context_count = t.integer("context_count", o.context_count);
  o.device = dist::World::instance().device();  // batches land on this rank's device
  // mesh = m: this rank reads its data-parallel slice; the ranks of one unit read the same one.
  if (t.push("mesh")) {
    bool is_mesh = mesh_data_shard(t.state(), -1, &o.shard_rank, &o.shard_count, &o.context_rank, &o.context_count);
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

// pt.data.text { path, seq, split, val_fraction, ... } (bytes) and pt.data.tokens { ..., dtype,
// header } (pre-tokenized ids): one corpus reader, then the loader options.
int push_corpus(Args& a, const char* what, bool tokens) {
  Options t(a, 1, what);
  data::TextOptions x;
  x.path = t.string("path", "");
  if (x.path.empty()) throw std::invalid_argument(std::string(what) + " needs option 'path' (the corpus file)");
  x.seq = t.integer("seq", x.seq);
  if (tokens) {
    std::string dtype = t.string("dtype", "uint16");
    if (dtype == "uint16") x.dtype = data::TextOptions::Storage::UInt16;
    else if (dtype == "int32") x.dtype = data::TextOptions::Storage::Int32;
    else if (dtype == "uint8") x.dtype = data::TextOptions::Storage::UInt8;
    else throw std::invalid_argument("tokens: dtype must be 'uint16', 'int32' or 'uint8', got '" + dtype + "'");
    // header: "auto" (llm.c's when its magic number is there), "none", or bytes to skip.
    x.header = -1;
    if (t.push("header")) {
      lua_State* L = t.state();
      if (lua_type(L, -1) == LUA_TSTRING && std::string(lua_tostring(L, -1)) == "none") x.header = 0;
      else if (lua_type(L, -1) == LUA_TSTRING && std::string(lua_tostring(L, -1)) == "auto") x.header = -1;
      else if (lua_type(L, -1) == LUA_TNUMBER && lua_tonumber(L, -1) >= 0 &&
               lua_tonumber(L, -1) == static_cast<double>(static_cast<int64_t>(lua_tonumber(L, -1))))
        x.header = static_cast<int64_t>(lua_tonumber(L, -1));
      else {
        std::ostringstream got;  // the value (a string as the key reader shows it), or its type
        if (lua_type(L, -1) == LUA_TNUMBER) got << std::setprecision(14) << lua_tonumber(L, -1);
        else if (lua_type(L, -1) == LUA_TSTRING) got << key_text(L, -1);
        else got << "a " << luaL_typename(L, -1);
        lua_pop(L, 1);
        throw std::invalid_argument("tokens: header must be 'auto', 'none' or a whole number of bytes >= 0, got " + got.str());
      }
      lua_pop(L, 1);
    }
  }
  // split: the whole corpus, or its first (train) or last (val) part, val_fraction of the tokens.
  std::string split = t.string("split", "all");
  double fraction = t.number("val_fraction", 0.1);
  if (!(fraction > 0 && fraction < 1))
    throw std::invalid_argument(std::string(what) + ": val_fraction must be in (0, 1), got " + std::to_string(fraction));
  if (split == "train") x.end = 1 - fraction;
  else if (split == "val") x.begin = 1 - fraction;
  else if (split != "all")
    throw std::invalid_argument(std::string(what) + ": split must be 'all', 'train' or 'val', got '" + split + "'");
  auto o = read_loader(t);
  t.finish();
  ud_push(a.L, std::make_shared<data::Loader>(std::make_shared<data::Text>(x), o), PT_LOADER_MT);
  return 1;
}

const Function kLoaderMethods[] = {
    {"next", [](Args& a) { return push_batch(a, loader(a, 1)->next()); }},
    {"has_next", [](Args& a) { return a.ret(loader(a, 1)->has_next()); }},
    {"start_epoch", [](Args& a) { auto& l = loader(a, 1); l->start_epoch(a.integer(2, l->epoch() + 1)); return a.ret(); }},
    {"epoch", [](Args& a) { return a.ret(double(loader(a, 1)->epoch())); }},
    {"position", [](Args& a) { return a.ret(double(loader(a, 1)->position())); }},
    // _place(epoch, position): back to exactly there (pt.evaluate's restore)
    {"_place", [](Args& a) { loader(a, 1)->set_place(a.integer(2), a.integer(3)); return a.ret(); }},
    {"batches_per_epoch", [](Args& a) { return a.ret(double(loader(a, 1)->batches_per_epoch())); }},
    {"samples_seen", [](Args& a) { return a.ret(double(loader(a, 1)->samples_seen())); }},
    {"seek", [](Args& a) {  // seek(samples): continue as after that many global samples
       int64_t n = a.integer(2);
       if (n < 0) a.fail(2, "samples must be >= 0, got " + std::to_string(n));
       // The loader moves by whole batches: a count between two had been rounded down, and the
       // samples between seen again without a word. (A checkpoint's resume says so in a note.)
       auto& l = loader(a, 1);
       if (int64_t lands = l->seek_lands_at(n); lands != n)
         a.fail(2, std::to_string(n) + " samples do not end a batch of " + std::to_string(l->options().batch) +
                       " (the loader moves by whole batches): seek to " + std::to_string(lands) + " or " +
                       std::to_string(l->seek_next_after(n)));
       l->seek(n);
       return a.ret(); }},
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
    {"text", [](Args& a) { return push_corpus(a, "text", /*tokens=*/false); }},
    {"tokens", [](Args& a) { return push_corpus(a, "tokens", /*tokens=*/true); }},
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
