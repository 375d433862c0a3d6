// Grouped matmul for experts: at::_grouped_mm, the padded bmm fallback and the loop (see grouped.hpp).
#include "engine/nn/grouped.hpp"

#include <algorithm>
#include <limits>
#include <numeric>

namespace partrain::nn {

namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The checks every path shares: x [T, in], w [G, in, out], same dtype (floating) and device.
void check_operands(const Tensor& x, const Tensor& w, const char* what) {
  TORCH_CHECK(x.defined() && w.defined(), what, ": x and w must be tensors");
  TORCH_CHECK(x.dim() == 2, what, ": x must be [tokens, in] (2 dimensions), got shape ", x.sizes());
  TORCH_CHECK(w.dim() == 3, what, ": w must be [groups, in, out] (3 dimensions), got shape ", w.sizes());
  TORCH_CHECK(w.size(0) >= 1, what, ": w must hold at least one group, got shape ", w.sizes());
  TORCH_CHECK(x.size(1) == w.size(1), what, ": x has in=", x.size(1), " columns but w ", w.sizes(), " has in=",
              w.size(1), " (w is [groups, in, out])");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), what, ": x is ", x.scalar_type(), " but w is ", w.scalar_type());
  TORCH_CHECK(x.is_floating_point(), what, ": x and w must be floating point, got ", x.scalar_type());
  TORCH_CHECK(x.device() == w.device(), what, ": x is on ", x.device(), " but w is on ", w.device());
}

void check_arguments(const Tensor& x, const Tensor& w, const std::vector<int64_t>& counts, const char* what) {
  check_operands(x, w, what);
  const int64_t G = w.size(0), T = x.size(0);
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == G, what, ": counts has ", counts.size(), " entries but w ",
              w.sizes(), " has G=", G, " groups");
  int64_t sum = 0;
  for (size_t g = 0; g < counts.size(); ++g) {
    TORCH_CHECK(counts[g] >= 0, what, ": counts[", g, "]=", counts[g], " is negative");
    TORCH_CHECK(counts[g] <= T, what, ": counts[", g, "]=", counts[g], " is more than x's T=", T, " rows");
    sum += counts[g];
  }
  TORCH_CHECK(sum == T, what, ": counts sum to ", sum, " but x has T=", T, " rows");
}

// Whether at::_grouped_mm takes a matrix (its last two dimensions) of these sizes and strides:
// PyTorch 2.11's check_valid_strides_and_return_transposed (ATen/native/GroupedMMUtils.h), which
// throws where this answers false. One stride must be 1 and the other at least the extent it
// steps over and a multiple of 16 bytes, column-major tried first.
bool grouped_mm_takes(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride, int64_t alignment) {
  if (row_stride == 1 && col_stride >= std::max<int64_t>(1, rows)) return col_stride % alignment == 0;
  if (col_stride == 1 && row_stride >= std::max<int64_t>(1, cols)) return row_stride % alignment == 0;
  return false;
}

bool aligned_16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// The gradient as a dense row-major [T, out]: an expanded one (out.sum()'s, strides 0) or one
// whose size-1 dimension has an odd stride would be refused by _grouped_mm.
Tensor dense(const Tensor& g) {
  if (g.dim() == 2 && g.stride(1) == 1 && g.stride(0) == g.size(1)) return g;
  return torch::empty(g.sizes(), g.options()).copy_(g);
}

// The cumulative end of each group, int32 on x's device: _grouped_mm's offsets.
Tensor offsets_of(const std::vector<int64_t>& counts, const torch::Device& device) {
  std::vector<int32_t> ends(counts.size());
  int64_t end = 0;
  for (size_t g = 0; g < counts.size(); ++g) ends[g] = static_cast<int32_t>(end += counts[g]);
  return torch::tensor(ends, torch::kInt32).to(device);
}

// out = _grouped_mm(x, w, offs); backward: dx = _grouped_mm(g, w^T, offs) and
// dw = _grouped_mm(x^T, g, offs) (2-D by 2-D: one [in, out] block a group, zeros for an empty
// one), with g made dense first. grouped_matmul_path checks exactly these operands.
struct GroupedMM : torch::autograd::Function<GroupedMM> {
  static Tensor forward(AutogradContext* ctx, Tensor x, Tensor w, Tensor offs) {
    ctx->save_for_backward({x, w, offs});
    return at::_grouped_mm(x, w, offs);  // [T, out]
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1], &offs = saved[2];
    auto g = dense(grads[0]);  // [T, out]
    Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = at::_grouped_mm(g, w.transpose(-2, -1), offs);  // [T, in]
    if (ctx->needs_input_grad(1)) dw = at::_grouped_mm(x.t(), g, offs);                 // [G, in, out]
    return {dx, dw, Tensor()};
  }
};

// The padded layout: G blocks of m = max(counts) slots, group g's rows in the first counts[g]
// slots of block g. slot_row [G*m]: the row each slot holds (T: none, a zero row); row_slot [T]:
// the slot each row goes to. The two gathers below are each other's transpose.
struct Slots {
  Tensor slot_row, row_slot;
  int64_t per_group = 0;
};

Slots slots_of(const std::vector<int64_t>& counts, int64_t T, const torch::Device& device) {
  Slots s;
  s.per_group = counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
  const int64_t G = static_cast<int64_t>(counts.size()), m = s.per_group;
  std::vector<int64_t> slot_row(G * m, T), row_slot(T);
  int64_t row = 0;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < counts[g]; ++j, ++row) {
      slot_row[g * m + j] = row;
      row_slot[row] = g * m + j;
    }
  s.slot_row = torch::tensor(slot_row, torch::kInt64).to(device);
  s.row_slot = torch::tensor(row_slot, torch::kInt64).to(device);
  return s;
}

// [T, d] rows -> [G*m, d] slots (padding slots zero).
Tensor rows_to_slots(const Tensor& rows, const Tensor& slot_row) {
  return torch::cat({rows, rows.new_zeros({1, rows.size(1)})}).index_select(0, slot_row);
}

struct FromSlots;
// rows -> slots, whose gradient is slots -> rows: a gather both ways.
struct ToSlots : torch::autograd::Function<ToSlots> {
  static Tensor forward(AutogradContext* ctx, Tensor rows, Tensor slot_row, Tensor row_slot) {
    ctx->save_for_backward({slot_row, row_slot});
    return rows_to_slots(rows, slot_row);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads);
};
// slots -> rows (padding slots dropped), whose gradient is rows -> slots.
struct FromSlots : torch::autograd::Function<FromSlots> {
  static Tensor forward(AutogradContext* ctx, Tensor slots, Tensor slot_row, Tensor row_slot) {
    ctx->save_for_backward({slot_row, row_slot});
    return slots.index_select(0, row_slot);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    return {ToSlots::apply(grads[0], saved[0], saved[1]), Tensor(), Tensor()};
  }
};
variable_list ToSlots::backward(AutogradContext* ctx, variable_list grads) {
  auto saved = ctx->get_saved_variables();
  return {FromSlots::apply(grads[0], saved[0], saved[1]), Tensor(), Tensor()};
}

}  // namespace

std::string grouped_matmul_path(const Tensor& x, const Tensor& w) {
  check_operands(x, w, "grouped_matmul_path");
  const auto dtype = x.scalar_type();
  if (dtype != torch::kFloat32 && dtype != torch::kBFloat16 && dtype != torch::kFloat16) return "padded_bmm";
  const int64_t T = x.size(0), in = x.size(1), out = w.size(2), a = 16 / static_cast<int64_t>(x.element_size());
  if (T > std::numeric_limits<int32_t>::max()) return "padded_bmm";
  const bool takes = grouped_mm_takes(T, in, x.stride(0), x.stride(1), a) &&      // x
                     grouped_mm_takes(in, out, w.stride(1), w.stride(2), a) &&    // w[g]
                     grouped_mm_takes(T, out, out, 1, a) &&                       // the dense gradient
                     grouped_mm_takes(out, in, w.stride(2), w.stride(1), a) &&    // w[g]^T
                     grouped_mm_takes(in, T, x.stride(1), x.stride(0), a);        // x^T
  if (!takes || !(x.is_cpu() || x.is_cuda())) return "padded_bmm";
  if (x.is_cuda()) {
    // The sm90/sm100 bfloat16 kernel: device asserts on an empty group when x is column-major, a
    // limit of 1023 groups, TMA's 16-byte alignment; T = 0 is left to the padded path (unproven).
    const bool row_major = x.stride(1) == 1 && x.stride(0) != 1;
    if (!row_major || w.size(0) >= 1024 || T == 0 || !aligned_16(x) || !aligned_16(w)) return "padded_bmm";
  }
  return "grouped_mm";
}

Tensor grouped_matmul(const Tensor& x, const Tensor& w, const std::vector<int64_t>& counts) {
  check_arguments(x, w, counts, "grouped_matmul");
  if (grouped_matmul_path(x, w) == "padded_bmm") return padded_bmm_matmul(x, w, counts);
  return GroupedMM::apply(x, w, offsets_of(counts, x.device()));
}

Tensor padded_bmm_matmul(const Tensor& x, const Tensor& w, const std::vector<int64_t>& counts) {
  check_arguments(x, w, counts, "padded_bmm_matmul");
  const int64_t G = w.size(0), in = x.size(1);
  auto s = slots_of(counts, x.size(0), x.device());
  auto blocks = ToSlots::apply(x, s.slot_row, s.row_slot).view({G, s.per_group, in});  // [G, m, in]
  auto products = torch::bmm(blocks, w);                                               // [G, m, out]
  return FromSlots::apply(products.reshape({G * s.per_group, w.size(2)}), s.slot_row, s.row_slot);  // [T, out]
}

Tensor looped_matmul(const Tensor& x, const Tensor& w, const std::vector<int64_t>& counts) {
  check_arguments(x, w, counts, "looped_matmul");
  // split and unbind, not a narrow and a select a group: their backwards concatenate and stack
  // once, where G selects' would each write a zero gradient of all of w.
  auto rows = x.split_with_sizes(counts);  // G x [counts[g], in]
  auto mats = w.unbind(0);                 // G x [in, out]
  std::vector<Tensor> parts;
  for (size_t g = 0; g < counts.size(); ++g) parts.push_back(rows[g].mm(mats[g]));  // [counts[g], out]
  return torch::cat(parts);
}

}  // namespace partrain::nn
