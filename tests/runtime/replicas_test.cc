// Many replicas on few cores, and failures: replica threads block (never spin) in collectives, so 64
// replicas run on a 2-core machine; a replica that throws stops the whole step promptly with its message.
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <thread>

#include "dsl/dsl.h"
#include "ir/error.h"
#include "ir/shard_format.h"
#include "models/models.h"
#include "runtime/dataset.h"
#include "runtime/executor.h"
#include "runtime/inprocess_collectives.h"
#include "runtime/replica_runner.h"
#include "runtime/sharding.h"

using namespace shardstep;
using namespace shardstep::runtime;
using Catch::Contains;

namespace {

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

constexpr int kReplicas = 64;
constexpr int64_t kBatch = 64;  // one example per replica

dsl::Program Build(int n, bool shard) {
  dsl::Model m("tiny", /*seed=*/2);
  models::ModelOptions mo;
  mo.batch = kBatch;
  mo.hidden = {8};
  mo.classes = 10;
  dsl::Tensor loss = models::DefineMlp(m, mo);
  return m.train(loss).optimizer(dsl::Adam().lr(1e-2)).replicas(n).shard_weight_update(shard).build();
}

std::vector<TensorMap> Batches(int count) {
  static const Dataset d = SyntheticClassification(256, 1, 28, 28, 10, /*seed=*/4);
  BatchIterator it(d, kBatch, /*shuffle=*/true, /*seed=*/1, ir::Shape{784});
  std::vector<TensorMap> out(count);
  for (auto& in : out) it.Next(&in["image"], &in["label"]);
  return out;
}

}  // namespace

TEST_CASE("64 replicas on 2 cores train a tiny MLP through the executor", "[replicas]") {
  const std::vector<TensorMap> batches = Batches(4);
  dsl::Program sharded = Build(kReplicas, true), replicated = Build(kReplicas, false);
  int sharded_vars = 0;
  for (ir::ValueId v : sharded.step.Variables()) {
    ir::ShardFormat f;
    sharded_vars += ir::ShardFormat::FromAttrs(sharded.step.at(v), &f) && f.count == kReplicas;
  }
  REQUIRE(sharded_vars > 0);

  auto run = [&](const dsl::Program& p, std::vector<double>* losses) {
    const TensorMap init = InitLogicalState(p.step);
    auto exec = MakeInterpreterExecutor(p.step, init);
    const auto t0 = Clock::now();
    for (const TensorMap& b : batches) losses->push_back(exec->Step(b).at("loss").f32[0]);
    WARN(batches.size() << " steps with 64 replicas (sharded=" << p.options.shard_weight_update
                        << "): " << SecondsSince(t0) << " s");
    return std::make_pair(init, exec->LogicalState());
  };
  std::vector<double> ls, lr;
  auto [init, s] = run(sharded, &ls);
  auto [init_r, r] = run(replicated, &lr);
  for (double l : ls) CHECK(std::isfinite(l));
  CHECK(ls.back() < ls.front());
  CHECK_FALSE(s.at("fc1.w") == init.at("fc1.w"));
  CHECK(s.at("step").s32[0] == 4);
  // Bonus: bitwise equal to the unsharded run at the same N.
  CHECK(ls == lr);
  for (const auto& [name, t] : r) {
    INFO("variable " << name);
    CHECK(s.at(name) == t);
  }
}

TEST_CASE("a bad label on one replica's slice stops the step with its message within a second", "[replicas]") {
  for (bool shard : {true, false}) {
    INFO("shard_weight_update " << shard);
    dsl::Program p = Build(kReplicas, shard);
    auto exec = MakeInterpreterExecutor(p.step, InitLogicalState(p.step));
    TensorMap in = Batches(1)[0];
    exec->Step(in);  // a good step first: the executor works
    in["label"].s32[37] = 99;  // replica 37's only example
    const auto t0 = Clock::now();
    std::string what;
    try {
      exec->Step(in);
    } catch (const std::exception& e) {
      what = e.what();
    }
    const double took = SecondsSince(t0);
    INFO("error: " << what << " after " << took << " s");
    CHECK_THAT(what, Contains("replica 37") && Contains("label 99 out of range"));
    CHECK(took < 1.0);
  }
}

TEST_CASE("RunReplicas: one throwing replica wakes 63 replicas blocked in collectives within a second", "[replicas]") {
  InProcessCollectives coll(kReplicas);
  ReplicaGroup all;
  for (int r = 0; r < kReplicas; ++r) all.push_back(r);
  const auto t0 = Clock::now();
  std::string what;
  try {
    RunReplicas(kReplicas, &coll, [&](int r) {
      std::vector<float> x(1000, 1.0f);
      coll.AllReduce(r, all, x.data(), x.size(), Reduction::kSum);  // everyone completes one round
      if (r == 13) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the others are blocked by now
        throw Error("replica body failed: disk on fire");
      }
      coll.AllReduce(r, all, x.data(), x.size(), Reduction::kSum);  // blocks forever without the abort
    });
  } catch (const Error& e) {
    what = e.what();
  }
  const double took = SecondsSince(t0);
  INFO("error: " << what << " after " << took << " s");
  CHECK(what == "replica 13: replica body failed: disk on fire");
  CHECK(took < 1.0);
  CHECK(coll.aborted());
}

TEST_CASE("RunReplicas: 64 replicas on 2 cores complete many collective rounds", "[replicas]") {
  InProcessCollectives coll(kReplicas);
  ReplicaGroup all;
  for (int r = 0; r < kReplicas; ++r) all.push_back(r);
  std::vector<float> results(kReplicas);
  const auto t0 = Clock::now();
  RunReplicas(kReplicas, &coll, [&](int r) {
    std::vector<float> x(kReplicas, static_cast<float>(r)), shard(1);
    for (int round = 0; round < 50; ++round) {
      coll.ReduceScatter(r, all, x.data(), shard.data(), 1, Reduction::kSum);
      coll.AllGather(r, all, shard.data(), x.data(), 1);
      for (float& v : x) v = v / kReplicas;
    }
    results[r] = x[0];
  });
  WARN("64 replicas x 100 collectives: " << SecondsSince(t0) << " s");
  // Each round: sum over r of x = mean of 0..63 = 31.5, stays 31.5.
  for (float v : results) CHECK(v == 31.5f);
}
