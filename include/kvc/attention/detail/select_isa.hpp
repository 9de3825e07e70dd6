/// \file select_isa.hpp
/// Private: the one place that maps a run-time kvc::Isa to a fused CPU kernel's instance for that path.
/// attention/detail/per_isa.hpp compiles each kernel family once per path this build contains, in the
/// namespaces kvc::detail::isa_portable, isa_avx2 and isa_avx512; each of them holds an IsaTag (declared here).
/// A family's per-path header declares a hook taking its path's IsaTag, found by argument-dependent lookup,
/// and its entry point calls `select_isa(isa, [](auto tag) { return hook(tag); })`: so which paths exist
/// (KVC_HAS_*_PATH(), KVC_DISPATCH_TARGET_ONLY) is decided here, not once per entry point. Host only.
#pragma once

#include <kvc/core/cpu_features.hpp>

namespace kvc::detail {
#if KVC_HAS_PORTABLE_PATH()
namespace isa_portable {
struct IsaTag {};
}  // namespace isa_portable
#endif
#if KVC_HAS_AVX2_PATH()
namespace isa_avx2 {
struct IsaTag {};
}  // namespace isa_avx2
#endif
#if KVC_HAS_AVX512_PATH()
namespace isa_avx512 {
struct IsaTag {};
}  // namespace isa_avx512
#endif

/// f(tag), tag the IsaTag of the path `isa` names. Precondition: this build contains `isa` (resolve_isa returns
/// only such paths). f must return the same type for every tag (a kernel's entry points).
template <class F>
constexpr decltype(auto) select_isa(Isa isa, F&& f) {
  (void)isa;  // unused when the build has one path
#if KVC_HAS_AVX512_PATH()
  if (isa == Isa::kAvx512) return f(isa_avx512::IsaTag{});
#endif
#if KVC_HAS_PORTABLE_PATH()
#  if KVC_HAS_AVX2_PATH()
  if (isa == Isa::kAvx2) return f(isa_avx2::IsaTag{});
#  endif
  return f(isa_portable::IsaTag{});
#else  // KVC_DISPATCH_TARGET_ONLY with AVX2 in the target: no portable path, so isa is kAvx2 here
  return f(isa_avx2::IsaTag{});
#endif
}
}  // namespace kvc::detail
