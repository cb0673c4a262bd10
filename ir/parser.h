// Parser: reads the textual IR form written by Print (grammar in printer.cc) back into a module.
#pragma once

#include <string>

#include "ir/module.h"

namespace shardstep::ir {

// Parses `text`, type-checking every instruction with InferType against its written type (leaves
// take the written type). Throws shardstep::Error "<filename>:<line>:<col>: error: <message>" on the
// first problem. Does not run the verifier (duplicate names, assign types, ... are its job).
Module Parse(const std::string& text, const std::string& filename = "<input>");

}  // namespace shardstep::ir
