// The backend registry (api/session.h): every registered name constructs a Session and runs one MLP
// step that agrees with the reference interpreter; the tpu-mesh backend is one of them and refuses
// replica counts and groups its mesh cannot run, with errors naming the flags.
#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <random>

#include "runtime/sharding.h"
#include "shardstep/shardstep.h"
#include "tpu_backend/mesh_backend.h"

using namespace shardstep;

namespace {

constexpr int64_t kBatch = 16;

TensorMap Batch(unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  std::vector<float> x(kBatch * 4);
  std::vector<int32_t> y(kBatch);
  for (float& v : x) v = noise(rng);
  for (int32_t& v : y) v = static_cast<int32_t>(rng() % 3);
  return {{"image", Tensor::F32({kBatch, 4}, x)}, {"label", Tensor::S32({kBatch}, y)}};
}

dsl::Program Mlp(dsl::Model& m, int replicas) {
  auto x = m.input("image", dsl::f32({kBatch, 4}));
  auto y = m.input("label", dsl::s32({kBatch}));
  auto logits = x.dense(8, "fc1").relu().dense(3, "fc2");
  m.output("logits", logits);
  return m.train(logits.cross_entropy_mean(y)).optimizer(dsl::Adam().lr(0.01)).replicas(replicas).build();
}

}  // namespace

TEST_CASE("every registered backend constructs and runs one MLP step") {
  const std::vector<std::string> names = BackendNames();
  for (const char* expected : {"cpu", "interp", "tpu-mesh"})
    CHECK(std::find(names.begin(), names.end(), expected) != names.end());
  const TensorMap batch = Batch(1);
  dsl::Model m("registry_mlp", 5);
  const dsl::Program p = Mlp(m, 2);
  Session ref(m, p, "interp");
  const float want = ref.Step(batch).at("loss").f32[0];
  const TensorMap want_state = ref.State();
  CHECK(std::isfinite(want));
  for (const std::string& name : names) {
    INFO("backend " << name);
    Session s(m, p, name);
    CHECK(s.backend() == name);
    const float got = s.Step(batch).at("loss").f32[0];
    CHECK(std::abs(got - want) <= 1e-5f * std::abs(want));
    const TensorMap state = s.State();
    const Tensor& w = state.at("fc1.w");
    double diff = 0;
    for (int64_t i = 0; i < w.elements(); ++i) diff = std::max<double>(diff, std::abs(w.at(i) - want_state.at("fc1.w").at(i)));
    CHECK(diff <= 1e-6);
  }
}

TEST_CASE("the tpu-mesh backend picks a mesh of 2-core chips and refuses what does not fit") {
  CHECK(tpu::DefaultMeshFor(2).ToString() == "1x1 chips, 2 cores each (2 replicas)");
  CHECK(tpu::DefaultMeshFor(8).ToString() == "2x2 chips, 2 cores each (8 replicas)");
  CHECK(tpu::DefaultMeshFor(16).ToString() == "2x4 chips, 2 cores each (16 replicas)");
  CHECK(tpu::DefaultMeshFor(32).ToString() == "4x4 chips, 2 cores each (32 replicas)");
  CHECK(tpu::DefaultMeshFor(1).replicas() == 1);
  CHECK_THROWS_WITH(tpu::DefaultMeshFor(6 - 3), Catch::Contains("--mesh") && Catch::Contains("3 replicas"));

  dsl::Model m("registry_mlp", 5);
  const dsl::Program p = Mlp(m, 4);
  const TensorMap init = runtime::InitLogicalState(p.step);
  CHECK_THROWS_WITH(tpu::MakeMeshExecutor(p.step, init, tpu::MeshTopology(2, 2)),
                    Catch::Contains("--mesh 2x2 has 8 cores") && Catch::Contains("4 replicas (--replicas)"));
  // 4 replicas: the default 1x2 mesh runs them.
  auto exec = tpu::MakeMeshExecutor(p.step, init, tpu::MeshTopology(1, 2));
  CHECK(std::isfinite(exec->Step(Batch(2)).at("loss").f32[0]));
}

TEST_CASE("mesh collectives refuse groups that are not along a mesh axis") {
  tpu::MeshCollectives c(tpu::MeshTopology(2, 2));
  std::vector<float> buf(4, 1.0f);
  // Replicas 0 and 3 are (x0,y0,core0) and (x1,y1,core0): not one axis.
  CHECK_THROWS_WITH(c.AllReduce(0, {0, 3}, buf.data(), 4, runtime::Reduction::kSum),
                    Catch::Contains("replica group {0,3}") && Catch::Contains("axes"));
  CHECK_THROWS_WITH(c.AllReduce(1, {0, 2}, buf.data(), 4, runtime::Reduction::kSum),
                    Catch::Contains("not a member"));
}
