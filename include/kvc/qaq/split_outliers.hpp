// kvc: nvcc-safe
/// \file split_outliers.hpp
/// The outliers a "split" side of a rotated QAQ cache takes before the rotation (QaqQuantizer with outliers and
/// a Rotation on that side; qaq_cache.hpp says why): per row (t, h) the Q::outliers(d) extremes o of x in the
/// original basis, as Q::quantize picks them, kept exact in the record; the row's residual x - o (zero on their
/// channels) is what gets rotated, y = R (x - o), and coded over all d channels (RecordFormat<Q, true>). Shared
/// by the host cache (qaq_cache.hpp) and the device cache's host-side append (cuda/qaq/device_qaq_cache.cuh),
/// so both store the same bytes. Host.
#pragma once

#include <kvc/core/numeric.hpp>
#include <kvc/core/view.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvc::qaq {

template <class Q>
class SplitOutliers {
 public:
  /// One row's outliers: values (fp16, exact in the record) and channels, Q::outliers(d) of each.
  struct Row {
    const half_t* val;
    const std::uint8_t* idx;
  };

  /// The rows side `keys` stores (Rules::rotated_input, Rules a kvc::detail::CacheRules), with every row's
  /// outliers taken before its rotation and kept here (row(t, h)). Throws before anything is stored: a
  /// non-finite input element or an outlier beyond Rules::input_limit() naming its channel, a rotated residual
  /// beyond it naming the rotated channel.
  template <class Rules>
  KVView rows(KVView x, bool keys, const std::uint32_t* layer_tables, std::vector<float>& buf) {
    const int d = x.dim2;
    n_ = Q::outliers(d);
    heads_ = x.dim1;
    val_.resize(std::size_t(x.dim0) * x.dim1 * n_);
    idx_.resize(val_.size());
    const char* what = keys ? "key" : "value";
    return Rules::rotated_input(x, keys, layer_tables, buf, [&](int t, int h, float* y) {
      const std::size_t at = (std::size_t(t) * heads_ + h) * n_;
      std::uint32_t taken[Q::kMaxHeadDim / 32] = {};
      Q::select_outliers(y, d, idx_.data() + at, val_.data() + at, taken);
      for (int j = 0; j < n_; ++j) {
        const int c = idx_[at + std::size_t(j)];
        Rules::check_value(y[c], what, t, h, c);
        y[c] = 0.0f;
      }
    });
  }
  /// Row (t, h) of the last rows() call.
  [[nodiscard]] Row row(int t, int h) const noexcept {
    const std::size_t at = (std::size_t(t) * heads_ + h) * n_;
    return {val_.data() + at, idx_.data() + at};
  }
  /// All of them, [tokens][kv_heads][Q::outliers(d)] (the device append uploads these).
  [[nodiscard]] const std::vector<half_t>& values() const noexcept { return val_; }
  [[nodiscard]] const std::vector<std::uint8_t>& channels() const noexcept { return idx_; }

 private:
  int n_ = 0, heads_ = 0;
  std::vector<half_t> val_;
  std::vector<std::uint8_t> idx_;
};

/// The rows side `keys` of a QAQ cache stores (the host and the device cache's append): Rules::rotated_input, or
/// on a split side (Split) its rotated residuals, the outliers in `out`. Throws before anything is stored.
template <bool Split, class Rules, class Q>
KVView stored_rows(KVView x, bool keys, const std::uint32_t* layer_tables, std::vector<float>& buf,
                   SplitOutliers<Q>& out) {
  if constexpr (Split) return out.template rows<Rules>(x, keys, layer_tables, buf);
  else return Rules::rotated_input(x, keys, layer_tables, buf);
}

/// Record r (width b) of side `keys` of KV head h in the original basis (dequantize of both caches): its codes
/// decoded, un-rotated by Rot, and on a split side (R::kAddOutliers) its outliers added: R^T y^ + o.
template <class R, class Rot>
void reconstruct(const std::byte* r, int d, int b, bool keys, const std::uint32_t* layer_tables, int h, float* row) {
  R::decode(r, d, b, row);
  if constexpr (Rot::kActive) Rot::unrotate(keys, layer_tables, h, d, row);
  if constexpr (R::kAddOutliers) R::add_outliers(r, d, b, row);
}
}  // namespace kvc::qaq
