// Every one of the 2^32 f32 inputs through the JIT's fused exp, log, tanh and sigmoid loops
// (jit/vector_math.h): exp and log within 1 ulp of libm, tanh within 2, sigmoid within 4 of the
// interpreter's formula; special values matched by class and sign. A few minutes
// per function on one core; vector_math_test.cc samples the same checks densely.
#include <catch2/catch.hpp>

#include <vector>

#include "tests/jit/vector_math_check.h"

namespace {

using namespace shardstep;

void Exhaustive(ir::OpCode op, float (*ref)(float), int64_t bound) {
  constexpr uint64_t kChunk = uint64_t{1} << 24;
  vmcheck::UnaryKernel k(op, static_cast<int64_t>(kChunk));
  std::vector<float> x(kChunk), y(kChunk);
  vmcheck::UlpStats s;
  s.bound = bound;
  for (uint64_t base = 0; base < (uint64_t{1} << 32); base += kChunk) {
    for (uint64_t i = 0; i < kChunk; ++i) x[i] = vmcheck::FromBits(static_cast<uint32_t>(base + i));
    k.Run(x.data(), y.data(), static_cast<int64_t>(kChunk));
    for (uint64_t i = 0; i < kChunk; ++i) s.Add(x[i], y[i], ref(x[i]));
  }
  WARN(s.Summary(ir::OpName(op)));
  CHECK(s.compared == (int64_t{1} << 32));
  CHECK(s.ok());
}

}  // namespace

TEST_CASE("exp over every f32 input: within 1 ulp of libm", "[jit][vector_math][slow]") {
  Exhaustive(ir::OpCode::kExp, vmcheck::RefExp, 1);
}
TEST_CASE("log over every f32 input: within 1 ulp of libm", "[jit][vector_math][slow]") {
  Exhaustive(ir::OpCode::kLog, vmcheck::RefLog, 1);
}
TEST_CASE("tanh over every f32 input: within 2 ulp of libm", "[jit][vector_math][slow]") {
  Exhaustive(ir::OpCode::kTanh, vmcheck::RefTanh, 2);
}
// One ulp of exp can move 1 + e across a rounding boundary (vector_math_test.cc).
TEST_CASE("sigmoid over every f32 input: within 4 ulp of the interpreter's 1 / (1 + expf(-x))", "[jit][vector_math][slow]") {
  Exhaustive(ir::OpCode::kSigmoid, vmcheck::RefSigmoid, 4);
}
