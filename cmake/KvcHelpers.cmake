# Helpers for kvc's own test, benchmark and example targets. Not installed.
include_guard(GLOBAL)

# kvc_native_flags(<target>)
#   Adds -march=native to <target> (PRIVATE) when KVC_NATIVE is ON and the compiler accepts it.
#   Only ever used on kvc's own executables: the exported kvc::kvc never carries -march flags.
function(kvc_native_flags target)
  if(KVC_NATIVE AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang|IntelLLVM")
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-march=native>)
  endif()
endfunction()

# kvc_native_target_only(<target>)
#   kvc_native_flags(<target>) and, when KVC_NATIVE is ON, KVC_DISPATCH_TARGET_ONLY (core/cpu_features.hpp): the
#   program runs only where it was built, so only the attention paths -march=native guarantees this CPU runs are
#   compiled (AVX-512 and AVX2, or AVX2 alone; the portable path only without AVX2).
function(kvc_native_target_only target)
  kvc_native_flags(${target})
  if(KVC_NATIVE AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang|IntelLLVM")
    target_compile_definitions(${target} PRIVATE KVC_DISPATCH_TARGET_ONLY)
  endif()
endfunction()

# kvc_add_test(<name> SOURCES <src>... [LABELS <label>...] [DEFINITIONS <def>...]
#              [OPTIONS <compile option>...] [LIBRARIES <lib>...] [TEST_PREFIX <prefix>]
#              [NATIVE] [NO_DISCOVERY])
#   One GoogleTest executable <name> linked to kvc::kvc and GTest::gtest_main, its tests
#   registered with gtest_discover_tests (DISCOVERY_TIMEOUT 60) under <prefix><Suite>.<Test>, each
#   run with KVC_TEST_ENVIRONMENT. NATIVE adds -march=native when KVC_NATIVE is ON. NO_DISCOVERY
#   builds but registers nothing (e.g. for an instruction set this machine cannot run).
function(kvc_add_test name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "NATIVE;NO_DISCOVERY" "TEST_PREFIX"
                        "SOURCES;LABELS;DEFINITIONS;OPTIONS;LIBRARIES")
  if(arg_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "kvc_add_test(${name}): unknown arguments ${arg_UNPARSED_ARGUMENTS}")
  endif()
  if(NOT arg_SOURCES)
    message(FATAL_ERROR "kvc_add_test(${name}): no SOURCES")
  endif()
  add_executable(${name} ${arg_SOURCES})
  target_link_libraries(${name} PRIVATE kvc::kvc GTest::gtest_main ${arg_LIBRARIES})
  target_compile_definitions(${name} PRIVATE ${arg_DEFINITIONS})
  target_compile_options(${name} PRIVATE ${arg_OPTIONS})
  if(arg_NATIVE)
    kvc_native_flags(${name})
  endif()
  if(arg_NO_DISCOVERY)
    return()
  endif()
  gtest_discover_tests(${name}
    TEST_PREFIX "${arg_TEST_PREFIX}"
    TEST_LIST ${name}_TESTS
    DISCOVERY_TIMEOUT 60)
  # gtest_discover_tests (CMake <= 3.2x) splits list-valued PROPERTIES, so set the labels (and
  # KVC_TEST_ENVIRONMENT) from a ctest include file that runs after the discovered tests were added.
  set(labels unit ${arg_LABELS})
  set(environment "${KVC_TEST_ENVIRONMENT}")
  set(label_file "${CMAKE_CURRENT_BINARY_DIR}/${name}_labels.cmake")
  file(CONFIGURE OUTPUT "${label_file}" CONTENT [[
foreach(_kvc_test IN LISTS @name@_TESTS)
  set_tests_properties("${_kvc_test}" PROPERTIES LABELS "@labels@" ENVIRONMENT "@environment@")
endforeach()
]] @ONLY)
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${label_file}")
endfunction()

# kvc_add_benchmark(<name> SOURCES <src>... [DEFINITIONS <def>...] [OPTIONS <compile option>...]
#                   [LIBRARIES <lib>...] [BASELINE])
#   One Google Benchmark executable linked to kvc::kvc and benchmark::benchmark (plus
#   benchmark::benchmark_main, a static archive: only used if no source defines main()),
#   built with -O3 and, when KVC_NATIVE is ON and BASELINE is not given, -march=native and
#   KVC_DISPATCH_TARGET_ONLY (kvc_native_target_only).
function(kvc_add_benchmark name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "BASELINE" "" "SOURCES;DEFINITIONS;OPTIONS;LIBRARIES")
  if(arg_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "kvc_add_benchmark(${name}): unknown arguments ${arg_UNPARSED_ARGUMENTS}")
  endif()
  if(NOT arg_SOURCES)
    message(FATAL_ERROR "kvc_add_benchmark(${name}): no SOURCES")
  endif()
  add_executable(${name} ${arg_SOURCES})
  target_link_libraries(${name} PRIVATE kvc::kvc benchmark::benchmark ${arg_LIBRARIES})
  if(TARGET benchmark::benchmark_main)
    target_link_libraries(${name} PRIVATE benchmark::benchmark_main)
  endif()
  target_compile_definitions(${name} PRIVATE ${arg_DEFINITIONS})
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang|IntelLLVM")
    target_compile_options(${name} PRIVATE -O3)
  endif()
  target_compile_options(${name} PRIVATE ${arg_OPTIONS})
  if(NOT arg_BASELINE)
    kvc_native_target_only(${name})  # they time the path the CPU runs (KVC_FORCE_ISA=avx2 still can, with AVX-512)
  endif()
endfunction()

# kvc_add_example(<source>)
#   One executable per example file, named after the file stem (examples/00_quickstart.cpp ->
#   00_quickstart), linked to kvc::kvc, -march=native when KVC_NATIVE is ON, and KVC_DISPATCH_TARGET_ONLY
#   with it but for the quickstart (which shows every path compiled in and one chosen at run time).
function(kvc_add_example source)
  get_filename_component(name "${source}" NAME_WLE)
  add_executable(${name} "${source}")
  target_link_libraries(${name} PRIVATE kvc::kvc)
  if(name STREQUAL "00_quickstart")
    kvc_native_flags(${name})
  else()
    kvc_native_target_only(${name})
  endif()
endfunction()
