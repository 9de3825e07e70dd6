# Consumer-project tests, run by ctest as `cmake -D... -P KvcPackageTest.cmake`.
#
#   KVC_MODE=find_package      install KVC_BUILD_DIR into <work>/prefix, then configure, build and
#                              run the consumer project with CMAKE_PREFIX_PATH=<work>/prefix
#   KVC_MODE=add_subdirectory  configure, build and run a project that add_subdirectory()s kvc
#
# Other inputs: KVC_SOURCE_DIR, KVC_BUILD_DIR, KVC_PROJECT_DIR, KVC_WORK_DIR, KVC_GENERATOR,
# KVC_MAKE_PROGRAM, KVC_CXX_COMPILER, KVC_CONFIG, KVC_WITH_CUDA, [KVC_CUDA_COMPILER,
# KVC_CUDA_ARCHITECTURES].
cmake_minimum_required(VERSION 3.21)

foreach(_var KVC_MODE KVC_SOURCE_DIR KVC_BUILD_DIR KVC_PROJECT_DIR KVC_WORK_DIR KVC_GENERATOR
             KVC_CXX_COMPILER)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "KvcPackageTest.cmake: ${_var} is not set")
  endif()
endforeach()
if(NOT KVC_CONFIG)
  set(KVC_CONFIG Release)
endif()

# Run a command, echo it, and stop with its output if it fails.
function(kvc_run what)
  string(REPLACE ";" " " _cmdline "${ARGN}")
  message(STATUS "[${KVC_MODE}] ${what}: ${_cmdline}")
  execute_process(COMMAND ${ARGN}
    RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
  if(NOT _rc STREQUAL "0")
    message(FATAL_ERROR "[${KVC_MODE}] ${what} FAILED (${_rc})\n${_out}")
  endif()
  set(KVC_LAST_OUTPUT "${_out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${KVC_WORK_DIR}")
file(MAKE_DIRECTORY "${KVC_WORK_DIR}")
set(_build "${KVC_WORK_DIR}/build")
set(_prefix "${KVC_WORK_DIR}/prefix")

# Compiler-flag environment variables would leak into the consumer's first configure.
foreach(_env CXXFLAGS CFLAGS CUDAFLAGS LDFLAGS)
  unset(ENV{${_env}})
endforeach()

set(_configure "${CMAKE_COMMAND}" -S "${KVC_PROJECT_DIR}" -B "${_build}"
  -G "${KVC_GENERATOR}"
  "-DCMAKE_CXX_COMPILER=${KVC_CXX_COMPILER}"
  "-DCMAKE_BUILD_TYPE=${KVC_CONFIG}"
  -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON)
if(KVC_MAKE_PROGRAM)
  list(APPEND _configure "-DCMAKE_MAKE_PROGRAM=${KVC_MAKE_PROGRAM}")
endif()
if(KVC_WITH_CUDA AND KVC_CUDA_COMPILER)
  list(APPEND _configure "-DCMAKE_CUDA_COMPILER=${KVC_CUDA_COMPILER}")
  if(KVC_CUDA_ARCHITECTURES)
    list(APPEND _configure "-DCMAKE_CUDA_ARCHITECTURES=${KVC_CUDA_ARCHITECTURES}")
  endif()
endif()

if(KVC_MODE STREQUAL "find_package")
  kvc_run("install" "${CMAKE_COMMAND}" --install "${KVC_BUILD_DIR}" --prefix "${_prefix}"
          --config "${KVC_CONFIG}")
  file(GLOB_RECURSE _configs "${_prefix}/*/kvcConfig.cmake")
  file(GLOB_RECURSE _cuda_targets "${_prefix}/*/kvcCudaTargets.cmake")
  if(NOT _configs)
    message(FATAL_ERROR "[${KVC_MODE}] no kvcConfig.cmake under ${_prefix}")
  endif()
  if(KVC_WITH_CUDA AND NOT _cuda_targets)
    message(FATAL_ERROR "[${KVC_MODE}] kvc was built with CUDA but kvcCudaTargets.cmake was not installed")
  elseif(NOT KVC_WITH_CUDA AND _cuda_targets)
    message(FATAL_ERROR "[${KVC_MODE}] kvc was built without CUDA but installed ${_cuda_targets}")
  endif()
  list(APPEND _configure "-DCMAKE_PREFIX_PATH=${_prefix}" "-DKVC_EXPECTED_PREFIX=${_prefix}")
  if(KVC_WITH_CUDA)
    list(APPEND _configure -DKVC_CONSUMER_CUDA=ON)
  else()
    list(APPEND _configure -DKVC_CONSUMER_EXPECT_NO_CUDA=ON)
  endif()
elseif(KVC_MODE STREQUAL "add_subdirectory")
  list(APPEND _configure "-DKVC_SOURCE_DIR=${KVC_SOURCE_DIR}")
else()
  message(FATAL_ERROR "KvcPackageTest.cmake: unknown KVC_MODE '${KVC_MODE}'")
endif()

kvc_run("configure" ${_configure})
kvc_run("build" "${CMAKE_COMMAND}" --build "${_build}" --config "${KVC_CONFIG}")

set(_exe "")
foreach(_candidate "${_build}/kvc_consumer" "${_build}/${KVC_CONFIG}/kvc_consumer"
                   "${_build}/kvc_consumer.exe" "${_build}/${KVC_CONFIG}/kvc_consumer.exe")
  if(EXISTS "${_candidate}")
    set(_exe "${_candidate}")
    break()
  endif()
endforeach()
if(NOT _exe)
  message(FATAL_ERROR "[${KVC_MODE}] the consumer executable was not built under ${_build}")
endif()
kvc_run("run" "${_exe}")
if(NOT KVC_LAST_OUTPUT MATCHES "kvc consumer: kvc [0-9]+\\.[0-9]+\\.[0-9]+ simd=")
  message(FATAL_ERROR "[${KVC_MODE}] unexpected consumer output:\n${KVC_LAST_OUTPUT}")
endif()
message(STATUS "[${KVC_MODE}] OK: ${KVC_LAST_OUTPUT}")
