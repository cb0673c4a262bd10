// Shape inference: the result type of every op from its operand types and attributes.
#pragma once

#include <vector>

#include "ir/module.h"

namespace shardstep::ir {

// Throws shardstep::Error naming the op, the operand shapes and the problem. Leaves (variable,
// input, constant) take their type from `declared`.
TensorType InferType(OpCode op, const std::vector<TensorType>& operands, const Attrs& attrs,
                     const TensorType* declared = nullptr);

// Replica group helpers for collectives: the "groups" attribute lists the replica ids of each
// group; empty means one group of all `num_replicas`.
IntLists ReplicaGroups(const Instr& collective, int num_replicas);
int64_t GroupSize(const Instr& collective, int num_replicas);

}  // namespace shardstep::ir
