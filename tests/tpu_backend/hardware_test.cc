// Hardware tables (tpu_backend/hardware.h): the shipped TPU v3 table reads back its public numbers and
// agrees with what the sources derive from them; broken tables are errors naming the file, line and key.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>

#include "ir/error.h"
#include "tpu_backend/hardware.h"

using namespace shardstep;
using namespace shardstep::tpu;

TEST_CASE("the TPU v3 table holds the public numbers") {
  const HardwareTable t = FindHardwareTable("tpu-v3");
  CHECK(t.name == "tpu-v3");
  CHECK(t.cores_per_chip == 2);
  CHECK(t.mxus_per_core == 2);
  CHECK(t.mxu_dim == 128);
  CHECK(t.peak_bf16_flops_per_chip == 123e12);
  CHECK(t.hbm_bytes_per_chip == 32.0 * (1 << 30));
  CHECK(t.hbm_bytes_per_s_per_chip == 900e9);
  CHECK(t.links_per_chip == 4);
  CHECK(t.link.bytes_per_s == 100e9);
  CHECK(t.link.latency_s == Approx(1e-6));
  // The MXU clock the peak implies is the published ~940 MHz (Jouppi et al. 2020), within 1%.
  CHECK(t.ClockHz() == Approx(940e6).epsilon(0.01));
  // The pod's published bisection bandwidth (6.4 TB/s): 64 links cross a cut of the 32x32 torus.
  CHECK(64 * t.link.bytes_per_s == Approx(6.4e12));
  CHECK(t.PeakFlopsPerCore() == 61.5e12);
  const auto names = HardwareTableNames();
  CHECK(std::find(names.begin(), names.end(), "tpu-v3") != names.end());
  CHECK_THROWS_WITH(FindHardwareTable("tpu-v9"), Catch::Contains("--hardware: unknown hardware table 'tpu-v9'; known: ") &&
                                                     Catch::Contains("tpu-v3"));
}

TEST_CASE("a broken hardware table is an error naming its file, line and key") {
  const auto dir = std::filesystem::temp_directory_path() / "shardstep_hardware_test";
  std::filesystem::create_directories(dir);
  const std::string good_path = std::string(SS_SOURCE_DIR) + "/tpu_backend/hardware/tpu-v3.toml";
  std::ifstream in(good_path);
  const std::string good((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto with = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    const size_t at = text.find(from);
    REQUIRE(at != std::string::npos);
    text.replace(at, from.size(), to);
    const std::string path = (dir / "bad.toml").string();
    std::ofstream(path) << text;
    return path;
  };
  CHECK_THROWS_WITH(ReadHardwareTable(with("link_gbps = 100", "link_gbps = 0")),
                    Catch::Contains("bad.toml:") && Catch::Contains(": link_gbps must be positive, got 0"));
  CHECK_THROWS_WITH(ReadHardwareTable(with("link_gbps = 100", "link_gbps = -5.5")), Catch::Contains("must be positive"));
  CHECK_THROWS_WITH(ReadHardwareTable(with("link_gbps = 100", "link_gbps = \"fast\"")),
                    Catch::Contains("link_gbps must be a number, got 'fast'"));
  CHECK_THROWS_WITH(ReadHardwareTable(with("cores = 2 ", "cores = 2.5 ")), Catch::Contains("cores must be an integer"));
  CHECK_THROWS_WITH(ReadHardwareTable(with("link_gbps = 100", "link_gbs = 100")),
                    Catch::Contains("unknown key 'link_gbs' in [interconnect]; known: links_per_chip, link_gbps"));
  CHECK_THROWS_WITH(ReadHardwareTable(with("link_gbps = 100\n", "")), Catch::Contains("missing 'link_gbps' in [interconnect]"));
  CHECK_THROWS_WITH(ReadHardwareTable(with("[interconnect]", "[network]")),
                    Catch::Contains("is in table [network]; a hardware table has [chip] and [interconnect]"));
  // The line number is the key's line in the file.
  const std::string path = with("on_chip_gbps = 450", "on_chip_gbps = 0");
  int line = 0, n = 0;
  std::ifstream f(path);
  for (std::string l; std::getline(f, l);) {
    ++n;
    if (l.rfind("on_chip_gbps", 0) == 0) line = n;
  }
  CHECK_THROWS_WITH(ReadHardwareTable(path), Catch::Contains("bad.toml:" + std::to_string(line) + ": on_chip_gbps"));
  CHECK_THROWS_WITH(ReadHardwareTable((dir / "none.toml").string()), Catch::Contains("cannot read config file"));
  std::filesystem::remove_all(dir);
}
