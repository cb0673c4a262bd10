// DESIGN §1 / §5: checkpoints never depend on the replica count. What is saved is the logical
// (unsharded, unpadded) state; loading it into a program built for another N reshards it and training
// continues to the same result.
#include <stdlib.h>

#include <catch2/catch.hpp>

#include "tests/test_util.h"
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>

#include "dsl/dsl.h"
#include "ir/shard_format.h"
#include "models/models.h"
#include "runtime/checkpoint.h"
#include "runtime/dataset.h"
#include "runtime/executor.h"
#include "runtime/sharding.h"

using namespace shardstep;
using namespace shardstep::runtime;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kBatch = 24;
const std::vector<int64_t> kHidden = {25, 10};  // shapes that need padding at N = 2, 4, 8

using shardstep::testing::TempDir;

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

ir::OptimizerConfig Optimizer() { return dsl::Adam().lr(1e-3); }

dsl::Program Build(int n, bool shard = true) {
  dsl::Model m("mlp", /*seed=*/3);
  models::ModelOptions mo;
  mo.batch = kBatch;
  mo.hidden = kHidden;
  mo.classes = 10;
  dsl::Tensor loss = models::DefineMlp(m, mo);
  return m.train(loss).optimizer(Optimizer()).replicas(n).shard_weight_update(shard).build();
}

std::vector<TensorMap> Batches(int count) {
  static const Dataset d = SyntheticClassification(480, 1, 28, 28, 10, /*seed=*/21);
  BatchIterator it(d, kBatch, /*shuffle=*/true, /*seed=*/9, ir::Shape{784});
  std::vector<TensorMap> out(count);
  for (auto& in : out) it.Next(&in["image"], &in["label"]);
  return out;
}

bool HasShardedVariables(const ir::Module& m) {
  for (ir::ValueId v : m.Variables()) {
    ir::ShardFormat f;
    if (ir::ShardFormat::FromAttrs(m.at(v), &f)) return true;
  }
  return false;
}

double RelDiff(double a, double b) { return std::abs(a - b) / std::max(std::abs(a), 1e-30); }

}  // namespace

TEST_CASE("a checkpoint saved at N=4 continues at N=2 and N=8 with the same losses", "[checkpoint][sharding]") {
  TempDir dir;
  const std::vector<TensorMap> batches = Batches(20);
  dsl::Program p4 = Build(4);
  REQUIRE(HasShardedVariables(p4.step));

  auto exec = MakeInterpreterExecutor(p4.step, InitLogicalState(p4.step));
  std::vector<double> first;
  for (int i = 0; i < 10; ++i) first.push_back(exec->Step(batches[i]).at("loss").f32[0]);
  const std::string path = dir / "step10.safetensors";
  const TensorMap saved = exec->LogicalState();
  SaveCheckpoint(path, saved);
  REQUIRE(saved.at("step").s32[0] == 10);

  // The uninterrupted run.
  std::vector<double> uninterrupted;
  for (int i = 10; i < 20; ++i) uninterrupted.push_back(exec->Step(batches[i]).at("loss").f32[0]);
  const TensorMap final4 = exec->LogicalState();
  CHECK(uninterrupted.back() < first.front());  // it trains

  for (int m : {1, 2, 4, 8}) {
    INFO("resumed at N=" << m);
    dsl::Program pm = Build(m);
    CHECK(HasShardedVariables(pm.step) == (m > 1));
    const TensorMap loaded = LoadCheckpoint(path);
    CheckCheckpointMatches(loaded, LogicalTypes(pm.step), path);
    auto resumed = MakeInterpreterExecutor(pm.step, InitLogicalState(pm.step));
    resumed->LoadLogicalState(loaded);
    // Loading and reading back the logical state is exact, whatever the shard layout.
    const TensorMap back = resumed->LogicalState();
    for (const auto& [name, t] : saved) {
      INFO("variable " << name);
      CHECK(back.at(name) == t);
    }
    double worst = 0;
    for (int i = 10; i < 20; ++i) {
      const double loss = resumed->Step(batches[i]).at("loss").f32[0];
      worst = std::max(worst, RelDiff(uninterrupted[i - 10], loss));
      INFO("step " << i + 1 << ": resumed loss " << std::setprecision(9) << loss << ", uninterrupted "
                   << uninterrupted[i - 10]);
      CHECK(RelDiff(uninterrupted[i - 10], loss) <= 1e-5);
    }
    WARN("resumed at N=" << m << ": worst relative loss difference " << worst);
    if (m == 4) {  // the same N resumes bit for bit
      const TensorMap final_m = resumed->LogicalState();
      for (const auto& [name, t] : final4) {
        INFO("variable " << name);
        CHECK(final_m.at(name) == t);
      }
    }
  }
}

TEST_CASE("the initial logical state saves to the same bytes at every replica count", "[checkpoint][sharding]") {
  TempDir dir;
  std::string reference;
  for (int n : {1, 2, 4, 8}) {
    INFO("N=" << n);
    dsl::Program p = Build(n);
    CHECK(HasShardedVariables(p.step) == (n > 1));
    const std::string path = dir / ("init" + std::to_string(n) + ".safetensors");
    SaveCheckpoint(path, InitLogicalState(p.step));
    const std::string bytes = ReadBytes(path);
    REQUIRE(!bytes.empty());
    if (reference.empty()) reference = bytes;
    CHECK(bytes == reference);
  }
}

TEST_CASE("a checkpoint saved after sharded training holds logical tensors only", "[checkpoint][sharding]") {
  TempDir dir;
  const std::vector<TensorMap> batches = Batches(10);

  dsl::Program p1 = Build(1);
  const std::string path1 = dir / "n1.safetensors";
  SaveCheckpoint(path1, InitLogicalState(p1.step));

  dsl::Program p4 = Build(4);
  auto exec = MakeInterpreterExecutor(p4.step, InitLogicalState(p4.step));
  for (const TensorMap& b : batches) exec->Step(b);
  const std::string path4 = dir / "n4.safetensors";
  SaveCheckpoint(path4, exec->LogicalState());

  const TensorMap a = LoadCheckpoint(path1), b = LoadCheckpoint(path4);
  REQUIRE(a.size() == b.size());
  for (const auto& [name, t] : a) {
    INFO("tensor " << name);
    REQUIRE(b.count(name));
    CHECK(b.at(name).type == t.type);  // same dtype and logical shape: no shard shapes, no padding
  }
  CHECK(ReadBytes(path1).size() == ReadBytes(path4).size());
  // The model's own view agrees: N=4's logical types are N=1's types.
  CHECK(LogicalTypes(p4.step) == LogicalTypes(p1.step));
  // And the sharded program's per-replica types really are different (so the check above means something).
  bool some_shard_shape_differs = false;
  for (ir::ValueId v : p4.step.Variables()) {
    const ir::Instr& var = p4.step.at(v);
    some_shard_shape_differs |= !(var.type == a.at(var.name).type);
  }
  CHECK(some_shard_shape_differs);
  // The N=4 training changed the state (the file is not just the initial state again).
  CHECK_FALSE(b.at("fc1.w/m") == a.at("fc1.w/m"));
}
