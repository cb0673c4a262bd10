// tpu_backend/hardware_dirs.h: the hardware tables are found by $SHARDSTEP_HARDWARE_DIR, then next to an
// installed program (<bin>/../share/shardstep/hardware), then in the source tree, then under the configured
// install prefix. (That an install puts the tables there and its `shardstep simulate` reads them:
// tests/downstream/run_downstream.cmake.)
#include <catch2/catch.hpp>

#include <stdlib.h>

#include <algorithm>
#include <filesystem>

#include "tests/test_util.h"
#include "tpu_backend/hardware.h"
#include "tpu_backend/hardware_dirs.h"

using namespace shardstep::tpu;

namespace {

// Sets $SHARDSTEP_HARDWARE_DIR for the scope (unset: "").
struct ScopedEnv {
  explicit ScopedEnv(const std::string& value) {
    if (value.empty()) unsetenv("SHARDSTEP_HARDWARE_DIR");
    else setenv("SHARDSTEP_HARDWARE_DIR", value.c_str(), 1);
  }
  ~ScopedEnv() { unsetenv("SHARDSTEP_HARDWARE_DIR"); }
};

}  // namespace

TEST_CASE("hardware tables: installed layout next to the program, then the source tree, then the prefix") {
  ScopedEnv env("");
  const std::string source = std::string(SS_SOURCE_DIR) + "/tpu_backend/hardware";
  const std::vector<std::string> dirs = HardwareTableSearchPath();
  INFO(dirs.size());
  REQUIRE(dirs.size() == 3);
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe").parent_path().string();
  CHECK(dirs[0] == (std::filesystem::path(exe) / ".." / "share/shardstep/hardware").lexically_normal().string());
  CHECK(dirs[1] == source);
  CHECK(dirs[2].size() > std::string("/share/shardstep/hardware").size());
  CHECK(dirs[2].substr(dirs[2].size() - 25) == "/share/shardstep/hardware");
  // A test program of the build tree has no share/ next to it: the source tree's tables.
  CHECK(HardwareTableDir() == source);
  CHECK(FindHardwareTable("tpu-v3").path == source + "/tpu-v3.toml");
}

TEST_CASE("hardware tables: $SHARDSTEP_HARDWARE_DIR comes first, and must hold a table") {
  shardstep::testing::TempDir dir;
  std::filesystem::copy_file(std::string(SS_SOURCE_DIR) + "/tpu_backend/hardware/tpu-v3.toml", dir / "tpu-x.toml");
  {
    ScopedEnv env(dir.path);
    CHECK(HardwareTableSearchPath().front() == dir.path);
    CHECK(HardwareTableDir() == dir.path);
    CHECK(HardwareTableNames() == std::vector<std::string>{"tpu-x"});
    CHECK(FindHardwareTable("tpu-x").cores_per_chip == 2);
    CHECK_THROWS_WITH(FindHardwareTable("tpu-v3"), Catch::Contains("unknown hardware table 'tpu-v3'; known: tpu-x") &&
                                                       Catch::Contains(dir.path));
  }
  std::filesystem::remove(dir / "tpu-x.toml");
  ScopedEnv env(dir.path);
  CHECK_THROWS_WITH(HardwareTableDir(), Catch::Contains("SHARDSTEP_HARDWARE_DIR=" + dir.path) &&
                                            Catch::Contains("holds no hardware table"));
}
