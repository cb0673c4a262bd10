// The weights' bf16 copies (jit/step_rewrites.h Bf16WeightCopies, JitOptions::bf16_weight_copies): with
// --precision bf16 the optimizer's loop writes each weight's rounding for the next step's products into
// a copy jit::CpuExecutor keeps per replica, instead of a loop rounding every weight at each step. The
// steps must keep their bits (against the same executor without copies), through loads of the state,
// replicated and sharded updates, matmul and convolution weights.
#include <catch2/catch.hpp>

#include <string>

#include "dsl/dsl.h"
#include "jit/compiled_step.h"
#include "jit/cpu_executor.h"
#include "jit/step_rewrites.h"
#include "models/models.h"
#include "runtime/dataset.h"
#include "runtime/executor.h"
#include "runtime/sharding.h"
#include "tests/jit/small_programs.h"

using namespace shardstep;
using namespace shardstep::runtime;

namespace {

constexpr int64_t kBatch = 16;

dsl::Program Build(bool cnn, int replicas, bool shard) {
  test::SmallProgram s;
  s.cnn = cnn;
  s.batch = kBatch;
  s.hidden = {32, 24};
  s.seed = 3;
  s.precision = "bf16";
  return test::Build(s, dsl::Adam().lr(3e-3), replicas, shard);
}

std::vector<TensorMap> Batches(bool cnn, int steps) {
  static const Dataset d = SyntheticClassification(320, 1, 28, 28, 10, /*seed=*/13);
  return test::Batches(d, cnn, kBatch, steps, /*order_seed=*/7);
}

std::unique_ptr<jit::CpuExecutor> MakeExecutor(const dsl::Program& p, const TensorMap& init, bool copies) {
  jit::CpuExecutorOptions o;
  o.bf16_weight_copies = copies;
  return std::make_unique<jit::CpuExecutor>(p.step, init, o);
}

// Every variable of the logical state, bit for bit; and no copy among them.
void CheckSameState(const TensorMap& want, const TensorMap& got) {
  REQUIRE(want.size() == got.size());
  for (const auto& [name, t] : want) {
    INFO("variable " << name);
    REQUIRE(got.count(name) == 1);
    CHECK(t == got.at(name));
  }
  for (const auto& [name, t] : got) CHECK(name.find(jit::kBf16CopySuffix) == std::string::npos);
}

// Weights scaled by `by` (a load of the state that changes them between steps).
TensorMap Scaled(TensorMap state, float by) {
  for (auto& [name, t] : state)
    if (name.find(".w") != std::string::npos && name.find('/') == std::string::npos)
      for (float& x : t.f32) x *= by;
  return state;
}

}  // namespace

TEST_CASE("bf16 weight copies: written by the update's loop, in place, the steps' bits unchanged", "[jit][bf16]") {
  for (bool cnn : {false, true}) {
    INFO((cnn ? "cnn" : "mlp"));
    const dsl::Program p = Build(cnn, 1, false);
    const TensorMap init = InitLogicalState(p.step);
    auto with = MakeExecutor(p, init, true), without = MakeExecutor(p, init, false);
    const jit::CompiledStep& step = with->compiled();
    // Every matmul or convolution weight (not the biases): fc1..fc3.w; the CNN's conv1.w, conv2.w, fc1.w, fc2.w.
    const int weights = cnn ? 4 : 3;
    CHECK(step.info().bf16_weight_copies == weights);
    CHECK(without->compiled().info().bf16_weight_copies == 0);
    CHECK(step.info().in_place_updates == without->compiled().info().in_place_updates + weights);
    CHECK(step.info().swapped_bytes == without->compiled().info().swapped_bytes);
    // No step rounds a weight any more: nothing converts a variable to bf16.
    for (const ir::Instr& in : step.module().instrs)
      if (in.op == ir::OpCode::kConvert && in.type.dtype == ir::DType::kBF16)
        CHECK(step.module().at(in.operands[0]).op != ir::OpCode::kVariable);
    for (const auto& [copy, weight] : step.bf16_weight_copies()) CHECK(copy == weight + jit::kBf16CopySuffix);

    const auto batches = Batches(cnn, 6);
    for (size_t i = 0; i < batches.size(); ++i) {
      INFO("step " << i);
      if (i == 3) {  // the weights change between steps: the copies must follow
        const TensorMap changed = Scaled(with->LogicalState(), 0.5f);
        with->LoadLogicalState(changed);
        without->LoadLogicalState(changed);
      }
      CHECK(with->Step(batches[i]).at("loss") == without->Step(batches[i]).at("loss"));
      CheckSameState(without->LogicalState(), with->LogicalState());
    }
    CHECK_FALSE(with->LogicalState().at("fc1.w") == init.at("fc1.w"));
  }
}

TEST_CASE("bf16 weight copies at N = 2: per replica with a replicated update, none with a sharded one", "[jit][bf16]") {
  const auto batches = Batches(false, 5);
  for (bool shard : {false, true}) {
    INFO((shard ? "sharded" : "replicated"));
    const dsl::Program p = Build(false, 2, shard);
    const TensorMap init = InitLogicalState(p.step);
    auto with = MakeExecutor(p, init, true), without = MakeExecutor(p, init, false);
    // The sharded update assigns each weight from its all-gather: no loop to write a copy.
    CHECK(with->compiled().info().bf16_weight_copies == (shard ? 0 : 3));
    for (const auto& batch : batches) CHECK(with->Step(batch).at("loss") == without->Step(batch).at("loss"));
    CheckSameState(without->LogicalState(), with->LogicalState());
  }
}

TEST_CASE("Bf16WeightCopies leaves f32 steps, unassigned weights and forward modules alone", "[jit][bf16]") {
  dsl::Model m("mlp", 3);
  models::ModelOptions mo;
  mo.batch = kBatch;
  mo.hidden = {32};
  dsl::Tensor loss = models::DefineMlp(m, mo);
  const ir::Module f32_step = m.train(loss).optimizer(dsl::Adam()).build().step;
  ir::Module rewritten = f32_step;
  CHECK(jit::Bf16WeightCopies(rewritten).empty());
  CHECK(rewritten == f32_step);
  // A bf16 step without its assignments (as an evaluation's forward): nothing to write a copy.
  dsl::Model m2("mlp", 3);
  ir::Module bf16_step = m2.train(models::DefineMlp(m2, mo)).optimizer(dsl::Adam()).precision("bf16").build().step;
  ir::Module forward = bf16_step;
  forward.assigns.clear();
  CHECK(jit::Bf16WeightCopies(forward).empty());
  CHECK(jit::Bf16WeightCopies(bf16_step).size() == 2);
}
