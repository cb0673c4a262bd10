// Shared by the jit/attention.h tests: uniform random operands.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace shardstep::attention_test {

// n floats uniform in [-range, range) from `seed`.
inline std::vector<float> Random(int64_t n, uint32_t seed, float range = 2) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-range, range);
  std::vector<float> x(n);
  for (float& v : x) v = u(rng);
  return x;
}

}  // namespace shardstep::attention_test
