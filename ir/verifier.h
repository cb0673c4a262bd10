// Verifier: checks the structural invariants of a module; runs between every two passes.
#pragma once

#include "ir/module.h"

namespace shardstep::ir {

// Throws shardstep::Error naming the module, the offending instruction ("%3 (add): ...") or module
// entry, the attribute and its bad value, when `m` breaks an invariant. After Verify, the rest of the
// code may trust every attribute it reads (Instr::GetInt and friends abort on a wrong type):
//  - operands defined before use, op arity, recorded type == InferType (which checks the shape
//    attributes of broadcast, reshape, transpose, slice, pad, concat, reductions, matmul,
//    convolutions, pools, one-hot, gather, scatter-add and the collectives' reductions);
//  - every type has non-negative dimensions and fits in 2^62 bytes;
//  - named unique variables and inputs; 'role' a string, 'fusion' a non-negative integer;
//  - shard specs of variables: 'shard_format', 'shard_count' and 'logical_shape' all present and
//    well typed, the count in [1, replicas] dividing replicas, the format the one ShardFormat::For
//    picks, the variable's type exactly the shard shape, f32 only;
//  - collectives: 'groups' lists every replica exactly once, ids in [0, replicas), equal group
//    sizes; 'group_size' equal to that size; 'combined' a positive integer; all_gather has no
//    reduction; matmul's transpose flags are 0 or 1;
//  - gradient/assign targets are variables of the same type and appear at most once; outputs are
//    defined and unique; num_replicas >= 1.
void Verify(const Module& m);

}  // namespace shardstep::ir
