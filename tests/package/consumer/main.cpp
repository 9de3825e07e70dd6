// Smoke test for an installed / add_subdirectory'd kvc (tests/package).
#if __has_include(<kvc/kvc.hpp>)
#  include <kvc/kvc.hpp>
#else
#  include <kvc/core/cpu_features.hpp>
#endif

#include <cstdio>

int main() {
  std::printf("kvc consumer: kvc %d.%d.%d simd=%s\n", KVC_VERSION_MAJOR, KVC_VERSION_MINOR,
              KVC_VERSION_PATCH, kvc::simd_path_name());
  return 0;
}
