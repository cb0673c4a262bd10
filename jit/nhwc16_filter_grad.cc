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
// Two images' 2 x h x w x 16 floats in cache lines over the 9 x h rows of an image's taps: 8 lines per
// row fetch them in the first 8 taps at any image size.
constexpr int kFetchLinesPerRow = 8;

#define SS_AVX512 __attribute__((target("avx512f")))

// Adds the images [first, last) into part[tap][c][o], image by image, tap by tap, row by row, column
// by column: acc[c] (lanes: o) += x[position + tap offset][c] * dy[position][o].
SS_AVX512 void SumGroup(const ConvShape& g, const float* x, const float* dy, int64_t first, int64_t last,
                        float* part) {
  std::fill_n(part, kPart, 0.0f);
  const int64_t image = g.h * g.w * kChannels;
  for (int64_t n = first; n < last; ++n) {
    const float* xn = x + n * image;
    const float* dn = dy + n * image;
    // The next image's input, then its gradient, fetched into L2 a few lines per row while this
    // image's taps run (bench/conv: 2.2 -> 2.0 ms when the operands come from memory).
    const float* fetch = n + 1 < last ? xn + image : nullptr;
    const float* fetch_end = fetch ? fetch + image : nullptr;
    bool fetching_grad = false;
    for (int64_t kh = 0; kh < 3; ++kh)
      for (int64_t kw = 0; kw < 3; ++kw) {
        float* p = part + (kh * 3 + kw) * kChannels * kChannels;
        __m512 acc[kChannels];
#pragma GCC unroll 16
        for (int c = 0; c < kChannels; ++c) acc[c] = _mm512_loadu_ps(p + c * kChannels);
        // The output positions whose tap (kh, kw) reads inside the image.
        const int64_t h0 = std::max<int64_t>(0, 1 - kh), h1 = std::min<int64_t>(g.h, g.h + 1 - kh);
        const int64_t w0 = std::max<int64_t>(0, 1 - kw), w1 = std::min<int64_t>(g.w, g.w + 1 - kw);
        for (int64_t h = h0; h < h1; ++h) {
          for (int q = 0; q < kFetchLinesPerRow && fetch < fetch_end; ++q, fetch += kChannels)
            _mm_prefetch(reinterpret_cast<const char*>(fetch), _MM_HINT_T1);
          if (fetch && fetch == fetch_end && !fetching_grad) {
            fetching_grad = true;
            fetch = dn + image;
            fetch_end = fetch + image;
          }
          const float* xr = xn + ((h + kh - 1) * g.w + (w0 + kw - 1)) * kChannels;
          const float* dr = dn + (h * g.w + w0) * kChannels;
          for (int64_t w = w0; w < w1; ++w, xr += kChannels, dr += kChannels) {
            const __m512 grad = _mm512_loadu_ps(dr);
#pragma GCC unroll 16
            for (int c = 0; c < kChannels; ++c) acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(xr[c]), grad, acc[c]);
          }
        }
#pragma GCC unroll 16
        for (int c = 0; c < kChannels; ++c) _mm512_storeu_ps(p + c * kChannels, acc[c]);
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
