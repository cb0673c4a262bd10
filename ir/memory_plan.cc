// Memory accounting.
#include "ir/memory_plan.h"

#include <sstream>
#include <vector>

namespace shardstep::ir {

MemoryPlan PlanMemory(const Module& m) {
  MemoryPlan p;
  const int n = m.size();
  const std::vector<char> per = m.PerReplicaValues();
  for (ValueId v = 0; v < n; ++v) {
    const Instr& in = m.at(v);
    if (in.op == OpCode::kVariable) {
      const std::string role = in.GetString("role", "");
      (role == kRoleWeight ? p.weight_bytes : p.optimizer_state_bytes) += in.type.bytes();
    }
    if ((in.op == OpCode::kAllReduce || in.op == OpCode::kReduceScatter) && !in.operands.empty() &&
        per[in.operands[0]] && !in.type.shape.empty())
      p.gradient_bytes += m.type(in.operands[0]).bytes();
  }
  if (p.gradient_bytes == 0)  // one replica: the gradients recorded by autodiff, or all weights' worth
    for (auto& [var, g] : m.gradients) p.gradient_bytes += m.type(g).bytes();
  // Last use of every value; assigned values and outputs live to the end.
  std::vector<int> last(n, -1);
  for (ValueId v = 0; v < n; ++v)
    for (ValueId o : m.at(v).operands) last[o] = v;
  for (auto& [var, v] : m.assigns) last[v] = n;
  for (auto& [name, v] : m.outputs) last[v] = n;
  std::vector<int64_t> frees(n + 1, 0);
  int64_t live = 0;
  for (ValueId v = 0; v < n; ++v) {
    const Instr& in = m.at(v);
    if (in.op != OpCode::kVariable && in.op != OpCode::kInput && last[v] >= 0) {
      live += in.type.bytes();
      frees[last[v]] += in.type.bytes();
    }
    p.peak_temp_bytes = std::max(p.peak_temp_bytes, live);
    live -= frees[v];
  }
  return p;
}

std::string MemoryPlan::ToString() const {
  std::ostringstream os;
  auto mib = [](int64_t b) { return b / 1048576.0; };
  os.setf(std::ios::fixed);
  os.precision(3);
  os << "memory per replica: weights " << mib(weight_bytes) << " MiB, optimizer state " << mib(optimizer_state_bytes)
     << " MiB, gradients " << mib(gradient_bytes) << " MiB, peak temporaries " << mib(peak_temp_bytes) << " MiB\n";
  return os.str();
}

}  // namespace shardstep::ir
