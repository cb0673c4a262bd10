// The JIT's channels-last rewrite (jit/channels_last.h): convolutions with >= 8 channels run on NHWC
// activations, and so do the loops and reductions between them, with transposes only where a value
// enters or leaves that region. Checked on a residual block with batch norm's arithmetic, both
// convolution gradients and a global average pool: which ops were rewritten, the interpreter's values
// (within the sums' rounding), the same bits twice and on one thread, and an inf weight meeting padding
// giving the interpreter's NaNs through the NHWC kernels.
// Also 2x2 max pooling NHWC (its loops against the NCHW ones, and a CNN-shaped step).
#include <catch2/catch.hpp>
#include <tbb/global_control.h>

#include <cmath>
#include <cstring>
#include <random>

#include "ir/builder.h"
#include "ir/printer.h"
#include "jit/channels_last.h"
#include "jit/compiled_step.h"
#include "jit/data_movement.h"
#include "jit/max_pool_2x2.h"
#include "jit/stem_conv.h"
#include "runtime/interpreter.h"
#include "tests/jit/conv_test_util.h"

using namespace shardstep;
using conv_test::RandomF32;
using ir::DType;
using ir::IntList;
using ir::OpCode;
using ir::ValueId;
using runtime::Tensor;
using runtime::TensorMap;

namespace {

constexpr int64_t kN = 5, kH = 6, kW = 7;

// x -> conv(w1) -> batch-norm arithmetic (mean and variance over N, H, W) -> + a per-position bias
// -> relu -> conv(w2) -> + x
// -> relu = y; dy (an input) through the second convolution's input and filter gradients and relu's
// mask; the global average pool of y. Every convolution has kC channels on both sides (16: NHWC is
// oneDNN's nChw16c; 32: its nhwc kernels).
ir::Module ResidualBlock(int64_t kC) {
  ir::Module m;
  m.name = "residual block";
  ir::Builder b(&m);
  const ir::Shape act{kN, kC, kH, kW}, filt{kC, kC, 3, 3};
  const auto x = b.Input("x", {DType::kF32, act});
  const auto dy = b.Input("dy", {DType::kF32, act});
  const auto w1 = b.Variable("w1", {DType::kF32, filt}, ir::kRoleWeight);
  const auto w2 = b.Variable("w2", {DType::kF32, filt}, ir::kRoleWeight);
  const auto gamma = b.Variable("gamma", {DType::kF32, {kC}}, ir::kRoleWeight);
  const ir::Attrs same{{"stride", IntList{1, 1}}, {"padding", IntList{1, 1}}};
  auto per_channel = [&](ValueId v) { return b.Broadcast(v, act, {1}); };
  const auto c1 = b.Emit(OpCode::kConv2d, {x, w1}, same);
  const auto centred = b.Sub(c1, per_channel(b.ReduceMean(c1, {0, 2, 3})));
  const auto var = b.ReduceMean(b.Mul(centred, centred), {0, 2, 3});
  const auto scale = b.Mul(gamma, b.Unary(OpCode::kRsqrt, b.AddScalar(var, 1e-5)));
  const auto bias = b.Variable("bias", {DType::kF32, {kH, kW}}, ir::kRoleWeight);  // per position: H, W remapped
  const auto h = b.Unary(OpCode::kRelu, b.Add(b.Mul(centred, per_channel(scale)), b.Broadcast(bias, act, {2, 3})));
  const auto c2 = b.Emit(OpCode::kConv2d, {h, w2}, same);
  const auto y = b.Unary(OpCode::kRelu, b.Add(c2, x));
  const auto mask = b.Emit(OpCode::kGt, {y, b.ScalarLike(0.0, y)});
  const auto g = b.Mul(dy, mask);
  ir::Attrs ig = same, fg = same;
  ig["input_shape"] = IntList(act.begin(), act.end());
  fg["filter_shape"] = IntList(filt.begin(), filt.end());
  m.outputs.push_back({"y", y});
  m.outputs.push_back({"dh", b.Emit(OpCode::kConv2dInputGrad, {g, w2}, ig)});
  m.outputs.push_back({"dw2", b.Emit(OpCode::kConv2dFilterGrad, {h, g}, fg)});
  m.outputs.push_back({"pool", b.ReduceMean(y, {2, 3})});
  m.outputs.push_back({"var", var});
  m.outputs.push_back({"sum0", b.ReduceSum(y, {0})});  // [C, H, W]: kept in NCHW's order, so read NCHW
  return m;
}

TensorMap Inputs(int64_t kC) {
  return {{"x", RandomF32({kN, kC, kH, kW}, 1)}, {"dy", RandomF32({kN, kC, kH, kW}, 2)}};
}
TensorMap Variables(int64_t kC) {
  return {{"w1", RandomF32({kC, kC, 3, 3}, 3)}, {"w2", RandomF32({kC, kC, 3, 3}, 4)}, {"gamma", RandomF32({kC}, 5)},
          {"bias", RandomF32({kH, kW}, 6)}};
}

TensorMap Jit(const ir::Module& m, bool channels_last, TensorMap vars, const TensorMap& in) {
  jit::JitOptions o{"", /*disk_cache=*/false};
  o.channels_last = channels_last;
  jit::Workspace ws;
  return jit::CompiledStep::Compile(m, o)->Run(vars, in, 0, nullptr, &ws);
}

// max |a - b| over the tensor, relative to its largest |b| (sums of up to 16 * 9 products, or the
// filter gradient's kN * kH * kW, in another order than the interpreter's).
double RelativeError(const Tensor& a, const Tensor& b) {
  double worst = 0, scale = 0;
  for (size_t i = 0; i < b.f32.size(); ++i) {
    worst = std::max<double>(worst, std::abs(a.f32[i] - b.f32[i]));
    scale = std::max<double>(scale, std::abs(b.f32[i]));
  }
  return worst / scale;
}

// The channels-last step's outputs `keys`: the interpreter's values (within the sums' rounding), and the same
// bits again and on one thread.
void CheckAgainstInterpreter(const ir::Module& m, const TensorMap& vars, const TensorMap& in,
                             const std::vector<const char*>& keys) {
  TensorMap ref_vars = vars;
  const TensorMap ref = runtime::RunStep(m, ref_vars, in);
  const TensorMap got = Jit(m, true, vars, in), again = Jit(m, true, vars, in);
  TensorMap one;
  {
    const tbb::global_control one_thread(tbb::global_control::max_allowed_parallelism, 1);
    one = Jit(m, true, vars, in);
  }
  for (const char* k : keys) {
    INFO(k);
    CHECK(got.at(k).type == ref.at(k).type);
    CHECK(RelativeError(got.at(k), ref.at(k)) <= 1e-5);
    CHECK(std::memcmp(got.at(k).raw(), again.at(k).raw(), got.at(k).bytes()) == 0);
    CHECK(std::memcmp(got.at(k).raw(), one.at(k).raw(), got.at(k).bytes()) == 0);
  }
}

}  // namespace

TEST_CASE("channels-last: the convolutions and the loops between them run NHWC, transposed only at the edges",
          "[jit][conv]") {
  const int64_t kC = GENERATE(16, 32);
  INFO(kC << " channels");
  const ir::Module m = ResidualBlock(kC);
  auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
  const ir::Module& jm = step->module();
  INFO(ir::Print(jm));
  CHECK(step->info().channels_last_convs == 4);  // both forward convolutions and both gradients
  int transposes = 0, nhwc_convs = 0, nchw_loops = 0;
  for (ValueId v = 0; v < jm.size(); ++v) {
    const ir::Instr& in = jm.at(v);
    transposes += in.op == OpCode::kTranspose;
    if (in.op == OpCode::kConv2d || in.op == OpCode::kConv2dInputGrad || in.op == OpCode::kConv2dFilterGrad)
      nhwc_convs += in.GetInt(jit::kNhwcAttr, 0) == 1;
    // Between the convolutions, no 4-d loop computes in NCHW (the batch-norm arithmetic, relu, the
    // residual add, relu's mask): the only NCHW 4-d values are the inputs and the results transposed back.
    if (in.type.rank() == 4 && ir::HasProperty(in.op, ir::kElementwise)) nchw_loops += in.type.shape[1] == kC;
  }
  CHECK(nhwc_convs == 4);
  CHECK(nchw_loops == 0);
  // In: x and dy. Out: y and dh. (w and the pool's, batch norm's and the filter gradient's results are not
  // activations.)
  CHECK(transposes == 4);

  const TensorMap in = Inputs(kC), vars = Variables(kC);
  TensorMap ref_vars = vars;
  const TensorMap ref = runtime::RunStep(m, ref_vars, in);
  const TensorMap nhwc = Jit(m, true, vars, in), nchw = Jit(m, false, vars, in);
  for (const char* k : {"y", "dh", "dw2", "pool", "var", "sum0"}) {
    INFO(k);
    CHECK(nhwc.at(k).type == ref.at(k).type);
    CHECK(RelativeError(nhwc.at(k), ref.at(k)) <= 1e-5);
    CHECK(RelativeError(nchw.at(k), ref.at(k)) <= 1e-5);
  }
  TensorMap again = Jit(m, true, vars, in), one;
  {
    const tbb::global_control one_thread(tbb::global_control::max_allowed_parallelism, 1);
    one = Jit(m, true, vars, in);
  }
  for (const char* k : {"y", "dh", "dw2", "pool", "var", "sum0"}) {
    INFO(k);
    CHECK(std::memcmp(nhwc.at(k).raw(), again.at(k).raw(), nhwc.at(k).bytes()) == 0);
    CHECK(std::memcmp(nhwc.at(k).raw(), one.at(k).raw(), nhwc.at(k).bytes()) == 0);
  }
}

TEST_CASE("channels-last: an inf weight meeting padding gives the interpreter's NaNs", "[jit][conv]") {
  const int64_t kC = GENERATE(16, 32);
  INFO(kC << " channels");
  const ir::Module m = ResidualBlock(kC);
  const TensorMap in = Inputs(kC);
  TensorMap vars = Variables(kC);
  vars["w1"].f32[4 * 9 + 0] = INFINITY;  // output channel 4, input channel 0, the top-left tap: meets padding
  TensorMap ref_vars = vars;
  const TensorMap ref = runtime::RunStep(m, ref_vars, in);
  const TensorMap got = Jit(m, true, vars, in);
  int nans = 0;
  for (const char* k : {"y", "dh", "dw2", "pool", "var", "sum0"}) {
    const Tensor &a = got.at(k), &r = ref.at(k);
    for (size_t i = 0; i < r.f32.size(); ++i) {
      INFO(k << "[" << i << "]: " << a.f32[i] << " vs the interpreter's " << r.f32[i]);
      REQUIRE(std::isnan(a.f32[i]) == std::isnan(r.f32[i]));
      REQUIRE(std::isinf(a.f32[i]) == std::isinf(r.f32[i]));
      nans += std::isnan(r.f32[i]);
    }
  }
  CHECK(nans > 0);
}

TEST_CASE("channels-last: a convolution with fewer than 8 channels stays NCHW", "[jit][conv]") {
  ir::Module m;
  ir::Builder b(&m);
  const auto x = b.Input("x", {DType::kF32, {2, 1, 6, 6}});
  const auto w = b.Variable("w", {DType::kF32, {16, 1, 3, 3}}, ir::kRoleWeight);
  m.outputs.push_back({"y", b.Unary(OpCode::kRelu, b.Emit(OpCode::kConv2d, {x, w}, {{"stride", IntList{1, 1}},
                                                                                     {"padding", IntList{1, 1}}}))});
  auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
  CHECK(step->info().channels_last_convs == 0);
  for (ValueId v = 0; v < step->module().size(); ++v) CHECK(step->module().at(v).op != OpCode::kTranspose);
}

// image (one channel) -> stem conv (16) -> relu -> conv -> relu -> conv = y; dy (an input) through the
// stem's filter gradient: the stem runs channels-last by the stem loops, its image reshaped (no copy).
// (Seven columns: a row tail on AVX-512's 8-pixel steps and on AVX2's 4-pixel ones.)
TEST_CASE("channels-last: a one-channel stem runs NHWC when two convolutions follow it", "[jit][conv]") {
  constexpr int64_t kC = 16;
  if (!jit::StemConvNhwcApplies({kN, 1, kH, kW, kC, 3, 3, 1, 1, 1, 1, kH, kW})) {
    WARN("neither AVX-512 nor AVX2: no stem loops here");
    return;
  }
  ir::Module m;
  ir::Builder b(&m);
  const ir::Shape act{kN, kC, kH, kW};
  const auto image = b.Input("image", {DType::kF32, {kN, 1, kH, kW}});
  const auto dy = b.Input("dy", {DType::kF32, act});
  const auto ws = b.Variable("ws", {DType::kF32, {kC, 1, 3, 3}}, ir::kRoleWeight);
  const auto w1 = b.Variable("w1", {DType::kF32, {kC, kC, 3, 3}}, ir::kRoleWeight);
  const auto w2 = b.Variable("w2", {DType::kF32, {kC, kC, 3, 3}}, ir::kRoleWeight);
  const ir::Attrs same{{"stride", IntList{1, 1}}, {"padding", IntList{1, 1}}};
  const auto stem = b.Unary(OpCode::kRelu, b.Emit(OpCode::kConv2d, {image, ws}, same));
  const auto h = b.Unary(OpCode::kRelu, b.Emit(OpCode::kConv2d, {stem, w1}, same));
  m.outputs.push_back({"y", b.Emit(OpCode::kConv2d, {h, w2}, same)});
  ir::Attrs fg = same;
  fg["filter_shape"] = IntList{kC, 1, 3, 3};
  m.outputs.push_back({"dws", b.Emit(OpCode::kConv2dFilterGrad, {image, b.Mul(dy, stem)}, fg)});

  auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
  const ir::Module& jm = step->module();
  INFO(ir::Print(jm));
  CHECK(step->info().channels_last_convs == 4);  // the stem, its filter gradient and the two convolutions
  int transposes = 0, reshapes = 0;
  for (ValueId v = 0; v < jm.size(); ++v) {
    transposes += jm.at(v).op == OpCode::kTranspose;
    reshapes += jm.at(v).op == OpCode::kReshape;
  }
  CHECK(transposes == 2);  // dy in, y out
  CHECK(reshapes == 1);    // the image

  TensorMap in{{"image", RandomF32({kN, 1, kH, kW}, 11)}, {"dy", RandomF32(act, 12)}};
  TensorMap vars{{"ws", RandomF32({kC, 1, 3, 3}, 13)}, {"w1", RandomF32({kC, kC, 3, 3}, 14)},
                 {"w2", RandomF32({kC, kC, 3, 3}, 15)}};
  CheckAgainstInterpreter(m, vars, in, {"y", "dws"});

  // An inf in the stem's output gradient at an image's corner meets padding in the filter gradient,
  // and an inf stem weight at the top-left tap in the forward pass: the interpreter's NaNs.
  in["dy"].f32[0] = INFINITY;
  vars["ws"].f32[9 * 3] = INFINITY;
  TensorMap ref_vars = vars;
  const TensorMap ref_bad = runtime::RunStep(m, ref_vars, in), bad = Jit(m, true, vars, in);
  int nans = 0;
  for (const char* k : {"y", "dws"}) {
    const Tensor &a = bad.at(k), &r = ref_bad.at(k);
    for (size_t i = 0; i < r.f32.size(); ++i) {
      INFO(k << "[" << i << "]: " << a.f32[i] << " vs the interpreter's " << r.f32[i]);
      REQUIRE(std::isnan(a.f32[i]) == std::isnan(r.f32[i]));
      REQUIRE(std::isinf(a.f32[i]) == std::isinf(r.f32[i]));
      nans += std::isnan(r.f32[i]);
    }
  }
  CHECK(nans > 0);
}

// Channels-last batch norm sums [rows, C] over the rows into C outputs. For C = 16, 32 and 64 the
// sums stay in registers over a block's rows (jit/data_movement.cc ColumnRows); the order is
// Reduce's: each block's rows dealt in turn to K chains (K = 4 for 16 channels, 2 for 32, else 1), each
// chain summed in f64 from its first row to its last, the chains added pairwise, the blocks in order.
// Wider rows (bias gradients: 128, 192, 512 columns) go in strips of 128 or 64 columns held in registers
// (ColumnStrips), in the same order.
TEST_CASE("channels-last sums over rows keep Reduce's order for every channel count", "[jit]") {
  for (int64_t c : {16, 24, 32, 64, 128, 192, 512}) {
    const int64_t rows = 9000;  // several blocks, the last one short
    const jit::ReduceLayout l = jit::LayoutOf({rows, c}, {0}, {c});
    REQUIRE(l.blocks > 2);
    Tensor x = RandomF32({rows, c}, static_cast<uint32_t>(c));
    // In every block, 1e17 then -1e17 eight rows later (the same chain): in f64 the chain's rows between
    // them are absorbed (lost), so a sum in another order (reversed, pairwise, split) gives other values.
    for (int64_t b0 = 0; b0 + 8 < rows; b0 += l.block_rows)
      for (int64_t k = 0; k < c; ++k) x.f32[b0 * c + k] = 1e17f, x.f32[(b0 + 8) * c + k] = -1e17f;
    std::vector<double> acc;
    std::vector<float> got(c);
    jit::Reduce<float>(OpCode::kReduceSum, {rows, c}, {0}, {c}, x.f32.data(), got.data(), acc);
    for (int64_t k = 0; k < c; ++k) {
      double total = 0;
      const int64_t chains = c == 16 ? 4 : c == 32 ? 2 : 1;
      for (int64_t b0 = 0; b0 < rows; b0 += l.block_rows) {
        double chain[4] = {};
        for (int64_t r = b0; r < std::min(rows, b0 + l.block_rows); ++r) chain[(r - b0) % chains] += x.f32[r * c + k];
        total += chains == 4 ? (chain[0] + chain[1]) + (chain[2] + chain[3]) : chain[0] + chain[1];
      }
      INFO(c << " channels, output " << k);
      REQUIRE(got[k] == static_cast<float>(total));
    }

    // The same sums fused with the loop producing their operands (FusedSums, a window at a time, three
    // sums in one pass): x, x reversed by rows (other terms in each window) and x again, each in
    // Reduce's order.
    Tensor rev = x;
    for (int64_t r = 0; r < rows; ++r) std::copy_n(x.f32.data() + (rows - 1 - r) * c, c, rev.f32.data() + r * c);
    auto produce = [&](int64_t e0, int64_t) -> const float* const* {
      thread_local const float* ptrs[3];
      ptrs[0] = x.f32.data() + e0, ptrs[1] = rev.f32.data() + e0, ptrs[2] = x.f32.data() + e0;
      return ptrs;
    };
    std::vector<float> fx(c), frev(c), fx2(c);
    float* outs[3] = {fx.data(), frev.data(), fx2.data()};
    const bool means[3] = {false, false, false};
    jit::FusedSums(l, 3, means, outs, 4096, produce, acc);
    std::vector<float> want_rev(c);
    jit::Reduce<float>(OpCode::kReduceSum, {rows, c}, {0}, {c}, rev.f32.data(), want_rev.data(), acc);
    for (int64_t k = 0; k < c; ++k) {
      INFO(c << " channels, fused, output " << k);
      REQUIRE(fx[k] == got[k]);
      REQUIRE(fx2[k] == got[k]);
      REQUIRE(frev[k] == want_rev[k]);
    }
    REQUIRE(want_rev != got);  // the order shows in these sums
  }
}

// The NHWC max pooling loops give the NCHW kernels' bits (the AVX-512 loops, or the scalar ones on an
// AVX2 CPU), element for element after the transpose: values from a small set (ties everywhere, zeros
// that relu's mask drops, NaNs that win), channel counts with and without a 16- or 8-lane tail, the
// gradient with and without the mask.
TEST_CASE("channels-last 2x2 max pooling and its gradient are the NCHW kernels' bits", "[jit]") {
  if (!jit::MaxPool2x2NhwcVectorised()) {
    WARN("neither AVX-512 nor AVX2: no pooling loops here");
    return;
  }
  for (int64_t c : {16, 20, 32, 64, 12}) {
    constexpr int64_t n = 3, h = 6, w = 10;
    const float kValues[] = {-1.0f, 0.0f, -0.0f, 1.0f, 2.0f, NAN};
    std::mt19937 rng(static_cast<uint32_t>(c));
    std::vector<float> x(n * c * h * w), dy(n * c * (h / 2) * (w / 2));
    for (float& v : x) v = kValues[rng() % 6];
    for (float& v : dy) v = rng() % 5 == 0 ? -0.0f : static_cast<float>(rng() % 1000) / 7.0f;
    // NCHW index of NHWC element (i, y, x, k), and the same for the pooled shape.
    auto at = [c](int64_t hh, int64_t ww) {
      return [c, hh, ww](int64_t i, int64_t yy, int64_t xx, int64_t k) { return ((i * c + k) * hh + yy) * ww + xx; };
    };
    auto to_nhwc = [&](const std::vector<float>& a, int64_t hh, int64_t ww) {
      std::vector<float> b(a.size());
      const auto nchw = at(hh, ww);
      for (int64_t i = 0, o = 0; i < n; ++i)
        for (int64_t yy = 0; yy < hh; ++yy)
          for (int64_t xx = 0; xx < ww; ++xx)
            for (int64_t k = 0; k < c; ++k) b[o++] = a[nchw(i, yy, xx, k)];
      return b;
    };
    const jit::PoolShape g{n * c, h, w, 2, 2, 2, 2, h / 2, w / 2, 0};
    const jit::NhwcPool gn{n, h, w, c};
    std::vector<float> y(dy.size()), yn(dy.size());
    jit::MaxPool(g, x.data(), y.data());
    jit::MaxPool2x2Nhwc(gn, to_nhwc(x, h, w).data(), yn.data());
    INFO(c << " channels");
    const std::vector<float> y_as_nhwc = to_nhwc(y, h / 2, w / 2);
    REQUIRE(std::memcmp(yn.data(), y_as_nhwc.data(), 4 * y.size()) == 0);
    for (bool relu_mask : {false, true}) {
      INFO("relu mask " << relu_mask);
      std::vector<float> dx(x.size()), dxn(x.size(), 7.0f);  // every element written
      jit::MaxPoolGrad(g, x.data(), dy.data(), dx.data(), relu_mask);
      jit::MaxPool2x2GradNhwc(gn, to_nhwc(x, h, w).data(), to_nhwc(dy, h / 2, w / 2).data(), dxn.data(), relu_mask);
      const std::vector<float> dx_as_nhwc = to_nhwc(dx, h, w);
      REQUIRE(std::memcmp(dxn.data(), dx_as_nhwc.data(), 4 * dx.size()) == 0);
    }
  }
}

// Fashion-MNIST's CNN in small: image -> stem conv (16) + bias -> relu -> 2x2 max pool -> conv (32) + bias ->
// relu -> 2x2 max pool -> flattened features; their gradient (an input) back through both poolings
// (relu-masked), the bias sums and the convolutions' gradients. With the poolings NHWC the one
// convolution after the stem runs NHWC too, and only the features and their gradient are transposed.
TEST_CASE("channels-last: a stem, a convolution and max pooling run NHWC, transposed only at the features",
          "[jit][conv]") {
  if (!jit::MaxPool2x2NhwcVectorised()) {
    WARN("neither AVX-512 nor AVX2: no stem or pooling loops here");
    return;
  }
  constexpr int64_t n = 3, c1 = 16, c2 = 32, hw = 8, feats = c2 * (hw / 4) * (hw / 4);
  ir::Module m;
  ir::Builder b(&m);
  const auto image = b.Input("image", {DType::kF32, {n, 1, hw, hw}});
  const auto dfeat = b.Input("dfeat", {DType::kF32, {n, feats}});
  const auto w1 = b.Variable("w1", {DType::kF32, {c1, 1, 3, 3}}, ir::kRoleWeight);
  const auto b1 = b.Variable("b1", {DType::kF32, {c1}}, ir::kRoleWeight);
  const auto w2 = b.Variable("w2", {DType::kF32, {c2, c1, 3, 3}}, ir::kRoleWeight);
  const auto b2 = b.Variable("b2", {DType::kF32, {c2}}, ir::kRoleWeight);
  const ir::Attrs same{{"stride", IntList{1, 1}}, {"padding", IntList{1, 1}}};
  const ir::Attrs pool{{"window", IntList{2, 2}}, {"stride", IntList{2, 2}}};
  auto block = [&](ValueId x, ValueId w, ValueId bias, const ir::Shape& s) {
    return b.Unary(OpCode::kRelu, b.Add(b.Emit(OpCode::kConv2d, {x, w}, same), b.Broadcast(bias, s, {1})));
  };
  const ir::Shape s1{n, c1, hw, hw}, s2{n, c2, hw / 2, hw / 2};
  const auto r1 = block(image, w1, b1, s1);
  const auto p1 = b.Emit(OpCode::kMaxPool, {r1}, pool);
  const auto r2 = block(p1, w2, b2, s2);
  const auto p2 = b.Emit(OpCode::kMaxPool, {r2}, pool);
  m.outputs.push_back({"feat", b.Reshape(p2, {n, feats})});
  auto masked_pool_grad = [&](ValueId r, ValueId d) {
    return b.Emit(OpCode::kSelect, {b.Emit(OpCode::kGt, {r, b.ScalarLike(0.0, r)}),
                                    b.Emit(OpCode::kMaxPoolGrad, {r, d}, pool), b.ScalarLike(0.0, r)});
  };
  const auto g2 = masked_pool_grad(r2, b.Reshape(dfeat, {n, c2, hw / 4, hw / 4}));
  ir::Attrs ig = same, fg2 = same, fg1 = same;
  ig["input_shape"] = IntList{n, c1, hw / 2, hw / 2};
  fg2["filter_shape"] = IntList{c2, c1, 3, 3};
  fg1["filter_shape"] = IntList{c1, 1, 3, 3};
  m.outputs.push_back({"db2", b.ReduceSum(g2, {0, 2, 3})});
  m.outputs.push_back({"dw2", b.Emit(OpCode::kConv2dFilterGrad, {p1, g2}, fg2)});
  const auto g1 = masked_pool_grad(r1, b.Emit(OpCode::kConv2dInputGrad, {g2, w2}, ig));
  m.outputs.push_back({"db1", b.ReduceSum(g1, {0, 2, 3})});
  m.outputs.push_back({"dw1", b.Emit(OpCode::kConv2dFilterGrad, {image, g1}, fg1)});

  auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
  const ir::Module& jm = step->module();
  INFO(ir::Print(jm));
  CHECK(step->info().channels_last_convs == 5);  // the stem and its filter gradient, the convolution and both gradients
  int transposes = 0, nhwc_pools = 0;
  for (ValueId v = 0; v < jm.size(); ++v) {
    const ir::Instr& in = jm.at(v);
    transposes += in.op == OpCode::kTranspose;
    if (in.op == OpCode::kMaxPool || in.op == OpCode::kMaxPoolGrad) {
      CHECK(in.GetInt(jit::kNhwcAttr, 0) == 1);
      nhwc_pools += 1;
    }
  }
  CHECK(nhwc_pools == 4);
  CHECK(transposes == 2);  // the features out, their gradient in

  TensorMap in{{"image", RandomF32({n, 1, hw, hw}, 21)}, {"dfeat", RandomF32({n, feats}, 22)}};
  TensorMap vars{{"w1", RandomF32({c1, 1, 3, 3}, 23)}, {"b1", RandomF32({c1}, 24)},
                 {"w2", RandomF32({c2, c1, 3, 3}, 25)}, {"b2", RandomF32({c2}, 26)}};
  const std::vector<const char*> kOutputs = {"feat", "db2", "dw2", "db1", "dw1"};
  CheckAgainstInterpreter(m, vars, in, kOutputs);

  // A NaN pixel: the stem spreads it over its 3x3 neighbourhood in every channel, the poolings take it as
  // a maximum and relu's mask drops its gradient (NaN > 0 is false): the interpreter's NaNs, where they are.
  in["image"].f32[hw + 3] = NAN;
  TensorMap ref_vars = vars;
  const TensorMap ref_nan = runtime::RunStep(m, ref_vars, in), nan = Jit(m, true, vars, in);
  int nans = 0;
  for (const char* k : kOutputs) {
    const Tensor &a = nan.at(k), &r = ref_nan.at(k);
    for (size_t i = 0; i < r.f32.size(); ++i) {
      INFO(k << "[" << i << "]: " << a.f32[i] << " vs the interpreter's " << r.f32[i]);
      REQUIRE(std::isnan(a.f32[i]) == std::isnan(r.f32[i]));
      nans += std::isnan(r.f32[i]);
    }
  }
  CHECK(nans > 0);
}
