// bench/mlperf: a run that cannot reach its target within its step budget logs run_stop "aborted" (with
// the reason) as the last line of a still compliant log and exits non-zero; so does a run whose data
// cannot be read (bad text file, bad image directory) or whose loss becomes non-finite, with the error in
// run_stop's metadata.
#include <catch2/catch.hpp>

#include "runtime/mllog_check.h"
#include "tests/mlperf/mlperf_util.h"
#include "tests/test_util.h"

using namespace mlperf_test;

TEST_CASE("a run that misses its target within the step budget is aborted") {
  shardstep::testing::TempDir dir;
  const std::string log = dir / "run.log";
  // 0.01 bits per character is out of reach in 4 steps.
  const RunResult r = Run("mlperf_transformer", SmokeArgs(4, 0.01) + " --log " + log + " --out-dir " + dir.path);
  INFO(r.output);
  CHECK(r.status == 1);
  const std::string text = Slurp(log);
  INFO(text);
  for (const std::string& p : shardstep::runtime::CheckMlLog(text)) FAIL_CHECK(p);
  const auto rec = Records(text);
  REQUIRE(!rec.empty());
  CHECK(rec.back()["key"] == "run_stop");
  CHECK(rec.back()["metadata"]["status"] == "aborted");
  CHECK(rec.back()["metadata"]["error"].get<std::string>().find("step budget of 4 steps") != std::string::npos);
  CHECK(Count(rec, "eval_accuracy") == 2);  // steps 2 and 4
  const auto result = nlohmann::json::parse(Slurp(dir / "mlperf_transformer_result.json"));
  CHECK(result["all_reached_target"] == false);
  CHECK(result["time_to_train_s"].is_null());
  CHECK(result["runs"][0]["status"] == "aborted");
}

TEST_CASE("a bad data path aborts the run with the reason in the log") {
  shardstep::testing::TempDir dir;
  SECTION("text file") {
    const RunResult r = Run("mlperf_transformer", SmokeArgs(2, 7.0) + " --data /nonexistent/corpus.txt --log " +
                                                      dir / "run.log --out-dir " + dir.path);
    INFO(r.output);
    CHECK(r.status == 1);
    const auto rec = Records(Slurp(dir / "run.log"));
    REQUIRE(!rec.empty());
    CHECK(rec.back()["key"] == "run_stop");
    CHECK(rec.back()["metadata"]["status"] == "aborted");
    CHECK(rec.back()["metadata"]["error"].get<std::string>().find("/nonexistent/corpus.txt") != std::string::npos);
    CHECK(Count(rec, "init_stop") == 1);
    CHECK(Count(rec, "run_start") == 1);
    CHECK(Count(rec, "eval_accuracy") == 0);
  }
  SECTION("image directory") {
    const RunResult r = Run("mlperf_resnet", "--data /nonexistent/fashion --no-update-timing --log " + dir / "run.log" +
                                                 " --out-dir " + dir.path);
    INFO(r.output);
    CHECK(r.status == 1);
    const auto rec = Records(Slurp(dir / "run.log"));
    REQUIRE(!rec.empty());
    CHECK(rec.back()["metadata"]["status"] == "aborted");
    CHECK(rec.back()["metadata"]["error"].get<std::string>().find("/nonexistent/fashion") != std::string::npos);
    CHECK(Count(rec, "submission_benchmark") == 1);
  }
}

TEST_CASE("a non-finite loss aborts the run with the step in the reason") {
  shardstep::testing::TempDir dir;
  // A learning rate of 1e30 overflows the weights at the first update.
  const RunResult r = Run("mlperf_transformer", SmokeArgs(6, 7.0) + " --lr 1e30 --log " + dir / "run.log --out-dir " +
                                                    dir.path);
  INFO(r.output);
  CHECK(r.status == 1);
  const std::string text = Slurp(dir / "run.log");
  INFO(text);
  const auto rec = Records(text);
  REQUIRE(!rec.empty());
  CHECK(rec.back()["key"] == "run_stop");
  CHECK(rec.back()["metadata"]["status"] == "aborted");
  const std::string error = rec.back()["metadata"]["error"];
  CHECK((error.find("non-finite") != std::string::npos || error.find("nan") != std::string::npos));
  // Every interval opened before the crash is closed, run_stop is last: the log complies but for the
  // evaluation the crash came before.
  for (const std::string& p : shardstep::runtime::CheckMlLog(text))
    if (p.find("eval_accuracy never appears") == std::string::npos) FAIL_CHECK(p);
}
