// CpuExecutor: the JIT'd step on runtime::ReplicatedExecutor's replica threads; each replica has its
// own workspace and reads its chunk of the global batch in place.
#include "jit/cpu_executor.h"

#include <map>
#include <mutex>

#include "ir/printer.h"
#include "jit/dnnl_kernels.h"

namespace shardstep::jit {

using runtime::TensorMap;

struct CpuExecutor::State {
  explicit State(int n) : workspaces(n) {}
  std::vector<Workspace> workspaces;  // one per replica
  std::mutex forward_mu;
  std::map<std::string, std::shared_ptr<const CompiledStep>> forwards;
  Workspace forward_ws;
};

CpuExecutor::CpuExecutor(const ir::Module& step, const TensorMap& state, const CpuExecutorOptions& options)
    : ReplicatedExecutor(step, options.collectives), s_(std::make_unique<State>(step.num_replicas)), options_(options) {
  step_ = CompiledStep::Compile(step, options.jit);
  LoadLogicalState(state);
}

CpuExecutor::~CpuExecutor() = default;

TensorMap CpuExecutor::RunReplica(int r, const TensorMap& global_inputs, TensorMap& state, runtime::Collectives* c) {
  ConfigureThreadsForReplica(num_replicas());
  // Each replica reads its chunk of the global batch in place.
  return step_->Run(state, global_inputs, r, c, &s_->workspaces[r], num_replicas());
}

void CpuExecutor::RunReplicaInto(int r, const TensorMap& global_inputs, TensorMap& state, runtime::Collectives* c,
                                 TensorMap* outputs) {
  ConfigureThreadsForReplica(num_replicas());
  step_->Run(state, global_inputs, r, c, &s_->workspaces[r], num_replicas(), outputs);
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
