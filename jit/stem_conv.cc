// The one-input-channel 3x3 convolution as direct AVX-512 loops, the channels-last forms also as AVX2
// loops (see stem_conv.h).
#include "jit/stem_conv.h"

#include <immintrin.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <vector>

#include "jit/simd.h"

namespace shardstep::jit {
namespace {

constexpr int64_t kLanes = 16;
// The forward pass: blocks of 8 images as TBB tasks, at most 32 of them (more images per block in a
// bigger batch; each block's scratch is one padded image).
constexpr int64_t kImagesPerTask = 8;
constexpr int64_t kMaxForwardTasks = 32;

#define SS_AVX512 __attribute__((target("avx512f")))

SS_AVX512 inline __mmask16 FirstLanes(int64_t n) {
  return static_cast<__mmask16>(n >= kLanes ? 0xFFFFu : (1u << n) - 1u);
}

// A zero-bordered copy of one image in a task's slice of scratch: cell (r + 1, c + 1) holds x[r][c] and
// every other cell is zero, so the taps of an output segment are plain loads with no bounds to test.
struct PaddedImage {
  int64_t stride = 0;  // floats per row: the segments' columns rounded up to 16, and the two borders
  float* cells = nullptr;
};
int64_t PaddedStride(const ConvShape& g) { return (g.w + kLanes - 1) / kLanes * kLanes + 2; }
int64_t PaddedSize(const ConvShape& g) { return (g.h + 2) * PaddedStride(g); }
PaddedImage Pad(const ConvShape& g, const float* img, float* cells) {
  PaddedImage p{PaddedStride(g), cells};
  std::fill_n(p.cells, PaddedSize(g), 0.0f);
  for (int64_t r = 0; r < g.h; ++r) std::copy_n(img + r * g.w, g.w, p.cells + (r + 1) * p.stride + 1);
  return p;
}

// Scratch of the calling (replica) thread, grown only: the TBB tasks of one call each get a slice (a
// worker keeps no state of its own, so a step after the first allocates nothing on any thread).
float* TaskScratch(int64_t floats) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < floats) buf.resize(floats);
  return buf.data();
}

// The 16 lanes of an accumulator summed pairwise in one fixed order: lane l + w is added into lane l
// for w = 8, 4, 2, 1.
float LaneSum(const float* lanes) {
  float v[kLanes];
  std::copy_n(lanes, kLanes, v);
  for (int64_t w = kLanes / 2; w >= 1; w /= 2)
    for (int64_t l = 0; l < w; ++l) v[l] += v[l + w];
  return v[0];
}

// The 9 taps of the output segment at row r, columns x0 .. x0 + 15: tap (dy, dx) holds, in lane l, the
// input at row r + dy - 1, column x0 + dx - 1 + l (a padded zero outside the image). Lanes past the
// segment (`lanes`) are zero too, so that the filter gradient adds 0 * 0 there, never 0 * (an inf).
SS_AVX512 __attribute__((always_inline)) inline void LoadTaps(const PaddedImage& p, int64_t r, int64_t x0,
                                                              __mmask16 lanes, __m512* tap) {
#pragma GCC unroll 3
  for (int dy = 0; dy < 3; ++dy)
#pragma GCC unroll 3
    for (int dx = 0; dx < 3; ++dx) tap[dy * 3 + dx] = _mm512_maskz_loadu_ps(lanes, p.cells + (r + dy) * p.stride + x0 + dx);
}

SS_AVX512 void ForwardImages(const ConvShape& g, const float* x, const float* w, float* y, int64_t first,
                             int64_t last, float* scratch) {
  const int64_t plane = g.h * g.w, channels = g.o;
  for (int64_t n = first; n < last; ++n) {
    const PaddedImage p = Pad(g, x + n * plane, scratch);
    float* const out = y + n * channels * plane;
    for (int64_t r = 0; r < g.h; ++r)
      for (int64_t x0 = 0; x0 < g.w; x0 += kLanes) {
        const __mmask16 lanes = FirstLanes(g.w - x0);
        __m512 tap[9];
        LoadTaps(p, r, x0, lanes, tap);
        float* yp = out + r * g.w + x0;
        const float* wo = w;
        for (int64_t o = 0; o < channels; ++o, wo += 9, yp += plane) {
          __m512 acc = _mm512_mul_ps(tap[0], _mm512_set1_ps(wo[0]));
#pragma GCC unroll 8
          for (int k = 1; k < 9; ++k) acc = _mm512_fmadd_ps(tap[k], _mm512_set1_ps(wo[k]), acc);
          _mm512_mask_storeu_ps(yp, lanes, acc);
        }
      }
  }
}

// One group's sum over images [first, last): part[o * 9 + k], each lane adding its columns' products
// image by image, row by row, then the lanes summed by one fixed reduction. The 9 accumulators of each
// output channel (16 lanes each) wait in `scratch` while the other channels run; the padded image
// follows them.
int64_t FilterGradScratch(const ConvShape& g) { return g.o * 9 * kLanes + PaddedSize(g); }
SS_AVX512 void FilterGradGroup(const ConvShape& g, const float* x, const float* dy, int64_t first, int64_t last,
                               float* part, float* scratch) {
  const int64_t plane = g.h * g.w, channels = g.o;
  float* const acc_all = scratch;
  std::fill_n(acc_all, channels * 9 * kLanes, 0.0f);
  for (int64_t n = first; n < last; ++n) {
    const PaddedImage p = Pad(g, x + n * plane, scratch + channels * 9 * kLanes);
    for (int64_t o = 0; o < channels; ++o) {
      __m512 acc[9];
#pragma GCC unroll 9
      for (int k = 0; k < 9; ++k) acc[k] = _mm512_loadu_ps(acc_all + (o * 9 + k) * kLanes);
      const float* d = dy + (n * channels + o) * plane;
      for (int64_t r = 0; r < g.h; ++r)
        for (int64_t x0 = 0; x0 < g.w; x0 += kLanes) {
          const __mmask16 lanes = FirstLanes(g.w - x0);
          __m512 tap[9];
          LoadTaps(p, r, x0, lanes, tap);
          const __m512 grad = _mm512_maskz_loadu_ps(lanes, d + r * g.w + x0);
#pragma GCC unroll 9
          for (int k = 0; k < 9; ++k) acc[k] = _mm512_fmadd_ps(tap[k], grad, acc[k]);
        }
#pragma GCC unroll 9
      for (int k = 0; k < 9; ++k) _mm512_storeu_ps(acc_all + (o * 9 + k) * kLanes, acc[k]);
    }
  }
  for (int64_t i = 0; i < channels * 9; ++i) part[i] = LaneSum(acc_all + i * kLanes);
}

// Channels-last (jit/channels_last.h): the output and its gradient NHWC, [n, h, w, o], o a multiple of
// 16; the image is the same bytes in both layouts. Lanes run over output channels of one pixel, so the
// AVX-512 and AVX2 builds of these loops (jit/stem_conv_nhwc_loops.inc, jit/simd.h) give the same bits.
#define SS_SIMD_BODY "jit/stem_conv_nhwc_loops.inc"
#include "jit/simd_each_target.inc"

#undef SS_AVX512

}  // namespace

namespace {
bool StemShape(const ConvShape& g) {
  return g.c == 1 && g.kh == 3 && g.kw == 3 && g.sh == 1 && g.sw == 1 && g.ph == 1 && g.pw == 1 && g.oh == g.h &&
         g.ow == g.w && g.n > 0 && g.o > 0 && g.h > 0 && g.w > 0;
}
}  // namespace

bool StemConvApplies(const ConvShape& g) {
  return simd::CpuLanes() == 16 && StemShape(g);
}

namespace {
// The forward pass's TBB tasks: blocks of images, each block with one padded image of scratch.
template <typename Images>
void ForwardTasks(const ConvShape& g, Images images) {
  const int64_t tasks = std::min(kMaxForwardTasks, (g.n + kImagesPerTask - 1) / kImagesPerTask);
  const int64_t per_task = (g.n + tasks - 1) / tasks, slice = PaddedSize(g);
  float* const scratch = TaskScratch(tasks * slice);
  tbb::parallel_for(int64_t{0}, tasks, [&](int64_t t) {
    images(std::min(g.n, t * per_task), std::min(g.n, (t + 1) * per_task), scratch + t * slice);
  });
}

// The filter gradient's fixed groups of images as TBB tasks: group_sum(first, last, part, scratch) sums
// a group into its part (`size` floats; a group with no image, when there are fewer images than
// groups, sums nothing: a zero part) with `slice` floats of scratch. Returns the parts.
template <typename GroupSum>
const float* FilterGradGroups(const ConvShape& g, int64_t size, int64_t slice, GroupSum group_sum) {
  const int64_t per_group = (g.n + kStemFilterGradGroups - 1) / kStemFilterGradGroups;
  float* const parts = TaskScratch(kStemFilterGradGroups * (size + slice));
  float* const scratch = parts + kStemFilterGradGroups * size;
  tbb::parallel_for(int64_t{0}, kStemFilterGradGroups, [&](int64_t group) {
    group_sum(std::min(g.n, group * per_group), std::min(g.n, (group + 1) * per_group), parts + group * size,
              scratch + group * slice);
  });
  return parts;
}
}  // namespace

void StemConvForward(const ConvShape& g, const float* x, const float* w, float* y) {
  ForwardTasks(g, [&](int64_t first, int64_t last, float* scratch) { ForwardImages(g, x, w, y, first, last, scratch); });
}

void StemConvFilterGrad(const ConvShape& g, const float* x, const float* dy, float* dw) {
  const int64_t size = g.o * 9;
  const float* parts = FilterGradGroups(g, size, FilterGradScratch(g), [&](int64_t first, int64_t last, float* part,
                                                                           float* scratch) {
    FilterGradGroup(g, x, dy, first, last, part, scratch);
  });
  std::fill(dw, dw + size, 0.0f);
  for (int64_t group = 0; group < kStemFilterGradGroups; ++group)
    for (int64_t j = 0; j < size; ++j) dw[j] += parts[group * size + j];
}

bool StemConvNhwcApplies(const ConvShape& g) { return simd::CpuLanes() > 0 && StemShape(g) && g.o % 16 == 0; }

void StemConvForwardNhwc(const ConvShape& g, const float* x, const float* w, float* y) {
  // (A padded row of 16k + 2 cells holds every 8-pixel step's taps: the pixels past the image read
  // zeros and are not stored.)
  const bool wide = simd::CpuLanes() == 16;
  ForwardTasks(g, [&](int64_t first, int64_t last, float* scratch) {
    (wide ? avx512::ForwardImagesNhwc : avx2::ForwardImagesNhwc)(g, x, w, y, first, last, scratch);
  });
}

void StemConvFilterGradNhwc(const ConvShape& g, const float* x, const float* dy, float* dw) {
  const bool wide = simd::CpuLanes() == 16;
  const int64_t size = g.o * 9;
  const float* parts = FilterGradGroups(g, size, PaddedSize(g), [&](int64_t first, int64_t last, float* part,
                                                                    float* scratch) {
    (wide ? avx512::FilterGradGroupNhwc : avx2::FilterGradGroupNhwc)(g, x, dy, first, last, part, scratch);
  });
  // dw[o][k] = the groups' part[k][o], added in group order.
  for (int64_t o = 0; o < g.o; ++o)
    for (int64_t k = 0; k < 9; ++k) {
      float s = 0.0f;
      for (int64_t group = 0; group < kStemFilterGradGroups; ++group) s += parts[group * size + k * g.o + o];
      dw[o * 9 + k] = s;
    }
}

}  // namespace shardstep::jit
