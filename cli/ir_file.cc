// Reading IR files with located errors.
#include "cli/ir_file.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <regex>
#include <sstream>

#include "ir/error.h"
#include "ir/parser.h"
#include "ir/verifier.h"

namespace shardstep::cli {

int LineOfVerifierMessage(const std::string& text, const std::string& message) {
  std::smatch m;
  std::regex line_re;
  if (std::regex_search(message, m, std::regex(R"(: (assign|gradient) %\d+ = %(\d+):)")))
    line_re = std::regex(Str(R"(^\s*)", m[1].str(), R"(\s+\S+\s*=\s*%)", m[2].str(), R"(\s*(//.*)?$)"));
  else if (std::regex_search(message, m, std::regex(R"(: output (@\S+) = %(\d+))")))
    line_re = std::regex(Str(R"(^\s*output\s+)", std::regex_replace(m[1].str(), std::regex(R"([.^$|()\[\]{}*+?\\])"), R"(\$&)"),
                             R"(\s*=\s*%)", m[2].str(), R"(\s*(//.*)?$)"));
  else if (std::regex_search(message, m, std::regex(R"((^|: )%(\d+) \()")))
    line_re = std::regex(Str(R"(^\s*%)", m[2].str(), R"(\s*=)"));
  else if (message.find(": replicas=") != std::string::npos)
    line_re = std::regex(R"(^\s*module\b)");
  else
    return 0;
  std::istringstream in(text);
  std::string line;
  for (int n = 1; std::getline(in, line); ++n)
    if (std::regex_search(line, line_re)) return n;
  return 0;
}

ir::Module ReadIrFile(const std::string& path) {
  std::string text;
  if (path == "-") {
    std::ostringstream os;
    os << std::cin.rdbuf();
    text = os.str();
  } else {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw Error(Str("cannot read IR file ", path, ": ", std::strerror(errno)));
    std::ostringstream os;
    os << in.rdbuf();
    text = os.str();
  }
  const std::string name = path == "-" ? "<stdin>" : path;
  ir::Module m = ir::Parse(text, name);  // "FILE:LINE:COL: error: ..."
  try {
    ir::Verify(m);
  } catch (const Error& e) {
    const int line = LineOfVerifierMessage(text, e.what());
    throw Error(Str(name, line ? Str(":", line) : "", ": error: ", e.what()));
  }
  return m;
}

}  // namespace shardstep::cli
