# Teaches CMake < 3.26 that nvcc (>= 12) supports C++20, so that `cuda_std_20` (used by kvc::cuda)
# and CUDA_STANDARD 20 work. Must run after enable_language(CUDA) and before any target that needs
# CUDA standard 20 is generated, in the directory (or a parent of the directory) of that target.
# Installed next to kvcConfig.cmake; the config runs it for `find_package(kvc COMPONENTS cuda)`.
include_guard(GLOBAL)

macro(kvc_enable_cuda20)
  if(CMAKE_CUDA_COMPILER_LOADED AND CMAKE_CUDA_COMPILER_ID STREQUAL "NVIDIA"
     AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.0)
    if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    if(NOT "cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
      list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
      set(CMAKE_CUDA20_COMPILE_FEATURES cuda_std_20)
    endif()
  endif()
endmacro()

# For kvc used via add_subdirectory(): make the parent directory know it too.
macro(kvc_enable_cuda20_parent_scope)
  foreach(_kvc_var CMAKE_CUDA20_STANDARD_COMPILE_OPTION CMAKE_CUDA20_EXTENSION_COMPILE_OPTION
                   CMAKE_CUDA_COMPILE_FEATURES CMAKE_CUDA20_COMPILE_FEATURES)
    if(DEFINED ${_kvc_var})
      set(${_kvc_var} "${${_kvc_var}}" PARENT_SCOPE)
    endif()
  endforeach()
  unset(_kvc_var)
endmacro()
