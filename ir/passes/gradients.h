// Gradient rules: for every op of ir/ops.def, the cotangent of each operand given the output's cotangent.
#pragma once

#include <vector>

#include "ir/builder.h"

namespace shardstep::ir {

// Emits (through `b`) the vector-Jacobian product of instruction `instr` with cotangent `dy` (same type
// as `instr`) and returns one cotangent per operand, each of that operand's type, or kNoValue where
// the operand gets none (integer operands, select conditions, ops with kNoGradient, and operands whose
// derivative is zero almost everywhere). Defined by a switch over every OpCode with no default, so a
// new op without a rule fails to compile.
std::vector<ValueId> GradientRule(Builder& b, ValueId instr, ValueId dy);

}  // namespace shardstep::ir
