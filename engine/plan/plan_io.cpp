// A plan on disk and on the wire: the versioned cereal format, save, load and a rank's plan as bytes.
#include "engine/plan/plan.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>

#include <cereal/archives/binary.hpp>
#include <cereal/types/string.hpp>
#include <cereal/types/utility.hpp>
#include <cereal/types/vector.hpp>

#include "engine/util/bounded_archive.hpp"
#include "engine/util/files.hpp"

namespace partrain::plan {

// ---- Saving and loading --------------------------------------------------------------------

namespace {
// The format version being read: version 1 plans (before pipeline stages) have no StagePlan,
// version 2 ones (before ZeRO) no master bytes or zero stage, version 3 ones (before ZeRO-3) no
// parameter shard or gather bytes, version 4 ones (before context parallelism) no context,
// version 5 ones (before expert parallelism) no expert size, coordinate or ExpertPlan, version 6
// ones (before split backwards) no pending bytes a stage.
uint32_t reading_version = 7;
}  // namespace

template <class Archive>
void serialize(Archive& ar, Shard& s) {
  ar(s.name, s.dtype, s.shape, s.local_shape, s.dim, s.slices, s.group, s.bytes);
}
template <class Archive>
void serialize(Archive& ar, Collective& c) {
  ar(c.group, c.op, c.calls, c.bytes);
}
template <class Archive>
void serialize(Archive& ar, StageChunk& c) {
  ar(c.stage, c.first_block, c.end_block, c.first, c.last, c.activation_bytes, c.gradient_bytes, c.backward_bytes);
  if (reading_version >= 7) ar(c.pending_bytes);
}
template <class Archive>
void serialize(Archive& ar, PeerTraffic& t) {
  ar(t.peer, t.pipeline_peer, t.sends, t.send_bytes, t.recvs, t.recv_bytes);
}
template <class Archive>
void serialize(Archive& ar, StagePlan& st) {
  ar(st.present, st.schedule, st.blocks, st.first, st.last, st.microbatches, st.stages, st.chunks, st.in_flight, st.activation_peak,
     st.bubble, st.peers);
}

template <class Archive>
void serialize(Archive& ar, ContextPlan& c) {
  ar(c.mode, c.calls, c.batch, c.heads, c.kv_heads, c.rows, c.head_size, c.element_size, c.ring_bytes,
     c.all_to_all_bytes, c.all_to_all_refusal);
}

template <class Archive>
void serialize(Archive& ar, ExpertPlan& e) {
  ar(e.experts, e.local, e.blocks, e.top_k, e.forwards, e.tokens, e.slots, e.dim, e.element_size, e.all_to_alls, e.count_bytes,
     e.balanced_bytes, e.balanced_sent, e.worst_sent, e.param_bytes, e.stacked_bytes, e.grad_bytes, e.optimizer_bytes);
}

template <class Archive>
void serialize(Archive& ar, RankPlan& r) {
  ar(r.rank, r.tensor, r.data, r.pipeline, r.shards, r.param_bytes, r.grad_bytes, r.optimizer_bytes,
     r.activation_bytes, r.collectives);
  if (reading_version >= 2) ar(r.stage);
  if (reading_version >= 3) ar(r.master_bytes, r.zero_stage, r.zero_group);
  if (reading_version >= 4) ar(r.param_shard_bytes, r.gather_bytes, r.gathers_all);
  if (reading_version >= 5) ar(r.context, r.context_plan);
  if (reading_version >= 6) ar(r.expert, r.expert_plan);
}
template <class Archive>
void serialize(Archive& ar, Plan& p) {
  ar(p.script, p.world, p.nproc_per_node, p.tensor, p.data, p.pipeline, p.zero);
  if (reading_version >= 5) ar(p.context);
  if (reading_version >= 6) ar(p.expert);
  ar(p.cpu_peak_bytes, p.seconds, p.ranks);
}

namespace {
const char kMagic[] = "partrain-plan";
// 2: pipeline stages; 3: master bytes and the zero stage; 4: ZeRO-3's shard and gather bytes;
// 5: context parallelism (the layout's context, a rank's coordinate and its ContextPlan);
// 6: expert parallelism (the layout's expert, a rank's expert coordinate and its ExpertPlan)
// (1 to 5 still read)
constexpr uint32_t kVersion = 7;
constexpr uint64_t kMaxPlanBytes = 256ull << 20;  // a plan of 65536 ranks of a large model fits
}  // namespace

// Whether `bytes` begin with the magic as cereal writes a string: its length (8 bytes, little
// endian), then its characters.
bool begins_with_magic(const std::string& bytes) {
  const size_t n = sizeof(kMagic) - 1;
  if (bytes.size() < 8 + n) return false;
  uint64_t length = 0;
  std::memcpy(&length, bytes.data(), 8);
  return length == n && bytes.compare(8, n, kMagic) == 0;
}

void check_save(const std::string& path) {
  auto refused = util::may_replace(path, begins_with_magic, "a partrain plan");
  TORCH_CHECK(refused.empty(), "--save ", refused);
}

void save(const Plan& plan, const std::string& path) {
  check_save(path);
  std::ostringstream out(std::ios::binary);
  {
    cereal::BinaryOutputArchive ar(out);
    ar(std::string(kMagic), kVersion, const_cast<Plan&>(plan));
  }
  util::write_atomic(path, out.str());
}

Plan load(const std::string& path) {
  // A regular file of bounded size (never a FIFO or a folder); cereal then reads it from memory,
  // and every length inside it is checked against what is left before anything is allocated.
  std::string bytes = util::read_regular(path, "plan", kMaxPlanBytes);
  TORCH_CHECK(begins_with_magic(bytes), "'", path, "' is not a partrain plan (made by partrain plan --save)");
  Plan plan;
  std::string magic;
  uint32_t version = 0;
  try {
    // Every length is checked against the bytes left before anything is sized.
    util::BoundedInputArchive ar(bytes.data(), bytes.size());
    ar(magic);
    TORCH_CHECK(magic == kMagic, "'", path, "' is not a partrain plan (made by partrain plan --save)");
    ar(version);
    TORCH_CHECK(version >= 1 && version <= kVersion, "the plan '", path, "' has format version ", version,
                "; this partrain reads 1 to ", kVersion);
    struct Reading {  // the version's fields, back to the current one whatever happens
      explicit Reading(uint32_t v) { reading_version = v; }
      ~Reading() { reading_version = kVersion; }
    } reading(version);
    ar(plan);
    if (ar.left() != 0) throw cereal::Exception(std::to_string(ar.left()) + " bytes follow the end of the plan");
  } catch (const cereal::Exception& e) {
    TORCH_CHECK(false, "the plan '", path, "' is damaged or truncated (", e.what(), ")");
  } catch (const std::length_error& e) {
    TORCH_CHECK(false, "'", path, "' is not a partrain plan");
  } catch (const std::bad_alloc& e) {
    TORCH_CHECK(false, "'", path, "' is not a partrain plan");
  }
  return plan;
}

bool starts_like_plan(const std::string& path) {
  int fd = util::open_regular(path, "plan");
  std::string head(8 + sizeof(kMagic) - 1, '\0');
  ssize_t n = ::read(fd, head.data(), head.size());
  ::close(fd);
  return n == static_cast<ssize_t>(head.size()) && begins_with_magic(head);
}

std::string to_bytes(const RankPlan& rank) {
  std::ostringstream out(std::ios::binary);
  {
    cereal::BinaryOutputArchive ar(out);
    ar(const_cast<RankPlan&>(rank));
  }
  return out.str();
}

RankPlan from_bytes(const std::string& bytes) {
  RankPlan r;
  util::BoundedInputArchive ar(bytes.data(), bytes.size());
  ar(r);
  return r;
}

}  // namespace partrain::plan
