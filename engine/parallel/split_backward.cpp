// The backward split in B and W (see split_backward.hpp).
#include "engine/parallel/split_backward.hpp"

#include <atomic>
#include <numeric>
#include <unordered_map>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include "engine/util/autograd.hpp"

namespace partrain::parallel {

namespace {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;

std::atomic<int64_t> whole_count{0};

// The graph below an output, walked once: its nodes children first, and for each the weights it
// reaches (a bit a weight's accumulator) and whether it reaches the stage's input.
struct Graph {
  std::vector<std::shared_ptr<Node>> nodes;  // post-order: a node after everything it leads to
  std::unordered_map<const Node*, size_t> index;
  std::vector<std::shared_ptr<Node>> leaves;  // the weights' accumulators, by bit
  size_t words = 0;
  std::vector<uint64_t> reach;   // nodes x words: the weights a node leads to
  std::vector<char> to_input;    // a node leads to the input (or is its accumulator)

  uint64_t* bits(size_t node) { return reach.data() + node * words; }

  Graph(const std::shared_ptr<Node>& root, const Node* input) {
    struct Frame {
      std::shared_ptr<Node> node;
      size_t next = 0;
    };
    std::vector<Frame> stack{{root}};
    index.emplace(root.get(), SIZE_MAX);  // on the stack: placed when left
    while (!stack.empty()) {
      auto& top = stack.back();
      const auto& edges = top.node->next_edges();
      if (top.next < edges.size()) {
        const auto& e = edges[top.next++];
        if (e.function && index.emplace(e.function.get(), SIZE_MAX).second) stack.push_back({e.function});
        continue;
      }
      index[top.node.get()] = nodes.size();
      if (top.node.get() != input && dynamic_cast<torch::autograd::AccumulateGrad*>(top.node.get()))
        leaves.push_back(top.node);
      nodes.push_back(std::move(top.node));
      stack.pop_back();
    }
    words = (leaves.size() + 63) / 64;
    reach.assign(nodes.size() * words, 0);
    to_input.assign(nodes.size(), 0);
    std::unordered_map<const Node*, size_t> bit;
    for (size_t b = 0; b < leaves.size(); ++b) bit.emplace(leaves[b].get(), b);
    for (size_t n = 0; n < nodes.size(); ++n) {
      const Node* node = nodes[n].get();
      if (auto it = bit.find(node); it != bit.end()) bits(n)[it->second / 64] |= uint64_t{1} << (it->second % 64);
      if (node == input) to_input[n] = 1;
      for (const auto& e : node->next_edges()) {
        if (!e.function) continue;
        const size_t c = index.at(e.function.get());
        for (size_t w = 0; w < words; ++w) bits(n)[w] |= bits(c)[w];
        to_input[n] |= to_input[c];
      }
    }
  }
};

bool any(const std::vector<uint64_t>& a) {
  return std::any_of(a.begin(), a.end(), [](uint64_t w) { return w != 0; });
}

struct UnionFind {
  std::vector<size_t> parent;
  explicit UnionFind(size_t n) : parent(n) { std::iota(parent.begin(), parent.end(), 0); }
  size_t find(size_t x) {
    while (parent[x] != x) x = parent[x] = parent[parent[x]];
    return x;
  }
  void join(size_t a, size_t b) { parent[find(a)] = find(b); }
};

torch::autograd::Engine& engine() { return torch::autograd::Engine::get_default_engine(); }

}  // namespace

int64_t split_backward_whole_count() { return whole_count.load(); }

SplitBackward::~SplitBackward() = default;

std::unique_ptr<SplitBackward> SplitBackward::input(const torch::Tensor& output, const torch::Tensor& grad,
                                                    const torch::Tensor& input, torch::Tensor* input_grad) {
  TORCH_CHECK(output.requires_grad(), "split backward: the stage's output does not require grad");
  std::unique_ptr<SplitBackward> s(new SplitBackward());
  s->root_ = torch::autograd::impl::gradient_edge(output);
  s->root_grad_ = grad.defined() ? grad : torch::ones_like(output);
  TORCH_CHECK(s->root_.function, "split backward: the stage's output has no gradient function");
  Edge input_edge;
  if (input.defined() && input.requires_grad()) input_edge = torch::autograd::impl::gradient_edge(input);
  Graph g(s->root_.function, input_edge.function.get());
  for (const auto& leaf : g.leaves) s->all_leaves_.emplace_back(leaf, 0);
  const size_t root = g.nodes.size() - 1;

  // The intermediates: on the input's path, with an edge off it toward weights. P: the weights
  // reached through those edges; below: those reached through its edges along the path.
  struct Intermediate {
    size_t node;
    std::vector<uint64_t> own, below;
  };
  std::vector<Intermediate> mids;
  if (g.to_input[root]) {
    for (size_t n = g.nodes.size(); n-- > 0;) {  // from the output down
      if (!g.to_input[n] || g.nodes[n].get() == input_edge.function.get()) continue;
      Intermediate m{n, std::vector<uint64_t>(g.words, 0), std::vector<uint64_t>(g.words, 0)};
      for (const auto& e : g.nodes[n]->next_edges()) {
        if (!e.function) continue;
        const size_t c = g.index.at(e.function.get());
        auto& into = g.to_input[c] ? m.below : m.own;
        for (size_t w = 0; w < g.words; ++w) into[w] |= g.bits(c)[w];
      }
      if (any(m.own)) mids.push_back(std::move(m));
    }
  }
  s->whole_ = !g.to_input[root] || !input_edge.function;

  // Groups: intermediates that reach a common weight run in one call (a weight accumulates once).
  std::vector<size_t> group_of(mids.size());
  std::vector<std::vector<uint64_t>> own, below;
  if (!s->whole_) {
    UnionFind sets(mids.size());
    std::vector<size_t> owner(g.leaves.size(), SIZE_MAX);
    for (size_t i = 0; i < mids.size(); ++i)
      for (size_t b = 0; b < g.leaves.size(); ++b)
        if (mids[i].own[b / 64] >> (b % 64) & 1) {
          if (owner[b] == SIZE_MAX) owner[b] = i;
          else sets.join(i, owner[b]);
        }
    std::unordered_map<size_t, size_t> group_at;  // a set's representative -> its group, output first
    for (size_t i = 0; i < mids.size(); ++i) {
      auto [it, fresh] = group_at.emplace(sets.find(i), group_at.size());
      if (fresh) own.emplace_back(g.words, 0), below.emplace_back(g.words, 0);
      group_of[i] = it->second;
      for (size_t w = 0; w < g.words; ++w) own[it->second][w] |= mids[i].own[w], below[it->second][w] |= mids[i].below[w];
    }
    // Exact only when no weight of a group is also reached through the input's path below it:
    // else W's call would run that path again and add to those weights twice.
    for (size_t k = 0; k < own.size() && !s->whole_; ++k)
      for (size_t w = 0; w < g.words; ++w)
        if (own[k][w] & below[k][w]) s->whole_ = true;
  }

  // B: the input's gradient, and the gradient into every input of each intermediate.
  edge_list outputs;
  if (input_edge.function) outputs.push_back(input_edge);
  if (!s->whole_)
    for (const auto& m : mids)
      for (uint32_t i = 0; i < g.nodes[m.node]->num_inputs(); ++i) outputs.emplace_back(g.nodes[m.node], i);
  torch::autograd::variable_list got;
  if (input_edge.function && g.to_input[root])
    got = engine().execute({s->root_}, {s->root_grad_}, /*keep_graph=*/true, /*create_graph=*/false,
                           /*accumulate_grad=*/false, outputs);
  if (input_grad) *input_grad = input_edge.function && !got.empty() ? got[0] : torch::Tensor();
  if (s->whole_) {
    ++whole_count;
    return s;
  }
  s->groups_.resize(own.size());
  size_t at = input_edge.function ? 1 : 0;
  for (size_t i = 0; i < mids.size(); ++i) {
    auto& group = s->groups_[group_of[i]];
    const auto& node = g.nodes[mids[i].node];
    for (uint32_t k = 0; k < node->num_inputs(); ++k, ++at)
      if (got[at].defined()) group.roots.emplace_back(node, k), group.grads.push_back(got[at]);
  }
  for (size_t k = 0; k < own.size(); ++k)
    for (size_t b = 0; b < g.leaves.size(); ++b)
      if (own[k][b / 64] >> (b % 64) & 1) s->groups_[k].leaves.emplace_back(g.leaves[b], 0);
  // What only B needed goes now: the saved tensors of the path's other nodes (W never runs them).
  std::vector<char> keep(g.nodes.size(), 0);
  for (const auto& m : mids) keep[m.node] = 1;
  for (size_t n = 0; n < g.nodes.size(); ++n)
    if (g.to_input[n] && !keep[n]) g.nodes[n]->release_variables();
  return s;
}

std::vector<torch::Tensor> SplitBackward::run(bool accumulate, const std::vector<torch::Tensor>& wanted) {
  TORCH_CHECK(!done_, "split backward: W of this micro-batch has run already");
  done_ = true;
  // Returned gradients (a checkpointed block's W), by the position of their leaf in `wanted`.
  std::unordered_map<const Node*, size_t> position;
  edge_list wanted_edges;
  for (size_t i = 0; i < wanted.size(); ++i) {
    auto acc = wanted[i].requires_grad() ? torch::autograd::impl::try_get_grad_accumulator(wanted[i]) : nullptr;
    if (acc) position.emplace(acc.get(), i);
  }
  std::vector<torch::Tensor> out(wanted.size());
  auto call = [&](const edge_list& roots, const std::vector<torch::Tensor>& grads, const edge_list& leaves) {
    if (roots.empty() || leaves.empty()) return;
    auto got = engine().execute(roots, grads, /*keep_graph=*/false, /*create_graph=*/false, accumulate, leaves);
    if (accumulate) return;
    for (size_t i = 0; i < leaves.size() && i < got.size(); ++i) {
      auto it = position.find(leaves[i].function.get());
      if (it == position.end() || !got[i].defined()) continue;
      out[it->second] = out[it->second].defined() ? out[it->second] + got[i] : got[i];
    }
  };
  // One pass for data parallelism's hooks however many engine calls W makes.
  util::BackwardGroup pass;
  if (whole_) {
    call({root_}, {root_grad_}, all_leaves_);
  } else {
    for (const auto& group : groups_) call(group.roots, group.grads, group.leaves);
  }
  groups_.clear();
  root_grad_ = torch::Tensor();
  root_ = Edge();
  all_leaves_.clear();
  return out;
}

void SplitBackward::weights() { run(/*accumulate=*/true, {}); }

std::vector<torch::Tensor> SplitBackward::weight_gradients(const std::vector<torch::Tensor>& leaves) {
  return run(/*accumulate=*/false, leaves);
}

}  // namespace partrain::parallel
