// jit/attention.h with bf16 products: the probabilities and their gradient are rounded to bf16 by the
// softmax loops that write them (one pass), and must give the bits of the separate rounding pass they
// replaced (SeparateRoundingForTesting), forward and backward, on the AVX-512 loops (t a multiple of 16,
// causal or not) and the generic ones (t = 24), with operands in f32 (rounded by the op) and stored as
// bf16; a NaN in q gives the same NaN pattern both ways. The values themselves are checked against the
// interpreter by jit_conformance_test.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "jit/attention.h"
#include "jit/dnnl_kernels.h"
#include "runtime/tensor.h"
#include "tests/jit/attention_test_util.h"

using namespace shardstep;
using attention_test::Random;

namespace {


struct Outputs {
  std::vector<float> forward, backward;
};

Outputs Run(const jit::AttentionShape& s, const std::vector<float>& q, const std::vector<float>& k,
            const std::vector<float>& v, const std::vector<float>& dout, bool separate) {
  jit::SeparateRoundingForTesting(separate);
  const int64_t n = s.heads * s.t * s.d;
  Outputs o{std::vector<float>(n), std::vector<float>(3 * n)};
  if (s.stored_bf16[0]) {
    auto bf = [](const std::vector<float>& x) {
      std::vector<uint16_t> h(x.size());
      for (size_t i = 0; i < x.size(); ++i) h[i] = runtime::F32ToBf16(x[i]);
      return h;
    };
    const auto qh = bf(q), kh = bf(k), vh = bf(v), dh = bf(dout);
    jit::AttentionForward(s, qh.data(), kh.data(), vh.data(), o.forward.data());
    jit::AttentionBackward(s, qh.data(), kh.data(), vh.data(), dh.data(), o.backward.data());
  } else {
    jit::AttentionForward(s, q.data(), k.data(), v.data(), o.forward.data());
    jit::AttentionBackward(s, q.data(), k.data(), v.data(), dout.data(), o.backward.data());
  }
  jit::SeparateRoundingForTesting(false);
  return o;
}

// How many of head 0's probabilities are subnormal floats (in double: the exact values, near enough).
int64_t SubnormalProbabilities(const jit::AttentionShape& s, const std::vector<float>& q, const std::vector<float>& k) {
  int64_t count = 0;
  for (int64_t i = 0; i < s.t; ++i) {
    const int64_t keys = s.causal ? i + 1 : s.t;
    std::vector<double> score(keys);
    for (int64_t j = 0; j < keys; ++j) {
      double dot = 0;
      for (int64_t c = 0; c < s.d; ++c) dot += double(q[i * s.d + c]) * double(k[j * s.d + c]);
      score[j] = dot * s.scale;
    }
    double top = -INFINITY, total = 0;
    for (double x : score) top = std::max(top, x);
    for (double x : score) total += std::exp(x - top);
    for (double x : score) {
      const double p = std::exp(x - top) / total;
      count += p > 0 && p < std::numeric_limits<float>::min();
    }
  }
  return count;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The ways bf16 products can run here: oneDNN's bf16 kernels (0) only where oneDNN has them
// (avx512_core), and f32 sgemm on widened operands (1) everywhere.
std::vector<int> Bf16Ways() { return jit::OnednnAvx512Core() ? std::vector<int>{0, 1} : std::vector<int>{1}; }

}  // namespace

TEST_CASE("bf16 attention: rounding in the softmax loops gives the separate pass's bits") {
  // Every way the CPU may run bf16 products: oneDNN bf16, or f32 on the widened operands.
  const int widens = GENERATE(from_range(Bf16Ways()));
  INFO("widened operands " << widens);
  jit::SetBf16MatmulWidens(widens);
  struct Reset {
    ~Reset() { jit::SetBf16MatmulWidens(-1); }
  } reset;
  struct Case {
    int64_t heads, t, d;
    bool causal, bf16_operands;
    float range = 2;  // of q, k, v, dout; 12: scores far apart, many probabilities subnormal
  };
  for (const Case& c : {Case{8, 128, 32, true, false}, Case{8, 128, 32, true, true}, Case{6, 32, 16, false, false},
                        Case{4, 48, 8, true, true}, Case{5, 24, 8, true, false}, Case{3, 24, 16, false, true},
                        Case{8, 128, 32, true, false, 12}, Case{8, 128, 32, false, true, 12}}) {
    jit::AttentionShape s;
    s.heads = c.heads, s.t = c.t, s.d = c.d, s.causal = c.causal, s.bf16 = true;
    s.stored_bf16.fill(c.bf16_operands);
    s.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
    const int64_t n = c.heads * c.t * c.d;
    auto q = Random(n, 1, c.range), k = Random(n, 2, c.range), v = Random(n, 3, c.range), dout = Random(n, 4, c.range);
    if (c.bf16_operands)  // the values the op sees (SubnormalProbabilities counts with them)
      for (auto* x : {&q, &k, &v, &dout})
        for (float& e : *x) e = runtime::Bf16ToF32(runtime::F32ToBf16(e));
    INFO("heads " << c.heads << " t " << c.t << " d " << c.d << (c.causal ? " causal" : "")
                  << (c.bf16_operands ? " bf16 operands" : "") << " range " << c.range);
    // The wide cases put subnormal probabilities in the vectors the softmax loops round, so their rounding
    // takes StoreBf16's integer path (vcvtneps2bf16 would flush them); the products' vdpbf16ps then reads
    // them as 0 either way, so this checks that path runs and agrees, not the flush itself.
    if (c.range > 2) CHECK(SubnormalProbabilities(s, q, k) > 100);
    const Outputs fused = Run(s, q, k, v, dout, false), separate = Run(s, q, k, v, dout, true);
    CHECK(SameBits(fused.forward, separate.forward));
    CHECK(SameBits(fused.backward, separate.backward));
    // Not a vacuous comparison: the outputs are finite and not all zero.
    double sum = 0;
    for (float x : fused.backward) sum += std::abs(x);
    CHECK(std::isfinite(sum));
    CHECK(sum > 0);
  }
}

TEST_CASE("bf16 attention: a NaN gives the same pattern with fused and separate rounding") {
  jit::AttentionShape s;
  s.heads = 2, s.t = 32, s.d = 16, s.causal = true, s.bf16 = true, s.scale = 0.25f;
  const int64_t n = s.heads * s.t * s.d;
  auto q = Random(n, 5);
  const auto k = Random(n, 6), v = Random(n, 7), dout = Random(n, 8);
  q[5 * s.d + 3] = std::numeric_limits<float>::quiet_NaN();  // head 0, query 5
  const Outputs fused = Run(s, q, k, v, dout, false), separate = Run(s, q, k, v, dout, true);
  CHECK(SameBits(fused.forward, separate.forward));
  CHECK(SameBits(fused.backward, separate.backward));
  CHECK(std::isnan(fused.forward[5 * s.d]));  // the NaN reached query 5's output
}
