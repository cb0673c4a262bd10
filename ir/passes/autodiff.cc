// Autodiff: reverse-mode differentiation of the scalar loss with respect to every weight variable.
//
// Algorithm:
//  1. Check the loss: an output of that name, a scalar f32.
//  2. Mark the active instructions: f32 values that depend on a weight (forward sweep) and that the
//     loss depends on (backward sweep). Only these are differentiated, so the forward pass's other
//     branches (metrics, integer label work, the optimizer state) cost nothing.
//  3. Seed d loss = 1 and walk the active instructions in reverse order, asking gradients.cc for each
//     one's operand cotangents and summing the contributions per value with `add`.
//  4. Record (weight, cotangent) in module.gradients, a zero constant for weights the loss ignores,
//     and canonicalize (drops what the backward pass did not use, renumbers).
// Why reverse instruction order: instructions are in SSA order, so every user of a value is visited
// before the value itself and its cotangent is complete when we reach it.
#include "ir/passes/autodiff.h"

#include "ir/builder.h"
#include "ir/error.h"
#include "ir/passes/gradients.h"

namespace shardstep::ir {

bool Autodiff::Run(Module& module) {
  // 1. The loss.
  ValueId loss = module.FindOutput(loss_);
  if (loss == kNoValue) throw Error(Str("autodiff: module '", module.name, "' has no output named '", loss_, "'"));
  const TensorType& lt = module.type(loss);
  if (lt.dtype != DType::kF32 || lt.rank() != 0)
    throw Error(Str("autodiff: loss output '", loss_, "' must be a scalar f32, got ", lt.ToString()));

  std::vector<ValueId> weights = module.VariablesWithRole(kRoleWeight);
  if (weights.empty()) return false;
  for (ValueId w : weights)
    if (module.GradientOf(w) != kNoValue)
      throw Error(Str("autodiff: weight @", module.at(w).name, " already has a gradient (autodiff ran twice?)"));

  // The sweeps below rely on SSA order (operands before users); restore it if a pass left it broken.
  bool ordered = true;
  for (ValueId v = 0; v < module.size() && ordered; ++v)
    for (ValueId o : module.at(v).operands) ordered = ordered && o < v;
  if (!ordered) {
    module.Canonicalize();
    loss = module.FindOutput(loss_);
    weights = module.VariablesWithRole(kRoleWeight);
  }

  // 2. Active instructions.
  const int n = module.size();
  std::vector<char> from_weight(n, 0), to_loss(n, 0);
  for (ValueId w : weights) from_weight[w] = module.type(w).dtype == DType::kF32;
  for (ValueId v = 0; v < n; ++v) {
    const Instr& in = module.at(v);
    if (in.type.dtype != DType::kF32) continue;
    for (ValueId o : in.operands) from_weight[v] = from_weight[v] || from_weight[o];
  }
  to_loss[loss] = 1;
  for (ValueId v = loss; v >= 0; --v)
    if (to_loss[v])
      for (ValueId o : module.at(v).operands) to_loss[o] = 1;
  std::vector<char> active(n, 0);
  for (ValueId v = 0; v < n; ++v) {
    active[v] = from_weight[v] && to_loss[v];
    // all_reduce may appear in the forward pass (cross-replica statistics) and has a rule; the
    // other collectives are inserted after autodiff.
    if (active[v] && HasProperty(module.at(v).op, kCollective) && module.at(v).op != OpCode::kAllReduce)
      throw Error(Str("autodiff: ", OpName(module.at(v).op), " (%", v, ") lies between a weight and loss '", loss_,
                      "'; it is inserted after autodiff and has no gradient rule"));
  }

  // 3. Reverse sweep.
  Builder b(&module);
  std::vector<ValueId> grad(n, kNoValue);
  grad[loss] = b.Scalar(1.0);
  for (ValueId v = loss; v >= 0; --v) {
    if (!active[v] || grad[v] == kNoValue || HasProperty(module.at(v).op, kLeaf)) continue;
    std::vector<ValueId> contrib = GradientRule(b, v, grad[v]);
    const std::vector<ValueId> operands = module.at(v).operands;  // a copy: the rule appended
    SS_CHECK(contrib.size() == operands.size(), OpName(module.at(v).op), " rule returned ", contrib.size(),
             " cotangents for ", operands.size(), " operands");
    for (size_t i = 0; i < operands.size(); ++i) {
      const ValueId u = operands[i], c = contrib[i];
      if (c == kNoValue || !active[u]) continue;
      SS_CHECK(module.type(c) == module.type(u), OpName(module.at(v).op), " rule: cotangent ",
               module.type(c).ToString(), " for operand ", i, " of type ", module.type(u).ToString());
      grad[u] = grad[u] == kNoValue ? c : b.Add(grad[u], c);
    }
  }

  // 4. Record and clean up.
  for (ValueId w : weights) {
    ValueId g = grad[w];
    if (g == kNoValue) g = b.Constant(0.0, module.type(w));
    // A weight read only by a forward all_reduce gets all_reduce(dz) as its gradient, which
    // DataParallelLowering would take for an already-lowered gradient and skip (wrong when the
    // forward groups are not its groups). A bitwise copy (convert f32 -> f32) keeps it per-replica.
    if (module.at(g).op == OpCode::kAllReduce)
      g = b.Emit(OpCode::kConvert, {g}, {{"dtype", std::string(DTypeName(module.type(g).dtype))}});
    module.gradients.push_back({w, g});
  }
  module.Canonicalize();
  return true;
}

}  // namespace shardstep::ir
