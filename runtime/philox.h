// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; Random123),
// the reference interpreter's implementation: one block at a time, in the paper's notation. The
// CPU JIT has its own (jit/random_lowering.cc); both are tested against Random123's known answers.
#pragma once

#include <array>
#include <cstdint>

namespace shardstep::runtime {

using Philox4x32 = std::array<uint32_t, 4>;
using PhiloxKey = std::array<uint32_t, 2>;

// The 10-round Philox4x32 bijection of `counter` under `key`.
inline Philox4x32 Philox4x32_10(Philox4x32 ctr, PhiloxKey key) {
  constexpr uint64_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) key = {key[0] + kW0, key[1] + kW1};  // the key schedule: bumped between rounds
    const uint64_t p0 = kM0 * ctr[0], p1 = kM1 * ctr[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    ctr = {hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0};
  }
  return ctr;
}

// random_uniform's value (ir/ops.def) for seed S, global example e, index j within the example and
// step: word 0 of Philox4x32-10 with key (S mod 2^32, S / 2^32) and counter (j, e, step, 0), as
// (x0 >> 8) * 2^-24, exactly representable in f32 and in [0, 1).
inline float PhiloxUniform(uint64_t seed, uint32_t j, uint32_t example, uint32_t step) {
  const Philox4x32 r = Philox4x32_10({j, example, step, 0u}, {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
  return static_cast<float>(r[0] >> 8) * 0x1p-24f;
}

}  // namespace shardstep::runtime
