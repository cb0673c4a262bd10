// In-place updates (CompiledStep::PlanInPlaceUpdates): a fused loop that reads a variable at the index it
// writes stores the new value over the old one. Checked here: Adam's three arrays are updated in place
// with the interpreter's bits over several steps and TBB chunks; a variable read after its loop (by an
// output, another assignment, a later copy) keeps its own buffer and every reader sees the old value; and
// when an instruction that can fail runs after the loop, nothing is updated in place, so a failed step
// leaves every variable as it was (a collective after the loop does not stop it when a rendezvous of every
// replica comes before the loop and nothing after that can fail; nor does a gather of the replica's own
// row, which cannot fail); a loop with fused sums of its outputs updates in place too. The same mechanism
// stores a loop's output over a temporary the loop
// reads last (PlanReusedInputs), and an all-gather's result into the variable it is assigned to (the
// sharded weight update's), both checked at the end.
#include <catch2/catch.hpp>

#include <functional>
#include <string>
#include <vector>

#include "ir/builder.h"
#include "jit/compiled_step.h"
#include "runtime/inprocess_collectives.h"
#include "runtime/interpreter.h"
#include "runtime/replica_runner.h"

namespace shardstep {
namespace {

using runtime::Tensor;
using runtime::TensorMap;

std::shared_ptr<const jit::CompiledStep> Compile(const ir::Module& m, bool in_place_all_gathers = false) {
  jit::JitOptions o;
  o.disk_cache = false;
  o.in_place_all_gathers = in_place_all_gathers;
  return jit::CompiledStep::Compile(m, o);
}

Tensor Ramp(const ir::TensorType& t, float scale, float offset) {
  Tensor x(t);
  for (size_t i = 0; i < x.f32.size(); ++i) x.f32[i] = offset + scale * static_cast<float>(static_cast<int64_t>(i % 97) - 48);
  return x;
}

TEST_CASE("Adam's weights and moments are updated in place, with the interpreter's bits", "[jit][in_place]") {
  // 3 * 2^15 + 5 elements: several TBB chunks and a vector remainder.
  const int64_t n = GENERATE(int64_t{7}, int64_t{3 * 32768 + 5});
  INFO("n = " << n);
  ir::Module m;
  m.name = "adam";
  ir::Builder b(&m);
  const ir::TensorType t{ir::DType::kF32, {n}};
  auto w = b.Variable("w", t, ir::kRoleWeight), mm = b.Variable("m", t, ir::kRoleOptimizerState),
       v = b.Variable("v", t, ir::kRoleOptimizerState);
  auto g = b.Input("g", t);
  auto lr = b.Input("lr", {ir::DType::kF32, {}});
  m.outputs.push_back({"w_sum", b.SumAll(w)});  // scheduled before the update: does not stop it
  auto m2 = b.Add(b.MulScalar(mm, 0.9), b.MulScalar(g, 0.1));
  auto v2 = b.Add(b.MulScalar(v, 0.999), b.Mul(b.MulScalar(g, 0.001), g));
  auto w2 = b.Sub(w, b.Div(b.Mul(b.BroadcastScalar(lr, {n}), m2), b.AddScalar(b.Unary(ir::OpCode::kSqrt, v2), 1e-8)));
  m.assigns = {{w, w2}, {mm, m2}, {v, v2}};
  auto step = Compile(m);
  CHECK(step->info().in_place_updates == 3);
  CHECK(step->info().swapped_bytes == 0);

  TensorMap jit_vars{{"w", Ramp(t, 0.01f, 0.5f)}, {"m", Ramp(t, 0.001f, 0)}, {"v", Ramp(t, 0.0f, 0.25f)}};
  TensorMap ref_vars = jit_vars;
  const float* storage = jit_vars.at("w").f32.data();
  jit::Workspace ws;
  for (int s = 0; s < 3; ++s) {
    const TensorMap in{{"g", Ramp(t, 0.003f * static_cast<float>(s + 1), 0.01f)}, {"lr", Tensor::Scalar(1e-2f)}};
    const TensorMap out = step->Run(jit_vars, in, 0, nullptr, &ws);
    const TensorMap ref_out = runtime::RunStep(m, ref_vars, in);
    INFO("step " << s + 1);
    CHECK(out.at("w_sum") == ref_out.at("w_sum"));
    for (const char* name : {"w", "m", "v"}) {
      INFO("@" << name);
      CHECK(jit_vars.at(name).f32 == ref_vars.at(name).f32);
    }
  }
  CHECK(jit_vars.at("w").f32.data() == storage);  // written where it was, never swapped
}

// w' = w * 0.5 + x in one loop; `extra` adds another reader of @w or a failing instruction.
struct Halving {
  ir::Module m;
  ir::ValueId w = -1, x = -1;
};

Halving MakeHalving() {
  Halving h;
  h.m.name = "halving";
  ir::Builder b(&h.m);
  const ir::TensorType t{ir::DType::kF32, {4, 3}};
  h.w = b.Variable("w", t, ir::kRoleWeight);
  h.x = b.Input("x", t);
  h.m.assigns = {{h.w, b.Add(b.MulScalar(h.w, 0.5), h.x)}};
  return h;
}

void CheckAgainstInterpreter(const ir::Module& m, int in_place) {
  auto step = Compile(m);
  CHECK(step->info().in_place_updates == in_place);
  const ir::TensorType t{ir::DType::kF32, {4, 3}};
  TensorMap jit_vars;
  for (ir::ValueId v = 0; v < m.size(); ++v)
    if (m.at(v).op == ir::OpCode::kVariable) jit_vars[m.at(v).name] = Ramp(m.at(v).type, 0.25f, 1);
  TensorMap ref_vars = jit_vars;
  const TensorMap in{{"x", Ramp(t, 1, 0)}};
  jit::Workspace ws;
  for (int s = 0; s < 2; ++s) {
    const TensorMap out = step->Run(jit_vars, in, 0, nullptr, &ws);
    const TensorMap ref_out = runtime::RunStep(m, ref_vars, in);
    INFO("step " << s + 1);
    CHECK(out == ref_out);
    CHECK(jit_vars == ref_vars);
  }
}

TEST_CASE("a variable read after its update's loop keeps a buffer of its own", "[jit][in_place]") {
  SECTION("nothing else reads it: in place") { CheckAgainstInterpreter(MakeHalving().m, 1); }
  SECTION("an output of the variable itself") {
    Halving h = MakeHalving();
    h.m.outputs.push_back({"old", h.w});
    CheckAgainstInterpreter(h.m, 0);
  }
  SECTION("another assignment reads it: @u = @w") {
    Halving h = MakeHalving();
    ir::Builder b(&h.m);
    const ir::ValueId u = b.Variable("u", h.m.type(h.w), ir::kRoleWeight);
    h.m.assigns.push_back({u, h.w});
    CheckAgainstInterpreter(h.m, 0);
  }
  SECTION("a copy scheduled after the loop: a transpose") {
    Halving h = MakeHalving();
    ir::Builder b(&h.m);
    h.m.outputs.push_back({"t", b.Transpose(h.w, {1, 0})});
    CheckAgainstInterpreter(h.m, 0);
  }
  SECTION("through a reshape, read after the loop") {
    Halving h = MakeHalving();
    ir::Builder b(&h.m);
    h.m.outputs.push_back({"t", b.Transpose(b.Reshape(h.w, {3, 4}), {1, 0})});
    CheckAgainstInterpreter(h.m, 0);
  }
}

TEST_CASE("a loop with fused sums updates in place unless a sum reads the variable after the loop", "[jit][in_place]") {
  SECTION("a sum of the new value, in its loop (the sum reads the loop's output)") {
    Halving h = MakeHalving();
    ir::Builder b(&h.m);
    h.m.outputs.push_back({"sum", b.SumAll(h.m.assigns[0].second)});
    CHECK(Compile(h.m)->info().fused_reductions == 1);
    CheckAgainstInterpreter(h.m, 1);
  }
  SECTION("and a sum of the variable itself: never fused into the loop that updates it, run before it") {
    Halving h = MakeHalving();
    ir::Builder b(&h.m);
    h.m.outputs.push_back({"old_sum", b.SumAll(h.w)});
    h.m.outputs.push_back({"sum", b.SumAll(h.m.assigns[0].second)});
    CHECK(Compile(h.m)->info().fused_reductions == 1);
    CheckAgainstInterpreter(h.m, 1);
  }
}

TEST_CASE("with a failing instruction after the loop nothing is updated in place, and a failed step changes nothing",
          "[jit][in_place][errors]") {
  Halving h = MakeHalving();
  ir::Builder b(&h.m);
  auto table = b.Input("table", {ir::DType::kF32, {10, 3}});
  auto idx = b.Input("idx", {ir::DType::kS32, {2}});
  h.m.outputs.push_back({"rows", b.Emit(ir::OpCode::kGather, {table, idx})});
  auto step = Compile(h.m);
  CHECK(step->info().in_place_updates == 0);
  const ir::TensorType t{ir::DType::kF32, {4, 3}};
  TensorMap vars{{"w", Ramp(t, 0.25f, 1)}};
  const TensorMap before = vars;
  TensorMap in{{"x", Ramp(t, 1, 0)}, {"table", Tensor(ir::TensorType{ir::DType::kF32, {10, 3}})},
               {"idx", Tensor::S32({2}, {1, 12})}};
  jit::Workspace ws;
  CHECK_THROWS(step->Run(vars, in, 0, nullptr, &ws));
  CHECK(vars == before);
  in["idx"] = Tensor::S32({2}, {1, 2});
  TensorMap ref_vars = vars;
  step->Run(vars, in, 0, nullptr, &ws);
  runtime::RunStep(h.m, ref_vars, in);
  CHECK(vars == ref_vars);
  CHECK(!(vars == before));
}

// Loop outputs stored over a dead input (CompiledStep::PlanReusedInputs): a = transpose(x) is a
// temporary of its own; the loop b = 2a + 1 reads it last, so b takes a's bytes unless something reads a
// after the loop. Integer-valued data: every sum is exact, so the interpreter's bits are the check.
struct Reuse {
  ir::Module m;
  ir::ValueId a = -1, b = -1;
};

Reuse MakeReuse() {
  Reuse r;
  r.m.name = "reuse";
  ir::Builder b(&r.m);
  const ir::ValueId x = b.Input("x", {ir::DType::kF32, {4, 3}});
  r.a = b.Transpose(x, {1, 0});
  r.b = b.AddScalar(b.MulScalar(r.a, 2), 1);
  return r;
}

void CheckReuse(const Reuse& r, int reused, bool same_bytes) {
  auto step = Compile(r.m);
  CHECK(step->info().reused_inputs == reused);
  CHECK((step->arena_offset(r.a) >= 0 && step->arena_offset(r.a) == step->arena_offset(r.b)) == same_bytes);
  const TensorMap in{{"x", Ramp({ir::DType::kF32, {4, 3}}, 1, 0)}};
  TensorMap vars, ref_vars;
  jit::Workspace ws;
  for (int s = 0; s < 2; ++s) {
    INFO("step " << s + 1);
    CHECK(step->Run(vars, in, 0, nullptr, &ws) == runtime::RunStep(r.m, ref_vars, in));
  }
}

TEST_CASE("a loop output is stored over a temporary the loop reads last, and only then", "[jit][in_place]") {
  SECTION("b = 2a + 1 is the only output: b takes a's bytes") {
    Reuse r = MakeReuse();
    r.m.outputs.push_back({"b", r.b});
    CheckReuse(r, 1, true);
  }
  SECTION("a is an output too") {
    Reuse r = MakeReuse();
    r.m.outputs = {{"b", r.b}, {"a", r.a}};
    CheckReuse(r, 0, false);
  }
  SECTION("a matmul after the loop reads a") {
    Reuse r = MakeReuse();
    ir::Builder b(&r.m);
    r.m.outputs.push_back({"c", b.Matmul(r.b, r.a, false, true)});
    CheckReuse(r, 0, false);
  }
  SECTION("b is also summed in the loop (a fused reduction reading b from memory)") {
    Reuse r = MakeReuse();
    ir::Builder b(&r.m);
    r.m.outputs = {{"b", r.b}, {"rows", b.ReduceSum(r.b, {1})}};
    CheckReuse(r, 1, true);
  }
  SECTION("b is only summed: it never reaches memory, nothing is stored over a") {
    Reuse r = MakeReuse();
    ir::Builder b(&r.m);
    r.m.outputs = {{"rows", b.ReduceSum(r.b, {1})}};
    CheckReuse(r, 0, false);
  }
}


// An all-gather whose result is a variable's new value writes it into the variable (two replicas):
// w' = all_gather(x * 0.5 + 1), w f32[4,3], each replica's x f32[2,3]. Integer-valued data: exact.
struct Gathered {
  ir::Module m;
  ir::ValueId w = -1, gathered = -1;
};

// A module of two replicas with a weight @w f32[4,3].
Gathered TwoReplicasWithWeight(const std::string& name) {
  Gathered g;
  g.m.name = name;
  g.m.num_replicas = 2;
  g.w = ir::Builder(&g.m).Variable("w", {ir::DType::kF32, {4, 3}}, ir::kRoleWeight);
  return g;
}

Gathered MakeGathered() {
  Gathered g = TwoReplicasWithWeight("gathered");
  ir::Builder b(&g.m);
  const ir::ValueId x = b.Input("x", {ir::DType::kF32, {2, 3}});
  g.m.outputs.push_back({"w_sum", b.SumAll(g.w)});  // a reader before the all-gather: does not stop it
  g.gathered = b.Emit(ir::OpCode::kAllGather, {b.AddScalar(b.MulScalar(x, 0.5), 1)}, {{"group_size", int64_t{2}}});
  g.m.assigns = {{g.w, g.gathered}};
  return g;
}

// Two steps on two replicas (in-process collectives) against the interpreter's RunStep on collectives of
// its own: every output and variable the same bits, and with `same_storage` variable `var` still where it
// was (a swapped buffer may come back too, so only that way round). Input `input` of step k on replica r:
// Ramp(scale, offset(k, r)).
void CheckTwoReplicaSteps(const ir::Module& m, std::vector<TensorMap> jit_vars, const std::string& input,
                          const ir::TensorType& input_type, float scale, const std::function<float(int, int)>& offset,
                          const std::string& var, bool same_storage, bool in_place_all_gathers = false) {
  auto step = Compile(m, in_place_all_gathers);
  std::vector<TensorMap> ref_vars = jit_vars, jit_out(2), ref_out(2);
  const float* storage[] = {jit_vars[0].at(var).f32.data(), jit_vars[1].at(var).f32.data()};
  std::vector<jit::Workspace> ws(2);
  runtime::InProcessCollectives c(2), ref_c(2);
  for (int k = 0; k < 2; ++k) {
    INFO("step " << k + 1);
    std::vector<TensorMap> in(2);
    for (int r = 0; r < 2; ++r) in[r] = {{input, Ramp(input_type, scale, offset(k, r))}};
    runtime::RunReplicas(2, &c, [&](int r) { jit_out[r] = step->Run(jit_vars[r], in[r], r, &c, &ws[r]); });
    runtime::RunReplicas(2, &ref_c, [&](int r) { ref_out[r] = runtime::RunStep(m, ref_vars[r], in[r], r, &ref_c); });
    for (int r = 0; r < 2; ++r) {
      INFO("replica " << r);
      CHECK(jit_out[r] == ref_out[r]);
      CHECK(jit_vars[r] == ref_vars[r]);
      if (same_storage) CHECK(jit_vars[r].at(var).f32.data() == storage[r]);
    }
  }
}

// Each replica's @w must be the gathered rows. Each section is a mutation check of one condition (the
// counts fail if the condition is dropped).
void CheckGathered(const ir::Module& m, int gathered, bool in_place) {
  CHECK(Compile(m)->info().gathered_updates == gathered);
  std::vector<TensorMap> vars(2);
  for (int r = 0; r < 2; ++r)
    for (ir::ValueId v = 0; v < m.size(); ++v)
      if (m.at(v).op == ir::OpCode::kVariable) vars[r][m.at(v).name] = Ramp(m.at(v).type, 1, 3);
  CheckTwoReplicaSteps(m, vars, "x", {ir::DType::kF32, {2, 3}}, 1,
                       [](int k, int r) { return static_cast<float>(10 * k + 4 * r); }, "w", in_place);
}

TEST_CASE("an all-gather's result assigned to its variable is written into it, and only then", "[jit][in_place]") {
  SECTION("nothing reads @w after the all-gather: written in place") { CheckGathered(MakeGathered().m, 1, true); }
  SECTION("an output of @w itself") {
    Gathered g = MakeGathered();
    g.m.outputs.push_back({"old", g.w});
    CheckGathered(g.m, 0, false);
  }
  SECTION("a copy of @w scheduled after the all-gather") {
    Gathered g = MakeGathered();
    ir::Builder b(&g.m);
    g.m.outputs.push_back({"t", b.Transpose(g.w, {1, 0})});
    CheckGathered(g.m, 0, false);
  }
  SECTION("the all-gather's result is also an output") {
    Gathered g = MakeGathered();
    g.m.outputs.push_back({"new", g.gathered});
    CheckGathered(g.m, 0, false);
  }
  SECTION("an instruction that can fail after the all-gather") {
    Gathered g = MakeGathered();
    ir::Builder b(&g.m);
    g.m.outputs.push_back({"q", b.Emit(ir::OpCode::kDiv, {b.Input("n", {ir::DType::kS32, {}}), b.Input("d", {ir::DType::kS32, {}})})});
    auto step = Compile(g.m);
    CHECK(step->info().gathered_updates == 0);
  }
}

// The sharded update's form: w' = w_r * 0.5 + all_reduce(x), w_r = replica r's row of w [2, 6], and w =
// reshape(all_gather(w')). With in-place all-gathers (JitOptions::in_place_all_gathers, in-process
// collectives) the loop stores w' over w_r, in @w itself, and the all-gather copies the other row only.
Gathered MakeSlicedUpdate() {
  Gathered su = TwoReplicasWithWeight("sliced_update");
  ir::Builder b(&su.m);
  const ir::ValueId own = b.Emit(ir::OpCode::kGather, {b.Reshape(su.w, {2, 6}), b.ReplicaId()});
  const ir::ValueId updated = b.Add(b.MulScalar(own, 0.5), b.AllReduce(b.Input("x", {ir::DType::kF32, {6}}), "sum", {}));
  su.gathered = b.Emit(ir::OpCode::kAllGather, {updated}, {{"group_size", int64_t{2}}});
  su.m.assigns = {{su.w, b.Reshape(su.gathered, {4, 3})}};
  return su;
}

// Two steps on two replicas against the interpreter (CheckTwoReplicaSteps), compiled with in-place
// all-gathers; without the option nothing is stored in place.
void CheckSlicedUpdate(const ir::Module& m, int in_place_gathers) {
  CHECK(Compile(m, true)->info().in_place_gathers == in_place_gathers);
  CHECK(Compile(m)->info().in_place_gathers == 0);
  std::vector<TensorMap> vars(2);
  for (int r = 0; r < 2; ++r) vars[r] = {{"w", Ramp({ir::DType::kF32, {4, 3}}, 1, 3)}};
  CheckTwoReplicaSteps(m, vars, "x", {ir::DType::kF32, {6}}, 1,
                       [](int k, int r) { return static_cast<float>(10 * k + 4 * r); }, "w", false, true);
}

TEST_CASE("a replica's new slice of a weight is stored in its own row, and the all-gather copies the others",
          "[jit][in_place]") {
  SECTION("the sharded update's form: in place") { CheckSlicedUpdate(MakeSlicedUpdate().m, 1); }
  SECTION("a reader of @w after the loop") {
    Gathered su = MakeSlicedUpdate();
    ir::Builder b(&su.m);
    su.m.outputs.push_back({"late", b.SumAll(su.w)});
    CheckSlicedUpdate(su.m, 0);
  }
  SECTION("another replica's row") {
    Gathered su = MakeSlicedUpdate();
    for (ir::Instr& in : su.m.instrs)
      if (in.op == ir::OpCode::kReplicaId) in = ir::Instr{ir::OpCode::kConstant, {}, {ir::DType::kS32, {}}, {{"value", 1.0}}};
    CheckSlicedUpdate(su.m, 0);
  }
  SECTION("an instruction that can fail after the loop") {
    Gathered su = MakeSlicedUpdate();
    ir::Builder b(&su.m);
    su.m.outputs.push_back({"q", b.Emit(ir::OpCode::kDiv, {b.Input("n", {ir::DType::kS32, {}}), b.Input("d", {ir::DType::kS32, {}})})});
    CHECK(Compile(su.m, true)->info().in_place_gathers == 0);
  }
}

// A loop after a rendezvous of every replica (an all-reduce over both) may update in place although a
// collective follows it: every replica got past everything that can fail, so the all-gather after it
// completes too (the sharded weight update's optimizer state, updated before the weights' all-gathers).
// s' = 0.5 s + all_reduce(g); t = s' + 1 (the same loop) is all-gathered after it. Two replicas, two steps,
// the interpreter's bits; each section is a mutation check of one condition.
struct AfterRendezvous {
  ir::Module m;
  ir::ValueId s = -1;
};

AfterRendezvous MakeAfterRendezvous(const ir::IntLists& groups) {
  AfterRendezvous a;
  a.m.name = "after_rendezvous";
  a.m.num_replicas = 2;
  ir::Builder b(&a.m);
  const ir::TensorType t{ir::DType::kF32, {6}};
  a.s = b.Variable("s", t, ir::kRoleOptimizerState);
  const ir::ValueId g = b.Input("g", t);
  const ir::ValueId s2 = b.Add(b.MulScalar(a.s, 0.5), b.AllReduce(g, "sum", groups));
  a.m.outputs.push_back({"gathered", b.Emit(ir::OpCode::kAllGather, {b.AddScalar(s2, 1)}, {{"group_size", int64_t{2}}})});
  a.m.assigns = {{a.s, s2}};
  return a;
}

void CheckAfterRendezvous(const ir::Module& m, int in_place) {
  CHECK(Compile(m)->info().in_place_updates == in_place);
  const ir::TensorType t{ir::DType::kF32, {6}};
  std::vector<TensorMap> vars(2);
  for (int r = 0; r < 2; ++r) vars[r] = {{"s", Ramp(t, 1, static_cast<float>(r))}};
  CheckTwoReplicaSteps(m, vars, "g", t, 2, [](int k, int r) { return static_cast<float>(3 * k + r); }, "s", in_place == 1);
}

TEST_CASE("a loop after a rendezvous of every replica updates in place although collectives follow", "[jit][in_place]") {
  SECTION("an all-reduce over both replicas before the loop: in place") { CheckAfterRendezvous(MakeAfterRendezvous({}).m, 1); }
  SECTION("the all-reduce over groups of one: no rendezvous of every replica") {
    CheckAfterRendezvous(MakeAfterRendezvous({{0}, {1}}).m, 0);
  }
  // The sharded weight update reads each variable's slice as a gather of the replica's own row; the
  // small tensors' gathers run after the large tensors' loops (bench/weight_update at N = 8: the
  // MLP's largest moments were written to buffers of their own, the update computation 1.45x slower).
  SECTION("a gather of the replica's own row after the loop cannot fail: in place") {
    AfterRendezvous a = MakeAfterRendezvous({});
    ir::Builder b(&a.m);
    a.m.outputs.push_back({"own_row", b.Emit(ir::OpCode::kGather, {b.Input("rows", {ir::DType::kF32, {2, 3}}), b.ReplicaId()})});
    CHECK(Compile(a.m)->info().in_place_updates == 1);
  }
  SECTION("a gather by another index, or from a table with fewer rows than replicas, may fail") {
    AfterRendezvous a = MakeAfterRendezvous({});
    ir::Builder b(&a.m);
    const bool by_input = GENERATE(true, false);
    const ir::ValueId table = b.Input("rows", {ir::DType::kF32, {by_input ? 2 : 1, 3}});
    const ir::ValueId index = by_input ? b.Input("i", {ir::DType::kS32, {}}) : b.ReplicaId();
    a.m.outputs.push_back({"row", b.Emit(ir::OpCode::kGather, {table, index})});
    CHECK(Compile(a.m)->info().in_place_updates == 0);
  }
  SECTION("an instruction that can fail after the rendezvous") {
    AfterRendezvous a = MakeAfterRendezvous({});
    ir::Builder b(&a.m);
    a.m.outputs.push_back({"q", b.Emit(ir::OpCode::kDiv, {b.Input("n", {ir::DType::kS32, {}}), b.Input("d", {ir::DType::kS32, {}})})});
    CHECK(Compile(a.m)->info().in_place_updates == 0);
  }
}
}  // namespace
}  // namespace shardstep
