// FLOP, parameter and activation-memory counting.
#include "ir/cost.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "ir/error.h"

namespace shardstep::ir {

int64_t InstrFlops(const Module& m, ValueId v) {
  const Instr& in = m.at(v);
  const int64_t out = in.type.elements();
  auto operand = [&](size_t i) -> const TensorType& { return m.type(in.operands.at(i)); };
  switch (in.op) {
    case OpCode::kMatmul: {
      const Shape& a = operand(0).shape;
      const size_t r = a.size();
      const int64_t k = in.GetInt("transpose_a", 0) ? a[r - 2] : a[r - 1];
      return 2 * out * k;
    }
    case OpCode::kConv2d: {
      const Shape& w = operand(1).shape;  // OIHW
      return 2 * out * w[1] * w[2] * w[3];
    }
    case OpCode::kConv2dInputGrad: {  // (dy, w)
      const Shape& w = operand(1).shape;
      return 2 * operand(0).elements() * w[1] * w[2] * w[3];
    }
    case OpCode::kConv2dFilterGrad: {  // (x, dy) -> w
      const Shape& w = in.type.shape;
      return 2 * operand(1).elements() * w[1] * w[2] * w[3];
    }
    case OpCode::kMaxPool:
    case OpCode::kAvgPool:
    case OpCode::kMaxPoolGrad:
    case OpCode::kAvgPoolGrad: {
      int64_t window = 1;  // {window=k} or {window=[kh, kw]}
      auto attr = in.attrs.find("window");
      if (attr != in.attrs.end()) {
        if (const int64_t* k = std::get_if<int64_t>(&attr->second)) window = *k * *k;
        if (const IntList* k = std::get_if<IntList>(&attr->second)) window = k->size() == 2 ? (*k)[0] * (*k)[1] : (*k)[0] * (*k)[0];
      }
      const int64_t dy = in.op == OpCode::kMaxPoolGrad   ? operand(1).elements()
                         : in.op == OpCode::kAvgPoolGrad ? operand(0).elements()
                                                         : out;
      return window * dy;
    }
    case OpCode::kAttention:
    case OpCode::kAttentionGrad: {  // per T x T block: 2 products forward; 5 backward (scores recomputed)
      const Shape& q = operand(0).shape;
      const int64_t t = q[q.size() - 2], heads = operand(0).elements() / std::max<int64_t>(1, t * q.back());
      const int64_t product = 2 * heads * t * t * q.back();
      return (in.op == OpCode::kAttention ? 2 : 5) * product + (in.op == OpCode::kAttention ? 4 : 6) * heads * t * t;
    }
    case OpCode::kScatterAdd:
      return operand(1).elements();
    default:
      break;
  }
  if (HasProperty(in.op, kElementwise)) return out;
  if (HasProperty(in.op, kReduction)) return operand(0).elements();
  return 0;
}

FlopCount CountFlops(const Module& m, const std::vector<char>* mask) {
  FlopCount c;
  for (ValueId v = 0; v < m.size(); ++v) {
    if (mask && !(*mask)[v]) continue;
    const int64_t f = InstrFlops(m, v);
    if (f == 0) continue;
    c.total += f;
    c.by_op[OpName(m.at(v).op)] += f;
  }
  return c;
}

std::vector<char> AncestorsOf(const Module& m, ValueId v) {
  std::vector<char> mark(m.size(), 0);
  std::vector<ValueId> stack{v};
  mark[v] = 1;
  while (!stack.empty()) {
    const ValueId u = stack.back();
    stack.pop_back();
    for (ValueId o : m.at(u).operands)
      if (!mark[o]) mark[o] = 1, stack.push_back(o);
  }
  return mark;
}

int64_t CountParameters(const Module& m) {
  int64_t n = 0;
  for (ValueId v : m.VariablesWithRole(kRoleWeight)) n += m.type(v).elements();
  return n;
}

CostReport ComputeCost(const Module& grad, const Module& step, int64_t examples) {
  CostReport r;
  r.parameters = CountParameters(grad);
  r.examples = examples;
  const ValueId loss = grad.FindOutput("loss");
  if (loss == kNoValue) throw Error("cost: the module has no \"loss\" output");
  const std::vector<char> forward = AncestorsOf(grad, loss);
  r.forward = CountFlops(grad, &forward);
  r.step = CountFlops(step);
  std::vector<char> kept(grad.size(), 0);
  for (ValueId v = 0; v < grad.size(); ++v) {
    if (forward[v]) continue;  // a backward instruction: what forward values does it read?
    for (ValueId o : grad.at(v).operands)
      if (forward[o] && !HasProperty(grad.at(o).op, kLeaf)) kept[o] = 1;
  }
  for (ValueId v = 0; v < grad.size(); ++v)
    if (kept[v]) r.activation_bytes += grad.type(v).bytes(), ++r.activation_values;
  return r;
}

namespace {
std::string Flops(double f) {
  const char* units[] = {"", "K", "M", "G", "T", "P"};
  int u = 0;
  while (f >= 1000 && u < 5) f /= 1000, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.3g %sFLOP" : "%.0f %sFLOP", f, units[u]);
  return buf;
}
std::string MiB(int64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f MiB", b / 1048576.0);
  return buf;
}
}  // namespace

std::string CostReport::ToString() const {
  std::ostringstream os;
  const double n = examples > 0 ? static_cast<double>(examples) : 1;
  os << "parameters: " << parameters << "\n";
  os << "FLOPs per example: forward " << Flops(forward.total / n) << " (" << forward.total / n << "), training step "
     << Flops(step.total / n) << " (" << step.total / n << "; forward + backward + optimizer, per replica / "
     << examples << " examples)\n";
  os << "  forward by op:";
  for (const auto& [op, f] : forward.by_op) os << " " << op << " " << Flops(f / n);
  os << "\n  step by op:";
  for (const auto& [op, f] : step.by_op) os << " " << op << " " << Flops(f / n);
  os << "\nactivation memory per replica: " << MiB(activation_bytes) << " (" << activation_bytes << " bytes in "
     << activation_values << " forward values the backward reads, at " << examples
     << " examples per replica; the JIT's buffer plan may overlap them with other temporaries)\n";
  return os.str();
}

}  // namespace shardstep::ir
