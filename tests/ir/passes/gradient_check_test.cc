// Gradient check: walks the op table and compares every gradient rule (through Autodiff) with central
// finite differences on the reference interpreter; plus an MLP-like composition and Autodiff's errors.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <sstream>

#include "ir/builder.h"
#include "ir/error.h"
#include "ir/passes/autodiff.h"
#include "ir/passes/data_parallel_lowering.h"
#include "ir/passes/pipeline.h"
#include "ir/passes/gradients.h"
#include "ir/printer.h"
#include "runtime/inprocess_collectives.h"
#include "runtime/interpreter.h"
#include "runtime/replica_runner.h"

namespace shardstep::ir {
namespace {

using runtime::Tensor;
using runtime::TensorMap;
using Init = std::function<std::vector<float>(int64_t n, std::mt19937& rng)>;

// ---- Initialisers that keep the inputs away from kinks and ties ----

Init Uniform(float lo, float hi) {
  return [=](int64_t n, std::mt19937& rng) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng);
    return v;
  };
}
// |x| in [0.2, 1], random sign: away from the kinks of relu and abs at 0.
Init AwayFromZero(float lo = 0.2f, float hi = 1.0f) {
  return [=](int64_t n, std::mt19937& rng) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::bernoulli_distribution sign(0.5);
    std::vector<float> v(n);
    for (float& x : v) x = sign(rng) ? d(rng) : -d(rng);
    return v;
  };
}
// A shuffled grid with step 0.1: all values distinct by far more than the FD step (max / pool ties).
Init Distinct() {
  return [](int64_t n, std::mt19937& rng) {
    std::vector<float> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = 0.1f * static_cast<float>(i) - 0.05f * static_cast<float>(n);
    std::shuffle(v.begin(), v.end(), rng);
    return v;
  };
}

// ---- A case: a small module whose weights feed one op ----

struct Ctx {
  Builder& b;
  std::mt19937& rng;
  TensorMap variables, inputs;

  ValueId Weight(const std::string& name, const Shape& shape, const Init& init = Uniform(-1, 1)) {
    return WeightData(name, shape, init(NumElements(shape), rng));
  }
  ValueId WeightData(const std::string& name, const Shape& shape, std::vector<float> data) {
    variables[name] = Tensor::F32(shape, std::move(data));
    return b.Variable(name, {DType::kF32, shape}, kRoleWeight);
  }
  ValueId InputF32(const std::string& name, const Shape& shape, std::vector<float> data) {
    inputs[name] = Tensor::F32(shape, std::move(data));
    return b.Input(name, {DType::kF32, shape});
  }
  ValueId Indices(const std::string& name, const Shape& shape, std::vector<int32_t> data) {
    inputs[name] = Tensor::S32(shape, std::move(data));
    return b.Input(name, {DType::kS32, shape});
  }
  const std::vector<float>& Data(const std::string& weight) { return variables.at(weight).f32; }
};

struct Case {
  OpCode op;          // the op under test (must appear in the built module)
  std::string label;  // names the variant
  std::function<ValueId(Ctx&)> build;
  double eps = 1e-2;
};

Attrs Conv(IntList stride, IntList padding) { return {{"stride", stride}, {"padding", padding}}; }
Attrs Pool(IntList window, IntList stride) { return {{"window", window}, {"stride", stride}}; }
Attrs With(Attrs a, const std::string& key, AttrValue v) {
  a[key] = std::move(v);
  return a;
}

Case Unary(OpCode op, Init init, std::string label = "") {
  return {op, label.empty() ? OpName(op) : label, [op, init](Ctx& c) {
            return c.b.Unary(op, c.Weight("x", {2, 3}, init));
          }};
}
Case Binary(OpCode op, Init ix, Init iy) {
  return {op, OpName(op), [op, ix, iy](Ctx& c) {
            return c.b.Binary(op, c.Weight("x", {2, 3}, ix), c.Weight("y", {2, 3}, iy));
          }};
}
// max / min: y = x +- [0.2, 1], so no ties within the FD step.
Case MaxMin(OpCode op) {
  return {op, OpName(op), [op](Ctx& c) {
            ValueId x = c.Weight("x", {2, 3});
            std::vector<float> y = c.Data("x"), off = AwayFromZero()(6, c.rng);
            for (size_t i = 0; i < y.size(); ++i) y[i] += off[i];
            return c.b.Binary(op, x, c.WeightData("y", {2, 3}, y));
          }};
}
Case Matmul(bool ta, bool tb) {
  return {OpCode::kMatmul, Str("matmul ta=", ta, " tb=", tb), [ta, tb](Ctx& c) {
            ValueId a = c.Weight("a", ta ? Shape{4, 3} : Shape{3, 4});
            ValueId w = c.Weight("b", tb ? Shape{5, 4} : Shape{4, 5});
            return c.b.Matmul(a, w, ta, tb);
          }};
}
// Batched: a [2,3] batch of products (attention's layout), transposes on the last two dims.
Case BatchedMatmul(bool ta, bool tb) {
  return {OpCode::kMatmul, Str("batched matmul [2,3] ta=", ta, " tb=", tb), [ta, tb](Ctx& c) {
            ValueId a = c.Weight("a", ta ? Shape{2, 3, 4, 3} : Shape{2, 3, 3, 4});
            ValueId w = c.Weight("b", tb ? Shape{2, 3, 5, 4} : Shape{2, 3, 4, 5});
            return c.b.Matmul(a, w, ta, tb);
          }};
}
Case Conv2d(Shape x, Shape w, IntList s, IntList p) {
  return {OpCode::kConv2d, Str("conv2d x=", ShapeToString(x), " w=", ShapeToString(w), " s=", ShapeToString(s),
                               " p=", ShapeToString(p)),
          [=](Ctx& c) { return c.b.Emit(OpCode::kConv2d, {c.Weight("x", x), c.Weight("w", w)}, Conv(s, p)); }};
}
int64_t Out(int64_t in, int64_t k, int64_t s, int64_t p) { return (in + 2 * p - k) / s + 1; }
Case ConvInputGrad(Shape x, Shape w, IntList s, IntList p) {
  Shape dy{x[0], w[0], Out(x[2], w[2], s[0], p[0]), Out(x[3], w[3], s[1], p[1])};
  return {OpCode::kConv2dInputGrad, Str("conv2d_input_grad x=", ShapeToString(x), " s=", ShapeToString(s), " p=",
                                        ShapeToString(p)),
          [=](Ctx& c) {
            return c.b.Emit(OpCode::kConv2dInputGrad, {c.Weight("dy", dy), c.Weight("w", w)},
                            With(Conv(s, p), "input_shape", IntList(x)));
          }};
}
Case ConvFilterGrad(Shape x, Shape w, IntList s, IntList p) {
  Shape dy{x[0], w[0], Out(x[2], w[2], s[0], p[0]), Out(x[3], w[3], s[1], p[1])};
  return {OpCode::kConv2dFilterGrad, Str("conv2d_filter_grad x=", ShapeToString(x), " s=", ShapeToString(s), " p=",
                                         ShapeToString(p)),
          [=](Ctx& c) {
            return c.b.Emit(OpCode::kConv2dFilterGrad, {c.Weight("x", x), c.Weight("dy", dy)},
                            With(Conv(s, p), "filter_shape", IntList(w)));
          }};
}
Case PoolCase(OpCode op, Shape x, IntList k, IntList s) {
  return {op, Str(OpName(op), " x=", ShapeToString(x), " k=", ShapeToString(k), " s=", ShapeToString(s)),
          [=](Ctx& c) { return c.b.Emit(op, {c.Weight("x", x, Distinct())}, Pool(k, s)); }};
}
Case MaxPoolGradCase(Shape x, IntList k, IntList s, int64_t p = 0) {
  Shape dy{x[0], x[1], Out(x[2], k[0], s[0], p), Out(x[3], k[1], s[1], p)};
  Attrs a = Pool(k, s);
  if (p) a["padding"] = p;
  return {OpCode::kMaxPoolGrad, Str("max_pool_grad x=", ShapeToString(x), " k=", ShapeToString(k), " s=",
                                    ShapeToString(s), " p=", p),
          [=](Ctx& c) { return c.b.Emit(OpCode::kMaxPoolGrad, {c.Weight("x", x, Distinct()), c.Weight("dy", dy)}, a); }};
}
// Padded max pooling on negative inputs: a padded cell (0 before the rule) would win every border window.
Case PaddedMaxPool(Shape x, IntList k, IntList s, int64_t p) {
  return {OpCode::kMaxPool, Str("max_pool x=", ShapeToString(x), " k=", ShapeToString(k), " s=", ShapeToString(s),
                                " padding=", p),
          [=](Ctx& c) {
            std::vector<float> v = Distinct()(NumElements(x), c.rng);
            for (float& e : v) e = e - 10.0f;
            return c.b.MaxPool(c.WeightData("x", x, v), k, s, p);
          }};
}
Case AvgPoolGradCase(Shape x, IntList k, IntList s) {
  Shape dy{x[0], x[1], Out(x[2], k[0], s[0], 0), Out(x[3], k[1], s[1], 0)};
  return {OpCode::kAvgPoolGrad, Str("avg_pool_grad x=", ShapeToString(x), " k=", ShapeToString(k), " s=",
                                    ShapeToString(s)),
          [=](Ctx& c) {
            return c.b.Emit(OpCode::kAvgPoolGrad, {c.Weight("dy", dy)}, With(Pool(k, s), "input_shape", IntList(x)));
          }};
}

// attention(q, k, v) on [2, t, d] weights; causal or not.
Case AttentionCase(int64_t t, int64_t d, bool causal) {
  const Shape x{2, t, d};
  return {OpCode::kAttention, Str("attention ", ShapeToString(x), causal ? " causal" : ""), [=](Ctx& c) {
            return c.b.Emit(OpCode::kAttention, {c.Weight("q", x), c.Weight("k", x), c.Weight("v", x)},
                            {{"scale", 0.5}, {"causal", int64_t{causal}}});
          }};
}

std::vector<Case> Cases() {
  const Init any = Uniform(-1, 1), positive = Uniform(0.5f, 2.0f), nonzero = AwayFromZero(0.5f, 2.0f);
  std::vector<Case> cases = {
      Unary(OpCode::kNeg, any),
      Unary(OpCode::kExp, any),
      Unary(OpCode::kLog, positive),
      Unary(OpCode::kSqrt, positive),
      Unary(OpCode::kRsqrt, positive),
      Unary(OpCode::kTanh, Uniform(-2, 2)),
      Unary(OpCode::kSin, Uniform(-3, 3)),
      Unary(OpCode::kCos, Uniform(-3, 3)),
      Unary(OpCode::kSigmoid, Uniform(-3, 3)),
      Unary(OpCode::kRelu, AwayFromZero()),
      Unary(OpCode::kAbs, AwayFromZero()),
      {OpCode::kConvert, "convert f32->f32",
       [](Ctx& c) { return c.b.Emit(OpCode::kConvert, {c.Weight("x", {2, 3})}, {{"dtype", std::string("f32")}}); }},
      Binary(OpCode::kAdd, any, any),
      Binary(OpCode::kSub, any, any),
      Binary(OpCode::kMul, any, any),
      {OpCode::kMul, "mul x*x (one weight, two uses)",
       [](Ctx& c) {
         ValueId x = c.Weight("x", {2, 3});
         return c.b.Mul(x, x);
       }},
      Binary(OpCode::kDiv, any, nonzero),
      Binary(OpCode::kPow, positive, Uniform(-1.5f, 1.5f)),
      MaxMin(OpCode::kMax),
      MaxMin(OpCode::kMin),
      {OpCode::kSelect, "select with a fixed condition",
       [](Ctx& c) {
         ValueId cond = c.InputF32("cond", {2, 3}, {1, 0, 0, 1, 1, 0});
         return c.b.Select(cond, c.Weight("x", {2, 3}), c.Weight("y", {2, 3}));
       }},
      {OpCode::kSelect, "select on a comparison of weights (the comparison gets no cotangent)",
       [](Ctx& c) {
         ValueId x = c.Weight("x", {2, 3});
         std::vector<float> y = c.Data("x"), off = AwayFromZero()(6, c.rng);
         for (size_t i = 0; i < y.size(); ++i) y[i] += off[i];
         ValueId yv = c.WeightData("y", {2, 3}, y);
         return c.b.Select(c.b.Binary(OpCode::kGt, x, yv), c.b.Mul(x, yv), c.b.Sub(x, yv));
       }},
      {OpCode::kBroadcast, "broadcast [3] -> [2,3,4]",
       [](Ctx& c) { return c.b.Broadcast(c.Weight("x", {3}), {2, 3, 4}, {1}); }},
      {OpCode::kBroadcast, "broadcast [2,4] -> [2,3,4]",
       [](Ctx& c) { return c.b.Broadcast(c.Weight("x", {2, 4}), {2, 3, 4}, {0, 2}); }},
      {OpCode::kBroadcast, "broadcast scalar -> [2,3]",
       [](Ctx& c) { return c.b.BroadcastScalar(c.Weight("x", {}), {2, 3}); }},
      {OpCode::kReshape, "reshape", [](Ctx& c) { return c.b.Reshape(c.Weight("x", {2, 3, 4}), {6, 4}); }},
      {OpCode::kTranspose, "transpose", [](Ctx& c) { return c.b.Transpose(c.Weight("x", {2, 3, 4}), {2, 0, 1}); }},
      {OpCode::kSlice, "slice", [](Ctx& c) { return c.b.Slice(c.Weight("x", {4, 5}), {1, 0}, {3, 4}); }},
      {OpCode::kPad, "pad", [](Ctx& c) { return c.b.Pad(c.Weight("x", {2, 3}), {1, 0}, {0, 2}); }},
      {OpCode::kConcat, "concat of three along axis 1",
       [](Ctx& c) {
         return c.b.Concat({c.Weight("x", {2, 1}), c.Weight("y", {2, 3}), c.Weight("z", {2, 2})}, 1);
       }},
      {OpCode::kConcat, "concat of a weight with itself along axis 0",
       [](Ctx& c) {
         ValueId x = c.Weight("x", {2, 3});
         return c.b.Concat({x, x}, 0);
       }},
      {OpCode::kReduceSum, "reduce_sum axes {0,2}", [](Ctx& c) { return c.b.ReduceSum(c.Weight("x", {2, 3, 4}), {0, 2}); }},
      {OpCode::kReduceSum, "reduce_sum axes {1}", [](Ctx& c) { return c.b.ReduceSum(c.Weight("x", {2, 3, 4}), {1}); }},
      {OpCode::kReduceMean, "reduce_mean axes {0,2}",
       [](Ctx& c) { return c.b.ReduceMean(c.Weight("x", {2, 3, 4}), {0, 2}); }},
      {OpCode::kReduceMean, "reduce_mean all", [](Ctx& c) { return c.b.ReduceMean(c.Weight("x", {3, 4}), {0, 1}); }},
      {OpCode::kReduceMax, "reduce_max axes {1}",
       [](Ctx& c) { return c.b.ReduceMax(c.Weight("x", {2, 3, 4}, Distinct()), {1}); }},
      {OpCode::kReduceMax, "reduce_max axes {0,2}",
       [](Ctx& c) { return c.b.ReduceMax(c.Weight("x", {2, 3, 4}, Distinct()), {0, 2}); }},
      Matmul(false, false),
      Matmul(false, true),
      Matmul(true, false),
      Matmul(true, true),
      BatchedMatmul(false, false),
      BatchedMatmul(false, true),
      BatchedMatmul(true, false),
      BatchedMatmul(true, true),
      Conv2d({2, 2, 5, 5}, {3, 2, 3, 3}, {1, 1}, {0, 0}),
      Conv2d({1, 2, 6, 5}, {3, 2, 3, 2}, {2, 1}, {1, 0}),
      Conv2d({1, 3, 6, 6}, {2, 3, 3, 3}, {2, 2}, {0, 0}),  // the last input row/column is not covered
      ConvInputGrad({1, 2, 5, 5}, {3, 2, 3, 3}, {1, 1}, {0, 0}),
      ConvInputGrad({1, 2, 6, 5}, {3, 2, 3, 3}, {2, 2}, {1, 1}),
      ConvInputGrad({2, 2, 6, 6}, {2, 2, 3, 3}, {2, 1}, {0, 1}),
      AttentionCase(3, 2, false),
      AttentionCase(4, 3, true),
      ConvFilterGrad({1, 2, 5, 5}, {3, 2, 3, 3}, {1, 1}, {0, 0}),
      ConvFilterGrad({1, 2, 6, 5}, {3, 2, 3, 3}, {2, 2}, {1, 1}),
      ConvFilterGrad({2, 2, 6, 6}, {2, 2, 3, 3}, {2, 1}, {0, 1}),
      PoolCase(OpCode::kMaxPool, {1, 2, 4, 4}, {2, 2}, {2, 2}),
      PoolCase(OpCode::kMaxPool, {1, 2, 5, 5}, {3, 3}, {2, 2}),  // overlapping windows
      PoolCase(OpCode::kMaxPool, {2, 1, 5, 4}, {2, 2}, {1, 2}),
      MaxPoolGradCase({1, 2, 4, 4}, {2, 2}, {2, 2}),
      MaxPoolGradCase({1, 2, 5, 5}, {3, 3}, {2, 2}),  // overlapping: one element can win two windows
      MaxPoolGradCase({2, 1, 5, 4}, {2, 2}, {1, 2}),
      MaxPoolGradCase({1, 1, 5, 5}, {2, 2}, {2, 2}),  // uncovered tail
      PaddedMaxPool({1, 2, 5, 5}, {3, 3}, {2, 2}, 1),
      PaddedMaxPool({2, 1, 4, 5}, {2, 2}, {1, 1}, 1),
      MaxPoolGradCase({1, 2, 5, 5}, {3, 3}, {2, 2}, 1),
      MaxPoolGradCase({1, 1, 4, 5}, {2, 3}, {2, 1}, 1),
      PoolCase(OpCode::kAvgPool, {1, 2, 4, 4}, {2, 2}, {2, 2}),
      PoolCase(OpCode::kAvgPool, {1, 2, 5, 5}, {3, 3}, {1, 1}),
      AvgPoolGradCase({1, 2, 4, 4}, {2, 2}, {2, 2}),
      AvgPoolGradCase({1, 2, 5, 5}, {3, 3}, {2, 1}),
      {OpCode::kGather, "gather with repeated indices",
       [](Ctx& c) { return c.b.Emit(OpCode::kGather, {c.Weight("t", {5, 3}), c.Indices("i", {4}, {1, 3, 1, 0})}); }},
      {OpCode::kGather, "gather with 2-d indices",
       [](Ctx& c) {
         return c.b.Emit(OpCode::kGather, {c.Weight("t", {4, 2, 2}), c.Indices("i", {2, 2}, {3, 0, 3, 2})});
       }},
      {OpCode::kScatterAdd, "scatter_add with repeated indices",
       [](Ctx& c) {
         return c.b.Emit(OpCode::kScatterAdd, {c.Indices("i", {4}, {1, 3, 1, 0}), c.Weight("u", {4, 3})},
                         {{"rows", int64_t{5}}});
       }},
      {OpCode::kScatterAdd, "scatter_add with 2-d indices",
       [](Ctx& c) {
         return c.b.Emit(OpCode::kScatterAdd, {c.Indices("i", {2, 2}, {2, 0, 2, 1}), c.Weight("u", {2, 2, 3})},
                         {{"rows", int64_t{3}}});
       }},
      // One replica: all_reduce is the identity and so is its rule's all_reduce(dz); the replicated
      // case is checked against finite differences of the global loss below.
      {OpCode::kAllReduce, "all_reduce sum (one replica)",
       [](Ctx& c) { return c.b.AllReduce(c.b.Mul(c.Weight("x", {2, 3}), c.Weight("y", {2, 3})), "sum"); }},
      {OpCode::kAllReduce, "all_reduce mean (one replica)",
       [](Ctx& c) { return c.b.AllReduce(c.Weight("x", {4}), "mean"); }},
  };
  return cases;
}

// ---- Finite differences ----

float Loss(const Module& m, const TensorMap& variables, const TensorMap& inputs) {
  std::vector<Tensor> values = runtime::EvaluateAll(m, variables, inputs);
  return values[m.FindOutput("loss")].f32[0];
}

struct Mismatch {
  int count = 0;
  std::string first;  // the worst element, for the message
  double worst = 0;
};

// Compares Autodiff's gradient of every weight with central differences; returns a report per weight.
// `module` has a scalar f32 output "loss".
void CheckGradients(const Module& module, TensorMap variables, const TensorMap& inputs, double eps,
                    double rtol = 2e-2, double atol = 2e-3) {
  Module ad = module;
  REQUIRE(Autodiff().Run(ad));
  INFO("module with gradients:\n" << Print(ad));
  std::vector<Tensor> values = runtime::EvaluateAll(ad, variables, inputs);
  for (auto& [w, g] : ad.gradients) {
    const std::string& name = ad.at(w).name;
    const Tensor& grad = values.at(g);
    REQUIRE(grad.type == ad.type(w));
    Tensor& var = variables.at(name);
    Mismatch mm;
    for (int64_t i = 0; i < var.elements(); ++i) {
      const float x0 = var.f32[i];
      const float xp = static_cast<float>(x0 + eps), xm = static_cast<float>(x0 - eps);
      var.f32[i] = xp;
      const double lp = Loss(module, variables, inputs);
      var.f32[i] = xm;
      const double lm = Loss(module, variables, inputs);
      var.f32[i] = x0;
      const double fd = (lp - lm) / (static_cast<double>(xp) - static_cast<double>(xm));
      const double got = grad.f32[i];
      const double err = std::abs(got - fd), tol = atol + rtol * std::max(std::abs(fd), std::abs(got));
      if (!(err <= tol)) {
        ++mm.count;
        if (!(err <= mm.worst)) {
          mm.worst = err;
          mm.first = Str("@", name, "[", i, "]: autodiff ", got, " vs finite difference ", fd);
        }
      }
    }
    INFO(mm.count << " of " << var.elements() << " elements differ; worst " << mm.first);
    CHECK(mm.count == 0);
  }
}

// Builds a case: its op, then loss = reduce_sum(op(...) * r) for a fixed random r.
struct Built {
  Module module;
  TensorMap variables, inputs;
};
Built Build(const Case& c, unsigned seed) {
  Built out;
  std::mt19937 rng(seed);
  Builder b(&out.module);
  Ctx ctx{b, rng, {}, {}};
  ValueId y = c.build(ctx);
  REQUIRE(b.type(y).dtype == DType::kF32);
  const Shape shape = b.shape(y);
  ValueId r = ctx.InputF32("r", shape, Uniform(-1, 1)(NumElements(shape), rng));
  ValueId loss = b.SumAll(b.Mul(y, r));
  out.module.outputs.push_back({"loss", loss});
  out.variables = std::move(ctx.variables);
  out.inputs = std::move(ctx.inputs);
  return out;
}

TEST_CASE("every op with a gradient rule has a finite-difference case", "[autodiff]") {
  std::set<OpCode> covered;
  for (const Case& c : Cases()) covered.insert(c.op);
  for (int i = 0; i < kNumOpCodes; ++i) {
    const OpCode op = static_cast<OpCode>(i);
    if (HasProperty(op, kNoGradient)) continue;
    INFO("op '" << OpName(op) << "' has a gradient rule but no case in Cases()");
    CHECK(covered.count(op) == 1);
  }
}

TEST_CASE("every gradient rule matches finite differences", "[autodiff]") {
  const std::vector<Case> cases = Cases();
  for (size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    INFO("case: " << c.label);
    Built built = Build(c, 1000 + static_cast<unsigned>(k));
    const bool has_op = std::any_of(built.module.instrs.begin(), built.module.instrs.end(),
                                    [&](const Instr& in) { return in.op == c.op; });
    REQUIRE(has_op);
    CheckGradients(built.module, built.variables, built.inputs, c.eps);
  }
}

TEST_CASE("ops without gradients give no cotangent", "[autodiff]") {
  Module m;
  Builder b(&m);
  ValueId x = b.Variable("x", {DType::kF32, {3}}, kRoleWeight), y = b.Variable("y", {DType::kF32, {3}}, kRoleWeight);
  for (OpCode op : {OpCode::kEq, OpCode::kNe, OpCode::kLt, OpCode::kLe, OpCode::kGt, OpCode::kGe}) {
    ValueId z = b.Binary(op, x, y);
    CHECK(GradientRule(b, z, b.ScalarLike(1.0, z)) == std::vector<ValueId>{kNoValue, kNoValue});
  }
  ValueId labels = b.Input("labels", {DType::kS32, {3}});
  ValueId oh = b.Emit(OpCode::kOneHot, {labels}, {{"depth", int64_t{4}}});
  CHECK(GradientRule(b, oh, b.ScalarLike(1.0, oh)) == std::vector<ValueId>{kNoValue});
  ValueId sg = b.Unary(OpCode::kStopGradient, x);
  CHECK(GradientRule(b, sg, b.ScalarLike(1.0, sg)) == std::vector<ValueId>{kNoValue});
}

// loss = sum(x * stop_gradient(x)^2): the value of x^3, the gradient x^2 (only the first factor's
// path), where without the op it would be 3 x^2.
TEST_CASE("autodiff sends no gradient through stop_gradient", "[autodiff]") {
  Module m;
  Builder b(&m);
  ValueId x = b.Variable("x", {DType::kF32, {3}}, kRoleWeight);
  ValueId held = b.Unary(OpCode::kStopGradient, x);
  m.outputs.push_back({"loss", b.SumAll(b.Mul(x, b.Mul(held, held)))});
  REQUIRE(Autodiff().Run(m));
  const TensorMap variables{{"x", Tensor::F32({3}, {-2, 0.5f, 3})}};
  std::vector<Tensor> values = runtime::EvaluateAll(m, variables, {});
  CHECK(values[m.FindOutput("loss")].f32[0] == -8 + 0.125f + 27);
  REQUIRE(m.gradients.size() == 1);
  CHECK(values.at(m.gradients.begin()->second).f32 == std::vector<float>{4, 0.25f, 9});
}

// ---- An MLP-like composition: matmul + bias + relu + softmax cross-entropy from exp/log/reduce ----

TEST_CASE("autodiff of an MLP with softmax cross-entropy matches finite differences", "[autodiff]") {
  const int64_t batch = 4, in = 3, hidden = 5, classes = 3;
  Module m;
  Builder b(&m);
  ValueId x = b.Input("x", {DType::kF32, {batch, in}});
  ValueId labels = b.Input("labels", {DType::kS32, {batch}});
  ValueId w1 = b.Variable("w1", {DType::kF32, {in, hidden}}, kRoleWeight);
  ValueId b1 = b.Variable("b1", {DType::kF32, {hidden}}, kRoleWeight);
  ValueId w2 = b.Variable("w2", {DType::kF32, {hidden, classes}}, kRoleWeight);
  ValueId b2 = b.Variable("b2", {DType::kF32, {classes}}, kRoleWeight);
  ValueId pre = b.Add(b.Matmul(x, w1), b.Broadcast(b1, {batch, hidden}, {1}));
  ValueId h = b.Unary(OpCode::kRelu, pre);
  ValueId logits = b.Add(b.Matmul(h, w2), b.Broadcast(b2, {batch, classes}, {1}));
  // log_softmax(z) = z - max - log(sum(exp(z - max)))
  ValueId shifted = b.Sub(logits, b.Broadcast(b.ReduceMax(logits, {1}), {batch, classes}, {0}));
  ValueId lse = b.Unary(OpCode::kLog, b.ReduceSum(b.Unary(OpCode::kExp, shifted), {1}));
  ValueId logp = b.Sub(shifted, b.Broadcast(lse, {batch, classes}, {0}));
  ValueId onehot = b.Emit(OpCode::kOneHot, {labels}, {{"depth", classes}});
  ValueId loss = b.Neg(b.ReduceMean(b.ReduceSum(b.Mul(onehot, logp), {1}), {0}));
  m.outputs.push_back({"loss", loss});
  m.outputs.push_back({"pre", pre});

  // Pick data whose hidden pre-activations stay clear of relu's kink under the FD step.
  TensorMap variables, inputs;
  for (unsigned seed = 1;; ++seed) {
    REQUIRE(seed < 100);
    std::mt19937 rng(seed);
    variables = {{"w1", Tensor::F32({in, hidden}, Uniform(-1, 1)(in * hidden, rng))},
                 {"b1", Tensor::F32({hidden}, Uniform(-0.5, 0.5)(hidden, rng))},
                 {"w2", Tensor::F32({hidden, classes}, Uniform(-1, 1)(hidden * classes, rng))},
                 {"b2", Tensor::F32({classes}, Uniform(-0.5, 0.5)(classes, rng))}};
    inputs = {{"x", Tensor::F32({batch, in}, Uniform(-1, 1)(batch * in, rng))},
              {"labels", Tensor::S32({batch}, {0, 2, 1, 2})}};
    const Tensor p = runtime::EvaluateAll(m, variables, inputs)[pre];
    float closest = 1e9f;
    for (float v : p.f32) closest = std::min(closest, std::abs(v));
    if (closest > 0.05f) break;
  }
  CheckGradients(m, variables, inputs, 1e-3, 2e-2, 1e-3);

  Module ad = m;
  Autodiff().Run(ad);
  REQUIRE(ad.gradients.size() == 4);
  for (auto [w, g] : ad.gradients) CHECK(ad.type(g) == ad.type(w));
}

// ---- A forward all_reduce across replicas (cross-replica statistics) ----

TEST_CASE("forward all_reduce: autodiff + data-parallel lowering give the global loss's gradient", "[autodiff]") {
  const int n = 4;
  Module m;
  m.num_replicas = n;
  Builder b(&m);
  const TensorType t{DType::kF32, {3}};
  ValueId w = b.Variable("w", t, kRoleWeight), v = b.Variable("v", t, kRoleWeight);
  ValueId x = b.Input("x", t);
  const IntLists pairs{{0, 1}, {2, 3}};
  ValueId z = b.AllReduce(b.Mul(w, x), "mean", pairs);
  ValueId z2 = b.AllReduce(v, "sum", pairs);  // a weight read only by an all_reduce over pairs
  m.outputs.push_back({"loss", b.SumAll(b.Mul(b.Add(b.Mul(z, z), z2), x))});

  Module lowered = m;
  REQUIRE(Autodiff().Run(lowered));
  REQUIRE(DataParallelLowering().Run(lowered));
  INFO(Print(lowered));
  REQUIRE(lowered.gradients.size() == 2);
  for (auto [var, g] : lowered.gradients) {  // the lowering's mean over all replicas, not skipped
    REQUIRE(lowered.at(g).op == OpCode::kAllReduce);
    CHECK(lowered.at(g).GetString("reduction") == "mean");
    CHECK(lowered.at(g).GetIntLists("groups").empty());
  }

  auto inputs_of = [](int r) {
    const float f = static_cast<float>(r);
    return TensorMap{{"x", Tensor::F32({3}, {0.5f + f, -1.0f + 0.3f * f, 2.0f - 0.7f * f})}};
  };
  auto run = [&](const Module& mod, const TensorMap& vars) {
    runtime::InProcessCollectives coll(n);
    std::vector<std::vector<Tensor>> out(n);
    runtime::RunReplicas(n, &coll, [&](int r) { out[r] = runtime::EvaluateAll(mod, vars, inputs_of(r), r, &coll); });
    return out;
  };
  // The data-parallel loss: the mean of the replicas' losses.
  auto global_loss = [&](const TensorMap& vars) {
    double sum = 0;
    for (auto& values : run(m, vars)) sum += values[m.FindOutput("loss")].f32[0];
    return sum / n;
  };
  TensorMap vars{{"w", Tensor::F32({3}, {0.3f, -0.8f, 1.1f})}, {"v", Tensor::F32({3}, {0.7f, 0.2f, -0.4f})}};
  const auto values = run(lowered, vars);
  for (auto [var, g] : lowered.gradients) {
    const std::string& name = lowered.at(var).name;
    for (int r = 1; r < n; ++r) CHECK(values[r][g].f32 == values[0][g].f32);  // one gradient everywhere
    for (int i = 0; i < 3; ++i) {
      const double eps = 1e-2;
      TensorMap plus = vars, minus = vars;
      plus[name].f32[i] += static_cast<float>(eps);
      minus[name].f32[i] -= static_cast<float>(eps);
      const double fd = (global_loss(plus) - global_loss(minus)) /
                        (static_cast<double>(plus[name].f32[i]) - minus[name].f32[i]);
      INFO("@" << name << "[" << i << "]");
      CHECK(values[0][g].f32[i] == Approx(fd).epsilon(2e-3).margin(1e-3));
    }
  }
}

TEST_CASE("the training pipeline accepts a forward all_reduce, sharded or not", "[autodiff]") {
  for (bool shard : {false, true}) {
    Module m;
    m.num_replicas = 4;
    Builder b(&m);
    ValueId w = b.Variable("w", {DType::kF32, {4, 3}}, kRoleWeight);
    ValueId x = b.Input("x", {DType::kF32, {2, 4}});
    ValueId h = b.Matmul(x, w);                                                   // [2, 3]
    ValueId mean = b.MulScalar(b.AllReduce(b.ReduceSum(h, {0}), "sum"), 1.0 / 8);  // cross-replica batch mean
    ValueId centred = b.Sub(h, b.Broadcast(mean, {2, 3}, {1}));
    m.outputs.push_back({"loss", b.ReduceMean(b.Mul(centred, centred), {0, 1})});
    PipelineOptions o;
    o.replicas = 4;
    o.shard_weight_update = shard;
    INFO("shard " << shard);
    REQUIRE_NOTHROW(BuildTrainingPipeline(o).Run(m));
    // One step on 4 replicas: every replica ends with the same weights (or shards of them).
    TensorMap vars0{{"w", Tensor::F32({4, 3}, Uniform(-1, 1)(12, *std::make_unique<std::mt19937>(3)))}};
    std::vector<TensorMap> vars(4);
    for (ValueId v : m.Variables()) {
      const Instr& in = m.at(v);
      for (int r = 0; r < 4; ++r)
        vars[r][in.name] = in.name == "w" ? vars0["w"] : Tensor(in.type);  // shards: zeros are fine for a smoke test
    }
    if (shard) continue;  // the sharded layout is the sharder's to test; it compiled and verified
    runtime::InProcessCollectives coll(4);
    runtime::RunReplicas(4, &coll, [&](int r) {
      TensorMap inputs{{"x", Tensor::F32({2, 4}, Uniform(-1, 1)(8, *std::make_unique<std::mt19937>(10 + r)))}};
      runtime::RunStep(m, vars[r], inputs, r, &coll);
    });
    for (int r = 1; r < 4; ++r) CHECK(vars[r].at("w").f32 == vars[0].at("w").f32);
    CHECK(vars[0].at("w").f32 != vars0.at("w").f32);
  }
}

// ---- Pass behaviour and errors ----

TEST_CASE("autodiff records a zero gradient for weights the loss ignores, and none for other roles",
          "[autodiff]") {
  Module m;
  Builder b(&m);
  ValueId w = b.Variable("w", {DType::kF32, {2}}, kRoleWeight);
  b.Variable("unused", {DType::kF32, {3}}, kRoleWeight);
  ValueId cut = b.Variable("cut", {DType::kF32, {2}}, kRoleWeight);  // reaches the loss only through s32
  ValueId state = b.Variable("m", {DType::kF32, {2}}, kRoleOptimizerState);
  ValueId through_int = b.Convert(b.Convert(cut, DType::kS32), DType::kF32);
  ValueId loss = b.SumAll(b.Add(b.Mul(w, state), through_int));
  m.outputs.push_back({"loss", loss});
  Autodiff ad;
  CHECK(ad.name() == "autodiff");
  REQUIRE(ad.Run(m));
  CHECK(m.gradients.size() == 3);
  for (const char* name : {"unused", "cut"}) {
    ValueId g = m.GradientOf(m.FindVariable(name));
    REQUIRE(g != kNoValue);
    CHECK(m.at(g).op == OpCode::kConstant);
    CHECK(m.at(g).GetFloat("value") == 0.0);
    CHECK(m.type(g) == m.type(m.FindVariable(name)));
  }
  CHECK(m.GradientOf(m.FindVariable("m")) == kNoValue);
  CHECK(m.GradientOf(m.FindVariable("w")) != kNoValue);

  TensorMap vars{{"w", Tensor::F32({2}, {1, 2})}, {"unused", Tensor::F32({3}, {0, 0, 0})},
                 {"cut", Tensor::F32({2}, {0.5f, 1.5f})}, {"m", Tensor::F32({2}, {3, -4})}};
  std::vector<Tensor> values = runtime::EvaluateAll(m, vars, {});
  CHECK(values[m.GradientOf(m.FindVariable("w"))].f32 == std::vector<float>{3, -4});
}

TEST_CASE("autodiff with a custom loss name; no weights means no change", "[autodiff]") {
  Module m;
  Builder b(&m);
  ValueId w = b.Variable("w", {DType::kF32, {}}, kRoleWeight);
  m.outputs.push_back({"objective", b.Mul(w, w)});
  REQUIRE(Autodiff("objective").Run(m));
  REQUIRE(m.gradients.size() == 1);
  std::vector<Tensor> values = runtime::EvaluateAll(m, {{"w", Tensor::Scalar(3)}}, {});
  CHECK(values[m.gradients[0].second].f32[0] == 6.0f);

  Module plain;
  Builder pb(&plain);
  ValueId x = pb.Input("x", {DType::kF32, {2}});
  plain.outputs.push_back({"loss", pb.SumAll(x)});
  Module before = plain;
  CHECK_FALSE(Autodiff().Run(plain));
  CHECK(plain == before);
}

TEST_CASE("autodiff errors", "[autodiff][error]") {
  auto module_with_loss = [](TensorType loss_type) {
    Module m;
    Builder b(&m);
    ValueId w = b.Variable("w", {DType::kF32, {2}}, kRoleWeight);
    ValueId v = loss_type.rank() == 0 ? b.SumAll(w) : w;
    if (loss_type.dtype == DType::kS32) v = b.Convert(v, DType::kS32);
    m.outputs.push_back({"loss", v});
    return m;
  };
  SECTION("no loss output") {
    Module m = module_with_loss({DType::kF32, {}});
    m.outputs[0].first = "metric";
    CHECK_THROWS_WITH(Autodiff().Run(m), Catch::Contains("no output named 'loss'"));
  }
  SECTION("loss is not a scalar") {
    Module m = module_with_loss({DType::kF32, {2}});
    CHECK_THROWS_WITH(Autodiff().Run(m), Catch::Contains("must be a scalar f32, got f32[2]"));
  }
  SECTION("loss is not f32") {
    Module m = module_with_loss({DType::kS32, {}});
    CHECK_THROWS_WITH(Autodiff().Run(m), Catch::Contains("must be a scalar f32, got s32[]"));
  }
  SECTION("autodiff twice") {
    Module m = module_with_loss({DType::kF32, {}});
    Autodiff().Run(m);
    CHECK_THROWS_WITH(Autodiff().Run(m), Catch::Contains("already has a gradient"));
  }
  SECTION("a collective other than all_reduce between a weight and the loss") {
    Module m;
    Builder b(&m);
    ValueId w = b.Variable("w", {DType::kF32, {2}}, kRoleWeight);
    ValueId r = b.Emit(OpCode::kReduceScatter, {w}, {{"reduction", std::string("sum")}, {"group_size", int64_t{1}}});
    m.outputs.push_back({"loss", b.SumAll(r)});
    CHECK_THROWS_WITH(Autodiff().Run(m), Catch::Contains("reduce_scatter") && Catch::Contains("inserted after autodiff"));
  }
  SECTION("all_reduce max has no gradient rule") {
    Module m;
    Builder b(&m);
    ValueId w = b.Variable("w", {DType::kF32, {2}}, kRoleWeight);
    m.outputs.push_back({"loss", b.SumAll(b.AllReduce(w, "max"))});
    CHECK_THROWS_WITH(Autodiff().Run(m), Catch::Contains("all_reduce {reduction=\"max\"}") &&
                                             Catch::Contains("no gradient rule"));
  }
}

}  // namespace
}  // namespace shardstep::ir
