// Activation checkpointing (recomputation): a block's forward runs without keeping its
// intermediate activations, only its input; backward runs the forward again, with the random
// numbers it drew the first time, and takes the gradients from that. Memory for activations falls
// from every layer's to one input a block, at the cost of a second forward per block.
#pragma once

#include <string>

#include "engine/nn/module.hpp"

namespace partrain::parallel {

using torch::Tensor;

/// `block`'s forward on x, checkpointed: x's and the block's parameters' gradients come out of
/// backward as if it had run normally (dropout replays the same masks).
Tensor checkpointed_forward(nn::Module& block, const Tensor& x);

/// Makes the module at `container` (a Sequential of blocks: GPT-2's "h", LLaMA's "layers") run
/// each child checkpointed. Refuses a container whose forward is replaced already or that is not
/// a Sequential.
void recompute_blocks(nn::Module& root, const std::string& container);

/// Whether this thread is running a checkpointed block's forward again, inside backward (ZeRO-3
/// keeps the block's parameters gathered for the backward that follows).
bool replaying_checkpoint();

}  // namespace partrain::parallel
