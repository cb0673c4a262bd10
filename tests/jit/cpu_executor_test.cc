// The CPU JIT executor against the interpreter on whole training steps (MLP and CNN), sharded vs
// replicated bitwise identity on the JIT, the ElementwiseFuser's groups, and the compile cache.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "dsl/dsl.h"
#include "ir/passes/elementwise_fuser.h"
#include "ir/printer.h"
#include "jit/compiled_step.h"
#include "jit/cpu_executor.h"
#include "jit/small_gemm.h"
#include "models/models.h"
#include "runtime/dataset.h"
#include "runtime/executor.h"
#include "runtime/sharding.h"
#include "tests/jit/small_programs.h"

using namespace shardstep;
using namespace shardstep::runtime;

namespace {

constexpr int64_t kBatch = 24;

dsl::Program Build(bool cnn, ir::OptimizerConfig opt, int replicas = 1, bool shard = false) {
  test::SmallProgram s;
  s.cnn = cnn;
  s.batch = kBatch;
  return test::Build(s, opt, replicas, shard);
}

std::vector<TensorMap> Batches(bool cnn, int steps) {
  static const Dataset d = SyntheticClassification(480, 1, 28, 28, 10, /*seed=*/11);
  return test::Batches(d, cnn, kBatch, steps, /*order_seed=*/5);
}

// Per element: |got - want| <= rtol * |want| + atol (want: the interpreter's value). Returns the
// worst ratio |got - want| / (rtol * |want| + atol): the check passes when it is <= 1.
double WorstRatio(const Tensor& want, const Tensor& got, double rtol, double atol) {
  double worst = 0;
  for (int64_t i = 0; i < want.elements(); ++i)
    worst = std::max(worst, std::abs(got.at(i) - want.at(i)) / (rtol * std::abs(want.at(i)) + atol));
  return worst;
}

std::string Describe(const Tensor& a, const Tensor& b) {
  int64_t differing = 0, first = -1;
  for (int64_t i = 0; i < a.elements(); ++i)
    if (std::memcmp(static_cast<const char*>(a.raw()) + 4 * i, static_cast<const char*>(b.raw()) + 4 * i, 4) != 0 &&
        ++differing == 1)
      first = i;
  std::ostringstream os;
  os << differing << " of " << a.elements() << " elements differ";
  if (first >= 0) os << "; first " << first << ": " << std::setprecision(9) << a.at(first) << " vs " << b.at(first);
  return os.str();
}

// Re-synchronised every step: the JIT starts each step from the interpreter's state, so each
// step's difference is measured on its own (loss and every variable element, per element).
//
// The interpreter sums matmul and convolution products in double, the JIT in float (oneDNN), so
// gradients differ by float rounding of their sums. SGD passes that on scaled by lr; Adam's first
// step is g / (|g| + eps) ~ sign(g), so with the default eps 1e-8 a gradient that cancels to ~1e-9
// flips sign with rounding and its weight moves by a full lr on one side only: the CNN's fc1.w
// (3136 x 128, sums of many cancelling products) does this; the MLP's does not. The CNN Adam case
// uses eps 1e-3: the update then changes by at most lr |dg| / eps = |dg|. (At eps 1e-4 it was 10 |dg|, which
// oneDNN's AVX-512 sgemm, blocking its sums otherwise than the AVX2 one, took to 1.9x the tolerance.)
void CheckAgainstInterpreter(bool cnn, ir::OptimizerConfig opt, int steps, double rtol = 1e-5, double atol = 1e-7) {
  dsl::Program p = Build(cnn, opt);
  const TensorMap init = InitLogicalState(p.step);
  auto ref = MakeInterpreterExecutor(p.step, init);
  auto jit = jit::MakeCpuExecutor(p.step, init);
  const auto batches = Batches(cnn, steps);
  for (int i = 0; i < steps; ++i) {
    jit->LoadLogicalState(ref->LogicalState());
    const float lr = ref->Step(batches[i]).at("loss").f32[0];
    const float lj = jit->Step(batches[i]).at("loss").f32[0];
    INFO("step " << i << " loss " << lr << " vs " << lj);
    CHECK(std::abs(lr - lj) <= 1e-5 * std::max(1.0f, std::abs(lr)));
    const TensorMap a = ref->LogicalState(), b = jit->LogicalState();
    REQUIRE(a.size() == b.size());
    for (const auto& [name, t] : a) {
      const double worst = WorstRatio(t, b.at(name), rtol, atol);
      INFO("variable " << name << ": " << Describe(t, b.at(name)) << "; worst |a-e| / (" << rtol << "|e| + " << atol
                       << ") = " << worst);
      CHECK(worst <= 1);
    }
  }
}

}  // namespace

TEST_CASE("MLP training steps on the JIT agree with the interpreter", "[jit][train]") {
  SECTION("sgd") { CheckAgainstInterpreter(false, dsl::SGD().lr(0.1), 5); }
  SECTION("adam") { CheckAgainstInterpreter(false, dsl::Adam().lr(1e-3), 5); }
}

TEST_CASE("CNN training steps on the JIT agree with the interpreter", "[jit][train]") {
  SECTION("sgd") { CheckAgainstInterpreter(true, dsl::SGD().lr(0.1), 3); }
  SECTION("adam") { CheckAgainstInterpreter(true, dsl::Adam().lr(1e-3).eps(1e-3), 3); }
}

TEST_CASE("JIT forward (evaluation) agrees with the interpreter", "[jit][train]") {
  dsl::Program p = Build(false, dsl::Adam().lr(1e-3));
  const TensorMap init = InitLogicalState(p.step);
  auto ref = MakeInterpreterExecutor(p.step, init);
  auto jit = jit::MakeCpuExecutor(p.step, init);
  const auto batches = Batches(false, 1);
  TensorMap a = ref->Forward(p.forward, batches[0]), b = jit->Forward(p.forward, batches[0]);
  REQUIRE(a.size() == b.size());
  for (auto& [name, t] : a) {
    const double worst = WorstRatio(t, b.at(name), 1e-5, 1e-6);  // logits of magnitude ~1
    INFO(name << ": worst |a-e| / (1e-5 |e| + 1e-6) = " << worst);
    CHECK(worst <= 1);
  }
}

TEST_CASE("sharded and replicated Adam on the JIT are bitwise identical", "[jit][sharding]") {
  constexpr int kSteps = 20;
  const auto batches = Batches(false, kSteps);
  for (int n : {2, 4}) {
    dsl::Program rep = Build(false, dsl::Adam().lr(1e-3), n, false), sh = Build(false, dsl::Adam().lr(1e-3), n, true);
    const TensorMap init = InitLogicalState(rep.step);
    auto a = jit::MakeCpuExecutor(rep.step, init), b = jit::MakeCpuExecutor(sh.step, init);
    for (int i = 0; i < kSteps; ++i) {
      a->Step(batches[i]);
      b->Step(batches[i]);
    }
    const TensorMap x = a->LogicalState(), y = b->LogicalState();
    REQUIRE(x.size() == y.size());
    for (auto& [name, t] : x) {
      INFO("N=" << n << " variable " << name << ": " << Describe(t, y.at(name)));
      CHECK(t == y.at(name));
      CHECK_FALSE(t == init.at(name));
    }
  }
}

TEST_CASE("sharded and replicated Adam on the JIT are bitwise identical for the CNN at N=2", "[jit][sharding]") {
  constexpr int kSteps = 4;
  const auto batches = Batches(true, kSteps);
  dsl::Program rep = Build(true, dsl::Adam().lr(1e-3), 2, false), sh = Build(true, dsl::Adam().lr(1e-3), 2, true);
  const TensorMap init = InitLogicalState(rep.step);
  auto a = jit::MakeCpuExecutor(rep.step, init), b = jit::MakeCpuExecutor(sh.step, init);
  for (int i = 0; i < kSteps; ++i) {
    a->Step(batches[i]);
    b->Step(batches[i]);
  }
  const TensorMap x = a->LogicalState(), y = b->LogicalState();
  for (auto& [name, t] : x) {
    INFO("variable " << name << ": " << Describe(t, y.at(name)));
    CHECK(t == y.at(name));
  }
}

// The sharded update's all-gathers write the weights straight into their variables
// (CompiledStep::PlanInPlaceUpdates), and in-process replicas then share one copy of each such weight
// (CpuExecutorOptions::share_weights): the same bits as private copies, through a reload of the state.
TEST_CASE("in-process replicas share the weights the sharded update gathers into, with private copies' bits",
          "[jit][sharding]") {
  constexpr int kSteps = 6, kReplicas = 4;
  const auto batches = Batches(false, kSteps);
  dsl::Program sh = Build(false, dsl::Adam().lr(1e-3), kReplicas, true);
  const bool with_output = GENERATE(false, true);
  ir::ValueId fc1_w = -1;
  for (ir::ValueId v = 0; v < sh.step.size(); ++v)
    if (sh.step.at(v).op == ir::OpCode::kVariable && sh.step.at(v).name == "fc1.w") fc1_w = v;
  REQUIRE(fc1_w >= 0);
  // An output of the old weight is read at the step's end: that weight keeps its own buffer.
  if (with_output) sh.step.outputs.push_back({"fc1.w_before", fc1_w});
  INFO("with an output of @fc1.w: " << with_output);
  const TensorMap init = InitLogicalState(sh.step);
  jit::CpuExecutorOptions shared, own;
  own.share_weights = false;
  jit::CpuExecutor a(sh.step, init, shared), b(sh.step, init, own);
  const int gathered = a.compile_info().gathered_updates;
  CHECK(gathered >= (with_output ? 1 : 2));  // fc1.w and fc2.w at least (a padded bias is sliced out of its rows: a copy)
  CHECK_FALSE(a.compiled().GatheredVariableSlots(kReplicas).empty());
  const auto names = a.compiled().variable_names();
  const auto slots = a.compiled().GatheredVariableSlots(kReplicas);
  const bool fc1_shared =
      std::find_if(slots.begin(), slots.end(), [&](int s) { return names[s] == "fc1.w"; }) != slots.end();
  CHECK(fc1_shared == !with_output);
  TensorMap before = init;
  for (int i = 0; i < kSteps; ++i) {
    if (i == 3) {  // a reload binds the replicas again
      a.LoadLogicalState(a.LogicalState());
      b.LoadLogicalState(b.LogicalState());
    }
    const TensorMap oa = a.Step(batches[i]), ob = b.Step(batches[i]);
    CHECK(oa.at("loss") == ob.at("loss"));
    if (with_output) CHECK(oa.at("fc1.w_before") == before.at("fc1.w"));
    before = a.LogicalState();
  }
  const TensorMap x = a.LogicalState(), y = b.LogicalState();
  for (auto& [name, t] : x) {
    INFO("variable " << name << ": " << Describe(t, y.at(name)));
    CHECK(t == y.at(name));
    CHECK_FALSE(t == init.at(name));
  }
  TensorMap images;  // one replica's batch
  for (const char* name : {"image", "label"}) images[name] = SliceBatch(batches[0].at(name), kReplicas, 0);
  CHECK(a.Forward(sh.forward, images).at("logits") == b.Forward(sh.forward, images).at("logits"));
}

// The replicas' few rows times a weight they share read one packed copy of it, packed once a step by
// the replicas together (jit/shared_weight_packs.h): the bits of each replica packing it itself, and of
// the replicated update, through a reload.
TEST_CASE("in-process replicas share the packed copy of a shared weight, with the bits of their own packing",
          "[jit][sharding]") {
  constexpr int kSteps = 5, kReplicas = 4;
  const auto batches = Batches(false, kSteps);
  test::SmallProgram s;
  s.batch = kBatch;
  s.hidden = {128, 64};  // fc1 [6 rows, 784] x [784, 128] and fc2 [6, 128] x [128, 64] per replica
  dsl::Program sh = test::Build(s, dsl::Adam().lr(1e-3), kReplicas, true);
  dsl::Program rep = test::Build(s, dsl::Adam().lr(1e-3), kReplicas, false);
  const TensorMap init = InitLogicalState(sh.step);
  jit::CpuExecutorOptions packs, own;
  own.share_packs = false;
  jit::CpuExecutor a(sh.step, init, packs), b(sh.step, init, own), c(rep.step, init, packs);
  if (!jit::SmallGemmApplies(false, false, kBatch / kReplicas, 128, 784)) {
    CHECK(a.shared_packed_products() == 0);
    WARN("SmallGemm does not take these products on this CPU (oneDNN's avx512_core kernels, or no AVX2)");
    return;
  }
  CHECK(a.shared_packed_products() == 2);
  CHECK(a.shared_packed_bytes() >= int64_t{4} * (784 * 128 + 128 * 64));
  CHECK(b.shared_packed_products() == 0);
  CHECK(c.shared_packed_products() == 0);  // the replicated update shares no weight
  for (int i = 0; i < kSteps; ++i) {
    if (i == 2) a.LoadLogicalState(a.LogicalState());  // bound again; the packs are made again too
    const TensorMap oa = a.Step(batches[i]), ob = b.Step(batches[i]), oc = c.Step(batches[i]);
    CHECK(oa.at("loss") == ob.at("loss"));
    CHECK(oa.at("loss") == oc.at("loss"));
  }
  const TensorMap x = a.LogicalState(), y = b.LogicalState(), z = c.LogicalState();
  for (auto& [name, t] : x) {
    INFO("variable " << name << ": " << Describe(t, y.at(name)) << "; replicated: " << Describe(t, z.at(name)));
    CHECK(t == y.at(name));
    CHECK(t == z.at(name));
    CHECK_FALSE(t == init.at(name));
  }
}

TEST_CASE("weight gradients their reduce-scatter computes and folds have the bits of materialised ones",
          "[jit][sharding]") {
  constexpr int kSteps = 4, kReplicas = 4;
  const auto batches = Batches(false, kSteps);
  const dsl::Program sh = Build(false, dsl::Adam().lr(1e-3), kReplicas, true);
  const dsl::Program rep = Build(false, dsl::Adam().lr(1e-3), kReplicas, false);
  const TensorMap init = InitLogicalState(sh.step);
  jit::CpuExecutorOptions folding, materialising;
  materialising.fold_products = false;
  jit::CpuExecutor a(sh.step, init, folding), b(sh.step, init, materialising), c(rep.step, init);
  // fc1's [784, 25] gradient: 784 rows in 4 row blocks (the others' rows do not divide by 4).
  CHECK(a.folded_products() >= 1);
  CHECK(b.folded_products() == 0);
  CHECK(c.folded_products() == 0);
  for (int i = 0; i < kSteps; ++i) {
    const TensorMap oa = a.Step(batches[i]), ob = b.Step(batches[i]), oc = c.Step(batches[i]);
    CHECK(oa.at("loss") == ob.at("loss"));
    CHECK(oa.at("loss") == oc.at("loss"));
  }
  const TensorMap x = a.LogicalState(), y = b.LogicalState(), z = c.LogicalState();
  for (auto& [name, t] : x) {
    INFO("variable " << name << ": folded vs materialised " << Describe(t, y.at(name)) << "; vs replicated "
                     << Describe(t, z.at(name)));
    CHECK(t == y.at(name));
    CHECK(t == z.at(name));
    CHECK_FALSE(t == init.at(name));
  }
}

TEST_CASE("the JIT executor's state round-trips and matches the interpreter at N=2 sharded", "[jit][sharding]") {
  dsl::Program p = Build(false, dsl::Adam().lr(1e-3), 2, true);
  const TensorMap init = InitLogicalState(p.step);
  auto ref = MakeInterpreterExecutor(p.step, init);
  auto jit = jit::MakeCpuExecutor(p.step, init);
  const auto batches = Batches(false, 3);
  for (int i = 0; i < 3; ++i) {
    jit->LoadLogicalState(ref->LogicalState());
    ref->Step(batches[i]);
    jit->Step(batches[i]);
    for (auto& [name, t] : ref->LogicalState()) {
      const double worst = WorstRatio(t, jit->LogicalState().at(name), 1e-5, 1e-7);
      INFO("step " << i << " variable " << name << ": worst |a-e| / (1e-5 |e| + 1e-7) = " << worst);
      CHECK(worst <= 1);
    }
  }
}

TEST_CASE("ElementwiseFuser puts a tensor's whole Adam update in one group and changes only attributes",
          "[jit][fuser]") {
  dsl::Program p = Build(false, dsl::Adam().lr(1e-3));
  ir::Module fused = p.step;
  CHECK(ir::ElementwiseFuser().Run(fused));
  // Only attributes changed: strip them and the module is what it was.
  ir::Module stripped = fused;
  for (auto& in : stripped.instrs) in.attrs.erase(ir::kFusionAttr);
  CHECK(stripped == p.step);
  // Idempotent.
  ir::Module again = fused;
  ir::ElementwiseFuser().Run(again);
  CHECK(again == fused);
  // The new value of fc1.w/m, fc1.w/v and fc1.w are all computed in one group.
  auto group_of = [&](const std::string& var) {
    const ir::ValueId v = fused.AssignedValue(fused.FindVariable(var));
    return fused.at(v).GetInt(ir::kFusionAttr, -1);
  };
  CHECK(group_of("fc1.w") >= 0);
  CHECK(group_of("fc1.w") == group_of("fc1.w/m"));
  CHECK(group_of("fc1.w") == group_of("fc1.w/v"));
  // The interpreter runs the fused module unchanged.
  TensorMap s1 = InitLogicalState(p.step), s2 = s1;
  const auto batches = Batches(false, 1);
  RunStep(p.step, s1, batches[0]);
  RunStep(fused, s2, batches[0]);
  for (auto& [name, t] : s1) CHECK(t == s2.at(name));
}

TEST_CASE("relu's gradient mask is computed in the backward loop from relu's output, not kept by the forward one",
          "[jit][fuser]") {
  for (bool cnn : {false, true}) {
    dsl::Program p = Build(cnn, dsl::Adam().lr(1e-3));
    ir::Module fused = p.step;
    ir::ElementwiseFuser().Run(fused);
    const auto users = fused.Users();
    int relus = 0;
    for (ir::ValueId v = 0; v < fused.size(); ++v) {
      if (fused.at(v).op != ir::OpCode::kRelu) continue;
      ++relus;
      INFO((cnn ? "cnn" : "mlp") << " relu %" << v);
      const int forward = fused.at(v).GetInt(ir::kFusionAttr, -1);
      int masks = 0;
      for (ir::ValueId u : users[v]) {
        if (fused.at(u).op != ir::OpCode::kGt) continue;
        ++masks;
        // The mask's group is not the forward loop's, and the select reading it is in the mask's group.
        const int group = fused.at(u).GetInt(ir::kFusionAttr, -1);
        CHECK(group != forward);
        for (ir::ValueId s : users[u]) {
          CHECK(fused.at(s).op == ir::OpCode::kSelect);
          CHECK(fused.at(s).GetInt(ir::kFusionAttr, -1) == group);
        }
      }
      CHECK(masks == 1);
    }
    CHECK(relus >= 2);
  }
}

TEST_CASE("the disk cache skips compilation, and a corrupt entry is rejected and recompiled", "[jit][cache]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("shardstep-jit-cache-test-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  jit::JitOptions o;
  o.cache_dir = dir.string();
  o.memory_cache = false;
  dsl::Program p = Build(false, dsl::Adam().lr(1e-3));
  auto cold = jit::CompiledStep::Compile(p.step, o);
  CHECK(cold->info().source == "compiled");
  auto warm = jit::CompiledStep::Compile(p.step, o);
  CHECK(warm->info().source == "disk cache");
  INFO("cold " << cold->info().seconds << " s, cached " << warm->info().seconds << " s");
  CHECK(warm->info().seconds < cold->info().seconds);
  // Flip one byte of the object: detected, deleted, recompiled.
  const fs::path entry = dir / (cold->info().key + ".o");
  REQUIRE(fs::exists(entry));
  {
    std::fstream f(entry, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(entry) / 2));
    char c = 0;
    f.seekg(f.tellp());
    f.read(&c, 1);
    c ^= 0x5a;
    f.seekp(static_cast<std::streamoff>(fs::file_size(entry) / 2));
    f.write(&c, 1);
  }
  auto again = jit::CompiledStep::Compile(p.step, o);
  CHECK(again->info().source == "compiled");
  CHECK(again->info().rejected_corrupt);
  // Truncated: the same.
  fs::resize_file(entry, 100);
  auto trunc = jit::CompiledStep::Compile(p.step, o);
  CHECK(trunc->info().source == "compiled");
  // And the recompiled step runs correctly.
  TensorMap s1 = InitLogicalState(p.step), s2 = s1;
  const auto batches = Batches(false, 1);
  RunStep(p.step, s1, batches[0]);
  jit::Workspace ws;
  trunc->Run(s2, batches[0], 0, nullptr, &ws);
  for (auto& [name, t] : s1) {
    const double worst = WorstRatio(t, s2.at(name), 1e-5, 1e-7);
    INFO(name << ": worst |a-e| / (1e-5 |e| + 1e-7) = " << worst);
    CHECK(worst <= 1);
  }
  fs::remove_all(dir);
}

TEST_CASE("--emit=llvm: the fused loops are vectorised", "[jit]") {
  dsl::Program p = Build(false, dsl::Adam().lr(1e-3));
  const std::string ir = jit::EmitLlvmIr(p.step);
  CHECK(ir.find("x float>") != std::string::npos);
  // The optimisation remarks: the big loops (the Adam updates of the weight matrices) vectorised.
  int vectorized = 0;
  for (size_t at = 0; (at = ir.find("passed: vectorized loop", at)) != std::string::npos; ++at) ++vectorized;
  INFO(ir.substr(0, ir.find("\n\n")));
  CHECK(vectorized >= 6);
  CHECK(ir.find("fmul contract") == std::string::npos);
  CHECK(ir.find("fast") == std::string::npos);
}

TEST_CASE("bad input to the JIT executor is a clear error, not a crash", "[jit][errors]") {
  dsl::Program p = Build(false, dsl::Adam().lr(1e-3));
  auto jit = jit::MakeCpuExecutor(p.step, InitLogicalState(p.step));
  TensorMap in = Batches(false, 1)[0];
  TensorMap missing = in;
  missing.erase("label");
  CHECK_THROWS_WITH(jit->Step(missing), Catch::Contains("input @label: missing"));
  TensorMap wrong = in;
  wrong["image"] = Tensor(ir::TensorType{ir::DType::kF32, {kBatch, 783}});
  CHECK_THROWS_WITH(jit->Step(wrong), Catch::Contains("input @image: expected f32[24,784]"));
  TensorMap bad_label = in;
  bad_label["label"].s32[0] = 10;
  CHECK_THROWS_WITH(jit->Step(bad_label), Catch::Contains("one_hot"));
  // The state is untouched by the failed steps, and a good step still runs.
  CHECK(jit->LogicalState() == InitLogicalState(p.step));
  CHECK_NOTHROW(jit->Step(in));
}

TEST_CASE("a step bound to its tensors once runs by slot, with the name-based Run's bits and errors", "[jit][errors]") {
  dsl::Program p = Build(false, dsl::Adam().lr(1e-3));
  auto step = jit::CompiledStep::Compile(p.step);
  const TensorMap init = InitLogicalState(p.step);
  REQUIRE(step->variable_names().size() == init.size());
  CHECK(step->input_names() == std::vector<std::string>{"image", "label"});
  const auto batches = Batches(false, 3);
  TensorMap by_name = init, bound = init, out;
  jit::Workspace ws_name, ws_bound;
  jit::StepBinding b;
  step->BindVariables(bound, &b);
  step->BindOutputs(&out, &b);
  for (const TensorMap& batch : batches) {
    const TensorMap want = step->Run(by_name, batch, 0, nullptr, &ws_name);
    step->BindInputs(batch, &b);  // a new batch map each step: its tensors are bound, the rest stays
    step->Run(b, 0, nullptr, &ws_bound);
    CHECK(out == want);
    CHECK(bound == by_name);  // the assignments went into the bound tensors
  }
  CHECK_FALSE(bound == init);

  // A bound tensor replaced in place with the wrong shape: a clear error before anything is written.
  const std::string w = step->variable_names()[0];
  const TensorMap before = bound;
  const Tensor kept = bound.at(w);
  bound[w] = Tensor(ir::TensorType{ir::DType::kF32, {3}});
  CHECK_THROWS_WITH(step->Run(b, 0, nullptr, &ws_bound), Catch::Contains("variable @" + w + ": expected"));
  bound[w] = kept;
  CHECK(bound == before);
  CHECK_NOTHROW(step->Run(b, 0, nullptr, &ws_bound));  // the same binding, the tensor back

  // Binding a map without one of the step's names names it; an unbound binding is refused.
  TensorMap missing = init;
  missing.erase(w);
  jit::StepBinding fresh;
  CHECK_THROWS_WITH(step->BindVariables(missing, &fresh), Catch::Contains("variable @" + w + ": missing (expected"));
  CHECK_THROWS_WITH(step->Run(jit::StepBinding{}, 0, nullptr, &ws_bound), Catch::Contains("bind them first"));
}

TEST_CASE("s32 division by zero on the JIT is an error, as in the interpreter", "[jit][errors]") {
  ir::Module m;
  ir::Builder b(&m);
  auto x = b.Input("x", {ir::DType::kS32, {3}}), y = b.Input("y", {ir::DType::kS32, {3}});
  m.outputs.push_back({"q", b.Div(x, y)});
  TensorMap vars, in{{"x", Tensor::S32({3}, {7, -7, 1})}, {"y", Tensor::S32({3}, {2, 2, 0})}};
  CHECK_THROWS_WITH(jit::JitRunStep(m, vars, in), Catch::Contains("division by zero"));
  in["y"] = Tensor::S32({3}, {2, 2, 1});
  CHECK(jit::JitRunStep(m, vars, in).at("q") == Tensor::S32({3}, {3, -3, 1}));
}
