// bench/weight_update: the weight-update phase and the whole training step of an Adam model with
// >= 20M parameters at N = 1, 2, 4, 8 replicas, replicated vs sharded update, measured in one run.
//
// The update phase is timed on a module holding only that phase (per-replica gradients in,
// all-reduce or reduce-scatter + all-gather, Adam, assigns), built by the same passes as training;
// the whole step is the full MLP training step. Medians over --reps steps after one warm-up.
//
// The phase is split into its communication (the all-reduce, or the reduce-scatter + all-gather:
// wall time inside the collectives, from the executor) and the update computation (the rest: the
// optimizer arithmetic and the formatting around it), which is the redundant work that sharding
// divides by N. Without shared weights both modes move the same collective bytes (ratio near 1), which
// on a shared-memory host where collectives are memory copies on the same cores bounds the whole-phase
// ratio from below; with them (the cpu backend's in-process replicas) the all-gather writes each byte once.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <tuple>

#include "bench/update_module.h"
#include "dsl/dsl.h"
#include "jit/cpu_executor.h"
#include "shardstep/shardstep.h"
#include "models/models.h"
#include "runtime/executor.h"
#include "runtime/sharding.h"

using namespace shardstep;

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Timing {
  double total_ms = 0, compute_ms = 0, comm_ms = 0;  // medians over the reps
};

// Median wall time of Step(in) on the replicated and the sharded executor, measured alternately
// (so drifting machine noise hits both alike), and of each step's communication and computation.
std::pair<Timing, Timing> TimeAlternately(int reps, runtime::Executor& repl, runtime::Executor& shard,
                                          const runtime::TensorMap& in) {
  runtime::Executor* execs[2] = {&repl, &shard};
  std::vector<double> total[2], compute[2], comm[2];
  for (runtime::Executor* e : execs) {
    e->SetPhaseTiming(true);  // communication and computation never overlap: the split is exact
    e->Step(in);              // warm-up
  }
  for (int i = 0; i < reps; ++i) {
    for (int k = 0; k < 2; ++k) {
      const double c0 = execs[k]->CommunicationSeconds();
      auto a = std::chrono::steady_clock::now();
      execs[k]->Step(in);
      const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
      const double c = execs[k]->CommunicationSeconds() - c0;
      total[k].push_back(t * 1e3);
      comm[k].push_back(c * 1e3);
      compute[k].push_back((t - c) * 1e3);
    }
  }
  auto timing = [&](int k) { return Timing{Median(total[k]), Median(compute[k]), Median(comm[k])}; };
  return {timing(0), timing(1)};
}

runtime::Tensor Random(ir::Shape s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  runtime::Tensor t(ir::TensorType{ir::DType::kF32, std::move(s)});
  for (float& x : t.f32) x = u(rng);
  return t;
}

// A Session on backend `backend` (the registry) for a lowered module. The timing drives its executor
// directly: the update-phase module's inputs are per-replica gradients, not a global batch.
std::unique_ptr<Session> MakeSession(const std::string& backend, const ir::Module& m) {
  return std::make_unique<Session>(m, std::nullopt, backend);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"weight-update benchmark: replicated vs sharded Adam update at N = 1, 2, 4, 8"};
  std::vector<int64_t> hidden = {4096, 4096};
  int reps = 11;
  int64_t batch = 64;
  std::vector<int> ns = {1, 2, 4, 8};
  bool skip_step = false;
  std::string backend = "cpu";
  app.add_option("--hidden", hidden, "MLP widths (default 784-4096-4096-10: 20.0M parameters)")->delimiter(',');
  app.add_option("--reps", reps, "timed steps per measurement (median)");
  app.add_option("--batch", batch, "global batch for the whole step");
  app.add_option("--replicas", ns, "replica counts")->delimiter(',');
  app.add_flag("--skip-step", skip_step, "only time the update phase");
  app.add_option("--backend", backend, "a registered backend")->check(CLI::IsMember(BackendNames()))->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  models::ModelOptions mo;
  mo.batch = batch;
  mo.hidden = hidden;
  const bench::WeightShapes weights = bench::MlpWeights(hidden);
  int64_t params = 0;
  for (auto& [name, shape] : weights) params += ir::NumElements(shape);
  std::printf("model: MLP 784-%s-10, %.2fM parameters, Adam, global batch %lld, %s backend, %d reps (median, replicated and sharded alternately)\n",
              [&] { std::string s; for (auto h : hidden) s += (s.empty() ? "" : "-") + std::to_string(h); return s; }().c_str(),
              params / 1e6, static_cast<long long>(batch), backend.c_str(), reps);
  std::printf("%3s | %-32s | %-32s | %-26s | %-26s\n", "", "update phase (ms)", "update computation (ms)",
              "collectives (ms)", "whole step (ms)");
  std::printf("%3s | %10s %10s %10s | %10s %10s %10s | %8s %8s %8s | %8s %8s %8s\n", "N", "repl", "shard", "ratio", "repl",
              "shard", "ratio", "repl", "shard", "ratio", "repl", "shard", "ratio");
  bool shared_weights = false;  // the sharded replicas share one copy of each weight (jit::CpuExecutor)
  for (int n : ns) {
    Timing upd[2], step[2];
    {
      const runtime::TensorMap grads = bench::RandomGradients(weights, n);
      ir::Module repl = bench::UpdateModule(weights, n, false), shard = bench::UpdateModule(weights, n, true);
      auto r = MakeSession(backend, repl), s = MakeSession(backend, shard);
      if (auto* cpu = dynamic_cast<jit::CpuExecutor*>(&s->executor()); cpu && n > 1) shared_weights = cpu->shared_weights() > 0;
      std::tie(upd[0], upd[1]) = TimeAlternately(reps, r->executor(), s->executor(), grads);
    }
    if (!skip_step) {
      std::unique_ptr<Session> sessions[2];
      for (int shard = 0; shard < 2; ++shard) {
        dsl::Model m("mlp");
        auto loss = models::DefineMlp(m, mo);
        dsl::Program p = m.train(loss).optimizer(dsl::Adam().lr(1e-3)).replicas(n).shard_weight_update(shard).build();
        sessions[shard] = MakeSession(backend, p.step);
      }
      runtime::TensorMap in{{"image", Random({batch, 784}, 7)}};
      runtime::Tensor labels(ir::TensorType{ir::DType::kS32, {batch}});
      for (int64_t i = 0; i < batch; ++i) labels.s32[i] = static_cast<int32_t>(i % 10);
      in["label"] = labels;
      std::tie(step[0], step[1]) = TimeAlternately(reps, sessions[0]->executor(), sessions[1]->executor(), in);
    }
    auto ratio = [](double a, double b) { return a > 0 ? b / a : 0.0; };
    std::printf("%3d | %10.1f %10.1f %10.3f | %10.1f %10.1f %10.3f | %8.1f %8.1f %8.3f | %8.1f %8.1f %8.3f\n", n,
                upd[0].total_ms, upd[1].total_ms, ratio(upd[0].total_ms, upd[1].total_ms), upd[0].compute_ms,
                upd[1].compute_ms, ratio(upd[0].compute_ms, upd[1].compute_ms), upd[0].comm_ms, upd[1].comm_ms,
                ratio(upd[0].comm_ms, upd[1].comm_ms), step[0].total_ms, step[1].total_ms,
                ratio(step[0].total_ms, step[1].total_ms));
    std::fflush(stdout);
  }
  // The closed-form memory traffic per replica, in units of E = the gradient bytes (in-process
  // collectives are memory copies; see runtime/inprocess_collectives.h):
  //   all-reduce: fold reads E, writes E/N to scratch; copy-out reads E, writes E   = 3E + E/N
  //   reduce-scatter: fold reads E, writes E/N                                      = E + E/N
  //   all-gather: reads E, writes E; into one weight copy the replicas share, each
  //     member writes its own chunk only: reads E/N, writes E/N                     = 2E or 2E/N
  //   Adam replicated: reads g, w, m, v, writes w, m, v (in place)                 = 7E
  //   Adam sharded: the same on 1/N: the local slice of w is read where it is (a
  //     view), m and v are updated in place, the new slice goes to the all-gather   = 7E/N
  std::printf("\nclosed-form memory traffic per replica (units of the gradient bytes), as sharded/replicated ratios%s:\n",
              shared_weights ? " (the sharded replicas share one weight copy)" : "");
  std::printf("%3s | %10s | %10s | %10s\n", "N", "phase", "update", "collectives");
  for (int n : ns) {
    if (n == 1) continue;
    const double coll_r = 3.0 + 1.0 / n, coll_s = 1.0 + 1.0 / n + (shared_weights ? 2.0 / n : 2.0);
    const double upd_r = 7.0, upd_s = 7.0 / n;
    std::printf("%3d | %10.3f | %10.3f | %10.3f\n", n, (coll_s + upd_s) / (coll_r + upd_r), upd_s / upd_r, coll_s / coll_r);
  }
  std::printf("ratio = sharded / replicated time, measured in this run on this machine; update computation =\n"
              "update phase - collectives (from a collective's last arrival to its exit; replicas leave it together)\n");
  return 0;
}
