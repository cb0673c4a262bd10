// The channels-last path's two routes for 16 -> 16 channel 3x3 stride-1 convolutions (jit/dnnl_conv.h):
// the filter gradient by our own AVX-512 loops (jit/nhwc16_filter_grad.h) and the input gradient as
// oneDNN's forward pass of the turned filter. Both against the interpreter (NCHW) within the sums'
// rounding, on batches that leave filter-gradient groups short or empty and on images so small that
// most taps fall on padding; the same bits twice and on one TBB thread; an inf meeting padding gives
// the interpreter's NaN/inf pattern.
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
#include "jit/nhwc16_filter_grad.h"
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

constexpr int64_t kC = 16;

struct Case {
  int64_t n, h, w;
};

// The interpreter's op: input gradient (a = dy, b = w) or filter gradient (a = x, b = dy), NCHW.
ir::Module OneOp(OpCode op, const Case& k) {
  ir::Module m;
  ir::Builder b(&m);
  const ir::Shape x{k.n, kC, k.h, k.w}, w{kC, kC, 3, 3};
  ir::Attrs attrs{{"stride", IntList{1, 1}}, {"padding", IntList{1, 1}}};
  ir::ValueId a, c;
  if (op == OpCode::kConv2dInputGrad) {
    a = b.Input("a", {DType::kF32, x});
    c = b.Input("b", {DType::kF32, w});
    attrs["input_shape"] = IntList(x.begin(), x.end());
  } else {
    a = b.Input("a", {DType::kF32, x});
    c = b.Input("b", {DType::kF32, x});
    attrs["filter_shape"] = IntList(w.begin(), w.end());
  }
  m.outputs.push_back({"out", b.Emit(op, {a, c}, attrs)});
  return m;
}

std::vector<float> ToNhwc(const Tensor& t, const Case& k) {
  std::vector<float> y(t.f32.size());
  jit::NchwToNhwc(t.f32.data(), k.n, kC, k.h * k.w, y.data());
  return y;
}

// The kernel on the NHWC forms of the inputs (the weights stay OIHW), its output back in NCHW.
Tensor RunNhwc(const jit::ConvKernel& kernel, OpCode op, const Case& k, const TensorMap& in, const ir::TensorType& type) {
  const std::vector<float> a = ToNhwc(in.at("a"), k);
  const std::vector<float> b = op == OpCode::kConv2dFilterGrad ? ToNhwc(in.at("b"), k) : in.at("b").f32;
  Tensor out(type);
  if (op == OpCode::kConv2dFilterGrad) {
    kernel.Run(a.data(), b.data(), out.f32.data());
  } else {
    std::vector<float> nhwc(out.f32.size());
    kernel.Run(a.data(), b.data(), nhwc.data());
    jit::NhwcToNchw(nhwc.data(), k.n, kC, k.h * k.w, out.f32.data());
  }
  return out;
}

}  // namespace

TEST_CASE("16-channel channels-last gradients match the interpreter, keep its NaNs and give the same bits on any "
          "number of threads",
          "[jit][conv]") {
  if (!__builtin_cpu_supports("avx512f")) {
    WARN("no AVX-512: the 16-channel filter-gradient loops are not used here");
    return;
  }
  jit::ConfigureThreadsForReplica(1);
  const Case cases[] = {
      {19, 9, 7},   // filter-gradient groups of 3 images, the last of 1
      {5, 28, 28},  // groups of 1, three of them empty; resnet20's image size
      {2, 1, 1},    // a 1x1 image: only the centre tap reads inside it
  };
  uint32_t seed = 31;
  for (const Case& k : cases)
    for (OpCode op : {OpCode::kConv2dInputGrad, OpCode::kConv2dFilterGrad}) {
      INFO(ir::OpName(op) << " n" << k.n << " " << k.h << "x" << k.w);
      const ir::Module m = OneOp(op, k);
      const ir::TensorType type = m.type(m.outputs[0].second);
      const jit::ConvShape g{k.n, kC, k.h, k.w, kC, 3, 3, 1, 1, 1, 1, k.h, k.w};
      const jit::ConvKind kind = op == OpCode::kConv2dInputGrad ? jit::ConvKind::kInputGrad : jit::ConvKind::kFilterGrad;
      const auto kernel = jit::PlannedChannelsLastConv(kind, g);
      REQUIRE(kernel);
      CHECK_THAT(kernel->Describe(),
                 Catch::Contains(op == OpCode::kConv2dInputGrad ? "(turned filter)" : "nhwc16-avx512"));
      const ir::Instr& in = m.at(m.outputs[0].second);
      TensorMap inputs{{"a", RandomF32(m.type(in.operands[0]).shape, seed++)},
                       {"b", RandomF32(m.type(in.operands[1]).shape, seed++)}};
      TensorMap no_vars;
      const Tensor want = runtime::RunStep(m, no_vars, inputs).at("out");
      const Tensor scale = runtime::RunStep(m, no_vars, Abs(inputs)).at("out");
      const Tensor got = RunNhwc(*kernel, op, k, inputs, type);
      const Tolerance tol = Tolerance::Sum(op == OpCode::kConv2dInputGrad ? kC * 9 : k.n * k.h * k.w);
      const conformance::Verdict v = Compare(want, got, tol, &scale);
      INFO(tol.ToString() << "\n" << v.message);
      CHECK(v.ok);
      CHECK(SameBits(RunNhwc(*kernel, op, k, inputs, type), got));
      Tensor one;
      tbb::task_arena(1).execute([&] { one = RunNhwc(*kernel, op, k, inputs, type); });
      CHECK(SameBits(one, got));

      // An inf output gradient in an image's corner (filter gradient: its padded taps are multiplied
      // by the interpreter) or an inf weight at a corner tap (input gradient: padded cells dropped),
      // and a -inf input: the interpreter's NaN and inf pattern.
      TensorMap bad = inputs;
      bad["b"].f32[0] = std::numeric_limits<float>::infinity();
      if (op == OpCode::kConv2dFilterGrad) bad["a"].f32[k.h * k.w - 1] = -std::numeric_limits<float>::infinity();
      const Tensor want_bad = runtime::RunStep(m, no_vars, bad).at("out"), got_bad = RunNhwc(*kernel, op, k, bad, type);
      int64_t nonfinite = 0, class_mismatches = 0;
      for (size_t i = 0; i < want_bad.f32.size(); ++i) {
        nonfinite += !std::isfinite(want_bad.f32[i]);
        class_mismatches += std::isnan(want_bad.f32[i]) != std::isnan(got_bad.f32[i]) ||
                            std::isinf(want_bad.f32[i]) != std::isinf(got_bad.f32[i]);
      }
      // (In a 1x1 image a corner tap meets only padding: the input gradient drops it, all finite.)
      CHECK((nonfinite > 0) == (op == OpCode::kConv2dFilterGrad || k.h > 1));
      CHECK(class_mismatches == 0);
    }
}

TEST_CASE("only 16 -> 16 channel 3x3 stride-1 padding-1 gradients take the 16-channel routes", "[jit][conv]") {
  const jit::ConvShape base{4, 16, 8, 8, 16, 3, 3, 1, 1, 1, 1, 8, 8};
  jit::ConvShape wide = base, strided = base, unpadded = base;
  wide.c = wide.o = 32;
  strided.sh = strided.sw = 2;
  strided.oh = strided.ow = 4;
  unpadded.ph = unpadded.pw = 0;
  unpadded.oh = unpadded.ow = 6;
  for (const jit::ConvShape& g : {wide, strided, unpadded}) {
    CHECK_FALSE(jit::Nhwc16FilterGradApplies(g));
    for (jit::ConvKind kind : {jit::ConvKind::kInputGrad, jit::ConvKind::kFilterGrad})
      if (const auto k = jit::PlannedChannelsLastConv(kind, g)) {
        CHECK_THAT(k->Describe(), !Catch::Contains("nhwc16-avx512"));
        // (32 channels: the turned filter on the Winograd loops where they run, jit/winograd_nhwc.h.)
        const bool turned =
            g.c == 32 && kind == jit::ConvKind::kInputGrad && jit::WinogradAllowed() && jit::WinogradNhwcApplies(g);
        CHECK((k->Describe().find("turned filter") != std::string::npos) == turned);
      }
  }
  CHECK(jit::Nhwc16FilterGradApplies(base) == static_cast<bool>(__builtin_cpu_supports("avx512f")));
}
