// IR text files for `compile --ir` and `run --ir`: read, parse and verify, with every error located
// in the file.
#pragma once

#include <string>

#include "ir/module.h"

namespace shardstep::cli {

// Reads IR text from `path` ("-" is standard input), parses and verifies it. Parse errors read
// "FILE:LINE:COL: error: message"; verifier errors "FILE:LINE: error: message" with the line of the
// statement the verifier names (or "FILE: error: message" when it names none).
ir::Module ReadIrFile(const std::string& path);

// The line (1-based) of `text` holding the statement a verifier message names ("%12 (add): ...",
// "assign %3 = %40: ..."), or 0.
int LineOfVerifierMessage(const std::string& text, const std::string& message);

}  // namespace shardstep::cli
