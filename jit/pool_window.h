// Pooling windows of the CPU backend's native kernels: geometry and which element is a window's
// maximum (the first one in row-major order; a NaN counts as a maximum). The reference interpreter
// computes its windows independently (runtime/interpreter.cc), so the two can check each other.
#pragma once

#include <cstdint>

#include "ir/module.h"

namespace shardstep::runtime {

// NCHW input seen as planes (N*C) of h x w, windows kh x kw with strides sh, sw, no padding.
struct PoolWindow {
  int64_t planes, h, w, kh, kw, sh, sw, oh, ow;
};

inline PoolWindow PoolWindowOf(const ir::Shape& x, const ir::Instr& pool) {
  const ir::IntList& k = pool.GetInts("window");  // in place: steps do not allocate
  const ir::IntList& s = pool.Has("stride") ? pool.GetInts("stride") : k;
  return {x[0] * x[1], x[2], x[3], k[0], k[1], s[0], s[1], (x[2] - k[0]) / s[0] + 1, (x[3] - k[1]) / s[1] + 1};
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
