// Tests for the verifier: a valid module passes; each broken invariant is reported naming the culprit.
#include <catch2/catch.hpp>

#include <functional>

#include "ir/builder.h"
#include "ir/error.h"
#include "ir/verifier.h"

namespace shardstep::ir {
namespace {

TensorType F32(Shape s) { return {DType::kF32, std::move(s)}; }

// %0 = variable @w f32[3,4], %1 = variable @b f32[4], %2 = input @x f32[2,3], %3 = matmul, %4 = constant,
// %5 = mul(%0, %4), %6 = sub(%0, %5), %7 = reduce_sum(%3); gradient @w = %5, assign @w = %6, output @loss = %7.
Module ValidModule() {
  Module m;
  m.name = "v";
  Builder b(&m);
  ValueId w = b.Variable("w", F32({3, 4}), kRoleWeight);
  b.Variable("b", F32({4}), kRoleWeight);
  ValueId x = b.Input("x", F32({2, 3}));
  ValueId h = b.Matmul(x, w);
  ValueId g = b.MulScalar(w, 0.1);
  m.gradients.push_back({w, g});
  m.assigns.push_back({w, b.Sub(w, g)});
  m.outputs.push_back({"loss", b.SumAll(h)});
  return m;
}

TEST_CASE("Verify accepts a valid module") {
  Module m = ValidModule();
  REQUIRE(m.size() == 8);
  CHECK_NOTHROW(Verify(m));
  SECTION("collective groups may be a list of lists, or empty") {
    Builder b(&m);
    b.Emit(OpCode::kAllReduce, {3}, {{"groups", IntLists{{0}}}});
    b.Emit(OpCode::kAllReduce, {3}, {{"groups", IntList{}}});
    CHECK_NOTHROW(Verify(m));
  }
  SECTION("a variable and an input may share a name") {
    Builder(&m).Input("w", F32({1}));
    CHECK_NOTHROW(Verify(m));
  }
}

TEST_CASE("Verify rejects broken modules") {
  struct Case {
    const char* what;
    std::function<void(Module&)> breaks;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"use before definition", [](Module& m) { m.at(3).operands[0] = 5; },
       "%3 (matmul): operand %5 is not defined before use"},
      {"self use", [](Module& m) { m.at(6).operands[1] = 6; }, "%6 (sub): operand %6 is not defined before use"},
      {"negative operand", [](Module& m) { m.at(6).operands[1] = -1; }, "%6 (sub): operand %-1 is not defined"},
      {"too few operands", [](Module& m) { m.at(6).operands.pop_back(); }, "%6 (sub): takes 2 operands, got 1"},
      {"too many operands", [](Module& m) { m.at(7).operands.push_back(0); },
       "%7 (reduce_sum): takes 1 operand, got 2"},
      {"empty concat", [](Module& m) { m.at(7).op = OpCode::kConcat; m.at(7).operands.clear(); },
       "%7 (concat): takes at least 1 operand, got 0"},
      {"leaf with operands", [](Module& m) { m.at(4).operands.push_back(0); },
       "%4 (constant): a leaf takes no operands, got 1"},
      {"wrong recorded type", [](Module& m) { m.at(3).type = F32({2, 5}); },
       "%3 (matmul): recorded type f32[2,5] but its operands give f32[2,4]"},
      {"shape error", [](Module& m) { m.at(3).attrs["transpose_b"] = int64_t{1}; },
       "%3 (matmul): matmul(f32[2,3], f32[3,4]): contracting dimensions differ"},
      {"constant without value", [](Module& m) { m.at(4).attrs.clear(); }, "%4 (constant): "},
      {"flat replica groups",
       [](Module& m) { m.at(7) = Instr{OpCode::kAllReduce, {3}, F32({2, 4}), {{"groups", IntList{0, 1}}}, ""}; },
       "%7 (all_reduce): attribute 'groups'=[0,1] must be a list of replica lists"},
      {"unnamed variable", [](Module& m) { m.at(1).name.clear(); }, "%1 (variable): has no name"},
      {"duplicate variable", [](Module& m) { m.at(1).name = "w"; }, "%1 (variable): name @w is used twice"},
      {"duplicate input",
       [](Module& m) {
         Builder(&m).Input("y", F32({1}));
         Builder(&m).Input("z", F32({1}));
         m.instrs.back().name = "x";
       },
       "%9 (input): name @x is used twice"},
      {"assign to an input", [](Module& m) { m.assigns[0].first = 2; }, "assign %2 = %6: target %2 is not a variable"},
      {"assign out of range", [](Module& m) { m.assigns[0].second = 99; }, "assign %0 = %99: value %99 is not defined"},
      {"assign type", [](Module& m) { m.assigns[0].second = 7; },
       "assign %0 = %7: value type f32[] differs from variable @w type f32[3,4]"},
      {"gradient type", [](Module& m) { m.gradients.push_back({1, 5}); },
       "gradient %1 = %5: value type f32[3,4] differs from variable @b type f32[4]"},
      {"gradient target", [](Module& m) { m.gradients[0].first = 3; }, "gradient %3 = %5: target %3 is not a variable"},
      {"duplicate gradient", [](Module& m) { m.gradients.push_back({0, 0}); },
       "gradient %0 = %0: variable @w has a second gradient"},
      {"duplicate assign", [](Module& m) { m.assigns.push_back({0, 0}); },
       "assign %0 = %0: variable @w has a second assign"},
      {"duplicate output", [](Module& m) { m.outputs.push_back({"loss", 3}); },
       "output @loss = %3: output name used twice"},
      {"output out of range", [](Module& m) { m.outputs[0].second = 8; }, "output @loss = %8: value %8 is not defined"},
      {"no replicas", [](Module& m) { m.num_replicas = 0; }, "replicas=0 must be at least 1"},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    Module m = ValidModule();
    c.breaks(m);
    try {
      Verify(m);
      FAIL("verified without error");
    } catch (const Error& e) {
      CHECK_THAT(e.what(), Catch::StartsWith("module @v: "));
      CHECK_THAT(e.what(), Catch::Contains(c.message));
    }
  }
}

}  // namespace
}  // namespace shardstep::ir
