// ShardFormat: how a tensor is laid out as N equal shards (DESIGN §1 "Data formatting").
// Along the major dimension when it divides evenly (no re-layout); else flattened and zero-padded
// to a multiple of N. Shared by the sharder (IR) and the runtime (checkpoints, state resharding).
#pragma once

#include <cstdint>

#include "ir/module.h"

namespace shardstep::ir {

struct ShardFormat {
  Shape logical;          // the unsharded, unpadded shape
  int64_t count = 1;      // number of shards (the replica group size)
  bool flat = false;      // false: shard along dim 0; true: flatten and pad
  int64_t padding = 0;    // padded elements at the end (flat only)

  static ShardFormat For(const Shape& logical, int64_t count);
  Shape ShardShape() const;         // each replica's piece
  int64_t shard_elements() const { return NumElements(ShardShape()); }
  Shape FormattedShape() const;     // [count * rows, ...]: what reduce-scatter / all-gather see
  const char* kind() const { return flat ? "flat" : "dim0"; }

  // Stored on a sharded variable's attributes so the runtime can reshard its state.
  void ToAttrs(Attrs* attrs) const;
  static bool FromAttrs(const Instr& variable, ShardFormat* out);  // false when not sharded
};

}  // namespace shardstep::ir
