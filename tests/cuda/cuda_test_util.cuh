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

using kvc_test::error_of;

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

/// The schemes of the host suites (test_data.hpp) plus those only the CUDA suites use.
namespace sch {
using namespace kvc_test::sch;
using Bf16 = kvc::CompressedKVCache<kvc::NoQuantizer<kvc::bfloat16_t>>;
/// KIVI-3 with a 4-token sink, a 16-token window and 16-channel value groups (head dims 80 and 96).
using Kivi3Sink = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<3, 32, kvc::Axis::kChannel>>,
                                         kvc::values<kvc::GroupQuantizer<3, 16, kvc::Axis::kToken>>,
                                         kvc::FullPrecisionWindow<16, 4>>;
using GearKivi2 = kvc::schemes::GearKivi2;
using Gear4 = kvc::schemes::Gear4;
using OutlierQuant4 = kvc::schemes::OutlierQuant4;
/// Rotated: KIVI-2 (both sides), GEAR keys only (the low-rank fit on rotated blocks), KIVI-3 with a sink at
/// head dims 80/96 (the Hartley mix across power-of-two blocks).
using RotKivi2 = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<2, 32, kvc::Axis::kChannel>>,
                                        kvc::values<kvc::GroupQuantizer<2, 32, kvc::Axis::kToken>>,
                                        kvc::FullPrecisionWindow<128>, kvc::Rotation<kvc::Hadamard<>>>;
using RotKeysGear4 = kvc::CompressedKVCache<kvc::UniformQuantizer<4, kvc::Scope::kTensor>, kvc::OutlierFilter<200>,
                                            kvc::LowRankResidual<kvc::Rho<200>>, kvc::BlockTokens<64>,
                                            kvc::RotateKeys<kvc::Hadamard<>>>;
using RotKivi3Sink = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<3, 32, kvc::Axis::kChannel>>,
                                            kvc::values<kvc::GroupQuantizer<3, 16, kvc::Axis::kToken>>,
                                            kvc::FullPrecisionWindow<16, 4>, kvc::Rotation<kvc::Hadamard<>>>;
/// The sink on the block grid (AlignedSinkWindow: block 0's first rows masked): KIVI-3 with 16-channel value
/// groups (every head dim), and the sweep's <= 4.6-bit scheme, Rotated<KiviGridSink<4>> (64-token blocks).
using Kivi3GridSink = kvc::schemes::KiviGridSink<3, 32, 4, 16, 16>;
using RotGridSink4 = kvc::schemes::Rotated<kvc::schemes::KiviGridSink<4>>;
/// AlignedLoader over a scheme's fp16 slots (AlignedWindow: the slots as bit planes): KIVI-2's window, an odd window
/// and sink (slots not a multiple of the block), the same rotated, LogQuant with a small W (its set evicts and moves
/// slots within a few dozen tokens).
using AlignedKivi2 = kvc::schemes::AlignedWindow<kvc::schemes::Kivi2>;
using KiviOdd = kvc::CompressedKVCache<kvc::keys<kvc::GroupQuantizer<2, 32, kvc::Axis::kChannel>>,
                                       kvc::values<kvc::GroupQuantizer<2, 32, kvc::Axis::kToken>>,
                                       kvc::FullPrecisionWindow<40, 3>>;
using AlignedKiviOdd = kvc::schemes::AlignedWindow<KiviOdd>;
using AlignedRotKiviOdd = kvc::schemes::AlignedWindow<kvc::schemes::Rotated<KiviOdd>>;
using AlignedLogW5 = kvc::schemes::AlignedWindow<kvc::schemes::LogQuant<2, 5, 32>>;
}  // namespace sch
using kvc_test::scheme_name;
using Names = kvc_test::SchemeNames;
}  // namespace kvc_cuda_test

template <> inline constexpr const char* kvc_test::scheme_name<kvc_cuda_test::sch::Bf16> = "Bf16";
template <> inline constexpr const char* kvc_test::scheme_name<kvc_cuda_test::sch::Kivi3Sink> = "Kivi3Sink";
template <> inline constexpr const char* kvc_test::scheme_name<kvc_cuda_test::sch::GearKivi2> = "GearKivi2";
template <> inline constexpr const char* kvc_test::scheme_name<kvc_cuda_test::sch::Gear4> = "Gear4";
template <> inline constexpr const char* kvc_test::scheme_name<kvc_cuda_test::sch::OutlierQuant4> = "OutlierQuant4";
template <> inline constexpr const char* kvc_test::scheme_name<kvc_cuda_test::sch::RotKivi2> = "RotKivi2";
template <> inline constexpr const char* kvc_test::scheme_name<kvc_cuda_test::sch::RotKeysGear4> = "RotKeysGear4";
template <> inline constexpr const char* kvc_test::scheme_name<kvc_cuda_test::sch::RotKivi3Sink> = "RotKivi3Sink";
template <> inline constexpr const char* kvc_test::scheme_name<kvc_cuda_test::sch::Kivi3GridSink> = "Kivi3GridSink";
template <> inline constexpr const char* kvc_test::scheme_name<kvc_cuda_test::sch::RotGridSink4> = "RotGridSink4";
template <> inline constexpr const char* kvc_test::scheme_name<kvc_cuda_test::sch::AlignedKivi2> = "AlignedKivi2";
template <> inline constexpr const char* kvc_test::scheme_name<kvc_cuda_test::sch::AlignedKiviOdd> = "AlignedKiviOdd";
template <> inline constexpr const char* kvc_test::scheme_name<kvc_cuda_test::sch::AlignedRotKiviOdd> = "AlignedRotKiviOdd";
template <> inline constexpr const char* kvc_test::scheme_name<kvc_cuda_test::sch::AlignedLogW5> = "AlignedLogW5";

namespace kvc_cuda_test {

/// Whether a cache fits its low-rank factors by power iteration (device = host up to fp32 rounding).
template <class C>
inline constexpr bool kLowRank = C::key_format::correction::kLowRank || C::value_format::correction::kLowRank;
}  // namespace kvc_cuda_test
