// expect: Rotation \(not built for QAQ
// QAQ's cache is its own container; rotating its records is not built.
#include <kvc/kvc.hpp>

using Bad = kvc::CompressedKVCache<kvc::QaqQuantizer<>, kvc::Rotation<kvc::Hadamard<>>>;
static_assert(sizeof(Bad) > 0);
