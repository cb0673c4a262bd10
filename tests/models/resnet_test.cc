// ResNet-20 and ResNet-50: parameter counts, the pinned names, and resnet20 training steps on the
// interpreter and the JIT (replicas 1 and 2, per-replica and cross-replica batch norm).
#include <catch2/catch.hpp>

#include <cmath>

#include "dsl/dsl.h"
#include "jit/cpu_executor.h"
#include "models/models.h"
#include "models/resnet.h"
#include "runtime/dataset.h"
#include "runtime/executor.h"
#include "runtime/sharding.h"

using namespace shardstep;
using namespace shardstep::runtime;

namespace {

int64_t CountRole(const ir::Module& m, const char* role) {
  int64_t n = 0;
  for (ir::ValueId v : m.VariablesWithRole(role)) n += m.type(v).elements();
  return n;
}

dsl::Program BuildResnet20(int64_t batch, int replicas, bool cross_bn, double ls = 0.1) {
  dsl::Model m("resnet20", /*seed=*/3);
  models::ModelOptions o;
  o.batch = batch;
  o.cross_replica_bn = cross_bn;
  o.label_smoothing = ls;
  dsl::Tensor loss = models::DefineResnet20(m, o);
  return m.train(loss).optimizer(dsl::Momentum(0.9).lr(0.05).weight_decay(5e-4)).replicas(replicas).build();
}

TensorMap Batch(int64_t batch, int step) {
  static const Dataset d = SyntheticClassification(64, 1, 28, 28, 10, /*seed=*/7);
  BatchIterator it(d, batch, /*shuffle=*/false, /*seed=*/1, ir::Shape{1, 28, 28});
  TensorMap in;
  for (int i = 0; i <= step; ++i) it.Next(&in["image"], &in["label"]);
  return in;
}

}  // namespace

TEST_CASE("resnet50 has exactly torchvision's 25,557,032 trainable parameters", "[models]") {
  dsl::Model m("resnet50");
  models::ModelOptions o;
  o.batch = 2;
  o.classes = 1000;
  m.train(models::DefineResnet50(m, o));
  ir::Module f = m.lower();
  CHECK(CountRole(f, ir::kRoleWeight) == 25557032);
  // 53 batch norms (1 + 16 blocks x 3 + 4 projections); running mean and var per channel.
  CHECK(f.VariablesWithRole(ir::kRoleModelState).size() == 2 * 53);
  CHECK(CountRole(f, ir::kRoleModelState) == 2 * 26560);
  CHECK(f.type(f.FindOutput("logits")).shape == ir::Shape{2, 1000});
  CHECK(f.FindVariable("s4b2.conv3.w") != ir::kNoValue);
  CHECK(f.type(f.FindVariable("s2b0.conv2.w")).shape == ir::Shape{128, 128, 3, 3});
  CHECK(f.type(f.FindVariable("s2b0.proj.w")).shape == ir::Shape{512, 256, 1, 1});
  CHECK(f.FindVariable("conv1.b") == ir::kNoValue);
}

TEST_CASE("resnet20 has the pinned names and shapes", "[models]") {
  dsl::Model m("resnet20");
  models::ModelOptions o;
  o.batch = 4;
  m.train(models::DefineResnet20(m, o));
  ir::Module f = m.lower();
  CHECK(f.type(f.FindVariable("s2b0.proj.w")).shape == ir::Shape{32, 16, 1, 1});
  CHECK(f.type(f.FindVariable("s3b0.conv1.w")).shape == ir::Shape{64, 32, 3, 3});
  CHECK(f.FindVariable("s1b0.proj.w") == ir::kNoValue);  // identity shortcut in stage 1
  CHECK(f.type(f.FindVariable("fc.w")).shape == ir::Shape{64, 10});
  CHECK(f.at(f.FindVariable("fc.b")).GetInt("weight_decay", 1) == 0);
  CHECK(f.at(f.FindVariable("s3b2.bn2.gamma")).GetInt("layer_adaptation", 1) == 0);
  CHECK(f.at(f.FindVariable("s3b2.conv2.w")).GetInt("weight_decay", 1) == 1);
  CHECK(f.at(f.FindVariable("bn1.running_var")).GetString("role") == ir::kRoleModelState);
  // conv1 144 + bn1 32; stage 1: 3 x (2 x 2304 + 64); stage 2: 4608 + 9216 + 128 + proj 512 + 64,
  // then 2 x (2 x 9216 + 128); stage 3: 18432 + 36864 + 256 + proj 2048 + 128, then 2 x (2 x 36864
  // + 256); fc 64 x 10 + 10.
  CHECK(CountRole(f, ir::kRoleWeight) == 176 + 14016 + 51648 + 205696 + 650);
}

TEST_CASE("resnet20 training steps: interpreter and JIT agree, replicas 1 and 2", "[models][jit]") {
  constexpr int64_t kBatch = 4;
  for (int replicas : {1, 2}) {
    for (bool cross : {false, true}) {
      if (replicas == 1 && cross) continue;
      INFO("replicas " << replicas << (cross ? " cross-replica bn" : ""));
      dsl::Program p = BuildResnet20(kBatch, replicas, cross);
      const TensorMap init = InitLogicalState(p.step);
      auto ref = MakeInterpreterExecutor(p.step, init);
      auto jit = jit::MakeCpuExecutor(p.step, init);
      for (int s = 0; s < 2; ++s) {
        const TensorMap in = Batch(kBatch, s);
        const float lr = ref->Step(in).at("loss").f32[0];
        const float lj = jit->Step(in).at("loss").f32[0];
        INFO("step " << s << " loss interpreter " << lr << " JIT " << lj);
        CHECK(std::isfinite(lr));
        CHECK(lr > 1.0f);  // ~ln 10 at the start
        CHECK(std::abs(lr - lj) <= 1e-4 * std::abs(lr));
      }
      // Running statistics moved away from their init, identically on both backends.
      const TensorMap a = ref->LogicalState(), b = jit->LogicalState();
      const Tensor& rm = a.at("bn1.running_mean");
      double moved = 0, diff = 0;
      for (int64_t i = 0; i < rm.elements(); ++i) {
        moved += std::abs(rm.at(i));
        diff = std::max<double>(diff, std::abs(rm.at(i) - b.at("bn1.running_mean").at(i)));
      }
      CHECK(moved > 0);
      CHECK(diff <= 1e-4);
    }
  }
}

TEST_CASE("resnet20 with cross-replica batch norm on 2 replicas equals 1 replica", "[models]") {
  constexpr int64_t kBatch = 4;
  dsl::Program one = BuildResnet20(kBatch, 1, false), two = BuildResnet20(kBatch, 2, true);
  const TensorMap init = InitLogicalState(one.step);
  auto a = MakeInterpreterExecutor(one.step, init);
  auto b = MakeInterpreterExecutor(two.step, init);
  for (int s = 0; s < 2; ++s) {
    const TensorMap in = Batch(kBatch, s);
    const float la = a->Step(in).at("loss").f32[0], lb = b->Step(in).at("loss").f32[0];
    INFO("step " << s << ": " << la << " vs " << lb);
    CHECK(std::abs(la - lb) <= 1e-5 * std::abs(la));
  }
  const TensorMap x = a->LogicalState(), y = b->LogicalState();
  for (const char* name : {"bn1.running_mean", "s3b2.bn2.running_var", "fc.w"}) {
    double worst = 0;
    for (int64_t i = 0; i < x.at(name).elements(); ++i)
      worst = std::max<double>(worst, std::abs(x.at(name).at(i) - y.at(name).at(i)));
    INFO(name << " worst difference " << worst);
    CHECK(worst <= 1e-4);
  }
}
