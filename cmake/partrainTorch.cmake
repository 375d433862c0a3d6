# LibTorch the way partrain links it, shared by the build (cmake/torch.cmake) and the installed
# package (partrainConfig.cmake): the CPU half of a CUDA LibTorch imported by hand, and the folders
# a binary loads LibTorch's libraries from.

# A CUDA LibTorch on a machine without the toolkit: LibTorch's configuration would stop at the
# missing toolkit, so import its CPU half by hand: libtorch_cpu and libc10, not libtorch.so,
# which would load libtorch_cuda (libtorch_cpu still loads the CUDA runtime and CUPTI, which a
# wheel's NVIDIA packages provide through its RPATH). `root` is the LibTorch folder (holding
# include/ and lib/); extra arguments go to add_library (IMPORTED in the package).
function(partrain_torch_cpu_target target root)
  add_library(${target} INTERFACE ${ARGN})
  target_include_directories(${target} SYSTEM INTERFACE "${root}/include" "${root}/include/torch/csrc/api/include")
  target_link_libraries(${target} INTERFACE "${root}/lib/libtorch_cpu.so" "${root}/lib/libc10.so")
  # LibTorch's own definitions, which some of its headers' class layouts depend on.
  target_compile_definitions(${target} INTERFACE USE_DISTRIBUTED USE_C10D_GLOO USE_RPC USE_TENSORPIPE)
endfunction()

# Where a binary finds LibTorch's libraries at run time: its lib folder, and a wheel's NVIDIA
# packages beside it (site-packages/nvidia/*/lib), so that the CUDA runtime a binary links itself
# is the one LibTorch's libraries load through their own RPATH. Sets `out` to the list.
function(partrain_torch_rpath out root)
  set(dirs "${root}/lib")
  file(GLOB nvidia_libs LIST_DIRECTORIES true "${root}/../nvidia/*/lib")
  foreach(d ${nvidia_libs})
    get_filename_component(d "${d}" ABSOLUTE)
    list(APPEND dirs "${d}")
  endforeach()
  set(${out} ${dirs} PARENT_SCOPE)
endfunction()
