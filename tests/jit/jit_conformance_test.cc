// Op conformance: every op of ir/ops.def runs on the CPU JIT backend and on the reference interpreter,
// and the results agree element by element (tests/jit/conformance_compare.h has the rule and why each
// tolerance is what it is).
//
//  1. Value cases (CasesFor): well-scaled random inputs for every op and every dtype that shape
//     inference accepts; each op's tolerance is exact, a few ulp (libm calls) or a proven bound on a
//     sum of K terms relative to sum|terms| (computed by the interpreter on |inputs|).
//  2. Dtype coverage: for every op, every operand dtype signature that shape inference accepts has
//     a value case, or a case in which both backends refuse it with an error.
//  3. Specials with hand-written exact expectations (NaN, +-inf, -0, overflow, saturation, s32
//     wrapping, empty reductions): the JIT and the interpreter are each compared with the expectation
//     (by class and sign for NaN/inf, bitwise for finite values) and with each other.
//  4. Bad data is an error on both backends.
//  5. The mutation check (a test of this test): one element of the JIT's result, moved just beyond
//     its tolerance, is rejected and named; an error that a large value elsewhere masked under the
//     old max-based rule is rejected.
// CasesFor is a switch over the op table with no default, so a new op without a case fails to compile,
// and the walk fails when an op has no case.
#include <catch2/catch.hpp>
#include <tbb/global_control.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <tuple>

#include "ir/builder.h"
#include "ir/printer.h"
#include "ir/passes/elementwise_fuser.h"
#include "ir/passes/mixed_precision.h"
#include "ir/error.h"
#include "ir/shape_inference.h"
#include "jit/compiled_step.h"
#include "jit/cpu_executor.h"
#include "jit/data_movement.h"
#include "jit/dnnl_kernels.h"
#include "jit/step_rewrites.h"
#include "runtime/inprocess_collectives.h"
#include "runtime/interpreter.h"
#include "runtime/replica_runner.h"
#include "tests/jit/conformance_compare.h"

using namespace shardstep;
using namespace shardstep::runtime;
using conformance::Compare;
using conformance::Tolerance;
using conformance::Verdict;
using ir::DType;
using ir::IntList;
using ir::OpCode;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int32_t kMaxS = std::numeric_limits<int32_t>::max();
constexpr int32_t kMinS = std::numeric_limits<int32_t>::min();
// libm results (exp, log, tanh, sin, cos, sigmoid, pow): within 4 ulp (conformance_compare.h).
const Tolerance kLibm = Tolerance::Ulps(4);

// ---- Ordinary inputs ----

// kGrid: quarters in [-3, 3] (s32: [-12, 12]): ties and zeros, so comparisons hit equality and pools
//        hit the first-maximum rule.
// kUniform: full-mantissa values in [-2, 2] (s32: [-1000, 1000]), so sums round.
// kPositive: [1/8, 4] (s32: [1, 13]) for log, sqrt, rsqrt and pow's base.
// kNonZero: |x| in [1/2, 2] with random sign (s32: [-50, 50] without 0), for divisors.
// kWide: [-50, 50] (s32: the whole range, so add, mul and sums wrap).
enum class Dist { kGrid, kUniform, kPositive, kNonZero, kWide };

Tensor Random(ir::TensorType t, uint32_t seed, Dist dist) {
  std::mt19937 rng(seed);
  Tensor out(t);
  for (int64_t i = 0; i < out.elements(); ++i) {
    if (t.dtype == DType::kF32) {
      float v = 0;
      switch (dist) {
        case Dist::kGrid: v = std::uniform_int_distribution<int>(-12, 12)(rng) * 0.25f; break;
        case Dist::kUniform: v = std::uniform_real_distribution<float>(-2, 2)(rng); break;
        case Dist::kPositive: v = std::uniform_real_distribution<float>(0.125f, 4)(rng); break;
        case Dist::kNonZero:
          v = std::uniform_real_distribution<float>(0.5f, 2)(rng) * (rng() & 1 ? 1 : -1);
          break;
        case Dist::kWide: v = std::uniform_real_distribution<float>(-50, 50)(rng); break;
      }
      out.f32[i] = v;
    } else {
      int32_t v = 0;
      switch (dist) {
        case Dist::kGrid: v = std::uniform_int_distribution<int32_t>(-12, 12)(rng); break;
        case Dist::kUniform: v = std::uniform_int_distribution<int32_t>(-1000, 1000)(rng); break;
        case Dist::kPositive: v = std::uniform_int_distribution<int32_t>(1, 13)(rng); break;
        case Dist::kNonZero:
          v = std::uniform_int_distribution<int32_t>(1, 50)(rng) * (rng() & 1 ? 1 : -1);
          break;
        case Dist::kWide: v = std::uniform_int_distribution<int32_t>(kMinS, kMaxS)(rng); break;
      }
      out.s32[i] = v;
    }
  }
  return out;
}

// ---- Cases ----

struct Case {
  std::string label;
  ir::Module m;
  TensorMap variables, inputs;  // inputs: the same on every replica (collectives add the replica id)
  Tolerance tol;                // for f32 results; s32 is always exact
  std::set<std::string> signed_inputs;  // kept as they are (not |x|) when computing the sum|terms| scale
  bool expect_error = false;    // both backends must refuse the case with shardstep::Error
};

struct CaseBuilder {
  Case c;
  ir::Builder b{&c.m};
  int next_input = 0;
  uint32_t salt;
  explicit CaseBuilder(std::string label, Tolerance tol = Tolerance::Exact())
      : salt(static_cast<uint32_t>(std::hash<std::string>()(label))) {
    c.label = std::move(label);
    c.tol = tol;
  }
  std::string NextName() { return "x" + std::to_string(next_input++); }
  ir::ValueId In(ir::TensorType t, Dist d = Dist::kUniform) {
    const std::string name = NextName();
    c.inputs[name] = Random(t, salt + 31 * next_input, d);
    return b.Input(name, t);
  }
  // An input that keeps its sign in the |terms| scale (max_pool_grad's x decides where terms go).
  ir::ValueId InSigned(ir::TensorType t, Dist d) {
    c.signed_inputs.insert("x" + std::to_string(next_input));
    return In(t, d);
  }
  ir::ValueId InTensor(Tensor t) {
    const std::string name = NextName();
    ir::ValueId v = b.Input(name, t.type);
    c.inputs[name] = std::move(t);
    return v;
  }
  Case Out(ir::ValueId v) {
    c.m.outputs.push_back({"out", v});
    return std::move(c);
  }
};

ir::TensorType F(ir::Shape s) { return {DType::kF32, std::move(s)}; }
ir::TensorType S(ir::Shape s) { return {DType::kS32, std::move(s)}; }
ir::TensorType T(DType t, ir::Shape s) { return {t, std::move(s)}; }
const char* Name(DType t) { return ir::DTypeName(t); }
int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The cases of one op: every dtype shape inference accepts, attribute variants, ordinary inputs.
std::vector<Case> CasesFor(OpCode op) {
  std::vector<Case> out;
  const std::string name = ir::OpName(op);
  // Large: more than two parallel chunks of a fused loop (jit/step_runtime.cc), not a multiple of
  // any vector width.
  const ir::Shape large = {257, 263};
  auto unary = [&](DType t, Dist d, Tolerance tol = Tolerance::Exact(), ir::Shape shape = {7, 13}) {
    CaseBuilder cb(name + " " + Name(t) + " dist " + std::to_string(static_cast<int>(d)) +
                       (shape == large ? " large" : ""),
                   tol);
    auto x = cb.In({t, shape}, d);
    out.push_back(cb.Out(cb.b.Emit(op, {x})));
  };
  auto binary = [&](DType t, Dist dx, Dist dy, Tolerance tol = Tolerance::Exact(), ir::Shape shape = {9, 11}) {
    CaseBuilder cb(name + " " + Name(t) + " dists " + std::to_string(static_cast<int>(dx)) + "," +
                       std::to_string(static_cast<int>(dy)) + (shape == large ? " large" : ""),
                   tol);
    auto x = cb.In({t, shape}, dx);
    auto y = cb.In({t, shape}, dy);
    out.push_back(cb.Out(cb.b.Emit(op, {x, y})));
  };
  // Shape inference does not look at the dtype of convolution and pooling operands; both backends
  // refuse anything but f32 at run time. One refused case per non-f32 operand signature.
  auto refused = [&](std::vector<ir::TensorType> types, ir::Attrs attrs) {
    const int n = static_cast<int>(types.size());
    for (int mask = 1; mask < (1 << n); ++mask) {
      std::string sig;
      CaseBuilder cb("");
      std::vector<ir::ValueId> xs;
      for (int i = 0; i < n; ++i) {
        ir::TensorType t = types[i];
        if (mask & (1 << i)) t.dtype = DType::kS32;
        sig += std::string(i ? "," : "") + Name(t.dtype);
        xs.push_back(cb.In(t, Dist::kGrid));
      }
      cb.c.label = name + " refuses (" + sig + ")";
      cb.c.expect_error = true;
      out.push_back(cb.Out(cb.b.Emit(op, xs, attrs)));
    }
  };
  switch (op) {
    case OpCode::kVariable:
      for (DType t : {DType::kF32, DType::kS32}) {
        CaseBuilder cb(name + " " + Name(t));
        auto v = cb.b.Variable("w", T(t, {3, 5}), ir::kRoleWeight);
        cb.c.variables["w"] = Random(T(t, {3, 5}), 3, Dist::kUniform);
        auto y = cb.b.Add(v, v);
        cb.c.m.assigns.push_back({v, y});
        out.push_back(cb.Out(v));
      }
      break;
    case OpCode::kInput:
      for (DType t : {DType::kF32, DType::kS32}) {
        CaseBuilder cb(name + " " + Name(t));
        out.push_back(cb.Out(cb.In(T(t, {6}), Dist::kWide)));
      }
      break;
    case OpCode::kConstant: {
      CaseBuilder f(name + " f32");
      out.push_back(f.Out(f.b.Constant(2.5, F({3, 4}))));
      CaseBuilder s(name + " s32");
      out.push_back(s.Out(s.b.Constant(-7.9, S({5}))));
      break;
    }
    case OpCode::kReplicaId: {
      CaseBuilder cb(name);
      out.push_back(cb.Out(cb.b.ReplicaId()));
      break;
    }
    case OpCode::kIota:
      for (DType t : {DType::kF32, DType::kS32})
        for (int64_t d : {0, 1, 2}) {
          CaseBuilder cb(name + " " + Name(t) + " dimension " + std::to_string(d));
          out.push_back(cb.Out(cb.b.Iota(T(t, {3, 4, 5}), d)));
        }
      break;
    case OpCode::kRandomUniform:  // Philox: the JIT's and the interpreter's implementations agree bitwise
      for (auto [step, first, shape] : {std::tuple{0, 0, ir::Shape{4, 5}}, std::tuple{7, 12, ir::Shape{3, 2, 3}},
                                        std::tuple{-1, 2147483647, ir::Shape{2, 300}}, std::tuple{3, 5, ir::Shape{}},
                                        std::tuple{123456, 64, ir::Shape{16, 1031}}}) {
        CaseBuilder cb(name + " step " + std::to_string(step) + " first " + std::to_string(first) + " " +
                       ir::ShapeToString(shape));
        auto st = cb.InTensor(Tensor::S32({}, {step})), fe = cb.InTensor(Tensor::S32({}, {first}));
        out.push_back(cb.Out(cb.b.RandomUniform(st, fe, shape, (uint64_t{0xfeedbeef} << 32) + 0x1234u + step)));
      }
      break;
    case OpCode::kNeg:
    case OpCode::kAbs:
    case OpCode::kStopGradient:
      unary(DType::kF32, Dist::kUniform);
      unary(DType::kF32, Dist::kGrid);  // zeros: neg(0) = -0 bitwise
      unary(DType::kS32, Dist::kGrid);
      unary(DType::kS32, Dist::kWide);
      unary(DType::kF32, Dist::kUniform, Tolerance::Exact(), large);
      unary(DType::kS32, Dist::kWide, Tolerance::Exact(), large);
      break;
    case OpCode::kExp:
    case OpCode::kTanh:
    case OpCode::kSin:
    case OpCode::kCos:
    case OpCode::kSigmoid:
      unary(DType::kF32, Dist::kUniform, kLibm);
      unary(DType::kF32, Dist::kWide, kLibm);
      unary(DType::kF32, Dist::kWide, kLibm, large);
      break;
    case OpCode::kRelu:
      unary(DType::kF32, Dist::kUniform);
      unary(DType::kF32, Dist::kGrid);
      unary(DType::kF32, Dist::kUniform, Tolerance::Exact(), large);
      break;
    case OpCode::kLog:
      unary(DType::kF32, Dist::kPositive, kLibm);
      unary(DType::kF32, Dist::kPositive, kLibm, large);
      break;
    case OpCode::kSqrt:   // IEEE sqrt is correctly rounded: exact
    case OpCode::kRsqrt:  // 1 / sqrt(x), two correctly rounded operations: exact
      unary(DType::kF32, Dist::kPositive);
      unary(DType::kF32, Dist::kPositive, Tolerance::Exact(), large);
      break;
    case OpCode::kConvert:
      for (DType from : {DType::kF32, DType::kS32})
        for (DType to : {DType::kF32, DType::kS32})
          for (Dist d : {Dist::kUniform, Dist::kWide}) {
            CaseBuilder cb(name + " " + Name(from) + "->" + Name(to) + " dist " + std::to_string(static_cast<int>(d)));
            auto x = cb.In(T(from, {5, 6}), d);
            out.push_back(cb.Out(cb.b.Emit(op, {x}, {{"dtype", std::string(Name(to))}})));
          }
      for (DType from : {DType::kF32, DType::kS32}) {
        const DType to = from == DType::kF32 ? DType::kS32 : DType::kF32;
        CaseBuilder cb(name + " " + Name(from) + "->" + Name(to) + " large");
        auto x = cb.In(T(from, large), Dist::kWide);
        out.push_back(cb.Out(cb.b.Emit(op, {x}, {{"dtype", std::string(Name(to))}})));
      }
      break;
    case OpCode::kAdd:
    case OpCode::kSub:
    case OpCode::kMul:
    case OpCode::kMax:
    case OpCode::kMin:
    case OpCode::kEq:
    case OpCode::kNe:
    case OpCode::kLt:
    case OpCode::kLe:
    case OpCode::kGt:
    case OpCode::kGe:
      binary(DType::kF32, Dist::kUniform, Dist::kUniform);
      binary(DType::kF32, Dist::kGrid, Dist::kGrid);
      binary(DType::kS32, Dist::kGrid, Dist::kGrid);
      binary(DType::kS32, Dist::kWide, Dist::kWide);
      binary(DType::kF32, Dist::kGrid, Dist::kUniform, Tolerance::Exact(), large);
      binary(DType::kS32, Dist::kGrid, Dist::kWide, Tolerance::Exact(), large);
      break;
    case OpCode::kDiv:
      binary(DType::kF32, Dist::kUniform, Dist::kNonZero);
      binary(DType::kF32, Dist::kWide, Dist::kNonZero);
      binary(DType::kS32, Dist::kWide, Dist::kNonZero);  // s32: a native loop (checks the divisor)
      binary(DType::kS32, Dist::kGrid, Dist::kNonZero);
      binary(DType::kF32, Dist::kWide, Dist::kNonZero, Tolerance::Exact(), large);
      binary(DType::kS32, Dist::kWide, Dist::kNonZero, Tolerance::Exact(), large);
      break;
    case OpCode::kPow:
      binary(DType::kF32, Dist::kPositive, Dist::kUniform, kLibm);
      binary(DType::kF32, Dist::kPositive, Dist::kUniform, kLibm, large);
      break;
    case OpCode::kSelect:
      for (DType ct : {DType::kF32, DType::kS32})
        for (DType vt : {DType::kF32, DType::kS32}) {
          CaseBuilder a(name + " cond " + Name(ct) + " values " + Name(vt));
          auto c = a.In(T(ct, {8, 9}), Dist::kGrid);
          auto x = a.In(T(vt, {8, 9}), Dist::kWide), y = a.In(T(vt, {8, 9}), Dist::kWide);
          out.push_back(a.Out(a.b.Select(c, x, y)));
        }
      {
        CaseBuilder a(name + " large");
        auto c = a.In(F(large), Dist::kGrid);
        auto x = a.In(F(large), Dist::kWide), y = a.In(F(large), Dist::kWide);
        out.push_back(a.Out(a.b.Select(c, x, y)));
      }
      break;
    case OpCode::kBroadcast:
      for (DType t : {DType::kF32, DType::kS32}) {
        CaseBuilder a(name + " scalar (fused) " + Name(t));
        out.push_back(a.Out(a.b.Broadcast(a.In(T(t, {}), Dist::kWide), {4, 5}, {})));
        CaseBuilder b(name + " row " + Name(t));
        out.push_back(b.Out(b.b.Broadcast(b.In(T(t, {5}), Dist::kWide), {4, 5}, {1})));
        CaseBuilder c(name + " column " + Name(t));
        out.push_back(c.Out(c.b.Broadcast(c.In(T(t, {4}), Dist::kWide), {4, 3, 5}, {0})));
        CaseBuilder d(name + " middle " + Name(t));
        out.push_back(d.Out(d.b.Broadcast(d.In(T(t, {3, 5}), Dist::kWide), {3, 4, 5}, {0, 2})));
        CaseBuilder e(name + " row large " + Name(t));
        out.push_back(e.Out(e.b.Broadcast(e.In(T(t, {263}), Dist::kWide), large, {1})));
        CaseBuilder f(name + " column large " + Name(t));
        out.push_back(f.Out(f.b.Broadcast(f.In(T(t, {257}), Dist::kWide), large, {0})));
      }
      break;
    case OpCode::kReshape:
      for (DType t : {DType::kF32, DType::kS32}) {
        CaseBuilder a(name + " " + Name(t));
        out.push_back(a.Out(a.b.Reshape(a.In(T(t, {6, 4}), Dist::kWide), {2, 12})));
      }
      break;
    case OpCode::kTranspose:
      for (DType t : {DType::kF32, DType::kS32}) {
        CaseBuilder a(name + " 3d " + Name(t));
        out.push_back(a.Out(a.b.Transpose(a.In(T(t, {2, 3, 4}), Dist::kWide), {2, 0, 1})));
        CaseBuilder b(name + " 2d " + Name(t));
        out.push_back(b.Out(b.b.Transpose(b.In(T(t, {5, 7}), Dist::kWide), {1, 0})));
        // Batches of matrix transposes with sides of at least 8 (jit/data_movement.h BatchedTranspose):
        // NCHW -> NHWC and back, a 2-D one, each with tiles cut short at both edges.
        CaseBuilder c(name + " nchw->nhwc " + Name(t));
        out.push_back(c.Out(c.b.Transpose(c.In(T(t, {3, 20, 5, 7}), Dist::kWide), {0, 2, 3, 1})));
        CaseBuilder d(name + " nhwc->nchw " + Name(t));
        out.push_back(d.Out(d.b.Transpose(d.In(T(t, {3, 5, 7, 20}), Dist::kWide), {0, 3, 1, 2})));
        CaseBuilder e(name + " 2d large " + Name(t));
        out.push_back(e.Out(e.b.Transpose(e.In(T(t, {19, 33}), Dist::kWide), {1, 0})));
      }
      break;
    case OpCode::kSlice:
      for (DType t : {DType::kF32, DType::kS32}) {
        CaseBuilder a(name + " " + Name(t));
        out.push_back(a.Out(a.b.Slice(a.In(T(t, {5, 6, 7}), Dist::kWide), {1, 0, 2}, {4, 6, 5})));
      }
      break;
    case OpCode::kPad:
      for (DType t : {DType::kF32, DType::kS32}) {
        CaseBuilder a(name + " " + Name(t));
        out.push_back(a.Out(a.b.Pad(a.In(T(t, {3, 4}), Dist::kWide), {1, 0}, {2, 3})));
        CaseBuilder b(name + " 1d " + Name(t));
        out.push_back(b.Out(b.b.Pad(b.In(T(t, {25}), Dist::kWide), {0}, {1})));
      }
      break;
    case OpCode::kConcat:
      for (DType t : {DType::kF32, DType::kS32}) {
        CaseBuilder a(name + " axis 1 " + Name(t));
        auto x = a.In(T(t, {3, 2}), Dist::kWide), y = a.In(T(t, {3, 5}), Dist::kWide);
        out.push_back(a.Out(a.b.Concat({x, y}, 1)));
        CaseBuilder b(name + " axis 0 " + Name(t));
        auto p = b.In(T(t, {2, 4}), Dist::kWide), q = b.In(T(t, {1, 4}), Dist::kWide), r = b.In(T(t, {3, 4}), Dist::kWide);
        out.push_back(b.Out(b.b.Concat({p, q, r}, 0)));
      }
      break;
    case OpCode::kReduceSum:
    case OpCode::kReduceMax:
    case OpCode::kReduceMean: {
      const ir::Shape shape = {4, 5, 6};
      for (IntList axes : {IntList{1}, IntList{0, 2}, IntList{0, 1, 2}, IntList{2}}) {
        int64_t terms = 1;
        for (int64_t a : axes) terms *= shape[a];
        // Sums accumulate in double on both backends (the interpreter's convention); max is exact.
        const Tolerance tol = op == OpCode::kReduceMax ? Tolerance::Exact() : Tolerance::Sum(terms, true);
        for (auto [t, d] : {std::pair{DType::kF32, Dist::kUniform}, std::pair{DType::kF32, Dist::kGrid},
                            std::pair{DType::kS32, Dist::kGrid}, std::pair{DType::kS32, Dist::kWide}}) {
          std::ostringstream label;
          label << name << " " << Name(t) << " dist " << static_cast<int>(d) << " axes " << ir::ShapeToString(axes);
          CaseBuilder a(label.str(), tol);
          out.push_back(a.Out(a.b.Emit(op, {a.In({t, shape}, d)}, {{"axes", axes}})));
        }
      }
      break;
    }
    case OpCode::kMatmul:
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb) {
          CaseBuilder a(name + " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb), Tolerance::Sum(17));
          auto x = a.In(F(ta ? ir::Shape{17, 9} : ir::Shape{9, 17}));
          auto y = a.In(F(tb ? ir::Shape{13, 17} : ir::Shape{17, 13}));
          out.push_back(a.Out(a.b.Matmul(x, y, ta, tb)));
        }
      {  // large enough for ParallelSgemm's row blocks (m*n*k >= 2^22)
        CaseBuilder a(name + " 256x128x130 (row blocks)", Tolerance::Sum(130));
        auto x = a.In(F({256, 130})), y = a.In(F({130, 128}));
        out.push_back(a.Out(a.b.Matmul(x, y)));
      }
      {  // dX = dY W^T with a replica's 16 rows: StepSgemm computes it turned around (C^T = W dY^T)
        SS_CHECK(jit::SgemmTurnsAround(false, true, 16, 128, 512), "the case no longer covers the turned path");
        CaseBuilder a(name + " 16x128x512 tb=1 (turned around)", Tolerance::Sum(512));
        auto x = a.In(F({16, 512})), y = a.In(F({128, 512}));
        out.push_back(a.Out(a.b.Matmul(x, y, false, true)));
      }
      // Batched: leading dimensions are independent products (attention's [B,H,T,D] x [B,H,T,D]^T).
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb) {
          CaseBuilder a(name + " batched [3] ta=" + std::to_string(ta) + " tb=" + std::to_string(tb), Tolerance::Sum(11));
          auto x = a.In(F(ta ? ir::Shape{3, 11, 7} : ir::Shape{3, 7, 11}));
          auto y = a.In(F(tb ? ir::Shape{3, 5, 11} : ir::Shape{3, 11, 5}));
          out.push_back(a.Out(a.b.Matmul(x, y, ta, tb)));
        }
      {
        CaseBuilder a(name + " batched [2,3] q k^T", Tolerance::Sum(8));
        auto q = a.In(F({2, 3, 6, 8})), k = a.In(F({2, 3, 6, 8}));
        out.push_back(a.Out(a.b.Matmul(q, k, false, true)));
      }
      break;
    case OpCode::kConv2d: {
      CaseBuilder a(name, Tolerance::Sum(3 * 3 * 3));
      auto x = a.In(F({2, 3, 9, 8})), w = a.In(F({4, 3, 3, 3}));
      out.push_back(a.Out(a.b.Emit(op, {x, w}, {{"stride", IntList{2, 1}}, {"padding", IntList{1, 1}}})));
      CaseBuilder b(name + " stride 1x2 padding 0x2", Tolerance::Sum(2 * 2 * 3));
      auto x2 = b.In(F({3, 2, 7, 9})), w2 = b.In(F({5, 2, 2, 3}));
      out.push_back(b.Out(b.b.Emit(op, {x2, w2}, {{"stride", IntList{1, 2}}, {"padding", IntList{0, 2}}})));
      refused({F({2, 3, 9, 8}), F({4, 3, 3, 3})}, {{"stride", IntList{2, 1}}, {"padding", IntList{1, 1}}});
      break;
    }
    case OpCode::kConv2dInputGrad: {
      // dx element: sum over output channels and the kernel positions that cover it.
      CaseBuilder a(name, Tolerance::Sum(4 * 3 * 3));
      auto dy = a.In(F({2, 4, 5, 8})), w = a.In(F({4, 3, 3, 3}));
      const ir::Attrs attrs = {{"input_shape", IntList{2, 3, 9, 8}}, {"stride", IntList{2, 1}}, {"padding", IntList{1, 1}}};
      out.push_back(a.Out(a.b.Emit(op, {dy, w}, attrs)));
      CaseBuilder b(name + " stride 1x2 padding 0x2", Tolerance::Sum(5 * 2 * 3));
      auto dy2 = b.In(F({3, 5, 6, 6})), w2 = b.In(F({5, 2, 2, 3}));
      out.push_back(b.Out(b.b.Emit(op, {dy2, w2},
                                   {{"input_shape", IntList{3, 2, 7, 9}}, {"stride", IntList{1, 2}}, {"padding", IntList{0, 2}}})));
      refused({F({2, 4, 5, 8}), F({4, 3, 3, 3})}, attrs);
      break;
    }
    case OpCode::kConv2dFilterGrad: {
      // dw element: sum over images and output positions.
      CaseBuilder a(name, Tolerance::Sum(2 * 5 * 8));
      auto x = a.In(F({2, 3, 9, 8})), dy = a.In(F({2, 4, 5, 8}));
      const ir::Attrs attrs = {{"filter_shape", IntList{4, 3, 3, 3}}, {"stride", IntList{2, 1}}, {"padding", IntList{1, 1}}};
      out.push_back(a.Out(a.b.Emit(op, {x, dy}, attrs)));
      CaseBuilder b(name + " 19 images (8 groups of 3)", Tolerance::Sum(19 * 5 * 5));
      auto x2 = b.In(F({19, 2, 5, 5})), dy2 = b.In(F({19, 3, 5, 5}));
      out.push_back(b.Out(b.b.Emit(op, {x2, dy2},
                                   {{"filter_shape", IntList{3, 2, 3, 3}}, {"stride", IntList{1, 1}}, {"padding", IntList{1, 1}}})));
      refused({F({2, 3, 9, 8}), F({2, 4, 5, 8})}, attrs);
      break;
    }
    case OpCode::kMaxPool:
    case OpCode::kAvgPool: {
      // avg_pool: a sum of kh*kw terms, then a division (one more rounding).
      auto tol = [&](int64_t area) { return op == OpCode::kMaxPool ? Tolerance::Exact() : Tolerance::Sum(area + 1); };
      for (Dist d : {Dist::kGrid, Dist::kUniform}) {
        const std::string ds = d == Dist::kGrid ? " grid" : " uniform";
        CaseBuilder a(name + " 2x2" + ds, tol(4));
        out.push_back(a.Out(a.b.Emit(op, {a.In(F({2, 3, 8, 6}), d)}, {{"window", IntList{2, 2}}})));
        CaseBuilder b(name + " 2x2 odd input" + ds, tol(4));
        out.push_back(b.Out(b.b.Emit(op, {b.In(F({2, 3, 9, 7}), d)}, {{"window", IntList{2, 2}}})));
        CaseBuilder c(name + " overlapping 3x3 stride 2" + ds, tol(9));
        out.push_back(c.Out(c.b.Emit(op, {c.In(F({2, 3, 9, 7}), d)}, {{"window", IntList{3, 3}}, {"stride", IntList{2, 2}}})));
      }
      CaseBuilder l(name + " 2x2 large (parallel rows)", tol(4));
      out.push_back(l.Out(l.b.Emit(op, {l.In(F({4, 16, 34, 32}), Dist::kGrid)}, {{"window", IntList{2, 2}}})));
      CaseBuilder l3(name + " 3x3 large (parallel planes)", tol(9));
      out.push_back(l3.Out(l3.b.Emit(op, {l3.In(F({4, 16, 33, 31}), Dist::kGrid)}, {{"window", IntList{3, 3}}, {"stride", IntList{2, 2}}})));
      if (op == OpCode::kMaxPool)  // padded cells never win (all-negative inputs would pick a padded 0)
        for (Dist d : {Dist::kGrid, Dist::kUniform}) {
          CaseBuilder p(name + " 3x3 stride 2 padding 1" + (d == Dist::kGrid ? " grid" : " uniform"));
          Tensor neg = Random(F({2, 3, 9, 7}), 77, d);
          for (float& v : neg.f32) v = -std::abs(v) - 0.5f;
          out.push_back(p.Out(p.b.MaxPool(p.InTensor(neg), {3, 3}, {2, 2}, 1)));
          CaseBuilder q(name + " 2x2 stride 1 padding 1" + (d == Dist::kGrid ? " grid" : " uniform"));
          out.push_back(q.Out(q.b.MaxPool(q.In(F({2, 2, 5, 6}), d), {2, 2}, {1, 1}, 1)));
        }
      refused({F({2, 3, 8, 6})}, {{"window", IntList{2, 2}}});
      break;
    }
    case OpCode::kMaxPoolGrad: {
      // dx element: the sum of dy over the windows whose first maximum it is (x on a grid: ties).
      CaseBuilder a(name + " 2x2", Tolerance::Sum(1));
      auto x = a.InSigned(F({2, 3, 8, 6}), Dist::kGrid), dy = a.In(F({2, 3, 4, 3}));
      out.push_back(a.Out(a.b.Emit(op, {x, dy}, {{"window", IntList{2, 2}}})));
      CaseBuilder b(name + " 2x2 odd input", Tolerance::Sum(1));
      auto xb = b.InSigned(F({2, 3, 9, 7}), Dist::kGrid), dyb = b.In(F({2, 3, 4, 3}));
      out.push_back(b.Out(b.b.Emit(op, {xb, dyb}, {{"window", IntList{2, 2}}})));
      CaseBuilder c(name + " overlapping 3x3 stride 2", Tolerance::Sum(CeilDiv(3, 2) * CeilDiv(3, 2)));
      auto x2 = c.InSigned(F({2, 3, 9, 7}), Dist::kGrid), dy2 = c.In(F({2, 3, 4, 3}));
      out.push_back(c.Out(c.b.Emit(op, {x2, dy2}, {{"window", IntList{3, 3}}, {"stride", IntList{2, 2}}})));
      CaseBuilder l(name + " 2x2 large (parallel rows)", Tolerance::Sum(1));
      auto xl = l.InSigned(F({4, 16, 34, 32}), Dist::kGrid), dyl = l.In(F({4, 16, 17, 16}));
      out.push_back(l.Out(l.b.Emit(op, {xl, dyl}, {{"window", IntList{2, 2}}})));
      CaseBuilder l3(name + " 3x3 large (parallel planes)", Tolerance::Sum(4));
      auto xl3 = l3.InSigned(F({4, 16, 33, 31}), Dist::kGrid), dyl3 = l3.In(F({4, 16, 16, 15}));
      out.push_back(l3.Out(l3.b.Emit(op, {xl3, dyl3}, {{"window", IntList{3, 3}}, {"stride", IntList{2, 2}}})));
      CaseBuilder p(name + " 3x3 stride 2 padding 1", Tolerance::Sum(4));
      auto xp = p.InSigned(F({2, 3, 9, 7}), Dist::kGrid), dyp = p.In(F({2, 3, 5, 4}));
      out.push_back(p.Out(p.b.Emit(op, {xp, dyp}, {{"window", IntList{3, 3}}, {"stride", IntList{2, 2}}, {"padding", int64_t{1}}})));
      refused({F({2, 3, 8, 6}), F({2, 3, 4, 3})}, {{"window", IntList{2, 2}}});
      break;
    }
    case OpCode::kAvgPoolGrad: {
      // dx element: the sum of dy / area over the windows that cover it.
      CaseBuilder a(name, Tolerance::Sum(1 + 1));
      auto dy = a.In(F({2, 3, 4, 3}));
      out.push_back(a.Out(a.b.Emit(op, {dy}, {{"window", IntList{2, 2}}, {"input_shape", IntList{2, 3, 8, 6}}})));
      CaseBuilder b(name + " overlapping 3x3 stride 2", Tolerance::Sum(CeilDiv(3, 2) * CeilDiv(3, 2) + 1));
      auto dy2 = b.In(F({2, 3, 4, 3}));
      out.push_back(b.Out(b.b.Emit(
          op, {dy2}, {{"window", IntList{3, 3}}, {"stride", IntList{2, 2}}, {"input_shape", IntList{2, 3, 9, 7}}})));
      refused({F({2, 3, 4, 3})}, {{"window", IntList{2, 2}}, {"input_shape", IntList{2, 3, 8, 6}}});
      break;
    }
    case OpCode::kAttention:
    case OpCode::kAttentionGrad: {
      // The interpreter's products sum in double in index order and its exp is libm's; the JIT's sum in
      // f32 (oneDNN) and its exp is within 1 ulp: relative and absolute allowances (inputs of size ~1,
      // outputs of size ~1). bf16: grid inputs (bf16 values) and the probabilities rounded on both
      // sides, where a rounding may go the other way (2^-8).
      const int n = op == OpCode::kAttention ? 3 : 4;
      for (const auto& [shape, causal] : {std::pair{ir::Shape{2, 3, 16, 8}, 0}, std::pair{ir::Shape{2, 3, 16, 8}, 1},
                                          std::pair{ir::Shape{1, 8, 128, 32}, 1}, std::pair{ir::Shape{3, 5, 24}, 0}})
        for (int bf16 = 0; bf16 < 2; ++bf16) {
          const Tolerance tol{Tolerance::Kind::kUlps, bf16 ? 3e-2 : 1e-4, bf16 ? 3e-3 : 1e-4, 0};
          CaseBuilder a(name + " " + ir::ShapeToString(shape) + (causal ? " causal" : "") + (bf16 ? " bf16" : ""), tol);
          std::vector<ir::ValueId> xs;
          for (int i = 0; i < n; ++i) xs.push_back(a.In(F(shape), bf16 ? Dist::kGrid : Dist::kUniform));
          const double scale = 1.0 / std::sqrt(static_cast<double>(shape.back()));
          out.push_back(a.Out(a.b.Emit(op, xs, {{"scale", scale}, {"causal", int64_t{causal}}, {"bf16", int64_t{bf16}}})));
        }
      {  // the mixed-precision pass's form: operands convert(convert(x, bf16), f32), which the JIT reads as
         // bf16 in place (ReadBf16OperandsInPlace)
        const ir::Shape shape{2, 4, 32, 16};
        const Tolerance tol{Tolerance::Kind::kUlps, 3e-2, 3e-3, 0};
        CaseBuilder a(name + " " + ir::ShapeToString(shape) + " causal, bf16 operands", tol);
        std::vector<ir::ValueId> xs;
        for (int i = 0; i < n; ++i)
          xs.push_back(a.b.Convert(a.b.Convert(a.In(F(shape), Dist::kUniform), DType::kBF16), DType::kF32));
        const ir::ValueId y =
            a.b.Emit(op, xs, {{"scale", 0.25}, {"causal", int64_t{1}}, {"bf16", int64_t{1}}});
        ir::Module probe = a.b.module();
        probe.outputs.push_back({"out", y});
        jit::ReadBf16OperandsInPlace(probe);  // renumbers (the widening converts are dropped)
        bool in_place = false;
        for (ir::ValueId v = 0; v < probe.size(); ++v) in_place |= probe.at(v).op == op && probe.at(v).Has(jit::kBf16OperandsAttr);
        SS_CHECK(in_place, "the case no longer covers attention's bf16 operands read in place");
        out.push_back(a.Out(y));
      }
      break;
    }
    case OpCode::kOneHot: {
      CaseBuilder a(name);
      auto l = a.InTensor(Tensor::S32({6}, {0, 3, 9, 2, 2, 7}));
      out.push_back(a.Out(a.b.Emit(op, {l}, {{"depth", int64_t{10}}})));
      CaseBuilder b(name + " 2d labels");
      auto l2 = b.In(S({3, 4}), Dist::kPositive);  // [1, 13]
      out.push_back(b.Out(b.b.Emit(op, {l2}, {{"depth", int64_t{14}}})));
      break;
    }
    case OpCode::kGather:
      for (DType t : {DType::kF32, DType::kS32}) {
        CaseBuilder a(name + " " + Name(t));
        auto table = a.In(T(t, {5, 3, 2}), Dist::kWide);
        auto idx = a.InTensor(Tensor::S32({2, 2}, {4, 0, 2, 2}));
        out.push_back(a.Out(a.b.Emit(op, {table, idx})));
      }
      break;
    case OpCode::kScatterAdd:
      for (DType t : {DType::kF32, DType::kS32}) {
        CaseBuilder a(name + " " + Name(t), Tolerance::Sum(4));  // a row sums at most all 4 updates
        auto idx = a.InTensor(Tensor::S32({4}, {1, 3, 1, 0}));
        auto up = a.In(T(t, {4, 3}), Dist::kWide);
        out.push_back(a.Out(a.b.Emit(op, {idx, up}, {{"rows", int64_t{5}}})));
      }
      break;
    // Collectives run on the same Collectives implementation in both backends: exact. The
    // Collectives interface carries f32 only; both backends refuse s32 with an error.
    case OpCode::kAllReduce:
      for (const char* r : {"sum", "mean", "max"}) {
        CaseBuilder a(name + " " + r);
        out.push_back(a.Out(a.b.Emit(op, {a.In(F({6, 5}))}, {{"reduction", std::string(r)}})));
      }
      refused({F({6, 5})}, {{"reduction", std::string("sum")}});
      break;
    case OpCode::kReduceScatter: {
      CaseBuilder a(name);
      const ir::Attrs attrs = {{"reduction", std::string("sum")}, {"group_size", int64_t{2}}};
      out.push_back(a.Out(a.b.Emit(op, {a.In(F({6, 5}))}, attrs)));
      refused({F({6, 5})}, attrs);
      break;
    }
    case OpCode::kAllGather: {
      CaseBuilder a(name);
      out.push_back(a.Out(a.b.Emit(op, {a.In(F({3, 5}))}, {{"group_size", int64_t{2}}})));
      refused({F({3, 5})}, {{"group_size", int64_t{2}}});
      break;
    }
    case OpCode::kCollectivePermute: {  // 2 replicas: a swap, and a one-way send (replica 0 gets zeros)
      for (const ir::IntLists& pairs : {ir::IntLists{{0, 1}, {1, 0}}, ir::IntLists{{0, 1}}}) {
        CaseBuilder a(name + (pairs.size() == 2 ? " swap" : " one way"));
        out.push_back(a.Out(a.b.Emit(op, {a.In(F({3, 5}))}, {{"pairs", pairs}})));
      }
      refused({F({3, 5})}, {{"pairs", ir::IntLists{{0, 1}, {1, 0}}}});
      break;
    }
  }
  for (Case& c : out)
    if (ir::HasProperty(op, ir::kCollective) || op == OpCode::kReplicaId) c.m.num_replicas = 2;
  return out;
}

// One step on the JIT as compiled by this binary: no disk cache, whose objects are keyed by a
// hand-bumped emitter version and would otherwise let a stale kernel stand in for the code under test.
TensorMap JitStep(const ir::Module& m, TensorMap& variables, const TensorMap& inputs, int replica = 0,
                  Collectives* collectives = nullptr) {
  auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", /*disk_cache=*/false});
  jit::Workspace ws;
  return step->Run(variables, inputs, replica, collectives, &ws);
}

// CasesFor(op), built once per process (Catch re-enters a test case once per section).
const std::vector<Case>& Cases(OpCode op) {
  static std::vector<std::vector<Case>> cache = [] {
    std::vector<std::vector<Case>> all;
    for (int i = 0; i < ir::kNumOpCodes; ++i) all.push_back(CasesFor(static_cast<OpCode>(i)));
    return all;
  }();
  return cache[static_cast<int>(op)];
}

// Collectives, replica ids: run as 2 replicas with in-process collectives; everything else as 1.
// `abs_inputs`: every f32 input not in c.signed_inputs is replaced by |x| (the sum|terms| scale).
std::vector<TensorMap> Run(const Case& c, bool jit, bool abs_inputs = false) {
  const bool multi = c.m.num_replicas > 1;
  const int n = c.m.num_replicas;
  std::vector<TensorMap> outs(n);
  InProcessCollectives coll(n);
  RunReplicas(n, multi ? &coll : nullptr, [&](int r) {
    TensorMap vars = c.variables;
    TensorMap inputs = c.inputs;
    for (auto& [name, t] : inputs) {
      if (t.dtype() != DType::kF32) continue;
      if (multi)  // replica r's input differs: add r to every f32 element
        for (float& x : t.f32) x += static_cast<float>(r);
      if (abs_inputs && !c.signed_inputs.count(name))
        for (float& x : t.f32) x = std::abs(x);
    }
    outs[r] = jit ? JitStep(c.m, vars, inputs, r, multi ? &coll : nullptr)
                  : RunStep(c.m, vars, inputs, r, multi ? &coll : nullptr);
    for (auto& [name, t] : vars) outs[r]["var:" + name] = t;
  });
  return outs;
}

// Both backends' results of a value case and, for a sum tolerance, the sum|terms| scale.
struct Results {
  std::vector<TensorMap> ref, got, scale;
};

// Names the backend that threw (a failing case then says which side broke).
std::vector<TensorMap> RunNamed(const Case& c, bool jit, bool abs_inputs = false) {
  try {
    return Run(c, jit, abs_inputs);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string(jit ? "JIT" : abs_inputs ? "interpreter (on |inputs|)" : "interpreter") +
                             " threw: " + e.what());
  }
}

Results RunCase(const Case& c) {
  Results r{RunNamed(c, false), RunNamed(c, true), {}};
  if (c.tol.kind == Tolerance::Kind::kSum) r.scale = RunNamed(c, false, /*abs_inputs=*/true);
  return r;
}

const Tensor* ScaleOf(const Results& r, size_t replica, const std::string& key) {
  if (r.scale.empty()) return nullptr;
  return &r.scale[replica].at(key);
}

// The signature of an op's instruction: operand dtypes -> result dtype.
std::string Signature(const std::vector<DType>& operands, DType result) {
  std::string s = "(";
  for (size_t i = 0; i < operands.size(); ++i) s += std::string(i ? "," : "") + Name(operands[i]);
  return s + ") -> " + Name(result);
}

const ir::Instr& OpInstr(const Case& c) { return c.m.at(c.m.outputs.at(0).second); }

// The rule this file used before issue 8, kept only to show what it let through: NaN positions and
// infinities must agree, and max |diff| <= 1e-5 * max |expected| over the whole tensor.
bool OldRuleAccepts(const Tensor& ref, const Tensor& got) {
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < ref.elements(); ++i) {
    const float a = ref.f32[i], b = got.f32[i];
    if (std::isnan(a) || std::isnan(b)) {
      if (std::isnan(a) != std::isnan(b)) return false;
      continue;
    }
    if (std::isinf(a) || std::isinf(b)) {
      if (a != b) return false;
      continue;
    }
    diff = std::max(diff, std::abs(static_cast<double>(a) - b));
    scale = std::max(scale, std::abs(static_cast<double>(a)));
  }
  return diff <= 1e-5 * std::max(scale, 1e-30);
}

// `got` with element i moved just beyond its tolerance, away from the expectation: by one ulp (or 1
// for s32) when exact, else to |diff| > allowed with a step of at most twice the allowed error (plus
// the ulps it takes to get past it after rounding to f32).
Tensor Perturb(const Tensor& expected, const Tensor& got, const Tolerance& tol, const Tensor* scale, int64_t i) {
  Tensor t = got;
  if (t.dtype() == DType::kS32) {
    t.s32[i] = t.s32[i] == kMaxS ? t.s32[i] - 1 : t.s32[i] + 1;
    return t;
  }
  const float e = expected.f32[i], g = got.f32[i];
  const float dir = g < e ? -kInf : kInf;
  if (tol.kind == Tolerance::Kind::kExact) {
    t.f32[i] = std::nextafter(g, dir);
    return t;
  }
  const double allowed = conformance::Allowed(tol, e, scale, i);
  float v = static_cast<float>(g + (dir > 0 ? 2 : -2) * allowed);
  while (!(std::abs(static_cast<double>(v) - e) > allowed)) v = std::nextafter(v, dir);
  t.f32[i] = v;
  return t;
}

// Elements to perturb: the first, middle and last one whose expected value is finite.
std::vector<int64_t> OrdinaryElements(const Tensor& expected) {
  std::vector<int64_t> finite;
  for (int64_t i = 0; i < expected.elements(); ++i)
    if (expected.dtype() == DType::kS32 || std::isfinite(expected.f32[i])) finite.push_back(i);
  if (finite.empty()) return {};
  return {finite.front(), finite[finite.size() / 2], finite.back()};
}

// ---- Specials: one op on given operands, with a hand-written expectation ----

struct Special {
  std::string label;
  OpCode op;
  std::vector<Tensor> args;
  ir::Attrs attrs;
  Tensor expected;
};

// Long enough that fused loops run their vector body and their scalar tail.
constexpr size_t kTiled = 67;

template <typename V>
std::vector<V> Tile(const std::vector<V>& v) {
  std::vector<V> out(kTiled);
  for (size_t i = 0; i < kTiled; ++i) out[i] = v[i % v.size()];
  return out;
}
Tensor Fv(std::vector<float> v) { return Tensor::F32({static_cast<int64_t>(kTiled)}, Tile(v)); }
Tensor Sv(std::vector<int32_t> v) { return Tensor::S32({static_cast<int64_t>(kTiled)}, Tile(v)); }

std::vector<Special> Specials() {
  const float sub = std::numeric_limits<float>::denorm_min() * 5;
  std::vector<Special> s;
  auto e = [&](std::string label, OpCode op, std::vector<Tensor> args, Tensor expected, ir::Attrs attrs = {}) {
    s.push_back({std::move(label), op, std::move(args), std::move(attrs), std::move(expected)});
  };
  // f32 unary.
  e("neg", OpCode::kNeg, {Fv({0.f, -0.f, kInf, -kInf, kNaN, 1.5f})}, Fv({-0.f, 0.f, -kInf, kInf, kNaN, -1.5f}));
  e("abs", OpCode::kAbs, {Fv({-0.f, -kInf, kInf, kNaN, -2.5f, -sub})}, Fv({0.f, kInf, kInf, kNaN, 2.5f, sub}));
  e("stop_gradient", OpCode::kStopGradient, {Fv({-0.f, 0.f, kInf, -kInf, kNaN, -2.5f, sub})},
    Fv({-0.f, 0.f, kInf, -kInf, kNaN, -2.5f, sub}));
  e("relu", OpCode::kRelu, {Fv({-0.f, kNaN, -kInf, kInf, -1.f, 2.f, sub, -sub})},
    Fv({0.f, kNaN, 0.f, kInf, 0.f, 2.f, sub, 0.f}));
  e("exp", OpCode::kExp, {Fv({-kInf, kInf, kNaN, 0.f, -0.f, 100.f, -200.f})}, Fv({0.f, kInf, kNaN, 1.f, 1.f, kInf, 0.f}));
  e("log", OpCode::kLog, {Fv({0.f, -0.f, -1.f, kInf, 1.f, kNaN, -kInf})}, Fv({-kInf, -kInf, kNaN, kInf, 0.f, kNaN, kNaN}));
  e("sqrt", OpCode::kSqrt, {Fv({-1.f, -0.f, 0.f, kInf, -kInf, kNaN, 4.f})}, Fv({kNaN, -0.f, 0.f, kInf, kNaN, kNaN, 2.f}));
  e("rsqrt", OpCode::kRsqrt, {Fv({0.f, -0.f, kInf, -1.f, kNaN, 4.f})}, Fv({kInf, -kInf, 0.f, kNaN, kNaN, 0.5f}));
  e("tanh", OpCode::kTanh, {Fv({kInf, -kInf, kNaN, 0.f, -0.f, 30.f, -30.f})}, Fv({1.f, -1.f, kNaN, 0.f, -0.f, 1.f, -1.f}));
  e("sin", OpCode::kSin, {Fv({kInf, -kInf, kNaN, 0.f, -0.f})}, Fv({kNaN, kNaN, kNaN, 0.f, -0.f}));
  e("cos", OpCode::kCos, {Fv({kInf, -kInf, kNaN, 0.f, -0.f})}, Fv({kNaN, kNaN, kNaN, 1.f, 1.f}));
  e("sigmoid", OpCode::kSigmoid, {Fv({kInf, -kInf, kNaN, 0.f, -200.f, 200.f})}, Fv({1.f, 0.f, kNaN, 0.5f, 0.f, 1.f}));
  // convert: f32 -> s32 truncates toward zero and saturates, NaN -> 0; s32 -> f32 rounds to nearest even.
  e("convert f32->s32", OpCode::kConvert,
    {Fv({kNaN, kInf, -kInf, 3e9f, -3e9f, -2.75f, 2.75f, -0.f, 2147483520.f, -2147483648.f, 2147483648.f, -kNaN})},
    Sv({0, kMaxS, kMinS, kMaxS, kMinS, -2, 2, 0, 2147483520, kMinS, kMaxS, 0}), {{"dtype", std::string("s32")}});
  e("convert s32->f32", OpCode::kConvert, {Sv({kMaxS, kMinS, 16777217, -16777217, 0, 16777219})},
    Fv({2147483648.f, -2147483648.f, 16777216.f, -16777216.f, 0.f, 16777220.f}), {{"dtype", std::string("f32")}});
  // f32 binary.
  e("add", OpCode::kAdd, {Fv({kInf, kInf, kNaN, 3e38f, -0.f, -0.f}), Fv({-kInf, 1.f, 1.f, 3e38f, -0.f, 0.f})},
    Fv({kNaN, kInf, kNaN, kInf, -0.f, 0.f}));
  e("sub", OpCode::kSub, {Fv({kInf, 1.f, -0.f, 0.f, -3e38f}), Fv({kInf, kNaN, 0.f, 0.f, 3e38f})},
    Fv({kNaN, kNaN, -0.f, 0.f, -kInf}));
  e("mul", OpCode::kMul, {Fv({0.f, -0.f, kInf, 3e38f, -1.f}), Fv({kInf, 5.f, -2.f, 10.f, 0.f})},
    Fv({kNaN, -0.f, -kInf, kInf, -0.f}));
  e("div", OpCode::kDiv, {Fv({1.f, -1.f, 0.f, 1.f, kInf, kNaN, 1.f}), Fv({0.f, 0.f, 0.f, -0.f, kInf, 1.f, kInf})},
    Fv({kInf, -kInf, kNaN, -kInf, kNaN, kNaN, 0.f}));
  e("pow", OpCode::kPow,
    {Fv({0.f, -8.f, kNaN, 1.f, 2.f, 0.5f, -2.f, 0.f, kInf, -kInf}),
     Fv({-1.f, 1.f / 3, 0.f, kNaN, kInf, kInf, 3.f, 0.f, -1.f, 3.f})},
    Fv({kInf, kNaN, 1.f, 1.f, kInf, 0.f, -8.f, 1.f, 0.f, -kInf}));
  // max/min propagate NaN from either side.
  const Tensor ma = Fv({kNaN, 1.f, kInf, -kInf, kNaN, 3.f}), mb = Fv({1.f, kNaN, 3.f, 3.f, kNaN, -kInf});
  e("max", OpCode::kMax, {ma, mb}, Fv({kNaN, kNaN, kInf, 3.f, kNaN, 3.f}));
  e("min", OpCode::kMin, {ma, mb}, Fv({kNaN, kNaN, 3.f, -kInf, kNaN, -kInf}));
  // Comparisons: NaN is unordered (only ne holds); -0 == +0.
  const Tensor ca = Fv({kNaN, kNaN, -0.f, kInf, 1.f, kNaN, 1.f, -kInf}), cb = Fv({kNaN, 1.f, 0.f, kInf, 1.f, 1.f, kNaN, 3.f});
  e("eq", OpCode::kEq, {ca, cb}, Fv({0, 0, 1, 1, 1, 0, 0, 0}));
  e("ne", OpCode::kNe, {ca, cb}, Fv({1, 1, 0, 0, 0, 1, 1, 1}));
  e("lt", OpCode::kLt, {ca, cb}, Fv({0, 0, 0, 0, 0, 0, 0, 1}));
  e("le", OpCode::kLe, {ca, cb}, Fv({0, 0, 1, 1, 1, 0, 0, 1}));
  e("gt", OpCode::kGt, {ca, cb}, Fv({0, 0, 0, 0, 0, 0, 0, 0}));
  e("ge", OpCode::kGe, {ca, cb}, Fv({0, 0, 1, 1, 1, 0, 0, 0}));
  // select tests cond != 0: NaN and subnormals count as true, -0 as false; branches are copied bitwise.
  e("select f32 cond", OpCode::kSelect,
    {Fv({kNaN, -0.f, 0.f, kInf, sub, -1.f}), Fv({1.f, 2.f, 3.f, 4.f, 5.f, -0.f}), Fv({-1.f, -2.f, -3.f, -4.f, -5.f, 6.f})},
    Fv({1.f, -2.f, -3.f, 4.f, 5.f, -0.f}));
  e("select s32 cond, specials", OpCode::kSelect,
    {Sv({1, 0, -1, 0}), Fv({-0.f, kNaN, -kInf, 1.f}), Fv({2.f, -0.f, 3.f, kNaN})}, Fv({-0.f, -0.f, -kInf, kNaN}));
  // s32 wraps (two's complement) and division truncates toward zero.
  e("add s32", OpCode::kAdd, {Sv({kMaxS, kMinS, -1}), Sv({1, -1, 1})}, Sv({kMinS, kMaxS, 0}));
  e("sub s32", OpCode::kSub, {Sv({kMinS, kMaxS, 0}), Sv({1, -1, kMinS})}, Sv({kMaxS, kMinS, kMinS}));
  e("mul s32", OpCode::kMul, {Sv({65536, kMinS, kMaxS, -1}), Sv({65536, -1, 2, kMinS})}, Sv({0, kMinS, -2, kMinS}));
  e("div s32", OpCode::kDiv, {Sv({-7, 7, -7, kMinS, kMinS, 7, 0}), Sv({2, -2, -2, -1, 1, 7, -3})},
    Sv({-3, -3, 3, kMinS, kMinS, 1, 0}));
  e("neg s32", OpCode::kNeg, {Sv({kMinS, kMaxS, 0})}, Sv({kMinS, -kMaxS, 0}));
  e("abs s32", OpCode::kAbs, {Sv({kMinS, -5, kMaxS})}, Sv({kMinS, 5, kMaxS}));
  e("max s32", OpCode::kMax, {Sv({kMinS, kMaxS, -1}), Sv({kMaxS, kMinS, -1})}, Sv({kMaxS, kMaxS, -1}));
  e("min s32", OpCode::kMin, {Sv({kMinS, kMaxS, -1}), Sv({kMaxS, kMinS, -1})}, Sv({kMinS, kMinS, -1}));
  e("lt s32", OpCode::kLt, {Sv({kMinS, kMaxS, 5}), Sv({kMaxS, kMinS, 5})}, Sv({1, 0, 0}));
  e("ge s32", OpCode::kGe, {Sv({kMinS, kMaxS, 5}), Sv({kMaxS, kMinS, 5})}, Sv({0, 1, 1}));

  // Reductions (rows of a [5, 3]): max takes NaN as a maximum and starts from -inf; sums accumulate in
  // double, so 3e38 + 3e38 - 3e38 is 3e38 and the mean of three 3e38 is 3e38.
  const IntList rows = {1};
  e("reduce_max f32", OpCode::kReduceMax,
    {Tensor::F32({5, 3}, {kNaN, 1, 2, 1, kNaN, 2, -kInf, -kInf, -kInf, -kInf, -3e38f, -kInf, 5, kInf, kNaN})},
    Tensor::F32({5}, {kNaN, kNaN, -kInf, -3e38f, kNaN}), {{"axes", rows}});
  e("reduce_sum f32", OpCode::kReduceSum,
    {Tensor::F32({5, 3}, {kInf, 1, 2, kInf, -kInf, 0, 3e38f, 3e38f, -3e38f, kNaN, 1, 1, 3e38f, 3e38f, 0})},
    Tensor::F32({5}, {kInf, kNaN, 3e38f, kNaN, kInf}), {{"axes", rows}});
  e("reduce_mean f32", OpCode::kReduceMean,
    {Tensor::F32({5, 3}, {3e38f, 3e38f, 3e38f, -kInf, 1, 1, kNaN, 0, 0, 1, 2, 3, -0.f, -0.f, -0.f})},
    Tensor::F32({5}, {3e38f, -kInf, kNaN, 2, 0}), {{"axes", rows}});
  e("reduce_max s32", OpCode::kReduceMax, {Tensor::S32({2, 3}, {kMinS, kMinS, kMinS, -5, kMaxS, 3})},
    Tensor::S32({2}, {kMinS, kMaxS}), {{"axes", rows}});
  e("reduce_sum s32 wraps", OpCode::kReduceSum, {Tensor::S32({2, 3}, {kMaxS, 1, 0, kMinS, -1, 0})},
    Tensor::S32({2}, {kMinS, kMaxS}), {{"axes", rows}});
  e("reduce_mean s32 truncates", OpCode::kReduceMean, {Tensor::S32({2, 3}, {-3, -1, 0, kMaxS, kMaxS, kMaxS})},
    Tensor::S32({2}, {-1, kMaxS}), {{"axes", rows}});
  // Empty reductions: max of nothing is -inf (s32: its lowest value), the sum 0, the mean NaN (s32: 0).
  const Tensor empty_f = Tensor::F32({2, 0}, {}), empty_s = Tensor::S32({2, 0}, {});
  e("reduce_max f32 empty", OpCode::kReduceMax, {empty_f}, Tensor::F32({2}, {-kInf, -kInf}), {{"axes", rows}});
  e("reduce_sum f32 empty", OpCode::kReduceSum, {empty_f}, Tensor::F32({2}, {0, 0}), {{"axes", rows}});
  e("reduce_mean f32 empty", OpCode::kReduceMean, {empty_f}, Tensor::F32({2}, {kNaN, kNaN}), {{"axes", rows}});
  e("reduce_max s32 empty", OpCode::kReduceMax, {empty_s}, Tensor::S32({2}, {kMinS, kMinS}), {{"axes", rows}});
  e("reduce_mean s32 empty", OpCode::kReduceMean, {empty_s}, Tensor::S32({2}, {0, 0}), {{"axes", rows}});

  // Zero-size tensors: an empty contraction is 0, empty operands contribute nothing.
  e("matmul k=0", OpCode::kMatmul, {Tensor::F32({3, 0}, {}), Tensor::F32({0, 2}, {})},
    Tensor::F32({3, 2}, {0, 0, 0, 0, 0, 0}));
  e("reduce_sum over an empty axis 0", OpCode::kReduceSum, {Tensor::F32({0, 3}, {})}, Tensor::F32({3}, {0, 0, 0}),
    {{"axes", IntList{0}}});
  e("add of empty tensors", OpCode::kAdd, {Tensor::F32({0, 5}, {}), Tensor::F32({0, 5}, {})}, Tensor::F32({0, 5}, {}));
  e("concat with an empty operand", OpCode::kConcat, {Tensor::S32({2, 0}, {}), Tensor::S32({2, 2}, {1, 2, 3, 4})},
    Tensor::S32({2, 2}, {1, 2, 3, 4}), {{"axis", int64_t{1}}});
  e("pad of an empty tensor", OpCode::kPad, {Tensor::F32({0, 2}, {})}, Tensor::F32({1, 2}, {0, 0}),
    {{"low", IntList{1, 0}}, {"high", IntList{0, 0}}});

  // Pools: the first maximum in row-major order wins, a NaN counting as a maximum.
  //   x rows: [NaN, 1, -inf, -inf, 5, 7] / [2, 3, -inf, -inf, 7, 5]; 2x2 windows -> NaN, -inf, 7
  //   (the 7 in row 0), so max_pool_grad puts dy at flat 0, 2 (first of equal -infs) and 5.
  const Tensor px = Tensor::F32({1, 1, 2, 6}, {kNaN, 1, -kInf, -kInf, 5, 7, 2, 3, -kInf, -kInf, 7, 5});
  const ir::Attrs w22 = {{"window", IntList{2, 2}}};
  e("max_pool", OpCode::kMaxPool, {px}, Tensor::F32({1, 1, 1, 3}, {kNaN, -kInf, 7}), w22);
  e("max_pool_grad", OpCode::kMaxPoolGrad, {px, Tensor::F32({1, 1, 1, 3}, {10, 20, 30})},
    Tensor::F32({1, 1, 2, 6}, {10, 0, 20, 0, 0, 30, 0, 0, 0, 0, 0, 0}), w22);
  //   3x3 windows with stride 2 over [1,1,3,5] share column 2, whose 9 is both windows' maximum.
  const Tensor ox = Tensor::F32({1, 1, 3, 5}, {0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, -0.f, 0, 0, 0});
  const ir::Attrs w33 = {{"window", IntList{3, 3}}, {"stride", IntList{2, 2}}};
  e("max_pool overlapping", OpCode::kMaxPool, {ox}, Tensor::F32({1, 1, 1, 2}, {9, 9}), w33);
  e("max_pool_grad overlapping", OpCode::kMaxPoolGrad, {ox, Tensor::F32({1, 1, 1, 2}, {1.5f, 2.25f})},
    Tensor::F32({1, 1, 3, 5}, {0, 0, 3.75f, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}), w33);
  //   The generic (overlapping) path with NaN: a NaN replaces a finite maximum, never another NaN.
  const Tensor nx = Tensor::F32({1, 1, 3, 5}, {1, kNaN, 2, 2, 1, 2, 0, 2, 0, 0, 0, 0, 0, 0, kNaN});
  e("max_pool overlapping NaN", OpCode::kMaxPool, {nx}, Tensor::F32({1, 1, 1, 2}, {kNaN, kNaN}), w33);
  e("max_pool_grad overlapping NaN", OpCode::kMaxPoolGrad, {nx, Tensor::F32({1, 1, 1, 2}, {1.5f, 2.25f})},
    Tensor::F32({1, 1, 3, 5}, {0, 1.5f, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2.25f}), w33);
  e("avg_pool", OpCode::kAvgPool,
    {Tensor::F32({1, 1, 2, 6}, {kInf, 1, kInf, -kInf, kNaN, 0, 1, 1, 0, 0, 0, 0})},
    Tensor::F32({1, 1, 1, 3}, {kInf, kNaN, kNaN}), w22);
  e("avg_pool_grad", OpCode::kAvgPoolGrad, {Tensor::F32({1, 1, 1, 2}, {kInf, kNaN})},
    Tensor::F32({1, 1, 2, 4}, {kInf, kInf, kNaN, kNaN, kInf, kInf, kNaN, kNaN}),
    {{"window", IntList{2, 2}}, {"input_shape", IntList{1, 1, 2, 4}}});

  // Contractions propagate NaN and inf as IEEE sums of products do (inf * 0 is NaN).
  e("matmul", OpCode::kMatmul, {Tensor::F32({2, 2}, {1, kNaN, kInf, 1}), Tensor::F32({2, 2}, {1, 0, 0, 1})},
    Tensor::F32({2, 2}, {kNaN, kNaN, kInf, kNaN}));
  //   x 3x3 of ones with inf in the centre, filter [[1,0],[0,1]]: the diagonal windows see inf * 1, the
  //   others inf * 0.
  e("conv2d", OpCode::kConv2d,
    {Tensor::F32({1, 1, 3, 3}, {1, 1, 1, 1, kInf, 1, 1, 1, 1}), Tensor::F32({1, 1, 2, 2}, {1, 0, 0, 1})},
    Tensor::F32({1, 1, 2, 2}, {kInf, kNaN, kNaN, kInf}));

  //   Input gradient: dy = [[1, 0], [0, 0]] against w = [[inf, 1], [1, 1]]; every dy = 0 that meets
  //   the inf makes a NaN.
  e("conv2d_input_grad", OpCode::kConv2dInputGrad,
    {Tensor::F32({1, 1, 2, 2}, {1, 0, 0, 0}), Tensor::F32({1, 1, 2, 2}, {kInf, 1, 1, 1})},
    Tensor::F32({1, 1, 3, 3}, {kInf, kNaN, 0, kNaN, kNaN, 0, 0, 0, 0}), {{"input_shape", IntList{1, 1, 3, 3}}});
  //   Filter gradient over two images, dy = 1 and 0: dw = 1 * x0 + 0 * x1 (0 * NaN is NaN).
  e("conv2d_filter_grad", OpCode::kConv2dFilterGrad,
    {Tensor::F32({2, 1, 2, 2}, {kInf, 1, 1, 1, 1, 1, 1, kNaN}), Tensor::F32({2, 1, 1, 1}, {1, 0})},
    Tensor::F32({1, 1, 2, 2}, {kInf, 1, 1, kNaN}), {{"filter_shape", IntList{1, 1, 2, 2}}});

  // Data movement copies bits (NaN payloads aside, -0 stays -0).
  e("concat", OpCode::kConcat, {Tensor::F32({1, 2}, {-0.f, kNaN}), Tensor::F32({1, 3}, {kInf, -kInf, -0.f})},
    Tensor::F32({1, 5}, {-0.f, kNaN, kInf, -kInf, -0.f}), {{"axis", int64_t{1}}});
  e("transpose", OpCode::kTranspose, {Tensor::F32({2, 2}, {-0.f, kNaN, -kInf, sub})},
    Tensor::F32({2, 2}, {-0.f, -kInf, kNaN, sub}), {{"perm", IntList{1, 0}}});
  e("gather", OpCode::kGather,
    {Tensor::F32({3, 2}, {kNaN, kInf, 1, 2, -kInf, -0.f}), Tensor::S32({3}, {2, 0, 2})},
    Tensor::F32({3, 2}, {-kInf, -0.f, kNaN, kInf, -kInf, -0.f}));
  e("scatter_add f32", OpCode::kScatterAdd,
    {Tensor::S32({3}, {0, 0, 1}), Tensor::F32({3, 1}, {kInf, -kInf, kNaN})}, Tensor::F32({3, 1}, {kNaN, kNaN, 0}),
    {{"rows", int64_t{3}}});
  e("scatter_add s32 wraps", OpCode::kScatterAdd,
    {Tensor::S32({3}, {0, 0, 1}), Tensor::S32({3, 1}, {kMaxS, 1, kMinS})}, Tensor::S32({2, 1}, {kMinS, kMinS}),
    {{"rows", int64_t{2}}});
  return s;
}

Case CaseOf(const Special& sp) {
  CaseBuilder cb(sp.label);
  std::vector<ir::ValueId> xs;
  for (const Tensor& t : sp.args) xs.push_back(cb.InTensor(t));
  return cb.Out(cb.b.Emit(sp.op, xs, sp.attrs));
}

// Constants: s32 splats truncate and saturate (NaN -> 0), in a constant leaf and inside a fused loop.
struct ConstantSpecial {
  double value;
  DType dtype;
  float f;
  int32_t s;
};

}  // namespace

// ---------------------------------------------------------------------------------------------------

TEST_CASE("every op of the table runs on the JIT and matches the interpreter per element", "[jit][conformance]") {
  int ops = 0;
  for (int i = 0; i < ir::kNumOpCodes; ++i) {
    const OpCode op = static_cast<OpCode>(i);
    const std::vector<Case>& list = Cases(op);
    INFO("op " << ir::OpName(op));
    bool has_value_case = false;
    for (const Case& c : list) has_value_case |= !c.expect_error;
    REQUIRE(has_value_case);  // an op without a conformance case fails here
    ++ops;
    for (const Case& c : list) {
      DYNAMIC_SECTION(c.label) {
        if (c.expect_error) {
          CHECK_THROWS_AS(Run(c, false), shardstep::Error);
          CHECK_THROWS_AS(Run(c, true), shardstep::Error);
        } else {
          const Results r = RunCase(c);
          for (size_t rep = 0; rep < r.ref.size(); ++rep) {
            REQUIRE(r.ref[rep].size() == r.got[rep].size());
            for (auto& [k, t] : r.ref[rep]) {
              const Verdict v = Compare(t, r.got[rep].at(k), c.tol, ScaleOf(r, rep, k));
              INFO(c.label << " replica " << rep << " " << k << " (" << c.tol.ToString() << ")\n" << v.message);
              CHECK(v.ok);
            }
          }
        }
      }
    }
  }
  CHECK(ops == ir::kNumOpCodes);
}

TEST_CASE("every dtype signature that shape inference accepts has a conformance case", "[jit][conformance]") {
  for (int i = 0; i < ir::kNumOpCodes; ++i) {
    const OpCode op = static_cast<OpCode>(i);
    const std::vector<Case>& list = Cases(op);
    std::set<std::string> covered, accepted;
    for (const Case& c : list) {
      const ir::Instr& in = OpInstr(c);
      REQUIRE(in.op == op);
      std::vector<ir::TensorType> types;
      for (ir::ValueId o : in.operands) types.push_back(c.m.type(o));
      std::vector<DType> dts;
      for (const auto& t : types) dts.push_back(t.dtype);
      covered.insert(Signature(dts, in.type.dtype));
      // Every assignment of f32/s32 to the operands (leaves: to the declared type) with this case's
      // shapes and attributes.
      const int n = ir::HasProperty(op, ir::kLeaf) ? 1 : static_cast<int>(types.size());
      for (int mask = 0; mask < (1 << n); ++mask) {
        std::vector<ir::TensorType> flipped = types;
        ir::TensorType declared = in.type;
        std::vector<DType> sig;
        for (int k = 0; k < n; ++k) {
          const DType d = mask & (1 << k) ? DType::kS32 : DType::kF32;
          if (ir::HasProperty(op, ir::kLeaf)) declared.dtype = d;
          else flipped[k].dtype = d, sig.push_back(d);
        }
        try {
          const ir::TensorType result = ir::InferType(op, flipped, in.attrs, &declared);
          accepted.insert(Signature(sig, result.dtype));
        } catch (const shardstep::Error&) {
        }
      }
    }
    for (const std::string& sig : accepted) {
      INFO("op " << ir::OpName(op) << ": shape inference accepts " << sig << " but no case runs it");
      CHECK(covered.count(sig) == 1);
    }
  }
}

TEST_CASE("specials: NaN, infinities, signed zeros, saturation and wrapping match exact expectations",
          "[jit][conformance]") {
  std::set<OpCode> seen;
  for (const Special& sp : Specials()) {
    seen.insert(sp.op);
    Case c = CaseOf(sp);
    INFO(sp.label);
    std::vector<TensorMap> refs, gots;
    CHECK_NOTHROW(refs = RunNamed(c, false));
    CHECK_NOTHROW(gots = RunNamed(c, true));
    if (refs.empty() || gots.empty()) continue;
    const TensorMap &ref = refs[0], &got = gots[0];
    const Verdict interp = Compare(sp.expected, ref.at("out"), Tolerance::Exact());
    const Verdict jit = Compare(sp.expected, got.at("out"), Tolerance::Exact());
    const Verdict both = Compare(ref.at("out"), got.at("out"), Tolerance::Exact());
    INFO("interpreter vs hand-written: " << (interp.ok ? "ok" : "\n" + interp.message));
    INFO("JIT vs hand-written: " << (jit.ok ? "ok" : "\n" + jit.message));
    INFO("JIT vs interpreter: " << (both.ok ? "ok" : "\n" + both.message));
    CHECK(interp.ok);
    CHECK(jit.ok);
    CHECK(both.ok);
  }
  // Every op that computes values has special cases, except pure data movement checked bitwise by the
  // value cases, one_hot (no float input) and the collectives (one shared implementation).
  for (OpCode op : {OpCode::kNeg, OpCode::kExp, OpCode::kLog, OpCode::kSqrt, OpCode::kRsqrt, OpCode::kTanh, OpCode::kSin,
                    OpCode::kCos, OpCode::kSigmoid, OpCode::kRelu, OpCode::kAbs, OpCode::kStopGradient, OpCode::kConvert, OpCode::kAdd,
                    OpCode::kSub, OpCode::kMul, OpCode::kDiv, OpCode::kPow, OpCode::kMax, OpCode::kMin, OpCode::kEq,
                    OpCode::kNe, OpCode::kLt, OpCode::kLe, OpCode::kGt, OpCode::kGe, OpCode::kSelect,
                    OpCode::kReduceSum, OpCode::kReduceMax, OpCode::kReduceMean, OpCode::kMatmul, OpCode::kConv2d,
                    OpCode::kConv2dInputGrad, OpCode::kConv2dFilterGrad, OpCode::kMaxPool, OpCode::kMaxPoolGrad, OpCode::kAvgPool, OpCode::kAvgPoolGrad, OpCode::kGather,
                    OpCode::kScatterAdd}) {
    INFO("op " << ir::OpName(op) << " has no special case");
    CHECK(seen.count(op) == 1);
  }

  // Constant splats, as a leaf and folded into a fused loop (x + c, x = 0 / +0.0f).
  const ConstantSpecial constants[] = {
      {3e9, DType::kS32, 0, kMaxS},         {-3e9, DType::kS32, 0, kMinS}, {std::nan(""), DType::kS32, 0, 0},
      {-7.9, DType::kS32, 0, -7},           {7.9, DType::kS32, 0, 7},      {1e300, DType::kF32, kInf, 0},
      {-0.0, DType::kF32, -0.f, 0},         {std::nan(""), DType::kF32, kNaN, 0},
      {-1e300, DType::kF32, -kInf, 0},      {0.1, DType::kF32, 0.1f, 0},
  };
  for (const ConstantSpecial& k : constants) {
    const ir::TensorType t = T(k.dtype, {static_cast<int64_t>(kTiled)});
    const Tensor expected = k.dtype == DType::kF32 ? Fv({k.f}) : Sv({k.s});
    CaseBuilder leaf("constant leaf");
    Case a = leaf.Out(leaf.b.Constant(k.value, t));
    CaseBuilder fused("constant in a fused loop");
    // x - x is +0 (f32) or 0 (s32), so (x - x) + c = c for every c but -0 (+0 + -0 = +0).
    auto x = fused.In(t, Dist::kUniform);
    Case b = fused.Out(fused.b.Add(fused.b.Sub(x, x), fused.b.Constant(k.value, t)));
    Tensor expected_fused = expected;
    if (k.dtype == DType::kF32 && k.f == 0) std::fill(expected_fused.f32.begin(), expected_fused.f32.end(), 0.f);
    for (const auto& [c, want] : {std::pair<Case*, const Tensor*>{&a, &expected}, {&b, &expected_fused}}) {
      TensorMap vars;
      const TensorMap ref = RunStep(c->m, vars, c->inputs), got = JitStep(c->m, vars, c->inputs);
      const Verdict vi = Compare(*want, ref.at("out"), Tolerance::Exact());
      const Verdict vj = Compare(*want, got.at("out"), Tolerance::Exact());
      INFO(c->label << " " << Name(k.dtype) << " value " << k.value << "\ninterpreter: " << vi.message << "\nJIT: "
                    << vj.message);
      CHECK(vi.ok);
      CHECK(vj.ok);
    }
  }
}

TEST_CASE("a forward all_reduce (cross-replica statistics) runs on 1 and on N replicas on both backends", "[jit]") {
  // y = x * all_reduce(reduce_sum(x)){reduction}: replica r's x is base + r.
  const std::vector<float> base = {0.5f, -1.25f, 2.0f};
  for (int n : {1, 4})
    for (const char* reduction : {"sum", "mean"})
      for (bool jit : {false, true}) {
        ir::Module m;
        m.num_replicas = n;
        ir::Builder b(&m);
        auto x = b.Input("x", F({3}));
        auto total = b.AllReduce(b.ReduceSum(x, {0}), reduction, n == 4 ? ir::IntLists{{0, 1}, {2, 3}} : ir::IntLists{});
        m.outputs.push_back({"y", b.Mul(x, b.BroadcastScalar(total, {3}))});
        std::vector<TensorMap> outs(n);
        InProcessCollectives coll(n);
        RunReplicas(n, &coll, [&](int r) {
          TensorMap vars, inputs{{"x", Tensor::F32({3}, base)}};
          for (float& v : inputs["x"].f32) v += static_cast<float>(r);
          outs[r] = jit ? JitStep(m, vars, inputs, r, &coll) : RunStep(m, vars, inputs, r, &coll);
        });
        for (int r = 0; r < n; ++r) {
          // The group of r: itself (n = 1) or the pair {r - r % 2, r - r % 2 + 1}.
          double sum = 0;
          const int first = n == 1 ? r : r - r % 2, size = n == 1 ? 1 : 2;
          for (int s = first; s < first + size; ++s)
            for (float v : base) sum += v + s;
          const double t = std::string(reduction) == "sum" ? sum : sum / size;
          INFO((jit ? "JIT" : "interpreter") << " replicas " << n << " " << reduction << " replica " << r);
          for (int i = 0; i < 3; ++i) CHECK(outs[r].at("y").f32[i] == Approx((base[i] + r) * t).epsilon(1e-6));
        }
      }
}

TEST_CASE("bad data is an error on both backends", "[jit][conformance]") {
  struct Bad {
    std::string label;
    OpCode op;
    std::vector<Tensor> args;
    ir::Attrs attrs;
  };
  const Bad bad[] = {
      {"s32 division by zero", OpCode::kDiv, {Sv({1, 2, 3}), Sv({1, 0, 3})}, {}},
      {"one_hot label past depth", OpCode::kOneHot, {Tensor::S32({2}, {1, 10})}, {{"depth", int64_t{10}}}},
      {"one_hot negative label", OpCode::kOneHot, {Tensor::S32({2}, {-1, 1})}, {{"depth", int64_t{10}}}},
      {"gather index past rows", OpCode::kGather, {Tensor::F32({2, 2}, {1, 2, 3, 4}), Tensor::S32({2}, {0, 2})}, {}},
      {"gather negative index", OpCode::kGather, {Tensor::F32({2, 2}, {1, 2, 3, 4}), Tensor::S32({1}, {-1})}, {}},
      {"scatter_add index past rows", OpCode::kScatterAdd, {Tensor::S32({2}, {0, 3}), Tensor::F32({2, 1}, {1, 2})},
       {{"rows", int64_t{3}}}},
  };
  for (const Bad& b : bad) {
    Case c = CaseOf({b.label, b.op, b.args, b.attrs, Tensor()});
    TensorMap vars;
    INFO(b.label);
    CHECK_THROWS_AS(RunStep(c.m, vars, c.inputs), shardstep::Error);
    CHECK_THROWS_AS(JitStep(c.m, vars, c.inputs), shardstep::Error);
  }
}

// A test of the test: the comparison must reject a result that is off by just more than its tolerance.
TEST_CASE("mutation check: one element just beyond its tolerance fails and is named", "[jit][conformance][mutation]") {
  SECTION("every case of every op") {
    int mutated = 0;
    for (int i = 0; i < ir::kNumOpCodes; ++i) {
      const OpCode op = static_cast<OpCode>(i);
      for (const Case& c : Cases(op)) {
        if (c.expect_error) continue;
        Results r;
        try {
          r = RunCase(c);
        } catch (const std::exception&) {
          continue;  // reported by the conformance test
        }
        for (size_t rep = 0; rep < r.ref.size(); ++rep)
          for (auto& [k, exp] : r.ref[rep]) {
            const Tensor& got = r.got[rep].at(k);
            const Tensor* scale = ScaleOf(r, rep, k);
            if (!Compare(exp, got, c.tol, scale).ok) continue;  // reported by the conformance test
            for (int64_t at : OrdinaryElements(exp)) {
              const Tensor bad = Perturb(exp, got, c.tol, scale, at);
              const Verdict v = Compare(exp, bad, c.tol, scale);
              INFO(c.label << " " << k << ": element " << at << " perturbed from " << got.at(at) << " to " << bad.at(at)
                           << " (" << c.tol.ToString() << ")\n" << v.message);
              CHECK_FALSE(v.ok);
              CHECK(v.first_bad == at);
              CHECK(v.bad == 1);
              CHECK(v.message.find("element " + conformance::IndexName(exp.shape(), at)) != std::string::npos);
              ++mutated;
            }
          }
      }
    }
    CHECK(mutated > 300);
  }

  SECTION("an error masked by a large value elsewhere under the old max-based rule now fails") {
    // max(x, y) with x[1] = 3e9: the old rule allowed any element an error of 1e-5 * 3e9 = 3e4.
    CaseBuilder cb("max with a large element");
    auto x = cb.In(F({9, 11})), y = cb.In(F({9, 11}));
    cb.c.inputs["x0"].f32[1] = 3e9f;
    Case c = cb.Out(cb.b.Emit(OpCode::kMax, {x, y}));
    const Results r = RunCase(c);
    const Tensor& exp = r.ref[0].at("out");
    REQUIRE(Compare(exp, r.got[0].at("out"), Tolerance::Exact()).ok);
    Tensor bad = r.got[0].at("out");
    bad.f32[5] += 1000.0f;
    CHECK(OldRuleAccepts(exp, bad));  // what the old test let through
    const Verdict v = Compare(exp, bad, Tolerance::Exact());
    INFO(v.message);
    CHECK_FALSE(v.ok);
    CHECK(v.first_bad == 5);
    CHECK(v.message.find("element 5 [0,5]") != std::string::npos);
    // And by one ulp.
    Tensor ulp = r.got[0].at("out");
    ulp.f32[5] = std::nextafter(ulp.f32[5], kInf);
    CHECK(OldRuleAccepts(exp, ulp));
    CHECK(Compare(exp, ulp, Tolerance::Exact()).first_bad == 5);
  }

  SECTION("specials compare by class and sign, finite values bitwise") {
    const Tensor exp = Tensor::F32({5}, {kNaN, kInf, -kInf, -0.f, 1.f});
    CHECK(Compare(exp, Tensor::F32({5}, {-kNaN, kInf, -kInf, -0.f, 1.f}), Tolerance::Exact()).ok);  // any NaN
    const std::pair<int64_t, float> wrong[] = {{0, kInf}, {0, 0.f}, {1, -kInf}, {1, kNaN}, {1, 3e38f},
                                               {2, kInf}, {3, 0.f}, {4, kNaN}, {4, kInf}};
    for (auto [at, value] : wrong) {
      Tensor bad = exp;
      bad.f32[at] = value;
      for (const Tolerance& tol : {Tolerance::Exact(), kLibm}) {
        const Verdict v = Compare(exp, bad, tol, nullptr);
        INFO("element " << at << " = " << value << " under " << tol.ToString());
        if (tol.kind == Tolerance::Kind::kUlps && at == 3) {
          CHECK(v.ok);  // +0 for -0 is within any non-exact tolerance
          continue;
        }
        CHECK_FALSE(v.ok);
        CHECK(v.first_bad == at);
      }
    }
  }
}

TEST_CASE("no op of the table falls back to the interpreter's kernels on the JIT", "[jit]") {
  for (int i = 0; i < ir::kNumOpCodes; ++i) {
    const OpCode op = static_cast<OpCode>(i);
    for (const Case& c : Cases(op)) {
      auto step = jit::CompiledStep::Compile(c.m, jit::JitOptions{"", false});
      for (ir::ValueId v = 0; v < step->module().size(); ++v) {
        INFO(c.label << ": %" << v << " " << ir::OpName(step->module().at(v).op));
        CHECK(jit::LoweringOf(step->module(), v) != jit::Lowering::kReference);
      }
    }
  }
}

TEST_CASE("elementwise ops are lowered to JIT'd loops, the rest to native or reference kernels", "[jit]") {
  int fused = 0;
  for (int i = 0; i < ir::kNumOpCodes; ++i) {
    const OpCode op = static_cast<OpCode>(i);
    for (const Case& c : Cases(op)) {
      auto step = jit::CompiledStep::Compile(c.m, jit::JitOptions{"", false});
      const ir::ValueId v = c.m.outputs[0].second;
      if (ir::HasProperty(op, ir::kElementwise) && !(op == OpCode::kDiv && c.m.type(v).dtype == DType::kS32)) {
        INFO(c.label);
        CHECK(jit::LoweringOf(step->module(), v) == jit::Lowering::kFused);
        ++fused;
      }
    }
  }
  CHECK(fused > 30);
}

// A long chain (Adam's update shape) over a size that is not a multiple of any vector width, split
// across threads: bitwise equal to the interpreter (no FMA contraction, no reassociation).
// Every output of a case equals the interpreter's bitwise.
static void CheckBitwise(const Case& c, const std::string& what) {
  TensorMap vars;
  TensorMap ref = RunStep(c.m, vars, c.inputs), got = JitStep(c.m, vars, c.inputs);
  for (auto& [k, t] : ref) {
    const Verdict v = Compare(t, got.at(k), Tolerance::Exact());
    INFO(what << " output " << k << "\n" << v.message);
    CHECK(v.ok);
  }
}
// A case that compiles to one fused loop, whose every output equals the interpreter's bitwise.
static void CheckOneLoopBitwise(const Case& c, const std::string& what) {
  auto step = jit::CompiledStep::Compile(c.m, jit::JitOptions{"", false});
  CHECK(step->kernels().size() == 1);
  CheckBitwise(c, what);
}

TEST_CASE("a fused Adam-like chain is bitwise equal to the interpreter", "[jit]") {
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000003}}) {
    CaseBuilder cb("adam chain " + std::to_string(n));
    ir::Builder& b = cb.b;
    auto w = cb.In(F({n})), g = cb.In(F({n})), m = cb.In(F({n})), v = cb.In(F({n}), Dist::kPositive);
    auto lr = cb.In(F({}));
    auto m2 = b.Add(b.MulScalar(m, 0.9), b.MulScalar(g, 0.1));
    auto v2 = b.Add(b.MulScalar(v, 0.999), b.Mul(b.MulScalar(g, 0.001), g));
    auto upd = b.Div(b.Mul(b.BroadcastScalar(lr, {n}), m2), b.AddScalar(b.Unary(OpCode::kSqrt, v2), 1e-8));
    auto w2 = b.Sub(w, upd);
    cb.c.m.outputs.push_back({"m", m2});
    cb.c.m.outputs.push_back({"v", v2});
    CheckOneLoopBitwise(cb.Out(w2), "n " + std::to_string(n));
  }
}

// A gather of one row of a variable (the sharded update's weight shard, gather(reshape(@w), replica_id))
// reads the row in place (jit/compiled_step.cc PlanRowViews) and still sees the value from before the
// step when @w is assigned in the same step; a view that is itself assigned stays a copy. Bitwise
// against the interpreter for every row; an index out of range is still an error.
TEST_CASE("a gather of one row of a variable reads it in place and keeps the old value", "[jit]") {
  for (bool assign_view : {false, true}) {
    ir::Module m;
    m.name = "row view";
    ir::Builder b(&m);
    const ir::TensorType wt{DType::kF32, {6, 4}};
    const auto w = b.Variable("w", wt, ir::kRoleWeight);
    const auto u = b.Variable("u", {DType::kF32, {2, 6}}, ir::kRoleWeight);
    const auto idx = b.Input("i", {DType::kS32, {}});
    const auto row = b.Emit(OpCode::kGather, {b.Reshape(w, {3, 8}), idx});  // f32[8]
    m.outputs.push_back({"y", b.MulScalar(row, 3.0)});
    m.outputs.push_back({"row", row});
    m.assigns.push_back({w, b.AddScalar(w, 1.0)});
    if (assign_view) m.assigns.push_back({u, b.Reshape(b.Emit(OpCode::kGather, {b.Reshape(w, {2, 12}), idx}), {2, 6})});
    auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
    CHECK(step->info().row_views == 1);
    TensorMap vars{{"w", Tensor(wt)}, {"u", Tensor(ir::TensorType{DType::kF32, {2, 6}})}};
    for (size_t i = 0; i < vars["w"].f32.size(); ++i) vars["w"].f32[i] = 0.25f * static_cast<float>(i) - 1.0f;
    for (int32_t i : {0, 1, 2}) {
      if (assign_view && i == 2) break;  // a [2, 12] table has no row 2
      TensorMap inputs{{"i", Tensor(ir::TensorType{DType::kS32, {}})}};
      inputs["i"].s32[0] = i;
      TensorMap ref_vars = vars, got_vars = vars;
      TensorMap ref = RunStep(m, ref_vars, inputs), got = JitStep(m, got_vars, inputs);
      INFO("row " << i << (assign_view ? ", the view of another shape assigned" : ""));
      for (const char* k : {"y", "row"}) CHECK(Compare(ref.at(k), got.at(k), Tolerance::Exact()).ok);
      for (const char* k : {"w", "u"}) CHECK(got_vars.at(k).f32 == ref_vars.at(k).f32);
      CHECK(got.at("row").f32[0] == vars["w"].f32[8 * i]);  // the row from before the step
    }
    TensorMap bad{{"i", Tensor(ir::TensorType{DType::kS32, {}})}};
    bad["i"].s32[0] = 3;
    TensorMap v2 = vars;
    CHECK_THROWS_WITH(JitStep(m, v2, bad), Catch::Contains("gather index 3 out of range [0,3)"));
  }
}

// Batch norm's shape: c = x - broadcast(mean) read by a loop before a matmul (its sum of squares) and by
// one that needs the matmul's result. The later loop computes its own copy of c from x (RecomputeCheapValues), so no loop
// writes c, and the results have the bits of the same module with the copy written by hand (the
// interpreter's sum of squares within rounding).
TEST_CASE("a cheap value read by loops on both sides of a matmul is recomputed, not written", "[jit]") {
  const TensorMap vars{{"w", Random({DType::kF32, {32, 32}}, 7, Dist::kUniform)}};
  const TensorMap inputs{{"x", Random({DType::kF32, {64, 32}}, 8, Dist::kUniform)}};
  TensorMap got[2];
  std::string printed[2];
  for (bool by_hand : {false, true}) {
    ir::Module m;
    m.name = "recomputed";
    ir::Builder b(&m);
    const auto x = b.Input("x", {DType::kF32, {64, 32}});
    const auto w = b.Variable("w", {DType::kF32, {32, 32}}, ir::kRoleWeight);
    const auto mean = b.ReduceMean(x, {0});  // f32[32], in memory
    auto centered = [&] { return b.Sub(x, b.Broadcast(mean, {64, 32}, {1})); };
    const auto c = centered();
    const auto s = b.ReduceSum(b.Mul(c, c), {0});  // the first reader
    m.outputs.push_back({"s", s});
    // The second reader needs s through a matmul: it cannot join the first reader's loop.
    const auto k = b.Reshape(b.Matmul(b.Reshape(s, {1, 32}), w), {32});
    m.outputs.push_back({"d", b.Mul(by_hand ? centered() : c, b.Broadcast(k, {64, 32}, {1}))});
    auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
    INFO((by_hand ? "the copy written by hand" : "one c, two readers"));
    INFO(ir::Print(step->module()));
    printed[by_hand] = ir::Print(step->module());
    if (!by_hand) CHECK(step->info().recomputed_values == 1);
    int subs = 0;
    for (ir::ValueId v = 0; v < step->module().size(); ++v) {
      if (step->module().at(v).op != OpCode::kSub) continue;
      ++subs;
      CHECK(step->arena_offset(v) < 0);  // in neither loop's output
    }
    CHECK(subs == 2);
    TensorMap ref_vars = vars, got_vars = vars;
    const TensorMap ref = RunStep(m, ref_vars, inputs);
    got[by_hand] = JitStep(m, got_vars, inputs);
    CHECK(Compare(ref.at("s"), got[by_hand].at("s"), Tolerance::Ulps(4)).ok);  // positive terms, f64 sums
  }
  CHECK(printed[0] == printed[1]);  // the JIT's module is the one written by hand
  for (const char* k : {"s", "d"}) CHECK(got[0].at(k).f32 == got[1].at(k).f32);
}

// A chain of elementwise ops from one value in memory (GELU's x + b, x^2, tanh(...), ...) read on both
// sides of a matmul: the later loop gets its own copy of the whole chain, so no loop writes any of it;
// a value computed from two values in memory is read back instead (a copy would read two for one).
TEST_CASE("an elementwise chain from one value in memory is recomputed by its later reader", "[jit]") {
  for (bool two_leaves : {false, true}) {
    ir::Module m;
    m.name = "chain";
    ir::Builder b(&m);
    const auto x = b.Input("x", {DType::kF32, {64, 32}});
    const auto x2 = b.Input("x2", {DType::kF32, {64, 32}});
    const auto w = b.Variable("w", {DType::kF32, {32, 32}}, ir::kRoleWeight);
    const auto t = b.Unary(OpCode::kTanh, b.MulScalar(x, 0.5));
    const auto u = b.Add(t, b.Mul(two_leaves ? x2 : x, x));
    const auto s = b.ReduceSum(b.Mul(u, u), {0});  // the first reader
    m.outputs.push_back({"s", s});
    const auto k = b.Reshape(b.Matmul(b.Reshape(s, {1, 32}), w), {32});
    m.outputs.push_back({"d", b.Mul(u, b.Broadcast(k, {64, 32}, {1}))});  // the second, after the matmul
    auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
    INFO("from " << (two_leaves ? "two values" : "one value") << " in memory\n" << ir::Print(step->module()));
    int tanhs = 0, written = 0;
    for (ir::ValueId v = 0; v < step->module().size(); ++v) {
      const OpCode op = step->module().at(v).op;
      if (op != OpCode::kTanh && op != OpCode::kAdd) continue;
      tanhs += op == OpCode::kTanh;
      written += step->arena_offset(v) >= 0;
    }
    CHECK(step->info().recomputed_values == (two_leaves ? 0 : 1));
    CHECK(tanhs == (two_leaves ? 1 : 2));
    CHECK(written == (two_leaves ? 1 : 0));  // u itself, or nothing
    const TensorMap vars{{"w", Random({DType::kF32, {32, 32}}, 7, Dist::kUniform)}};
    const TensorMap inputs{{"x", Random({DType::kF32, {64, 32}}, 8, Dist::kUniform)},
                           {"x2", Random({DType::kF32, {64, 32}}, 9, Dist::kUniform)}};
    TensorMap ref_vars = vars, got_vars = vars;
    const TensorMap ref = RunStep(m, ref_vars, inputs), got = JitStep(m, got_vars, inputs);
    // Sums of 64 and 32 terms of values within 2 ulp of libm's tanh: within 1e-4 of their magnitude.
    for (const char* name : {"s", "d"})
      for (size_t e = 0; e < ref.at(name).f32.size(); ++e) {
        const float want = ref.at(name).f32[e], have = got.at(name).f32[e];
        INFO(name << "[" << e << "]: " << have << " vs the interpreter's " << want);
        REQUIRE(std::abs(have - want) <= 1e-4f * (std::abs(want) + 1.0f));
      }
  }
}

// A contiguous slice (whole in every dimension but the first: the reduce-scatter's result cut into each
// tensor's shard) is a view into its operand (PlanViews), whose storage then stays live while the view
// is read: here a loop computed after the slice (u) would otherwise take the sliced value's place.
TEST_CASE("a contiguous slice reads its operand in place, and keeps the operand alive", "[jit]") {
  ir::Module m;
  m.name = "slice view";
  ir::Builder b(&m);
  const ir::TensorType xt{DType::kF32, {64, 32}};
  const auto x = b.Input("x", xt);
  const auto t = b.MulScalar(x, 2.0);                                              // in the arena
  const auto s = b.Emit(OpCode::kSlice, {t}, {{"start", IntList{8, 0}}, {"limit", IntList{40, 32}}});  // a view
  const auto strided = b.Emit(OpCode::kSlice, {b.MulScalar(b.Input("x2", {DType::kF32, {32, 64}}), 1.5)},
                              {{"start", IntList{0, 16}}, {"limit", IntList{32, 48}}});  // columns: a copy
  const auto u = b.Emit(OpCode::kSlice, {b.AddScalar(b.Emit(OpCode::kTranspose, {x}, {{"perm", IntList{1, 0}}}), 1.0)},
                        {{"start", IntList{0, 0}}, {"limit", IntList{32, 32}}});  // [32, 32], computed after s
  m.outputs.push_back({"y", b.Add(b.Mul(s, u), strided)});
  auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
  CHECK(step->info().slice_views >= 1);  // s at least (u's slice may be read by the last loop through its index map); `strided` is a copy
  TensorMap inputs{{"x", Random(xt, 21, Dist::kUniform)}, {"x2", Random({DType::kF32, {32, 64}}, 22, Dist::kUniform)}};
  TensorMap vars;
  const TensorMap ref = RunStep(m, vars, inputs), got = JitStep(m, vars, inputs);
  CHECK(Compare(ref.at("y"), got.at("y"), Tolerance::Exact()).ok);
}

// Softmax's shape: row sums broadcast back over the rows, read by a loop before a matmul and by one that
// needs the matmul's result (jit/compiled_step.cc CopyBroadcastsPerReader). Each loop reads the sums
// through its own copy of the broadcast, so no loop writes the broadcast at the rows' size, and the
// results are the bits of the same module with the second broadcast written by hand.
TEST_CASE("a broadcast read by two loops is copied into each, never written at its full size", "[jit]") {
  const TensorMap vars{{"w", Random({DType::kF32, {32, 32}}, 7, Dist::kUniform)}};
  const TensorMap inputs{{"x", Random({DType::kF32, {64, 32}}, 8, Dist::kUniform)}};
  TensorMap got[2];
  for (bool by_hand : {false, true}) {
    ir::Module m;
    m.name = "broadcast copies";
    ir::Builder b(&m);
    const auto x = b.Input("x", {DType::kF32, {64, 32}});
    const auto w = b.Variable("w", {DType::kF32, {32, 32}}, ir::kRoleWeight);
    const auto sums = b.ReduceSum(b.Unary(OpCode::kExp, x), {1});  // f32[64], in memory
    auto spread = [&] { return b.Broadcast(sums, {64, 32}, {0}); };
    const auto bc = spread();
    const auto p = b.Div(x, bc);                                   // the first reader
    const auto s = b.ReduceSum(b.Mul(p, p), {0});
    m.outputs.push_back({"s", s});
    const auto k = b.Reshape(b.Matmul(b.Reshape(s, {1, 32}), w), {32});  // the second reader needs it
    m.outputs.push_back({"d", b.Mul(b.Div(b.MulScalar(x, 3.0), by_hand ? spread() : bc), b.Broadcast(k, {64, 32}, {1}))});
    auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
    INFO((by_hand ? "the copy written by hand" : "one broadcast, two readers") << "\n" << ir::Print(step->module()));
    CHECK(step->info().broadcast_copies == (by_hand ? 0 : 1));
    int spreads = 0;
    for (ir::ValueId v = 0; v < step->module().size(); ++v) {
      const ir::Instr& in = step->module().at(v);
      if (in.op != OpCode::kBroadcast || in.type.shape != ir::Shape{64, 32} || in.GetInts("dims") != IntList{0}) continue;
      ++spreads;
      CHECK(step->arena_offset(v) < 0);  // read through each loop's index map, in neither loop's output
    }
    CHECK(spreads == 2);
    TensorMap ref_vars = vars, got_vars = vars;
    const TensorMap ref = RunStep(m, ref_vars, inputs);
    got[by_hand] = JitStep(m, got_vars, inputs);
    // exp within 2 ulp of libm's, through a quotient, its square and sums of positive terms.
    CHECK(Compare(ref.at("s"), got[by_hand].at("s"), Tolerance::Ulps(16)).ok);
  }
  for (const char* k : {"s", "d"}) CHECK(got[0].at(k).f32 == got[1].at(k).f32);
}

// A matmul of bf16-rounded operands reads the bf16 values in place (ReadBf16OperandsInPlace); the
// widening converts it no longer reads are dropped, not left as loops that write values nobody reads
// (8 passes over [4096,512] per transformer_lm step ran so).
TEST_CASE("a bf16 matmul's widening converts are dropped when the matmul reads its operands in place", "[jit][bf16]") {
  ir::Module m;
  m.name = "bf16 operands";
  ir::Builder b(&m);
  const auto x = b.Input("x", {DType::kF32, {48, 40}});
  const auto w = b.Variable("w", {DType::kF32, {40, 24}}, ir::kRoleWeight);
  auto rounded = [&](ir::ValueId v) { return b.Convert(b.Convert(b.MulScalar(v, 1.0), DType::kBF16), DType::kF32); };
  m.outputs.push_back({"y", b.Matmul(rounded(x), rounded(w))});
  auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
  INFO(ir::Print(step->module()));
  int widening = 0;
  for (ir::ValueId v = 0; v < step->module().size(); ++v) {
    const ir::Instr& in = step->module().at(v);
    widening += in.op == OpCode::kConvert && in.type.dtype == DType::kF32;
  }
  CHECK(widening == 0);
  for (const jit::FusedKernel& k : step->kernels())
    for (ir::ValueId v : k.outputs) CHECK(step->module().type(v).dtype == DType::kBF16);  // only the rounded operands
  const TensorMap vars{{"w", Random({DType::kF32, {40, 24}}, 3, Dist::kPositive)}};
  const TensorMap inputs{{"x", Random({DType::kF32, {48, 40}}, 4, Dist::kPositive)}};
  TensorMap ref_vars = vars, got_vars = vars;
  const TensorMap ref = RunStep(m, ref_vars, inputs), got = JitStep(m, got_vars, inputs);
  // Exact products of bf16 values, f32 sums of 40 positive terms (so |sum| is the sum of |terms|).
  const Verdict v = Compare(ref.at("y"), got.at("y"), Tolerance::Sum(40), &ref.at("y"));
  INFO(v.message);
  CHECK(v.ok);
}

// Transposes, strided slices, broadcasts, pads and concats of more than one block of rows are copied
// by TBB tasks (jit/data_movement.cc ForRowBlocks): each block starts its source (or destination)
// offset from its first row's index. Odd dimensions so that blocks start mid-way through every
// dimension; the interpreter's bits, the same on one thread.
TEST_CASE("large strided copies split into row blocks are the interpreter's bits", "[jit]") {
  const ir::Shape shape = {3, 37, 5, 67};  // 37185 elements: rows of 67, blocks of 489 rows
  CaseBuilder cb("large strided copies");
  ir::Builder& b = cb.b;
  const auto x = cb.In(F(shape));
  const auto t = b.Emit(OpCode::kTranspose, {x}, {{"perm", IntList{2, 0, 3, 1}}});          // rows of 37, stride 335
  const auto t2 = b.Emit(OpCode::kTranspose, {x}, {{"perm", IntList{1, 2, 0, 3}}});         // rows of 67, contiguous
  const auto sl = b.Emit(OpCode::kSlice, {x}, {{"start", IntList{1, 2, 0, 3}}, {"limit", IntList{3, 37, 5, 66}}});
  const auto bc = b.Broadcast(cb.In(F({37, 67})), {4, 37, 3, 67}, {1, 3});
  const auto pad = b.Emit(OpCode::kPad, {x}, {{"low", IntList{0, 1, 2, 0}}, {"high", IntList{1, 0, 1, 5}}});
  const auto cat = b.Emit(OpCode::kConcat, {x, b.MulScalar(x, 2.0)}, {{"axis", int64_t{1}}});
  cb.c.m.outputs.push_back({"t", t});
  cb.c.m.outputs.push_back({"t2", t2});
  cb.c.m.outputs.push_back({"sl", sl});
  cb.c.m.outputs.push_back({"bc", bc});
  cb.c.m.outputs.push_back({"pad", pad});
  Case c = cb.Out(cat);
  TensorMap vars;
  const TensorMap ref = RunStep(c.m, vars, c.inputs), got = JitStep(c.m, vars, c.inputs);
  TensorMap one;
  {
    const tbb::global_control one_thread(tbb::global_control::max_allowed_parallelism, 1);
    one = JitStep(c.m, vars, c.inputs);
  }
  for (const char* k : {"t", "t2", "sl", "bc", "pad", "out"}) {
    INFO(k);
    CHECK(Compare(ref.at(k), got.at(k), Tolerance::Exact()).ok);
    CHECK(got.at(k).f32 == one.at(k).f32);
  }
}

// relu's gradient after max pooling's, select(y > 0, max_pool_grad(y, dy), 0) with y = relu(x), runs
// in the pooling gradient's own pass (jit/compiled_step.cc MaskMaxPoolGradsByRelu): no select is left
// in any loop, and the result is the interpreter's bit for bit (overlapping windows add in the same
// order). y on a grid: zeros and ties, where the mask and the first maximum decide.
TEST_CASE("relu's mask after a max pooling gradient runs in the pooling gradient's pass", "[jit]") {
  struct Pool {
    ir::Shape x, y;
    IntList window, stride;
  };
  for (const Pool& p : {Pool{{4, 16, 28, 28}, {4, 16, 14, 14}, {2, 2}, {2, 2}}, Pool{{2, 3, 9, 7}, {2, 3, 4, 3}, {2, 2}, {2, 2}},
                        Pool{{2, 3, 9, 7}, {2, 3, 4, 3}, {3, 3}, {2, 2}}}) {
    const std::string what = "window " + std::to_string(p.window[0]) + ", input " + std::to_string(p.x[2]) + "x" +
                             std::to_string(p.x[3]);
    CaseBuilder cb("relu mask after max_pool_grad, " + what);
    ir::Builder& b = cb.b;
    auto y = b.Unary(OpCode::kRelu, cb.InSigned(F(p.x), Dist::kGrid));
    auto dy = cb.In(F(p.y));
    auto grad = b.Emit(OpCode::kMaxPoolGrad, {y, dy}, {{"window", p.window}, {"stride", p.stride}});
    Case c = cb.Out(b.Select(b.Emit(OpCode::kGt, {y, b.ScalarLike(0.0, y)}), grad, b.ScalarLike(0.0, grad)));
    auto step = jit::CompiledStep::Compile(c.m, jit::JitOptions{"", false});
    for (const auto& k : step->kernels())
      for (ir::ValueId v : k.members) CHECK(step->module().at(v).op != OpCode::kSelect);
    CheckBitwise(c, what);
  }
}

// SgemmRowBlockAdd's premise (the reduce-scatter's fold of produced weight gradients): where
// SgemmAddsExactly holds, dnnl_sgemm with beta = 1 leaves C + P bit for bit, P the beta = 0 product.
// Every transpose pairing, the MLP's row blocks at N = 8 and N = 4 (98, 128 and 256 rows, 10 and 1024
// columns, 16 and 32 terms) and the rule's edges (8 rows or columns, 96, 97 and 256 terms). Shapes the
// rule leaves out on this CPU are not checked. If a oneDNN update or another CPU sums into C
// differently, this fails and the rule must narrow.
TEST_CASE("sgemm with beta = 1 adds the finished product where SgemmAddsExactly says so", "[jit]") {
  struct Shape3 {
    int64_t m, n, k;
  };
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int64_t checked = 0;
  for (const Shape3 s : {Shape3{128, 1024, 16}, Shape3{98, 1024, 16}, Shape3{128, 10, 16}, Shape3{256, 1024, 32},
                         Shape3{8, 8, 256}, Shape3{8, 100, 1}, Shape3{33, 8, 200}, Shape3{200, 300, 256},
                         Shape3{8, 8, 96}, Shape3{200, 300, 96}, Shape3{33, 17, 97}})
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        if (!jit::SgemmAddsExactly(ta, s.m, s.n, s.k)) continue;
        ++checked;
        std::vector<float> a(s.m * s.k), b(s.k * s.n), c(s.m * s.n), product(s.m * s.n);
        for (float& x : a) x = normal(rng);
        for (float& x : b) x = normal(rng);
        for (float& x : c) x = 3.0f * normal(rng);
        const int64_t lda = ta ? s.m : s.k, ldb = tb ? s.k : s.n;
        jit::DnnlSgemm(ta, tb, s.m, s.n, s.k, a.data(), lda, b.data(), ldb, 0.0f, product.data(), s.n);
        std::vector<float> added = c;
        jit::DnnlSgemm(ta, tb, s.m, s.n, s.k, a.data(), lda, b.data(), ldb, 1.0f, added.data(), s.n);
        int64_t differ = 0;
        for (size_t i = 0; i < c.size(); ++i) {
          const float want = c[i] + product[i];
          differ += std::memcmp(&want, &added[i], sizeof(float)) != 0;
        }
        INFO(s.m << "x" << s.n << "x" << s.k << " ta=" << ta << " tb=" << tb);
        CHECK(differ == 0);
      }
  // The products the MLP folds at N = 8 and N = 4 (a transposed A) hold on every CPU.
  CHECK(checked >= 34);
  for (int ta = 0; ta < 2; ++ta) {
    CHECK(jit::SgemmAddsExactly(ta, 16, 1024, 96));
    CHECK_FALSE(jit::SgemmAddsExactly(ta, 128, 1024, 257));  // summed into C in k blocks
    CHECK_FALSE(jit::SgemmAddsExactly(ta, 1, 1024, 16));     // a matrix-vector product
    CHECK_FALSE(jit::SgemmAddsExactly(ta, 1024, 1, 16));
  }
  CHECK(jit::SgemmAddsExactly(false, 128, 1024, 256));
}

// TurnedSgemmNT (C = A B^T as C^T = B A^T, transposed in and out: whole 8 x 8 blocks in AVX registers,
// the edges element by element): rows and columns that are and are not multiples of 8, against a
// double-precision product (a misplaced element would be off by far more than rounding).
TEST_CASE("a product turned around and transposed back is C = A B^T", "[jit]") {
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (int64_t m : {16, 20, 37, 48})
    for (int64_t n : {128, 135, 1000}) {
      const int64_t k = 512;
      std::vector<float> a(m * k), b(n * k), c(m * n);
      for (float& x : a) x = uniform(rng);
      for (float& x : b) x = uniform(rng);
      jit::TurnedSgemmNT(m, n, k, a.data(), b.data(), c.data());
      double worst = 0;
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double want = 0;
          for (int64_t l = 0; l < k; ++l) want += static_cast<double>(a[i * k + l]) * b[j * k + l];
          worst = std::max(worst, std::abs(want - c[i * n + j]));
        }
      INFO(m << "x" << n << "x" << k);
      CHECK(worst < 1e-3);  // 512 terms of magnitude < 1 in f32
    }
}

// relu's gradient mask gt(relu(z), 0), read after a matmul, with z batch norm's (x - mean) * scale: the
// mask reads z, which its loop computes again from x (ReluMasksFromInputs, then RecomputeCheapValues),
// not relu's output; with z from two values in memory (a residual's add) it still reads relu's output.
// x on a grid (ties with the mean: zeros, where the mask decides). Bitwise the interpreter's.
TEST_CASE("relu's gradient mask is taken from relu's input where its loop can compute it again", "[jit]") {
  for (bool residual : {false, true}) {
    const std::string what = residual ? "z from two values in memory" : "z from one value in memory";
    CaseBuilder cb("relu mask, " + what);
    ir::Builder& b = cb.b;
    const ir::Shape s{64, 32};
    const auto x = cb.InSigned(F(s), Dist::kGrid);
    const auto mean = b.ReduceMean(x, {0});
    const auto scale = cb.In(F({32}));
    auto z = b.Mul(b.Sub(x, b.Broadcast(mean, s, {1})), b.Broadcast(scale, s, {1}));
    if (residual) z = b.Add(z, cb.InSigned(F(s), Dist::kGrid));
    const auto y = b.Unary(OpCode::kRelu, z);
    Tensor permutation(F({32, 32}));  // y's columns permuted: exact in sgemm and in the interpreter alike
    for (int64_t i = 0; i < 32; ++i) permutation.f32[i * 32 + (i * 7 + 3) % 32] = 1.0f;
    const auto t = b.Matmul(y, cb.InTensor(permutation));  // reads y from memory; the mask's loop comes after it
    const auto g = b.Select(b.Emit(OpCode::kGt, {y, b.ScalarLike(0.0, y)}), t, b.ScalarLike(0.0, t));
    Case c = cb.Out(b.Mul(g, b.Sub(x, b.Broadcast(mean, s, {1}))));
    auto step = jit::CompiledStep::Compile(c.m, jit::JitOptions{"", false});
    INFO(what << "\n" << ir::Print(step->module()));
    int masks = 0, from_relu = 0;
    for (ir::ValueId v = 0; v < step->module().size(); ++v) {
      const ir::Instr& in = step->module().at(v);
      if (in.op != OpCode::kGt) continue;
      ++masks;
      from_relu += step->module().at(in.operands[0]).op == OpCode::kRelu;
    }
    CHECK(masks == 1);
    CHECK(from_relu == (residual ? 1 : 0));
    CheckBitwise(c, what);
  }
}

// A max over the last axis (softmax's) runs rows in parallel and finds each row's maximum in SSE lanes
// (jit/data_movement.cc RowMax); where the order of the interpreter's fold shows in the bits (the first
// NaN's payload, the last of +0 and -0) it folds. Rows of 8, 13 and 128 elements, with such specials
// at both ends of a row and in its middle, and ordinary random rows: bitwise equal.
TEST_CASE("reduce_max over rows keeps the interpreter's bits: NaN payloads, signed zeros, infinities", "[jit]") {
  auto bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  const float nan1 = bits(0x7fc00001u), nan2 = bits(0xffc00002u), inf = INFINITY;
  for (int64_t n : {int64_t{8}, int64_t{13}, int64_t{128}}) {
    const int64_t rows = 300;
    CaseBuilder cb("reduce_max rows of " + std::to_string(n));
    auto x = cb.InSigned(F({rows, n}), Dist::kGrid);  // a grid: ties between equal values
    Tensor& t = cb.c.inputs.begin()->second;
    auto row = [&](int64_t r) { return t.f32.data() + r * n; };
    std::fill(row(0), row(0) + n, -inf);                                       // all -inf
    std::fill(row(1), row(1) + n, -1.0f), row(1)[0] = 0.0f, row(1)[n - 1] = -0.0f;  // +0 then -0: -0
    std::fill(row(2), row(2) + n, -1.0f), row(2)[1] = -0.0f, row(2)[n - 2] = 0.0f;  // -0 then +0: +0
    row(3)[n / 2] = nan1, row(3)[n - 1] = nan2;                                 // the first NaN's payload
    row(4)[0] = nan2, row(4)[n - 1] = nan1;
    row(5)[n - 1] = nan1;                                                       // NaN in the tail
    row(6)[2] = inf, row(6)[n - 1] = inf;
    std::fill(row(7), row(7) + n, 0.0f), row(7)[n / 2] = -0.0f;                 // zeros: the last +0
    std::fill(row(8), row(8) + n, -0.0f);
    CheckBitwise(cb.Out(cb.b.Emit(OpCode::kReduceMax, {x}, {{"axes", IntList{1}}})), "rows of " + std::to_string(n));
  }
}

// Broadcasts inside a fused loop are read per row when every one of them is constant (batch norm's
// per-channel values over H*W) or contiguous (a bias along the last dimensions) along the kernel's
// last dimensions (jit/kernel_emitter.cc EmitBody); else per element through the index map. Either
// way each element's arithmetic is the interpreter's: bitwise equal, also when a parallel chunk
// starts in the middle of a row (72816 elements: chunks of 32768).
TEST_CASE("broadcasts read per row or per element in fused loops are bitwise equal to the interpreter", "[jit]") {
  struct Shape4 {
    ir::Shape x;
    std::string what;
  };
  for (const Shape4& s : {Shape4{{5, 16, 9, 13}, "rows of 117 (H*W) or 13 (W)"},
                          Shape4{{3, 16, 37, 41}, "chunks cut rows"}, Shape4{{2, 16, 2, 3}, "rows of 6 or 3: per element"}}) {
    for (bool along_w : {false, true}) {  // a broadcast along W only makes the rows W long
      const ir::Shape& x = s.x;
      CaseBuilder cb("row broadcasts " + s.what);
      ir::Builder& b = cb.b;
      auto in = cb.In(F(x));
      auto scale = cb.In(F({x[1]})), shift = cb.In(F({x[1]})), plane = cb.In(F({x[2], x[3]})), col = cb.In(F({x[3]}));
      auto bn = b.Add(b.Mul(in, b.Broadcast(scale, x, {1})), b.Broadcast(shift, x, {1}));  // constant along H*W
      auto with_plane = b.Add(bn, b.Broadcast(plane, x, {2, 3}));                          // contiguous along H*W
      auto last = b.Unary(OpCode::kRelu, with_plane);
      if (along_w) last = b.Mul(last, b.Broadcast(col, x, {3}));
      cb.c.m.outputs.push_back({"bn", bn});
      CheckOneLoopBitwise(cb.Out(last), s.what + (along_w ? ", along W" : ""));
    }
  }
}

// Reductions run inside the fused loop that produces their operand (jit/compiled_step.cc
// FuseReductions, jit/data_movement.cc FusedSums) sum the same terms in the same order as Reduce on
// the materialised operand: the bits are equal with and without the fusion, in every layout (rows
// along a reduced last axis, grouped four at a time or alone; long rows four to a window (20000) or
// cut into windows (2 x 70001); a kept last axis), with an operand that is also read elsewhere
// (materialised and reduced)
// and one read only by its reductions (never materialised), several sums of one loop in one pass.
// A case compiled with the JIT's fusions (fuse_reductions) and without; FusedAndPlain::Run returns the
// first's outputs after checking that every output has the second's bits.
struct FusedAndPlain {
  std::shared_ptr<const jit::CompiledStep> fused, plain;
  explicit FusedAndPlain(const ir::Module& m) {
    jit::JitOptions on{"", false, false}, off{"", false, false};
    off.fuse_reductions = false;
    fused = jit::CompiledStep::Compile(m, on);
    plain = jit::CompiledStep::Compile(m, off);
  }
  TensorMap Run(const TensorMap& inputs) const {
    TensorMap vars;
    jit::Workspace ws1, ws2;
    const TensorMap got = fused->Run(vars, inputs, 0, nullptr, &ws1), want = plain->Run(vars, inputs, 0, nullptr, &ws2);
    for (auto& [k, t] : want) {
      INFO("output " << k);
      CHECK(std::memcmp(t.raw(), got.at(k).raw(), t.bytes()) == 0);
    }
    return got;
  }
};

TEST_CASE("reductions fused with the loops producing their operands give the unfused bits", "[jit]") {
  struct Layout {
    ir::Shape x;
    IntList axes;
  };
  for (const Layout& l : {Layout{{64, 16, 28, 28}, {0, 2, 3}}, Layout{{2, 3, 7, 7}, {0, 2, 3}}, Layout{{3, 9000}, {1}}, Layout{{6, 9000}, {1}}, Layout{{5, 20000}, {1}},
                          Layout{{300, 40}, {0}}, Layout{{5, 6, 7}, {0, 1, 2}}, Layout{{40, 30, 50}, {1}},
                          // one long reduced row: cut into segments (8320 elements), and not (no multiple of
                          // 8 divides 2 x 70001)
                          Layout{{1024, 130}, {0, 1}}, Layout{{3, 70001, 2}, {1, 2}},
                          // channels-last batch norm: [rows, 16] and [rows, 32] summed into 16 or 32 columns,
                          // several blocks of rows, the last one short
                          Layout{{9000, 16}, {0}}, Layout{{3, 1500, 32}, {0, 1}}}) {
    std::ostringstream label;
    label << "fused reductions over [" << l.x[0];
    for (size_t d = 1; d < l.x.size(); ++d) label << "," << l.x[d];
    label << "] axes";
    for (int64_t a : l.axes) label << " " << a;
    CaseBuilder cb(label.str());
    ir::Builder& b = cb.b;
    auto x = cb.In(F(l.x)), dy = cb.In(F(l.x));
    auto mean = b.Emit(OpCode::kReduceMean, {x}, {{"axes", l.axes}});
    IntList kept;
    for (int64_t d = 0; d < static_cast<int64_t>(l.x.size()); ++d)
      if (!std::binary_search(l.axes.begin(), l.axes.end(), d)) kept.push_back(d);
    auto centred = b.Sub(x, b.Broadcast(mean, l.x, kept));
    auto var = b.Emit(OpCode::kReduceMean, {b.Mul(centred, centred)}, {{"axes", l.axes}});  // windowed
    auto g = b.Mul(dy, b.Unary(OpCode::kTanh, centred));                                      // also an output
    auto sum_g = b.Emit(OpCode::kReduceSum, {g}, {{"axes", l.axes}});
    auto sum_gx = b.Emit(OpCode::kReduceSum, {b.Mul(g, centred)}, {{"axes", l.axes}});       // windowed
    // Summed and read by the loop's own ops (batch norm's masked gradient): windowed too.
    auto masked = b.Select(b.Binary(OpCode::kGt, x, b.ScalarLike(0.0, x)), dy, b.ScalarLike(0.0, dy));
    auto sum_masked = b.Emit(OpCode::kReduceSum, {masked}, {{"axes", l.axes}});
    cb.c.m.outputs.push_back({"masked_scaled", b.Mul(masked, centred)});
    cb.c.m.outputs.push_back({"sum_masked", sum_masked});
    cb.c.m.outputs.push_back({"var", var});
    cb.c.m.outputs.push_back({"g", g});
    cb.c.m.outputs.push_back({"sum_g", sum_g});
    Case c = cb.Out(sum_gx);
    const FusedAndPlain steps(c.m);
    INFO(c.label);
    CHECK(steps.fused->info().fused_reductions >= 2);  // var and the two sums of dy * tanh(x - mean)
    CHECK(steps.fused->info().windowed_values >= 3);   // (x - mean)^2, g * (x - mean) and the masked dy
    CHECK(steps.plain->info().fused_reductions == 0);
    steps.Run(c.inputs);  // (Reduce against the interpreter: the test below)
  }
}

// A sum of a value no loop computes (a product's result: the bias gradients of transformer_lm's bf16
// step) runs in the loop that reads that value element for element (its bf16 rounding for the next
// product), from the loop's input after the loop read it: the unfused bits, also where that loop would
// otherwise store its output over the dead input (PlanReusedInputs: not over a summed input). A loop
// computed from the sum itself (layer norm's x - mean(x)) cannot take it: it stays a pass of its own.
TEST_CASE("reductions of a loop's input run in that loop and give the unfused bits", "[jit]") {
  struct Layout {
    ir::Shape x;
    IntList axes;
  };
  for (const Layout& l : {Layout{{300, 40}, {0}}, Layout{{32, 128, 128}, {0, 1}}, Layout{{64, 512}, {0}},
                          Layout{{40, 30, 50}, {2}}, Layout{{6, 9000}, {1}}}) {
    std::ostringstream label;
    label << "sum of a loop's input over [" << l.x[0];
    for (size_t d = 1; d < l.x.size(); ++d) label << "," << l.x[d];
    label << "] axes";
    for (int64_t a : l.axes) label << " " << a;
    const int64_t cols = l.x.back();
    int64_t rows = 1;
    for (size_t d = 0; d + 1 < l.x.size(); ++d) rows *= l.x[d];
    for (int form = 0; form < 3; ++form) {  // 0: bf16 rounding reads it; 1: x * 2 over it; 2: x - mean(x)
      CaseBuilder cb(label.str() + (form == 0 ? ", rounded to bf16" : form == 1 ? ", doubled" : ", centred"));
      ir::Builder& b = cb.b;
      auto u = cb.In(F({rows, 24})), w = cb.In(F({24, cols}));
      auto x = b.Reshape(b.Matmul(u, w), l.x);  // no loop computes it
      ir::ValueId sum = b.Emit(form == 2 ? OpCode::kReduceMean : OpCode::kReduceSum, {x}, {{"axes", l.axes}});
      ir::ValueId y;
      if (form == 0) {
        y = b.Convert(x, DType::kBF16);
      } else if (form == 1) {
        y = b.MulScalar(x, 2.0);
      } else {
        IntList kept;
        for (int64_t d = 0; d < static_cast<int64_t>(l.x.size()); ++d)
          if (!std::binary_search(l.axes.begin(), l.axes.end(), d)) kept.push_back(d);
        y = b.Sub(x, b.Broadcast(sum, l.x, kept));
      }
      cb.c.m.outputs.push_back({"y", y});
      Case c = cb.Out(sum);
      const FusedAndPlain steps(c.m);
      INFO(c.label);
      CHECK(steps.fused->info().fused_reductions == (form == 2 ? 0 : 1));
      CHECK(steps.plain->info().fused_reductions == 0);
      const TensorMap got = steps.Run(c.inputs);
      // And the interpreter's sum (the product's bits may differ: compared within the sum's tolerance).
      TensorMap vars;
      const TensorMap ref = runtime::RunStep(c.m, vars, c.inputs);
      const Tensor& s = got.at("out");
      const Tensor& r = ref.at("out");
      double worst = 0, scale = 0;
      for (size_t i = 0; i < s.f32.size(); ++i) {
        worst = std::max(worst, std::abs(double(s.f32[i]) - double(r.f32[i])));
        scale = std::max(scale, std::abs(double(r.f32[i])));
      }
      CHECK(worst <= 1e-4 * std::max(1.0, scale));
    }
  }
}

// Large sums run as parallel blocks of rows (jit/compiled_step.cc, Reduce): they stay within the
// double-accumulation bound of the interpreter's serial order and give the same bits on every run.
TEST_CASE("large reductions split into blocks agree with the interpreter and are deterministic", "[jit]") {
  const ir::Shape shape = {64, 8, 30, 30};  // 460800 elements: several blocks
  // A whole tensor summed to a scalar (the non-finite guard's checks) is one long row, cut into
  // segments that run in parallel blocks, not one add chain.
  CHECK(jit::LayoutOf(shape, {0, 1, 2, 3}, {}).blocks > 1);
  CHECK(jit::LayoutOf({1024, 1024}, {0, 1}, {}).blocks == 16);
  for (const IntList& axes : {IntList{0, 2, 3}, IntList{0}, IntList{3}, IntList{1, 2}, IntList{0, 1, 2, 3}}) {
    for (OpCode op : {OpCode::kReduceSum, OpCode::kReduceMean}) {
      std::ostringstream label;
      label << ir::OpName(op) << " axes";
      int64_t terms = 1;
      for (int64_t a : axes) label << " " << a, terms *= shape[a];
      CaseBuilder cb(label.str());
      const ir::ValueId x = cb.In(F(shape));
      Case c = cb.Out(cb.b.Emit(op, {x}, {{"axes", axes}}));
      TensorMap vars;
      const Results r{{RunStep(c.m, vars, c.inputs)}, {JitStep(c.m, vars, c.inputs)}, {}};
      const TensorMap second = JitStep(c.m, vars, c.inputs);
      const std::vector<TensorMap> scale = Run(c, false, true);
      INFO(c.label);
      CHECK(r.got[0].at("out") == second.at("out"));
      const Verdict v = Compare(r.ref[0].at("out"), r.got[0].at("out"), c.tol, &scale[0].at("out"));
      INFO(v.message);
      CHECK(v.ok);
    }
  }
}


// Many columns summed over several blocks of rows (a positional embedding's gradient, [32, 128, 128]
// over the batch): the blocks' partials are zeroed by their blocks and added in ranges of outputs in
// parallel (data_movement.cc Finish), in the documented order all the same: each column down its
// block's rows in row order in double from +0, the blocks added in block order, rounded once.
TEST_CASE("column sums over many outputs keep the blocks' order bit for bit", "[jit]") {
  for (const ir::Shape& shape : {ir::Shape{32, 128, 128}, ir::Shape{37, 9000}, ir::Shape{1000, 40}}) {
    const ir::Shape out(shape.begin() + 1, shape.end());
    const jit::ReduceLayout l = jit::LayoutOf(shape, {0}, out);
    const int64_t rows = shape[0], n = l.nout;
    INFO("shape [" << rows << ", " << n << "], " << l.blocks << " blocks of " << l.block_rows << " rows");
    if (n >= 9000) CHECK(l.blocks >= 4);
    for (OpCode op : {OpCode::kReduceSum, OpCode::kReduceMean}) {
      CaseBuilder cb(std::string("column sums ") + ir::OpName(op));
      const ir::ValueId x = cb.In(F(shape));
      Case c = cb.Out(cb.b.Emit(op, {x}, {{"axes", IntList{0}}}));
      TensorMap vars;
      const TensorMap got = JitStep(c.m, vars, c.inputs);
      const std::vector<float>& v = c.inputs.begin()->second.f32;
      std::vector<float> want(n);
      for (int64_t col = 0; col < n; ++col) {
        double total = 0;
        for (int64_t r0 = 0; r0 < rows; r0 += l.block_rows) {
          double block = 0;
          for (int64_t r = r0; r < std::min(rows, r0 + l.block_rows); ++r) block += v[r * n + col];
          total = r0 == 0 ? block : total + block;
        }
        want[col] = static_cast<float>(op == OpCode::kReduceMean ? total / rows : total);
      }
      const std::vector<float>& have = got.at("out").f32;
      REQUIRE(have.size() == want.size());
      int64_t differ = 0;
      for (int64_t col = 0; col < n; ++col) differ += std::memcmp(&have[col], &want[col], sizeof(float)) != 0;
      INFO(ir::OpName(op));
      CHECK(differ == 0);
    }
  }
}


// How much of its tolerance each case uses (max |diff| / allowed): `jit_conformance_test "[.margins]" -s`.
TEST_CASE("conformance margins", "[.margins]") {
  for (int i = 0; i < ir::kNumOpCodes; ++i)
    for (const Case& c : Cases(static_cast<OpCode>(i))) {
      if (c.expect_error) continue;
      const Results r = RunCase(c);
      double worst = 0;
      for (size_t rep = 0; rep < r.ref.size(); ++rep)
        for (auto& [k, t] : r.ref[rep]) worst = std::max(worst, Compare(t, r.got[rep].at(k), c.tol, ScaleOf(r, rep, k)).worst);
      if (worst > 0) std::printf("%-50s uses %.3g of its tolerance (%s)\n", c.label.c_str(), worst, c.tol.ToString().c_str());
    }
}

// ---- bf16 (issue 10) ----
//
// The same table walk in bf16: every value case with an f32 operand, result or declared leaf becomes
// a case in which those are bf16 (inputs rounded to nearest even; types re-inferred), and the JIT must
// match the interpreter, whose rule is the reference: compute in f32, round to bf16. Tolerances, from
// the f32 ones: exact stays bitwise (both compute the same f32 value and round it the same way); a
// libm or sum tolerance grows by one bf16 rounding of the result, 2^-7 relative (bf16 has 8
// significant bits: two f32 results within the f32 bound may straddle a bf16 rounding boundary and
// round to neighbours one bf16 ulp <= 2^-7 |x| apart).
namespace {

constexpr double kBf16Eps = 1.0 / 128;

bool TouchesF32(const ir::Module& m, ir::ValueId v) {
  bool f = m.type(v).dtype == DType::kF32;
  for (ir::ValueId o : m.at(v).operands) f |= m.type(o).dtype == DType::kF32;
  return f;
}

bool TouchesBf16(const ir::Module& m, ir::ValueId v) {
  bool f = m.type(v).dtype == DType::kBF16;
  for (ir::ValueId o : m.at(v).operands) f |= m.type(o).dtype == DType::kBF16;
  return f;
}

// The bf16 variant of a value case, or nullopt when shape inference refuses it (an op that takes no
// float operand) or the op's instruction touches no bf16 value.
std::optional<Case> Bf16Variant(const Case& c) {
  if (c.expect_error) return std::nullopt;
  Case b = c;
  b.label = c.label + " [bf16]";
  for (ir::ValueId v = 0; v < b.m.size(); ++v) {
    ir::Instr& in = b.m.at(v);
    if (ir::HasProperty(in.op, ir::kLeaf)) {
      if (in.type.dtype == DType::kF32 && in.op != OpCode::kReplicaId) in.type.dtype = DType::kBF16;
      continue;
    }
    std::vector<ir::TensorType> types;
    for (ir::ValueId o : in.operands) types.push_back(b.m.type(o));
    try {
      in.type = ir::InferType(in.op, types, in.attrs, &in.type);
    } catch (const shardstep::Error&) {
      return std::nullopt;
    }
  }
  for (TensorMap* map : {&b.inputs, &b.variables})
    for (auto& [name, t] : *map)
      if (t.dtype() == DType::kF32) t = t.AsFloat(DType::kBF16);
  if (!TouchesBf16(b.m, b.m.outputs.at(0).second)) return std::nullopt;
  if (c.tol.kind != Tolerance::Kind::kExact) b.tol.rtol += kBf16Eps;
  return b;
}

// bf16 tensors of a result map as f32 (exactly), for Compare.
TensorMap Widened(const TensorMap& m) {
  TensorMap out;
  for (const auto& [k, t] : m) out[k] = t.dtype() == DType::kBF16 ? t.AsFloat(DType::kF32) : t;
  return out;
}

// Both backends on the bf16 case; the sum|terms| scale from the f32 case on the same (rounded) values.
Results RunBf16Case(const Case& f32_case, const Case& b) {
  Results r;
  for (const TensorMap& t : RunNamed(b, false)) r.ref.push_back(Widened(t));
  for (const TensorMap& t : RunNamed(b, true)) r.got.push_back(Widened(t));
  if (b.tol.kind == Tolerance::Kind::kSum) {
    Case scale_case = f32_case;
    for (auto& [name, t] : scale_case.inputs)
      if (t.dtype() == DType::kF32) t = t.AsFloat(DType::kBF16).AsFloat(DType::kF32);
    for (const TensorMap& t : RunNamed(scale_case, false, /*abs_inputs=*/true)) r.scale.push_back(t);
  }
  return r;
}

}  // namespace

TEST_CASE("bf16: every float op of the table runs on the JIT in bf16 and matches the interpreter",
          "[jit][conformance][bf16]") {
  int variants = 0, fused = 0;
  for (int i = 0; i < ir::kNumOpCodes; ++i) {
    const OpCode op = static_cast<OpCode>(i);
    INFO("op " << ir::OpName(op));
    bool float_op = false, ran = false;
    for (const Case& c : Cases(op)) {
      if (c.expect_error) continue;
      const ir::ValueId out = c.m.outputs.at(0).second;
      float_op |= TouchesF32(c.m, out) && op != OpCode::kOneHot && op != OpCode::kRandomUniform;
      const std::optional<Case> b = Bf16Variant(c);
      if (!b) continue;
      ran = true;
      ++variants;
      if (jit::LoweringOf(b->m, out) == jit::Lowering::kFused) ++fused;
      DYNAMIC_SECTION(b->label) {
        const Results r = RunBf16Case(c, *b);
        for (size_t rep = 0; rep < r.ref.size(); ++rep) {
          REQUIRE(r.ref[rep].size() == r.got[rep].size());
          for (auto& [k, t] : r.ref[rep]) {
            const Verdict v = Compare(t, r.got[rep].at(k), b->tol, r.scale.empty() ? nullptr : &r.scale[rep].at(k));
            INFO(b->label << " replica " << rep << " " << k << " (" << b->tol.ToString() << ")\n" << v.message);
            CHECK(v.ok);
          }
        }
      }
    }
    // one_hot and random_uniform produce f32 from s32 operands only: nothing to make bf16.
    if (float_op) CHECK(ran);
  }
  CHECK(variants > 60);
  CHECK(fused > 25);
}

TEST_CASE("bf16: the JIT's fused loops round like the interpreter (ties, overflow, NaN, subnormals)", "[jit][bf16]") {
  // x * 1 in bf16 from f32 inputs: convert(f32 -> bf16) is the rounding itself, then a bf16 op.
  const uint32_t bits[] = {0x3f808000u,  // 1 + 2^-8: a tie, rounds to even (1.0)
                           0x3f818000u,  // 1 + 3 * 2^-8: a tie, rounds to even (up)
                           0x3f808001u,  // just above the tie: up
                           0x7f7fffffu,  // FLT_MAX: rounds to +inf
                           0xff7f8000u,  // -(largest bf16 + half ulp): a tie to even -> -inf
                           0x7fc00001u,  // NaN stays NaN
                           0x7f800001u,  // signalling NaN: quiet NaN, not inf
                           0x00000001u,  // smallest subnormal: rounds to +0
                           0x00018000u,  // subnormal tie: to even (up, since 0x0001 is odd)
                           0x80000000u}; // -0 stays -0
  std::vector<float> xs;
  for (uint32_t u : bits) {
    float f;
    std::memcpy(&f, &u, 4);
    xs.push_back(f);
  }
  const int64_t n = static_cast<int64_t>(xs.size());
  ir::Module m;
  ir::Builder b(&m);
  const ir::ValueId x = b.Input("x", {DType::kF32, {n}});
  const ir::ValueId h = b.Convert(x, DType::kBF16);
  const ir::ValueId y = b.Mul(h, b.Constant(1, {DType::kBF16, {n}}));
  m.outputs.push_back({"y", y});
  m.outputs.push_back({"back", b.Convert(y, DType::kF32)});
  TensorMap vars, inputs{{"x", Tensor::F32({n}, xs)}};
  const TensorMap ref = RunStep(m, vars, inputs), got = JitStep(m, vars, inputs);
  CHECK(jit::LoweringOf(m, y) == jit::Lowering::kFused);
  REQUIRE(ref.at("y").dtype() == DType::kBF16);
  for (int64_t i = 0; i < n; ++i) {
    INFO("element " << i << " bits 0x" << std::hex << bits[i]);
    CHECK(ref.at("y").bf16[i] == F32ToBf16(xs[i]));
    CHECK(got.at("y").bf16[i] == ref.at("y").bf16[i]);
    CHECK(conformance::Bits(got.at("back").f32[i]) == conformance::Bits(ref.at("back").f32[i]));
  }
  const std::vector<uint16_t> want = {0x3f80, 0x3f82, 0x3f81, 0x7f80, 0xff80, 0x7fc0, 0x7fc0, 0x0000, 0x0002, 0x8000};
  CHECK(ref.at("y").bf16 == want);
}

// f32 bit patterns whose rounding to bf16 is easy to get wrong: ties to even (down and up), just
// above a tie, overflow to inf, a negative tie to -inf, NaN payloads (a signalling one), a subnormal
// tie, -0 and -inf.
constexpr uint32_t kRoundingSpecials[] = {0x3f808000u, 0x3f818000u, 0x3f808001u, 0x7f7fffffu, 0xff7f8000u,
                                          0x7fc00001u, 0x7f800001u, 0x00018000u, 0x80000000u, 0xff800000u};

// The JIT's bf16 outputs `names` of m on `inputs` equal the interpreter's bit for bit.
void CheckBf16OutputsBitwise(const ir::Module& m, const TensorMap& inputs, std::initializer_list<const char*> names) {
  TensorMap vars;
  const TensorMap ref = RunStep(m, vars, inputs), got = JitStep(m, vars, inputs);
  for (const char* k : names) {
    INFO(k);
    REQUIRE(got.at(k).dtype() == DType::kBF16);
    CHECK(got.at(k).shape() == ref.at(k).shape());
    CHECK(got.at(k).bf16 == ref.at(k).bf16);
  }
}

// A rounding that reads a transpose (through reshapes) is done by the transpose as it copies
// (RoundInTransposes: transformer_lm's attention heads), one pass to bf16 instead of two. The
// interpreter's bits, ties, overflow and NaN included, in both of the copy's forms (contiguous rows
// of an odd length, and strided), over several row blocks.
TEST_CASE("bf16: a transpose that rounds as it copies gives the interpreter's bits", "[jit][bf16]") {
  ir::Module m;
  m.name = "rounding transposes";
  ir::Builder b(&m);
  const ir::Shape shape = {3, 37, 5, 67};
  const ir::ValueId x = b.Input("x", {DType::kF32, shape});
  const ir::ValueId rows = b.Transpose(x, {0, 2, 1, 3});  // contiguous rows of 67
  m.outputs.push_back({"rows", b.Convert(b.Reshape(b.Reshape(rows, {15, 37, 67}), {15, 2479}), DType::kBF16)});
  const ir::ValueId cols = b.Transpose(b.Reshape(x, {111, 335}), {1, 0});  // strided
  m.outputs.push_back({"cols", b.Convert(cols, DType::kBF16)});
  Tensor xs = Random({DType::kF32, shape}, 11, Dist::kWide);
  for (size_t i = 0; i < std::size(kRoundingSpecials); ++i)
    for (int64_t at : {int64_t{0}, int64_t{67 * 5 * 37 + 3}, xs.elements() - 1 - static_cast<int64_t>(i) * 997})
      std::memcpy(&xs.f32[at + (at == 0 ? static_cast<int64_t>(i) * 7 : 0)], &kRoundingSpecials[i], 4);
  auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
  INFO(ir::Print(step->module()));
  int rounding = 0;
  for (ir::ValueId v = 0; v < step->module().size(); ++v) {
    const ir::Instr& in = step->module().at(v);
    CHECK(in.op != OpCode::kConvert);  // no rounding loop left
    rounding += in.op == OpCode::kTranspose && in.Has(jit::kRoundsAttr) && in.type.dtype == DType::kBF16;
  }
  CHECK(rounding == 2);
  CheckBf16OutputsBitwise(m, {{"x", xs}}, {"rows", "cols"});
}

// A rounding that reads a transpose of an elementwise loop's value (through reshapes on both sides)
// is done by that loop, which writes bf16, and the transpose moves bf16 (RoundInProducers:
// transformer_lm's q, k and v after their bias adds). The interpreter's bits, ties, overflow, NaN and
// subnormals included, for contiguous rows (the heads' split) and a strided transpose.
TEST_CASE("bf16: a loop rounds what a transpose then moves, with the interpreter's bits", "[jit][bf16]") {
  ir::Module m;
  m.name = "rounding producers";
  ir::Builder b(&m);
  const ir::Shape shape = {3, 37, 5 * 12};
  const ir::ValueId a = b.Input("a", {DType::kF32, shape});
  const ir::ValueId x = b.Mul(a, b.ScalarLike(1.0, a));  // an elementwise loop's value, specials kept
  const ir::ValueId heads = b.Transpose(b.Reshape(x, {3, 37, 5, 12}), {0, 2, 1, 3});  // rows of 12
  m.outputs.push_back({"heads", b.Convert(b.Reshape(heads, {15, 444}), DType::kBF16)});
  const ir::ValueId y = b.Add(a, b.ScalarLike(0.5, a));
  const ir::ValueId cols = b.Transpose(b.Reshape(y, {111, 60}), {1, 0});  // strided
  m.outputs.push_back({"cols", b.Convert(cols, DType::kBF16)});
  Tensor as = Random({DType::kF32, shape}, 13, Dist::kWide);
  for (size_t i = 0; i < std::size(kRoundingSpecials); ++i)
    for (int64_t at : {static_cast<int64_t>(i) * 7, int64_t{60 * 37 + 3} + static_cast<int64_t>(i), as.elements() - 1 - static_cast<int64_t>(i) * 131})
      std::memcpy(&as.f32[at], &kRoundingSpecials[i], 4);
  auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
  INFO(ir::Print(step->module()));
  int moves = 0, roundings = 0;
  for (ir::ValueId v = 0; v < step->module().size(); ++v) {
    const ir::Instr& in = step->module().at(v);
    CHECK(!(in.op == OpCode::kTranspose && in.Has(jit::kRoundsAttr)));  // no rounding transpose
    moves += in.op == OpCode::kTranspose && in.type.dtype == DType::kBF16;
    if (in.op == OpCode::kConvert && in.type.dtype == DType::kBF16) {
      ++roundings;
      CHECK(in.Has(ir::kFusionAttr));  // in the loop that computes its operand
    }
  }
  CHECK(moves == 2);
  CHECK(roundings == 2);
  CheckBf16OutputsBitwise(m, {{"a", as}}, {"heads", "cols"});
}

// Reshapes of one value feeding several bf16 matmuls (the transformer's layer-norm output, reshaped
// for each of Q, K and V) share one rounding (RoundBeforeReshapes): one bf16 copy written by the loop
// that computes the value, not one per matmul. The interpreter's results.
TEST_CASE("bf16: the reshapes of one value share its rounding", "[jit][bf16]") {
  ir::Module m;
  m.name = "shared rounding";
  ir::Builder b(&m);
  const ir::ValueId x = b.Input("x", {DType::kF32, {4, 8, 16}});
  const ir::ValueId y = b.Unary(OpCode::kTanh, x);
  TensorMap vars, inputs{{"x", Random({DType::kF32, {4, 8, 16}}, 5, Dist::kWide)}};
  for (int i = 0; i < 3; ++i) {
    const std::string w = "w" + std::to_string(i);
    const ir::ValueId wv = b.Variable(w, {DType::kF32, {16, 24}}, "weight");
    vars[w] = Random({DType::kF32, {16, 24}}, 7 + i, Dist::kUniform);
    m.outputs.push_back({"out" + std::to_string(i), b.Matmul(b.Reshape(y, {32, 16}), wv)});
  }
  REQUIRE(ir::MixedPrecision().Run(m));
  auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
  INFO(ir::Print(step->module()));
  int roundings = 0;
  for (ir::ValueId v = 0; v < step->module().size(); ++v) {
    const ir::Instr& in = step->module().at(v);
    roundings += in.op == OpCode::kConvert && in.type.dtype == DType::kBF16;
  }
  CHECK(roundings == 4);  // y once, and each weight
  TensorMap vars2 = vars;
  const TensorMap ref = RunStep(m, vars, inputs), got = JitStep(m, vars2, inputs);
  for (int i = 0; i < 3; ++i) {
    const std::string k = "out" + std::to_string(i);
    INFO(k);
    REQUIRE(got.at(k).f32.size() == ref.at(k).f32.size());
    for (size_t e = 0; e < ref.at(k).f32.size(); ++e)
      CHECK(std::fabs(got.at(k).f32[e] - ref.at(k).f32[e]) <= 1e-5f * (1 + std::fabs(ref.at(k).f32[e])));
  }
}

// A loop output t = s * broadcast(c), with s written anyway (returned here; the residual branch's
// gradient in resnet20), read only by a later loop (after a sum that loop waits for): the later loop
// computes t again from s (SinkCheapLoopOutputs), and the first loop writes s alone. The
// interpreter's bits.
TEST_CASE("a loop output computed from a value in memory is computed again by its reader's loop", "[jit]") {
  ir::Module m;
  m.name = "sunk output";
  ir::Builder b(&m);
  const ir::TensorType t2{DType::kF32, {64, 32}};
  const ir::ValueId x = b.Input("x", t2), y = b.Input("y", t2);
  const ir::ValueId c = b.Variable("c", {DType::kF32, {32}}, "weight");
  const ir::ValueId s = b.Add(x, y);
  const ir::ValueId t = b.Mul(s, b.Broadcast(c, {64, 32}, {1}));
  const ir::ValueId r = b.ReduceSum(s, {0});                      // the first loop's sum
  const ir::ValueId u = b.Mul(t, b.Broadcast(r, {64, 32}, {1}));  // waits for it: another loop
  m.outputs.push_back({"s", s});
  m.outputs.push_back({"u", u});
  TensorMap vars{{"c", Random({DType::kF32, {32}}, 3, Dist::kUniform)}};
  TensorMap inputs{{"x", Random(t2, 4, Dist::kWide)}, {"y", Random(t2, 5, Dist::kWide)}};
  ir::Module fused = m;
  ir::ElementwiseFuser().Run(fused);
  CHECK(jit::SinkCheapLoopOutputs(fused) == 1);
  auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
  INFO(ir::Print(step->module()));
  int outputs = 0;  // the loops' outputs of t's shape: s and u (t was a third)
  for (const jit::FusedKernel& k : step->kernels())
    for (ir::ValueId o : k.outputs) outputs += step->module().type(o).shape == t2.shape;
  CHECK(outputs == 2);
  TensorMap vars2 = vars;
  const TensorMap ref = RunStep(m, vars, inputs), got = JitStep(m, vars2, inputs);
  for (const char* k : {"s", "u"}) {
    INFO(k);
    REQUIRE(got.at(k).f32.size() == ref.at(k).f32.size());
    for (size_t e = 0; e < ref.at(k).f32.size(); ++e) CHECK(conformance::Bits(got.at(k).f32[e]) == conformance::Bits(ref.at(k).f32[e]));
  }
}

// GELU's gradient shape: a chain t = x * x + x (from one value in memory) read by a loop that sums and
// by two readers in a later loop (which waits for the sum). RecomputeCheapValues gives each later reader
// its own copy of the chain; MergeRepeatsInLoops then leaves one copy in that loop (it computed t twice).
// The interpreter's bits.
TEST_CASE("a loop holding two copies of a recomputed chain computes it once", "[jit]") {
  ir::Module m;
  m.name = "merged repeats";
  ir::Builder b(&m);
  const ir::TensorType t2{DType::kF32, {64, 32}};
  const auto x = b.Input("x", t2);
  const auto y = b.Input("y", t2);
  const auto t = b.Add(b.Mul(x, x), x);
  const auto s = b.ReduceSum(b.Mul(t, y), {0});  // the first reader
  m.outputs.push_back({"s", s});
  const auto bs = b.Broadcast(s, {64, 32}, {1});
  m.outputs.push_back({"d", b.Add(b.Mul(t, bs), b.Mul(t, y))});  // two readers after the sum
  ir::Module fused = m;
  CHECK(jit::RecomputeCheapValues(fused) == 2);
  ir::ElementwiseFuser().Run(fused);
  CHECK(jit::MergeRepeatsInLoops(fused) == 2);  // the second copy's mul and add
  auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", false});
  INFO(ir::Print(step->module()));
  CHECK(step->info().merged_repeats == 2);
  int squares = 0;  // x * x: one in each loop
  for (ir::ValueId v = 0; v < step->module().size(); ++v) {
    const ir::Instr& in = step->module().at(v);
    squares += in.op == OpCode::kMul && in.operands.size() == 2 && in.operands[0] == in.operands[1];
  }
  CHECK(squares == 2);
  TensorMap vars, vars2;
  const TensorMap inputs{{"x", Random(t2, 8, Dist::kWide)}, {"y", Random(t2, 9, Dist::kWide)}};
  const TensorMap ref = RunStep(m, vars, inputs), got = JitStep(m, vars2, inputs);
  for (const char* k : {"s", "d"}) {
    INFO(k);
    REQUIRE(got.at(k).f32.size() == ref.at(k).f32.size());
    for (size_t e = 0; e < ref.at(k).f32.size(); ++e) CHECK(conformance::Bits(got.at(k).f32[e]) == conformance::Bits(ref.at(k).f32[e]));
  }
}

TEST_CASE("bf16 mutation check: one bf16 ulp off in an exact fused case fails and is named", "[jit][bf16][mutation]") {
  int checked = 0;
  for (OpCode op : {OpCode::kAdd, OpCode::kMul, OpCode::kRelu, OpCode::kConvert}) {
    for (const Case& c : Cases(op)) {
      const std::optional<Case> b = Bf16Variant(c);
      if (!b || b->tol.kind != Tolerance::Kind::kExact || b->m.num_replicas > 1) continue;
      const ir::ValueId out = b->m.outputs.at(0).second;
      if (b->m.type(out).dtype != DType::kBF16 || b->m.type(out).elements() < 2) continue;
      TensorMap vars = b->variables;
      TensorMap got = JitStep(b->m, vars, b->inputs);
      const std::string k = b->m.outputs.at(0).first;
      Tensor& t = got.at(k);
      t.bf16[1] = static_cast<uint16_t>(t.bf16[1] + 1);  // the next bf16 away from zero
      TensorMap vars2 = b->variables;
      const TensorMap ref = RunStep(b->m, vars2, b->inputs);
      const Verdict v = Compare(Widened(ref).at(k), Widened(got).at(k), b->tol);
      INFO(b->label << "\n" << v.message);
      CHECK_FALSE(v.ok);
      CHECK(v.first_bad == 1);
      ++checked;
    }
  }
  CHECK(checked >= 4);
}

// 2x2 stride-2 max pooling runs 16 windows of a row at a time in AVX-512 lanes (jit/max_pool_2x2.h),
// masked at a row's tail: rows of 7, 14, 16, 17 and 33 outputs (and an odd input width, whose last
// column no window reads) keep the interpreter's bits in the forward pass, the gradient and the
// gradient under relu's mask. Values on a grid (ties, zeros) with NaNs of two payloads, -0 and
// infinities spread over the rows.
TEST_CASE("2x2 max pooling in vector lanes keeps the interpreter's bits at every row length", "[jit]") {
  auto bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  const float specials[] = {bits(0x7fc00001u), bits(0xffc00002u), -0.0f, 0.0f, INFINITY, -INFINITY};
  for (int64_t w : {int64_t{14}, int64_t{28}, int64_t{32}, int64_t{34}, int64_t{66}, int64_t{15}}) {
    const ir::Shape xs{2, 3, 6, w}, ys{2, 3, 3, w / 2};
    for (int kind = 0; kind < (w % 2 ? 1 : 3); ++kind) {  // forward; gradient; gradient under relu's mask
      const std::string what = std::string(kind == 0 ? "max_pool" : kind == 1 ? "max_pool_grad" : "masked max_pool_grad") +
                               ", input width " + std::to_string(w);
      CaseBuilder cb(what);
      ir::Builder& b = cb.b;
      auto x = cb.InSigned(F(xs), Dist::kGrid);
      Tensor& t = cb.c.inputs.begin()->second;
      for (size_t i = 0; i < t.f32.size(); i += 7) t.f32[i] = specials[(i / 7) % 6];
      Case c;
      if (kind == 0) {
        c = cb.Out(b.MaxPool(x, {2, 2}, {2, 2}));
      } else {
        auto dy = cb.In(F(ys));
        auto grad = b.Emit(OpCode::kMaxPoolGrad, {x, dy}, {{"window", IntList{2, 2}}, {"stride", IntList{2, 2}}});
        c = cb.Out(kind == 1 ? grad : b.Select(b.Emit(OpCode::kGt, {x, b.ScalarLike(0.0, x)}), grad, b.ScalarLike(0.0, grad)));
      }
      CheckBitwise(c, what);
    }
  }
}
