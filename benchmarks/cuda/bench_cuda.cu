// GPU benchmarks of kvc::cuda, one binary so that ratios come from one run:
//   BM_CudaDecodeAttention/<scheme>/T:<tokens>/B:<batch>/G:<gqa>  fused decode attention, 8 KV heads,
//       head dim 128, fp16 queries; bytes_per_second = the bytes one decode step reads (the cache's own
//       decode_read_bytes: codes, scales, zeros, corrections, fp16 window) per second of kernel time
//   BM_CudaDecodeAttention/qaq/T:<tokens>/B:<batch>/G:4  QAQ's mixed-bit attention (with the per-token
//       probabilities handed back) at ~3 average code bits per side; BM_CudaQaqDecodeStep/...: a whole step
//       (attention + width update, a new query each step); bytes_per_second = stored bytes per second
//   BM_CudaCopy/bytes:<n>  cudaMemcpyAsync device to device: bytes_per_second = n read + n written per
//       second (the bandwidth limit; read_per_second is half of it)
//   BM_CudaDecodeAttention/aligned_fp16{,_tier16}/T:<tokens>/B:<batch>/G:<gqa>  AlignedKV's attention over fp16 bit
//       planes (fp32 queries); bytes_per_second = the bytes actually read (aligned::ReadStats), fp16_MB what fp16 reads
// Timing: CUDA events around each call (UseManualTime). Which GPU: printed at start.
#include <kvc/cuda/kvc_cuda.cuh>
#include <kvc/schemes.hpp>

#include <benchmark/benchmark.h>

#include <cstdint>
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

/// The fill data of every row: kChunk tokens of N(0, 1) keys (one outlier channel) and values.
void fill_chunk(std::vector<float>& k, std::vector<float>& v) {
  std::mt19937_64 rng(1);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  k.resize(std::size_t(kChunk) * kKvHeads * kHeadDim);
  v.resize(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = n01(rng) * (1.0f + float(i % kHeadDim == 7) * 8.0f);  // one outlier channel
    v[i] = n01(rng);
  }
}

/// f(seq, n) for the chunks of n <= kChunk tokens that fill `batch` sequences of T tokens, in order.
template <class F>
void for_chunks(int T, int batch, F&& f) {
  for (int s = 0; s < batch; ++s)
    for (int t = 0; t < T; t += kChunk) f(s, T - t < kChunk ? T - t : kChunk);
}

/// A device fp16 N(0, 1) query of n elements.
kvc::cuda::DeviceBuffer<kvc::half_t> device_query(std::size_t n, std::uint64_t seed = 2) {
  std::vector<kvc::half_t> q(n);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  for (auto& x : q) x = kvc::half_t::from_float(n01(rng));
  kvc::cuda::DeviceBuffer<kvc::half_t> dq(n);
  kvc::cuda::check(cudaMemcpy(dq.data(), q.data(), n * 2, cudaMemcpyHostToDevice), "query");
  return dq;
}

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
      std::vector<float> k, v;
      fill_chunk(k, v);
      kvc::cuda::DeviceBuffer<float> dk(k.size()), dv(v.size());
      kvc::cuda::check(cudaMemcpy(dk.data(), k.data(), k.size() * 4, cudaMemcpyHostToDevice), "fill");
      kvc::cuda::check(cudaMemcpy(dv.data(), v.data(), v.size() * 4, cudaMemcpyHostToDevice), "fill");
      for_chunks(T, batch, [&](int s, int n) {
        cache->append_device(0, s, kvc::KVView::contiguous(dk.data(), n, kKvHeads, kHeadDim),
                             kvc::KVView::contiguous(dv.data(), n, kKvHeads, kHeadDim));
      });
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
  const std::size_t nq = std::size_t(batch) * H * kHeadDim;
  kvc::cuda::DeviceBuffer<kvc::half_t> dq = device_query(nq), dout(nq);
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

/// QAQ (QaqQuantizer<>, or QaqDev = DeviceQaqCache<QaqQuantizer<>, Rotation<...>>) filled like the other rows,
/// n = 5 decode steps to fill the histories, then each side's target bisected to ~3 average bits (as kvc_bench's
/// QAQ rows), all on the device.
template <class QaqDev>
struct QaqFilled {
  std::unique_ptr<QaqDev> cache;
  std::unique_ptr<kvc::cuda::DeviceBuffer<float>> probs;
  int T = -1, batch = -1, gqa = -1;
  static QaqFilled& get(int T, int batch, int gqa, const kvc::cuda::DeviceBuffer<kvc::half_t>& q,
                        kvc::cuda::DeviceBuffer<kvc::half_t>& out) {
    static QaqFilled f;
    if (f.cache && f.T == T && f.batch == batch && f.gqa == gqa) return f;
    f.cache.reset();
    kvc::qaq::QueryNormCalibration calib(1, kKvHeads, kHeadDim);
    for (float& x : calib.qnorm2) x = 1.0f;  // E ||q / sqrt(d)||^2 of the N(0, 1) query
    calib.queries = 1;
    f.cache = std::make_unique<QaqDev>(kvc::CacheConfig{1, batch, kKvHeads, kHeadDim, T}, kvc::qaq::Targets{1e-3, 1e-3},
                                       calib);
    f.probs = std::make_unique<kvc::cuda::DeviceBuffer<float>>(std::size_t(batch) * kKvHeads * T);
    std::vector<float> k, v;
    fill_chunk(k, v);
    for (int s = 0; s < batch; ++s)
      for (int t = 0; t < T; t += kChunk) {
        const int n = T - t < kChunk ? T - t : kChunk;
        f.cache->append(0, s, kvc::KVView::contiguous(k.data(), n, kKvHeads, kHeadDim),
                        kvc::KVView::contiguous(v.data(), n, kKvHeads, kHeadDim));
      }
    const int H = kKvHeads * gqa;
    for (int i = 0; i < kvc::QaqQuantizer<>::kWindow; ++i) {
      kvc::cuda::decode_attention<kHeadDim>(*f.cache, 0, batch, H, q.data(), out.data(), f.probs->data(), T);
      f.cache->update_widths(0, f.probs->data(), T);
    }
    kvc::qaq::Targets tg = f.cache->targets();
    auto average = [&](int side) {
      return [&, side](double target) {
        (side == 0 ? tg.key_sigma_s : tg.value_sigma_x) = target;
        f.cache->set_targets(tg);
        f.cache->update_widths(0, f.probs->data(), T);  // the same probabilities: the histories' maxima stay
        return f.cache->average_width(side);
      };
    };
    tg.key_sigma_s = kvc::qaq::calibrate_target(average(0), 3.0, 1e-9, 1e3, 30);
    tg.value_sigma_x = kvc::qaq::calibrate_target(average(1), 3.0, 1e-9, 1e3, 30);
    f.cache->set_targets(tg);
    f.cache->update_widths(0, f.probs->data(), T);
    kvc::cuda::check(cudaDeviceSynchronize(), "QAQ fill");
    f.T = T, f.batch = batch, f.gqa = gqa;
    return f;
  }
};

/// QAQ rows: step = false times decode attention (with the probabilities handed back); true a whole decode
/// step as a model runs it, attention then the width update, with a new query each step (16 in turn), so that
/// tokens really move between widths (repeating one step's probabilities would move nothing).
template <class QaqDev>
void qaq_row(benchmark::State& state, int T, int batch, int gqa, bool step) {
  const int H = kKvHeads * gqa;
  const std::size_t nq = std::size_t(batch) * H * kHeadDim;
  kvc::cuda::DeviceBuffer<kvc::half_t> dq = device_query(nq), dout(nq);
  QaqFilled<QaqDev>& f = QaqFilled<QaqDev>::get(T, batch, gqa, dq, dout);
  std::vector<kvc::cuda::DeviceBuffer<kvc::half_t>> qs;
  for (std::uint64_t i = 0; i < 16; ++i) qs.push_back(device_query(nq, 100 + i));
  EventTimer timer;
  std::size_t n = 0;
  for (auto _ : state) {
    const kvc::half_t* q = step ? qs[n++ % qs.size()].data() : dq.data();
    timer.start();
    kvc::cuda::decode_attention<kHeadDim>(*f.cache, 0, batch, H, q, dout.data(), f.probs->data(), T);
    if (step) f.cache->update_widths(0, f.probs->data(), T);
    state.SetIterationTime(timer.stop_seconds());
  }
  const double bytes = double(f.cache->stored_bytes());
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes * double(state.iterations())));
  state.counters["read_MB"] = bytes / 1e6;
  state.counters["bits_per_element"] = f.cache->bits_per_element();
  state.counters["key_bits"] = f.cache->average_width(0);
  state.counters["value_bits"] = f.cache->average_width(1);
}

/// AlignedKV (AlignedLoader<>, and every tier forced to 16): filled with the other rows' chunks (appended on the
/// device from host memory), fp32 queries;
/// bytes_per_second = the bytes the kernel actually read (its aligned::ReadStats, taken on the warm-up call).
template <class L>
void aligned_row(benchmark::State& state, int T, int batch, int gqa) {
  using Dev = kvc::cuda::DeviceAlignedCache<L>;
  static std::unique_ptr<Dev> cache;
  static int key_t = -1, key_b = -1;
  if (!cache || key_t != T || key_b != batch) {
    cache.reset();
    cache = std::make_unique<Dev>(kvc::CacheConfig{1, batch, kKvHeads, kHeadDim, T});
    std::vector<float> k, v;
    fill_chunk(k, v);
    for_chunks(T, batch, [&](int s, int n) {  // append reads host memory
      cache->append(0, s, kvc::KVView::contiguous(k.data(), n, kKvHeads, kHeadDim),
                    kvc::KVView::contiguous(v.data(), n, kKvHeads, kHeadDim));
    });
    kvc::cuda::check(cudaDeviceSynchronize(), "fill");
    key_t = T, key_b = batch;
  }
  const int H = kKvHeads * gqa;
  const std::size_t nq = std::size_t(batch) * H * kHeadDim;
  std::vector<float> q(nq);
  std::mt19937_64 rng(2);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  for (auto& x : q) x = n01(rng);
  kvc::cuda::DeviceBuffer<float> dq(nq), dout(nq);
  kvc::cuda::check(cudaMemcpy(dq.data(), q.data(), nq * 4, cudaMemcpyHostToDevice), "query");
  kvc::aligned::ReadStats st;
  kvc::cuda::decode_attention<kHeadDim>(*cache, 0, batch, H, dq.data(), dout.data(), {}, &st);  // warm-up, statistics
  EventTimer timer;
  for (auto _ : state) {
    timer.start();
    kvc::cuda::decode_attention<kHeadDim>(*cache, 0, batch, H, dq.data(), dout.data());
    state.SetIterationTime(timer.stop_seconds());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(double(st.total_bytes()) * double(state.iterations())));
  state.counters["read_MB"] = double(st.total_bytes()) / 1e6;
  state.counters["average_bits"] = st.average_bits();
  state.counters["fp16_MB"] = 2.0 * 2.0 * double(T) * batch * kKvHeads * kHeadDim / 1e6;
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
  // Rotation: the query rotated in the split kernel's prologue, the output un-rotated in the merge (beside the
  // plain rows above: the per-step transform must not show at long context).
  register_scheme<kvc::schemes::Rotated<kvc::schemes::Kivi2>>("kivi2_rot", {4096, 32768}, {1, 16});
  register_scheme<kvc::schemes::Int4>("int4", {4096, 32768}, {1, 16});
  register_scheme<kvc::schemes::Rotated<kvc::schemes::Int4>>("int4_rot", {4096, 32768}, {1, 16});
  // The sweep's <= 4.6-bit scheme: KIVI-4 on 64-token groups, a 4-token sink on the block grid (masked rows), rotated.
  register_scheme<kvc::schemes::KiviGridSink<4>>("kivi4_b64_gsink4", {4096, 32768}, {1, 16});
  register_scheme<kvc::schemes::Rotated<kvc::schemes::KiviGridSink<4>>>("kivi4_b64_gsink4_rot", {4096, 32768}, {1, 16});
  // AlignedLoader over a scheme's fp16 slots (the window / log set as bit planes read at the rules' tiers), beside the
  // plain kivi2 and logquant2 rows: what the tiers' decisions cost and save per step on the device.
  register_scheme<kvc::schemes::AlignedWindow<kvc::schemes::Kivi2>>("kivi2_aligned", {4096, 32768}, {1, 16});
  register_scheme<kvc::schemes::AlignedWindow<kvc::schemes::LogQuant2>>("logquant2_aligned", {4096, 32768}, {1, 16});
  // AlignedKV: fp16 bit planes read at the tiers its rules choose, and every tier 16 (beside fp16's rows).
  for (int Ta : {4096, 32768})
    for (int Ba : {1, 16})
      for (int Ga : {1, 4})
        for (int forced = 0; forced < 2; ++forced) {
          const std::string row = std::string("BM_CudaDecodeAttention/") + (forced ? "aligned_fp16_tier16" : "aligned_fp16") +
                                  "/T:" + std::to_string(Ta) + "/B:" + std::to_string(Ba) + "/G:" + std::to_string(Ga);
          auto fn = forced ? [](benchmark::State& st, int a, int b, int c) { aligned_row<kvc::AlignedLoader<99, 99, 99, 99>>(st, a, b, c); }
                           : [](benchmark::State& st, int a, int b, int c) { aligned_row<kvc::AlignedLoader<>>(st, a, b, c); };
          benchmark::RegisterBenchmark(row.c_str(), [=](benchmark::State& s) { fn(s, Ta, Ba, Ga); })
              ->UseManualTime()
              ->Unit(benchmark::kMicrosecond)
              ->MinTime(0.2);
        }
  // QAQ at ~3 average code bits per side: decode attention alone, and whole steps (attention + width update);
  // "qaq_rot": with K and V Hadamard-rotated (the outliers taken before the rotation, as kvc_bench's qaq_rot).
  using Qaq = kvc::cuda::DeviceQaqCache<kvc::QaqQuantizer<>>;
  using QaqRot = kvc::cuda::DeviceQaqCache<kvc::QaqQuantizer<>, kvc::Rotation<kvc::Hadamard<>>>;
  for (int rot = 0; rot < 2; ++rot)
    for (int Tq : {4096, 32768})
      for (int Bq : {1, 16})
        for (int step = 0; step < 2; ++step) {
          const char* name[2][2] = {{"BM_CudaDecodeAttention/qaq", "BM_CudaQaqDecodeStep"},
                                    {"BM_CudaDecodeAttention/qaq_rot", "BM_CudaQaqDecodeStep/rot"}};
          const std::string row = std::string(name[rot][step]) + "/T:" + std::to_string(Tq) + "/B:" + std::to_string(Bq) +
                                  "/G:4";
          auto fn = rot ? [](benchmark::State& st, int a, int b, bool c) { qaq_row<QaqRot>(st, a, b, 4, c); }
                        : [](benchmark::State& st, int a, int b, bool c) { qaq_row<Qaq>(st, a, b, 4, c); };
          benchmark::RegisterBenchmark(row.c_str(), [=](benchmark::State& s) { fn(s, Tq, Bq, step != 0); })
              ->UseManualTime()
              ->Unit(benchmark::kMicrosecond)
              ->MinTime(0.2);
        }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
