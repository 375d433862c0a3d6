// GoogleTest for context parallelism's pieces without processes: the zigzag layout, the exact
// merge of partial softmaxes, the CPU flash blocks against the plain formulas (forward and the
// per-block backward from the whole attention's output), and ring attention with c ranks run as
// threads of one process over an in-memory ring, against attention over the whole sequence.
#include <gtest/gtest.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "engine/nn/functional.hpp"
#include "engine/parallel/context_parallel.hpp"
#include "tests/engine/testing.hpp"

using namespace partrain;
using torch::Tensor;

namespace {

using testing_util::error_of;

double max_relative(const Tensor& a, const Tensor& b) {
  auto scale = b.abs().max().item<double>();
  return (a - b).abs().max().item<double>() / (scale > 0 ? scale : 1.0);
}

Tensor randn(std::vector<int64_t> shape) { return torch::randn(shape, torch::kFloat64); }

// A ring whose ranks are threads: each message waits in a mailbox for its receiver.
struct Mailboxes {
  std::mutex mutex;
  std::condition_variable arrived;
  std::map<std::tuple<int, int, int64_t>, Tensor> box;  // (receiver, tag, number on the channel)
};

class ThreadRing : public parallel::RingLink {
 public:
  ThreadRing(std::shared_ptr<Mailboxes> boxes, int rank, int size) : boxes_(std::move(boxes)), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::function<void()> pass(const Tensor& out, Tensor& in, Channel tag, int) override {
    {
      std::lock_guard<std::mutex> lock(boxes_->mutex);
      boxes_->box[{(rank_ + 1) % size_, tag, sent_[tag]++}] = out.clone();
    }
    boxes_->arrived.notify_all();
    auto key = std::make_tuple(rank_, tag, received_[tag]++);
    auto boxes = boxes_;
    Tensor into = in;
    return [boxes, key, into]() mutable {
      std::unique_lock<std::mutex> lock(boxes->mutex);
      boxes->arrived.wait(lock, [&] { return boxes->box.count(key) > 0; });
      into.copy_(boxes->box[key]);
      boxes->box.erase(key);
    };
  }

 private:
  std::shared_ptr<Mailboxes> boxes_;
  int rank_, size_;
  std::map<int, int64_t> sent_, received_;
};

// Attention over the whole sequence and its gradients under loss = sum(out * w).
struct Reference {
  Tensor out, dq, dk, dv;
};
Reference whole(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w, bool causal) {
  auto q1 = q.clone().requires_grad_(), k1 = k.clone().requires_grad_(), v1 = v.clone().requires_grad_();
  nn::AttentionOptions a;
  a.causal = causal;
  auto out = nn::scaled_dot_product_attention(q1, k1, v1, a);
  (out * w).sum().backward();
  return {out.detach(), q1.grad(), k1.grad(), v1.grad()};
}

}  // namespace

TEST(ContextLayout, ZigzagChunksCoverTheSequenceOnceAndKeepOrder) {
  for (int c : {1, 2, 3, 4}) {
    const int64_t T = 2 * c * 3;
    std::vector<Tensor> all;
    for (int r = 0; r < c; ++r) {
      auto idx = parallel::zigzag_index(T, c, r);
      ASSERT_EQ(idx.numel(), T / c);
      EXPECT_EQ(idx[0].item<int64_t>(), r * 3);
      EXPECT_EQ(idx[3].item<int64_t>(), (2 * c - 1 - r) * 3);
      EXPECT_TRUE((idx.slice(0, 1) > idx.slice(0, 0, -1)).all().item<bool>()) << "rows in sequence order";
      all.push_back(idx);
    }
    EXPECT_TRUE(std::get<0>(torch::cat(all).sort()).equal(torch::arange(T)));
  }
  auto why = error_of([] { parallel::zigzag_index(10, 2, 0); });
  EXPECT_NE(why.find("sequence of 10 positions does not split into 2*context = 4"), std::string::npos) << why;
}

TEST(ContextBlocks, MergedBlocksEqualAttentionOverAllKeys) {
  torch::manual_seed(1);
  auto q = randn({2, 4, 5, 8}), k = randn({2, 2, 12, 8}), v = randn({2, 2, 12, 8});
  const double scale = 0.3;
  auto whole_block = parallel::attention_block(q, k, v, false, scale, /*fused=*/false);
  Tensor out, lse;
  for (auto [from, len] : {std::pair<int64_t, int64_t>{0, 3}, {3, 5}, {8, 4}}) {
    auto b = parallel::attention_block(q, k.narrow(2, from, len), v.narrow(2, from, len), false, scale, false);
    parallel::merge_attention(out, lse, b.out, b.lse);
  }
  EXPECT_LE(max_relative(out, whole_block.out), 1e-14);
  EXPECT_LE(max_relative(lse, whole_block.lse), 1e-14);
  // lse is logsumexp of the scores, over repeated key/value heads.
  auto scores = q.matmul(k.repeat_interleave(2, 1).transpose(-2, -1)) * scale;
  EXPECT_LE(max_relative(lse, scores.logsumexp(-1)), 1e-14);
}

TEST(ContextBlocks, FlashBlocksEqualThePlainFormulasForwardAndBackward) {
  torch::manual_seed(2);
  for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{4, 4}, {4, 2}, {6, 1}}) {
    for (bool causal : {true, false}) {
      auto q = randn({2, hq, 6, 8}), k = randn({2, hkv, 6, 8}), v = randn({2, hkv, 6, 8}), g = randn({2, hq, 6, 8});
      auto fused = parallel::attention_block(q, k, v, causal, 0.35, true);
      auto plain = parallel::attention_block(q, k, v, causal, 0.35, false);
      EXPECT_LE(max_relative(fused.out, plain.out), 1e-13);
      EXPECT_LE(max_relative(fused.lse, plain.lse), 1e-13);
      // A block's backward from the whole attention's out and lse: the first 4 keys of 6, not
      // causal (the diagonal block of a longer sequence is the causal case above).
      auto kb = k.narrow(2, 0, 4), vb = v.narrow(2, 0, 4);
      auto [dq1, dk1, dv1] = parallel::attention_block_backward(g, q, kb, vb, plain.out, plain.lse, false, 0.35, true);
      auto [dq2, dk2, dv2] = parallel::attention_block_backward(g, q, kb, vb, plain.out, plain.lse, false, 0.35, false);
      EXPECT_LE(max_relative(dq1, dq2), 1e-12);
      EXPECT_LE(max_relative(dk1, dk2), 1e-12);
      EXPECT_LE(max_relative(dv1, dv2), 1e-12);
      EXPECT_EQ(dk1.size(1), hkv);
    }
  }
}

TEST(ContextBlocks, BlockBackwardsSumToTheWholeGradient) {
  torch::manual_seed(3);
  auto q = randn({1, 4, 8, 4}), k = randn({1, 2, 8, 4}), v = randn({1, 2, 8, 4}), w = randn({1, 4, 8, 4});
  auto ref = whole(q, k, v, w, /*causal=*/true);
  const double scale = 0.5;
  auto all = parallel::attention_block(q, k, v, true, scale, false);
  // Split the causal 8x8 problem into the diagonal blocks and the block below them.
  auto lo = [](const Tensor& t) { return t.narrow(2, 0, 4); };
  auto hi = [](const Tensor& t) { return t.narrow(2, 4, 4); };
  auto [a1, b1, e1] = parallel::attention_block_backward(lo(w), lo(q), lo(k), lo(v), lo(all.out), lo(all.lse), true, scale);
  auto [a2, b2, e2] = parallel::attention_block_backward(hi(w), hi(q), hi(k), hi(v), hi(all.out), hi(all.lse), true, scale);
  auto [a3, b3, e3] =
      parallel::attention_block_backward(hi(w), hi(q), lo(k), lo(v), hi(all.out), hi(all.lse).contiguous(), false, scale);
  // scale 0.5 = 1/sqrt(4): the reference's default.
  EXPECT_LE(max_relative(torch::cat({a1, a2 + a3}, 2), ref.dq), 1e-12);
  EXPECT_LE(max_relative(torch::cat({b1 + b3, b2}, 2), ref.dk), 1e-12);
  EXPECT_LE(max_relative(torch::cat({e1 + e3, e2}, 2), ref.dv), 1e-12);
}

TEST(RingAttention, ThreadsOfARingEqualAttentionOverTheWholeSequence) {
  for (int c : {1, 2, 3, 4}) {
    for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{4, 4}, {4, 2}, {6, 1}}) {
      for (bool causal : {true, false}) {
        torch::manual_seed(10 * c + hq + hkv);
        const int64_t T = 4 * c;
        auto q = randn({2, hq, T, 8}), k = randn({2, hkv, T, 8}), v = randn({2, hkv, T, 8}), w = randn({2, hq, T, 8});
        auto ref = whole(q, k, v, w, causal);
        auto boxes = std::make_shared<Mailboxes>();
        std::vector<std::string> errors(c);
        std::vector<Reference> got(c);
        std::vector<std::thread> ranks;
        for (int r = 0; r < c; ++r) {
          ranks.emplace_back([&, r] {
            try {
              at::set_num_threads(1);
              auto idx = parallel::zigzag_index(T, c, r);
              auto mine = [&](const Tensor& t) { return t.index_select(2, idx).requires_grad_(); };
              auto qr = mine(q), kr = mine(k), vr = mine(v);
              auto link = c10::make_intrusive<ThreadRing>(boxes, r, c);
              auto out = parallel::ring_attention(qr, kr, vr, link, causal, 1.0 / std::sqrt(8.0));
              (out * w.index_select(2, idx)).sum().backward();
              got[r] = {out.detach(), qr.grad(), kr.grad(), vr.grad()};
            } catch (const std::exception& e) {
              errors[r] = e.what();
            }
          });
        }
        for (auto& t : ranks) t.join();
        for (int r = 0; r < c; ++r) {
          ASSERT_EQ(errors[r], "");
          auto idx = parallel::zigzag_index(T, c, r);
          SCOPED_TRACE("c=" + std::to_string(c) + " r=" + std::to_string(r) + " heads " + std::to_string(hq) + "/" +
                       std::to_string(hkv) + (causal ? " causal" : ""));
          EXPECT_LE(max_relative(got[r].out, ref.out.index_select(2, idx)), 1e-13);
          EXPECT_LE(max_relative(got[r].dq, ref.dq.index_select(2, idx)), 1e-12);
          EXPECT_LE(max_relative(got[r].dk, ref.dk.index_select(2, idx)), 1e-12);
          EXPECT_LE(max_relative(got[r].dv, ref.dv.index_select(2, idx)), 1e-12);
        }
      }
    }
  }
}

TEST(ContextAttention, AllToAllRefusesHeadsThatDoNotSplit) {
  using parallel::ContextMode;
  EXPECT_EQ(parallel::context_mode_refusal(ContextMode::AllToAll, 8, 2, 4), "");  // kv heads repeated
  EXPECT_EQ(parallel::context_mode_refusal(ContextMode::AllToAll, 8, 8, 4), "");
  EXPECT_EQ(parallel::context_mode_refusal(ContextMode::Ring, 6, 1, 4), "");
  auto why = parallel::context_mode_refusal(ContextMode::AllToAll, 6, 6, 4);
  EXPECT_NE(why.find("6 query heads do not divide by 4"), std::string::npos) << why;
  why = parallel::context_mode_refusal(ContextMode::AllToAll, 12, 3, 4);
  EXPECT_NE(why.find("3 key/value heads neither divide by 4 nor divide it"), std::string::npos) << why;
  auto bad = error_of([] { parallel::parse_context_mode("zigzag"); });
  EXPECT_NE(bad.find("unknown mode 'zigzag'"), std::string::npos) << bad;
}
