// Launched by tests/runtime/mpi_training_test.cc under mpirun: K ranks train the MLP for --steps steps,
// one replica per rank (the JIT'd step of replica `rank`, reading its chunk of each global batch, over
// MpiCollectives), then gather the logical state; rank 0 trains the same program in process with K
// replica threads and compares every variable bit for bit, and the losses. Exit 1 on a difference.
// --fail-how hang makes rank R sleep forever instead; --collective-timeout T makes the others give up after T s.
//   training_worker [--model mlp|cnn] --optimizer adam|lamb --shard on|off [--steps N] [--fail-rank R --fail-step S --fail-how throw|kill]
// --first-step F starts at batch F (after F steps); --load PATH starts from a checkpoint; --save PATH: rank 0
// writes the gathered logical state after the last step. Rank 0 prints "loss <step> <value>" for every step.
// With --fail-*, rank R throws (caught: MpiCollectives::Abort names the rank and ends the job) or is killed
// (SIGKILL: mpirun notices and ends the job) before its step S; the test checks that every rank is gone soon.
// --replicas-per-process T: T replica threads per rank (runtime::MpiExecutor over HybridCollectives) against the
// in-process run with K*T replicas (tests/mpi/mpi_hybrid_test.cc).
#include <chrono>
#include <csignal>
#include <thread>
#include <cstdio>
#include <cstring>
#include <string>

#include "dsl/dsl.h"
#include "ir/error.h"
#include "jit/compiled_step.h"
#include "jit/cpu_executor.h"
#include "jit/dnnl_kernels.h"
#include "models/models.h"
#include "runtime/checkpoint.h"
#include "runtime/dataset.h"
#include "runtime/mpi/distributed_state.h"
#include "runtime/mpi/hybrid_collectives.h"
#include "runtime/mpi/mpi_executor.h"
#include "runtime/mpi/mpi_collectives.h"
#include "runtime/sharding.h"

using namespace shardstep;
using runtime::TensorMap;

namespace {

// --replicas-per-process T: K ranks x T replica threads (runtime::MpiExecutor over HybridCollectives) against
// the in-process run with K*T replicas: every step's averaged loss and every variable, bit for bit.
int RunHybrid(const dsl::Program& p, const TensorMap& init, const std::vector<TensorMap>& batches, int T,
              double timeout, const std::string& what) {
  runtime::HybridCollectives hc(T, timeout);
  const int K = hc.ranks(), me = hc.rank();
  runtime::MpiExecutor exec(p.step, init, hc);
  std::vector<float> losses;
  for (const TensorMap& b : batches) losses.push_back(exec.Step(b).at("loss").f32[0]);
  const TensorMap gathered = exec.LogicalState();
  if (me != 0) return 0;
  int bad = 0;
  auto ref = jit::MakeCpuExecutor(p.step, init);
  for (size_t i = 0; i < batches.size(); ++i) {
    const float want = ref->Step(batches[i]).at("loss").f32[0];
    if (std::memcmp(&want, &losses[i], 4) != 0) {
      std::fprintf(stderr, "step %zu: loss %.9g over MPI, %.9g in process\n", i + 1, losses[i], want);
      ++bad;
    }
  }
  for (const auto& [name, t] : ref->LogicalState()) {
    const auto g = gathered.find(name);
    if (g == gathered.end() || !(g->second == t)) {
      std::fprintf(stderr, "variable %s differs from the in-process run\n", name.c_str());
      ++bad;
    }
  }
  std::printf("%s: %d ranks x %d replicas, %s, %zu steps, %zu variables, final loss %.6f, %lld bytes sent by rank 0\n",
              bad ? "MISMATCH" : "bitwise equal to in-process", K, T, what.c_str(), batches.size(), gathered.size(),
              losses.back(), static_cast<long long>(hc.bytes_sent()));
  std::fflush(stdout);
  return bad ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  runtime::MpiSession session(&argc, &argv);
  std::string model = "mlp", optimizer = "adam", shard = "off", fail_how = "throw";
  int steps = 20, fail_rank = -1, fail_step = -1, first_step = 0, per_process = 0;
  double timeout = 0;
  std::string load, save;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") model = v;
    else if (k == "--optimizer") optimizer = v;
    else if (k == "--shard") shard = v;
    else if (k == "--steps") steps = std::stoi(v);
    else if (k == "--fail-rank") fail_rank = std::stoi(v);
    else if (k == "--fail-step") fail_step = std::stoi(v);
    else if (k == "--fail-how") fail_how = v;
    else if (k == "--first-step") first_step = std::stoi(v);
    else if (k == "--collective-timeout") timeout = std::stod(v);
    else if (k == "--load") load = v;
    else if (k == "--save") save = v;
    else if (k == "--replicas-per-process") per_process = std::stoi(v);
    else {
      std::fprintf(stderr, "training_worker: unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  const int K = session.size() * std::max(per_process, 1), me = session.rank();
  constexpr int64_t kBatch = 48;  // divisible by 2, 3 and 4

  dsl::Model m(model, /*seed=*/5);
  models::ModelOptions mo;
  mo.batch = kBatch;
  mo.hidden = {64, 32};
  mo.classes = 10;
  dsl::Tensor loss = model == "cnn" ? models::DefineCnn(m, mo) : models::DefineMlp(m, mo);
  ir::OptimizerConfig opt = optimizer == "lamb" ? dsl::Lamb().lr(1e-2).weight_decay(0.01) : dsl::Adam().lr(1e-3);
  dsl::Program p = m.train(loss).optimizer(opt).replicas(K).shard_weight_update(shard == "on").build();

  const runtime::Dataset data = runtime::SyntheticClassification(4 * kBatch, 1, 28, 28, 10, /*seed=*/11);
  runtime::BatchIterator it(data, kBatch, /*shuffle=*/true, /*seed=*/3,
                            model == "cnn" ? ir::Shape{1, 28, 28} : ir::Shape{784});
  std::vector<TensorMap> batches(steps);
  TensorMap skipped;
  for (int i = 0; i < first_step; ++i) it.Next(&skipped["image"], &skipped["label"]);
  for (TensorMap& b : batches) it.Next(&b["image"], &b["label"]);

  // This rank's replica, over MPI, from the initialisers or a checkpoint (written by any replica count).
  TensorMap init = runtime::InitLogicalState(p.step);
  if (!load.empty()) {
    TensorMap loaded = runtime::LoadCheckpoint(load);
    std::map<std::string, ir::TensorType> expected;
    for (const auto& [name, t] : init) expected[name] = t.type;
    runtime::CheckCheckpointMatches(loaded, expected, load);
    init = std::move(loaded);
  }
  if (per_process > 0)
    return RunHybrid(p, init, batches, per_process, timeout, Str(model, ", ", optimizer, ", shard ", shard));
  runtime::MpiCollectives mpi(timeout);
  jit::ConfigureThreadsForReplica(1);
  auto step = jit::CompiledStep::Compile(p.step);
  jit::Workspace ws;
  TensorMap state = runtime::ReplicaState(p.step, init, me);
  std::vector<float> losses;
  try {
    for (int i = 0; i < steps; ++i) {
      if (me == fail_rank && i + 1 == fail_step) {
        if (fail_how == "kill") std::raise(SIGKILL);
        if (fail_how == "hang")
          for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
        throw Error(Str("the data file went away at step ", i + 1));
      }
      losses.push_back(step->Run(state, batches[i], me, &mpi, &ws, K).at("loss").f32[0]);
    }
  } catch (const std::exception& e) {
    mpi.Abort(e.what());  // does not return
  }
  const TensorMap gathered = runtime::GatherLogicalState(p.step, state, me, mpi);
  if (me == 0 && !save.empty()) runtime::SaveCheckpoint(save, gathered);
  // Each step's loss averaged over the replicas as Executor::Step does (each replica's loss is its own chunk's).
  std::vector<float> all_losses(static_cast<size_t>(steps) * K);
  runtime::ReplicaGroup world(K);
  for (int r = 0; r < K; ++r) world[r] = r;
  mpi.AllGather(me, world, losses.data(), all_losses.data(), steps);
  if (me == 0)
    for (int i = 0; i < steps; ++i) {
      double sum = 0;
      for (int r = 0; r < K; ++r) sum += all_losses[static_cast<size_t>(r) * steps + i];
      std::printf("loss %d %.9g\n", first_step + i + 1, static_cast<float>(sum / K));
    }

  int bad = 0;
  if (me == 0) {  // the in-process run with K replica threads
    auto exec = jit::MakeCpuExecutor(p.step, init);
    for (int i = 0; i < steps; ++i) {
      const std::vector<TensorMap> outs = exec->StepReplicas(batches[i]);
      if (std::memcmp(&outs[0].at("loss").f32[0], &losses[i], 4) != 0) {
        std::fprintf(stderr, "step %d: loss %.9g over MPI, %.9g in process\n", i + 1, losses[i],
                     outs[0].at("loss").f32[0]);
        ++bad;
      }
    }
    const TensorMap ref = exec->LogicalState();
    for (const auto& [name, t] : ref) {
      const auto g = gathered.find(name);
      if (g == gathered.end() || !(g->second == t)) {
        std::fprintf(stderr, "variable %s differs from the in-process run\n", name.c_str());
        ++bad;
      }
    }
    std::printf("%s: %d ranks, %s, %s, shard %s, %d steps, %zu variables, final loss %.6f\n",
                bad ? "MISMATCH" : "bitwise equal to in-process", K, model.c_str(), optimizer.c_str(), shard.c_str(),
                steps, ref.size(), losses.back());
    std::fflush(stdout);
  }
  return bad ? 1 : 0;
}
