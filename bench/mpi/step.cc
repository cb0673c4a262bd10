// bench/mpi_step (run under mpirun -np K): the MLP training step with one replica per MPI rank against the
// same program with K replica threads in one process, measured in one run, and the bytes each rank sends
// per step against the closed form of the algorithm (MpiCollectives: a reduce-scatter sends g-1 chunks, an
// all-gather g-1 copies of its chunk, an all-reduce both of ceil(n/g)-element shards), summed over the
// collectives of the lowered step module.
//   mpirun --allow-run-as-root --oversubscribe -np 4 build/bench/mpi_step --shard-weight-update on
// --replicas-per-process T: K ranks x T replica threads (runtime::MpiExecutor over HybridCollectives) against
// K*T replica threads in one process; bytes per rank against HybridClosedFormBytes.
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>

#include "dsl/dsl.h"
#include "jit/compiled_step.h"
#include "jit/cpu_executor.h"
#include "jit/dnnl_kernels.h"
#include "models/models.h"
#include "runtime/dataset.h"
#include "runtime/mpi/hybrid_collectives.h"
#include "runtime/mpi/mpi_collectives.h"
#include "runtime/mpi/mpi_executor.h"
#include "runtime/sharding.h"

using namespace shardstep;

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Closed form: payload bytes one member sends per step, from the step module's collectives.
int64_t ClosedFormBytes(const ir::Module& m) {
  int64_t bytes = 0;
  for (const ir::Instr& in : m.instrs) {
    const bool ar = in.op == ir::OpCode::kAllReduce, rs = in.op == ir::OpCode::kReduceScatter,
               ag = in.op == ir::OpCode::kAllGather;
    if (!ar && !rs && !ag) continue;
    int64_t g = m.num_replicas;
    if (in.Has("group_size")) g = in.GetInt("group_size");
    if (g <= 1) continue;
    const int64_t out = ir::NumElements(in.type.shape), operand = ir::NumElements(m.type(in.operands[0]).shape);
    if (ar) bytes += 2 * (g - 1) * ((out + g - 1) / g) * 4;  // reduce-scatter + all-gather of padded shards
    if (rs) bytes += (g - 1) * out * 4;                       // out = one chunk
    if (ag) bytes += (g - 1) * operand * 4;                   // operand = one chunk
  }
  return bytes;
}

// HybridCollectives, for K ranks x T replicas and collectives over every replica: a rank sends each of the
// K-1 others, per reduce-scatter, its T members' chunks for the peer's T members (T*T chunks); per all-gather
// its T members' inputs; an all-reduce is both over ceil(n/g)-element shards; plus the all-gather of the T
// losses per step (MpiExecutor averages the loss over every replica).
int64_t HybridClosedFormBytes(const ir::Module& m, int K, int T) {
  int64_t bytes = 0;
  const int64_t g = m.num_replicas;
  for (const ir::Instr& in : m.instrs) {
    const bool ar = in.op == ir::OpCode::kAllReduce, rs = in.op == ir::OpCode::kReduceScatter,
               ag = in.op == ir::OpCode::kAllGather;
    if (!ar && !rs && !ag) continue;
    if (in.Has("group_size") && in.GetInt("group_size") != g) return -1;  // only whole-world groups here
    const int64_t out = ir::NumElements(in.type.shape), operand = ir::NumElements(m.type(in.operands[0]).shape);
    if (ar) bytes += int64_t{T} * (T + 1) * (K - 1) * ((out + g - 1) / g) * 4;
    if (rs) bytes += int64_t{T} * T * (K - 1) * out * 4;
    if (ag) bytes += int64_t{T} * (K - 1) * operand * 4;
  }
  return bytes + int64_t{T} * (K - 1) * 4;
}

// K ranks x T replica threads against K*T threads in one process.
int RunHybrid(int T, const std::string& shard, int64_t batch, int steps) {
  runtime::HybridCollectives hc(T);
  const int K = hc.ranks(), me = hc.rank(), n = K * T;
  if (batch % n != 0) {
    if (me == 0)
      std::fprintf(stderr, "mpi_step: --batch %ld is not divisible by %d replicas\n", static_cast<long>(batch), n);
    return 2;
  }
  dsl::Model m("mlp", 1);
  models::ModelOptions mo;
  mo.batch = batch;
  mo.classes = 10;
  dsl::Tensor loss = models::DefineMlp(m, mo);
  dsl::Program p = m.train(loss).optimizer(dsl::Adam().lr(1e-3)).replicas(n).shard_weight_update(shard == "on").build();
  const runtime::Dataset data = runtime::SyntheticClassification(batch, 1, 28, 28, 10, 3);
  runtime::BatchIterator it(data, batch, false, 0, ir::Shape{784});
  runtime::TensorMap in;
  it.Next(&in["image"], &in["label"]);
  const runtime::TensorMap init = runtime::InitLogicalState(p.step);
  runtime::MpiExecutor exec(p.step, init, hc);
  exec.Step(in);  // warm-up
  const int64_t bytes0 = hc.bytes_sent();
  std::vector<double> ms;
  for (int i = 0; i < steps; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    exec.Step(in);
    MPI_Barrier(MPI_COMM_WORLD);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  const double bytes_per_step = static_cast<double>(hc.bytes_sent() - bytes0) / steps;
  const double mpi_ms = Median(ms);
  if (me != 0) return 0;
  auto local = jit::MakeCpuExecutor(p.step, init);
  local->Step(in);
  std::vector<double> lms;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    local->Step(in);
    lms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  const int64_t closed = HybridClosedFormBytes(p.step, K, T);
  std::printf("MLP, global batch %ld, Adam, weight update sharded %s, %d steps after a warm-up\n",
              static_cast<long>(batch), shard.c_str(), steps);
  std::printf("  %d MPI ranks x %d replica threads:  median step %8.2f ms\n", K, T, mpi_ms);
  std::printf("  %d replica threads in one process:  median step %8.2f ms\n", n, Median(lms));
  std::printf("  ratio MPI / in-process: %.2f\n", mpi_ms / Median(lms));
  std::printf("  bytes each rank sends per step: measured %.0f, closed form %ld (%s)\n", bytes_per_step,
              static_cast<long>(closed), static_cast<int64_t>(bytes_per_step) == closed ? "equal" : "DIFFERENT");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  runtime::MpiSession session(&argc, &argv);
  CLI::App app{"MLP training step: K MPI ranks vs K in-process replicas"};
  std::string shard = "on";
  int64_t batch = 256;
  int steps = 30, per_process = 0;
  app.add_option("--shard-weight-update", shard, "on|off")->check(CLI::IsMember({"on", "off"}));
  app.add_option("--batch", batch, "global batch (divisible by the rank count)");
  app.add_option("--steps", steps, "timed steps (after one warm-up)");
  app.add_option("--replicas-per-process", per_process, "K ranks x this many replica threads (MpiExecutor)");
  CLI11_PARSE(app, argc, argv);
  if (per_process > 0) return RunHybrid(per_process, shard, batch, steps);
  runtime::MpiCollectives mpi;
  const int K = session.size(), me = session.rank();
  if (batch % K != 0) {
    if (me == 0) std::fprintf(stderr, "mpi_step: --batch %ld is not divisible by %d ranks\n", static_cast<long>(batch), K);
    return 2;
  }

  dsl::Model m("mlp", 1);
  models::ModelOptions mo;
  mo.batch = batch;
  mo.classes = 10;
  dsl::Tensor loss = models::DefineMlp(m, mo);
  dsl::Program p = m.train(loss).optimizer(dsl::Adam().lr(1e-3)).replicas(K).shard_weight_update(shard == "on").build();
  const runtime::Dataset data = runtime::SyntheticClassification(batch, 1, 28, 28, 10, 3);
  runtime::BatchIterator it(data, batch, false, 0, ir::Shape{784});
  runtime::TensorMap in;
  it.Next(&in["image"], &in["label"]);
  const runtime::TensorMap init = runtime::InitLogicalState(p.step);

  jit::ConfigureThreadsForReplica(K);
  auto step = jit::CompiledStep::Compile(p.step);
  jit::Workspace ws;
  runtime::TensorMap state = runtime::ReplicaState(p.step, init, me);
  step->Run(state, in, me, &mpi, &ws, K);  // warm-up
  const int64_t bytes0 = mpi.bytes_sent();
  std::vector<double> ms;
  for (int i = 0; i < steps; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);  // every rank starts the step together
    const auto t0 = std::chrono::steady_clock::now();
    step->Run(state, in, me, &mpi, &ws, K);
    MPI_Barrier(MPI_COMM_WORLD);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  const double bytes_per_step = static_cast<double>(mpi.bytes_sent() - bytes0) / steps;
  const double mpi_ms = Median(ms);

  if (me == 0) {
    auto exec = jit::MakeCpuExecutor(p.step, init);
    exec->Step(in);
    std::vector<double> local;
    for (int i = 0; i < steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      exec->Step(in);
      local.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    const double local_ms = Median(local);
    const int64_t closed = ClosedFormBytes(p.step);
    int64_t params = 0;
    for (const auto& [name, t] : init)
      if (name.find('/') == std::string::npos && t.dtype() == ir::DType::kF32) params += t.elements();
    std::printf("MLP (%ld parameters), global batch %ld, Adam, weight update sharded %s, %d steps after a warm-up\n",
                static_cast<long>(params), static_cast<long>(batch), shard.c_str(), steps);
    std::printf("  %d MPI ranks (1 replica each):       median step %8.2f ms\n", K, mpi_ms);
    std::printf("  %d replica threads in one process:   median step %8.2f ms\n", K, local_ms);
    std::printf("  ratio MPI / in-process: %.2f (same machine, same cores; ranks exchange through shared memory)\n",
                mpi_ms / local_ms);
    std::printf("  bytes each rank sends per step: measured %.0f, closed form %ld (%s)\n", bytes_per_step,
                static_cast<long>(closed), static_cast<int64_t>(bytes_per_step) == closed ? "equal" : "DIFFERENT");
    std::printf("  ideal ring all-reduce of the gradients, 2 (K-1)/K x 4 x params: %.0f\n",
                2.0 * (K - 1) / K * 4 * static_cast<double>(params));
  }
  return 0;
}
