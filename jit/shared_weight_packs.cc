// One packed copy of a shared weight a step, made by the replicas together (see the header).
#include "jit/shared_weight_packs.h"

#include <algorithm>

#include "jit/compiled_step.h"
#include "jit/small_gemm.h"

namespace shardstep::jit {

using ir::OpCode;
using ir::ValueId;

namespace {
// The variable whose storage v is (through reshapes), or -1.
ValueId VariableBehind(const ir::Module& m, ValueId v) {
  while (LoweringOf(m, v) == Lowering::kAlias) v = m.at(v).operands[0];
  return m.at(v).op == OpCode::kVariable ? v : -1;
}
}  // namespace

SharedWeightPacks::SharedWeightPacks(const CompiledStep& step, const std::vector<int>& shared_slots) {
  const ir::Module& m = step.module();
  entry_of_.assign(m.size(), -1);
  if (!SmallGemmRuns()) return;
  std::vector<std::string> shared;
  for (int slot : shared_slots) shared.push_back(step.variable_names()[slot]);
  for (ValueId v = 0; v < m.size(); ++v) {
    const ir::Instr& in = m.at(v);
    if (in.op != OpCode::kMatmul || LoweringOf(m, v) != Lowering::kMatmul || in.GetInt("transpose_a", 0) != 0 ||
        in.GetInt("transpose_b", 0) != 0 || in.type.shape.size() != 2)
      continue;
    const ir::Shape& a = m.type(in.operands[0]).shape;
    const ir::Shape& b = m.type(in.operands[1]).shape;
    if (a.size() != 2 || b.size() != 2) continue;
    const int64_t rows = a[0], k = a[1], n = b[1];
    if (!SmallGemmApplies(false, false, rows, n, k)) continue;
    const ValueId var = VariableBehind(m, in.operands[1]);
    if (var < 0 || std::find(shared.begin(), shared.end(), m.at(var).name) == shared.end()) continue;
    entry_of_[v] = static_cast<int>(entries_.size());
    entries_.push_back(std::make_unique<SharedPackedB>(n, k));
  }
}

SharedWeightPacks::~SharedWeightPacks() = default;

int64_t SharedWeightPacks::bytes() const {
  int64_t total = 0;
  for (const auto& e : entries_) total += e->bytes();
  return total;
}

bool SharedWeightPacks::Multiply(ValueId v, uint64_t run, int64_t m, int64_t n, int64_t k, const float* a,
                                 int64_t lda, const float* b, int64_t ldb, float* c) {
  if (v < 0 || v >= static_cast<ValueId>(entry_of_.size()) || entry_of_[v] < 0) return false;
  SharedPackedB& e = *entries_[entry_of_[v]];
  if (n != e.n() || k != e.k() || ldb != n) return false;
  return e.Multiply(run, m, a, lda, b, c);
}

SharedPackedB::SharedPackedB(int64_t n, int64_t k)
    : n_(n),
      k_(k),
      // 64 columns a chunk (16 chunks for n = 1024; 256 KiB each at k = 1024), whole panels.
      chunk_columns_(std::max<int64_t>(SmallGemmPanelColumns(), 64 / SmallGemmPanelColumns() * SmallGemmPanelColumns())),
      chunks_(static_cast<int>((n + chunk_columns_ - 1) / chunk_columns_)),
      packed_(PackedBFloats(n, k), 0.0f) {}

bool SharedPackedB::Multiply(uint64_t run, int64_t m, const float* a, int64_t lda, const float* b, float* c) {
  {
    std::lock_guard lk(mu_);
    if (run < run_) return false;  // behind the others: its B may not be the one packed
    if (run > run_) {              // the first thread in this run: nothing is taken yet
      run_ = run;
      source_ = b;
      next_.store(0, std::memory_order_relaxed);
      done_.store(0, std::memory_order_relaxed);
    } else if (source_ != b) {
      return false;
    }
  }
  for (int chunk = next_.fetch_add(1, std::memory_order_relaxed); chunk < chunks_;
       chunk = next_.fetch_add(1, std::memory_order_relaxed)) {
    const int64_t j0 = chunk * chunk_columns_, j1 = std::min(n_, j0 + chunk_columns_);
    PackB(n_, k_, b, n_, j0, j1, packed_.data());
    if (done_.fetch_add(1, std::memory_order_release) + 1 == chunks_) done_.notify_all();
  }
  for (int d = done_.load(std::memory_order_acquire); d < chunks_; d = done_.load(std::memory_order_acquire))
    done_.wait(d, std::memory_order_acquire);
  ParallelSmallGemmPackedB(m, n_, k_, a, lda, packed_.data(), c);
  return true;
}

}  // namespace shardstep::jit
