// Native convolution and pooling kernels (see cpu_kernels.h). Semantics follow the interpreter's
// (runtime/interpreter.cc): conv2d = im2col + sgemm per image; the filter gradient sums fixed groups
// of images, then adds the groups in order; max pooling takes the first maximum, a NaN counting as one.
#include "jit/cpu_kernels.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "jit/dnnl_kernels.h"
#include "jit/max_pool_2x2.h"

namespace shardstep::jit {
namespace {

void SingleThreadedOmp() {
  thread_local const bool once = (SetOmpThreads(1), true);
  (void)once;
}

// The calling (replica) thread's scratch: grown only, a slice per TBB task, handed to the tasks by
// pointer. TBB workers keep no scratch of their own: which worker runs a task changes from step to
// step, and a worker's first task would otherwise allocate in the middle of a later step.
float* Scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// The images of a call split into at most kImageBlocks contiguous blocks, one TBB task (and one
// scratch slice) each.
constexpr int64_t kImageBlocks = 8;

// col[(c,i,j), (y,x)] = zero-padded x[c, y*sh - ph + i, x*sw - pw + j] for one image.
void Im2Col(const float* x, const ConvShape& g, float* col) {
  for (int64_t c = 0; c < g.c; ++c)
    for (int64_t i = 0; i < g.kh; ++i)
      for (int64_t j = 0; j < g.kw; ++j) {
        float* row = col + ((c * g.kh + i) * g.kw + j) * g.p();
        // Output columns whose input column is inside the image: [xlo, xhi).
        int64_t xlo = 0;
        while (xlo < g.ow && xlo * g.sw - g.pw + j < 0) ++xlo;
        int64_t xhi = g.ow;
        while (xhi > xlo && (xhi - 1) * g.sw - g.pw + j >= g.w) --xhi;
        for (int64_t y = 0; y < g.oh; ++y) {
          const int64_t iy = y * g.sh - g.ph + i;
          float* dst = row + y * g.ow;
          if (iy < 0 || iy >= g.h) {
            std::fill(dst, dst + g.ow, 0.0f);
            continue;
          }
          const float* src = x + (c * g.h + iy) * g.w - g.pw + j;
          std::fill(dst, dst + xlo, 0.0f);
          if (g.sw == 1) std::memcpy(dst + xlo, src + xlo, (xhi - xlo) * sizeof(float));
          else for (int64_t xx = xlo; xx < xhi; ++xx) dst[xx] = src[xx * g.sw];
          std::fill(dst + xhi, dst + g.ow, 0.0f);
        }
      }
}

// dx += col2im(col) for one image, in a fixed order.
void Col2Im(const float* col, const ConvShape& g, float* dx) {
  for (int64_t c = 0; c < g.c; ++c)
    for (int64_t i = 0; i < g.kh; ++i)
      for (int64_t j = 0; j < g.kw; ++j) {
        const float* row = col + ((c * g.kh + i) * g.kw + j) * g.p();
        int64_t xlo = 0;  // output columns whose input column is inside the image: [xlo, xhi)
        while (xlo < g.ow && xlo * g.sw - g.pw + j < 0) ++xlo;
        int64_t xhi = g.ow;
        while (xhi > xlo && (xhi - 1) * g.sw - g.pw + j >= g.w) --xhi;
        for (int64_t y = 0; y < g.oh; ++y) {
          const int64_t iy = y * g.sh - g.ph + i;
          if (iy < 0 || iy >= g.h) continue;
          float* d = dx + (c * g.h + iy) * g.w - g.pw + j;
          const float* r = row + y * g.ow;
          if (g.sw == 1) for (int64_t xx = xlo; xx < xhi; ++xx) d[xx] += r[xx];
          else for (int64_t xx = xlo; xx < xhi; ++xx) d[xx * g.sw] += r[xx];
        }
      }
}

constexpr int64_t kFilterGradGroups = 8;

}  // namespace

ConvShape ConvShapeOf(const ir::Shape& x, const ir::Shape& w, const ir::Instr& in) {
  // Attributes read in place (a step allocates nothing).
  auto pair = [&](const char* key, int64_t dflt, int64_t* a, int64_t* b) {
    if (!in.Has(key)) {
      *a = *b = dflt;
      return;
    }
    const ir::IntList& v = in.GetInts(key);
    *a = v[0];
    *b = v[1];
  };
  ConvShape g{x[0], x[1], x[2], x[3], w[0], w[2], w[3], 1, 1, 0, 0, 0, 0};
  pair("stride", 1, &g.sh, &g.sw);
  pair("padding", 0, &g.ph, &g.pw);
  g.oh = (g.h + 2 * g.ph - g.kh) / g.sh + 1;
  g.ow = (g.w + 2 * g.pw - g.kw) / g.sw + 1;
  return g;
}

void Conv2dForward(const ConvShape& g, const float* x, const float* w, float* y) {
  const int64_t per = (g.n + kImageBlocks - 1) / kImageBlocks, slice = g.k() * g.p();
  float* const cols = Scratch(kImageBlocks * slice);
  tbb::parallel_for(int64_t{0}, kImageBlocks, [&](int64_t blk) {
    SingleThreadedOmp();
    float* col = cols + blk * slice;
    for (int64_t n = blk * per; n < std::min(g.n, (blk + 1) * per); ++n) {
      Im2Col(x + n * g.c * g.h * g.w, g, col);
      DnnlSgemm(false, false, g.o, g.p(), g.k(), w, g.k(), col, g.p(), 0.0f, y + n * g.o * g.p(), g.p());
    }
  });
}

void Conv2dInputGrad(const ConvShape& g, const float* dy, const float* w, float* dx) {
  const int64_t per = (g.n + kImageBlocks - 1) / kImageBlocks, slice = g.k() * g.p();
  float* const dcols = Scratch(kImageBlocks * slice);
  tbb::parallel_for(int64_t{0}, kImageBlocks, [&](int64_t blk) {
    SingleThreadedOmp();
    float* dcol = dcols + blk * slice;
    for (int64_t n = blk * per; n < std::min(g.n, (blk + 1) * per); ++n) {
      DnnlSgemm(true, false, g.k(), g.p(), g.o, w, g.k(), dy + n * g.o * g.p(), g.p(), 0.0f, dcol, g.p());
      float* d = dx + n * g.c * g.h * g.w;
      std::fill(d, d + g.c * g.h * g.w, 0.0f);
      Col2Im(dcol, g, d);
    }
  });
}

void Conv2dFilterGrad(const ConvShape& g, const float* x, const float* dy, float* dw) {
  const int64_t per_group = (g.n + kFilterGradGroups - 1) / kFilterGradGroups, size = g.o * g.k();
  // The groups' partial sums: per calling (replica) thread, grown once, so a step allocates nothing.
  // (TBB workers see their own thread_locals: they get the pointer, not the name.)
  thread_local std::vector<float> parts_buf;
  if (static_cast<int64_t>(parts_buf.size()) < kFilterGradGroups * size) parts_buf.resize(kFilterGradGroups * size);
  float* const parts = parts_buf.data();
  const int64_t slice = g.k() * g.p();
  float* const cols = Scratch(kFilterGradGroups * slice);
  tbb::parallel_for(int64_t{0}, kFilterGradGroups, [&](int64_t group) {
    SingleThreadedOmp();
    float* col = cols + group * slice;
    const int64_t first = group * per_group, last = std::min(g.n, (group + 1) * per_group);
    if (first >= last) std::fill_n(parts + group * size, size, 0.0f);  // no image: a zero part
    for (int64_t n = first; n < last; ++n) {
      Im2Col(x + n * g.c * g.h * g.w, g, col);
      DnnlSgemm(false, true, g.o, g.k(), g.p(), dy + n * g.o * g.p(), g.p(), col, g.p(),
                n == first ? 0.0f : 1.0f, parts + group * size, g.k());
    }
  });
  std::fill(dw, dw + size, 0.0f);
  for (int64_t group = 0; group < kFilterGradGroups; ++group)
    for (int64_t j = 0; j < size; ++j) dw[j] += parts[group * size + j];
}


namespace {
template <typename F>
void ForEachWindow(const PoolShape& g, F f) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(g.h * g.w, 1));
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, g.planes, grain), [&](const tbb::blocked_range<int64_t>& r) {
    for (int64_t p = r.begin(); p < r.end(); ++p)
      for (int64_t y = 0; y < g.oh; ++y)
        for (int64_t x = 0; x < g.ow; ++x) f(p * g.h * g.w + y * g.sh * g.w + x * g.sw, (p * g.oh + y) * g.ow + x);
  });
}
}  // namespace

namespace {
// The common 2x2 window with stride 2: windows do not overlap, and the first-maximum rule
// (candidates in row-major order, NaN counts as a maximum) unrolls into selects. The selects are
// bit masks, not `?:`: on pooling inputs (random, many ReLU zeros) GCC turned `?:` into branches
// that mispredicted about half the time (13x slower than the masked form, which also vectorises).
inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float Float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// All ones when candidate c replaces the current maximum b, else 0.
inline uint32_t TakeMask(float c, float b) { return 0u - static_cast<uint32_t>((c > b) | ((c != c) & (b == b))); }
inline uint32_t Blend(uint32_t mask, uint32_t a, uint32_t b) { return (a & mask) | (b & ~mask); }
bool Is2x2(const PoolShape& g) { return g.kh == 2 && g.kw == 2 && g.sh == 2 && g.sw == 2; }

template <typename F>
void ForEachPlaneRow(const PoolShape& g, F f) {  // f(row 0 of the window, row 1, output row offset)
  const int64_t rows = g.planes * g.oh;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, rows, 256), [&](const tbb::blocked_range<int64_t>& r) {
    for (int64_t pr = r.begin(); pr < r.end(); ++pr) {
      const int64_t p = pr / g.oh, y = pr % g.oh;
      const int64_t r0 = p * g.h * g.w + 2 * y * g.w;
      f(r0, r0 + g.w, pr * g.ow);
    }
  });
}
}  // namespace

namespace {
// Padded max pooling: each window clipped to its plane (padded cells never win).
template <typename F>
void ForEachPaddedWindow(const PoolShape& g, F f) {  // f(plane offset, argmax within the plane, output index)
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, g.planes, 1), [&](const tbb::blocked_range<int64_t>& r) {
    for (int64_t p = r.begin(); p < r.end(); ++p)
      for (int64_t y = 0; y < g.oh; ++y)
        for (int64_t x = 0; x < g.ow; ++x) f(p * g.h * g.w, p, y, x, (p * g.oh + y) * g.ow + x);
  });
}
}  // namespace

void MaxPool(const PoolShape& g, const float* x, float* y) {
  if (g.pad > 0) {
    ForEachPaddedWindow(g, [&](int64_t plane, int64_t, int64_t oy, int64_t ox, int64_t o) {
      y[o] = x[plane + runtime::PaddedWindowArgMax(x + plane, g, oy, ox)];
    });
    return;
  }
  if (Is2x2(g) && MaxPool2x2Vectorised()) return MaxPool2x2(g, x, y);
  if (Is2x2(g)) {
    ForEachPlaneRow(g, [&](int64_t r0, int64_t r1, int64_t o) {
      const float* __restrict a = x + r0;
      const float* __restrict c = x + r1;
      float* __restrict out = y + o;
      for (int64_t j = 0; j < g.ow; ++j) {
        const float c0 = a[2 * j], c1 = a[2 * j + 1], c2 = c[2 * j], c3 = c[2 * j + 1];
        uint32_t b = Bits(c0);
        b = Blend(TakeMask(c1, Float(b)), Bits(c1), b);
        b = Blend(TakeMask(c2, Float(b)), Bits(c2), b);
        b = Blend(TakeMask(c3, Float(b)), Bits(c3), b);
        out[j] = Float(b);
      }
    });
    return;
  }
  ForEachWindow(g, [&](int64_t i, int64_t o) { y[o] = x[i + runtime::WindowArgMax(x + i, g)]; });
}

namespace {
// select(x > 0, dx, 0), in place: x > 0 is false for NaN, as the comparison in the IR.
void MaskByPositive(int64_t n, const float* x, float* dx) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, int64_t{1} << 14), [&](const tbb::blocked_range<int64_t>& r) {
    for (int64_t i = r.begin(); i < r.end(); ++i) dx[i] = x[i] > 0.0f ? dx[i] : 0.0f;
  });
}
inline uint32_t PositiveMask(float c) { return 0u - static_cast<uint32_t>(c > 0.0f); }
}  // namespace

void MaxPoolGrad(const PoolShape& g, const float* x, const float* dy, float* dx, bool relu_mask) {
  if (relu_mask && !(g.pad == 0 && Is2x2(g) && g.h == 2 * g.oh && g.w == 2 * g.ow)) {
    MaxPoolGrad(g, x, dy, dx, false);
    MaskByPositive(g.planes * g.h * g.w, x, dx);
    return;
  }
  if (g.pad > 0) {  // a plane's windows are visited by one task, in order: no race, the interpreter's order
    std::fill(dx, dx + g.planes * g.h * g.w, 0.0f);
    ForEachPaddedWindow(g, [&](int64_t plane, int64_t, int64_t oy, int64_t ox, int64_t o) {
      dx[plane + runtime::PaddedWindowArgMax(x + plane, g, oy, ox)] += dy[o];
    });
    return;
  }
  if (Is2x2(g) && g.h == 2 * g.oh && g.w == 2 * g.ow && MaxPool2x2Vectorised())
    return MaxPool2x2Grad(g, x, dy, dx, relu_mask);
  if (Is2x2(g) && g.h == 2 * g.oh && g.w == 2 * g.ow) {
    // The windows tile the plane: one pass writes every element of dx (no separate zeroing).
    const uint32_t unmasked = relu_mask ? 0u : ~0u;  // branch-free: the inputs look random
    ForEachPlaneRow(g, [&](int64_t r0, int64_t r1, int64_t o) {
      const float* __restrict a = x + r0;
      const float* __restrict c = x + r1;
      float* __restrict da = dx + r0;
      float* __restrict dc = dx + r1;
      const float* __restrict d_out = dy + o;
      for (int64_t j = 0; j < g.ow; ++j) {
        const float c0 = a[2 * j], c1 = a[2 * j + 1], c2 = c[2 * j], c3 = c[2 * j + 1];
        // m_k: candidate k is the first maximum so far; the later masks clear the earlier ones.
        uint32_t b = Bits(c0), k1 = TakeMask(c1, Float(b));
        b = Blend(k1, Bits(c1), b);
        const uint32_t k2 = TakeMask(c2, Float(b));
        b = Blend(k2, Bits(c2), b);
        const uint32_t k3 = TakeMask(c3, Float(b));
        uint32_t m3 = k3, m2 = k2 & ~k3, m1 = k1 & ~k2 & ~k3, m0 = ~(k1 | k2 | k3);
        m0 &= PositiveMask(c0) | unmasked, m1 &= PositiveMask(c1) | unmasked;
        m2 &= PositiveMask(c2) | unmasked, m3 &= PositiveMask(c3) | unmasked;
        const uint32_t d = Bits(0.0f + d_out[j]);  // 0 + dy, as the interpreter accumulates
        da[2 * j] = Float(d & m0);  // +0 where the mask is clear
        da[2 * j + 1] = Float(d & m1);
        dc[2 * j] = Float(d & m2);
        dc[2 * j + 1] = Float(d & m3);
      }
    });
    return;
  }
  std::fill(dx, dx + g.planes * g.h * g.w, 0.0f);
  ForEachWindow(g, [&](int64_t i, int64_t o) { dx[i + runtime::WindowArgMax(x + i, g)] += dy[o]; });
}

}  // namespace shardstep::jit
