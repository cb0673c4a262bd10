// mixed-precision (--precision bf16, issue 10): text in, text out; idempotent; what it leaves alone; the
// pipeline option and the flag's errors; and a trained step that rounds exactly the contraction operands.
#include <catch2/catch.hpp>

#include <string>

#include "dsl/dsl.h"
#include "ir/parser.h"
#include "ir/passes/mixed_precision.h"
#include "ir/passes/pipeline.h"
#include "ir/printer.h"
#include "tests/ir/passes/pass_test_util.h"

using namespace shardstep;
using namespace shardstep::ir;
using namespace ::shardstep::ir::testing;

namespace {

const char* kDense = R"(module @m {
  %0 = input @x : f32[2,3]
  %1 = variable @w {role="weight"} : f32[3,4]
  %2 = matmul(%0, %1) : f32[2,4]
  %3 = matmul(%2, %1) {transpose_b=1} : f32[2,3]
  %4 = exp(%3) : f32[2,3]
  output @y = %4
}
)";

}  // namespace

TEST_CASE("mixed-precision: matmul operands rounded through bf16, each value once; idempotent") {
  Module m = Parse(kDense);
  REQUIRE(MixedPrecision().Run(m));
  const std::string text = Print(m);
  INFO(text);
  CHECK(FileCheck(text, R"(
CHECK: [[X:%[0-9]+]] = convert(%0) {dtype="bf16"} : bf16[2,3]
CHECK-NEXT: [[XR:%[0-9]+]] = convert([[X]]) {dtype="f32"} : f32[2,3]
CHECK-NEXT: [[W:%[0-9]+]] = convert(%1) {dtype="bf16"} : bf16[3,4]
CHECK-NEXT: [[WR:%[0-9]+]] = convert([[W]]) {dtype="f32"} : f32[3,4]
CHECK-NEXT: [[Y:%[0-9]+]] = matmul([[XR]], [[WR]]) : f32[2,4]
CHECK-NEXT: [[YB:%[0-9]+]] = convert([[Y]]) {dtype="bf16"} : bf16[2,4]
CHECK-NEXT: [[YR:%[0-9]+]] = convert([[YB]]) {dtype="f32"} : f32[2,4]
CHECK-NEXT: {{%[0-9]+}} = matmul([[YR]], [[WR]]) {transpose_b=1} : f32[2,3]
CHECK-NOT: convert
)") == "");
  CHECK(Parse(text) == m);
  Module again = m;
  CHECK_FALSE(MixedPrecision().Run(again));
  CHECK(again == m);
  // No contraction: unchanged.
  Module plain = Parse("module @p {\n  %0 = input @x : f32[2]\n  %1 = exp(%0) : f32[2]\n  output @y = %1\n}\n");
  const Module before = plain;
  CHECK_FALSE(MixedPrecision().Run(plain));
  CHECK(plain == before);
}

TEST_CASE("mixed-precision: numbers: the contraction sees bf16 values, accumulates in f32") {
  Module m = Parse(kDense);
  MixedPrecision().Run(m);
  Module ref = Parse(kDense);
  TensorMap vars{
      {"w", Tensor::F32({3, 4}, {1.00390625f, 0.1f, -2.5f, 3.0f, 0.3f, 1.0f, 1.0f, 1.0f, 7.77f, 0.0f, 0.5f, 1.0f})}};
  TensorMap inputs{{"x", Tensor::F32({2, 3}, {1.001f, 2.0f, 0.5f, -1.0f, 0.25f, 3.3f})}};
  TensorMap rounded_vars = vars, rounded_inputs = inputs;
  for (float& v : rounded_vars["w"].f32) v = runtime::RoundToBf16(v);
  for (float& v : rounded_inputs["x"].f32) v = runtime::RoundToBf16(v);
  // The second matmul's left operand is the first's result, rounded: emulate by hand with the pass's rule.
  TensorMap v1 = vars, v2 = rounded_vars;
  const TensorMap got = runtime::RunStep(m, v1, inputs);
  const TensorMap f32 = runtime::RunStep(ref, v2, rounded_inputs);  // rounds x and w, not the intermediate
  bool differs = false;
  for (int64_t i = 0; i < 6; ++i) differs |= got.at("y").f32[i] != f32.at("y").f32[i];
  CHECK(differs);  // the intermediate %2 was rounded too
  // First matmul alone: exactly the f32 matmul of rounded operands.
  Module first = Parse("module @f {\n  %0 = input @x : f32[2,3]\n  %1 = variable @w {role=\"weight\"} : f32[3,4]\n"
                       "  %2 = matmul(%0, %1) : f32[2,4]\n  output @y = %2\n}\n");
  Module first_ref = first;
  MixedPrecision().Run(first);
  TensorMap v3 = vars, v4 = rounded_vars;
  CHECK(runtime::RunStep(first, v3, inputs).at("y") == runtime::RunStep(first_ref, v4, rounded_inputs).at("y"));
}

TEST_CASE("mixed-precision: the pipeline option and the precision flag") {
  PipelineOptions o;
  CHECK_FALSE(ParsePrecision("f32"));
  CHECK(ParsePrecision("bf16"));
  CHECK_THROWS_WITH(ParsePrecision("f16"), Catch::Contains("--precision must be f32 or bf16, got 'f16'"));
  auto has = [](const std::vector<std::string>& v, const std::string& s) {
    return std::find(v.begin(), v.end(), s) != v.end();
  };
  CHECK(has(KnownPassNames(), "mixed-precision"));
  CHECK_FALSE(has(BuildPipeline({"all"}, o).Names(), "mixed-precision"));
  o.bf16_contractions = true;
  const std::vector<std::string> names = BuildPipeline({"all"}, o).Names();
  REQUIRE(names.size() >= 2);
  CHECK(names[0] == "autodiff");
  CHECK(names[1] == "mixed-precision");
}

TEST_CASE("mixed-precision: the DSL's .precision() adds the pass to the training step") {
  auto count_bf16 = [](const std::string& precision) {
    dsl::Model m("mlp");
    auto x = m.input("x", dsl::f32({4, 6}));
    auto y = m.input("y", dsl::s32({4}));
    auto loss = x.dense(5, "fc1").relu().dense(3, "fc2").cross_entropy(y).mean();
    const dsl::Program p = m.train(loss).precision(precision).build();
    int converts = 0;
    for (const Instr& in : p.step.instrs) converts += in.op == OpCode::kConvert && in.type.dtype == DType::kBF16;
    return std::make_pair(converts, p.options.bf16_contractions);
  };
  CHECK(count_bf16("f32") == std::make_pair(0, false));
  // fc1: x, w1 (forward), dy1 (dw1); fc2: h, w2 (forward), dy2 (dw2 and dh share it).
  CHECK(count_bf16("bf16") == std::make_pair(6, true));
  CHECK_THROWS_WITH(count_bf16("fp16"), Catch::Contains(".precision() must be f32 or bf16, got 'fp16'"));
}
