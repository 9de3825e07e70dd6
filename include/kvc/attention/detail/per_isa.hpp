/// \file per_isa.hpp
/// Private: includes the header named by KVC_PER_ISA_HEADER once per SIMD path, each time inside that
/// path's target region with KVC_ISA_LEVEL_ (0 portable, 1 AVX2, 2 AVX-512) and KVC_ISA_NS (the path's
/// namespace) defined: how the fused CPU kernels are compiled for every path (and select_isa.hpp picks one at
/// run time).
/// The includer defines KVC_ATTENTION_INTERNAL and KVC_PER_ISA_HEADER around it. No include guard by design.
#if !defined(KVC_ATTENTION_INTERNAL) || !defined(KVC_PER_ISA_HEADER)
#  error "kvc/attention/detail/per_isa.hpp is private"
#endif

#include <kvc/attention/detail/select_isa.hpp>  // each path's IsaTag, and select_isa for the entry points

#if KVC_HAS_PORTABLE_PATH()
#  define KVC_ISA_LEVEL_ 0
#  define KVC_ISA_NS isa_portable
#  include KVC_PER_ISA_HEADER
#  undef KVC_ISA_NS
#  undef KVC_ISA_LEVEL_
#endif
#if KVC_HAS_AVX2_PATH()
KVC_TARGET_BEGIN_AVX2_
#  define KVC_ISA_LEVEL_ 1
#  define KVC_ISA_NS isa_avx2
#  include KVC_PER_ISA_HEADER
#  undef KVC_ISA_NS
#  undef KVC_ISA_LEVEL_
KVC_TARGET_END_
#endif
#if KVC_HAS_AVX512_PATH()
KVC_TARGET_BEGIN_AVX512_
#  define KVC_ISA_LEVEL_ 2
#  define KVC_ISA_NS isa_avx512
#  include KVC_PER_ISA_HEADER
#  undef KVC_ISA_NS
#  undef KVC_ISA_LEVEL_
KVC_TARGET_END_
#endif
