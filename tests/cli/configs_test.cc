// Every shipped config (configs/*.toml) parses, is accepted by `shardstep train`, and passes the
// pre-flight checks and the step build (--dry-run): a broken config fails here, not hours into a run.
#include <filesystem>
#include <string>

#include "tests/cli/cli_util.h"

using namespace cli_test;
using Catch::Contains;

TEST_CASE("every shipped config passes a dry run") {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(SS_SOURCE_DIR) + "/configs")) {
    if (entry.path().extension() != ".toml") continue;
    ++count;
    auto r = Run("train --config " + entry.path().string() + " --dry-run");
    INFO(entry.path() << ":\n" << r.output);
    CHECK(r.status == 0);
    CHECK_THAT(r.output, Contains("dry run: model"));
  }
  CHECK(count >= 5);  // mlp, cnn, resnet20, transformer_lm, bert_small
}

TEST_CASE("dry runs check the task, the data and the options") {
  auto r = Run("train --model mlp --dataset kjv --dry-run");
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Contains("--dataset kjv is a text corpus; --model mlp classifies images"));
  r = Run("train --model transformer_lm --dataset synthetic --dry-run");
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Contains("--dataset synthetic holds images"));
  r = Run("train --model transformer_lm --context 32 --layers 1 --width 32 --heads 2 --dry-run");
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Contains("--dataset kjv (vocabulary "));
  CHECK_THAT(r.output, Contains("context 32"));
}

TEST_CASE("compile --report prints parameters, FLOPs per example and activation memory") {
  auto r = Run("compile --model mlp --hidden 8 --batch 4 --replicas 2 --report");
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.output, Contains("parameters: 6370\n"));  // 784*8 + 8 + 8*10 + 10
  // Per replica: 2 examples; the matmuls alone are 2*784*8 + 2*8*10 = 12704 FLOPs per example.
  CHECK_THAT(r.output, Contains("FLOPs per example: forward 12.8 KFLOP"));
  CHECK_THAT(r.output, Contains("per replica / 2 examples"));
  CHECK_THAT(r.output, Contains("matmul 12.7 KFLOP"));
  CHECK_THAT(r.output, Contains("activation memory per replica: "));
}
