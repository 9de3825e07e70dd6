// expect: its cache is CompressedKVCache<AlignedLoader<...>> alone
// AlignedKV reads fp16 planes; it does not load another scheme's integer codes (SPEC §6).
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::GroupQuantizer<4, 32, kvc::Axis::kToken>, kvc::AlignedLoader<>>;
static_assert(sizeof(Bad) > 0);
