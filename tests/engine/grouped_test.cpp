// GoogleTest for the experts' grouped matmul: both paths (at::_grouped_mm, the padded bmm) equal
// the loop of per-group products, forward and both gradients, with empty groups (first, last,
// all) and no rows at all; a transposed weight view; out.sum()'s expanded gradient; the path
// chosen exactly where _grouped_mm takes the operands (forward and backward), and refusals of
// bad counts and shapes naming the sizes.
#include <gtest/gtest.h>

#include <functional>
#include <numeric>

#include "engine/nn/grouped.hpp"
#include "engine/plan/meta_kernels.hpp"
#include "tests/engine/testing.hpp"

using namespace partrain;
using torch::Tensor;
using testing_util::error_of;

namespace {

using Matmul = std::function<Tensor(const Tensor&, const Tensor&, const std::vector<int64_t>&)>;

double max_relative(const Tensor& a, const Tensor& b) {
  if (b.numel() == 0) return a.numel() == 0 ? 0.0 : 1.0 / 0.0;
  auto scale = b.abs().max().item<double>();
  return (a - b).abs().max().item<double>() / (scale > 0 ? scale : 1.0);
}

// An output and the gradients of x and of the weight's leaf.
struct Run {
  Tensor out, dx, dw;
};

// fn(x, view(w_leaf), counts) with fresh leaves, then backward with `grad` (undefined: out.sum()).
Run run(const Matmul& fn, const Tensor& x0, const Tensor& w0, const std::vector<int64_t>& counts, const Tensor& grad,
        const std::function<Tensor(const Tensor&)>& view = [](const Tensor& w) { return w; }) {
  auto x = x0.detach().clone().requires_grad_(true);
  auto w = w0.detach().clone().requires_grad_(true);
  auto out = fn(x, view(w), counts);
  if (grad.defined()) out.backward(grad);
  else out.sum().backward();
  return {out.detach(), x.grad(), w.grad()};
}

// Expects `got` to equal `want` within `tol` (relative to want's largest element), value and grads.
void expect_close(const Run& got, const Run& want, double tol, const std::string& what) {
  ASSERT_EQ(got.out.sizes(), want.out.sizes()) << what;
  EXPECT_LE(max_relative(got.out, want.out), tol) << "error on the output: " << what;
  EXPECT_LE(max_relative(got.dx, want.dx), tol) << "error on x's gradient: " << what;
  EXPECT_LE(max_relative(got.dw, want.dw), tol) << "error on w's gradient: " << what;
}

int64_t total(const std::vector<int64_t>& counts) { return std::accumulate(counts.begin(), counts.end(), int64_t{0}); }

// Count patterns: uneven, empty groups inside, first and last empty, one group holding all, no rows.
const std::vector<std::vector<int64_t>> kCounts = {{3, 0, 5, 2}, {0, 4, 4, 0}, {0, 0, 9, 0}, {1, 1, 1, 1}, {0, 0, 0, 0}};

void compare_with_loop(torch::ScalarType dtype, const std::string& path, double tol, const Matmul& fn) {
  torch::manual_seed(1);
  const int64_t in = 8, out = 12;
  for (const auto& counts : kCounts) {
    const int64_t T = total(counts), G = static_cast<int64_t>(counts.size());
    auto x = torch::randn({T, in}, dtype), w = torch::randn({G, in, out}, dtype), g = torch::randn({T, out}, dtype);
    EXPECT_EQ(nn::grouped_matmul_path(x, w), path);
    const std::string what = "counts " + c10::str(c10::IntArrayRef(counts)) + " in " + c10::toString(dtype);
    auto want = run(nn::looped_matmul, x, w, counts, g);
    expect_close(run(fn, x, w, counts, g), want, tol, what);
    // An empty group's weight gets a zero gradient, not a missing or stale one.
    auto got = run(fn, x, w, counts, g);
    for (int64_t e = 0; e < G; ++e)
      if (counts[e] == 0) EXPECT_EQ(got.dw[e].abs().max().item<double>(), 0.0) << "group " << e << ", " << what;
  }
}

}  // namespace

TEST(GroupedMatmul, GroupedMmMatchesTheLoopInFloat32) {
  compare_with_loop(torch::kFloat32, "grouped_mm", 1e-5, nn::grouped_matmul);
}

TEST(GroupedMatmul, Float64TakesThePaddedBmmAndMatchesTheLoop) {
  compare_with_loop(torch::kFloat64, "padded_bmm", 1e-12, nn::grouped_matmul);
}

TEST(GroupedMatmul, PaddedBmmMatchesTheLoopInFloat32) {
  compare_with_loop(torch::kFloat32, "grouped_mm", 1e-5, nn::padded_bmm_matmul);
}

TEST(GroupedMatmul, BothPathsAgreeInFloat32) {
  torch::manual_seed(2);
  const std::vector<int64_t> counts = {5, 0, 17, 3, 0, 7};
  const int64_t T = total(counts);
  auto x = torch::randn({T, 16}), w = torch::randn({6, 16, 32}), g = torch::randn({T, 32});
  ASSERT_EQ(nn::grouped_matmul_path(x, w), "grouped_mm");
  expect_close(run(nn::padded_bmm_matmul, x, w, counts, g), run(nn::grouped_matmul, x, w, counts, g), 1e-5,
               "padded_bmm against grouped_mm");
  // A float32 layout _grouped_mm refuses (in = 6: rows of 24 bytes) goes the padded way.
  auto x6 = torch::randn({T, 6}), w6 = torch::randn({6, 6, 32});
  EXPECT_EQ(nn::grouped_matmul_path(x6, w6), "padded_bmm");
  expect_close(run(nn::grouped_matmul, x6, w6, counts, g), run(nn::looped_matmul, x6, w6, counts, g), 1e-5,
               "in = 6 through padded_bmm");
}

TEST(GroupedMatmul, TransposedWeightViewOfAnOutByInStack) {
  torch::manual_seed(3);
  const std::vector<int64_t> counts = {4, 0, 6, 2};
  const int64_t T = total(counts);
  auto view = [](const Tensor& w) { return w.transpose(1, 2); };  // [G, out, in] -> [G, in, out]
  for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
    auto x = torch::randn({T, 8}, dtype), stack = torch::randn({4, 12, 8}, dtype), g = torch::randn({T, 12}, dtype);
    EXPECT_EQ(nn::grouped_matmul_path(x, view(stack)), dtype == torch::kFloat32 ? "grouped_mm" : "padded_bmm");
    const double tol = dtype == torch::kFloat32 ? 1e-5 : 1e-12;
    auto want = run(nn::looped_matmul, x, stack, counts, g, view);
    expect_close(run(nn::grouped_matmul, x, stack, counts, g, view), want, tol, "transposed view");
    expect_close(run(nn::padded_bmm_matmul, x, stack, counts, g, view), want, tol, "transposed view, padded");
  }
}

TEST(GroupedMatmul, SumLossBackwardThroughAnExpandedGradient) {
  torch::manual_seed(4);
  const std::vector<int64_t> counts = {3, 0, 5};
  auto x = torch::randn({8, 8}), w = torch::randn({3, 8, 12});
  ASSERT_EQ(nn::grouped_matmul_path(x, w), "grouped_mm");
  // out.sum()'s gradient is one number expanded to [T, out] (strides 0), which _grouped_mm refuses.
  auto want = run(nn::looped_matmul, x, w, counts, Tensor());
  expect_close(run(nn::grouped_matmul, x, w, counts, Tensor()), want, 1e-5, "out.sum()");
  expect_close(run(nn::padded_bmm_matmul, x, w, counts, Tensor()), want, 1e-5, "out.sum(), padded");
}

// The path says grouped_mm exactly where _grouped_mm takes the forward's and the backward's
// operands (on the CPU), over layouts drawn at random: sizes 1 to 12 or 8 and 16, row- and column-major x
// and w, strides padded past the extent, float32, bfloat16 and float16; and then the grouped
// matmul matches the loop.
TEST(GroupedMatmul, PathIsGroupedMmExactlyWhereGroupedMmTakesTheOperands) {
  torch::manual_seed(5);
  int grouped = 0, padded = 0;
  for (int i = 0; i < 300; ++i) {
    auto pick = [](int64_t n) { return torch::randint(n, {1}).item<int64_t>(); };
    const auto dtype = std::vector<torch::ScalarType>{torch::kFloat32, torch::kBFloat16, torch::kFloat16}[pick(3)];
    auto size = [&] { return pick(3) ? 8 * (1 + pick(2)) : 1 + pick(12); };  // often aligned
    const int64_t G = 1 + pick(4), in = size(), out = size(), pad_x = pick(3) * 4, pad_w = pick(3) * 4;
    std::vector<int64_t> counts(G);
    for (auto& c : counts) c = pick(3) == 0 ? 0 : pick(5);
    const int64_t T = total(counts);
    // x row-major [T, in + pad] narrowed, or column-major; w likewise along its last two dims.
    auto x = pick(2) ? torch::randn({T, in + pad_x}, dtype).narrow(1, 0, in)
                     : torch::randn({in + pad_x, T}, dtype).narrow(0, 0, in).t();
    auto w = pick(2) ? torch::randn({G, in, out + pad_w}, dtype).narrow(2, 0, out)
                     : torch::randn({G, out + pad_w, in}, dtype).narrow(1, 0, out).transpose(1, 2);
    std::vector<int32_t> ends;
    int64_t end = 0;
    for (auto c : counts) ends.push_back(static_cast<int32_t>(end += c));
    auto offs = torch::tensor(ends, torch::kInt32);
    auto g = torch::randn({T, out}, dtype);
    const bool takes = error_of([&] {
                         at::_grouped_mm(x, w, offs);
                         at::_grouped_mm(g, w.transpose(-2, -1), offs);
                         at::_grouped_mm(x.t(), g, offs);
                       }) == "";
    const std::string what = "x " + c10::str(x.sizes(), x.strides()) + " w " + c10::str(w.sizes(), w.strides()) +
                             " " + c10::toString(dtype);
    ASSERT_EQ(nn::grouped_matmul_path(x, w), takes ? "grouped_mm" : "padded_bmm") << what;
    (takes ? grouped : padded)++;
    const double tol = dtype == torch::kFloat32 ? 1e-5 : 2e-2;
    auto f = [](const Tensor& t) { return t.to(torch::kFloat64); };
    auto got = run(nn::grouped_matmul, x, w, counts, g), want = run(nn::looped_matmul, x, w, counts, g);
    expect_close({f(got.out), f(got.dx), f(got.dw)}, {f(want.out), f(want.dx), f(want.dw)}, tol, what);
  }
  EXPECT_GT(grouped, 20) << "too few drawn layouts took _grouped_mm";
  EXPECT_GT(padded, 20) << "too few drawn layouts took the padded bmm";
}

TEST(GroupedMatmul, PathFollowsDtypeAndAlignment) {
  auto path = [](torch::ScalarType dtype, int64_t in, int64_t out) {
    return nn::grouped_matmul_path(torch::zeros({5, in}, dtype), torch::zeros({3, in, out}, dtype));
  };
  EXPECT_EQ(path(torch::kFloat32, 8, 12), "grouped_mm");
  EXPECT_EQ(path(torch::kFloat32, 8, 6), "padded_bmm") << "out = 6 floats: 24-byte rows";
  EXPECT_EQ(path(torch::kFloat64, 8, 12), "padded_bmm") << "_grouped_mm refuses float64";
  EXPECT_EQ(path(torch::kBFloat16, 16, 24), "grouped_mm");
  EXPECT_EQ(path(torch::kBFloat16, 8, 12), "padded_bmm") << "out = 12 bfloat16: 24-byte rows";
  EXPECT_EQ(path(torch::kFloat16, 8, 16), "grouped_mm");
}

TEST(GroupedMatmul, RefusesBadArgumentsNamingTheSizes) {
  auto x = torch::randn({6, 8}), w = torch::randn({3, 8, 4});
  auto refusal = [&](const Tensor& a, const Tensor& b, std::vector<int64_t> counts) {
    return error_of([&] { nn::grouped_matmul(a, b, counts); });
  };
  EXPECT_EQ(refusal(x, w, {2, 4}), "grouped_matmul: counts has 2 entries but w [3, 8, 4] has G=3 groups");
  EXPECT_EQ(refusal(x, w, {2, 2, 1}), "grouped_matmul: counts sum to 5 but x has T=6 rows");
  EXPECT_EQ(refusal(x, w, {4, -1, 3}), "grouped_matmul: counts[1]=-1 is negative");
  EXPECT_EQ(refusal(x.view({6, 2, 4}), w, {2, 2, 2}),
            "grouped_matmul: x must be [tokens, in] (2 dimensions), got shape [6, 2, 4]");
  EXPECT_EQ(refusal(x, w[0], {2, 2, 2}), "grouped_matmul: w must be [groups, in, out] (3 dimensions), got shape [8, 4]");
  EXPECT_EQ(refusal(x, torch::randn({3, 4, 8}), {2, 2, 2}),
            "grouped_matmul: x has in=8 columns but w [3, 4, 8] has in=4 (w is [groups, in, out])");
  EXPECT_EQ(refusal(x, w.to(torch::kFloat64), {2, 2, 2}), "grouped_matmul: x is Float but w is Double");
  EXPECT_EQ(refusal(x, w.to(torch::kMeta), {2, 2, 2}), "grouped_matmul: x is on cpu but w is on meta");
  EXPECT_EQ(error_of([&] { nn::looped_matmul(x, w, {6}); }),
            "looped_matmul: counts has 1 entries but w [3, 8, 4] has G=3 groups");
  EXPECT_EQ(error_of([&] { nn::padded_bmm_matmul(x, w, {7, 0, -1}); }), "padded_bmm_matmul: counts[0]=7 is more than x's T=6 rows");
}

TEST(GroupedMatmul, MetaTensorsTakeThePaddedBmm) {
  // The planner runs forwards on meta tensors (with its meta kernels, index_select's among them),
  // where _grouped_mm's composite kernel would read the offsets' values: the padded path gives
  // the shape without them.
  plan::meta::install();
  auto x = torch::empty({6, 8}, torch::kMeta), w = torch::empty({3, 8, 12}, torch::kMeta);
  EXPECT_EQ(nn::grouped_matmul_path(x, w), "padded_bmm");
  auto out = nn::grouped_matmul(x, w, {2, 0, 4});
  EXPECT_TRUE(out.is_meta());
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{6, 12}));
}
