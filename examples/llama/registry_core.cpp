/// \file registry_core.cpp
/// kvc-eval-core's registry: schemes_core alone, the schemes the llama.* tests run (scheme_registry.hpp). Every
/// other name, QAQ's included, is an error that names the program holding it.
#include <llama/scheme_registry.hpp>

namespace kvc::llama::detail {
namespace {
constexpr const char* kNote =
    "; this is kvc-eval-core, which holds only the schemes the tests run: every other scheme is in kvc-eval "
    "(cmake --build <build> --target kvc-eval)";
}
std::vector<SchemeEntry> linked_schemes() { return schemes_core(); }
const char* registry_note() { return kNote; }
std::optional<SchemeEntry> qaq_scheme(const std::string& kind, const std::string& name, qaq::Targets) {
  KVC_CHECK(!kind.starts_with("qaq"), Errc::kInvalidArgument, "QAQ scheme '", name, "' is not linked", kNote);
  return std::nullopt;
}
}  // namespace kvc::llama::detail
