// CpuExecutor: the JIT'd step on runtime::ReplicatedExecutor's replica threads; each replica has its
// own workspace and reads its chunk of the global batch in place.
#include "jit/cpu_executor.h"

#include <map>
#include <mutex>

#include "jit/dnnl_kernels.h"

namespace shardstep::jit {

using runtime::TensorMap;

struct CpuExecutor::State {
  explicit State(int n) : workspaces(n) {}
  std::vector<Workspace> workspaces;  // one per replica
  std::mutex forward_mu;
  // Forward modules compiled so far, found by comparing modules (cheaper than printing one per call).
  std::vector<std::pair<ir::Module, std::shared_ptr<const CompiledStep>>> forwards;
  Workspace forward_ws;
};

namespace {
// True when `state` holds every variable `forward` reads with the type it reads (replica 0's state
// does, unless the weights themselves are sharded: --gather-weights start).
bool HoldsWhole(const ir::Module& forward, const TensorMap& state) {
  if (!forward.assigns.empty()) return false;  // it would change the training state
  for (const ir::Instr& in : forward.instrs) {
    if (in.op != ir::OpCode::kVariable) continue;
    auto it = state.find(in.name);
    if (it == state.end() || it->second.type != in.type) return false;
  }
  return true;
}
}  // namespace

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
  std::shared_ptr<const CompiledStep> compiled;
  for (auto& [m, c] : s_->forwards)
    if (m == forward) compiled = c;
  if (!compiled) {
    compiled = CompiledStep::Compile(forward, options_.jit);
    s_->forwards.emplace_back(forward, compiled);
  }
  ConfigureThreadsForReplica(1);
  // The weights in place; the logical state (a copy of every variable, optimizer state included)
  // only when replica 0 does not hold them whole or the module assigns.
  TensorMap& own = replica_state(0);
  if (HoldsWhole(forward, own)) return compiled->Run(own, inputs, 0, nullptr, &s_->forward_ws);
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
