// Attention blockwise (see attention.h): per group of heads (one TBB task), the products through oneDNN
// batched matmuls on the task's slot scratch, the softmax and its gradient in loops between them.
#include "jit/attention.h"

#include <immintrin.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "ir/error.h"
#include "jit/dnnl_kernels.h"
#include "jit/dnnl_runtime.h"
#include "jit/vector_math.h"

namespace shardstep::jit {

namespace {

// Heads per task: the largest divisor of the head count whose T x T block of all its heads is at most
// 64K floats (256 KB), so a task's scores and their gradient stay in a core's L2.
int64_t GroupOf(const AttentionShape& s) {
  const int64_t cap = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, s.t * s.t));
  for (int64_t g = std::min(cap, s.heads); g > 1; --g)
    if (s.heads % g == 0) return g;
  return 1;
}

// One batched product C[g] = op(A[g]) op(B[g]) over g dense [rows, cols] blocks (f32 or bf16 operands,
// f32 result), built once per shape and kept for the process; user scratchpad (one per thread).
struct Product {
  dnnl::memory::desc a, b, c, scratch_md;
  dnnl::matmul prim;
  size_t scratch = 0;
};

const Product& ProductFor(bool bf16, bool ta, bool tb, int64_t g, int64_t m, int64_t n, int64_t k) {
  using dnnl::memory;
  static std::mutex mu;
  static std::map<std::array<int64_t, 7>, std::unique_ptr<Product>> cache;
  const std::array<int64_t, 7> key{bf16, ta, tb, g, m, n, k};
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(key); it != cache.end()) return *it->second;
  auto p = std::make_unique<Product>();
  const memory::data_type in = bf16 ? memory::data_type::bf16 : memory::data_type::f32;
  // A stored [m, k] (or [k, m] when transposed), B [k, n] (or [n, k]), C [m, n]; blocks dense.
  p->a = memory::desc({g, m, k}, in, ta ? memory::dims{m * k, 1, m} : memory::dims{m * k, k, 1});
  p->b = memory::desc({g, k, n}, in, tb ? memory::dims{k * n, 1, k} : memory::dims{k * n, n, 1});
  p->c = memory::desc({g, m, n}, memory::data_type::f32, memory::dims{m * n, n, 1});
  try {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(p->a, p->b, p->c), attr, DnnlEngine());
    p->prim = dnnl::matmul(pd);
    p->scratch = pd.scratchpad_desc().get_size();
    p->scratch_md = memory::desc({static_cast<int64_t>(std::max<size_t>(p->scratch, 1))}, memory::data_type::u8,
                                 memory::format_tag::a);
  } catch (const dnnl::error& e) {
    throw Error(Str("oneDNN refused attention's ", g, " x ", m, "x", n, "x", k, " product: ", e.what()));
  }
  return *cache.emplace(key, std::move(p)).first->second;
}

// A product's memory objects for one TBB thread slot (bound once, re-pointed per call).
struct Mems {
  BoundDnnlMem a, b, c, scratch;
};

// Runs product p on the calling worker (one OpenMP thread) with its slot's memory objects and scratchpad.
void Run(const Product& p, Mems& mm, char* pad, const void* a, const void* b, float* c) {
  thread_local const bool single = (SetOmpThreads(1), true);
  (void)single;
  dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, mm.a.Bind(p.a, const_cast<void*>(a))},
                            {DNNL_ARG_WEIGHTS, mm.b.Bind(p.b, const_cast<void*>(b))},
                            {DNNL_ARG_DST, mm.c.Bind(p.c, c)},
                            {DNNL_ARG_SCRATCHPAD, p.scratch > 0 ? mm.scratch.Bind(p.scratch_md, pad) : nullptr}};
  DnnlExecute(p.prim.get(), p.scratch > 0 ? 4 : 3, args, "attention matmul");
}

// Round to nearest even (NaN quieted), as runtime::F32ToBf16 without its branch.
inline uint16_t ToBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x0040u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}
inline float Bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// jit/vector_math.cc EmitExp on one f32: the same operations in the same order (the same bits).
template <typename = void>
[[gnu::always_inline]] inline float ExpBody(float x) {
  const ExpCoefficients& c = kExpCoefficients;
  const bool underflow = x <= -104.0f;
  float y = x > -104.0f ? x : -104.0f;  // NaN -> -104 (patched at the end)
  y = y < 104.0f ? y : 104.0f;
  const float xc = underflow ? 0.0f : y;
  const float t = xc * 1.44269504088896341f;
  const float kf = (t + 12582912.0f) - 12582912.0f;  // rint for |t| < 2^22, as llvm.rint in the default mode
  const int32_t k = static_cast<int32_t>(kf);
  float r = std::fma(kf, -0.693145751953125f, xc);
  r = std::fma(kf, -1.428606765330187045e-06f, r);
  float p = c[0];
  for (size_t i = 1; i < c.size(); ++i) p = std::fma(p, r, c[i]);
  const float u = 1.0f + std::fma(r * r, p, r);
  const int32_t h = k >> 1;
  const float e = (u * Bits(static_cast<uint32_t>(h + 127) << 23)) * Bits(static_cast<uint32_t>(k - h + 127) << 23);
  return x != x ? x + x : underflow ? 0.0f : e;
}

// The scores are held transposed, st[j, i] = score of query i against key j ([keys, queries] per head),
// so the softmax's reductions over the keys run down the columns: 16 queries at a time in the lanes of a
// vector, each lane's sum in key order as the interpreter's, and no horizontal reductions per row.
// A causal block of 16 queries stops at its last query's key (the rest of its column is 0).

// With bf16 (non-null) each probability is also stored rounded to bf16 there (the products' operand) in
// the same pass; the gradient's loop then stores ds^T only rounded (bf16 products read no f32 ds^T).

// Softmax statistics (AttentionStats): with `out`, each query's max and 1 / sum are stored at
// [h * t + i] of its two arrays; with `in`, read from there instead of computed, the probabilities
// then made in one pass (the same operations on each element as the three passes: the same bits).
struct StatsIo {
  AttentionStats out, in;
};

// Generic form (any t): the same operations per element, one query at a time.
void SoftmaxColumnsBase(float* st, int64_t heads, int64_t t, float scale, bool causal, uint16_t* bf16,
                        const StatsIo& io) {
  for (int64_t h = 0; h < heads; ++h) {
    float* x = st + h * t * t;
    for (int64_t i = 0; i < t; ++i) {
      const int64_t n = causal ? i + 1 : t;
      float m = -INFINITY, r;
      if (io.in.max) {
        m = io.in.max[h * t + i], r = io.in.inv_sum[h * t + i];
        for (int64_t j = 0; j < n; ++j) x[j * t + i] = ExpBody(x[j * t + i] * scale - m);
      } else {
        for (int64_t j = 0; j < n; ++j) {
          float& v = x[j * t + i];
          v *= scale;
          m = v > m ? v : m;  // a NaN is skipped: its exp makes the sum, so every p of the query, NaN
        }
        double total = 0;
        for (int64_t j = 0; j < n; ++j) total += x[j * t + i] = ExpBody(x[j * t + i] - m);
        r = 1.0f / static_cast<float>(total);
        if (io.out.max) io.out.max[h * t + i] = m, io.out.inv_sum[h * t + i] = r;
      }
      for (int64_t j = 0; j < t; ++j) {
        x[j * t + i] = j < n ? x[j * t + i] * r : 0.0f;
        if (bf16) bf16[h * t * t + j * t + i] = ToBf16(x[j * t + i]);
      }
    }
  }
}
// dst[j, i] = pt[j, i] (dst[j, i] - sum over j of dst[j, i] pt[j, i]) * scale, dst holding dp^T; with
// causal, over the keys j <= i only, and 0 for the masked ones (the interpreter's AttentionGrad).
void SoftmaxGradColumnsBase(const float* pt, float* dst, int64_t heads, int64_t t, float scale, bool causal,
                            uint16_t* bf16) {
  for (int64_t h = 0; h < heads; ++h) {
    const float* p = pt + h * t * t;
    float* g = dst + h * t * t;
    for (int64_t i = 0; i < t; ++i) {
      const int64_t n = causal ? i + 1 : t;
      double dot = 0;
      for (int64_t j = 0; j < n; ++j) dot += double(g[j * t + i]) * double(p[j * t + i]);
      const float rowdot = static_cast<float>(dot);
      for (int64_t j = 0; j < t; ++j) {
        const float ds = j < n ? p[j * t + i] * (g[j * t + i] - rowdot) * scale : 0.0f;
        if (bf16) bf16[h * t * t + j * t + i] = ToBf16(ds);
        else g[j * t + i] = ds;
      }
    }
  }
}

// GCC 12's AVX-512 intrinsics pass _mm512_undefined_*() as the unused merge operand, which it then
// reports as maybe uninitialized once inlined here: a false positive, silenced for these functions only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// avx512bf16 (and avx512vl, which its 256-bit results need) only for StoreBf16<true>: the other forms
// contain no instruction of it, and are the ones run on CPUs without it (Bf16Ne).
#define SS_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")))
// ExpBody on 16 lanes.
SS_AVX512 inline __m512 Exp16(__m512 x) {
  const ExpCoefficients& c = kExpCoefficients;
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-104.0f), _CMP_LE_OQ);
  __m512 y = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  // x > -104 ? x : -104 (NaN -> -104)
  y = _mm512_min_ps(y, _mm512_set1_ps(104.0f));            // y < 104 ? y : 104
  const __m512 xc = _mm512_mask_mov_ps(y, underflow, _mm512_setzero_ps());
  const __m512 kf = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(kf, _mm512_set1_ps(-0.693145751953125f), xc);
  r = _mm512_fmadd_ps(kf, _mm512_set1_ps(-1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(c[0]);
  for (size_t i = 1; i < c.size(); ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c[i]));
  const __m512 u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(r, r), p, r));
  // u 2^k in one instruction: ExpBody's (u 2^h) 2^(k-h) is exact until its last product, which rounds
  // u 2^k once (to a subnormal, or to inf past 88.7), as vscalefps does: the same bits in 1 op for 8.
  __m512 e = _mm512_scalef_ps(u, kf);
  e = _mm512_mask_mov_ps(e, underflow, _mm512_setzero_ps());
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_add_ps(e, nan, x, x);
}
SS_AVX512 inline __m512d Lo(__m512 x) { return _mm512_cvtps_pd(_mm512_castps512_ps256(x)); }
SS_AVX512 inline __m512d Hi(__m512 x) {
  return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}
// Two vectors of 8 doubles (lanes 0-7, 8-15) rounded to one of 16 floats.
SS_AVX512 inline __m512 ToFloats(__m512d lo, __m512d hi) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(lo)), _mm512_cvtpd_ps(hi), 1);
}

// ToBf16 on 16 lanes, stored as 16 bf16. kNe (CPUs with AVX512-BF16): vcvtneps2bf16 rounds to nearest even
// and quiets a NaN as ToBf16 does, in one instruction for the integer sequence's eight, but it reads a
// subnormal as 0: a vector holding one takes the integer sequence, so the bits are ToBf16's either way.
template <bool kNe>
SS_AVX512 inline void StoreBf16(uint16_t* y, __m512 x) {
  if constexpr (kNe) {
    if (_mm512_fpclass_ps_mask(x, 0x20) == 0) {  // 0x20: subnormal
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
      return;
    }
  }
  const __m512i u = _mm512_castps_si512(x), hi = _mm512_srli_epi32(u, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(r));
}

// The lanes (queries) that see key j.
SS_AVX512 inline __mmask16 Keep(bool causal, __m512i query, int64_t j) {
  return causal ? _mm512_cmpge_epi32_mask(query, _mm512_set1_epi32(static_cast<int32_t>(j))) : __mmask16(0xffff);
}

template <bool kNe>
SS_AVX512 void SoftmaxColumns16(float* st, int64_t heads, int64_t t, float scale, bool causal, uint16_t* bf16,
                                bool f32_out, const StatsIo& io) {
  const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t h = 0; h < heads; ++h) {
    float* x = st + h * t * t;
    for (int64_t i0 = 0; i0 < t; i0 += 16) {
      const int64_t keys = causal ? std::min(t, i0 + 16) : t;
      const __m512i query = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(i0)));
      __m512 m = ninf, r;
      uint16_t* xb = bf16 ? bf16 + h * t * t : nullptr;
      if (io.in.max) {  // one pass: scale, mask, exp, normalise (the three passes' operations on each element)
        m = _mm512_loadu_ps(io.in.max + h * t + i0), r = _mm512_loadu_ps(io.in.inv_sum + h * t + i0);
        for (int64_t j = 0; j < keys; ++j) {
          float* c = x + j * t + i0;
          const __mmask16 keep = Keep(causal, query, j);
          const __m512 v = _mm512_mask_mul_ps(ninf, keep, _mm512_loadu_ps(c), vscale);
          const __m512 pv = _mm512_maskz_mul_ps(keep, Exp16(_mm512_sub_ps(v, m)), r);
          if (f32_out) _mm512_storeu_ps(c, pv);
          if (xb) StoreBf16<kNe>(xb + j * t + i0, pv);
        }
      } else {
        for (int64_t j = 0; j < keys; ++j) {
          float* c = x + j * t + i0;
          const __m512 v = _mm512_mask_mul_ps(ninf, Keep(causal, query, j), _mm512_loadu_ps(c), vscale);
          _mm512_storeu_ps(c, v);
          m = _mm512_max_ps(v, m);  // v > m ? v : m (a NaN is skipped, as in the generic form)
        }
        __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
        for (int64_t j = 0; j < keys; ++j) {
          float* c = x + j * t + i0;
          const __m512 e = Exp16(_mm512_sub_ps(_mm512_loadu_ps(c), m));
          _mm512_storeu_ps(c, e);
          lo = _mm512_add_pd(lo, Lo(e));
          hi = _mm512_add_pd(hi, Hi(e));
        }
        r = _mm512_div_ps(_mm512_set1_ps(1.0f), ToFloats(lo, hi));
        if (io.out.max) {
          _mm512_storeu_ps(io.out.max + h * t + i0, m);
          _mm512_storeu_ps(io.out.inv_sum + h * t + i0, r);
        }
        for (int64_t j = 0; j < keys; ++j) {
          float* c = x + j * t + i0;
          const __m512 pv = _mm512_maskz_mul_ps(Keep(causal, query, j), _mm512_loadu_ps(c), r);
          if (f32_out) _mm512_storeu_ps(c, pv);
          if (xb) StoreBf16<kNe>(xb + j * t + i0, pv);
        }
      }
      for (int64_t j = keys; j < t; ++j) {
        if (f32_out) _mm512_storeu_ps(x + j * t + i0, _mm512_setzero_ps());
        if (xb) _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + j * t + i0), _mm256_setzero_si256());
      }
    }
  }
}
// A causal block of 16 queries stops at its last query's key, as the forward's (the rest of its column
// is 0); within that block a lane's masked keys read as 0 (maskz): no dp of a masked score enters.
template <bool kNe>
SS_AVX512 void SoftmaxGradColumns16(const float* pt, float* dst, int64_t heads, int64_t t, float scale, bool causal,
                                    uint16_t* bf16) {
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t h = 0; h < heads; ++h) {
    const float* p = pt + h * t * t;
    float* g = dst + h * t * t;
    uint16_t* gb = bf16 ? bf16 + h * t * t : nullptr;
    for (int64_t i0 = 0; i0 < t; i0 += 16) {
      const int64_t keys = causal ? std::min(t, i0 + 16) : t;
      const __m512i query = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(i0)));
      __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
      for (int64_t j = 0; j < keys; ++j) {
        const __m512 a = _mm512_maskz_loadu_ps(Keep(causal, query, j), g + j * t + i0), b = _mm512_loadu_ps(p + j * t + i0);
        lo = _mm512_fmadd_pd(Lo(a), Lo(b), lo);  // the product of two floats is exact in double
        hi = _mm512_fmadd_pd(Hi(a), Hi(b), hi);
      }
      const __m512 rowdot = ToFloats(lo, hi);
      for (int64_t j = 0; j < keys; ++j) {
        float* c = g + j * t + i0;
        const __m512 pv = _mm512_loadu_ps(p + j * t + i0);
        const __m512 ds = _mm512_maskz_mul_ps(Keep(causal, query, j),
                                              _mm512_mul_ps(pv, _mm512_sub_ps(_mm512_loadu_ps(c), rowdot)), vscale);
        if (gb) StoreBf16<kNe>(gb + j * t + i0, ds);
        else _mm512_storeu_ps(c, ds);
      }
      for (int64_t j = keys; j < t; ++j) {
        if (gb) _mm256_storeu_si256(reinterpret_cast<__m256i*>(gb + j * t + i0), _mm256_setzero_si256());
        else _mm512_storeu_ps(g + j * t + i0, _mm512_setzero_ps());
      }
    }
  }
}

// The same loops on 8 lanes for CPUs with AVX2 and FMA but not AVX-512 (an AMD Zen 3 guest: the generic
// forms, one query at a time down a column, made transformer_lm's attention ops ~45% of its step).
#define SS_AVX2 __attribute__((target("avx2,fma")))
// ExpBody on 8 lanes: its operations in its order (u 2^h, then times 2^(k-h): no vscalefps here).
SS_AVX2 inline __m256 Exp8(__m256 x) {
  const ExpCoefficients& c = kExpCoefficients;
  const __m256 lo = _mm256_set1_ps(-104.0f), hi = _mm256_set1_ps(104.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LE_OQ);
  __m256 y = _mm256_blendv_ps(lo, x, _mm256_cmp_ps(x, lo, _CMP_GT_OQ));  // x > -104 ? x : -104 (NaN -> -104)
  y = _mm256_blendv_ps(hi, y, _mm256_cmp_ps(y, hi, _CMP_LT_OQ));         // y < 104 ? y : 104
  const __m256 xc = _mm256_andnot_ps(underflow, y);
  const __m256 kf = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(kf, _mm256_set1_ps(-0.693145751953125f), xc);
  r = _mm256_fmadd_ps(kf, _mm256_set1_ps(-1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(c[0]);
  for (size_t i = 1; i < c.size(); ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c[i]));
  const __m256 u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(r, r), p, r));
  const __m256i k = _mm256_cvtps_epi32(kf), h = _mm256_srai_epi32(k, 1), bias = _mm256_set1_epi32(127);
  const __m256 two_h = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
  const __m256 two_kh = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(k, h), bias), 23));
  __m256 e = _mm256_mul_ps(_mm256_mul_ps(u, two_h), two_kh);
  e = _mm256_andnot_ps(underflow, e);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_ps(e, _mm256_add_ps(x, x), nan);
}
// Lanes 0-3 and 4-7 as doubles, and two such vectors rounded back to 8 floats.
SS_AVX2 inline __m256d Lo4(__m256 x) { return _mm256_cvtps_pd(_mm256_castps256_ps128(x)); }
SS_AVX2 inline __m256d Hi4(__m256 x) { return _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)); }
SS_AVX2 inline __m256 ToFloats8(__m256d lo, __m256d hi) {
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(lo)), _mm256_cvtpd_ps(hi), 1);
}
// ToBf16 on 8 lanes (its integer sequence), stored as 8 bf16.
SS_AVX2 inline void StoreBf16x8(uint16_t* y, __m256 x) {
  const __m256i u = _mm256_castps_si256(x), hi = _mm256_srli_epi32(u, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1)));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
  // 8 values < 2^16 packed to 16 bits: packus works within 128-bit halves, so lanes 0-3 and 4-7 land in
  // 64-bit quarters 0 and 2.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), _mm256_castsi256_si128(packed));
}
// The lanes (queries) that see key j, as a vector mask.
SS_AVX2 inline __m256 Keep8(bool causal, __m256i query, int64_t j) {
  if (!causal) return _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(query, _mm256_set1_epi32(static_cast<int32_t>(j) - 1)));
}
SS_AVX2 void SoftmaxColumns8(float* st, int64_t heads, int64_t t, float scale, bool causal, uint16_t* bf16, bool f32_out,
                             const StatsIo& io) {
  const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t h = 0; h < heads; ++h) {
    float* x = st + h * t * t;
    for (int64_t i0 = 0; i0 < t; i0 += 8) {
      const int64_t keys = causal ? std::min(t, i0 + 8) : t;
      const __m256i query = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(i0)));
      __m256 m = ninf, r;
      if (io.in.max) {  // one pass: scale, mask, exp (the three passes' operations on each element)
        m = _mm256_loadu_ps(io.in.max + h * t + i0), r = _mm256_loadu_ps(io.in.inv_sum + h * t + i0);
        for (int64_t j = 0; j < keys; ++j) {
          float* c = x + j * t + i0;
          const __m256 v = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(c), vscale), Keep8(causal, query, j));
          _mm256_storeu_ps(c, Exp8(_mm256_sub_ps(v, m)));
        }
      } else {
        for (int64_t j = 0; j < keys; ++j) {
          float* c = x + j * t + i0;
          const __m256 v = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(c), vscale), Keep8(causal, query, j));
          _mm256_storeu_ps(c, v);
          m = _mm256_max_ps(v, m);  // v > m ? v : m (a NaN is skipped, as in the generic form)
        }
        __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
        for (int64_t j = 0; j < keys; ++j) {
          float* c = x + j * t + i0;
          const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(c), m));
          _mm256_storeu_ps(c, e);
          lo = _mm256_add_pd(lo, Lo4(e));
          hi = _mm256_add_pd(hi, Hi4(e));
        }
        r = _mm256_div_ps(_mm256_set1_ps(1.0f), ToFloats8(lo, hi));
        if (io.out.max) {
          _mm256_storeu_ps(io.out.max + h * t + i0, m);
          _mm256_storeu_ps(io.out.inv_sum + h * t + i0, r);
        }
      }
      uint16_t* xb = bf16 ? bf16 + h * t * t : nullptr;
      for (int64_t j = 0; j < keys; ++j) {
        float* c = x + j * t + i0;
        const __m256 pv = _mm256_and_ps(_mm256_mul_ps(_mm256_loadu_ps(c), r), Keep8(causal, query, j));
        if (f32_out) _mm256_storeu_ps(c, pv);
        if (xb) StoreBf16x8(xb + j * t + i0, pv);
      }
      for (int64_t j = keys; j < t; ++j) {
        if (f32_out) _mm256_storeu_ps(x + j * t + i0, _mm256_setzero_ps());
        if (xb) _mm_storeu_si128(reinterpret_cast<__m128i*>(xb + j * t + i0), _mm_setzero_si128());
      }
    }
  }
}
SS_AVX2 void SoftmaxGradColumns8(const float* pt, float* dst, int64_t heads, int64_t t, float scale, bool causal,
                                 uint16_t* bf16) {
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t h = 0; h < heads; ++h) {
    const float* p = pt + h * t * t;
    float* g = dst + h * t * t;
    uint16_t* gb = bf16 ? bf16 + h * t * t : nullptr;
    for (int64_t i0 = 0; i0 < t; i0 += 8) {
      const int64_t keys = causal ? std::min(t, i0 + 8) : t;
      const __m256i query = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(i0)));
      __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
      for (int64_t j = 0; j < keys; ++j) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(g + j * t + i0), Keep8(causal, query, j));
        const __m256 b = _mm256_loadu_ps(p + j * t + i0);
        lo = _mm256_fmadd_pd(Lo4(a), Lo4(b), lo);  // the product of two floats is exact in double
        hi = _mm256_fmadd_pd(Hi4(a), Hi4(b), hi);
      }
      const __m256 rowdot = ToFloats8(lo, hi);
      for (int64_t j = 0; j < keys; ++j) {
        float* c = g + j * t + i0;
        const __m256 pv = _mm256_loadu_ps(p + j * t + i0);
        const __m256 ds = _mm256_and_ps(_mm256_mul_ps(_mm256_mul_ps(pv, _mm256_sub_ps(_mm256_loadu_ps(c), rowdot)), vscale),
                                        Keep8(causal, query, j));
        if (gb) StoreBf16x8(gb + j * t + i0, ds);
        else _mm256_storeu_ps(c, ds);
      }
      for (int64_t j = keys; j < t; ++j) {
        if (gb) _mm_storeu_si128(reinterpret_cast<__m128i*>(gb + j * t + i0), _mm_setzero_si128());
        else _mm256_storeu_ps(g + j * t + i0, _mm256_setzero_ps());
      }
    }
  }
}

// Rows of `bytes` bytes from x (x_step bytes apart) to y (y_step apart), a 64-byte vector at a time (the
// attention heads' rows: 64 or 128 bytes, so no call per row).
SS_AVX512 void CopyRowsAvx512(const char* x, int64_t x_step, char* y, int64_t y_step, int64_t rows, int64_t bytes) {
  const int64_t full = bytes / 64, rest = bytes % 64;
  const __mmask64 tail = _cvtu64_mask64(rest ? (uint64_t{1} << rest) - 1 : 0);
  for (int64_t r = 0; r < rows; ++r, x += x_step, y += y_step) {
    for (int64_t c = 0; c < full; ++c) _mm512_storeu_si512(y + 64 * c, _mm512_loadu_si512(x + 64 * c));
    if (rest) _mm512_mask_storeu_epi8(y + 64 * full, tail, _mm512_maskz_loadu_epi8(tail, x + 64 * full));
  }
}
// Rows of n floats from x (x_step floats apart) rounded to bf16 at y (y_step apart).
template <bool kNe>
SS_AVX512 void RoundRowsAvx512(const float* x, int64_t x_step, uint16_t* y, int64_t y_step, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r, x += x_step, y += y_step) {
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) StoreBf16<kNe>(y + c, _mm512_loadu_ps(x + c));
    for (; c < n; ++c) y[c] = ToBf16(x[c]);
  }
}

// acc[e] += x[r * step + e] for rows r = 0 .. rows - 1 in order, e < n (a multiple of 16): each column's
// f64 sum in a register lane down the rows (AttentionGradParts' column sums; ColumnSumsDownRows' order).
SS_AVX512 void ColumnSumsAvx512(const float* x, int64_t step, int64_t rows, int64_t n, double* acc) {
  for (int64_t e = 0; e < n; e += 16) {
    __m512d lo = _mm512_loadu_pd(acc + e), hi = _mm512_loadu_pd(acc + e + 8);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 v = _mm512_loadu_ps(x + r * step + e);
      lo = _mm512_add_pd(lo, Lo(v));
      hi = _mm512_add_pd(hi, Hi(v));
    }
    _mm512_storeu_pd(acc + e, lo);
    _mm512_storeu_pd(acc + e + 8, hi);
  }
}

#pragma GCC diagnostic pop

template <typename = void>
[[gnu::always_inline]] inline void RoundBody(const float* x, int64_t n, uint16_t* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = ToBf16(x[i]);
}
__attribute__((target("avx512f,avx512bw,fma"))) void RoundAvx512(const float* x, int64_t n, uint16_t* y) {
  RoundBody(x, n, y);
}
bool Avx512() {
  static const bool on = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
  return on;
}
// Whether StoreBf16 may use vcvtneps2bf16 (AVX512-BF16 and AVX512VL).
bool Bf16Ne() {
  static const bool on = Avx512() && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vl");
  return on;
}
// f32_out false (with bf16 only): p is stored rounded alone (the forward's products read nothing else).
std::atomic<bool> g_generic_softmax{false};  // GenericSoftmaxForTesting
bool Avx2() {
  static const bool on = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return on;
}
void SoftmaxColumns(float* st, int64_t heads, int64_t t, float scale, bool causal, uint16_t* bf16, bool f32_out,
                    const StatsIo& io) {
  if (g_generic_softmax) return SoftmaxColumnsBase(st, heads, t, scale, causal, bf16, io);
  if (Avx512() && t % 16 == 0)
    return Bf16Ne() ? SoftmaxColumns16<true>(st, heads, t, scale, causal, bf16, f32_out || !bf16, io)
                    : SoftmaxColumns16<false>(st, heads, t, scale, causal, bf16, f32_out || !bf16, io);
  if (Avx2() && t % 8 == 0) return SoftmaxColumns8(st, heads, t, scale, causal, bf16, f32_out || !bf16, io);
  SoftmaxColumnsBase(st, heads, t, scale, causal, bf16, io);
}
void SoftmaxGradColumns(const float* pt, float* dst, int64_t heads, int64_t t, float scale, bool causal,
                        uint16_t* bf16) {
  if (g_generic_softmax) return SoftmaxGradColumnsBase(pt, dst, heads, t, scale, causal, bf16);
  if (Avx512() && t % 16 == 0)
    return Bf16Ne() ? SoftmaxGradColumns16<true>(pt, dst, heads, t, scale, causal, bf16)
                    : SoftmaxGradColumns16<false>(pt, dst, heads, t, scale, causal, bf16);
  if (Avx2() && t % 8 == 0) return SoftmaxGradColumns8(pt, dst, heads, t, scale, causal, bf16);
  SoftmaxGradColumnsBase(pt, dst, heads, t, scale, causal, bf16);
}
void Round(const float* x, int64_t n, uint16_t* y) { Avx512() ? RoundAvx512(x, n, y) : RoundBody(x, n, y); }
void CopyRows(const void* x, int64_t x_step, void* y, int64_t y_step, int64_t rows, int64_t bytes) {
  const char* from = static_cast<const char*>(x);
  char* to = static_cast<char*>(y);
  if (Avx512()) return CopyRowsAvx512(from, x_step, to, y_step, rows, bytes);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(to + r * y_step, from + r * x_step, bytes);
}
void ColumnSums(const float* x, int64_t step, int64_t rows, int64_t n, double* acc) {
  if (Avx512() && n % 16 == 0) return ColumnSumsAvx512(x, step, rows, n, acc);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e < n; ++e) acc[e] += x[r * step + e];
}
void RoundRows(const float* x, int64_t x_step, uint16_t* y, int64_t y_step, int64_t rows, int64_t n) {
  if (Avx512()) return Bf16Ne() ? RoundRowsAvx512<true>(x, x_step, y, y_step, rows, n)
                          : RoundRowsAvx512<false>(x, x_step, y, y_step, rows, n);
  for (int64_t r = 0; r < rows; ++r) RoundBody(x + r * x_step, n, y + r * y_step);
}

std::atomic<bool> g_separate_rounding{false};  // SeparateRoundingForTesting

// The three product forms a group runs: kScoresT (a b^T: s^T = k q^T, dp^T = v dout^T), kTransA (a^T b:
// out = p v, dq = ds k, from the stored transposes), kPlain (a b: dv = p^T dout, dk = ds^T q).
enum ProductKind { kScoresT, kTransA, kPlain, kKinds };

// One TBB thread slot's scratch and memory objects.
struct Slot {
  std::vector<float> s, dp;                        // p^T and dp^T / ds^T of the group, f32
  std::vector<uint16_t> p, ds;                     // bf16 copies
  std::array<std::vector<float>, 4> operand;       // q, k, v, dout gathered or rounded (Operand)
  std::vector<float> staged;                       // a result on its way out (ResultBlock)
  std::vector<float> wide_a, wide_b;               // a product's bf16 operands widened (Plan::widen)
  std::array<Mems, kKinds> mems;
  std::vector<char> pad;                           // oneDNN scratchpad (64-byte aligned within)
  char* Pad() { return pad.data() + (64 - reinterpret_cast<uintptr_t>(pad.data()) % 64) % 64; }
};

// The calling (replica) thread's products and per-slot state for one shape, all made at its first call
// (a step after the first allocates nothing; a worker's first task finds its slot ready).
struct Plan {
  std::array<const Product*, kKinds> product{};
  // bf16 products as f32 products on the operands widened to f32 (exact), in the slot, where the CPU's
  // bf16 dot product is half-rate (jit::Bf16MatmulWidens); the operands' elements per kind.
  bool widen = false;
  std::array<int64_t, kKinds> a_elems{}, b_elems{};
  std::vector<Slot> slots;
  int64_t g = 1;
  std::vector<double> partial;  // AttentionGradParts' column sums: [blocks][3][H * d], sized at first use
  Slot& ForThisThread() {
    const int index = std::max(0, tbb::this_task_arena::current_thread_index());
    SS_CHECK(index < static_cast<int>(slots.size()), "thread slot ", index, " beyond attention's ", slots.size());
    return slots[index];
  }
};

// Whether operand i is read through the slot's copy: gathered from the heads-inner layout, or rounded.
bool Copied(const AttentionShape& s, int i) { return s.heads_in > 0 || (s.bf16 && !s.stored_bf16[i]); }
// Whether results go through the slot's staging block: scattered to the heads-inner layout, or rounded.
bool Staged(const AttentionShape& s) { return s.heads_out > 0 || s.bf16_out; }

Plan& PlanFor(const AttentionShape& s) {
  thread_local std::map<std::array<int64_t, 9>, Plan> plans;
  int64_t stored = 0;
  for (int i = 0; i < 4; ++i) stored |= int64_t{s.stored_bf16[i]} << i;
  const bool widen = s.bf16 && Bf16MatmulWidens();
  const std::array<int64_t, 9> key{s.heads, s.t, s.d, s.bf16, stored, s.heads_in, s.heads_out, s.bf16_out, widen};
  auto [it, fresh] = plans.try_emplace(key);
  Plan& plan = it->second;
  if (!fresh) return plan;
  const int64_t g = plan.g = GroupOf(s), tt = s.t * s.t, n = g * s.t * s.d;
  const bool bf16_products = s.bf16 && !widen;
  plan.widen = widen;
  plan.product[kScoresT] = &ProductFor(bf16_products, false, true, g, s.t, s.t, s.d);
  plan.product[kTransA] = &ProductFor(bf16_products, true, false, g, s.t, s.d, s.t);
  plan.product[kPlain] = &ProductFor(bf16_products, false, false, g, s.t, s.d, s.t);
  plan.a_elems = {n, g * tt, g * tt};  // k (or v), p^T or ds^T, p^T or ds^T
  plan.b_elems = {n, n, n};            // q (or dout), v (or k), dout (or q)
  size_t scratch = 0;
  for (const Product* p : plan.product) scratch = std::max(scratch, p->scratch);
  plan.slots.resize(std::max(tbb::this_task_arena::max_concurrency(), tbb::info::default_concurrency()));
  for (Slot& slot : plan.slots) {
    slot.s.resize(g * tt);
    slot.dp.resize(g * tt);
    if (s.bf16) {
      slot.p.resize(g * tt);
      slot.ds.resize(g * tt);
    }
    for (int i = 0; i < 4; ++i)
      if (Copied(s, i)) slot.operand[i].resize(n);  // floats: room for either element type
    if (Staged(s)) slot.staged.resize(n);
    if (widen) {
      slot.wide_a.resize(g * std::max(tt, s.t * s.d));
      slot.wide_b.resize(n);
    }
    slot.pad.resize(scratch + 64);
    for (int kind = 0; kind < kKinds; ++kind) {  // bound now: a later Bind only re-points
      const Product& p = *plan.product[kind];
      slot.mems[kind].a.Bind(p.a, slot.s.data());
      slot.mems[kind].b.Bind(p.b, slot.dp.data());
      slot.mems[kind].c.Bind(p.c, slot.s.data());
      if (p.scratch > 0) slot.mems[kind].scratch.Bind(p.scratch_md, slot.Pad());
    }
  }
  return plan;
}

void Run(Slot& slot, const Plan& plan, ProductKind kind, const void* a, const void* b, float* c) {
  if (plan.widen) {  // a and b hold bf16 (every operand of a bf16 product does)
    WidenBf16Values(static_cast<const uint16_t*>(a), plan.a_elems[kind], slot.wide_a.data());
    WidenBf16Values(static_cast<const uint16_t*>(b), plan.b_elems[kind], slot.wide_b.data());
    a = slot.wide_a.data();
    b = slot.wide_b.data();
  }
  Run(*plan.product[kind], slot.mems[kind], slot.Pad(), a, b, c);
}

// Where row r of head h starts (in elements) in a layout with H heads inner, or dense (H = 0).
int64_t RowAt(const AttentionShape& s, int64_t H, int64_t h, int64_t r) {
  return H == 0 ? (h * s.t + r) * s.d : ((h / H) * s.t + r) * H * s.d + (h % H) * s.d;
}

// Operand i (q, k, v, dout) of the group of g heads from h0, [g, t, d] dense as the products take it: in
// place (dense, f32 or stored as bf16), or the slot's copy: gathered row by row from the heads-inner
// layout and/or rounded to bf16.
const void* Operand(const AttentionShape& s, int i, const void* x, int64_t h0, int64_t g, Slot& slot) {
  const bool stored = s.stored_bf16[i], round = s.bf16 && !stored;
  const int64_t at = h0 * s.t * s.d, n = g * s.t * s.d;
  if (!Copied(s, i)) return stored ? static_cast<const void*>(static_cast<const uint16_t*>(x) + at)
                                   : static_cast<const void*>(static_cast<const float*>(x) + at);
  void* copy = slot.operand[i].data();
  if (s.heads_in == 0) {
    Round(static_cast<const float*>(x) + at, n, static_cast<uint16_t*>(copy));
    return copy;
  }
  const int64_t size = stored ? 2 : 4, step = s.heads_in * s.d;  // the source's element, its rows' distance
  for (int64_t j = 0; j < g; ++j) {
    const int64_t from = RowAt(s, s.heads_in, h0 + j, 0), to = j * s.t * s.d;
    if (round) RoundRows(static_cast<const float*>(x) + from, step, static_cast<uint16_t*>(copy) + to, s.d, s.t, s.d);
    else CopyRows(static_cast<const char*>(x) + from * size, step * size, static_cast<char*>(copy) + to * size,
                  s.d * size, s.t, s.d * size);
  }
  return copy;
}

// Where a product writes the group's [g, t, d] block of an output: in place when the output is dense
// f32, else the slot's staging block, which StoreStaged then copies out.
float* ResultBlock(const AttentionShape& s, bool bf16_out, void* out, int64_t h0, Slot& slot) {
  return s.heads_out == 0 && !bf16_out ? static_cast<float*>(out) + h0 * s.t * s.d : slot.staged.data();
}
void StoreStaged(const AttentionShape& s, bool bf16_out, const Slot& slot, void* out, int64_t h0, int64_t g) {
  if (s.heads_out == 0 && !bf16_out) return;
  const float* c = slot.staged.data();
  const int64_t step = s.heads_out > 0 ? s.heads_out * s.d : s.d;  // the output's rows' distance
  for (int64_t j = 0; j < g; ++j) {
    const int64_t from = j * s.t * s.d, to = RowAt(s, s.heads_out, h0 + j, 0);
    if (bf16_out) RoundRows(c + from, s.d, static_cast<uint16_t*>(out) + to, step, s.t, s.d);
    else CopyRows(c + from, s.d * 4, static_cast<float*>(out) + to, step * 4, s.t, s.d * 4);
  }
}

// p^T or ds^T as the products take it: f32 in place, or its bf16 copy (rounded by the softmax loop that
// made it, or by a pass of its own with SeparateRoundingForTesting).
const void* ProductOperand(const AttentionShape& s, const float* x, int64_t n, std::vector<uint16_t>& copy) {
  if (!s.bf16) return x;
  if (g_separate_rounding) Round(x, n, copy.data());
  return copy.data();
}
uint16_t* FusedRounding(const AttentionShape& s, std::vector<uint16_t>& copy) {
  return s.bf16 && !g_separate_rounding ? copy.data() : nullptr;
}

// The group's probabilities transposed, p^T [g, keys, queries] (f32, in slot.s; bf16: also rounded in
// slot.p): s^T = k q^T, softmax down the columns.
// backward: p^T is kept in f32 too (the gradient's loop reads it); the forward's bf16 products need only
// the rounded copy.
// `stats` (optional): the forward writes the group's softmax statistics there, the backward reads them.
const float* Probabilities(const AttentionShape& s, const Plan& plan, Slot& slot, const void* q, const void* k,
                           bool backward, int64_t h0, const AttentionStats* stats) {
  Run(slot, plan, kScoresT, k, q, slot.s.data());
  StatsIo io;
  if (stats && stats->max) {
    const AttentionStats group{stats->max + h0 * s.t, stats->inv_sum + h0 * s.t};
    (backward ? io.in : io.out) = group;
  }
  SoftmaxColumns(slot.s.data(), plan.g, s.t, s.scale, s.causal, FusedRounding(s, slot.p), backward, io);
  return slot.s.data();
}

}  // namespace

void SeparateRoundingForTesting(bool on) { g_separate_rounding = on; }
void GenericSoftmaxForTesting(bool on) { g_generic_softmax = on; }

void AttentionForward(const AttentionShape& s, const void* q, const void* k, const void* v, void* out,
                      const AttentionStats* stats) {
  if (s.heads == 0 || s.t == 0 || s.d == 0) return;
  Plan& plan = PlanFor(s);
  const int64_t g = plan.g, tt = s.t * s.t;
  tbb::parallel_for(int64_t{0}, s.heads / g, [&](int64_t task) {
    Slot& slot = plan.ForThisThread();
    const int64_t h0 = task * g;
    const void* qg = Operand(s, 0, q, h0, g, slot);
    const void* kg = Operand(s, 1, k, h0, g, slot);
    const void* vg = Operand(s, 2, v, h0, g, slot);
    const void* pt = ProductOperand(s, Probabilities(s, plan, slot, qg, kg, false, h0, stats), g * tt, slot.p);
    Run(slot, plan, kTransA, pt, vg, ResultBlock(s, s.bf16_out, out, h0, slot));  // out = p v
    StoreStaged(s, s.bf16_out, slot, out, h0, g);
  });
}

bool AttentionGradPartsFit(const AttentionShape& s, int64_t block_rows) {
  // A block of rows is whole batch elements, and its heads whole groups (tasks).
  return s.heads_out > 0 && s.t > 0 && s.heads % s.heads_out == 0 && block_rows > 0 && block_rows % s.t == 0 &&
         block_rows / s.t * s.heads_out % GroupOf(s) == 0;
}

void AttentionBackward(const AttentionShape& s, const void* q, const void* k, const void* v, const void* dout,
                       float* out, const AttentionGradParts* parts, const AttentionStats* stats) {
  if (s.heads == 0 || s.t == 0 || s.d == 0) return;
  Plan& plan = PlanFor(s);
  const int64_t g = plan.g, tt = s.t * s.t, total = s.heads * s.t * s.d;
  bool sums = false;
  if (parts)
    for (float* x : parts->sums) sums |= x != nullptr;
  SS_CHECK(!parts || s.heads_out > 0, "attention_grad: parts written from a dense layout");
  SS_CHECK(!sums || AttentionGradPartsFit(s, parts->block_rows), "attention_grad: column sums of a layout it does not fit");
  const int64_t width = s.heads_out * s.d;  // features per row (sums)
  const int64_t per_block = sums ? parts->block_rows / s.t * s.heads_out / g : 1;  // tasks per block of rows
  const int64_t tasks = s.heads / g, blocks = (tasks + per_block - 1) / per_block;
  if (sums && plan.partial.size() < static_cast<size_t>(blocks * 3 * width)) plan.partial.resize(blocks * 3 * width);
  // Part i (dq, dk, dv) of the group from h0, staged in the slot: to the f32 result and/or rounded to
  // bf16, and its rows added to the block's column sums in row order.
  auto store = [&](int i, const Slot& slot, int64_t h0, int64_t blk) {
    if (!parts || parts->f32) StoreStaged(s, false, slot, out + i * total, h0, g);
    if (!parts) return;
    const float* c = slot.staged.data();
    if (uint16_t* y = parts->bf16[i])
      for (int64_t j = 0; j < g; ++j)
        RoundRows(c + j * s.t * s.d, s.d, y + RowAt(s, s.heads_out, h0 + j, 0), s.heads_out * s.d, s.t, s.d);
    if (parts->sums[i]) {
      // Head h0 + j of the group is head (h0 + j) % H of its batch element: columns from that head's d
      // features on. Each column gets its batch elements' rows in row order (the heads of one column,
      // in j order, belong to successive batch elements).
      double* acc = plan.partial.data() + (blk * 3 + i) * width;
      for (int64_t j = 0; j < g; ++j) ColumnSums(c + j * s.t * s.d, s.d, s.t, s.d, acc + (h0 + j) % s.heads_out * s.d);
    }
  };
  auto group = [&](int64_t task, int64_t blk) {
    Slot& slot = plan.ForThisThread();
    const int64_t h0 = task * g;
    const void* qg = Operand(s, 0, q, h0, g, slot);
    const void* kg = Operand(s, 1, k, h0, g, slot);
    const void* vg = Operand(s, 2, v, h0, g, slot);
    const void* dg = Operand(s, 3, dout, h0, g, slot);
    const bool staged = parts != nullptr;  // (ResultBlock stages whenever the layout is heads-inner)
    auto result = [&](int i) { return staged ? slot.staged.data() : ResultBlock(s, false, out + i * total, h0, slot); };
    const float* pt = Probabilities(s, plan, slot, qg, kg, true, h0, stats);
    Run(slot, plan, kPlain, ProductOperand(s, pt, g * tt, slot.p), dg, result(2));  // dv = p^T dout
    if (staged) store(2, slot, h0, blk);
    else StoreStaged(s, false, slot, out + 2 * total, h0, g);
    float* dst = slot.dp.data();
    Run(slot, plan, kScoresT, vg, dg, dst);         // dp^T = v dout^T
    SoftmaxGradColumns(pt, dst, g, s.t, s.scale, s.causal, FusedRounding(s, slot.ds));  // ds^T
    const void* ds = ProductOperand(s, dst, g * tt, slot.ds);
    Run(slot, plan, kTransA, ds, kg, result(0));  // dq = ds k
    if (staged) store(0, slot, h0, blk);
    else StoreStaged(s, false, slot, out, h0, g);
    Run(slot, plan, kPlain, ds, qg, result(1));  // dk = ds^T q
    if (staged) store(1, slot, h0, blk);
    else StoreStaged(s, false, slot, out + total, h0, g);
  };
  if (!sums) {
    tbb::parallel_for(int64_t{0}, tasks, [&](int64_t task) { group(task, 0); });
    return;
  }
  // Blocks of rows in parallel, each block's batch elements in order: every column's sum runs down its
  // block's rows in row order, from +0, as Reduce's.
  tbb::parallel_for(int64_t{0}, blocks, [&](int64_t blk) {
    std::fill_n(plan.partial.data() + blk * 3 * width, 3 * width, 0.0);
    for (int64_t task = blk * per_block; task < std::min(tasks, (blk + 1) * per_block); ++task) group(task, blk);
  });
  for (int i = 0; i < 3; ++i) {
    if (!parts->sums[i]) continue;
    for (int64_t e = 0; e < width; ++e) {
      double a = plan.partial[i * width + e];
      for (int64_t blk = 1; blk < blocks; ++blk) a += plan.partial[(blk * 3 + i) * width + e];
      parts->sums[i][e] = static_cast<float>(a);
    }
  }
}

}  // namespace shardstep::jit
