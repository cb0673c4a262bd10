// The bf16 x bf16 -> f32 matmul (jit/dnnl_kernels.h ParallelBf16Matmul) against a float64 reference on
// bf16-valued operands, every transpose, batched and split into row blocks; its bits across calls and
// thread counts; and the JIT running the mixed-precision pass's rounded matmuls through it. Every case
// runs both ways the CPU may choose (Bf16MatmulWidens): oneDNN's bf16 kernels, and f32 sgemm on the
// widened operands, which must give the bits of the step's f32 matmul on the same values.
#include <catch2/catch.hpp>
#include <tbb/global_control.h>

#include <cmath>
#include <random>
#include <vector>

#include "ir/builder.h"
#include "jit/compiled_step.h"
#include "jit/dnnl_kernels.h"
#include "runtime/tensor.h"

using namespace shardstep;

namespace {

std::vector<float> Bf16Values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(n);
  for (float& x : v) x = runtime::RoundToBf16(nd(rng));
  return v;
}

// |c - exact| <= 1e-5 * sum |a b| per element (f32 accumulation of exact products: ~k u sum |a b|).
void CheckAgainstFloat64(bool ta, bool tb, int64_t batches, int64_t m, int64_t n, int64_t k, const std::vector<float>& a,
                         const std::vector<float>& b, const std::vector<float>& c) {
  const int64_t lda = ta ? m : k, ldb = tb ? k : n;
  for (int64_t bt = 0; bt < batches; ++bt)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double exact = 0, mag = 0;
        for (int64_t p = 0; p < k; ++p) {
          const double x = a[bt * m * k + (ta ? p * lda + i : i * lda + p)];
          const double y = b[bt * k * n + (tb ? j * ldb + p : p * ldb + j)];
          exact += x * y;
          mag += std::abs(x * y);
        }
        const double got = c[bt * m * n + i * n + j];
        INFO("ta " << ta << " tb " << tb << " batch " << bt << " [" << i << "," << j << "] exact " << exact);
        REQUIRE(std::abs(got - exact) <= 1e-5 * mag + 1e-30);
      }
}

std::vector<float> Run(bool ta, bool tb, int64_t batches, int64_t m, int64_t n, int64_t k, const std::vector<float>& a,
                       const std::vector<float>& b) {
  std::vector<float> c(batches * m * n, -1.0f);
  jit::ParallelBf16Matmul(ta, tb, batches, m, n, k, a.data(), ta ? m : k, m * k, b.data(), tb ? k : n, k * n, c.data());
  return c;
}

// The ways bf16 products can run here: oneDNN's bf16 kernels (0) only where oneDNN has them
// (avx512_core), and f32 sgemm on widened operands (1) everywhere.
std::vector<int> Bf16Ways() { return jit::OnednnAvx512Core() ? std::vector<int>{0, 1} : std::vector<int>{1}; }

// Forces one way for a test case's scope (GENERATE(from_range(Bf16Ways())): each there is).
struct WidensScope {
  explicit WidensScope(int widens) { jit::SetBf16MatmulWidens(widens); }
  ~WidensScope() { jit::SetBf16MatmulWidens(-1); }
};

}  // namespace

TEST_CASE("bf16 matmul: every transpose, batched and in row blocks, within f32 accumulation of float64") {
  const int widens = GENERATE(from_range(Bf16Ways()));
  INFO("widened operands " << widens);
  const WidensScope mode(widens);
  jit::ConfigureThreadsForReplica(1);
  struct Case {
    int64_t batches, m, n, k;
  };
  // 1 block; column blocks (wider than tall), the last one short; batched; batched in 3 column blocks.
  for (const Case& s : {Case{1, 37, 29, 53}, Case{1, 203, 300, 300}, Case{3, 20, 17, 9}, Case{2, 48, 512, 256}})
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        const auto a = Bf16Values(s.batches * s.m * s.k, 1), b = Bf16Values(s.batches * s.k * s.n, 2);
        const auto c = Run(ta, tb, s.batches, s.m, s.n, s.k, a, b);
        CheckAgainstFloat64(ta, tb, s.batches, s.m, s.n, s.k, a, b, c);
      }
}

TEST_CASE("bf16 matmul: the same bits across calls and thread counts") {
  const int widens = GENERATE(from_range(Bf16Ways()));
  INFO("widened operands " << widens);
  const WidensScope mode(widens);
  jit::ConfigureThreadsForReplica(1);
  const int64_t m = 256, n = 512, k = 384;
  const auto a = Bf16Values(m * k, 3), b = Bf16Values(k * n, 4);
  const auto two = Run(false, true, 1, m, n, k, a, b);
  CHECK(Run(false, true, 1, m, n, k, a, b) == two);
  tbb::global_control one(tbb::global_control::max_allowed_parallelism, 1);
  CHECK(Run(false, true, 1, m, n, k, a, b) == two);
}

// A^T B taller than wide (a weight gradient such as transformer_lm's fc2, 512x128x4096) runs turned
// around, C^T = B^T A, then transposed: right, and the same bits on any threads.
TEST_CASE("bf16 matmul: a transposed A taller than wide runs turned around, right on any threads") {
  const int widens = GENERATE(from_range(Bf16Ways()));
  INFO("widened operands " << widens);
  const WidensScope mode(widens);
  jit::ConfigureThreadsForReplica(1);
  struct Case {
    int64_t m, n, k;
  };
  for (const Case& s : {Case{300, 37, 260}, Case{512, 128, 512}, Case{128, 63, 1024}}) {
    INFO(s.m << "x" << s.n << "x" << s.k);
    const auto a = Bf16Values(s.m * s.k, 11), b = Bf16Values(s.k * s.n, 12);
    const auto c = Run(true, false, 1, s.m, s.n, s.k, a, b);
    CheckAgainstFloat64(true, false, 1, s.m, s.n, s.k, a, b, c);
    CHECK(Run(true, false, 1, s.m, s.n, s.k, a, b) == c);
    tbb::global_control one(tbb::global_control::max_allowed_parallelism, 1);
    CHECK(Run(true, false, 1, s.m, s.n, s.k, a, b) == c);
  }
}

// Small products of a batch run several per oneDNN call (a 3D primitive): each product within f32
// accumulation of its float64 value, and the same bits whatever the threads. Not the bits each has
// alone: on AMX (oneDNN's brgemm kernels) a 3D call may block the sum over k otherwise than a 2D one.
TEST_CASE("bf16 matmul: a batch's small products grouped per call, each right, the same bits on any threads") {
  const int widens = GENERATE(from_range(Bf16Ways()));
  INFO("widened operands " << widens);
  const WidensScope mode(widens);
  jit::ConfigureThreadsForReplica(1);
  const bool ta = GENERATE(false, true), tb = GENERATE(false, true);
  INFO("ta " << ta << " tb " << tb);
  const int64_t batches = 12, m = 40, n = 24, k = 16;  // 12 products in one call
  const auto a = Bf16Values(batches * m * k, 9), b = Bf16Values(batches * k * n, 10);
  const auto all = Run(ta, tb, batches, m, n, k, a, b);
  CheckAgainstFloat64(ta, tb, batches, m, n, k, a, b, all);
  CHECK(Run(ta, tb, batches, m, n, k, a, b) == all);
  tbb::global_control one(tbb::global_control::max_allowed_parallelism, 1);
  CHECK(Run(ta, tb, batches, m, n, k, a, b) == all);
}

TEST_CASE("bf16 matmul: operands stored as bf16 give the bits of the same values stored as f32") {
  const int widens = GENERATE(from_range(Bf16Ways()));
  INFO("widened operands " << widens);
  const WidensScope mode(widens);
  jit::ConfigureThreadsForReplica(1);
  for (int t = 0; t < 4; ++t) {
    const bool ta = t & 1, tb = t & 2;
    const int64_t batches = 2, m = 70, n = 45, k = 33;
    const auto a = Bf16Values(batches * m * k, 7), b = Bf16Values(batches * k * n, 8);
    std::vector<uint16_t> ha(a.size()), hb(b.size());
    for (size_t i = 0; i < a.size(); ++i) ha[i] = runtime::F32ToBf16(a[i]);
    for (size_t i = 0; i < b.size(); ++i) hb[i] = runtime::F32ToBf16(b[i]);
    std::vector<float> c(batches * m * n, -1.0f);
    jit::ParallelBf16Matmul(ta, tb, batches, m, n, k, ha.data(), ta ? m : k, m * k, hb.data(), tb ? k : n, k * n,
                            c.data());
    INFO("ta " << ta << " tb " << tb);
    CHECK(c == Run(ta, tb, batches, m, n, k, a, b));
  }
}

TEST_CASE("bf16 matmul: the JIT runs rounded matmuls (rank 2 and batched) through ParallelBf16Matmul") {
  const int widens = GENERATE(from_range(Bf16Ways()));
  INFO("widened operands " << widens);
  const WidensScope mode(widens);
  for (int rank : {2, 3}) {
    ir::Module m;
    m.name = "bf16mm";
    ir::Builder b(&m);
    const ir::Shape xs = rank == 2 ? ir::Shape{64, 96} : ir::Shape{3, 64, 96};
    const ir::Shape ws = rank == 2 ? ir::Shape{80, 96} : ir::Shape{3, 80, 96};
    const auto x = b.Input("x", {ir::DType::kF32, xs});
    const auto w = b.Variable("w", {ir::DType::kF32, ws}, ir::kRoleWeight);
    auto round = [&](ir::ValueId v) { return b.Convert(b.Convert(v, ir::DType::kBF16), ir::DType::kF32); };
    const auto y = b.Matmul(round(x), round(w), false, true);
    m.outputs.push_back({"y", y});
    CHECK(jit::LoweringOf(m, y) == jit::Lowering::kNative);
    // Operands not both rounded: the f32 sgemm, as before.
    CHECK(jit::LoweringOf(m, b.Matmul(x, round(w), false, true)) == (rank == 2 ? jit::Lowering::kMatmul : jit::Lowering::kNative));

    runtime::TensorMap vars{{"w", runtime::Tensor(ir::TensorType{ir::DType::kF32, ws})}};
    runtime::TensorMap inputs{{"x", runtime::Tensor(ir::TensorType{ir::DType::kF32, xs})}};
    std::mt19937 rng(5);
    std::normal_distribution<float> nd;
    for (float& v : vars["w"].f32) v = nd(rng);
    for (float& v : inputs["x"].f32) v = nd(rng);
    auto step = jit::CompiledStep::Compile(m);
    // The compiled matmul reads the bf16 values in place (2 bytes an element, no per-call conversion).
    int bf16_matmuls = 0;
    for (ir::ValueId v = 0; v < step->module().size(); ++v) {
      const ir::Instr& in = step->module().at(v);
      const ir::Module& c = step->module();
      bf16_matmuls += in.op == ir::OpCode::kMatmul && in.type.dtype == ir::DType::kF32 &&
                      c.type(in.operands[0]).dtype == ir::DType::kBF16 && c.type(in.operands[1]).dtype == ir::DType::kBF16;
    }
    CHECK(bf16_matmuls == 1);
    jit::Workspace wsp;
    const auto out = step->Run(vars, inputs, 0, nullptr, &wsp);
    std::vector<float> ra(inputs["x"].f32), rb(vars["w"].f32);
    for (float& v : ra) v = runtime::RoundToBf16(v);
    for (float& v : rb) v = runtime::RoundToBf16(v);
    CheckAgainstFloat64(false, true, rank == 2 ? 1 : 3, 64, 80, 96, ra, rb, out.at("y").f32);
  }
}

// Widened, a product is the step's f32 matmul on the same values (StepSgemm; a batch's products one
// dnnl_sgemm each): the same bits, from f32-stored and bf16-stored operands alike.
TEST_CASE("bf16 matmul widened: the bits of the f32 sgemm on the same values") {
  jit::ConfigureThreadsForReplica(1);
  const WidensScope mode(1);
  REQUIRE(jit::Bf16MatmulWidens());
  const bool ta = GENERATE(false, true), tb = GENERATE(false, true);
  INFO("ta " << ta << " tb " << tb);
  for (int64_t batches : {1, 3}) {
    const int64_t m = 48, n = 1024, k = 512;  // m = 48: an NT product StepSgemm turns around
    const auto a = Bf16Values(batches * m * k, 13), b = Bf16Values(batches * k * n, 14);
    std::vector<float> want(batches * m * n);
    for (int64_t i = 0; i < batches; ++i) {
      if (batches == 1)
        jit::StepSgemm(ta, tb, m, n, k, a.data(), ta ? m : k, b.data(), tb ? k : n, want.data());
      else
        jit::DnnlSgemm(ta, tb, m, n, k, a.data() + i * m * k, ta ? m : k, b.data() + i * k * n, tb ? k : n, 0.0f,
                       want.data() + i * m * n, n);
    }
    CHECK(Run(ta, tb, batches, m, n, k, a, b) == want);
    std::vector<uint16_t> ha(a.size()), hb(b.size());
    for (size_t i = 0; i < a.size(); ++i) ha[i] = runtime::F32ToBf16(a[i]);
    for (size_t i = 0; i < b.size(); ++i) hb[i] = runtime::F32ToBf16(b[i]);
    std::vector<float> c(want.size(), -1.0f);
    jit::ParallelBf16Matmul(ta, tb, batches, m, n, k, ha.data(), ta ? m : k, m * k, hb.data(), tb ? k : n, k * n, c.data());
    CHECK(c == want);
  }
}
