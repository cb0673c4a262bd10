// The logical state of a run whose replicas live in different processes: each process holds only its
// own replica's state (its shards of the sharded variables, copies of the others); GatherLogicalState
// all-gathers every f32 variable over all replicas through the collectives and assembles the logical
// state exactly as the in-process executor does (runtime/sharding.h LogicalStateFrom). Every replica
// must call it, with the same step module, at the same point.
#pragma once

#include "ir/module.h"
#include "runtime/collectives.h"
#include "runtime/interpreter.h"

namespace shardstep::runtime {

TensorMap GatherLogicalState(const ir::Module& step, const TensorMap& local_state, int replica, Collectives& c);

}  // namespace shardstep::runtime
