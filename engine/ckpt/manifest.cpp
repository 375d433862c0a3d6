// The manifest: the file that says what a checkpoint holds (its header, its versions, its bounds),
// read and written, and its summary for people. Checking what it claims is in validate.cpp.
#include <zlib.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include <cereal/archives/binary.hpp>

#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/internal.hpp"
#include "engine/ckpt/serialize.hpp"
#include "engine/util/bounded_archive.hpp"
#include "engine/util/files.hpp"

namespace partrain::ckpt {

const TensorEntry* Manifest::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

namespace internal {

namespace {

const char kMagic[] = "partrain-checkpoint";
constexpr size_t kMagicLength = sizeof kMagic - 1;
// The manifest file: u64 magic length, magic, u32 version, u64 payload length, u32 CRC-32 of
// the payload, payload (cereal binary). Versions 1 and 2 share the first 31 bytes.
constexpr size_t kVersionEnd = 8 + kMagicLength + 4;
constexpr size_t kHeaderBytes = kVersionEnd + 8 + 4;
constexpr uint64_t kMaxManifestBytes = 256ull << 20;

// A configuration value as people write it: the shorter of %.6g and %.17g that reads back exactly.
std::string value_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  if (std::strtod(buf, nullptr) != v) std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string manifest_bytes(const Manifest& m) {
  std::string body = util::to_bytes(m);
  std::ostringstream out(std::ios::binary);
  {
    cereal::BinaryOutputArchive ar(out);
    uint64_t length = body.size();
    uint32_t crc = crc_of(body.data(), body.size());
    ar(std::string(kMagic), kFormatVersion, length, crc);  // always the current layout
  }
  std::string head = out.str();
  TORCH_CHECK(head.size() == kHeaderBytes, "internal: manifest header of ", head.size(), " bytes");
  return head + body;
}

}  // namespace

std::string hex32(uint32_t x) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", x);
  return buf;
}

uint32_t crc_of(const void* data, size_t n) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  const Bytef* p = static_cast<const Bytef*>(data);
  while (n > 0) {  // zlib takes uInt lengths
    uInt chunk = static_cast<uInt>(std::min<size_t>(n, 1u << 30));
    crc = ::crc32(crc, p, chunk);
    p += chunk;
    n -= chunk;
  }
  return static_cast<uint32_t>(crc);
}

const std::map<std::string, c10::ScalarType>& dtypes() {
  static const std::map<std::string, c10::ScalarType> types = {
      {"Float", torch::kFloat32}, {"Double", torch::kFloat64}, {"Half", torch::kFloat16},
      {"BFloat16", torch::kBFloat16}, {"Long", torch::kInt64}, {"Int", torch::kInt32},
      {"Byte", torch::kUInt8}, {"Bool", torch::kBool}};
  return types;
}

c10::ScalarType parse_dtype(const std::string& name) {
  auto it = dtypes().find(name);
  TORCH_CHECK(it != dtypes().end(), "unknown dtype '", name, "' in the checkpoint");
  return it->second;
}

int64_t volume(const std::vector<int64_t>& size) {
  int64_t n = 1;
  for (auto s : size) {
    if (s < 0) return -1;
    if (s == 0) return 0;
  }
  for (auto s : size) {
    if (s > kMaxElements / n) return -1;
    n *= s;
  }
  return n;
}

std::string shape_text(const std::vector<int64_t>& v) {
  std::string t = "[";
  for (size_t i = 0; i < v.size(); ++i) t += (i ? ", " : "") + std::to_string(v[i]);
  return t + "]";
}

std::string with_article(const std::string& type) {
  const bool acronym = type.size() > 1 && std::isupper(static_cast<unsigned char>(type[0])) &&
                       std::isupper(static_cast<unsigned char>(type[1]));
  const bool vowel = !type.empty() && (std::strchr("AEIOUaeiou", type[0]) ||
                                       (acronym && std::strchr("FHLMNRSX", type[0])));
  return (vowel ? "an " : "a ") + type;
}

std::string setting_text(double value, const std::string& text) { return text.empty() ? value_text(value) : text; }

void write_manifest(const std::string& tag_dir, const Manifest& m) {
  util::write_new(join_path(tag_dir, "manifest.bin"), manifest_bytes(m));
  util::write_new(join_path(tag_dir, "summary.txt"), describe(m));
  util::fsync_path(tag_dir);
}

void check_tag(const std::string& tag) {
  TORCH_CHECK(util::safe_name(tag) && tag != "newest", "bad checkpoint tag '", tag,
              "': a tag is 1-128 characters from A-Z a-z 0-9 . _ -, not starting with '.' or '-', and not 'newest'");
}

}  // namespace internal

using namespace internal;

Manifest read_manifest(const std::string& tag_dir) {
  std::string path = join_path(tag_dir, "manifest.bin");
  TORCH_CHECK(util::exists(path), "the checkpoint manifest '", path, "' is missing");
  std::string bytes = util::read_regular(path, "checkpoint manifest", kMaxManifestBytes, util::Links::Refuse);
  auto bad = [&](const std::string& why) { TORCH_CHECK(false, "the checkpoint manifest '", path, "' ", why); };
  if (bytes.size() < kVersionEnd) bad("is truncated (" + std::to_string(bytes.size()) + " bytes)");
  uint64_t magic_length = 0;
  std::memcpy(&magic_length, bytes.data(), 8);
  if (magic_length != kMagicLength || bytes.compare(8, kMagicLength, kMagic) != 0)
    bad("is not a partrain checkpoint manifest");
  uint32_t version = 0;
  std::memcpy(&version, bytes.data() + 8 + kMagicLength, 4);
  if (version == 1)
    bad("has format version 1, which has no checksum of its own; this partrain reads versions " +
        std::to_string(kOldestReadableFormat) + " to " + std::to_string(kFormatVersion) +
        " (load it with the partrain that saved it and save it again)");
  if (version < kOldestReadableFormat || version > kFormatVersion)
    bad("has format version " + std::to_string(version) + "; this partrain reads versions " +
        std::to_string(kOldestReadableFormat) + " to " + std::to_string(kFormatVersion));
  if (bytes.size() < kHeaderBytes) bad("is truncated (" + std::to_string(bytes.size()) + " bytes)");
  uint64_t length = 0;
  uint32_t crc = 0;
  std::memcpy(&length, bytes.data() + kVersionEnd, 8);
  std::memcpy(&crc, bytes.data() + kVersionEnd + 8, 4);
  if (length != bytes.size() - kHeaderBytes)
    bad("is damaged: its header says " + std::to_string(length) + " bytes follow, the file has " +
        std::to_string(bytes.size() - kHeaderBytes) + " (truncated or extended)");
  if (crc_of(bytes.data() + kHeaderBytes, length) != crc) bad("fails its checksum (its bytes were altered)");
  Manifest m;
  try {
    util::BoundedInputArchive ar(bytes.data() + kHeaderBytes, length);
    struct Format {  // the layout of this manifest's entries, for serialize(TensorEntry)
      explicit Format(uint32_t v) { reading_format = v; }
      ~Format() { reading_format = kFormatVersion; }
    } format(version);
    ar(m);
    if (ar.left() != 0) bad("has " + std::to_string(ar.left()) + " bytes after its contents");
  } catch (const cereal::Exception& e) {
    bad(std::string("is damaged: ") + e.what());
  }
  m.version = version;
  validate(m, path);
  return m;
}

std::string describe(const Manifest& m) {
  std::ostringstream s;
  auto shape = [](const std::vector<int64_t>& v) {
    std::string t;
    for (size_t i = 0; i < v.size(); ++i) t += (i ? "x" : "") + std::to_string(v[i]);
    return v.empty() ? std::string("scalar") : t;
  };
  s << "partrain checkpoint, format " << m.version << "\n"
    << "step " << m.step << "; saved by " << m.world << " rank(s): tensor " << m.tensor << " x data " << m.data
    << " x pipeline " << m.pipeline << ", zero " << m.zero << (m.full ? "; full (consolidated)" : "; partial (per-rank shards)")
    << "\nmodel " << m.model_type << (m.policy.empty() ? "" : ", policy " + m.policy);
  if (!m.optimizer.empty()) s << "; optimizer " << m.optimizer << " after " << m.optimizer_steps << " step(s)";
  if (!m.param_steps.empty()) {
    s << "\nparameters that stepped fewer times (no gradient on the others):";
    for (size_t i = 0; i < m.param_steps.size(); ++i)
      s << (i ? ", " : " ") << m.param_steps[i].name << " " << m.param_steps[i].steps;
  }
  if (!m.config.empty()) {
    s << "\nmodel config:";
    for (size_t i = 0; i < m.config.size(); ++i)
      s << (i ? ", " : " ") << m.config[i].name << "=" << setting_text(m.config[i].value, m.config[i].text);
  }
  if (m.loss_scale.size() == 4)
    s << "\nloss scale " << m.loss_scale[0] << " (" << int64_t(m.loss_scale[1]) << " good step(s) since the last change, "
      << int64_t(m.loss_scale[3]) << " step(s) skipped)";
  if (!m.stages.bounds.empty()) {
    // Virtual stage v (chunk v / pipeline of pipeline rank v % pipeline) holds blocks [b[v], b[v+1]).
    const auto& st = m.stages;
    auto list = [](const std::vector<std::string>& v) {
      std::string t;
      for (const auto& n : v) t += (t.empty() ? "" : ",") + n;
      return t;
    };
    s << "\npipeline: " << (st.schedule.empty() ? std::string("schedule not recorded") : "schedule " + st.schedule)
      << ", " << st.chunks << " chunk(s) a rank";
    for (size_t v = 0; v + 1 < st.bounds.size(); ++v) {
      s << "\n  stage " << v << " (pipeline rank " << v % m.pipeline << "): " << st.blocks << "." << st.bounds[v];
      if (st.bounds[v + 1] - 1 > st.bounds[v]) s << "-" << st.blocks << "." << st.bounds[v + 1] - 1;
      if (v == 0 && !st.first.empty()) s << " + " << list(st.first);
      if (v + 2 == st.bounds.size() && !st.last.empty()) s << " + " << list(st.last);
    }
  }
  s << "\ndata position: " << (m.samples_seen < 0 ? std::string("none") : std::to_string(m.samples_seen) + " samples")
    << "\nuser: " << m.user_json << "\n\nfiles:\n";
  uint64_t total = 0;
  for (const auto& f : m.files) {
    s << "  " << f.name << "  " << f.bytes << " bytes  crc32 " << hex32(f.crc32) << "\n";
    total += f.bytes;
  }
  s << "  total " << total << " bytes\n\ntensors:\n";
  for (const auto& e : m.tensors) {
    uint64_t bytes = 0;
    for (const auto& p : e.pieces) bytes += p.bytes;
    s << "  " << e.name << "  " << e.dtype << " " << shape(e.shape);
    if (e.dim >= 0) {
      s << "  split on " << e.dim;
      if (!e.parts.empty()) {
        s << " (parts ";
        for (size_t i = 0; i < e.parts.size(); ++i) s << (i ? "+" : "") << e.parts[i];
        s << ")";
      }
    }
    s << "  " << e.pieces.size() << " piece(s), " << bytes << " bytes:";
    for (const auto& p : e.pieces) {
      s << " [" << (p.file >= 0 && p.file < static_cast<int32_t>(m.files.size()) ? m.files[p.file].name : "?");
      if (e.dim >= 0 && static_cast<size_t>(e.dim) < p.start.size())
        s << " " << p.start[e.dim] << ":" << p.start[e.dim] + p.size[e.dim];
      s << "]";
    }
    s << "\n";
  }
  return s.str();
}

}  // namespace partrain::ckpt
