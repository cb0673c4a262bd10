// CpuExecutor: mirrors the interpreter executor (runtime/executor.cc) with the JIT'd step: the batch
// is split along dimension 0 across replica threads, each with its own state shard and workspace.
#include "jit/cpu_executor.h"

#include <malloc.h>

#include <map>
#include <mutex>

#include "ir/printer.h"
#include "jit/dnnl_kernels.h"
#include "runtime/inprocess_collectives.h"
#include "runtime/replica_runner.h"
#include "runtime/sharding.h"

namespace shardstep::jit {

using runtime::TensorMap;

struct CpuExecutor::State {
  explicit State(int n) : n(n), collectives(n), states(n), workspaces(n) {}
  int n;
  runtime::InProcessCollectives collectives;
  std::vector<TensorMap> states;
  std::vector<Workspace> workspaces;
  std::mutex forward_mu;
  std::map<std::string, std::shared_ptr<const CompiledStep>> forwards;
  Workspace forward_ws;
};

CpuExecutor::CpuExecutor(const ir::Module& step, const TensorMap& state, const CpuExecutorOptions& options)
    : s_(std::make_unique<State>(step.num_replicas)), options_(options) {
  // Large buffers are reused across steps; keep freed memory in the heap (as the interpreter executor).
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, -1);
  step_ = CompiledStep::Compile(step, options.jit);
  LoadLogicalState(state);
}

CpuExecutor::~CpuExecutor() = default;

TensorMap CpuExecutor::Step(const TensorMap& global_inputs) {
  const int n = s_->n;
  std::vector<TensorMap> outputs(n);
  auto body = [&](int r) {
    ConfigureThreadsForReplica(n);
    if (n == 1) {  // the whole batch, read in place
      outputs[r] = step_->Run(s_->states[r], global_inputs, r, nullptr, &s_->workspaces[r]);
      return;
    }
    // Each replica reads its chunk of the global batch in place.
    outputs[r] = step_->Run(s_->states[r], global_inputs, r, &s_->collectives, &s_->workspaces[r], n);
  };
  if (n == 1) body(0);  // no thread hop for one replica
  else runtime::RunReplicas(n, &s_->collectives, body);
  TensorMap out = outputs[0];
  if (n > 1 && out.count("loss")) {
    double sum = 0;
    for (auto& o : outputs) sum += o.at("loss").f32[0];
    out["loss"].f32[0] = static_cast<float>(sum / n);
  }
  return out;
}

TensorMap CpuExecutor::Forward(const ir::Module& forward, const TensorMap& inputs) {
  std::lock_guard<std::mutex> lock(s_->forward_mu);
  const std::string text = ir::Print(forward);
  auto& compiled = s_->forwards[text];
  if (!compiled) compiled = CompiledStep::Compile(forward, options_.jit);
  ConfigureThreadsForReplica(1);
  TensorMap state = LogicalState();
  return compiled->Run(state, inputs, 0, nullptr, &s_->forward_ws);
}

double CpuExecutor::CommunicationSeconds() const { return s_->collectives.busy_seconds(); }
void CpuExecutor::SetPhaseTiming(bool on) { s_->collectives.set_phase_timing(on); }

TensorMap CpuExecutor::LogicalState() const { return runtime::LogicalStateFrom(step_->module(), s_->states); }

void CpuExecutor::LoadLogicalState(const TensorMap& state) {
  for (int r = 0; r < s_->n; ++r) s_->states[r] = runtime::ReplicaState(step_->module(), state, r);
}

std::unique_ptr<runtime::Executor> MakeCpuExecutor(const ir::Module& step, const TensorMap& logical_state) {
  return std::make_unique<CpuExecutor>(step, logical_state);
}

TensorMap JitRunStep(const ir::Module& m, TensorMap& variables, const TensorMap& inputs, int replica,
                     runtime::Collectives* collectives) {
  auto step = CompiledStep::Compile(m);
  Workspace ws;
  return step->Run(variables, inputs, replica, collectives, &ws);
}

}  // namespace shardstep::jit
