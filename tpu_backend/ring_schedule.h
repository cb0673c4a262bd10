// Ring schedules: the mesh's reduce-scatter and all-gather as lists of neighbour transfers, and the
// emulator's one primitive that runs them (a transfer over one link, counted per link).
//
// A collective along one axis of size p is a bidirectional ring over each group of GroupsAlong(axis):
// the region each member works on (p chunks of c floats, the same region for every member of a group)
// is split per chunk into a low half (the first ceil(c/2) floats), which travels in the +1 direction,
// and a high half, which travels in the -1 direction, so both directions of every link carry half the
// data. Reduce-scatter, step s = 0 .. p-2: member i adds its neighbour's partial of chunk
//   +ring: (i - s - 1) mod p from member i - 1,     -ring: (i + s + 1) mod p from member i + 1,
// so member i ends with chunk i reduced, summed in ring order starting next to its owner:
//   low half of chunk c:  x[c+1] + x[c+2] + ... + x[c]      high half:  x[c-1] + x[c-2] + ... + x[c]
// (indices mod p, each "+" one f32 addition in that order). All-gather, step s = 0 .. p-2: member i
// forwards chunk (i - s) mod p (low half, +1) and (i + s) mod p (high half, -1) unchanged.
//
// Over the whole mesh, reduce-scatter runs along the cores of each chip (on chip), then X, then Y,
// each phase on the part of the buffer the previous phase left to the member, so replica
// r = (core*X + x)*Y + y ends with shard r; all-gather runs the phases in reverse (Y, X, core). The
// same shard order serves both, so all-reduce = reduce-scatter + all-gather bit for bit.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tpu_backend/mesh_topology.h"

namespace shardstep::tpu {

// `count` floats at `offset` of `from`'s buffer arrive at the same offset of `to`'s buffer, which adds
// them to its own (reduce) or stores them (gather). One hop: along `axis` (kCore: on chip) in `dir`.
struct Transfer {
  int from = 0, to = 0;
  MeshAxis axis = MeshAxis::kX;
  int dir = +1;
  int64_t offset = 0, count = 0;
  bool accumulate = false;
};

// The transfers of one step happen together: every sender's data is read before any receiver
// writes. Steps run in order.
struct RingSchedule {
  std::string name;  // e.g. "reduce-scatter over 2x2 chips, 2 cores each (8 replicas), shard 6"
  std::vector<std::vector<Transfer>> steps;
};

// Along one axis: every group of GroupsAlong(axis), buffers of AxisSize(axis) * shard floats.
RingSchedule AxisReduceScatter(const MeshTopology& mesh, MeshAxis axis, int64_t shard);
RingSchedule AxisAllGather(const MeshTopology& mesh, MeshAxis axis, int64_t shard);
// Over all replicas: buffers of mesh.replicas() * shard floats; replica r owns [r*shard, (r+1)*shard).
RingSchedule MeshReduceScatter(const MeshTopology& mesh, int64_t shard);
RingSchedule MeshAllGather(const MeshTopology& mesh, int64_t shard);

// What went over the wires: per directed link (MeshTopology::LinkIndex order) and on chip.
struct LinkTraffic {
  std::vector<int64_t> bytes, messages;  // per link
  int64_t on_chip_bytes = 0, on_chip_messages = 0;
  int64_t steps = 0;
  int64_t TotalLinkBytes() const;
  int64_t MaxLinkBytes() const;
};

// The emulator's primitive: runs `schedule` on one f32 buffer per replica (buffers[r] for replica r,
// each long enough for every offset the schedule touches), moving data only by transfers over one
// link (or on chip) between neighbours, and adds what moved to `traffic` (sized for `mesh` on first
// use). Throws if a transfer is not between neighbours or leaves a buffer.
// An accumulating transfer folds with `op` (kSum and kMean add, kMax runtime::FoldMax(partial, own));
// buffers of replicas no transfer touches may be null.
void RunSchedule(const MeshTopology& mesh, const RingSchedule& schedule, const std::vector<float*>& buffers,
                 int64_t buffer_elements, LinkTraffic* traffic, runtime::Reduction op = runtime::Reduction::kSum);

}  // namespace shardstep::tpu
