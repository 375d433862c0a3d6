// The load-balanced layout of a sequence split over c context ranks: 2c equal chunks, rank r
// holding chunks r and 2c-1-r (one early, one late), so that under a causal mask every rank does
// the same work. What the loader hands each rank and what context parallelism computes over.
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace partrain::util {

/// The global positions of context rank r's rows of a sequence of `length` split over c ranks:
/// chunks r and 2c-1-r of 2c, in order (length must divide into 2c equal chunks; an error says so).
inline torch::Tensor zigzag_index(int64_t length, int c, int r) {
  TORCH_CHECK(c >= 1 && r >= 0 && r < c, "context parallelism: rank ", r, " of ", c);
  TORCH_CHECK(length > 0 && length % (2 * c) == 0, "context parallelism: a sequence of ", length,
              " positions does not split into 2*context = ", 2 * c,
              " equal chunks (each rank holds one early and one late chunk)");
  const int64_t n = length / (2 * c);
  auto opts = torch::TensorOptions().dtype(torch::kInt64);
  return torch::cat({torch::arange(r * n, (r + 1) * n, opts), torch::arange((2 * c - 1 - r) * n, (2 * c - r) * n, opts)});
}

}  // namespace partrain::util
