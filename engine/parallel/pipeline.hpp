// Pipeline parallelism: the split of a model's blocks into stages, the cut that leaves each rank
// only its stages' modules, and the executor that runs a rank's lowered schedule (from
// bindings/lua/partrain/pipeline: forwards, backwards and asynchronous point-to-point transfers)
// every training step without going back to Lua. docs/pipeline.md describes what runs.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/dist/mesh.hpp"
#include "engine/nn/module.hpp"

namespace partrain::parallel {

class DataParallel;
class Fsdp;

/// How the blocks are divided among the stages.
struct StageBalance {
  /// "uniform": by block count (the first `blocks % stages` stages take one more); "parameters":
  /// contiguous stages whose largest parameter count (the first and last modules counted on the
  /// first and last stages) is the smallest possible; "explicit": `sizes` blocks a stage;
  /// "time": as "parameters", with `costs` (measured forward + backward microseconds: the first
  /// part, every block, the last part) in place of the parameter counts.
  std::string method = "uniform";
  std::vector<int64_t> sizes;
  std::vector<int64_t> costs;
};

/// Stage boundaries: `stages + 1` block indices, from 0 to block_params.size(); stage s holds the
/// blocks [b[s], b[s+1]). Every stage holds at least one block (an error says how many there are
/// for how many stages). `first_params`/`last_params` are what the first and last stages hold
/// besides their blocks (the "parameters" method counts them).
std::vector<int64_t> split_stages(const std::vector<int64_t>& block_params, int64_t stages,
                                  const StageBalance& balance, int64_t first_params = 0, int64_t last_params = 0);

/// One action of a lowered schedule (docs/pipeline.md), as plain data.
/// Backward is the whole backward of a micro-batch's chunk, or, when the rank's list also has its
/// Weight, the input's gradient alone (B), Weight then computing the weights' (W: split_backward.hpp).
enum class PipeOp { Forward, Backward, SendForward, RecvForward, SendBackward, RecvBackward, Weight };
struct PipeAction {
  PipeOp op = PipeOp::Forward;
  int mb = 0, chunk = 0;
  int peer = -1;  ///< the pipeline rank a transfer goes to or comes from; -1 for compute
};
/// "F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "W" (an error names anything else).
PipeOp parse_pipe_op(const std::string& op);
std::string describe(const PipeAction& a);  ///< "SEND_F3.c0->1"

/// Where the virtual stages are: "interleaved" (Megatron-LM's: chunk c of rank r is stage
/// c * pp + r) or "v" (ZB-V's: the odd chunks run back, c * pp + pp - 1 - r, so rank 0 holds the
/// first stage and, with 2 chunks, the last).
struct StageLayout {
  int pp = 1;
  bool v = false;
  int stage(int rank, int chunk) const { return chunk * pp + (v && chunk % 2 ? pp - 1 - rank : rank); }
  int rank(int stage) const { return v && (stage / pp) % 2 ? pp - 1 - stage % pp : stage % pp; }
  int chunk(int stage) const { return stage / pp; }
};

struct PipelineOptions {
  std::string blocks;                     ///< the container of the blocks ("h")
  std::vector<std::string> first, last;   ///< the root's children before and after the blocks
  StageBalance balance;
  std::string schedule;                   ///< its name, for messages
  std::string layout = "interleaved";     ///< StageLayout: "interleaved" or "v"
  int chunks = 1, microbatches = 1;
  /// The lowered, checked plan: one action list a pipeline rank (pipeline.build's result).
  std::vector<std::vector<PipeAction>> plan;
  /// The pre-flight check's predictions, which partrain plan shows: the bubble fraction (-1:
  /// not given) and each pipeline rank's peak in-flight chunk activations.
  double bubble = -1;
  std::vector<int64_t> peak_in_flight;
  /// balance "time": one step's input batch; its first micro-batch is what the blocks are timed on.
  torch::Tensor sample;

  /// Throws naming what does not fit `mesh`'s pipeline group (chunks, micro-batches, the plan's
  /// rank lists).
  void validate(const dist::Mesh& mesh) const;
};

/// What a rank's first train_step measured of its stages (partrain plan shows it; a real run
/// measures the same way). Bytes are those of the counting allocators (engine/util/tensor_memory.hpp)
/// on the CPU or the meta device; -1 on other devices.
struct PipelineMeasure {
  bool done = false;  ///< a train_step has run
  /// Per chunk: the bytes one micro-batch's forward leaves alive for its backward (saved
  /// tensors and output, the received input included), the input it receives (0 on the first
  /// virtual stage), the gradient it receives (0 on the last), and the most its backward
  /// allocates above what it began with, the parameters' new gradients left out.
  std::vector<int64_t> activations, inputs, gradients, backward;
  /// Per chunk, under a split backward: the bytes a micro-batch holds from its B to its W (the
  /// weights' products' inputs and the gradients captured for them); 0 where B is whole.
  std::vector<int64_t> pending;
  /// The most bytes alive at once along this rank's action list (peak_activation_bytes).
  int64_t peak = -1;
  /// Point-to-point messages of a step by peer (pipeline rank); bytes include the headers.
  struct Peer {
    int64_t sends = 0, send_bytes = 0, recvs = 0, recv_bytes = 0;
  };
  std::map<int, Peer> peers;
};

/// The schedule's peak of activation bytes on one rank (PipelineMeasure::peak): `m`'s action
/// list walked with a forward's activations and a received gradient held until the micro-batch's
/// backward, which needs its `backward` bytes more while it runs; and every tensor sent (an
/// output, a gradient of the input) held until the step ends, as the executor keeps it until
/// its send completes. `receives_ahead` (on Gloo): a gradient's buffer is held from its
/// micro-batch's forward rather than from its receive, and an activation's from
/// kActivationsAhead receives of its channel before its own.
int64_t peak_activation_bytes(const std::vector<PipeAction>& actions, const PipelineMeasure& m,
                              bool receives_ahead = false);

/// On Gloo, from the second step, how many activations of each channel a rank has receives
/// posted for ahead of their actions (each into a buffer of last step's shape).
constexpr size_t kActivationsAhead = 2;

/// partrain plan: forgets the activation shapes planned ranks sent (each virtual rank's receives
/// take the shape a lower pipeline rank planned before it sent), before another layout is planned.
void forget_planned_shapes();

/// A message's dtype and sizes.
struct MessageShape {
  torch::ScalarType dtype;
  std::vector<int64_t> sizes;
};

/// This rank's stages of a model and the schedule that runs them.
class Pipeline {
 public:
  /// Cuts `root` (the whole serial model, built deferred on the meta device or normally, the
  /// same on every pipeline rank) into pipeline x chunks stages and keeps only this rank's: the
  /// other stages' modules are replaced by empty placeholders (names and the tree's shape stay),
  /// so that what the rank holds, once materialized, has the serial model's initial weights.
  /// The stage ends are the model's stage_in/stage_out, or else the policy's first and last
  /// modules applied in order (a chain). Parameters tied across stages (GPT-2's wte and lm_head)
  /// are noted: their gradients are summed over the ranks holding them after every step.
  static std::shared_ptr<Pipeline> cut(nn::Module& root, const dist::Mesh& mesh, PipelineOptions options);

  /// Runs the schedule over options.microbatches micro-batches of (x, y) (split along dim 0;
  /// ParallelModel::train_step has checked the batch: the same on every rank of the pipeline,
  /// x and y of one size, divisible by microbatches):
  /// forwards, `loss` on the last stage (a micro-batch's loss summed over its targets),
  /// backwards from that loss times `weight` (a scalar tensor: the share that turns the sums into
  /// the global batch's mean) and `loss_scale` (loss scaling), the transfers; then sums the tied
  /// parameters' gradients and completes `dp`'s sync (it syncs during the rank's last backward).
  /// `fsdp` (ZeRO-3, if any): the first step's measure leaves out the units its forwards gather.
  /// Returns the sum of the micro-batches' losses (float64) on every pipeline rank.
  torch::Tensor train_step(const torch::Tensor& x, const torch::Tensor& y,
                           const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& loss,
                           const torch::Tensor& weight, DataParallel* dp, double loss_scale = 1.0,
                           const Fsdp* fsdp = nullptr);

  /// Refuses a step after one that failed part-way (its messages may still be queued in the
  /// group, unless the group was renewed since): before anything is sent over the group.
  void check_runnable() const;

  /// The global L2 norm of `params`' gradients over the whole pipeline (what clipping needs):
  /// squares summed here (a split parameter's over its tensor group in `groups`, as
  /// global_grad_norm: split_groups gives them; empty: all whole), then over the pipeline group;
  /// a parameter tied across stages counts once (on the first rank holding it). Every rank of
  /// the pipeline and tensor groups must call it.
  double grad_norm(const std::vector<torch::Tensor>& params, const std::vector<dist::GroupPtr>& groups = {}) const;

  /// The dtype train_step's loss is returned in on every rank (the last stage computes it): the
  /// parameters', but float32 for bfloat16 and float16 ones (as their losses are computed).
  torch::ScalarType loss_dtype() const {
    return dtype_ == torch::kBFloat16 || dtype_ == torch::kHalf ? torch::kFloat32 : dtype_;
  }

  int stages() const { return pp_ * options_.chunks; }
  /// Where this pipeline's virtual stages are (options().layout).
  StageLayout layout() const { return {pp_, options_.layout == "v"}; }
  const std::vector<int64_t>& bounds() const { return bounds_; }  ///< split_stages' boundaries
  const PipelineOptions& options() const { return options_; }
  const dist::GroupPtr& group() const { return group_; }
  int rank() const { return rank_; }  ///< this rank's place in the pipeline group
  const PipelineMeasure& measured() const { return measured_; }

  /// Whether each block of this rank's stages runs checkpointed (parallelize's recompute =
  /// "block"): its activations are recomputed in its backward (in B, under a split backward).
  void set_recompute(bool on) { recompute_ = on; }
  bool recompute() const { return recompute_; }

  /// Finds the tied parameters again by name in `root`, whose tensors were replaced since the
  /// cut (a deferred model materialized: its meta tensors gave way to real ones).
  void rebind(nn::Module& root);

  // ---- What checkpoints and the REPL ask of the stages ----------------------------------------
  int size() const { return pp_; }  ///< the pipeline group's size
  /// This rank's virtual stages, by chunk: chunk c is stage layout().stage(rank(), c).
  std::vector<int> own_stages() const;
  /// The name the serial model gives this rank's parameter `name`: a tensor tied across stages
  /// goes by its first name in the serial tree (GPT-2's lm_head.weight is wte.weight) on every
  /// stage holding it, so checkpoints find it by one name; any other name is its own.
  std::string logical_name(const std::string& name) const;
  /// Whether this rank is the first pipeline rank holding `param` (true for all but a tensor tied
  /// across stages, held first by another rank): the one that writes it in a checkpoint.
  bool first_holder(const torch::Tensor& param) const;
  /// Whether any parameter is tied across stages (its gradient summed over the pipeline group).
  bool has_ties() const { return !ties_.empty(); }
  /// This rank's parameters by its chunk (chunk c runs virtual stage layout().stage(rank(), c)): the
  /// blocks' and, on the first and last virtual stages, the policy's first and last modules'. A
  /// tensor two chunks hold is listed under both.
  std::vector<std::vector<torch::Tensor>> chunk_params() const;
  /// This rank's parameters tied across stages.
  std::vector<torch::Tensor> tied_params() const {
    std::vector<torch::Tensor> out;
    for (const auto& t : ties_)
      if (t.param.defined()) out.push_back(t.param);
    return out;
  }

 private:
  struct Tie {
    std::vector<std::string> names;  ///< every name of the tensor in the serial tree, in tree order
    torch::Tensor param;  ///< undefined on a rank that does not hold it
    bool counted;         ///< whether this rank counts it in grad_norm (the first rank holding it)
    std::vector<int64_t> shape;
    torch::ScalarType dtype;
  };
  /// A tied parameter's gradient where the optimizer reads it: its bucket slice under data
  /// parallelism (ZeRO's reduce dtype may differ from the parameter's), else .grad; undefined
  /// where the rank does not hold it or it has no .grad.
  torch::Tensor tie_gradient(const Tie& tie, DataParallel* dp) const;
  // The tied parameters' gradients: those an earlier step left set aside before the step (one a
  // tie), and after it this step's summed over the ranks holding them, the set-aside added back.
  std::vector<torch::Tensor> set_aside_tie_gradients(DataParallel* dp);
  void sum_tie_gradients(const std::vector<torch::Tensor>& kept, DataParallel* dp);
  /// The dtype the ranks sum a tied gradient in, the same on every rank (holding it or not).
  torch::ScalarType tie_dtype(const Tie& tie, DataParallel* dp) const;
  torch::Tensor run_chunk(int chunk, const torch::Tensor& in);
  /// An activation of micro-batch `mb` for virtual stage `to_stage`: a header (dtype, shape, how
  /// the tensor follows), then the tensor (pipeline.cpp's channels).
  void send_activation(const torch::Tensor& t, int peer, int mb, int to_stage);
  /// The tensor alone on `tag` (a gradient: the receiver knows its shape); `header_bytes`, the
  /// header sent before it if any, are counted with it in the step's measured traffic.
  void send_body(const torch::Tensor& t, int peer, int tag, int64_t header_bytes = 0);
  /// An activation, received when its action comes (no receive ahead). `expected`: the shape a
  /// planned group's message would have (nothing arrives there).
  torch::Tensor receive(int peer, const std::vector<int64_t>& expected);
  /// Whether the step's receives are posted ahead (the Inbox in pipeline.cpp): on Gloo, whose
  /// point-to-point calls progress on their own threads whatever else is pending; not on NCCL,
  /// where a pending receive would hold up the sends queued behind it on the pair's stream, and
  /// not in a plan (nothing arrives).
  bool receives_ahead() const;
  /// Whether a gradient's buffer is allocated at its micro-batch's forward, as receives posted
  /// ahead do (on Gloo; the planner walks a planned Gloo group's peak the same way).
  bool gradients_ahead() const;
  void note_received(int peer, int64_t bytes);  ///< the first step's measured traffic

  nn::Module* root_ = nullptr;
  PipelineOptions options_;
  dist::GroupPtr group_;
  int pp_ = 1, rank_ = 0;
  std::vector<int64_t> bounds_;
  std::vector<std::vector<nn::ModulePtr>> chunk_blocks_;  // this rank's blocks, by chunk
  std::vector<nn::ModulePtr> first_, last_;  // a chain's stage ends, on the ranks holding them
  std::vector<Tie> ties_;
  std::vector<std::pair<dist::Work, std::vector<torch::Tensor>>> sends_;  // in flight, kept alive
  torch::Device device_ = torch::kCPU;
  torch::ScalarType dtype_ = torch::kFloat32;  // the parameters' (loss_dtype)
  PipelineMeasure measured_;                   // filled by the first train_step
  // Each activation's shape by (micro-batch, receiving virtual stage), as sent and as received
  // last step: the shape both ends predict for this step's (receives posted ahead only).
  std::map<std::pair<int, int>, MessageShape> sent_shapes_, received_shapes_;
  // The group's renewals when a step did not finish (a renewed group has left that step's
  // messages behind in its old backend).
  std::optional<int> failed_at_renewal_;
  bool recompute_ = false;
  /// A train_step's end: unless `done`, it forgets the shapes and marks the group (pipeline_step.cpp).
  struct StepGuard {
    Pipeline& p;
    bool done = false;
    ~StepGuard();
  };

};

}  // namespace partrain::parallel
