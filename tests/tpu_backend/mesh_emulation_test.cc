// Functional emulation on the tpu-mesh backend (issue 10 part 5): every core of a 2x2 mesh (8 cores)
// runs the JIT-compiled step and exchanges data only by ring transfers over the torus links.
//  - MLP (Adam) trained 20 steps matches the CPU backend at the same replica count within 1e-6 relative
//    L2 per tensor of the final state (the ring folds in another order than the in-process 0..N-1, so
//    not bitwise). resnet20: mesh_resnet20_slow_test.cc.
//  - Sharded and replicated Adam give the same bits on the mesh: an uncombined all-reduce of n floats
//    splits into chunks of ceil(n/N), which are exactly the sharder's shards, and a combined one is laid
//    out as the sharder's packed [N, K] buffer (tpu_backend/mesh_shard_order.h), so the replicated
//    all-reduce and the sharded reduce-scatter fold every element in the same ring order.
//  - The bytes and messages on every link after one step equal the closed form of the step's
//    collectives (bidirectional rings on the 2D torus), computed here from the module's collective ops.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>

#include "ir/shape_inference.h"
#include "jit/cpu_executor.h"
#include "runtime/sharding.h"
#include "shardstep/shardstep.h"
#include "tpu_backend/mesh_backend.h"
#include "tpu_backend/mesh_shard_order.h"

using namespace shardstep;
using namespace shardstep::runtime;

namespace {

const tpu::MeshTopology kMesh(2, 2);  // 8 cores
constexpr int kSteps = 20;

TensorMap MlpBatch(int64_t batch, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  std::vector<float> x(batch * 16);
  std::vector<int32_t> y(batch);
  for (float& v : x) v = noise(rng);
  for (int32_t& v : y) v = static_cast<int32_t>(rng() % 5);
  return {{"image", Tensor::F32({batch, 16}, x)}, {"label", Tensor::S32({batch}, y)}};
}

dsl::Program Mlp(int64_t batch, bool shard, int64_t combine_bytes = 4 << 20) {
  dsl::Model m("mesh_mlp", 11);
  auto x = m.input("image", dsl::f32({batch, 16}));
  auto y = m.input("label", dsl::s32({batch}));
  // 37 hidden units: tensors whose sizes are not multiples of 8 (padded shards).
  auto logits = x.dense(37, "fc1").relu().dense(5, "fc2");
  m.output("logits", logits);
  return m.train(logits.cross_entropy_mean(y))
      .optimizer(dsl::Adam().lr(0.01))
      .replicas(kMesh.replicas())
      .shard_weight_update(shard)
      .combine_thresholds(combine_bytes, combine_bytes > 0 ? 64 : 1)
      .build();
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

bool SameBits(const Tensor& a, const Tensor& b) {
  return a.type == b.type && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

// The closed form of one whole-mesh reduce-scatter or all-gather with chunks of `shard` floats, added
// per link: a ring of p members moves ceil(c/2) floats per step over each "+" link and floor(c/2) over
// each "-" link, for p - 1 steps; the X phase works on c = Y * shard, the Y phase on c = shard, and the
// C cores of a chip each run their own ring over the chip's links.
void AddClosedForm(const tpu::MeshTopology& m, int64_t shard, std::vector<int64_t>* bytes, std::vector<int64_t>* msgs) {
  for (const tpu::Link& l : m.Links()) {
    const bool x = l.axis == tpu::MeshAxis::kX;
    const int64_t p = x ? m.x() : m.y(), c = x ? m.y() * shard : shard;
    const int64_t half = l.dir > 0 ? (c + 1) / 2 : c / 2;
    (*bytes)[m.LinkIndex(l)] += (p - 1) * m.cores_per_chip() * half * 4;
    (*msgs)[m.LinkIndex(l)] += half > 0 ? (p - 1) * m.cores_per_chip() : 0;
  }
}

}  // namespace

TEST_CASE("MLP (Adam) on a 2x2 mesh matches the CPU backend over 20 steps") {
  constexpr int64_t kBatch = 64;
  const dsl::Program p = Mlp(kBatch, /*shard=*/true);
  const TensorMap init = InitLogicalState(p.step);
  auto cpu = jit::MakeCpuExecutor(p.step, init);
  auto mesh = tpu::MakeMeshExecutor(p.step, init, kMesh);
  for (int s = 0; s < kSteps; ++s) {
    const TensorMap batch = MlpBatch(kBatch, 100 + s);
    const float lc = cpu->Step(batch).at("loss").f32[0], lm = mesh->Step(batch).at("loss").f32[0];
    INFO("step " << s << " loss cpu " << lc << " mesh " << lm);
    CHECK(std::abs(lc - lm) <= 1e-6f * std::abs(lc));
  }
  CheckClose(mesh->LogicalState(), cpu->LogicalState(), 1e-6);
}

TEST_CASE("sharded and replicated Adam give the same bits on the mesh") {
  constexpr int64_t kBatch = 32;
  // Combined collectives (the default; the mesh lays the replicated all-reduce out in shard order) and
  // uncombined ones (each gradient's all-reduce chunks are the sharder's shards).
  const int64_t combine_bytes = GENERATE(int64_t{4 << 20}, int64_t{0});
  INFO("combine bytes " << combine_bytes);
  const dsl::Program sharded = Mlp(kBatch, true, combine_bytes), replicated = Mlp(kBatch, false, combine_bytes);
  auto a = tpu::MakeMeshExecutor(sharded.step, InitLogicalState(sharded.step), kMesh);
  auto b = tpu::MakeMeshExecutor(replicated.step, InitLogicalState(replicated.step), kMesh);
  for (int s = 0; s < kSteps; ++s) {
    const TensorMap batch = MlpBatch(kBatch, 200 + s);
    a->Step(batch);
    b->Step(batch);
  }
  const TensorMap sa = a->LogicalState(), sb = b->LogicalState();
  REQUIRE(sa.size() == sb.size());
  for (auto& [name, t] : sa) {
    INFO(name);
    CHECK(SameBits(t, sb.at(name)));
  }
}

TEST_CASE("per-link bytes after one step equal the closed form of the step's collectives") {
  constexpr int64_t kBatch = 64;
  for (bool shard : {true, false}) {
    INFO((shard ? "sharded" : "replicated"));
    const dsl::Program p = Mlp(kBatch, shard);
    tpu::MeshExecutor exec(p.step, InitLogicalState(p.step), kMesh);
    exec.Step(MlpBatch(kBatch, 1));
    const tpu::LinkTraffic t = exec.mesh_collectives().traffic();

    // The collectives before ring lowering (the cores run them as collective_permute ring steps,
    // tpu_backend/ring_lowering.h, which must move exactly these bytes).
    ir::Module m = p.step;
    tpu::LayOutAllReducesInShardOrder(m);
    for (const ir::Instr& in : tpu::MeshStepModule(p.step, kMesh).instrs)
      CHECK((in.op != ir::OpCode::kAllReduce && in.op != ir::OpCode::kReduceScatter && in.op != ir::OpCode::kAllGather));
    const int64_t n = kMesh.replicas();
    std::vector<int64_t> bytes(kMesh.Links().size()), msgs(kMesh.Links().size());
    int collectives = 0;
    for (const ir::Instr& in : m.instrs) {
      if (in.op != ir::OpCode::kAllReduce && in.op != ir::OpCode::kReduceScatter && in.op != ir::OpCode::kAllGather)
        continue;
      REQUIRE(ir::ReplicaGroups(in, m.num_replicas).size() == 1);  // the whole mesh
      ++collectives;
      const int64_t out = in.type.elements();
      if (in.op == ir::OpCode::kAllReduce) {
        AddClosedForm(kMesh, (out + n - 1) / n, &bytes, &msgs);  // reduce-scatter of the padded buffer
        AddClosedForm(kMesh, (out + n - 1) / n, &bytes, &msgs);  // then all-gather
      } else {
        AddClosedForm(kMesh, in.op == ir::OpCode::kReduceScatter ? out : out / n, &bytes, &msgs);
      }
    }
    CHECK(collectives == (shard ? 2 : 1));  // combined: reduce-scatter + all-gather, or one all-reduce
    CHECK(t.bytes == bytes);
    CHECK(t.messages == msgs);
    CHECK(t.TotalLinkBytes() > 0);
    // A second step moves the same again.
    exec.Step(MlpBatch(kBatch, 2));
    const tpu::LinkTraffic t2 = exec.mesh_collectives().traffic();
    for (size_t l = 0; l < bytes.size(); ++l) CHECK(t2.bytes[l] == 2 * bytes[l]);
  }
}
