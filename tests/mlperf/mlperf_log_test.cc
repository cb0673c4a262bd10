// bench/mlperf: a short run of mlperf_transformer (--smoke) writes an MLPerf log that complies with the
// MLCommons training rules (runtime/mllog_check.h: valid JSON, the required keys as often as the rules
// say, intervals nested and closed, time non-decreasing, run_stop last with its status), stops at the
// first evaluation that reaches the target, and writes its result JSON and quality SVG. (--seeds:
// mlperf_seeds_slow_test.cc.)
#include <catch2/catch.hpp>

#include <filesystem>

#include "bench/mlperf/mlperf_common.h"
#include "runtime/mllog_check.h"
#include "tests/mlperf/mlperf_util.h"
#include "tests/test_util.h"

using namespace mlperf_test;

TEST_CASE("mlperf_transformer logs a compliant run that stops at its target") {
  shardstep::testing::TempDir dir;
  const std::string log = dir / "run.log";
  // Bits per character start near log2(vocabulary) ~ 6: a target of 7 is reached at the first evaluation.
  const RunResult r = Run("mlperf_transformer", SmokeArgs(6, 7.0) + " --seed 5 --log " + log + " --out-dir " + dir.path);
  INFO(r.output);
  REQUIRE(r.status == 0);
  const std::string text = Slurp(log);
  INFO(text);
  for (const std::string& p : shardstep::runtime::CheckMlLog(text)) FAIL_CHECK(p);
  const auto rec = Records(text);
  REQUIRE(rec.size() > 10);
  CHECK(rec.back()["key"] == "run_stop");
  CHECK(rec.back()["metadata"]["status"] == "success");
  CHECK(Count(rec, "eval_accuracy") == 1);  // stopped at step 2, not 6
  CHECK(Count(rec, "block_start") == 1);
  CHECK(Count(rec, "init_start") == 1);
  for (const auto& j : rec) {
    if (j["key"] == "submission_benchmark") CHECK(j["value"] == "gpt3");
    if (j["key"] == "submission_division") CHECK(j["value"] == "open");
    if (j["key"] == "seed") CHECK(j["value"] == 5);
    if (j["key"] == "global_batch_size") CHECK(j["value"] == 8);
    if (j["key"] == "opt_name") CHECK(j["value"] == "adamw");
    if (j["key"] == "eval_accuracy") {
      CHECK(j["metadata"]["step_num"] == 2);
      CHECK(j["value"].get<double>() < 7.0);
      CHECK(j["value"].get<double>() > 3.0);
    }
  }
  const auto result = nlohmann::json::parse(Slurp(dir / "mlperf_transformer_result.json"));
  CHECK(result["all_reached_target"] == true);
  REQUIRE(result["runs"].size() == 1);
  CHECK(result["runs"][0]["steps"] == 2);
  CHECK(result["runs"][0]["status"] == "success");
  CHECK(result["time_to_train_s"].get<double>() == Approx(result["runs"][0]["seconds"].get<double>()));
  CHECK(result["optimizer_state_bytes_per_replica"].get<int64_t>() > 0);
  CHECK(Slurp(dir / "mlperf_transformer_quality.svg").rfind("<svg", 0) == 0);
}

TEST_CASE("OlympicMean drops the fastest and the slowest run from 3 on") {
  using shardstep::mlperf::OlympicMean;
  CHECK(OlympicMean({10.0}) == 10.0);
  CHECK(OlympicMean({10.0, 20.0}) == 15.0);
  CHECK(OlympicMean({30.0, 10.0, 20.0}) == 20.0);
  CHECK(OlympicMean({1.0, 100.0, 3.0, 5.0, 4.0}) == Approx(4.0));
}
