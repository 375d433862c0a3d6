# Finds LibTorch and decides whether this is a CUDA build. Sets TORCH_LIBRARIES, PARTRAIN_CUDA_ON
# and PARTRAIN_TORCH_RPATH (the folders a partrain binary loads LibTorch's libraries from).
#
# LibTorch is looked for in PARTRAIN_TORCH (a LibTorch folder, or the folder
# torch.utils.cmake_prefix_path names) and then CMAKE_PREFIX_PATH; scripts/build passes the
# PyTorch wheel's from .venv/. PARTRAIN_CUDA is AUTO (a CUDA build where the LibTorch is a CUDA one
# and the CUDA toolkit is on the machine), ON (the same, refused where either is missing) or OFF.

set(PARTRAIN_TORCH "$ENV{PARTRAIN_TORCH}" CACHE PATH "A LibTorch folder (or its share/cmake), ahead of CMAKE_PREFIX_PATH")
set(PARTRAIN_CUDA AUTO CACHE STRING "Build the CUDA and NCCL paths: AUTO, ON or OFF")
set_property(CACHE PARTRAIN_CUDA PROPERTY STRINGS AUTO ON OFF)
if(NOT PARTRAIN_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "PARTRAIN_CUDA=${PARTRAIN_CUDA}: expected AUTO, ON or OFF")
endif()

# The folder holding TorchConfig.cmake, among PARTRAIN_TORCH, Torch_DIR and CMAKE_PREFIX_PATH.
set(_candidates)
foreach(_p ${PARTRAIN_TORCH} ${Torch_DIR} ${CMAKE_PREFIX_PATH})
  list(APPEND _candidates "${_p}" "${_p}/Torch" "${_p}/cmake/Torch" "${_p}/share/cmake/Torch")
endforeach()
set(_torch_config_dir "")
foreach(_c ${_candidates})
  if(EXISTS "${_c}/TorchConfig.cmake")
    get_filename_component(_torch_config_dir "${_c}" ABSOLUTE)
    break()
  endif()
endforeach()
if(NOT _torch_config_dir)
  message(FATAL_ERROR "LibTorch not found: run scripts/setup (it installs PyTorch ${PARTRAIN_TORCH_PIN}'s wheel "
                      "into .venv/), or name a LibTorch with PARTRAIN_TORCH=/path or CMAKE_PREFIX_PATH "
                      "(looked in: ${PARTRAIN_TORCH} ${Torch_DIR} ${CMAKE_PREFIX_PATH})")
endif()
get_filename_component(_torch_root "${_torch_config_dir}/../../.." ABSOLUTE)
set(Torch_DIR "${_torch_config_dir}" CACHE PATH "The folder holding TorchConfig.cmake" FORCE)

# Is it a CUDA LibTorch, and can this machine compile against it?
set(_torch_is_cuda OFF)
if(EXISTS "${_torch_root}/lib/libtorch_cuda.so")
  set(_torch_is_cuda ON)
endif()
find_package(CUDAToolkit QUIET)
set(PARTRAIN_CUDA_ON OFF)
set(_why_off "")
if(PARTRAIN_CUDA STREQUAL "OFF")
  set(_why_off "PARTRAIN_CUDA=OFF")
elseif(NOT _torch_is_cuda)
  set(_why_off "the LibTorch in ${_torch_root} is a CPU one")
elseif(NOT CUDAToolkit_FOUND)
  set(_why_off "no CUDA toolkit on this machine (nvcc not found)")
else()
  set(PARTRAIN_CUDA_ON ON)
endif()
if(PARTRAIN_CUDA STREQUAL "ON" AND NOT PARTRAIN_CUDA_ON)
  message(FATAL_ERROR "PARTRAIN_CUDA=ON, but ${_why_off}")
endif()

if(PARTRAIN_CUDA_ON OR NOT _torch_is_cuda)
  # LibTorch's own configuration: for a CUDA LibTorch it finds the toolkit, cuDNN and NVTX itself.
  if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(TORCH_CUDA_ARCH_LIST "9.0")  # partrain compiles no kernels; this only quiets the GPU probe
  endif()
  find_package(Torch REQUIRED CONFIG PATHS "${_torch_config_dir}" NO_DEFAULT_PATH)
else()
  # A CUDA LibTorch on a machine without the toolkit: LibTorch's configuration would stop at the
  # missing toolkit, so import its CPU half by hand (the libraries a CPU program links; at run
  # time libtorch.so still loads libtorch_cuda.so, whose CUDA libraries the wheel's NVIDIA
  # packages provide).
  add_library(partrain_torch_cpu INTERFACE)
  target_include_directories(partrain_torch_cpu SYSTEM INTERFACE
    "${_torch_root}/include" "${_torch_root}/include/torch/csrc/api/include")
  target_link_libraries(partrain_torch_cpu INTERFACE
    "${_torch_root}/lib/libtorch.so" "${_torch_root}/lib/libtorch_cpu.so" "${_torch_root}/lib/libc10.so")
  set(TORCH_LIBRARIES partrain_torch_cpu)
endif()

# Where the binaries find LibTorch's libraries at run time. The wheel's libtorch_cuda.so carries
# no search path for the CUDA libraries (Python loads them before it); the NVIDIA packages beside
# it (site-packages/nvidia/*/lib) hold them. A binary's RPATH (not RUNPATH) reaches the libraries
# its libraries load, so the binaries are linked with --disable-new-dtags.
set(PARTRAIN_TORCH_RPATH "${_torch_root}/lib")
file(GLOB _nvidia_libs LIST_DIRECTORIES true "${_torch_root}/../nvidia/*/lib")
foreach(_d ${_nvidia_libs})
  get_filename_component(_d "${_d}" ABSOLUTE)
  list(APPEND PARTRAIN_TORCH_RPATH "${_d}")
endforeach()

set(PARTRAIN_TORCH_VERSION "")
set(_version_h "${_torch_root}/include/torch/headeronly/version.h")     # 2.9 on
if(NOT EXISTS "${_version_h}")
  set(_version_h "${_torch_root}/include/torch/csrc/api/include/torch/version.h")
endif()
foreach(_part MAJOR MINOR PATCH)
  file(STRINGS "${_version_h}" _v REGEX "#define TORCH_VERSION_${_part} ")
  string(REGEX MATCH "[0-9]+" _v "${_v}")
  list(APPEND PARTRAIN_TORCH_VERSION "${_v}")
endforeach()
string(REPLACE ";" "." PARTRAIN_TORCH_VERSION "${PARTRAIN_TORCH_VERSION}")
if(PARTRAIN_CUDA_ON)
  message(STATUS "partrain: CUDA build: LibTorch ${PARTRAIN_TORCH_VERSION} (${_torch_root}), CUDA ${CUDAToolkit_VERSION}, NCCL")
else()
  message(STATUS "partrain: CPU build (CUDA off: ${_why_off}): LibTorch ${PARTRAIN_TORCH_VERSION} (${_torch_root})")
endif()
if(PARTRAIN_TORCH_PIN AND NOT PARTRAIN_TORCH_VERSION VERSION_EQUAL PARTRAIN_TORCH_PIN)
  message(STATUS "partrain: note: LibTorch ${PARTRAIN_TORCH_VERSION} is not the ${PARTRAIN_TORCH_PIN} partrain is tested with")
endif()
