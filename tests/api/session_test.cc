// The public C++ API (shardstep/shardstep.h): a new user's MLP trained through Session, global-batch
// outputs, Predict without labels, checkpoints, backend agreement and misuse errors.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <memory>
#include <random>

#include "runtime/checkpoint.h"
#include "shardstep/shardstep.h"
#include "tests/test_util.h"

using namespace shardstep;

namespace {

constexpr int64_t kBatch = 64;

// Three Gaussian blobs in the plane (as examples/mlp_blobs.cc).
TensorMap Blobs(int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> noise(0.0f, 0.5f);
  std::vector<float> x;
  std::vector<int32_t> y;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t k = static_cast<int32_t>(rng() % 3);
    x.push_back(3.0f * std::cos(2.0944f * k) + noise(rng));
    x.push_back(3.0f * std::sin(2.0944f * k) + noise(rng));
    y.push_back(k);
  }
  return {{"image", Tensor::F32({n, 2}, x)}, {"label", Tensor::S32({n}, y)}};
}

struct Mlp {
  std::unique_ptr<dsl::Model> model;
  dsl::Program program;
};

Mlp MakeMlp(int replicas, bool shard) {
  Mlp r{std::make_unique<dsl::Model>("mlp_blobs", 1), {}};
  dsl::Model& m = *r.model;
  auto x = m.input("image", dsl::f32({kBatch, 2}));
  auto y = m.input("label", dsl::s32({kBatch}));
  auto logits = x.dense(32, "fc1").relu().dense(3, "fc2");
  m.output("logits", logits);
  r.program = m.train(logits.cross_entropy_mean(y))
                  .optimizer(dsl::Adam().lr(0.02))
                  .replicas(replicas)
                  .shard_weight_update(shard)
                  .build();
  return r;
}

void RequireClose(const Tensor& a, const Tensor& b, double tol) {
  REQUIRE(a.type == b.type);
  for (int64_t i = 0; i < a.elements(); ++i) REQUIRE(a.at(i) == Approx(b.at(i)).margin(tol));
}

}  // namespace

TEST_CASE("session: a 2-replica sharded MLP trains on blobs to a low loss") {
  Mlp mlp = MakeMlp(2, true);
  Session s(*mlp.model, mlp.program, "cpu");
  REQUIRE(s.num_replicas() == 2);
  float first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    const float loss = s.Step(Blobs(kBatch, step)).at("loss").f32[0];
    if (step == 0) first = loss;
    last = loss;
  }
  CHECK(first > 0.5f);
  CHECK(last < 0.05f);
  CHECK(s.step() == 60);
  const float eval_loss = s.Evaluate(Blobs(kBatch, 999)).at("loss").f32[0];
  CHECK(eval_loss < 0.1f);
}

TEST_CASE("session: Step outputs cover the global batch, equal to a single-replica run") {
  Mlp two = MakeMlp(2, true), one = MakeMlp(1, false);
  Session s2(*two.model, two.program, "cpu"), s1(*one.model, one.program, "cpu");
  const TensorMap batch = Blobs(kBatch, 7);
  TensorMap o2 = s2.Step(batch), o1 = s1.Step(batch);
  REQUIRE(o2.count("logits"));
  REQUIRE(o2.at("logits").shape() == ir::Shape{kBatch, 3});  // not replica 0's 32 rows
  RequireClose(o2.at("logits"), o1.at("logits"), 1e-5);
  CHECK(o2.at("loss").f32[0] == Approx(o1.at("loss").f32[0]).margin(1e-6));
  // The rows of replica 1 are not a copy of replica 0's.
  CHECK(o2.at("logits").f32[0] != o2.at("logits").f32[32 * 3]);
  // The updated weights agree too (the sharded update equals the unsharded one).
  TensorMap st2 = s2.State(), st1 = s1.State();
  RequireClose(st2.at("fc1.w"), st1.at("fc1.w"), 1e-5);
  RequireClose(st2.at("fc2.b"), st1.at("fc2.b"), 1e-5);
}

TEST_CASE("session: Predict needs no labels and equals Evaluate's logits") {
  Mlp mlp = MakeMlp(2, true);
  Session s(*mlp.model, mlp.program, "cpu");
  for (int step = 0; step < 5; ++step) s.Step(Blobs(kBatch, step));
  const TensorMap batch = Blobs(kBatch, 42);
  const Tensor eval_logits = s.Evaluate(batch).at("logits");
  TensorMap p = s.Predict({{"image", batch.at("image")}});
  REQUIRE(p.size() == 1);
  RequireClose(p.at("logits"), eval_logits, 1e-6);
  // The full batch (with labels) is accepted too: the label is ignored.
  RequireClose(s.Predict(batch).at("logits"), eval_logits, 1e-6);
  // Any number of examples: 5 (one padded chunk) and 100 (a full chunk and a padded one); Blobs(n, seed)
  // is a prefix of Blobs(m > n, seed).
  const Tensor five = s.Predict({{"image", Blobs(5, 42).at("image")}}).at("logits");
  REQUIRE(five.shape() == ir::Shape{5, 3});
  for (int64_t i = 0; i < 15; ++i) CHECK(five.f32[i] == Approx(eval_logits.f32[i]).margin(1e-6));
  const Tensor hundred = s.Predict({{"image", Blobs(100, 43).at("image")}}).at("logits");
  const Tensor twice = s.Predict({{"image", Blobs(128, 43).at("image")}}).at("logits");
  REQUIRE(hundred.shape() == ir::Shape{100, 3});
  for (int64_t i = 0; i < 300; ++i) CHECK(hundred.f32[i] == Approx(twice.f32[i]).margin(1e-6));
  CHECK_THROWS_WITH(s.Predict({{"image", Tensor(dsl::f32({5, 3}))}}),
                    Catch::Contains("\"image\"") && Catch::Contains("f32[5,3]") && Catch::Contains("f32[5,2]"));
  // Predicting changes nothing.
  CHECK(s.step() == 5);
}

TEST_CASE("session: Save, then Load into a new Session, gives bitwise the same next step") {
  testing::TempDir dir;
  Mlp mlp = MakeMlp(2, true);
  Session a(*mlp.model, mlp.program, "cpu");
  for (int step = 0; step < 5; ++step) a.Step(Blobs(kBatch, step));
  a.Save(dir / "ckpt.safetensors");
  const TensorMap next = Blobs(kBatch, 5);
  TensorMap out_a = a.Step(next);

  Session b(*mlp.model, mlp.program, "cpu");
  b.Load(dir / "ckpt.safetensors");
  CHECK(b.step() == 5);
  TensorMap out_b = b.Step(next);
  CHECK(out_a.at("loss") == out_b.at("loss"));
  CHECK(out_a.at("logits") == out_b.at("logits"));
  TensorMap sa = a.State(), sb = b.State();
  REQUIRE(sa.size() == sb.size());
  for (auto& [name, t] : sa) CHECK(t == sb.at(name));

  // The logical checkpoint loads at another replica count as well.
  Mlp single = MakeMlp(1, false);
  Session c(*single.model, single.program, "cpu");
  c.Load(dir / "ckpt.safetensors");
  RequireClose(c.Step(next).at("logits"), out_a.at("logits"), 1e-5);
}

TEST_CASE("session: the interp and cpu backends agree on a step") {
  Mlp mlp = MakeMlp(2, true);
  Session cpu(*mlp.model, mlp.program, "cpu"), interp(*mlp.model, mlp.program, "interp");
  const TensorMap batch = Blobs(kBatch, 3);
  for (int step = 0; step < 2; ++step) {
    TensorMap oc = cpu.Step(batch), oi = interp.Step(batch);
    CHECK(oc.at("loss").f32[0] == Approx(oi.at("loss").f32[0]).margin(1e-5));
    RequireClose(oc.at("logits"), oi.at("logits"), 1e-4);
  }
  TensorMap sc = cpu.State(), si = interp.State();
  for (auto& [name, t] : sc) RequireClose(t, si.at(name), 1e-4);
  const TensorMap images = {{"image", Blobs(10, 4).at("image")}};
  RequireClose(cpu.Predict(images).at("logits"), interp.Predict(images).at("logits"), 1e-4);
  CHECK(cpu.Evaluate(batch).at("loss").f32[0] == Approx(interp.Evaluate(batch).at("loss").f32[0]).margin(1e-5));
}

TEST_CASE("session: misuse throws shardstep::Error naming the culprit") {
  Mlp mlp = MakeMlp(2, true);
  Session s(*mlp.model, mlp.program, "cpu");
  TensorMap batch = Blobs(kBatch, 0);

  SECTION("unknown backend lists the known ones") {
    CHECK_THROWS_WITH(Session(*mlp.model, mlp.program, "tpu"),
                      Catch::Contains("\"tpu\"") && Catch::Contains("cpu") && Catch::Contains("interp"));
  }
  SECTION("wrong shape names the input and both shapes") {
    TensorMap bad = batch;
    bad["image"] = Tensor(dsl::f32({32, 2}));  // a per-replica batch instead of the global one
    CHECK_THROWS_WITH(s.Step(bad), Catch::Contains("\"image\"") && Catch::Contains("f32[32,2]") &&
                                       Catch::Contains("f32[64,2]"));
    CHECK_THROWS_WITH(s.Evaluate(bad), Catch::Contains("\"image\"") && Catch::Contains("f32[32,2]"));
  }
  SECTION("wrong dtype") {
    TensorMap bad = batch;
    bad["label"] = Tensor(dsl::f32({kBatch}));
    CHECK_THROWS_WITH(s.Step(bad), Catch::Contains("\"label\"") && Catch::Contains("s32[64]"));
  }
  SECTION("missing input") {
    TensorMap bad = batch;
    bad.erase("label");
    CHECK_THROWS_WITH(s.Step(bad), Catch::Contains("missing input \"label\""));
    CHECK_THROWS_WITH(s.Predict({}), Catch::Contains("missing input \"image\""));
  }
  SECTION("unknown input and unknown output") {
    TensorMap bad = batch;
    bad["imgae"] = batch.at("image");
    CHECK_THROWS_WITH(s.Step(bad), Catch::Contains("unknown input \"imgae\""));
    CHECK_THROWS_WITH(s.Predict(batch, {"probs"}),
                      Catch::Contains("unknown output \"probs\"") && Catch::Contains("logits"));
  }
  SECTION("Tensor::F32 and S32 with a wrong data size") {
    CHECK_THROWS_AS(Tensor::F32({2, 3}, std::vector<float>(5)), Error);
    CHECK_THROWS_WITH(Tensor::F32({2, 3}, std::vector<float>(5)), Catch::Contains("[2,3]") && Catch::Contains("5"));
    CHECK_THROWS_WITH(Tensor::S32({4}, std::vector<int32_t>(3)), Catch::Contains("Tensor::S32"));
  }
  SECTION("a checkpoint of another model") {
    testing::TempDir dir;
    runtime::SaveCheckpoint(dir / "other.safetensors", {{"w", Tensor::Scalar(1)}});
    CHECK_THROWS_AS(s.Load(dir / "other.safetensors"), Error);
  }
  // None of the above changed the session.
  CHECK(s.step() == 0);
}

TEST_CASE("session: a registered backend is found by name") {
  static int made = 0;  // the registry outlives this test
  RegisterBackend("counting_interp", [](const ir::Module& step, const TensorMap& state) {
    ++made;
    return runtime::MakeInterpreterExecutor(step, state);
  });
  const std::vector<std::string> names = BackendNames();
  CHECK(std::find(names.begin(), names.end(), "counting_interp") != names.end());
  Mlp mlp = MakeMlp(1, false);
  Session custom(*mlp.model, mlp.program, "counting_interp"), interp(*mlp.model, mlp.program, "interp");
  CHECK(made == 1);
  const TensorMap batch = Blobs(kBatch, 11);
  CHECK(custom.Step(batch).at("loss") == interp.Step(batch).at("loss"));  // the same interpreter, bitwise
}
