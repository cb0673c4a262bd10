// Sharded state in the runtime: the logical (unsharded, unpadded) state is what checkpoints hold;
// each replica holds its own shard of every sharded variable. Converting between the two is what
// makes checkpoints independent of the replica count.
#pragma once

#include <vector>

#include "ir/module.h"
#include "runtime/interpreter.h"

namespace shardstep::runtime {

// Every variable's logical type (the shape before sharding).
std::map<std::string, ir::TensorType> LogicalTypes(const ir::Module& step);
// Initial logical state from the variables' initialisers.
TensorMap InitLogicalState(const ir::Module& step);
// Replica `replica`'s state: its shard of each sharded variable, a copy of the others. Checks that
// `logical` holds every variable with its logical type.
TensorMap ReplicaState(const ir::Module& step, const TensorMap& logical, int replica);
// The logical state as replica `first` sees it: each sharded variable is assembled from the group of
// its shard count that holds `first` (groups are contiguous blocks; for G-way sharding and `first` a
// multiple of G these are replica ids first..first+G-1).
TensorMap LogicalStateFrom(const ir::Module& step, const std::vector<TensorMap>& replica_states, int first = 0);

}  // namespace shardstep::runtime
