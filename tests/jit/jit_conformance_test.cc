// Every op of ir/ops.def runs on the CPU JIT backend and on the reference interpreter, and the results
// agree (relative 1e-5 for f32, exactly for s32, NaN where the interpreter has NaN). The case list is
// a switch over the op table with no default, so a new op without a case here fails to compile.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>

#include "ir/builder.h"
#include "jit/compiled_step.h"
#include "jit/cpu_executor.h"
#include "runtime/inprocess_collectives.h"
#include "runtime/interpreter.h"
#include "runtime/replica_runner.h"

using namespace shardstep;
using namespace shardstep::runtime;
using ir::DType;
using ir::IntList;
using ir::OpCode;

namespace {

struct Case {
  std::string label;
  ir::Module m;
  TensorMap variables, inputs;  // inputs: the same on every replica
};

// Values on a grid of quarters so comparisons hit equality; `positive` shifts them above zero.
Tensor Random(ir::TensorType t, uint32_t seed, bool positive = false, bool specials = false) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> d(-12, 12);
  Tensor out(t);
  for (int64_t i = 0; i < out.elements(); ++i) {
    int v = d(rng);
    if (positive) v = std::abs(v) + 1;
    if (t.dtype == DType::kF32) out.f32[i] = v * 0.25f;
    else out.s32[i] = v;
  }
  if (specials && t.dtype == DType::kF32 && out.elements() >= 4) {
    out.f32[0] = NAN;
    out.f32[1] = 3e9f;
    out.f32[2] = -3e9f;
    out.f32[3] = -0.0f;
  }
  return out;
}

struct CaseBuilder {
  Case c;
  ir::Builder b{&c.m};
  int next_input = 0;
  explicit CaseBuilder(std::string label) { c.label = std::move(label); }
  ir::ValueId In(ir::TensorType t, bool positive = false, bool specials = false) {
    const std::string name = "x" + std::to_string(next_input++);
    c.inputs[name] = Random(t, 17 + 31 * next_input, positive, specials);
    return b.Input(name, t);
  }
  ir::ValueId InTensor(Tensor t) {
    const std::string name = "x" + std::to_string(next_input++);
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

// The cases of one op (several dtypes / attribute variants).
std::vector<Case> CasesFor(OpCode op) {
  std::vector<Case> out;
  const std::string name = ir::OpName(op);
  auto unary = [&](DType t, bool positive, bool specials = false) {
    CaseBuilder cb(name + " " + ir::DTypeName(t));
    auto x = cb.In({t, {7, 13}}, positive, specials);
    out.push_back(cb.Out(cb.b.Emit(op, {x})));
  };
  auto binary = [&](DType t, bool positive_rhs) {
    CaseBuilder cb(name + " " + ir::DTypeName(t));
    auto x = cb.In({t, {9, 11}}, op == OpCode::kPow, t == DType::kF32);
    auto y = cb.In({t, {9, 11}}, positive_rhs);
    out.push_back(cb.Out(cb.b.Emit(op, {x, y})));
  };
  switch (op) {
    case OpCode::kVariable: {
      CaseBuilder cb(name);
      auto v = cb.b.Variable("w", F({3, 5}), ir::kRoleWeight);
      cb.c.variables["w"] = Random(F({3, 5}), 3);
      auto y = cb.b.Add(v, v);
      cb.c.m.assigns.push_back({v, y});
      out.push_back(cb.Out(v));
      break;
    }
    case OpCode::kInput: {
      CaseBuilder cb(name);
      out.push_back(cb.Out(cb.In(S({6}))));
      break;
    }
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
    case OpCode::kNeg:
    case OpCode::kAbs:
      unary(DType::kF32, false, true);
      unary(DType::kS32, false);
      break;
    case OpCode::kExp:
    case OpCode::kTanh:
    case OpCode::kSin:
    case OpCode::kCos:
    case OpCode::kSigmoid:
    case OpCode::kRelu: unary(DType::kF32, false, true); break;
    case OpCode::kLog:
    case OpCode::kSqrt:
    case OpCode::kRsqrt: unary(DType::kF32, true); break;
    case OpCode::kConvert: {
      CaseBuilder a(name + " f32->s32");
      out.push_back(a.Out(a.b.Convert(a.In(F({5, 6}), false, true), DType::kS32)));
      CaseBuilder b(name + " s32->f32");
      out.push_back(b.Out(b.b.Convert(b.In(S({5, 6})), DType::kF32)));
      break;
    }
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
      binary(DType::kF32, false);
      binary(DType::kS32, false);
      break;
    case OpCode::kDiv:
      binary(DType::kF32, false);
      binary(DType::kS32, true);  // s32: the reference path (checks the divisor)
      break;
    case OpCode::kPow: binary(DType::kF32, false); break;
    case OpCode::kSelect: {
      CaseBuilder a(name + " f32 cond");
      auto c = a.In(F({8, 9}), false, true);
      auto x = a.In(F({8, 9})), y = a.In(F({8, 9}));
      out.push_back(a.Out(a.b.Select(c, x, y)));
      CaseBuilder s(name + " s32");
      auto sc = s.In(S({8, 9}));
      auto sx = s.In(S({8, 9})), sy = s.In(S({8, 9}));
      out.push_back(s.Out(s.b.Select(sc, sx, sy)));
      break;
    }
    case OpCode::kBroadcast: {
      CaseBuilder a(name + " scalar (fused)");
      auto s = a.In(F({}));
      out.push_back(a.Out(a.b.Broadcast(s, {4, 5}, {})));
      CaseBuilder b(name + " row");
      out.push_back(b.Out(b.b.Broadcast(b.In(F({5})), {4, 5}, {1})));
      CaseBuilder c(name + " column s32");
      out.push_back(c.Out(c.b.Broadcast(c.In(S({4})), {4, 3, 5}, {0})));
      break;
    }
    case OpCode::kReshape: {
      CaseBuilder a(name);
      out.push_back(a.Out(a.b.Reshape(a.In(F({6, 4})), {2, 12})));
      break;
    }
    case OpCode::kTranspose: {
      CaseBuilder a(name);
      out.push_back(a.Out(a.b.Transpose(a.In(F({2, 3, 4})), {2, 0, 1})));
      CaseBuilder b(name + " 2d");
      out.push_back(b.Out(b.b.Transpose(b.In(S({5, 7})), {1, 0})));
      break;
    }
    case OpCode::kSlice: {
      CaseBuilder a(name);
      out.push_back(a.Out(a.b.Slice(a.In(F({5, 6, 7})), {1, 0, 2}, {4, 6, 5})));
      break;
    }
    case OpCode::kPad: {
      CaseBuilder a(name);
      out.push_back(a.Out(a.b.Pad(a.In(F({3, 4})), {1, 0}, {2, 3})));
      CaseBuilder b(name + " 1d");
      out.push_back(b.Out(b.b.Pad(b.In(F({25})), {0}, {1})));
      break;
    }
    case OpCode::kConcat: {
      CaseBuilder a(name + " axis 1");
      auto x = a.In(F({3, 2})), y = a.In(F({3, 5}));
      out.push_back(a.Out(a.b.Concat({x, y}, 1)));
      CaseBuilder b(name + " axis 0");
      auto p = b.In(S({2, 4})), q = b.In(S({1, 4})), r = b.In(S({3, 4}));
      out.push_back(b.Out(b.b.Concat({p, q, r}, 0)));
      break;
    }
    case OpCode::kReduceSum:
    case OpCode::kReduceMax:
    case OpCode::kReduceMean:
      for (IntList axes : {IntList{1}, IntList{0, 2}, IntList{0, 1, 2}, IntList{2}}) {
        for (DType t : {DType::kF32, DType::kS32}) {
          std::ostringstream label;
          label << name << " " << ir::DTypeName(t) << " axes " << ir::ShapeToString(axes);
          CaseBuilder a(label.str());
          out.push_back(a.Out(a.b.Emit(op, {a.In({t, {4, 5, 6}})}, {{"axes", axes}})));
        }
      }
      break;
    case OpCode::kMatmul:
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb) {
          CaseBuilder a(name + " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb));
          auto x = a.In(F(ta ? ir::Shape{17, 9} : ir::Shape{9, 17}));
          auto y = a.In(F(tb ? ir::Shape{13, 17} : ir::Shape{17, 13}));
          out.push_back(a.Out(a.b.Matmul(x, y, ta, tb)));
        }
      break;
    case OpCode::kConv2d: {
      CaseBuilder a(name);
      auto x = a.In(F({2, 3, 9, 8})), w = a.In(F({4, 3, 3, 3}));
      out.push_back(a.Out(a.b.Emit(op, {x, w}, {{"stride", IntList{2, 1}}, {"padding", IntList{1, 1}}})));
      CaseBuilder b(name + " stride 1x2 padding 0x2");
      auto x2 = b.In(F({3, 2, 7, 9})), w2 = b.In(F({5, 2, 2, 3}));
      out.push_back(b.Out(b.b.Emit(op, {x2, w2}, {{"stride", IntList{1, 2}}, {"padding", IntList{0, 2}}})));
      break;
    }
    case OpCode::kConv2dInputGrad: {
      CaseBuilder a(name);
      auto dy = a.In(F({2, 4, 5, 8})), w = a.In(F({4, 3, 3, 3}));
      out.push_back(a.Out(a.b.Emit(op, {dy, w},
                                   {{"input_shape", IntList{2, 3, 9, 8}}, {"stride", IntList{2, 1}}, {"padding", IntList{1, 1}}})));
      break;
    }
    case OpCode::kConv2dFilterGrad: {
      CaseBuilder a(name);
      auto x = a.In(F({2, 3, 9, 8})), dy = a.In(F({2, 4, 5, 8}));
      out.push_back(a.Out(a.b.Emit(op, {x, dy},
                                   {{"filter_shape", IntList{4, 3, 3, 3}}, {"stride", IntList{2, 1}}, {"padding", IntList{1, 1}}})));
      break;
    }
    case OpCode::kMaxPool:
    case OpCode::kAvgPool: {
      CaseBuilder a(name);
      out.push_back(a.Out(a.b.Emit(op, {a.In(F({2, 3, 8, 6}), false, true)}, {{"window", IntList{2, 2}}})));
      CaseBuilder b(name + " overlapping 3x3 stride 2");
      out.push_back(b.Out(b.b.Emit(op, {b.In(F({2, 3, 9, 7}), false, true)}, {{"window", IntList{3, 3}}, {"stride", IntList{2, 2}}})));
      break;
    }
    case OpCode::kMaxPoolGrad: {
      CaseBuilder a(name);
      auto x = a.In(F({2, 3, 8, 6}), false, true), dy = a.In(F({2, 3, 4, 3}));
      out.push_back(a.Out(a.b.Emit(op, {x, dy}, {{"window", IntList{2, 2}}})));
      CaseBuilder b(name + " overlapping 3x3 stride 2");
      auto x2 = b.In(F({2, 3, 9, 7})), dy2 = b.In(F({2, 3, 4, 3}));
      out.push_back(b.Out(b.b.Emit(op, {x2, dy2}, {{"window", IntList{3, 3}}, {"stride", IntList{2, 2}}})));
      break;
    }
    case OpCode::kAvgPoolGrad: {
      CaseBuilder a(name);
      auto dy = a.In(F({2, 3, 4, 3}));
      out.push_back(a.Out(a.b.Emit(op, {dy}, {{"window", IntList{2, 2}}, {"input_shape", IntList{2, 3, 8, 6}}})));
      break;
    }
    case OpCode::kOneHot: {
      CaseBuilder a(name);
      auto l = a.InTensor(Tensor::S32({6}, {0, 3, 9, 2, 2, 7}));
      out.push_back(a.Out(a.b.Emit(op, {l}, {{"depth", int64_t{10}}})));
      break;
    }
    case OpCode::kGather: {
      CaseBuilder a(name);
      auto table = a.In(F({5, 3, 2}));
      auto idx = a.InTensor(Tensor::S32({2, 2}, {4, 0, 2, 2}));
      out.push_back(a.Out(a.b.Emit(op, {table, idx})));
      break;
    }
    case OpCode::kScatterAdd: {
      CaseBuilder a(name);
      auto idx = a.InTensor(Tensor::S32({4}, {1, 3, 1, 0}));
      auto up = a.In(F({4, 3}));
      out.push_back(a.Out(a.b.Emit(op, {idx, up}, {{"rows", int64_t{5}}})));
      break;
    }
    case OpCode::kAllReduce:
      for (const char* r : {"sum", "mean", "max"}) {
        CaseBuilder a(name + " " + r);
        out.push_back(a.Out(a.b.Emit(op, {a.In(F({6, 5}))}, {{"reduction", std::string(r)}})));
      }
      break;
    case OpCode::kReduceScatter: {
      CaseBuilder a(name);
      out.push_back(a.Out(a.b.Emit(op, {a.In(F({6, 5}))}, {{"reduction", std::string("sum")}, {"group_size", int64_t{2}}})));
      break;
    }
    case OpCode::kAllGather: {
      CaseBuilder a(name);
      out.push_back(a.Out(a.b.Emit(op, {a.In(F({3, 5}))}, {{"group_size", int64_t{2}}})));
      break;
    }
  }
  return out;
}

// Collectives, replica ids: run as 2 replicas with in-process collectives; everything else as 1.
std::vector<TensorMap> RunBoth(Case& c, bool jit) {
  const bool multi = c.m.num_replicas > 1;
  const int n = c.m.num_replicas;
  std::vector<TensorMap> outs(n);
  InProcessCollectives coll(n);
  RunReplicas(n, multi ? &coll : nullptr, [&](int r) {
    TensorMap vars = c.variables;
    TensorMap inputs = c.inputs;
    if (multi)  // replica r's input differs: add r to every f32 element
      for (auto& [name, t] : inputs)
        if (t.dtype() == DType::kF32)
          for (float& x : t.f32) x += static_cast<float>(r);
    outs[r] = jit ? jit::JitRunStep(c.m, vars, inputs, r, multi ? &coll : nullptr)
                  : RunStep(c.m, vars, inputs, r, multi ? &coll : nullptr);
    for (auto& [name, t] : vars) outs[r]["var:" + name] = t;
  });
  return outs;
}

void Compare(const Tensor& ref, const Tensor& got, const std::string& what) {
  INFO(what);
  REQUIRE(ref.type == got.type);
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < ref.elements(); ++i) {
    if (ref.dtype() == DType::kS32) {
      INFO("element " << i);
      REQUIRE(ref.s32[i] == got.s32[i]);
      continue;
    }
    const float a = ref.f32[i], b = got.f32[i];
    if (std::isnan(a) || std::isnan(b)) {
      INFO("element " << i << ": " << a << " vs " << b);
      REQUIRE(std::isnan(a) == std::isnan(b));
      continue;
    }
    if (std::isinf(a) || std::isinf(b)) {
      REQUIRE(a == b);
      continue;
    }
    diff = std::max(diff, std::abs(static_cast<double>(a) - b));
    scale = std::max(scale, std::abs(static_cast<double>(a)));
  }
  INFO("max abs diff " << diff << ", scale " << scale);
  CHECK(diff <= 1e-5 * std::max(scale, 1e-30));
}

}  // namespace

TEST_CASE("every op of the table runs on the JIT and matches the interpreter", "[jit][conformance]") {
  int ops = 0;
  for (int i = 0; i < ir::kNumOpCodes; ++i) {
    const OpCode op = static_cast<OpCode>(i);
    std::vector<Case> list = CasesFor(op);
    INFO("op " << ir::OpName(op));
    REQUIRE(!list.empty());
    ++ops;
    for (Case& c : list) {
      if (ir::HasProperty(op, ir::kCollective) || op == OpCode::kReplicaId) c.m.num_replicas = 2;
      DYNAMIC_SECTION(c.label) {
        std::vector<TensorMap> ref = RunBoth(c, false), got = RunBoth(c, true);
        for (size_t r = 0; r < ref.size(); ++r) {
          REQUIRE(ref[r].size() == got[r].size());
          for (auto& [k, t] : ref[r]) Compare(t, got[r].at(k), c.label + " replica " + std::to_string(r) + " " + k);
        }
      }
    }
  }
  CHECK(ops == ir::kNumOpCodes);
}

TEST_CASE("elementwise ops are lowered to JIT'd loops, the rest to native or reference kernels", "[jit]") {
  int fused = 0;
  for (int i = 0; i < ir::kNumOpCodes; ++i) {
    const OpCode op = static_cast<OpCode>(i);
    for (Case& c : CasesFor(op)) {
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
TEST_CASE("a fused Adam-like chain is bitwise equal to the interpreter", "[jit]") {
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000003}}) {
    CaseBuilder cb("adam chain " + std::to_string(n));
    ir::Builder& b = cb.b;
    auto w = cb.In(F({n})), g = cb.In(F({n})), m = cb.In(F({n})), v = cb.In(F({n}), true);
    auto lr = cb.In(F({}));
    auto m2 = b.Add(b.MulScalar(m, 0.9), b.MulScalar(g, 0.1));
    auto v2 = b.Add(b.MulScalar(v, 0.999), b.Mul(b.MulScalar(g, 0.001), g));
    auto upd = b.Div(b.Mul(b.BroadcastScalar(lr, {n}), m2), b.AddScalar(b.Unary(OpCode::kSqrt, v2), 1e-8));
    auto w2 = b.Sub(w, upd);
    cb.c.m.outputs.push_back({"m", m2});
    cb.c.m.outputs.push_back({"v", v2});
    Case c = cb.Out(w2);
    auto step = jit::CompiledStep::Compile(c.m, jit::JitOptions{"", false});
    CHECK(step->kernels().size() == 1);
    TensorMap vars;
    TensorMap ref = RunStep(c.m, vars, c.inputs), got = jit::JitRunStep(c.m, vars, c.inputs);
    for (auto& [k, t] : ref) {
      INFO("n " << n << " output " << k);
      CHECK(t == got.at(k));
    }
  }
}

// Large sums run as parallel blocks of rows (jit/compiled_step.cc, Reduce): they stay within float
// rounding of the interpreter's serial order and give the same bits on every run.
TEST_CASE("large reductions split into blocks agree with the interpreter and are deterministic", "[jit]") {
  const ir::Shape shape = {64, 8, 30, 30};  // 460800 elements: several blocks
  for (const IntList& axes : {IntList{0, 2, 3}, IntList{0}, IntList{3}, IntList{1, 2}, IntList{0, 1, 2, 3}}) {
    for (OpCode op : {OpCode::kReduceSum, OpCode::kReduceMean}) {
      std::ostringstream label;
      label << ir::OpName(op) << " axes";
      for (int64_t a : axes) label << " " << a;
      CaseBuilder cb(label.str());
      const ir::ValueId x = cb.In(F(shape));
      Case c = cb.Out(cb.b.Emit(op, {x}, {{"axes", axes}}));
      TensorMap vars;
      const TensorMap ref = RunStep(c.m, vars, c.inputs);
      const TensorMap first = jit::JitRunStep(c.m, vars, c.inputs), second = jit::JitRunStep(c.m, vars, c.inputs);
      INFO(c.label);
      CHECK(first.at("out") == second.at("out"));
      const Tensor& a = ref.at("out");
      const Tensor& b = first.at("out");
      double scale = 0, diff = 0;
      for (int64_t i = 0; i < a.elements(); ++i) {
        scale = std::max(scale, std::abs(static_cast<double>(a.f32[i])));
        diff = std::max(diff, std::abs(static_cast<double>(a.f32[i]) - b.f32[i]));
      }
      CHECK(diff <= 1e-5 * std::max(scale, 1e-30));
    }
  }
}
