// The tpu-mesh backend: jit::CpuExecutor's replicas as the mesh's cores, on MeshCollectives.
#include "tpu_backend/mesh_backend.h"

#include <cmath>

#include "ir/error.h"
#include "tpu_backend/mesh_shard_order.h"
#include "tpu_backend/ring_lowering.h"

namespace shardstep::tpu {

namespace {

const ir::Module& CheckedStep(const ir::Module& step, const MeshTopology& mesh) {
  if (mesh.replicas() != step.num_replicas)
    throw Error(Str("--mesh ", mesh.x(), "x", mesh.y(), " has ", mesh.replicas(), " cores (", mesh.cores_per_chip(),
                    " per chip), one replica each; the step module \"", step.name, "\" has ", step.num_replicas,
                    " replicas (--replicas)"));
  return step;
}

jit::CpuExecutorOptions OptionsFor(const MeshTopology& mesh) {
  jit::CpuExecutorOptions o;
  o.collectives = [mesh](int) -> std::unique_ptr<runtime::Collectives> { return std::make_unique<MeshCollectives>(mesh); };
  return o;
}

}  // namespace

MeshTopology DefaultMeshFor(int replicas) {
  if (replicas == 1) return MeshTopology(1, 1, 1);
  if (replicas < 1 || replicas % 2 != 0)
    throw Error(Str("the tpu-mesh backend runs one replica per core, 2 cores per chip: ", replicas,
                    " replicas do not fill a mesh of chips; use an even --replicas or --mesh XxY (2*X*Y replicas)"));
  const int chips = replicas / 2;
  int x = static_cast<int>(std::sqrt(static_cast<double>(chips)));
  while (x > 1 && chips % x != 0) --x;
  return MeshTopology(x, chips / x);
}

MeshExecutor::MeshExecutor(const ir::Module& step, const runtime::TensorMap& logical_state, const MeshTopology& mesh)
    : jit::CpuExecutor(MeshStepModule(CheckedStep(step, mesh), mesh), logical_state, OptionsFor(mesh)), mesh_(mesh) {}

ir::Module MeshStepModule(const ir::Module& step, const MeshTopology& mesh) {
  ir::Module m = step;
  LayOutAllReducesInShardOrder(m);
  LowerCollectivesToRingSteps(m, mesh);
  return m;
}

MeshCollectives& MeshExecutor::mesh_collectives() { return dynamic_cast<MeshCollectives&>(collectives()); }

std::unique_ptr<runtime::Executor> MakeMeshExecutor(const ir::Module& step, const runtime::TensorMap& logical_state,
                                                    const MeshTopology& mesh) {
  return std::make_unique<MeshExecutor>(step, logical_state, mesh);
}

BackendFactory MeshBackendFactory(std::optional<MeshTopology> mesh) {
  return [mesh](const ir::Module& step, const runtime::TensorMap& state) {
    return MakeMeshExecutor(step, state, mesh ? *mesh : DefaultMeshFor(step.num_replicas));
  };
}

}  // namespace shardstep::tpu
