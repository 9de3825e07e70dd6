// Helpers of the CUDA test suite (tests/cuda): GPU availability, device arrays, the schemes under test.
#pragma once

#include <kvc/cuda/kvc_cuda.cuh>
#include <kvc/schemes.hpp>

#include "test_data.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

/// Skips the test, with the CUDA runtime's error text, where no GPU can be used.
#define KVC_REQUIRE_GPU()                                                        \
  do {                                                                           \
    std::string kvc_why_;                                                        \
    if (!::kvc::cuda::device_available(&kvc_why_))                               \
      GTEST_SKIP() << "no usable CUDA device (" << kvc_why_ << ")";              \
  } while (0)

namespace kvc_cuda_test {

/// A device copy of a host vector.
template <class T>
struct DeviceArray {
  kvc::cuda::DeviceBuffer<T> buf;
  explicit DeviceArray(const std::vector<T>& h) : buf(h.size()) {
    kvc::cuda::check(cudaMemcpy(buf.data(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), "test upload");
  }
  explicit DeviceArray(std::size_t n) : buf(n) {}
  T* data() { return buf.data(); }
  std::vector<T> get() const {
    std::vector<T> h(buf.size());
    kvc::cuda::check(cudaMemcpy(h.data(), buf.data(), h.size() * sizeof(T), cudaMemcpyDeviceToHost), "test download");
    return h;
  }
};

namespace sch {
using namespace kvc;
using Fp16 = schemes::Fp16;
using Bf16 = CompressedKVCache<NoQuantizer<bfloat16_t>>;
using Fp32 = schemes::Fp32;
using Int8 = schemes::Int8;
using Kivi4 = schemes::Kivi4;
using Kivi2 = schemes::Kivi2;
/// KIVI-3 with a 4-token sink, a 16-token window and 16-channel value groups (head dims 80 and 96).
using Kivi3Sink = CompressedKVCache<keys<GroupQuantizer<3, 32, Axis::kChannel>>, values<GroupQuantizer<3, 16, Axis::kToken>>,
                                    FullPrecisionWindow<16, 4>>;
using GearKivi2 = schemes::GearKivi2;
using Gear4 = schemes::Gear4;
using OutlierQuant4 = schemes::OutlierQuant4;
}  // namespace sch

template <class C>
inline constexpr const char* name = "unnamed";
template <> inline constexpr const char* name<sch::Fp16> = "Fp16";
template <> inline constexpr const char* name<sch::Bf16> = "Bf16";
template <> inline constexpr const char* name<sch::Fp32> = "Fp32";
template <> inline constexpr const char* name<sch::Int8> = "Int8";
template <> inline constexpr const char* name<sch::Kivi4> = "Kivi4";
template <> inline constexpr const char* name<sch::Kivi2> = "Kivi2";
template <> inline constexpr const char* name<sch::Kivi3Sink> = "Kivi3Sink";
template <> inline constexpr const char* name<sch::GearKivi2> = "GearKivi2";
template <> inline constexpr const char* name<sch::Gear4> = "Gear4";
template <> inline constexpr const char* name<sch::OutlierQuant4> = "OutlierQuant4";

struct Names {
  template <class T>
  static std::string GetName(int) {
    return name<T>;
  }
};

/// Whether a cache fits its low-rank factors by power iteration (device = host up to fp32 rounding).
template <class C>
inline constexpr bool kLowRank = C::key_format::correction::kLowRank || C::value_format::correction::kLowRank;
}  // namespace kvc_cuda_test
