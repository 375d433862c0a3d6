// The FLOPs a planned rank's step would compute, counted as its operators are dispatched (on meta
// tensors: shapes only). What counts is what a training step spends its time on: every matrix
// product (mm, addmm, bmm, baddbmm, whatever composite op they come from: linear, matmul, the
// math path of attention) and the fused attention kernels, forward and backward alike, replays
// under recompute included. Elementwise work is not counted (a device's efficiency covers it).
// Every operator dispatched is counted apart (composite ones and those they call alike): each
// costs a dispatch, or a kernel launch, whatever its size.
#include <atomic>
#include <cstring>

#include <ATen/record_function.h>

#include "engine/plan/plan.hpp"

namespace partrain::plan {

namespace {

std::atomic<double> flops_{0};
std::atomic<int64_t> ops_{0};

int64_t size_of(const c10::IValue& v, int64_t dim) {
  if (!v.isTensor()) return 0;
  const auto& t = v.toTensor();
  if (!t.defined() || t.dim() <= dim) return 0;
  return t.sym_size(dim).guard_int(__FILE__, __LINE__);
}

// 2·M·K·N for a product of (…, M, K) and (…, K, N) given as inputs a and b, times the batch.
double product(const c10::ArrayRef<const c10::IValue>& in, size_t a, size_t b, bool batched) {
  if (in.size() <= b || !in[a].isTensor() || !in[b].isTensor()) return 0;
  const auto& x = in[a].toTensor();
  const auto& y = in[b].toTensor();
  if (!x.defined() || !y.defined() || x.dim() != (batched ? 3 : 2) || y.dim() != x.dim()) return 0;
  const int64_t d = x.dim();
  double f = 2.0 * double(size_of(in[a], d - 2)) * double(size_of(in[a], d - 1)) * double(size_of(in[b], d - 1));
  return batched ? f * double(size_of(in[a], 0)) : f;
}

// A fused attention kernel (the _scaled_dot_product_* entry points; the kernels they call, such
// as _flash_attention_forward, are not counted again) of q (batch, heads, L, E) over k (…, S, E) and v (…, S, Ev): the
// scores' and the output's products, 2·B·H·L·S·(E + Ev); a backward twice that.
double attention(const c10::ArrayRef<const c10::IValue>& in, size_t q, bool backward) {
  if (in.size() <= q + 2) return 0;
  double f = 2.0 * double(size_of(in[q], 0)) * double(size_of(in[q], 1)) * double(size_of(in[q], 2)) *
             double(size_of(in[q + 1], 2)) * double(size_of(in[q], 3) + size_of(in[q + 2], 3));
  return backward ? 2 * f : f;
}

bool starts(const char* name, const char* prefix) { return std::strncmp(name, prefix, std::strlen(prefix)) == 0; }

std::unique_ptr<at::ObserverContext> count(const at::RecordFunction& fn) {
  const char* name = fn.name();
  if (!starts(name, "aten::")) return nullptr;
  name += 6;
  ops_.fetch_add(1, std::memory_order_relaxed);
  double f = 0;
  if (!std::strcmp(name, "mm")) f = product(fn.inputs(), 0, 1, false);
  else if (!std::strcmp(name, "addmm")) f = product(fn.inputs(), 1, 2, false);
  else if (!std::strcmp(name, "bmm")) f = product(fn.inputs(), 0, 1, true);
  else if (!std::strcmp(name, "baddbmm")) f = product(fn.inputs(), 1, 2, true);
  else if (starts(name, "_scaled_dot_product_") && !starts(name, "_scaled_dot_product_attention_math"))
    f = attention(fn.inputs(), std::strstr(name, "backward") ? 1 : 0, std::strstr(name, "backward") != nullptr);
  if (f > 0) {  // (C++17 has no fetch_add for a double)
    double now = flops_.load(std::memory_order_relaxed);
    while (!flops_.compare_exchange_weak(now, now + f, std::memory_order_relaxed)) {
    }
  }
  return nullptr;
}

}  // namespace

void count_flops() {
  static const bool installed = [] {
    at::addGlobalCallback(at::RecordFunctionCallback(&count).needsInputs(true).scopes(
        {at::RecordScope::FUNCTION}));
    return true;
  }();
  (void)installed;
}

double counted_flops() { return flops_.load(std::memory_order_relaxed); }

int64_t counted_ops() { return ops_.load(std::memory_order_relaxed); }

}  // namespace partrain::plan
