// The executor path users run (CpuExecutor::Step) allocates nothing in a step after warm-up except
// the outputs it returns, for every built-in model at N = 1 and at N = 4 (replicated and with the
// weight update sharded), in f32 and with bf16 matmuls and convolutions (oneDNN's bf16 matmul: the
// memory objects are kept per thread and primitive, re-pointed at each call's operands). Global operator new is replaced by a counting one in this executable.
//
// What a step may allocate: the returned TensorMap, i.e. per output one map node, its shape vector
// (when rank > 0) and its storage (when non-empty): at most 3 allocations per output, and exactly
// one allocation of >= kLarge bytes per output of >= kLarge bytes (nothing else that large: no
// arena, no per-replica input slice, no per-replica output map, no collective scratch). oneDNN's
// execute (the convolutions) allocates its own argument map inside the library on every call; those
// are counted apart and reported, not allowed to hide ours.
#include <catch2/catch.hpp>
#include <tbb/global_control.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <new>

#include "dsl/dsl.h"
#include "jit/cpu_executor.h"
#include "models/models.h"
#include "runtime/sharding.h"

#include "tests/jit/counting_new.h"

using namespace shardstep;
using runtime::Tensor;
using runtime::TensorMap;

namespace {

// Small configurations of each built-in model (a global batch of 8: 2 examples per replica at N = 4).
dsl::Program Build(const std::string& model, int replicas, bool shard, const std::string& precision = "f32") {
  models::ModelOptions o;
  o.batch = 8;
  if (model == "mlp") o.hidden = {64, 32};
  if (model == "resnet20") o.image_size = 8, o.channels = 3;
  if (model == "transformer_lm" || model == "bert") {
    o.context = 8, o.layers = 2, o.width = 16, o.heads = 2, o.mlp_width = 32, o.vocab = 13;
  }
  dsl::Model m(model, /*seed=*/2);
  dsl::Tensor loss = models::FindModel(model).define(m, o);
  return m.train(loss)
      .optimizer(dsl::Adam().lr(1e-3))
      .replicas(replicas)
      .shard_weight_update(shard)
      .precision(precision)
      .build();
}

// The global batch for the step module's inputs (dimension 0 times the replicas): f32 in [-1, 1),
// s32 alternating 0, 1 (a valid label, token, segment and next-sentence flag for every model).
TensorMap Inputs(const ir::Module& step, int step_index) {
  TensorMap in;
  for (ir::ValueId v = 0; v < step.size(); ++v) {
    const ir::Instr& instr = step.at(v);
    if (instr.op != ir::OpCode::kInput) continue;
    ir::TensorType t = instr.type;
    if (!t.shape.empty()) t.shape[0] *= step.num_replicas;
    Tensor x(t);
    for (int64_t i = 0; i < x.elements(); ++i) {
      if (t.dtype == ir::DType::kF32) x.f32[i] = std::sin(0.37f * static_cast<float>(i + 11 * step_index));
      else if (t.dtype == ir::DType::kS32) x.s32[i] = static_cast<int32_t>((i + step_index) % 2);
    }
    in[instr.name] = std::move(x);
  }
  return in;
}

}  // namespace

TEST_CASE("a CpuExecutor step after warm-up allocates only its returned outputs, every model, N = 1 and 4, f32 and bf16",
          "[jit][buffers][replicas]") {
  const std::string model =
      GENERATE(std::string("mlp"), std::string("cnn"), std::string("resnet20"), std::string("transformer_lm"),
               std::string("bert"));
  const auto [replicas, shard] = GENERATE(std::make_pair(1, false), std::make_pair(4, false), std::make_pair(4, true));
  const std::string precision = GENERATE(std::string("f32"), std::string("bf16"));
  INFO("model " << model << ", N = " << replicas << (shard ? " sharded" : " replicated") << ", " << precision);
  // Under ASan nothing is counted: the MLP and the CNN still run the executor's reused outputs under its
  // checks; the larger models' steps (minutes to compile there) are covered by their own tests.
  if (!kCountingAllocations && model != "mlp" && model != "cnn") return;
  const dsl::Program p = Build(model, replicas, shard, precision);
  auto exec = jit::MakeCpuExecutor(p.step, runtime::InitLogicalState(p.step));
  const TensorMap in0 = Inputs(p.step, 0), in1 = Inputs(p.step, 1);
  float before = 0;
  {
    // Warm-up with TBB's workers held back, so the counted step is their first task: a worker's first
    // task must not allocate either (which worker runs which task changes from step to step).
    const tbb::global_control one_thread(tbb::global_control::max_allowed_parallelism, 1);
    for (int s = 0; s < 3; ++s) before = exec->Step(s % 2 ? in1 : in0).at("loss").f32[0];
  }

  g_allocs = g_large = g_bytes = g_library_allocs = 0;
  g_counting = true;
  const TensorMap out = exec->Step(in1);
  g_counting = false;
  const int64_t allocs = g_allocs, large = g_large, bytes = g_bytes, library = g_library_allocs;

  int64_t allowed = 0, large_outputs = 0;
  for (const auto& [name, t] : out) {
    allowed += 1 + (t.shape().empty() ? 0 : 1) + (t.bytes() > 0 ? 1 : 0);
    large_outputs += t.bytes() >= static_cast<int64_t>(kLarge);
  }
  if (std::getenv("SS_ALLOC_VERBOSE"))
    std::printf("%-15s N=%d %-10s %s: %lld allocations (%lld bytes, %lld >= %zu bytes); outputs %zu, allowed %lld; "
                "inside oneDNN's execute %lld\n",
                model.c_str(), replicas, shard ? "sharded" : "replicated", precision.c_str(), static_cast<long long>(allocs),
                static_cast<long long>(bytes), static_cast<long long>(large), kLarge, out.size(),
                static_cast<long long>(allowed), static_cast<long long>(library));
  INFO("counted step: " << allocs << " allocations, " << bytes << " bytes, " << large << " of >= " << kLarge
                        << " bytes; outputs " << out.size() << " (" << large_outputs << " of >= " << kLarge
                        << " bytes), allowed " << allowed);
  if (kCountingAllocations) {
    CHECK(large == large_outputs);
    CHECK(allocs <= allowed);
  }
  // The step ran: a finite loss that moved.
  REQUIRE(out.count("loss"));
  CHECK(std::isfinite(out.at("loss").f32[0]));
  CHECK(out.at("loss").f32[0] != before);
}
