// The pod-scale step-time simulator (DESIGN §4, issue 10 part 6): no numerics. It walks the lowered
// per-core step module — the one the pipeline builds for 2·X·Y replicas — through a cost model:
//   - each compute op by roofline on one core (op_cost.h: matrix units, vector unit, HBM);
//   - each collective by its ring schedule on the mesh (ring_schedule.h; whole-mesh collectives by the
//     2D-torus algorithm: cores of a chip, then X, then Y; all-reduce = reduce-scatter + all-gather) timed
//     by the α–β model of ring_cost.h with the table's link numbers;
// on two streams, a compute stream and an interconnect stream, each running one op at a time. An op
// starts when its operands are done and its stream is free; among the ops ready on a stream the first
// in module order goes first. So communication overlaps whatever compute does not depend on it: the
// gradient reduce-scatter of late layers with the backward of early ones, and the deferred all-gather
// (--gather-weights start) with the forward.
//
// Phases: forward = the ancestors of the "loss" output; backward = the other ops that depend on the
// batch and come before the gradient collectives; weight update = the rest. Exposed communication is
// the step time minus the compute stream's busy time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ir/module.h"
#include "tpu_backend/hardware.h"
#include "tpu_backend/mesh_topology.h"
#include "tpu_backend/op_cost.h"
#include "tpu_backend/ring_cost.h"

namespace shardstep::tpu {

struct SimulationResult {
  std::string mesh;  // MeshTopology::ToString()
  int replicas = 0;
  std::string hardware;
  Precision precision = Precision::kBf16;
  // Seconds per step. forward + backward + weight_update = compute (the compute stream's busy time).
  double step_s = 0, forward_s = 0, backward_s = 0, weight_update_s = 0, compute_s = 0;
  // The interconnect stream's busy time, by collective kind; gradient_collective_s: the collectives
  // that reduce the batch's gradients (reduce-scatter when sharded, all-reduce when not).
  double reduce_scatter_s = 0, all_reduce_s = 0, all_gather_s = 0, collective_s = 0, gradient_collective_s = 0;
  double exposed_communication_s = 0;
  int64_t forward_flops = 0, backward_flops = 0, weight_update_flops = 0;
  int collectives = 0;
  // Memory per core (bytes): weights, optimizer state (and step counter) as stored across steps,
  // the gradients the gradient collectives reduce (combined buffers, padding included), forward values
  // the backward reads, peak live temporaries
  // of the buffer plan (ir/memory_plan.h), and the core's share of the chip's HBM.
  int64_t weight_bytes = 0, optimizer_state_bytes = 0, gradient_bytes = 0, activation_bytes = 0;
  int64_t peak_temp_bytes = 0, hbm_capacity_bytes = 0;
  // Link traffic per step: bytes on the busiest directed link of each axis, over all inter-chip links,
  // the busiest ordered pair of cores of a chip, and messages (transfers) on inter-chip links.
  int64_t max_x_link_bytes = 0, max_y_link_bytes = 0, total_link_bytes = 0, max_on_chip_bytes = 0;
  int64_t link_messages = 0;

  std::string ToText() const;
  // One JSON object: step_ms, forward_ms, backward_ms, weight_update_ms, collective_ms,
  // exposed_communication_ms, the collective kinds, memory_bytes {...}, link_traffic_bytes {...}.
  std::string ToJson() const;
};

// Simulates one step of `step` (every pass run, `step.num_replicas` == mesh.replicas(), else an
// error naming --mesh). Collectives with replica groups must be the groups along one mesh axis.
SimulationResult Simulate(const ir::Module& step, const MeshTopology& mesh, const HardwareTable& hw,
                          Precision precision);

// The time of one collective over all replicas of `mesh` (op: kAllReduce, kReduceScatter or kAllGather;
// `elements`: the operand's f32 elements per replica), as Simulate charges it.
ScheduleTime CollectiveTime(const MeshTopology& mesh, const HardwareTable& hw, ir::OpCode op, int64_t elements);

}  // namespace shardstep::tpu
