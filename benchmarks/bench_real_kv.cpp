// Decode attention on REAL keys, values and queries (a KV dump of the llama engine, kvc/io/kv_dump.hpp).
//   BM_DecodeAttentionRealKV/<scheme>   one decode step over every token of one dumped layer, batch 1,
//                                       the dump's query/KV head counts and head_dim, the real query of
//                                       the last position; caches flushed before every iteration
// Counters as in bench_decode_attention.cpp: bytes_per_second = cache bytes one decode step reads
// (decode_read_bytes), bits_per_element = stored bits per K/V element; the label names the layer.
//
// Registered only when the dump file exists: $KVC_KV_DUMP, else ~/.cache/kvc/smollm2_kv_dump.bin
// (kvc::io::default_kv_dump_path()); otherwise this file registers nothing and prints nothing. The
// dump is read when the first of these benchmarks runs (a corrupt dump makes them report the error).
// The layer: the middle dumped one, or model layer $KVC_KV_DUMP_LAYER if set.
#include "bench_util.hpp"

#include <kvc/io/kv_dump.hpp>
#include <kvc/kvc.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

/// The dump (loaded once, on first use) and the dumped layer the benchmarks run on.
struct RealKV {
  std::string path, error;
  kvc::io::KVDump dump;
  std::size_t index = 0;
};

const RealKV& real_kv() {
  static const RealKV r = [] {
    RealKV x;
    x.path = kvc::io::default_kv_dump_path();
    try {
      x.dump = kvc::io::read_kv_dump(x.path);
      x.index = x.dump.layers.size() / 2;
      if (const char* l = std::getenv("KVC_KV_DUMP_LAYER"); l != nullptr && *l != '\0')
        x.index = x.dump.index_of(std::atoi(l));
    } catch (const kvc::Error& e) {
      x.error = e.what();
    }
    return x;
  }();
  return r;
}

template <class Cache>
void BM_DecodeAttentionRealKV(benchmark::State& state) {
  const RealKV& r = real_kv();
  if (!r.error.empty()) {
    state.SkipWithError(r.error.c_str());
    return;
  }
  const kvc::io::KVDump& dump = r.dump;
  const int T = dump.tokens, H = dump.kv_heads, Hq = dump.q_heads, d = dump.head_dim;
  std::unique_ptr<Cache> cache;
  try {
    cache = std::make_unique<Cache>(kvc::CacheConfig{1, 1, H, d, T});
    cache->append(0, 0, dump.keys(r.index), dump.values(r.index));  // prefill: every token of the layer
  } catch (const kvc::Error& e) {
    state.SkipWithError(e.what());
    return;
  }
  std::vector<float> q(std::size_t(Hq) * d);
  if (dump.has_queries()) {
    const kvc::QueryView qv = dump.queries(r.index, T - 1);
    std::copy(qv.data, qv.data + q.size(), q.begin());
  } else {  // keys and values only: a Gaussian query
    std::mt19937 rng(3);
    std::normal_distribution<float> nd;
    for (auto& x : q) x = nd(rng);
  }
  kvc_bench::time_decode_steps(state, *cache, q, Hq, d);
  state.SetLabel(dump.model + " layer " + std::to_string(dump.layers[r.index].layer) + ", T=" + std::to_string(T) +
                 ", " + std::to_string(Hq) + "/" + std::to_string(H) + " heads, d=" + std::to_string(d) +
                 (dump.has_queries() ? "" : ", random query"));
}

template <class Cache>
void register_real_kv(const char* name) {
  benchmark::RegisterBenchmark((std::string("BM_DecodeAttentionRealKV/") + name).c_str(),
                               BM_DecodeAttentionRealKV<Cache>)
      ->UseRealTime()
      // A step over one small real layer takes ~50 us while each iteration's untimed 1 GiB flush takes
      // ~40 ms: a time-based run would take minutes per scheme, so fix the count.
      ->Iterations(200)
      ->Unit(benchmark::kMicrosecond);
}

// Static-init registration (kvc_bench's main() is BENCHMARK_MAIN in bench_decode_attention.cpp):
// only a cheap existence check here, nothing is read before a benchmark runs.
const int registered_real_kv = [] {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(kvc::io::default_kv_dump_path(), ec)) return 0;
  register_real_kv<kvc::schemes::Fp32>("fp32");
  register_real_kv<kvc::schemes::Fp16>("fp16");
  register_real_kv<kvc::schemes::Int8>("int8");
  register_real_kv<kvc::schemes::Kivi4>("kivi4");
  register_real_kv<kvc::schemes::Kivi2>("kivi2");
  return 1;
}();
}  // namespace
