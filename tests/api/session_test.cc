// The public C++ API (shardstep/shardstep.h): a new user's MLP trained through Session, global-batch
// outputs, Predict without labels, checkpoints, backend agreement and misuse errors.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <memory>
#include <random>

#include <sstream>

#include "runtime/checkpoint.h"
#include "runtime/dataset.h"
#include "runtime/image_data.h"
#include "runtime/sharding.h"
#include "runtime/trainer.h"
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

// The blobs MLP's evaluation forward at another batch (the same variables), lowered in evaluation mode.
ir::Module MlpForward(int64_t batch) {
  dsl::Model m("mlp_blobs", 1);
  auto x = m.input("image", dsl::f32({batch, 2}));
  auto y = m.input("label", dsl::s32({batch}));
  auto logits = x.dense(32, "fc1").relu().dense(3, "fc2");
  m.output("logits", logits);
  m.train(logits.cross_entropy_mean(y));
  return m.lower(1, dsl::Mode::kEval);
}

// Mean cross-entropy of `logits` [n, C] against `labels` [n], in double.
double MeanCrossEntropy(const Tensor& logits, const Tensor& labels) {
  const int64_t n = logits.shape()[0], c = logits.shape()[1];
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float* row = logits.f32.data() + i * c;
    double m = row[0], z = 0;
    for (int64_t j = 1; j < c; ++j) m = std::max<double>(m, row[j]);
    for (int64_t j = 0; j < c; ++j) z += std::exp(row[j] - m);
    sum += m + std::log(z) - row[labels.s32[i]];
  }
  return sum / n;
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

// Evaluate reads replica 0's weights in place when it holds them whole (the all-gather at the end of
// the step), and the logical state when they are sharded (gathered at the start of the next step).
TEST_CASE("session: Evaluate sees the current weights, gathered at the end or at the start") {
  for (const bool at_start : {false, true}) {
    INFO("gather weights at the start: " << at_start);
    Mlp mlp{std::make_unique<dsl::Model>("mlp_blobs", 1), {}};
    dsl::Model& m = *mlp.model;
    auto x = m.input("image", dsl::f32({kBatch, 2}));
    auto y = m.input("label", dsl::s32({kBatch}));
    auto logits = x.dense(32, "fc1").relu().dense(3, "fc2");
    m.output("logits", logits);
    mlp.program = m.train(logits.cross_entropy_mean(y)).optimizer(dsl::Adam().lr(0.02)).replicas(2)
                      .shard_weight_update(true).gather_weights_at_start(at_start).build();
    Session s(m, mlp.program, "cpu");
    Mlp one = MakeMlp(1, false);
    const TensorMap batch = Blobs(kBatch, 42);
    Tensor before;
    for (int round = 0; round < 2; ++round) {
      for (int step = 0; step < 3; ++step) s.Step(Blobs(kBatch, 10 * round + step));
      Session reference(*one.model, one.program, "cpu");
      reference.LoadState(s.State());
      const Tensor got = s.Evaluate(batch).at("logits"), want = reference.Evaluate(batch).at("logits");
      REQUIRE(got.type == want.type);
      CHECK(std::equal(got.f32.begin(), got.f32.end(), want.f32.begin()));
      if (round == 1) CHECK_FALSE(std::equal(got.f32.begin(), got.f32.end(), before.f32.begin()));
      before = got;
    }
  }
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

TEST_CASE("session: Evaluate on any number of examples is the mean over those examples") {
  Mlp mlp = MakeMlp(2, true);
  Session s(*mlp.model, mlp.program, "cpu");
  for (int step = 0; step < 5; ++step) s.Step(Blobs(kBatch, step));
  // 100 = a full chunk of 64 and one of 36 real rows and 28 zero rows; 5 = one padded chunk; 128 = two full.
  for (int64_t n : {100, 5, 128, 64}) {
    INFO(n << " examples");
    const TensorMap batch = Blobs(n, 50);
    const TensorMap e = s.Evaluate(batch);
    const Tensor logits = s.Predict({{"image", batch.at("image")}}).at("logits");
    REQUIRE(e.at("logits").shape() == ir::Shape{n, 3});
    RequireClose(e.at("logits"), logits, 1e-6);
    const double want = MeanCrossEntropy(logits, batch.at("label"));
    CHECK(e.at("loss").f32[0] == Approx(want).epsilon(1e-5));
  }
  CHECK(s.step() == 5);  // evaluating changes nothing
  // Inputs that disagree on the number of examples.
  TensorMap bad = Blobs(10, 1);
  bad["label"] = Blobs(11, 1).at("label");
  CHECK_THROWS_WITH(s.Evaluate(bad), Catch::Contains("disagree") && Catch::Contains("s32[11]"));
}

TEST_CASE("session: built from lowered modules, with the evaluation forward at its own batch") {
  Mlp mlp = MakeMlp(2, true);
  Session a(*mlp.model, mlp.program, "cpu");
  Session b(mlp.program.step, MlpForward(10), "cpu");
  REQUIRE(b.has_forward());
  for (int step = 0; step < 3; ++step) CHECK(a.Step(Blobs(kBatch, step)).at("loss") == b.Step(Blobs(kBatch, step)).at("loss"));
  const TensorMap ten = Blobs(10, 9);
  const TensorMap ea = a.Evaluate(ten), eb = b.Evaluate(ten);  // a: one padded chunk of 64; b: one run of 10
  RequireClose(ea.at("logits"), eb.at("logits"), 1e-6);
  CHECK(ea.at("loss").f32[0] == Approx(eb.at("loss").f32[0]).epsilon(1e-5));

  // LoadState takes a logical state and the step counter; a wrong one is an Error naming the variable.
  Session c(mlp.program.step, std::nullopt, "interp");
  c.LoadState(a.State(), a.step());
  CHECK(c.step() == 3);
  CHECK(c.State().at("fc1.w") == a.State().at("fc1.w"));
  TensorMap wrong = a.State();
  wrong["fc1.w"] = Tensor(dsl::f32({3, 32}));
  CHECK_THROWS_WITH(c.LoadState(wrong), Catch::Contains("fc1.w"));
  // Without a forward module, Evaluate and Predict say so.
  CHECK_THROWS_WITH(c.Evaluate(ten), Catch::Contains("no forward module"));
  CHECK_THROWS_WITH(c.Predict(ten), Catch::Contains("no forward module"));
  // A forward module over other variables, or one lowered for several replicas, is refused.
  dsl::Model other("other", 1);
  auto x = other.input("image", dsl::f32({10, 2}));
  auto y = other.input("label", dsl::s32({10}));
  auto logits = x.dense(16, "fc1").relu().dense(3, "fc2");
  other.output("logits", logits);
  other.train(logits.cross_entropy_mean(y));
  CHECK_THROWS_WITH(Session(mlp.program.step, other.lower(1, dsl::Mode::kEval), "cpu"),
                    Catch::Contains("forward variable \"fc1.") && Catch::Contains("16]"));
  CHECK_THROWS_WITH(Session(mlp.program.step, other.lower(2, dsl::Mode::kEval), "cpu"), Catch::Contains("2 replicas"));
  CHECK_THROWS_WITH(Session(mlp.program.step, MlpForward(10), "gpu"),
                    Catch::Contains("\"gpu\"") && Catch::Contains("known backends:") && Catch::Contains("cpu, interp"));
}

TEST_CASE("session: runtime::Train runs on a Session as on its executor, evaluating at any batch") {
  // Images of 784 values, 10 classes; a 2-replica sharded MLP at global batch 16.
  const runtime::Dataset all = runtime::SyntheticClassification(300, 1, 28, 28, 10, /*seed=*/4);
  auto train = std::make_shared<runtime::Dataset>(runtime::TakeExamples(all, 0, 200));
  auto test = std::make_shared<runtime::Dataset>(runtime::TakeExamples(all, 200, 300));
  auto define = [](dsl::Model& m, int64_t batch) {
    auto x = m.input("image", dsl::f32({batch, 784}));
    auto y = m.input("label", dsl::s32({batch}));
    auto logits = x.dense(32, "fc1").relu().dense(10, "fc2");
    m.output("logits", logits);
    return logits.cross_entropy_mean(y);
  };
  dsl::Model model("mlp", 3), eval_model("mlp", 3);
  const dsl::Program p = model.train(define(model, 16)).optimizer(dsl::Adam().lr(1e-3)).replicas(2).shard_weight_update(true).build();
  eval_model.train(define(eval_model, 50));
  const ir::Module forward50 = eval_model.lower(1, dsl::Mode::kEval);

  runtime::TrainOptions o;
  o.steps = 24;
  o.batch = 16;
  o.log_every = 8;
  o.eval_every = 12;
  auto run = [&](runtime::Trainable& t) {
    runtime::ImageBatchSource source(train, 16, true, 11, ir::Shape{784}, "synthetic");
    runtime::ImageEvalSet eval(test, 50, ir::Shape{784}, "synthetic");  // batches of 50
    std::ostringstream log;
    runtime::TrainResult r = runtime::Train(t, source, &eval, runtime::kClassificationTask, o, log);
    CHECK_THAT(log.str(), Catch::Contains("eval  step 24  test accuracy"));
    return r;
  };
  // The executor the registry makes, with the forward at the eval batch (as the CLI did before the Session).
  auto exec = FindBackend("cpu")(p.step, runtime::InitLogicalState(p.step));
  runtime::ExecutorTrainable bare(*exec, forward50);
  Session at16(model, p, "cpu");                  // evaluates the batches of 50 in chunks of 16
  Session at50(p.step, forward50, "cpu");          // the CLI's way: the forward at the eval batch
  const runtime::TrainResult re = run(bare), r16 = run(at16), r50 = run(at50);
  REQUIRE(re.losses.size() == 24);
  CHECK(r16.losses == re.losses);
  CHECK(r50.losses == re.losses);
  CHECK(at16.step() == 24);
  CHECK(r50.test_loss == re.test_loss);
  CHECK(r50.test_metric == re.test_metric);
  CHECK(r16.test_loss == Approx(re.test_loss).epsilon(1e-5));
  CHECK(r16.test_metric == Approx(re.test_metric).margin(0.02));  // the same logits up to rounding
  CHECK(re.test_loss < re.losses[0]);
  CHECK(r16.curves.evals.size() == 2);
}
