// WriteFileAtomically: a file is replaced whole or not at all (checkpoints, plots).
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace shardstep::runtime {

// Writes the byte ranges `pieces` in order to `path`.tmp.<pid>, fsyncs it, renames it over `path`
// and fsyncs the directory (best effort). On failure the temporary file is removed, `path` is left
// as it was, and shardstep::Error says "<path>: cannot save <what>: <step>: <reason>".
void WriteFileAtomically(const std::string& path, const std::vector<std::pair<const void*, size_t>>& pieces,
                         const std::string& what);

}  // namespace shardstep::runtime
