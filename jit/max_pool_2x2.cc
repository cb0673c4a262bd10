// 2x2 stride-2 max pooling and its gradient as AVX-512 loops (see max_pool_2x2.h).
#include "jit/max_pool_2x2.h"

#include <immintrin.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>

namespace shardstep::jit {
namespace {

#define SS_AVX512 __attribute__((target("avx512f")))

constexpr int64_t kLanes = 16;

SS_AVX512 inline __mmask16 FirstLanes(int64_t n) {
  return static_cast<__mmask16>(n >= kLanes ? 0xFFFFu : n <= 0 ? 0u : (1u << n) - 1u);
}

// Output rows [begin, end) (row pr is plane pr / oh, row pr % oh), each row f(row 0 of its windows,
// row 1, the output row's offset).
template <typename F>
SS_AVX512 inline void ForRows(const PoolShape& g, int64_t begin, int64_t end, F f) {
  for (int64_t pr = begin; pr < end; ++pr) {
    const int64_t p = pr / g.oh, y = pr % g.oh;
    const int64_t r0 = p * g.h * g.w + 2 * y * g.w;
    f(r0, r0 + g.w, pr * g.ow);
  }
}
// Output rows in blocks of 256 as TBB tasks: body(begin, end), an AVX-512 function (a lambda would not
// inherit the target).
template <typename Body>
void InRowBlocks(const PoolShape& g, Body body) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, g.planes * g.oh, 256),
                    [&](const tbb::blocked_range<int64_t>& r) { body(r.begin(), r.end()); });
}

// The four candidates of outputs j0 .. j0 + 15 of one output row: top-left, top-right, bottom-left,
// bottom-right (row-major: the order the first-maximum rule visits them). Inputs past the row's
// windows load as zero (masked off: nothing is read there) and the lanes they feed are never stored.
struct Candidates {
  __m512 c[4];
};
SS_AVX512 inline Candidates Load(const float* row0, const float* row1, int64_t j0, int64_t outputs) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  const int64_t in = 2 * outputs;  // input columns 2 j0 .. 2 j0 + in - 1
  const __mmask16 lo = FirstLanes(in), hi = FirstLanes(in - kLanes);
  Candidates k;
  const float* rows[2] = {row0, row1};
  for (int r = 0; r < 2; ++r) {
    const __m512 a = _mm512_maskz_loadu_ps(lo, rows[r] + 2 * j0);
    const __m512 b = _mm512_maskz_loadu_ps(hi, rows[r] + 2 * j0 + kLanes);
    k.c[2 * r] = _mm512_permutex2var_ps(a, even, b);
    k.c[2 * r + 1] = _mm512_permutex2var_ps(a, odd, b);
  }
  return k;
}

// Lanes where candidate c replaces the current maximum b: c > b, or c is a NaN and b is not.
SS_AVX512 inline __mmask16 Takes(__m512 c, __m512 b) {
  return _mm512_cmp_ps_mask(c, b, _CMP_GT_OQ) |
         (_mm512_cmp_ps_mask(c, c, _CMP_UNORD_Q) & _mm512_cmp_ps_mask(b, b, _CMP_ORD_Q));
}

SS_AVX512 void ForwardRows(const PoolShape& g, const float* x, float* y, int64_t begin, int64_t end) {
  ForRows(g, begin, end, [&](int64_t r0, int64_t r1, int64_t o) SS_AVX512 {
    for (int64_t j0 = 0; j0 < g.ow; j0 += kLanes) {
      const int64_t outputs = std::min(kLanes, g.ow - j0);
      const Candidates k = Load(x + r0, x + r1, j0, outputs);
      __m512 b = k.c[0];
      for (int i = 1; i < 4; ++i) b = _mm512_mask_blend_ps(Takes(k.c[i], b), b, k.c[i]);
      _mm512_mask_storeu_ps(y + o + j0, FirstLanes(outputs), b);
    }
  });
}

SS_AVX512 void GradRows(const PoolShape& g, const float* x, const float* dy, float* dx, bool relu_mask, int64_t begin,
                        int64_t end) {
  // Even and odd columns back into row order: lanes 0..15 and 16..31 of the interleaved pair.
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  const __m512 zero = _mm512_setzero_ps();
  ForRows(g, begin, end, [&](int64_t r0, int64_t r1, int64_t o) SS_AVX512 {
    for (int64_t j0 = 0; j0 < g.ow; j0 += kLanes) {
      const int64_t outputs = std::min(kLanes, g.ow - j0);
      const Candidates k = Load(x + r0, x + r1, j0, outputs);
      // take[i]: candidate i is the first maximum so far; a later one clears the earlier ones.
      __m512 b = k.c[0];
      __mmask16 take[4] = {0, 0, 0, 0};
      for (int i = 1; i < 4; ++i) {
        take[i] = Takes(k.c[i], b);
        b = _mm512_mask_blend_ps(take[i], b, k.c[i]);
      }
      __mmask16 wins[4];
      wins[3] = take[3];
      wins[2] = take[2] & ~take[3];
      wins[1] = take[1] & ~take[2] & ~take[3];
      wins[0] = ~(take[1] | take[2] | take[3]);
      if (relu_mask)  // x > 0 is false for a NaN, as the IR's comparison
        for (int i = 0; i < 4; ++i) wins[i] &= _mm512_cmp_ps_mask(k.c[i], zero, _CMP_GT_OQ);
      // 0 + dy, as the interpreter accumulates; +0 where a candidate does not win.
      const __m512 d = _mm512_add_ps(zero, _mm512_maskz_loadu_ps(FirstLanes(outputs), dy + o + j0));
      const int64_t in = 2 * outputs;
      float* rows[2] = {dx + r0, dx + r1};
      for (int r = 0; r < 2; ++r) {
        const __m512 left = _mm512_maskz_mov_ps(wins[2 * r], d), right = _mm512_maskz_mov_ps(wins[2 * r + 1], d);
        _mm512_mask_storeu_ps(rows[r] + 2 * j0, FirstLanes(in), _mm512_permutex2var_ps(left, lo, right));
        _mm512_mask_storeu_ps(rows[r] + 2 * j0 + kLanes, FirstLanes(in - kLanes), _mm512_permutex2var_ps(left, hi, right));
      }
    }
  });
}

#undef SS_AVX512

}  // namespace

bool MaxPool2x2Vectorised() {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  return avx512;
}

void MaxPool2x2(const PoolShape& g, const float* x, float* y) {
  InRowBlocks(g, [&](int64_t begin, int64_t end) { ForwardRows(g, x, y, begin, end); });
}

void MaxPool2x2Grad(const PoolShape& g, const float* x, const float* dy, float* dx, bool relu_mask) {
  InRowBlocks(g, [&](int64_t begin, int64_t end) { GradRows(g, x, dy, dx, relu_mask, begin, end); });
}

}  // namespace shardstep::jit
