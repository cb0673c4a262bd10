// The CPU backend's Philox4x32-10 (see random_lowering.h).
#include "jit/random_lowering.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

namespace shardstep::jit {
namespace {

constexpr int kRounds = 10;
constexpr uint32_t kMulA = 0xD2511F53u, kMulB = 0xCD9E8D57u;      // round multipliers
constexpr uint32_t kBumpA = 0x9E3779B9u, kBumpB = 0xBB67AE85u;    // Weyl key increments
constexpr int64_t kBlock = 256;                                   // counters per vectorised batch

}  // namespace

void PhiloxBlocks(uint32_t k0, uint32_t k1, uint32_t* __restrict x0, uint32_t* __restrict x1, uint32_t* __restrict x2,
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
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, blocks, 16), [&](const tbb::blocked_range<int64_t>& r) {
    alignas(64) uint32_t x0[kBlock], x1[kBlock], x2[kBlock], x3[kBlock];
    for (int64_t blk = r.begin(); blk < r.end(); ++blk) {
      const int64_t begin = blk * kBlock, n = std::min(kBlock, total - begin);
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
