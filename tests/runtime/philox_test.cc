// random_uniform: Philox4x32-10 against Random123's known-answer vectors, for the interpreter's
// implementation (runtime/philox.h) and the JIT's own (jit/random_lowering.h); the two backends agree
// bitwise; splitting a batch across replicas (first_example) does not change an example's values; and
// tests/parity/philox.py (numpy, uint64) reproduces a tensor the interpreter produced.
#include <catch2/catch.hpp>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ir/builder.h"
#include "jit/compiled_step.h"
#include "jit/random_lowering.h"
#include "runtime/interpreter.h"
#include "runtime/philox.h"

namespace shardstep {
namespace {

using ir::DType;
using runtime::Tensor;
using runtime::TensorMap;

struct Kat {
  std::array<uint32_t, 4> counter;
  std::array<uint32_t, 2> key;
  std::array<uint32_t, 4> expected;
};

// Random123 kat_vectors, philox4x32 with 10 rounds.
const Kat kKats[] = {
    {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
    {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
     {0xffffffff, 0xffffffff},
     {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
     {0xa4093822, 0x299f31d0},
     {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
};

TEST_CASE("Philox4x32-10 matches Random123's known answers (interpreter and JIT implementations)", "[philox]") {
  for (const Kat& k : kKats) {
    INFO("counter " << std::hex << k.counter[0] << " key " << k.key[0]);
    CHECK(runtime::Philox4x32_10(k.counter, k.key) == k.expected);
    CHECK(jit::Philox4x32x10(k.counter, k.key) == k.expected);
  }
  // The vectorised form over many counters gives each counter's block.
  std::vector<uint32_t> x0, x1, x2, x3;
  for (int rep = 0; rep < 100; ++rep)
    for (const Kat& k : kKats) {
      if (k.key != kKats[2].key) continue;
      x0.push_back(k.counter[0]), x1.push_back(k.counter[1]), x2.push_back(k.counter[2]), x3.push_back(k.counter[3]);
    }
  jit::PhiloxBlocks(kKats[2].key[0], kKats[2].key[1], x0.data(), x1.data(), x2.data(), x3.data(),
                    static_cast<int64_t>(x0.size()));
  for (size_t i = 0; i < x0.size(); ++i) {
    CHECK(std::array<uint32_t, 4>{x0[i], x1[i], x2[i], x3[i]} == kKats[2].expected);
    if (x0[i] != kKats[2].expected[0]) break;
  }
}

TEST_CASE("Philox4x32-10 over many counters at once gives each counter's block (vector groups and tail)", "[philox]") {
  const std::array<uint32_t, 2> key{0xA4093822u, 0x299F31D0u};
  for (int64_t count : {1, 15, 16, 17, 100, 256}) {
    CAPTURE(count);
    std::vector<uint32_t> x0(count), x1(count), x2(count), x3(count);
    for (int64_t i = 0; i < count; ++i)  // distinct counters, every word varying
      x0[i] = static_cast<uint32_t>(i * 2654435761u), x1[i] = static_cast<uint32_t>(i + 7),
      x2[i] = 0xFFFFFFFFu - static_cast<uint32_t>(i), x3[i] = static_cast<uint32_t>(i * i);
    const std::vector<uint32_t> c0 = x0, c1 = x1, c2 = x2, c3 = x3;
    jit::PhiloxBlocks(key[0], key[1], x0.data(), x1.data(), x2.data(), x3.data(), count);
    for (int64_t i = 0; i < count; ++i) {
      const auto want = runtime::Philox4x32_10({c0[i], c1[i], c2[i], c3[i]}, key);
      CHECK(std::array<uint32_t, 4>{x0[i], x1[i], x2[i], x3[i]} == want);
      if (x0[i] != want[0]) break;
    }
  }
}

// random_uniform(step, first_example){seed, shape} as a one-op module.
struct Program {
  ir::Module m;
  explicit Program(const ir::Shape& shape, uint64_t seed) {
    ir::Builder b(&m);
    ir::ValueId step = b.Input("step", {DType::kS32, {}}), first = b.Input("first", {DType::kS32, {}});
    m.outputs.push_back({"u", b.RandomUniform(step, first, shape, seed)});
  }
  static TensorMap Inputs(int32_t step, int32_t first) {
    return {{"step", Tensor::S32({}, {step})}, {"first", Tensor::S32({}, {first})}};
  }
  std::vector<float> Interpret(int32_t step, int32_t first) const {
    TensorMap vars;
    return runtime::RunStep(m, vars, Inputs(step, first)).at("u").f32;
  }
  std::vector<float> Jit(int32_t step, int32_t first) const {
    auto compiled = jit::CompiledStep::Compile(m, jit::JitOptions{"", /*disk_cache=*/false});
    jit::Workspace ws;
    TensorMap vars;
    return compiled->Run(vars, Inputs(step, first), 0, nullptr, &ws).at("u").f32;
  }
};

TEST_CASE("random_uniform: the contract's formula, on both backends, bitwise", "[philox]") {
  const uint64_t seed = (uint64_t{0x0123} << 32) | 0x89abcdefu;
  const Program p({6, 2, 3}, seed);
  const std::vector<float> ref = p.Interpret(11, 40), got = p.Jit(11, 40);
  REQUIRE(ref.size() == 36);
  CHECK(std::memcmp(ref.data(), got.data(), ref.size() * 4) == 0);
  for (int64_t i = 0; i < 6; ++i)
    for (int64_t j = 0; j < 6; ++j) {
      const auto w = runtime::Philox4x32_10({static_cast<uint32_t>(j), static_cast<uint32_t>(40 + i), 11u, 0u},
                                            {0x89abcdefu, 0x0123u});
      CHECK(ref[i * 6 + j] == static_cast<float>(w[0] >> 8) / 16777216.0f);
    }
  double mean = 0;
  const Program big({64, 1000}, 42);
  const std::vector<float> u = big.Jit(0, 0);
  for (float v : u) {
    REQUIRE(v >= 0.0f);
    REQUIRE(v < 1.0f);
    mean += v;
  }
  CHECK(mean / u.size() == Approx(0.5).margin(0.005));
  CHECK(big.Interpret(0, 0) == u);
  CHECK(big.Jit(1, 0) != u);  // the step changes the stream
}

TEST_CASE("random_uniform: the JIT's vector groups equal the interpreter at every shape", "[philox]") {
  // Examples of 16 elements and more run in groups of 16 with the counters made in registers: groups
  // that cross examples, blocks ending in a partial group, a first example past 0, examples shorter
  // than a group (scalar), and 2^31 - 1 as the first example (the example word wraps).
  const uint64_t seed = (uint64_t{0xfeed} << 32) | 0xbeefu;
  for (const auto& [shape, first] : std::vector<std::pair<ir::Shape, int32_t>>{
           {{7, 3, 11}, 5}, {{3, 16}, 0}, {{2, 17}, 9}, {{300, 9}, 2}, {{5, 1000}, 0}, {{4, 40}, 2147483646}}) {
    CAPTURE(shape, first);
    const Program p(shape, seed);
    const std::vector<float> ref = p.Interpret(4, first), got = p.Jit(4, first);
    REQUIRE(ref.size() == got.size());
    CHECK(std::memcmp(ref.data(), got.data(), ref.size() * 4) == 0);
  }
}

TEST_CASE("random_uniform: splitting the batch across replicas does not change an example's values", "[philox]") {
  const uint64_t seed = 7;
  const std::vector<float> whole = Program({8, 5}, seed).Interpret(3, 0);
  for (int parts : {2, 4, 8}) {
    const int per = 8 / parts;
    const Program part({per, 5}, seed);
    std::vector<float> joined, joined_jit;
    for (int r = 0; r < parts; ++r) {
      const std::vector<float> a = part.Interpret(3, r * per), b = part.Jit(3, r * per);
      joined.insert(joined.end(), a.begin(), a.end());
      joined_jit.insert(joined_jit.end(), b.begin(), b.end());
    }
    INFO(parts << " replicas");
    CHECK(joined == whole);
    CHECK(joined_jit == whole);
  }
}

std::string Run(const std::string& command, int* status) {
  std::string out;
  FILE* f = popen(command.c_str(), "r");
  REQUIRE(f != nullptr);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  *status = pclose(f);
  return out;
}

TEST_CASE("tests/parity/philox.py reproduces the interpreter's random_uniform bit for bit", "[philox][parity]") {
  const std::string script = std::string("/usr/bin/python3 ") + SS_SOURCE_DIR + "/tests/parity/philox.py";
  int status = -1;
  const std::string self = Run(script + " --self-test", &status);
  INFO(self);
  REQUIRE(status == 0);
  const uint64_t seed = (uint64_t{3} << 48) + (uint64_t{0xdead} << 16) + 5;  // both key words non-zero
  const Program p({5, 3, 4}, seed);
  const std::vector<float> ref = p.Interpret(-2, 2147483646);  // step and examples wrap as uint32
  const std::string out =
      Run(script + " --seed " + std::to_string(seed) + " --step -2 --first-example 2147483646 --shape 5,3,4", &status);
  REQUIRE(status == 0);
  std::vector<uint32_t> bits;
  for (size_t at = 0; at + 8 <= out.size(); at += 9) bits.push_back(static_cast<uint32_t>(std::stoul(out.substr(at, 8), nullptr, 16)));
  REQUIRE(bits.size() == ref.size());
  int differ = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    uint32_t r;
    std::memcpy(&r, &ref[i], 4);
    differ += r != bits[i];
  }
  CHECK(differ == 0);
}

}  // namespace
}  // namespace shardstep

namespace shardstep {
namespace {

// Figures for the report (hidden): dropout-sized random_uniform and attention-sized batched matmul.
TEST_CASE("random_uniform and batched matmul throughput on the JIT", "[.][perf]") {
  auto time_step = [](const ir::Module& m, const TensorMap& inputs, int reps) {
    auto compiled = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
    jit::Workspace ws;
    TensorMap vars;
    compiled->Run(vars, inputs, 0, nullptr, &ws);  // allocates the workspace
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) compiled->Run(vars, inputs, 0, nullptr, &ws);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
  };
  {
    const Program p({64, 128, 256}, 99);
    const double s = time_step(p.m, Program::Inputs(5, 0), 5);
    WARN("random_uniform f32[64,128,256] (2.1M values) on the JIT: " << s * 1e3 << " ms");
  }
  {
    ir::Module m;
    ir::Builder b(&m);
    auto q = b.Input("q", {DType::kF32, {64, 4, 128, 64}}), k = b.Input("k", {DType::kF32, {64, 4, 128, 64}});
    m.outputs.push_back({"s", b.Matmul(q, k, false, true)});
    TensorMap in{{"q", Tensor(ir::TensorType{DType::kF32, {64, 4, 128, 64}})},
                 {"k", Tensor(ir::TensorType{DType::kF32, {64, 4, 128, 64}})}};
    const double s = time_step(m, in, 5);
    WARN("batched matmul [64,4,128,64] x [64,4,128,64]^T on the JIT: " << s * 1e3 << " ms, "
         << 2.0 * 64 * 4 * 128 * 128 * 64 / s * 1e-9 << " GFLOP/s");
  }
}

}  // namespace
}  // namespace shardstep
