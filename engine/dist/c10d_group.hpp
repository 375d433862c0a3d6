// What a process group holds of c10d, shared by the files that run its collectives (dist.cpp,
// flat.cpp, exchange.cpp): the backend group itself, a reduce op in c10d's terms, and the
// helpers their point-to-point calls share.
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

/// A described send's header: its own channel beside the tensor's (tags below it are the caller's).
constexpr int kHeaderTag = 1 << 24;
/// A described send's header: the tensor's dtype and element count, as int64 on `device`.
Tensor header_of(const Tensor& t, const torch::Device& device);
/// Refuses a received `header` (header_of the tensor sent) that disagrees with the tensor
/// received into, of `dtype` and `numel`; `what` names the receive ("recv from group rank 0 on
/// group 'world' (ranks 0,1)").
void check_header(const Tensor& header, c10::ScalarType dtype, int64_t numel, const std::string& what);

/// Waits for `work` up to `timeout`, ending early with an error when the REPL's interrupt check
/// says Ctrl-C (set_wait_interrupt).
void wait_for(c10d::Work& work, std::chrono::milliseconds timeout);

}  // namespace partrain::dist
