# cmake -DKVC_COMPILER=<c++ or nvcc> -DKVC_SOURCE=<case.cpp or case.cu> [-DKVC_INCLUDES=a|b] [-DKVC_FLAGS=x|y]
#       -P KvcCompileFail.cmake
#
# Passes only if compiling KVC_SOURCE fails AND the compiler output matches the CMake regex given
# on the file's first line, `// expect: <regex>`. A case that compiles is a failure.
cmake_minimum_required(VERSION 3.21)

foreach(_var KVC_COMPILER KVC_SOURCE)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "KvcCompileFail.cmake: ${_var} is not set")
  endif()
endforeach()

file(READ "${KVC_SOURCE}" _head LIMIT 4096)
string(REGEX MATCH "^[^\n]*" _first "${_head}")
string(REGEX REPLACE "\r$" "" _first "${_first}")
if(NOT _first MATCHES "^// expect: *(.+)$")
  message(FATAL_ERROR "${KVC_SOURCE}: the first line must be `// expect: <regex>`, got `${_first}`")
endif()
string(STRIP "${CMAKE_MATCH_1}" _expect)

if(KVC_SOURCE MATCHES "\\.cu$")  # nvcc: no -fsyntax-only; compile for one architecture into nothing
  set(_args -std=c++20 -arch=sm_80 -c -o /dev/null)
else()
  set(_args -std=c++20 -fsyntax-only -fdiagnostics-color=never)
endif()
string(REPLACE "|" ";" _flags "${KVC_FLAGS}")
foreach(_f IN LISTS _flags)
  if(NOT _f STREQUAL "")
    list(APPEND _args "${_f}")
  endif()
endforeach()
string(REPLACE "|" ";" _includes "${KVC_INCLUDES}")
foreach(_dir IN LISTS _includes)
  if(NOT _dir STREQUAL "")
    list(APPEND _args "-I${_dir}")
  endif()
endforeach()

set(ENV{LC_ALL} C)  # ASCII quotes in GCC diagnostics
execute_process(
  COMMAND "${KVC_COMPILER}" ${_args} "${KVC_SOURCE}"
  RESULT_VARIABLE _rc
  OUTPUT_VARIABLE _out
  ERROR_VARIABLE _out)

string(REPLACE ";" " " _cmdline "${KVC_COMPILER};${_args};${KVC_SOURCE}")
if(_rc STREQUAL "0")
  message(FATAL_ERROR "compile_fail: ${KVC_SOURCE} COMPILED, but it must fail to compile "
                      "(expected a diagnostic matching `${_expect}`).\ncommand: ${_cmdline}\n${_out}")
endif()
if(NOT _rc MATCHES "^[0-9]+$")
  message(FATAL_ERROR "compile_fail: could not run the compiler (${_rc}).\ncommand: ${_cmdline}")
endif()
if(NOT _out MATCHES "${_expect}")
  message(FATAL_ERROR "compile_fail: ${KVC_SOURCE} failed to compile (exit ${_rc}), but no "
                      "diagnostic matched `${_expect}`.\ncommand: ${_cmdline}\n--- output ---\n${_out}")
endif()
message(STATUS "compile_fail: ${KVC_SOURCE} failed to compile as expected (matched `${_expect}`)")
