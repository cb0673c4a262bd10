// MpiExecutor: this rank's T replicas of the JIT'd step over HybridCollectives (see the header).
#include "runtime/mpi/mpi_executor.h"

#include <mpi.h>

#include <cstring>

#include "ir/error.h"
#include "ir/printer.h"
#include "jit/compiled_step.h"
#include "jit/dnnl_kernels.h"
#include "runtime/replica_runner.h"
#include "runtime/sharding.h"

namespace shardstep::runtime {

MpiExecutor::MpiExecutor(const ir::Module& step, const TensorMap& logical_state, HybridCollectives& c)
    : step_(step), c_(c), per_rank_(c.replicas_per_process()), first_(c.first_replica()), n_(c.num_replicas()),
      workspaces_(per_rank_), states_(per_rank_), bindings_(per_rank_), forward_ws_(std::make_unique<jit::Workspace>()) {
  if (step.num_replicas != n_)
    throw Error(Str("the step is lowered for ", step.num_replicas, " replicas but ", c.ranks(), " ranks x ", per_rank_,
                    " replicas per process (--replicas-per-process) make ", n_));
  jit::JitOptions options;
  options.bf16_weight_copies = true;  // made per local replica from its state (LoadLogicalState)
  compiled_ = jit::CompiledStep::Compile(step, options);
  LoadLogicalState(logical_state);
  if (per_rank_ > 1) pool_ = std::make_unique<ReplicaPool>(per_rank_);
}

MpiExecutor::~MpiExecutor() = default;

TensorMap MpiExecutor::Step(const TensorMap& global_inputs) {
  logical_.reset();
  ++steps_;
  std::vector<TensorMap> outs(per_rank_);
  std::vector<std::vector<float>> losses(per_rank_, std::vector<float>(n_));
  if (!copies_made_)  // after a step that threw: the weights' bf16 copies made again, in place
    for (TensorMap& state : states_) compiled_->MakeBf16WeightCopies(state);
  copies_made_ = false;
  compiled_->BindInputs(global_inputs, &bindings_[0]);
  for (int t = 1; t < per_rank_; ++t) bindings_[t].inputs = bindings_[0].inputs;
  ReplicaGroup all(n_);
  for (int r = 0; r < n_; ++r) all[r] = r;
  auto body = [&](int t) {
    const int r = first_ + t;
    jit::ConfigureThreadsForReplica(n_);
    // Each replica reads its chunk of the global batch in place, as in process.
    compiled_->BindOutputs(&outs[t], &bindings_[t]);
    compiled_->Run(bindings_[t], r, &c_, &workspaces_[t], n_);
    auto loss = outs[t].find("loss");
    if (loss != outs[t].end()) c_.AllGather(r, all, loss->second.f32.data(), losses[t].data(), 1);
  };
  if (pool_) pool_->Run(&c_, body);
  else body(0);
  copies_made_ = true;
  TensorMap out = std::move(outs[0]);
  if (out.count("loss")) {  // averaged over every replica in replica order, as ReplicatedExecutor::Step
    double sum = 0;
    for (int r = 0; r < n_; ++r) sum += losses[0][r];
    out["loss"].f32[0] = static_cast<float>(sum / n_);
  }
  return out;
}

TensorMap MpiExecutor::LogicalState() const {
  if (logical_) return *logical_;
  std::vector<TensorMap> replicas(n_);
  ReplicaGroup all(n_);
  for (int r = 0; r < n_; ++r) all[r] = r;
  auto body = [&](int t) {
    const int r = first_ + t;
    std::vector<float> gathered;
    // In name order (a std::map): every replica walks the variables in the same order.
    for (const auto& [name, v] : states_[t]) {
      if (step_.FindVariable(name) == ir::kNoValue) continue;  // a weight's bf16 copy: not state
      if (v.dtype() != ir::DType::kF32) {  // s32 variables (the step counter) are never sharded
        if (t == 0)
          for (auto& s : replicas) s[name] = v;
        continue;
      }
      const int64_t e = v.elements();
      gathered.resize(static_cast<size_t>(e) * n_);
      c_.AllGather(r, all, v.f32.data(), gathered.data(), e);
      if (t != 0) continue;  // every local replica receives the same; one assembles
      for (int q = 0; q < n_; ++q) {
        Tensor piece(v.type);
        std::memcpy(piece.f32.data(), gathered.data() + static_cast<size_t>(q) * e, e * sizeof(float));
        replicas[q][name] = std::move(piece);
      }
    }
  };
  if (pool_) pool_->Run(&c_, body);
  else body(0);
  logical_ = std::make_unique<TensorMap>(LogicalStateFrom(step_, replicas, 0));
  return *logical_;
}

void MpiExecutor::LoadLogicalState(const TensorMap& state) {
  logical_.reset();
  for (int t = 0; t < per_rank_; ++t) {
    states_[t] = ReplicaState(step_, state, first_ + t);
    compiled_->MakeBf16WeightCopies(states_[t]);  // (jit::CompiledStep::bf16_weight_copies)
    compiled_->BindVariables(states_[t], &bindings_[t]);
  }
  copies_made_ = true;
}

TensorMap MpiExecutor::Forward(const ir::Module& forward, const TensorMap& inputs) {
  auto& compiled = forwards_[ir::Print(forward)];
  if (!compiled) compiled = jit::CompiledStep::Compile(forward);
  TensorMap state = LogicalState();  // collective: every rank evaluates the same batches
  jit::ConfigureThreadsForReplica(1);
  return compiled->Run(state, inputs, 0, nullptr, forward_ws_.get());
}

uint64_t StepModuleHash(const ir::Module& step) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : ir::Print(step)) h = (h ^ ch) * 1099511628211ull;
  return h;
}

void CheckSameStepModule(uint64_t hash, const char* what) {
  int ranks = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  std::vector<unsigned long long> all(ranks);
  unsigned long long mine = hash;
  MPI_Allgather(&mine, 1, MPI_UNSIGNED_LONG_LONG, all.data(), 1, MPI_UNSIGNED_LONG_LONG, MPI_COMM_WORLD);
  for (int r = 1; r < ranks; ++r)
    if (all[r] != all[0])
      throw Error(Str(what, " differs across ranks (hash ", all[0], " on rank 0, ", all[r], " on rank ", r,
                      "): every rank must run the same shardstep build with the same flags"));
}

}  // namespace shardstep::runtime
