// `shardstep train --mllog FILE`: the MLPerf training log of a run complies with the MLCommons rules
// (runtime/mllog_check.h), has one evaluation per --eval-every interval inside the run, and ends with
// run_stop "success"; a run that fails before or during training ends its log with run_stop "aborted"
// and the reason, and exits non-zero.
#include <catch2/catch.hpp>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "runtime/mllog_check.h"
#include "tests/cli/cli_util.h"

using cli_test::Run;

namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The log's records, in order.
std::vector<nlohmann::json> Records(const std::string& text) {
  std::vector<nlohmann::json> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(":::MLLOG ", 0) == 0) out.push_back(nlohmann::json::parse(line.substr(9)));
  return out;
}

int Count(const std::vector<nlohmann::json>& r, const std::string& key) {
  int n = 0;
  for (const auto& j : r) n += j["key"] == key;
  return n;
}

}  // namespace

TEST_CASE("train --mllog writes a compliant MLPerf log of the run") {
  cli_test::TempDir dir("mllog");
  const std::string log = dir.path + "/run.log";
  const auto r = Run("train --model mlp --hidden 32 --dataset synthetic --steps 30 --batch 32 --eval-every 10 "
                     "--eval-batch 400 --seed 7 --optimizer lamb --lr 0.01 --mllog " + log);
  INFO(r.output);
  REQUIRE(r.status == 0);
  const std::string text = Slurp(log);
  INFO(text);
  const auto problems = shardstep::runtime::CheckMlLog(text);
  for (const auto& p : problems) FAIL_CHECK(p);
  const auto rec = Records(text);
  REQUIRE(!rec.empty());
  CHECK(rec.back()["key"] == "run_stop");
  CHECK(rec.back()["metadata"]["status"] == "success");
  CHECK(Count(rec, "eval_accuracy") == 3);  // steps 10, 20, 30
  CHECK(Count(rec, "block_start") == 3);
  for (const auto& j : rec) {
    if (j["key"] == "seed") CHECK(j["value"] == 7);
    if (j["key"] == "global_batch_size") CHECK(j["value"] == 32);
    if (j["key"] == "train_samples") CHECK(j["value"] == 30 * 32);
    if (j["key"] == "eval_samples") CHECK(j["value"] == 2000);  // the synthetic test split, 5 batches of 400
    if (j["key"] == "opt_name") CHECK(j["value"] == "lamb");
    if (j["key"] == "submission_division") CHECK(j["value"] == "open");
    if (j["key"] == "eval_accuracy") {
      CHECK(j["value"].get<double>() > 0);
      CHECK(j["metadata"]["samples_count"] == j["metadata"]["step_num"].get<int>() * 32);
    }
  }
}

TEST_CASE("a run that fails ends its MLPerf log with run_stop aborted and the reason") {
  cli_test::TempDir dir("mllog_abort");
  SECTION("before training: a missing data directory") {
    const std::string log = dir.path + "/bad_data.log";
    const auto r = Run("train --model mlp --dataset fashion-mnist --data-dir " + dir.path + "/none --mllog " + log);
    CHECK(r.status != 0);
    const auto rec = Records(Slurp(log));
    REQUIRE(!rec.empty());
    CHECK(rec.back()["key"] == "run_stop");
    CHECK(rec.back()["metadata"]["status"] == "aborted");
    CHECK(rec.back()["metadata"]["error"].get<std::string>().find("--data-dir") != std::string::npos);
  }
  SECTION("during training: a non-finite loss") {
    const std::string log = dir.path + "/nan.log";
    const auto r = Run("train --model mlp --hidden 32 --dataset synthetic --steps 30 --batch 32 --eval-batch 400 "
                       "--optimizer sgd --lr 1e30 --mllog " + log);
    CHECK(r.status != 0);
    const std::string text = Slurp(log);
    INFO(text);
    const auto rec = Records(text);
    REQUIRE(!rec.empty());
    CHECK(rec.back()["key"] == "run_stop");
    CHECK(rec.back()["metadata"]["status"] == "aborted");
    CHECK(rec.back()["metadata"]["error"].get<std::string>().find("non-finite") != std::string::npos);
    CHECK(Count(rec, "run_start") == 1);
    // Intervals are still closed and nested: the only problems are what an aborted run lacks.
    for (const auto& p : shardstep::runtime::CheckMlLog(text)) CHECK(p.find("eval_accuracy never appears") != std::string::npos);
  }
  SECTION("a SIGTERM between steps") {
    const std::string log = dir.path + "/term.log";
    // The run would take minutes; it is stopped once its first block has started (polled, 20 s at most).
    const auto r = cli_test::Shell(cli_test::Binary() +
                                   " train --model mlp --hidden 32 --dataset synthetic --steps 1000000 --batch 32 "
                                   "--eval-batch 400 --eval-every 1000000 --mllog " + log + " > /dev/null & pid=$!; "
                                   "for i in $(seq 200); do grep -q block_start " + log +
                                   " 2>/dev/null && break; sleep 0.1; done; kill -TERM $pid; wait $pid; echo status=$?");
    INFO(r.output);
    CHECK(r.output.find("status=0") == std::string::npos);
    CHECK(r.output.find("status=") != std::string::npos);
    const std::string text = Slurp(log);
    INFO(text);
    const auto rec = Records(text);
    REQUIRE(!rec.empty());
    CHECK(rec.back()["key"] == "run_stop");
    CHECK(rec.back()["metadata"]["status"] == "aborted");
    CHECK(rec.back()["metadata"]["error"].get<std::string>().find("stopped by SIGTERM") != std::string::npos);
    for (const auto& p : shardstep::runtime::CheckMlLog(text)) CHECK(p.find("eval_accuracy never appears") != std::string::npos);
  }
}

TEST_CASE("check-mllog passes a run's log and locates what is wrong in a damaged one") {
  cli_test::TempDir dir("checkmllog");
  const std::string log = dir.path + "/run.log", damaged = dir.path + "/damaged.log";
  const auto r = Run("train --model mlp --hidden 16 --dataset synthetic --steps 4 --batch 16 --eval-every 2 "
                     "--eval-batch 200 --mllog " + log);
  REQUIRE(r.status == 0);
  const auto ok = Run("check-mllog " + log);
  INFO(ok.output);
  CHECK(ok.status == 0);
  CHECK(ok.output.find(log + ": ok (") != std::string::npos);

  // Damaged: the last line (run_stop) dropped and the third line cut in half.
  std::vector<std::string> lines;
  {
    std::istringstream in(Slurp(log));
    for (std::string line; std::getline(in, line);) lines.push_back(line);
  }
  REQUIRE(lines.size() > 5);
  lines.pop_back();
  lines[2] = lines[2].substr(0, lines[2].size() / 2);
  {
    std::ofstream out(damaged);
    for (const std::string& l : lines) out << l << "\n";
  }
  const auto bad = Run("check-mllog " + log + " " + damaged);
  INFO(bad.output);
  CHECK(bad.status == 1);
  CHECK(bad.output.find(log + ": ok (") != std::string::npos);
  CHECK(bad.output.find(damaged + ":3:") != std::string::npos);  // the cut line, located
  CHECK(bad.output.find("run_stop") != std::string::npos);

  const auto missing = Run("check-mllog " + dir.path + "/none.log");
  CHECK(missing.status == 1);
  CHECK(missing.output.find("none.log: cannot open the log") != std::string::npos);
}
