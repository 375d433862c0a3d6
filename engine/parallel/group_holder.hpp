// A process group held by an autograd node (saved_data takes capsules of CustomClassHolder): how
// the collectives written as autograd functions (context parallelism's all-to-all, expert
// parallelism's all-to-all of unequal rows) find their group again in backward.
#pragma once

#include <torch/torch.h>

#include "engine/dist/process_group.hpp"

namespace partrain::parallel {

struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(dist::GroupPtr g) : group(std::move(g)) {}
  dist::GroupPtr group;
};

}  // namespace partrain::parallel
