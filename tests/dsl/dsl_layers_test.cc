// The DSL's operators and layers: broadcasting arithmetic, softmax, generalised cross-entropy,
// evaluation vs training mode (batch norm, dropout, model state), per-weight optimizer options, and
// finite-difference gradient checks of the composites on the reference interpreter.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <random>
#include <thread>

#include "dsl/dsl.h"
#include "ir/error.h"
#include "ir/passes/autodiff.h"
#include "ir/verifier.h"
#include "jit/cpu_executor.h"
#include "runtime/executor.h"
#include "runtime/inprocess_collectives.h"
#include "runtime/interpreter.h"
#include "runtime/sharding.h"

using namespace shardstep;
using runtime::Tensor;
using runtime::TensorMap;

namespace {

std::vector<float> Iota(int64_t n, float scale = 1.0f, float offset = 0.0f) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = offset + scale * static_cast<float>(i);
  return v;
}

std::vector<float> Random(int64_t n, uint32_t seed, float lo = -1, float hi = 1) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Evaluates output `name` of `m` (lowered with `mode`) on `inputs`, the variables at their init.
Tensor Eval(const dsl::Model& m, const std::string& name, const TensorMap& inputs, dsl::Mode mode = dsl::Mode::kEval,
            TensorMap vars = {}) {
  ir::Module mod = m.lower(1, mode);
  ir::Verify(mod);
  TensorMap state = runtime::InitLogicalState(mod);
  for (auto& [n, t] : vars) state[n] = t;
  auto values = runtime::EvaluateAll(mod, state, inputs);
  return values.at(mod.FindOutput(name));
}

std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("operators broadcast numpy-style and mix scalars", "[dsl]") {
  dsl::Model m("ops");
  auto x = m.input("x", dsl::f32({2, 3}));
  auto y = m.input("y", dsl::f32({3}));
  auto z = m.input("z", dsl::f32({2, 1, 3}));
  auto col = m.input("c", dsl::f32({4, 1}));
  m.output("sum", x + y);
  m.output("mix", (2.0 - x) / 2.0 * 3.0 + 1.0);
  m.output("neg", -x);
  m.output("rdiv", 6.0 / (x + 1.0));
  m.output("outer", z * col);  // [2,1,3] * [4,1] -> [2,4,3]
  m.output("div", x / y);
  const TensorMap in{{"x", Tensor::F32({2, 3}, Iota(6))},
                     {"y", Tensor::F32({3}, {10, 20, 30})},
                     {"z", Tensor::F32({2, 1, 3}, Iota(6, 1, 1))},
                     {"c", Tensor::F32({4, 1}, {1, 2, 3, 4})}};
  Tensor s = Eval(m, "sum", in);
  CHECK(s.f32 == std::vector<float>{10, 21, 32, 13, 24, 35});
  Tensor mix = Eval(m, "mix", in);
  for (int i = 0; i < 6; ++i) CHECK(mix.f32[i] == Approx((2.0 - i) / 2.0 * 3.0 + 1.0));
  CHECK(Eval(m, "neg", in).f32[4] == -4);
  CHECK(Eval(m, "rdiv", in).f32[2] == Approx(2.0));
  Tensor outer = Eval(m, "outer", in);
  REQUIRE(outer.type.shape == ir::Shape{2, 4, 3});
  CHECK(outer.f32[0 * 12 + 3 * 3 + 2] == Approx(3 * 4));  // z[0,0,2] = 3, c[3] = 4
  CHECK(outer.f32[1 * 12 + 1 * 3 + 0] == Approx(4 * 2));  // z[1,0,0] = 4, c[1] = 2
  CHECK(Eval(m, "div", in).f32[5] == Approx(5.0 / 30));
}

TEST_CASE("a broadcasting error names the operator's source line and both shapes", "[dsl]") {
  dsl::Model m("bad");
  auto x = m.input("x", dsl::f32({2, 3}));
  auto y = m.input("y", dsl::f32({4}));
  const int line = __LINE__ + 1;
  auto bad = x + y;
  std::string msg = ErrorOf([&] { m.train(bad.mean()).build(); });
  CHECK_THAT(msg, Catch::Contains("dsl_layers_test.cc:" + std::to_string(line)));
  CHECK_THAT(msg, Catch::Contains("f32[2,3]"));
  CHECK_THAT(msg, Catch::Contains("f32[4]"));
}

TEST_CASE("softmax, log_softmax, matmul, transpose, reductions", "[dsl]") {
  dsl::Model m("sm");
  auto x = m.input("x", dsl::f32({2, 3}));
  auto a = m.input("a", dsl::f32({2, 2, 2, 3}));  // [B,H,T,D]
  m.output("softmax", x.softmax());
  m.output("log_softmax", x.log_softmax());
  m.output("scores", a.matmul(a, false, true));  // [B,H,T,T]
  m.output("t", x.transpose({0, 1}).sum({-1}));
  m.output("mean0", a.mean({1, 3}));
  std::vector<float> xd{1, 2, 3, 1000, 1001, 1002};  // the max is subtracted: no overflow
  const TensorMap in{{"x", Tensor::F32({2, 3}, xd)}, {"a", Tensor::F32({2, 2, 2, 3}, Iota(24, 0.1f))}};
  Tensor sm = Eval(m, "softmax", in), ls = Eval(m, "log_softmax", in);
  const double z = std::exp(-2.0) + std::exp(-1.0) + 1.0;
  for (int r = 0; r < 2; ++r)
    for (int j = 0; j < 3; ++j) {
      CHECK(sm.f32[r * 3 + j] == Approx(std::exp(j - 2.0) / z));
      CHECK(ls.f32[r * 3 + j] == Approx(j - 2.0 - std::log(z)));
    }
  Tensor sc = Eval(m, "scores", in);
  REQUIRE(sc.type.shape == ir::Shape{2, 2, 2, 2});
  // scores[1,0,1,0] = a[1,0,1,:] . a[1,0,0,:]: a[1,0,1,j] = 0.1 (15 + j), a[1,0,0,j] = 0.1 (12 + j).
  double want = 0;
  for (int j = 0; j < 3; ++j) want += 0.01 * (15 + j) * (12 + j);
  CHECK(sc.f32[1 * 8 + 0 * 4 + 1 * 2 + 0] == Approx(want));
  CHECK(Eval(m, "t", in).f32[1] == Approx(3003));
  CHECK(Eval(m, "mean0", in).type.shape == ir::Shape{2, 2});
}

TEST_CASE("cross-entropy over [B,T,C] with label smoothing, ignore_index and weights matches torch's formula",
          "[dsl][loss]") {
  const int64_t B = 2, T = 3, C = 4;
  const double ls = 0.2;
  std::vector<float> z = Random(B * T * C, 3, -2, 2);
  std::vector<int32_t> y{0, 3, -100, 2, 1, -100};
  std::vector<float> w{1, 2, 5, 0.5, 1, 7};
  auto build = [&](dsl::Model& m) {
    auto logits = m.input("logits", dsl::f32({B, T, C}));
    auto labels = m.input("labels", dsl::s32({B, T}));
    auto weights = m.input("w", dsl::f32({B, T}));
    dsl::CrossEntropyOptions o;
    o.label_smoothing = ls;
    o.ignore_index = -100;
    m.output("per", logits.cross_entropy(labels, o));
    m.output("mean", logits.cross_entropy_mean(labels, o));
    m.output("wmean", logits.cross_entropy_mean(labels, o, weights));
  };
  dsl::Model m("ce");
  build(m);
  const TensorMap in{{"logits", Tensor::F32({B, T, C}, z)}, {"labels", Tensor::S32({B, T}, y)}, {"w", Tensor::F32({B, T}, w)}};
  // Reference: per position, (1 - ls) (-log p_y) + ls mean_c(-log p_c); 0 where ignored.
  std::vector<double> per(B * T);
  double sum = 0, wsum = 0, count = 0, wtotal = 0;
  for (int i = 0; i < B * T; ++i) {
    double mx = -1e9, se = 0;
    for (int c = 0; c < C; ++c) mx = std::max<double>(mx, z[i * C + c]);
    for (int c = 0; c < C; ++c) se += std::exp(z[i * C + c] - mx);
    auto nlp = [&](int c) { return -(z[i * C + c] - mx - std::log(se)); };
    if (y[i] == -100) continue;
    double smooth = 0;
    for (int c = 0; c < C; ++c) smooth += nlp(c) / C;
    per[i] = (1 - ls) * nlp(y[i]) + ls * smooth;
    sum += per[i];
    count += 1;
    wsum += w[i] * per[i];
    wtotal += w[i];
  }
  Tensor got = Eval(m, "per", in);
  REQUIRE(got.type.shape == ir::Shape{B, T});
  for (int i = 0; i < B * T; ++i) CHECK(got.f32[i] == Approx(per[i]).margin(1e-6));
  CHECK(Eval(m, "mean", in).f32[0] == Approx(sum / count));
  CHECK(Eval(m, "wmean", in).f32[0] == Approx(wsum / wtotal));

  SECTION("the weighted mean equals the global value at 2 replicas whose weight sums differ") {
    ir::Module two = m.lower(2, dsl::Mode::kTrain);
    runtime::InProcessCollectives coll(2);
    std::vector<float> means(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([&, r] {
        TensorMap half;
        half["logits"] = Tensor::F32({1, T, C}, std::vector<float>(z.begin() + r * T * C, z.begin() + (r + 1) * T * C));
        half["labels"] = Tensor::S32({1, T}, std::vector<int32_t>(y.begin() + r * T, y.begin() + (r + 1) * T));
        half["w"] = Tensor::F32({1, T}, std::vector<float>(w.begin() + r * T, w.begin() + (r + 1) * T));
        TensorMap vars;
        means[r] = runtime::EvaluateAll(two, vars, half, r, &coll).at(two.FindOutput("wmean")).f32[0];
      });
    for (auto& t : threads) t.join();
    CHECK((means[0] + means[1]) / 2 == Approx(wsum / wtotal));  // the executor's loss is the replicas' mean
  }
}

TEST_CASE("evaluation mode: batch norm from running statistics, no dropout, no assignments", "[dsl][mode]") {
  dsl::Model m("bn", 5);
  auto x = m.input("x", dsl::f32({8, 3, 2, 2}));
  auto h = x.batch_norm("bn").dropout(0.5);
  m.output("h", h);
  auto loss = h.mean();
  dsl::Program p = m.train(loss).optimizer(dsl::SGD().lr(0.1)).build();
  CHECK(p.forward.assigns.empty());
  for (const ir::Instr& in : p.forward.instrs) {
    CHECK(in.op != ir::OpCode::kRandomUniform);
    CHECK(in.name != "step");
  }
  // Training step: running stats assigned, @step shared by dropout and the optimizer (assigned once).
  ir::ValueId rm = p.step.FindVariable("bn.running_mean"), rv = p.step.FindVariable("bn.running_var");
  REQUIRE(rm != ir::kNoValue);
  CHECK(p.step.at(rm).GetString("role") == ir::kRoleModelState);
  CHECK(p.step.AssignedValue(rm) != ir::kNoValue);
  CHECK(p.step.AssignedValue(rv) != ir::kNoValue);
  CHECK(p.step.GradientOf(rm) == ir::kNoValue);
  int steps = 0;
  for (const ir::Instr& in : p.step.instrs) steps += in.op == ir::OpCode::kVariable && in.name == "step";
  CHECK(steps == 1);
  CHECK(p.step.AssignedValue(p.step.FindVariable("step")) != ir::kNoValue);
  CHECK(p.step.FindVariable("bn.running_mean/m") == ir::kNoValue);

  // Run a step: the running statistics follow torch (momentum 0.1, unbiased variance).
  std::vector<float> xd = Random(8 * 12, 9, -1, 3);
  TensorMap state = runtime::InitLogicalState(p.step);
  auto exec = runtime::MakeInterpreterExecutor(p.step, state);
  exec->Step({{"x", Tensor::F32({8, 3, 2, 2}, xd)}});
  TensorMap after = exec->LogicalState();
  for (int c = 0; c < 3; ++c) {
    double s = 0, ss = 0;
    for (int b = 0; b < 8; ++b)
      for (int k = 0; k < 4; ++k) s += xd[b * 12 + c * 4 + k];
    const double mean = s / 32;
    for (int b = 0; b < 8; ++b)
      for (int k = 0; k < 4; ++k) ss += std::pow(xd[b * 12 + c * 4 + k] - mean, 2);
    CHECK(after.at("bn.running_mean").f32[c] == Approx(0.1 * mean).margin(1e-6));
    CHECK(after.at("bn.running_var").f32[c] == Approx(0.9 + 0.1 * ss / 31).margin(1e-6));
  }
  CHECK(after.at("step").s32[0] == 1);
  // Evaluation normalises with the running statistics and keeps every element.
  Tensor ev = Eval(m, "h", {{"x", Tensor::F32({8, 3, 2, 2}, xd)}}, dsl::Mode::kEval, after);
  for (int i = 0; i < 8 * 12; ++i) {
    const int c = (i / 4) % 3;
    const double want = (xd[i] - after.at("bn.running_mean").f32[c]) / std::sqrt(after.at("bn.running_var").f32[c] + 1e-5) *
                            after.at("bn.gamma").f32[c] +
                        after.at("bn.beta").f32[c];
    CHECK(ev.f32[i] == Approx(want).margin(1e-5));
  }
}

TEST_CASE("dropout: keeps about 1-p, scales by 1/(1-p), and an example's mask does not depend on the replicas",
          "[dsl][dropout]") {
  const int64_t B = 4, D = 256;
  const double p = 0.25;
  dsl::Model m("drop", 11);
  auto x = m.input("x", dsl::f32({B, D}));
  m.output("y", x.dropout(p));
  std::vector<float> xd = Random(B * D, 1, 0.5, 1.5);
  Tensor one = Eval(m, "y", {{"x", Tensor::F32({B, D}, xd)}}, dsl::Mode::kTrain);
  int kept = 0;
  for (int64_t i = 0; i < B * D; ++i) {
    if (one.f32[i] != 0) {
      ++kept;
      CHECK(one.f32[i] == Approx(xd[i] / (1 - p)));
    }
  }
  CHECK(kept > 0.70 * B * D);
  CHECK(kept < 0.80 * B * D);
  ir::Module two = m.lower(2, dsl::Mode::kTrain);
  TensorMap vars = runtime::InitLogicalState(two);
  for (int r = 0; r < 2; ++r) {
    TensorMap half{{"x", Tensor::F32({B / 2, D}, std::vector<float>(xd.begin() + r * B / 2 * D, xd.begin() + (r + 1) * B / 2 * D))}};
    Tensor y = runtime::EvaluateAll(two, vars, half, r).at(two.FindOutput("y"));
    for (int64_t i = 0; i < B / 2 * D; ++i) REQUIRE(y.f32[i] == one.f32[r * B / 2 * D + i]);
  }
  // The next step draws a different mask.
  TensorMap next{{"step", Tensor::S32({}, {1})}};
  Tensor later = Eval(m, "y", {{"x", Tensor::F32({B, D}, xd)}}, dsl::Mode::kTrain, next);
  CHECK(later.f32 != one.f32);
  // Evaluation: identity.
  CHECK(Eval(m, "y", {{"x", Tensor::F32({B, D}, xd)}}).f32 == xd);
}

TEST_CASE("per-weight options: no weight decay and no layer adaptation where asked", "[dsl][optimizer]") {
  auto run = [](ir::OptimizerConfig opt) {
    dsl::Model m("opts");
    auto x = m.input("x", dsl::f32({1, 4}));
    auto a = m.weight("a", dsl::f32({4}), "constant", {{"value", 3.0}});
    auto c = m.weight("c", dsl::f32({4}), "constant", {{"value", 3.0}}, dsl::WeightOptions::NoDecay());
    dsl::Program p = m.train((x * a).sum() + (x * c).sum()).optimizer(opt).build();
    CHECK(p.step.at(p.step.FindVariable("c")).GetInt("weight_decay") == 0);
    CHECK(p.step.at(p.step.FindVariable("c")).GetInt("layer_adaptation") == 0);
    auto exec = runtime::MakeInterpreterExecutor(p.step, runtime::InitLogicalState(p.step));
    exec->Step({{"x", Tensor::F32({1, 4}, {1, 1, 1, 1})}});  // gradient 1 everywhere
    TensorMap s = exec->LogicalState();
    return std::pair<double, double>{s.at("a").f32[0], s.at("c").f32[0]};
  };
  SECTION("SGD weight decay") {
    auto [a, c] = run(dsl::SGD().lr(0.1).weight_decay(0.5));
    CHECK(a == Approx(3 - 0.1 * (1 + 0.5 * 3)));
    CHECK(c == Approx(3 - 0.1));
  }
  SECTION("AdamW decoupled decay") {
    auto [a, c] = run(dsl::AdamW().lr(0.1).weight_decay(0.5));
    CHECK(a == Approx(3 * (1 - 0.05) - 0.1).epsilon(1e-5));
    CHECK(c == Approx(3 - 0.1).epsilon(1e-5));
  }
  SECTION("LAMB trust ratio") {
    auto [a, c] = run(dsl::Lamb().lr(0.1));
    CHECK(a == Approx(3 - 0.1 * 3).epsilon(1e-5));  // ||w|| / ||r|| = 6 / 2
    CHECK(c == Approx(3 - 0.1).epsilon(1e-5));      // trust fixed at 1
  }
  SECTION("LARS local learning rate and decay") {
    auto [a, c] = run(dsl::Lars().lr(0.1).weight_decay(0.5).trust_coefficient(0.001));
    const double local = 0.001 * 6 / (2 + 0.5 * 6);
    CHECK(a == Approx(3 - 0.1 * local * (1 + 0.5 * 3)).epsilon(1e-5));
    CHECK(c == Approx(3 - 0.1).epsilon(1e-5));
  }
}

// ---- Finite-difference gradient checks of the composites (interpreter, central differences) ----

namespace {

// Builds `f` on a weight "w" of `shape`, takes loss = sum(f(w) * r) for a fixed random r (or f itself
// when it is a scalar), and compares autodiff's gradient of every weight with central differences.
void GradCheck(const ir::Shape& shape, const std::function<dsl::Tensor(dsl::Model&, const dsl::Tensor&)>& f,
               TensorMap extra_inputs = {}, double h = 1e-2, double tol = 2e-3) {
  dsl::Model m("fd");
  auto w = m.weight("w", dsl::f32(shape), "zeros");
  auto out = f(m, w);
  dsl::Tensor loss = out;
  std::vector<float> rdata;
  if (!out.shape().empty()) {
    rdata = Random(ir::NumElements(out.shape()), 42);
    loss = (out * m.input("r", dsl::f32(out.shape()))).sum();
    extra_inputs["r"] = Tensor::F32(out.shape(), rdata);
  }
  m.train(loss);
  ir::Module mod = m.lower(1, dsl::Mode::kTrain);
  ir::Autodiff("loss").Run(mod);
  ir::Verify(mod);
  TensorMap vars = runtime::InitLogicalState(mod);
  int seed = 100;
  for (ir::ValueId v : mod.VariablesWithRole(ir::kRoleWeight))
    vars[mod.at(v).name] = Tensor::F32(mod.type(v).shape, Random(mod.type(v).elements(), ++seed, -1.5, 1.5));
  auto values = runtime::EvaluateAll(mod, vars, extra_inputs);
  auto loss_at = [&](const TensorMap& vs) { return runtime::EvaluateAll(mod, vs, extra_inputs).at(mod.FindOutput("loss")).f32[0]; };
  for (ir::ValueId v : mod.VariablesWithRole(ir::kRoleWeight)) {
    const std::string name = mod.at(v).name;
    const Tensor& g = values.at(mod.GradientOf(v));
    for (int64_t i = 0; i < g.elements(); ++i) {
      TensorMap plus = vars, minus = vars;
      plus[name].f32[i] += static_cast<float>(h);
      minus[name].f32[i] -= static_cast<float>(h);
      const double fd = (static_cast<double>(loss_at(plus)) - loss_at(minus)) / (2 * h);
      INFO(name << "[" << i << "]: autodiff " << g.f32[i] << " finite difference " << fd);
      CHECK(std::abs(g.f32[i] - fd) <= tol * (1 + std::abs(fd)));
    }
  }
}

}  // namespace

TEST_CASE("finite differences: softmax and log_softmax", "[dsl][gradient]") {
  GradCheck({3, 5}, [](dsl::Model&, const dsl::Tensor& w) { return w.softmax(); });
  GradCheck({2, 3, 4}, [](dsl::Model&, const dsl::Tensor& w) { return w.softmax(1); });
  GradCheck({3, 5}, [](dsl::Model&, const dsl::Tensor& w) { return w.log_softmax(); });
}

// The max that keeps exp in range does not change softmax's value, so its gradient is zero: it is held out
// of autodiff, and the gradient module has no path back through it (reduce_max's backward would compare
// every input with the max: an eq op per softmax).
TEST_CASE("softmax, log_softmax and cross-entropy hold their max out of autodiff", "[dsl][gradient]") {
  const std::vector<std::function<dsl::Tensor(dsl::Model&, const dsl::Tensor&)>> fs = {
      [](dsl::Model&, const dsl::Tensor& w) { return w.softmax().sum(); },
      [](dsl::Model&, const dsl::Tensor& w) { return w.log_softmax().sum(); },
      [](dsl::Model& m, const dsl::Tensor& w) { return w.cross_entropy(m.input("labels", dsl::s32({3}))).sum(); }};
  for (const auto& f : fs) {
    dsl::Model m("max");
    const auto w = m.weight("w", dsl::f32({3, 5}), "zeros");
    m.train(f(m, w));
    ir::Module mod = m.lower(1, dsl::Mode::kTrain);
    ir::Autodiff("loss").Run(mod);
    int maxes = 0, compares = 0;
    for (ir::ValueId v = 0; v < mod.size(); ++v) {
      maxes += mod.at(v).op == ir::OpCode::kReduceMax;
      compares += mod.at(v).op == ir::OpCode::kEq;
    }
    CHECK(maxes == 1);
    CHECK(compares == 0);
  }
}

// Softmax multiplies by its sum's reciprocal, log_softmax takes the log of its sum and layer norm the
// reciprocal square root of its variance: once per row, in the forward and in the gradient (autodiff of
// e / sum made up to four divisions per element, in loops that were bound by them).
TEST_CASE("softmax, log_softmax and layer norm divide, take logs and square roots per row", "[dsl][gradient]") {
  const std::vector<std::function<dsl::Tensor(const dsl::Tensor&)>> fs = {
      [](const dsl::Tensor& w) { return w.softmax(); }, [](const dsl::Tensor& w) { return w.log_softmax(); },
      [](const dsl::Tensor& w) { return w.layer_norm("ln"); }};
  for (const auto& f : fs) {
    dsl::Model m("per_row");
    const auto w = m.weight("w", dsl::f32({3, 5}), "zeros");
    const auto t = m.input("t", dsl::f32({3, 5}));
    m.train((f(w) * t).sum());
    ir::Module mod = m.lower(1, dsl::Mode::kTrain);
    ir::Autodiff("loss").Run(mod);
    int per_row = 0, per_element = 0;
    for (ir::ValueId v = 0; v < mod.size(); ++v) {
      const ir::Instr& in = mod.at(v);
      if (in.op != ir::OpCode::kDiv && in.op != ir::OpCode::kLog && in.op != ir::OpCode::kRsqrt) continue;
      per_row += in.type.shape == ir::Shape{3};
      per_element += in.type.elements() > 3;
    }
    CHECK(per_row >= 1);
    CHECK(per_element == 0);
  }
}
TEST_CASE("finite differences: cross-entropy with label smoothing, ignore_index and weights", "[dsl][gradient]") {
  TensorMap in{{"labels", Tensor::S32({2, 3}, {1, -1, 4, 0, 2, -1})}, {"wt", Tensor::F32({2, 3}, {1, 2, 0.5, 3, 1, 1})}};
  dsl::CrossEntropyOptions o;
  o.label_smoothing = 0.1;
  o.ignore_index = -1;
  GradCheck({2, 3, 5}, [o](dsl::Model& m, const dsl::Tensor& w) {
    return w.cross_entropy(m.input("labels", dsl::s32({2, 3})), o);
  }, in);
  GradCheck({2, 3, 5}, [o](dsl::Model& m, const dsl::Tensor& w) {
    return w.cross_entropy_mean(m.input("labels", dsl::s32({2, 3})), o, m.input("wt", dsl::f32({2, 3})));
  }, in);
}

TEST_CASE("finite differences: batch norm (training mode), layer norm, gelu, broadcasting", "[dsl][gradient]") {
  GradCheck({4, 3, 2, 2}, [](dsl::Model&, const dsl::Tensor& w) { return w.batch_norm("bn"); });
  GradCheck({6, 3}, [](dsl::Model&, const dsl::Tensor& w) { return w.batch_norm("bn"); });
  GradCheck({3, 6}, [](dsl::Model&, const dsl::Tensor& w) { return w.layer_norm("ln"); });
  GradCheck({3, 4}, [](dsl::Model&, const dsl::Tensor& w) { return w.gelu(); });
  GradCheck({2, 1, 4}, [](dsl::Model& m, const dsl::Tensor& w) {
    auto v = m.weight("v", dsl::f32({3, 1}), "zeros");
    return (w * v + w) / (v * v + 2.0);
  });
}

TEST_CASE("dropout and batch norm train the same on the JIT as on the interpreter, 2 replicas", "[dsl][jit]") {
  dsl::Model m("dropbn", 4);
  auto x = m.input("x", dsl::f32({8, 12}));
  auto y = m.input("y", dsl::s32({8}));
  auto h = x.dense(16, "fc1").batch_norm("bn").relu().dropout(0.3).dense(3, "fc2");
  dsl::Program p = m.train(h.cross_entropy_mean(y)).optimizer(dsl::Momentum(0.9).lr(0.1)).replicas(2).build();
  const TensorMap init = runtime::InitLogicalState(p.step);
  auto ref = runtime::MakeInterpreterExecutor(p.step, init);
  auto jit = jit::MakeCpuExecutor(p.step, init);
  for (int s = 0; s < 3; ++s) {
    TensorMap in{{"x", Tensor::F32({8, 12}, Random(96, 20 + s))},
                 {"y", Tensor::S32({8}, {0, 1, 2, 0, 1, 2, 0, 1})}};
    const float a = ref->Step(in).at("loss").f32[0], b = jit->Step(in).at("loss").f32[0];
    INFO("step " << s << ": interpreter " << a << " JIT " << b);
    CHECK(std::abs(a - b) <= 1e-5 * std::max(1.0f, std::abs(a)));
  }
  const TensorMap sa = ref->LogicalState(), sb = jit->LogicalState();
  for (const char* name : {"bn.running_mean", "bn.running_var", "fc1.w", "step"}) {
    double worst = 0;
    for (int64_t i = 0; i < sa.at(name).elements(); ++i)
      worst = std::max<double>(worst, std::abs(sa.at(name).at(i) - sb.at(name).at(i)));
    INFO(name << " worst difference " << worst);
    CHECK(worst <= 1e-5);
  }
  CHECK(sa.at("step").s32[0] == 3);
}

TEST_CASE("cross-replica batch norm over groups of 2 of 4 replicas all-reduces within the groups", "[dsl]") {
  dsl::Model m("bngroups");
  auto x = m.input("x", dsl::f32({8, 4}));
  auto h = x.batch_norm("bn", dsl::BatchNormOptions().with_cross_replica().with_group_size(2));
  ir::Module step = m.lower(4, dsl::Mode::kTrain);
  ir::Verify(step);
  int grouped = 0, all = 0;
  for (const ir::Instr& in : step.instrs) {
    if (in.op != ir::OpCode::kAllReduce) continue;
    if (in.GetIntLists("groups") == ir::IntLists{{0, 1}, {2, 3}}) ++grouped;
    else if (in.GetIntLists("groups").empty()) ++all;
  }
  CHECK(grouped == 2);  // mean and variance
  CHECK(all == 2);      // running statistics averaged over all 4 so every replica keeps the same
  (void)h;
  dsl::Model bad("bad");
  auto xb = bad.input("x", dsl::f32({6, 4}));
  bad.output("h", xb.batch_norm("bn", dsl::BatchNormOptions().with_cross_replica().with_group_size(2)));
  CHECK_THAT(ErrorOf([&] { bad.lower(3, dsl::Mode::kTrain); }), Catch::Contains("does not divide"));
}

TEST_CASE("slice, transpose and concat: weights freely, batched tensors keep the batch axis", "[dsl]") {
  dsl::Model m("shapes");
  auto x = m.input("x", dsl::f32({2, 3}));
  auto table = m.weight("pos", dsl::f32({5, 3}), "constant", {{"value", 1.0}});
  auto rows = table.slice(0, 1, 3);                        // weight rows [1, 3): fine
  m.output("t", table.transpose({1, 0}).sum({0}));         // [5]
  m.output("cat", dsl::concat({x, x * 2.0}, -1));          // [2, 6]
  m.output("pos", x + rows);                               // [2,3] + [2,3]
  m.output("xs", x.slice(1, 1, 3));
  const TensorMap in{{"x", Tensor::F32({2, 3}, Iota(6))}};
  CHECK(Eval(m, "t", in).f32 == std::vector<float>(5, 3));
  CHECK(Eval(m, "cat", in).f32 == std::vector<float>{0, 1, 2, 0, 2, 4, 3, 4, 5, 6, 8, 10});
  CHECK(Eval(m, "pos", in).f32[4] == 5);
  CHECK(Eval(m, "xs", in).f32 == std::vector<float>{1, 2, 4, 5});
  ir::Module two = m.lower(2);
  CHECK(two.type(two.FindOutput("cat")).shape == ir::Shape{1, 6});

  dsl::Model bad("bad");
  auto xb = bad.input("x", dsl::f32({2, 3}));
  const int line = __LINE__ + 1;
  auto cut = xb.slice(0, 0, 1);
  CHECK_THAT(ErrorOf([&] { bad.train(cut.mean()).build(); }),
             Catch::Contains("dsl_layers_test.cc:" + std::to_string(line)) && Catch::Contains("batch dimension"));
  dsl::Model bad2("bad2");
  auto xt = bad2.input("x", dsl::f32({2, 3}));
  CHECK_THAT(ErrorOf([&] { bad2.train(xt.transpose({1, 0}).mean()).build(); }), Catch::Contains("batch dimension first"));
}
