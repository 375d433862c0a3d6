// What a process group holds of c10d, shared by the files that run its collectives (dist.cpp,
// flat.cpp): the backend group itself, and a reduce op in c10d's terms.
#pragma once

#define PARTRAIN_COMPAT_C10D  // these files talk to c10d: pull its headers into compat.hpp
#include "engine/compat.hpp"
#include "engine/dist/process_group.hpp"

namespace partrain::dist {

struct ProcessGroup::Impl {
  c10::intrusive_ptr<compat::C10dGroup> group;
};

/// c10d's op for `op`: Mean is a sum (divided afterwards, as Gloo has no average).
c10d::ReduceOp c10d_op(ReduceOp op);

}  // namespace partrain::dist
