// Memory accounting: counting allocators on the CPU and the meta device, so that a run and a
// plan can say how many bytes their tensors hold (the planner is checked against it).
#pragma once

#include <cstdint>
#include <string>

#include <c10/core/DeviceType.h>

namespace partrain::util {

/// Bytes held by tensors on one device, now and at the peak since reset_peak().
struct Memory {
  int64_t allocated = 0, peak = 0;
};
/// Counts every allocation on the CPU and on the meta device from now on (idempotent). LibTorch's
/// CPU allocator keeps no statistics; the meta device's "allocations" are the bytes a real device
/// would need, which is how the planner weighs activations.
void install_allocators();
/// Whether install_allocators() keeps freed CPU memory in the process's heap (glibc: no trimming,
/// a fixed 32 MiB mmap threshold): yes with PARTRAIN_MALLOC=kept; no with PARTRAIN_MALLOC=system;
/// unset, yes unless glibc's own settings (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_,
/// MALLOC_TOP_PAD_, GLIBC_TUNABLES) are in the environment. Read from the environment each time.
bool keeps_freed_memory();
/// "" when PARTRAIN_MALLOC is unset, "system" or "kept"; otherwise a message naming its value and
/// the choices (the command refuses to start on it).
std::string malloc_setting_problem();
Memory memory(c10::DeviceType device = c10::kCPU);
void reset_peak(c10::DeviceType device = c10::kCPU);
/// A high-water mark kept apart from the peak (which a script may reset): start_mark() sets it
/// to the bytes allocated now, mark() is the most allocated since. The pipeline's first step
/// weighs its backwards with it.
void start_mark(c10::DeviceType device = c10::kCPU);
int64_t mark(c10::DeviceType device = c10::kCPU);

}  // namespace partrain::util
