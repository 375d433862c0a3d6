// GoogleTest for the loss scaler's arithmetic (DeepSpeed's dynamic loss scaler, smp's names):
// backoff, growth after scale_window good steps, delayed_shift with and without
// consecutive_hysteresis, min_scale, a static scale that never moves, the overflow check over
// gradients that unscales them, and option checks that name the value.
#include <gtest/gtest.h>

#include <limits>

#include "engine/optim/loss_scale.hpp"
#include "testing.hpp"

using namespace partrain;
using partrain::testing_util::error_of;

namespace {

optim::LossScaleOptions dynamic(double init, int64_t window, int64_t shift = 1, double min_scale = 1) {
  optim::LossScaleOptions o;
  o.kind = "dynamic";
  o.init_scale = init;
  o.scale_window = window;
  o.delayed_shift = shift;
  o.min_scale = min_scale;
  return o;
}

}  // namespace

TEST(LossScaler, DefaultsAreSmps) {
  optim::LossScaleOptions o;
  EXPECT_EQ(o.init_scale, 4294967296.0);  // 2^32
  EXPECT_EQ(o.scale_factor, 2.0);
  EXPECT_EQ(o.scale_window, 1000);
  EXPECT_EQ(o.min_scale, 1.0);
  EXPECT_EQ(o.delayed_shift, 1);
  EXPECT_FALSE(o.consecutive_hysteresis);
}

TEST(LossScaler, OverflowBacksOffAndGoodStepsGrowAfterTheWindow) {
  optim::LossScaler s(dynamic(1024, 3));
  EXPECT_EQ(s.update(true), 1024) << "update returns the scale the step used";
  EXPECT_EQ(s.scale(), 512);
  EXPECT_EQ(s.skipped(), 1);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 512) << "two good steps: not yet";
  s.update(false);
  EXPECT_EQ(s.scale(), 1024) << "the third good step since the overflow grows it";
  s.update(false);
  s.update(false);
  s.update(true);  // the tracker restarts on an overflow
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 512);
  s.update(false);
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_EQ(s.skipped(), 2);
}

TEST(LossScaler, DelayedShiftNeedsThatManyOverflowsUntilTheNextGrowth) {
  optim::LossScaler s(dynamic(64, 4, /*shift=*/3));
  s.update(true);
  s.update(true);
  EXPECT_EQ(s.scale(), 64) << "two overflows of three";
  s.update(false);  // a good step does not restore the count without consecutive_hysteresis
  s.update(true);
  EXPECT_EQ(s.scale(), 32) << "the third backs off";
  s.update(true);
  EXPECT_EQ(s.scale(), 16) << "and every one after it until the scale grows";
  for (int i = 0; i < 4; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 32) << "growth";
  s.update(true);
  EXPECT_EQ(s.scale(), 32) << "growth restored the count";
  EXPECT_EQ(s.skipped(), 5);
}

TEST(LossScaler, ConsecutiveHysteresisRestoresTheCountOnAGoodStep) {
  auto o = dynamic(64, 100, /*shift=*/2);
  o.consecutive_hysteresis = true;
  optim::LossScaler s(o);
  s.update(true);
  s.update(false);
  s.update(true);
  EXPECT_EQ(s.scale(), 64);
  s.update(true);
  EXPECT_EQ(s.scale(), 32);
}

TEST(LossScaler, NeverBelowMinScaleAndFactorIsUsed) {
  auto o = dynamic(16, 2, 1, /*min_scale=*/4);
  o.scale_factor = 4;
  optim::LossScaler s(o);
  s.update(true);
  EXPECT_EQ(s.scale(), 4);
  s.update(true);
  EXPECT_EQ(s.scale(), 4);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 16);
}

TEST(LossScaler, StaticScaleNeverMovesButCountsSkips) {
  optim::LossScaleOptions o;
  o.kind = "static";
  o.scale = 128;
  optim::LossScaler s(o);
  s.update(true);
  for (int i = 0; i < 2000; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 128);
  EXPECT_EQ(s.skipped(), 1);
  EXPECT_EQ(s.scale_loss(torch::tensor(0.5)).item<double>(), 64.0);
}

TEST(LossScaler, UnscalesEveryGradientAndFindsInfOrNanInAny) {
  optim::LossScaler s(dynamic(8, 10));
  auto a = torch::full({3}, 16.0), b = torch::full({2, 2}, 8.0);
  EXPECT_FALSE(s.unscale_and_check({a, torch::Tensor(), b}, nullptr));
  EXPECT_TRUE(a.equal(torch::full({3}, 2.0)));
  EXPECT_TRUE(b.equal(torch::full({2, 2}, 1.0)));
  b[1][0] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(s.unscale_and_check({a, b}, nullptr));
  auto c = torch::ones({4}, torch::kBFloat16);
  c[2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(s.unscale_and_check({c}, nullptr));
  EXPECT_FALSE(s.unscale_and_check({}, nullptr)) << "no gradients: nothing overflowed";
}

TEST(LossScaler, RefusesOptionsNamingTheValue) {
  auto o = dynamic(8, 0);
  EXPECT_EQ(error_of([&] { optim::LossScaler s(o); }), "scale_window must be >= 1, got 0");
  o = dynamic(1, 10, 1, 2);
  EXPECT_EQ(error_of([&] { optim::LossScaler s(o); }), "init_scale=1 is below min_scale=2");
  o = dynamic(8, 10);
  o.scale_factor = 0.5;
  EXPECT_EQ(error_of([&] { optim::LossScaler s(o); }), "scale_factor must be a finite number > 1, got 0.5");
  optim::LossScaleOptions st;
  st.kind = "static";
  st.scale = 0;
  EXPECT_EQ(error_of([&] { optim::LossScaler s(st); }), "loss_scale must be a number float32 holds, from 2^-126 to 2^127, got 0");
}
