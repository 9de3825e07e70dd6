// kvc: nvcc-safe
/// \file log_window.hpp
/// LogQuant's log-distributed full-precision token set (SPEC §4.2, Algorithm 1, authoritative), as a
/// selector of CompressedKVCache (the interface: select/full_precision_window.hpp).
///
/// State per sequence: FP, the positions kept in full precision, oldest first. APPEND(t):
///   |FP| < 3W:  FP.push_back(t)
///   |FP| = 3W:  evict FP[1], FP[3], ..., FP[2W-1] (W tokens, in that order, to the quantized store);
///               FP = FP[0], FP[2], ..., FP[2W-2] ++ FP[2W .. 3W-1] ++ [t]     (|FP| = 2W + 1)
/// Prefill = APPEND per token (SPEC L1 default). Evictions happen when token 3W + kW arrives (k >= 0),
/// W tokens each; position 0 is never evicted. The rule depends on the token count only, so every layer
/// and head of a sequence shares it, and so does the storage below (no per-sequence state is stored).
///
/// Storage (SPEC L2 default): slots [0, 3W) hold FP in list order (slot i = FP[i]; an eviction compacts
/// the slots exactly like the list: 2W - 1 row moves per W tokens); evicted rows go, in eviction order, to
/// a staging area of B slots [3W, 3W + B) until a block of B tokens (the key group, G = 64 in the paper)
/// has accumulated, which is then quantized once. Blocks therefore hold tokens that are not contiguous in
/// position; attention does not care (SPEC §4.1). Full-precision tokens: the set, then the staging rows.
///
/// PartialLogWindow<W> (below): PartialLogQuant's variant, keys as above, values a plain window of W.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/concepts.hpp>
#include <kvc/core/numeric.hpp>

namespace kvc {

template <int W, StorageType Storage = half_t>
struct LogWindow {
  static_assert(W >= 1, "kvc::LogWindow<W>: the window W must be at least 1 (the set holds at most 3W tokens)");
  using policy_kind = kind::selector;
  using storage = Storage;
  static constexpr int kWindow = W;
  static constexpr int kCapacity = 3 * W;  ///< most tokens in the log set at once

  /// One sequence's set: pos[0, size) oldest first (simulation; the cache derives everything from n).
  struct State {
    int size = 0;
    int pos[3 * W] = {};
  };

  /// Tokens evicted (quantized or staged) once a sequence holds n tokens: W per event, events at 3W + kW.
  KVC_HOST_DEVICE static constexpr int evicted_count(int n) noexcept {
    return n > kCapacity ? W * ((n - kCapacity - 1) / W + 1) : 0;
  }
  /// Tokens in the log set once a sequence holds n tokens.
  KVC_HOST_DEVICE static constexpr int kept_count(int n) noexcept { return n - evicted_count(n); }

  KVC_HOST_DEVICE static constexpr int quantized_blocks(int n, int block_tokens) noexcept {
    return evicted_count(n) / block_tokens;
  }
  KVC_HOST_DEVICE static constexpr int capacity_blocks(int capacity, int block_tokens) noexcept {
    return quantized_blocks(capacity, block_tokens);
  }
  KVC_HOST_DEVICE static constexpr int fp_slots(int block_tokens) noexcept { return kCapacity + block_tokens; }
  /// Slot of the i-th full-precision token: the set in list order, then the staging rows.
  KVC_HOST_DEVICE static constexpr int fp_slot(int n, int i, int block_tokens) noexcept {
    const int kept = kept_count(n);
    (void)block_tokens;
    return i < kept ? i : kCapacity + (i - kept);
  }

  /// APPEND(t) on a simulated State (t = the sequence's token count before it). Writes the evicted
  /// positions, in eviction order, to evicted[0, W) and returns how many (0 or W).
  KVC_HOST_DEVICE static int append(State& s, int t, int* evicted) noexcept {
    if (s.size < kCapacity) {
      s.pos[s.size++] = t;
      return 0;
    }
    for (int i = 0; i < W; ++i) evicted[i] = s.pos[2 * i + 1];
    compact(s.pos);
    s.pos[2 * W] = t;
    s.size = 2 * W + 1;
    return W;
  }

  /// Appending token n as slot operations: with a full set, ops.move(from, to) each evicted row to
  /// staging (ops.compress(block, slot_of_row) whenever B rows are staged), then the compaction's moves;
  /// then ops.write(slot) stores the new token. Each token is quantized exactly once.
  KVC_HD_CALLABLE_TEMPLATE
  template <class Ops>
  KVC_HOST_DEVICE static void append_token(int n, int block_tokens, Ops& ops) {
    const int kept = kept_count(n);
    if (kept < kCapacity) {
      ops.write(kept);
      return;
    }
    int staged = evicted_count(n) % block_tokens, blocks = quantized_blocks(n, block_tokens);
    for (int i = 0; i < W; ++i) {
      ops.move(2 * i + 1, kCapacity + staged);
      if (++staged == block_tokens) {
        ops.compress(blocks++, [](int r) { return kCapacity + r; });
        staged = 0;
      }
    }
    compact_slots(ops);
    ops.write(2 * W);
  }

  /// Position of every stored row with n tokens (the selector interface's order: blocks' rows, then the
  /// full-precision tokens), by simulating APPEND; n entries. O(n) time, 3W ints of stack.
  KVC_HOST_DEVICE static void positions(int n, int block_tokens, int* pos) noexcept {
    State s;
    const int ev = evicted_count(n), q = quantized_blocks(n, block_tokens) * block_tokens;
    int e = 0;
    for (int t = 0; t < n; ++t) e += append(s, t, pos + e);  // evicted positions, in eviction order
    // pos = [evicted[0, q)] [set] [evicted[q, ev)]: move the staged tail behind the set.
    for (int i = ev - 1; i >= q; --i) pos[s.size + i] = pos[i];
    for (int i = 0; i < s.size; ++i) pos[q + i] = s.pos[i];
  }

 private:
  /// The compaction FP = FP[0], FP[2], ..., FP[2W-2] ++ FP[2W .. 3W-1] as ordered ops.move(from, to).
  KVC_HD_CALLABLE_TEMPLATE
  template <class Ops>
  KVC_HOST_DEVICE static void compact_slots(Ops& ops) {
    for (int i = 1; i < W; ++i) ops.move(2 * i, i);
    for (int i = 0; i < W; ++i) ops.move(2 * W + i, W + i);
  }
  struct PositionMoves {
    int* pos;
    KVC_HOST_DEVICE void move(int from, int to) const noexcept { pos[to] = pos[from]; }
  };
  KVC_HOST_DEVICE static void compact(int* pos) noexcept {
    PositionMoves m{pos};
    compact_slots(m);
  }
};
}  // namespace kvc

namespace kvc {
/// PartialLogQuant's selector (SPEC §4.3): keys keep LogWindow<W>'s log-distributed set, values only
/// the newest `ValueWindow` tokens (a plain sliding window, W in the paper, evaluated with W = R/2).
/// The newest W tokens are always the last W entries of the set, so a value leaves its window while its
/// key is still in the set: at that moment it is quantized per token (the value quantizer's groups) into
/// the slot's quantized value row (CacheLayout::value_row_format), which the kernels read from then on.
/// When the token's block is completed its per-token groups equal that row's codes and metadata bit for
/// bit (the same quantize_group_masked call on the same fp16 row), so every value is quantized once.
/// Extra slot operation: ops.quantize_value(slot). Requires per-token value groups without corrections
/// (CompressedKVCache static_asserts it).
template <int W, int ValueWindow = W, StorageType Storage = half_t>
struct PartialLogWindow : LogWindow<W, Storage> {
  static_assert(ValueWindow >= 0 && ValueWindow <= W,
                "kvc::PartialLogWindow<W, ValueWindow>: the value window must lie in [0, W] (the newest W tokens are "
                "always in the key set)");
  using base = LogWindow<W, Storage>;
  static constexpr int kValueWindow = ValueWindow;
  static constexpr bool kQuantizedValues = true;  ///< some full-precision tokens keep only a quantized value

  /// Full-precision tokens whose value is exact once a sequence holds n tokens (the newest ValueWindow).
  KVC_HOST_DEVICE static constexpr int exact_values(int n, int block_tokens) noexcept {
    (void)block_tokens;
    return n < ValueWindow ? n : ValueWindow;
  }
  /// Whether the i-th full-precision token's value is a quantized row (older set entries, staging rows).
  KVC_HOST_DEVICE static constexpr bool value_quantized(int n, int i, int block_tokens) noexcept {
    const int kept = base::kept_count(n);
    return i < kept - exact_values(n, block_tokens) || i >= kept;
  }

  /// LogWindow's append, then ops.quantize_value(slot) for the token that leaves the value window
  /// (position n - ValueWindow, the (ValueWindow + 1)-th newest entry of the set).
  KVC_HD_CALLABLE_TEMPLATE
  template <class Ops>
  KVC_HOST_DEVICE static void append_token(int n, int block_tokens, Ops& ops) {
    base::append_token(n, block_tokens, ops);
    if (n + 1 > ValueWindow) ops.quantize_value(base::kept_count(n + 1) - 1 - ValueWindow);
  }
};
}  // namespace kvc
