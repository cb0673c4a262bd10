// Link support for config_file_fuzzer: cli/config_file.cc's ApplyConfig calls ClosestMatch, defined in
// cli/flags.cc, which needs the DSL (not compilable with clang 14). The fuzzer only calls ParseConfig.
#include <cstdlib>
#include <string>
#include <vector>

namespace shardstep::cli {

std::string ClosestMatch(const std::string&, const std::vector<std::string>&) { std::abort(); }

}  // namespace shardstep::cli
