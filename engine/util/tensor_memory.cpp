// Memory accounting (see tensor_memory.hpp): the counting allocators and their counters.
#include "engine/util/tensor_memory.hpp"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include "engine/compat.hpp"

namespace partrain::util {

namespace {

struct Counter {
  std::atomic<int64_t> allocated{0}, peak{0}, mark{0};
  static void raise(std::atomic<int64_t>& high, int64_t now) {
    int64_t seen = high.load();
    while (now > seen && !high.compare_exchange_weak(seen, now)) {
    }
  }
  void add(int64_t n) {
    int64_t now = allocated.fetch_add(n) + n;
    raise(peak, now);
    raise(mark, now);
  }
  void sub(int64_t n) { allocated.fetch_sub(n); }
};

Counter& cpu_counter() {
  static Counter c;
  return c;
}
Counter& meta_counter() {
  static Counter c;
  return c;
}

// CPU memory with its size in a header before the data (kept 64-byte aligned, as LibTorch's).
class CountingCpuAllocator final : public c10::Allocator {
 public:
  static constexpr size_t kHeader = 64;
  c10::DataPtr allocate(size_t n) override {
    auto* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    *reinterpret_cast<size_t*>(base) = n;
    cpu_counter().add(static_cast<int64_t>(n));
    void* data = base + kHeader;
    return {data, data, &release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count) std::memcpy(dest, src, count);
  }
  static void release(void* data) {
    if (!data) return;
    char* base = static_cast<char*>(data) - kHeader;
    cpu_counter().sub(static_cast<int64_t>(*reinterpret_cast<size_t*>(base)));
    c10::free_cpu(base);
  }
};

// Meta "memory": no data, only the size, counted while the storage lives.
class CountingMetaAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    meta_counter().add(static_cast<int64_t>(n));
    return {nullptr, new size_t(n), &release, c10::Device(c10::kMeta)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void*, const void*, std::size_t) const override {}  // meta tensors have no bytes to copy
  static void release(void* ctx) {
    auto* n = static_cast<size_t*>(ctx);
    meta_counter().sub(static_cast<int64_t>(*n));
    delete n;
  }
};

Counter& counter(c10::DeviceType device) {
  TORCH_CHECK(device == c10::kCPU || device == c10::kMeta, "memory is counted on the CPU and the meta device "
              "(and read from CUDA's caching allocator), not marked on ", device);
  return device == c10::kCPU ? cpu_counter() : meta_counter();
}

// glibc's malloc hands freed memory back to the system (it unmaps blocks above a threshold that
// moves, and trims the heap's top), so a training step that frees and re-makes the same
// activations every micro-batch pays the page faults of fresh memory each time: a pipeline
// stage's forward then took 50-170 ms instead of 50, and whole steps 1.3x longer. Freed memory is
// kept instead, as LibTorch's CUDA caching allocator keeps device memory: blocks up to 32 MiB
// come from the heap, which is never trimmed and grows 64 MiB at a time (address space; pages
// count once touched). A process's resident memory is then its peak, not its current use.
// PARTRAIN_MALLOC=system, or glibc's own settings in the environment (MALLOC_*_, GLIBC_TUNABLES)
// unless PARTRAIN_MALLOC=kept says otherwise, leave malloc as it is (keeps_freed_memory); another
// malloc (LD_PRELOAD) ignores these calls.
void tune_heap() {
#if defined(__GLIBC__)
  if (!keeps_freed_memory()) return;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
  mallopt(M_TOP_PAD, 64 << 20);
#endif
}

}  // namespace

bool keeps_freed_memory() {
  const char* chosen = std::getenv("PARTRAIN_MALLOC");
  if (chosen && std::strcmp(chosen, "system") == 0) return false;
  if (chosen && std::strcmp(chosen, "kept") == 0) return true;  // asked for: over glibc's own settings
  for (const char* own : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES"})
    if (std::getenv(own)) return false;
  return true;
}

std::string malloc_setting_problem() {
  const char* chosen = std::getenv("PARTRAIN_MALLOC");
  if (!chosen || std::strcmp(chosen, "system") == 0 || std::strcmp(chosen, "kept") == 0) return "";
  return std::string("PARTRAIN_MALLOC='") + chosen +
         "' is not a choice: kept (the default: freed CPU memory stays in the heap) or system (glibc's malloc as it comes)";
}

void install_allocators() {
  static CountingCpuAllocator cpu;
  static CountingMetaAllocator meta;
  static bool done = [] {
    tune_heap();
    c10::SetAllocator(c10::kCPU, &cpu, /*priority=*/100);
    c10::SetAllocator(c10::kMeta, &meta, /*priority=*/100);
    return true;
  }();
  (void)done;
}

Memory memory(c10::DeviceType device) {
  if (device == c10::kCUDA) {  // the caching allocator's own counters, of the current device
    auto m = compat::cuda_memory(compat::cuda_current_device());
    return {m.allocated, m.peak_allocated};
  }
  auto& c = counter(device);
  return {c.allocated.load(), c.peak.load()};
}

void reset_peak(c10::DeviceType device) {
  if (device == c10::kCUDA) return compat::cuda_reset_peak(compat::cuda_current_device());
  auto& c = counter(device);
  c.peak.store(c.allocated.load());
}

void start_mark(c10::DeviceType device) {
  auto& c = counter(device);
  c.mark.store(c.allocated.load());
}

int64_t mark(c10::DeviceType device) { return counter(device).mark.load(); }

}  // namespace partrain::util
