// The step-time simulator (tpu_backend/simulator.h): its collective times are the closed-form α–β
// costs of the 2D-torus algorithm for the same hardware table, sharding's simulated speedup grows as the
// per-core batch shrinks and as the mesh grows at a fixed global batch (at a fixed per-core batch it moves
// only by the sharded step's exposed collective latency), sharded optimizer state is 1/N per core (+ padding),
// the JSON has its keys, and bad input is an error naming the flag or the file and line.
#include "tpu_backend/simulator.h"

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>

#include "dsl/dsl.h"
#include "ir/error.h"
#include "ir/passes/pipeline.h"
#include "models/models.h"

using namespace shardstep;
using namespace shardstep::tpu;

namespace {

// The step `train` runs per replica: the model lowered for `replicas`, every pass run.
ir::Module Step(const std::string& model, int replicas, int64_t per_core_batch, bool sharded, ir::OptimizerKind opt) {
  models::ModelOptions o;
  o.batch = per_core_batch * replicas;
  o.hidden = {1024, 1024};
  dsl::Model m(model, 0);
  m.train(models::FindModel(model).define(m, o));
  ir::Module step = m.lower(replicas, dsl::Mode::kTrain);
  ir::PipelineOptions po;
  po.optimizer = ir::OptimizerConfig().kind(opt).lr(0.01);
  po.replicas = replicas;
  po.shard_weight_update = sharded;
  ir::BuildTrainingPipeline(po).Run(step);
  return step;
}

// The closed form of one phase of a whole-mesh collective: p - 1 steps; each moves a chunk of c floats per
// member, half in each ring direction. Inter-chip: the two halves take two links (distinct cables even
// for p = 2), and the rings of a chip's 2 cores share them, so a step lasts α + 2·ceil(c/2)·4/β. On chip
// (2 cores): both halves go to the one other core, α + c·4/β.
double Phase(int p, int64_t c, const LinkModel& link, bool on_chip) {
  if (p < 2) return 0;
  const double bytes = on_chip && p == 2 ? 4.0 * c : 2 * 4.0 * ((c + 1) / 2);
  return (p - 1) * (link.latency_s + bytes / link.bytes_per_s);
}

// Reduce-scatter (or all-gather) of shard s over all X*Y*2 replicas: cores of a chip, then X, then Y.
double MeshCollective(int x, int y, int64_t s, const HardwareTable& hw) {
  const int64_t n = 2LL * x * y;
  return Phase(2, n * s / 2, hw.on_chip, true) + Phase(x, n * s / (2 * x), hw.link, false) +
         Phase(y, s, hw.link, false);
}

double ClosedForm(ir::OpCode op, int x, int y, int64_t elements, const HardwareTable& hw) {
  const int64_t n = 2LL * x * y;
  if (op == ir::OpCode::kAllGather) return MeshCollective(x, y, elements, hw);
  const int64_t shard = (elements + n - 1) / n;
  return MeshCollective(x, y, shard, hw) * (op == ir::OpCode::kAllReduce ? 2 : 1);
}

}  // namespace

TEST_CASE("collective times are the closed-form alpha-beta costs of the 2D-torus algorithm") {
  const HardwareTable hw = FindHardwareTable("tpu-v3");
  for (auto [x, y] : {std::pair{1, 1}, {2, 1}, {4, 2}, {3, 5}})
    for (ir::OpCode op : {ir::OpCode::kReduceScatter, ir::OpCode::kAllGather, ir::OpCode::kAllReduce})
      for (int64_t e :
           {int64_t{1}, int64_t{2} * x * y * 5, int64_t{1000003}, int64_t{2} * x * y * 777, int64_t{2} * x * y * 778}) {
        const MeshTopology mesh(x, y);
        INFO(mesh.ToString() << " " << ir::OpName(op) << " of " << e);
        const int64_t elements =
            op == ir::OpCode::kReduceScatter ? (e + mesh.replicas() - 1) / mesh.replicas() * mesh.replicas() : e;
        CHECK(CollectiveTime(mesh, hw, op, elements).seconds ==
              Approx(ClosedForm(op, x, y, elements, hw)).epsilon(1e-9));
      }
  // A whole step: the interconnect's busy time is the sum of its collectives' closed forms.
  const MeshTopology mesh(2, 2);
  const ir::Module step = Step("mlp", mesh.replicas(), 4, true, ir::OptimizerKind::kAdam);
  double expected = 0;
  int collectives = 0;
  for (const ir::Instr& in : step.instrs)
    if (ir::HasProperty(in.op, ir::kCollective))
      expected += ClosedForm(in.op, 2, 2, step.type(in.operands[0]).elements(), hw), ++collectives;
  const SimulationResult r = Simulate(step, mesh, hw, Precision::kBf16);
  CHECK(collectives >= 2);
  CHECK(r.collectives == collectives);
  CHECK(r.collective_s == Approx(expected).epsilon(1e-9));
  CHECK(r.reduce_scatter_s + r.all_reduce_s + r.all_gather_s == Approx(r.collective_s));
  CHECK(r.compute_s == Approx(r.forward_s + r.backward_s + r.weight_update_s));
  // Two streams: the step is at least each stream's busy time and at most their sum.
  CHECK(r.step_s >= r.compute_s * (1 - 1e-12));
  CHECK(r.step_s >= r.collective_s * (1 - 1e-12));
  CHECK(r.step_s <= (r.compute_s + r.collective_s) * (1 + 1e-12));
  CHECK(r.exposed_communication_s == Approx(r.step_s - r.compute_s));
  CHECK(r.forward_s > 0);
  CHECK(r.backward_s > r.forward_s);  // two matmuls per forward one
}

// The speedup itself does not grow with the mesh for this small MLP: the collectives' latency grows
// with the ring (8x8 gives ~2.0x against ~2.8x on 2x2). What sharding makes smaller as the mesh grows is
// each core's weight update (1/N of it).
TEST_CASE("sharding's simulated speedup grows as the per-core batch shrinks, its update as the mesh grows") {
  const HardwareTable hw = FindHardwareTable("tpu-v3");
  struct Outcome {
    double speedup, sharded_update_s;
  };
  auto simulate = [&](int x, int y, int64_t batch) {
    const MeshTopology mesh(x, y);
    const SimulationResult replicated =
        Simulate(Step("mlp", mesh.replicas(), batch, false, ir::OptimizerKind::kLamb), mesh, hw, Precision::kBf16);
    const SimulationResult sharded =
        Simulate(Step("mlp", mesh.replicas(), batch, true, ir::OptimizerKind::kLamb), mesh, hw, Precision::kBf16);
    CHECK(sharded.weight_update_s < replicated.weight_update_s);
    return Outcome{replicated.step_s / sharded.step_s, sharded.weight_update_s};
  };
  const Outcome small_batch = simulate(2, 2, 2), large_batch = simulate(2, 2, 64), large_mesh = simulate(4, 4, 2);
  CHECK(small_batch.speedup > 1);
  CHECK(large_mesh.speedup > 1);
  CHECK(small_batch.speedup > large_batch.speedup);
  CHECK(large_mesh.sharded_update_s < 0.6 * small_batch.sharded_update_s);
}

// ResNet-50 with LARS, the paper's MLPerf image model, at `per_core_batch` on a `x` by `y` mesh.
std::pair<SimulationResult, SimulationResult> Resnet50(int x, int y, int64_t per_core_batch,
                                                        const HardwareTable& hw) {
  const MeshTopology mesh(x, y);
  models::ModelOptions o;
  o.batch = per_core_batch * mesh.replicas();
  o.classes = 1000;
  auto step = [&](bool sharded) {
    dsl::Model m("resnet50", 0);
    m.train(models::FindModel("resnet50").define(m, o));
    ir::Module s = m.lower(mesh.replicas(), dsl::Mode::kTrain);
    ir::PipelineOptions po;
    po.optimizer = ir::OptimizerConfig().kind(ir::OptimizerKind::kLars).lr(0.1);
    po.replicas = mesh.replicas();
    po.shard_weight_update = sharded;
    po.bf16_contractions = true;
    ir::BuildTrainingPipeline(po).Run(s);
    return Simulate(s, mesh, hw, Precision::kBf16);
  };
  return {step(false), step(true)};
}

TEST_CASE("at a fixed global batch (MLPerf-style scaling) sharding's speedup grows with every mesh step") {
  // The paper's setting: a larger mesh means a smaller per-core batch, so the replicated update (the same
  // on every mesh) is a growing part of the replicated step, while the sharded update shrinks as 1/N.
  // (Not for the tiny MLP: at a few examples per core its step is a few collective latencies.)
  const HardwareTable hw = FindHardwareTable("tpu-v3");
  const int64_t global = 2048;
  double previous = 0;
  for (auto [x, y] : {std::pair{4, 4}, {8, 4}, {8, 8}, {16, 8}, {16, 16}}) {
    const int64_t per_core = global / (2 * x * y);
    const auto [replicated, sharded] = Resnet50(x, y, per_core, hw);
    const double speedup = replicated.step_s / sharded.step_s;
    INFO(x << "x" << y << ": per-core batch " << per_core << ", speedup " << speedup);
    CHECK(speedup > previous);
    previous = speedup;
  }
  CHECK(previous > 1.05);  // 16x16 at 4 per core; 1.0 on 4x4 at 64 per core
}

TEST_CASE("at a fixed per-core batch the speedup moves only by the sharded step's exposed communication") {
  // Compute per core is the same on every mesh, the replicated all-reduces hide under the backward, and the
  // update saving U(1 - 1/N) is nearly constant; what grows with the mesh is the per-hop latency
  // (X + Y - 2 ring steps per reduce-scatter or all-gather) of the sharded step's tail: the last
  // gradient reduce-scatter, the LARS norm all-reduces after it and the all-gathers at the end of the step.
  const HardwareTable hw = FindHardwareTable("tpu-v3");
  const auto [rep_small, sh_small] = Resnet50(4, 4, 16, hw);
  const auto [rep_large, sh_large] = Resnet50(16, 16, 16, hw);
  // The replicated step: its all-reduces hide under the backward and the update (to a few microseconds).
  CHECK(rep_large.step_s == Approx(rep_small.step_s).epsilon(1e-4));
  CHECK(rep_large.exposed_communication_s < 1e-4 * rep_large.step_s);
  // The sharded step's forward and backward are the same on every mesh; its compute differs by the update
  // of 1/N of the weights (about 0.2% of the step at 4x4: its share grew as the backward got leaner).
  CHECK(sh_large.forward_s + sh_large.backward_s == Approx(sh_small.forward_s + sh_small.backward_s).epsilon(1e-4));
  CHECK(sh_small.compute_s - sh_large.compute_s == Approx(sh_small.weight_update_s - sh_large.weight_update_s).epsilon(0.02));
  CHECK(sh_large.weight_update_s < sh_small.weight_update_s);
  CHECK(rep_large.weight_update_s - sh_large.weight_update_s > 0.9 * rep_large.weight_update_s);
  CHECK(sh_large.exposed_communication_s > sh_small.exposed_communication_s);
  // The sharded step grows by its exposed communication, and by less than its interconnect's busy time does.
  const double growth = sh_large.step_s - sh_small.step_s;
  CHECK(growth == Approx(sh_large.exposed_communication_s - sh_small.exposed_communication_s +
                         sh_large.compute_s - sh_small.compute_s));
  CHECK(growth < sh_large.collective_s - sh_small.collective_s);
  // So the speedup shrinks by at most that latency, and sharding still wins.
  const double small = rep_small.step_s / sh_small.step_s, large = rep_large.step_s / sh_large.step_s;
  CHECK(large >= rep_large.step_s / (sh_small.step_s + sh_large.collective_s - sh_small.collective_s));
  CHECK(large > 1.0);
  CHECK(large <= small);
}

TEST_CASE("sharded optimizer state per core is 1/N of replicated, plus padding") {
  const HardwareTable hw = FindHardwareTable("tpu-v3");
  const MeshTopology mesh(2, 2);
  const int n = mesh.replicas();
  const ir::Module replicated_step = Step("mlp", n, 4, false, ir::OptimizerKind::kAdam);
  const SimulationResult replicated = Simulate(replicated_step, mesh, hw, Precision::kBf16);
  const SimulationResult sharded =
      Simulate(Step("mlp", n, 4, true, ir::OptimizerKind::kAdam), mesh, hw, Precision::kBf16);
  // Padding: at most one dim-0 row per state variable (N - 1 padded rows over N shards); the s32 step
  // counter stays whole.
  int64_t padding = 0;
  for (ir::ValueId v : replicated_step.VariablesWithRole(ir::kRoleOptimizerState)) {
    const ir::TensorType& t = replicated_step.type(v);
    padding += t.rank() == 0 ? t.bytes() : t.bytes() / t.shape[0];
  }
  const int64_t counter = 4;
  CHECK(replicated.optimizer_state_bytes > 1000000);
  CHECK(sharded.optimizer_state_bytes - counter >= (replicated.optimizer_state_bytes - counter) / n);
  CHECK(sharded.optimizer_state_bytes - counter <= (replicated.optimizer_state_bytes - counter) / n + padding);
  CHECK(sharded.weight_bytes == replicated.weight_bytes);  // gathered at the end of the step: stored whole
  CHECK(sharded.gradient_bytes > 0);
  CHECK(sharded.activation_bytes == replicated.activation_bytes);
  const std::string json = sharded.ToJson();
  for (const char* key : {"\"step_ms\":", "\"forward_ms\":", "\"backward_ms\":", "\"weight_update_ms\":",
                          "\"collective_ms\":", "\"exposed_communication_ms\":", "\"memory_bytes\":{", "\"weights\":",
                          "\"gradients\":", "\"optimizer_state\":", "\"activations\":", "\"link_traffic_bytes\":{"})
    CHECK(json.find(key) != std::string::npos);
  CHECK(json.find("\"optimizer_state\":" + std::to_string(sharded.optimizer_state_bytes)) != std::string::npos);
}

TEST_CASE("bad simulator input is an error naming the flag or the file and line") {
  const HardwareTable hw = FindHardwareTable("tpu-v3");
  const ir::Module step = Step("mlp", 8, 2, true, ir::OptimizerKind::kSgd);
  CHECK_THROWS_WITH(
      Simulate(step, MeshTopology(4, 4), hw, Precision::kBf16),
      Catch::Contains("--mesh: the 4x4 chips, 2 cores each (32 replicas) mesh has 32 cores but the step is "
                      "lowered for 8 replicas"));
  CHECK_THROWS_WITH(MeshTopology::Parse("4by4"), Catch::Contains("--mesh"));
  CHECK_THROWS_WITH(FindHardwareTable("tpu-v9", "--hardware"),
                    Catch::Contains("--hardware: unknown hardware table 'tpu-v9'"));
  // The simulator's own numbers are checked like the others: missing, or non-positive at its line.
  const auto dir = std::filesystem::temp_directory_path() / "shardstep_simulator_test";
  std::filesystem::create_directories(dir);
  std::ifstream in(std::string(SS_SOURCE_DIR) + "/tpu_backend/hardware/tpu-v3.toml");
  const std::string good((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto with = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    const size_t at = text.find(from);
    REQUIRE(at != std::string::npos);
    text.replace(at, from.size(), to);
    const std::string path = (dir / "bad.toml").string();
    std::ofstream(path) << text;
    return path;
  };
  CHECK_THROWS_WITH(ReadHardwareTable(with("vpu_lanes = 128", "")), Catch::Contains("missing 'vpu_lanes' in [chip]"));
  int line = 0;
  {
    std::ifstream f(std::string(SS_SOURCE_DIR) + "/tpu_backend/hardware/tpu-v3.toml");
    int k = 0;
    for (std::string l; std::getline(f, l);)
      if (++k, l.rfind("mxu_f32_passes", 0) == 0) line = k;
  }
  REQUIRE(line > 0);
  CHECK_THROWS_WITH(ReadHardwareTable(with("mxu_f32_passes = 6", "mxu_f32_passes = 0")),
                    Catch::Contains("bad.toml:" + std::to_string(line) + ": mxu_f32_passes must be positive, got 0"));
  std::filesystem::remove_all(dir);
}
