// The 16-channel 3x3 filter gradient on NHWC activations as direct AVX-512 loops (see nhwc16_filter_grad.h).
#include "jit/nhwc16_filter_grad.h"

#include <immintrin.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <vector>

namespace shardstep::jit {
namespace {

constexpr int64_t kChannels = 16;                   // in and out: one vector of output channels
constexpr int64_t kTaps = 9;                        // 3x3
constexpr int64_t kPart = kTaps * kChannels * kChannels;  // one group's sums: [tap][c][o]
constexpr int64_t kGroups = 8;                      // as the other filter-gradient paths (dnnl_conv.cc)
// The next image's x and dy (2 x h x w lines of 16 floats) fetched over the 6 passes (3 tap rows x 2
// channel halves) of about h rows each of this image: 10 lines per row fetch them all for w up to 30.
constexpr int kFetchLinesPerRow = 10;

#define SS_AVX512 __attribute__((target("avx512f")))

// Adds the images [first, last) into part[tap][c][o], image by image, tap row by tap row, half of the
// input channels at a time, row by row, column by column: acc[kw][c] (lanes: o) += x[column p][c] *
// dy[p + 1 - kw][o]. Each broadcast input value feeds the three taps of its row (24 accumulators), so
// the loop does three multiplies per load where it did one (bench/conv, batch 128 at 28x28, alternated
// with the one-tap loop: 2.10-2.14 -> 1.61-1.68 ms per call; oneDNN's forward on the same multiplies:
// 1.50-1.74). Out-of-image output columns read a zero gradient: x * 0 adds a zero, which
// leaves every sum's value and order as summing only the taps inside the image, except for a
// non-finite x, which makes the centre tap's sum non-finite too (the caller recomputes those).
SS_AVX512 void SumGroup(const ConvShape& g, const float* x, const float* dy, int64_t first, int64_t last,
                        float* part) {
  constexpr int kHalf = kChannels / 2;
  std::fill_n(part, kPart, 0.0f);
  const int64_t image = g.h * g.w * kChannels;
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t n = first; n < last; ++n) {
    const float* xn = x + n * image;
    const float* dn = dy + n * image;
    // The next image's input, then its gradient, fetched into L2 a few lines per row while this
    // image's taps run (bench/conv: 2.2 -> 2.0 ms when the operands come from memory).
    const float* fetch = n + 1 < last ? xn + image : nullptr;
    const float* fetch_end = fetch ? fetch + image : nullptr;
    bool fetching_grad = false;
    for (int64_t kh = 0; kh < 3; ++kh)
      for (int half = 0; half < 2; ++half) {
        float* p = part + kh * 3 * kChannels * kChannels + half * kHalf * kChannels;
        __m512 acc[3][kHalf];
#pragma GCC unroll 3
        for (int kw = 0; kw < 3; ++kw)
#pragma GCC unroll 8
          for (int c = 0; c < kHalf; ++c) acc[kw][c] = _mm512_loadu_ps(p + (kw * kChannels + c) * kChannels);
        // The output rows whose tap row kh reads inside the image.
        const int64_t h0 = std::max<int64_t>(0, 1 - kh), h1 = std::min<int64_t>(g.h, g.h + 1 - kh);
        for (int64_t h = h0; h < h1; ++h) {
          for (int q = 0; q < kFetchLinesPerRow && fetch < fetch_end; ++q, fetch += kChannels)
            _mm_prefetch(reinterpret_cast<const char*>(fetch), _MM_HINT_T1);
          if (fetch && fetch == fetch_end && !fetching_grad) {
            fetching_grad = true;
            fetch = dn + image;
            fetch_end = fetch + image;
          }
          const float* xr = xn + (h + kh - 1) * g.w * kChannels + half * kHalf;
          const float* dr = dn + h * g.w * kChannels;
          // dy at output columns p + 1, p, p - 1 (taps kw = 0, 1, 2 of input column p).
          __m512 d_next = _mm512_loadu_ps(dr), d_here = zero, d_prev = zero;
          for (int64_t col = 0; col < g.w; ++col, xr += kChannels) {
            d_prev = d_here;
            d_here = d_next;
            d_next = col + 1 < g.w ? _mm512_loadu_ps(dr + (col + 1) * kChannels) : zero;
#pragma GCC unroll 8
            for (int c = 0; c < kHalf; ++c) {
              const __m512 xv = _mm512_set1_ps(xr[c]);
              acc[0][c] = _mm512_fmadd_ps(xv, d_next, acc[0][c]);
              acc[1][c] = _mm512_fmadd_ps(xv, d_here, acc[1][c]);
              acc[2][c] = _mm512_fmadd_ps(xv, d_prev, acc[2][c]);
            }
          }
        }
#pragma GCC unroll 3
        for (int kw = 0; kw < 3; ++kw)
#pragma GCC unroll 8
          for (int c = 0; c < kHalf; ++c) _mm512_storeu_ps(p + (kw * kChannels + c) * kChannels, acc[kw][c]);
      }
  }
}

#undef SS_AVX512

// The groups' partial sums of the calling (replica) thread, grown once: the TBB tasks of a call each
// write their own group's slice, so a step after the first allocates nothing.
float* Parts() {
  thread_local std::vector<float> buf(kGroups * kPart);
  return buf.data();
}

}  // namespace

bool Nhwc16FilterGradApplies(const ConvShape& g) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  return avx512 && g.c == kChannels && g.o == kChannels && g.kh == 3 && g.kw == 3 && g.sh == 1 && g.sw == 1 &&
         g.ph == 1 && g.pw == 1 && g.oh == g.h && g.ow == g.w && g.n > 0 && g.h > 0 && g.w > 0;
}

void Nhwc16FilterGrad(const ConvShape& g, const float* x, const float* dy, float* dw) {
  const int64_t per_group = (g.n + kGroups - 1) / kGroups;
  float* const parts = Parts();
  tbb::parallel_for(int64_t{0}, kGroups, [&](int64_t group) {
    // A group with no image (fewer images than groups) sums nothing: a zero part.
    SumGroup(g, x, dy, std::min(g.n, group * per_group), std::min(g.n, (group + 1) * per_group),
             parts + group * kPart);
  });
  // dw[o][c][kh][kw] = the groups' sums at [tap][c][o], added in group order.
  for (int64_t tap = 0; tap < kTaps; ++tap)
    for (int64_t c = 0; c < kChannels; ++c)
      for (int64_t o = 0; o < kChannels; ++o) {
        float s = 0.0f;
        for (int64_t group = 0; group < kGroups; ++group) s += parts[group * kPart + (tap * kChannels + c) * kChannels + o];
        dw[(o * kChannels + c) * kTaps + tap] = s;
      }
}

}  // namespace shardstep::jit
