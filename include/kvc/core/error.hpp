/// \file error.hpp
/// The one exception type kvc throws, and the checking macro that builds its message.
/// Host-only (uses std::string); nothing a kernel touches throws.
#pragma once

#include <kvc/config.hpp>

#include <ios>
#include <sstream>
#include <stdexcept>
#include <string>

namespace kvc {

/// What went wrong, so callers can branch without parsing the message.
enum class Errc {
  kInvalidArgument,   ///< wrong shape, index out of range, unsupported parameter
  kNonFinite,         ///< NaN or Inf in an input
  kOutOfRange,        ///< a finite value the storage format cannot represent (e.g. |x| > 65504 for fp16)
  kCapacityExceeded,  ///< appending past the cache's token capacity
  kIo,                ///< a file cannot be opened, read or written
  kCorruptFile,       ///< a file is truncated, has a bad magic/version or inconsistent sizes
  kCuda,              ///< a CUDA runtime / cuBLAS / cuSOLVER call failed (the message carries its error text)
};

/// Thrown for every bad input. Operations that throw leave the object they were called on unchanged
/// (strong guarantee): kvc validates a whole input before it writes anything.
class Error : public std::invalid_argument {
 public:
  Error(Errc code, const std::string& what) : std::invalid_argument("kvc: " + what), code_(code) {}
  [[nodiscard]] Errc code() const noexcept { return code_; }

 private:
  Errc code_;
};

namespace detail {
template <class... Args>
[[noreturn]] inline void fail(Errc code, const Args&... args) {
  std::ostringstream os;
  os.precision(9);  // floats print exactly enough to tell 65504.0039 from 65504
  (os << ... << args);
  throw Error(code, os.str());
}
}  // namespace detail
}  // namespace kvc

/// `KVC_CHECK(cond, code, msg...)`: throws kvc::Error(code, "msg...") when `cond` is false.
/// The message parts are streamed, so `KVC_CHECK(n <= cap, Errc::kCapacityExceeded, "n=", n)` works.
#define KVC_CHECK(cond, code, ...)                       \
  do {                                                   \
    if (!(cond)) ::kvc::detail::fail(code, __VA_ARGS__); \
  } while (0)
