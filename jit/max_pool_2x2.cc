// 2x2 stride-2 max pooling and its gradient as AVX-512 loops (see max_pool_2x2.h).
#include "jit/max_pool_2x2.h"

#include <immintrin.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>

#include "jit/simd.h"

namespace shardstep::jit {
namespace {

// Channels-last: output pixels [begin, end) (image, row, column in row-major order), each window's four
// candidates c channels apart in a row and w * c apart between its rows, a vector of channels at a time.
struct Pixels {
  int64_t oh, ow, w, c;
  explicit Pixels(const NhwcPool& g) : oh(g.h / 2), ow(g.w / 2), w(g.w), c(g.c) {}
  int64_t Window(int64_t q) const {  // offset of pixel q's window's top-left candidate
    const int64_t img = q / (oh * ow), r = q % (oh * ow), oy = r / ow, ox = r % ow;
    return ((img * 2 * oh + 2 * oy) * w + 2 * ox) * c;
  }
};

// The first-maximum rule and the channels-last loops (jit/max_pool_2x2_loops.inc), built for AVX-512
// (the NCHW loops below use its rule too) and for AVX2 + FMA (jit/simd.h): selects only, the same bits.
#define SS_SIMD_BODY "jit/max_pool_2x2_loops.inc"
#include "jit/simd_each_target.inc"
using avx512::Takes;
using avx512::Winners;

#define SS_AVX512 __attribute__((target("avx512f")))

constexpr int64_t kLanes = 16;

SS_AVX512 inline __mmask16 FirstLanes(int64_t n) {
  return static_cast<__mmask16>(n >= kLanes ? 0xFFFFu : n <= 0 ? 0u : (1u << n) - 1u);
}

// The geometry the row loops need, by value. The loops are written out whole, the geometry in locals
// and the candidates loaded inline (below): their former shape (a per-row lambda reading a PoolShape
// reference, a helper returning the four candidate vectors as a struct) ran at half the speed with
// the same instructions' bits, and GCC's code for these loops moved by 2-3x on small changes of shape.
// The CNN's first pooling (4096 planes of 28 x 28), in its step: gradient 2.2 -> 1.2-1.4 ms, forward
// 0.53-0.66 -> 0.33-0.38 ms.
struct Rows {
  int64_t h, w, oh, ow;
  explicit Rows(const PoolShape& g) : h(g.h), w(g.w), oh(g.oh), ow(g.ow) {}
};

// Output rows in blocks of 256 as TBB tasks: body(begin, end), an AVX-512 function (a lambda would not
// inherit the target).
template <typename Body>
void InRowBlocks(const PoolShape& g, Body body) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, g.planes * g.oh, 256),
                    [&](const tbb::blocked_range<int64_t>& r) { body(r.begin(), r.end()); });
}

// The four candidates of outputs j0 .. j0 + 15 of one output row are loaded in each loop (rows r0, r1 of
// its windows): top-left, top-right, bottom-left, bottom-right (row-major: the order the
// first-maximum rule visits them). Inputs past the row's windows load as zero (masked off: nothing is
// read there) and the lanes they feed are never stored. Written out in each loop, not in a function
// returning the four vectors (see Rows).
// Output rows [begin, end): row pr is plane pr / oh, row pr % oh; its windows' rows start at r0, r1.
SS_AVX512 void ForwardRows(const Rows g, const float* __restrict x, float* __restrict y, int64_t begin,
                           int64_t end) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int64_t pr = begin; pr < end; ++pr) {
    const int64_t p = pr / g.oh, row = pr % g.oh, r0 = p * g.h * g.w + 2 * row * g.w, r1 = r0 + g.w, o = pr * g.ow;
    for (int64_t j0 = 0; j0 < g.ow; j0 += kLanes) {
      const int64_t outputs = std::min(kLanes, g.ow - j0);
      const int64_t in = 2 * outputs;
      __m512 c[4];
      const float* rows[2] = {x + r0, x + r1};
      for (int r = 0; r < 2; ++r) {
        const __m512 a = _mm512_maskz_loadu_ps(FirstLanes(in), rows[r] + 2 * j0);
        const __m512 b = _mm512_maskz_loadu_ps(FirstLanes(in - kLanes), rows[r] + 2 * j0 + kLanes);
        c[2 * r] = _mm512_permutex2var_ps(a, even, b);
        c[2 * r + 1] = _mm512_permutex2var_ps(a, odd, b);
      }
      __m512 b = c[0];
      for (int i = 1; i < 4; ++i) b = _mm512_mask_blend_ps(Takes(c[i], b), b, c[i]);
      _mm512_mask_storeu_ps(y + o + j0, FirstLanes(outputs), b);
    }
  }
}

template <bool kReluMask>
SS_AVX512 void GradRows(const Rows g, const float* __restrict x, const float* __restrict dy, float* __restrict dx,
                        int64_t begin, int64_t end) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  // Even and odd columns back into row order: lanes 0..15 and 16..31 of the interleaved pair.
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t pr = begin; pr < end; ++pr) {
    const int64_t p = pr / g.oh, y = pr % g.oh, r0 = p * g.h * g.w + 2 * y * g.w, r1 = r0 + g.w, o = pr * g.ow;
    for (int64_t j0 = 0; j0 < g.ow; j0 += kLanes) {
      const int64_t outputs = std::min(kLanes, g.ow - j0), in = 2 * outputs;
      __m512 c[4];
      const float* rows[2] = {x + r0, x + r1};
      for (int r = 0; r < 2; ++r) {
        const __m512 a = _mm512_maskz_loadu_ps(FirstLanes(in), rows[r] + 2 * j0);
        const __m512 b = _mm512_maskz_loadu_ps(FirstLanes(in - kLanes), rows[r] + 2 * j0 + kLanes);
        c[2 * r] = _mm512_permutex2var_ps(a, even, b);
        c[2 * r + 1] = _mm512_permutex2var_ps(a, odd, b);
      }
      __mmask16 wins[4];
      Winners<kReluMask>(c, wins);
      // 0 + dy, as the interpreter accumulates; +0 where a candidate does not win.
      const __m512 d = _mm512_add_ps(zero, _mm512_maskz_loadu_ps(FirstLanes(outputs), dy + o + j0));
      float* out[2] = {dx + r0, dx + r1};
      for (int r = 0; r < 2; ++r) {
        const __m512 left = _mm512_maskz_mov_ps(wins[2 * r], d), right = _mm512_maskz_mov_ps(wins[2 * r + 1], d);
        _mm512_mask_storeu_ps(out[r] + 2 * j0, FirstLanes(in), _mm512_permutex2var_ps(left, lo, right));
        _mm512_mask_storeu_ps(out[r] + 2 * j0 + kLanes, FirstLanes(in - kLanes), _mm512_permutex2var_ps(left, hi, right));
      }
    }
  }
}

// Output pixels in blocks of about 4096 channel values as TBB tasks (a lambda would not inherit the target).
template <typename Body>
void InPixelBlocks(const NhwcPool& g, Body body) {
  const int64_t pixels = g.n * (g.h / 2) * (g.w / 2), grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, g.c));
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, pixels, grain),
                    [&](const tbb::blocked_range<int64_t>& r) { body(r.begin(), r.end()); });
}

#undef SS_AVX512

}  // namespace

bool MaxPool2x2Vectorised() { return simd::CpuLanes() == 16; }

bool MaxPool2x2NhwcVectorised() { return simd::CpuLanes() > 0; }

void MaxPool2x2(const PoolShape& g, const float* x, float* y) {
  const Rows rows(g);
  InRowBlocks(g, [&](int64_t begin, int64_t end) { ForwardRows(rows, x, y, begin, end); });
}

void MaxPool2x2Grad(const PoolShape& g, const float* x, const float* dy, float* dx, bool relu_mask) {
  const Rows rows(g);
  InRowBlocks(g, [&](int64_t begin, int64_t end) {
    if (relu_mask) GradRows<true>(rows, x, dy, dx, begin, end);
    else GradRows<false>(rows, x, dy, dx, begin, end);
  });
}

void MaxPool2x2Nhwc(const NhwcPool& g, const float* x, float* y) {
  const Pixels pixels(g);
  const bool wide = simd::CpuLanes() == 16;
  InPixelBlocks(g, [&](int64_t begin, int64_t end) {
    (wide ? avx512::ForwardPixelsNhwc : avx2::ForwardPixelsNhwc)(pixels, x, y, begin, end);
  });
}

void MaxPool2x2GradNhwc(const NhwcPool& g, const float* x, const float* dy, float* dx, bool relu_mask) {
  const Pixels pixels(g);
  const bool wide = simd::CpuLanes() == 16;
  InPixelBlocks(g, [&](int64_t begin, int64_t end) {
    if (wide) (relu_mask ? avx512::GradPixelsNhwc<true> : avx512::GradPixelsNhwc<false>)(pixels, x, dy, dx, begin, end);
    else (relu_mask ? avx2::GradPixelsNhwc<true> : avx2::GradPixelsNhwc<false>)(pixels, x, dy, dx, begin, end);
  });
}

}  // namespace shardstep::jit
