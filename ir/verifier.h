// Verifier: checks the structural invariants of a module; runs between every two passes.
#pragma once

#include "ir/module.h"

namespace shardstep::ir {

// Throws shardstep::Error naming the offending instruction ("%3 (add): ...") or module entry when
// `m` breaks an invariant: operands defined before use, op arity, recorded type == InferType, named
// unique variables and inputs, gradient/assign targets are variables of the same type and appear at
// most once, unique output names, num_replicas >= 1.
void Verify(const Module& m);

}  // namespace shardstep::ir
