/// \file dump_cli.hpp
/// The command line the KV-dump examples share: `program [dump-file]`, default $KVC_KV_DUMP, else
/// kvc::io::default_kv_dump_path(). A missing default dump is not an error (the examples are demos):
/// the program says how to make one and exits 0; a file named explicitly that is missing exits 2, a
/// corrupt one 1.
#pragma once

#include <kvc/io/kv_dump.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

namespace kvc_examples {

/// Reads the dump into `dump` and `path`; returns the exit status when the program should stop.
inline std::optional<int> load_dump(int argc, char** argv, const char* program, const char* purpose,
                                    kvc::io::KVDump& dump, std::string& path) {
  if (argc > 2 || (argc == 2 && (std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help"))) {
    std::printf("usage: %s [dump-file]   (default: $KVC_KV_DUMP, else ~/.cache/kvc/smollm2_kv_dump.bin)\n",
                argv[0]);
    return argc > 2 ? 2 : 0;
  }
  const char* env = std::getenv("KVC_KV_DUMP");
  const bool explicit_path = argc == 2 || (env != nullptr && *env != '\0');
  path = argc == 2 ? std::string(argv[1]) : kvc::io::default_kv_dump_path();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    if (explicit_path) {
      std::fprintf(stderr, "%s: %s does not exist\n", program, path.c_str());
      return 2;
    }
    std::printf(
        "%s: no KV dump at %s\n"
        "This example %s on real keys/values/queries dumped by the llama engine.\n"
        "Make a dump with the engine in examples/llama:\n"
        "  kvc-eval --tokens 1024 --schemes fp32 --dump-kv %s   (see examples/llama for the model)\n"
        "then run  %s [dump-file]  (or set KVC_KV_DUMP=<dump-file>).\n"
        "Nothing to do: exiting with status 0.\n",
        program, path.c_str(), purpose, path.c_str(), program);
    return 0;
  }
  try {
    dump = kvc::io::read_kv_dump(path);
  } catch (const kvc::Error& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return 1;
  }
  return std::nullopt;
}
}  // namespace kvc_examples
