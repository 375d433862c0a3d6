// Balancing pipeline stages by measured time (smp's trace_execution_times): each unit of the
// serial model that a stage can hold — its first part (stage_in, or the policy's first modules),
// every block, its last part (stage_out, or the last modules) — runs forward and backward on one
// sample micro-batch, one unit at a time, and the median times are what split_stages balances.
#pragma once

#include <string>
#include <vector>

#include "engine/dist/process_group.hpp"
#include "engine/nn/module.hpp"

namespace partrain::parallel {

struct PipelineOptions;

/// Times `root`'s pipeline units (as `options` names them: blocks, first, last) on `sample`, a
/// micro-batch of input, each `repeats` times after one warm-up run, and returns the median
/// forward + backward time of each in microseconds: the first part, every block in order, the
/// last part (so blocks + 2 numbers, each at least 1). A unit whose tensors are on the meta device
/// (a deferred model) gets real tensors for its run and its meta tensors back afterwards, so at
/// most one unit is ever allocated. The run leaves no trace: gradients are taken without
/// touching .grad and the generators are put back as they were. When `group` is given (all its
/// ranks call this together) the times are averaged over it, so every rank splits alike.
std::vector<int64_t> time_pipeline_units(nn::Module& root, const PipelineOptions& options, const torch::Tensor& sample,
                                         const dist::GroupPtr& group, int repeats = 3);

}  // namespace partrain::parallel
