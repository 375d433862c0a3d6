// safetensors import and export: the format Hugging Face models ship in, read with every size
// bounded and every byte of the file accounted for. See ckpt.hpp.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <set>

#include <nlohmann/json.hpp>

#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/internal.hpp"
#include "engine/models/registry.hpp"
#include "engine/util/files.hpp"

namespace partrain::ckpt {

using namespace internal;

namespace {

const std::map<c10::ScalarType, std::string>& safetensors_types() {
  static const std::map<c10::ScalarType, std::string> types = {
      {torch::kFloat32, "F32"}, {torch::kFloat64, "F64"}, {torch::kFloat16, "F16"}, {torch::kBFloat16, "BF16"},
      {torch::kInt64, "I64"},   {torch::kInt32, "I32"},   {torch::kUInt8, "U8"},    {torch::kBool, "BOOL"}};
  return types;
}

constexpr uint64_t kMaxSafetensorsHeader = 100ull << 20;

// A name from a file as a message shows it: control characters (with `ascii`, every byte outside
// printable ASCII) escaped, at most 200 bytes.
std::string shown(const std::string& name, bool ascii = false) {
  std::string out;
  for (unsigned char c : name.substr(0, 200)) {
    if (c < 0x20 || c == 0x7f || (ascii && c > 0x7f)) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return name.size() > 200 ? out + "..." : out;
}

// Parses a safetensors header, refusing a key that appears twice in one object (nlohmann keeps
// the last one silently). `duplicate` names it: the tensor, or the key inside a tensor's entry.
nlohmann::json parse_header(const std::string& text, std::string* duplicate) {
  std::vector<std::set<std::string>> open;  // the keys of each object being parsed
  std::string tensor;                        // the top-level key being parsed
  auto callback = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) {
      open.emplace_back();
    } else if (event == Event::object_end) {
      if (!open.empty()) open.pop_back();
    } else if (event == Event::key && !open.empty()) {
      std::string key = parsed.get<std::string>();
      if (depth == 1) tensor = key;
      if (!open.back().insert(key).second && duplicate->empty())
        *duplicate = depth == 1 ? "tensor '" + shown(key) + "' appears twice in the header"
                                : "tensor '" + shown(tensor) + "' has the key '" + shown(key) + "' twice";
    }
    return true;
  };
  return nlohmann::json::parse(text, callback);
}

}  // namespace

namespace {

// partrain's tensors under a file's names and layouts: Hugging Face's names, its transposed
// weights turned, stacked tensors cut into their slices (Mixtral's experts). Without `hf`, as
// they are.
std::map<std::string, torch::Tensor> to_file_names(const std::map<std::string, torch::Tensor>& tensors,
                                                   const models::HfNames* hf) {
  std::map<std::string, torch::Tensor> named;  // by the file's names: sorted, as safetensors writes them
  auto add = [&](const std::string& file_name, const torch::Tensor& t) {
    TORCH_CHECK(file_name != "__metadata__", "safetensors: a tensor cannot be named '__metadata__' (the format's ",
                "name for the file's metadata): rename the parameter to export it");
    TORCH_CHECK(named.emplace(file_name, t.detach()).second, "safetensors: two tensors take the name '", file_name,
                "' in the ", hf ? hf->layout : "", " layout");
  };
  for (const auto& [name, t] : tensors) {
    if (hf && hf->slice_name && hf->slice_name(name, 0)) {
      // [n, ...] -> n tensors [...], slice i under its own name (slices are never transposed).
      TORCH_CHECK(t.dim() >= 1, "safetensors: '", name, "' is stacked in partrain and stored one ", hf->slice_noun,
                  " a tensor in the ", hf->layout, " layout, but it has no dimension to cut");
      for (int64_t i = 0; i < t.size(0); ++i) add(*hf->slice_name(name, i), t.select(0, i));
      continue;
    }
    add(hf ? hf->to_hf(name) : name, hf && hf->transposed(name) ? t.t() : t);
  }
  return named;
}

// Writes tensors under the names they have.
void write_named(const std::string& path, const std::map<std::string, torch::Tensor>& named) {
  // Over a .safetensors file only (its 8-byte header length, then the header's '{').
  auto refused = util::may_replace(path, [](const std::string& head) { return head.size() > 8 && head[8] == '{'; },
                                   "a .safetensors file");
  TORCH_CHECK(refused.empty(), "export: ", refused);
  nlohmann::json header = {{"__metadata__", {{"format", "pt"}, {"producer", "partrain"}}}};
  std::vector<torch::Tensor> blobs;
  uint64_t offset = 0;
  for (const auto& [name, t] : named) {
    auto value = t.detach().to(torch::kCPU);
    value = value.contiguous();
    auto type = safetensors_types().find(value.scalar_type());
    TORCH_CHECK(type != safetensors_types().end(), "safetensors: tensor '", name, "' has unsupported dtype ",
                value.scalar_type());
    header[name] = {{"dtype", type->second}, {"shape", value.sizes().vec()},
                    {"data_offsets", {offset, offset + value.nbytes()}}};
    offset += value.nbytes();
    blobs.push_back(value);
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text += ' ';  // data starts 8-byte aligned
  std::string bytes;
  bytes.reserve(8 + text.size() + offset);
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) bytes += static_cast<char>(n >> (8 * i));  // little-endian
  bytes += text;
  for (const auto& b : blobs) bytes.append(static_cast<const char*>(b.data_ptr()), b.nbytes());
  util::write_atomic(path, bytes);
}

}  // namespace

void write_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                       const models::HfNames* hf) {
  write_named(path, to_file_names(tensors, hf));
}

namespace {

// The tensors of one .safetensors file under the file's own names (read_safetensors's checks).
// `links`: Refuse for an index's shards, which sit beside it (a link would lead out of the folder).
std::map<std::string, torch::Tensor> read_file_names(const std::string& path, util::Links links = util::Links::Follow) {
  int fd = util::open_regular(path, "safetensors file", links);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  ::fstat(fd, &st);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  auto bad = [&](const std::string& why) { TORCH_CHECK(false, "'", path, "' ", why); };
  unsigned char len[8] = {};
  if (size < 8 || !util::read_at(fd, reinterpret_cast<char*>(len), 8, 0)) bad("is not a safetensors file (too short)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  if (n > size - 8 || n > kMaxSafetensorsHeader)
    bad("is not a safetensors file (a header of " + std::to_string(n) + " bytes in a file of " + std::to_string(size) +
        ")");
  std::string text(n, '\0');
  if (!util::read_at(fd, &text[0], n, 8)) bad("is truncated");
  if (text.empty() || text[0] != '{') bad("is not a safetensors file (its header does not start with '{')");
  // JSON has no raw NUL, and the parser would take one for the end of its input (what follows unread).
  if (auto nul = text.find('\0'); nul != std::string::npos)
    bad("has a NUL byte in its safetensors header (byte " + std::to_string(nul) + " of " + std::to_string(n) + ")");
  if (json_depth(text) > kMaxJsonDepth) bad("has a safetensors header nested deeper than " + std::to_string(kMaxJsonDepth));
  nlohmann::json header;
  std::string duplicate;
  try {
    header = parse_header(text, &duplicate);
  } catch (const std::exception& e) {
    bad("has a safetensors header that is not JSON (" + shown(e.what(), true) + ")");  // what() quotes the input
  }
  if (!duplicate.empty()) bad(duplicate);
  if (!header.is_object()) bad("has a safetensors header that is not an object");
  const uint64_t data_start = 8 + n, data_bytes = size - data_start;

  struct Entry {
    std::string name;
    c10::ScalarType type;
    std::vector<int64_t> shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      if (!info.is_object()) bad("has a __metadata__ that is not an object");
      for (const auto& [k, v] : info.items())
        if (!v.is_string()) bad("has a __metadata__ entry '" + shown(k) + "' that is not a string");
      continue;
    }
    auto fail = [&](const std::string& why) { bad("tensor '" + shown(name) + "': " + why); };
    if (name.empty()) bad("has a tensor with an empty name");
    // A control character (a NUL above all) would cut or garble every later message naming it.
    if (std::any_of(name.begin(), name.end(), [](unsigned char c) { return c < 0x20 || c == 0x7f; }))
      fail("its name holds a control character");
    if (!info.is_object()) fail("its entry is not an object");
    for (const auto& [k, v] : info.items())
      if (k != "dtype" && k != "shape" && k != "data_offsets") fail("unknown key '" + shown(k) + "'");
    if (!info.contains("dtype") || !info.contains("shape") || !info.contains("data_offsets"))
      fail("it needs dtype, shape and data_offsets");
    const auto& dtype = info["dtype"];
    if (!dtype.is_string()) fail("its dtype is not a string");
    auto type = std::find_if(safetensors_types().begin(), safetensors_types().end(),
                             [&](const auto& kv) { return kv.second == dtype.get<std::string>(); });
    if (type == safetensors_types().end()) fail("unsupported dtype " + dtype.dump());
    const auto& shape = info["shape"];
    if (!shape.is_array() || shape.size() > static_cast<size_t>(kMaxRank))
      fail("its shape is not a list of at most " + std::to_string(kMaxRank) + " sizes");
    Entry e{name, type->first, {}, 0, 0};
    for (const auto& s : shape) {
      if (!s.is_number_unsigned() || s.get<uint64_t>() > static_cast<uint64_t>(kMaxElements))
        fail("its shape " + shape.dump() + " holds something other than a non-negative integer size");
      e.shape.push_back(static_cast<int64_t>(s.get<uint64_t>()));
    }
    const auto& offsets = info["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned())
      fail("its data_offsets " + offsets.dump() + " are not two non-negative integers");
    e.begin = offsets[0].get<uint64_t>();
    e.end = offsets[1].get<uint64_t>();
    const int64_t count = volume(e.shape);
    if (count < 0) fail("its shape " + shape.dump() + " is too large");
    const uint64_t nbytes = static_cast<uint64_t>(count) * c10::elementSize(e.type);
    if (e.begin > e.end || e.end > data_bytes || e.end - e.begin != nbytes)
      fail("its data_offsets " + offsets.dump() + " do not fit its shape " + shape.dump() + " (" +
           std::to_string(nbytes) + " bytes) in the " + std::to_string(data_bytes) + " bytes of data");
    entries.push_back(std::move(e));
  }
  // The tensors' bytes, in offset order, tile the data exactly.
  std::vector<const Entry*> order;
  for (const auto& e : entries) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t at = 0;
  const Entry* previous = nullptr;
  for (const auto* e : order) {
    if (e->begin < at) bad("tensor '" + shown(e->name) + "': its bytes overlap those of '" + shown(previous->name) + "'");
    if (e->begin > at)
      bad("tensor '" + shown(e->name) + "': its bytes start at " + std::to_string(e->begin) + ", leaving a hole after " +
          (previous ? "'" + shown(previous->name) + "'" : std::string("the header")) + " (which ends at " +
          std::to_string(at) + ")");
    at = e->end;
    if (e->end > e->begin) previous = e;
  }
  if (at != data_bytes)
    bad("has " + std::to_string(data_bytes - at) + " bytes after its last tensor" +
        (previous ? " '" + shown(previous->name) + "'" : std::string()) + " (trailing garbage)");

  std::map<std::string, torch::Tensor> out;
  for (const auto& e : entries) {
    auto t = torch::empty(e.shape, torch::TensorOptions().dtype(e.type));
    if (!util::read_at(fd, static_cast<char*>(t.data_ptr()), e.end - e.begin, data_start + e.begin))
      bad("tensor '" + shown(e.name) + "': the file is truncated");
    if (e.type == torch::kBool) {
      const auto* b = static_cast<const uint8_t*>(t.data_ptr());
      for (uint64_t i = 0; i < e.end - e.begin; ++i)
        if (b[i] > 1) bad("tensor '" + shown(e.name) + "': a BOOL byte that is not 0 or 1");
    }
    out[e.name] = t;
  }
  return out;
}

// Slices of stacked tensors (Mixtral's experts) as a file names them: stacked name -> index ->
// (the file's name, the slice).
using Slices = std::map<std::string, std::map<int64_t, std::pair<std::string, torch::Tensor>>>;

// Each stacked tensor from its slices: indices 0..n-1 each present once (the file's own names
// are unique, but two of them may name one slice: with and without "model."), one shape and one
// dtype. The stack is as large as the slices already read: nothing is sized by an index.
void stack_slices(Slices& slices, const models::HfNames& hf, const std::string& where,
                  std::map<std::string, torch::Tensor>& out, std::map<std::string, std::string>& source) {
  const std::string& noun = hf.slice_noun;
  for (auto& [key, parts] : slices) {
    const auto& [name0, first] = parts.begin()->second;
    TORCH_CHECK(!source.count(key), "'", where, "' has both '", shown(source[key]), "' and '", shown(name0),
                "', which name the same tensor '", shown(key), "' (stacked, and one ", noun, " of it)");
    const int64_t n = static_cast<int64_t>(parts.size());
    int64_t next = 0;  // the first index missing from 0, 1, ...
    for (const auto& [index, part] : parts) {
      if (index != next) break;
      ++next;
    }
    if (next != n) {
      const auto& [last, part] = *parts.rbegin();
      auto missing = hf.slice_name ? hf.slice_name(key, next) : std::nullopt;
      TORCH_CHECK(false, "'", where, "' has ", noun, " ", last, " of '", shown(key), "' ('", shown(part.first),
                  "') but no ", noun, " ", next, missing ? " ('" + shown(*missing) + "')" : std::string(), ": its ", n,
                  " ", noun, "s must be numbered 0 to ", n - 1, ", each once");
    }
    std::vector<torch::Tensor> stack;
    for (auto& [index, part] : parts) {
      const auto& [name, t] = part;
      TORCH_CHECK(t.sizes().equals(first.sizes()) && t.scalar_type() == first.scalar_type(), "'", where, "' tensor '",
                  shown(name), "' is ", c10::toString(t.scalar_type()), " ", t.sizes(), ", but ", noun, " 0 of '",
                  shown(key), "' ('", shown(name0), "') is ", c10::toString(first.scalar_type()), " ", first.sizes(),
                  ": the ", noun, "s of one tensor share a shape and a dtype");
      stack.push_back(t);
    }
    source[key] = name0;
    out[key] = torch::stack(stack);
    parts.clear();  // the slices' memory goes as the stacks are made
  }
}

// Tensors under a file's names -> partrain's names and layouts (`where` names the file in errors).
std::map<std::string, torch::Tensor> to_partrain(std::map<std::string, torch::Tensor> raw, const models::HfNames* hf,
                                                 const std::string& where) {
  if (!hf) return raw;
  std::map<std::string, torch::Tensor> out;
  std::map<std::string, std::string> source;  // key -> the name in the file
  Slices slices;
  for (auto& [name, t] : raw) {
    if (auto slice = hf->sliced ? hf->sliced(name) : std::nullopt) {
      auto [at, fresh] = slices[slice->name].emplace(slice->index, std::make_pair(name, t));
      TORCH_CHECK(fresh, "'", where, "' has both '", shown(at->second.first), "' and '", shown(name),
                  "', which name the same ", hf->slice_noun, " ", slice->index, " of '", shown(slice->name), "'");
      t = torch::Tensor();
      continue;
    }
    std::string key = hf->from_hf(name);
    TORCH_CHECK(!source.count(key), "'", where, "' has both '", shown(source[key]), "' and '", shown(name),
                "', which name the same tensor '", shown(key), "'");
    source[key] = name;
    if (hf->transposed(key)) {  // GPT-2's Conv1D weights: [in, out] there, [out, in] here
      TORCH_CHECK(t.dim() == 2, "'", where, "' tensor '", shown(name), "': a Conv1D weight must have 2 dimensions, not ",
                  t.dim());
      t = t.t().contiguous();
    }
    out[key] = t;
  }
  stack_slices(slices, *hf, where, out, source);
  return out;
}

constexpr uint64_t kMaxIndexBytes = 64ull << 20;  // a model.safetensors.index.json
constexpr size_t kMaxShards = 100000;

}  // namespace

std::map<std::string, torch::Tensor> read_safetensors(const std::string& path, const models::HfNames* hf) {
  return to_partrain(read_file_names(path), hf, path);
}

std::map<std::string, torch::Tensor> read_safetensors_index(const std::string& index_path, const models::HfNames* hf) {
  auto bad = [&](const std::string& why) { TORCH_CHECK(false, "'", index_path, "' ", why); };
  std::string text = util::read_regular(index_path, "safetensors index", kMaxIndexBytes);
  if (json_depth(text) > kMaxJsonDepth) bad("is nested deeper than " + std::to_string(kMaxJsonDepth));
  nlohmann::json index;
  std::string duplicate;
  try {
    index = parse_header(text, &duplicate);
  } catch (const std::exception& e) {
    bad("is not JSON (" + shown(e.what(), true) + ")");
  }
  if (!duplicate.empty()) bad("names a tensor twice in its weight_map");
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    bad("is not a safetensors index (expected an object with a weight_map of tensor name -> file)");
  const auto slash = index_path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : index_path.substr(0, slash + 1);
  std::map<std::string, std::set<std::string>> files;  // file -> the tensors the map puts there
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string()) bad("maps tensor '" + shown(name) + "' to something other than a file name");
    auto f = file.get<std::string>();
    // Files sit beside the index: a name with a slash, "..", or a hidden name would lead elsewhere.
    if (!util::safe_name(f)) bad("maps tensor '" + shown(name) + "' to '" + shown(f) + "', not a plain file name beside it");
    files[f].insert(name);
    if (files.size() > kMaxShards) bad("names more than " + std::to_string(kMaxShards) + " files");
  }
  if (files.empty()) bad("has an empty weight_map");
  std::map<std::string, torch::Tensor> raw;
  for (const auto& [file, names] : files) {
    const std::string path = (dir == "." ? "" : dir) + file;
    for (auto& [name, t] : read_file_names(path, util::Links::Refuse)) {
      if (!names.count(name))
        TORCH_CHECK(false, "'", path, "' holds tensor '", shown(name), "', which the index '", index_path, "' ",
                    index["weight_map"].contains(name) ? "puts in another file" : "does not list");
      raw[name] = t;
    }
    for (const auto& name : names)
      TORCH_CHECK(raw.count(name), "'", path, "' lacks tensor '", shown(name), "', which the index '", index_path,
                  "' puts there");
  }
  return to_partrain(std::move(raw), hf, index_path);
}

void write_safetensors_sharded(const std::string& dir, const std::map<std::string, torch::Tensor>& tensors,
                               const models::HfNames* hf, int64_t max_shard_bytes) {
  TORCH_CHECK(max_shard_bytes > 0, "safetensors: the largest shard must be > 0 bytes, got ", max_shard_bytes);
  TORCH_CHECK(util::is_plain_dir(dir), "safetensors: '", dir, "' is not a folder (a sharded export writes its files there)");
  // Tensors in Hugging Face's name order (a stacked one as its slices), a new file when the next
  // would pass the limit (a tensor larger than the limit sits alone in its file).
  std::vector<std::map<std::string, torch::Tensor>> shards(1);  // by the file's names
  int64_t bytes = 0, total = 0;
  for (const auto& [file_name, t] : to_file_names(tensors, hf)) {
    const int64_t n = static_cast<int64_t>(t.nbytes());
    if (bytes > 0 && bytes + n > max_shard_bytes) {
      shards.emplace_back();
      bytes = 0;
    }
    shards.back()[file_name] = t;
    bytes += n;
    total += n;
  }
  nlohmann::json weight_map = nlohmann::json::object();
  const size_t count = shards.size();
  auto file_of = [&](size_t i) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, count);
    return std::string(name);
  };
  for (size_t i = 0; i < count; ++i) {
    write_named(dir + "/" + file_of(i), shards[i]);
    for (const auto& [name, t] : shards[i]) weight_map[name] = file_of(i);
  }
  nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  util::write_atomic(dir + "/model.safetensors.index.json", index.dump(2) + "\n");
}

}  // namespace partrain::ckpt
