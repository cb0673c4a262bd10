// The "tpu-mesh" backend (DESIGN §4): every emulated TPU core runs the per-core step compiled by the
// same LLVM JIT as the "cpu" backend (jit::CpuExecutor, unchanged), and the cores exchange data only
// through MeshCollectives, the ring schedules of the 2D torus with per-link byte and message counters.
// One replica per core: a mesh of X×Y chips with 2 cores each runs a step module of 2·X·Y replicas.
#pragma once

#include <memory>
#include <optional>

#include "api/session.h"
#include "jit/cpu_executor.h"
#include "tpu_backend/mesh_collectives.h"
#include "tpu_backend/mesh_topology.h"

namespace shardstep::tpu {

// The mesh the backend picks for `replicas` replicas when none is given: X×Y chips of 2 cores with
// X·Y = replicas / 2 and X the largest divisor <= sqrt(X·Y) (2 -> 1x1, 4 -> 1x2, 8 -> 2x2, 16 -> 2x4,
// 32 -> 4x4); one replica runs on a single core (1x1 chip, 1 core). Other odd counts are an error
// that names --mesh.
MeshTopology DefaultMeshFor(int replicas);

// The step the cores compile: `step` with its combined gradient all-reduces laid out in shard order
// (mesh_shard_order.h), so that sharded and replicated training give the same bits on the mesh, then
// its collectives lowered to ring steps on `mesh` (ring_lowering.h: neighbour sends and local adds,
// compiled with the rest of the step).
ir::Module MeshStepModule(const ir::Module& step, const MeshTopology& mesh);

class MeshExecutor : public jit::CpuExecutor {
 public:
  // Throws unless the mesh has exactly step.num_replicas cores (naming both).
  MeshExecutor(const ir::Module& step, const runtime::TensorMap& logical_state, const MeshTopology& mesh);
  const MeshTopology& mesh() const { return mesh_; }
  // The collectives the cores ran on: per-link traffic since construction (or ResetTraffic).
  MeshCollectives& mesh_collectives();

 private:
  MeshTopology mesh_;
};

std::unique_ptr<runtime::Executor> MakeMeshExecutor(const ir::Module& step, const runtime::TensorMap& logical_state,
                                                    const MeshTopology& mesh);
// The registry's factory: on `mesh`, or (none) on DefaultMeshFor(step.num_replicas).
BackendFactory MeshBackendFactory(std::optional<MeshTopology> mesh = std::nullopt);

}  // namespace shardstep::tpu
