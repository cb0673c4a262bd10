// `shardstep train --backend tpu-mesh --mesh XxY`: trains on 2·X·Y emulated cores; --mesh with another
// backend or with a conflicting --replicas is an error naming both flags.
#include <catch2/catch.hpp>

#include "tests/cli/cli_util.h"

using cli_test::Run;

namespace {
const std::string kFlags = "train --model mlp --hidden 16 --dataset synthetic --steps 3 --eval-batch 250 ";
const std::string kSmall = kFlags + "--batch 16 ";
}

TEST_CASE("train --backend tpu-mesh --mesh 1x2 trains on 4 emulated cores") {
  auto r = Run(kSmall + "--backend tpu-mesh --mesh 1x2");
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Catch::Contains("4 replica(s)") && Catch::Contains("backend tpu-mesh"));
  CHECK_THAT(r.output, Catch::Contains("final: loss"));
}

TEST_CASE("--mesh conflicts are errors naming the flags") {
  auto r = Run(kSmall + "--backend tpu-mesh --mesh 1x2 --replicas 2");
  INFO(r.output);
  CHECK(r.status != 0);
  CHECK_THAT(r.output, Catch::Contains("--mesh 1x2 means 4 replicas") && Catch::Contains("--replicas is 2"));
  r = Run(kSmall + "--backend cpu --mesh 1x2");
  CHECK(r.status != 0);
  CHECK_THAT(r.output, Catch::Contains("--mesh 1x2 is for --backend tpu-mesh"));
  r = Run(kSmall + "--backend tpu-mesh --mesh 0x2");
  CHECK(r.status != 0);
  CHECK_THAT(r.output, Catch::Contains("--mesh"));
  r = Run(kFlags + "--backend tpu-mesh --replicas 3 --batch 15");
  CHECK(r.status != 0);
  CHECK_THAT(r.output, Catch::Contains("3 replicas do not fill a mesh"));
}
