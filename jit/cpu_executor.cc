// CpuExecutor: the JIT'd step on runtime::ReplicatedExecutor's replica threads; each replica has its
// own workspace and reads its chunk of the global batch in place.
#include "jit/cpu_executor.h"

#include <cstdlib>
#include <map>
#include <mutex>

#include "jit/dnnl_kernels.h"
#include "jit/shared_weight_packs.h"

namespace shardstep::jit {

using runtime::TensorMap;

struct CpuExecutor::State {
  explicit State(int n)
      : workspaces(n), bindings(n), bound_generation(n, ~uint64_t{0}), copies_made(n, 0), bound_outputs(n, nullptr) {}
  std::vector<Workspace> workspaces;  // one per replica
  // Per replica: the slots of its state, its outputs and the global batch (the batch bound once per
  // step by BeginStep into `inputs`, then copied into each binding: pointers, no lookups).
  std::vector<StepBinding> bindings;
  std::vector<uint64_t> bound_generation;  // the state_generation() each replica's variables were bound at
  // Per replica: its weights' bf16 copies (CompiledStep::bf16_weight_copies) hold the rounded weights,
  // made at binding and kept so by every step that finishes.
  std::vector<char> copies_made;
  std::vector<const TensorMap*> bound_outputs;  // the map each replica's outputs are bound into, or null
  StepBinding inputs;
  std::mutex forward_mu;
  // Forward modules compiled so far, found by comparing modules (cheaper than printing one per call).
  std::vector<std::pair<ir::Module, std::shared_ptr<const CompiledStep>>> forwards;
  Workspace forward_ws;
  std::unique_ptr<SharedWeightPacks> packs;  // with shared weights: their products' packed copies
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
  // In-process collectives take an all-gather in place (the replica's new weight slice stored where the
  // all-gather's output has it).
  JitOptions jit = options.jit;
  jit.in_place_all_gathers = dynamic_cast<runtime::InProcessCollectives*>(&collectives()) != nullptr;
  // This executor makes the weights' bf16 copies from its replicas' state (BindingFor).
  static const bool copies_env = [] {
    const char* e = std::getenv("SHARDSTEP_JIT_BF16_COPIES");
    return !(e && std::string(e) == "0");
  }();
  jit.bf16_weight_copies = options.bf16_weight_copies && copies_env;
  step_ = CompiledStep::Compile(step, jit);
  static const bool share_env = [] {
    const char* e = std::getenv("SHARDSTEP_JIT_SHARE_WEIGHTS");
    return !(e && std::string(e) == "0");
  }();
  // Shared only between threads of one process that exchange through shared memory.
  if (options.share_weights && share_env && num_replicas() > 1 &&
      dynamic_cast<runtime::InProcessCollectives*>(&collectives()))
    shared_slots_ = step_->GatheredVariableSlots(num_replicas());
  static const bool packs_env = [] {
    const char* e = std::getenv("SHARDSTEP_JIT_SHARE_PACKS");
    return !(e && std::string(e) == "0");
  }();
  if (!shared_slots_.empty() && options.share_packs && packs_env) {
    s_->packs = std::make_unique<SharedWeightPacks>(*step_, shared_slots_);
    if (s_->packs->products() == 0) s_->packs.reset();
  }
  if (auto* in_process = dynamic_cast<runtime::InProcessCollectives*>(&collectives()); in_process && !options.fold_products)
    in_process->set_fold_products(false);
  LoadLogicalState(state);
}

CpuExecutor::~CpuExecutor() = default;

int CpuExecutor::folded_products() {
  return num_replicas() > 1 && collectives().FoldsProducts() ? step_->info().folded_products : 0;
}

int64_t CpuExecutor::shared_weight_bytes() const {
  int64_t bytes = 0;
  for (int slot : shared_slots_) bytes += step_->module().at(step_->VariableLeaf(slot)).type.bytes();
  return bytes;
}

int CpuExecutor::shared_packed_products() const { return s_->packs ? s_->packs->products() : 0; }
int64_t CpuExecutor::shared_packed_bytes() const { return s_->packs ? s_->packs->bytes() : 0; }

int64_t CpuExecutor::bf16_copy_bytes() const {
  int64_t bytes = 0;
  for (const auto& [copy, weight] : step_->bf16_weight_copies())
    bytes += step_->module().type(step_->module().FindVariable(copy)).bytes();
  return bytes;
}

void CpuExecutor::BeginStep(const TensorMap& global_inputs) { step_->BindInputs(global_inputs, &s_->inputs); }

StepBinding& CpuExecutor::BindingFor(int r, TensorMap& state) {
  StepBinding& b = s_->bindings[r];
  if (s_->bound_generation[r] != state_generation()) {
    step_->MakeBf16WeightCopies(state);  // before binding: new entries of the (new) map
    s_->copies_made[r] = 1;
    step_->BindVariables(state, &b);
    // Replica 0's tensor for the shared weights (its map is only read here, by every replica at once);
    // the replica's own copy is released (the logical state reads replica 0's; a reload makes new maps).
    if (r > 0)
      for (int slot : shared_slots_) {
        const std::string& name = step_->variable_names()[slot];
        b.variables[slot] = &replica_state(0).at(name);
        state.at(name) = runtime::Tensor();
      }
    s_->bound_generation[r] = state_generation();
  }
  if (!s_->copies_made[r]) {  // after a step that threw: in place, into the bound tensors
    step_->MakeBf16WeightCopies(state);
    s_->copies_made[r] = 1;
  }
  b.inputs = s_->inputs.inputs;  // the same size every step: no allocation
  b.packs = s_->packs.get();
  return b;
}

TensorMap CpuExecutor::RunReplica(int r, const TensorMap& global_inputs, TensorMap& state, runtime::Collectives* c) {
  ConfigureThreadsForReplica(num_replicas());
  // Each replica reads its chunk of the global batch in place. The returned map is new each step.
  StepBinding& b = BindingFor(r, state);
  TensorMap outputs;
  s_->bound_outputs[r] = nullptr;  // a local map: bound for this step only
  step_->BindOutputs(&outputs, &b);
  RunBound(r, b, c);
  return outputs;
}

void CpuExecutor::RunReplicaInto(int r, const TensorMap& global_inputs, TensorMap& state, runtime::Collectives* c,
                                 TensorMap* outputs) {
  ConfigureThreadsForReplica(num_replicas());
  StepBinding& b = BindingFor(r, state);
  // ReplicatedExecutor keeps `outputs` from step to step and never erases from it: bound once.
  if (s_->bound_outputs[r] != outputs) {
    step_->BindOutputs(outputs, &b);
    s_->bound_outputs[r] = outputs;
  }
  RunBound(r, b, c);
}

void CpuExecutor::RunBound(int r, const StepBinding& b, runtime::Collectives* c) {
  // The copies are made again after a step that throws. (A loop updates a weight and its copy in place
  // only when nothing after it can fail, and a swapped-in value is swapped in at the end with the others,
  // so a failed step should leave both as they were; this does not rely on it.)
  s_->copies_made[r] = 0;
  step_->Run(b, r, c, &s_->workspaces[r], num_replicas());
  s_->copies_made[r] = 1;
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
