// ElementwiseFuser: marks groups of elementwise ops over one shape that a backend runs as one loop.
#pragma once

#include <string>

#include "ir/passes/pass.h"

namespace shardstep::ir {

// The attribute that names an instruction's fusion group (an int, dense from 0).
inline constexpr const char* kFusionAttr = "fusion";

// Whether `v` may be a member of a fusion group: an elementwise op (except s32 division, which must
// check its divisor), or a broadcast (scalars are read once; other operands through an index map,
// so a bias broadcast is never materialised).
bool IsFusible(const Module& m, ValueId v);

// Attributes only: the module's instructions, order and values are unchanged, so every backend
// (the interpreter too) still runs it; a backend that fuses reads the groups from the attribute.
class ElementwiseFuser : public Pass {
 public:
  std::string name() const override { return "elementwise-fuser"; }
  bool Run(Module& module) override;
};

}  // namespace shardstep::ir
