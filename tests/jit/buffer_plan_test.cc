// The buffer plan (jit/buffer_plan.h) and the step driver's promises: buffers live at once never
// share bytes, an MLP step's arena is smaller than one buffer per value, a step after the first
// allocates no buffers (global operator new is replaced by a counting one in this executable), and an
// error inside the driver comes back as the interpreter's message.
#include <catch2/catch.hpp>
#include <tbb/global_control.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <new>
#include <random>

#include "dsl/dsl.h"
#include "ir/builder.h"
#include "jit/buffer_plan.h"
#include "jit/compiled_step.h"
#include "models/models.h"
#include "runtime/dataset.h"
#include "runtime/sharding.h"

#include "tests/jit/counting_new.h"
#include "tests/test_util.h"

using namespace shardstep;
using jit::BufferRequest;

namespace {

// No two requests live at the same time overlap in the arena; all fit and are aligned.
void CheckValid(const std::vector<BufferRequest>& r, const jit::BufferPlan& plan, int64_t align) {
  REQUIRE(plan.offset.size() == r.size());
  for (size_t i = 0; i < r.size(); ++i) {
    if (r[i].bytes == 0) {
      CHECK(plan.offset[i] == -1);
      continue;
    }
    CHECK(plan.offset[i] % align == 0);
    CHECK(plan.offset[i] + r[i].bytes <= plan.arena_bytes);
    for (size_t j = 0; j < i; ++j) {
      if (r[j].bytes == 0 || r[i].first > r[j].last || r[j].first > r[i].last) continue;
      INFO("requests " << j << " and " << i);
      CHECK((plan.offset[i] + r[i].bytes <= plan.offset[j] || plan.offset[j] + r[j].bytes <= plan.offset[i]));
    }
  }
}

}  // namespace

TEST_CASE("PlanBuffers shares bytes only between buffers not live at once", "[jit][buffers]") {
  // a [0,1], b [1,2] meet at step 1 (b is written while a is read): apart. c [2,3] can reuse a.
  const std::vector<BufferRequest> r = {{1000, 0, 1}, {1000, 1, 2}, {1000, 2, 3}, {0, 0, 3}, {10, 3, 3}};
  const jit::BufferPlan plan = jit::PlanBuffers(r, 64);
  CheckValid(r, plan, 64);
  CHECK(plan.offset[0] == plan.offset[2]);
  CHECK(plan.offset[0] != plan.offset[1]);
  CHECK(plan.buffer_bytes == 3 * 1024 + 64);
  CHECK(plan.arena_bytes == 2 * 1024);  // the last one fits where b was
}

TEST_CASE("PlanBuffers on random lifetimes is always valid", "[jit][buffers]") {
  std::mt19937 rng(3);
  for (int round = 0; round < 50; ++round) {
    std::vector<BufferRequest> r(60);
    for (auto& q : r) {
      q.first = static_cast<int>(rng() % 40);
      q.last = q.first + static_cast<int>(rng() % 10);
      q.bytes = rng() % 7 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % 5000);
    }
    const jit::BufferPlan plan = jit::PlanBuffers(r, 64);
    CheckValid(r, plan, 64);
    CHECK(plan.arena_bytes <= plan.buffer_bytes);
  }
}

namespace {

dsl::Program Model(const std::string& name, int64_t batch) {
  dsl::Model m(name, /*seed=*/1);
  models::ModelOptions mo;
  mo.batch = batch;
  mo.hidden = {64, 32};
  mo.classes = 10;
  auto loss = name == "cnn" ? models::DefineCnn(m, mo) : models::DefineMlp(m, mo);
  return m.train(loss).optimizer(dsl::Adam().lr(1e-3)).replicas(1).build();
}

}  // namespace

TEST_CASE("an MLP or CNN step after the first allocates no buffers, and its arena is smaller than one buffer per value",
          "[jit][buffers]") {
  constexpr int64_t kBatch = 32;
  const std::string name = GENERATE(std::string("mlp"), std::string("cnn"));
  INFO("model " << name);
  dsl::Program p = Model(name, kBatch);
  auto step = jit::CompiledStep::Compile(p.step);
  const jit::CompileInfo& info = step->info();
  INFO("arena " << info.arena_bytes << " bytes, one buffer per value " << info.buffer_bytes << ", swapped "
                << info.swapped_bytes << ", in place " << info.in_place_updates);
  CHECK(info.arena_bytes > 0);
  CHECK(info.arena_bytes < info.buffer_bytes);
  // The new weights and Adam moments are stored over the old ones by their loops, not copied or swapped in.
  CHECK(info.in_place_updates >= 3 * (name == "mlp" ? 6 : 8));
  CHECK(info.swapped_bytes < 64);  // the step counter at most

  const runtime::Dataset d = runtime::SyntheticClassification(2 * kBatch, 1, 28, 28, 10, /*seed=*/11);
  runtime::BatchIterator it(d, kBatch, /*shuffle=*/false, /*seed=*/5,
                           name == "cnn" ? ir::Shape{1, 28, 28} : ir::Shape{784});
  runtime::TensorMap in;
  it.Next(&in["image"], &in["label"]);
  runtime::TensorMap vars = runtime::InitLogicalState(p.step), reference = vars;

  jit::Workspace ws;
  // The first step runs on this thread alone, the second with TBB's workers: a worker's first task
  // must not allocate either (which worker runs which task changes from step to step).
  float first = 0;
  {
    const tbb::global_control one_thread(tbb::global_control::max_allowed_parallelism, 1);
    first = step->Run(vars, in, 0, nullptr, &ws).at("loss").f32[0];
  }
  g_allocs = g_large = g_bytes = 0;
  g_counting = true;
  const runtime::TensorMap out = step->Run(vars, in, 0, nullptr, &ws);
  g_counting = false;
  // What remains is the returned outputs (Run returns them by value: a map node and the storage of
  // each); no buffer of any other value, no arena, no kernel argument array, no stride vector.
  int64_t large_outputs = 0;
  for (const auto& [name, t] : out) large_outputs += t.bytes() >= static_cast<int64_t>(kLarge);
  INFO("second step: " << g_allocs << " allocations, " << g_bytes << " bytes, " << g_large << " of >= " << kLarge
                       << " bytes; outputs " << out.size() << ", " << large_outputs << " of them >= " << kLarge << " bytes");
  if (kCountingAllocations) {
    CHECK(g_large == large_outputs);
    CHECK(g_allocs <= 3 * static_cast<int64_t>(out.size()));
  }

  // The shared buffers give the same numbers as a fresh workspace each step (every value written
  // before it is read), and the loss moved.
  jit::Workspace fresh1, fresh2;
  step->Run(reference, in, 0, nullptr, &fresh1);
  const runtime::TensorMap again = step->Run(reference, in, 0, nullptr, &fresh2);
  CHECK(again.at("loss") == out.at("loss"));
  CHECK(reference == vars);
  CHECK(out.at("loss").f32[0] != first);
}

TEST_CASE("the step driver comes out of the disk cache with the kernels and runs the same step", "[jit][cache]") {
  const testing::TempDir dir;  // removed at the end, also when a check fails
  jit::JitOptions o;
  o.cache_dir = dir.path;
  o.memory_cache = false;
  dsl::Program p = Model("mlp", 8);
  auto cold = jit::CompiledStep::Compile(p.step, o);
  auto warm = jit::CompiledStep::Compile(p.step, o);
  CHECK(cold->info().source == "compiled");
  REQUIRE(warm->info().source == "disk cache");
  runtime::TensorMap in{{"image", runtime::Tensor(ir::TensorType{ir::DType::kF32, {8, 784}})},
                        {"label", runtime::Tensor::S32({8}, {0, 1, 2, 3, 4, 5, 6, 7})}};
  for (int64_t i = 0; i < 8 * 784; ++i) in["image"].f32[i] = static_cast<float>(i % 13) / 13;
  runtime::TensorMap a = runtime::InitLogicalState(p.step), b = a;
  jit::Workspace wa, wb;
  const runtime::TensorMap oa = cold->Run(a, in, 0, nullptr, &wa), ob = warm->Run(b, in, 0, nullptr, &wb);
  CHECK(oa.at("loss") == ob.at("loss"));
  CHECK(a == b);
}

// Planning that changes the kernels and the driver (here: loop outputs stored over a dead input, or not) is
// in the cache keys: a step planned the other way from the disk cache would run other loops over other
// buffers. Each way is compiled once, then comes from the cache, and all give the same step.
TEST_CASE("steps planned with and without reused inputs are cached apart and run the same step", "[jit][cache]") {
  const testing::TempDir dir;
  jit::JitOptions on;
  on.cache_dir = dir.path;
  on.memory_cache = false;
  jit::JitOptions off = on;
  off.reuse_inputs = false;
  dsl::Program p = Model("mlp", 8);
  auto with = jit::CompiledStep::Compile(p.step, on);
  auto without = jit::CompiledStep::Compile(p.step, off);
  auto without_again = jit::CompiledStep::Compile(p.step, off);
  auto with_again = jit::CompiledStep::Compile(p.step, on);
  CHECK(with->info().source == "compiled");
  CHECK(without->info().source == "compiled");
  CHECK(without_again->info().source == "disk cache");
  CHECK(with_again->info().source == "disk cache");
  CHECK(with->info().reused_inputs > 0);
  CHECK(without->info().reused_inputs == 0);
  runtime::TensorMap in{{"image", runtime::Tensor(ir::TensorType{ir::DType::kF32, {8, 784}})},
                        {"label", runtime::Tensor::S32({8}, {0, 1, 2, 3, 4, 5, 6, 7})}};
  for (int64_t i = 0; i < 8 * 784; ++i) in["image"].f32[i] = static_cast<float>(i % 11) / 11;
  const runtime::TensorMap init = runtime::InitLogicalState(p.step);
  std::vector<runtime::TensorMap> vars;
  std::vector<runtime::TensorMap> outs;
  for (const auto& step : {with, without, without_again, with_again}) {
    vars.push_back(init);
    jit::Workspace ws;
    outs.push_back(step->Run(vars.back(), in, 0, nullptr, &ws));
  }
  for (size_t i = 1; i < outs.size(); ++i) {
    INFO("step " << i);
    CHECK(outs[i].at("loss") == outs[0].at("loss"));
    CHECK(vars[i] == vars[0]);
  }
}

TEST_CASE("an error inside the step driver is the instruction's message, and the next step runs", "[jit][errors]") {
  ir::Module m;
  ir::Builder b(&m);
  auto table = b.Input("table", {ir::DType::kF32, {10, 3}});
  auto idx = b.Input("idx", {ir::DType::kS32, {2}});
  m.outputs.push_back({"rows", b.Emit(ir::OpCode::kGather, {table, idx})});
  auto step = jit::CompiledStep::Compile(m);
  runtime::TensorMap vars, in{{"table", runtime::Tensor(ir::TensorType{ir::DType::kF32, {10, 3}})},
                              {"idx", runtime::Tensor::S32({2}, {1, 12})}};
  jit::Workspace ws;
  CHECK_THROWS_WITH(step->Run(vars, in, 0, nullptr, &ws), "%2 = gather: gather index 12 out of range [0,10)");
  in["idx"] = runtime::Tensor::S32({2}, {1, 9});
  in["table"].f32[27] = 5;
  CHECK(step->Run(vars, in, 0, nullptr, &ws).at("rows").f32[3] == 5);
}
