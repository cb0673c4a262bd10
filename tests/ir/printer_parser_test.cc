// Tests for the textual IR: exact printed form, Parse(Print(m)) == m for every op and attribute kind,
// and line:column error messages for malformed text.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "ir/builder.h"
#include "ir/error.h"
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"

namespace shardstep::ir {
namespace {

TensorType F32(Shape s) { return {DType::kF32, std::move(s)}; }
TensorType S32(Shape s) { return {DType::kS32, std::move(s)}; }

// A fresh input with a unique name.
ValueId In(Builder& b, TensorType t) { return b.Input("in" + std::to_string(b.module().size()), std::move(t)); }

void CheckRoundTrip(const Module& m) {
  const std::string text = Print(m);
  INFO(text);
  Module back = Parse(text);
  CHECK(back == m);
  CHECK(Print(back) == text);
}

// One instance of `op` with operands of sensible shapes. No default: a new op must get a case here.
ValueId BuildOp(Builder& b, OpCode op) {
  const TensorType f23 = F32({2, 3}), image = F32({2, 3, 8, 8}), filter = F32({4, 3, 3, 3});
  switch (op) {
    case OpCode::kVariable:
      return b.Variable("w" + std::to_string(b.module().size()), F32({3, 4}), kRoleWeight,
                        {{"init", std::string("glorot_uniform")}, {"seed", int64_t{7}}});
    case OpCode::kInput: return In(b, f23);
    case OpCode::kConstant: return b.Constant(-2.5, f23);
    case OpCode::kReplicaId: return b.ReplicaId();
    case OpCode::kIota: return b.Iota(S32({4, 3}), 1);
    case OpCode::kNeg:
    case OpCode::kExp:
    case OpCode::kSin:
    case OpCode::kCos:
    case OpCode::kLog:
    case OpCode::kSqrt:
    case OpCode::kRsqrt:
    case OpCode::kTanh:
    case OpCode::kSigmoid:
    case OpCode::kRelu:
    case OpCode::kStopGradient:
    case OpCode::kAbs: return b.Unary(op, In(b, f23));
    case OpCode::kConvert: return b.Convert(In(b, f23), DType::kS32);
    case OpCode::kAdd:
    case OpCode::kSub:
    case OpCode::kMul:
    case OpCode::kDiv:
    case OpCode::kPow:
    case OpCode::kMax:
    case OpCode::kMin:
    case OpCode::kEq:
    case OpCode::kNe:
    case OpCode::kLt:
    case OpCode::kLe:
    case OpCode::kGt:
    case OpCode::kGe: return b.Binary(op, In(b, f23), In(b, f23));
    case OpCode::kSelect: {
      ValueId x = In(b, f23), y = In(b, f23);
      return b.Select(b.Binary(OpCode::kLt, x, y), x, y);
    }
    case OpCode::kBroadcast: return b.Broadcast(In(b, F32({3})), {2, 3}, {1});
    case OpCode::kReshape: return b.Reshape(In(b, f23), {3, 1, 2});
    case OpCode::kTranspose: return b.Transpose(In(b, f23), {1, 0});
    case OpCode::kSlice: return b.Slice(In(b, f23), {0, 1}, {2, 3});
    case OpCode::kPad: return b.Pad(In(b, f23), {1, 0}, {0, 2});
    case OpCode::kConcat: return b.Concat({In(b, f23), In(b, F32({2, 1})), In(b, f23)}, 1);
    case OpCode::kReduceSum: return b.ReduceSum(In(b, f23), {1});
    case OpCode::kReduceMax: return b.ReduceMax(In(b, f23), {0});
    case OpCode::kReduceMean: return b.ReduceMean(In(b, f23), {0, 1});
    case OpCode::kMatmul: return b.Matmul(In(b, F32({5, 2, 3})), In(b, F32({5, 4, 3})), false, true);
    case OpCode::kConv2d:
      return b.Emit(op, {In(b, image), In(b, filter)}, {{"stride", IntList{1, 1}}, {"padding", IntList{1, 1}}});
    case OpCode::kConv2dInputGrad:
      return b.Emit(op, {In(b, F32({2, 4, 8, 8})), In(b, filter)},
                    {{"input_shape", IntList{2, 3, 8, 8}}, {"padding", IntList{1, 1}}});
    case OpCode::kConv2dFilterGrad:
      return b.Emit(op, {In(b, image), In(b, F32({2, 4, 6, 6}))}, {{"filter_shape", IntList{4, 3, 3, 3}}});
    case OpCode::kMaxPool: return b.MaxPool(In(b, image), {3, 3}, {2, 2}, 1);
    case OpCode::kMaxPoolGrad:
      return b.Emit(op, {In(b, image), In(b, F32({2, 3, 4, 4}))},
                    {{"window", IntList{2, 2}}, {"stride", IntList{2, 2}}});
    case OpCode::kAvgPool: return b.Emit(op, {In(b, image)}, {{"window", IntList{3, 3}}, {"stride", IntList{1, 1}}});
    case OpCode::kAttention:
      return b.Emit(op, {In(b, F32({2, 2, 4, 3})), In(b, F32({2, 2, 4, 3})), In(b, F32({2, 2, 4, 3}))},
                    {{"scale", 0.5}, {"causal", int64_t{1}}});
    case OpCode::kAttentionGrad:
      return b.Emit(op, {In(b, F32({2, 4, 3})), In(b, F32({2, 4, 3})), In(b, F32({2, 4, 3})), In(b, F32({2, 4, 3}))},
                    {{"scale", 0.25}, {"bf16", int64_t{1}}});
    case OpCode::kAvgPoolGrad:
      return b.Emit(op, {In(b, F32({2, 3, 4, 4}))}, {{"window", IntList{2, 2}}, {"input_shape", IntList{2, 3, 8, 8}}});
    case OpCode::kRandomUniform:
      return b.RandomUniform(In(b, S32({})), In(b, S32({})), {4, 3}, (uint64_t{0xfedcba98} << 32) | 0x76543210u);
    case OpCode::kOneHot: return b.Emit(op, {In(b, S32({4}))}, {{"depth", int64_t{10}}});
    case OpCode::kGather: return b.Emit(op, {In(b, F32({10, 5})), In(b, S32({4}))});
    case OpCode::kScatterAdd: return b.Emit(op, {In(b, S32({4})), In(b, F32({4, 5}))}, {{"rows", int64_t{10}}});
    case OpCode::kAllReduce: return b.AllReduce(In(b, f23), "mean", {{0, 1}, {2, 3}});
    case OpCode::kReduceScatter:
      return b.Emit(op, {In(b, F32({8, 3}))}, {{"groups", IntLists{{0, 2}, {1, 3}}}, {"group_size", int64_t{2}}});
    case OpCode::kAllGather: return b.Emit(op, {In(b, f23)}, {{"group_size", int64_t{4}}});
    case OpCode::kCollectivePermute:
      return b.Emit(op, {In(b, f23)}, {{"pairs", IntLists{{0, 1}, {1, 2}, {3, 0}}}, {"direction", int64_t{-1}}});
  }
  return kNoValue;
}

TEST_CASE("Print writes the documented text form") {
  Module m;
  m.name = "mlp";
  m.num_replicas = 4;
  Builder b(&m);
  ValueId w = b.Variable("fc1.w", F32({784, 256}), kRoleWeight,
                         {{"init", std::string("glorot_uniform")}, {"seed", int64_t{1}}});
  ValueId x = b.Input("image", F32({64, 784}));
  ValueId h = b.Matmul(x, w);
  ValueId half = b.Scalar(0.5);
  ValueId cat = b.Concat({h, h}, 1);
  ValueId sum =
      b.Emit(OpCode::kAllReduce, {cat}, {{"groups", IntLists{{0, 1}, {2, 3}}}, {"reduction", std::string("sum")}});
  ValueId grad = b.BroadcastScalar(half, {784, 256});
  ValueId updated = b.Sub(w, grad);
  ValueId loss = b.SumAll(sum);
  ValueId rid = b.ReplicaId();
  m.gradients.push_back({w, grad});
  m.assigns.push_back({w, updated});
  m.outputs.push_back({"loss", loss});
  m.outputs.push_back({"replica", rid});
  const std::string expected = R"(module @mlp replicas=4 {
  %0 = variable @fc1.w {init="glorot_uniform", role="weight", seed=1} : f32[784,256]
  %1 = input @image : f32[64,784]
  %2 = matmul(%1, %0) {transpose_a=0, transpose_b=0} : f32[64,256]
  %3 = constant {value=0.5} : f32[]
  %4 = concat(%2, %2) {axis=1} : f32[64,512]
  %5 = all_reduce(%4) {groups=[[0,1],[2,3]], reduction="sum"} : f32[64,512]
  %6 = broadcast(%3) {dims=[], shape=[784,256]} : f32[784,256]
  %7 = sub(%0, %6) : f32[784,256]
  %8 = reduce_sum(%5) {axes=[0,1]} : f32[]
  %9 = replica_id : s32[]
  gradient @fc1.w = %6
  assign @fc1.w = %7
  output @loss = %8
  output @replica = %9
}
)";
  CHECK(Print(m) == expected);
  Verify(m);
  CHECK(Parse(expected) == m);
}

TEST_CASE("every op in the table round-trips") {
  Module all;
  all.num_replicas = 4;
  Builder all_builder(&all);
  for (int i = 0; i < kNumOpCodes; ++i) {
    const OpCode op = static_cast<OpCode>(i);
    INFO("op " << OpName(op));
    Module m;
    m.num_replicas = 4;
    Builder b(&m);
    ValueId v = BuildOp(b, op);
    REQUIRE(v != kNoValue);
    CHECK(m.at(v).op == op);
    m.outputs.push_back({"out", v});
    Verify(m);
    CheckRoundTrip(m);
    all.outputs.push_back({std::string("out_") + OpName(op), BuildOp(all_builder, op)});
  }
  Verify(all);
  CheckRoundTrip(all);
}

TEST_CASE("every attribute kind round-trips") {
  Module m;
  m.name = "attrs test/1";  // needs quotes
  Builder b(&m);
  Attrs attrs{
      {"int_zero", int64_t{0}},
      {"int_neg", int64_t{-42}},
      {"int_min", std::numeric_limits<int64_t>::min()},
      {"int_max", std::numeric_limits<int64_t>::max()},
      {"f_one", 1.0},
      {"f_half", 0.5},
      {"f_tenth", 0.1},
      {"f_third", 1.0 / 3.0},
      {"f_neg_zero", -0.0},
      {"f_big", 1e300},
      {"f_max", std::numeric_limits<double>::max()},
      {"f_min_normal", std::numeric_limits<double>::min()},
      {"f_denormal", std::numeric_limits<double>::denorm_min()},
      {"f_int_like", 123456789012345678.0},
      {"f_inf", std::numeric_limits<double>::infinity()},
      {"f_neg_inf", -std::numeric_limits<double>::infinity()},
      {"s_empty", std::string()},
      {"s_escapes", std::string("quote\" backslash\\ newline\n tab\t bell\x07 utf8 \xc3\xa9 // not a comment")},
      {"list_empty", IntList{}},
      {"list_one", IntList{5}},
      {"list", IntList{-1, 0, 1, std::numeric_limits<int64_t>::min()}},
      {"lists", IntLists{{0, 1}, {2, 3}}},
      {"lists_with_empty", IntLists{{}, {1}, {}}},
      {"lists_single", IntLists{{7}}},
      {"key with spaces", int64_t{1}},
  };
  ValueId w = b.Variable("model/layer-1.w_0", F32({2}), kRoleOptimizerState, attrs);
  ValueId odd = b.Variable("name with \"quotes\"", F32({}), kRoleStep);
  m.gradients.push_back({w, w});
  m.assigns.push_back({odd, odd});
  m.outputs.push_back({"", w});
  Verify(m);
  CheckRoundTrip(m);

  const std::string text = Print(m);
  CHECK(text.find("f_one=1.0,") != std::string::npos);
  CHECK(text.find("int_zero=0,") != std::string::npos);
  CHECK(text.find("f_neg_zero=-0.0,") != std::string::npos);
  CHECK(text.find("f_inf=inf,") != std::string::npos);
  CHECK(text.find("f_neg_inf=-inf,") != std::string::npos);
  CHECK(text.find("list_empty=[],") != std::string::npos);
  CHECK(text.find("lists_with_empty=[[],[1],[]],") != std::string::npos);
  CHECK(text.find(R"("key with spaces"=1)") != std::string::npos);
  CHECK(text.find(R"(assign @"name with \"quotes\"" = %1)") != std::string::npos);
  CHECK(text.find(R"(output @"" = %0)") != std::string::npos);
  CHECK(std::signbit(std::get<double>(Parse(text).at(0).attrs.at("f_neg_zero"))));
}

TEST_CASE("PrintDouble is shortest, exact and never looks like an int") {
  CHECK(PrintDouble(1.0) == "1.0");
  CHECK(PrintDouble(-3.0) == "-3.0");
  CHECK(PrintDouble(0.1) == "0.1");
  CHECK(PrintDouble(1e20) == "1e+20");
  CHECK(PrintDouble(1e-7) == "1e-07");
  CHECK(PrintDouble(std::nan("")) == "nan");
  // Random bit patterns: every finite double reads back bit-identical.
  std::mt19937_64 rng(12345);
  Module m;
  Builder b(&m);
  std::vector<double> values;
  while (values.size() < 3000) {
    uint64_t bits = rng();
    double d;
    std::memcpy(&d, &bits, sizeof(d));
    if (std::isfinite(d)) values.push_back(d);
    values.push_back(static_cast<double>(static_cast<float>(rng() % 100000) / 1024.0f));
  }
  for (double d : values) b.Scalar(d);
  Module back = Parse(Print(m));
  REQUIRE(back.size() == m.size());
  for (ValueId v = 0; v < m.size(); ++v) {
    double got = std::get<double>(back.at(v).attrs.at("value"));
    INFO(PrintDouble(values[v]));
    CHECK(std::memcmp(&got, &values[v], sizeof(double)) == 0);
  }
}

TEST_CASE("round-trip edge cases") {
  SECTION("nan survives (though nan != nan)") {
    Module m;
    Builder(&m).Scalar(std::nan(""));
    CHECK(std::isnan(std::get<double>(Parse(Print(m)).at(0).attrs.at("value"))));
  }
  SECTION("an empty IntLists prints [] and reads back as an empty IntList") {
    Module m;
    Builder b(&m);
    ValueId x = In(b, F32({4}));
    b.Emit(OpCode::kAllReduce, {x}, {{"groups", IntLists{}}});
    Module back = Parse(Print(m));
    CHECK(std::holds_alternative<IntList>(back.at(1).attrs.at("groups")));
    CHECK(back.at(1).GetIntLists("groups").empty());
  }
  SECTION("unnamed and same-named variables print their target as a value id") {
    Module m;
    Builder b(&m);
    ValueId v0 = b.Variable("w", F32({2}), kRoleWeight);
    Instr copy = m.at(v0);
    ValueId v1 = m.Append(copy);
    copy.name = "";
    ValueId v2 = m.Append(copy);
    m.assigns = {{v0, v1}, {v1, v0}, {v2, v0}};
    const std::string text = Print(m);
    CHECK(text.find("assign @w = %1\n  assign %1 = %0\n  assign %2 = %0\n") != std::string::npos);
    CHECK(text.find("%2 = variable {role=\"weight\"} : f32[2]") != std::string::npos);
    CheckRoundTrip(m);
  }
  SECTION("an empty module") { CheckRoundTrip(Module{}); }
}

TEST_CASE("Parse accepts hand-written text") {
  Module m = Parse(R"(
// A comment line.
module @hand {   // replicas defaults to 1
  %0 = input @x:f32[2]
  %1 = constant{value=1e-3}: f32[2]
  %2 = constant { value = -inf , extra = 1E+5 } : f32[2]
  %3 = add( %0 ,%1 ) : f32[2]
  output @y = %3
}
)");
  CHECK(m.name == "hand");
  CHECK(m.num_replicas == 1);
  CHECK(m.size() == 4);
  CHECK(m.at(1).GetFloat("value") == 1e-3);
  CHECK(std::isinf(m.at(2).GetFloat("value")));
  CHECK(std::get<double>(m.at(2).attrs.at("extra")) == 1e5);
  CHECK(m.at(3).operands == std::vector<ValueId>{0, 1});
  CHECK(m.FindOutput("y") == 3);
}

TEST_CASE("the text form of iota, random_uniform, batched matmul, padded max_pool and forward all_reduce") {
  Module m;
  m.name = "ops";
  m.num_replicas = 2;
  Builder b(&m);
  ValueId q = b.Input("q", F32({2, 4, 3, 8}));
  ValueId step = b.Input("step", S32({})), first = b.Input("first", S32({}));
  ValueId scores = b.Matmul(q, q, false, true);
  ValueId pos = b.Iota(S32({3, 3}), 1);
  ValueId u = b.RandomUniform(step, first, {2, 4, 3, 3}, (uint64_t{1} << 40) + 7);
  ValueId pooled = b.MaxPool(u, {2, 2}, {1, 1}, 1);
  ValueId total = b.AllReduce(b.SumAll(scores), "mean", {{0}, {1}});
  m.outputs = {{"pos", pos}, {"pooled", pooled}, {"total", total}};
  const std::string expected = R"(module @ops replicas=2 {
  %0 = input @q : f32[2,4,3,8]
  %1 = input @step : s32[]
  %2 = input @first : s32[]
  %3 = matmul(%0, %0) {transpose_a=0, transpose_b=1} : f32[2,4,3,3]
  %4 = iota {dimension=1} : s32[3,3]
  %5 = random_uniform(%1, %2) {seed=1099511627783, shape=[2,4,3,3]} : f32[2,4,3,3]
  %6 = max_pool(%5) {padding=1, stride=[1,1], window=[2,2]} : f32[2,4,4,4]
  %7 = reduce_sum(%3) {axes=[0,1,2,3]} : f32[]
  %8 = all_reduce(%7) {groups=[[0],[1]], reduction="mean"} : f32[]
  output @pos = %4
  output @pooled = %6
  output @total = %8
}
)";
  CHECK(Print(m) == expected);
  Verify(m);
  CHECK(Parse(expected) == m);
  CheckRoundTrip(m);
}

TEST_CASE("Parse reports malformed text with line:col") {
  const std::string head = "module @m {\n  %0 = input @x : f32[2,3]\n";
  struct Case {
    std::string text;
    std::string where;  // line:col
    std::string message;
  };
  const std::vector<Case> cases = {
      {"modul @m {}", "1:1", "expected 'module' at start of input, found 'modul'"},
      {"module m {}", "1:8", "expected module name (@name), found 'm'"},
      {head + "  %1 = add(%0, %0} : f32[2,3]\n}", "3:18", "expected ',' or ')' after operand, found '}'"},
      {head + "  %1 = addd(%0, %0) : f32[2,3]\n}", "3:8", "unknown op 'addd'"},
      {head + "  %1 = add(%0, %7) : f32[2,3]\n}", "3:16", "use of undefined value %7"},
      {head + "  %0 = input @y : f32[2]\n}", "3:3", "value %0 defined twice"},
      {head + "  %2 = neg(%0) : f32[2,3]\n}", "3:3", "expected %1 (values must be numbered in order)"},
      {head + "  %1 = input @y : f32[3,2]\n  %2 = add(%0, %1) : f32[2,3]\n}", "4:3",
       "add(f32[2,3], f32[3,2]): operand shapes differ"},
      {head + "  %1 = neg(%0) : f32[3,2]\n}", "3:18",
       "type mismatch: neg(f32[2,3]) has type f32[2,3], written f32[3,2]"},
      {head + "  %1 = add(%0) : f32[2,3]\n}", "3:8", "add takes 2 operands, got 1"},
      {head + "  %1 = concat(%0) : f32[2,3]\n}", "3:3", "missing attribute 'axis'"},
      {head + "  %1 = reduce_sum(%0) {axes=[0.5]} : f32[3]\n}", "3:30", "expected integer or ']' in list, found '0.5'"},
      {head + "  assign @foo = %0\n}", "3:10", "unknown variable @foo in assign"},
      {head + "  gradient @x = %0\n}", "3:12", "unknown variable @x in gradient"},
      {head + "  output @y = %3\n}", "3:15", "use of undefined value %3"},
      {"module @m {\n  %0 = input @x : f16[2,3]\n}", "2:19", "unknown dtype 'f16'"},
      {"module @m {\n  %0 = input @x : f32[2,-3]\n}", "2:25", "negative dimension -3"},
      {"module @m {\n  %0 = variable @w {init=\"glorot : f32[2]\n}", "2:26", "unterminated string"},
      {"module @m {\n  %0 = variable @w {init=\"a\\qb\"} : f32[2]\n}", "2:28", "unknown escape sequence"},
      {"module @m {\n  %0 = variable @w {seed=99999999999999999999} : f32[2]\n}", "2:26", "out of range"},
      {"module @m {\n  %0 = variable @w {seed=1, seed=2} : f32[2]\n}", "2:29", "duplicate attribute 'seed'"},
      {"module @m {\n  %0 = variable @w {seed=1 role=\"weight\"} : f32[2]\n}", "2:28",
       "expected ',' or '}' after attribute, found 'role'"},
      {head + "  %1 = neg(%0) f32[2,3]\n}", "3:16", "expected ':' and the result type of neg, found 'f32'"},
      {head + "  %1 = neg(%0) : $\n}", "3:18", "unexpected character '$'"},
      {head + "}\nextra", "4:1", "unexpected 'extra' after the end of the module"},
      {head, "3:1", "expected '}' at end of module, found end of input"},
      {head + "  neg(%0)\n}", "3:3",
       "expected an instruction (%N = ...), 'gradient', 'assign', 'output' or '}', found 'neg'"},
  };
  REQUIRE(cases.size() >= 12);
  for (const Case& c : cases) {
    INFO(c.text);
    try {
      Parse(c.text, "model.ir");
      FAIL("parsed without error");
    } catch (const Error& e) {
      const std::string what = e.what();
      CHECK_THAT(what, Catch::StartsWith("model.ir:" + c.where + ": error: "));
      CHECK_THAT(what, Catch::Contains(c.message));
    }
  }
}

}  // namespace
}  // namespace shardstep::ir
