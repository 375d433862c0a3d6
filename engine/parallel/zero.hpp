// ZeRO stages 1, 2 and 3: the distributed optimizer. Each rank of a zero group keeps master
// weights and optimizer state for its part of every data-parallel bucket only (the flat gradient
// buffer split into zero-group-size contiguous parts), steps them with the ordinary optimizer, and
// all-gathers the updated parts into the parameters over the zero group after each step (stages 1
// and 2). Under stage 3 the parameters themselves are kept as those parts (fsdp.hpp): the step
// writes the parts and the next forward gathers them.
#pragma once

#include <memory>
#include <vector>

#include "engine/dist/mesh.hpp"
#include "engine/optim/optim.hpp"
#include "engine/parallel/data_parallel.hpp"

namespace partrain::parallel {

class ParallelModel;
class Pipeline;

struct ZeroOptions {
  /// 0 off; 1 optimizer state and master weights sharded; 2 gradients too; 3 parameters too.
  int stage = 0;
  double reduce_bucket_size = 0;    ///< MiB of gradient a bucket reduce-scatters (0: data parallelism's bucket_cap_mb)
  /// After the step, start each bucket's all-gather of the updated parameters and return; they
  /// are waited for when the model is next used (ParallelModel::sync_params), so the gathers
  /// overlap whatever the script does in between (InternLM's overlap_sync_param).
  bool overlap_sync_param = false;
  /// MiB of updated parameters an all-gather after the step holds: consecutive buckets of one
  /// flat buffer are gathered together up to this size (at least one bucket each), so a step
  /// pays a few collectives, not one a bucket. DeepSpeed's allgather_bucket_size (in elements
  /// there). Each rank keeps a buffer of that size, in the parameters' dtype, for the gathers.
  double allgather_bucket_size = 25;
  /// Stage 1: each bucket is reduce-scattered over the zero group, so a rank gets only the part
  /// its masters update (the bytes of an all-reduce, not those plus the all-gather's), and the
  /// parameters' .grad go as under stage 2 (sync_shard_grad makes them whole). false: buckets are
  /// all-reduced and every .grad stays whole. DeepSpeed's reduce_scatter, default true there too.
  bool reduce_scatter = true;
  /// Stage 2: leave each bucket's reduce-scatter in flight beside backward (Gloo: one all-to-all
  /// on its threads) instead of completing it before backward goes on, at the cost of the
  /// scratch and an inbox of the (at most two) buckets in flight. Stage 1's reduce-scatters are
  /// always in flight (its buffer is whole anyway), so there it can only be true. DeepSpeed's
  /// overlap_comm, off by default there too for stage 2.
  c10::optional<bool> overlap_comm;
  /// Stage 3: free a unit's parameters after its forward and gather them again for backward
  /// (FSDP2's reshard_after_forward); off keeps them from forward to backward. Absent: on, but
  /// off under a pipeline (a stage's units stay gathered over its micro-batches, gathered once a
  /// step, as torchtitan does).
  c10::optional<bool> reshard_after_forward;
  /// Stage 3: units whose gather starts while one computes (the next in forward, the ones before
  /// in backward); 0 gathers each when it is reached.
  int prefetch = 1;
  /// Stage 3: the modules gathered as units, by dotted path, in forward order; empty: each child
  /// of `blocks` (every direct child of the root holding parameters when that is empty too).
  /// The root unit holds the rest.
  std::vector<std::string> units;
  std::string blocks;  ///< the container of the model's blocks (a policy's pipeline blocks)

  /// Checks the options against `mesh` (its zero groups) and returns the stage they ask for;
  /// throws naming the option and value that do not fit.
  int validate(const dist::Mesh& mesh) const;
};

/// The zero stage of a model parallelized over `mesh` with `zero` (absent: 1 when the mesh has
/// zero groups of more than one rank, else 0), checked (ZeroOptions::validate).
int zero_stage_of(const c10::optional<ZeroOptions>& zero, const dist::Mesh& mesh);

/// ZeRO's part of data parallelism: `dp` set for `stage` (the zero group, reduce-scatter,
/// overlap, bucket size) and, on a pipeline rank, the tensors whose buckets stay whole (ties
/// across stages, tensors two of its chunks hold) and its chunks' parameters.
void zero_data_parallel(int stage, const c10::optional<ZeroOptions>& zero, const dist::Mesh& mesh,
                        const Pipeline* pipeline, DataParallelOptions& dp);

/// What ZeRO keeps on this rank, in bytes, for the planner and the REPL.
struct ZeroBytes {
  int stage = 0;               ///< the zero stage
  int group = 1;               ///< the zero group's size
  int64_t master = 0;          ///< master weights of this rank's shard
  int64_t state = 0;           ///< optimizer state of the shard (as allocated so far)
  int64_t shard_grad = 0;      ///< the gradient shard the update reads (the masters' .grad)
  /// What data parallelism holds for gradients: stage 1 the whole flat buffers; stage 2 the shard
  /// buffers, the buckets reduced whole (ties across pipeline stages) and the scratch pool.
  int64_t grad_buffer = 0;
  int64_t scratch = 0;         ///< stage 2: the scratch pool (its high-water mark), part of grad_buffer
  /// Stage 2: bytes of shard_grad that are grad_buffer's shard itself (one tensor, not two).
  int64_t shared_grad = 0;
  /// overlap_sync_param: buckets whose all-gather of updated parameters is in flight now.
  int gathers_in_flight = 0;
  /// The all-gathers a step makes of the updated parameters (runs of buckets up to
  /// allgather_bucket_size), and the bytes of the buffer they are gathered into.
  int gathers = 0;
  int64_t gather_buffer = 0;
  /// The tensors the optimizer steps: the masters cut into pieces, each one parameter's elements
  /// or padding (on the CPU of at most 128 Ki elements, which keeps the update's temporaries in
  /// cache), so that a parameter without a gradient is skipped with its own state.
  int pieces = 0;
  /// Stage 3: the parameters' shards (1/z of every parameter); of master, the bytes that are
  /// those shards themselves (float32 parameters: one tensor, not two); the units gathered now,
  /// the most at once so far, the largest unit and the root unit (gathered bytes).
  int64_t param_shard = 0, shared_master = 0;
  int64_t gathered = 0, peak_gathered = 0, largest_unit = 0, root_unit = 0;
};

/// Makes the distributed optimizer for `model` (parallelized with a zero stage of 1 or 2): an
/// Optimizer over this rank's master shards (float32, or float64 for float64 parameters) with
/// `options`, whose step moves the gradient shard in, clips by the global norm (every element of
/// every parameter once: across the zero group, tensor-split parameters over their group, the
/// pipeline's stages, a tied tensor once), and all-gathers the updated shards into the parameters.
std::shared_ptr<optim::Optimizer> make_zero_optimizer(const std::shared_ptr<ParallelModel>& model,
                                                      const optim::OptimizerOptions& options);

/// ZeRO's bytes on this rank for an optimizer make_zero_optimizer made; nullopt for any other.
c10::optional<ZeroBytes> zero_bytes(const optim::Optimizer& opt);

/// Cube's sync_shard_grad: when the buckets are reduce-scattered (ZeRO-2; ZeRO-1 unless
/// reduce_scatter = false), the reduced parts are gathered so that every parameter's .grad is
/// whole before the user reads it (a norm, a histogram). A no-op otherwise.
void sync_shard_grad(const optim::Optimizer& opt);

}  // namespace partrain::parallel
