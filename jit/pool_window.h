// Pooling windows of the CPU backend's native kernels: geometry and which element is a window's
// maximum (the first one in row-major order; a NaN counts as a maximum). The reference interpreter
// computes its windows independently (runtime/interpreter.cc), so the two can check each other.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ir/module.h"

namespace shardstep::runtime {

// NCHW input seen as planes (N*C) of h x w, windows kh x kw with strides sh, sw and `pad` cells of
// padding on every side (max pooling only; padded cells never win).
struct PoolWindow {
  int64_t planes, h, w, kh, kw, sh, sw, oh, ow, pad = 0;
};

inline PoolWindow PoolWindowOf(const ir::Shape& x, const ir::Instr& pool) {
  const ir::IntList& k = pool.GetInts("window");  // in place: steps do not allocate
  const ir::IntList& s = pool.Has("stride") ? pool.GetInts("stride") : k;
  const bool max = pool.op == ir::OpCode::kMaxPool || pool.op == ir::OpCode::kMaxPoolGrad;
  const int64_t p = max ? pool.GetInt("padding", 0) : 0;  // avg pooling has no padding (ir/shape_inference.cc)
  return {x[0] * x[1], x[2], x[3], k[0], k[1], s[0], s[1], (x[2] + 2 * p - k[0]) / s[0] + 1,
          (x[3] + 2 * p - k[1]) / s[1] + 1, p};
}

// Offset (from the plane's origin) of the first maximum among the real cells of window (y, x) of a
// padded pooling: the window clipped to the plane, scanned in row-major order.
inline int64_t PaddedWindowArgMax(const float* plane, const PoolWindow& g, int64_t y, int64_t x) {
  const int64_t r0 = std::max<int64_t>(0, y * g.sh - g.pad), r1 = std::min(g.h, y * g.sh - g.pad + g.kh);
  const int64_t c0 = std::max<int64_t>(0, x * g.sw - g.pad), c1 = std::min(g.w, x * g.sw - g.pad + g.kw);
  int64_t best = r0 * g.w + c0;
  for (int64_t i = r0; i < r1; ++i)
    for (int64_t j = c0; j < c1; ++j) {
      const int64_t at = i * g.w + j;
      const float c = plane[at], b = plane[best];
      if (c > b || (c != c && b == b)) best = at;
    }
  return best;
}

// Offset (from the window origin `v`) of the window's first maximum. Branch-free (a mask, not a
// conditional): pooling inputs look random, so a branch would mispredict.
inline int64_t WindowArgMax(const float* v, const PoolWindow& g) {
  int64_t best = 0;
  for (int64_t i = 0; i < g.kh; ++i)
    for (int64_t j = 0; j < g.kw; ++j) {
      const int64_t at = i * g.w + j;
      const float c = v[at], b = v[best];
      const int64_t take = (c > b) | ((c != c) & (b == b));
      best ^= (best ^ at) & -take;
    }
  return best;
}

}  // namespace shardstep::runtime
