// Vector types for loops written once and built for AVX-512 and for AVX2 + FMA (jit/winograd_nhwc.cc,
// jit/stem_conv.cc): a loop body (a .inc file) uses V::F and V's functions only, and its includer
// compiles it once per instruction set, each copy in its own namespace inside a `#pragma GCC target`
// region with `using V = simd::Avx512;` or `simd::Avx2;`. The functions here carry their own target
// and are always inlined into those loops; nothing here runs on a CPU without the set.
//
// Each function is one instruction's arithmetic (no fused forms beyond Fma), so a loop's result per
// lane does not depend on the lane count: the two builds of one body give the same bits.
#pragma once

#include <immintrin.h>

#include <atomic>
#include <cstdint>

namespace shardstep::jit::simd {

#define SS_SIMD_AVX512 __attribute__((target("avx512f"), always_inline)) inline
#define SS_SIMD_AVX2 __attribute__((target("avx2,fma"), always_inline)) inline

struct Avx512 {
  using F = __m512;
  using Mask = __mmask16;             // lanes to load (all or none, in the loops here)
  static constexpr int64_t kLanes = 16;
  static constexpr int kRegisters = 32;
  static SS_SIMD_AVX512 F Load(const float* p) { return _mm512_loadu_ps(p); }
  static SS_SIMD_AVX512 void Store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static SS_SIMD_AVX512 Mask MaskOf(bool all) { return static_cast<Mask>(all ? 0xffff : 0); }
  static SS_SIMD_AVX512 F LoadOrZero(Mask in, const float* p) { return _mm512_maskz_loadu_ps(in, p); }
  static SS_SIMD_AVX512 F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static SS_SIMD_AVX512 F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static SS_SIMD_AVX512 F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static SS_SIMD_AVX512 F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static SS_SIMD_AVX512 F Set1(float x) { return _mm512_set1_ps(x); }
  static SS_SIMD_AVX512 F Zero() { return _mm512_setzero_ps(); }
  static SS_SIMD_AVX512 __m512i Strided(int stride) {
    return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                              _mm512_set1_epi32(stride));
  }
  // Lane l = p[l * stride]. (GCC 12's plain gather warns of its unset source operand.)
  static SS_SIMD_AVX512 F GatherStride(const float* p, int stride) {
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), 0xffff, Strided(stride), p, 4);
  }
  // p[l * stride] = lane l.
  static SS_SIMD_AVX512 void ScatterStride(float* p, int stride, F v) { _mm512_i32scatter_ps(p, Strided(stride), v, 4); }
  // Whether a lane is a NaN.
  static SS_SIMD_AVX512 bool AnyUnordered(F v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }

  // Lanes [0, n) (n clamped to [0, kLanes]), and stores to them alone.
  static SS_SIMD_AVX512 Mask FirstLanes(int64_t n) {
    return static_cast<Mask>(n >= kLanes ? 0xFFFFu : n <= 0 ? 0u : (1u << n) - 1u);
  }
  static SS_SIMD_AVX512 void StoreMasked(Mask m, float* p, F v) { _mm512_mask_storeu_ps(p, m, v); }
  // Comparisons per lane, and their logic.
  using Cmp = __mmask16;
  static SS_SIMD_AVX512 Cmp Greater(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static SS_SIMD_AVX512 Cmp IsNaN(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
  static SS_SIMD_AVX512 Cmp IsNumber(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_ORD_Q); }
  static SS_SIMD_AVX512 Cmp And(Cmp a, Cmp b) { return static_cast<Cmp>(a & b); }
  static SS_SIMD_AVX512 Cmp Or(Cmp a, Cmp b) { return static_cast<Cmp>(a | b); }
  static SS_SIMD_AVX512 Cmp AndNot(Cmp a, Cmp b) { return static_cast<Cmp>(~a & b); }  // b and not a
  static SS_SIMD_AVX512 Cmp Not(Cmp a) { return static_cast<Cmp>(~a); }
  static SS_SIMD_AVX512 F Blend(Cmp m, F a, F b) { return _mm512_mask_blend_ps(m, a, b); }  // m ? b : a
  static SS_SIMD_AVX512 F Select(Cmp m, F v) { return _mm512_maskz_mov_ps(m, v); }          // m ? v : +0
};

struct Avx2 {
  using F = __m256;
  using Mask = __m256i;
  static constexpr int64_t kLanes = 8;
  static constexpr int kRegisters = 16;
  static SS_SIMD_AVX2 F Load(const float* p) { return _mm256_loadu_ps(p); }
  static SS_SIMD_AVX2 void Store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static SS_SIMD_AVX2 Mask MaskOf(bool all) { return _mm256_set1_epi32(all ? -1 : 0); }
  static SS_SIMD_AVX2 F LoadOrZero(Mask in, const float* p) { return _mm256_maskload_ps(p, in); }
  static SS_SIMD_AVX2 F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static SS_SIMD_AVX2 F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static SS_SIMD_AVX2 F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static SS_SIMD_AVX2 F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static SS_SIMD_AVX2 F Set1(float x) { return _mm256_set1_ps(x); }
  static SS_SIMD_AVX2 F Zero() { return _mm256_setzero_ps(); }
  static SS_SIMD_AVX2 F GatherStride(const float* p, int stride) {
    const __m256i lanes = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride));
    return _mm256_i32gather_ps(p, lanes, 4);
  }
  static SS_SIMD_AVX2 void ScatterStride(float* p, int stride, F v) {  // (AVX2 has no scatter)
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (int i = 0; i < 8; ++i) p[i * stride] = lanes[i];
  }
  static SS_SIMD_AVX2 bool AnyUnordered(F v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }

  static SS_SIMD_AVX2 Mask FirstLanes(int64_t n) {
    const int clamped = n >= kLanes ? static_cast<int>(kLanes) : n <= 0 ? 0 : static_cast<int>(n);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(clamped), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static SS_SIMD_AVX2 void StoreMasked(Mask m, float* p, F v) { _mm256_maskstore_ps(p, m, v); }
  using Cmp = __m256;  // all ones or all zeros per lane
  static SS_SIMD_AVX2 Cmp Greater(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static SS_SIMD_AVX2 Cmp IsNaN(F a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
  static SS_SIMD_AVX2 Cmp IsNumber(F a) { return _mm256_cmp_ps(a, a, _CMP_ORD_Q); }
  static SS_SIMD_AVX2 Cmp And(Cmp a, Cmp b) { return _mm256_and_ps(a, b); }
  static SS_SIMD_AVX2 Cmp Or(Cmp a, Cmp b) { return _mm256_or_ps(a, b); }
  static SS_SIMD_AVX2 Cmp AndNot(Cmp a, Cmp b) { return _mm256_andnot_ps(a, b); }
  static SS_SIMD_AVX2 Cmp Not(Cmp a) { return _mm256_xor_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(-1))); }
  static SS_SIMD_AVX2 F Blend(Cmp m, F a, F b) { return _mm256_blendv_ps(a, b, m); }
  static SS_SIMD_AVX2 F Select(Cmp m, F v) { return _mm256_and_ps(m, v); }
};

#undef SS_SIMD_AVX512
#undef SS_SIMD_AVX2

// The widest of the two this CPU runs (read once per process): 16 or 8 lanes, or 0 for neither; or the
// narrower one a test asked for (LanesForTesting).
inline std::atomic<int64_t>& LanesForTesting() {  // 0: the CPU's choice
  static std::atomic<int64_t> lanes{0};
  return lanes;
}
inline int64_t CpuLanes() {
  static const int64_t cpu = __builtin_cpu_supports("avx512f")                                         ? 16
                             : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 8
                                                                                                 : 0;
  const int64_t asked = LanesForTesting().load(std::memory_order_relaxed);
  return asked > 0 && asked < cpu ? asked : cpu;
}

}  // namespace shardstep::jit::simd
