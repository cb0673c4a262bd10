// Two error channels: user errors (bad input: thrown, with a message naming the place) and internal
// invariants (SS_CHECK: abort loudly, a bug in shardstep).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace shardstep {

// A user-facing error: malformed IR text, shape errors, bad files, bad flags.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

[[noreturn]] void InternalError(const char* file, int line, const std::string& msg);

// Builds a message from streamable pieces: Str("shape ", s, " at ", line).
template <typename... Args>
std::string Str(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

}  // namespace shardstep

#define SS_CHECK(cond, ...)                                                                   \
  do {                                                                                        \
    if (!(cond)) ::shardstep::InternalError(__FILE__, __LINE__,                               \
                                            ::shardstep::Str("check failed: " #cond " ", ##__VA_ARGS__)); \
  } while (0)
