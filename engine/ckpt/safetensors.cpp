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

// A name from a file as a message shows it: control characters escaped, at most 200 bytes.
std::string shown(const std::string& name) {
  std::string out;
  for (unsigned char c : name.substr(0, 200)) {
    if (c < 0x20 || c == 0x7f) {
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

void write_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                       const models::HfNames* hf) {
  nlohmann::json header = {{"__metadata__", {{"format", "pt"}, {"producer", "partrain"}}}};
  std::vector<torch::Tensor> blobs;
  uint64_t offset = 0;
  std::map<std::string, torch::Tensor> named;  // by the file's names: sorted, as safetensors writes them
  for (const auto& [name, t] : tensors) {
    auto hf_name = hf ? hf->to_hf(name) : name;
    TORCH_CHECK(named.emplace(hf_name, hf && hf->transposed(name) ? t.detach().t() : t).second, "safetensors: ",
                "two tensors take the name '", hf_name, "' in the ", hf ? hf->layout : "", " layout");
  }
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

std::map<std::string, torch::Tensor> read_safetensors(const std::string& path, const models::HfNames* hf) {
  int fd = util::open_regular(path, "safetensors file");
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  ::fstat(fd, &st);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  auto bad = [&](const std::string& why) { TORCH_CHECK(false, "'", path, "' ", why); };
  unsigned char len[8] = {};
  if (size < 8 || !read_at(fd, reinterpret_cast<char*>(len), 8, 0)) bad("is not a safetensors file (too short)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  if (n > size - 8 || n > kMaxSafetensorsHeader)
    bad("is not a safetensors file (a header of " + std::to_string(n) + " bytes in a file of " + std::to_string(size) +
        ")");
  std::string text(n, '\0');
  if (!read_at(fd, &text[0], n, 8)) bad("is truncated");
  if (text.empty() || text[0] != '{') bad("is not a safetensors file (its header does not start with '{')");
  if (json_depth(text) > kMaxJsonDepth) bad("has a safetensors header nested deeper than " + std::to_string(kMaxJsonDepth));
  nlohmann::json header;
  std::string duplicate;
  try {
    header = parse_header(text, &duplicate);
  } catch (const std::exception& e) {
    bad(std::string("has a safetensors header that is not JSON (") + e.what() + ")");
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
  std::map<std::string, std::string> source;  // key -> the name in the file
  for (const auto& e : entries) {
    std::string key = e.name;
    if (hf) key = hf->from_hf(key);
    if (source.count(key))
      bad("has both '" + shown(source[key]) + "' and '" + shown(e.name) + "', which name the same tensor '" + shown(key) +
          "'");
    source[key] = e.name;
    auto t = torch::empty(e.shape, torch::TensorOptions().dtype(e.type));
    if (!read_at(fd, static_cast<char*>(t.data_ptr()), e.end - e.begin, data_start + e.begin))
      bad("tensor '" + shown(e.name) + "': the file is truncated");
    if (e.type == torch::kBool) {
      const auto* b = static_cast<const uint8_t*>(t.data_ptr());
      for (uint64_t i = 0; i < e.end - e.begin; ++i)
        if (b[i] > 1) bad("tensor '" + shown(e.name) + "': a BOOL byte that is not 0 or 1");
    }
    if (hf && hf->transposed(key)) {  // GPT-2's Conv1D weights: [in, out] there, [out, in] here
      if (t.dim() != 2) bad("tensor '" + shown(e.name) + "': a Conv1D weight must have 2 dimensions, not " +
                                 std::to_string(t.dim()));
      t = t.t().contiguous();
    }
    out[key] = t;
  }
  return out;
}

}  // namespace partrain::ckpt
