// jit/step_rewrites.h AttentionHeadsInPlace: the transposes a model makes around attention ([B, T, H, D]
// <-> [B, H, T, D]) are read and written in place by the op (jit/attention.h heads_in, heads_out). The
// module below computes each attention twice: once through the transposes (rewritten: the op gathers
// and scatters the heads' rows itself) and once on operands already dense in [B, H, T, D] (inputs the
// test transposes on the host; results returned as they are, so not rewritten). The results must be
// the same bits, forward and backward, f32 and bf16 (the bf16 chains as the mixed-precision pass and
// the JIT's rounding rewrites leave them: q, k, v rounded by the loops that compute them and moved as
// bf16, dout and the forward's output rounded by the op itself), for heads of 32 and of an odd width.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>

#include "ir/builder.h"
#include "ir/printer.h"
#include "jit/compiled_step.h"
#include "jit/step_rewrites.h"
#include "runtime/tensor.h"

using namespace shardstep;
using ir::DType;
using ir::OpCode;
using runtime::Tensor;
using runtime::TensorMap;

namespace {

// [B, T, H, D] -> [B, H, T, D] (or back, with the two middle sizes given the other way round).
template <typename T>
std::vector<T> SwapMiddle(const std::vector<T>& x, const ir::Shape& s) {
  std::vector<T> y(x.size());
  for (int64_t b = 0; b < s[0]; ++b)
    for (int64_t i = 0; i < s[1]; ++i)
      for (int64_t j = 0; j < s[2]; ++j)
        for (int64_t d = 0; d < s[3]; ++d)
          y[((b * s[2] + j) * s[1] + i) * s[3] + d] = x[((b * s[1] + i) * s[2] + j) * s[3] + d];
  return y;
}

Tensor Random(const ir::Shape& shape, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-2, 2);
  Tensor t({DType::kF32, shape});
  for (float& v : t.f32) v = u(rng);
  return t;
}

struct Case {
  int64_t b, t, h, d;
  bool bf16, causal;
};

void Check(const Case& c) {
  const ir::Shape inner{c.b, c.t, c.h, c.d}, first{c.b, c.h, c.t, c.d}, perm{0, 2, 1, 3};
  ir::Module m;
  m.name = "attention heads";
  ir::Builder b(&m);
  // The operands as the op takes them: through the model's transposes (x [B, T, H, D]) or dense (xd).
  auto through = [&](ir::ValueId x) {
    if (!c.bf16) return b.Transpose(x, perm);
    const ir::ValueId y = b.Mul(x, b.ScalarLike(1.0, x));  // a loop's value, as q, k, v after their bias adds
    return b.Convert(b.Convert(b.Transpose(y, perm), DType::kBF16), DType::kF32);
  };
  auto dense = [&](ir::ValueId x) { return c.bf16 ? b.Convert(b.Convert(x, DType::kBF16), DType::kF32) : x; };
  std::vector<ir::ValueId> moved, kept;
  const char* names[] = {"q", "k", "v", "dout"};
  for (const char* name : names) {
    const ir::ValueId x = b.Input(name, {DType::kF32, inner});
    const ir::ValueId xd = b.Input(std::string(name) + "_dense", {DType::kF32, first});
    // dout reaches the op through a rounding transpose (RoundInTransposes), not a loop's rounding.
    moved.push_back(std::string(name) == "dout" && c.bf16
                        ? b.Convert(b.Convert(b.Transpose(x, perm), DType::kBF16), DType::kF32)
                        : through(x));
    kept.push_back(dense(xd));
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const ir::Attrs attrs{{"scale", scale}, {"causal", int64_t{c.causal}}, {"bf16", int64_t{c.bf16}}};
  const ir::ValueId out = b.Emit(OpCode::kAttention, {moved[0], moved[1], moved[2]}, attrs);
  const ir::ValueId out_t = b.Transpose(out, perm);
  m.outputs.push_back({"out", c.bf16 ? b.Convert(out_t, DType::kBF16) : out_t});
  const ir::ValueId grad = b.Emit(OpCode::kAttentionGrad, moved, attrs);
  for (int64_t i = 0; i < 3; ++i) {
    const ir::ValueId part = b.Reshape(b.Slice(grad, {i, 0, 0, 0, 0}, {i + 1, c.b, c.h, c.t, c.d}), first);
    m.outputs.push_back({std::string("d") + names[i], b.Transpose(part, perm)});
  }
  m.outputs.push_back({"out_dense", b.Emit(OpCode::kAttention, {kept[0], kept[1], kept[2]}, attrs)});
  m.outputs.push_back({"grad_dense", b.Emit(OpCode::kAttentionGrad, kept, attrs)});

  TensorMap inputs;
  for (uint32_t i = 0; i < 4; ++i) {
    Tensor x = Random(inner, 10 + i);
    Tensor xd({DType::kF32, first});
    xd.f32 = SwapMiddle(x.f32, inner);
    inputs[std::string(names[i]) + "_dense"] = xd;
    inputs[names[i]] = x;
  }
  auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
  INFO(ir::Print(step->module()));
  int in_place = 0, transposes = 0;
  for (ir::ValueId v = 0; v < step->module().size(); ++v) {
    const ir::Instr& in = step->module().at(v);
    in_place += in.Has(jit::kHeadsInAttr) && in.Has(jit::kHeadsOutAttr);
    transposes += in.op == OpCode::kTranspose;
  }
  CHECK(in_place == 2);    // the forward and the gradient through the transposes
  CHECK(transposes == 0);  // every transpose went into the ops
  TensorMap vars;
  jit::Workspace ws;
  const TensorMap got = step->Run(vars, inputs, 0, nullptr, &ws);

  // The forward: out [B, T, H, D] against the dense op's [B, H, T, D], bit for bit.
  const Tensor& od = got.at("out_dense");
  const std::vector<float> want = SwapMiddle(od.f32, first);
  if (c.bf16) {
    REQUIRE(got.at("out").dtype() == DType::kBF16);
    for (size_t i = 0; i < want.size(); ++i) REQUIRE(got.at("out").bf16[i] == runtime::F32ToBf16(want[i]));
  } else {
    CHECK(std::memcmp(got.at("out").f32.data(), want.data(), want.size() * 4) == 0);
  }
  // The gradients: part i of the dense op's [3, B, H, T, D].
  const Tensor& gd = got.at("grad_dense");
  const int64_t n = c.b * c.h * c.t * c.d;
  double sum = 0;
  for (int64_t i = 0; i < 3; ++i) {
    const std::vector<float> part(gd.f32.begin() + i * n, gd.f32.begin() + (i + 1) * n);
    const std::vector<float> part_inner = SwapMiddle(part, first);
    const Tensor& g = got.at(std::string("d") + names[i]);
    INFO("d" << names[i]);
    CHECK(std::memcmp(g.f32.data(), part_inner.data(), n * 4) == 0);
    for (float x : g.f32) sum += std::abs(x);
  }
  CHECK(std::isfinite(sum));
  CHECK(sum > 0);  // not a vacuous comparison
}

}  // namespace

TEST_CASE("attention reads and writes the heads' transposes in place: the dense op's bits", "[jit][attention]") {
  for (const Case& c : {Case{2, 128, 4, 32, false, true}, Case{2, 128, 4, 32, true, true}, Case{3, 32, 2, 16, true, false},
                        Case{2, 24, 3, 20, false, true}, Case{2, 24, 3, 20, true, true}, Case{1, 48, 5, 8, true, false}}) {
    INFO("B " << c.b << " T " << c.t << " H " << c.h << " D " << c.d << (c.bf16 ? " bf16" : " f32")
              << (c.causal ? " causal" : ""));
    Check(c);
  }
}

// jit/compiled_step.cc PlanAttentionGradParts: attention_grad's parts read by a loop that only rounds them
// to bf16 for the next products, and by the projections' bias sums (reduce_sum over all B * T rows), are
// written by the op itself. Compiled with the JIT's fusions (the op writes them) and without (a loop and a
// reduction each), the step must give the same bits: the products of the rounded parts and the sums, in
// blocks of rows (2048 or 1664 rows: 4 blocks of 512, the last short; 4096 rows of 64 features: 4 blocks
// of 1024, a task 16 heads of 8 batch elements; 2048 rows of 256 tokens: a task one head of 4). With
// fewer than 4 blocks (256 rows) or heads of 16 features (H * D = 32: Reduce deals rows to two chains)
// nothing is taken. (Sums in f64 rounded to f32 rarely show their order on such data; the order is
// Reduce's by construction, attention.cc; a part's sums given to another part fail here, checked.)
namespace {

struct PartsCase {
  int64_t b, t, h, d;
  bool bf16;
  int parts;  // expected CompileInfo::attention_parts
};

void CheckParts(const PartsCase& c) {
  const ir::Shape inner{c.b, c.t, c.h, c.d}, first{c.b, c.h, c.t, c.d}, perm{0, 2, 1, 3};
  const int64_t width = c.h * c.d, rows = c.b * c.t;
  ir::Module m;
  m.name = "attention grad parts";
  ir::Builder b(&m);
  auto rounded = [&](ir::ValueId x) { return c.bf16 ? b.Convert(b.Convert(x, DType::kBF16), DType::kF32) : x; };
  std::vector<ir::ValueId> ops;
  const char* names[] = {"q", "k", "v", "dout"};
  for (const char* name : names) {
    const ir::ValueId x = b.Input(name, {DType::kF32, inner});
    const ir::ValueId y = b.Mul(x, b.ScalarLike(1.0, x));  // a loop's value, as after a bias add
    ops.push_back(rounded(b.Transpose(y, perm)));
  }
  const ir::Attrs attrs{{"scale", 1.0 / std::sqrt(static_cast<double>(c.d))}, {"causal", int64_t{1}}, {"bf16", int64_t{c.bf16}}};
  const ir::ValueId grad = b.Emit(OpCode::kAttentionGrad, ops, attrs);
  const ir::ValueId w = rounded(b.Input("w", {DType::kF32, {width, 8}}));
  for (int64_t i = 0; i < 3; ++i) {
    const ir::ValueId part = b.Reshape(b.Slice(grad, {i, 0, 0, 0, 0}, {i + 1, c.b, c.h, c.t, c.d}), first);
    const ir::ValueId rows_of = b.Reshape(b.Transpose(part, perm), {c.b, c.t, width});  // [B, T, H * D]
    const ir::ValueId bias = b.Emit(OpCode::kReduceSum, {rows_of}, {{"axes", ir::IntList{0, 1}}});
    m.outputs.push_back({std::string("bias_") + names[i], b.Mul(bias, b.ScalarLike(1.0, bias))});  // (an update reads it)
    m.outputs.push_back({std::string("y_") + names[i], b.Matmul(rounded(b.Reshape(rows_of, {rows, width})), w)});
  }
  TensorMap inputs;
  for (uint32_t i = 0; i < 4; ++i) inputs[names[i]] = Random(inner, 40 + i);
  inputs["w"] = Random({width, 8}, 50);
  jit::JitOptions fused{"", false, false}, plain{"", false, false};
  plain.fuse_reductions = false;
  auto step = jit::CompiledStep::Compile(m, fused), reference = jit::CompiledStep::Compile(m, plain);
  CHECK(step->info().attention_parts == c.parts);
  CHECK(reference->info().attention_parts == 0);
  TensorMap vars;
  jit::Workspace ws1, ws2;
  const TensorMap got = step->Run(vars, inputs, 0, nullptr, &ws1), want = reference->Run(vars, inputs, 0, nullptr, &ws2);
  double total = 0;
  for (const auto& [name, t] : want) {
    INFO(name);
    REQUIRE(got.at(name).bytes() == t.bytes());
    CHECK(std::memcmp(got.at(name).raw(), t.raw(), t.bytes()) == 0);
    for (float x : t.f32) total += std::abs(x);
  }
  CHECK(std::isfinite(total));
  CHECK(total > 0);  // not a vacuous comparison
}

}  // namespace

TEST_CASE("attention_grad rounds and sums its parts itself: the bits of the loops and reductions", "[jit][attention]") {
  for (const PartsCase& c : {PartsCase{16, 128, 4, 32, true, 6}, PartsCase{13, 128, 4, 32, true, 6},
                             PartsCase{16, 128, 4, 32, false, 3}, PartsCase{64, 64, 2, 32, true, 6}, PartsCase{8, 256, 4, 32, true, 6},
                             PartsCase{2, 128, 4, 32, true, 0}, PartsCase{8, 64, 2, 16, true, 0}}) {
    INFO("B " << c.b << " T " << c.t << " H " << c.h << " D " << c.d << (c.bf16 ? " bf16" : " f32"));
    CheckParts(c);
  }
}
