// Planning without processes (Cube's dry run) and the memory accounting it is checked against.
//
// `partrain plan --world N script.lua` runs the script once per virtual rank in one process: the
// world is planned (every group records its collectives and runs none), parameters are made on
// the meta device (shapes, no memory), and the first optimizer step stops the script. What the
// rank then holds is a RankPlan; all ranks' make a Plan. A real run builds the same RankPlan at
// its first optimizer step, so a saved plan can be checked against it (Cube's ReuseType).
// Under pipeline parallelism each virtual rank runs its own stage's schedule on meta tensors
// (what it would receive is made from the known activation shape), and its StagePlan says what
// the pipeline's first step measured and what the schedule predicts.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "engine/util/planning.hpp"
#include "engine/util/tensor_memory.hpp"

namespace partrain::nn {
class Module;
}
namespace partrain::optim {
class Optimizer;
}
namespace partrain::dist {
class Mesh;
}
namespace partrain::parallel {
class Pipeline;
}

namespace partrain::plan {

// ---- Planning mode ----------------------------------------------------------------------------

/// Whether this process is planning (engine/util/planning.hpp).
using util::planning;
/// Turns planning on or off; on, it also supplies the meta kernels LibTorch's C++ library lacks
/// (PyTorch registers some from Python only: index_select's, for one).
void set_planning(bool on);
/// Counts, from now on, the FLOPs of the operators dispatched on any thread: matrix products and
/// fused attention, forward and backward (engine/plan/flops.cpp); the layout search turns it on
/// (it slows planning by about a quarter).
void count_flops();
/// The FLOPs counted so far in this process.
double counted_flops();
/// The operators dispatched so far while counting (each aten:: call, composite ones included).
int64_t counted_ops();

// ---- The first training step ---------------------------------------------------------------

/// The first training step's phases, as the step announces them (engine/util/step_events.hpp),
/// noted the same way in a real run and in a plan: the first training forward begins it
/// (collective counters reset, memory noted), the end of that forward measures its activations
/// (what it left allocated). A forward set aside (events::Aside: the policy probe, the stage
/// timing) counts for nothing.
struct FirstStep {
  bool begun = false, forward_done = false;
  int64_t base = 0;          ///< bytes allocated when the forward began
  int64_t activations = -1;  ///< bytes the forward left allocated (-1: not measured)
  /// ZeRO-3: the bytes of units the forward left gathered (gathered at its end less at its
  /// start), part of what it left allocated but counted as parameters; activations exclude them.
  int64_t gathered = 0;
  bool hooked = false;       ///< the first optimizer step's hook has run
  double flops_base = 0;     ///< counted_flops() when the forward began
  int64_t ops_base = 0;      ///< counted_ops() when the forward began
};
/// Runs before the first step's memory is noted (once): the Lua host collects its garbage there,
/// so that tensors already dead (a serial model pt.parallelize replaced) are not freed during
/// the forward, which would count against its activations. nullptr: nothing.
void set_before_first_step(void (*fn)());
void first_step_hooked();
const FirstStep& first_step();
void reset_first_step();

// ---- The plan ------------------------------------------------------------------------------

/// One parameter as a rank holds it.
struct Shard {
  std::string name, dtype;
  std::vector<int64_t> shape;        ///< logical (what the serial model has)
  std::vector<int64_t> local_shape;  ///< this rank's tensor
  int dim = -1;                      ///< split dimension; -1: whole on every rank
  std::vector<std::pair<int64_t, int64_t>> slices;  ///< (start, length) of `dim` this rank holds
  std::vector<int> group;            ///< the global ranks it is split over (empty when whole)
  int64_t bytes = 0;                 ///< of the local tensor
  bool operator==(const Shard& o) const;
};

/// Calls and bytes of one kind of collective on one group during the first step.
struct Collective {
  std::string group, op;
  int64_t calls = 0, bytes = 0;
  /// The group's ranks and the nodes they span (of LOCAL_WORLD_SIZE ranks each): what a cost
  /// model needs to pick the link. Not saved in a plan file, nor compared.
  int size = 0, nodes = 0;
  bool operator==(const Collective& o) const;
};

/// One model chunk a pipeline rank holds: its virtual stage and blocks.
struct StageChunk {
  int stage = 0;                         ///< virtual stage (parallel::StageLayout: c * pipeline + r, interleaved)
  int64_t first_block = 0, end_block = 0;  ///< the blocks [first_block, end_block)
  bool first = false, last = false;      ///< holds the policy's first (embeddings) / last (head) modules
  int64_t activation_bytes = -1;         ///< one micro-batch's forward leaves alive for backward (-1: not measured)
  int64_t gradient_bytes = 0;            ///< the gradient it receives a micro-batch (0 on the last stage)
  int64_t backward_bytes = -1;           ///< what a micro-batch's backward needs while it runs, above that
  int64_t pending_bytes = 0;             ///< what a split B keeps for its W (0: the schedule splits none)
};

/// Point-to-point traffic of one step with one peer (a global rank); bytes include headers.
struct PeerTraffic {
  int peer = 0, pipeline_peer = 0;  ///< the peer's global rank and its pipeline rank
  int64_t sends = 0, send_bytes = 0, recvs = 0, recv_bytes = 0;
};

/// A pipeline rank's stages and what its schedule predicts (absent without a pipeline).
struct StagePlan {
  bool present = false;
  std::string schedule, blocks;  ///< the schedule's name; the blocks' container ("h")
  std::vector<std::string> first, last;  ///< the modules before and after the blocks (policy's pipeline)
  int microbatches = 0, stages = 0;
  std::vector<StageChunk> chunks;
  int64_t in_flight = -1;        ///< the pre-flight check's peak in-flight chunk activations on this rank
  int64_t activation_peak = -1;  ///< peak activation bytes under the schedule (see PipelineMeasure::peak)
  double bubble = -1;            ///< the schedule's predicted bubble fraction
  std::vector<PeerTraffic> peers;
};

/// Context parallelism on this rank (the mesh's context > 1): the attention calls its first step
/// made over the context group, and what each mode would exchange over it in a step, predicted
/// from their shapes (q (batch, heads, rows, head_size) and kv_heads heads of k and v, this rank's
/// rows). Bytes as the group's traffic counts them: send_recv the bytes sent (ring: a forward
/// passes c - 1 key/value blocks, a backward c - 1 again and c gradient blocks in float32, or
/// float64 for float64 inputs), all_to_all the whole input (4 all-to-alls of q, k, v and the
/// output a forward, 4 a backward), of which 1/c stays on the rank. A planned run notes them; a
/// real run's plan has none (calls 0).
struct ContextPlan {
  std::string mode;   ///< the mode the model ran: "ring" or "all_to_all" ("" when none ran)
  int64_t calls = 0;  ///< context attention calls in the first step (a replay under recompute too)
  int64_t batch = 0, heads = 0, kv_heads = 0, rows = 0, head_size = 0;  ///< the first call's shapes
  int64_t element_size = 0;            ///< of q, k and v
  int64_t ring_bytes = 0;              ///< ring: bytes sent a step (send_recv)
  int64_t all_to_all_bytes = 0;        ///< all_to_all: bytes through its all-to-alls a step (0: it cannot run)
  std::string all_to_all_refusal;      ///< why all_to_all cannot split these heads ("" when it can)
  /// all_to_all's bytes that leave the rank ((c - 1)/c of them), to compare with the ring's.
  int64_t all_to_all_sent(int context) const { return context > 0 ? all_to_all_bytes / context * (context - 1) : 0; }
};

/// Expert parallelism on this rank (the mesh's expert > 1): its share of the mixture-of-experts
/// blocks' stacked experts, and what their all-to-alls over the expert group move in a step. Each
/// MoE forward exchanges the routed counts (an equal all-to-all of E int64), then its T routed rows
/// of width dim (an all-to-all of unequal row counts), and the experts' results back the same way;
/// its backward sends both row exchanges' gradients back (2 more calls). The routing depends on
/// the data, so the bytes are predicted for a balanced routing (T/E rows an expert, the planner's
/// meta routing), where (e - 1)/e of each rank's rows leave it, and for the worst case, where all
/// of them do. Bytes as a group's traffic counts them: whole messages, the rows kept on the rank
/// included. A real run's plan notes no exchanges (forwards 0) but holds the same parameters.
struct ExpertPlan {
  int64_t experts = 0, local = 0;  ///< E of a block and the experts a rank holds (E/e); 0: no MoE block
  int64_t blocks = 0;              ///< MoE blocks (stacks of experts) on this rank
  int64_t top_k = 0;
  int64_t forwards = 0;            ///< MoE forwards over the expert group in the first step (replays too)
  int64_t tokens = 0, slots = 0, dim = 0, element_size = 0;  ///< the first forward's N, T = N x top_k, width
  int64_t all_to_alls = 0;         ///< predicted calls a step: 3 a forward (counts, rows, results), 2 a backward
  int64_t count_bytes = 0;         ///< the counts' all-to-alls a step (E x 8 bytes a forward)
  int64_t balanced_bytes = 0;      ///< the rows' all-to-alls a step, balanced routing (whole messages)
  int64_t balanced_sent = 0;       ///< of them, what leaves the rank: (e - 1)/e
  int64_t worst_sent = 0;          ///< what leaves the rank when every routed row goes to another rank
  /// This rank's expert tensors (E/e of every stack), the whole stacks (what one rank would hold
  /// unsplit), and the experts' gradients and optimizer state (also counted in the memory table).
  int64_t param_bytes = 0, stacked_bytes = 0, grad_bytes = 0, optimizer_bytes = 0;
};

struct RankPlan {
  int rank = 0;
  int tensor = 0, data = 0, pipeline = 0;  ///< coordinates in the mesh
  int context = 0;                         ///< this rank's context coordinate
  ContextPlan context_plan;                ///< under context parallelism (calls 0 otherwise)
  int expert = 0;                          ///< which share of the experts this rank holds (format 6 on)
  ExpertPlan expert_plan;                  ///< under expert parallelism (experts 0 otherwise)
  std::vector<Shard> shards;
  /// Parameters in their dtype; gradients as the run holds them (data parallelism's flat buffers,
  /// a parameter's own .grad where the buffer has another dtype, and the float32 gradients the
  /// masters read: ZeRO's shard, a plain optimizer's whole copy); optimizer state (moments) and
  /// master weights (float32 copies of bfloat16/float16 parameters; under ZeRO this rank's shard).
  int64_t param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0, master_bytes = 0;
  int zero_stage = 0, zero_group = 1;  ///< the optimizer's ZeRO stage and its zero group's size
  /// ZeRO-3: param_bytes is param_shard_bytes (this rank's shards, and parameters kept whole: ties
  /// across pipeline stages, frozen ones) plus gather_bytes, the units gathered at once at most:
  /// the root unit and the largest run of 1 + prefetch consecutive units, or every unit when they
  /// stay gathered from forward to backward (gathers_all: reshard_after_forward off, a
  /// pipeline's default). 0 and false below stage 3.
  int64_t param_shard_bytes = 0, gather_bytes = 0;
  bool gathers_all = false;
  /// -1: no forward and backward ran before the first step. Under a pipeline: the schedule's
  /// peak (stage.activation_peak).
  int64_t activation_bytes = -1;
  std::vector<Collective> collectives;
  StagePlan stage;  ///< under pipeline parallelism
  /// The FLOPs of the first step (from its first forward to its first optimizer step: every
  /// micro-batch's forward and backward, recompute's replays), counted while planning with
  /// count_flops() on (partrain plan --auto); 0 otherwise. Not saved in a plan file, nor compared.
  double flops = 0;
  int64_t ops = 0;  ///< the operators the first step dispatched, counted alike
  /// The most tensor bytes the planned script held at once from its start to its first optimizer
  /// step, setup included (a policy's probe forward, a deferred model made whole), as the layout
  /// search plans it; -1 when not measured. Not saved in a plan file, nor compared.
  int64_t run_peak_bytes = -1;
  int64_t model_state_bytes() const { return param_bytes + grad_bytes + optimizer_bytes + master_bytes; }
  /// The most this rank holds during a step: its model state and its activations (the first
  /// step's, or the schedule's peak under a pipeline, which counts the micro-batches in flight).
  int64_t peak_bytes() const { return model_state_bytes() + std::max<int64_t>(activation_bytes, 0); }
};

struct Plan {
  std::string script;
  int world = 1, nproc_per_node = 1;
  int tensor = 1, data = 1, pipeline = 1, zero = 1;
  int context = 1;             ///< ranks each sequence is split over (format 5 on; 1 before)
  int expert = 1;              ///< ranks each expert group splits the experts over (format 6 on; 1 before)
  int64_t cpu_peak_bytes = 0;  ///< tensor memory the planner allocated on the CPU (when planning)
  double seconds = 0;          ///< how long planning took
  std::vector<RankPlan> ranks;
};

/// What `model` and its optimizers hold on this rank: shards, parameter, gradient and optimizer
/// bytes (the optimizer's state as it will be after the first step), and the first step's
/// activations and collectives as noted so far.
RankPlan describe(int rank, const nn::Module& model, const std::vector<const optim::Optimizer*>& optimizers,
                  const dist::Mesh* mesh);

/// What `model` and its optimizers hold now, measured from their tensors (each storage once, a
/// tied parameter once): the real-run counterpart of describe()'s model-state bytes. Optimizer
/// state is what has been allocated so far (after a first step, all of it).
/// Under ZeRO-3 params is what exists now: the shards, the parameters kept whole and the units
/// gathered now; master leaves out the float32 masters that are the parameters' shards.
struct Held {
  int64_t params = 0, grads = 0, optimizer = 0, master = 0;
  int64_t scratch = 0;  ///< ZeRO-2: the gradient scratch pool's part of grads
  int zero_stage = 0, zero_group = 1;
  /// ZeRO-3 (0 below): the shards and parameters kept whole, the units gathered now and the most
  /// at once so far (Fsdp::bytes), the largest unit and the root unit (gathered bytes).
  int64_t param_shard = 0, gathered = 0, peak_gathered = 0, largest_unit = 0, root_unit = 0;
  /// ZeRO-3 on the CPU: freed gather buffers kept for the next gathers (at most what was gathered
  /// at once), beside params.
  int64_t pooled = 0;
};
Held held(const nn::Module& model, const std::vector<const optim::Optimizer*>& optimizers);

/// A pipeline rank's stages, the check's predictions and what its first train_step measured.
StagePlan stage_plan(const parallel::Pipeline& pipe);

/// A plan with the layout's fields (world, mesh sizes) filled from `mesh`, and no ranks.
Plan layout_of(const dist::Mesh* mesh);

/// The planner's collection: each virtual rank's plan is added here when the rank stops.
void record(RankPlan rank, const Plan& layout);
Plan& recorded();

/// Checks this run against a saved plan at the first optimizer step (Cube's ReuseType): "match"
/// fails on any difference or a missing file; "override" writes this run's plan over the file;
/// "moo" matches when the file exists and agrees, and overrides otherwise. Collective over the
/// world: every rank calls it, and all fail together. Returns what it did, for a log line.
std::string check(const RankPlan& actual, const Plan& layout, const std::string& path, const std::string& mode);

/// Writes the plan (cereal, binary, behind a magic and a version) to `path` atomically.
void save(const Plan& plan, const std::string& path);
/// Throws what save would refuse about `path` itself (a file that is not a plan, a link, a FIFO,
/// a device), so that a caller can refuse before the work of making the plan.
void check_save(const std::string& path);
/// Reads a plan; a missing, truncated or foreign file is an error naming it.
Plan load(const std::string& path);
/// Whether the regular file at `path` begins as a plan does (its magic), whatever its version
/// or state: the test before writing over it (--plan-mode override or moo).
bool starts_like_plan(const std::string& path);
/// A rank plan as bytes and back (to gather them over a group).
std::string to_bytes(const RankPlan& rank);
RankPlan from_bytes(const std::string& bytes);

/// How `actual` differs from `planned`, one line a difference, "" when they match. Shards,
/// model-state bytes and collectives are compared; activations are an estimate and are not, nor
/// are the bytes of the expert group's all-to-alls (the routing decides them): their calls are.
std::string differences(const RankPlan& planned, const RankPlan& actual);

/// For people: the shard map, memory per rank and collectives per step.
/// How to_text prints a plan.
struct TextOptions {
  /// The memory of one device, in bytes: the plan opens with whether every rank's peak fits in it
  /// ("fits: ..." / "does not fit: ..., try ..."); 0: no verdict.
  int64_t device_memory = 0;
  /// Where device_memory came from ("--device-memory", "cuda:0 (NVIDIA H100 80GB HBM3)").
  std::string device_source;
  /// The shard table too (every logical tensor and which ranks hold which slice).
  bool shards = false;
};
std::string to_text(const Plan& plan, const TextOptions& options = {});
/// "tensor 2 x context 2 x data 2 x pipeline 1, expert 2": a plan's mesh sizes (context and
/// expert only above 1).
std::string layout_text(const Plan& plan);
/// The verdict line of a plan against one device's memory (see TextOptions).
std::string fit_verdict(const Plan& plan, int64_t device_memory, const std::string& source);
/// For machines.
std::string to_json(const Plan& plan);

}  // namespace partrain::plan
