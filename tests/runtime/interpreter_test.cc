// Tests for the reference interpreter (a hand-checked example for every op of the table, conv and
// pooling against naive loops and adjoint identities, collectives, errors) and for InitVariables.
#include "runtime/interpreter.h"

#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <ctime>
#include <functional>
#include <limits>

#include "ir/builder.h"
#include "ir/error.h"
#include "runtime/initializers.h"

namespace shardstep::runtime {
namespace {

using ir::Attrs;
using ir::Builder;
using ir::DType;
using ir::IntList;
using ir::IntLists;
using ir::Module;
using ir::OpCode;
using ir::Shape;
using ir::ValueId;

Tensor F(Shape shape, std::vector<float> data) { return Tensor::F32(std::move(shape), std::move(data)); }
Tensor S(Shape shape, std::vector<int32_t> data) { return Tensor::S32(std::move(shape), std::move(data)); }

// Evaluates op(args...) {attrs}, the arguments fed as inputs @a0, @a1, ...
Tensor Apply(OpCode op, const std::vector<Tensor>& args, Attrs attrs = {}, int num_replicas = 1, int replica = 0,
             Collectives* collectives = nullptr) {
  Module m;
  m.num_replicas = num_replicas;
  Builder b(&m);
  TensorMap inputs;
  std::vector<ValueId> operands;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string name = "a" + std::to_string(i);
    operands.push_back(b.Input(name, args[i].type));
    inputs[name] = args[i];
  }
  const ValueId out = b.Emit(op, operands, std::move(attrs));
  return EvaluateAll(m, {}, inputs, replica, collectives)[out];
}

// Bitwise equality, with readable output on failure.
void Expect(const Tensor& got, const Tensor& want) {
  INFO("got " << got.type.ToString() << ", want " << want.type.ToString());
  REQUIRE(got.type == want.type);
  CHECK(got.f32 == want.f32);
  CHECK(got.s32 == want.s32);
}

void ExpectClose(const Tensor& got, const Tensor& want, double eps = 1e-6) {
  REQUIRE(got.type == want.type);
  for (int64_t i = 0; i < got.elements(); ++i) {
    INFO("element " << i);
    CHECK(got.at(i) == Approx(want.at(i)).epsilon(eps).margin(eps));
  }
}

std::vector<float> Random(int64_t n, uint64_t seed) {
  Xoshiro256 rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(2 * rng.Uniform() - 1);
  return v;
}

double Dot(const Tensor& a, const Tensor& b) {
  REQUIRE(a.type == b.type);
  double s = 0;
  for (int64_t i = 0; i < a.elements(); ++i) s += double(a.f32[i]) * b.f32[i];
  return s;
}

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();
const int32_t kIntMin = std::numeric_limits<int32_t>::min(), kIntMax = std::numeric_limits<int32_t>::max();

// Leaves need more than Apply: a variable, a constant, the replica id.
Tensor EvalLeaf(std::function<ValueId(Builder&)> make, const TensorMap& variables = {}, int num_replicas = 1,
                int replica = 0) {
  Module m;
  m.num_replicas = num_replicas;
  Builder b(&m);
  const ValueId v = make(b);
  return EvaluateAll(m, variables, {}, replica)[v];
}

// One hand-checked example per op. The walk below fails when an op of ir/ops.def has no entry.
const std::map<OpCode, std::function<void()>>& Examples() {
  static const std::map<OpCode, std::function<void()>> examples = {
      {OpCode::kVariable,
       [] {
         Tensor w = F({2}, {1.5f, -2});
         Expect(EvalLeaf([](Builder& b) { return b.Variable("w", {DType::kF32, {2}}, ir::kRoleWeight); }, {{"w", w}}),
                w);
       }},
      {OpCode::kInput,
       [] {
         Module m;
         const ValueId x = Builder(&m).Input("x", {DType::kS32, {3}});
         Expect(EvaluateAll(m, {}, {{"x", S({3}, {1, 2, 3})}})[x], S({3}, {1, 2, 3}));
       }},
      {OpCode::kConstant,
       [] {
         Expect(EvalLeaf([](Builder& b) { return b.Constant(2.5, {DType::kF32, {2, 2}}); }), F({2, 2}, {2.5, 2.5, 2.5, 2.5}));
         Expect(EvalLeaf([](Builder& b) { return b.Constant(-3, {DType::kS32, {}}); }), S({}, {-3}));
       }},
      {OpCode::kReplicaId,
       [] { Expect(EvalLeaf([](Builder& b) { return b.ReplicaId(); }, {}, /*num_replicas=*/3, /*replica=*/2), S({}, {2})); }},
      {OpCode::kIota,
       [] {
         Expect(EvalLeaf([](Builder& b) { return b.Iota({DType::kS32, {2, 3}}, 1); }), S({2, 3}, {0, 1, 2, 0, 1, 2}));
         Expect(EvalLeaf([](Builder& b) { return b.Iota({DType::kF32, {2, 3}}, 0); }), F({2, 3}, {0, 0, 0, 1, 1, 1}));
       }},
      // Philox4x32-10 of counter 0 under key 0 is Random123's known answer 6627e8d5 ...: (x0 >> 8) * 2^-24.
      {OpCode::kRandomUniform,
       [] {
         Expect(Apply(OpCode::kRandomUniform, {S({}, {0}), S({}, {0})}, {{"seed", int64_t{0}}, {"shape", IntList{1}}}),
                F({1}, {static_cast<float>(0x6627e8d5u >> 8) / 16777216.0f}));
       }},

      {OpCode::kNeg,
       [] {
         Expect(Apply(OpCode::kNeg, {F({3}, {1, -2, 0})}), F({3}, {-1, 2, -0.0f}));
         Expect(Apply(OpCode::kNeg, {S({3}, {3, -4, kIntMin})}), S({3}, {-3, 4, kIntMin}));  // wraps
       }},
      {OpCode::kExp,
       [] {
         Expect(Apply(OpCode::kExp, {F({3}, {0, -kInf, kInf})}), F({3}, {1, 0, kInf}));
         ExpectClose(Apply(OpCode::kExp, {F({1}, {1})}), F({1}, {2.7182817f}));
       }},
      {OpCode::kLog,
       [] {
         Expect(Apply(OpCode::kLog, {F({2}, {1, 0})}), F({2}, {0, -kInf}));
         ExpectClose(Apply(OpCode::kLog, {F({1}, {2.7182817f})}), F({1}, {1}));
       }},
      {OpCode::kSqrt, [] { Expect(Apply(OpCode::kSqrt, {F({3}, {4, 0.25f, 0})}), F({3}, {2, 0.5f, 0})); }},
      {OpCode::kRsqrt, [] { Expect(Apply(OpCode::kRsqrt, {F({3}, {4, 0.25f, 0})}), F({3}, {0.5f, 2, kInf})); }},
      {OpCode::kTanh, [] { Expect(Apply(OpCode::kTanh, {F({3}, {0, 20, -20})}), F({3}, {0, 1, -1})); }},
      {OpCode::kSin,
       [] {
         Expect(Apply(OpCode::kSin, {F({1}, {0})}), F({1}, {0}));
         ExpectClose(Apply(OpCode::kSin, {F({2}, {1.5707964f, -0.5235988f})}), F({2}, {1, -0.5f}));
       }},
      {OpCode::kCos,
       [] {
         Expect(Apply(OpCode::kCos, {F({1}, {0})}), F({1}, {1}));
         ExpectClose(Apply(OpCode::kCos, {F({2}, {3.1415927f, 1.0471976f})}), F({2}, {-1, 0.5f}));
       }},
      {OpCode::kSigmoid, [] { Expect(Apply(OpCode::kSigmoid, {F({3}, {0, 100, -100})}), F({3}, {0.5f, 1, 0})); }},
      {OpCode::kRelu, [] { Expect(Apply(OpCode::kRelu, {F({4}, {-1, 0, 2, -0.0f})}), F({4}, {0, 0, 2, 0})); }},
      {OpCode::kAbs,
       [] {
         Expect(Apply(OpCode::kAbs, {F({3}, {-1.5f, 2, -0.0f})}), F({3}, {1.5f, 2, 0}));
         Expect(Apply(OpCode::kAbs, {S({2}, {-3, 4})}), S({2}, {3, 4}));
       }},
      {OpCode::kStopGradient,
       [] {
         Expect(Apply(OpCode::kStopGradient, {F({3}, {-1.5f, -0.0f, kInf})}), F({3}, {-1.5f, -0.0f, kInf}));
         Expect(Apply(OpCode::kStopGradient, {S({2}, {-3, kIntMax})}), S({2}, {-3, kIntMax}));
       }},
      {OpCode::kConvert,
       [] {
         Expect(Apply(OpCode::kConvert, {F({5}, {1.7f, -1.7f, 2, kNaN, 3e9f})}, {{"dtype", std::string("s32")}}),
                S({5}, {1, -1, 2, 0, kIntMax}));  // truncation toward zero, saturating
         Expect(Apply(OpCode::kConvert, {S({2}, {3, -2})}, {{"dtype", std::string("f32")}}), F({2}, {3, -2}));
       }},

      {OpCode::kAdd,
       [] {
         Expect(Apply(OpCode::kAdd, {F({2}, {1, 2}), F({2}, {3, 4.5f})}), F({2}, {4, 6.5f}));
         Expect(Apply(OpCode::kAdd, {S({2}, {kIntMax, 1}), S({2}, {1, 2})}), S({2}, {kIntMin, 3}));
       }},
      {OpCode::kSub,
       [] {
         Expect(Apply(OpCode::kSub, {F({2}, {5, 1}), F({2}, {2, 3})}), F({2}, {3, -2}));
         Expect(Apply(OpCode::kSub, {S({2}, {5, 1}), S({2}, {2, 3})}), S({2}, {3, -2}));
       }},
      {OpCode::kMul,
       [] {
         Expect(Apply(OpCode::kMul, {F({2}, {2, 3}), F({2}, {4, -0.5f})}), F({2}, {8, -1.5f}));
         Expect(Apply(OpCode::kMul, {S({2}, {2, 3}), S({2}, {4, -1})}), S({2}, {8, -3}));
       }},
      {OpCode::kDiv,
       [] {
         Expect(Apply(OpCode::kDiv, {F({3}, {1, 3, 1}), F({3}, {4, 2, 0})}), F({3}, {0.25f, 1.5f, kInf}));
         Expect(Apply(OpCode::kDiv, {S({3}, {7, -7, kIntMin}), S({3}, {2, 2, -1})}), S({3}, {3, -3, kIntMin}));
       }},
      {OpCode::kPow, [] { Expect(Apply(OpCode::kPow, {F({3}, {2, 9, 5}), F({3}, {3, 0.5f, 0})}), F({3}, {8, 3, 1})); }},
      {OpCode::kMax,
       [] {
         Tensor got = Apply(OpCode::kMax, {F({3}, {1, 5, kNaN}), F({3}, {2, 3, 0})});
         CHECK(got.f32[0] == 2);
         CHECK(got.f32[1] == 5);
         CHECK(std::isnan(got.f32[2]));  // NaN propagates
         Expect(Apply(OpCode::kMax, {S({2}, {1, 5}), S({2}, {2, 3})}), S({2}, {2, 5}));
       }},
      {OpCode::kMin,
       [] {
         Expect(Apply(OpCode::kMin, {F({2}, {1, 5}), F({2}, {2, 3})}), F({2}, {1, 3}));
         Expect(Apply(OpCode::kMin, {S({2}, {1, 5}), S({2}, {2, 3})}), S({2}, {1, 3}));
         CHECK(std::isnan(Apply(OpCode::kMin, {F({1}, {0}), F({1}, {kNaN})}).f32[0]));
       }},
      {OpCode::kEq, [] { Expect(Apply(OpCode::kEq, {F({3}, {1, 2, 3}), F({3}, {2, 2, 2})}), F({3}, {0, 1, 0})); }},
      {OpCode::kNe, [] { Expect(Apply(OpCode::kNe, {S({3}, {1, 2, 3}), S({3}, {2, 2, 2})}), S({3}, {1, 0, 1})); }},
      {OpCode::kLt, [] { Expect(Apply(OpCode::kLt, {F({3}, {1, 2, 3}), F({3}, {2, 2, 2})}), F({3}, {1, 0, 0})); }},
      {OpCode::kLe, [] { Expect(Apply(OpCode::kLe, {F({3}, {1, 2, 3}), F({3}, {2, 2, 2})}), F({3}, {1, 1, 0})); }},
      {OpCode::kGt, [] { Expect(Apply(OpCode::kGt, {S({3}, {1, 2, 3}), S({3}, {2, 2, 2})}), S({3}, {0, 0, 1})); }},
      {OpCode::kGe, [] { Expect(Apply(OpCode::kGe, {F({3}, {1, 2, 3}), F({3}, {2, 2, 2})}), F({3}, {0, 1, 1})); }},
      {OpCode::kSelect,
       [] {
         Expect(Apply(OpCode::kSelect, {S({3}, {1, 0, -2}), F({3}, {1, 2, 3}), F({3}, {10, 20, 30})}),
                F({3}, {1, 20, 3}));
         Expect(Apply(OpCode::kSelect, {F({2}, {0, 0.5f}), S({2}, {1, 2}), S({2}, {10, 20})}), S({2}, {10, 2}));
       }},

      {OpCode::kBroadcast,
       [] {
         Expect(Apply(OpCode::kBroadcast, {F({2}, {1, 2})}, {{"shape", IntList{2, 3}}, {"dims", IntList{0}}}),
                F({2, 3}, {1, 1, 1, 2, 2, 2}));
         Expect(Apply(OpCode::kBroadcast, {F({3}, {1, 2, 3})}, {{"shape", IntList{2, 3}}, {"dims", IntList{1}}}),
                F({2, 3}, {1, 2, 3, 1, 2, 3}));
         Expect(Apply(OpCode::kBroadcast, {S({}, {7})}, {{"shape", IntList{2}}, {"dims", IntList{}}}), S({2}, {7, 7}));
       }},
      {OpCode::kReshape,
       [] {
         Expect(Apply(OpCode::kReshape, {F({2, 3}, {1, 2, 3, 4, 5, 6})}, {{"shape", IntList{3, 2}}}),
                F({3, 2}, {1, 2, 3, 4, 5, 6}));
       }},
      {OpCode::kTranspose,
       [] {
         Expect(Apply(OpCode::kTranspose, {F({2, 3}, {1, 2, 3, 4, 5, 6})}, {{"perm", IntList{1, 0}}}),
                F({3, 2}, {1, 4, 2, 5, 3, 6}));
         // out[i,j,k] = in[j,k,i]: in [2,2,2] = 0..7, in index 4j + 2k + i.
         Expect(Apply(OpCode::kTranspose, {S({2, 2, 2}, {0, 1, 2, 3, 4, 5, 6, 7})}, {{"perm", IntList{2, 0, 1}}}),
                S({2, 2, 2}, {0, 2, 4, 6, 1, 3, 5, 7}));
       }},
      {OpCode::kSlice,
       [] {
         Expect(Apply(OpCode::kSlice, {F({3, 3}, {0, 1, 2, 3, 4, 5, 6, 7, 8})},
                      {{"start", IntList{1, 0}}, {"limit", IntList{3, 2}}}),
                F({2, 2}, {3, 4, 6, 7}));
       }},
      {OpCode::kPad,
       [] {
         Expect(Apply(OpCode::kPad, {F({2, 2}, {1, 2, 3, 4})}, {{"low", IntList{1, 0}}, {"high", IntList{0, 1}}}),
                F({3, 3}, {0, 0, 0, 1, 2, 0, 3, 4, 0}));
       }},
      {OpCode::kConcat,
       [] {
         Expect(Apply(OpCode::kConcat, {F({2, 1}, {1, 2}), F({2, 2}, {3, 4, 5, 6})}, {{"axis", int64_t{1}}}),
                F({2, 3}, {1, 3, 4, 2, 5, 6}));
         Expect(Apply(OpCode::kConcat, {S({1}, {1}), S({2}, {2, 3}), S({1}, {4})}, {{"axis", int64_t{0}}}),
                S({4}, {1, 2, 3, 4}));
       }},

      {OpCode::kReduceSum,
       [] {
         Tensor x = F({2, 3}, {1, 2, 3, 4, 5, 6});
         Expect(Apply(OpCode::kReduceSum, {x}, {{"axes", IntList{0}}}), F({3}, {5, 7, 9}));
         Expect(Apply(OpCode::kReduceSum, {x}, {{"axes", IntList{1}}}), F({2}, {6, 15}));
         Expect(Apply(OpCode::kReduceSum, {x}, {{"axes", IntList{0, 1}}}), F({}, {21}));
         Expect(Apply(OpCode::kReduceSum, {S({2, 2}, {1, 2, 3, 4})}, {{"axes", IntList{1}}}), S({2}, {3, 7}));
       }},
      {OpCode::kReduceMax,
       [] {
         Expect(Apply(OpCode::kReduceMax, {F({2, 3}, {-1, -5, -3, 4, 6, 5})}, {{"axes", IntList{1}}}), F({2}, {-1, 6}));
         Expect(Apply(OpCode::kReduceMax, {S({2, 2}, {1, 7, 3, 4})}, {{"axes", IntList{0}}}), S({2}, {3, 7}));
       }},
      {OpCode::kReduceMean,
       [] {
         Expect(Apply(OpCode::kReduceMean, {F({2, 3}, {1, 2, 3, 4, 5, 6})}, {{"axes", IntList{0, 1}}}), F({}, {3.5f}));
         Expect(Apply(OpCode::kReduceMean, {F({2, 2}, {1, 2, 4, 8})}, {{"axes", IntList{0}}}), F({2}, {2.5f, 5}));
       }},

      {OpCode::kMatmul,
       [] {
         Tensor a = F({2, 3}, {1, 2, 3, 4, 5, 6}), b = F({3, 2}, {1, 0, 0, 1, 1, 1});
         Expect(Apply(OpCode::kMatmul, {a, b}), F({2, 2}, {4, 5, 10, 11}));
         Expect(Apply(OpCode::kMatmul, {a, a}, {{"transpose_b", int64_t{1}}}), F({2, 2}, {14, 32, 32, 77}));
         Expect(Apply(OpCode::kMatmul, {a, a}, {{"transpose_a", int64_t{1}}}),
                F({3, 3}, {17, 22, 27, 22, 29, 36, 27, 36, 45}));
         // Batched: [2] x ([1,2] x [2,1]); the transposes act on the last two dims.
         Tensor x = F({2, 1, 2}, {1, 2, 3, 4}), y = F({2, 2, 1}, {5, 6, 7, 8});
         Expect(Apply(OpCode::kMatmul, {x, y}), F({2, 1, 1}, {17, 53}));
         Expect(Apply(OpCode::kMatmul, {x, y}, {{"transpose_a", int64_t{1}}, {"transpose_b", int64_t{1}}}),
                F({2, 2, 2}, {5, 6, 10, 12, 21, 24, 28, 32}));
       }},
      // x = [[1,2,3],[4,5,6],[7,8,9]], w = [[1,0],[0,1]]: y[i,j] = x[i,j] + x[i+1,j+1].
      {OpCode::kConv2d,
       [] {
         Expect(Apply(OpCode::kConv2d, {F({1, 1, 3, 3}, {1, 2, 3, 4, 5, 6, 7, 8, 9}), F({1, 1, 2, 2}, {1, 0, 0, 1})}),
                F({1, 1, 2, 2}, {6, 8, 12, 14}));
         // padding 1, stride 2 on the same x: windows start at (-1,-1), (-1,1), (1,-1), (1,1).
         Expect(Apply(OpCode::kConv2d, {F({1, 1, 3, 3}, {1, 2, 3, 4, 5, 6, 7, 8, 9}), F({1, 1, 2, 2}, {1, 0, 0, 1})},
                      {{"stride", IntList{2, 2}}, {"padding", IntList{1, 1}}}),
                F({1, 1, 2, 2}, {1, 3, 7, 14}));
       }},
      {OpCode::kConv2dInputGrad,
       [] {
         Expect(Apply(OpCode::kConv2dInputGrad, {F({1, 1, 2, 2}, {1, 1, 1, 1}), F({1, 1, 2, 2}, {1, 0, 0, 1})},
                      {{"input_shape", IntList{1, 1, 3, 3}}}),
                F({1, 1, 3, 3}, {1, 1, 0, 1, 2, 1, 0, 1, 1}));
       }},
      {OpCode::kConv2dFilterGrad,
       [] {
         Expect(Apply(OpCode::kConv2dFilterGrad,
                      {F({1, 1, 3, 3}, {1, 2, 3, 4, 5, 6, 7, 8, 9}), F({1, 1, 2, 2}, {1, 1, 1, 1})},
                      {{"filter_shape", IntList{1, 1, 2, 2}}}),
                F({1, 1, 2, 2}, {12, 16, 24, 28}));
       }},
      {OpCode::kMaxPool,
       [] {
         Tensor x = F({1, 1, 4, 4}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});
         Expect(Apply(OpCode::kMaxPool, {x}, {{"window", IntList{2, 2}}}), F({1, 1, 2, 2}, {5, 7, 13, 15}));
         // padding 1: each window holds one real cell; the padded cells never win, even over negatives.
         Expect(Apply(OpCode::kMaxPool, {F({1, 1, 2, 2}, {-1, -2, -3, -4})}, {{"window", IntList{2, 2}}, {"padding", int64_t{1}}}),
                F({1, 1, 2, 2}, {-1, -2, -3, -4}));
       }},
      // Overlapping windows [1,3;0,3] and [3,2;3,1]: both pick the first 3, which gets 10 + 20.
      {OpCode::kMaxPoolGrad,
       [] {
         Expect(Apply(OpCode::kMaxPoolGrad, {F({1, 1, 2, 3}, {1, 3, 2, 0, 3, 1}), F({1, 1, 1, 2}, {10, 20})},
                      {{"window", IntList{2, 2}}, {"stride", IntList{1, 1}}}),
                F({1, 1, 2, 3}, {0, 30, 0, 0, 0, 0}));
         Expect(Apply(OpCode::kMaxPoolGrad, {F({1, 1, 2, 2}, {-1, -2, -3, -4}), F({1, 1, 2, 2}, {10, 20, 30, 40})},
                      {{"window", IntList{2, 2}}, {"padding", int64_t{1}}}),
                F({1, 1, 2, 2}, {10, 20, 30, 40}));
       }},
      {OpCode::kAvgPool,
       [] {
         Tensor x = F({1, 1, 4, 4}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});
         Expect(Apply(OpCode::kAvgPool, {x}, {{"window", IntList{2, 2}}}), F({1, 1, 2, 2}, {2.5f, 4.5f, 10.5f, 12.5f}));
       }},
      {OpCode::kAvgPoolGrad,
       [] {
         Expect(Apply(OpCode::kAvgPoolGrad, {F({1, 1, 1, 2}, {4, 8})},
                      {{"window", IntList{2, 2}}, {"stride", IntList{1, 1}}, {"input_shape", IntList{1, 1, 2, 3}}}),
                F({1, 1, 2, 3}, {1, 3, 2, 1, 3, 2}));
       }},

      // q = k = [[1], [0]], v = [[2], [4]], causal, scale 1: query 0 sees key 0 only (p = [1, 0]); query 1
      // scores 0 and 0 (p = [1/2, 1/2]). out = [2, 3]. With dout = [1, 1]: dv = p^T dout = [1.5, 0.5];
      // dp = dout v^T = [[2, 4], [2, 4]], rowsums of dp p: 2 and 3, ds = p (dp - rowsum) = [[0, 0],
      // [-0.5, 0.5]]; dq = ds k = [0, -0.5], dk = ds^T q = [0, 0].
      {OpCode::kAttention,
       [] {
         const Tensor q = F({1, 2, 1}, {1, 0}), v = F({1, 2, 1}, {2, 4});
         Expect(Apply(OpCode::kAttention, {q, q, v}, {{"scale", 1.0}, {"causal", int64_t{1}}}), F({1, 2, 1}, {2, 3}));
       }},
      {OpCode::kAttentionGrad,
       [] {
         const Tensor q = F({1, 2, 1}, {1, 0}), v = F({1, 2, 1}, {2, 4}), dout = F({1, 2, 1}, {1, 1});
         Expect(Apply(OpCode::kAttentionGrad, {q, q, v, dout}, {{"scale", 1.0}, {"causal", int64_t{1}}}),
                F({3, 1, 2, 1}, {0, -0.5f, 0, 0, 1.5f, 0.5f}));
       }},

      {OpCode::kOneHot,
       [] {
         Expect(Apply(OpCode::kOneHot, {S({2}, {2, 0})}, {{"depth", int64_t{3}}}), F({2, 3}, {0, 0, 1, 1, 0, 0}));
       }},
      {OpCode::kGather,
       [] {
         Expect(Apply(OpCode::kGather, {F({3, 2}, {1, 2, 3, 4, 5, 6}), S({3}, {2, 0, 2})}),
                F({3, 2}, {5, 6, 1, 2, 5, 6}));
         Expect(Apply(OpCode::kGather, {S({3}, {7, 8, 9}), S({2, 2}, {1, 1, 0, 2})}), S({2, 2}, {8, 8, 7, 9}));
       }},
      {OpCode::kScatterAdd,
       [] {
         Expect(Apply(OpCode::kScatterAdd, {S({3}, {2, 0, 2}), F({3, 2}, {1, 1, 2, 2, 3, 3})}, {{"rows", int64_t{4}}}),
                F({4, 2}, {2, 2, 0, 0, 4, 4, 0, 0}));
       }},

      // Without a Collectives, a single replica is a group of one.
      {OpCode::kAllReduce,
       [] {
         for (const char* r : {"sum", "mean", "max"})
           Expect(Apply(OpCode::kAllReduce, {F({2}, {1, -2})}, {{"reduction", std::string(r)}}), F({2}, {1, -2}));
       }},
      {OpCode::kReduceScatter,
       [] {
         Expect(Apply(OpCode::kReduceScatter, {F({2, 1}, {1, 2})},
                      {{"reduction", std::string("sum")}, {"group_size", int64_t{1}}}),
                F({2, 1}, {1, 2}));
       }},
      {OpCode::kAllGather,
       [] {
         Expect(Apply(OpCode::kAllGather, {F({2}, {1, 2})}, {{"group_size", int64_t{1}}}), F({2}, {1, 2}));
       }},
      // One replica: sending to itself keeps the operand; with no pair it receives zeros.
      {OpCode::kCollectivePermute,
       [] {
         Expect(Apply(OpCode::kCollectivePermute, {F({2}, {1, -2})}, {{"pairs", IntLists{{0, 0}}}}), F({2}, {1, -2}));
         Expect(Apply(OpCode::kCollectivePermute, {F({2}, {1, -2})}, {{"pairs", IntList{}}}), F({2}, {0, 0}));
       }},
  };
  return examples;
}

TEST_CASE("every op of the table has a hand-checked example", "[interpreter]") {
  const auto& examples = Examples();
  for (int i = 0; i < ir::kNumOpCodes; ++i) {
    const OpCode op = static_cast<OpCode>(i);
    INFO("op " << ir::OpName(op) << " has no example in interpreter_test.cc");
    CHECK(examples.count(op) == 1);
  }
  for (const auto& [op, example] : examples) {
    DYNAMIC_SECTION(ir::OpName(op)) { example(); }
  }
}

// ---- Convolution ----

// y[n,o,i,j] = sum_{c,a,b} w[o,c,a,b] * x[n, c, i*sh - ph + a, j*sw - pw + b]  (zero outside x)
Tensor NaiveConv(const Tensor& x, const Tensor& w, IntList s, IntList p) {
  const Shape &xs = x.shape(), &ws = w.shape();
  const int64_t oh = (xs[2] + 2 * p[0] - ws[2]) / s[0] + 1, ow = (xs[3] + 2 * p[1] - ws[3]) / s[1] + 1;
  Tensor y({DType::kF32, {xs[0], ws[0], oh, ow}});
  for (int64_t n = 0; n < xs[0]; ++n)
    for (int64_t o = 0; o < ws[0]; ++o)
      for (int64_t i = 0; i < oh; ++i)
        for (int64_t j = 0; j < ow; ++j) {
          double acc = 0;
          for (int64_t c = 0; c < xs[1]; ++c)
            for (int64_t a = 0; a < ws[2]; ++a)
              for (int64_t b = 0; b < ws[3]; ++b) {
                const int64_t yy = i * s[0] - p[0] + a, xx = j * s[1] - p[1] + b;
                if (yy < 0 || yy >= xs[2] || xx < 0 || xx >= xs[3]) continue;
                acc += double(w.f32[((o * xs[1] + c) * ws[2] + a) * ws[3] + b]) *
                       x.f32[((n * xs[1] + c) * xs[2] + yy) * xs[3] + xx];
              }
          y.f32[((n * ws[0] + o) * oh + i) * ow + j] = static_cast<float>(acc);
        }
  return y;
}

TEST_CASE("conv2d matches a direct loop (stride 2, padding 1)", "[interpreter]") {
  for (IntList s : {IntList{2, 2}, IntList{2, 1}, IntList{1, 1}}) {
    for (IntList p : {IntList{1, 1}, IntList{0, 1}}) {
      Tensor x = F({2, 3, 7, 6}, Random(2 * 3 * 7 * 6, 1)), w = F({4, 3, 3, 3}, Random(4 * 3 * 3 * 3, 2));
      INFO("stride " << s[0] << "," << s[1] << " padding " << p[0] << "," << p[1]);
      ExpectClose(Apply(OpCode::kConv2d, {x, w}, {{"stride", s}, {"padding", p}}), NaiveConv(x, w, s, p), 1e-5);
    }
  }
}

TEST_CASE("conv2d gradients are the adjoints of conv2d", "[interpreter]") {
  // <conv(x, w), dy> = <x, input_grad(dy, w)> = <w, filter_grad(x, dy)>
  const IntList stride{2, 2}, padding{1, 1};
  Tensor x = F({11, 2, 9, 8}, Random(11 * 2 * 9 * 8, 3)), w = F({5, 2, 3, 3}, Random(5 * 2 * 3 * 3, 4));
  Tensor y = Apply(OpCode::kConv2d, {x, w}, {{"stride", stride}, {"padding", padding}});
  Tensor dy = F(y.shape(), Random(y.elements(), 5));
  Tensor dx = Apply(OpCode::kConv2dInputGrad, {dy, w},
                    {{"stride", stride}, {"padding", padding}, {"input_shape", IntList(x.shape())}});
  Tensor dw = Apply(OpCode::kConv2dFilterGrad, {x, dy},
                    {{"stride", stride}, {"padding", padding}, {"filter_shape", IntList(w.shape())}});
  const double forward = Dot(y, dy);
  CHECK(Dot(x, dx) == Approx(forward).epsilon(1e-5));
  CHECK(Dot(w, dw) == Approx(forward).epsilon(1e-5));
}

TEST_CASE("matmul matches a direct loop, for every transpose", "[interpreter]") {
  const int64_t m = 300, k = 200, n = 150;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      Tensor a = F(ta ? Shape{k, m} : Shape{m, k}, Random(m * k, 11)), b = F(tb ? Shape{n, k} : Shape{k, n}, Random(k * n, 12));
      Tensor want({DType::kF32, {m, n}});
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double s = 0;
          for (int64_t l = 0; l < k; ++l)
            s += double(ta ? a.f32[l * m + i] : a.f32[i * k + l]) * (tb ? b.f32[j * k + l] : b.f32[l * n + j]);
          want.f32[i * n + j] = static_cast<float>(s);
        }
      INFO("transpose_a " << ta << " transpose_b " << tb);
      ExpectClose(Apply(OpCode::kMatmul, {a, b}, {{"transpose_a", int64_t{ta}}, {"transpose_b", int64_t{tb}}}), want, 1e-5);
    }
}

TEST_CASE("matmul and convolutions sum their products in double and round once", "[interpreter]") {
  // 1e8 + 1 - 1e8: summed in float the 1 is lost (1e8 + 1 rounds to 1e8); in double it survives.
  const std::vector<float> big{1e8f, 1, -1e8f}, ones{1, 1, 1};
  Expect(Apply(OpCode::kMatmul, {F({1, 3}, big), F({3, 1}, ones)}), F({1, 1}, {1}));
  Expect(Apply(OpCode::kConv2d, {F({1, 3, 1, 1}, big), F({1, 3, 1, 1}, ones)}), F({1, 1, 1, 1}, {1}));
  Expect(Apply(OpCode::kConv2dInputGrad, {F({1, 3, 1, 1}, ones), F({3, 1, 1, 1}, big)},
               {{"input_shape", IntList{1, 1, 1, 1}}}),
         F({1, 1, 1, 1}, {1}));
  Expect(Apply(OpCode::kConv2dFilterGrad, {F({3, 1, 1, 1}, big), F({3, 1, 1, 1}, ones)},
               {{"filter_shape", IntList{1, 1, 1, 1}}}),
         F({1, 1, 1, 1}, {1}));
}

// ---- Pooling ----

TEST_CASE("pooling gradients satisfy the adjoint identities (overlapping windows)", "[interpreter]") {
  // max_pool(x)[o] = x[argmax o], so <max_pool(x), dy> = <x, max_pool_grad(x, dy)> exactly in exact
  // arithmetic; avg_pool is linear, so <avg_pool(x), dy> = <x, avg_pool_grad(dy)>.
  const Attrs window{{"window", IntList{3, 3}}, {"stride", IntList{2, 2}}};
  Tensor x = F({2, 3, 7, 9}, Random(2 * 3 * 7 * 9, 6));
  Tensor mp = Apply(OpCode::kMaxPool, {x}, window);
  REQUIRE(mp.shape() == Shape{2, 3, 3, 4});
  Tensor dy = F(mp.shape(), Random(mp.elements(), 7));
  CHECK(Dot(x, Apply(OpCode::kMaxPoolGrad, {x, dy}, window)) == Approx(Dot(mp, dy)).epsilon(1e-6));

  Attrs avg_grad = window;
  avg_grad["input_shape"] = IntList(x.shape());
  Tensor ap = Apply(OpCode::kAvgPool, {x}, window);
  CHECK(Dot(x, Apply(OpCode::kAvgPoolGrad, {dy}, avg_grad)) == Approx(Dot(ap, dy)).epsilon(1e-5));
}

// ---- Data movement and reductions on larger shapes ----

TEST_CASE("rank-3 transpose, broadcast and reductions match index loops", "[interpreter]") {
  const int64_t A = 3, B = 4, C = 5;
  Tensor x = F({A, B, C}, Random(A * B * C, 8));
  auto at = [&](int64_t a, int64_t b, int64_t c) { return x.f32[(a * B + b) * C + c]; };

  Tensor t = Apply(OpCode::kTranspose, {x}, {{"perm", IntList{1, 2, 0}}});  // out[b,c,a] = x[a,b,c]
  Tensor sum = Apply(OpCode::kReduceSum, {x}, {{"axes", IntList{0, 2}}});
  Tensor mx = Apply(OpCode::kReduceMax, {x}, {{"axes", IntList{1}}});
  Tensor bc = Apply(OpCode::kBroadcast, {F({B}, std::vector<float>(x.f32.begin(), x.f32.begin() + B))},
                    {{"shape", IntList{A, B, C}}, {"dims", IntList{1}}});
  for (int64_t b = 0; b < B; ++b) {
    double s = 0;
    for (int64_t a = 0; a < A; ++a)
      for (int64_t c = 0; c < C; ++c) {
        s += at(a, b, c);
        CHECK(t.f32[(b * C + c) * A + a] == at(a, b, c));
        CHECK(bc.f32[(a * B + b) * C + c] == x.f32[b]);
      }
    CHECK(sum.f32[b] == static_cast<float>(s));
  }
  for (int64_t a = 0; a < A; ++a)
    for (int64_t c = 0; c < C; ++c) {
      float m = at(a, 0, c);
      for (int64_t b = 1; b < B; ++b) m = std::max(m, at(a, b, c));
      CHECK(mx.f32[a * C + c] == m);
    }
}

TEST_CASE("large kernels are bitwise deterministic", "[interpreter]") {
  Tensor x = F({16, 8, 30, 30}, Random(16 * 8 * 30 * 30, 9)), w = F({16, 8, 3, 3}, Random(16 * 8 * 9, 10));
  const Attrs conv{{"padding", IntList{1, 1}}}, input_grad{{"padding", IntList{1, 1}}, {"input_shape", IntList{16, 8, 30, 30}}};
  auto run = [&] {
    Tensor c = Apply(OpCode::kConv2d, {x, w}, conv);
    Attrs filter_grad = conv;
    filter_grad["filter_shape"] = IntList{16, 8, 3, 3};
    return std::vector<Tensor>{c, Apply(OpCode::kConv2dInputGrad, {c, w}, input_grad),
                               Apply(OpCode::kConv2dFilterGrad, {x, c}, filter_grad),
                               Apply(OpCode::kReduceSum, {x}, {{"axes", IntList{0, 2, 3}}}), Apply(OpCode::kExp, {x})};
  };
  const std::vector<Tensor> first = run(), second = run();
  for (size_t i = 0; i < first.size(); ++i) CHECK(first[i] == second[i]);
}

// ---- Collectives ----

// A fake where every other member of a group holds the same data as the caller: sum = |group| * x,
// mean = max = x, and a gather repeats the input. It records the calls it sees.
class MirrorCollectives : public Collectives {
 public:
  explicit MirrorCollectives(int n) : n_(n) {}
  int num_replicas() const override { return n_; }
  void AllReduce(int replica, const ReplicaGroup& group, float* data, int64_t n, Reduction op) override {
    Record("all_reduce", replica, group);
    for (int64_t i = 0; i < n; ++i) data[i] = Reduce(data[i], group.size(), op);
  }
  void ReduceScatter(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n,
                     Reduction op) override {
    Record("reduce_scatter", replica, group);
    const int64_t pos = std::find(group.begin(), group.end(), replica) - group.begin();
    for (int64_t i = 0; i < n; ++i) out[i] = Reduce(in[pos * n + i], group.size(), op);
  }
  void AllGather(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n) override {
    Record("all_gather", replica, group);
    for (size_t p = 0; p < group.size(); ++p) std::copy_n(in, n, out + p * n);
  }
  void Broadcast(int, const ReplicaGroup&, float*, int64_t, int) override {}
  void Barrier(int, const ReplicaGroup&) override {}
  void Abort(const std::string&) override {}

  std::vector<std::string> calls;

 private:
  static float Reduce(float x, size_t g, Reduction op) { return op == Reduction::kSum ? x * g : x; }
  void Record(const char* what, int replica, const ReplicaGroup& group) {
    std::string s = std::string(what) + " r" + std::to_string(replica) + " {";
    for (int64_t r : group) s += std::to_string(r) + ",";
    calls.push_back(s + "}");
  }
  int n_;
};

TEST_CASE("collectives call the Collectives interface with the replica's group", "[interpreter]") {
  SECTION("a fake single-replica group") {
    MirrorCollectives one(1);
    Expect(Apply(OpCode::kAllReduce, {F({2}, {1, 2})}, {{"reduction", std::string("sum")}}, 1, 0, &one), F({2}, {1, 2}));
    Expect(Apply(OpCode::kAllGather, {F({1}, {3})}, {{"group_size", int64_t{1}}}, 1, 0, &one), F({1}, {3}));
    Expect(Apply(OpCode::kReduceScatter, {F({1}, {4})}, {{"group_size", int64_t{1}}}, 1, 0, &one), F({1}, {4}));
    CHECK(one.calls == std::vector<std::string>{"all_reduce r0 {0,}", "all_gather r0 {0,}", "reduce_scatter r0 {0,}"});
  }
  SECTION("replica 3 of 4 in groups {0,2} {1,3}") {
    MirrorCollectives four(4);
    const IntLists groups{{0, 2}, {1, 3}};
    Expect(Apply(OpCode::kAllReduce, {F({2}, {1, 2})}, {{"groups", groups}}, 4, 3, &four), F({2}, {2, 4}));
    Expect(Apply(OpCode::kReduceScatter, {F({4, 1}, {1, 2, 3, 4})},
                 {{"reduction", std::string("sum")}, {"group_size", int64_t{2}}, {"groups", groups}}, 4, 3, &four),
           F({2, 1}, {6, 8}));  // group position 1 gets the second half
    Expect(Apply(OpCode::kAllGather, {F({1, 2}, {5, 6})}, {{"group_size", int64_t{2}}, {"groups", groups}}, 4, 3, &four),
           F({2, 2}, {5, 6, 5, 6}));
    CHECK(four.calls == std::vector<std::string>{"all_reduce r3 {1,3,}", "reduce_scatter r3 {1,3,}", "all_gather r3 {1,3,}"});
  }
  SECTION("a multi-replica group without a Collectives is an error") {
    CHECK_THROWS_WITH(Apply(OpCode::kAllReduce, {F({2}, {1, 2})}, {}, 2, 1),
                      Catch::Contains("a group of 2 replicas needs a Collectives implementation"));
  }
}

// ---- Errors and RunStep ----

TEST_CASE("missing or mistyped inputs and variables are user errors naming them", "[interpreter]") {
  Module m;
  Builder b(&m);
  const ValueId image = b.Input("image", {DType::kF32, {64, 784}});
  const ValueId w = b.Variable("w", {DType::kF32, {784}}, ir::kRoleWeight);
  b.Mul(image, b.Broadcast(w, {64, 784}, {1}));
  const TensorMap vars{{"w", Tensor({DType::kF32, {784}})}};
  CHECK_THROWS_WITH(EvaluateAll(m, vars, {}), "input @image: missing (expected f32[64,784])");
  CHECK_THROWS_WITH(EvaluateAll(m, vars, {{"image", Tensor({DType::kF32, {32, 784}})}}),
                    "input @image: expected f32[64,784], got f32[32,784]");
  CHECK_THROWS_WITH(EvaluateAll(m, vars, {{"image", Tensor({DType::kS32, {64, 784}})}}),
                    "input @image: expected f32[64,784], got s32[64,784]");
  CHECK_THROWS_WITH(EvaluateAll(m, {}, {{"image", Tensor({DType::kF32, {64, 784}})}}),
                    "variable @w: missing (expected f32[784])");
  CHECK_THROWS_AS(EvaluateAll(m, vars, {{"image", Tensor({DType::kF32, {64, 784}})}}, /*replica=*/1), Error);
}

TEST_CASE("bad data is a user error naming the value", "[interpreter]") {
  CHECK_THROWS_WITH(Apply(OpCode::kOneHot, {S({2}, {3, 12})}, {{"depth", int64_t{10}}}),
                    "%1 = one_hot: label 12 out of range [0,10)");
  CHECK_THROWS_WITH(Apply(OpCode::kOneHot, {S({1}, {-1})}, {{"depth", int64_t{10}}}),
                    Catch::Contains("label -1 out of range [0,10)"));
  CHECK_THROWS_WITH(Apply(OpCode::kGather, {F({3, 2}, {1, 2, 3, 4, 5, 6}), S({1}, {3})}),
                    Catch::Contains("gather index 3 out of range [0,3)"));
  CHECK_THROWS_WITH(Apply(OpCode::kScatterAdd, {S({1}, {-1}), F({1}, {1})}, {{"rows", int64_t{2}}}),
                    Catch::Contains("scatter_add index -1 out of range [0,2)"));
  CHECK_THROWS_WITH(Apply(OpCode::kDiv, {S({2}, {1, 2}), S({2}, {1, 0})}), Catch::Contains("s32 division by zero"));
  CHECK_THROWS_WITH(Apply(OpCode::kMaxPool, {S({1, 1, 2, 2}, {1, 2, 3, 4})}, {{"window", IntList{2, 2}}}),
                    Catch::Contains("operands must be f32, got s32[1,1,2,2]"));
}

TEST_CASE("RunStep returns outputs and writes assigned variables", "[interpreter]") {
  Module m;
  Builder b(&m);
  const ValueId w = b.Variable("w", {DType::kF32, {2}}, ir::kRoleWeight);
  const ValueId step = b.Variable("step", {DType::kS32, {}}, ir::kRoleStep);
  const ValueId x = b.Input("x", {DType::kF32, {2}});
  const ValueId loss = b.SumAll(b.Mul(w, x));
  m.assigns.push_back({w, b.Sub(w, b.MulScalar(x, 0.5))});
  m.assigns.push_back({step, b.AddScalar(step, 1)});
  m.outputs.push_back({"loss", loss});

  TensorMap vars{{"w", F({2}, {1, 2})}, {"step", S({}, {0})}, {"unrelated", F({1}, {9})}};
  const TensorMap inputs{{"x", F({2}, {2, 4})}};
  TensorMap out = RunStep(m, vars, inputs);
  Expect(out.at("loss"), F({}, {10}));
  Expect(vars.at("w"), F({2}, {0, 0}));
  Expect(vars.at("step"), S({}, {1}));
  Expect(vars.at("unrelated"), F({1}, {9}));
  out = RunStep(m, vars, inputs);
  Expect(out.at("loss"), F({}, {0}));
  Expect(vars.at("w"), F({2}, {-1, -2}));
  Expect(vars.at("step"), S({}, {2}));
}

// ---- InitVariables ----

struct Stats {
  double mean = 0, stddev = 0, min = 1e300, max = -1e300;
};
Stats StatsOf(const Tensor& t) {
  Stats s;
  for (float v : t.f32) s.mean += v, s.min = std::min<double>(s.min, v), s.max = std::max<double>(s.max, v);
  s.mean /= t.elements();
  for (float v : t.f32) s.stddev += (v - s.mean) * (v - s.mean);
  s.stddev = std::sqrt(s.stddev / t.elements());
  return s;
}

Module InitModule(const std::vector<std::pair<std::string, Attrs>>& vars, Shape shape = {200, 300}) {
  Module m;
  Builder b(&m);
  for (const auto& [name, attrs] : vars) b.Variable(name, {DType::kF32, shape}, ir::kRoleWeight, attrs);
  return m;
}

TEST_CASE("InitVariables: constants and the default", "[initializers]") {
  Module m;
  Builder b(&m);
  b.Variable("z", {DType::kF32, {2}}, ir::kRoleWeight);
  b.Variable("one", {DType::kF32, {2}}, ir::kRoleWeight, {{"init", std::string("ones")}});
  b.Variable("c", {DType::kF32, {2}}, ir::kRoleWeight, {{"init", std::string("constant")}, {"value", 0.25}});
  b.Variable("step", {DType::kS32, {}}, ir::kRoleStep, {{"init", std::string("zeros")}});
  TensorMap v = InitVariables(m);
  REQUIRE(v.size() == 4);
  Expect(v.at("z"), F({2}, {0, 0}));
  Expect(v.at("one"), F({2}, {1, 1}));
  Expect(v.at("c"), F({2}, {0.25f, 0.25f}));
  Expect(v.at("step"), S({}, {0}));
}

TEST_CASE("InitVariables: random inits are deterministic and order-independent", "[initializers]") {
  const Attrs a{{"init", std::string("he_normal")}, {"fan_in", int64_t{300}}, {"seed", int64_t{7}}};
  const Attrs b{{"init", std::string("glorot_uniform")}, {"fan_in", int64_t{300}}, {"fan_out", int64_t{200}},
                {"seed", int64_t{7}}};
  TensorMap one = InitVariables(InitModule({{"a", a}, {"b", b}}));
  TensorMap two = InitVariables(InitModule({{"b", b}, {"a", a}}));
  CHECK(one.at("a") == two.at("a"));
  CHECK(one.at("b") == two.at("b"));
  CHECK(InitVariables(InitModule({{"a", a}})).at("a") == one.at("a"));

  Attrs other_seed = a;
  other_seed["seed"] = int64_t{8};
  CHECK_FALSE(InitVariables(InitModule({{"a", other_seed}})).at("a") == one.at("a"));
  // Same attributes, different names: different streams (no two layers start identical).
  CHECK_FALSE(InitVariables(InitModule({{"c", a}})).at("c").f32 == one.at("a").f32);
  // Pinned against the reference splitmix64 / xoshiro256** (computed independently in Python).
  Xoshiro256 rng(42);
  CHECK(rng.Next() == 0x15780b2e0c2ec716ull);
  CHECK(rng.Next() == 0x6104d9866d113a7eull);
  CHECK(rng.Next() == 0xae17533239e499a1ull);
}

TEST_CASE("InitVariables: random inits have the right statistics", "[initializers]") {
  // 60000 samples: the sample stddev is within ~0.6% of the true one with overwhelming probability.
  auto init = [](Attrs attrs) {
    attrs["seed"] = int64_t{1};
    return StatsOf(InitVariables(InitModule({{"w", attrs}})).at("w"));
  };
  const double glorot = std::sqrt(6.0 / (300 + 200));
  Stats g = init({{"init", std::string("glorot_uniform")}, {"fan_in", int64_t{300}}, {"fan_out", int64_t{200}}});
  CHECK(std::abs(g.mean) < 0.01 * glorot);
  CHECK(g.stddev == Approx(glorot / std::sqrt(3.0)).epsilon(0.02));
  CHECK(g.max <= glorot);
  CHECK(g.min >= -glorot);
  CHECK(g.max > 0.99 * glorot);

  Stats hn = init({{"init", std::string("he_normal")}, {"fan_in", int64_t{50}}});
  CHECK(std::abs(hn.mean) < 0.01 * std::sqrt(2.0 / 50));
  CHECK(hn.stddev == Approx(std::sqrt(2.0 / 50)).epsilon(0.02));
  CHECK(hn.max > 3 * hn.stddev);  // tails exist: not a uniform in disguise

  const double he_u = std::sqrt(6.0 / 50);
  Stats hu = init({{"init", std::string("he_uniform")}, {"fan_in", int64_t{50}}});
  CHECK(hu.stddev == Approx(he_u / std::sqrt(3.0)).epsilon(0.02));
  CHECK(hu.max <= he_u);
  CHECK(hu.min >= -he_u);

  Stats n = init({{"init", std::string("normal")}, {"stddev", 0.05}});
  CHECK(std::abs(n.mean) < 0.001);
  CHECK(n.stddev == Approx(0.05).epsilon(0.02));

  Stats u = init({{"init", std::string("uniform")}, {"limit", 0.1}});
  CHECK(u.stddev == Approx(0.1 / std::sqrt(3.0)).epsilon(0.02));
  CHECK(u.max <= 0.1);
  CHECK(u.min >= -0.1);
}

TEST_CASE("InitVariables: bad attributes name the variable", "[initializers]") {
  CHECK_THROWS_WITH(InitVariables(InitModule({{"fc1.w", {{"init", std::string("xavier")}}}})),
                    Catch::StartsWith("variable @fc1.w: unknown init 'xavier'"));
  CHECK_THROWS_WITH(InitVariables(InitModule({{"fc1.w", {{"init", std::string("he_normal")}}}})),
                    "variable @fc1.w: init 'he_normal' needs attribute 'fan_in'");
  Module m;
  Builder b(&m);
  b.Variable("count", {DType::kS32, {2}}, ir::kRoleStep, {{"init", std::string("normal")}, {"stddev", 1.0}});
  CHECK_THROWS_WITH(InitVariables(m), Catch::Contains("variable @count: init 'normal' needs an f32 variable"));
}

// ---- Speed (hidden; run with `interpreter_test [perf]`) ----

TEST_CASE("a 2-conv-layer CNN step on a batch of 64 Fashion-MNIST images", "[.][perf]") {
  // conv 1->32 3x3 pad 1, relu, pool 2, conv 32->64 3x3 pad 1, relu, pool 2, dense 3136->10: forward,
  // plus the backward convolutions, pooling grads and matmuls (the bulk of a training step).
  Module m;
  Builder b(&m);
  const int64_t n = 64;
  auto x = b.Input("x", {DType::kF32, {n, 1, 28, 28}});
  auto w1 = b.Input("w1", {DType::kF32, {32, 1, 3, 3}});
  auto w2 = b.Input("w2", {DType::kF32, {64, 32, 3, 3}});
  auto w3 = b.Input("w3", {DType::kF32, {3136, 10}});
  const Attrs conv{{"padding", IntList{1, 1}}}, pool{{"window", IntList{2, 2}}};
  auto c1 = b.Emit(OpCode::kRelu, {b.Emit(OpCode::kConv2d, {x, w1}, conv)});
  auto p1 = b.Emit(OpCode::kMaxPool, {c1}, pool);
  auto c2 = b.Emit(OpCode::kRelu, {b.Emit(OpCode::kConv2d, {p1, w2}, conv)});
  auto p2 = b.Emit(OpCode::kMaxPool, {c2}, pool);
  auto flat = b.Reshape(p2, {n, 3136});
  auto logits = b.Matmul(flat, w3);
  auto dlogits = logits;  // stand-in for the loss gradient
  b.Matmul(flat, dlogits, true, false);
  auto dflat = b.Matmul(dlogits, w3, false, true);
  auto dp2 = b.Reshape(dflat, {n, 64, 7, 7});
  auto dc2 = b.Emit(OpCode::kMaxPoolGrad, {c2, dp2}, pool);
  Attrs fg2 = conv, ig2 = conv, fg1 = conv;
  fg2["filter_shape"] = IntList{64, 32, 3, 3};
  ig2["input_shape"] = IntList{n, 32, 14, 14};
  fg1["filter_shape"] = IntList{32, 1, 3, 3};
  b.Emit(OpCode::kConv2dFilterGrad, {p1, dc2}, fg2);
  auto dp1 = b.Emit(OpCode::kConv2dInputGrad, {dc2, w2}, ig2);
  auto dc1 = b.Emit(OpCode::kMaxPoolGrad, {c1, dp1}, pool);
  b.Emit(OpCode::kConv2dFilterGrad, {x, dc1}, fg1);

  TensorMap inputs{{"x", F({n, 1, 28, 28}, Random(n * 784, 1))},
                   {"w1", F({32, 1, 3, 3}, Random(288, 2))},
                   {"w2", F({64, 32, 3, 3}, Random(18432, 3))},
                   {"w3", F({3136, 10}, Random(31360, 4))}};
  EvaluateAll(m, {}, inputs);
  const int steps = 20;
  const auto start = std::chrono::steady_clock::now();
  const std::clock_t cpu_start = std::clock();
  for (int i = 0; i < steps; ++i) EvaluateAll(m, {}, inputs);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / steps;
  const double cpu = double(std::clock() - cpu_start) / CLOCKS_PER_SEC / steps;  // all threads
  WARN("per step: " << wall * 1e3 << " ms wall, " << cpu * 1e3 << " ms CPU; a 60000-image epoch: about "
                    << wall * 60000 / n << " s wall");
}

}  // namespace
}  // namespace shardstep::runtime
