// Replays every committed fuzz input through the fuzz targets' own entry points (fuzz/fuzz_entry.h)
// in the normal build: the crashes once found (fuzz/regressions/<target>/) and the seed corpora
// (fuzz/corpus/<target>/). An entry accepts an input or rejects it with shardstep::Error; anything
// else (another exception, an SS_CHECK or a broken round-trip property, which abort) fails here.
#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz/fuzz_entry.h"

// cli/ is not a library (its files make up the shardstep executable): the config reader is compiled
// in here, as in the fuzz target, with the same stand-in for ClosestMatch (see that file).
#include "cli/config_file.cc"
#include "fuzz/config_file_support.cc"

namespace fs = std::filesystem;

namespace {

std::vector<fs::path> FilesIn(const fs::path& dir) {
  std::vector<fs::path> files;
  if (fs::is_directory(dir))
    for (const auto& e : fs::directory_iterator(dir))
      if (e.is_regular_file() && e.path().extension() != ".md") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

std::string ReadBytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// Feeds every regression input and seed of `target` to `entry`; returns how many there were.
template <typename Entry>
size_t Replay(const std::string& target, Entry entry) {
  const fs::path fuzz = fs::path(SS_SOURCE_DIR) / "fuzz";
  size_t n = 0;
  for (const char* kind : {"regressions", "corpus"}) {
    for (const fs::path& p : FilesIn(fuzz / kind / target)) {
      INFO(p.string());
      const std::string bytes = ReadBytes(p);
      REQUIRE_NOTHROW(entry(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
      ++n;
    }
  }
  return n;
}

}  // namespace

TEST_CASE("fuzz inputs: IR text parser, verifier and printer round trip") {
  CHECK(Replay("ir_parser", shardstep::fuzz::FuzzIrParser) > 0);
}

TEST_CASE("fuzz inputs: safetensors reader") {
  CHECK(Replay("safetensors", shardstep::fuzz::FuzzSafetensors) > 0);
}

TEST_CASE("fuzz inputs: IDX reader") {
  CHECK(Replay("idx", shardstep::fuzz::FuzzIdx) > 0);
}

TEST_CASE("fuzz inputs: config-file reader") {
  CHECK(Replay("config_file", shardstep::fuzz::FuzzConfigFile) > 0);
}
