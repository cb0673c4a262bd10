// bench/weight_update: the weight-update phase and the whole training step of an Adam model with
// >= 20M parameters at N = 1, 2, 4, 8 replicas, replicated vs sharded update, measured in one run.
//
// The update phase is timed on a module holding only that phase (per-replica gradients in,
// all-reduce or reduce-scatter + all-gather, Adam, assigns), built by the same passes as training;
// the whole step is the full MLP training step. Medians over --reps steps after one warm-up.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include "bench/update_module.h"
#include "dsl/dsl.h"
#include "jit/cpu_executor.h"
#include "models/models.h"
#include "runtime/executor.h"
#include "runtime/sharding.h"

using namespace shardstep;

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename F>
double TimeMedian(int reps, F&& f) {
  f();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto a = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  return Median(t);
}

runtime::Tensor Random(ir::Shape s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  runtime::Tensor t(ir::TensorType{ir::DType::kF32, std::move(s)});
  for (float& x : t.f32) x = u(rng);
  return t;
}

std::unique_ptr<runtime::Executor> MakeExecutor(const std::string& backend, const ir::Module& m) {
  if (backend == "cpu") return jit::MakeCpuExecutor(m, runtime::InitLogicalState(m));
  return runtime::MakeInterpreterExecutor(m, runtime::InitLogicalState(m));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"weight-update benchmark: replicated vs sharded Adam update at N = 1, 2, 4, 8"};
  std::vector<int64_t> hidden = {4096, 4096};
  int reps = 5;
  int64_t batch = 64;
  std::vector<int> ns = {1, 2, 4, 8};
  bool skip_step = false;
  std::string backend = "interp";
  app.add_option("--hidden", hidden, "MLP widths (default 784-4096-4096-10: 20.0M parameters)")->delimiter(',');
  app.add_option("--reps", reps, "timed steps per measurement (median)");
  app.add_option("--batch", batch, "global batch for the whole step");
  app.add_option("--replicas", ns, "replica counts")->delimiter(',');
  app.add_flag("--skip-step", skip_step, "only time the update phase");
  app.add_option("--backend", backend, "interp|cpu")->check(CLI::IsMember({"interp", "cpu"}))->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  models::ModelOptions mo;
  mo.batch = batch;
  mo.hidden = hidden;
  const bench::WeightShapes weights = bench::MlpWeights(hidden);
  int64_t params = 0;
  for (auto& [name, shape] : weights) params += ir::NumElements(shape);
  std::printf("model: MLP 784-%s-10, %.2fM parameters, Adam, global batch %lld, %s backend, %d reps (median)\n",
              [&] { std::string s; for (auto h : hidden) s += (s.empty() ? "" : "-") + std::to_string(h); return s; }().c_str(),
              params / 1e6, static_cast<long long>(batch), backend.c_str(), reps);
  std::printf("%3s  %14s %14s %7s   %14s %14s %7s\n", "N", "update repl ms", "update shrd ms", "ratio", "step repl ms",
              "step shrd ms", "ratio");
  for (int n : ns) {
    double upd[2], step[2] = {0, 0};
    for (int shard = 0; shard < 2; ++shard) {
      ir::Module um = bench::UpdateModule(weights, n, shard);
      auto exec = MakeExecutor(backend, um);
      runtime::TensorMap grads = bench::RandomGradients(weights, n);
      upd[shard] = TimeMedian(reps, [&] { exec->Step(grads); }) * 1e3;
      if (skip_step) continue;
      dsl::Model m("mlp");
      auto loss = models::DefineMlp(m, mo);
      dsl::Program p = m.train(loss).optimizer(dsl::Adam().lr(1e-3)).replicas(n).shard_weight_update(shard).build();
      auto sexec = MakeExecutor(backend, p.step);
      runtime::TensorMap in{{"image", Random({batch, 784}, 7)}};
      runtime::Tensor labels(ir::TensorType{ir::DType::kS32, {batch}});
      for (int64_t i = 0; i < batch; ++i) labels.s32[i] = static_cast<int32_t>(i % 10);
      in["label"] = labels;
      step[shard] = TimeMedian(reps, [&] { sexec->Step(in); }) * 1e3;
    }
    std::printf("%3d  %14.1f %14.1f %7.3f   %14.1f %14.1f %7.3f\n", n, upd[0], upd[1], upd[1] / upd[0], step[0], step[1],
                step[0] > 0 ? step[1] / step[0] : 0.0);
    std::fflush(stdout);
  }
  std::printf("ratio = sharded / replicated time, measured in this run on this machine\n");
  return 0;
}
