// Collectives lowered to ring steps in the IR (tpu_backend/ring_lowering.h, issue 10 item 4): on meshes
// from 1x2 to 4x4 (2 cores per chip, and some with 1), for the whole mesh and the groups along each
// axis, every collective kind run as the lowered module on the JIT (one thread per core, as the
// executor) gives the bits of MeshCollectives' direct call (the unlowered module on the interpreter,
// which calls it), moves the same bytes and messages over every link and on chip, and the lowered
// module holds no all_reduce / reduce_scatter / all_gather. Plus: permutes between non-neighbours are
// errors naming both replicas, and the interpreter runs a lowered module to the same bits.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <random>
#include <thread>

#include <algorithm>
#include <chrono>
#include <iostream>

#include "dsl/dsl.h"
#include "ir/builder.h"
#include "ir/error.h"
#include "ir/passes/pipeline.h"
#include "jit/cpu_executor.h"
#include "models/models.h"
#include "runtime/sharding.h"
#include "tpu_backend/mesh_backend.h"
#include "tpu_backend/mesh_shard_order.h"
#include "ir/verifier.h"
#include "jit/compiled_step.h"
#include "runtime/inprocess_collectives.h"
#include "runtime/interpreter.h"
#include "tpu_backend/mesh_collectives.h"
#include "tpu_backend/ring_lowering.h"

using namespace shardstep;
using namespace shardstep::tpu;
using ir::DType;
using ir::OpCode;
using runtime::Tensor;
using runtime::TensorMap;

namespace {

// Runs `body(r)` on one thread per replica; the first failure aborts the collectives and is rethrown.
void OnEveryReplica(int replicas, runtime::Collectives& c, const std::function<void(int)>& body) {
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < replicas; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        c.Abort(e.what());
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

std::vector<TensorMap> RunJit(const ir::Module& m, const std::vector<TensorMap>& inputs, runtime::Collectives& c) {
  auto step = jit::CompiledStep::Compile(m, jit::JitOptions{"", /*disk_cache=*/false});
  std::vector<TensorMap> out(m.num_replicas);
  OnEveryReplica(m.num_replicas, c, [&](int r) {
    TensorMap vars;
    jit::Workspace ws;
    out[r] = step->Run(vars, inputs[r], r, &c, &ws);
  });
  return out;
}

std::vector<TensorMap> RunInterpreter(const ir::Module& m, const std::vector<TensorMap>& inputs,
                                      runtime::Collectives& c) {
  std::vector<TensorMap> out(m.num_replicas);
  OnEveryReplica(m.num_replicas, c, [&](int r) {
    TensorMap vars;
    out[r] = runtime::RunStep(m, vars, inputs[r], r, &c);
  });
  return out;
}

struct Collective {
  std::string name;
  OpCode op;
  std::string reduction;  // "" for all_gather
  int64_t n;              // all_reduce: elements; reduce_scatter: output rows; all_gather: input rows
  DType dtype = DType::kF32;
};

// Every kind, with sizes that do not divide the group (all_reduce pads) and chunks of one float (no
// high half). Along one axis (the same one-phase code as each phase of the whole mesh) a subset, to
// keep the test fast.
std::vector<Collective> Kinds(bool all = true) {
  if (!all)
    return {{"all_reduce sum", OpCode::kAllReduce, "sum", 37},
            {"all_reduce max", OpCode::kAllReduce, "max", 29},
            {"reduce_scatter mean", OpCode::kReduceScatter, "mean", 3},
            {"all_gather", OpCode::kAllGather, "", 3}};
  return {{"all_reduce sum", OpCode::kAllReduce, "sum", 37},
          {"all_reduce max", OpCode::kAllReduce, "max", 29},
          {"all_reduce mean", OpCode::kAllReduce, "mean", 13},
          {"all_reduce sum small", OpCode::kAllReduce, "sum", 3},
          {"reduce_scatter sum", OpCode::kReduceScatter, "sum", 5},
          {"reduce_scatter mean", OpCode::kReduceScatter, "mean", 1},
          {"all_gather", OpCode::kAllGather, "", 3},
          {"all_reduce sum bf16", OpCode::kAllReduce, "sum", 11, DType::kBF16}};
}

// One module with every kind over `groups` (group size g); input x<i>, output y<i>.
ir::Module Collectives(int replicas, const ir::IntLists& groups, bool all_kinds = true) {
  ir::Module m;
  m.name = "collectives";
  m.num_replicas = replicas;
  ir::Builder b(&m);
  const int64_t g = static_cast<int64_t>(groups[0].size());
  const auto kinds = Kinds(all_kinds);
  for (size_t i = 0; i < kinds.size(); ++i) {
    const Collective& k = kinds[i];
    const int64_t rows = k.op == OpCode::kReduceScatter ? k.n * g : k.n;
    const ir::ValueId x = b.Input(Str("x", i), {k.dtype, {rows, 2}});
    ir::Attrs attrs{{"groups", groups}, {"group_size", g}};
    if (!k.reduction.empty()) attrs["reduction"] = k.reduction;
    m.outputs.push_back({Str("y", i), b.Emit(k.op, {x}, attrs)});
  }
  ir::Verify(m);
  return m;
}

// Values of many magnitudes, so that a different fold order changes the bits; a NaN for max.
std::vector<TensorMap> Inputs(const ir::Module& m, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<TensorMap> out(m.num_replicas);
  for (int r = 0; r < m.num_replicas; ++r)
    for (const ir::Instr& in : m.instrs) {
      if (in.op != OpCode::kInput) continue;
      std::vector<float> v(in.type.elements());
      for (float& e : v) e = std::ldexp(normal(rng), static_cast<int>(rng() % 24) - 12);
      if (r == 1 && in.name == "x1") v[3] = std::nanf("");  // max (both kind lists)
      Tensor t = Tensor::F32(in.type.shape, v);
      out[r][in.name] = in.type.dtype == DType::kBF16 ? t.AsFloat(DType::kBF16) : t;
    }
  return out;
}

bool SameBits(const Tensor& a, const Tensor& b) {
  return a.type == b.type && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

int Count(const ir::Module& m, OpCode op) {
  int n = 0;
  for (const ir::Instr& in : m.instrs) n += in.op == op;
  return n;
}

std::vector<MeshTopology> Meshes() {
  return {MeshTopology(1, 2), MeshTopology(2, 1), MeshTopology(2, 2), MeshTopology(1, 4), MeshTopology(2, 4),
          MeshTopology(4, 4), MeshTopology(2, 2, 1), MeshTopology(4, 1, 1)};
}

}  // namespace

TEST_CASE("lowered collectives equal MeshCollectives bit for bit and move the same bytes per link") {
  int compared = 0, differs_from_in_process = 0;
  for (const MeshTopology& mesh : Meshes()) {
    std::vector<std::pair<std::string, ir::IntLists>> groupings = {{"whole mesh", {mesh.AllReplicas()}}};
    for (MeshAxis a : {MeshAxis::kCore, MeshAxis::kX, MeshAxis::kY})
      if (mesh.AxisSize(a) > 1 && mesh.AxisSize(a) < mesh.replicas())
        groupings.push_back({Str("along ", AxisName(a)), mesh.GroupsAlong(a)});
    for (const auto& [label, groups] : groupings) {
      INFO(mesh.ToString() << ", " << label);
      const bool whole = groups.size() == 1;
      const std::vector<Collective> kinds = Kinds(whole);
      const ir::Module m = Collectives(mesh.replicas(), groups, whole);
      ir::Module lowered = m;
      CHECK(LowerCollectivesToRingSteps(lowered, mesh) == static_cast<int>(kinds.size()));
      ir::Verify(lowered);
      CHECK(Count(lowered, OpCode::kAllReduce) + Count(lowered, OpCode::kReduceScatter) +
                Count(lowered, OpCode::kAllGather) ==
            0);
      CHECK(Count(lowered, OpCode::kCollectivePermute) > 0);
      const std::vector<TensorMap> in = Inputs(m, 7 + mesh.replicas());

      MeshCollectives direct(mesh), ring(mesh);
      const auto want = RunInterpreter(m, in, direct);
      const auto got = RunJit(lowered, in, ring);
      runtime::InProcessCollectives ip(mesh.replicas());
      const auto sequential = RunInterpreter(m, in, ip);
      for (int r = 0; r < mesh.replicas(); ++r)
        for (size_t i = 0; i < kinds.size(); ++i) {
          const std::string y = Str("y", i);
          INFO("replica " << r << " " << kinds[i].name);
          CHECK(SameBits(got[r].at(y), want[r].at(y)));
          ++compared;
          differs_from_in_process += !SameBits(want[r].at(y), sequential[r].at(y));
        }
      const LinkTraffic a = direct.traffic(), b = ring.traffic();
      CHECK(b.bytes == a.bytes);
      CHECK(b.messages == a.messages);
      CHECK(b.on_chip_bytes == a.on_chip_bytes);
      CHECK(b.on_chip_messages == a.on_chip_messages);
      CHECK(a.TotalLinkBytes() + a.on_chip_bytes > 0);
    }
  }
  CHECK(compared > 0);
  // The comparison can fail: the ring's fold order is not the in-process 0..g-1 order, so these
  // inputs give other bits there for many results.
  CHECK(differs_from_in_process > 0);
}

TEST_CASE("the interpreter runs a lowered module to the same bits as the JIT") {
  const MeshTopology mesh(2, 2);
  const ir::Module m = Collectives(mesh.replicas(), {mesh.AllReplicas()});
  ir::Module lowered = m;
  LowerCollectivesToRingSteps(lowered, mesh);
  const std::vector<TensorMap> in = Inputs(m, 3);
  MeshCollectives direct(mesh), a(mesh);
  runtime::InProcessCollectives b(mesh.replicas());
  const auto want = RunInterpreter(m, in, direct);
  const auto interp_mesh = RunInterpreter(lowered, in, a);
  const auto interp_any = RunInterpreter(lowered, in, b);  // in-process point-to-point: any pair
  for (int r = 0; r < mesh.replicas(); ++r)
    for (const auto& [name, t] : want[r]) {
      INFO("replica " << r << " " << name);
      CHECK(SameBits(interp_mesh[r].at(name), t));
      CHECK(SameBits(interp_any[r].at(name), t));
    }
  CHECK(a.traffic().bytes == direct.traffic().bytes);
}

TEST_CASE("groups of one become the identity; other groupings are left alone") {
  const MeshTopology mesh(1, 2);  // 4 replicas
  ir::Module m;
  m.num_replicas = 4;
  ir::Builder b(&m);
  const ir::ValueId x = b.Input("x", {DType::kF32, {4}});
  m.outputs.push_back({"one", b.AllReduce(x, "sum", {{0}, {1}, {2}, {3}})});
  m.outputs.push_back({"odd", b.AllReduce(x, "sum", {{0, 3}, {1, 2}})});
  CHECK(LowerCollectivesToRingSteps(m, mesh) == 1);
  CHECK(m.at(m.outputs[0].second).op == OpCode::kInput);
  CHECK(m.at(m.outputs[1].second).op == OpCode::kAllReduce);
  ir::Module wrong = m;
  wrong.num_replicas = 8;
  CHECK_THROWS_WITH(LowerCollectivesToRingSteps(wrong, mesh), Catch::Contains("8 replicas"));
}

TEST_CASE("a permute between replicas that are not neighbours is an error naming them") {
  const MeshTopology mesh(2, 2);  // replica 3 is chip (1,1) core 0: diagonal to replica 0's chip
  MeshCollectives c(mesh);
  std::vector<float> x(4, 1.0f), y(4);
  CHECK_THROWS_WITH(c.Permute(0, 3, x.data(), -1, y.data(), 4, +1),
                    Catch::Contains("replica 0") && Catch::Contains("replica 3") &&
                        Catch::Contains("2x2 chips, 2 cores each"));
  const MeshTopology wide(4, 1, 1);  // x = 0 and x = 2 are two hops apart
  MeshCollectives w(wide);
  CHECK_THROWS_WITH(w.Permute(0, 2, x.data(), -1, y.data(), 4, +1), Catch::Contains("not torus neighbours"));
  // Neighbours along y, along x (both ways round the 4-ring) and cores of one chip are fine.
  c.Permute(0, 1, x.data(), -1, y.data(), 4, +1);
  c.Permute(0, 2, x.data(), -1, y.data(), 4, -1);
  c.Permute(0, 4, x.data(), -1, y.data(), 4, +1);
  w.Permute(0, 3, x.data(), -1, y.data(), 4, -1);
  CHECK(c.traffic().TotalLinkBytes() == 32);
  CHECK(c.traffic().on_chip_bytes == 16);
  CHECK(w.traffic().TotalLinkBytes() == 16);
  CHECK(y == std::vector<float>(4, 0.0f));  // no source: zeros

  // In a module on the JIT: every core fails or is woken, none hangs.
  ir::Module m;
  m.num_replicas = mesh.replicas();
  ir::Builder b(&m);
  m.outputs.push_back(
      {"y", b.Emit(OpCode::kCollectivePermute, {b.Input("x", {DType::kF32, {4}})}, {{"pairs", ir::IntLists{{0, 3}}}})});
  ir::Verify(m);
  MeshCollectives d(mesh);
  std::vector<TensorMap> in(mesh.replicas(), TensorMap{{"x", Tensor::F32({4}, x)}});
  CHECK_THROWS_WITH(RunJit(m, in, d), Catch::Contains("replica 0") && Catch::Contains("replica 3"));
}

TEST_CASE("the verifier checks collective_permute's pairs") {
  auto module = [](ir::IntLists pairs) {
    ir::Module m;
    m.num_replicas = 4;
    ir::Builder b(&m);
    m.outputs.push_back(
        {"y", b.Emit(OpCode::kCollectivePermute, {b.Input("x", {DType::kF32, {2}})}, {{"pairs", pairs}})});
    return m;
  };
  ir::Verify(module({{0, 1}, {1, 0}, {2, 3}}));
  CHECK_THROWS_WITH(ir::Verify(module({{0, 1}, {0, 2}})), Catch::Contains("replica 0 as a source twice"));
  CHECK_THROWS_WITH(ir::Verify(module({{0, 1}, {2, 1}})), Catch::Contains("replica 1 as a target twice"));
  CHECK_THROWS_WITH(ir::Verify(module({{0, 4}})), Catch::Contains("names replica 4"));
  CHECK_THROWS_WITH(ir::Verify(module({{0, 1, 2}})), Catch::Contains("not [source,target]"));
}

// Not run by default (`ring_lowering_test "[bench]"`): the MLP 784-1024-1024-10 (Adam, sharded, per-core
// batch 8) on a 2x2 mesh, its op count before and after ring lowering and the median step time with
// the collectives as direct MeshCollectives calls vs lowered into the compiled step.
TEST_CASE("bench: MLP step on a 2x2 mesh, direct collectives vs ring steps in the IR", "[.][bench]") {
  const MeshTopology mesh(2, 2);
  models::ModelOptions o;
  o.batch = 8 * mesh.replicas();
  // SS_RING_BENCH_MODEL=resnet20: 8x8 images, 3 channels (as mesh_resnet20_slow_test).
  const std::string name = std::getenv("SS_RING_BENCH_MODEL") ? std::getenv("SS_RING_BENCH_MODEL") : "mlp";
  if (name != "mlp") o.image_size = 8, o.channels = 3;
  dsl::Model model(name, 0);
  model.train(models::FindModel(name).define(model, o));
  ir::Module step = model.lower(mesh.replicas(), dsl::Mode::kTrain);
  ir::PipelineOptions po;
  po.optimizer = ir::OptimizerConfig().kind(ir::OptimizerKind::kAdam).lr(0.01);
  po.replicas = mesh.replicas();
  po.shard_weight_update = true;
  ir::BuildTrainingPipeline(po).Run(step);
  ir::Module direct_step = step;
  LayOutAllReducesInShardOrder(direct_step);
  const ir::Module lowered = MeshStepModule(step, mesh);
  std::cout << "ops: " << direct_step.size() << " before ring lowering, " << lowered.size() << " after ("
            << Count(lowered, OpCode::kCollectivePermute) << " collective_permute)\n";

  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  TensorMap batch;
  for (const ir::Instr& in : step.instrs) {
    if (in.op != OpCode::kInput) continue;
    ir::TensorType global = in.type;  // the executor takes the global batch
    global.shape[0] *= mesh.replicas();
    Tensor t(global);
    for (int64_t i = 0; i < t.elements(); ++i)
      if (in.type.dtype == DType::kS32) t.s32[i] = static_cast<int32_t>(rng() % 10);
      else t.f32[i] = normal(rng);
    batch[in.name] = t;
  }
  const TensorMap init = runtime::InitLogicalState(step);
  jit::CpuExecutorOptions options;
  options.collectives = [mesh](int) -> std::unique_ptr<runtime::Collectives> {
    return std::make_unique<MeshCollectives>(mesh);
  };
  jit::CpuExecutor direct(direct_step, init, options);
  MeshExecutor ring(step, init, mesh);
  auto median_ms = [&](runtime::Executor& e) {
    for (int i = 0; i < 2; ++i) e.Step(batch);
    std::vector<double> ms;
    for (int i = 0; i < 10; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      e.Step(batch);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  const double a = median_ms(direct), b = median_ms(ring);
  std::cout << "median step: " << a << " ms with direct MeshCollectives calls, " << b << " ms lowered\n";
  // Same bits either way.
  const TensorMap sa = direct.LogicalState(), sb = ring.LogicalState();
  for (const auto& [name, t] : sa) CHECK(SameBits(t, sb.at(name)));
}
