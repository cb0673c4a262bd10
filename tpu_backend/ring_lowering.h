// LowerCollectivesToRingSteps: the tpu-mesh backend's lowering of all-reduce, reduce-scatter and
// all-gather into ring steps in the IR (issue 10 item 4), so each core's JIT-compiled program holds the
// collective code itself: neighbour sends (collective_permute, one link each) and local adds, and the
// emulator's only primitive is MeshCollectives::Permute, a transfer over one link counted per link.
//
// Bits: the lowered IR reproduces MeshCollectives (ring_schedule.h) exactly: the same pairs of values
// added in the same order (own partial + received, as RunSchedule's dst += in), the same zero padding
// of all-reduce to g·ceil(n/g), "mean" as the reduced shard divided by g once, "max" as the IR max
// (own, received), which is runtime::FoldMax(received, own) (NaN wins, then the larger). bf16 operands
// are converted to f32 once, ring in f32, and the result is rounded back once (as the JIT does).
//
// Static offsets in an SPMD module: in a phase along an axis of p members, member i first rotates its
// p chunks by its position (local chunk k = chunk (i + k) mod p: reshape to [p, c], gather with an s32
// index (k + i) mod p computed from replica_id). Then at ring step s every member sends the same local
// chunk: reduce-scatter low halves (the first ceil(c/2) floats, travelling +1) local p-1-s, added into
// local p-2-s of the receiver; high halves (travelling -1) local s+1 into s+2 (mod p); all-gather low
// local (p-s) mod p into p-1-s, high s into s+1. Every half is its own SSA value, so a step is one
// collective_permute per half and one add (or max) each: no copies of the whole buffer. After a
// reduce-scatter phase the member's chunk is local 0; after an all-gather phase the chunks are put
// back in order with the inverse rotation (concat the rows, gather).
//
// Which collectives: those whose replica groups are the whole mesh in replica order (phases core, X,
// Y for reduce-scatter, Y, X, core for all-gather, as MeshReduceScatter / MeshAllGather) or exactly
// the groups MeshTopology::GroupsAlong(axis) of one axis (one bidirectional ring per group). Groups of
// one become the identity. Others (other groupings, s32 operands) are left alone, and MeshCollectives
// refuses them at run time as before. Broadcast and barrier are not IR ops; nothing else is lowered.
#pragma once

#include "ir/module.h"
#include "tpu_backend/mesh_topology.h"

namespace shardstep::tpu {

// Returns how many collectives it lowered. Throws unless the module has mesh.replicas() replicas.
int LowerCollectivesToRingSteps(ir::Module& m, const MeshTopology& mesh);

}  // namespace shardstep::tpu
