// Per-element comparison of a backend's result with the reference interpreter's (op conformance).
//
// Element i passes when |got_i - exp_i| <= rtol * scale_i + atol, where scale_i is |exp_i| for an
// elementwise op and, for a contraction (a sum of terms), the sum of the absolute values of the terms
// that make up element i (the same op evaluated on |inputs|). Non-finite expectations compare by class
// and sign (NaN with any payload, +inf, -inf); an exact tolerance compares finite values bitwise (so
// -0 and +0 differ); s32 is always exact. The verdict names every failing element by flat and
// multi-dimensional index, so a failure says where and by how much.
#pragma once

#include <cfloat>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>

#include "runtime/tensor.h"

namespace shardstep::conformance {

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// How far a backend may be from the interpreter on one op's result.
//
// The bounds are proven, not fitted (u = 2^-24, the unit roundoff of f32):
//  - kExact: IEEE-exact operations (neg, abs, relu, add/sub/mul/div, sqrt, rsqrt = 1/sqrt,
//    comparisons, select, convert, data movement, max/min, reduce_max, max_pool, s32 anything):
//    every backend must give the same bits.
//  - kUlps(n): results of libm calls (exp, log, tanh, sin, cos, sigmoid, pow). glibc's scalar
//    functions are within 1-2 ulp of the true value, vector variants (libmvec, xsimd) within 4, so
//    two implementations differ by at most n = 4 ulp of each: rtol = n * FLT_EPSILON (2-4 ulp per
//    side, as an ulp is between eps/2 and eps of the value), atol = n subnormal steps.
//  - kSum(K, double_acc): a sum of K rounded terms, in any order (matmul, conv and its gradients,
//    pools' gradients, avg_pool, scatter_add, reduce_sum/mean). Higham, Accuracy and Stability,
//    eq. 3.5: |fl(sum) - sum| <= gamma_K * sum|terms|, gamma_K = K u / (1 - K u). Both backends are
//    within that of the exact sum, so rtol = 2 gamma_K (+ 2u for the final rounding to f32). With
//    double accumulation (reductions: the documented convention) gamma is over 2^-53, so the final
//    rounding dominates: rtol = 2u + 2 K 2^-53. atol = K subnormal steps (gradual underflow adds at
//    most half a subnormal step per operation).
struct Tolerance {
  enum class Kind { kExact, kUlps, kSum };
  Kind kind = Kind::kExact;
  double rtol = 0, atol = 0;
  int64_t terms = 0;  // kSum: terms per element

  static Tolerance Exact() { return {}; }
  static Tolerance Ulps(int n) {
    return {Kind::kUlps, n * static_cast<double>(FLT_EPSILON), n * static_cast<double>(std::numeric_limits<float>::denorm_min()), 0};
  }
  static Tolerance Sum(int64_t terms, bool double_accumulation = false) {
    const double u = std::ldexp(1.0, -24);
    const double k = static_cast<double>(terms);
    const double gamma = double_accumulation ? k * std::ldexp(1.0, -53) / (1 - k * std::ldexp(1.0, -53)) : k * u / (1 - k * u);
    return {Kind::kSum, 2 * gamma + 2 * u, k * static_cast<double>(std::numeric_limits<float>::denorm_min()), terms};
  }
  std::string ToString() const {
    std::ostringstream s;
    if (kind == Kind::kExact) s << "exact (bitwise)";
    else if (kind == Kind::kUlps) s << "rtol " << rtol << " x |expected| + atol " << atol;
    else s << "sum of " << terms << " terms: rtol " << rtol << " x sum|terms| + atol " << atol;
    return s.str();
  }
};

struct Verdict {
  bool ok = true;
  int64_t first_bad = -1;  // flat index of the first failing element
  int64_t bad = 0;         // failing elements
  double worst = 0;        // max |diff| / allowed over the compared finite elements (0 when all equal)
  std::string message;     // the first few failures, each with its index and values
};

// "17 [1,4]": flat index and row-major multi-index in `shape`.
inline std::string IndexName(const ir::Shape& shape, int64_t flat) {
  std::ostringstream s;
  s << flat << " [";
  std::vector<int64_t> idx(shape.size());
  int64_t rem = flat;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    idx[d] = shape[d] ? rem % shape[d] : 0;
    rem = shape[d] ? rem / shape[d] : 0;
  }
  for (size_t d = 0; d < idx.size(); ++d) s << (d ? "," : "") << idx[d];
  s << "]";
  return s.str();
}

// The error element i may have: rtol * scale_i + atol (0 for exact comparisons).
inline double Allowed(const Tolerance& tol, float expected, const runtime::Tensor* scale, int64_t i) {
  if (tol.kind == Tolerance::Kind::kExact) return 0;
  const double s = tol.kind == Tolerance::Kind::kSum && scale ? std::abs(static_cast<double>(scale->f32[i]))
                                                               : std::abs(static_cast<double>(expected));
  return tol.rtol * s + tol.atol;
}

// Compares `got` with `expected` element by element. `scale` (kSum only) holds sum|terms| per element.
inline Verdict Compare(const runtime::Tensor& expected, const runtime::Tensor& got, const Tolerance& tol,
                       const runtime::Tensor* scale = nullptr) {
  Verdict v;
  std::ostringstream msg;
  if (expected.type != got.type) {
    v.ok = false;
    v.message = "type " + got.type.ToString() + ", expected " + expected.type.ToString();
    return v;
  }
  if (tol.kind == Tolerance::Kind::kSum && expected.dtype() == ir::DType::kF32 &&
      (!scale || scale->type != expected.type)) {
    v.ok = false;
    v.message = "a sum tolerance needs a scale tensor of the result's type";
    return v;
  }
  constexpr int kShown = 6;
  auto fail = [&](int64_t i, const std::string& why) {
    if (v.bad == 0) v.first_bad = i;
    if (v.bad < kShown) msg << "  element " << IndexName(expected.shape(), i) << ": " << why << "\n";
    ++v.bad;
  };
  for (int64_t i = 0; i < expected.elements(); ++i) {
    if (expected.dtype() == ir::DType::kS32) {
      if (expected.s32[i] != got.s32[i])
        fail(i, "got " + std::to_string(got.s32[i]) + ", expected " + std::to_string(expected.s32[i]) + " (exact)");
      continue;
    }
    const float e = expected.f32[i], g = got.f32[i];
    auto values = [&] {  // built only for a failure
      std::ostringstream d;
      d.precision(9);
      d << "got " << g << " (0x" << std::hex << Bits(g) << std::dec << "), expected " << e << " (0x" << std::hex
        << Bits(e) << std::dec << ")";
      return d.str();
    };
    if (std::isnan(e) || std::isinf(e)) {  // by class and sign
      const bool same = std::isnan(e) ? std::isnan(g) : g == e;
      if (!same) fail(i, values() + ": a special value must match by class and sign");
      continue;
    }
    if (!std::isfinite(g)) {
      fail(i, values());
      continue;
    }
    if (tol.kind == Tolerance::Kind::kExact) {
      if (Bits(e) != Bits(g)) fail(i, values() + " (exact: bitwise)");
      continue;
    }
    if (tol.kind == Tolerance::Kind::kSum && !std::isfinite(scale->f32[i])) {
      fail(i, values() + ": the |terms| scale is not finite (specials belong in the specials test)");
      continue;
    }
    const double diff = std::abs(static_cast<double>(g) - e), allowed = Allowed(tol, e, scale, i);
    if (diff > 0) v.worst = std::max(v.worst, allowed > 0 ? diff / allowed : INFINITY);
    if (!(diff <= allowed)) {
      std::ostringstream w;
      w << values() << ", |diff| " << diff << " > allowed " << allowed << " (" << tol.ToString();
      if (tol.kind == Tolerance::Kind::kSum) w << ", sum|terms| " << scale->f32[i];
      w << ")";
      fail(i, w.str());
    }
  }
  if (v.bad) {
    v.ok = false;
    std::ostringstream head;
    head << v.bad << " of " << expected.elements() << " elements of " << expected.type.ToString()
         << " differ beyond tolerance; first at element " << IndexName(expected.shape(), v.first_bad) << "\n";
    v.message = head.str() + msg.str();
  }
  return v;
}

}  // namespace shardstep::conformance
