/// \file cache_dir.hpp
/// Where kvc's tools keep downloaded and generated data (the quality harness's model, KV dumps):
/// $KVC_CACHE_DIR if set and non-empty, else $HOME/.cache/kvc, else the current directory. The same
/// rule as examples/llama/fetch_model.sh and the CMake test setup. Host only.
#pragma once

#include <cstdlib>
#include <string>

namespace kvc::io {

inline std::string cache_dir() {
  if (const char* d = std::getenv("KVC_CACHE_DIR"); d != nullptr && *d != '\0') return d;
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') return std::string(h) + "/.cache/kvc";
  return ".";
}
}  // namespace kvc::io
