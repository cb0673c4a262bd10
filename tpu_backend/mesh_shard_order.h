// LayOutAllReducesInShardOrder: the tpu-mesh backend's rewrite of combined gradient all-reduces, so that
// sharded and replicated training give the same bits on the mesh (DESIGN §5).
//
// Why: a ring folds element j of a reduce-scatter in an order that depends on the chunk j falls in (the
// ring starts next to the chunk's owner) and on j's place in that chunk (low half +ring, high half
// -ring). The sharded program reduce-scatters the packed buffer [g, K] whose row r holds shard r of every
// gradient (CollectiveCombiner), while the replicated program all-reduces the gradients flattened and
// concatenated, which puts most elements in another chunk. In-process collectives fold every element
// in replica order, so there the layout does not matter; on the mesh it does.
//
// What: every all-reduce with reduction "mean" (the data-parallel gradient all-reduce; "sum" ones are
// losses and norms) whose operand is a concatenation (axis 0) of two or more rank-1 parts is rewritten
// to all-reduce the same parts in the sharder's layout: part i (n_i floats) zero-padded to g·k_i,
// k_i = ceil(n_i / g), as [g, k_i]; the parts side by side as [g, K]; flattened, all-reduced over the
// same groups, then each part's rows taken back and unpadded. An uncombined all-reduce needs nothing:
// MeshCollectives splits n floats into g chunks of ceil(n/g), which are the sharder's shards. The
// values do not change (only where each float travels), so any backend computes the same result.
#pragma once

#include "ir/module.h"

namespace shardstep::tpu {

// Returns true when it rewrote something.
bool LayOutAllReducesInShardOrder(ir::Module& m);

}  // namespace shardstep::tpu
