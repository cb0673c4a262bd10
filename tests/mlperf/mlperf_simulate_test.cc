// bench/mlperf --simulate: an MLPerf-style binary predicts its recipe's step time and time to train on a
// TPU pod slice with the simulator `shardstep simulate` uses; for the same model, optimizer, mesh and
// per-core batch the two give the same step time, sharded and replicated. Time to train = steps x step
// time, the steps from the recipe's budget (labelled an upper bound) or from a real run's result JSON
// (--steps-from), converted by examples when the pod's global batch differs. Bad flags name themselves.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>

#include "tests/mlperf/mlperf_util.h"
#include "tests/test_util.h"

using namespace mlperf_test;
using Json = nlohmann::json;

namespace {

// `shardstep simulate --json` for the --smoke transformer recipe (mlperf_transformer.cc: transformer_lm,
// 1 block of width 32, 2 heads, context 32; AdamW lr 0.003, betas 0.9/0.99, wd 0.01, clip 1, 50 warm-up
// steps, cosine over 1200 steps to 0.1x; no non-finite guard, as the binary builds it).
Json CliSimulate(const std::string& mesh, int per_core_batch, const std::string& shard) {
  const std::string cmd = std::string(SS_BINARY_DIR) +
                          "/shardstep simulate --model transformer_lm --context 32 --layers 1 --width 32 --heads 2 "
                          "--mlp-width 128 --optimizer adamw --lr 0.003 --beta1 0.9 --beta2 0.99 --weight-decay 0.01 "
                          "--clip-norm 1 --schedule cosine --warmup-steps 50 --decay-steps 1200 --end-lr-factor 0.1 "
                          "--on-nonfinite ignore --json --mesh " +
                          mesh + " --per-core-batch " + std::to_string(per_core_batch) + " --shard-weight-update " +
                          shard + " 2>&1";
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = pclose(p);
  INFO(cmd << "\n" << out);
  REQUIRE(st == 0);
  return Json::parse(out.substr(out.find('{')));
}

Json Simulation(const std::string& dir) {
  const Json j = Json::parse(Slurp(dir + "/mlperf_transformer_result.json"));
  REQUIRE(j.contains("simulation"));
  return j["simulation"];
}

}  // namespace

TEST_CASE("mlperf_transformer --simulate gives shardstep simulate's step time and steps x step time to train") {
  shardstep::testing::TempDir dir;
  const RunResult r = Run("mlperf_transformer", "--smoke --simulate --mesh 2x1 --per-core-batch 2 --out-dir " + dir.path);
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK(r.output.find("upper bound") != std::string::npos);  // the steps are the budget, and it says so
  CHECK(r.output.find("evaluation is not modelled") != std::string::npos);
  const Json sim = Simulation(dir.path);
  CHECK(sim["replicas"] == 4);
  CHECK(sim["global_batch"] == 8);
  CHECK(sim["precision"] == "bf16");
  // The budget: 1200 steps at the smoke recipe's global batch 8 = the pod's global batch here.
  CHECK(sim["steps_to_target"] == 1200);
  CHECK(sim["steps_measured"] == false);
  for (const char* mode : {"replicated", "sharded"}) {
    INFO(mode);
    const Json cli = CliSimulate("2x1", 2, std::string(mode) == "sharded" ? "on" : "off");
    // The simulator's whole report (times as printed, FLOPs, memory, link traffic) is the CLI's, key by key.
    for (const auto& [key, value] : sim[mode]["simulation"].items()) {
      INFO(key);
      CHECK(cli[key] == value);
    }
    const double step_ms = sim[mode]["step_ms"];  // unrounded: the JSON report prints 6 digits
    CHECK(step_ms > 0);
    CHECK(step_ms == Approx(cli["step_ms"].get<double>()).epsilon(1e-5));
    CHECK(sim[mode]["weight_update_ms"].get<double>() == Approx(cli["weight_update_ms"].get<double>()).epsilon(1e-5));
    CHECK(sim[mode]["time_to_train_s"].get<double>() == Approx(1200 * step_ms / 1e3).epsilon(1e-12));
  }
  // Sharding divides the update's work among the 4 replicas.
  CHECK(sim["sharded"]["weight_update_ms"].get<double>() < sim["replicated"]["weight_update_ms"].get<double>());
  CHECK(sim["speedup"].get<double>() ==
        Approx(sim["replicated"]["step_ms"].get<double>() / sim["sharded"]["step_ms"].get<double>()));
}

TEST_CASE("mlperf_transformer --simulate --steps-from takes a real run's steps, converted by examples") {
  shardstep::testing::TempDir dir;
  // A result file as a training run writes it (kept: the simulation is added next to its runs).
  const Json result = {{"benchmark", "mlperf_transformer"},
                       {"runs",
                        {{{"seed", 0}, {"status", "success"}, {"steps", 100}, {"global_batch", 8}},
                         {{"seed", 1}, {"status", "success"}, {"steps", 140}, {"global_batch", 8}},
                         {{"seed", 2}, {"status", "aborted"}, {"steps", 9999}, {"global_batch", 8}}}}};
  std::ofstream(dir / "mlperf_transformer_result.json") << result.dump();
  const std::string from = " --steps-from " + dir / "mlperf_transformer_result.json";
  SECTION("same global batch: the measured steps") {
    const RunResult r = Run("mlperf_transformer", "--smoke --simulate --mesh 2x1 --per-core-batch 2 --out-dir " +
                                                      dir.path + from);
    INFO(r.output);
    REQUIRE(r.status == 0);
    const Json j = Json::parse(Slurp(dir / "mlperf_transformer_result.json"));
    CHECK(j["runs"].size() == 3);  // the run's result is kept
    const Json& sim = j["simulation"];
    CHECK(sim["steps_to_target"] == 120);  // the mean of the successful runs
    CHECK(sim["steps_measured"] == true);
    CHECK(sim["sharded"]["time_to_train_s"].get<double>() ==
          Approx(120 * sim["sharded"]["step_ms"].get<double>() / 1e3).epsilon(1e-12));
  }
  SECTION("4x the global batch: a quarter of the steps, labelled optimistic") {
    const RunResult r = Run("mlperf_transformer", "--smoke --simulate --mesh 2x2 --per-core-batch 2 --precision f32 "
                                                  "--out-dir " + dir.path + from);
    INFO(r.output);
    REQUIRE(r.status == 0);
    CHECK(r.output.find("optimistic") != std::string::npos);
    const Json sim = Simulation(dir.path);
    CHECK(sim["global_batch"] == 16);
    CHECK(sim["steps_to_target"] == 60);
    CHECK(sim["precision"] == "f32");
  }
}

TEST_CASE("mlperf --simulate: bad flags are errors that name the flag") {
  shardstep::testing::TempDir dir;
  auto fails_with = [&](const std::string& args, const std::string& text) {
    const RunResult r = Run("mlperf_transformer", "--smoke " + args + " --out-dir " + dir.path);
    INFO(args << "\n" << r.output);
    CHECK(r.status != 0);
    CHECK(r.output.find(text) != std::string::npos);
  };
  fails_with("--simulate --mesh 2y2 --per-core-batch 2", "--mesh");
  fails_with("--simulate --mesh 0x2 --per-core-batch 2", "--mesh");
  fails_with("--simulate --per-core-batch 2", "--mesh");
  fails_with("--simulate --mesh 2x2", "--per-core-batch");
  fails_with("--simulate --mesh 2x2 --per-core-batch 2 --hardware tpu-v9", "--hardware");
  fails_with("--mesh 2x2 --per-core-batch 2", "add --simulate");
  std::ofstream(dir / "other.json") << R"({"benchmark": "mlperf_bert", "runs": []})";
  fails_with("--simulate --mesh 2x1 --per-core-batch 2 --steps-from " + dir / "other.json", "not mlperf_transformer");
  std::ofstream(dir / "none.json") << R"({"benchmark": "mlperf_transformer", "runs": [{"status": "aborted", "steps": 4, "global_batch": 8}]})";
  fails_with("--simulate --mesh 2x1 --per-core-batch 2 --steps-from " + dir / "none.json", "no run in it reached the target");
}
