// NonfiniteGuard (see the header for the algorithm).
#include "ir/passes/nonfinite_guard.h"

#include <map>

#include "ir/builder.h"
#include "ir/error.h"

namespace shardstep::ir {

bool NonfiniteGuard::Run(Module& m) {
  if (m.FindOutput(kStepFiniteOutput) != kNoValue) return false;  // already guarded
  if (m.assigns.empty()) return false;                               // nothing to guard
  if (m.gradients.empty()) throw Error("nonfinite-guard: the module has no gradients (run autodiff first)");
  const ValueId loss = m.FindOutput("loss");  // checked when it is an f32 scalar
  const bool check_loss = loss != kNoValue && m.type(loss).shape.empty() && m.type(loss).dtype == DType::kF32;
  Builder b(&m);

  // 1. Per-gradient checks.
  ValueId total = kNoValue;
  std::vector<std::pair<std::string, ValueId>> checks;
  for (auto [w, g] : m.gradients) {
    const std::string wname = m.at(w).name;  // a copy: the builder appends to m.instrs
    if (m.type(g).dtype != DType::kF32) continue;
    ValueId c = m.type(g).shape.empty() ? g : b.SumAll(g);
    checks.push_back({kGradCheckOutputPrefix + wname, c});
    ValueId z = b.Sub(c, c);
    total = total == kNoValue ? z : b.Add(total, z);
  }
  // 2. The loss, agreed on by every replica.
  if (check_loss) {
    ValueId l = b.Sub(loss, loss);
    if (m.num_replicas > 1) l = b.Emit(OpCode::kAllReduce, {l}, {{"reduction", std::string("sum")}});
    total = total == kNoValue ? l : b.Add(l, total);
  }
  if (total == kNoValue) return false;  // no f32 gradient and no loss: nothing to check
  // 3. The flag.
  const ValueId ok = b.Binary(OpCode::kEq, total, b.Scalar(0.0));
  // 4. Guarded assignments.
  std::map<Shape, ValueId> conds;  // one broadcast of the flag per shape
  conds[Shape{}] = ok;
  for (auto& [var, val] : m.assigns) {
    const Shape shape = m.type(var).shape;
    auto it = conds.find(shape);
    if (it == conds.end()) it = conds.emplace(shape, b.BroadcastScalar(ok, shape)).first;
    val = b.Select(it->second, val, var);
  }
  for (auto& [name, c] : checks) m.outputs.push_back({name, c});
  m.outputs.push_back({kStepFiniteOutput, ok});
  m.Canonicalize();
  return true;
}

}  // namespace shardstep::ir
