// splitmix64 (Steele et al.): tiny and fully specified, so data orders, synthetic sets and masks are
// identical on every platform and never depend on the standard library's distributions.
#pragma once

#include <cstdint>

namespace shardstep::runtime {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound), unbiased (rejection sampling).
  uint64_t Below(uint64_t bound) {
    uint64_t threshold = (0 - bound) % bound;
    for (;;) {
      uint64_t r = Next();
      if (r >= threshold) return r % bound;
    }
  }
  float UniformFloat() { return static_cast<float>(Next() >> 40) * 0x1p-24f; }     // [0, 1), 24 bits
  double UniformDouble() { return static_cast<double>(Next() >> 11) * 0x1p-53; }  // [0, 1), 53 bits

 private:
  uint64_t state_;
};

}  // namespace shardstep::runtime
