// Internal-error reporting: a bug in shardstep, not a user mistake.
#include "ir/error.h"

#include <cstdio>
#include <cstdlib>

namespace shardstep {

void InternalError(const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "shardstep internal error at %s:%d: %s\n", file, line, msg.c_str());
  std::abort();
}

}  // namespace shardstep
