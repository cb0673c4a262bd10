// The JIT's module rewrites before planning (see step_rewrites.h).
#include "jit/step_rewrites.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <tuple>
#include <vector>

#include "ir/passes/elementwise_fuser.h"

namespace shardstep::jit {

using ir::DType;
using ir::OpCode;
using ir::ValueId;

// (jit/dnnl_kernels.h ParallelBf16Matmul runs it.)
bool Bf16Operands(const ir::Module& m, const ir::Instr& in) {
  if (in.op != OpCode::kMatmul || in.type.dtype != DType::kF32) return false;
  for (ValueId o : in.operands) {
    const ir::Instr& x = m.at(o);
    if (x.op != OpCode::kConvert || x.type.dtype != DType::kF32 || m.type(x.operands[0]).dtype != DType::kBF16)
      return false;
  }
  return true;
}

// The JIT's own form of such a matmul: its operands are the bf16 values themselves (2 bytes an element,
// read in place by oneDNN), marked kBf16OperandsAttr, and the widening converts lose these readers (a
// convert left with none is dropped; before, its loop still ran: 8 passes over [4096,512] per
// transformer_lm step). Only CompiledStep sees this form: the
// IR's matmul takes operands of its result's dtype.
// An attention op with bf16=1 whose operands are all such roundings (its products take bf16 operands).
bool Bf16AttentionOperands(const ir::Module& m, const ir::Instr& in) {
  if ((in.op != OpCode::kAttention && in.op != OpCode::kAttentionGrad) || in.GetInt("bf16", 0) == 0 ||
      in.type.dtype != DType::kF32)
    return false;
  for (ValueId o : in.operands) {
    const ir::Instr& x = m.at(o);
    if (x.op != OpCode::kConvert || x.type.dtype != DType::kF32 || m.type(x.operands[0]).dtype != DType::kBF16)
      return false;
  }
  return true;
}

void ReadBf16OperandsInPlace(ir::Module& m) {
  bool changed = false;
  for (ValueId v = 0; v < m.size(); ++v) {
    ir::Instr& in = m.at(v);
    if (!Bf16Operands(m, in) && !Bf16AttentionOperands(m, in)) continue;
    for (ValueId& o : in.operands) o = m.at(o).operands[0];
    in.attrs[kBf16OperandsAttr] = int64_t{1};
    changed = true;
  }
  // A widening convert read by nothing else is dropped: the step would still run its loop.
  if (changed) m.Canonicalize();
}
std::vector<std::pair<std::string, std::string>> Bf16WeightCopies(ir::Module& m) {
  std::map<std::string, ValueId> assigned;  // variable name -> its new value
  for (const auto& [var, v] : m.assigns) assigned[m.at(var).name] = v;
  std::map<std::string, ValueId> copy_of;  // weight name -> its copy's variable
  std::vector<std::pair<std::string, std::string>> copies;
  const int n = m.size();
  std::vector<ValueId> place(n);  // the copy where the weight's rounding was, its next value after u
  for (ValueId v = 0; v < n; ++v) place[v] = v;
  for (ValueId c = 0; c < n; ++c) {
    const ir::Instr round = m.at(c);  // copies: Append may move the instructions
    if (round.op != OpCode::kConvert || round.type.dtype != DType::kBF16) continue;
    const ir::Instr w = m.at(round.operands[0]);
    if (w.op != OpCode::kVariable || w.type.dtype != DType::kF32) continue;
    auto a = assigned.find(w.name);
    if (a == assigned.end()) continue;
    const ValueId u = a->second;
    if (!ir::HasProperty(m.at(u).op, ir::kElementwise) || m.type(u) != w.type) continue;
    auto it = copy_of.find(w.name);
    if (it == copy_of.end()) {
      const std::string name = w.name + kBf16CopySuffix;
      if (m.FindVariable(name) != ir::kNoValue) continue;  // taken (never by a model's own names)
      ir::Instr var;
      var.op = OpCode::kVariable;
      var.name = name;
      var.type = round.type;
      var.attrs["role"] = std::string("bf16_copy");
      const ValueId copy = m.Append(var);
      place.push_back(c);
      ir::Instr next = round;  // the next step's copy, from the update
      next.operands = {u};
      next.attrs.erase(ir::kFusionAttr);
      m.assigns.emplace_back(copy, m.Append(next));
      place.push_back(u);
      copies.emplace_back(name, w.name);
      it = copy_of.emplace(w.name, copy).first;
    }
    m.ReplaceAllUses(c, it->second);
  }
  if (!copies.empty()) m.Canonicalize(place);  // the old roundings are dead
  return copies;
}

// The mixed-precision pass rounds a matmul operand after the reshape that gives it the matmul's shape,
// convert(reshape(x), bf16). Rounding is elementwise and a reshape keeps the element order, so the JIT
// rounds first, reshape(convert(x, bf16)): the rounding then joins the loop that computes x (one pass
// writes both) instead of a loop of its own reading x back (the transformer's activations: 57 passes
// over [4096,128] per step). The same bits. One rounding per x: the reshapes of one value (the
// transformer's layer-norm output, reshaped for each of Q, K and V) share it, where three converts
// wrote three copies.
void RoundBeforeReshapes(ir::Module& m) {
  bool changed = false;
  std::map<ValueId, ValueId> round_of;  // x -> convert(x, bf16)
  const int n = m.size();
  for (ValueId c = 0; c < n; ++c) {
    const ir::Instr in = m.at(c);  // copies: Append may move the instructions
    if (in.op != OpCode::kConvert || in.type.dtype != DType::kBF16 || m.at(in.operands[0]).op != OpCode::kReshape) continue;
    ir::Instr reshape = m.at(in.operands[0]);
    const ValueId x = reshape.operands[0];
    if (m.type(x).dtype != DType::kF32) continue;
    auto it = round_of.find(x);
    if (it == round_of.end()) {
      ir::Instr round = in;
      round.operands = {x};
      round.type = ir::TensorType{DType::kBF16, m.type(x).shape};
      round.attrs.erase(ir::kFusionAttr);
      it = round_of.emplace(x, m.Append(round)).first;
    }
    reshape.operands = {it->second};
    reshape.type = in.type;
    reshape.attrs.erase(ir::kFusionAttr);
    m.ReplaceAllUses(c, m.Append(reshape));
    changed = true;
  }
  if (changed) m.Canonicalize();
}

namespace {
// The data movements `chain` (each reading the next one; the last reads the value v stands in for)
// appended again on top of v with bf16 elements, innermost first; returns the outermost copy.
ValueId AppendInBf16(ir::Module& m, ValueId v, const std::vector<ValueId>& chain) {
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
    ir::Instr link = m.at(*it);  // copies: Append may move the instructions
    link.operands = {v};
    link.type.dtype = DType::kBF16;
    link.attrs.erase(ir::kFusionAttr);
    v = m.Append(link);
  }
  return v;
}
}  // namespace

void RoundInProducers(ir::Module& m) {
  const auto users = m.Users();
  std::vector<char> kept(m.size(), 0);  // returned or assigned: stays in memory in f32
  for (const auto& [name, v] : m.outputs) kept[v] = 1;
  for (const auto& [var, v] : m.assigns) kept[v] = 1;
  auto only_reader = [&](ValueId x) { return users[x].size() == 1 && !kept[x]; };
  bool changed = false;
  const int n = m.size();
  for (ValueId c = 0; c < n; ++c) {
    if (m.at(c).op != OpCode::kConvert || m.at(c).type.dtype != DType::kBF16) continue;
    std::vector<ValueId> chain;  // the reshapes and the transpose, from the convert's operand down to x
    ValueId x = m.at(c).operands[0];
    while (m.at(x).op == OpCode::kReshape && only_reader(x)) chain.push_back(x), x = m.at(x).operands[0];
    if (m.at(x).op != OpCode::kTranspose || m.at(x).type.dtype != DType::kF32 || !only_reader(x)) continue;
    chain.push_back(x);
    x = m.at(x).operands[0];
    while (m.at(x).op == OpCode::kReshape && only_reader(x)) chain.push_back(x), x = m.at(x).operands[0];
    const ir::Instr& producer = m.at(x);
    if (producer.type.dtype != DType::kF32 || !only_reader(x) || producer.op == OpCode::kBroadcast ||
        producer.op == OpCode::kConvert || !ir::HasProperty(producer.op, ir::kElementwise) || !ir::IsFusible(m, x))
      continue;
    ir::Instr round = m.at(c);  // copies: Append may move the instructions
    round.operands = {x};
    round.type = ir::TensorType{DType::kBF16, producer.type.shape};
    round.attrs.erase(ir::kFusionAttr);
    m.ReplaceAllUses(c, AppendInBf16(m, m.Append(round), chain));
    changed = true;
  }
  if (changed) m.Canonicalize();
}

void RoundInTransposes(ir::Module& m) {
  const auto users = m.Users();
  auto only_reader = [&](ValueId x) { return users[x].size() == 1; };
  bool changed = false;
  const int n = m.size();
  for (ValueId c = 0; c < n; ++c) {
    if (m.at(c).op != OpCode::kConvert || m.at(c).type.dtype != DType::kBF16) continue;
    std::vector<ValueId> reshapes;  // from the convert's operand down to the transpose
    ValueId x = m.at(c).operands[0];
    while (m.at(x).op == OpCode::kReshape && only_reader(x)) {
      reshapes.push_back(x);
      x = m.at(x).operands[0];
    }
    if (m.at(x).op != OpCode::kTranspose || m.at(x).type.dtype != DType::kF32 || !only_reader(x)) continue;
    ir::Instr t = m.at(x);  // copies: Append may move the instructions
    t.type.dtype = DType::kBF16;
    t.attrs.erase(ir::kFusionAttr);
    t.attrs[kRoundsAttr] = int64_t{1};
    m.ReplaceAllUses(c, AppendInBf16(m, m.Append(t), reshapes));
    changed = true;
  }
  if (changed) m.Canonicalize();
}

namespace {
// Whether x is a transpose between [B, T, H, D] and [B, H, T, D].
bool IsHeadsTranspose(const ir::Module& m, ValueId x) {
  const ir::Instr& t = m.at(x);
  return t.op == OpCode::kTranspose && t.type.rank() == 4 && t.GetInts("perm") == ir::IntList{0, 2, 1, 3};
}
}  // namespace

void AttentionHeadsInPlace(ir::Module& m) {
  const auto users = m.Users();
  std::vector<char> kept(m.size(), 0);  // returned or assigned: its layout is the module's
  for (const auto& [name, v] : m.outputs) kept[v] = 1;
  for (const auto& [var, v] : m.assigns) kept[v] = 1;
  bool changed = false;
  for (ValueId v = 0; v < m.size(); ++v) {
    ir::Instr& in = m.at(v);  // (nothing is appended in this loop)
    // (An op computing in bf16 throughout runs on the reference interpreter, which takes no other layout.)
    if ((in.op != OpCode::kAttention && in.op != OpCode::kAttentionGrad) || in.type.dtype != DType::kF32) continue;
    const bool bf16 = in.GetInt("bf16", 0) != 0;
    bool operands = !in.operands.empty();
    for (ValueId o : in.operands) {
      operands = operands && IsHeadsTranspose(m, o) && m.type(m.at(o).operands[0]).shape == m.type(m.at(in.operands[0]).operands[0]).shape;
      // A rounding transpose only where the op rounds its operands itself; a bf16 one only where it reads them
      // as such.
      operands = operands && (m.type(o).dtype == DType::kF32 || bf16);
    }
    if (operands) {
      const int64_t heads = m.type(in.operands[0]).shape[1];
      for (ValueId& o : in.operands) o = m.at(o).operands[0];
      in.attrs[kHeadsInAttr] = heads;
      changed = true;
    }
    if (kept[v]) continue;
    if (in.op == OpCode::kAttention) {
      if (users[v].size() != 1 || !IsHeadsTranspose(m, users[v][0])) continue;
      const ValueId t = users[v][0];
      in.attrs[kHeadsOutAttr] = in.type.shape[1];
      in.type = m.type(t);  // [B, T, H, D]; bf16 for a rounding transpose
      m.ReplaceAllUses(t, v);
      changed = true;
      continue;
    }
    // attention_grad [3, B, H, T, D]: slice i -> reshape [B, H, T, D] -> transposes, for each part.
    const ir::Shape& full = in.type.shape;
    const ir::Shape heads_first(full.begin() + 1, full.end());
    const ir::Shape heads_inner{full[1], full[3], full[2], full[4]};
    bool results = !users[v].empty();
    for (ValueId s : users[v]) {
      const ir::Instr& slice = m.at(s);
      results = results && slice.op == OpCode::kSlice && !kept[s] && users[s].size() == 1;
      if (!results) break;
      const ir::IntList& start = slice.GetInts("start");
      const ir::IntList& limit = slice.GetInts("limit");
      for (size_t a = 1; a < full.size(); ++a) results = results && start[a] == 0 && limit[a] == full[a];
      results = results && limit[0] == start[0] + 1;
      const ValueId r = users[s][0];
      results = results && m.at(r).op == OpCode::kReshape && m.type(r).shape == heads_first && !kept[r] &&
                !users[r].empty();
      if (!results) break;
      for (ValueId t : users[r]) results = results && IsHeadsTranspose(m, t) && m.type(t).dtype == DType::kF32;
    }
    if (!results) continue;
    in.attrs[kHeadsOutAttr] = full[2];
    in.type.shape = {full[0], heads_inner[0], heads_inner[1], heads_inner[2], heads_inner[3]};
    for (ValueId s : users[v]) {
      ir::Instr& slice = m.at(s);
      slice.type.shape = {1, heads_inner[0], heads_inner[1], heads_inner[2], heads_inner[3]};
      ir::IntList limit = slice.GetInts("limit");
      for (size_t a = 1; a < limit.size(); ++a) limit[a] = in.type.shape[a];
      slice.attrs["limit"] = limit;
      const ValueId r = users[s][0];
      m.at(r).type.shape = heads_inner;
      m.at(r).attrs["shape"] = ir::IntList(heads_inner.begin(), heads_inner.end());
      for (ValueId t : users[r]) m.ReplaceAllUses(t, r);
    }
    changed = true;
  }
  if (changed) m.Canonicalize();
}

// relu's gradient after max pooling's, select(x > 0, max_pool_grad(x, dy), 0) with x the pooled relu
// output, is one pass of the pooling gradient with the mask (cpu_kernels.h MaxPoolGrad): the gradient is
// not written and read back. The JIT's own form, marked kReluMaskAttr; the same bits.
namespace {
bool IsZeroSplat(const ir::Module& m, ValueId v) {
  const ir::Instr& in = m.at(v);
  if (in.op != OpCode::kConstant || in.type.dtype != DType::kF32 || !in.Has("value")) return false;
  return in.GetFloat("value") == 0.0 && !std::signbit(in.GetFloat("value"));
}
}  // namespace

void MaskMaxPoolGradsByRelu(ir::Module& m) {
  const auto users = m.Users();
  bool changed = false;
  for (ValueId s = 0; s < m.size(); ++s) {
    const ir::Instr& sel = m.at(s);
    if (sel.op != OpCode::kSelect || !IsZeroSplat(m, sel.operands[2])) continue;
    const ir::Instr& mask = m.at(sel.operands[0]);
    const ValueId g = sel.operands[1];
    const ir::Instr& grad = m.at(g);
    if (mask.op != OpCode::kGt || !IsZeroSplat(m, mask.operands[1]) || grad.op != OpCode::kMaxPoolGrad ||
        grad.operands[0] != mask.operands[0] || users[g].size() != 1 || grad.Has(kReluMaskAttr))
      continue;
    m.at(g).attrs[kReluMaskAttr] = int64_t{1};
    m.ReplaceAllUses(s, g);
    changed = true;
  }
  if (changed) m.Canonicalize();
}
// Values recomputed in their later readers' loops instead of written by one loop and read back by
// another. Batch norm's x - mean (x: a convolution's output) is read by the forward loops and by the
// backward's; GELU's x + b, x^2, 1 + tanh(...), 0.5 x and 1 - tanh^2 were written by the forward loop
// and read back by the backward's (five [4096,512] tensors per transformer layer). A value qualifies
// when a loop can compute it again from at most one value in memory anyway (a leaf's or a non-fusible
// op's result, or a value some non-fusible op reads), small broadcasts (at most 1/64 of its size) and
// splat constants: an f32 elementwise op of at least kMinRecomputedElements elements, read by no
// non-fusible op, whose operands are those or qualify themselves, kMaxRecomputedOps ops at most in
// all. Each of its elementwise readers of its shape after the first gets its own copy of the chain
// (with its broadcasts), which the fuser puts in the reader's loop. The same ops on the same values:
// the same bits.
namespace {
constexpr int kMaxRecomputedOps = 16;
constexpr int64_t kMinRecomputedElements = 1024;

class Recomputation {
 public:
  explicit Recomputation(const ir::Module& m) : m_(m), users_(m.Users()), cost_(m.size(), kUnknown), in_memory_(m.size(), 0) {
    for (const auto& [name, v] : m.outputs) in_memory_[v] = 1;
    for (const auto& [var, v] : m.assigns) in_memory_[v] = 1;
    for (ValueId u = 0; u < m.size(); ++u) {
      const ir::Instr& in = m.at(u);
      const bool fusible = ir::IsFusible(m, u);
      if (!fusible) in_memory_[u] = 1;
      if (fusible || in.op == OpCode::kReduceSum || in.op == OpCode::kReduceMean) continue;  // sums may fuse
      for (ValueId o : in.operands) in_memory_[o] = 1;
    }
  }
  const std::vector<std::vector<ValueId>>& users() const { return users_; }

  // Ops a loop spends computing v again, or -1 when it cannot (or need not: v is in memory anyway).
  int Cost(ValueId v) {
    if (cost_[v] != kUnknown) return cost_[v];
    cost_[v] = -1;
    const ir::Instr& in = m_.at(v);
    if (in_memory_[v] || in.type.dtype != DType::kF32 || in.op == OpCode::kConstant || in.op == OpCode::kBroadcast) return -1;
    if (in.type.elements() < kMinRecomputedElements) return -1;  // small: its loop would be split for nothing
    int cost = 1;
    std::vector<ValueId>& leaves = leaves_[v];
    for (ValueId o : in.operands) {
      const ir::Instr& x = m_.at(o);
      if (x.op == OpCode::kBroadcast) {
        if (m_.type(x.operands[0]).elements() * 64 > in.type.elements()) return -1;  // not small
        ++cost;
      } else if (x.op == OpCode::kConstant) {
        continue;
      } else if (in_memory_[o]) {
        leaves.push_back(o);
      } else {
        const int c = Cost(o);
        if (c < 0) return -1;
        cost += c;
        leaves.insert(leaves.end(), leaves_[o].begin(), leaves_[o].end());
      }
    }
    std::sort(leaves.begin(), leaves.end());
    leaves.erase(std::unique(leaves.begin(), leaves.end()), leaves.end());
    // A copy reading two values in memory to spare its reader one is no saving (resnet20's relu
    // gradients, from up to 9 values: 7% slower).
    if (leaves.size() > 1) return -1;
    return cost_[v] = cost <= kMaxRecomputedOps ? cost : -1;
  }
  // Whether operand o of a copy is itself copied (else the copy reads the original).
  bool Copied(ValueId o) {
    const ir::Instr& x = m_.at(o);
    return x.op == OpCode::kBroadcast || (x.op != OpCode::kConstant && !in_memory_[o] && Cost(o) >= 0);
  }

 private:
  static constexpr int kUnknown = -2;
  const ir::Module& m_;
  std::vector<std::vector<ValueId>> users_;
  std::vector<int> cost_;
  std::vector<char> in_memory_;
  std::vector<std::vector<ValueId>> leaves_ = std::vector<std::vector<ValueId>>(m_.size());  // in memory, read by a copy
};
}  // namespace

// relu's gradient mask gt(relu(z), 0) is gt(z, 0): z > 0 exactly when relu(z) > 0 (NaN: both false).
// Where z can be computed again from one value in memory (the rule above: batch norm's
// (x - mean) * scale + shift from its convolution's output x), the mask reads z, which the next
// rewrite then computes again in the mask's loop, from x: resnet20's batch-norm gradient loops read x
// anyway, so they no longer read relu's output as well (one [128,28,28,16] tensor fewer per
// first-stage layer). Runs just before RecomputeCheapValues; the same bits.
int ReluMasksFromInputs(ir::Module& m) {
  Recomputation r(m);
  int masks = 0;
  for (ValueId g = 0; g < m.size(); ++g) {
    const ir::Instr& mask = m.at(g);
    if (mask.op != OpCode::kGt || !IsZeroSplat(m, mask.operands[1])) continue;
    const ir::Instr& relu = m.at(mask.operands[0]);
    if (relu.op != OpCode::kRelu || r.Cost(relu.operands[0]) < 0) continue;
    m.at(g).operands[0] = relu.operands[0];
    ++masks;
  }
  if (masks > 0) m.Canonicalize();
  return masks;
}

// Returns the number of values copied for a reader.
int RecomputeCheapValues(ir::Module& m) {
  Recomputation r(m);
  const auto& users = r.users();
  const int n = m.size();
  // Per user: the values it gets its own copies of; copies are placed just before their reader.
  std::vector<std::vector<ValueId>> copies_of(n);
  bool any = false;
  for (ValueId v = 0; v < n; ++v) {
    if (r.Cost(v) < 0) continue;
    std::vector<ValueId> readers;
    // Elementwise readers of v's shape (a broadcast of v, or a loop of another shape, could not take the
    // copy into its own loop).
    for (ValueId u : users[v])
      if (ir::IsFusible(m, u) && m.at(u).op != OpCode::kBroadcast && m.type(u).shape == m.type(v).shape &&
          (readers.empty() || readers.back() != u))  // (mul(v, v) lists u twice)
        readers.push_back(u);
    for (size_t i = 1; i < readers.size(); ++i) {
      copies_of[readers[i]].push_back(v);
      any = true;
    }
  }
  if (!any) return 0;
  ir::Module out = m;
  out.instrs.clear();
  std::vector<ValueId> id(n, ir::kNoValue);
  int copies = 0;
  auto emit = [&](ir::Instr in) {
    in.attrs.erase(ir::kFusionAttr);
    out.instrs.push_back(std::move(in));
    return static_cast<ValueId>(out.instrs.size() - 1);
  };
  for (ValueId u = 0; u < n; ++u) {
    ir::Instr in = m.at(u);
    for (ValueId& o : in.operands) o = id[o];
    std::map<ValueId, ValueId> copy_of;  // this reader's copies, each value once
    std::function<ValueId(ValueId)> copy = [&](ValueId v) -> ValueId {
      if (auto it = copy_of.find(v); it != copy_of.end()) return it->second;
      ir::Instr c = m.at(v);
      for (ValueId& o : c.operands) o = r.Copied(o) ? copy(o) : id[o];
      return copy_of[v] = emit(std::move(c));
    };
    for (ValueId v : copies_of[u]) {
      const ValueId c = copy(v);
      ++copies;
      for (size_t i = 0; i < in.operands.size(); ++i)
        if (m.at(u).operands[i] == v) in.operands[i] = c;
    }
    id[u] = emit(std::move(in));
  }
  for (auto& [var, v] : out.assigns) var = id[var], v = id[v];
  for (auto& [var, g] : out.gradients) var = id[var], g = id[g];
  for (auto& [name, v] : out.outputs) v = id[v];
  m = std::move(out);
  return copies;
}

// A broadcast read by several loops: each reader after the first gets its own copy, which the fuser puts
// in the reader's loop (read through an index map), so no loop writes the broadcast at its full size for
// another to read back. Softmax's row sums, broadcast to the scores' shape, were written by the forward
// loop and read by two backward loops ([32,4,128,128] per transformer_lm layer: 8 MB written, 16 MB
// read, where the index map reads 64 KB). Readers that are not elementwise loops of its shape (a
// matmul, a reduction) share the original. A broadcast copies its operand exactly: the same bits.
int CopyBroadcastsPerReader(ir::Module& m) {
  const auto users = m.Users();
  const int n = m.size();
  int copies = 0;
  for (ValueId b = 0; b < n; ++b) {
    if (m.at(b).op != OpCode::kBroadcast) continue;
    bool first = true;
    ValueId prev = ir::kNoValue;
    for (ValueId u : users[b]) {
      if (u == prev) continue;  // (mul(b, b) lists u twice)
      prev = u;
      if (!ir::IsFusible(m, u) || m.at(u).op == OpCode::kBroadcast || m.type(u).shape != m.type(b).shape) continue;
      if (first) {  // the first loop reader keeps the original
        first = false;
        continue;
      }
      ir::Instr c = m.at(b);
      c.attrs.erase(ir::kFusionAttr);
      const ValueId copy = m.Append(std::move(c));
      for (ValueId& o : m.at(u).operands)
        if (o == b) o = copy;
      ++copies;
    }
  }
  if (copies > 0) m.Canonicalize();
  return copies;
}

// After the fuser: a loop output v = f(w, broadcasts, constants), with w in memory anyway, whose every
// reader outside v's loop is an elementwise loop of v's shape, is computed again in those loops from w
// instead of written and read back. resnet20's batch-norm gradient: the scaled gradient
// select(mask, dy, 0) * (gamma * rstd) was written by the sums' loop, which writes the select anyway
// (the residual branch reads it), and read by the dx loop: one [128,28,28,16] tensor fewer written per
// first-stage layer. (RecomputeCheapValues, before the fuser, cannot see that the select is written.)
// The same ops on the same values: the same bits.
int SinkCheapLoopOutputs(ir::Module& m) {
  const int n = m.size();
  const auto users = m.Users();
  auto group = [&](ValueId v) { return static_cast<int>(m.at(v).GetInt(ir::kFusionAttr, -1)); };
  std::vector<char> root(n, 0);  // returned or assigned
  for (const auto& [name, v] : m.outputs) root[v] = 1;
  for (const auto& [var, v] : m.assigns) root[v] = 1;
  // In memory whatever happens here: not a loop member (a leaf, a matmul's result...), returned, or read
  // by another loop or a non-fused op other than a sum (which may fuse with v's loop).
  auto in_memory = [&](ValueId x) {
    const ir::Instr& in = m.at(x);
    if (root[x]) return true;
    if (group(x) < 0) return in.op != OpCode::kConstant && in.op != OpCode::kBroadcast;
    for (ValueId u : users[x]) {
      const OpCode op = m.at(u).op;
      if (group(u) >= 0 ? group(u) != group(x)
                        : op != OpCode::kReduceSum && op != OpCode::kReduceMean && op != OpCode::kReduceMax)
        return true;
    }
    return false;
  };
  // Per reader: the values it computes again (each gets its own copy in the reader's loop).
  std::vector<std::vector<ValueId>> sunk_into(n);
  int sunk = 0;
  for (ValueId v = 0; v < n; ++v) {
    const ir::Instr& in = m.at(v);
    const int g = group(v);
    if (g < 0 || root[v] || in.op == OpCode::kBroadcast || !ir::IsFusible(m, v)) continue;
    if (in.type.elements() < kMinRecomputedElements) continue;
    int leaves = 0;
    bool ok = true;
    for (ValueId o : in.operands) {
      const OpCode op = m.at(o).op;
      if (op == OpCode::kConstant || op == OpCode::kBroadcast) continue;
      if (!in_memory(o)) ok = false;
      ++leaves;
    }
    if (!ok || leaves != 1) continue;
    std::vector<ValueId> readers;
    for (ValueId u : users[v]) {
      if (group(u) == g) continue;
      if (group(u) < 0 || m.at(u).op == OpCode::kBroadcast || m.type(u).shape != in.type.shape) {
        ok = false;
        break;
      }
      if (readers.empty() || readers.back() != u) readers.push_back(u);
    }
    if (!ok || readers.empty()) continue;
    for (ValueId u : readers) sunk_into[u].push_back(v);
    ++sunk;
  }
  if (sunk == 0) return 0;
  // Rebuilt with each copy just before its reader (appending would let Canonicalize move the reader
  // and everything after it to the end of the step).
  ir::Module out = m;
  out.instrs.clear();
  std::vector<ValueId> id(n, ir::kNoValue);
  auto emit = [&](ir::Instr in) {
    out.instrs.push_back(std::move(in));
    return static_cast<ValueId>(out.instrs.size() - 1);
  };
  std::map<std::pair<ValueId, int>, ValueId> copy_in;  // (v, reader's loop) -> v's copy there
  for (ValueId u = 0; u < n; ++u) {
    ir::Instr in = m.at(u);
    for (ValueId& o : in.operands) o = id[o];
    for (ValueId v : sunk_into[u]) {
      if (auto it = copy_in.find({v, group(u)}); it != copy_in.end()) {
        for (size_t i = 0; i < in.operands.size(); ++i)
          if (m.at(u).operands[i] == v) in.operands[i] = it->second;
        continue;
      }
      ir::Instr c = m.at(v);
      c.attrs[ir::kFusionAttr] = int64_t{group(u)};
      for (ValueId& o : c.operands) {
        if (m.at(o).op == OpCode::kBroadcast) {  // the reader's own copy, read through its index map
          ir::Instr b = m.at(o);
          b.attrs[ir::kFusionAttr] = int64_t{group(u)};
          for (ValueId& bo : b.operands) bo = id[bo];
          o = emit(std::move(b));
        } else {
          o = id[o];
        }
      }
      const ValueId copy = copy_in[{v, group(u)}] = emit(std::move(c));
      for (size_t i = 0; i < in.operands.size(); ++i)
        if (m.at(u).operands[i] == v) in.operands[i] = copy;
    }
    id[u] = emit(std::move(in));
  }
  for (auto& [var, v] : out.assigns) var = id[var], v = id[v];
  for (auto& [var, g] : out.gradients) var = id[var], g = id[g];
  for (auto& [name, v] : out.outputs) v = id[v];
  out.Canonicalize();  // drops a value no reader is left with
  m = std::move(out);
  return sunk;
}

int MergeRepeatsInLoops(ir::Module& m) {
  const int n = m.size();
  std::vector<ValueId> same(n);  // each value's earlier equal in its loop, or itself
  std::map<std::tuple<int64_t, OpCode, ValueId>, std::vector<ValueId>> seen;  // (loop, op, first operand)
  int merged = 0;
  for (ValueId v = 0; v < n; ++v) {
    ir::Instr& in = m.at(v);
    for (ValueId& o : in.operands) o = same[o];
    same[v] = v;
    const int64_t g = in.GetInt(ir::kFusionAttr, -1);
    if (g < 0 || in.op == OpCode::kRandomUniform || !ir::IsFusible(m, v)) continue;
    auto& candidates = seen[{g, in.op, in.operands.empty() ? ir::kNoValue : in.operands[0]}];
    for (ValueId w : candidates)
      if (m.at(w) == in) {
        same[v] = w;
        ++merged;
        break;
      }
    if (same[v] == v) candidates.push_back(v);
  }
  if (merged == 0) return 0;
  for (auto& [var, v] : m.assigns) v = same[v];
  for (auto& [var, gr] : m.gradients) gr = same[gr];
  for (auto& [name, v] : m.outputs) v = same[v];
  m.Canonicalize();  // drops the repeats, read by nothing now
  return merged;
}

}  // namespace shardstep::jit
