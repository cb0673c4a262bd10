// Shared test helpers: TempDir, a fresh directory under /tmp that is removed with everything in it.
#pragma once

#include <errno.h>  // program_invocation_short_name (glibc)
#include <stdlib.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>
#include <string>
#include <vector>

namespace shardstep::testing {

// A new directory /tmp/<prefix>.XXXXXX; the prefix defaults to "ss_" + the test binary's name
// (e.g. /tmp/ss_checkpoint_test.Ab12Cd), so a leftover directory says which test made it.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string& prefix = std::string("ss_") + program_invocation_short_name) {
    std::string tmpl = "/tmp/" + prefix + ".XXXXXX";
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return path + "/" + name; }
  // The names of the entries in the directory, sorted.
  std::vector<std::string> Files() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(path)) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  }
};

}  // namespace shardstep::testing
