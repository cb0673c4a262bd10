// Runs the `shardstep` binary for the CLI tests: its status and its merged stdout + stderr.
#pragma once

#include <catch2/catch.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

namespace cli_test {

struct Result {
  int status;
  std::string output;
};

// Runs `command` with sh; the status is the exit code, or 128 + the signal.
inline Result Shell(const std::string& command) {
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), out};
}

inline std::string Binary() { return std::string(SS_BINARY_DIR) + "/shardstep"; }

inline Result Run(const std::string& args) { return Shell(Binary() + " " + args); }

// A fresh directory for one test case, removed by the destructor.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string& tag) {
    path = (std::filesystem::temp_directory_path() / ("ss_" + tag + "_" + std::to_string(getpid()))).string();
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string Write(const std::string& name, const std::string& text) const {
    std::string p = path + "/" + name;
    std::ofstream(p) << text;
    return p;
  }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
};

// The text of a file ("" when missing).
inline std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace cli_test
