// GPU benchmarks of kvc::cuda, one binary so that ratios come from one run:
//   BM_CudaDecodeAttention/<scheme>/T:<tokens>/B:<batch>/G:<gqa>  fused decode attention, 8 KV heads,
//       head dim 128, fp16 queries; bytes_per_second = the bytes one decode step reads (the cache's own
//       decode_read_bytes: codes, scales, zeros, corrections, fp16 window) per second of kernel time
//   BM_CudaCopy/bytes:<n>  cudaMemcpyAsync device to device: bytes_per_second = n read + n written per
//       second (the bandwidth limit; read_per_second is half of it)
// Timing: CUDA events around each call (UseManualTime). Which GPU: printed at start.
#include <kvc/cuda/kvc_cuda.cuh>
#include <kvc/schemes.hpp>

#include <benchmark/benchmark.h>

#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {
constexpr int kKvHeads = 8, kHeadDim = 128, kChunk = 2048;

/// CUDA events timing one stream region.
struct EventTimer {
  cudaEvent_t a = nullptr, b = nullptr;
  EventTimer() {
    kvc::cuda::check(cudaEventCreate(&a), "cudaEventCreate");
    kvc::cuda::check(cudaEventCreate(&b), "cudaEventCreate");
  }
  ~EventTimer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  void start() { kvc::cuda::check(cudaEventRecord(a), "cudaEventRecord"); }
  double stop_seconds() {
    kvc::cuda::check(cudaEventRecord(b), "cudaEventRecord");
    kvc::cuda::check(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0.0f;
    kvc::cuda::check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    return ms * 1e-3;
  }
};

/// A device cache of `batch` sequences of T tokens, filled on the device from random chunks (built once
/// per shape and scheme, kept while consecutive rows use it).
template <class Host>
struct Filled {
  using Dev = kvc::cuda::device_cache_t<Host>;
  static Dev& get(int T, int batch) {
    static std::unique_ptr<Dev> cache;
    static int key_t = -1, key_b = -1;
    if (!cache || key_t != T || key_b != batch) {
      cache.reset();
      cache = std::make_unique<Dev>(kvc::CacheConfig{1, batch, kKvHeads, kHeadDim, T});
      std::mt19937_64 rng(1);
      std::normal_distribution<float> n01(0.0f, 1.0f);
      std::vector<float> k(std::size_t(kChunk) * kKvHeads * kHeadDim), v(k.size());
      for (std::size_t i = 0; i < k.size(); ++i) {
        k[i] = n01(rng) * (1.0f + float(i % kHeadDim == 7) * 8.0f);  // one outlier channel
        v[i] = n01(rng);
      }
      kvc::cuda::DeviceBuffer<float> dk(k.size()), dv(v.size());
      kvc::cuda::check(cudaMemcpy(dk.data(), k.data(), k.size() * 4, cudaMemcpyHostToDevice), "fill");
      kvc::cuda::check(cudaMemcpy(dv.data(), v.data(), v.size() * 4, cudaMemcpyHostToDevice), "fill");
      for (int s = 0; s < batch; ++s)
        for (int t = 0; t < T; t += kChunk) {
          const int n = T - t < kChunk ? T - t : kChunk;
          cache->append_device(0, s, kvc::KVView::contiguous(dk.data(), n, kKvHeads, kHeadDim),
                               kvc::KVView::contiguous(dv.data(), n, kKvHeads, kHeadDim));
        }
      kvc::cuda::check(cudaDeviceSynchronize(), "fill");
      key_t = T;
      key_b = batch;
    }
    return *cache;
  }
};

template <class Host>
void decode_row(benchmark::State& state, int T, int batch, int gqa) {
  auto& cache = Filled<Host>::get(T, batch);
  const int H = kKvHeads * gqa;
  std::vector<kvc::half_t> q(std::size_t(batch) * H * kHeadDim);
  std::mt19937_64 rng(2);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  for (auto& x : q) x = kvc::half_t::from_float(n01(rng));
  kvc::cuda::DeviceBuffer<kvc::half_t> dq(q.size()), dout(q.size());
  kvc::cuda::check(cudaMemcpy(dq.data(), q.data(), q.size() * 2, cudaMemcpyHostToDevice), "query");
  kvc::cuda::decode_attention<kHeadDim>(cache, 0, batch, H, dq.data(), dout.data());  // warm-up
  EventTimer timer;
  for (auto _ : state) {
    timer.start();
    kvc::cuda::decode_attention<kHeadDim>(cache, 0, batch, H, dq.data(), dout.data());
    state.SetIterationTime(timer.stop_seconds());
  }
  const double bytes = double(cache.decode_read_bytes(0));
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes * double(state.iterations())));
  state.counters["read_MB"] = bytes / 1e6;
  state.counters["bits_per_element"] = cache.bits_per_element();
}

void copy_row(benchmark::State& state) {
  const std::size_t n = std::size_t(state.range(0));
  kvc::cuda::DeviceBuffer<std::byte> a(n), b(n);
  EventTimer timer;
  for (auto _ : state) {
    timer.start();
    kvc::cuda::check(cudaMemcpyAsync(b.data(), a.data(), n, cudaMemcpyDeviceToDevice), "cudaMemcpyAsync");
    state.SetIterationTime(timer.stop_seconds());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(2.0 * double(n) * double(state.iterations())));
  state.counters["read_per_second"] =
      benchmark::Counter(double(n) * double(state.iterations()), benchmark::Counter::kIsRate);
}

template <class Host>
void register_scheme(const char* name, std::vector<int> tokens, std::vector<int> batches) {
  for (int T : tokens)
    for (int B : batches)
      for (int G : {1, 4}) {
        const std::string row = std::string("BM_CudaDecodeAttention/") + name + "/T:" + std::to_string(T) +
                                "/B:" + std::to_string(B) + "/G:" + std::to_string(G);
        benchmark::RegisterBenchmark(row.c_str(), [=](benchmark::State& s) { decode_row<Host>(s, T, B, G); })
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond)
            ->MinTime(0.2);
      }
}
}  // namespace

int main(int argc, char** argv) {
  std::string why;
  if (!kvc::cuda::device_available(&why)) {
    std::fprintf(stderr, "kvc_cuda_bench: no usable CUDA device (%s): nothing measured\n", why.c_str());
    return 1;
  }
  cudaDeviceProp prop{};
  kvc::cuda::check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("kvc_cuda_bench on %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  const std::vector<int> T{4096, 32768, 131072}, B{1, 16};
  benchmark::RegisterBenchmark("BM_CudaCopy", copy_row)
      ->Arg(256 << 20)
      ->Arg(1 << 30)
      ->ArgName("bytes")
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
  register_scheme<kvc::schemes::Fp16>("fp16", T, B);
  register_scheme<kvc::CompressedKVCache<kvc::NoQuantizer<kvc::bfloat16_t>>>("bf16", T, B);
  register_scheme<kvc::schemes::Int8>("int8", T, B);
  register_scheme<kvc::schemes::Kivi4>("kivi4", T, B);
  register_scheme<kvc::schemes::Kivi2>("kivi2", T, B);
  // LogQuant beside KIVI-2 on its quantizer and budget (G = 64, 126 fp16 tokens).
  register_scheme<kvc::schemes::LogQuant2>("logquant2", T, B);
  register_scheme<kvc::schemes::PartialLogQuant2>("partiallogquant2", T, B);
  register_scheme<kvc::schemes::Kivi2Budget126>("kivi2_g64_w126", T, B);
  // GEAR's device append fits one rank-1 residual per block through cuBLAS/cuSOLVER: built for the
  // shorter shapes only.
  register_scheme<kvc::schemes::GearKivi2>("gear_kivi2", {4096, 32768}, {1});
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
