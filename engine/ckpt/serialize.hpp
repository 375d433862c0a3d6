// How checkpoint records are laid out in cereal's binary archives: the manifest's payload (in
// every format this partrain reads) and what ranks send rank 0 while saving. Not for use elsewhere.
#pragma once

#include <cstdint>

#include <cereal/types/string.hpp>
#include <cereal/types/vector.hpp>

#include "engine/ckpt/ckpt.hpp"

namespace partrain::ckpt {

// The format version a manifest being read was written in: format 2 stored a count of equal
// parts where format 3 stores their sizes. Set only around reading one manifest (read_manifest()).
inline thread_local uint32_t reading_format = kFormatVersion;

template <class Archive>
void serialize(Archive& ar, Piece& p) {
  ar(p.file, p.offset, p.bytes, p.start, p.size, p.crc32);
}

template <class Archive>
void serialize(Archive& ar, TensorEntry& e) {
  ar(e.name, e.dtype, e.shape, e.dim);
  if (Archive::is_loading::value && reading_format == 2) {
    int64_t fused = 1;
    ar(fused);
    e.parts.clear();
    // Equal parts of the split dimension; validate() refuses a count that does not divide it.
    if (e.dim >= 0 && static_cast<size_t>(e.dim) < e.shape.size() && fused > 1 && fused <= 4096 &&
        e.shape[e.dim] % fused == 0)
      e.parts.assign(static_cast<size_t>(fused), e.shape[e.dim] / fused);
    else if (fused != 1)
      e.parts.assign(1, 0);  // no such part: refused by validate(), naming the tensor
  } else {
    ar(e.parts);
  }
  ar(e.pieces);
}
template <class Archive>
void serialize(Archive& ar, FileEntry& f) {
  ar(f.name, f.bytes, f.crc32);
}
template <class Archive>
void serialize(Archive& ar, PipelineLayout& p) {
  ar(p.schedule, p.chunks, p.blocks, p.first, p.last, p.bounds);
}
template <class Archive>
void serialize(Archive& ar, ConfigEntry& c) {
  ar(c.name, c.value);
  if (!Archive::is_loading::value || reading_format >= 9) ar(c.text);
}
template <class Archive>
void serialize(Archive& ar, ParamSteps& p) {
  ar(p.name, p.steps);
}
template <class Archive>
void serialize(Archive& ar, Manifest& m) {
  ar(m.step, m.world, m.tensor, m.data, m.pipeline, m.zero, m.model_type, m.policy, m.optimizer, m.optimizer_steps,
     m.samples_seen, m.user_json, m.full, m.tensors, m.files, m.rng);
  if (!Archive::is_loading::value || reading_format >= 4) ar(m.stages);
  if (!Archive::is_loading::value || reading_format >= 5) ar(m.loss_scale);
  if (!Archive::is_loading::value || reading_format >= 6) ar(m.cuda_rng);
  if (!Archive::is_loading::value || reading_format >= 7) ar(m.config);
  if (!Archive::is_loading::value || reading_format >= 8) ar(m.param_steps);
}

}  // namespace partrain::ckpt
