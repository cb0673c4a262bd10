// random_uniform on the CPU backend: the JIT's own Philox4x32-10 (Salmon et al. 2011), written
// independently of the interpreter's (runtime/philox.h) so that each checks the other; both are
// tested against Random123's known-answer vectors (tests/runtime/philox_test.cc).
#pragma once

#include <array>
#include <cstdint>

#include "ir/module.h"

namespace shardstep::jit {

// Philox4x32-10 of `count` counters held as four word arrays (x0[i], x1[i], x2[i], x3[i]), in place,
// all under key (k0, k1): in groups of 16 in AVX2 registers where the CPU has AVX2, the rest (and
// everything elsewhere) in a scalar loop.
void PhiloxBlocks(uint32_t k0, uint32_t k1, uint32_t* x0, uint32_t* x1, uint32_t* x2, uint32_t* x3, int64_t count);

// One block (for the known-answer tests).
std::array<uint32_t, 4> Philox4x32x10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// out = random_uniform(step, first_example){seed, shape = out_shape}: element (i, rest...) is word 0 of
// Philox4x32-10 with key (seed mod 2^32, seed / 2^32) and counter (j, first_example + i, step, 0),
// j = flat index of rest, as (x0 >> 8) * 2^-24. No allocation; parallel over fixed blocks.
void RandomUniform(uint64_t seed, int32_t step, int32_t first_example, const ir::Shape& out_shape, float* out);

}  // namespace shardstep::jit
