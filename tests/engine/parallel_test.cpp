// GoogleTest for the parallel engine without processes: sharding arithmetic (slices, padding,
// unequal parts, re-cutting along another dimension), the mesh layout for every size that
// divides 8 (context and expert groups included), the data-parallel bucket layout, and the parallelized model's
// records, lifetime, thread-bound hooks and train_step on a world of one, the split of blocks into
// pipeline stages, and the peak activation bytes a rank's pipeline schedule holds.
#include <gtest/gtest.h>

#include <sstream>
#include <thread>

#include "engine/dist/mesh.hpp"
#include "engine/models/models.hpp"
#include "engine/nn/layers.hpp"
#include "engine/parallel/data_parallel.hpp"
#include "engine/parallel/parallel_model.hpp"
#include "engine/parallel/pipeline.hpp"
#include "engine/parallel/sharding.hpp"
#include "tests/engine/testing.hpp"

using namespace partrain;
using parallel::Sharding;
using parallel::Slice;
using torch::Tensor;

namespace {

using testing_util::error_of;

// A logical tensor whose every element differs: (rows, cols) of 0, 1, 2, ...
Tensor numbered(int64_t rows, int64_t cols) { return torch::arange(rows * cols, torch::kFloat64).view({rows, cols}); }

dist::World& world_of_one() {
  auto& w = dist::World::instance();
  if (!w.initialized()) w.init(dist::WorldOptions{});
  return w;
}

// A module holding one parameter that it says is split as `split` (sizes only, no group).
class SplitHolder : public nn::Module {
 public:
  SplitHolder(Tensor weight, c10::optional<Sharding> split) : nn::Module("SplitHolder"), split_(std::move(split)) {
    register_parameter("weight", std::move(weight));
  }
  const Sharding* sharding_of(const std::string& name) const override {
    return name == "weight" && split_ ? &*split_ : nullptr;
  }

 private:
  c10::optional<Sharding> split_;
};

}  // namespace

TEST(Sharding, SlicesOfAPaddedDimension) {
  // 10 rows over 4 ranks, padded to 12: 3 rows a rank, the last holds 1 row and 2 of padding.
  auto s = Sharding::split(nullptr, 4, 0, {10, 3}, {}, 12);
  EXPECT_EQ(s.slices(0), (std::vector<Slice>{{0, 3}}));
  EXPECT_EQ(s.slices(2), (std::vector<Slice>{{6, 3}}));
  EXPECT_EQ(s.slices(3), (std::vector<Slice>{{9, 1}}));
  EXPECT_EQ(s.local_shape(), (std::vector<int64_t>{3, 3}));
  auto full = numbered(10, 3);
  std::vector<Tensor> parts;
  for (int r = 0; r < 4; ++r) parts.push_back(parallel::local_part(full, s, r));
  EXPECT_TRUE(parts[3].narrow(0, 1, 2).eq(0).all().item<bool>()) << "padding rows are zero";
  EXPECT_TRUE(parts[3][0].equal(full[9])) << "the last rank's one real row";
  EXPECT_TRUE(parallel::assemble(parts, s).equal(full)) << "the parts put back give the logical tensor";
}

TEST(Sharding, UnequalPartsEachSplitAcrossTheGroup) {
  // Grouped-query attention's fused q, k, v: 8 query rows, 4 key and 4 value rows, over 2 ranks.
  auto s = Sharding::split(nullptr, 2, 0, {16, 5}, {8, 4, 4});
  EXPECT_EQ(s.slices(0), (std::vector<Slice>{{0, 4}, {8, 2}, {12, 2}}));
  EXPECT_EQ(s.slices(1), (std::vector<Slice>{{4, 4}, {10, 2}, {14, 2}}));
  EXPECT_EQ(s.local_shape(), (std::vector<int64_t>{8, 5}));
  auto full = numbered(16, 5);
  auto mine = parallel::local_part(full, s, 1);
  EXPECT_TRUE(mine.narrow(0, 0, 4).equal(full.narrow(0, 4, 4))) << "rank 1's half of q";
  EXPECT_TRUE(mine.narrow(0, 4, 2).equal(full.narrow(0, 10, 2))) << "rank 1's half of k";
  EXPECT_TRUE(mine.narrow(0, 6, 2).equal(full.narrow(0, 14, 2))) << "rank 1's half of v";
  EXPECT_TRUE(parallel::assemble({parallel::local_part(full, s, 0), mine}, s).equal(full));
  EXPECT_NE(error_of([&] { s.equal_parts(); }).find("unequal sizes [8, 4, 4]"), std::string::npos);
  EXPECT_EQ(Sharding::split(nullptr, 2, 0, {12, 5}, {4, 4, 4}).equal_parts(), 3);
  EXPECT_NE(s.describe().find("parts 8+4+4"), std::string::npos) << s.describe();
}

TEST(Sharding, SizesThatDoNotFitAreRefusedByName) {
  EXPECT_NE(error_of([] { Sharding::split(nullptr, 2, 0, {16, 5}, {8, 4}); }).find("do not add up to dimension 0's size 16"),
            std::string::npos);
  EXPECT_NE(error_of([] { Sharding::split(nullptr, 4, 0, {12, 5}, {6, 3, 3}); }).find("a part of 6"), std::string::npos);
  EXPECT_NE(error_of([] { Sharding::split(nullptr, 2, 0, {12, 5}, {6, 6}, 14); }).find("cannot be padded"),
            std::string::npos);
  EXPECT_NE(error_of([] { Sharding::split(nullptr, 4, 0, {10, 3}, {}, 11); }).find("padded to 11"), std::string::npos);
  EXPECT_NE(error_of([] { Sharding::split(nullptr, 2, 2, {10, 3}); }).find("cannot split dimension 2"),
            std::string::npos);
  EXPECT_NE(error_of([] { Sharding::split(nullptr, 2, 1, {4, 4}).slices(2); }).find("rank 2 is outside"),
            std::string::npos);
}

TEST(Sharding, APieceCutAlongAnotherDimensionReadsTheSameValues) {
  // The logical tensor saved cut along dim 0 (fused parts, 2 ranks) and read back cut along dim 1
  // (3 ranks): each new piece assembled from the old pieces through their slices equals the
  // piece cut from the logical tensor directly.
  auto full = numbered(12, 6);
  auto by_rows = Sharding::split(nullptr, 2, 0, {12, 6}, {4, 8});
  auto by_cols = Sharding::split(nullptr, 3, 1, {12, 6});
  std::vector<Tensor> saved;
  for (int r = 0; r < 2; ++r) saved.push_back(parallel::local_part(full, by_rows, r));
  for (int r = 0; r < 3; ++r) {
    auto piece = torch::zeros(by_cols.local_shape(), torch::kFloat64);
    for (int q = 0; q < 2; ++q) {
      int64_t offset = 0;
      for (auto [start, rows] : by_rows.slices(q)) {
        int64_t col = 0;
        for (auto [first, cols] : by_cols.slices(r)) {
          piece.narrow(0, start, rows).narrow(1, col, cols).copy_(saved[q].narrow(0, offset, rows).narrow(1, first, cols));
          col += cols;
        }
        offset += rows;
      }
    }
    EXPECT_TRUE(piece.equal(parallel::local_part(full, by_cols, r))) << "rank " << r << " of the column cut";
  }
}

TEST(MeshLayout, EverySizeThatDividesEightLaysOutAndGroupsAgree) {
  const std::vector<int> sizes{1, 2, 4, 8};
  int layouts = 0;
  for (int t : sizes)
    for (int p : sizes)
      for (int d : sizes) {
        if (t * p * d != 8) continue;
        for (int z : sizes) {
          if (z > d || d % z) continue;
          SCOPED_TRACE("tensor=" + std::to_string(t) + " pipeline=" + std::to_string(p) + " data=" + std::to_string(d) +
                       " zero=" + std::to_string(z));
          dist::Layout layout({t, p, 0, z}, 8);
          ++layouts;
          ASSERT_EQ(layout.data, d);
          ASSERT_EQ(layout.zero, z);
          for (int r = 0; r < 8; ++r) {
            auto c = layout.coord(r);
            EXPECT_EQ(layout.rank_of(c), r);
            EXPECT_EQ(r, c.tensor + t * (c.data + d * c.pipeline)) << "tensor fastest, then data, then pipeline";
          }
          const std::map<std::string, int> want{{"world", 8}, {"tensor", t}, {"data", d},
                                                {"pipeline", p}, {"unit", t * p}, {"zero", z}};
          for (const auto& [kind, size] : want) {
            std::vector<int> seen(8, 0);
            for (const auto& g : layout.groups(kind)) {
              EXPECT_EQ(static_cast<int>(g.size()), size) << kind;
              for (int member : g) {
                ++seen[member];
                EXPECT_EQ(layout.group_of(kind, member), g) << kind << ": every member sees the same group";
              }
            }
            for (int r = 0; r < 8; ++r) EXPECT_EQ(seen[r], 1) << kind << ": rank " << r << " is in exactly one group";
          }
          for (int r = 0; r < 8; ++r) {
            auto c = layout.coord(r);
            for (int m : layout.group_of("tensor", r)) {
              EXPECT_EQ(layout.coord(m).data, c.data);
              EXPECT_EQ(layout.coord(m).pipeline, c.pipeline);
            }
            for (int m : layout.group_of("data", r)) EXPECT_EQ(layout.coord(m).tensor, c.tensor);
            auto data = layout.group_of("data", r);
            for (int m : layout.group_of("zero", r))
              EXPECT_NE(std::find(data.begin(), data.end(), m), data.end()) << "a zero group lies in the data group";
          }
        }
      }
  EXPECT_EQ(layouts, 20) << "the 10 (tensor, pipeline, data) with product 8, each with every zero size dividing data";
  EXPECT_NE(error_of([] { dist::Layout({3, 1, 0, 0}, 8); }).find("tensor=3 x pipeline=1 = 3 does not divide the world"),
            std::string::npos);
  EXPECT_NE(error_of([] { dist::Layout({2, 1, 0, 3}, 8); }).find("zero=3 does not divide the data size 4"),
            std::string::npos);
  EXPECT_EQ(dist::Layout({2, 1, 0}, 8).zero, 1) << "unset: ZeRO off";
  EXPECT_EQ(dist::Layout({2, 1, 0, 0}, 8).zero, 4) << "zero <= 0: the whole data group (InternLM's zero1)";
  // zero_across: the ranks at one place of every zero group (hierarchical ZeRO's all-reduce).
  dist::Layout groups_of_two({1, 1, 0, 2}, 8);
  EXPECT_EQ(groups_of_two.group_of("zero", 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(groups_of_two.group_of("zero_across", 5), (std::vector<int>{1, 3, 5, 7}));
}

// The coordinates every member of a group of `kind` shares with the others (1: shared).
struct Shared {
  bool tensor, context, data, pipeline;
};

TEST(MeshLayout, EveryTensorContextDataPipelineOfEightPartitionsTheWorldByItsCoordinates) {
  const std::vector<int> sizes{1, 2, 4, 8};
  const std::map<std::string, Shared> shared{
      {"tensor", {false, true, true, true}},   {"context", {true, false, true, true}},
      {"data", {true, true, false, true}},     {"data_context", {true, false, false, true}},
      {"pipeline", {true, true, true, false}}, {"unit", {false, false, true, false}},
      {"zero", {true, false, false, true}},    {"zero_across", {true, false, false, true}}};
  int layouts = 0;
  for (int t : sizes)
    for (int c : sizes)
      for (int d : sizes)
        for (int p : sizes) {
          if (t * c * d * p != 8) continue;
          for (int z : sizes) {
            if ((d * c) % z) continue;
            SCOPED_TRACE("tensor=" + std::to_string(t) + " context=" + std::to_string(c) + " data=" +
                         std::to_string(d) + " pipeline=" + std::to_string(p) + " zero=" + std::to_string(z));
            dist::MeshOptions o;
            o.tensor = t, o.context = c, o.pipeline = p, o.zero = z;  // data from the world
            dist::Layout layout(o, 8);
            ++layouts;
            ASSERT_EQ(layout.data, d);
            ASSERT_EQ(layout.context, c);
            ASSERT_EQ(layout.zero, z);
            ASSERT_EQ(layout.world(), 8);
            for (int r = 0; r < 8; ++r) {
              auto at = layout.coord(r);
              EXPECT_EQ(layout.rank_of(at), r) << "rank_of(coord(r)) == r";
              EXPECT_EQ(r, at.tensor + t * (at.context + c * (at.data + d * at.pipeline)))
                  << "tensor fastest, then context, then data, then pipeline";
            }
            const std::map<std::string, int> want{
                {"world", 8},           {"tensor", t},   {"context", c},     {"data", d},
                {"data_context", d * c}, {"pipeline", p}, {"unit", t * c * p}, {"zero", z},
                {"zero_across", d * c / z}};
            for (const auto& [kind, size] : want) {
              std::vector<int> seen(8, 0);
              for (const auto& g : layout.groups(kind)) {
                EXPECT_EQ(static_cast<int>(g.size()), size) << kind;
                EXPECT_TRUE(std::is_sorted(g.begin(), g.end())) << kind << ": group ranks in global-rank order";
                for (int member : g) {
                  ++seen[member];
                  EXPECT_EQ(layout.group_of(kind, member), g) << kind << ": every member sees the same group";
                  if (!shared.count(kind)) continue;
                  const Shared& same = shared.at(kind);
                  auto a = layout.coord(g.front()), b = layout.coord(member);
                  if (same.tensor) EXPECT_EQ(a.tensor, b.tensor) << kind << " shares the tensor coordinate";
                  if (same.context) EXPECT_EQ(a.context, b.context) << kind << " shares the context coordinate";
                  if (same.data) EXPECT_EQ(a.data, b.data) << kind << " shares the data coordinate";
                  if (same.pipeline) EXPECT_EQ(a.pipeline, b.pipeline) << kind << " shares the pipeline coordinate";
                }
              }
              for (int r = 0; r < 8; ++r) EXPECT_EQ(seen[r], 1) << kind << ": rank " << r << " is in exactly one group";
            }
            for (int r = 0; r < 8; ++r) {
              // data_context is the union of the data groups of r's context group.
              std::vector<int> joined;
              for (int x : layout.group_of("context", r))
                for (int m : layout.group_of("data", x)) joined.push_back(m);
              std::sort(joined.begin(), joined.end());
              const auto replicas = layout.group_of("data_context", r);
              EXPECT_EQ(replicas, joined) << "data_context = the data groups across context, rank " << r;
              // A zero group is a consecutive part of data_context; zero_across takes one rank of each.
              const auto zero = layout.group_of("zero", r);
              auto first = std::find(replicas.begin(), replicas.end(), zero.front());
              ASSERT_NE(first, replicas.end()) << "a zero group lies in data_context";
              EXPECT_EQ((first - replicas.begin()) % z, 0) << "zero groups start at multiples of zero";
              EXPECT_TRUE(std::equal(zero.begin(), zero.end(), first)) << "a zero group is consecutive in data_context";
              for (int m : layout.group_of("zero_across", r)) {
                EXPECT_NE(std::find(replicas.begin(), replicas.end(), m), replicas.end()) << "zero_across lies in data_context";
                const auto other = layout.group_of("zero", m);
                EXPECT_EQ(std::find(other.begin(), other.end(), m) - other.begin(),
                          std::find(zero.begin(), zero.end(), r) - zero.begin())
                    << "zero_across: the same place in every zero group";
              }
            }
          }
        }
  EXPECT_EQ(layouts, 50) << "the 20 (tensor, context, data, pipeline) with product 8, each with every zero dividing "
                            "data x context";
}

TEST(MeshLayout, ContextSizesThatDoNotFitAreRefusedNamingThem) {
  auto options = [](int t, int c, int d, int z) {
    dist::MeshOptions o;
    o.tensor = t, o.context = c, o.data = d, o.zero = z;
    return o;
  };
  EXPECT_NE(error_of([&] { dist::Layout(options(2, 3, 0, 1), 8); })
                .find("tensor=2 x context=3 x pipeline=1 = 6 does not divide the world of 8 ranks"),
            std::string::npos);
  EXPECT_NE(error_of([&] { dist::Layout(options(2, 2, 4, 1), 8); })
                .find("tensor=2 x context=2 x data=4 x pipeline=1 = 16 ranks, but the world has 8"),
            std::string::npos);
  EXPECT_NE(error_of([&] { dist::Layout(options(1, 2, 0, 3), 8); })
                .find("zero=3 does not divide data x context = 4 x 2 = 8"),
            std::string::npos);
  EXPECT_NE(error_of([&] { dist::Layout(options(1, 0, 0, 1), 8); }).find("context=0"), std::string::npos);
  EXPECT_EQ(dist::Layout(options(2, 2, 0, 0), 8).zero, 4) << "zero <= 0: the whole data_context group";
  dist::Layout l(options(1, 2, 0, 1), 8);
  EXPECT_EQ(l.group_of("context", 5), (std::vector<int>{4, 5})) << "context neighbours are adjacent without tensor";
  EXPECT_EQ(l.group_of("data", 5), (std::vector<int>{1, 3, 5, 7})) << "data strides by tensor x context";
  EXPECT_EQ(l.group_of("unit", 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(dist::Layout(options(1, 2, 0, 2), 8).group_of("zero", 5), (std::vector<int>{4, 5}))
      << "a zero group of two is one data rank's context pair";
  EXPECT_EQ(dist::Layout(options(1, 2, 0, 2), 8).group_of("zero_across", 5), (std::vector<int>{1, 3, 5, 7}));
}

TEST(Mesh, ZeroGroupsMustFitTheDataGroup) {
  auto& w = world_of_one();
  EXPECT_NE(error_of([&] { dist::Mesh({1, 1, 0, 2}, w); }).find("zero=2 does not divide the data size 1"),
            std::string::npos);
  dist::Mesh mesh({}, w);
  EXPECT_EQ(mesh.describe().find("zero:"), std::string::npos) << "no zero group printed while ZeRO is off";
  EXPECT_EQ(mesh.zero_across(), nullptr) << "no hierarchical groups without ZeRO";
  EXPECT_EQ(mesh.group("data_context"), mesh.group("data")) << "without context, data_context is the data group";
  EXPECT_EQ(mesh.size("context"), 1);
  EXPECT_EQ(mesh.describe().find("data_context:"), std::string::npos) << "no context groups printed while unsplit";
  EXPECT_NE(error_of([&] { mesh.group("experts"); }).find("expected world, tensor, context, data, data_context"),
            std::string::npos);
}

// The mesh sizes of a layout with expert groups (data from the world).
dist::MeshOptions expert_mesh(int tensor, int context, int pipeline, int expert) {
  dist::MeshOptions o;
  o.tensor = tensor, o.context = context, o.pipeline = pipeline, o.expert = expert;
  return o;
}

TEST(MeshLayout, ExpertGroupsSplitDataContextIntoConsecutiveAndStridedRanks) {
  // data=4 expert=2: experts split over pairs of neighbours, each half synced over the ranks two apart.
  dist::Layout pairs(expert_mesh(1, 1, 1, 2), 4);
  EXPECT_EQ(pairs.group_of("expert", 1), (std::vector<int>{0, 1}));
  EXPECT_EQ(pairs.group_of("expert", 2), (std::vector<int>{2, 3}));
  EXPECT_EQ(pairs.group_of("expert_data", 1), (std::vector<int>{1, 3})) << "the ranks holding the same experts";
  EXPECT_EQ(pairs.group_of("expert_tensor", 2), (std::vector<int>{2, 3})) << "without tensor: the expert group";
  for (int r = 0; r < 4; ++r) EXPECT_EQ(pairs.coord(r).expert, r % 2) << "rank " << r << "'s place in its expert group";
  // data=2 context=2 expert=4: one expert group of all of data_context; each rank alone in expert_data.
  dist::Layout across(expert_mesh(1, 2, 1, 4), 4);
  EXPECT_EQ(across.group_of("expert", 2), (std::vector<int>{0, 1, 2, 3})) << "expert spans data x context";
  EXPECT_EQ(across.group_of("expert_data", 2), (std::vector<int>{2})) << "every rank its own experts";
  for (int r = 0; r < 4; ++r) EXPECT_EQ(across.coord(r).expert, r) << "expert = context + C * data";
  // tensor=2 data=2 expert=2: expert groups stride by the tensor size; expert_tensor joins them.
  dist::Layout tp(expert_mesh(2, 1, 1, 2), 4);
  EXPECT_EQ(tp.group_of("expert", 1), (std::vector<int>{1, 3})) << "same tensor rank, consecutive data places";
  EXPECT_EQ(tp.group_of("expert_data", 1), (std::vector<int>{1}));
  EXPECT_EQ(tp.group_of("expert_tensor", 1), (std::vector<int>{0, 1, 2, 3})) << "tensor x expert, global-rank order";
  EXPECT_EQ(tp.coord(3).expert, 1);
  // tensor=2 context=2 data=2 expert=2 of 8: rank 5 (tensor 1, context 0, data 1) at data_context place 2.
  dist::Layout all(expert_mesh(2, 2, 1, 2), 8);
  EXPECT_EQ(all.group_of("expert", 5), (std::vector<int>{5, 7})) << "places 2 and 3: context 0 and 1 of data 1";
  EXPECT_EQ(all.group_of("expert_data", 5), (std::vector<int>{1, 5})) << "places 0 and 2";
  EXPECT_EQ(all.group_of("expert_tensor", 5), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(all.coord(5).expert, 0);
  // pipeline=2 data=2 expert=2: groups stay within one pipeline stage.
  EXPECT_EQ(dist::Layout(expert_mesh(1, 1, 2, 2), 4).group_of("expert", 3), (std::vector<int>{2, 3}));
  // Unset (1): experts not split; expert_data has data_context's members and expert_tensor tensor's.
  dist::Layout dense(expert_mesh(2, 2, 1, 1), 8);
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(dense.group_of("expert", r), (std::vector<int>{r})) << "an expert group of one";
    EXPECT_EQ(dense.group_of("expert_data", r), dense.group_of("data_context", r));
    EXPECT_EQ(dense.group_of("expert_tensor", r), dense.group_of("tensor", r));
    EXPECT_EQ(dense.coord(r).expert, 0);
  }
}

TEST(MeshLayout, EveryExpertSizeDividingDataContextOfEightPartitionsTheWorld) {
  const std::vector<int> sizes{1, 2, 4, 8};
  int layouts = 0;
  for (int t : sizes)
    for (int c : sizes)
      for (int p : sizes) {
        if (8 % (t * c * p)) continue;
        const int d = 8 / (t * c * p);
        for (int e : sizes) {
          if ((d * c) % e) continue;
          SCOPED_TRACE("tensor=" + std::to_string(t) + " context=" + std::to_string(c) + " data=" + std::to_string(d) +
                       " pipeline=" + std::to_string(p) + " expert=" + std::to_string(e));
          dist::Layout layout(expert_mesh(t, c, p, e), 8);
          ++layouts;
          ASSERT_EQ(layout.expert, e);
          const std::map<std::string, int> want{{"expert", e}, {"expert_data", d * c / e}, {"expert_tensor", t * e}};
          for (const auto& [kind, size] : want) {
            std::vector<int> seen(8, 0);
            for (const auto& g : layout.groups(kind)) {
              EXPECT_EQ(static_cast<int>(g.size()), size) << kind;
              EXPECT_TRUE(std::is_sorted(g.begin(), g.end())) << kind << ": group ranks in global-rank order";
              for (int member : g) {
                ++seen[member];
                EXPECT_EQ(layout.group_of(kind, member), g) << kind << ": every member sees the same group";
              }
            }
            for (int r = 0; r < 8; ++r) EXPECT_EQ(seen[r], 1) << kind << ": rank " << r << " is in exactly one group";
          }
          for (int r = 0; r < 8; ++r) {
            const auto replicas = layout.group_of("data_context", r);
            const auto expert = layout.group_of("expert", r), across = layout.group_of("expert_data", r);
            // expert: consecutive in data_context, starting at a multiple of e; r at its coordinate.
            auto first = std::find(replicas.begin(), replicas.end(), expert.front());
            ASSERT_NE(first, replicas.end()) << "an expert group lies in data_context";
            EXPECT_EQ((first - replicas.begin()) % e, 0) << "expert groups start at multiples of expert";
            EXPECT_TRUE(std::equal(expert.begin(), expert.end(), first)) << "an expert group is consecutive";
            EXPECT_EQ(expert[layout.coord(r).expert], r) << "coord.expert is r's place in its expert group";
            // expert_data: the data_context ranks at r's place in every expert group.
            for (int m : across) {
              EXPECT_NE(std::find(replicas.begin(), replicas.end(), m), replicas.end())
                  << "expert_data lies in data_context";
              EXPECT_EQ(layout.coord(m).expert, layout.coord(r).expert) << "expert_data: the same experts";
            }
            std::vector<int> meet;
            for (int m : expert)
              if (std::find(across.begin(), across.end(), m) != across.end()) meet.push_back(m);
            EXPECT_EQ(meet, std::vector<int>{r}) << "expert and expert_data cross at r alone";
            // expert_tensor: the tensor groups of r's expert group, joined.
            std::vector<int> joined;
            for (int m : expert)
              for (int x : layout.group_of("tensor", m)) joined.push_back(x);
            std::sort(joined.begin(), joined.end());
            EXPECT_EQ(layout.group_of("expert_tensor", r), joined) << "expert_tensor = tensor x expert";
          }
        }
      }
  EXPECT_EQ(layouts, 50) << "the 20 (tensor, context, data, pipeline) with product 8, each with every expert "
                            "dividing data x context";
}

TEST(MeshLayout, ExpertSizesThatDoNotDivideDataContextAreRefusedNamingThem) {
  EXPECT_NE(error_of([] { dist::Layout(expert_mesh(1, 1, 1, 3), 4); })
                .find("mesh: expert=3 does not divide data x context = 4 (expert ranks are data ranks"),
            std::string::npos);
  EXPECT_NE(error_of([] { dist::Layout(expert_mesh(2, 2, 1, 3), 8); })
                .find("expert=3 does not divide data x context = 2 x 2 = 4"),
            std::string::npos);
  EXPECT_NE(error_of([] { dist::Layout(expert_mesh(1, 1, 1, 8), 4); }).find("expert=8 does not divide"),
            std::string::npos)
      << "larger than data x context";
  EXPECT_NE(error_of([] { dist::Layout(expert_mesh(1, 1, 1, 0), 4); }).find("mesh sizes must be positive"),
            std::string::npos);
  EXPECT_NE(error_of([] { dist::Layout(expert_mesh(2, 1, 1, 2), 2); })
                .find("expert=2 does not divide data x context = 1"),
            std::string::npos)
      << "a tensor pair has no data ranks to split experts over";
}

TEST(Mesh, ExpertGroupsReuseTheDenseCommunicatorsWhileExpertsAreNotSplit) {
  auto& w = world_of_one();
  dist::Mesh mesh({}, w);
  EXPECT_EQ(mesh.group("expert_data"), mesh.group("data_context")) << "expert=1: expert_data is data_context";
  EXPECT_EQ(mesh.group("expert_tensor"), mesh.group("tensor")) << "expert=1: expert_tensor is tensor";
  EXPECT_EQ(mesh.size("expert"), 1);
  EXPECT_EQ(mesh.coord().expert, 0);
  EXPECT_EQ(mesh.describe().find("expert"), std::string::npos) << "print(mesh) reads as before while unsplit";
  EXPECT_NE(error_of([&] { dist::Mesh(expert_mesh(1, 1, 1, 2), w); })
                .find("expert=2 does not divide data x context = 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { mesh.group("experts"); }).find("expected world, tensor, context, data, data_context, "
                                                          "pipeline, unit, zero, expert, expert_data or expert_tensor"),
            std::string::npos);
}

TEST(DataParallel, BucketsInReverseOrderUnderTheCapEveryParameterOnce) {
  std::vector<parallel::BucketParam> params;
  const std::vector<int64_t> bytes{400, 100, 100, 300, 50, 700, 10, 10};
  for (auto b : bytes) params.push_back({b, torch::kFloat32, torch::kCPU});
  params[2].dtype = torch::kFloat64;  // a dtype change closes a bucket
  const int64_t cap = 300;
  auto buckets = parallel::bucket_layout(params, cap);
  std::vector<size_t> order;
  for (const auto& b : buckets) {
    ASSERT_FALSE(b.empty());
    int64_t before_last = 0;
    for (size_t i = 0; i + 1 < b.size(); ++i) before_last += bytes[b[i]];
    EXPECT_LT(before_last, cap) << "a bucket is closed once it reaches the cap";
    for (size_t k : b) {
      order.push_back(k);
      EXPECT_EQ(params[k].dtype, params[b.front()].dtype) << "one dtype a bucket";
    }
  }
  std::vector<size_t> reverse;
  for (size_t k = params.size(); k-- > 0;) reverse.push_back(k);
  EXPECT_EQ(order, reverse) << "every parameter exactly once, in reverse parameter order";
  EXPECT_EQ(buckets.size(), 4u) << "{7, 6, 5} (reaches the cap), {4, 3}, {2} (float64), {1, 0}";
  EXPECT_EQ(parallel::bucket_layout(params, int64_t{1} << 40).size(), 3u) << "a huge cap: split by dtype only";
}

TEST(ParallelModel, ShardingIsAskedOfTheHolderAndTiesMustAgree) {
  auto root = std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{});
  auto split = Sharding::split(nullptr, 2, 0, {8, 3});
  auto a = std::make_shared<SplitHolder>(torch::zeros({4, 3}), split);
  root->set_child("a", a);
  root->set_child("b", std::make_shared<SplitHolder>(torch::zeros({2}), c10::nullopt));
  auto s = parallel::sharding_of(*root, "a.weight");
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(*s, split);
  EXPECT_FALSE(parallel::sharding_of(*root, "b.weight").has_value()) << "a whole parameter";
  EXPECT_FALSE(parallel::sharding_of(*root, "c.weight").has_value()) << "no such module";
  auto records = parallel::parameter_records(*root);
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].name, "a.weight");
  EXPECT_EQ(records[0].shape, (std::vector<int64_t>{8, 3})) << "the logical shape";
  EXPECT_EQ(records[0].flat_buffer, -1) << "filled by the composer's data parallelism, not here";
  EXPECT_FALSE(records[0].master.defined()) << "reserved for mixed precision";
  // The same tensor held whole by another module: refused, naming both names.
  auto whole = std::make_shared<SplitHolder>(a->named_parameters()["weight"], c10::nullopt);
  root->set_child("c", whole);
  auto error = error_of([&] { parallel::parameter_records(*root); });
  EXPECT_NE(error.find("'c.weight' is tied to 'a.weight'"), std::string::npos) << error;
  EXPECT_NE(error.find("whole"), std::string::npos) << error;
  // Held split the same way under both names: one record with an alias.
  root->set_child("c", std::make_shared<SplitHolder>(a->named_parameters()["weight"], split));
  records = parallel::parameter_records(*root);
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].aliases, (std::vector<std::string>{"c.weight"}));
}

TEST(ParallelModel, DroppedModelIsFreedWithItsState) {
  auto& w = world_of_one();
  const auto before = parallel::ParallelModel::live();
  std::weak_ptr<nn::Module> tree;
  std::weak_ptr<parallel::DataParallel> dp;
  {
    auto model = models::mlp(models::MlpOptions{{4, 8, 2}});
    tree = model;
    auto pm = parallel::ParallelModel::parallelize(model, std::make_shared<dist::Mesh>(dist::MeshOptions{}, w), {});
    model.reset();
    dp = pm->data_parallel();
    EXPECT_EQ(parallel::ParallelModel::live(), before + 1);
    EXPECT_EQ(parallel::ParallelModel::of(pm->module()), pm) << "the tree knows its owner";
    EXPECT_NE(error_of([&] { parallel::ParallelModel::parallelize(pm->root(), pm->mesh(), {}); }).find("already"),
              std::string::npos);
  }
  EXPECT_EQ(parallel::ParallelModel::live(), before);
  EXPECT_TRUE(tree.expired()) << "the module tree is freed with its owner";
  EXPECT_TRUE(dp.expired()) << "the data-parallel state is freed with its owner";
}

TEST(ParallelModel, TrainStepEqualsTheHandWrittenStep) {
  auto& w = world_of_one();
  auto mesh = std::make_shared<dist::Mesh>(dist::MeshOptions{}, w);
  torch::manual_seed(3);
  auto serial = models::mlp(models::MlpOptions{{6, 16, 5}});
  torch::manual_seed(3);
  auto pm = parallel::ParallelModel::parallelize(models::mlp(models::MlpOptions{{6, 16, 5}}), mesh, {});
  auto x = torch::randn({8, 6});
  auto y = torch::randint(0, 5, {8});
  auto loss = pm->train_step(x, y);
  auto want = nn::cross_entropy(serial->forward(std::vector<Tensor>{x}), y);
  want.backward();
  EXPECT_NEAR(loss.item<double>(), want.item<double>(), 1e-6);
  auto mine = pm->module().named_parameters(), theirs = serial->named_parameters();
  for (const auto& item : theirs)
    EXPECT_TRUE(torch::allclose(mine[item.key()].grad(), item.value().grad(), 1e-5, 1e-6)) << item.key();
  // accumulate = 2: the mean of the two halves' losses, and the gradient of the whole batch.
  for (auto& p : pm->module().parameters()) p.mutable_grad().zero_();
  auto accumulated = pm->train_step(x, y, {"cross_entropy", 2});
  EXPECT_NEAR(accumulated.item<double>(), want.item<double>(), 1e-6);
  for (const auto& item : theirs)
    EXPECT_TRUE(torch::allclose(mine[item.key()].grad(), item.value().grad(), 1e-5, 1e-6)) << item.key();
  EXPECT_NE(error_of([&] { pm->train_step(x, y, {"hinge"}); }).find("unknown loss 'hinge' (expected one of "
                                                                   "cross_entropy, mse)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { pm->train_step(x, y, {"cross_entropy", 3}); }).find("accumulate=3 does not divide the batch of 8"),
            std::string::npos);
}

TEST(DataParallel, ThreadBoundHooksRunOnlyOnTheirThread) {
  auto& w = world_of_one();
  auto mesh = std::make_shared<dist::Mesh>(dist::MeshOptions{}, w);
  auto pm = parallel::ParallelModel::parallelize(models::mlp(models::MlpOptions{{3, 4, 2}}), mesh, {});
  auto& dp = *pm->data_parallel();
  const auto main = std::this_thread::get_id();
  std::vector<std::thread::id> ran;
  dp.set_pre_hook([&](int, Tensor& flat) { ran.push_back(std::this_thread::get_id()); }, /*thread_bound=*/true);
  auto x = torch::randn({4, 3});
  auto y = torch::randint(0, 2, {4});
  std::thread autograd([&] { nn::cross_entropy(pm->module().forward(std::vector<Tensor>{x}), y).backward(); });
  autograd.join();
  EXPECT_TRUE(ran.empty()) << "no hook ran on the backward's thread";
  EXPECT_FALSE(dp.passes_since_sync() == 0) << "the sync waits for the hooks' thread";
  EXPECT_TRUE(dp.synced()) << "completed on this thread";
  ASSERT_FALSE(ran.empty());
  for (auto id : ran) EXPECT_EQ(id, main);
  // On the hooks' own thread the sync completes at the end of backward, as before.
  ran.clear();
  nn::cross_entropy(pm->module().forward(std::vector<Tensor>{x}), y).backward();
  EXPECT_EQ(dp.passes_since_sync(), 0);
  EXPECT_EQ(ran.size(), dp.buckets().size());
}

// ---- Pipeline stages --------------------------------------------------------------------------

TEST(PipelineSplit, UniformGivesTheRemainderToTheFirstStages) {
  parallel::StageBalance uniform;
  std::vector<int64_t> twelve(12, 1), ten(10, 1);
  EXPECT_EQ(parallel::split_stages(twelve, 2, uniform), (std::vector<int64_t>{0, 6, 12}));
  EXPECT_EQ(parallel::split_stages(ten, 4, uniform), (std::vector<int64_t>{0, 3, 6, 8, 10})) << "uneven: 3 3 2 2";
  // pipeline 2 x chunks 2: four virtual stages, chunk c of rank r is stage c*2 + r.
  EXPECT_EQ(parallel::split_stages(ten, 2 * 2, uniform), (std::vector<int64_t>{0, 3, 6, 8, 10}));
  EXPECT_EQ(parallel::split_stages(twelve, 12, uniform).size(), 13u) << "one block a stage";
  EXPECT_NE(error_of([&] { parallel::split_stages(ten, 11, uniform); }).find("10 blocks cannot fill 11 stages"),
            std::string::npos);
}

TEST(PipelineSplit, ParametersMinimizeTheLargestStageCountingTheEnds) {
  parallel::StageBalance by;
  by.method = "parameters";
  // Equal blocks, but a heavy first stage (embeddings): it takes fewer blocks.
  std::vector<int64_t> six(6, 10);
  EXPECT_EQ(parallel::split_stages(six, 2, by, /*first=*/40, /*last=*/0), (std::vector<int64_t>{0, 1, 6}));
  // Both ends heavy (a tied embedding and head counted on both): the middle stage takes more.
  EXPECT_EQ(parallel::split_stages(six, 3, by, 25, 25), (std::vector<int64_t>{0, 1, 5, 6}));
  // Uneven blocks: the split whose largest stage is smallest (30 | 10 10 10 | 5 5 20 -> max 30).
  std::vector<int64_t> blocks{30, 10, 10, 10, 5, 5, 20};
  auto b = parallel::split_stages(blocks, 3, by);
  int64_t largest = 0;
  for (size_t s = 0; s + 1 < b.size(); ++s) {
    int64_t sum = 0;
    for (auto i = b[s]; i < b[s + 1]; ++i) sum += blocks[i];
    EXPECT_GE(b[s + 1], b[s] + 1) << "every stage holds a block";
    largest = std::max(largest, sum);
  }
  EXPECT_EQ(largest, 30);
  EXPECT_EQ(b.front(), 0);
  EXPECT_EQ(b.back(), 7);
}

TEST(PipelineSplit, ExplicitSizesAreCheckedAgainstTheModel) {
  parallel::StageBalance sizes;
  sizes.method = "explicit";
  sizes.sizes = {5, 1};
  std::vector<int64_t> six(6, 1);
  EXPECT_EQ(parallel::split_stages(six, 2, sizes), (std::vector<int64_t>{0, 5, 6}));
  EXPECT_NE(error_of([&] { parallel::split_stages(six, 3, sizes); }).find("gives 2 stage sizes for 3 stages"),
            std::string::npos);
  sizes.sizes = {4, 1};
  EXPECT_NE(error_of([&] { parallel::split_stages(six, 2, sizes); }).find("gives 5 blocks in all, the model has 6"),
            std::string::npos);
  sizes.sizes = {6, 0};
  EXPECT_NE(error_of([&] { parallel::split_stages(six, 2, sizes); }).find("a stage of 0 blocks"), std::string::npos);
  parallel::StageBalance odd;
  odd.method = "by_flops";
  EXPECT_NE(error_of([&] { parallel::split_stages(six, 2, odd); }).find("unknown balance 'by_flops'"),
            std::string::npos);
}

TEST(PipelineSplit, ActionsParseAndPrintAsTheScheduleWritesThem) {
  EXPECT_EQ(parallel::parse_pipe_op("RECV_B"), parallel::PipeOp::RecvBackward);
  EXPECT_EQ(parallel::describe({parallel::PipeOp::SendForward, 3, 0, 1}), "SEND_F3.c0->1");
  EXPECT_EQ(parallel::describe({parallel::PipeOp::RecvForward, 3, 1, 0}), "RECV_F3.c1<-0");
  EXPECT_EQ(parallel::describe({parallel::PipeOp::Backward, 2, 0, -1}), "B2.c0");
  EXPECT_NE(error_of([] { parallel::parse_pipe_op("SEND"); }).find("unknown action 'SEND'"), std::string::npos);
}

// A rank's action list from "F0 SEND_F0 RECV_B0 B0 ..." (chunk 0; peers do not matter here).
static std::vector<parallel::PipeAction> pipe_actions(const std::string& text) {
  std::vector<parallel::PipeAction> out;
  std::istringstream words(text);
  for (std::string w; words >> w;) {
    auto digit = w.find_first_of("0123456789");
    out.push_back({parallel::parse_pipe_op(w.substr(0, digit)), std::stoi(w.substr(digit)), 0, -1});
  }
  return out;
}

TEST(PipelinePeak, OneFOneBHoldsItsWarmUpGPipeEveryMicroBatchSendsUntilTheEnd) {
  // A forward leaves 100 bytes, a received gradient 10 (the output sent has its shape), a
  // backward needs 5 more while it runs; the first stage receives no input.
  parallel::PipelineMeasure m;
  m.activations = {100};
  m.gradients = {10};
  m.inputs = {0};
  m.backward = {5};
  // 1F1B, rank 0 of 2, 4 micro-batches: at B2, two in flight, B2's gradient, the four outputs
  // sent so far and the backward's working memory.
  auto one_f_one_b = pipe_actions("F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 F2 SEND_F2 RECV_B1 B1 F3 SEND_F3 RECV_B2 B2 "
                                  "RECV_B3 B3");
  EXPECT_EQ(parallel::peak_activation_bytes(one_f_one_b, m), 2 * 100 + 10 + 4 * 10 + 5);
  // GPipe: all four in flight, their outputs sent, then the first gradient and backward.
  auto gpipe = pipe_actions("F0 SEND_F0 F1 SEND_F1 F2 SEND_F2 F3 SEND_F3 RECV_B0 B0 RECV_B1 B1 RECV_B2 B2 RECV_B3 B3");
  EXPECT_EQ(parallel::peak_activation_bytes(gpipe, m), 4 * 100 + 4 * 10 + 10 + 5);
  // The last stage: its input arrives and its gradient is sent back (and kept) after each backward.
  parallel::PipelineMeasure last;
  last.activations = {120};
  last.inputs = {10};
  last.gradients = {0};
  last.backward = {7};
  auto tail = pipe_actions("RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1");
  EXPECT_EQ(parallel::peak_activation_bytes(tail, last), 10 + 120 + 7) << "the second backward, one gradient kept";
  // Receives posted ahead (Gloo): each gradient's buffer is held from its forward, so every
  // micro-batch in flight holds one; the last stage receives none, so nothing changes there.
  EXPECT_EQ(parallel::peak_activation_bytes(one_f_one_b, m, /*receives_ahead=*/true), 2 * 100 + 2 * 10 + 4 * 10 + 5);
  EXPECT_EQ(parallel::peak_activation_bytes(gpipe, m, /*receives_ahead=*/true), 4 * 100 + 4 * 10 + 4 * 10 + 5);
  EXPECT_EQ(parallel::peak_activation_bytes(tail, last, /*receives_ahead=*/true), 10 + 120 + 7)
      << "the first backward: the next input's buffer posted ahead, where the second has a gradient kept";
  // Each activation's buffer is posted kActivationsAhead receives of its channel before its own:
  // the first two at the step's start, the third once the first has been taken. A rank that sent
  // nothing back (so no kept send hides them) holds, at its first backward, two more inputs.
  parallel::PipelineMeasure inputs;
  inputs.activations = {100};  // the received input's 30 bytes included
  inputs.inputs = {30};
  inputs.gradients = {0};
  inputs.backward = {5};
  auto receives = pipe_actions("RECV_F0 F0 B0 RECV_F1 F1 B1 RECV_F2 F2 B2");
  EXPECT_EQ(parallel::peak_activation_bytes(receives, inputs), 100 + 5);
  EXPECT_EQ(parallel::peak_activation_bytes(receives, inputs, /*receives_ahead=*/true), 100 + 2 * 30 + 5);
}
