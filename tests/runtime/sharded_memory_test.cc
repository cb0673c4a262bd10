// DESIGN §5: optimizer-state bytes per replica in sharded mode = replicated / N, plus at most N-1
// padding elements per tensor. Checked three ways: the step module's optimizer_state variables, the
// WeightUpdateSharder's report rows, and ir::PlanMemory.
#include <catch2/catch.hpp>
#include <sstream>

#include "dsl/dsl.h"
#include "ir/memory_plan.h"
#include "ir/printer.h"
#include "ir/passes/pipeline.h"
#include "ir/passes/weight_update_sharder.h"
#include "ir/shard_format.h"
#include "models/models.h"
#include "runtime/sharding.h"

using namespace shardstep;

namespace {

constexpr int64_t kBatch = 24;

struct Compiled {
  dsl::Program program;             // the DSL's build()
  ir::Module piped;                 // the same pipeline run by hand
  ir::ShardingReport report;
  bool have_report = false;
};

void Define(dsl::Model& m, bool cnn) {
  models::ModelOptions mo;
  mo.batch = kBatch;
  mo.hidden = {25, 10};
  mo.classes = 10;
  dsl::Tensor loss = cnn ? models::DefineCnn(m, mo) : models::DefineMlp(m, mo);
  m.train(loss);
}

Compiled Compile(const ir::OptimizerConfig& opt, int n, bool shard, bool cnn, bool gather_at_start = false) {
  Compiled c;
  {
    dsl::Model m(cnn ? "cnn" : "mlp", 1);
    models::ModelOptions mo;
    mo.batch = kBatch;
    mo.hidden = {25, 10};
    mo.classes = 10;
    dsl::Tensor loss = cnn ? models::DefineCnn(m, mo) : models::DefineMlp(m, mo);
    c.program = m.train(loss)
                    .optimizer(opt)
                    .replicas(n)
                    .shard_weight_update(shard)
                    .gather_weights_at_start(gather_at_start)
                    .build();
  }
  dsl::Model m(cnn ? "cnn" : "mlp", 1);
  Define(m, cnn);
  c.piped = m.lower(n);
  ir::PipelineOptions po;
  po.optimizer = opt;
  po.replicas = n;
  po.shard_weight_update = shard;
  po.gather_at_start = gather_at_start;
  ir::PassPipeline pipeline = ir::BuildTrainingPipeline(po);
  pipeline.OnPass([&](const ir::Pass& p, const ir::Module&) {
    if (auto* s = dynamic_cast<const ir::WeightUpdateSharder*>(&p)) {
      c.report = s->report();
      c.have_report = true;
    }
  });
  pipeline.Run(c.piped);
  return c;
}

int64_t RoleBytes(const ir::Module& m, const std::string& role) {
  int64_t b = 0;
  for (ir::ValueId v : m.VariablesWithRole(role)) b += m.at(v).type.bytes();
  return b;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

void CheckMemory(const std::string& label, const ir::OptimizerConfig& opt, bool cnn) {
  // The replicated program at N=1 gives the logical (full) sizes.
  const Compiled full = Compile(opt, 1, false, cnn);
  const ir::Module& ref = full.program.step;
  const int64_t full_state = RoleBytes(ref, ir::kRoleOptimizerState);
  const int64_t full_weights = RoleBytes(ref, ir::kRoleWeight);
  const int64_t step_bytes = RoleBytes(ref, ir::kRoleStep);
  const auto states = ref.VariablesWithRole(ir::kRoleOptimizerState);
  REQUIRE(!states.empty());
  REQUIRE(full_state > 0);

  for (int n : {2, 3, 4, 8}) {
    INFO(label << " at N=" << n);
    // The replicated program at N: every replica holds everything.
    const Compiled rep = Compile(opt, n, false, cnn);
    CHECK(RoleBytes(rep.program.step, ir::kRoleOptimizerState) == full_state);
    CHECK(ir::PlanMemory(rep.program.step).optimizer_state_bytes == full_state + step_bytes);

    const Compiled sh = Compile(opt, n, true, cnn);
    const ir::Module& step = sh.program.step;
    // The DSL's program and the hand-run pipeline are the same module.
    CHECK(ir::Print(step) == ir::Print(sh.piped));

    int64_t expected = 0, padded_elements = 0;
    int tensors = 0;
    for (ir::ValueId v : states) {
      const ir::Instr& logical = ref.at(v);
      const int64_t e = logical.type.elements();
      INFO("variable " << logical.name << " " << logical.type.ToString());
      REQUIRE(logical.type.rank() >= 1);
      expected += CeilDiv(e, n) * 4;
      padded_elements += CeilDiv(e, n) * n - e;
      ++tensors;
      // In the sharded module: a shard of ceil(E/N) elements, with its format recorded.
      const ir::ValueId sv = step.FindVariable(logical.name);
      REQUIRE(sv != ir::kNoValue);
      CHECK(step.at(sv).GetString("role") == std::string(ir::kRoleOptimizerState));
      CHECK(step.at(sv).type.elements() == CeilDiv(e, n));
      ir::ShardFormat f;
      REQUIRE(ir::ShardFormat::FromAttrs(step.at(sv), &f));
      CHECK(f.count == n);
      CHECK(f.logical == logical.type.shape);
      CHECK(f.padding == CeilDiv(e, n) * n - e);
      CHECK(f.padding <= n - 1);
    }
    const int64_t state_bytes = RoleBytes(step, ir::kRoleOptimizerState);
    CHECK(state_bytes == expected);
    // = replicated / N plus at most N-1 padding elements per tensor.
    CHECK(state_bytes * n == full_state + padded_elements * 4);
    CHECK(state_bytes * n >= full_state);
    CHECK(state_bytes * n <= full_state + int64_t{tensors} * (n - 1) * 4 * n);
    CHECK(state_bytes <= CeilDiv(full_state, n) + int64_t{tensors} * (n - 1) * 4);
    // Weights stay whole when they are gathered at the end of the step.
    CHECK(RoleBytes(step, ir::kRoleWeight) == full_weights);

    // PlanMemory: optimizer state (+ the replicated scalar step counter).
    const ir::MemoryPlan plan = ir::PlanMemory(step);
    CHECK(plan.optimizer_state_bytes == expected + step_bytes);
    CHECK(plan.weight_bytes == full_weights);

    // The sharder's report.
    REQUIRE(sh.have_report);
    CHECK(sh.report.group_size == n);
    int64_t report_state_after = 0, report_state_before = 0;
    int state_rows = 0;
    for (const ir::VariableShardingRow& row : sh.report.variables) {
      INFO("report row " << row.name << " (" << row.role << "): " << row.why);
      const ir::ValueId lv = ref.FindVariable(row.name);
      REQUIRE(lv != ir::kNoValue);
      const int64_t e = ref.at(lv).type.elements();
      if (row.role == ir::kRoleOptimizerState) {
        ++state_rows;
        CHECK(row.sharded);
        CHECK(row.bytes_before == e * 4);
        CHECK(row.bytes_after == CeilDiv(e, n) * 4);
        CHECK(row.padding == CeilDiv(e, n) * n - e);
        CHECK(row.format == std::string(ir::ShardFormat::For(ref.at(lv).type.shape, n).kind()));
        report_state_after += row.bytes_after;
        report_state_before += row.bytes_before;
      } else {
        CHECK_FALSE(row.sharded);
        CHECK(row.bytes_after == row.bytes_before);
      }
    }
    CHECK(state_rows == tensors);
    CHECK(report_state_before == full_state);
    CHECK(report_state_after == expected);
    // The printed table (what `shardstep compile --report` shows) says "yes" on those rows.
    std::istringstream table(sh.report.ToString());
    std::string line;
    int yes_rows = 0;
    while (std::getline(table, line)) {
      std::istringstream cols(line);
      std::string name, role, sharded;
      cols >> name >> role >> sharded;
      if (role == ir::kRoleOptimizerState) {
        INFO("report line: " << line);
        CHECK(sharded == "yes");
        ++yes_rows;
      }
    }
    CHECK(yes_rows == tensors);
  }
}

}  // namespace

TEST_CASE("Adam state per replica is 1/N plus padding (MLP)", "[memory][sharding]") {
  CheckMemory("adam mlp", dsl::Adam(), false);
}

TEST_CASE("momentum state per replica is 1/N plus padding (MLP)", "[memory][sharding]") {
  CheckMemory("momentum mlp", dsl::Momentum(), false);
}

TEST_CASE("Adam state per replica is 1/N plus padding (CNN)", "[memory][sharding]") {
  CheckMemory("adam cnn", dsl::Adam(), true);
}

TEST_CASE("other stateful optimizers shard their state too", "[memory][sharding]") {
  SECTION("adagrad") { CheckMemory("adagrad", dsl::Adagrad(), false); }
  SECTION("lamb") { CheckMemory("lamb", dsl::Lamb(), false); }
  SECTION("lars") { CheckMemory("lars", dsl::Lars(), false); }
}

TEST_CASE("with weights gathered at the start, weights are 1/N per replica too", "[memory][sharding]") {
  const Compiled full = Compile(dsl::Adam(), 1, false, false);
  for (int n : {2, 3, 4, 8}) {
    INFO("N=" << n);
    const Compiled sh = Compile(dsl::Adam(), n, true, false, /*gather_at_start=*/true);
    int64_t expected = 0;
    for (ir::ValueId v : full.program.step.VariablesWithRole(ir::kRoleWeight))
      expected += CeilDiv(full.program.step.at(v).type.elements(), n) * 4;
    CHECK(RoleBytes(sh.program.step, ir::kRoleWeight) == expected);
    CHECK(ir::PlanMemory(sh.program.step).weight_bytes == expected);
    for (const ir::VariableShardingRow& row : sh.report.variables) {
      INFO(row.name);
      if (row.role == ir::kRoleWeight || row.role == ir::kRoleOptimizerState) CHECK(row.sharded);
    }
  }
}
