// --on-nonfinite: NaN injected into a batch (an image value) and into a weight (a loaded state), with
// one replica and with two replicas and the weight update sharded, on the interpreter and the JIT.
// skip: the step leaves every variable (weights, optimizer state, step counter) bitwise unchanged, is
// counted, and training goes on exactly as if that batch had never been seen; stop: Train throws naming
// the step and the first non-finite tensor, and the executor's state is that of the step before.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "dsl/dsl.h"
#include "ir/error.h"
#include "jit/cpu_executor.h"
#include "models/models.h"
#include "runtime/dataset.h"
#include "runtime/executor.h"
#include "runtime/sharding.h"
#include "runtime/trainer.h"

using namespace shardstep;
using namespace shardstep::runtime;

namespace {

constexpr int64_t kBatch = 8;
const float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Setup {
  int replicas = 1;
  bool shard = false;
  bool jit = false;
  bool guard = true;
};

std::string Name(const Setup& s) {
  return Str(s.jit ? "jit" : "interp", " N=", s.replicas, s.shard ? " sharded" : "", s.guard ? "" : " unguarded");
}

dsl::Program Build(const Setup& s, ir::OptimizerConfig opt = ir::OptimizerConfig().kind(ir::OptimizerKind::kAdam).lr(1e-2),
                   int64_t batch = kBatch) {
  dsl::Model m("mlp", /*seed=*/1);
  models::ModelOptions mo;
  mo.batch = batch;
  mo.hidden = {12, 10};
  mo.classes = 10;
  dsl::Tensor loss = models::DefineMlp(m, mo);
  return m.train(loss)
      .optimizer(opt)
      .replicas(s.replicas)
      .shard_weight_update(s.shard)
      .nonfinite_guard(s.guard)
      .build();
}

std::unique_ptr<Executor> MakeExecutor(const Setup& s, const ir::Module& step, const TensorMap& state) {
  if (s.jit) return std::make_unique<jit::CpuExecutor>(step, state);
  return MakeInterpreterExecutor(step, state);
}

const Dataset& Data() {
  static const Dataset d = SyntheticClassification(200, 1, 28, 28, 10, /*seed=*/3);
  return d;
}

std::vector<TensorMap> Batches(int count) {
  BatchIterator it(Data(), kBatch, /*shuffle=*/false, 0, ir::Shape{784});
  std::vector<TensorMap> out(count);
  for (TensorMap& in : out) it.Next(&in["image"], &in["label"]);
  return out;
}

// "" when a and b hold the same variables with the same bits, else the first that differs.
std::string BitwiseDiff(const TensorMap& a, const TensorMap& b) {
  if (a.size() != b.size()) return "different variables";
  for (auto& [name, t] : a) {
    const Tensor& u = b.at(name);
    const bool same = t.type == u.type &&
                      (t.dtype() == ir::DType::kF32 ? std::memcmp(t.f32.data(), u.f32.data(), t.f32.size() * 4) == 0
                                                    : t.s32 == u.s32);
    if (!same) return "@" + name + " differs";
  }
  return "";
}

const Setup kSetups[] = {{1, false, false}, {2, true, false}, {1, false, true}, {2, true, true}};

TEST_CASE("skip: a NaN in a batch leaves the state bitwise unchanged and training goes on as without that batch") {
  for (const Setup& s : kSetups) {
    INFO(Name(s));
    const dsl::Program p = Build(s);
    const TensorMap init = InitLogicalState(p.step);
    std::vector<TensorMap> batches = Batches(4);
    batches[1]["image"].f32[kBatch * 784 - 100] = kNaN;  // the last example of step 2: replica 1's half at N=2
    auto a = MakeExecutor(s, p.step, init);
    TensorMap before;
    for (int i = 0; i < 4; ++i) {
      if (i == 1) before = a->LogicalState();
      TensorMap out = a->Step(batches[i]);
      CHECK(out.at("step_finite").f32[0] == (i == 1 ? 0.0f : 1.0f));
      if (i == 1) {
        CHECK(std::isnan(out.at("loss").f32[0]));
        CHECK(BitwiseDiff(a->LogicalState(), before) == "");
      }
      if (i != 1) CHECK(std::isfinite(out.at("loss").f32[0]));
    }
    // The same as a run that never saw batch 2 (the step counter did not advance either).
    auto b = MakeExecutor(s, p.step, init);
    for (int i : {0, 2, 3}) b->Step(batches[i]);
    CHECK(BitwiseDiff(a->LogicalState(), b->LogicalState()) == "");
    CHECK(a->LogicalState().at("step").s32[0] == 3);
  }
}

TEST_CASE("the guard changes no result bitwise when everything is finite") {
  for (const Setup& s : kSetups) {
    INFO(Name(s));
    Setup plain = s;
    plain.guard = false;
    const dsl::Program p = Build(s), q = Build(plain);
    auto a = MakeExecutor(s, p.step, InitLogicalState(p.step));
    auto b = MakeExecutor(plain, q.step, InitLogicalState(q.step));
    for (const TensorMap& in : Batches(5)) {
      TensorMap oa = a->Step(in), ob = b->Step(in);
      CHECK(std::memcmp(oa.at("loss").f32.data(), ob.at("loss").f32.data(), 4) == 0);
    }
    CHECK(BitwiseDiff(a->LogicalState(), b->LogicalState()) == "");
  }
}

TEST_CASE("guarded steps: sharded == replicated bitwise for every elementwise optimizer, N = 2 and 3 (padded)") {
  using K = ir::OptimizerKind;
  const ir::OptimizerConfig opts[] = {ir::OptimizerConfig().kind(K::kSgd).lr(0.1),
                                      ir::OptimizerConfig().kind(K::kMomentum).lr(0.02).momentum(0.9).nesterov().weight_decay(1e-3),
                                      ir::OptimizerConfig().kind(K::kAdam).lr(1e-3).warmup(3),
                                      ir::OptimizerConfig().kind(K::kAdamW).lr(1e-3).weight_decay(0.01),
                                      ir::OptimizerConfig().kind(K::kAdagrad).lr(0.01).initial_accumulator(0.1)};
  BatchIterator it(Data(), 12, /*shuffle=*/true, 9, ir::Shape{784});
  std::vector<TensorMap> batches(6);
  for (TensorMap& in : batches) it.Next(&in["image"], &in["label"]);
  batches[2]["image"].f32[11 * 784 + 5] = kNaN;  // the last replica's part: one skipped step on the way
  for (const auto& opt : opts)
    for (int n : {2, 3}) {
      INFO(opt.ToString() << " N=" << n);
      const dsl::Program rep = Build({n, false, false}, opt, 12), sh = Build({n, true, false}, opt, 12);
      auto a = MakeInterpreterExecutor(rep.step, InitLogicalState(rep.step));
      auto b = MakeInterpreterExecutor(sh.step, InitLogicalState(sh.step));
      for (size_t i = 0; i < batches.size(); ++i) {
        TensorMap oa = a->Step(batches[i]), ob = b->Step(batches[i]);
        CHECK(oa.at("step_finite").f32[0] == (i == 2 ? 0.0f : 1.0f));
        CHECK(ob.at("step_finite").f32[0] == oa.at("step_finite").f32[0]);
      }
        CHECK(BitwiseDiff(a->LogicalState(), b->LogicalState()) == "");
      CHECK(a->LogicalState().at("step").s32[0] == 5);
    }
}

// Train() on a copy of the data with one NaN pixel in the batch of step `bad_step` (no shuffling).
struct TrainRun {
  std::string error;
  TrainResult result;
  std::string metrics;
  TensorMap state;
};

TrainRun RunTrain(const Setup& s, TrainOptions::OnNonfinite mode, int64_t bad_step, const TensorMap* load = nullptr) {
  const dsl::Program p = Build(s);
  const TensorMap init = load ? *load : InitLogicalState(p.step);
  auto exec = MakeExecutor(s, p.step, init);
  Dataset data = TakeExamples(Data(), 0, 80);
  if (bad_step > 0) data.images.f32[((bad_step - 1) * kBatch + 2) * 784 + 300] = kNaN;
  TrainOptions o;
  o.steps = 6;
  o.batch = kBatch;
  o.example_shape = {784};
  o.shuffle = false;
  o.log_every = 3;
  o.on_nonfinite = mode;
  const std::string metrics = Str("/tmp/nonfinite_test_", ::getpid(), ".jsonl");
  o.metrics_out = metrics;
  TrainRun r;
  std::ostringstream log;
  try {
    r.result = Train(*exec, p.forward, data, nullptr, o, log);
  } catch (const Error& e) {
    r.error = e.what();
  }
  std::ifstream f(metrics);
  std::stringstream ss;
  ss << f.rdbuf();
  r.metrics = ss.str() + log.str();
  std::remove(metrics.c_str());
  r.state = exec->LogicalState();
  return r;
}

TEST_CASE("Train: stop names the step and the first non-finite tensor; skip counts the step") {
  for (const Setup& s : kSetups) {
    INFO(Name(s));
    // A NaN in the batch of step 4.
    TrainRun stop = RunTrain(s, TrainOptions::OnNonfinite::kStop, 4);
    CHECK_THAT(stop.error, Catch::StartsWith("step 4: non-finite loss (nan) and gradients of @fc1.w"));
    CHECK_THAT(stop.error, Catch::Contains("first non-finite tensor: input @image (1 of "));
    // The state is that after step 3 (a final or periodic checkpoint would hold no NaN).
    TrainRun three = RunTrain(s, TrainOptions::OnNonfinite::kStop, 0);
    {
      const dsl::Program p = Build(s);
      auto e = MakeExecutor(s, p.step, InitLogicalState(p.step));
      for (const TensorMap& in : Batches(3)) e->Step(in);
        CHECK(BitwiseDiff(stop.state, e->LogicalState()) == "");
    }
    TrainRun skip = RunTrain(s, TrainOptions::OnNonfinite::kSkip, 4);
    CHECK(skip.error == "");
    CHECK(skip.result.skipped_steps == 1);
    CHECK(skip.state.at("step").s32[0] == 5);
    CHECK_THAT(skip.metrics, Catch::Contains("\"step\":4,\"loss\":null"));
    CHECK_THAT(skip.metrics, Catch::Contains("\"skipped\":true,\"skipped_steps\":1}"));
    CHECK_THAT(skip.metrics, Catch::Contains("\"step\":6,"));
    CHECK_THAT(skip.metrics, Catch::Contains("skipped 1 non-finite step(s)"));
    CHECK(three.result.skipped_steps == 0);
    CHECK_THAT(three.metrics, !Catch::Contains("\"skipped\":true"));
  }
}

TEST_CASE("Train: a NaN in a loaded weight is named; skip leaves it and every step is skipped") {
  for (const Setup& s : kSetups) {
    INFO(Name(s));
    TensorMap state = InitLogicalState(Build(s).step);
    state.at("fc2.w").f32[7] = kNaN;
    TrainRun stop = RunTrain(s, TrainOptions::OnNonfinite::kStop, 0, &state);
    CHECK_THAT(stop.error, Catch::StartsWith("step 1: non-finite loss (nan)"));
    CHECK_THAT(stop.error, Catch::Contains("first non-finite tensor: variable @fc2.w (1 of 120 elements non-finite, first at index 7: nan)"));
    TrainRun skip = RunTrain(s, TrainOptions::OnNonfinite::kSkip, 0, &state);
    CHECK(skip.result.skipped_steps == 6);
    CHECK(BitwiseDiff(skip.state, state) == "");
  }
}

TEST_CASE("ignore, or a step without the guard: a non-finite loss ends the run as before") {
  Setup s;
  TrainRun ignore = RunTrain(s, TrainOptions::OnNonfinite::kIgnore, 2);
  CHECK_THAT(ignore.error, Catch::Contains("loss became nan at step 2"));
  s.guard = false;
  TrainRun unguarded = RunTrain(s, TrainOptions::OnNonfinite::kSkip, 2);
  CHECK_THAT(unguarded.error, Catch::Contains("loss became nan at step 2"));
}

}  // namespace

namespace {

// Not run by default (tag [.]): the guard's cost on the MLP 784-1024-1024-10 step (batch 128, Adam, JIT),
// guarded and unguarded executors stepped alternately so both see the same machine load:
//   ./nonfinite_test "[guard-cost]"
TEST_CASE("guard cost on the MLP step", "[.][guard-cost]") {
  for (int n : {1, 2}) {
    auto build = [&](bool guard) {
      dsl::Model m("mlp", /*seed=*/1);
      models::ModelOptions mo;
      mo.batch = 128;
      mo.hidden = {1024, 1024};
      mo.classes = 10;
      dsl::Tensor loss = models::DefineMlp(m, mo);
      return m.train(loss).optimizer(ir::OptimizerConfig().kind(ir::OptimizerKind::kAdam).lr(1e-3))
          .replicas(n).shard_weight_update(n > 1).nonfinite_guard(guard).build();
    };
    const dsl::Program p = build(true), q = build(false);
    jit::CpuExecutor a(p.step, InitLogicalState(p.step)), b(q.step, InitLogicalState(q.step));
    BatchIterator it(Data(), 128, true, 1, ir::Shape{784});
    TensorMap in;
    it.Next(&in["image"], &in["label"]);
    std::vector<double> ta, tb, ratio;
    for (int i = 0; i < 130; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      a.Step(in);
      auto t1 = std::chrono::steady_clock::now();
      b.Step(in);
      auto t2 = std::chrono::steady_clock::now();
      if (i < 10) continue;
      ta.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      tb.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
      ratio.push_back(ta.back() / tb.back());
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    auto least = [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };
    WARN("N=" << n << (n > 1 ? " sharded" : "") << ": guarded step median " << median(ta) << " ms (min " << least(ta)
              << "), unguarded " << median(tb) << " ms (min " << least(tb) << "); median of per-pair ratios "
              << median(ratio));
  }
}

}  // namespace
