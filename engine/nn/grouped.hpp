// Grouped matrix products for mixture-of-experts blocks: the rows of x are sorted by group (an
// expert), and each group's rows are multiplied by that group's own matrix in one call, through
// LibTorch's at::_grouped_mm where it accepts the arguments and one zero-padded bmm elsewhere;
// with the loop of per-group products both are checked and timed against.
#pragma once

#include <string>
#include <vector>

#include <torch/torch.h>

namespace partrain::nn {

/// x: [T, in], rows sorted by group: the first counts[0] rows are group 0's, the next counts[1]
/// group 1's, and so on. w: [G, in, out] (it may be a transposed view of a [G, out, in] stack).
/// counts: G numbers >= 0 summing to T, on the host. Returns [T, out]: row t of group g is
/// x[t] @ w[g]. Differentiable in x and w; a group with no rows gets a zero gradient. Takes the
/// path grouped_matmul_path names.
torch::Tensor grouped_matmul(const torch::Tensor& x, const torch::Tensor& w, const std::vector<int64_t>& counts);

/// Which path grouped_matmul takes for these arguments:
/// - "grouped_mm": at::_grouped_mm, forward and backward, on the CPU or CUDA. float32, bfloat16
///   or float16, where x, w, their transposes and a dense [T, out] gradient each have one unit
///   stride and the other a multiple of 16 bytes (for contiguous operands: in and out multiples
///   of 4 elements in float32, of 8 in the 16-bit types), and T < 2^31 (the offsets are int32).
///   On CUDA also: data 16-byte aligned, x row-major, fewer than 1024 groups and T > 0 (the
///   bfloat16 kernel of sm90/sm100 asserts on the device or refuses otherwise).
/// - "padded_bmm": everything else: float64, other layouts, meta tensors (padded_bmm_matmul).
std::string grouped_matmul_path(const torch::Tensor& x, const torch::Tensor& w);

/// The fallback path, for any floating dtype and layout: each group's rows copied into a zero-padded
/// [G, max(counts), in] block, one torch::bmm with w, the rows gathered back. Both directions are
/// gathers (index_select), never index_add_, so CUDA computes it deterministically. Its memory is
/// G * max(counts) rows, more than T when the groups are uneven.
torch::Tensor padded_bmm_matmul(const torch::Tensor& x, const torch::Tensor& w, const std::vector<int64_t>& counts);

/// The reference: one x[rows of g] @ w[g] a group, concatenated (what bench/moe compares against).
torch::Tensor looped_matmul(const torch::Tensor& x, const torch::Tensor& w, const std::vector<int64_t>& counts);

}  // namespace partrain::nn
