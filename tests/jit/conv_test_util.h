// Helpers the convolution tests share: random operands, their absolute values (the interpreter on
// |inputs| gives a contraction's conformance scale) and a bitwise comparison.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>

#include "runtime/interpreter.h"

namespace shardstep::conv_test {

// f32 values uniform in [-1, 1) from a seeded generator.
inline runtime::Tensor RandomF32(ir::Shape s, uint32_t seed) {
  runtime::Tensor t(ir::TensorType{ir::DType::kF32, std::move(s)});
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  for (float& v : t.f32) v = u(rng);
  return t;
}

inline runtime::TensorMap Abs(runtime::TensorMap in) {
  for (auto& [name, t] : in)
    for (float& v : t.f32) v = std::abs(v);
  return in;
}

inline bool SameBits(const runtime::Tensor& a, const runtime::Tensor& b) {
  return a.type == b.type && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

}  // namespace shardstep::conv_test
