// The MLPerf training log (runtime/mllog.h) and its checker (runtime/mllog_check.h): a complete run's
// log complies; each rule broken on its own is reported with its line.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "ir/error.h"
#include "runtime/mllog.h"
#include "runtime/mllog_check.h"

using namespace shardstep;
using namespace shardstep::runtime;
namespace ml = shardstep::runtime::mllog;

namespace {

// What to break in the run's log (one at a time).
enum class Break {
  kNothing, kNoSeed, kTwoRunStarts, kUnclosedBlock, kCrossedIntervals, kTimeBackwards, kNoStatus, kLineAfterStop,
  kRunBeforeInit, kBadDivision, kEpochWithoutNum, kEvalOutsideRun, kNoEvalAccuracy, kBadBenchmark
};

// A short run: 2 blocks of one epoch each, an evaluation after each; time advances 5 ms a line
// (backwards once for kTimeBackwards).
std::string RunLog(Break b) {
  std::ostringstream os;
  int64_t now = 1000;
  bool backwards = b == Break::kTimeBackwards;
  MlLog log(&os, [&] {
    now += 5;
    if (backwards && now > 1050) now -= 20, backwards = false;
    return now;
  });
  log.Event(ml::kSubmissionBenchmark, b == Break::kBadBenchmark ? "resnet20" : "resnet");
  log.Event(ml::kSubmissionOrg, "shardstep");
  log.Event(ml::kSubmissionDivision, b == Break::kBadDivision ? "closed-ish" : "open");
  log.Event(ml::kSubmissionStatus, "research");
  log.Event(ml::kSubmissionPlatform, "2-core CPU");
  log.Event(ml::kCacheClear, true);
  if (b == Break::kRunBeforeInit) log.Start(ml::kRunStart);
  log.Start(ml::kInitStart);
  if (b != Break::kNoSeed) log.Event(ml::kSeed, 7);
  log.Event(ml::kGlobalBatchSize, 128);
  log.Event(ml::kTrainSamples, 60000);
  log.Event(ml::kEvalSamples, 10000);
  log.Event(ml::kOptBaseLearningRate, 0.1);
  log.End(ml::kInitStop);
  if (b != Break::kRunBeforeInit) log.Start(ml::kRunStart);
  if (b == Break::kTwoRunStarts) log.Event(ml::kRunStart);
  for (int epoch = 0; epoch < 2; ++epoch) {
    log.Start(ml::kBlockStart, nullptr, {{"first_epoch_num", epoch}, {"epoch_count", 1}});
    log.Start(ml::kEpochStart, nullptr, b == Break::kEpochWithoutNum ? MlLog::Json{} : MlLog::Json{{"epoch_num", epoch}});
    if (b == Break::kCrossedIntervals && epoch == 1) log.End(ml::kBlockStop, nullptr, {{"first_epoch_num", epoch}});
    log.End(ml::kEpochStop, nullptr, {{"epoch_num", epoch}});
    if (!(b == Break::kUnclosedBlock && epoch == 1) && !(b == Break::kCrossedIntervals && epoch == 1))
      log.End(ml::kBlockStop, nullptr, {{"first_epoch_num", epoch}});
    log.Start(ml::kEvalStart, nullptr, {{"epoch_num", epoch}});
    if (b != Break::kNoEvalAccuracy) log.Event(ml::kEvalAccuracy, 0.9 + 0.01 * epoch, {{"epoch_num", epoch}});
    log.End(ml::kEvalStop, nullptr, {{"epoch_num", epoch}});
  }
  log.End(ml::kRunStop, nullptr, b == Break::kNoStatus ? MlLog::Json{} : MlLog::Json{{"status", "success"}});
  if (b == Break::kLineAfterStop) log.Event(ml::kEvalAccuracy, 0.95, {{"epoch_num", 2}});
  if (b == Break::kEvalOutsideRun) log.Event(ml::kEvalAccuracy, 0.95, {{"epoch_num", 2}});
  return os.str();
}

std::string Joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + "\n";
  return s;
}

}  // namespace

TEST_CASE("a run's MLPerf log has the reference format and complies") {
  const std::string text = RunLog(Break::kNothing);
  INFO(text);
  INFO(Joined(CheckMlLog(text)));
  CHECK(CheckMlLog(text).empty());
  std::istringstream in(text);
  std::string line;
  int lines = 0;
  int64_t last = 0;
  while (std::getline(in, line)) {
    ++lines;
    REQUIRE(line.rfind(":::MLLOG {", 0) == 0);
    const auto j = nlohmann::json::parse(line.substr(9));
    CHECK(j["namespace"] == "");
    CHECK(j["time_ms"].get<int64_t>() > last);
    last = j["time_ms"];
    CHECK(j["metadata"]["file"] == "mllog_test.cc");
    CHECK(j["metadata"]["lineno"].get<int>() > 0);
  }
  CHECK(lines == 29);
  // The fields in the reference logger's order, and the caller's line recorded.
  std::ostringstream os;
  MlLog log(&os, [] { return int64_t{42}; });
  log.Event(ml::kSeed, 3); const int here = __LINE__;
  CHECK(os.str() == ":::MLLOG {\"namespace\":\"\",\"time_ms\":42,\"event_type\":\"POINT_IN_TIME\",\"key\":\"seed\","
                    "\"value\":3,\"metadata\":{\"file\":\"mllog_test.cc\",\"lineno\":" + std::to_string(here) + "}}\n");
  CHECK_THROWS_WITH(log.Event("x", 1, 5), Catch::Contains("metadata must be a JSON object"));
}

TEST_CASE("each broken rule is named with its line") {
  const std::vector<std::pair<Break, const char*>> cases = {
      {Break::kNoSeed, "seed appears 0 times"},
      {Break::kTwoRunStarts, "run_start: an interval key logged as POINT_IN_TIME"},
      {Break::kUnclosedBlock, "block_start is never closed"},
      {Break::kCrossedIntervals, "block_stop while epoch_start"},
      {Break::kTimeBackwards, "is before the previous line's"},
      {Break::kNoStatus, "run_stop without metadata status"},
      {Break::kLineAfterStop, "a line after run_stop"},
      {Break::kRunBeforeInit, "run_start before init_stop"},
      {Break::kBadDivision, "submission_division must be closed or open"},
      {Break::kEpochWithoutNum, "epoch_start without metadata epoch_num"},
      {Break::kEvalOutsideRun, "run_stop is not the last line"},
      {Break::kNoEvalAccuracy, "eval_accuracy never appears"},
      {Break::kBadBenchmark, "\"resnet20\" is not an MLPerf training benchmark"},
  };
  for (const auto& [b, expected] : cases) {
    const auto problems = CheckMlLog(RunLog(b));
    INFO(expected << "\n" << Joined(problems));
    CHECK(Joined(problems).find(expected) != std::string::npos);
    CHECK(Joined(problems).find("line ") == 0);
  }
  // Lines that are not JSON, or lack fields, are named too; other output between lines is ignored.
  std::string text = RunLog(Break::kNothing);
  CHECK(CheckMlLog("progress: step 10\n" + text).empty());
  CHECK(Joined(CheckMlLog(":::MLLOG {not json\n" + text)).find("line 1: not one JSON object") == 0);
  CHECK(Joined(CheckMlLog(":::MLLOG {\"key\":\"seed\"}\n" + text)).find("line 1: no \"namespace\"") == 0);
}

TEST_CASE("the log file is created or the error names it") {
  const auto dir = std::filesystem::temp_directory_path() / "shardstep_mllog_test";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "run.log").string();
  {
    auto log = MlLog::OpenFile(path);
    log->Event(ml::kSeed, 1);
  }
  std::ifstream in(path);
  std::string line;
  REQUIRE(std::getline(in, line));
  CHECK(line.find("\"key\":\"seed\"") != std::string::npos);
  CHECK_THROWS_WITH(MlLog::OpenFile((dir / "no" / "such" / "dir.log").string()),
                    Catch::Contains("cannot write the MLPerf log") && Catch::Contains("dir.log"));
  std::filesystem::remove_all(dir);
}
