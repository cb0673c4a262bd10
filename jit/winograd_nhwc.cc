// Winograd F(2x2, 3x3) on NHWC activations as AVX-512 loops (see winograd_nhwc.h): the forward pass,
// then the filter gradient.
#include "jit/winograd_nhwc.h"

#include <immintrin.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "ir/error.h"

namespace shardstep::jit {
namespace {

#define SS_AVX512 __attribute__((target("avx512f")))

constexpr int64_t kLanes = 16;  // channels per vector
constexpr int kPositions = 16;  // a 4x4 input tile's transformed positions, p = 4 i + j
constexpr int64_t kMaxChannels = 256;

// (GCC 12's plain gather warns of its unset source operand.)
SS_AVX512 inline __m512 Gather(__m512i index, const float* base) {
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), 0xffff, index, base, 4);
}

// U[p][c][o] = (G g G^T)[i][j] for the filter g = w[o][c] (3x3), with
// G = [1 0 0; 1/2 1/2 1/2; 1/2 -1/2 1/2; 0 0 1]; 16 output channels per vector (their taps gathered).
SS_AVX512 void TransformFilter(const ConvShape& g, const float* w, float* u) {
  const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(static_cast<int>(g.c * 9)));
  const __m512 half = _mm512_set1_ps(0.5f);
  for (int64_t o = 0; o < g.o; o += kLanes)
    for (int64_t c = 0; c < g.c; ++c) {
      const float* k = w + (o * g.c + c) * 9;
      __m512 t[4][3];  // G g
      for (int j = 0; j < 3; ++j) {
        const __m512 k0 = Gather(lanes, k + j), k1 = Gather(lanes, k + 3 + j), k2 = Gather(lanes, k + 6 + j);
        t[0][j] = k0;
        t[1][j] = _mm512_mul_ps(half, _mm512_add_ps(_mm512_add_ps(k0, k1), k2));
        t[2][j] = _mm512_mul_ps(half, _mm512_add_ps(_mm512_sub_ps(k0, k1), k2));
        t[3][j] = k2;
      }
      for (int i = 0; i < 4; ++i) {
        const __m512 r[4] = {t[i][0], _mm512_mul_ps(half, _mm512_add_ps(_mm512_add_ps(t[i][0], t[i][1]), t[i][2])),
                             _mm512_mul_ps(half, _mm512_add_ps(_mm512_sub_ps(t[i][0], t[i][1]), t[i][2])), t[i][2]};
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(u + ((4 * i + j) * g.c + c) * g.o + o, r[j]);
      }
    }
}

// How the output channels are blocked (OB vectors per product) and the most tiles per group for that
// block: the T x OB accumulators and OB filter vectors fit in the 32 vector registers.
struct Blocking {
  int ob, max_tiles;
};
Blocking BlockingOf(int64_t o) {
  const int64_t vectors = o / kLanes;
  if (vectors % 4 == 0) return {4, 6};
  if (vectors % 2 == 0) return {2, 12};
  return {1, 16};
}

// Output tiles walked in row-major order: one division per call, not two per tile (an integer
// division costs about what a tile's input transform does with 16 channels).
struct TileWalk {
  int64_t ty, tx, tiles_w;
  TileWalk(int64_t first, int64_t w) : ty(first / w), tx(first % w), tiles_w(w) {}
  void Next() {
    if (++tx == tiles_w) tx = 0, ++ty;
  }
};

// V = B^T d B of one patch d (16 vectors: one position's channels [c, c + 16)), stored at
// v[p * stride_t].
SS_AVX512 inline void TransformPatch(const __m512 (&d)[4][4], int64_t stride_t, float* v) {
  __m512 r[4][4];  // B^T d
  for (int j = 0; j < 4; ++j) {
    r[0][j] = _mm512_sub_ps(d[0][j], d[2][j]);
    r[1][j] = _mm512_add_ps(d[1][j], d[2][j]);
    r[2][j] = _mm512_sub_ps(d[2][j], d[1][j]);
    r[3][j] = _mm512_sub_ps(d[1][j], d[3][j]);
  }
  for (int i = 0; i < 4; ++i) {  // (B^T d) B
    float* out = v + (4 * i) * stride_t;
    _mm512_storeu_ps(out, _mm512_sub_ps(r[i][0], r[i][2]));
    _mm512_storeu_ps(out + stride_t, _mm512_add_ps(r[i][1], r[i][2]));
    _mm512_storeu_ps(out + 2 * stride_t, _mm512_sub_ps(r[i][2], r[i][1]));
    _mm512_storeu_ps(out + 3 * stride_t, _mm512_sub_ps(r[i][1], r[i][3]));
  }
}

// Input tiles [first, first + count) of one image into v[p][t][c] (t < count): d is the 4x4 patch
// whose top-left input is (2 ty - 1, 2 tx - 1), zeros outside the image; V = B^T d B with
// B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1].
SS_AVX512 void TransformInput(const ConvShape& g, const float* x, int64_t tiles_w, int64_t first, int64_t count,
                              int64_t stride_t, float* v) {
  const int64_t c_all = g.c;
  int64_t step[16];  // the positions' offsets from the patch's top-left input
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) step[4 * i + j] = (i * g.w + j) * c_all;
  TileWalk at(first, tiles_w);
  for (int64_t t = 0; t < count; ++t, at.Next()) {
    const int64_t y0 = 2 * at.ty - 1, x0 = 2 * at.tx - 1;
    const int64_t base = (y0 * g.w + x0) * c_all;
    float* vt = v + t * c_all;
    __m512 d[4][4];
    if (y0 >= 0 && y0 + 3 < g.h && x0 >= 0 && x0 + 3 < g.w) {  // the patch inside the image
      const float* patch = x + base;
      for (int64_t c = 0; c < c_all; c += kLanes) {
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 4; ++j) d[i][j] = _mm512_loadu_ps(patch + step[4 * i + j] + c);
        TransformPatch(d, stride_t, vt + c);
      }
      continue;
    }
    // On the border: each position's load mask (no lanes outside the image) and offset (0 there).
    int64_t off[16];
    __mmask16 in[16];
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) {
        const int64_t inside = static_cast<uint64_t>(y0 + i) < static_cast<uint64_t>(g.h) &&
                               static_cast<uint64_t>(x0 + j) < static_cast<uint64_t>(g.w);
        off[4 * i + j] = (base + step[4 * i + j]) & -inside;
        in[4 * i + j] = static_cast<__mmask16>(0xffff & -inside);
      }
    for (int64_t c = 0; c < c_all; c += kLanes) {
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) d[i][j] = _mm512_maskz_loadu_ps(in[4 * i + j], x + off[4 * i + j] + c);
      TransformPatch(d, stride_t, vt + c);
    }
  }
}

// m[t][ob vectors] = sum over c of v[t][c] u[c][ob vectors] for one position: T x OB accumulators,
// each input value broadcast to OB products, each filter vector used by T. C: the input channels when
// known at compile time (the broadcasts then address v at constant offsets), else 0.
template <int T, int OB, int C>
SS_AVX512 void Product(const float* v, const float* u, int64_t c_all, int64_t o_all, float* m) {
  const int64_t cs = C > 0 ? C : c_all;
  __m512 acc[T][OB];
  {  // the first channel's products start the sums (zeroing the accumulators compiled to a memset)
    __m512 uc[OB];
    for (int b = 0; b < OB; ++b) uc[b] = _mm512_loadu_ps(u + b * kLanes);
    for (int t = 0; t < T; ++t) {
      const __m512 vt = _mm512_set1_ps(v[t * cs]);
      for (int b = 0; b < OB; ++b) acc[t][b] = _mm512_mul_ps(vt, uc[b]);
    }
  }
  for (int64_t c = 1; c < cs; ++c) {
    __m512 uc[OB];
    for (int b = 0; b < OB; ++b) uc[b] = _mm512_loadu_ps(u + c * o_all + b * kLanes);
    for (int t = 0; t < T; ++t) {
      const __m512 vt = _mm512_set1_ps(v[t * cs + c]);
      for (int b = 0; b < OB; ++b) acc[t][b] = _mm512_fmadd_ps(vt, uc[b], acc[t][b]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int b = 0; b < OB; ++b) _mm512_storeu_ps(m + (t * OB + b) * kLanes, acc[t][b]);
}

using ProductFn = void (*)(const float*, const float*, int64_t, int64_t, float*);
template <int OB, int C, int... Ts>
constexpr std::array<ProductFn, sizeof...(Ts)> ProductTable(std::integer_sequence<int, Ts...>) {
  return {&Product<Ts + 1, OB, C>...};
}
template <int C>
ProductFn ProductOf(int tiles, int ob) {
  static constexpr auto one = ProductTable<1, C>(std::make_integer_sequence<int, 16>());
  static constexpr auto two = ProductTable<2, C>(std::make_integer_sequence<int, 12>());
  static constexpr auto four = ProductTable<4, C>(std::make_integer_sequence<int, 6>());
  return ob == 4 ? four[tiles - 1] : ob == 2 ? two[tiles - 1] : one[tiles - 1];
}
ProductFn ProductOf(int tiles, int ob, int64_t c) {
  return c == 16 ? ProductOf<16>(tiles, ob) : c == 32 ? ProductOf<32>(tiles, ob) : c == 64 ? ProductOf<64>(tiles, ob)
                                                                                         : ProductOf<0>(tiles, ob);
}

// Y = A^T M A (A^T = [1 1 1 0; 0 1 -1 -1]) of tiles [first, first + count), output channels
// [o0, o0 + OB * 16), stored into the image's y where inside it; `bad` adds up y - y (NaN once a y is
// an inf or a NaN).
SS_AVX512 void TransformOutput(const ConvShape& g, const float* m, int64_t stride_p, int ob, int64_t tiles_w,
                               int64_t first, int64_t count, int64_t o0, float* y, __m512& bad) {
  TileWalk at(first, tiles_w);
  for (int64_t t = 0; t < count; ++t, at.Next()) {
    const int64_t ty = at.ty, tx = at.tx;
    for (int b = 0; b < ob; ++b) {
      const float* mt = m + (t * ob + b) * kLanes;
      __m512 s[2][4];  // A^T M
      for (int j = 0; j < 4; ++j) {
        const __m512 m0 = _mm512_loadu_ps(mt + j * stride_p), m1 = _mm512_loadu_ps(mt + (4 + j) * stride_p);
        const __m512 m2 = _mm512_loadu_ps(mt + (8 + j) * stride_p), m3 = _mm512_loadu_ps(mt + (12 + j) * stride_p);
        s[0][j] = _mm512_add_ps(_mm512_add_ps(m0, m1), m2);
        s[1][j] = _mm512_sub_ps(_mm512_sub_ps(m1, m2), m3);
      }
      for (int a = 0; a < 2; ++a) {
        const int64_t row = 2 * ty + a;
        if (row >= g.oh) continue;
        const __m512 y0 = _mm512_add_ps(_mm512_add_ps(s[a][0], s[a][1]), s[a][2]);
        const __m512 y1 = _mm512_sub_ps(_mm512_sub_ps(s[a][1], s[a][2]), s[a][3]);
        float* out = y + (row * g.ow + 2 * tx) * g.o + o0 + b * kLanes;
        _mm512_storeu_ps(out, y0);
        bad = _mm512_add_ps(bad, _mm512_sub_ps(y0, y0));
        if (2 * tx + 1 < g.ow) {
          _mm512_storeu_ps(out + g.o, y1);
          bad = _mm512_add_ps(bad, _mm512_sub_ps(y1, y1));
        }
      }
    }
  }
}

// One image: groups of `per_group` tiles (the last one shorter), each through the three stages.
SS_AVX512 bool Image(const ConvShape& g, const float* x, const float* u, float* y, int64_t per_group, float* v,
                     float* m) {
  const Blocking bl = BlockingOf(g.o);
  const int64_t tiles_h = (g.oh + 1) / 2, tiles_w = (g.ow + 1) / 2, tiles = tiles_h * tiles_w;
  // (Strides one vector more than the positions' data, as in FilterGradImages.)
  const int64_t stride_v = per_group * g.c + kLanes, stride_m = per_group * bl.ob * kLanes + kLanes;
  __m512 bad = _mm512_setzero_ps();
  for (int64_t first = 0; first < tiles; first += per_group) {
    const int64_t count = std::min(per_group, tiles - first);
    TransformInput(g, x, tiles_w, first, count, stride_v, v);
    const ProductFn product = ProductOf(static_cast<int>(count), bl.ob, g.c);
    for (int64_t o0 = 0; o0 < g.o; o0 += bl.ob * kLanes) {
      for (int p = 0; p < kPositions; ++p) product(v + p * stride_v, u + p * g.c * g.o + o0, g.c, g.o, m + p * stride_m);
      TransformOutput(g, m, stride_m, bl.ob, tiles_w, first, count, o0, y, bad);
    }
  }
  return _mm512_cmp_ps_mask(bad, bad, _CMP_UNORD_Q) == 0;
}

// The filter gradient: dW = G^T [ (A dY A^T) (.) (B^T d B) ] G summed over the tiles (the forward
// identity transposed: dY's tile (2x2, zero beyond the output) transformed, d the input patch as in the
// forward pass), A = [1 0; 1 1; 1 -1; 0 -1], G^T = [1 1/2 1/2 0; 0 1/2 -1/2 0; 0 1/2 1/2 1].

// Output-gradient tiles [first, first + count) of one image into w[p][t][o]: W = A e A^T.
SS_AVX512 void TransformGrad(const ConvShape& g, const float* dy, int64_t tiles_w, int64_t first, int64_t count,
                             int64_t stride_t, float* w) {
  const __m512 zero = _mm512_setzero_ps();
  TileWalk at(first, tiles_w);
  for (int64_t t = 0; t < count; ++t, at.Next()) {
    const int64_t ty = at.ty, tx = at.tx;
    int64_t off[2][2];
    __mmask16 in[2][2];
    for (int a = 0; a < 2; ++a)
      for (int b = 0; b < 2; ++b) {
        const int64_t inside = 2 * ty + a < g.oh && 2 * tx + b < g.ow;
        off[a][b] = ((2 * ty + a) * g.ow + 2 * tx + b) * g.o & -inside;
        in[a][b] = static_cast<__mmask16>(0xffff & -inside);
      }
    for (int64_t o = 0; o < g.o; o += kLanes) {
      __m512 e[2][2];
      for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 2; ++b) e[a][b] = _mm512_maskz_loadu_ps(in[a][b], dy + off[a][b] + o);
      __m512 r[4][2];  // A e
      for (int b = 0; b < 2; ++b) {
        r[0][b] = e[0][b];
        r[1][b] = _mm512_add_ps(e[0][b], e[1][b]);
        r[2][b] = _mm512_sub_ps(e[0][b], e[1][b]);
        r[3][b] = _mm512_sub_ps(zero, e[1][b]);
      }
      for (int i = 0; i < 4; ++i) {  // (A e) A^T
        float* out = w + (4 * i) * stride_t + t * g.o + o;
        _mm512_storeu_ps(out, r[i][0]);
        _mm512_storeu_ps(out + stride_t, _mm512_add_ps(r[i][0], r[i][1]));
        _mm512_storeu_ps(out + 2 * stride_t, _mm512_sub_ps(r[i][0], r[i][1]));
        _mm512_storeu_ps(out + 3 * stride_t, _mm512_sub_ps(zero, r[i][1]));
      }
    }
  }
}

// m[c][o] += sum over t of v[t][c] w[t][o] for one position, channels [c0, c0 + CB) and output vectors
// [o0, o0 + OB * 16): CB x OB accumulators over the tiles in order.
template <int CB, int OB>
SS_AVX512 void AccumulateProduct(const float* v, const float* w, int64_t tiles, int64_t c_all, int64_t o_all, int64_t c0,
                                 int64_t o0, float* m) {
  __m512 acc[CB][OB];
  for (int i = 0; i < CB; ++i)
    for (int b = 0; b < OB; ++b) acc[i][b] = _mm512_loadu_ps(m + (c0 + i) * o_all + o0 + b * kLanes);
  for (int64_t t = 0; t < tiles; ++t) {
    __m512 wt[OB];
    for (int b = 0; b < OB; ++b) wt[b] = _mm512_loadu_ps(w + t * o_all + o0 + b * kLanes);
    for (int i = 0; i < CB; ++i) {
      const __m512 vi = _mm512_set1_ps(v[t * c_all + c0 + i]);
      for (int b = 0; b < OB; ++b) acc[i][b] = _mm512_fmadd_ps(vi, wt[b], acc[i][b]);
    }
  }
  for (int i = 0; i < CB; ++i)
    for (int b = 0; b < OB; ++b) _mm512_storeu_ps(m + (c0 + i) * o_all + o0 + b * kLanes, acc[i][b]);
}

// Tiles transformed per sweep over the sums m: a sweep loads and stores all of m (16 x C x O floats:
// 256 KB with 64 channels), so it runs over several images' tiles at once.
constexpr int64_t kTilesPerSweep = 64;
int64_t ImagesPerSweep(const ConvShape& g) {
  const int64_t tiles = ((g.oh + 1) / 2) * ((g.ow + 1) / 2);
  return std::max<int64_t>(1, kTilesPerSweep / std::max<int64_t>(tiles, 1));
}

// Images [first, last) added into m[p][c][o]: per sweep its images' tiles transformed (v, w), then per
// position the products over those tiles in order.
SS_AVX512 void FilterGradImages(const ConvShape& g, const float* x, const float* dy, int64_t first, int64_t last, float* v,
                                float* w, float* m) {
  const int64_t tiles_w = (g.ow + 1) / 2, tiles = ((g.oh + 1) / 2) * tiles_w, per_sweep = ImagesPerSweep(g);
  const int ob = BlockingOf(g.o).ob, cb = 16 / ob;  // 16 accumulators
  for (int64_t n0 = first; n0 < last; n0 += per_sweep) {
    const int64_t images = std::min(per_sweep, last - n0), k = images * tiles;
    // (One vector more per position: strides of a power of two put the 16 positions' stores of a tile
    // in one L1 set.)
    const int64_t stride_v = k * g.c + kLanes, stride_w = k * g.o + kLanes;
    for (int64_t i = 0; i < images; ++i) {
      TransformInput(g, x + (n0 + i) * g.h * g.w * g.c, tiles_w, 0, tiles, stride_v, v + i * tiles * g.c);
      TransformGrad(g, dy + (n0 + i) * g.oh * g.ow * g.o, tiles_w, 0, tiles, stride_w, w + i * tiles * g.o);
    }
    for (int p = 0; p < kPositions; ++p) {
      const float* vp = v + p * stride_v;
      const float* wp = w + p * stride_w;
      float* mp = m + p * g.c * g.o;
      for (int64_t c0 = 0; c0 < g.c; c0 += cb)
        for (int64_t o0 = 0; o0 < g.o; o0 += ob * kLanes) {
          if (ob == 4) AccumulateProduct<4, 4>(vp, wp, k, g.c, g.o, c0, o0, mp);
          else if (ob == 2) AccumulateProduct<8, 2>(vp, wp, k, g.c, g.o, c0, o0, mp);
          else AccumulateProduct<16, 1>(vp, wp, k, g.c, g.o, c0, o0, mp);
        }
    }
  }
}

// dw[o][c] (3x3, OIHW) = G^T M G of m[p][c][o], 16 output channels per vector (scattered to OIHW).
SS_AVX512 void TransformFilterGrad(const ConvShape& g, const float* m, float* dw) {
  const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(static_cast<int>(g.c * 9)));
  const __m512 half = _mm512_set1_ps(0.5f);
  for (int64_t c = 0; c < g.c; ++c)
    for (int64_t o = 0; o < g.o; o += kLanes) {
      __m512 q[3][4];  // G^T M
      for (int j = 0; j < 4; ++j) {
        const __m512 m0 = _mm512_loadu_ps(m + ((0 + j) * g.c + c) * g.o + o), m1 = _mm512_loadu_ps(m + ((4 + j) * g.c + c) * g.o + o);
        const __m512 m2 = _mm512_loadu_ps(m + ((8 + j) * g.c + c) * g.o + o), m3 = _mm512_loadu_ps(m + ((12 + j) * g.c + c) * g.o + o);
        const __m512 sum = _mm512_mul_ps(half, _mm512_add_ps(m1, m2));
        q[0][j] = _mm512_add_ps(m0, sum);
        q[1][j] = _mm512_mul_ps(half, _mm512_sub_ps(m1, m2));
        q[2][j] = _mm512_add_ps(sum, m3);
      }
      float* out = dw + (o * g.c + c) * 9;
      for (int k = 0; k < 3; ++k) {  // (G^T M) G
        const __m512 sum = _mm512_mul_ps(half, _mm512_add_ps(q[k][1], q[k][2]));
        _mm512_i32scatter_ps(out + 3 * k, lanes, _mm512_add_ps(q[k][0], sum), 4);
        _mm512_i32scatter_ps(out + 3 * k + 1, lanes, _mm512_mul_ps(half, _mm512_sub_ps(q[k][1], q[k][2])), 4);
        _mm512_i32scatter_ps(out + 3 * k + 2, lanes, _mm512_add_ps(sum, q[k][3]), 4);
      }
    }
}

// Whether any of v[0, n) is an inf or a NaN.
bool AnyNonFinite(const float* v, int64_t n) {
  const uint32_t* u = reinterpret_cast<const uint32_t*>(v);
  uint32_t found = 0;
  for (int64_t i = 0; i < n; ++i) found |= static_cast<uint32_t>((u[i] & 0x7f800000u) == 0x7f800000u);
  return found != 0;
}

}  // namespace

bool WinogradNhwcApplies(const ConvShape& g) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  return avx512 && g.kh == 3 && g.kw == 3 && g.sh == 1 && g.sw == 1 && g.ph == 1 && g.pw == 1 && g.c % kLanes == 0 &&
         g.o % kLanes == 0 && g.c >= 32 && g.o >= 32 && g.c <= kMaxChannels && g.o <= kMaxChannels && g.oh == g.h &&
         g.ow == g.w && g.h > 0 && g.w > 0;
}

bool WinogradNhwcForward(const ConvShape& g, const float* x, const float* w, float* y) {
  thread_local std::vector<float> u;  // the calling thread's transformed filter
  if (static_cast<int64_t>(u.size()) < kPositions * g.c * g.o) u.resize(kPositions * g.c * g.o);
  TransformFilter(g, w, u.data());
  // Groups of tiles: as few as the register blocking allows, of equal size but the last.
  const Blocking bl = BlockingOf(g.o);
  const int64_t tiles = ((g.oh + 1) / 2) * ((g.ow + 1) / 2);
  const int64_t groups = (tiles + bl.max_tiles - 1) / bl.max_tiles, per_group = (tiles + groups - 1) / groups;
  const int64_t v_size = kPositions * (per_group * g.c + kLanes);
  const int64_t image_in = g.h * g.w * g.c, image_out = g.oh * g.ow * g.o;
  std::atomic<bool> finite{true};
  const float* uu = u.data();
  // v then m per TBB thread slot, owned by the calling (replica) thread and grown by it: a worker may
  // run its first image of a shape in any step, and then finds its scratch made.
  thread_local std::vector<std::vector<float>> caller_slots;
  std::vector<std::vector<float>>& slots = caller_slots;  // (in the tasks, the caller's: not their own)
  const size_t need = static_cast<size_t>(v_size + kPositions * (per_group * bl.ob * kLanes + kLanes));
  slots.resize(std::max(tbb::this_task_arena::max_concurrency(), tbb::info::default_concurrency()));
  for (std::vector<float>& slot : slots)
    if (slot.size() < need) slot.resize(need);
  tbb::parallel_for(int64_t{0}, g.n, [&](int64_t n) {
    const int index = std::max(0, tbb::this_task_arena::current_thread_index());
    SS_CHECK(index < static_cast<int>(slots.size()), "thread slot ", index, " beyond the Winograd loops' ", slots.size());
    float* scratch = slots[index].data();
    if (!Image(g, x + n * image_in, uu, y + n * image_out, per_group, scratch, scratch + v_size))
      finite.store(false, std::memory_order_relaxed);
  });
  return finite.load();
}

bool WinogradNhwcFilterGrad(const ConvShape& g, const float* x, const float* dy, float* dw) {
  // Fixed groups of images (as the other filter-gradient paths), each group's sums in one order
  // (image, position, tile), the groups added in order: the same bits on any number of threads.
  constexpr int64_t kGroups = 8;
  const int64_t tiles = ((g.oh + 1) / 2) * ((g.ow + 1) / 2), part = kPositions * g.c * g.o;
  const int64_t sweep = std::min(ImagesPerSweep(g), std::max<int64_t>(g.n, 1)) * tiles;
  const int64_t v_size = kPositions * (sweep * g.c + kLanes), w_size = kPositions * (sweep * g.o + kLanes);
  // Per calling thread: the groups' sums; per TBB thread slot: an image's transformed tiles.
  thread_local std::vector<float> caller_parts;
  thread_local std::vector<std::vector<float>> caller_slots;
  std::vector<float>& parts = caller_parts;
  std::vector<std::vector<float>>& slots = caller_slots;
  if (static_cast<int64_t>(parts.size()) < kGroups * part) parts.resize(kGroups * part);
  slots.resize(std::max(tbb::this_task_arena::max_concurrency(), tbb::info::default_concurrency()));
  for (std::vector<float>& slot : slots)
    if (static_cast<int64_t>(slot.size()) < v_size + w_size) slot.resize(v_size + w_size);
  const int64_t per_group = (g.n + kGroups - 1) / kGroups;
  tbb::parallel_for(int64_t{0}, kGroups, [&](int64_t group) {
    const int index = std::max(0, tbb::this_task_arena::current_thread_index());
    SS_CHECK(index < static_cast<int>(slots.size()), "thread slot ", index, " beyond the Winograd loops' ", slots.size());
    float* m = parts.data() + group * part;
    std::fill_n(m, part, 0.0f);
    float* scratch = slots[index].data();
    FilterGradImages(g, x, dy, std::min(g.n, group * per_group), std::min(g.n, (group + 1) * per_group), scratch,
                     scratch + v_size, m);
  });
  float* m = parts.data();
  for (int64_t group = 1; group < kGroups; ++group)
    for (int64_t i = 0; i < part; ++i) m[i] += parts[group * part + i];
  TransformFilterGrad(g, m, dw);
  return !AnyNonFinite(dw, g.o * g.c * 9);
}

}  // namespace shardstep::jit
