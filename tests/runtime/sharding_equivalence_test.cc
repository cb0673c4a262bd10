// DESIGN §1 / §5: automatic cross-replica sharding of the weight update must not change what is
// trained. With shard_weight_update(true) vs (false) at the same replica count N (same all-reduce bits:
// in-process AllReduce == ReduceScatter + AllGather), every optimizer gives BITWISE-identical logical
// state after many steps: elementwise ones (SGD, momentum, Adam, ...) trivially, norm-based ones (LAMB,
// LARS, global-norm clipping) because the replicated update sums its norms in the sharded order
// (ir::ShardOrderReductions: the same shard-shaped partial sums, added in replica order).
//
// The MLP uses hidden widths {25, 10} so the variables exercise every shard format at N = 2, 3, 4, 8:
// fc1.w [784,25] is dim0 at N=2,4,8 and flat+padded at N=3; fc1.b [25] is always padded; fc2.w [25,10]
// is flat (padded except at N=2); fc3.w [10,10] is dim0 at N=2 and padded at N=3,4,8.
#include <catch2/catch.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <sstream>

#include "dsl/dsl.h"
#include "ir/shard_format.h"
#include "models/models.h"
#include "runtime/dataset.h"
#include "runtime/executor.h"
#include "runtime/inprocess_collectives.h"
#include "runtime/interpreter.h"
#include "runtime/replica_runner.h"
#include "runtime/sharding.h"

using namespace shardstep;
using namespace shardstep::runtime;

namespace {

constexpr int64_t kBatch = 24;  // divisible by 2, 3, 4 and 8
constexpr int kSteps = 50;
const std::vector<int64_t> kHidden = {25, 10};

struct Config {
  ir::OptimizerConfig opt;
  int replicas = 1;
  bool shard = false;
  bool gather_at_start = false;
  int group_size = 0;
  bool cnn = false;
};

dsl::Program Build(const Config& c) {
  dsl::Model m(c.cnn ? "cnn" : "mlp", /*seed=*/1);
  models::ModelOptions mo;
  mo.batch = kBatch;
  mo.hidden = kHidden;
  mo.classes = 10;
  dsl::Tensor loss = c.cnn ? models::DefineCnn(m, mo) : models::DefineMlp(m, mo);
  return m.train(loss)
      .optimizer(c.opt)
      .replicas(c.replicas)
      .replica_group_size(c.group_size)
      .shard_weight_update(c.shard)
      .gather_weights_at_start(c.gather_at_start)
      .build();
}

const Dataset& Data() {
  static const Dataset d = SyntheticClassification(480, 1, 28, 28, 10, /*seed=*/11);
  return d;
}

// The same global batches for every run.
const std::vector<TensorMap>& Batches(bool cnn) {
  static std::vector<TensorMap> mlp, conv;
  std::vector<TensorMap>& out = cnn ? conv : mlp;
  if (out.empty()) {
    BatchIterator it(Data(), kBatch, /*shuffle=*/true, /*seed=*/5, cnn ? ir::Shape{1, 28, 28} : ir::Shape{784});
    for (int i = 0; i < kSteps; ++i) {
      TensorMap in;
      it.Next(&in["image"], &in["label"]);
      out.push_back(std::move(in));
    }
  }
  return out;
}

struct Run {
  TensorMap initial, final_state;
  std::vector<double> losses;
};

Run Train(const dsl::Program& p, int steps, bool cnn = false) {
  Run r;
  r.initial = InitLogicalState(p.step);
  auto exec = MakeInterpreterExecutor(p.step, r.initial);
  for (int i = 0; i < steps; ++i) r.losses.push_back(exec->Step(Batches(cnn)[i]).at("loss").f32[0]);
  r.final_state = exec->LogicalState();
  return r;
}

int CountOps(const ir::Module& m, ir::OpCode op) {
  int n = 0;
  for (const ir::Instr& in : m.instrs) n += in.op == op;
  return n;
}

std::vector<std::string> ShardedVariables(const ir::Module& m) {
  std::vector<std::string> names;
  for (ir::ValueId v : m.Variables()) {
    ir::ShardFormat f;
    if (ir::ShardFormat::FromAttrs(m.at(v), &f)) names.push_back(m.at(v).name);
  }
  return names;
}

// The sharded program really is sharded: reduce-scatters, no full-size gradient all-reduce left,
// and every rank >= 1 optimizer-state variable (plus the weights with gather_at_start) stored as a shard.
void CheckIsSharded(const dsl::Program& p, const Config& c) {
  INFO("replicas " << c.replicas << ", sharded program");
  CHECK(CountOps(p.step, ir::OpCode::kReduceScatter) > 0);
  CHECK(CountOps(p.step, ir::OpCode::kAllGather) > 0);
  auto sharded = ShardedVariables(p.step);
  for (ir::ValueId v : p.step.Variables()) {
    const ir::Instr& var = p.step.at(v);
    const std::string role = var.GetString("role", "");
    const bool expect = (role == ir::kRoleOptimizerState || (c.gather_at_start && role == ir::kRoleWeight)) &&
                        !LogicalTypes(p.step).at(var.name).shape.empty();
    INFO("variable " << var.name << " role " << role);
    CHECK((std::find(sharded.begin(), sharded.end(), var.name) != sharded.end()) == expect);
  }
}

std::string Describe(const Tensor& a, const Tensor& b) {
  std::ostringstream os;
  if (a.type != b.type) {
    os << "types differ: " << a.type.ToString() << " vs " << b.type.ToString();
    return os.str();
  }
  int64_t differing = 0, first = -1;
  double max_diff = 0;
  for (int64_t i = 0; i < a.elements(); ++i) {
    const bool same = a.dtype() == ir::DType::kF32 ? std::memcmp(&a.f32[i], &b.f32[i], 4) == 0 : a.s32[i] == b.s32[i];
    if (same) continue;
    ++differing;
    if (first < 0) first = i;
    max_diff = std::max(max_diff, std::abs(a.at(i) - b.at(i)));
  }
  os << differing << " of " << a.elements() << " elements differ";
  if (first >= 0)
    os << "; first at flat index " << first << " (" << std::setprecision(9) << a.at(first) << " vs " << b.at(first)
       << "); max abs diff " << max_diff;
  return os.str();
}

// Every variable, every byte.
void CheckBitwise(const TensorMap& reference, const TensorMap& sharded) {
  CHECK(reference.size() == sharded.size());
  for (const auto& [name, t] : reference) {
    INFO("variable " << name);
    REQUIRE(sharded.count(name));
    const Tensor& s = sharded.at(name);
    INFO(Describe(t, s));
    CHECK(s == t);
  }
}

double Mean(const std::vector<double>& v, size_t begin, size_t end) {
  double s = 0;
  for (size_t i = begin; i < end; ++i) s += v[i];
  return s / (end - begin);
}

// Training did something: every weight moved and the loss went down.
void CheckTrained(const Run& r) {
  for (const auto& [name, t] : r.final_state) {
    INFO("variable " << name);
    CHECK_FALSE(t == r.initial.at(name));  // weights, optimizer state and the step counter all change
  }
  for (double l : r.losses) REQUIRE(std::isfinite(l));
  INFO("first losses " << Mean(r.losses, 0, 5) << ", last losses " << Mean(r.losses, r.losses.size() - 5, r.losses.size()));
  CHECK(Mean(r.losses, r.losses.size() - 5, r.losses.size()) < 0.9 * Mean(r.losses, 0, 5));
}

void Compare(const std::string& label, ir::OptimizerConfig opt, std::vector<int> ns = {2, 3, 4, 8},
             bool gather_at_start = false) {
  for (int n : ns) {
    const auto t0 = std::chrono::steady_clock::now();
    INFO(label << " at N=" << n << (gather_at_start ? " (gather weights at start)" : ""));
    Config rc{opt, n, false, false};
    Config sc{opt, n, true, gather_at_start};
    dsl::Program replicated = Build(rc), sharded = Build(sc);
    REQUIRE(CountOps(replicated.step, ir::OpCode::kReduceScatter) == 0);
    REQUIRE(ShardedVariables(replicated.step).empty());
    CheckIsSharded(sharded, sc);
    Run a = Train(replicated, kSteps), b = Train(sharded, kSteps);
    // Both start from the same logical state.
    CheckBitwise(a.initial, b.initial);
    CheckTrained(b);
    CheckBitwise(a.final_state, b.final_state);
    CHECK(a.losses == b.losses);
    WARN(label << " N=" << n << ": "
               << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s");
  }
}

}  // namespace

TEST_CASE("sharded SGD is bitwise identical to replicated SGD", "[sharding]") {
  Compare("sgd", dsl::SGD().lr(0.05));
}

TEST_CASE("sharded momentum is bitwise identical to replicated momentum", "[sharding]") {
  Compare("momentum", dsl::Momentum(0.9).lr(0.02));
}

TEST_CASE("sharded nesterov momentum is bitwise identical", "[sharding]") {
  Compare("nesterov", dsl::Momentum(0.9).nesterov().lr(0.02));
}

TEST_CASE("sharded Adam is bitwise identical to replicated Adam", "[sharding]") {
  Compare("adam", dsl::Adam().lr(1e-3));
}

TEST_CASE("sharded AdamW (weight decay) is bitwise identical", "[sharding]") {
  Compare("adamw", dsl::AdamW().lr(1e-3).weight_decay(0.05));
}

TEST_CASE("sharded Adagrad is bitwise identical", "[sharding]") {
  Compare("adagrad", dsl::Adagrad().lr(0.02));
}

TEST_CASE("Adam with weights gathered at the start of the next step is bitwise identical", "[sharding]") {
  Compare("adam gather-at-start", dsl::Adam().lr(1e-3), {2, 3, 4, 8}, /*gather_at_start=*/true);
}

TEST_CASE("norm-based optimizers are bitwise identical too", "[sharding]") {
  SECTION("lamb") { Compare("lamb", dsl::Lamb().lr(1e-2).weight_decay(0.01)); }
  SECTION("lars") { Compare("lars", dsl::Lars().lr(0.5).weight_decay(1e-4)); }
  SECTION("sgd + clip_global_norm") { Compare("sgd clip", dsl::SGD().lr(0.05).clip_global_norm(1.0)); }
  SECTION("adam + clip_global_norm") { Compare("adam clip", dsl::Adam().lr(1e-3).clip_global_norm(1.0)); }
}

// Replica groups: 8 replicas in 2 data-parallel groups of 4. Each group trains on its own half of the
// batch; sharding happens within each group. Driven replica by replica so both groups can be checked.
TEST_CASE("Adam sharded within replica groups (N=8, groups of 4) is bitwise identical", "[sharding][groups]") {
  const int n = 8, g = 4;
  // Each group trains on 12 examples per step, which learns slower than 24: a larger step size.
  Config rc{dsl::Adam().lr(3e-3), n, false, false, g};
  Config sc{dsl::Adam().lr(3e-3), n, true, false, g};
  dsl::Program replicated = Build(rc), sharded = Build(sc);
  CheckIsSharded(sharded, sc);
  for (ir::ValueId v : sharded.step.Variables()) {
    ir::ShardFormat f;
    if (ir::ShardFormat::FromAttrs(sharded.step.at(v), &f)) CHECK(f.count == g);
  }

  auto run = [&](const dsl::Program& p, std::vector<double>* losses) {
    const TensorMap init = InitLogicalState(p.step);
    std::vector<TensorMap> states(n);
    for (int r = 0; r < n; ++r) states[r] = ReplicaState(p.step, init, r);
    InProcessCollectives coll(n);
    for (int s = 0; s < kSteps; ++s) {
      std::vector<float> loss(n);
      RunReplicas(n, &coll, [&](int r) {
        TensorMap in;
        for (auto& [name, t] : Batches(false)[s]) in[name] = SliceBatch(t, n, r);
        loss[r] = RunStep(p.step, states[r], in, r, &coll).at("loss").f32[0];
      });
      double sum = 0;
      for (float l : loss) sum += l;
      losses->push_back(sum / n);
    }
    return std::make_pair(LogicalStateFrom(p.step, states, 0), LogicalStateFrom(p.step, states, g));
  };
  std::vector<double> la, lb;
  auto [a0, a1] = run(replicated, &la);
  auto [b0, b1] = run(sharded, &lb);
  {
    INFO("group 0 (replicas 0-3)");
    CheckBitwise(a0, b0);
  }
  {
    INFO("group 1 (replicas 4-7)");
    CheckBitwise(a1, b1);
  }
  CHECK(la == lb);
  // The two groups saw different data, so they must have diverged (groups really are independent).
  CHECK_FALSE(a0.at("fc1.w") == a1.at("fc1.w"));
  CHECK(Mean(lb, kSteps - 5, kSteps) < 0.9 * Mean(lb, 0, 5));

  // The executor agrees with the hand-driven replicas for group 0.
  Run e = Train(sharded, kSteps);
  CheckBitwise(b0, e.final_state);
}

TEST_CASE("CNN with Adam at N=2: sharded is bitwise identical (a few steps)", "[sharding][cnn]") {
  Config rc{dsl::Adam().lr(1e-3), 2, false, false, 0, /*cnn=*/true};
  Config sc{dsl::Adam().lr(1e-3), 2, true, false, 0, /*cnn=*/true};
  dsl::Program replicated = Build(rc), sharded = Build(sc);
  CheckIsSharded(sharded, sc);
  Run a = Train(replicated, 3, true), b = Train(sharded, 3, true);
  CheckBitwise(a.initial, b.initial);
  for (const auto& [name, t] : b.final_state) {
    INFO("variable " << name);
    CHECK_FALSE(t == b.initial.at(name));
  }
  CheckBitwise(a.final_state, b.final_state);
  CHECK(a.losses == b.losses);
}
