// Causal attention_grad (ir/ops.def): a masked score (key after query) is no function of q or k, so its
// gradient is 0 and its dP (dout . v of a later key) takes no part in the row's sum. With the last
// value row infinite, the queries before it keep finite dq, in the interpreter and in
// jit/attention.h, which also skips the masked keys' work (each block of 16 queries stops at its last
// query's key): the AVX-512 loops (t = 32) and the generic ones (t = 24), f32 and bf16, against the
// interpreter within the conformance tolerance. Without the rule, 0 x inf makes every row's sum NaN.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ir/builder.h"
#include "jit/attention.h"
#include "runtime/interpreter.h"
#include "runtime/tensor.h"
#include "tests/jit/attention_test_util.h"

using namespace shardstep;
using attention_test::Random;

namespace {


// The interpreter's attention_grad of one head ([1, t, d] operands), [3, 1, t, d].
std::vector<float> Reference(int64_t t, int64_t d, float scale, bool bf16, const std::vector<float>& q,
                             const std::vector<float>& k, const std::vector<float>& v, const std::vector<float>& dout) {
  ir::Module m;
  ir::Builder b(&m);
  const ir::TensorType type{ir::DType::kF32, {1, t, d}};
  runtime::TensorMap inputs;
  std::vector<ir::ValueId> operands;
  const std::vector<const std::vector<float>*> data = {&q, &k, &v, &dout};
  for (int i = 0; i < 4; ++i) {
    const std::string name = "x" + std::to_string(i);
    operands.push_back(b.Input(name, type));
    inputs[name] = runtime::Tensor::F32(type.shape, *data[i]);
  }
  const ir::ValueId g = b.Emit(ir::OpCode::kAttentionGrad, operands,
                               {{"scale", double{scale}}, {"causal", int64_t{1}}, {"bf16", int64_t{bf16}}});
  return runtime::EvaluateAll(m, {}, inputs)[g].f32;
}

TEST_CASE("causal attention_grad: masked scores take no part, an infinite later value row included", "[jit][attention]") {
  for (const int64_t t : {32, 24}) {
    for (const bool bf16 : {false, true}) {
      const int64_t d = 8, n = t * d;
      const float scale = 0.35f;
      INFO("t " << t << (bf16 ? ", bf16" : ", f32"));
      const std::vector<float> q = Random(n, 1), k = Random(n, 2), dout = Random(n, 4);
      std::vector<float> v = Random(n, 3);
      for (int64_t c = 0; c < d; ++c) v[(t - 1) * d + c] = std::numeric_limits<float>::infinity();  // the last key's value
      const std::vector<float> want = Reference(t, d, scale, bf16, q, k, v, dout);
      jit::AttentionShape s;
      s.heads = 1, s.t = t, s.d = d, s.scale = scale, s.causal = true, s.bf16 = bf16;
      std::vector<float> got(3 * n);
      jit::AttentionBackward(s, q.data(), k.data(), v.data(), dout.data(), got.data());
      // dq of every query but the last (the only one that sees the infinite value) is finite in both,
      // and they agree; dv of every key too (no v enters it). (dk takes the last query's non-finite
      // row of ds into every key's sum.)
      int64_t finite = 0, checked = 0;
      for (int part : {0, 2})
        for (int64_t r = 0; r < (part == 0 ? t - 1 : t); ++r)
          for (int64_t c = 0; c < d; ++c) {
            const int64_t i = part * n + r * d + c;
            ++checked;
            finite += std::isfinite(want[i]) && std::isfinite(got[i]);
            const double tol = 1e-4 + (bf16 ? 2e-2 : 1e-4) * std::fabs(want[i]);
            if (std::isfinite(want[i]) && std::isfinite(got[i]) && std::fabs(got[i] - want[i]) > tol)
              FAIL_CHECK("element " << i << ": got " << got[i] << ", interpreter " << want[i]);
          }
      CHECK(finite == checked);
    }
  }
}

}  // namespace
