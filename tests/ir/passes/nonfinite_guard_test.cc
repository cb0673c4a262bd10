// NonfiniteGuard: IR text in, text out; the guarded step changes no state when the loss or a gradient
// holds NaN/inf and changes nothing bitwise otherwise, replicated and after the weight-update sharder
// (whose partial sums and selects it must shard, with no fallback).
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <string>

#include "ir/parser.h"
#include "ir/passes/nonfinite_guard.h"
#include "ir/passes/pipeline.h"
#include "ir/passes/weight_update_sharder.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "tests/ir/passes/pass_test_util.h"

namespace shardstep::ir {
namespace {

using namespace ::shardstep::ir::testing;

// SGD on w [4,3] (gradient x * w) and b [3] (gradient: column sums of x), loss = sum(x * w), and a
// step counter. REPLICAS is replaced; with more than one the gradients are all-reduced.
const char* kSgd = R"IR(
module @sgd replicas=REPLICAS {
  %0 = input @x : f32[4,3]
  %1 = variable @w {role="weight"} : f32[4,3]
  %2 = variable @b {role="weight"} : f32[3]
  %3 = variable @step {role="step"} : s32[]
  %4 = mul(%0, %1) : f32[4,3]
  %5 = reduce_sum(%0) {axes=[0]} : f32[3]
  %6 = reduce_sum(%4) {axes=[0,1]} : f32[]
  GW
  GB
  %9 = constant {value=0.1} : f32[4,3]
  %10 = mul(%9, %7) : f32[4,3]
  %11 = sub(%1, %10) : f32[4,3]
  %12 = constant {value=0.1} : f32[3]
  %13 = mul(%12, %8) : f32[3]
  %14 = sub(%2, %13) : f32[3]
  %15 = constant {value=1} : s32[]
  %16 = add(%3, %15) : s32[]
  gradient @w = %7
  gradient @b = %8
  assign @w = %11
  assign @b = %14
  assign @step = %16
  output @loss = %6
}
)IR";

Module Sgd(int replicas) {
  std::string t = kSgd;
  auto put = [&](const std::string& key, const std::string& value) { t.replace(t.find(key), key.size(), value); };
  put("REPLICAS", std::to_string(replicas));
  if (replicas == 1) {
    put("GW", "%7 = mul(%4, %1) : f32[4,3]");  // any op, so the numbering stays
    put("GB", "%8 = add(%5, %5) : f32[3]");
  } else {
    put("GW", "%7 = all_reduce(%4) {reduction=\"mean\"} : f32[4,3]");
    put("GB", "%8 = all_reduce(%5) {reduction=\"mean\"} : f32[3]");
  }
  return ParseVerified(t);
}

Module Guarded(const Module& m) {
  Module out = m;
  REQUIRE(NonfiniteGuard().Run(out));
  Verify(out);
  return out;
}

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

TEST_CASE("nonfinite-guard: text out, round trip, idempotent") {
  const Module g = Guarded(Sgd(1));
  const std::string text = Print(g);
  INFO(text);
  CHECK(FileCheck(text, R"(
CHECK: [[CW:%[0-9]+]] = reduce_sum(%7) {axes=[0,1]} : f32[]
CHECK-NEXT: [[ZW:%[0-9]+]] = sub([[CW]], [[CW]]) : f32[]
CHECK-NEXT: [[CB:%[0-9]+]] = reduce_sum(%8) {axes=[0]} : f32[]
CHECK-NEXT: [[ZB:%[0-9]+]] = sub([[CB]], [[CB]]) : f32[]
CHECK-NEXT: [[T:%[0-9]+]] = add([[ZW]], [[ZB]]) : f32[]
CHECK-NEXT: [[L:%[0-9]+]] = sub(%6, %6) : f32[]
CHECK-NEXT: [[T2:%[0-9]+]] = add([[L]], [[T]]) : f32[]
CHECK: [[OK:%[0-9]+]] = eq([[T2]], {{%[0-9]+}}) : f32[]
CHECK-NEXT: [[BW:%[0-9]+]] = broadcast([[OK]]) {dims=[], shape=[4,3]} : f32[4,3]
CHECK-NEXT: [[NW:%[0-9]+]] = select([[BW]], {{%[0-9]+}}, %1) : f32[4,3]
CHECK-NEXT: [[BB:%[0-9]+]] = broadcast([[OK]]) {dims=[], shape=[3]} : f32[3]
CHECK-NEXT: [[NB:%[0-9]+]] = select([[BB]], {{%[0-9]+}}, %2) : f32[3]
CHECK-NEXT: [[NS:%[0-9]+]] = select([[OK]], {{%[0-9]+}}, %3) : s32[]
CHECK: assign @w = [[NW]]
CHECK-NEXT: assign @b = [[NB]]
CHECK-NEXT: assign @step = [[NS]]
CHECK: output @loss = %6
CHECK-NEXT: output @grad_check/w = [[CW]]
CHECK-NEXT: output @grad_check/b = [[CB]]
CHECK-NEXT: output @step_finite = [[OK]]
)") == "");
  CHECK(Parse(text) == g);
  Module again = g;
  CHECK_FALSE(NonfiniteGuard().Run(again));
  CHECK(again == g);
  // With replicas, the loss check is all-reduced so every replica decides alike.
  const std::string text2 = Print(Guarded(Sgd(2)));
  CHECK(FileCheck(text2, R"(
CHECK: [[L:%[0-9]+]] = sub(%6, %6) : f32[]
CHECK-NEXT: {{%[0-9]+}} = all_reduce([[L]]) {reduction="sum"} : f32[]
)") == "");
}

TEST_CASE("nonfinite-guard: errors and the pipeline option") {
  Module m = Sgd(1);
  m.gradients.clear();
  CHECK_THROWS_WITH(NonfiniteGuard().Run(m), Catch::Contains("no gradients"));
  PipelineOptions o;
  auto has = [](const std::vector<std::string>& v, const std::string& s) { return std::find(v.begin(), v.end(), s) != v.end(); };
  CHECK(has(KnownPassNames(), "nonfinite-guard"));
  CHECK(MakePass("nonfinite-guard", o)->name() == "nonfinite-guard");
  CHECK_FALSE(has(BuildPipeline({"all"}, o).Names(), "nonfinite-guard"));
  o.nonfinite_guard = true;
  const std::vector<std::string> names = BuildPipeline({"all"}, o).Names();
  REQUIRE(has(names, "nonfinite-guard"));
  auto at = [&](const std::string& s) { return std::find(names.begin(), names.end(), s) - names.begin(); };
  CHECK(at("optimizer-lowering") < at("nonfinite-guard"));
  CHECK(at("nonfinite-guard") < at("weight-update-sharder"));
}

// Runs one step of `m` (N replicas) from `logical` on per-replica inputs; returns the run.
Run OneStep(const Module& m, const TensorMap& logical, const std::vector<TensorMap>& inputs) {
  return Train(m, logical, {inputs});
}

TEST_CASE("nonfinite-guard: finite steps are bitwise unchanged, non-finite ones change no state") {
  const Module plain = Sgd(1), guarded = Guarded(plain);
  std::mt19937 rng(3);
  const TensorMap logical = RandomLogicalState(plain, rng);
  const auto inputs = RandomInputs(plain, 1, rng);
  const Run a = OneStep(plain, logical, inputs[0]), b = OneStep(guarded, logical, inputs[0]);
  for (auto& [name, t] : a.states[0][0]) CHECK(Compare(name, b.states[0][0].at(name), t, 0) == "");
  CHECK(b.outputs[0][0].at("step_finite").f32[0] == 1.0f);
  CHECK(std::isfinite(b.outputs[0][0].at("grad_check/w").f32[0]));
  CHECK(b.outputs[0][0].at("loss") == a.outputs[0][0].at("loss"));

  for (float bad : {kNaN, kInf, -kInf}) {
    INFO("injected " << bad);
    // In the batch.
    auto in = inputs[0];
    in[0]["x"].f32[5] = bad;
    const Run r = OneStep(guarded, logical, in);
    CHECK(r.outputs[0][0].at("step_finite").f32[0] == 0.0f);
    CHECK_FALSE(std::isfinite(r.outputs[0][0].at("grad_check/w").f32[0]));
    for (auto& [name, t] : logical) CHECK(Compare(name, r.states[0][0].at(name), t, 0) == "");
    // In a weight: only b's gradient (column sums of x) stays finite.
    TensorMap bad_state = logical;
    bad_state["w"].f32[2] = bad;
    const Run s = OneStep(guarded, bad_state, inputs[0]);
    CHECK(s.outputs[0][0].at("step_finite").f32[0] == 0.0f);
    CHECK(std::isfinite(s.outputs[0][0].at("grad_check/b").f32[0]));
    CHECK_FALSE(std::isfinite(s.outputs[0][0].at("grad_check/w").f32[0]));
    CHECK(s.states[0][0].at("step").s32[0] == 0);
    CHECK(std::memcmp(s.states[0][0].at("b").f32.data(), logical.at("b").f32.data(), 12) == 0);
  }
}

TEST_CASE("nonfinite-guard: sharded (N = 2, b padded) is bitwise the guarded replicated step, and skips alike") {
  const Module guarded = Guarded(Sgd(2));
  Module sharded = guarded;
  WeightUpdateSharder sharder;
  REQUIRE(sharder.Run(sharded));
  Verify(sharded);
  CHECK(sharder.report().fallbacks.empty());
  CHECK(CountOps(sharded, OpCode::kReduceScatter) == 2);
  CHECK(CountOps(sharded, OpCode::kAllReduce) == 3);  // the loss check and the two partial gradient checks
  CHECK(Parse(Print(sharded)) == sharded);
  EXPECT_SAME_TRAINING(guarded, sharded, 1e-6);  // the grad_check outputs are sums in another order
  // Without them, every variable and every other output (step_finite, loss) is bitwise the same.
  Module quiet = guarded;
  std::erase_if(quiet.outputs, [](const auto& o) { return o.first.rfind(kGradCheckOutputPrefix, 0) == 0; });
  Module quiet_sharded = quiet;
  REQUIRE(WeightUpdateSharder().Run(quiet_sharded));
  EXPECT_SAME_TRAINING(quiet, quiet_sharded, 0.0);

  std::mt19937 rng(4);
  const TensorMap logical = RandomLogicalState(guarded, rng);
  for (int bad_replica : {0, 1}) {
    INFO("NaN in replica " << bad_replica << "'s batch");
    auto in = RandomInputs(guarded, 1, rng)[0];
    in[bad_replica]["x"].f32[7] = kNaN;
    for (const Module* m : {&guarded, static_cast<const Module*>(&sharded)}) {
      const Run r = OneStep(*m, logical, in);
      for (int rep = 0; rep < 2; ++rep) {
        CHECK(r.outputs[0][rep].at("step_finite").f32[0] == 0.0f);
        const TensorMap after = runtime::LogicalStateFrom(*m, r.states[0], 0);
        for (auto& [name, t] : logical) CHECK(Compare(name, after.at(name), t, 0) == "");
      }
    }
  }
}

}  // namespace
}  // namespace shardstep::ir
