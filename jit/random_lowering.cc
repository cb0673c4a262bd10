// The CPU backend's Philox4x32-10 (see random_lowering.h).
#include "jit/random_lowering.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <immintrin.h>

namespace shardstep::jit {
namespace {

constexpr int kRounds = 10;
constexpr uint32_t kMulA = 0xD2511F53u, kMulB = 0xCD9E8D57u;      // round multipliers
constexpr uint32_t kBumpA = 0x9E3779B9u, kBumpB = 0xBB67AE85u;    // Weyl key increments
constexpr int64_t kBlock = 256;                                   // counters per batch

void PhiloxScalar(uint32_t k0, uint32_t k1, uint32_t* __restrict x0, uint32_t* __restrict x1, uint32_t* __restrict x2,
                  uint32_t* __restrict x3, int64_t count) {
  for (int r = 0; r < kRounds; ++r) {
    // Round r uses the key bumped r times: k + r * W (mod 2^32).
    const uint32_t ka = k0 + static_cast<uint32_t>(r) * kBumpA, kb = k1 + static_cast<uint32_t>(r) * kBumpB;
    for (int64_t i = 0; i < count; ++i) {
      const uint64_t pa = static_cast<uint64_t>(x0[i]) * kMulA;
      const uint64_t pb = static_cast<uint64_t>(x2[i]) * kMulB;
      const uint32_t n0 = static_cast<uint32_t>(pb >> 32) ^ x1[i] ^ ka;
      const uint32_t n2 = static_cast<uint32_t>(pa >> 32) ^ x3[i] ^ kb;
      x1[i] = static_cast<uint32_t>(pb);
      x3[i] = static_cast<uint32_t>(pa);
      x0[i] = n0;
      x2[i] = n2;
    }
  }
}

// AVX2. GCC's own vectorisation of the scalar loop's 64-bit products ran slower than the scalar loop
// on a Zen 3 guest; these registers-only rounds with the counters made in registers are 2.3x faster
// there (random_uniform [32, 64, 128] on 2 threads, medians: 0.97 -> 0.42 ms; BERT's step draws 7 such
// dropout masks).

// The high and low words of x * m for 8 words at once (vpmuludq multiplies the even words; the odd
// ones are shifted down first).
struct HiLo {
  __m256i hi, lo;
};
__attribute__((target("avx2"))) inline HiLo MulHiLo(__m256i x, __m256i m) {
  const __m256i even = _mm256_mul_epu32(x, m);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), m);
  return {_mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA),
          _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA)};
}

__attribute__((target("avx2"))) inline __m256i Load8(const uint32_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
__attribute__((target("avx2"))) inline void Store8(uint32_t* p, __m256i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
}

constexpr int kVectors = 2, kGroup = 8 * kVectors;  // two vectors in flight: the rounds are one dependency chain

// Philox4x32-10 of kGroup counters held in registers: words 0..3 of counter 8 h + lane in x0..x3[h].
__attribute__((target("avx2"))) inline void PhiloxRegisters(uint32_t k0, uint32_t k1, __m256i* x0, __m256i* x1,
                                                            __m256i* x2, __m256i* x3) {
  const __m256i ma = _mm256_set1_epi32(static_cast<int>(kMulA)), mb = _mm256_set1_epi32(static_cast<int>(kMulB));
  for (int r = 0; r < kRounds; ++r) {
    const __m256i ka = _mm256_set1_epi32(static_cast<int>(k0 + static_cast<uint32_t>(r) * kBumpA));
    const __m256i kb = _mm256_set1_epi32(static_cast<int>(k1 + static_cast<uint32_t>(r) * kBumpB));
    for (int h = 0; h < kVectors; ++h) {
      const HiLo pa = MulHiLo(x0[h], ma), pb = MulHiLo(x2[h], mb);
      x0[h] = _mm256_xor_si256(_mm256_xor_si256(pb.hi, x1[h]), ka);
      x2[h] = _mm256_xor_si256(_mm256_xor_si256(pa.hi, x3[h]), kb);
      x1[h] = pb.lo;
      x3[h] = pa.lo;
    }
  }
}

// The counters in groups of kGroup; returns how many it did.
__attribute__((target("avx2"))) int64_t PhiloxAvx2(uint32_t k0, uint32_t k1, uint32_t* x0, uint32_t* x1,
                                                    uint32_t* x2, uint32_t* x3, int64_t count) {
  const int64_t done = count / kGroup * kGroup;
  for (int64_t i = 0; i < done; i += kGroup) {
    __m256i a0[kVectors], a1[kVectors], a2[kVectors], a3[kVectors];
    for (int h = 0; h < kVectors; ++h) {
      const int64_t at = i + 8 * h;
      a0[h] = Load8(x0 + at), a1[h] = Load8(x1 + at), a2[h] = Load8(x2 + at), a3[h] = Load8(x3 + at);
    }
    PhiloxRegisters(k0, k1, a0, a1, a2, a3);
    for (int h = 0; h < kVectors; ++h) {
      const int64_t at = i + 8 * h;
      Store8(x0 + at, a0[h]), Store8(x1 + at, a1[h]), Store8(x2 + at, a2[h]), Store8(x3 + at, a3[h]);
    }
  }
  return done;
}

// random_uniform's elements [begin, begin + n) in groups of kGroup, the counters made in registers
// (j and the example advance by kGroup a group; with per_example >= kGroup a lane wraps at most once)
// and the floats stored directly; returns how many it did. The scalar form's per-element counter walk
// and its four arrays cost as much as the rounds.
__attribute__((target("avx2"))) int64_t UniformAvx2(uint32_t k0, uint32_t k1, int32_t step, int32_t first_example,
                                                     int64_t per_example, int64_t begin, int64_t n, float* out) {
  const int64_t done = n / kGroup * kGroup;
  if (done == 0 || per_example < kGroup) return 0;
  alignas(32) uint32_t j0[kGroup], e0[kGroup];
  for (int l = 0; l < kGroup; ++l) {
    j0[l] = static_cast<uint32_t>((begin + l) % per_example);
    e0[l] = static_cast<uint32_t>(first_example) + static_cast<uint32_t>((begin + l) / per_example);
  }
  __m256i j[kVectors], e[kVectors];
  for (int h = 0; h < kVectors; ++h) j[h] = Load8(j0 + 8 * h), e[h] = Load8(e0 + 8 * h);
  const __m256i group = _mm256_set1_epi32(kGroup), pe = _mm256_set1_epi32(static_cast<int32_t>(per_example));
  const __m256i last = _mm256_set1_epi32(static_cast<int32_t>(per_example - 1)), one = _mm256_set1_epi32(1);
  const __m256i st = _mm256_set1_epi32(step), zero = _mm256_setzero_si256();
  const __m256 scale = _mm256_set1_ps(0x1p-24f);
  for (int64_t i = 0; i < done; i += kGroup) {
    __m256i a0[kVectors], a1[kVectors], a2[kVectors], a3[kVectors];
    for (int h = 0; h < kVectors; ++h) a0[h] = j[h], a1[h] = e[h], a2[h] = st, a3[h] = zero;
    PhiloxRegisters(k0, k1, a0, a1, a2, a3);
    for (int h = 0; h < kVectors; ++h) {
      // (x0 >> 8) < 2^24 converts exactly, and times 2^-24 is exact.
      const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a0[h], 8)), scale);
      _mm256_storeu_ps(out + i + 8 * h, u);
      // The next group: j += kGroup; where it passes the example's end, j -= per_example and the
      // example word goes up by one (mod 2^32). j < 2^31: a tensor's elements.
      j[h] = _mm256_add_epi32(j[h], group);
      const __m256i wrap = _mm256_cmpgt_epi32(j[h], last);
      j[h] = _mm256_sub_epi32(j[h], _mm256_and_si256(wrap, pe));
      e[h] = _mm256_add_epi32(e[h], _mm256_and_si256(wrap, one));
    }
  }
  return done;
}

bool HasAvx2() {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
}

}  // namespace

void PhiloxBlocks(uint32_t k0, uint32_t k1, uint32_t* x0, uint32_t* x1, uint32_t* x2, uint32_t* x3, int64_t count) {
  const int64_t done = HasAvx2() ? PhiloxAvx2(k0, k1, x0, x1, x2, x3, count) : 0;
  PhiloxScalar(k0, k1, x0 + done, x1 + done, x2 + done, x3 + done, count - done);
}

std::array<uint32_t, 4> Philox4x32x10(std::array<uint32_t, 4> c, std::array<uint32_t, 2> key) {
  PhiloxBlocks(key[0], key[1], &c[0], &c[1], &c[2], &c[3], 1);
  return c;
}

void RandomUniform(uint64_t seed, int32_t step, int32_t first_example, const ir::Shape& shape, float* out) {
  const int64_t total = ir::NumElements(shape);
  int64_t per_example = 1;
  for (size_t d = 1; d < shape.size(); ++d) per_example *= shape[d];
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  const int64_t blocks = (total + kBlock - 1) / kBlock;
  const bool avx2 = HasAvx2();
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, blocks, 16), [&](const tbb::blocked_range<int64_t>& r) {
    alignas(64) uint32_t x0[kBlock], x1[kBlock], x2[kBlock], x3[kBlock];
    for (int64_t blk = r.begin(); blk < r.end(); ++blk) {
      int64_t begin = blk * kBlock, n = std::min(kBlock, total - begin);
      if (avx2) {
        const int64_t done = UniformAvx2(k0, k1, step, first_example, per_example, begin, n, out + begin);
        begin += done, n -= done;
      }
      int64_t e = begin / per_example, j = begin % per_example;  // walked incrementally: no division per element
      for (int64_t i = 0; i < n; ++i) {
        x0[i] = static_cast<uint32_t>(j);
        x1[i] = static_cast<uint32_t>(first_example) + static_cast<uint32_t>(e);
        x2[i] = static_cast<uint32_t>(step);
        x3[i] = 0;
        if (++j == per_example) j = 0, ++e;
      }
      PhiloxBlocks(k0, k1, x0, x1, x2, x3, n);
      for (int64_t i = 0; i < n; ++i) out[begin + i] = static_cast<float>(x0[i] >> 8) * 0x1p-24f;
    }
  });
}

}  // namespace shardstep::jit
