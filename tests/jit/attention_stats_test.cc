// jit/attention.h AttentionStats: the backward recomputing its probabilities in one pass from the
// forward's softmax statistics gives the bits of the three passes without them: the AVX-512 loops
// (t = 32) and the generic ones (t = 24), causal or not, f32 and bf16 (operands in f32 and stored as
// bf16), a NaN in q included. And CompiledStep pairs an attention_grad with its forward
// (PlanAttentionStats) only when they share q, k, v and attributes, with the interpreter's values.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ir/builder.h"
#include "jit/attention.h"
#include "jit/compiled_step.h"
#include "runtime/interpreter.h"
#include "runtime/tensor.h"
#include "tests/jit/attention_test_util.h"

using namespace shardstep;
using attention_test::Random;

namespace {


// The forward (writing statistics when `stats`) and the backward (reading them), on operands in f32 or
// stored as bf16.
std::vector<float> Backward(const jit::AttentionShape& s, const std::vector<std::vector<float>>& x, bool stats) {
  const int64_t n = s.heads * s.t * s.d;
  std::vector<float> out(n), grad(3 * n), st(2 * s.heads * s.t, -1.0f);
  jit::AttentionStats io{st.data(), st.data() + s.heads * s.t};
  const jit::AttentionStats* p = stats ? &io : nullptr;
  std::vector<std::vector<uint16_t>> h(4);
  std::vector<const void*> ptr(4);
  for (int i = 0; i < 4; ++i) {
    if (s.stored_bf16[i]) {
      for (float v : x[i]) h[i].push_back(runtime::F32ToBf16(v));
      ptr[i] = h[i].data();
    } else {
      ptr[i] = x[i].data();
    }
  }
  jit::AttentionForward(s, ptr[0], ptr[1], ptr[2], out.data(), p);
  if (stats) {  // every query's statistics were written (the forward wrote the whole array)
    int64_t unwritten = 0;
    for (float v : st) unwritten += v == -1.0f;
    CHECK(unwritten == 0);
  }
  jit::AttentionBackward(s, ptr[0], ptr[1], ptr[2], ptr[3], grad.data(), nullptr, p);
  return grad;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_CASE("attention_grad from the forward's softmax statistics: the bits of the three passes", "[jit][attention]") {
  for (const int64_t t : {32, 24})
    for (const bool causal : {true, false})
      for (const int precision : {0, 1, 2}) {  // f32; bf16 on f32 operands; bf16 on operands stored as bf16
        for (const bool nan : {false, true}) {
          jit::AttentionShape s;
          s.heads = 8, s.t = t, s.d = 16, s.scale = 0.25f, s.causal = causal, s.bf16 = precision > 0;
          s.stored_bf16.fill(precision == 2);
          const int64_t n = s.heads * s.t * s.d;
          std::vector<std::vector<float>> x = {Random(n, 1, 3), Random(n, 2, 3), Random(n, 3, 3), Random(n, 4, 3)};
          if (nan) x[0][3 * s.t * s.d + 5 * s.d + 2] = std::numeric_limits<float>::quiet_NaN();  // head 3, query 5
          INFO("t " << t << (causal ? " causal" : "") << " precision " << precision << (nan ? " NaN in q" : ""));
          const std::vector<float> with = Backward(s, x, true), without = Backward(s, x, false);
          CHECK(SameBits(with, without));
          double sum = 0;
          int64_t nans = 0;
          for (float v : with) std::isnan(v) ? ++nans : sum += std::fabs(v);
          CHECK(sum > 0);               // not a vacuous comparison
          CHECK((nans > 0) == nan);     // the NaN reaches the gradients, the same way in both
        }
      }
}

// One attention layer's forward and gradient in a module: paired when the gradient reads the forward's
// q, k, v with the same attributes; a gradient with another scale is not.
TEST_CASE("CompiledStep pairs an attention_grad with its forward only on the same operands and attributes", "[jit][attention]") {
  for (const bool other_scale : {false, true}) {
    ir::Module m;
    ir::Builder b(&m);
    const ir::TensorType type{ir::DType::kF32, {2, 4, 32, 16}};
    std::vector<ir::ValueId> x;
    for (const char* name : {"q", "k", "v", "dout"}) x.push_back(b.Input(name, type));
    const ir::Attrs attrs = {{"scale", 0.25}, {"causal", int64_t{1}}};
    const ir::Attrs grad_attrs = {{"scale", other_scale ? 0.5 : 0.25}, {"causal", int64_t{1}}};
    m.outputs.push_back({"out", b.Emit(ir::OpCode::kAttention, {x[0], x[1], x[2]}, attrs)});
    m.outputs.push_back({"grad", b.Emit(ir::OpCode::kAttentionGrad, x, grad_attrs)});
    runtime::TensorMap inputs;
    uint32_t seed = 1;
    for (const char* name : {"q", "k", "v", "dout"}) inputs[name] = runtime::Tensor::F32(type.shape, Random(type.elements(), seed++, 3));
    auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
    INFO((other_scale ? "another scale" : "the same attributes"));
    CHECK(step->info().attention_stats == (other_scale ? 0 : 1));
    runtime::TensorMap vars;
    jit::Workspace ws;
    const runtime::TensorMap got = step->Run(vars, inputs, 0, nullptr, &ws);
    const std::vector<runtime::Tensor> want = runtime::EvaluateAll(m, {}, inputs);
    const std::vector<float>& g = got.at("grad").f32;
    const std::vector<float>& r = want[m.outputs[1].second].f32;
    REQUIRE(g.size() == r.size());
    int64_t off = 0;  // outside 1e-4 + 1e-3 |r| (the products' and exp's rounding differ from the interpreter's)
    for (size_t i = 0; i < g.size(); ++i) off += !(std::fabs(double(g[i]) - r[i]) <= 1e-4 + 1e-3 * std::fabs(r[i]));
    CHECK(off == 0);
  }
}

}  // namespace

// The softmax loops' vector forms (AVX-512: 16 queries a vector, AVX2: 8) against their generic form,
// one query at a time: the same bits in the forward's output and statistics and in the gradient, for
// f32 and bf16, causal or not, from statistics or not, t a multiple of 16 or only of 8, a NaN score.
TEST_CASE("attention's vector softmax loops give the generic form's bits", "[jit][attention]") {
  struct Generic {
    explicit Generic(bool on) { jit::GenericSoftmaxForTesting(on); }
    ~Generic() { jit::GenericSoftmaxForTesting(false); }
  };
  for (const int64_t t : {32, 24, 128})
    for (const bool causal : {true, false})
      for (const int precision : {0, 1})
        for (const bool nan : {false, true}) {
          jit::AttentionShape s;
          s.heads = 4, s.t = t, s.d = 16, s.scale = 0.25f, s.causal = causal, s.bf16 = precision > 0;
          const int64_t n = s.heads * s.t * s.d;
          std::vector<std::vector<float>> x = {Random(n, 11, 3), Random(n, 12, 3), Random(n, 13, 3), Random(n, 14, 3)};
          if (nan) x[1][2 * s.t * s.d + 3 * s.d + 1] = std::numeric_limits<float>::quiet_NaN();  // head 2, key 3
          INFO("t " << t << (causal ? " causal" : "") << " precision " << precision << (nan ? " NaN in k" : ""));
          std::vector<float> out[2], grad[2], grad_stats[2], max[2], inv_sum[2];
          for (int generic = 0; generic < 2; ++generic) {
            const Generic mode(generic == 1);
            out[generic].assign(n, 0.0f);
            max[generic].assign(s.heads * t, 0.0f);
            inv_sum[generic].assign(s.heads * t, 0.0f);
            jit::AttentionStats st{max[generic].data(), inv_sum[generic].data()};
            jit::AttentionForward(s, x[0].data(), x[1].data(), x[2].data(), out[generic].data(), &st);
            grad[generic].assign(3 * n, 0.0f);
            jit::AttentionBackward(s, x[0].data(), x[1].data(), x[2].data(), x[3].data(), grad[generic].data());
            grad_stats[generic].assign(3 * n, 0.0f);
            jit::AttentionBackward(s, x[0].data(), x[1].data(), x[2].data(), x[3].data(), grad_stats[generic].data(),
                                   nullptr, &st);
          }
          CHECK(SameBits(out[0], out[1]));
          CHECK(SameBits(max[0], max[1]));
          CHECK(SameBits(inv_sum[0], inv_sum[1]));
          CHECK(SameBits(grad[0], grad[1]));
          CHECK(SameBits(grad_stats[0], grad_stats[1]));
          double sum = 0;
          int64_t nans = 0;
          for (float v : grad[0]) std::isnan(v) ? ++nans : sum += std::fabs(v);
          CHECK(sum > 0);  // not a vacuous comparison
          CHECK((nans > 0) == nan);
        }
}
