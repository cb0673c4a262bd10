// Functional emulation of resnet20 (8x8 images, momentum) on a 2x2 mesh (8 cores) against the CPU
// backend at 8 replicas (issue 10 part 5); slow: the JIT compiles resnet20's step (~30 s on a loaded
// machine without the compile cache).
#include <catch2/catch.hpp>

#include <cmath>

#include "jit/cpu_executor.h"
#include "models/models.h"
#include "models/resnet.h"
#include "runtime/dataset.h"
#include "runtime/sharding.h"
#include "shardstep/shardstep.h"
#include "tpu_backend/mesh_backend.h"

using namespace shardstep;
using namespace shardstep::runtime;

namespace {

const tpu::MeshTopology kMesh(2, 2);  // 8 cores
constexpr int kSteps = 20;

dsl::Program Resnet20(int64_t batch, double lr) {
  dsl::Model m("resnet20", 3);
  models::ModelOptions o;
  o.batch = batch;
  o.image_size = 8;
  o.channels = 3;
  dsl::Tensor loss = models::DefineResnet20(m, o);
  return m.train(loss).optimizer(dsl::Momentum(0.9).lr(lr)).replicas(kMesh.replicas()).build();
}

TensorMap ImageBatch(int64_t batch, int step) {
  static const Dataset d = SyntheticClassification(64, 3, 8, 8, 10, /*seed=*/7);
  BatchIterator it(d, batch, /*shuffle=*/false, /*seed=*/1, ir::Shape{3, 8, 8});
  TensorMap in;
  for (int i = 0; i <= step; ++i) it.Next(&in["image"], &in["label"]);
  return in;
}

// ||a - b|| / ||b|| per f32 tensor (0 when both are zero); s32 tensors must be equal.
void CheckClose(const TensorMap& a, const TensorMap& b, double tol) {
  REQUIRE(a.size() == b.size());
  for (auto& [name, tb] : b) {
    INFO("tensor " << name);
    const Tensor& ta = a.at(name);
    REQUIRE(ta.type == tb.type);
    double diff = 0, norm = 0;
    for (int64_t i = 0; i < tb.elements(); ++i) {
      diff += (double(ta.at(i)) - tb.at(i)) * (double(ta.at(i)) - tb.at(i));
      norm += double(tb.at(i)) * tb.at(i);
    }
    const double rel = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
    INFO("relative L2 " << rel);
    CHECK(rel <= tol);
  }
}

}  // namespace

// resnet20 is chaotic at this scale: per-replica batch norm over 2 examples turns the ring's last-bit
// differences in the gradient sums into 1e-4 relative differences of the loss within 6 steps (the CPU
// backend against itself is bitwise; measured in the report of issue 10). So the 20 steps are checked
// along the CPU backend's trajectory: before every step the mesh takes the CPU's state, and after it
// every tensor of the mesh's state is within 1e-6 relative L2 of the CPU's. The free-running 20-step
// comparison is only reported (a warning with the largest relative loss difference; 0.086 here).
// The divergence is the model's float32 conditioning, not the mesh's: at batch 64 (8 per core), lr 0.002,
// free running, the CPU backend against the reference interpreter -- the same collectives and fold order,
// only the kernels' roundings differ -- is 1.2e-3 apart in s1b2.bn2.beta's momentum after 3 steps and
// 3.5e-2 after 6 (the mesh against the CPU: 8.2e-4 and 1.1e-2); batch-norm betas' gradients are sums that
// nearly cancel, and one ReLU input on the other side of 0 moves them by 1e-3 (measured 2026-12-01).
TEST_CASE("resnet20 (8x8 images) on a 2x2 mesh matches the CPU backend step by step over 20 steps") {
  constexpr int64_t kBatch = 16;  // 2 per core
  const dsl::Program p = Resnet20(kBatch, 0.05);
  const TensorMap init = InitLogicalState(p.step);
  auto cpu = jit::MakeCpuExecutor(p.step, init);
  auto mesh = tpu::MakeMeshExecutor(p.step, init, kMesh);
  auto free_mesh = tpu::MakeMeshExecutor(p.step, init, kMesh);
  float first = 0, last = 0, worst_free = 0;
  for (int s = 0; s < kSteps; ++s) {
    INFO("step " << s);
    const TensorMap batch = ImageBatch(kBatch, s % (64 / kBatch));
    mesh->LoadLogicalState(cpu->LogicalState());
    const float lc = cpu->Step(batch).at("loss").f32[0], lm = mesh->Step(batch).at("loss").f32[0];
    const float lf = free_mesh->Step(batch).at("loss").f32[0];
    INFO("loss cpu " << lc << " mesh " << lm << " free-running mesh " << lf);
    CHECK(std::abs(lc - lm) <= 1e-6f * std::abs(lc));
    CheckClose(mesh->LogicalState(), cpu->LogicalState(), 1e-6);
    worst_free = std::max(worst_free, std::abs(lc - lf) / std::abs(lc));
    if (s == 0) first = lc;
    last = lc;
  }
  CHECK(last < first);  // it trains
  WARN("free-running 20 steps: largest relative loss difference mesh vs cpu " << worst_free);
}

