// pt.ckpt's C++ half: saving and loading sharded checkpoints, inspecting and verifying them, and
// safetensors import and export. The Lua half (init.lua) adds the defaults (the model's mesh,
// its policy) and resume.
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <set>
#include <sstream>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "bindings/lua.hpp"
#include "engine/ckpt/ckpt.hpp"
#include "engine/data/data.hpp"
#include "engine/dist/world.hpp"
#include "engine/models/registry.hpp"
#include "engine/optim/optim.hpp"
#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/util/files.hpp"
#include "engine/util/text.hpp"

namespace partrain::lua {

namespace {

// The Hugging Face names of the model's family (by its root's type), or nullptr: names as they are.
const models::HfNames* hf_names(const nn::Module& model) {
  const auto* family = models::family_of_type(model.type());
  return family && family->has_hf() ? &family->hf : nullptr;
}

// Whether the model's tensors `tied` and `source` are one tensor (GPT-2's lm_head and wte always;
// LLaMA's lm_head and embed_tokens only when built with tie = true).
bool ties(nn::Module& model, const std::string& tied, const std::string& source) {
  auto a = model.find(tied.substr(0, tied.rfind('.'))), b = model.find(source.substr(0, source.rfind('.')));
  if (!a || !b) return false;
  auto x = a->own_tensor(tied.substr(tied.rfind('.') + 1)), y = b->own_tensor(source.substr(source.rfind('.') + 1));
  return x.defined() && y.defined() && x.is_same(y);
}

using nlohmann::json;

// A Lua value made of numbers, strings, booleans and tables of them, as JSON (loading a
// checkpoint must never run code, so user values are data only).
json json_of(lua_State* L, int idx, const std::string& where, int depth = 0) {
  idx = idx < 0 ? lua_gettop(L) + idx + 1 : idx;
  if (depth > 32) throw std::invalid_argument(where + " nests too deep");
  switch (lua_type(L, idx)) {
    case LUA_TNUMBER: {
      double x = lua_tonumber(L, idx);
      if (!std::isfinite(x))  // JSON has no NaN or infinity: it had come back as nil
        throw std::invalid_argument(where + " is " + (x != x ? "NaN" : "infinite") + ": user values hold finite numbers");
      if (std::abs(x) < 9.0e15 && x == std::trunc(x)) return static_cast<int64_t>(x);
      return x;
    }
    case LUA_TSTRING: return std::string(lua_tostring(L, idx));
    case LUA_TBOOLEAN: return static_cast<bool>(lua_toboolean(L, idx));
    case LUA_TTABLE: {
      const int n = static_cast<int>(lua_objlen(L, idx));
      if (n > 0) {
        // A list is its elements 1..n in order, and nothing else: a list with holes ({[1] = 1,
        // [3] = 3}) or named fields beside it would not come back as it was.
        std::string stray = stray_key(L, idx, n);
        if (!stray.empty())
          throw std::invalid_argument(where + " is not a list of elements 1 to " + std::to_string(n) +
                                      " alone: it also has the key " + stray + " (a hole, or a named field beside the list)");
        json out = json::array();
        for (int i = 1; i <= n; ++i) {
          lua_rawgeti(L, idx, i);
          out.push_back(json_of(L, -1, where + "[" + std::to_string(i) + "]", depth + 1));
          lua_pop(L, 1);
        }
        return out;
      }
      json out = json::object();
      lua_pushnil(L);
      while (lua_next(L, idx)) {
        if (lua_type(L, -2) != LUA_TSTRING) throw std::invalid_argument(where + " has a key that is not a string");
        std::string key = lua_tostring(L, -2);
        out[key] = json_of(L, -1, where + "." + key, depth + 1);
        lua_pop(L, 1);
      }
      return out;
    }
    default:
      throw std::invalid_argument(where + " holds a " + luaL_typename(L, idx) +
                                  ": user values must be numbers, strings, booleans or tables of them");
  }
}

void push_json(lua_State* L, const json& j) {
  if (j.is_boolean()) lua_pushboolean(L, j.get<bool>());
  else if (j.is_number()) lua_pushnumber(L, j.get<double>());
  else if (j.is_string()) lua_pushstring(L, j.get<std::string>().c_str());
  else if (j.is_array()) {
    lua_createtable(L, static_cast<int>(j.size()), 0);
    int i = 0;
    for (const auto& v : j) {
      push_json(L, v);
      lua_rawseti(L, -2, ++i);
    }
  } else if (j.is_object()) {
    lua_createtable(L, 0, static_cast<int>(j.size()));
    for (const auto& [k, v] : j.items()) {
      push_json(L, v);
      lua_setfield(L, -2, k.c_str());
    }
  } else {
    lua_pushnil(L);
  }
}

// A pipelined model's stages hold parts of the model under their serial names; a tensor tied
// across stages (GPT-2's lm_head on the last stage, wte on the first) goes by its first name.
const parallel::Pipeline* pipeline_of(const nn::Module& m) {
  auto pm = parallel::ParallelModel::of(m);
  return pm ? pm->pipeline().get() : nullptr;
}


// The logical tensors this rank contributes to an export: its state (tensor-parallel parts
// gathered), by logical name, a tensor tied across stages only from the first rank holding it.
// Under ZeRO-3 every unit is gathered for the read (the file holds the whole model anyway) and
// the tensors are copies, which outlive the gather.
std::map<std::string, torch::Tensor> exported_tensors(nn::Module& m) {
  auto fsdp = parallel::ParallelModel::fsdp_of(m);
  parallel::Fsdp::Gathered gathered(fsdp, /*writeback=*/false);
  auto full = parallel::full_state_dict(m);
  if (fsdp)
    for (auto& [name, t] : full) t = t.detach().clone();
  const auto* pipe = pipeline_of(m);
  if (!pipe) return {full.begin(), full.end()};
  std::map<std::string, torch::Tensor> out;
  auto own = m.state_dict();
  for (const auto& [name, t] : full)
    if (pipe->first_holder(own.at(name))) out[pipe->logical_name(name)] = t;
  return out;
}

// Every stage's tensors to the first stage of each pipeline group, one tensor at a time (each
// stage's list first: names, dtypes and shapes), so that world rank 0 holds the whole model.
void gather_stages(const parallel::Pipeline& pipe, std::map<std::string, torch::Tensor>& tensors) {
  std::string mine;
  for (const auto& [name, t] : tensors) {
    mine += name + "\t" + std::to_string(static_cast<int>(t.scalar_type()));
    for (auto d : t.sizes()) mine += "\t" + std::to_string(d);
    mine += "\n";
  }
  auto lists = dist::all_gather_strings(pipe.group(), mine);
  torch::NoGradGuard no_grad;
  for (int stage = 1; stage < static_cast<int>(lists.size()); ++stage) {
    std::istringstream lines(lists[stage]);
    for (std::string line; std::getline(lines, line);) {
      std::istringstream fields(line);
      std::string name, field;
      std::getline(fields, name, '\t');
      std::getline(fields, field, '\t');
      auto dtype = static_cast<torch::ScalarType>(std::stoi(field));
      std::vector<int64_t> shape;
      while (std::getline(fields, field, '\t')) shape.push_back(std::stoll(field));
      torch::Tensor t = pipe.rank() == stage ? tensors.at(name).contiguous()
                                             : torch::empty(shape, torch::TensorOptions().dtype(dtype).device(
                                                                       dist::World::instance().device()));
      pipe.group()->broadcast(t, stage);
      if (pipe.rank() == 0) tensors[name] = t.cpu();
    }
  }
}

// { model =, optim =, data =, mesh = } at `idx` into a State (the table's other keys are the
// caller's to read).
ckpt::State state_of(Args& a, Options& t) {
  ckpt::State s;
  lua_State* L = a.L;
  if (!t.push("model")) throw std::invalid_argument("'model' is required (the module to save or load)");
  auto* m = ud_test<nn::ModulePtr>(L, -1, PT_MODULE_MT);
  if (!m) throw std::invalid_argument("'model' must be a module");
  s.model = m->get();
  lua_pop(L, 1);
  if (t.push("optim")) {
    auto* o = ud_test<std::shared_ptr<optim::Optimizer>>(L, -1, PT_OPTIMIZER_MT);
    if (!o && !lua_isnil(L, -1)) throw std::invalid_argument("'optim' must be an optimizer");
    if (o) s.optimizer = o->get();
    lua_pop(L, 1);
    // The model's optimizer, not another's: its state would be saved as this model's (another
    // model's AdamW after one step loaded as a step count with no moments).
    if (o) {
      auto made_for = model_of_optimizer(o->get());
      bool ours = made_for && made_for.get() == s.model;
      if (!ours) {  // made from a table of tensors or a module of the model: they must be this model's
        std::unordered_set<const c10::TensorImpl*> mine;
        for (const auto& p : s.model->parameters(/*recurse=*/true)) mine.insert(p.unsafeGetTensorImpl());
        ours = std::all_of((*o)->params().begin(), (*o)->params().end(),
                           [&](const torch::Tensor& p) { return mine.count(p.unsafeGetTensorImpl()) > 0; });
      }
      if (!ours)
        throw std::invalid_argument("'optim' is not an optimizer of this model (it was made for " +
                                    (made_for ? "a " + made_for->type() : std::string("other tensors")) +
                                    "): give the optimizer made from the model");
    }
  }
  if (t.push("data")) {
    auto* d = ud_test<std::shared_ptr<data::Loader>>(L, -1, PT_LOADER_MT);
    if (!d && !lua_isnil(L, -1)) throw std::invalid_argument("'data' must be a data loader");
    if (d) s.data = d->get();
    lua_pop(L, 1);
  }
  if (t.push("mesh")) {
    s.mesh = mesh_at(L, -1);
    if (!s.mesh && !lua_isnil(L, -1)) throw std::invalid_argument("'mesh' must be a mesh");
    lua_pop(L, 1);
  }
  return s;
}

void push_strings(lua_State* L, const std::vector<std::string>& list) {
  lua_createtable(L, static_cast<int>(list.size()), 0);
  for (size_t i = 0; i < list.size(); ++i) {
    lua_pushstring(L, list[i].c_str());
    lua_rawseti(L, -2, static_cast<int>(i + 1));
  }
}

int push_loaded(Args& a, const ckpt::Loaded& l) {
  lua_createtable(a.L, 0, 4);
  push_strings(a.L, l.notes);
  lua_setfield(a.L, -2, "notes");
  lua_pushstring(a.L, l.tag.c_str());
  lua_setfield(a.L, -2, "tag");
  lua_pushnumber(a.L, static_cast<double>(l.step));
  lua_setfield(a.L, -2, "step");
  push_json(a.L, json::parse(l.user_json.empty() ? "{}" : l.user_json));
  lua_setfield(a.L, -2, "user");
  return 1;
}

const Function kCkpt[] = {
    // save(dir, { model, optim, data, mesh, step, user, full, num_kept, tag, overwrite, policy })
    // -> tag, notes
    {"save", [](Args& a) {
       std::string dir = a.string(1);
       Options t(a, 2, "pt.ckpt.save");
       ckpt::State s = state_of(a, t);
       s.step = t.integer("step", 0);
       s.policy = t.string("policy", "");
       if (t.push("user")) {
         s.user_json = json_of(a.L, -1, "user").dump();
         lua_pop(a.L, 1);
       }
       ckpt::SaveOptions o;
       o.full = t.boolean("full", false);
       o.num_kept = t.int32("num_kept", 0);
       if (o.num_kept < 0) throw std::invalid_argument("num_kept must be >= 0 (0 keeps every checkpoint)");
       if (t.has("tag") && t.string("tag", "").empty())
         throw std::invalid_argument("bad checkpoint tag '': leave 'tag' out for step-<step>");
       o.tag = t.string("tag", "");
       o.overwrite = t.boolean("overwrite", false);
       t.finish();
       auto saved = ckpt::save(dir, s, o);
       lua_pushstring(a.L, saved.tag.c_str());
       push_strings(a.L, saved.notes);
       return 2; }},
    // load(dir, tag or nil, { model, optim, data, mesh }) -> { tag, step, user }
    {"load", [](Args& a) {
       std::string dir = a.string(1);
       std::string tag = a.none(2) ? "" : a.string(2);
       Options t(a, 3, "pt.ckpt.load");
       ckpt::State s = state_of(a, t);
       t.finish();
       return push_loaded(a, ckpt::load(dir, tag, s)); }},
    // resume(dir, { model, optim, data, mesh }) -> { tag, step, user, notes }, or nil when dir
    // holds no checkpoint at all
    {"resume", [](Args& a) {
       std::string dir = a.string(1);
       Options t(a, 2, "pt.ckpt.resume");
       ckpt::State s = state_of(a, t);
       t.finish();
       ckpt::Loaded loaded;
       if (!ckpt::resume(dir, s, &loaded)) { lua_pushnil(a.L); return 1; }
       return push_loaded(a, loaded); }},
    {"newest", [](Args& a) {  // the tag dir/newest names (intact, a safe name), or nil
       auto tag = ckpt::newest(a.string(1));
       if (tag.empty()) { lua_pushnil(a.L); return 1; }
       return a.ret(tag); }},
    {"tags", [](Args& a) { push_strings(a.L, ckpt::tags(a.string(1))); return 1; }},
    {"describe", [](Args& a) { return a.ret(ckpt::describe(ckpt::read_manifest(a.string(1)))); }},  // a tag folder
    // verify(path) -> ok, problems ("path: what", one a string): a tag folder, or a checkpoint
    // folder with every tag and `newest`
    {"verify", [](Args& a) {
       std::string path = a.string(1);
       std::vector<std::string> problems;
       struct stat st;
       if (::lstat((path + "/manifest.bin").c_str(), &st) == 0) {
         for (const auto& p : ckpt::verify(path)) problems.push_back(path + ": " + p);
       } else {
         for (const auto& f : ckpt::verify_folder(path))
           if (f.problem) problems.push_back(f.path + ": " + f.message);
       }
       lua_pushboolean(a.L, problems.empty());
       push_strings(a.L, problems);
       return 2; }},
    // export_safetensors(model, path): the logical weights (a collective over each tensor group;
    // rank 0 writes), in Hugging Face GPT-2's layout for GPT-2 models.
    {"export_safetensors", [](Args& a) {
       auto& m = a.module(1);
       std::string path = a.string(2);
       Options o(a, 3, "export_safetensors");
       double shard_mb = o.number("max_shard_size", 0);
       o.finish();
       if (o.has("max_shard_size") && !(shard_mb > 0 && shard_mb < 1e9))
         a.fail(3, "max_shard_size must be a number of MB > 0, got " + std::to_string(shard_mb));
       auto tensors = exported_tensors(*m);
       if (const auto* pipe = pipeline_of(*m)) gather_stages(*pipe, tensors);
       const auto* hf = hf_names(*m);
       if (hf)
         for (const auto& [tied, source] : hf->tied)
           if (ties(*m, tied, source)) tensors.erase(tied);  // Hugging Face stores the source alone
       auto& world = dist::World::instance();
       std::string failed;  // rank 0's error, or ""
       if (world.initialized() ? world.rank() == 0 : true) {
         try {
           if (shard_mb > 0) {
             if (!util::is_plain_dir(path) && ::mkdir(path.c_str(), 0755) != 0)
               throw std::runtime_error("cannot make the folder '" + path + "' for a sharded export: " +
                                        std::strerror(errno));
             ckpt::write_safetensors_sharded(path, tensors, hf, static_cast<int64_t>(shard_mb * 1024 * 1024));
           } else {
             ckpt::write_safetensors(path, tensors, hf);
           }
         } catch (const std::exception& e) {
           failed = e.what();
           if (failed.empty()) failed = "failed";
         }
       }
       // Every rank returns once the file is in place (a rank reading it next must find it), or
       // fails with rank 0's error.
       if (world.initialized()) failed = dist::all_gather_strings(world.world(), failed).front();
       if (!failed.empty()) throw std::runtime_error(failed);
       return a.ret(); }},
    // import_safetensors(model, path): loads logical weights into the (possibly split) model.
    {"import_safetensors", [](Args& a) {
       auto& m = a.module(1);
       std::string path = a.string(2);
       const auto* hf = hf_names(*m);
       // A file, an index, or a folder holding an index (a sharded model) or model.safetensors.
       std::string source = path;
       if (util::is_plain_dir(path)) {
         source = path + "/model.safetensors.index.json";
         if (!util::is_regular(source)) source = path + "/model.safetensors";
         if (!util::is_regular(source))
           throw std::runtime_error("importing '" + path + "': the folder holds neither model.safetensors.index.json nor "
                                    "model.safetensors");
       }
       const std::string index_end = ".index.json";
       bool index = source.size() >= index_end.size() &&
                    source.compare(source.size() - index_end.size(), index_end.size(), index_end) == 0;
       // Each rank takes the tensors it holds by their logical names (a pipeline's stages: a tied
       // tensor by its first name); the names are checked against the whole model's, every stage's.
       const auto* pipe = pipeline_of(*m);
       auto targets = m->state_dict();
       std::map<std::string, std::string> logical;  // this rank's name -> the whole model's
       std::set<std::string> whole;
       for (const auto& [name, t] : targets) whole.insert(logical[name] = pipe ? pipe->logical_name(name) : name);
       if (pipe) {
         std::string mine;
         for (const auto& name : whole) mine += name + "\n";
         for (const auto& list : dist::all_gather_strings(pipe->group(), mine)) {
           std::istringstream lines(list);
           for (std::string line; std::getline(lines, line);) whole.insert(line);
         }
       }
       auto tied_in_model = [&](const std::string& tied, const std::string& source) {
         return pipe ? !whole.count(tied) && whole.count(source) : ties(*m, tied, source);
       };
       // Everything is checked on every rank before anything is copied, so a refused file changes
       // nothing anywhere: the names both ways, the logical shapes, and the kinds (a value converts
       // only within its kind: floating point to floating point, an integer or a boolean only to
       // the same dtype).
       nn::TensorMap local;
       std::string failed;
       try {
         auto tensors = index ? ckpt::read_safetensors_index(source, hf) : ckpt::read_safetensors(source, hf);
         nn::TensorMap state(tensors.begin(), tensors.end());
         auto fail = [&](const std::string& why) { throw std::runtime_error("importing '" + path + "': " + why); };
         for (const auto& [tied, source] : hf ? hf->tied : decltype(hf->tied){}) {
           if (!state.count(source) || !tied_in_model(tied, source)) continue;  // an untied head is its own tensor
           // A tied tensor (GPT-2's lm_head, tied to wte): a file may leave it out, or hold the same values.
           if (state.count(tied) && (!state[tied].sizes().equals(state[source].sizes()) ||
                                     !state[tied].to(torch::kFloat64).equal(state[source].to(torch::kFloat64))))
             fail("tensor '" + tied + "' differs from '" + source + "', to which the model ties it");
           if (pipe) state.erase(tied);  // the stages know it by its first name
           else if (!state.count(tied)) state[tied] = state[source];
         }
         // Tensors Hugging Face's files may carry that partrain computes (GPT-2's causal-mask buffers).
         if (hf && hf->ignored)
           for (auto it = state.begin(); it != state.end();) it = hf->ignored(it->first) ? state.erase(it) : std::next(it);
         for (const auto& [name, t] : state)
           if (!whole.count(name)) fail("tensor '" + name + "' is not in the model (a " + m->type() + ")");
         for (const auto& name : whole)
           if (!state.count(name)) fail("the file has no tensor '" + name + "' (the model's)");
         for (const auto& [name, target] : targets) {
           const auto& t = state.at(logical.at(name));
           auto split = parallel::sharding_of(*m, name);
           auto shape = split ? split->shape : target.sizes().vec();
           if (!t.sizes().equals(shape)) {
             // A stack of another length: the file numbers other slices than the model holds.
             auto slice = hf && hf->slice_name ? hf->slice_name(logical.at(name), 0) : std::nullopt;
             const bool other_count = t.dim() >= 1 && t.size(0) >= 1 && !shape.empty() &&
                                      t.sizes().slice(1).equals(c10::IntArrayRef(shape).slice(1));
             if (slice && other_count)
               fail("tensor '" + logical.at(name) + "' has " + std::to_string(t.size(0)) + " " + hf->slice_noun +
                    "s in the file ('" + *slice + "' to '" + *hf->slice_name(logical.at(name), t.size(0) - 1) +
                    "'); the model has " + std::to_string(shape[0]) + " (numbered 0 to " +
                    std::to_string(shape[0] - 1) + ")");
             fail("tensor '" + logical.at(name) + "' has shape " + c10::str(t.sizes()) + "; the model's is " +
                  c10::str(c10::IntArrayRef(shape)));
           }
           auto want = target.scalar_type(), got = t.scalar_type();
           if (c10::isFloatingType(want) ? !c10::isFloatingType(got) : want != got)
             fail("tensor '" + logical.at(name) + "' is " + c10::toString(got) + "; the model's is " + c10::toString(want));
           local[name] = t;
         }
       } catch (const std::exception& e) {
         failed = util::message_of(e);
         if (failed.empty()) failed = "importing '" + path + "' failed";
       }
       // A stage refuses for every rank (another stage's tensor may be the wrong one).
       if (pipe)
         for (const auto& f : dist::all_gather_strings(dist::World::instance().world(), failed))
           if (!f.empty()) {
             failed = f;
             break;
           }
       if (!failed.empty()) throw std::runtime_error(failed);
       try {
         // Under ZeRO-3 every unit is gathered for the write and each rank's shards take it.
         parallel::Fsdp::Gathered gathered(parallel::ParallelModel::fsdp_of(*m), /*writeback=*/true);
         parallel::load_full_state_dict(*m, local, /*strict=*/true);  // any other unknown or missing name fails
       } catch (const std::exception& e) {
         throw std::runtime_error("importing '" + path + "': " + util::message_of(e));
       }
       return a.ret(); }},
    {nullptr, nullptr}};

}  // namespace

void open_ckpt(lua_State* L, int core) { set_library(L, core, "ckpt", kCkpt); }

}  // namespace partrain::lua
