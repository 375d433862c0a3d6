// Memory accounting: counting allocators on the CPU and the meta device, so that a run and a
// plan can say how many bytes their tensors hold (the planner is checked against it).
#pragma once

#include <cstdint>

#include <c10/core/DeviceType.h>

namespace partrain::plan {

/// Bytes held by tensors on one device, now and at the peak since reset_peak().
struct Memory {
  int64_t allocated = 0, peak = 0;
};
/// Counts every allocation on the CPU and on the meta device from now on (idempotent). LibTorch's
/// CPU allocator keeps no statistics; the meta device's "allocations" are the bytes a real device
/// would need, which is how the planner weighs activations.
void install_allocators();
Memory memory(c10::DeviceType device = c10::kCPU);
void reset_peak(c10::DeviceType device = c10::kCPU);

}  // namespace partrain::plan
