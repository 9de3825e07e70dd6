// The attention kernels of half the test schemes (see KVC_TEST_SCHEMES_B in test_util.hpp),
// compiled once for the whole test binary. No tests here.
#include "test_util.hpp"

KVC_TEST_SCHEMES_B(KVC_TEST_INSTANTIATE_ATTENTION)
