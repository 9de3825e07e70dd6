/// \file registry_all.cpp
/// kvc-eval's registry: every part (scheme_registry.hpp).
#include <llama/scheme_registry.hpp>

namespace kvc::llama::detail {
std::vector<SchemeEntry> linked_schemes() {
  std::vector<SchemeEntry> all;
  for (auto part : {schemes_core, schemes_a, schemes_b, schemes_c, schemes_f, schemes_d, schemes_e})
    for (SchemeEntry& e : part()) all.push_back(std::move(e));
  return all;
}
const char* registry_note() { return ""; }
}  // namespace kvc::llama::detail
