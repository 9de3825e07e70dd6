// kvc: nvcc-safe
/// \file append_plan.hpp
/// What an append of `tokens` tokens to a sequence holding n does to one stream, as data: the selector's
/// rule (Sel::append_token) run symbolically over slot labels. The device cache (kvc::cuda::DeviceKVCache)
/// executes a plan with kernels (compress the new blocks from their row sources, gather then scatter the
/// slot writes, re-derive changed quantized value rows); tests replay it on the host against the host
/// cache, which applies the same rule directly (CompressedKVCache::AppendOps). Host code.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/concepts.hpp>

#include <climits>
#include <cstddef>
#include <vector>

namespace kvc::detail {

/// Where a row of an append comes from: src >= 0 is full-precision slot src as it was before the
/// append, src < 0 is input token -1 - src. Host+device.
KVC_HOST_DEVICE constexpr int input_source(int token) noexcept { return -1 - token; }

/// The plan of one append for a cache of layout L (CacheLayout).
template <class L>
struct AppendPlan {
  using Sel = typename L::selector;
  static constexpr int B = L::kBlockTokens;
  static constexpr int kNoRow = INT_MIN;  ///< qlabel: the slot holds no quantized value row

  int first_block = 0;          ///< index of the first block the append completes
  int blocks = 0;               ///< blocks it completes
  std::vector<int> block_rows;  ///< [blocks][B] row sources, in block order
  std::vector<int> dst, src;    ///< live slots whose content changes, and their sources
  /// PartialLogWindow: live slots whose quantized value row must be (re)derived from the slot's fp16
  /// value row once the writes are done (a value that left its window, or a quantized one that moved).
  std::vector<int> requantize;

  static AppendPlan make(int n, int tokens) {
    AppendPlan plan;
    Labels ops;
    ops.label.resize(std::size_t(L::kFpSlots));
    ops.qlabel.assign(std::size_t(L::kFpSlots), kNoRow);
    ops.rows = &plan.block_rows;
    for (int i = 0; i < L::kFpSlots; ++i) ops.label[std::size_t(i)] = i;
    if constexpr (L::kQuantizedFpValues)
      for (int i = 0; i < detail::fp_tokens<Sel>(n, B); ++i)
        if (Sel::value_quantized(n, i, B)) ops.qlabel[std::size_t(Sel::fp_slot(n, i, B))] = Sel::fp_slot(n, i, B);
    const std::vector<int> qlabel0 = ops.qlabel;
    for (int t = 0; t < tokens; ++t) {
      ops.token = t;
      Sel::append_token(n + t, B, ops);
    }
    const int n_after = n + tokens, nb1 = Sel::quantized_blocks(n_after, B);
    plan.first_block = Sel::quantized_blocks(n, B);
    plan.blocks = nb1 - plan.first_block;
    for (int i = 0; i < detail::fp_tokens<Sel>(n_after, B); ++i) {
      const int slot = Sel::fp_slot(n_after, i, B);
      if (ops.label[std::size_t(slot)] != slot) {
        plan.dst.push_back(slot);
        plan.src.push_back(ops.label[std::size_t(slot)]);
      }
      if constexpr (L::kQuantizedFpValues)
        if (Sel::value_quantized(n_after, i, B) && ops.qlabel[std::size_t(slot)] != qlabel0[std::size_t(slot)])
          plan.requantize.push_back(slot);
    }
    return plan;
  }

 private:
  /// The slot operations over labels: label[slot] = what the slot holds (input_source), qlabel[slot] =
  /// the content whose quantized value row it holds.
  struct Labels {
    std::vector<int> label, qlabel;
    std::vector<int>* rows = nullptr;
    int token = 0;
    void write(int slot) {
      label[std::size_t(slot)] = input_source(token);
      qlabel[std::size_t(slot)] = kNoRow;
    }
    void move(int from, int to) {
      label[std::size_t(to)] = label[std::size_t(from)];
      qlabel[std::size_t(to)] = qlabel[std::size_t(from)];
    }
    void quantize_value(int slot) { qlabel[std::size_t(slot)] = label[std::size_t(slot)]; }
    template <class SlotOf>
    void compress(int, SlotOf slot_of) {
      for (int r = 0; r < B; ++r) rows->push_back(label[std::size_t(slot_of(r))]);
    }
  };
};
}  // namespace kvc::detail
