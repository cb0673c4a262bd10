// Convolutions on oneDNN's primitives (jit/dnnl_conv.h): the shapes it is preferred for match the
// interpreter within the conformance tolerance (a sum of K terms), including batches that leave a
// smaller last block and filter-gradient groups with no image; they give the same bits twice and on
// one TBB thread; the three paths agree; and inf/NaN meeting padding gives the interpreter's NaNs.
// The Winograd path: within the same tolerance, deterministic, preferred only where it pays, a
// non-finite result recomputed on the direct path, and no Winograd forward pass next to max pooling.
#include <catch2/catch.hpp>
#include <tbb/task_arena.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "ir/builder.h"
#include "jit/compiled_step.h"
#include "jit/dnnl_conv.h"
#include "jit/dnnl_kernels.h"
#include "runtime/interpreter.h"
#include "tests/jit/conformance_compare.h"
#include "tests/jit/conv_test_util.h"

using namespace shardstep;
using conv_test::RandomF32;
using conv_test::Abs;
using conv_test::SameBits;
using conformance::Compare;
using conformance::Tolerance;
using ir::DType;
using ir::IntList;
using ir::OpCode;
using runtime::Tensor;
using runtime::TensorMap;

namespace {

struct Geometry {
  int64_t n, c, o, h, w, kh, kw, stride, pad;
  int64_t oh() const { return (h + 2 * pad - kh) / stride + 1; }
  int64_t ow() const { return (w + 2 * pad - kw) / stride + 1; }
};

// A one-op module: `op` on inputs a, b with g's stride and padding; the out's shape by inference.
ir::Module OneOp(OpCode op, const Geometry& g) {
  ir::Module m;
  ir::Builder b(&m);
  const ir::Shape x{g.n, g.c, g.h, g.w}, w{g.o, g.c, g.kh, g.kw}, y{g.n, g.o, g.oh(), g.ow()};
  ir::Attrs attrs{{"stride", IntList{g.stride, g.stride}}, {"padding", IntList{g.pad, g.pad}}};
  ir::ValueId a, c;
  if (op == OpCode::kConv2d) {
    a = b.Input("a", {DType::kF32, x});
    c = b.Input("b", {DType::kF32, w});
  } else if (op == OpCode::kConv2dInputGrad) {
    a = b.Input("a", {DType::kF32, y});
    c = b.Input("b", {DType::kF32, w});
    attrs["input_shape"] = IntList(x.begin(), x.end());
  } else {
    a = b.Input("a", {DType::kF32, x});
    c = b.Input("b", {DType::kF32, y});
    attrs["filter_shape"] = IntList(w.begin(), w.end());
  }
  m.outputs.push_back({"out", b.Emit(op, {a, c}, attrs)});
  return m;
}

Tensor Jit(const ir::Module& m, const TensorMap& in) {
  TensorMap vars;
  jit::Workspace ws;
  return jit::CompiledStep::Compile(m)->Run(vars, in, 0, nullptr, &ws).at("out");
}

Tensor Interpret(const ir::Module& m, const TensorMap& in) {
  TensorMap vars;
  return runtime::RunStep(m, vars, in).at("out");
}

int64_t Terms(OpCode op, const Geometry& g) {  // products summed into one result element (an upper bound)
  if (op == OpCode::kConv2d) return g.c * g.kh * g.kw;
  if (op == OpCode::kConv2dInputGrad) return g.o * g.kh * g.kw;
  return g.n * g.oh() * g.ow();
}

jit::ConvKind KindOf(OpCode op) {
  return op == OpCode::kConv2d ? jit::ConvKind::kForward
                               : op == OpCode::kConv2dInputGrad ? jit::ConvKind::kInputGrad : jit::ConvKind::kFilterGrad;
}

jit::ConvShape ShapeOf(const Geometry& g) {
  return {g.n, g.c, g.h, g.w, g.o, g.kh, g.kw, g.stride, g.stride, g.pad, g.pad, g.oh(), g.ow()};
}

}  // namespace

TEST_CASE("oneDNN convolutions match the interpreter and give the same bits on any number of threads",
          "[jit][conv]") {
  jit::ConfigureThreadsForReplica(1);
  const Geometry geometry[] = {
      {19, 8, 16, 9, 9, 3, 3, 1, 1},  // blocks of 8, 8, 3 images; filter groups of 3 (the last of 1)
      {5, 16, 8, 10, 7, 3, 3, 2, 1},  // one block of 5; filter groups of 1, three of them empty
      {8, 8, 8, 11, 9, 3, 2, 2, 0},   // no padding, a 3x2 kernel
  };
  const OpCode ops[] = {OpCode::kConv2d, OpCode::kConv2dInputGrad, OpCode::kConv2dFilterGrad};
  uint32_t seed = 1;
  for (const Geometry& g : geometry)
    for (OpCode op : ops) {
      INFO(ir::OpName(op) << " n" << g.n << " c" << g.c << " o" << g.o << " " << g.h << "x" << g.w << " k" << g.kh << "x"
                          << g.kw << " stride " << g.stride << " pad " << g.pad);
      // The shape is one oneDNN is preferred for (else this test would not cover that path).
      REQUIRE(jit::PreferredConvPath(KindOf(op), ShapeOf(g)) == jit::ConvPath::kDnnlBlocked);
      const ir::Module m = OneOp(op, g);
      const ir::Instr& in = m.at(m.outputs[0].second);
      TensorMap inputs{{"a", RandomF32(m.type(in.operands[0]).shape, seed++)},
                       {"b", RandomF32(m.type(in.operands[1]).shape, seed++)}};
      const Tensor want = Interpret(m, inputs), scale = Interpret(m, Abs(inputs));
      const float* a = inputs["a"].f32.data();
      const float* b = inputs["b"].f32.data();
      auto run = [&](jit::ConvPath p) {
        Tensor t(want.type);
        jit::ConvKernel(KindOf(op), ShapeOf(g), p).Run(a, b, t.f32.data());
        return t;
      };
      const Tensor got = run(jit::ConvPath::kDnnlBlocked);
      const Tolerance tol = Tolerance::Sum(Terms(op, g));
      const conformance::Verdict v = Compare(want, got, tol, &scale);
      INFO(tol.ToString() << "\n" << v.message);
      CHECK(v.ok);
      CHECK(SameBits(run(jit::ConvPath::kDnnlBlocked), got));
      Tensor one;
      tbb::task_arena(1).execute([&] { one = run(jit::ConvPath::kDnnlBlocked); });
      CHECK(SameBits(one, got));

      // The other paths and the compiled step (its default path) within the same bound.
      for (jit::ConvPath p : {jit::ConvPath::kIm2col, jit::ConvPath::kDnnlPlain}) {
        INFO(jit::ConvPathName(p));
        CHECK(Compare(want, run(p), tol, &scale).ok);
      }
      CHECK(Compare(want, Jit(m, inputs), tol, &scale).ok);
    }
}

TEST_CASE("an inf weight or output gradient meeting padding gives the interpreter's NaNs on the oneDNN path",
          "[jit][conv]") {
  const float inf = std::numeric_limits<float>::infinity();
  // The filter gradient checks its result where a tap reads no padding (the first two shapes, the
  // second with stride 2) and scans the output gradient first where none does (the third: padding 2
  // around a 1x1 image).
  const Geometry geometry[] = {{3, 8, 8, 6, 6, 3, 3, 1, 1}, {3, 8, 8, 7, 7, 3, 3, 2, 1}, {2, 8, 8, 1, 1, 3, 3, 1, 2}};
  for (const Geometry& g : geometry)
    for (OpCode op : {OpCode::kConv2d, OpCode::kConv2dFilterGrad}) {
      INFO(ir::OpName(op) << " " << g.h << "x" << g.w << " stride " << g.stride << " pad " << g.pad);
      const ir::Module m = OneOp(op, g);
      const ir::Instr& in = m.at(m.outputs[0].second);
      TensorMap inputs{{"a", RandomF32(m.type(in.operands[0]).shape, 3)},
                       {"b", RandomF32(m.type(in.operands[1]).shape, 4)}};
      // A weight (forward) or an output gradient at a corner (filter gradient).
      inputs["b"].f32[op == OpCode::kConv2d ? 5 : 0] = inf;
      const Tensor want = Interpret(m, inputs);
      Tensor got(want.type);
      jit::ConvKernel(KindOf(op), ShapeOf(g), jit::ConvPath::kDnnlBlocked)
          .Run(inputs["a"].f32.data(), inputs["b"].f32.data(), got.f32.data());
      int64_t nans = 0;
      for (float v : want.f32) nans += std::isnan(v);
      CHECK(nans > 0);  // padded zeros times inf
      const Tensor scale = Interpret(m, Abs(inputs));
      const conformance::Verdict v = Compare(want, got, Tolerance::Sum(Terms(op, g)), &scale);
      INFO(v.message);
      CHECK(v.ok);
    }
}

// Max pooling picks the first of equal values; its ties are exact where equal input patches give equal
// outputs (an image's constant background: Fashion-MNIST's black border). The interpreter and im2col
// sum every output position in the same order, so equal patches give equal bits; a path that does not
// flips max pooling's choice against the interpreter's and moves whole gradients (a kink, not noise).
TEST_CASE("equal input patches give equal forward outputs on the path a step takes", "[jit][conv]") {
  jit::ConfigureThreadsForReplica(1);
  const Geometry g{8, 32, 64, 14, 14, 3, 3, 1, 1};  // the CNN's second convolution at batch 8
  Tensor x(ir::TensorType{DType::kF32, {g.n, g.c, g.h, g.w}});
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(0, 1);
  for (int64_t n = 0; n < g.n; ++n)
    for (int64_t c = 0; c < g.c; ++c) {
      const float background = 0.1f * static_cast<float>(c % 7);
      for (int64_t i = 0; i < g.h; ++i)
        for (int64_t j = 0; j < g.w; ++j)
          x.f32[((n * g.c + c) * g.h + i) * g.w + j] = (i >= 5 && i < 9 && j >= 5 && j < 9) ? u(rng) : background;
    }
  const Tensor w = RandomF32({g.o, g.c, g.kh, g.kw}, 4);
  for (jit::ConvPath p : {jit::ConvPath::kIm2col, jit::ConvPath::kDnnlBlocked, jit::ConvPath::kDnnlPlain}) {
    INFO(jit::ConvPathName(p));
    Tensor y(ir::TensorType{DType::kF32, {g.n, g.o, g.oh(), g.ow()}});
    jit::ConvKernel(jit::ConvKind::kForward, ShapeOf(g), p).Run(x.f32.data(), w.f32.data(), y.f32.data());
    int64_t unequal = 0, pairs = 0;
    for (int64_t n = 0; n < g.n; ++n)
      for (int64_t o = 0; o < g.o; ++o) {
        // Interior background positions (their 3x3 patch is all background): rows/cols 1..3 and 10..12.
        const float first = y.f32[((n * g.o + o) * g.oh() + 1) * g.ow() + 1];
        for (int64_t i : {1, 2, 3, 10, 11, 12})
          for (int64_t j : {1, 2, 3, 10, 11, 12}) {
            ++pairs;
            unequal += y.f32[((n * g.o + o) * g.oh() + i) * g.ow() + j] != first;
          }
      }
    std::printf("%s: %lld of %lld equal-patch outputs differ from the first\n", jit::ConvPathName(p),
                static_cast<long long>(unequal), static_cast<long long>(pairs));
    CHECK(unequal == 0);
  }
}

// oneDNN's Winograd kernels (AVX-512 only) compute 4x4 output tiles from transformed 6x6 input tiles:
// a different sum from the direct one, which must still be within the conformance tolerance of the
// interpreter's, the same bits however the blocks are spread over threads, and preferred only where
// bench/conv measured a gain.
TEST_CASE("Winograd convolutions match the interpreter, give the same bits on any number of threads, and are "
          "preferred only where they pay",
          "[jit][conv]") {
  if (!__builtin_cpu_supports("avx512f")) {
    WARN("no AVX-512: oneDNN has no Winograd kernels here");
    return;
  }
  jit::ConfigureThreadsForReplica(1);
  const Geometry exact_tiles{19, 32, 32, 8, 8, 3, 3, 1, 1};    // blocks of 8, 8, 3 images; 2x2 whole tiles
  const Geometry partial_tiles{5, 48, 32, 7, 6, 3, 3, 1, 1};   // one block of 5; filter groups of 1, three empty
  const Geometry few_channels{4, 16, 16, 8, 8, 3, 3, 1, 1};
  const OpCode ops[] = {OpCode::kConv2d, OpCode::kConv2dInputGrad, OpCode::kConv2dFilterGrad};
  uint32_t seed = 11;
  for (const Geometry& g : {exact_tiles, partial_tiles})
    for (OpCode op : ops) {
      INFO(ir::OpName(op) << " n" << g.n << " c" << g.c << " o" << g.o << " " << g.h << "x" << g.w);
      const ir::Module m = OneOp(op, g);
      const ir::Instr& in = m.at(m.outputs[0].second);
      TensorMap inputs{{"a", RandomF32(m.type(in.operands[0]).shape, seed++)},
                       {"b", RandomF32(m.type(in.operands[1]).shape, seed++)}};
      const Tensor want = Interpret(m, inputs), scale = Interpret(m, Abs(inputs));
      const jit::ConvKernel kernel(KindOf(op), ShapeOf(g), jit::ConvPath::kDnnlWinograd);
      CHECK(kernel.Describe().find("wino") != std::string::npos);
      auto run = [&] {
        Tensor t(want.type);
        kernel.Run(inputs["a"].f32.data(), inputs["b"].f32.data(), t.f32.data());
        return t;
      };
      const Tensor got = run();
      const conformance::Verdict v = Compare(want, got, Tolerance::Sum(Terms(op, g)), &scale);
      INFO(kernel.Describe() << "\n" << v.message);
      CHECK(v.ok);
      CHECK_FALSE(SameBits(got, want));  // a different sum, not the direct one under another name
      CHECK(SameBits(run(), got));
      Tensor one;
      tbb::task_arena(1).execute([&] { one = run(); });
      CHECK(SameBits(one, got));
    }

  using jit::ConvKind;
  using jit::ConvPath;
  using jit::ConvTies;
  const jit::ConvShape whole = ShapeOf(exact_tiles), partial = ShapeOf(partial_tiles), few = ShapeOf(few_channels);
  // On a CPU where Winograd pays:
  CHECK(jit::PreferredConvPath(ConvKind::kForward, whole, ConvTies::kFree, true) == ConvPath::kDnnlWinograd);
  CHECK(jit::PreferredConvPath(ConvKind::kForward, whole, ConvTies::kExact, true) == ConvPath::kDnnlBlocked);
  CHECK(jit::PreferredConvPath(ConvKind::kInputGrad, whole, ConvTies::kExact, true) == ConvPath::kDnnlWinograd);
  CHECK(jit::PreferredConvPath(ConvKind::kFilterGrad, whole, ConvTies::kExact, true) == ConvPath::kDnnlWinograd);
  // Partial tiles: the filter gradient only; 16 channels: never.
  CHECK(jit::PreferredConvPath(ConvKind::kForward, partial, ConvTies::kFree, true) == ConvPath::kDnnlBlocked);
  CHECK(jit::PreferredConvPath(ConvKind::kInputGrad, partial, ConvTies::kFree, true) == ConvPath::kDnnlBlocked);
  CHECK(jit::PreferredConvPath(ConvKind::kFilterGrad, partial, ConvTies::kFree, true) == ConvPath::kDnnlWinograd);
  for (ConvKind kind : {ConvKind::kForward, ConvKind::kInputGrad, ConvKind::kFilterGrad})
    CHECK(jit::PreferredConvPath(kind, few, ConvTies::kFree, true) == ConvPath::kDnnlBlocked);
  // Where it does not (an Intel CPU with AMX), never; this machine's class is read from oneDNN's ISA.
  for (ConvKind kind : {ConvKind::kForward, ConvKind::kInputGrad, ConvKind::kFilterGrad})
    for (const jit::ConvShape& s : {whole, partial, few})
      CHECK(jit::PreferredConvPath(kind, s, ConvTies::kFree, false) == ConvPath::kDnnlBlocked);
  CHECK(jit::WinogradCpu() == !jit::CpuHasAmx());
}

// Winograd's input transform adds and subtracts a tile's inputs, so one inf makes NaNs over a whole
// tile where the direct sum (the interpreter's) has infs on the outputs that read it: such a call is
// computed again on the direct path.
TEST_CASE("an inf on the Winograd path gives the direct path's result", "[jit][conv]") {
  if (!__builtin_cpu_supports("avx512f")) {
    WARN("no AVX-512: oneDNN has no Winograd kernels here");
    return;
  }
  jit::ConfigureThreadsForReplica(1);
  const float inf = std::numeric_limits<float>::infinity();
  const Geometry g{9, 32, 32, 8, 8, 3, 3, 1, 1};
  for (OpCode op : {OpCode::kConv2d, OpCode::kConv2dInputGrad, OpCode::kConv2dFilterGrad}) {
    INFO(ir::OpName(op));
    const ir::Module m = OneOp(op, g);
    const ir::Instr& in = m.at(m.outputs[0].second);
    TensorMap inputs{{"a", RandomF32(m.type(in.operands[0]).shape, 5)},
                     {"b", RandomF32(m.type(in.operands[1]).shape, 6)}};
    // Image 8 (the last block), channel 3, row 3, column 4: an interior pixel of x or dy.
    inputs["a"].f32[((8 * 32 + 3) * 8 + 3) * 8 + 4] = inf;
    const Tensor want = Interpret(m, inputs);
    auto run = [&](jit::ConvPath p) {
      Tensor t(want.type);
      jit::ConvKernel(KindOf(op), ShapeOf(g), p).Run(inputs["a"].f32.data(), inputs["b"].f32.data(), t.f32.data());
      return t;
    };
    const Tensor got = run(jit::ConvPath::kDnnlWinograd), direct = run(jit::ConvPath::kDnnlBlocked);
    CHECK(SameBits(got, direct));
    int64_t infs = 0, class_mismatches = 0;
    for (size_t i = 0; i < want.f32.size(); ++i) {
      infs += std::isinf(want.f32[i]);
      class_mismatches += std::isnan(want.f32[i]) != std::isnan(got.f32[i]) || std::isinf(want.f32[i]) != std::isinf(got.f32[i]);
    }
    CHECK(infs > 0);
    CHECK(class_mismatches == 0);
  }
}

// A step's forward convolutions take Winograd only without max pooling, whose ties need equal patches
// to give equal outputs (see above); the gradients take it either way.
TEST_CASE("a compiled step keeps its forward convolutions direct when the module has max pooling", "[jit][conv]") {
  if (!__builtin_cpu_supports("avx512f")) {
    WARN("no AVX-512: oneDNN has no Winograd kernels here");
    return;
  }
  const Geometry g{4, 32, 32, 8, 8, 3, 3, 1, 1};
  for (bool pool : {false, true}) {
    ir::Module m;
    ir::Builder b(&m);
    const ir::ValueId x = b.Input("x", {DType::kF32, {g.n, g.c, g.h, g.w}});
    const ir::ValueId w = b.Input("w", {DType::kF32, {g.o, g.c, g.kh, g.kw}});
    const ir::ValueId dy = b.Input("dy", {DType::kF32, {g.n, g.o, g.oh(), g.ow()}});
    const ir::Attrs attrs{{"stride", IntList{1, 1}}, {"padding", IntList{1, 1}}};
    ir::ValueId y = b.Emit(OpCode::kConv2d, {x, w}, attrs);
    if (pool) y = b.Emit(OpCode::kMaxPool, {y}, {{"window", IntList{2, 2}}});
    ir::Attrs fg = attrs;
    fg["filter_shape"] = IntList{g.o, g.c, g.kh, g.kw};
    m.outputs.push_back({"y", y});
    m.outputs.push_back({"dw", b.Emit(OpCode::kConv2dFilterGrad, {x, dy}, fg)});
    INFO("max pooling: " << pool);
    CHECK(jit::CompiledStep::Compile(m)->info().winograd_convs == (!jit::WinogradCpu() ? 0 : pool ? 1 : 2));
  }
}

// The stem loops (jit/stem_conv.h): a grey image's 3x3 convolution, forward and filter gradient, as
// direct AVX-512 loops. Shapes with a row tail (w not a multiple of 16), several segments, a 1x1 image
// (every tap but the centre on padding) and filter-gradient groups with no image.
TEST_CASE("the stem loops match the interpreter, keep its NaNs and ties, and give the same bits on any number "
          "of threads",
          "[jit][conv]") {
  if (!__builtin_cpu_supports("avx512f")) {
    WARN("no AVX-512: the stem loops are not used here");
    return;
  }
  jit::ConfigureThreadsForReplica(1);
  const Geometry geometry[] = {
      {19, 1, 16, 28, 28, 3, 3, 1, 1},  // two segments (16 + 12); forward blocks of 7, 7, 5; groups of 3, the last 1
      {5, 1, 3, 9, 35, 3, 3, 1, 1},     // three segments (16 + 16 + 3); groups of 1, three of them empty
      {2, 1, 8, 1, 1, 3, 3, 1, 1},      // a 1x1 image
  };
  uint32_t seed = 21;
  for (const Geometry& g : geometry)
    for (OpCode op : {OpCode::kConv2d, OpCode::kConv2dFilterGrad}) {
      INFO(ir::OpName(op) << " n" << g.n << " o" << g.o << " " << g.h << "x" << g.w);
      REQUIRE(jit::PreferredConvPath(KindOf(op), ShapeOf(g)) == jit::ConvPath::kStem);
      const ir::Module m = OneOp(op, g);
      const ir::Instr& in = m.at(m.outputs[0].second);
      TensorMap inputs{{"a", RandomF32(m.type(in.operands[0]).shape, seed++)},
                       {"b", RandomF32(m.type(in.operands[1]).shape, seed++)}};
      const Tensor want = Interpret(m, inputs), scale = Interpret(m, Abs(inputs));
      const jit::ConvKernel kernel(KindOf(op), ShapeOf(g), jit::ConvPath::kStem);
      auto run = [&](const TensorMap& in_map) {
        Tensor t(want.type);
        kernel.Run(in_map.at("a").f32.data(), in_map.at("b").f32.data(), t.f32.data());
        return t;
      };
      const Tensor got = run(inputs);
      const Tolerance tol = Tolerance::Sum(Terms(op, g));
      const conformance::Verdict v = Compare(want, got, tol, &scale);
      INFO(tol.ToString() << "\n" << v.message);
      CHECK(v.ok);
      CHECK(SameBits(run(inputs), got));
      Tensor one;
      tbb::task_arena(1).execute([&] { one = run(inputs); });
      CHECK(SameBits(one, got));
      CHECK(Compare(want, Jit(m, inputs), tol, &scale).ok);  // the compiled step takes this path

      // An inf weight (forward) or output gradient (filter gradient) meets padding: NaNs where the
      // interpreter has them. An inf in the image's last column next to a row tail: lanes past the row
      // add nothing (no NaN from 0 * inf there).
      TensorMap bad = inputs;
      bad["b"].f32[op == OpCode::kConv2d ? 1 : 0] = std::numeric_limits<float>::infinity();  // a top tap / a corner
      bad["a"].f32[g.w - 1] = -std::numeric_limits<float>::infinity();
      const Tensor want_bad = Interpret(m, bad), got_bad = run(bad);
      int64_t nans = 0, class_mismatches = 0;
      for (size_t i = 0; i < want_bad.f32.size(); ++i) {
        nans += std::isnan(want_bad.f32[i]);
        class_mismatches += std::isnan(want_bad.f32[i]) != std::isnan(got_bad.f32[i]) ||
                            std::isinf(want_bad.f32[i]) != std::isinf(got_bad.f32[i]);
      }
      CHECK(nans > 0);
      CHECK(class_mismatches == 0);
    }

  // Equal input patches give equal outputs (max pooling's ties; see the test above): a constant
  // background with a bright square in the middle.
  const Geometry g{4, 1, 8, 14, 20, 3, 3, 1, 1};
  Tensor x(ir::TensorType{DType::kF32, {g.n, 1, g.h, g.w}});
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(0, 1);
  for (int64_t i = 0; i < g.n * g.h * g.w; ++i) {
    const int64_t r = i / g.w % g.h, c = i % g.w;
    x.f32[i] = (r >= 5 && r < 9 && c >= 8 && c < 12) ? u(rng) : 0.3f;
  }
  const Tensor w = RandomF32({g.o, 1, 3, 3}, 6);
  Tensor y(ir::TensorType{DType::kF32, {g.n, g.o, g.h, g.w}});
  jit::ConvKernel(jit::ConvKind::kForward, ShapeOf(g), jit::ConvPath::kStem).Run(x.f32.data(), w.f32.data(), y.f32.data());
  int64_t unequal = 0;
  for (int64_t n = 0; n < g.n; ++n)
    for (int64_t o = 0; o < g.o; ++o) {
      const float* plane = y.f32.data() + (n * g.o + o) * g.h * g.w;
      for (int64_t r : {1, 2, 11, 12})
        for (int64_t c : {1, 2, 5, 14, 15, 16, 17, 18}) unequal += plane[r * g.w + c] != plane[1 * g.w + 1];
    }
  CHECK(unequal == 0);
  // Not for the input gradient, nor for more than one input channel.
  CHECK(jit::PreferredConvPath(jit::ConvKind::kInputGrad, ShapeOf(g)) != jit::ConvPath::kStem);
  CHECK(jit::PreferredConvPath(jit::ConvKind::kForward, ShapeOf({4, 2, 8, 14, 20, 3, 3, 1, 1})) != jit::ConvPath::kStem);
  CHECK_THROWS_WITH(jit::ConvKernel(jit::ConvKind::kInputGrad, ShapeOf(g), jit::ConvPath::kStem),
                    Catch::Contains("one input channel"));
}
