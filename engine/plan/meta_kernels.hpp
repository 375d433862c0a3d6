// The meta kernels planning needs and the running LibTorch lacks in C++ (meta_kernels.cpp).
#pragma once

namespace partrain::plan::meta {

/// Registers, once, a Meta kernel for each operator planning runs that has none in C++.
void install();

}  // namespace partrain::plan::meta
