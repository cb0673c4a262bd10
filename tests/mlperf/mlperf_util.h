// Helpers of the MLPerf binaries' tests: run a binary of build/bench with arguments (its output and exit
// status), read a file, the :::MLLOG records of a log.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace mlperf_test {

struct RunResult {
  int status = -1;
  std::string output;  // stdout and stderr
};

// build/bench/<binary> <args>, stderr joined to stdout.
inline RunResult Run(const std::string& binary, const std::string& args) {
  const std::string cmd = std::string(SS_BINARY_DIR) + "/bench/" + binary + " " + args + " 2>&1";
  RunResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

inline std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::vector<nlohmann::json> Records(const std::string& text) {
  std::vector<nlohmann::json> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(":::MLLOG ", 0) == 0) out.push_back(nlohmann::json::parse(line.substr(9)));
  return out;
}

inline int Count(const std::vector<nlohmann::json>& r, const std::string& key) {
  int n = 0;
  for (const auto& j : r) n += j["key"] == key;
  return n;
}

// A short smoke run of the transformer benchmark: 1-layer model, `steps` steps, evaluation every 2 on one batch.
inline std::string SmokeArgs(int steps, double target) {
  return "--smoke --max-steps " + std::to_string(steps) + " --eval-every 2 --eval-batches 1 --target " +
         std::to_string(target) + " --no-update-timing";
}

}  // namespace mlperf_test
