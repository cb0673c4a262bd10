// The channels-last Winograd F(2x2, 3x3) loops (jit/winograd_nhwc.h), alone and as the channels-last
// path runs them (the forward pass, the filter gradient, and the input gradient through the turned
// filter): against the
// interpreter (NCHW) within a sum's rounding, on images with odd sides (partial tiles), a 1x1 image
// (one tile, mostly padding), channel counts in 16s that are not powers of two and more tiles than a
// group holds; the same bits twice and on one TBB thread; an inf input or weight gives the direct
// path's bits (the interpreter's NaN/inf pattern); only the shapes it takes, and no forward pass where
// ties must be exact.
#include <catch2/catch.hpp>
#include <tbb/task_arena.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "ir/builder.h"
#include "jit/data_movement.h"
#include "jit/dnnl_conv.h"
#include "jit/dnnl_kernels.h"
#include "jit/winograd_nhwc.h"
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

struct Case {
  int64_t n, c, o, h, w;
};

jit::ConvShape ShapeOf(const Case& k) { return {k.n, k.c, k.h, k.w, k.o, 3, 3, 1, 1, 1, 1, k.h, k.w}; }

// The interpreter's op, NCHW: forward (a = x, b = w), input gradient (a = dy, b = w) or filter
// gradient (a = x, b = dy).
ir::Module OneOp(OpCode op, const Case& k) {
  ir::Module m;
  ir::Builder b(&m);
  const ir::Shape x{k.n, k.c, k.h, k.w}, w{k.o, k.c, 3, 3}, y{k.n, k.o, k.h, k.w};
  ir::Attrs attrs{{"stride", IntList{1, 1}}, {"padding", IntList{1, 1}}};
  const ir::ValueId a = b.Input("a", {DType::kF32, op == OpCode::kConv2dInputGrad ? y : x});
  const ir::ValueId c = b.Input("b", {DType::kF32, op == OpCode::kConv2dFilterGrad ? y : w});
  if (op == OpCode::kConv2dInputGrad) attrs["input_shape"] = IntList(x.begin(), x.end());
  if (op == OpCode::kConv2dFilterGrad) attrs["filter_shape"] = IntList(w.begin(), w.end());
  m.outputs.push_back({"out", b.Emit(op, {a, c}, attrs)});
  return m;
}

// f(a_nhwc, b, out) on the NHWC form of input a (channels ca), the output (channels co) back NCHW; for
// the filter gradient (co == 0) b is NHWC too (channels k.o) and the output OIHW as it is.
template <typename F>
Tensor RunNhwc(F f, const Case& k, int64_t ca, int64_t co, const TensorMap& in, const ir::TensorType& type) {
  std::vector<float> a(in.at("a").f32.size()), b = in.at("b").f32, out(type.elements());
  jit::NchwToNhwc(in.at("a").f32.data(), k.n, ca, k.h * k.w, a.data());
  if (co == 0) jit::NchwToNhwc(in.at("b").f32.data(), k.n, k.o, k.h * k.w, b.data());
  f(a.data(), b.data(), out.data());
  Tensor t(type);
  if (co == 0) t.f32 = out;
  else jit::NhwcToNchw(out.data(), k.n, co, k.h * k.w, t.f32.data());
  return t;
}

jit::ConvKind KindOf(OpCode op) {
  return op == OpCode::kConv2d ? jit::ConvKind::kForward
         : op == OpCode::kConv2dInputGrad ? jit::ConvKind::kInputGrad
                                          : jit::ConvKind::kFilterGrad;
}

}  // namespace

TEST_CASE("channels-last Winograd matches the interpreter and gives the same bits on any number of threads",
          "[jit][conv]") {
  if (std::string(jit::WinogradNhwcIsa()) == "none") {
    WARN("neither AVX-512 nor AVX2: the Winograd loops are not used here");
    return;
  }
  jit::ConfigureThreadsForReplica(1);
  const Case cases[] = {
      {3, 32, 32, 14, 14},  // resnet20's second stage: 49 tiles, groups of 10 (the last of 9)
      {2, 64, 64, 7, 7},    // its third: partial tiles on the right and bottom
      {2, 48, 32, 5, 6},    // three input vectors, two output vectors; odd height
      {2, 32, 80, 9, 4},    // five output vectors (one per product)
      {3, 32, 64, 1, 1},    // one tile, all but the centre tap on padding
      {2, 16, 16, 28, 28},  // resnet20's first stage (the loops take it on AVX2 only)
  };
  uint32_t seed = 41;
  for (const Case& k : cases)
    for (OpCode op : {OpCode::kConv2d, OpCode::kConv2dInputGrad, OpCode::kConv2dFilterGrad}) {
      INFO(ir::OpName(op) << " n" << k.n << " c" << k.c << " o" << k.o << " " << k.h << "x" << k.w);
      const ir::Module m = OneOp(op, k);
      const ir::TensorType type = m.type(m.outputs[0].second);
      const ir::Instr& in = m.at(m.outputs[0].second);
      TensorMap inputs{{"a", RandomF32(m.type(in.operands[0]).shape, seed++)},
                       {"b", RandomF32(m.type(in.operands[1]).shape, seed++)}};
      TensorMap no_vars;
      const Tensor want = runtime::RunStep(m, no_vars, inputs).at("out");
      const Tensor scale = runtime::RunStep(m, no_vars, Abs(inputs)).at("out");
      const bool forward = op == OpCode::kConv2d, filter = op == OpCode::kConv2dFilterGrad;
      const int64_t ca = op == OpCode::kConv2dInputGrad ? k.o : k.c, co = forward ? k.o : filter ? 0 : k.c;
      const auto kernel = jit::PlannedChannelsLastConv(KindOf(op), ShapeOf(k), jit::ConvTies::kFree);
      REQUIRE(kernel);
      const bool applies = jit::WinogradAllowed() && jit::WinogradNhwcApplies(ShapeOf(k));
      if (applies) {
        CHECK_THAT(kernel->Describe(), Catch::Contains(std::string("winograd-f2x2-") + jit::WinogradNhwcIsa()));
        CHECK(kernel->winograd());
      }
      auto run = [&] {
        return RunNhwc([&](const float* a, const float* b, float* out) { kernel->Run(a, b, out); }, k, ca, co, inputs,
                       type);
      };
      const Tensor got = run();
      const Tolerance tol = Tolerance::Sum(filter ? k.n * k.h * k.w : ca * 9);
      const conformance::Verdict v = Compare(want, got, tol, &scale);
      INFO(kernel->Describe() << "\n" << tol.ToString() << "\n" << v.message);
      CHECK(v.ok);
      CHECK(SameBits(run(), got));
      Tensor one;
      tbb::task_arena(1).execute([&] { one = run(); });
      CHECK(SameBits(one, got));
      if (applies && op != OpCode::kConv2dInputGrad) {  // the loops alone: the same bits as through the kernel
        const Tensor alone = RunNhwc(
            [&](const float* a, const float* b, float* out) {
              CHECK((forward ? jit::WinogradNhwcForward : jit::WinogradNhwcFilterGrad)(ShapeOf(k), a, b, out));
            },
            k, ca, co, inputs, type);
        CHECK(SameBits(alone, got));
      }
    }
}

// An inf spreads over a whole Winograd tile (and a weight's halvings make NaNs of it): such calls take
// the direct kernel, whose result (the interpreter's NaN/inf pattern) they then give (bit for bit: the
// forward pass). For the filter gradient, an inf input or output gradient (in an image's corner: its
// padded taps meet it, where the interpreter multiplies a padded zero).
TEST_CASE("an inf input or weight on the Winograd path gives the direct path's bits", "[jit][conv]") {
  if (std::string(jit::WinogradNhwcIsa()) == "none" || !jit::WinogradAllowed()) {
    WARN("the Winograd loops are not used here");
    return;
  }
  jit::ConfigureThreadsForReplica(1);
  const float inf = std::numeric_limits<float>::infinity();
  const Case k{2, 32, 32, 6, 6};
  for (OpCode op : {OpCode::kConv2d, OpCode::kConv2dInputGrad, OpCode::kConv2dFilterGrad})
    for (const char* where : {"input", "weight"}) {
      INFO(ir::OpName(op) << ", an inf " << where);
      const ir::Module m = OneOp(op, k);
      const ir::TensorType type = m.type(m.outputs[0].second);
      const ir::Instr& in = m.at(m.outputs[0].second);
      TensorMap inputs{{"a", RandomF32(m.type(in.operands[0]).shape, 3)},
                       {"b", RandomF32(m.type(in.operands[1]).shape, 4)}};
      if (std::string(where) == "input") inputs["a"].f32[((1 * 32 + 5) * 6 + 2) * 6 + 3] = inf;  // image 1, channel 5, (2, 3)
      else if (op == OpCode::kConv2dFilterGrad) inputs["b"].f32[(0 * 32 + 7) * 36] = -inf;  // dy, image 0, (0, 0)
      else inputs["b"].f32[(7 * 32 + 9) * 9 + 0] = -inf;  // a corner tap: it meets padding
      TensorMap no_vars;
      const Tensor want = runtime::RunStep(m, no_vars, inputs).at("out");
      const jit::ConvKind kind = KindOf(op);
      const jit::ConvKernel winograd(kind, ShapeOf(k), jit::ConvPath::kDnnlChannelsLast, jit::ConvTies::kFree);
      const jit::ConvKernel direct(kind, ShapeOf(k), jit::ConvPath::kDnnlChannelsLast, jit::ConvTies::kExact);
      REQUIRE(winograd.winograd());
      auto run = [&](const jit::ConvKernel& kernel) {
        return RunNhwc([&](const float* a, const float* b, float* out) { kernel.Run(a, b, out); }, k, 32,
                       op == OpCode::kConv2dFilterGrad ? 0 : 32, inputs, type);
      };
      const Tensor got = run(winograd);
      int64_t nonfinite = 0, class_mismatches = 0;
      for (size_t i = 0; i < want.f32.size(); ++i) {
        nonfinite += !std::isfinite(want.f32[i]);
        class_mismatches +=
            std::isnan(want.f32[i]) != std::isnan(got.f32[i]) || std::isinf(want.f32[i]) != std::isinf(got.f32[i]);
      }
      CHECK(nonfinite > 0);
      CHECK(class_mismatches == 0);
      if (kind == jit::ConvKind::kForward) CHECK(SameBits(got, run(direct)));  // (the input gradient's: turned, both)
    }
}

TEST_CASE("only 3x3 stride-1 padding-1 convolutions with channels in 16s (from 32; on AVX2 from 16) take the "
          "Winograd loops",
          "[jit][conv]") {
  const jit::ConvShape base = ShapeOf({4, 32, 32, 8, 8});
  jit::ConvShape strided = base, unpadded = base, five = base, narrow = base, sixteen = base;
  strided.sh = strided.sw = 2;
  strided.oh = strided.ow = 4;
  unpadded.ph = unpadded.pw = 0;
  unpadded.oh = unpadded.ow = 6;
  five.kh = five.kw = 5;
  five.ph = five.pw = 2;
  narrow.c = 40;  // not a multiple of 16
  sixteen.c = sixteen.o = 16;  // on AVX-512 oneDNN's direct kernel was faster in the step (bench/conv)
  for (const jit::ConvShape& g : {strided, unpadded, five, narrow}) CHECK_FALSE(jit::WinogradNhwcApplies(g));
  CHECK(jit::WinogradNhwcApplies(sixteen) == (std::string(jit::WinogradNhwcIsa()) == "avx2"));
  CHECK(jit::WinogradNhwcApplies(base) == (std::string(jit::WinogradNhwcIsa()) != "none"));
  // Where equal patches must give equal outputs (max pooling in the module), the forward pass stays direct;
  // the gradients take it either way.
  const auto exact = jit::PlannedChannelsLastConv(jit::ConvKind::kForward, base, jit::ConvTies::kExact);
  REQUIRE(exact);
  CHECK_FALSE(exact->winograd());
  const auto grad = jit::PlannedChannelsLastConv(jit::ConvKind::kInputGrad, base, jit::ConvTies::kExact);
  REQUIRE(grad);
  CHECK(grad->winograd() == (jit::WinogradAllowed() && jit::WinogradNhwcApplies(base)));
  const auto filter = jit::PlannedChannelsLastConv(jit::ConvKind::kFilterGrad, base, jit::ConvTies::kExact);
  REQUIRE(filter);
  CHECK(filter->winograd() == (jit::WinogradAllowed() && jit::WinogradNhwcApplies(base)));
}
