# Finds LibTorch and decides whether this is a CUDA build. Sets TORCH_LIBRARIES, PARTRAIN_CUDA_ON,
# PARTRAIN_TORCH_RPATH (the folders a partrain binary loads LibTorch's libraries from), and for the
# installed package PARTRAIN_TORCH_ROOT (the LibTorch folder) and PARTRAIN_TORCH_BY_HAND (its CPU
# half imported without LibTorch's configuration).
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

# The folder holding TorchConfig.cmake, among PARTRAIN_TORCH, CMAKE_PREFIX_PATH and Torch_DIR
# (as variables, then from the environment).
set(_candidates)
string(REPLACE ":" ";" _env_prefix "$ENV{CMAKE_PREFIX_PATH}")
foreach(_p ${PARTRAIN_TORCH} ${CMAKE_PREFIX_PATH} ${Torch_DIR} ${_env_prefix} $ENV{Torch_DIR})
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
if(NOT EXISTS "${_torch_root}/include/torch/csrc/api/include/torch/torch.h")
  message(FATAL_ERROR "${_torch_config_dir}/TorchConfig.cmake is not inside a LibTorch folder (expected its headers "
                      "in ${_torch_root}/include): name the LibTorch folder itself with PARTRAIN_TORCH=/path")
endif()

# Is it a CUDA LibTorch, and can this machine compile against it?
set(_torch_is_cuda OFF)
if(EXISTS "${_torch_root}/lib/libtorch_cuda.so")
  set(_torch_is_cuda ON)
endif()
find_package(CUDAToolkit QUIET)
# The CUDA release the LibTorch was built for: a wheel's torch/version.py, a LibTorch zip's
# build-version ("2.11.0+cu130").
set(_torch_cuda "")
if(EXISTS "${_torch_root}/version.py")
  file(STRINGS "${_torch_root}/version.py" _v REGEX "^cuda")
  string(REGEX MATCH "[0-9]+\\.[0-9]+" _torch_cuda "${_v}")
elseif(EXISTS "${_torch_root}/build-version")
  file(READ "${_torch_root}/build-version" _v)
  string(REGEX MATCH "cu([0-9]+)([0-9])" _m "${_v}")
  if(_m)
    set(_torch_cuda "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}")
  endif()
endif()
string(REGEX MATCH "^[0-9]+" _torch_cuda_major "${_torch_cuda}")
set(PARTRAIN_CUDA_ON OFF)
set(_why_off "")
if(PARTRAIN_CUDA STREQUAL "OFF")
  set(_why_off "PARTRAIN_CUDA=OFF")
elseif(NOT _torch_is_cuda)
  set(_why_off "the LibTorch in ${_torch_root} is a CPU one")
elseif(NOT CUDAToolkit_FOUND)
  set(_why_off "no CUDA toolkit on this machine (nvcc not found)")
elseif(_torch_cuda_major AND NOT _torch_cuda_major STREQUAL CUDAToolkit_VERSION_MAJOR)
  set(_why_off "the CUDA toolkit here is ${CUDAToolkit_VERSION}, LibTorch was built for CUDA ${_torch_cuda}")
else()
  set(PARTRAIN_CUDA_ON ON)
endif()
if(PARTRAIN_CUDA STREQUAL "ON" AND NOT PARTRAIN_CUDA_ON)
  message(FATAL_ERROR "PARTRAIN_CUDA=ON, but ${_why_off}")
endif()

include(${CMAKE_CURRENT_LIST_DIR}/partrainTorch.cmake)
set(PARTRAIN_TORCH_BY_HAND OFF)
if(PARTRAIN_CUDA_ON OR NOT _torch_is_cuda)
  # LibTorch's own configuration: for a CUDA LibTorch it finds the toolkit, cuDNN and NVTX itself.
  if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(TORCH_CUDA_ARCH_LIST "9.0")  # partrain compiles no kernels; this only quiets the GPU probe
  endif()
  # The LibTorch chosen above, not one an earlier configure cached (the candidates put
  # PARTRAIN_TORCH and CMAKE_PREFIX_PATH before Torch_DIR, so this records the choice only).
  set(Torch_DIR "${_torch_config_dir}" CACHE PATH "The folder holding TorchConfig.cmake" FORCE)
  find_package(Torch REQUIRED CONFIG PATHS "${_torch_config_dir}" NO_DEFAULT_PATH)
else()
  # A CUDA LibTorch on a machine without the toolkit: its CPU half, imported by hand.
  partrain_torch_cpu_target(partrain_torch_cpu "${_torch_root}")
  set(TORCH_LIBRARIES partrain_torch_cpu)
  set(PARTRAIN_TORCH_BY_HAND ON)
endif()
set(PARTRAIN_TORCH_ROOT "${_torch_root}")
partrain_torch_rpath(PARTRAIN_TORCH_RPATH "${_torch_root}")

set(PARTRAIN_TORCH_VERSION "")
foreach(_version_h "${_torch_root}/include/torch/headeronly/version.h"           # 2.9 on
                   "${_torch_root}/include/torch/csrc/api/include/torch/version.h")
  if(EXISTS "${_version_h}")
    foreach(_part MAJOR MINOR PATCH)
      file(STRINGS "${_version_h}" _v REGEX "#define TORCH_VERSION_${_part} ")
      string(REGEX MATCH "[0-9]+" _v "${_v}")
      list(APPEND PARTRAIN_TORCH_VERSION "${_v}")
    endforeach()
    string(REPLACE ";" "." PARTRAIN_TORCH_VERSION "${PARTRAIN_TORCH_VERSION}")
    break()
  endif()
endforeach()
if(PARTRAIN_CUDA_ON)
  message(STATUS "partrain: CUDA build: LibTorch ${PARTRAIN_TORCH_VERSION} (${_torch_root}), CUDA ${CUDAToolkit_VERSION}, NCCL")
else()
  message(STATUS "partrain: CPU build (CUDA off: ${_why_off}): LibTorch ${PARTRAIN_TORCH_VERSION} (${_torch_root})")
endif()
if(PARTRAIN_TORCH_PIN AND NOT PARTRAIN_TORCH_VERSION VERSION_EQUAL PARTRAIN_TORCH_PIN)
  message(STATUS "partrain: note: LibTorch ${PARTRAIN_TORCH_VERSION} is not the ${PARTRAIN_TORCH_PIN} partrain is tested with")
endif()
