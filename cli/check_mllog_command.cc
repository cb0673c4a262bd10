// `shardstep check-mllog FILE...`: checks MLPerf training logs (the :::MLLOG lines of `shardstep train
// --mllog` and the bench/mlperf binaries) against the MLCommons training logging rules that apply to
// them (runtime/mllog_check.h). Each problem is printed as FILE:LINE: what; a clean log prints one
// "ok" line with its record count. Exit status 1 when any log has a problem or cannot be read.
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "ir/error.h"
#include "runtime/mllog_check.h"

namespace shardstep::cli {
namespace {

int CheckLogs(const std::vector<std::string>& files) {
  int failed = 0;
  for (const std::string& path : files) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw Error(Str(path, ": cannot open the log"));
    std::stringstream text;
    text << in.rdbuf();
    const std::vector<std::string> problems = runtime::CheckMlLog(text.str());
    for (const std::string& p : problems) {  // "line N: what" -> "FILE:N: what", as compilers locate
      const bool located = p.rfind("line ", 0) == 0 && p.find(':') != std::string::npos;
      std::cout << path << (located ? ":" + p.substr(5) : ": " + p) << "\n";
    }
    if (!problems.empty()) {
      ++failed;
      continue;
    }
    int records = 0;
    std::istringstream lines(text.str());
    for (std::string line; std::getline(lines, line);) records += line.find(":::MLLOG") != std::string::npos;
    std::cout << path << ": ok (" << records << " MLLOG records)\n";
  }
  return failed ? 1 : 0;
}

}  // namespace

Command AddCheckMllogCommand(CLI::App& app) {
  auto files = std::make_shared<std::vector<std::string>>();
  CLI::App* cmd = app.add_subcommand(
      "check-mllog", "check MLPerf training logs (:::MLLOG lines) against the MLCommons training logging rules");
  cmd->add_option("files", *files, "log files")->required();
  return {cmd, [files] { return CheckLogs(*files); }};
}

}  // namespace shardstep::cli
