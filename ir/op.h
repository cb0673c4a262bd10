// OpCode enum and per-op static properties, generated from ir/ops.def.
#pragma once

#include <string>

namespace shardstep::ir {

enum OpProperty : unsigned {
  kNone = 0,
  kLeaf = 1u << 0,         // no operands: variable, input, constant, replica id
  kElementwise = 1u << 1,  // output[i] depends only on operand[i]; all shapes equal
  kCommutative = 1u << 2,
  kReduction = 1u << 3,
  kCollective = 1u << 4,   // communicates across replicas
  kNoGradient = 1u << 5,   // has no gradient rule (integer-valued, a leaf, or inserted after autodiff)
};

enum class OpCode {
#define OP(name, mnemonic, arity, props) k##name,
#include "ir/ops.def"
#undef OP
};

constexpr int kNumOpCodes = 0
#define OP(name, mnemonic, arity, props) +1
#include "ir/ops.def"
#undef OP
    ;

const char* OpName(OpCode op);
int OpArity(OpCode op);  // -1 for variadic
unsigned OpProperties(OpCode op);
bool ParseOpCode(const std::string& mnemonic, OpCode* out);
inline bool HasProperty(OpCode op, unsigned p) { return (OpProperties(op) & p) != 0; }

}  // namespace shardstep::ir
