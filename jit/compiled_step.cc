// CompiledStep: plans, compiles and runs one step module on the CPU.
//
// Before planning, the JIT's own module rewrites run (jit/step_rewrites.h, jit/channels_last.h).
// Planning:
//  1. ElementwiseFuser marks fusion groups; each group becomes one JIT'd loop (FusedKernel) whose
//     inputs are the members' operands from outside (splat constants are inlined) and whose outputs
//     are the members read outside the group (by another op, an assign or an output).
//     FuseReductions then lets kernels read broadcasts through their index maps (no broadcast is
//     materialised for another loop) and runs the f32 sums and means of a kernel's outputs inside it,
//     a window at a time (an output read only by them never reaches memory): batch norm's
//     statistics and gradient sums, softmax's and layer norm's sums, in Reduce's order.
//  2. The schedule is a topological order of kernels and the remaining instructions (a kernel runs
//     when all its inputs exist; the fuser guarantees the condensed graph is acyclic).
//  3. The driver: the schedule as one JIT'd function in the kernels' object (jit/driver_emitter.h),
//     calling the entry points of jit/step_runtime.h with constant arguments.
//  4. Buffers (jit/buffer_plan.h): every materialised value gets a place in one arena per replica
//     (Workspace), allocated at the first step and reused; values live from their step to their last
//     reader (through reshape aliases; outputs and assigned values to the end of the step), and
//     values not live at once share bytes. A value swapped into its variable at the end of the step
//     (assigned once, not an output) keeps a tensor of its own, since the variable takes its storage;
//     a variable's new value from a fused loop that reads the old one at the same index is stored
//     over it instead, where nothing can tell the difference (PlanInPlaceUpdates: Adam's w, m, v).
//     Variables and inputs are read in place, through slots bound to the caller's tensors once
//     (StepBinding: the executors bind the state when it is loaded and the batch once per step, so
//     no replica looks a name up in a step); reshape aliases its operand, and so do views (PlanViews:
//     a gather of one row of a variable, a contiguous slice), which keep their operand's storage live.
//     A step allocates nothing except on the reference path (and small per-op index vectors and the
//     returned outputs).
//  5. The collective combiner's packing runs without copies (PlanPackedCollectives): a combined
//     reduce-scatter reads its concat's parts where they are, a combined all-gather writes the slices
//     of its result directly (Collectives::ReduceScatterParts / AllGatherParts).
//  6. Assignments take effect together, as in the interpreter: a variable read in place by another
//     assignment (`@a = @b; @b = @a`, a reshape of a variable) is read before it is overwritten, and
//     a cycle of such reads goes through a staging buffer (jit/buffer_plan.h SequenceAssignments).
// Lowering of the non-fused ops: matmul -> oneDNN sgemm (batched: one per batch element,
// jit/native_ops.h), or oneDNN bf16 matmul when both operands are bf16-rounded (Bf16Operands: it then
// reads the bf16 values in place, ReadBf16OperandsInPlace); broadcast, transpose, slice, pad, concat -> strided copies; reductions and
// gather -> native loops with the interpreter's summation order; conv2d and its gradients -> oneDNN
// convolution primitives or im2col + oneDNN sgemm per image, chosen per shape at planning
// (jit/dnnl_conv.h), max pooling -> native loops (jit/cpu_kernels.h); avg pooling, scatter-add,
// s32 division, iota -> native loops (jit/native_ops.h); random_uniform -> the JIT's own Philox
// (jit/random_lowering.h); one-hot -> a native loop; collectives -> the runtime Collectives. The
// interpreter's kernel on a one-op module (kReference) remains as a fallback for a future op with no
// native lowering; no op of the table uses it on f32/s32 (tests/jit/jit_conformance_test.cc checks).
// bf16: elementwise ops and broadcasts are fused loops (jit/kernel_emitter.cc: widen, compute in
// f32, round to nearest even); collectives and matmuls widen to f32, reduce (sgemm: f32 accumulation)
// and round once; a transpose whose result is only rounded rounds as it copies (RoundInTransposes,
// f32 in, bf16 out); the other ops on bf16 run the interpreter's kernel (kReference: the same
// widen-compute-round rule) until they get native bf16 lowerings. The mixed-precision pass
// (ir/passes/mixed_precision.h) leaves matmuls and convolutions on f32 operands, so it never needs those.
#include "jit/compiled_step.h"
#include "jit/jit_source_hash.h"

#include <tbb/blocked_range.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <llvm/IR/LLVMContext.h>
#include <llvm/IR/Module.h>
#include <llvm/Support/raw_ostream.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <queue>

#include <unistd.h>

#include "ir/error.h"
#include "ir/passes/elementwise_fuser.h"
#include "ir/printer.h"
#include "ir/shape_inference.h"
#include "jit/attention.h"
#include "jit/buffer_plan.h"
#include "jit/channels_last.h"
#include "jit/cpu_kernels.h"
#include "jit/data_movement.h"
#include "jit/dnnl_conv.h"
#include "jit/dnnl_kernels.h"
#include "jit/max_pool_2x2.h"
#include "jit/native_ops.h"
#include "jit/random_lowering.h"
#include "jit/step_rewrites.h"

namespace shardstep::jit {

using ir::DType;
using ir::OpCode;
using ir::Shape;
using ir::ValueId;
using runtime::Tensor;
using runtime::TensorMap;

namespace {

// Changes with every change to jit/ (a build-time hash of its sources), so stale cache entries are
// never used.
constexpr const char* kEmitterVersion = "shardstep-jit-" SS_JIT_SOURCE_HASH;
// Fused reductions: elements per window (multiples of 8), and reductions per kernel (data_movement.cc
// FusedSums). The kernel stops at each window's end for the sums, so its input streams restart there.
//  - Channels-last batch norm's sums (a kept last axis of <= 64 channels): 4096 (16 KB per windowed
//    operand and thread, L1; measured fastest on resnet20 against 2048, 8192 and 16384).
//  - Every other layout: a whole block of rows at a time (ReduceLayout's ~64K elements). transformer_lm's
//    sums (layer norm's rows of 128, the bias gradients' columns of 128-512) ran 1.0-1.5 ms per step
//    faster than with 4096 (f32 and bf16 alike, SHARDSTEP_JIT_PROFILE, two runs each); with 4096 the
//    GELU-backward-and-bias-sum loops of the bf16 step were slower fused than apart.
//  - Rows longer than a quarter of that (a sum over a vocabulary's logits): four rows per window while
//    four fit in kLongRowWindow, so FusedSums sums them as Reduce does, four rows in flight (Lanes4),
//    where one row at a time waits on one chain of adds (bert's cross-entropy sum over 8192 logits:
//    fused 8.1 ms a step against 5.7 for the loop and Reduce apart); longer rows are cut into windows.
constexpr int64_t kChannelWindow = 4096, kBlockWindow = int64_t{1} << 16, kLongRowWindow = int64_t{1} << 18;
int64_t FusedWindow(const ReduceLayout& l) {
  if (l.inner != 0 && l.n <= 64) return kChannelWindow;
  if (l.inner == 0 && 4 * l.n > kBlockWindow && 4 * l.n <= kLongRowWindow) return (4 * l.n + 7) / 8 * 8;
  return kBlockWindow;
}
constexpr int kMaxFusedReductions = 8;
constexpr int64_t kArenaAlign = 64;

int FusionGroup(const ir::Instr& in) { return static_cast<int>(in.GetInt(ir::kFusionAttr, -1)); }

runtime::Reduction ReductionOf(const ir::Instr& in) { return runtime::ParseReduction(in.GetString("reduction", "sum")); }

// Replica `replica`'s group of collective `in`, found once at planning; the checks that depend on
// the collectives passed to Run are made per call (CheckGroup).
runtime::ReplicaGroup GroupOf(const ir::Module& m, const ir::Instr& in, int replica) {
  for (const auto& group : ir::ReplicaGroups(in, m.num_replicas)) {
    if (std::find(group.begin(), group.end(), replica) == group.end()) continue;
    if (in.Has("group_size") && in.GetInt("group_size") != static_cast<int64_t>(group.size()))
      throw Error(Str("group_size ", in.GetInt("group_size"), " but replica ", replica, "'s group has ", group.size(),
                      " members"));
    return group;
  }
  throw Error(Str("replica ", replica, " is in none of the replica groups"));
}

void CheckGroup(const ir::Instr& in, const runtime::ReplicaGroup& group, runtime::Collectives* c) {
  if (!c && group.size() != 1) throw Error(Str("a group of ", group.size(), " replicas needs a Collectives implementation"));
  if (c && !ir::IsFloat(in.type.dtype))
    throw Error(Str("the Collectives interface carries f32 (and bf16 widened to f32) only, got ", in.type.ToString()));
}

// The leaf's storage, from the tensor bound to its slot; with parts > 1 the tensor holds the global
// batch (dimension 0 scaled by parts) and this returns chunk `part` of it in place. The type is checked
// at every step (in place, no copy: a step allocates nothing), since the caller may have replaced the
// bound tensor's contents since binding.
const void* BoundLeaf(const Tensor& t, const char* what, const ir::Instr& in, int parts = 1, int part = 0) {
  const Shape& want = in.type.shape;
  bool same = t.type.dtype == in.type.dtype && t.shape().size() == want.size();
  for (size_t d = 0; same && d < want.size(); ++d) same = t.shape()[d] == want[d] * (d == 0 ? parts : 1);
  if (parts > 1 && want.empty()) throw Error(Str(what, " @", in.name, ": a scalar cannot be split across ", parts, " replicas"));
  if (!same) {
    ir::TensorType global = in.type;
    if (!global.shape.empty()) global.shape[0] *= parts;
    throw Error(Str(what, " @", in.name, ": expected ", global.ToString(),
                    parts > 1 ? Str(" (", parts, " replicas of ", in.type.ToString(), ")") : "", ", got ", t.type.ToString()));
  }
  const size_t held = t.held();
  if (static_cast<int64_t>(held) != t.elements())
    throw Error(Str(what, " @", in.name, ": ", t.type.ToString(), " holds ", held, " values"));
  return static_cast<const char*>(t.raw()) + (parts > 1 ? part * in.type.bytes() : 0);
}

// Points `slots` (one per name) at the map's tensors; `type_of` gives a slot's expected type for the
// error on a missing name.
template <typename Map, typename T>
void BindSlots(Map& map, const std::vector<std::string>& names, const char* what,
               const std::function<const ir::TensorType&(size_t)>& type_of, std::vector<T*>* slots) {
  slots->resize(names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    auto it = map.find(names[i]);
    if (it == map.end()) throw Error(Str(what, " @", names[i], ": missing (expected ", type_of(i).ToString(), ")"));
    (*slots)[i] = &it->second;
  }
}

int32_t ToS32(double v) {
  if (std::isnan(v)) return 0;
  if (v >= 2147483647.0) return std::numeric_limits<int32_t>::max();
  if (v <= -2147483648.0) return std::numeric_limits<int32_t>::min();
  return static_cast<int32_t>(v);
}

std::mutex g_cache_mu;
std::map<std::string, std::shared_ptr<const CompiledStep>>& MemoryCache() {
  static std::map<std::string, std::shared_ptr<const CompiledStep>> cache;
  return cache;
}

// collective_permute: this replica's target and source in the pairs (-1: none, PlanRoutes); the operand goes to
// the target, the source's operand (or zeros) comes back. bf16 travels widened to f32, as in the
// other collectives.
void RunPermute(const ir::Instr& in, const void* x, void* out, int replica, int to, int from, runtime::Collectives* c) {
  const int64_t n = in.type.elements();
  if (to < 0 && from < 0) {
    std::memset(out, 0, in.type.bytes());
    return;
  }
  if (!c) {
    if (to != replica || from != replica)
      throw Error(Str("collective_permute between replicas ", replica, " and ", to >= 0 ? to : from,
                      " needs a Collectives implementation"));
    std::memcpy(out, x, in.type.bytes());
    return;
  }
  if (!ir::IsFloat(in.type.dtype))
    throw Error(Str("the Collectives interface carries f32 (and bf16 widened to f32) only, got ", in.type.ToString()));
  const int direction = static_cast<int>(in.GetInt("direction", 1));
  if (in.type.dtype == DType::kF32) {
    c->Permute(replica, to, static_cast<const float*>(x), from, static_cast<float*>(out), n, direction);
    return;
  }
  std::vector<float> wide_x(n), wide_o(n);
  for (int64_t i = 0; i < n; ++i) wide_x[i] = runtime::Bf16ToF32(static_cast<const uint16_t*>(x)[i]);
  c->Permute(replica, to, wide_x.data(), from, wide_o.data(), n, direction);
  for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(out)[i] = runtime::F32ToBf16(wide_o[i]);
}


// (By the dtypes, not the attribute: a step allocates nothing, and the attribute's name is a string.)
bool HasBf16Operands(const ir::Module& m, const ir::Instr& in) {
  return in.op == OpCode::kMatmul && in.type.dtype == DType::kF32 && m.type(in.operands[0]).dtype == DType::kBF16;
}

// A gather of the replica's own row: its index is replica_id, always in [0, num_replicas) (Run checks
// the replica), and the table has a row for every replica, so it cannot fail on the data. The sharded
// weight update reads each variable's slice this way; the small slices' gathers run after the large
// tensors' optimizer loops, which could otherwise not update in place (PlanInPlaceUpdates).
bool GathersOwnRow(const ir::Module& m, const ir::Instr& in) {
  return in.op == OpCode::kGather && in.operands.size() == 2 && m.at(in.operands[1]).op == OpCode::kReplicaId &&
         !m.type(in.operands[0]).shape.empty() && m.type(in.operands[0]).shape[0] >= m.num_replicas;
}
}  // namespace

Lowering LoweringOf(const ir::Module& m, ValueId v) {
  const ir::Instr& in = m.at(v);
  if (ir::HasProperty(in.op, ir::kLeaf)) return Lowering::kLeaf;
  if (in.Has(ir::kFusionAttr) || ir::IsFusible(m, v)) return Lowering::kFused;
  bool bf16 = in.type.dtype == DType::kBF16;
  for (ValueId o : in.operands) bf16 |= m.type(o).dtype == DType::kBF16;
  if (bf16 && in.op == OpCode::kMatmul) return Lowering::kNative;  // widened, f32 sgemm, rounded (RunInstr)
  if ((in.op == OpCode::kAttention || in.op == OpCode::kAttentionGrad) &&
      (in.type.dtype == DType::kF32 || in.Has(kHeadsOutAttr)))
    return Lowering::kNative;  // bf16 operands read in place (ReadBf16OperandsInPlace), a bf16 output rounded
                               // (AttentionHeadsInPlace; the attribute's name is short: no allocation per step)
  if (in.op == OpCode::kTranspose && in.Has(kRoundsAttr)) return Lowering::kNative;  // RoundInTransposes
  if (in.op == OpCode::kTranspose && in.type.dtype == DType::kBF16) return Lowering::kNative;  // 2-byte copies
  if (bf16 && in.op != OpCode::kReshape && !ir::HasProperty(in.op, ir::kCollective)) return Lowering::kReference;
  switch (in.op) {
    case OpCode::kReshape: return Lowering::kAlias;
    case OpCode::kMatmul: return in.type.rank() == 2 && !Bf16Operands(m, in) ? Lowering::kMatmul : Lowering::kNative;
    case OpCode::kAllReduce:
    case OpCode::kReduceScatter:
    case OpCode::kAllGather:
    case OpCode::kCollectivePermute: return Lowering::kCollective;
    case OpCode::kBroadcast:
    case OpCode::kTranspose:
    case OpCode::kSlice:
    case OpCode::kPad:
    case OpCode::kConcat:
    case OpCode::kReduceSum:
    case OpCode::kReduceMax:
    case OpCode::kReduceMean:
    case OpCode::kGather:
    case OpCode::kOneHot:
    case OpCode::kConv2d:
    case OpCode::kConv2dInputGrad:
    case OpCode::kConv2dFilterGrad:
    case OpCode::kMaxPool:
    case OpCode::kMaxPoolGrad:
    case OpCode::kAvgPool:
    case OpCode::kAvgPoolGrad:
    case OpCode::kScatterAdd:
    case OpCode::kAttention:
    case OpCode::kAttentionGrad:
    case OpCode::kRandomUniform: return Lowering::kNative;
    case OpCode::kDiv: return in.type.dtype == DType::kS32 ? Lowering::kNative : Lowering::kReference;
    default: return Lowering::kReference;
  }
}

CompiledStep::~CompiledStep() = default;

void CompiledStep::Plan(bool fuse_reductions) {
  const int n = m_.size();
  // 1. Kernels from the fusion groups.
  std::map<int, int> kernel_of_group;
  std::vector<int> kernel_of(n, -1);
  for (ValueId v = 0; v < n; ++v) {
    const int g = FusionGroup(m_.at(v));
    if (g < 0) continue;
    auto [it, fresh] = kernel_of_group.emplace(g, static_cast<int>(kernels_.size()));
    if (fresh) {
      kernels_.emplace_back();
      kernels_.back().name = "ss_k" + std::to_string(it->second);
      kernels_.back().shape = m_.type(v).shape;
    }
    kernel_of[v] = it->second;
    kernels_[it->second].members.push_back(v);
  }
  const auto users = m_.Users();
  std::vector<char> external(n, 0);  // read outside its kernel (or not in one)
  for (auto& [var, v] : m_.assigns) external[v] = 1;
  for (auto& [name, v] : m_.outputs) external[v] = 1;
  for (ValueId v = 0; v < n; ++v)
    for (ValueId u : users[v])
      if (kernel_of[u] < 0 || kernel_of[u] != kernel_of[v]) external[v] = 1;
  for (FusedKernel& k : kernels_) {
    const int id = kernel_of[k.members[0]];
    for (ValueId v : k.members) {
      for (ValueId o : m_.at(v).operands) {
        if (kernel_of[o] == id || m_.at(o).op == OpCode::kConstant) continue;
        if (std::find(k.inputs.begin(), k.inputs.end(), o) == k.inputs.end()) k.inputs.push_back(o);
      }
      if (external[v]) k.outputs.push_back(v);
    }
  }
  reduce_group_of_kernel_.assign(kernels_.size(), -1);
  reduce_group_of_value_.assign(n, -1);
  if (fuse_reductions) FuseReductions(kernel_of, external);
  info_.kernels = static_cast<int>(kernels_.size());
  info_.fused_ops = 0;
  for (auto& k : kernels_) info_.fused_ops += static_cast<int>(k.members.size());

  // Buffers: every non-member value, except constants only inlined into kernels; kernel outputs.
  needs_buffer_.assign(n, 0);
  for (ValueId v = 0; v < n; ++v) {
    if (kernel_of[v] >= 0) needs_buffer_[v] = external[v];
    else if (m_.at(v).op == OpCode::kConstant) {
      bool other = false;
      for (auto& [var, a] : m_.assigns) other |= a == v;
      for (auto& [name, o] : m_.outputs) other |= o == v;
      for (ValueId u : users[v]) other |= kernel_of[u] < 0;
      needs_buffer_[v] = other;
    } else needs_buffer_[v] = 1;
  }

  // An assigned value may be swapped into its variable when it is assigned once and not an output.
  std::vector<int> uses(n, 0);
  for (const auto& [var, v] : m_.assigns) ++uses[v];
  for (const auto& [name, v] : m_.outputs) uses[v] += 2;
  swappable_.assign(n, 0);
  for (ValueId v = 0; v < n; ++v) swappable_[v] = uses[v] == 1;

  // 2. Schedule: Kahn's algorithm over kernels and the other instructions, in module order where possible.
  const int nodes = n + static_cast<int>(kernels_.size());
  // A fused reduction is part of its kernel's node.
  auto node_of = [&](ValueId v) {
    if (kernel_of[v] >= 0) return n + kernel_of[v];
    if (reduce_group_of_value_[v] >= 0) return n + reduce_groups_[reduce_group_of_value_[v]].kernel;
    return v;
  };
  std::vector<std::vector<int>> succ(nodes);
  std::vector<int> indeg(nodes, 0), key(nodes, 0);
  std::vector<char> present(nodes, 0);
  for (ValueId v = 0; v < n; ++v) {
    const int nv = node_of(v);
    present[nv] = 1;
    key[nv] = std::max(key[nv], v);
    for (ValueId o : m_.at(v).operands) {
      const int no = node_of(o);
      if (no == nv) continue;
      if (kernel_of[v] >= 0 && m_.at(o).op == OpCode::kConstant) continue;  // inlined
      succ[no].push_back(nv);
      ++indeg[nv];
    }
  }
  using Item = std::pair<int, int>;  // (key, node)
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> ready;
  for (int x = 0; x < nodes; ++x)
    if (present[x] && indeg[x] == 0) ready.push({key[x], x});
  while (!ready.empty()) {
    const int x = ready.top().second;
    ready.pop();
    Step s;
    if (x >= n) s.kernel = x - n;
    else s.value = x;
    schedule_.push_back(s);
    for (int y : succ[x])
      if (--indeg[y] == 0) ready.push({key[y], y});
  }
  int expected = 0;
  for (int x = 0; x < nodes; ++x) expected += present[x];
  SS_CHECK(static_cast<int>(schedule_.size()) == expected, "fusion groups form a cycle");

  // 3. One-op modules for the interpreter's kernels.
  reference_.assign(n, ir::Module());
  for (ValueId v = 0; v < n; ++v) {
    if (kernel_of[v] >= 0 || LoweringOf(m_, v) != Lowering::kReference) continue;
    ir::Module& r = reference_[v];
    r.name = "ref";
    r.num_replicas = 1;
    ir::Instr op = m_.at(v);
    op.attrs.erase(ir::kFusionAttr);
    for (size_t i = 0; i < op.operands.size(); ++i) {
      ir::Instr in;
      in.op = OpCode::kInput;
      in.name = "x" + std::to_string(i);
      in.type = m_.type(op.operands[i]);
      r.Append(in);
      op.operands[i] = static_cast<ValueId>(i);
    }
    const ValueId out = r.Append(op);
    r.outputs.push_back({"y", out});
  }

  // Convolutions: the path and oneDNN's primitives, chosen and built once per shape (jit/dnnl_conv.h).
  // With max pooling in the module, equal input patches must give equal forward outputs (its choice
  // among equal values follows exact ties), which rules out Winograd for the forward passes.
  conv_.assign(n, nullptr);
  ConvTies ties = ConvTies::kFree;
  for (ValueId v = 0; v < n; ++v)
    if (m_.at(v).op == OpCode::kMaxPool || m_.at(v).op == OpCode::kMaxPoolGrad) ties = ConvTies::kExact;
  for (ValueId v = 0; v < n; ++v) {
    const ir::Instr& in = m_.at(v);
    if (kernel_of[v] >= 0 || LoweringOf(m_, v) != Lowering::kNative) continue;
    if (in.op != OpCode::kConv2d && in.op != OpCode::kConv2dInputGrad && in.op != OpCode::kConv2dFilterGrad) continue;
    bool f32 = in.type.dtype == DType::kF32;
    for (ValueId o : in.operands) f32 &= m_.type(o).dtype == DType::kF32;
    if (!f32) continue;  // RunInstr reports it
    // The channels-last form (jit/channels_last.h) holds NHWC activations: ConvShape takes NCHW.
    const bool nhwc = in.GetInt(kNhwcAttr, 0) != 0;
    auto nchw = [&](const Shape& s) { return nhwc ? Shape{s[0], s[3], s[1], s[2]} : s; };
    const Shape a = m_.type(in.operands[0]).shape, &b = m_.type(in.operands[1]).shape;
    const ConvKind kind = in.op == OpCode::kConv2d            ? ConvKind::kForward
                          : in.op == OpCode::kConv2dInputGrad ? ConvKind::kInputGrad
                                                              : ConvKind::kFilterGrad;
    const ConvShape g = kind == ConvKind::kForward     ? ConvShapeOf(nchw(a), b, in)
                        : kind == ConvKind::kInputGrad ? ConvShapeOf(nchw(in.type.shape), b, in)
                                                       : ConvShapeOf(nchw(a), in.type.shape, in);
    conv_[v] = nhwc ? PlannedChannelsLastConv(kind, g, ties) : PlannedConv(kind, g, ties);
    SS_CHECK(conv_[v], "no channels-last kernel for convolution %", v, " (the rewrite checked for one)");
    info_.channels_last_convs += nhwc;
    info_.winograd_convs += conv_[v]->winograd();
  }

  // 4. What the driver does at each step; constants need nothing at run time (filled at allocation),
  // nor do the concats and slices whose copies a packed collective saves.
  PlanPackedCollectives();
  PlanRowBlocks();
  PlanAttentionGradParts(fuse_reductions);
  PlanAttentionStats();
  for (const Step& s : schedule_) {
    DriverStep d;
    if (s.kernel >= 0 && absorbed_[s.kernel]) continue;  // written by an attention_grad
    if (s.kernel < 0 && written_by_[s.value] >= 0) continue;
    if (s.kernel >= 0 && reduce_group_of_kernel_[s.kernel] >= 0) {  // the loop and its reductions
      d.kind = DriverStep::Kind::kInstr;
      d.value = reduce_groups_[reduce_group_of_kernel_[s.kernel]].reductions[0];
      driver_steps_.push_back(d);
      continue;
    }
    if (s.kernel >= 0) {
      d.kind = DriverStep::Kind::kKernel;
      d.kernel = s.kernel;
      driver_steps_.push_back(d);
      continue;
    }
    if (elided_[s.value]) continue;
    const ir::Instr& in = m_.at(s.value);
    d.value = s.value;
    switch (LoweringOf(m_, s.value)) {
      case Lowering::kLeaf:
        if (in.op == OpCode::kConstant) continue;
        break;
      case Lowering::kAlias:
        d.kind = DriverStep::Kind::kAlias;
        d.source = in.operands[0];
        break;
      case Lowering::kMatmul: {
        if (row_blocks_[s.value] > 0) break;  // RunInstr: row blocks, or folded by its reduce-scatter
        const Shape& a = m_.type(in.operands[0]).shape;
        d.kind = DriverStep::Kind::kSgemm;
        d.ta = in.GetInt("transpose_a", 0) != 0;
        d.tb = in.GetInt("transpose_b", 0) != 0;
        d.m = in.type.shape[0];
        d.n = in.type.shape[1];
        d.k = d.ta ? a[0] : a[1];
        d.a = in.operands[0];
        d.lda = a[1];
        d.b = in.operands[1];
        d.ldb = m_.type(in.operands[1]).shape[1];
        break;
      }
      case Lowering::kCollective: d.kind = DriverStep::Kind::kCollective; break;
      case Lowering::kFused:  // RunInstr reports the broken invariant
      case Lowering::kNative:
      case Lowering::kReference: break;
    }
    driver_steps_.push_back(d);
  }
  PlanRoutes();
  PlanLeafSlots();
  PlanViews();
  PlanInPlaceUpdates();
  PlanProductParts();
  PlanBuffers();
}

// Views: values read in place from their operand's storage instead of copied.
//  - A gather of one row (one index) of a variable: the sharded weight update's shard of each weight,
//    gather(reshape(@w), replica_id). Variables are not written before the assignments at the end of
//    the step (an in-place update, PlanInPlaceUpdates, runs after every reader of its variable's
//    storage, views included), so the row holds its value throughout.
//  - A contiguous slice (whole in every dimension but the first): the reduce-scatter's result cut
//    into each tensor's shard. Its operand's storage stays live as long as the view is read
//    (PlanBuffers: the view's storage is its operand's).
// A view (or a reshape of it) that is assigned stays a copy, since the assignments may overwrite the
// storage it points into before copying it.
void CompiledStep::PlanViews() {
  const int n = m_.size();
  auto root_of = [&](ValueId v) {
    while (LoweringOf(m_, v) == Lowering::kAlias) v = m_.at(v).operands[0];
    return v;
  };
  view_.assign(n, 0);
  std::vector<char> slice(n, 0);
  for (ValueId v = 0; v < n; ++v) {
    const ir::Instr& in = m_.at(v);
    if (LoweringOf(m_, v) != Lowering::kNative || !needs_buffer_[v] || elided_[v] || in.type.dtype == DType::kBF16) continue;
    if (in.op == OpCode::kGather) {
      view_[v] = m_.type(in.operands[1]).elements() == 1 && m_.at(root_of(in.operands[0])).op == OpCode::kVariable;
    } else if (in.op == OpCode::kSlice) {
      const Shape& src = m_.type(in.operands[0]).shape;
      const ir::IntList& start = in.GetInts("start");
      bool whole = true;
      for (size_t d = 1; d < src.size(); ++d) whole &= start[d] == 0 && in.type.shape[d] == src[d];
      view_[v] = slice[v] = whole;
    }
  }
  for (const auto& [var, v] : m_.assigns) view_[root_of(v)] = 0;
  int slices = 0;
  for (ValueId v = 0; v < n; ++v) slices += view_[v] && slice[v];
  info_.slice_views = slices;
  info_.row_views = static_cast<int>(std::count(view_.begin(), view_.end(), 1)) - slices;
}

// In-place updates: a variable's new value computed by a fused loop that reads the old value at the
// same index is stored over it, element by element after the read, instead of into a buffer of its own
// swapped in at the end. A memory-bound update (Adam: 4 arrays read, 3 written) then streams 4 arrays
// instead of 7 (a C++ loop of the same update on this machine: 28 -> 55 GB/s out of place -> in place).
// Only where the end of the step cannot tell the difference:
//  - the value is assigned once, not an output, and read by nothing but its own loop's members and fused
//    sums (which read the new value after the loop wrote it: the same bits);
//  - the loop reads the variable as one input of its own shape (through reshapes at most), never through a
//    broadcast's index map, and nothing else reads the variable's storage (its reshapes, views, other
//    assignments, outputs, a fused sum of the input) after the loop starts; or the loop does not read the
//    variable at all (a weight's bf16 copy, written by the weight's update: jit/step_rewrites.h
//    Bf16WeightCopies) and everything that reads it runs before the loop;
//  - nothing scheduled after the loop can fail on the data (a collective, or an instruction outside the
//    fused loops, matmuls and copies), so a step that throws still leaves every variable as it was; or the
//    loop runs after a rendezvous of every replica (an all-reduce, reduce-scatter or all-gather over all)
//    after which nothing can fail on any replica (later collectives then complete too).
void CompiledStep::PlanInPlaceUpdates() {
  const int n = m_.size(), end = static_cast<int>(schedule_.size());
  in_place_.assign(n, 0);
  for (FusedKernel& k : kernels_) k.store_into.assign(k.outputs.size(), -1);
  std::vector<ValueId> root(n);
  for (ValueId v = 0; v < n; ++v)
    root[v] = LoweringOf(m_, v) == Lowering::kAlias || view_[v] ? root[m_.at(v).operands[0]] : v;
  std::vector<int> kernel_of(n, -1), at_kernel(kernels_.size(), -1);
  for (size_t kk = 0; kk < kernels_.size(); ++kk)
    for (ValueId v : kernels_[kk].members) kernel_of[v] = static_cast<int>(kk);
  // Per position: whether it or anything after it may fail on the data. And the same once every replica
  // has reached a collective of this step (its rendezvous): every replica then reaches each later
  // collective too unless something that can fail on the data runs in between, so a later collective
  // fails only if its replica group is invalid (known at planning) or it is a permute (mailboxes).
  std::vector<char> may_fail_from(end + 1, 0), may_fail_after_rendezvous(end + 1, 0);
  for (int p = end - 1; p >= 0; --p) {
    const Step& s = schedule_[p];
    bool fails = false, fails_after_rendezvous = false;
    if (s.kernel < 0) {
      const OpCode op = m_.at(s.value).op;
      switch (LoweringOf(m_, s.value)) {
        case Lowering::kLeaf:
        case Lowering::kAlias:
        case Lowering::kMatmul: break;
        case Lowering::kCollective:
          fails = true;
          fails_after_rendezvous = op == OpCode::kCollectivePermute;
          for (const Route& route : routes_[s.value]) fails_after_rendezvous |= !route.error.empty();
          break;
        default:
          fails = !(op == OpCode::kBroadcast || op == OpCode::kTranspose || op == OpCode::kReshape ||
                    op == OpCode::kSlice || op == OpCode::kPad || op == OpCode::kConcat || op == OpCode::kReduceSum ||
                    op == OpCode::kReduceMean || op == OpCode::kReduceMax || GathersOwnRow(m_, m_.at(s.value)));
      }
      if (LoweringOf(m_, s.value) != Lowering::kCollective) fails_after_rendezvous = fails;
    } else {
      at_kernel[s.kernel] = p;
    }
    may_fail_from[p] = fails || may_fail_from[p + 1];
    may_fail_after_rendezvous[p] = fails_after_rendezvous || may_fail_after_rendezvous[p + 1];
  }
  // Per storage root: the positions that read it, and whether the step's end reads it.
  std::vector<std::vector<int>> readers(n);
  std::vector<char> read_at_end(n, 0);
  for (int p = 0; p < end; ++p) {
    const Step& s = schedule_[p];
    auto read = [&](ValueId v) { readers[root[v]].push_back(p); };
    if (s.kernel >= 0) {
      for (ValueId v : kernels_[s.kernel].inputs) read(v);
    } else {
      for (ValueId o : m_.at(s.value).operands) read(o);
      if (const int k = packed_of_[s.value]; k >= 0)
        for (ValueId o : packed_[k].ins) read(o);
    }
  }
  for (const auto& [name, v] : m_.outputs) read_at_end[root[v]] = 1;
  for (const auto& [var, v] : m_.assigns) read_at_end[root[v]] = 1;
  const auto users = m_.Users();
  std::vector<int> assigned(n, 0);
  for (const auto& [var, v] : m_.assigns) ++assigned[var];
  std::vector<int> leaf_at(n, -1);  // per variable: where its leaf binds its storage, or -1
  for (int p = 0; p < end; ++p)
    if (schedule_[p].kernel < 0 && m_.at(schedule_[p].value).op == OpCode::kVariable) leaf_at[schedule_[p].value] = p;
  // Per position: the last all-reduce, reduce-scatter or all-gather over every replica before it (-1: none).
  // Its completion means every replica ran everything before it without failing; if nothing after it can
  // fail on any replica (may_fail_after_rendezvous), a loop after it may update in place although
  // collectives follow (the sharded update's optimizer state, before the weights' all-gathers: at N = 8 the
  // MLP's m and v shards were written to buffers of their own and swapped in).
  std::vector<int> full_rendezvous_before(end + 1, -1);
  for (int p = 0; p < end; ++p) {
    full_rendezvous_before[p + 1] = full_rendezvous_before[p];
    const Step& s = schedule_[p];
    if (s.kernel >= 0 || LoweringOf(m_, s.value) != Lowering::kCollective) continue;
    const OpCode op = m_.at(s.value).op;
    if (op != OpCode::kAllReduce && op != OpCode::kReduceScatter && op != OpCode::kAllGather) continue;
    bool full = !routes_[s.value].empty();
    for (const Route& route : routes_[s.value])
      full &= route.error.empty() && static_cast<int>(route.group.size()) == m_.num_replicas;
    if (full) full_rendezvous_before[p + 1] = p;
  }
  auto nothing_fails_after = [&](int p) {
    if (!may_fail_from[p + 1]) return true;
    const int q = full_rendezvous_before[p];
    return q >= 0 && !may_fail_after_rendezvous[q + 1];
  };
  for (const auto& [var, v] : m_.assigns) {
    const int kk = kernel_of[v];
    if (!swappable_[v] || kk < 0 || assigned[var] != 1 || in_place_[v]) continue;
    if (!nothing_fails_after(at_kernel[kk]) || read_at_end[var]) continue;
    FusedKernel& k = kernels_[kk];
    bool only_here = true;  // read by its loop's members and fused sums only (the sums read the new value)
    for (ValueId u : users[v])
      only_here &= kernel_of[u] == kk || (reduce_group_of_value_[u] >= 0 && reduce_groups_[reduce_group_of_value_[u]].kernel == kk);
    if (!only_here || !(m_.type(v) == m_.at(var).type) || m_.type(v).shape != k.shape) continue;
    int into = -1, count = 0;
    for (size_t j = 0; j < k.inputs.size(); ++j) {
      if (root[k.inputs[j]] != var) continue;
      ++count;
      into = static_cast<int>(j);
      const ValueId u = k.inputs[j];
      bool direct = m_.type(u) == m_.type(v) || (m_.type(u).dtype == m_.type(v).dtype && m_.type(u).shape == k.shape);
      for (ValueId w : users[u])
        if (kernel_of[w] == kk && m_.at(w).op == OpCode::kBroadcast) direct = false;
      if (!direct) count = 2;
    }
    // A loop that does not read the variable (a weight's bf16 copy, written by the weight's update:
    // Bf16WeightCopies) stores through it as an input of its own, read by no member, so loaded never.
    const bool unread = count == 0 && leaf_at[var] >= 0 && leaf_at[var] < at_kernel[kk];
    if (count != 1 && !unread) continue;
    // A loop with fused sums (RunFusedReductions) may store over the variable unless a sum reads the
    // variable itself after the loop ran (the sums of an input are taken from memory after the loop).
    if (const int g = reduce_group_of_kernel_[kk]; g >= 0 && count == 1) {
      const std::vector<int>& operand = reduce_groups_[g].operand;
      if (std::find(operand.begin(), operand.end(), -1 - into) != operand.end()) continue;
    }
    bool later = false;
    for (int p : readers[var]) later |= p > at_kernel[kk];
    for (int p : readers[var]) later |= p == at_kernel[kk] && !(schedule_[p].kernel == kk);
    if (later) continue;
    if (unread) {
      into = static_cast<int>(k.inputs.size());
      k.inputs.push_back(var);
    }
    const auto out = std::find(k.outputs.begin(), k.outputs.end(), v);
    k.store_into[out - k.outputs.begin()] = into;
    in_place_[v] = 1;
  }
  info_.in_place_updates = static_cast<int>(std::count(in_place_.begin(), in_place_.end(), 1));

  // A packed all-gather's slice that is (through reshapes read by nothing else) a variable's new value is
  // written straight into the variable, not into a buffer copied over it at the end (the sharded weight
  // update: every weight byte once instead of twice). Under the same conditions as a loop's, with the
  // all-gather in the loop's place: every reader of the variable's storage runs before it (on every
  // replica: all reach its rendezvous before anyone writes), nothing after it can fail (later collectives
  // included: all replicas passed this one's rendezvous), and no part it gathers is read from a
  // variable's storage.
  gather_slot_.assign(n, -1);
  info_.gathered_updates = 0;
  std::vector<int> at_value(n, -1);
  for (int p = 0; p < end; ++p)
    if (schedule_[p].kernel < 0) at_value[schedule_[p].value] = p;
  std::vector<ValueId> gathered_by(n, -1);  // per slice a packed all-gather writes: that all-gather
  for (ValueId v = 0; v < n; ++v)
    if (packed_of_[v] >= 0)
      for (ValueId o : packed_[packed_of_[v]].outs) gathered_by[o] = v;
  for (const auto& [var, v] : m_.assigns) {
    if (!swappable_[v] || assigned[var] != 1 || read_at_end[var] || in_place_[v] || !users[v].empty()) continue;
    if (!(m_.type(v) == m_.at(var).type)) continue;
    ValueId s = v;
    bool alone = true;  // each value from the slice up to v is read only by the next
    while (LoweringOf(m_, s) == Lowering::kAlias) {
      s = m_.at(s).operands[0];
      alone &= users[s].size() == 1;
    }
    const bool plain = m_.at(s).op == OpCode::kAllGather && packed_of_[s] < 0 && m_.type(s).dtype == DType::kF32;
    const ValueId g = plain ? s : gathered_by[s];
    if (!alone || g < 0 || at_value[g] < 0 || may_fail_after_rendezvous[at_value[g] + 1]) continue;
    bool later = false;
    for (int p : readers[var]) later |= p >= at_value[g];
    for (ValueId in : plain ? m_.at(g).operands : packed_[packed_of_[g]].ins) later |= m_.at(root[in]).op == OpCode::kVariable;
    if (later) continue;
    gather_slot_[s] = leaf_slot_[var];
    needs_buffer_[s] = 0;
    in_place_[v] = 1;
    ++info_.gathered_updates;
  }

  // With collectives that take an all-gather whose input is the member's own chunk of its output
  // (JitOptions::in_place_all_gathers), a plain all-gather written into its variable whose input is a
  // loop's output computed from the replica's own row of that variable (the sharded update: w' = w_r -
  // step, w_r = gather(reshape(w), replica_id)) has the loop store w' over w_r, in the variable itself;
  // the all-gather then copies the other members' chunks only (none, into a weight the replicas share).
  // The new slice's buffer, and its write-allocate reads, go (MLP 784-4096-4096-10 update at N = 8: the
  // loops' writes were 4 of 7 streams, 1 of them to that buffer). Only where nothing can tell: the loop
  // is its only writer of the variable, after a rendezvous of every replica before which every other
  // reader of the variable runs (replicas may share the variable's storage), nothing after that
  // rendezvous can fail, and the all-gather's group is every replica in order (member r's chunk is row r).
  gathered_from_.assign(n, -1);
  info_.in_place_gathers = 0;
  if (!in_place_all_gathers_) return;
  std::vector<int> chain_at;  // positions of the view's chain from the variable to the loop's input
  for (ValueId g = 0; g < n; ++g) {
    const ir::Instr& gi = m_.at(g);
    if (gi.op != OpCode::kAllGather || gather_slot_[g] < 0 || packed_of_[g] >= 0 || gi.type.dtype != DType::kF32) continue;
    const ValueId u = gi.operands[0];
    const int slot = gather_slot_[g];
    // (A variable may appear as several instructions of one slot.)
    auto of_var = [&](ValueId r) { return m_.at(r).op == OpCode::kVariable && leaf_slot_[r] == slot; };
    const int kk = kernel_of[u];
    if (kk < 0 || reduce_group_of_kernel_[kk] >= 0 || users[u].size() != 1 || in_place_[u] || read_at_end[root[u]]) continue;
    FusedKernel& k = kernels_[kk];
    const auto out = std::find(k.outputs.begin(), k.outputs.end(), u);
    if (out == k.outputs.end() || k.store_into[out - k.outputs.begin()] >= 0 || m_.type(u).shape != k.shape) continue;
    // The loop reads the variable once, directly, through a view of the replica's own row.
    int into = -1, count = 0;
    for (size_t j = 0; j < k.inputs.size(); ++j) {
      if (!of_var(root[k.inputs[j]])) continue;
      ++count;
      into = static_cast<int>(j);
    }
    if (count != 1) continue;
    const ValueId x = k.inputs[into];
    bool direct = m_.type(x) == m_.type(u);
    for (ValueId w : users[x])
      if (kernel_of[w] == kk && m_.at(w).op == OpCode::kBroadcast) direct = false;
    if (!direct) continue;
    chain_at.clear();
    ValueId s = x;
    while (LoweringOf(m_, s) == Lowering::kAlias) {
      chain_at.push_back(at_value[s]);
      s = m_.at(s).operands[0];
    }
    if (!(view_[s] && GathersOwnRow(m_, m_.at(s)))) continue;
    chain_at.push_back(at_value[s]);
    ValueId table = m_.at(s).operands[0];
    while (!of_var(table) && LoweringOf(m_, table) == Lowering::kAlias) {
      chain_at.push_back(at_value[table]);
      table = m_.at(table).operands[0];
    }
    const ir::Shape& rows = m_.type(m_.at(s).operands[0]).shape;
    if (!of_var(table) || rows[0] != m_.num_replicas || m_.type(table).elements() != m_.num_replicas * m_.type(u).elements())
      continue;
    bool in_order = static_cast<int>(routes_[g].size()) == m_.num_replicas;
    for (int r = 0; in_order && r < m_.num_replicas; ++r) {
      const Route& route = routes_[g][r];
      in_order = route.error.empty() && static_cast<int>(route.group.size()) == m_.num_replicas;
      for (int i = 0; in_order && i < m_.num_replicas; ++i) in_order = route.group[i] == i;
    }
    const int at = at_kernel[kk], q = full_rendezvous_before[at];
    if (!in_order || q < 0 || may_fail_after_rendezvous[q + 1]) continue;
    bool later = false;
    for (ValueId r = 0; r < n && !later; ++r)
      if (of_var(r))
        for (int p : readers[r])
          later |= p > q && p != at && std::find(chain_at.begin(), chain_at.end(), p) == chain_at.end();
    if (later) continue;
    k.store_into[out - k.outputs.begin()] = into;
    in_place_[u] = 1;
    gathered_from_[g] = x;
    ++info_.in_place_gathers;
  }
}

std::vector<int> CompiledStep::GatheredVariableSlots(int num_replicas) const {
  std::vector<int> slots;
  for (ValueId s = 0; s < m_.size(); ++s) {
    if (gather_slot_[s] < 0) continue;
    slots.push_back(gather_slot_[s]);
  }
  // Only where every all-gather that writes them gathers over all replicas: disjoint groups would
  // write the same bytes at once.
  for (ValueId v = 0; v < m_.size(); ++v) {
    if (m_.at(v).op != OpCode::kAllGather) continue;
    bool writes_variable = gather_slot_[v] >= 0;
    if (packed_of_[v] >= 0)
      for (ValueId o : packed_[packed_of_[v]].outs) writes_variable |= gather_slot_[o] >= 0;
    if (!writes_variable) continue;
    for (int r = 0; r < num_replicas; ++r) {
      const Route& route = routes_[v][std::min<int>(r, static_cast<int>(routes_[v].size()) - 1)];
      if (!route.error.empty() || static_cast<int>(route.group.size()) != num_replicas) return {};
    }
  }
  std::sort(slots.begin(), slots.end());
  slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
  return slots;
}

// The collective combiner packs tensors into one collective with a concat, and unpacks an all-gather's
// result with slices:
//   reduce_scatter(reshape(concat(p_0, ..., p_k) {axis=1}))   parts [G, n_i] -> [sum n_i]
//   slice_i(reshape(all_gather(concat(p_0, ..., p_k))))        parts [n_i] -> slices [G, n_i]
// Run on their parts (Collectives::ReduceScatterParts / AllGatherParts: the same bits), neither the
// concat nor the slices copy: every gradient byte is read once by the reduce-scatter where the backward
// pass left it, and the all-gather writes every weight byte once where the assignment takes it from.
// Only where the concat (and the all-gather's result) has no other reader and every slice is one
// part's whole columns; anything else keeps the packed form.
namespace {
void ProduceRowBlock(const void* context, int64_t chunk, float* dst) {
  const ProductOperands& p = *static_cast<const ProductOperands*>(context);
  SgemmRowBlock(p.ta, p.tb, p.m, p.n, p.k, p.a, p.lda, p.b, p.ldb, p.blocks, chunk, dst);
}
void AddRowBlock(const void* context, int64_t chunk, float* dst) {
  const ProductOperands& p = *static_cast<const ProductOperands*>(context);
  SgemmRowBlockAdd(p.ta, p.tb, p.m, p.n, p.k, p.a, p.lda, p.b, p.ldb, p.blocks, chunk, dst);
}
// The producer of a product's row blocks, which adds them in place where that keeps the bits.
runtime::PartProducer RowBlockProducer(const ProductOperands& p) {
  return {&ProduceRowBlock, &p, SgemmAddsExactly(p.ta, p.m / p.blocks, p.n, p.k) ? &AddRowBlock : nullptr};
}
}  // namespace

// A weight gradient's product, C = A^T B, in a step of N > 1 replicas: N row blocks (RowBlockSgemm)
// when its rows divide by N. Chunk p of its reduce-scatter over all N replicas is then row block p,
// which SgemmRowBlock computes anywhere with the same bits (PlanProductParts). The rule depends only
// on the product's shape and N, so a replicated step (an all-reduce instead) computes the same bits.
void CompiledStep::PlanRowBlocks() {
  const int n = m_.size(), replicas = m_.num_replicas;
  row_blocks_.assign(n, 0);
  if (replicas <= 1) return;
  for (ValueId v = 0; v < n; ++v) {
    const ir::Instr& in = m_.at(v);
    if (LoweringOf(m_, v) != Lowering::kMatmul || in.type.dtype != DType::kF32) continue;
    if (in.GetInt("transpose_a", 0) == 0 || in.GetInt("transpose_b", 0) != 0) continue;
    if (in.type.shape[0] % replicas == 0 && in.type.shape[0] >= replicas) row_blocks_[v] = replicas;
  }
}

// The products a packed reduce-scatter folds straight from their operands when the collectives allow
// it (Collectives::FoldsProducts: in-process replicas): part i is, through reshapes, a row-blocked
// product read by nothing else, over a group of all N replicas, whose chunk is one row block. Member
// p then computes row block p of every member's product and folds them in group order: no product is
// written out whole and read back (at N = 8 on the MLP, 8 x 7.1 MB a step), the same bits. The
// product's operands live until the collective; the product itself is not run (RunInstr).
void CompiledStep::PlanProductParts() {
  const int n = m_.size();
  folded_.assign(n, 0);
  info_.folded_products = 0;
  const auto users = m_.Users();
  std::vector<char> kept(n, 0);  // assigned or an output
  for (const auto& [var, v] : m_.assigns) kept[v] = 1;
  for (const auto& [name, v] : m_.outputs) kept[v] = 1;
  auto plain_storage = [&](ValueId o) {  // not a variable's storage, nor written into one
    ValueId r = o;
    while (LoweringOf(m_, r) == Lowering::kAlias || view_[r]) r = m_.at(r).operands[0];
    return m_.at(r).op != OpCode::kVariable && !in_place_[r] && !swappable_[r];
  };
  // The product a part of `len` elements per member is (through reshapes, each read only by the next),
  // or -1.
  auto product_of = [&](ValueId part, int64_t len) -> ValueId {
    ValueId d = part;
    bool ok = !kept[d] && users[d].size() == 1;
    while (ok && LoweringOf(m_, d) == Lowering::kAlias) {
      d = m_.at(d).operands[0];
      ok = !kept[d] && users[d].size() == 1 && !view_[d];
    }
    if (!ok || row_blocks_[d] != m_.num_replicas || in_place_[d] || swappable_[d]) return -1;
    const ir::Instr& di = m_.at(d);
    if (len * m_.num_replicas != di.type.elements()) return -1;
    if (!plain_storage(di.operands[0]) || !plain_storage(di.operands[1])) return -1;
    folded_[d] = 1;
    ++info_.folded_products;
    return d;
  };
  plain_product_.assign(n, -1);
  for (ValueId v = 0; v < n; ++v) {
    const ir::Instr& in = m_.at(v);
    if (in.op != OpCode::kReduceScatter || in.type.dtype != DType::kF32) continue;
    bool all_replicas = !routes_[v].empty();
    for (const Route& route : routes_[v])
      all_replicas = all_replicas && route.error.empty() && static_cast<int>(route.group.size()) == m_.num_replicas;
    if (!all_replicas) continue;
    if (packed_of_[v] < 0) {
      plain_product_[v] = product_of(in.operands[0], in.type.elements());
      continue;
    }
    PackedParts& pk = packed_[packed_of_[v]];
    pk.products.assign(pk.ins.size(), -1);
    for (size_t i = 0; i < pk.ins.size(); ++i) pk.products[i] = product_of(pk.ins[i], pk.lens[i]);
  }
}

void CompiledStep::BindProduct(ValueId d, const Workspace& ws, ProductOperands* po) const {
  const ir::Instr& di = m_.at(d);
  const Shape& a = m_.type(di.operands[0]).shape;
  po->ta = di.GetInt("transpose_a", 0) != 0;
  po->tb = di.GetInt("transpose_b", 0) != 0;
  po->m = di.type.shape[0];
  po->n = di.type.shape[1];
  po->k = po->ta ? a[0] : a[1];
  po->a = static_cast<const float*>(ws.ptr[di.operands[0]]);
  po->lda = a[1];
  po->b = static_cast<const float*>(ws.ptr[di.operands[1]]);
  po->ldb = m_.type(di.operands[1]).shape[1];
  po->blocks = row_blocks_[d];
}

void CompiledStep::PlanPackedCollectives() {
  const int n = m_.size();
  const auto users = m_.Users();
  std::vector<char> kept(n, 0);  // assigned or an output
  for (const auto& [var, v] : m_.assigns) kept[v] = 1;
  for (const auto& [name, v] : m_.outputs) kept[v] = 1;
  auto only_user = [&](ValueId v) -> ValueId { return !kept[v] && users[v].size() == 1 ? users[v][0] : -1; };
  packed_of_.assign(n, -1);
  elided_.assign(n, 0);
  packed_.clear();
  for (ValueId v = 0; v < n; ++v) {
    const ir::Instr& in = m_.at(v);
    if ((in.op != OpCode::kReduceScatter && in.op != OpCode::kAllGather) || in.type.dtype != DType::kF32) continue;
    PackedParts parts;
    std::vector<ValueId> elide;
    if (in.op == OpCode::kReduceScatter) {
      const ValueId r = in.operands[0];
      if (m_.at(r).op != OpCode::kReshape) continue;
      const ValueId c = m_.at(r).operands[0];
      const ir::Instr& cat = m_.at(c);
      if (cat.op != OpCode::kConcat || cat.type.rank() != 2 || cat.GetInt("axis") != 1 || only_user(c) != r ||
          only_user(r) != v || cat.type.shape[1] != in.type.elements())
        continue;
      for (ValueId o : cat.operands) {
        parts.ins.push_back(o);
        parts.lens.push_back(m_.type(o).shape[1]);
      }
      elide.push_back(c);
    } else {
      const ValueId c = in.operands[0];
      const ir::Instr& cat = m_.at(c);
      const ValueId r = only_user(v);
      if (cat.op != OpCode::kConcat || cat.type.rank() != 1 || only_user(c) != v || r < 0 ||
          m_.at(r).op != OpCode::kReshape || kept[r] || m_.type(r).rank() != 2 || m_.type(r).shape[1] != cat.type.elements())
        continue;
      const int64_t rows = m_.type(r).shape[0];
      std::map<int64_t, ValueId> slice_at;  // first column -> the slice
      bool ok = true;
      for (ValueId sl : users[r]) {
        const ir::Instr& si = m_.at(sl);
        ok = ok && si.op == OpCode::kSlice && si.type.rank() == 2 && si.type.dtype == DType::kF32 &&
             si.GetInts("start")[0] == 0 && si.type.shape[0] == rows && slice_at.emplace(si.GetInts("start")[1], sl).second;
      }
      int64_t col = 0;
      for (size_t i = 0; ok && i < cat.operands.size(); ++i) {
        const ValueId o = cat.operands[i];
        const int64_t len = m_.type(o).elements();
        const auto it = slice_at.find(col);
        ok = it != slice_at.end() && m_.type(it->second).shape[1] == len;
        if (!ok) break;
        parts.ins.push_back(o);
        parts.outs.push_back(it->second);
        parts.lens.push_back(len);
        col += len;
      }
      if (!ok || parts.outs.size() != users[r].size()) continue;
      elide = parts.outs;
      elide.push_back(c);
      needs_buffer_[v] = 0;  // the packed result itself is never materialised
    }
    for (ValueId e : elide) {
      elided_[e] = 1;
      if (m_.at(e).op == OpCode::kConcat) needs_buffer_[e] = 0;
    }
    packed_of_[v] = static_cast<int>(packed_.size());
    packed_.push_back(std::move(parts));
  }
  info_.packed_collectives = static_cast<int>(packed_.size());
}

void* CompiledStep::GatheredInto(ValueId v, const StepBinding& b) const {
  runtime::Tensor& t = *b.variables[gather_slot_[v]];
  const ir::Instr& var = m_.at(variable_leaf_[gather_slot_[v]]);
  if (!(t.type == var.type))
    throw Error(Str("variable \"", var.name, "\": bound to a ", t.type.ToString(), " tensor, the step writes ", var.type.ToString()));
  return t.raw();
}

void CompiledStep::RunPackedCollective(ValueId v, const runtime::ReplicaGroup& group, const StepBinding& b,
                                       int replica, runtime::Collectives* c, Workspace* ws) const {
  const ir::Instr& in = m_.at(v);
  const PackedParts& pk = packed_[packed_of_[v]];
  const int parts = static_cast<int>(pk.ins.size());
  const float** ins = ws->part_ins.data();
  for (int i = 0; i < parts; ++i) ins[i] = static_cast<const float*>(ws->ptr[pk.ins[i]]);
  if (in.op == OpCode::kReduceScatter) {
    float* out = static_cast<float*>(ws->ptr[v]);
    if (c && !pk.products.empty() && c->FoldsProducts()) {
      runtime::PartProducer* producers = ws->part_producers.data();
      for (int i = 0; i < parts; ++i) {
        const ValueId d = pk.products[i];
        if (d < 0) {
          producers[i] = {};
          continue;
        }
        BindProduct(d, *ws, &ws->product_operands[i]);
        producers[i] = RowBlockProducer(ws->product_operands[i]);
      }
      return c->ReduceScatterProducts(replica, group, ins, producers, pk.lens.data(), parts, out, ReductionOf(in));
    }
    if (c) return c->ReduceScatterParts(replica, group, ins, pk.lens.data(), parts, out, ReductionOf(in));
    for (int64_t i = 0, col = 0; i < parts; col += pk.lens[i++]) std::copy_n(ins[i], pk.lens[i], out + col);  // one replica
    return;
  }
  float** outs = ws->part_outs.data();
  for (int i = 0; i < parts; ++i) {
    if (gather_slot_[pk.outs[i]] >= 0) ws->ptr[pk.outs[i]] = GatheredInto(pk.outs[i], b);
    outs[i] = static_cast<float*>(ws->ptr[pk.outs[i]]);
  }
  if (c) return c->AllGatherParts(replica, group, ins, pk.lens.data(), parts, outs);
  for (int i = 0; i < parts; ++i) std::copy_n(ins[i], pk.lens[i], outs[i]);
}

// Two rewrites of the kernels that save passes over memory (Plan, before the buffers are planned):
//  - A broadcast read by other kernels is read by each of them through its index map, from the
//    broadcast's operand (absorbed as a member), so it is materialised only when something other
//    than a fused loop reads it: batch norm's per-channel scale is never a full-size tensor.
//  - An f32 reduce_sum or reduce_mean whose operand is a kernel's output runs inside that kernel
//    (FusedSums): the kernel computes a window of elements into a small per-thread buffer, the sums
//    read it at once, and an output read only by such reductions is never written to memory. All
//    the reductions of one kernel over the same axes share the pass (batch norm's backward sums
//    of dy and dy * x_hat). The order of every sum is Reduce's, so the bits are the unfused ones.
// attention_grad's parts (dq, dk, dv: slices of its [3, B, T, H, D] result, through reshapes) read by a loop
// that only rounds the part to bf16 for the next products (with the bias sum FuseReductions put in it), or
// by a reduce_sum over all its rows (the projection's bias gradient): the op writes those itself while each
// group's block is in cache (jit/attention.h AttentionGradParts). The loops and reductions leave the driver,
// their values are written at the op's place in the schedule, and the f32 result is not written at all when
// nothing else reads it (transformer_lm bf16: 6 MB a layer written and read back). The same bits: the
// rounding is elementwise, the sums in Reduce's order (ColumnSumsDownRows). Off with fuse_reductions.
void CompiledStep::PlanAttentionGradParts(bool on) {
  const int n = m_.size();
  grad_parts_.clear();
  grad_parts_of_.assign(n, -1);
  written_by_.assign(n, -1);
  absorbed_.assign(kernels_.size(), 0);
  info_.attention_parts = 0;
  if (!on) return;
  std::vector<int> kernel_of(n, -1);
  for (size_t kk = 0; kk < kernels_.size(); ++kk)
    for (ValueId v : kernels_[kk].members) kernel_of[v] = static_cast<int>(kk);
  std::vector<char> kept(n, 0);
  for (const auto& [name, v] : m_.outputs) kept[v] = 1;
  for (const auto& [var, v] : m_.assigns) kept[v] = 1;
  const auto users = m_.Users();
  for (ValueId g = 0; g < n; ++g) {
    const ir::Instr& in = m_.at(g);
    if (in.op != OpCode::kAttentionGrad || LoweringOf(m_, g) != Lowering::kNative || in.type.dtype != DType::kF32 ||
        kept[g] || in.type.rank() != 5)
      continue;
    const Shape& x = in.type.shape;  // [3, B, T, H, D] (AttentionHeadsInPlace)
    AttentionShape a;
    a.heads_out = in.GetInt(kHeadsOutAttr, 0);
    if (a.heads_out <= 0 || x[0] != 3 || x[3] != a.heads_out) continue;
    a.t = x[2], a.d = x[4], a.heads = x[1] * x[3];
    const int64_t part = x[1] * x[2] * x[3] * x[4];
    GradParts gp;
    gp.f32 = false;
    bool any = false;
    for (ValueId s : users[g]) {
      const ir::Instr& slice = m_.at(s);
      const ir::IntList start = slice.GetInts("start", {}), limit = slice.GetInts("limit", {});
      bool whole = slice.op == OpCode::kSlice && start.size() == 5 && limit.size() == 5 && limit[0] == start[0] + 1;
      for (size_t d = 1; whole && d < 5; ++d) whole = start[d] == 0 && limit[d] == x[d];
      const int i = whole ? static_cast<int>(start[0]) : -1;
      if (i < 0 || gp.bf16[i] >= 0 || gp.sums[i] >= 0) {  // something else reads the result
        gp.f32 = true;
        continue;
      }
      std::vector<ValueId> same{s};  // the part and its reshapes
      for (size_t j = 0; j < same.size(); ++j)
        for (ValueId u : users[same[j]])
          if (m_.at(u).op == OpCode::kReshape) same.push_back(u);
      ValueId sum = -1, convert = -1;
      int loop = -1;
      bool other = false;
      for (ValueId w : same) {
        other |= kept[w] != 0;
        for (ValueId u : users[w]) {
          const ir::Instr& ui = m_.at(u);
          if (ui.op == OpCode::kReshape) continue;
          if (ui.op == OpCode::kReduceSum && sum < 0 && !kept[u] && ui.type.dtype == DType::kF32 && kernel_of[u] < 0) {
            const ReduceLayout l = LayoutOf(m_.type(w).shape, ui.GetInts("axes"), ui.type.shape);
            // (At least 4 blocks: the op then runs a block per task, which would leave cores idle.)
            if (ColumnSumsDownRows(l) && l.rows == x[1] * x[2] && l.n == x[3] * x[4] && l.blocks >= 4 &&
                AttentionGradPartsFit(a, l.block_rows) && (gp.block_rows == 0 || gp.block_rows == l.block_rows)) {
              sum = u;
              gp.block_rows = l.block_rows;
              continue;
            }
          }
          const int kk = kernel_of[u];
          if (kk >= 0 && convert < 0 && ui.op == OpCode::kConvert && ui.type.dtype == DType::kBF16 && !kept[u] &&
              kernels_[kk].members.size() == 1 && kernels_[kk].outputs.size() == 1 && kernels_[kk].inputs.size() == 1 &&
              kernels_[kk].inputs[0] == w && ui.type.elements() == part) {
            convert = u;
            loop = kk;
            continue;
          }
          other = true;
        }
      }
      // The loop's fused sums must be the part's sum, which the op then writes; else the loop stays (and
      // computes the sum it holds).
      if (loop >= 0)
        if (const int rg = reduce_group_of_kernel_[loop]; rg >= 0) {
          const auto& r = reduce_groups_[rg].reductions;
          if (sum < 0 || r.size() != 1 || r[0] != sum) {
            if (std::find(r.begin(), r.end(), sum) != r.end()) sum = -1;
            loop = -1, convert = -1;
            other = true;
          }
        }
      if (sum >= 0 && reduce_group_of_value_[sum] >= 0 && (loop < 0 || reduce_groups_[reduce_group_of_value_[sum]].kernel != loop))
        sum = -1, other = true;  // another loop computes it
      gp.f32 |= other;
      if (sum >= 0) gp.sums[i] = sum;
      if (convert >= 0) {
        gp.bf16[i] = convert;
        absorbed_[loop] = 1;
      }
      any |= sum >= 0 || convert >= 0;
    }
    if (!any) continue;
    for (int i = 0; i < 3; ++i)
      for (ValueId v : {gp.bf16[i], gp.sums[i]})
        if (v >= 0) written_by_[v] = g, ++info_.attention_parts;
    grad_parts_of_[g] = static_cast<int>(grad_parts_.size());
    grad_parts_.push_back(gp);
  }
}

// An attention_grad whose probabilities its forward computed: the attention op on the same q, k and v
// with the same attributes (so the same shape, layout and rounding: the same scores), run earlier in
// the step. The forward keeps each query's softmax max and reciprocal sum (2 floats a query), and the
// backward makes the probabilities from them in one pass instead of three (jit/attention.h
// AttentionStats: the same bits). transformer_lm: 128 x 128 queries a layer, 128 KB.
void CompiledStep::PlanAttentionStats() {
  const int n = m_.size();
  attention_stats_at_.assign(n, -1);
  attention_stats_floats_ = 0;
  info_.attention_stats = 0;
  std::vector<int> at(n, -1);  // schedule position of each instruction run on its own
  for (int p = 0; p < static_cast<int>(schedule_.size()); ++p)
    if (schedule_[p].kernel < 0) at[schedule_[p].value] = p;
  auto same_attrs = [&](const ir::Instr& a, const ir::Instr& b) {
    for (const char* name : {"causal", "bf16", kHeadsInAttr})
      if (a.GetInt(name, 0) != b.GetInt(name, 0)) return false;
    return a.GetFloat("scale") == b.GetFloat("scale");
  };
  for (ValueId g = 0; g < n; ++g) {
    const ir::Instr& grad = m_.at(g);
    if (grad.op != OpCode::kAttentionGrad || LoweringOf(m_, g) != Lowering::kNative || at[g] < 0) continue;
    for (ValueId f = 0; f < n; ++f) {
      const ir::Instr& fwd = m_.at(f);
      if (fwd.op != OpCode::kAttention || LoweringOf(m_, f) != Lowering::kNative || at[f] < 0 || at[f] > at[g] ||
          attention_stats_at_[f] >= 0 || !same_attrs(fwd, grad) ||
          !std::equal(fwd.operands.begin(), fwd.operands.end(), grad.operands.begin()))
        continue;
      const int64_t queries = m_.type(fwd.operands[0]).elements() / std::max<int64_t>(1, m_.type(fwd.operands[0]).shape.back());
      attention_stats_at_[f] = attention_stats_at_[g] = attention_stats_floats_;
      attention_stats_floats_ += 2 * queries;
      ++info_.attention_stats;
      break;
    }
  }
}

// The first kernel that reads `a` (f32), or a reshape of the same storage (RoundBeforeReshapes moves a
// rounding above the reshapes), as an input of the kernel's shape at each element's own index (through
// elementwise members only, not a broadcast's index map), and whose place in the schedule does not
// depend on reduction `v` of it: nothing in that kernel, nor in any kernel it reads, is computed from v
// (the schedule's nodes, as Plan builds them, with v in the kernel's node). Returns the kernel and sets
// `input` to that input's index, or -1. Not for a variable or an input (nor views of them), nor into a
// kernel that computes a variable's new value: a kernel with fused sums is never an in-place update
// (PlanInPlaceUpdates), which would overwrite them anyway.
int CompiledStep::KernelReadingDirectly(ValueId a, ValueId v, const std::vector<int>& kernel_of, int* input) const {
  const int n = m_.size();
  ValueId root = a;
  while (m_.at(root).op == OpCode::kReshape) root = m_.at(root).operands[0];
  ValueId base = root;
  while (m_.at(base).op == OpCode::kSlice) base = m_.at(base).operands[0];
  if (const OpCode op = m_.at(base).op; op == OpCode::kVariable || op == OpCode::kInput || op == OpCode::kConstant)
    return -1;
  std::vector<char> assigned(n, 0);
  for (const auto& [var, x] : m_.assigns) assigned[x] = 1;
  const auto users = m_.Users();
  std::vector<ValueId> same{root};  // the values holding a's elements in a's order: root and its reshapes
  for (size_t i = 0; i < same.size(); ++i)
    for (ValueId u : users[same[i]])
      if (m_.at(u).op == OpCode::kReshape) same.push_back(u);
  auto node_of = [&](ValueId x) {
    if (kernel_of[x] >= 0) return n + kernel_of[x];
    if (reduce_group_of_value_[x] >= 0) return n + reduce_groups_[reduce_group_of_value_[x]].kernel;
    return static_cast<int>(x);
  };
  for (ValueId s : same) {
    for (ValueId u : users[s]) {
      const int kk = kernel_of[u];
      if (kk < 0 || m_.type(s).shape != kernels_[kk].shape) continue;
      const FusedKernel& k = kernels_[kk];
      const auto at = std::find(k.inputs.begin(), k.inputs.end(), s);
      if (at == k.inputs.end()) continue;
      bool direct = true, updates = false;
      for (ValueId w : users[s])
        if (kernel_of[w] == kk) direct &= ir::HasProperty(m_.at(w).op, ir::kElementwise);
      for (ValueId o : k.outputs) updates |= assigned[o] != 0;
      if (!direct || updates) continue;
      // Forward from v's users over the schedule's nodes: reaching the kernel's node would be a cycle.
      std::vector<char> reached(n + kernels_.size(), 0);
      std::vector<ValueId> stack(users[v].begin(), users[v].end());
      bool cycle = false;
      while (!stack.empty() && !cycle) {
        const ValueId x = stack.back();
        stack.pop_back();
        const int node = node_of(x);
        if (node == n + kk) cycle = true;
        if (reached[node]) continue;
        reached[node] = 1;
        if (node >= n) {  // a kernel (or its fused reductions): everything read from all of its values
          for (ValueId m : kernels_[node - n].members)
            for (ValueId y : users[m]) stack.push_back(y);
          if (const int g = reduce_group_of_kernel_[node - n]; g >= 0)
            for (ValueId r : reduce_groups_[g].reductions)
              for (ValueId y : users[r]) stack.push_back(y);
        } else {
          for (ValueId y : users[x]) stack.push_back(y);
        }
      }
      if (cycle) continue;
      *input = static_cast<int>(at - k.inputs.begin());
      return kk;
    }
  }
  return -1;
}

void CompiledStep::FuseReductions(const std::vector<int>& kernel_of, std::vector<char>& external) {
  const int n = m_.size();
  const auto users = m_.Users();
  std::vector<char> read_elsewhere(n, 0);  // an output or assigned value, or read by a non-kernel op
  for (auto& [var, v] : m_.assigns) read_elsewhere[v] = 1;
  for (auto& [name, v] : m_.outputs) read_elsewhere[v] = 1;

  // Broadcasts: absorbed by every kernel that reads them.
  for (int kk = 0; kk < static_cast<int>(kernels_.size()); ++kk) {
    FusedKernel& k = kernels_[kk];
    for (size_t j = 0; j < k.inputs.size();) {
      const ValueId o = k.inputs[j];
      const ir::Instr& in = m_.at(o);
      if (in.op != OpCode::kBroadcast || kernel_of[o] < 0) {
        ++j;
        continue;
      }
      k.inputs.erase(k.inputs.begin() + static_cast<std::ptrdiff_t>(j));
      k.members.insert(std::upper_bound(k.members.begin(), k.members.end(), o), o);
      const ValueId src = in.operands[0];
      if (m_.at(src).op != OpCode::kConstant && kernel_of[src] != kk &&
          std::find(k.inputs.begin(), k.inputs.end(), src) == k.inputs.end())
        k.inputs.push_back(src);
    }
  }
  for (ValueId o = 0; o < n; ++o) {
    if (m_.at(o).op != OpCode::kBroadcast || kernel_of[o] < 0 || !external[o]) continue;
    bool needed = read_elsewhere[o];
    for (ValueId u : users[o]) needed |= kernel_of[u] < 0;
    if (needed) continue;
    external[o] = 0;
    auto& outs = kernels_[kernel_of[o]].outputs;
    outs.erase(std::remove(outs.begin(), outs.end(), o), outs.end());
  }

  // Reductions: grouped by the kernel of their operand, one layout per kernel. A reduction of a value
  // no kernel computes (an attention gradient, a product's result) joins a kernel that reads that value
  // element for element (rounding it to bf16 for the next products: the q/k/v and residual gradients of
  // transformer_lm's bf16 step, whose bias sums were another pass over 2 MB each), unless that kernel
  // depends on the reduction (layer norm's x - mean(x)): its sums then read the input's window from
  // memory just after the loop did.
  std::vector<ir::IntList> axes_of(kernels_.size());
  for (ValueId v = 0; v < n; ++v) {
    const ir::Instr& in = m_.at(v);
    if ((in.op != OpCode::kReduceSum && in.op != OpCode::kReduceMean) || kernel_of[v] >= 0) continue;
    const ValueId a = in.operands[0];
    if (in.type.dtype != DType::kF32 || m_.type(a).dtype != DType::kF32) continue;
    int input = -1;
    const int kk = kernel_of[a] >= 0 ? kernel_of[a] : KernelReadingDirectly(a, v, kernel_of, &input);
    if (kk < 0) continue;
    const ir::IntList& axes = in.GetInts("axes");
    int g = reduce_group_of_kernel_[kk];
    if (g < 0) {
      const ReduceLayout layout = LayoutOf(m_.type(a).shape, axes, in.type.shape);
      // One block: the fused pass would be serial where the loop alone runs on every core.
      if (layout.blocks == 1 && layout.total >= (int64_t{1} << 16)) continue;
      g = static_cast<int>(reduce_groups_.size());
      reduce_groups_.emplace_back();
      reduce_groups_.back().kernel = kk;
      reduce_groups_.back().layout = layout;
      reduce_groups_.back().window = FusedWindow(layout);
      reduce_group_of_kernel_[kk] = g;
      axes_of[kk] = axes;
    }
    ReduceGroup& group = reduce_groups_[g];
    if (axes_of[kk] != axes || static_cast<int>(group.reductions.size()) == kMaxFusedReductions) continue;
    const auto& outs = kernels_[kk].outputs;
    group.reductions.push_back(v);
    group.operand.push_back(kernel_of[a] >= 0 ? static_cast<int>(std::find(outs.begin(), outs.end(), a) - outs.begin())
                                              : -1 - input);
    reduce_group_of_value_[v] = g;
  }
  for (ReduceGroup& group : reduce_groups_) {
    const FusedKernel& k = kernels_[group.kernel];
    group.windowed.assign(k.outputs.size(), 0);
    group.window_of.assign(k.outputs.size(), -1);
    for (size_t j = 0; j < k.outputs.size(); ++j) {
      const ValueId w = k.outputs[j];
      // Read only by this kernel's own ops (from registers) and its fused sums: batch norm's masked
      // gradient, summed and scaled in the loop, was written to memory for its sum alone (6.4 MB per
      // 16-channel layer of resnet20's backward).
      bool only_fused = !read_elsewhere[w] && m_.type(w).dtype == DType::kF32;
      for (ValueId u : users[w])
        only_fused &= kernel_of[u] == group.kernel ||
                      (reduce_group_of_value_[u] >= 0 && reduce_groups_[reduce_group_of_value_[u]].kernel == group.kernel);
      if (!only_fused) continue;
      group.windowed[j] = 1;
      group.window_of[j] = group.windows++;
      external[w] = 0;  // still a kernel output (written to the window), never to memory
      ++info_.windowed_values;
    }
    info_.fused_reductions += static_cast<int>(group.reductions.size());
  }
}

void CompiledStep::PlanRoutes() {
  routes_.assign(m_.size(), {});
  for (ValueId v = 0; v < m_.size(); ++v) {
    const ir::Instr& in = m_.at(v);
    if (!ir::HasProperty(in.op, ir::kCollective)) continue;
    auto& routes = routes_[v];
    routes.resize(std::max(m_.num_replicas, 1));
    for (int r = 0; r < static_cast<int>(routes.size()); ++r) {
      Route& route = routes[r];
      if (in.op == OpCode::kCollectivePermute) {
        for (const auto& p : in.GetIntLists("pairs")) {
          if (p.at(0) == r) route.to = static_cast<int>(p[1]);
          if (p.at(1) == r) route.from = static_cast<int>(p[0]);
        }
        continue;
      }
      try {
        route.group = GroupOf(m_, in, r);
      } catch (const std::exception& e) {  // reported when the step runs, as before
        route.error = e.what();
      }
    }
  }
}

void CompiledStep::PlanBuffers() {
  const int n = m_.size(), end = static_cast<int>(schedule_.size());
  // Storage is the alias root's: readers of a reshape (or a view) keep its operand alive.
  std::vector<ValueId> root(n);
  for (ValueId v = 0; v < n; ++v)
    root[v] = LoweringOf(m_, v) == Lowering::kAlias || view_[v] ? root[m_.at(v).operands[0]] : v;
  std::vector<int> first(n, 0), last(n, -1);
  auto read = [&](ValueId v, int at) { last[root[v]] = std::max(last[root[v]], at); };
  for (int p = 0; p < end; ++p) {
    const Step& s = schedule_[p];
    if (s.kernel >= 0) {
      for (ValueId v : kernels_[s.kernel].outputs) first[v] = p;
      for (ValueId v : kernels_[s.kernel].inputs) read(v, p);
      if (const int g = reduce_group_of_kernel_[s.kernel]; g >= 0)
        for (ValueId r : reduce_groups_[g].reductions) first[r] = p;
    } else {
      first[s.value] = p;
      for (ValueId o : m_.at(s.value).operands) read(o, p);
      if (const ValueId d = plain_product_[s.value]; d >= 0)  // a product its reduce-scatter folds
        for (ValueId o : m_.at(d).operands) read(o, p);
      if (const int k = packed_of_[s.value]; k >= 0) {
        for (ValueId o : packed_[k].ins) read(o, p);  // read in place of its concat
        for (ValueId d : packed_[k].products)          // and the products it folds, from their operands
          if (d >= 0)
            for (ValueId o : m_.at(d).operands) read(o, p);
      }
    }
  }
  // A packed all-gather writes its slices: they live from there.
  for (int p = 0; p < end; ++p)
    if (const ValueId v = schedule_[p].value; schedule_[p].kernel < 0 && packed_of_[v] >= 0)
      for (ValueId o : packed_[packed_of_[v]].outs) first[o] = p;
  // So does an attention_grad its parts' roundings and sums (PlanAttentionGradParts).
  for (int p = 0; p < end; ++p)
    if (const ValueId v = schedule_[p].value; schedule_[p].kernel < 0 && grad_parts_of_[v] >= 0) {
      const GradParts& gp = grad_parts_[grad_parts_of_[v]];
      for (int i = 0; i < 3; ++i)
        for (ValueId o : {gp.bf16[i], gp.sums[i]})
          if (o >= 0) first[o] = p;
    }
  for (const auto& [name, v] : m_.outputs) read(v, end);
  for (const auto& [var, v] : m_.assigns) read(v, end);
  const std::vector<ValueId> home = PlanReusedInputs(root, last);

  separate_.assign(n, 0);
  offset_.assign(n, -1);
  std::vector<BufferRequest> requests(n);
  info_.swapped_bytes = 0;
  for (ValueId v = 0; v < n; ++v) {
    const ir::Instr& in = m_.at(v);
    if (!needs_buffer_[v] || in.op == OpCode::kVariable || in.op == OpCode::kInput) continue;
    if (LoweringOf(m_, v) == Lowering::kAlias || view_[v] || in_place_[v] || home[v] != v) continue;
    if (in.op == OpCode::kConstant) {
      requests[v] = {in.type.bytes(), 0, end};  // filled once: never shared
    } else if (swappable_[v]) {
      separate_[v] = 1;
      info_.swapped_bytes += in.type.bytes();
    } else {
      requests[v] = {in.type.bytes(), first[v], std::max(first[v], last[v])};
    }
  }
  const BufferPlan plan = jit::PlanBuffers(requests, kArenaAlign);
  offset_ = plan.offset;
  for (ValueId v = 0; v < n; ++v)
    if (home[v] != v) offset_[v] = offset_[home[v]];
  info_.arena_bytes = plan.arena_bytes;
  info_.buffer_bytes = plan.buffer_bytes;
  PlanAssignments();
}

// Loop outputs written over a dead input: where a fused loop reads a temporary at the same index as it
// writes an output of the same type, and nothing reads that temporary's storage after the loop, the
// output is stored over it (through the input's pointer, as PlanInPlaceUpdates). The loop then streams
// one array less and its stores hit lines it has just read (no write-allocate reads): batch norm's and
// the activations' backward loops. Returns each value's storage home (itself, or the temporary whose
// bytes it takes) and extends `last` (per storage root) over the readers of the values stored there.
// Not for windowed outputs (they never reach memory), variables, inputs, constants, views or values
// swapped into variables; never through a broadcast's index map.
std::vector<ValueId> CompiledStep::PlanReusedInputs(const std::vector<ValueId>& root, std::vector<int>& last) {
  const int n = m_.size();
  std::vector<ValueId> home(n);
  for (ValueId v = 0; v < n; ++v) home[v] = v;
  info_.reused_inputs = 0;
  if (!reuse_inputs_) return home;
  auto arena_value = [&](ValueId r) {
    const OpCode op = m_.at(r).op;
    return needs_buffer_[r] && op != OpCode::kVariable && op != OpCode::kInput && op != OpCode::kConstant &&
           LoweringOf(m_, r) != Lowering::kAlias && !view_[r] && !in_place_[r] && !swappable_[r];
  };
  const auto users = m_.Users();
  std::vector<int> kernel_of(n, -1);
  for (size_t kk = 0; kk < kernels_.size(); ++kk)
    for (ValueId v : kernels_[kk].members) kernel_of[v] = static_cast<int>(kk);
  for (int p = 0; p < static_cast<int>(schedule_.size()); ++p) {
    const int kk = schedule_[p].kernel;
    if (kk < 0 || absorbed_[kk]) continue;
    FusedKernel& k = kernels_[kk];
    const int g = reduce_group_of_kernel_[kk];
    std::vector<char> taken(k.inputs.size(), 0);
    for (size_t j = 0; j < k.outputs.size(); ++j) {
      const ValueId v = k.outputs[j];
      if (k.store_into[j] >= 0 || !arena_value(v) || root[v] != v || (g >= 0 && reduce_groups_[g].windowed[j])) continue;
      if (m_.type(v).shape != k.shape) continue;
      for (size_t i = 0; i < k.inputs.size(); ++i) {
        const ValueId u = k.inputs[i];
        const ValueId r = home[root[u]];
        if (taken[i] || !arena_value(r) || last[r] != p || m_.type(u).dtype != m_.type(v).dtype ||
            m_.type(u).shape != k.shape || m_.type(r).bytes() != m_.type(v).bytes())
          continue;
        if (g >= 0 && std::find(reduce_groups_[g].operand.begin(), reduce_groups_[g].operand.end(),
                                -1 - static_cast<int>(i)) != reduce_groups_[g].operand.end())
          continue;  // its fused sums read it after the loop
        bool direct = true;  // the loop reads r only as this input, element i at i
        for (size_t o = 0; o < k.inputs.size(); ++o) direct &= o == i || home[root[k.inputs[o]]] != r;
        for (ValueId w : users[u]) direct &= !(kernel_of[w] == kk && m_.at(w).op == OpCode::kBroadcast);
        if (!direct) continue;
        k.store_into[j] = static_cast<int>(i);
        taken[i] = 1;
        home[v] = r;
        last[r] = std::max(last[r], last[v]);
        ++info_.reused_inputs;
        break;
      }
    }
  }
  return home;
}

void CompiledStep::PlanAssignments() {
  const int n = m_.size();
  // Whose storage each value is: a reshape is its operand's; a variable is read in place.
  std::vector<ValueId> root(n);
  for (ValueId v = 0; v < n; ++v) root[v] = LoweringOf(m_, v) == Lowering::kAlias ? root[m_.at(v).operands[0]] : v;
  std::vector<AssignMove> moves;
  for (const auto& [var, v] : m_.assigns)
    moves.push_back({var, m_.at(root[v]).op == OpCode::kVariable ? root[v] : -1});
  const AssignOrder order = SequenceAssignments(moves);
  assign_order_ = order.order;
  staging_offset_.assign(moves.size(), -1);
  staging_bytes_ = 0;
  for (size_t i = 0; i < moves.size(); ++i) {
    if (!order.staged[i]) continue;
    staging_offset_[i] = staging_bytes_;
    staging_bytes_ += (m_.type(m_.assigns[i].second).bytes() + kArenaAlign - 1) / kArenaAlign * kArenaAlign;
  }
}

// Each variable and input name gets one slot (StepBinding), in the module's order; assignments write
// their variable's slot.
void CompiledStep::PlanLeafSlots() {
  leaf_slot_.assign(m_.size(), -1);
  std::map<std::string, int> variable_slot, input_slot;
  for (ValueId v = 0; v < m_.size(); ++v) {
    const ir::Instr& in = m_.at(v);
    if (in.op != OpCode::kVariable && in.op != OpCode::kInput) continue;
    const bool variable = in.op == OpCode::kVariable;
    auto& slot_of = variable ? variable_slot : input_slot;
    auto& names = variable ? variable_names_ : input_names_;
    auto [it, added] = slot_of.emplace(in.name, static_cast<int>(names.size()));
    if (added) {
      names.push_back(in.name);
      (variable ? variable_leaf_ : input_leaf_).push_back(v);
    }
    leaf_slot_[v] = it->second;
  }
  assign_slot_.clear();
  for (const auto& [var, v] : m_.assigns) assign_slot_.push_back(leaf_slot_[var]);
}

std::unique_ptr<llvm::Module> CompiledStep::Emit(llvm::LLVMContext& ctx, const std::string& name) const {
  auto mod = EmitKernels(m_, kernels_, ctx, name);
  EmitStepDriver(*mod, kernels_, driver_steps_, kStepDriverName);
  return mod;
}

namespace {
// Debugging aids, read from the environment once:
//  - SHARDSTEP_JIT_DUMP=<file>: each compiled module's text is appended to <file> (then a line "=====")
//    as the JIT runs it, after its own rewrites (rounding before reshapes, bf16 operands read in place,
//    recomputed values, broadcast copies) and with its fusion groups: `compile --emit fused` shows the
//    module before these.
//  - SHARDSTEP_JIT_PERF_MAP=1: the fused loops' addresses go to /tmp/perf-<pid>.map, so `perf report`
//    names them (ss_k<N>_n<elements>_<first ops>_v<first member>) instead of bare JIT addresses.
void AppendJitModuleText(const std::string& text) {
  static const char* path = std::getenv("SHARDSTEP_JIT_DUMP");
  if (!path || !*path) return;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (FILE* f = std::fopen(path, "a")) {
    std::fputs(text.c_str(), f);
    std::fputs("=====\n", f);
    std::fclose(f);
  }
}
bool JitDumpWanted() {
  const char* path = std::getenv("SHARDSTEP_JIT_DUMP");
  return path && *path;
}
// SHARDSTEP_JIT_SINK=0: every loop output is written (to compare; SinkCheapLoopOutputs).
bool SinkWanted() {
  static const bool on = [] {
    const char* e = std::getenv("SHARDSTEP_JIT_SINK");
    return !(e && std::string(e) == "0");
  }();
  return on;
}
// SHARDSTEP_JIT_MERGE_REPEATS=0: a loop computes each copy of a recomputed chain (to compare; MergeRepeatsInLoops).
bool MergeRepeatsWanted() {
  static const bool on = [] {
    const char* e = std::getenv("SHARDSTEP_JIT_MERGE_REPEATS");
    return !(e && std::string(e) == "0");
  }();
  return on;
}
// SHARDSTEP_JIT_RELU_MASKS=0: relu's gradient masks read relu's output (to compare; ReluMasksFromInputs).
bool ReluMasksFromInputsWanted() {
  static const bool on = [] {
    const char* e = std::getenv("SHARDSTEP_JIT_RELU_MASKS");
    return !(e && std::string(e) == "0");
  }();
  return on;
}
bool PerfMapWanted() {
  static const bool on = [] {
    const char* e = std::getenv("SHARDSTEP_JIT_PERF_MAP");
    return e && std::string(e) == "1";
  }();
  return on;
}
}  // namespace

// SHARDSTEP_JIT_DUMP's second part: per fused loop, what it reads and writes to memory (an output
// stored over one of its inputs as "%out(over %in)") and what its fused reductions read from a window (a
// value only recomputed in a loop appears in none).
std::string CompiledStep::KernelTable() const {
  std::string t = "fused loops (elements: inputs -> outputs in memory; windows: outputs only its fused sums read)\n";
  for (size_t kk = 0; kk < kernels_.size(); ++kk) {
    const FusedKernel& k = kernels_[kk];
    t += Str(k.name, " n=", ir::NumElements(k.shape), ":");
    for (ValueId v : k.inputs) t += Str(" %", v);
    t += " ->";
    const int g = reduce_group_of_kernel_[kk];
    std::string windows;
    for (size_t j = 0; j < k.outputs.size(); ++j) {
      if (g >= 0 && reduce_groups_[g].windowed[j]) windows += Str(" %", k.outputs[j]);
      else if (j < k.store_into.size() && k.store_into[j] >= 0) t += Str(" %", k.outputs[j], "(over %", k.inputs[k.store_into[j]], ")");
      else t += Str(" %", k.outputs[j]);
    }
    if (!windows.empty()) t += "; windows" + windows;
    if (g >= 0) {
      t += "; sums";
      for (ValueId r : reduce_groups_[g].reductions) t += Str(" %", r);
    }
    if (absorbed_[kk]) t += Str("; written by attention_grad %", written_by_[k.outputs[0]], " (not run)");
    t += "\n";
  }
  for (const GradParts& gp : grad_parts_)
    for (int i = 0; i < 3; ++i)
      if (gp.sums[i] >= 0 && reduce_group_of_value_[gp.sums[i]] < 0)
        t += Str("%", gp.sums[i], " written by attention_grad %", written_by_[gp.sums[i]], " (not run)\n");
  return t;
}

void CompiledStep::WritePerfMap() const {
  std::vector<std::pair<uintptr_t, std::string>> syms{{reinterpret_cast<uintptr_t>(driver_), kStepDriverName}};
  for (const FusedKernel& k : kernels_) {
    std::string name = Str(k.name, "_n", ir::NumElements(k.shape));
    for (size_t j = 0; j < k.members.size() && j < 6; ++j) name += Str("_", ir::OpName(m_.at(k.members[j]).op));
    syms.push_back({reinterpret_cast<uintptr_t>(jit_->Lookup(k.name)), Str(name, "_v", k.members[0])});
  }
  std::sort(syms.begin(), syms.end());
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  FILE* f = std::fopen(Str("/tmp/perf-", getpid(), ".map").c_str(), "a");
  if (!f) return;
  // A symbol's size is the distance to the next one (the entries are laid out in order); the last
  // gets 64 KiB.
  for (size_t i = 0; i < syms.size(); ++i) {
    const uintptr_t size = i + 1 < syms.size() ? std::min<uintptr_t>(syms[i + 1].first - syms[i].first, 1 << 16) : 1 << 16;
    std::fprintf(f, "%lx %lx %s\n", static_cast<unsigned long>(syms[i].first), static_cast<unsigned long>(size),
                 syms[i].second.c_str());
  }
  std::fclose(f);
}

std::shared_ptr<const CompiledStep> CompiledStep::Compile(const ir::Module& module, const JitOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  ir::Module m = module;
  RoundBeforeReshapes(m);
  RoundInProducers(m);
  RoundInTransposes(m);
  ReadBf16OperandsInPlace(m);
  auto bf16_copies = options.bf16_weight_copies ? Bf16WeightCopies(m) : std::vector<std::pair<std::string, std::string>>{};
  AttentionHeadsInPlace(m);
  MaskMaxPoolGradsByRelu(m);
  if (options.channels_last) ConvolutionsChannelsLast(m);
  if (ReluMasksFromInputsWanted()) ReluMasksFromInputs(m);
  const int recomputed = RecomputeCheapValues(m);
  const int broadcast_copies = CopyBroadcastsPerReader(m);
  ir::ElementwiseFuser().Run(m);
  if (SinkWanted()) SinkCheapLoopOutputs(m);
  const int merged = MergeRepeatsWanted() ? MergeRepeatsInLoops(m) : 0;
  const std::string text = ir::Print(m);
  AppendJitModuleText(text);
  static const bool fuse_env = [] {
    const char* e = std::getenv("SHARDSTEP_JIT_FUSE_REDUCTIONS");
    return !(e && std::string(e) == "0");
  }();
  const bool fuse = options.fuse_reductions && fuse_env;
  static const bool reuse_env = [] {
    const char* e = std::getenv("SHARDSTEP_JIT_REUSE");
    return !(e && std::string(e) == "0");
  }();
  const bool reuse = options.reuse_inputs && reuse_env;
  // Every choice that changes the kernels or the driver is in the keys (a cached step planned the other way
  // would run other loops over other buffers).
  const std::string mem_key = HashHex(text) + (options.disk_cache ? "d" : "n") + (fuse ? "r" : "u") + (reuse ? "i" : "o") +
                              (options.in_place_all_gathers ? "g" : "c") + options.cache_dir;
  std::lock_guard<std::mutex> lock(g_cache_mu);
  if (auto it = MemoryCache().find(mem_key); options.memory_cache && it != MemoryCache().end()) {
    auto copy = std::shared_ptr<CompiledStep>(new CompiledStep(*it->second));
    copy->info_.source = "memory cache";
    copy->info_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return copy;
  }
  auto step = std::shared_ptr<CompiledStep>(new CompiledStep());
  step->m_ = std::move(m);
  step->bf16_copies_ = std::move(bf16_copies);
  step->info_.bf16_weight_copies = static_cast<int>(step->bf16_copies_.size());
  step->reuse_inputs_ = reuse;
  step->in_place_all_gathers_ = options.in_place_all_gathers;
  step->Plan(fuse);
  if (JitDumpWanted()) AppendJitModuleText(step->KernelTable());
  step->info_.recomputed_values = recomputed;
  step->info_.broadcast_copies = broadcast_copies;
  step->info_.merged_repeats = merged;
  step->info_.source = "compiled";
  step->jit_ = JitCompiler::Create(options);
  step->jit_->DefineSymbols(StepRuntimeSymbols());
  step->info_.key = HashHex(text + "|" + kEmitterVersion + (fuse ? "|fused-reductions" : "") +
                            (reuse ? "" : "|no-reused-inputs") + (options.in_place_all_gathers ? "|in-place-all-gathers" : "") +
                            "|" + step->jit_->target_key());
  if (step->jit_->AddCachedObject(step->info_.key)) {
    step->info_.source = "disk cache";
  } else {
    step->info_.rejected_corrupt = step->jit_->cache_rejects() > 0;
    auto ctx = std::make_unique<llvm::LLVMContext>();
    auto mod = step->Emit(*ctx, step->info_.key);
    step->jit_->AddModule(std::move(mod), std::move(ctx), step->info_.key);
  }
  step->driver_ = reinterpret_cast<StepDriverFn>(step->jit_->Lookup(kStepDriverName));
  step->kernel_fns_.assign(step->kernels_.size(), nullptr);
  if (PerfMapWanted()) step->WritePerfMap();
  for (size_t i = 0; i < step->kernels_.size(); ++i)  // the fused reductions call them; profiles name them
    step->kernel_fns_[i] = reinterpret_cast<void*>(step->jit_->Lookup(step->kernels_[i].name));
  step->info_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MemoryCache()[mem_key] = step;
  return step;
}

namespace {
char* ArenaBase(Workspace* ws) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(ws->arena.data());
  return ws->arena.data() + ((kArenaAlign - p % kArenaAlign) % kArenaAlign);
}
}  // namespace

void CompiledStep::Allocate(Workspace* ws) const {
  const int n = m_.size();
  ws->owner = this;
  ws->arena.Assign(info_.arena_bytes + kArenaAlign);
  ws->owned.assign(n, Tensor());
  ws->ptr.assign(n, nullptr);
  ws->is_owned.assign(n, 0);
  ws->staging.assign(staging_bytes_, 0);
  size_t parts = 0;
  for (const PackedParts& pk : packed_) parts = std::max(parts, pk.ins.size());
  ws->part_ins.assign(parts, nullptr);
  ws->part_outs.assign(parts, nullptr);
  ws->part_producers.assign(parts, runtime::PartProducer{});
  ws->product_operands.assign(std::max<size_t>(parts, 1), ProductOperands{});
  // Fused reductions: per TBB thread slot (tbb::this_task_arena::current_thread_index()).
  ws->thread_slots = std::max(tbb::this_task_arena::max_concurrency(), tbb::info::default_concurrency());
  size_t bufs = 0, windows = 0;
  for (const ReduceGroup& g : reduce_groups_) {
    const FusedKernel& k = kernels_[g.kernel];
    bufs = std::max(bufs, k.inputs.size() + k.outputs.size());
    windows = std::max(windows, static_cast<size_t>(g.windows * g.window));
  }
  ws->fused_bufs.assign(ws->thread_slots * bufs, nullptr);
  ws->fused_operands.assign(ws->thread_slots * kMaxFusedReductions, nullptr);
  ws->fused_windows.assign(ws->thread_slots * windows, 0.0f);
  ws->attention_stats.assign(attention_stats_floats_, 0.0f);
  char* base = ArenaBase(ws);
  for (ValueId v = 0; v < n; ++v) {
    const ir::Instr& in = m_.at(v);
    if (separate_[v]) {
      ws->owned[v] = Tensor(in.type);
      ws->is_owned[v] = 1;
    }
    if (in.op == OpCode::kConstant && offset_[v] >= 0) {
      const double c = in.GetFloat("value");
      const int64_t count = in.type.elements();
      if (in.type.dtype == DType::kF32) std::fill_n(reinterpret_cast<float*>(base + offset_[v]), count, static_cast<float>(c));
      else if (in.type.dtype == DType::kBF16)
        std::fill_n(reinterpret_cast<uint16_t*>(base + offset_[v]), count, runtime::F32ToBf16(static_cast<float>(c)));
      else std::fill_n(reinterpret_cast<int32_t*>(base + offset_[v]), count, ToS32(c));
    }
  }
}

// A kernel and its reductions (FuseReductions): each call of the producer computes elements
// [e0, e1) of the kernel, into memory or (windowed outputs) into this thread's windows.
namespace {
// Where a loop writes output j: over the input it is stored into (a variable updated in place has no
// storage of its own), else its own.
void* OutputStorage(const FusedKernel& k, size_t j, const Workspace* ws) {
  const int into = j < k.store_into.size() ? k.store_into[j] : -1;
  return ws->ptr[into >= 0 ? k.inputs[into] : k.outputs[j]];
}
}  // namespace

void CompiledStep::RunFusedReductions(int group, Workspace* ws) const {
  const ReduceGroup& g = reduce_groups_[group];
  const FusedKernel& k = kernels_[g.kernel];
  const auto fn = reinterpret_cast<KernelFn>(kernel_fns_[g.kernel]);
  const size_t nin = k.inputs.size(), nbuf = nin + k.outputs.size();
  const int count = static_cast<int>(g.reductions.size());
  auto produce = [&](int64_t e0, int64_t e1) -> const float* const* {
    const int slot = std::max(0, tbb::this_task_arena::current_thread_index());
    SS_CHECK(slot < ws->thread_slots, "thread slot ", slot, " beyond the workspace's ", ws->thread_slots);
    void** bufs = ws->fused_bufs.data() + slot * nbuf;
    float* windows = ws->fused_windows.data() + static_cast<size_t>(slot) * (ws->fused_windows.size() / ws->thread_slots);
    for (size_t j = 0; j < nin; ++j) bufs[j] = ws->ptr[k.inputs[j]];
    for (size_t j = 0; j < k.outputs.size(); ++j) {
      // The kernel writes element e at bufs[nin + j][e]: a window's base is moved back by e0 elements
      // (integer arithmetic; only elements [e0, e1) are written, all inside the window).
      bufs[nin + j] = g.windowed[j] ? reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(windows + g.window_of[j] * g.window) -
                                                              static_cast<uintptr_t>(e0) * sizeof(float))
                                    : OutputStorage(k, j, ws);
    }
    fn(bufs, e0, e1);
    const float** operands = ws->fused_operands.data() + slot * kMaxFusedReductions;
    for (int r = 0; r < count; ++r) {
      const int j = g.operand[r];
      operands[r] = j < 0             ? static_cast<const float*>(bufs[-1 - j]) + e0  // an input, just read
                    : g.windowed[j] ? windows + g.window_of[j] * g.window
                                    : static_cast<const float*>(OutputStorage(k, j, ws)) + e0;
    }
    return operands;
  };
  bool mean[kMaxFusedReductions];
  float* out[kMaxFusedReductions];
  for (int r = 0; r < count; ++r) {
    mean[r] = m_.at(g.reductions[r]).op == OpCode::kReduceMean;
    out[r] = static_cast<float*>(ws->ptr[g.reductions[r]]);
  }
  FusedSums(g.layout, count, mean, out, g.window, produce, ws->scratch);
}

void CompiledStep::RunInstr(ValueId v, const StepBinding& b, int replica, runtime::Collectives* c, Workspace* ws,
                            int batch_parts) const {
  const ir::Instr& in = m_.at(v);
  auto P = [&](int i) { return ws->ptr[in.operands[i]]; };
  auto U = [&](int i) { return static_cast<const uint32_t*>(ws->ptr[in.operands[i]]); };
  auto shape = [&](int i) -> const Shape& { return m_.type(in.operands[i]).shape; };
  void* out = ws->ptr[v];
  uint32_t* uo = static_cast<uint32_t*>(out);
  switch (LoweringOf(m_, v)) {
    case Lowering::kLeaf:
      if (in.op == OpCode::kVariable) ws->ptr[v] = const_cast<void*>(BoundLeaf(*b.variables[leaf_slot_[v]], "variable", in));
      else if (in.op == OpCode::kInput)
        ws->ptr[v] = const_cast<void*>(BoundLeaf(*b.inputs[leaf_slot_[v]], "input", in, batch_parts, replica));
      else if (in.op == OpCode::kReplicaId) static_cast<int32_t*>(out)[0] = replica;
      else if (in.op == OpCode::kIota) Iota(in.type, in.GetInt("dimension"), out);
      return;
    case Lowering::kAlias: ws->ptr[v] = P(0); return;
    case Lowering::kFused: SS_CHECK(false, "fused %", v, " scheduled alone"); return;
    case Lowering::kMatmul: {
      const bool ta = in.GetInt("transpose_a", 0) != 0, tb = in.GetInt("transpose_b", 0) != 0;
      const int64_t mm = in.type.shape[0], nn = in.type.shape[1], k = ta ? shape(0)[0] : shape(0)[1];
      if (folded_[v] && c && c->FoldsProducts()) return;  // its reduce-scatter computes it (PlanProductParts)
      if (row_blocks_[v] > 0)
        return RowBlockSgemm(ta, tb, mm, nn, k, static_cast<const float*>(P(0)), shape(0)[1], static_cast<const float*>(P(1)),
                             shape(1)[1], row_blocks_[v], static_cast<float*>(out));
      StepSgemm(ta, tb, mm, nn, k, static_cast<const float*>(P(0)), shape(0)[1], static_cast<const float*>(P(1)),
                    shape(1)[1], static_cast<float*>(out));
      return;
    }
    case Lowering::kCollective: {
      const Route& route = routes_[v][replica];
      if (in.op == OpCode::kCollectivePermute) return RunPermute(in, P(0), out, replica, route.to, route.from, c);
      if (!route.error.empty()) throw Error(route.error);
      const runtime::ReplicaGroup& group = route.group;
      CheckGroup(in, group, c);
      if (packed_of_[v] >= 0) return RunPackedCollective(v, group, b, replica, c, ws);
      if (gather_slot_[v] >= 0) out = ws->ptr[v] = GatheredInto(v, b);
      const int64_t nin = m_.type(in.operands[0]).elements(), nout = in.type.elements();
      // Stored in place by its loop: the replica's own chunk of the output (PlanInPlaceUpdates).
      const void* in0 = gathered_from_[v] >= 0 ? ws->ptr[gathered_from_[v]] : P(0);
      if (!c) {
        std::memmove(out, in0, in.type.bytes());
        return;
      }
      float* o = static_cast<float*>(out);
      const float* x = static_cast<const float*>(in0);
      std::vector<float> wide_x, wide_o;  // bf16: reduced as f32 in the f32 order, rounded once
      if (in.type.dtype == DType::kBF16) {
        const uint16_t* h = static_cast<const uint16_t*>(P(0));
        wide_x.resize(nin);
        wide_o.resize(nout);
        for (int64_t i = 0; i < nin; ++i) wide_x[i] = runtime::Bf16ToF32(h[i]);
        x = wide_x.data();
        o = wide_o.data();
      }
      if (in.op == OpCode::kAllReduce) {
        c->AllReduce(replica, group, x, o, nout, ReductionOf(in));
      } else if (in.op == OpCode::kReduceScatter && plain_product_[v] >= 0 && c->FoldsProducts()) {
        BindProduct(plain_product_[v], *ws, &ws->product_operands[0]);
        const runtime::PartProducer producer = RowBlockProducer(ws->product_operands[0]);
        c->ReduceScatterProducts(replica, group, &x, &producer, &nout, 1, o, ReductionOf(in));
      } else if (in.op == OpCode::kReduceScatter) {
        c->ReduceScatter(replica, group, x, o, nout, ReductionOf(in));
      } else {
        c->AllGather(replica, group, x, o, nin);
      }
      if (in.type.dtype == DType::kBF16)
        for (int64_t i = 0; i < nout; ++i) static_cast<uint16_t*>(out)[i] = runtime::F32ToBf16(wide_o[i]);
      return;
    }
    case Lowering::kNative: break;
    case Lowering::kReference: {
      TensorMap args;
      for (size_t i = 0; i < in.operands.size(); ++i) {
        Tensor t(m_.type(in.operands[i]));
        std::memcpy(t.raw(), ws->ptr[in.operands[i]], t.bytes());
        args["x" + std::to_string(i)] = std::move(t);
      }
      std::vector<Tensor> r = runtime::EvaluateAll(reference_[v], {}, args, 0, nullptr);
      std::memcpy(out, r.back().raw(), in.type.bytes());
      return;
    }
  }
  switch (in.op) {
    case OpCode::kBroadcast: {
      const ir::IntList& dims = in.GetInts("dims");
      Strides is = RowMajor(shape(0)), ss(in.type.rank(), 0);
      for (size_t i = 0; i < dims.size(); ++i) ss[dims[i]] = is[i];
      StridedGather(in.type.shape, U(0), ss, uo);
      return;
    }
    case OpCode::kTranspose: {
      const ir::IntList& perm = in.GetInts("perm");
      Strides is = RowMajor(shape(0)), ss(perm.size());
      for (size_t i = 0; i < perm.size(); ++i) ss[i] = is[perm[i]];
      if (in.Has(kRoundsAttr))
        StridedGatherToBf16(in.type.shape, static_cast<const float*>(P(0)), ss, static_cast<uint16_t*>(out));
      else if (in.type.dtype == DType::kBF16)
        StridedGather16(in.type.shape, static_cast<const uint16_t*>(P(0)), ss, static_cast<uint16_t*>(out));
      else if (!BatchedTranspose(shape(0), perm, U(0), uo))
        StridedGather(in.type.shape, U(0), ss, uo);
      return;
    }
    case OpCode::kSlice: {
      const ir::IntList& start = in.GetInts("start");
      Strides is = RowMajor(shape(0));
      int64_t offset = 0;
      for (size_t i = 0; i < start.size(); ++i) offset += start[i] * is[i];
      if (view_[v]) {  // PlanViews
        ws->ptr[v] = const_cast<uint32_t*>(U(0)) + offset;
        return;
      }
      StridedGather(in.type.shape, U(0) + offset, is, uo);
      return;
    }
    case OpCode::kPad: {
      const ir::IntList& low = in.GetInts("low");
      std::memset(out, 0, in.type.bytes());
      Strides os = RowMajor(in.type.shape);
      int64_t offset = 0;
      for (size_t i = 0; i < low.size(); ++i) offset += low[i] * os[i];
      StridedScatter(shape(0), U(0), uo + offset, os);
      return;
    }
    case OpCode::kConcat: {
      const int64_t axis = in.GetInt("axis");
      Strides os = RowMajor(in.type.shape);
      int64_t at = 0;
      for (size_t i = 0; i < in.operands.size(); ++i) {
        StridedScatter(shape(static_cast<int>(i)), U(static_cast<int>(i)), uo + at * os[axis], os);
        at += shape(static_cast<int>(i))[axis];
      }
      return;
    }
    case OpCode::kReduceSum:
    case OpCode::kReduceMax:
    case OpCode::kReduceMean: {
      if (reduce_group_of_value_[v] >= 0) return RunFusedReductions(reduce_group_of_value_[v], ws);
      const ir::IntList& axes = in.GetInts("axes");
      if (in.type.dtype == DType::kF32)
        Reduce<float>(in.op, shape(0), axes, in.type.shape, static_cast<const float*>(P(0)), static_cast<float*>(out), ws->scratch);
      else
        Reduce<int32_t>(in.op, shape(0), axes, in.type.shape, static_cast<const int32_t*>(P(0)), static_cast<int32_t*>(out),
                        ws->scratch);
      return;
    }
    case OpCode::kGather: {  // rows of the table
      const Shape& table = shape(0);
      const int64_t rows = table[0], width = ir::NumElements(table) / std::max<int64_t>(rows, 1);
      const int32_t* idx = static_cast<const int32_t*>(P(1));
      const int64_t count = m_.type(in.operands[1]).elements();
      for (int64_t i = 0; i < count; ++i) {
        if (idx[i] < 0 || idx[i] >= rows) throw Error(Str("gather index ", idx[i], " out of range [0,", rows, ")"));
        if (view_[v]) ws->ptr[v] = const_cast<uint32_t*>(U(0)) + idx[i] * width;  // PlanViews
        else std::memcpy(uo + i * width, U(0) + idx[i] * width, width * 4);
      }
      return;
    }
    case OpCode::kOneHot: {  // the interpreter's rule, without its temporaries (every training step has one)
      const int64_t depth = in.GetInt("depth"), count = m_.type(in.operands[0]).elements();
      const int32_t* labels = static_cast<const int32_t*>(P(0));
      float* o = static_cast<float*>(out);
      std::memset(out, 0, in.type.bytes());
      for (int64_t i = 0; i < count; ++i) {
        if (labels[i] < 0 || labels[i] >= depth) throw Error(Str("label ", labels[i], " out of range [0,", depth, ")"));
        o[i * depth + labels[i]] = 1;
      }
      return;
    }
    case OpCode::kConv2d:
    case OpCode::kConv2dInputGrad:
    case OpCode::kConv2dFilterGrad: {
      for (ValueId o : in.operands)
        if (m_.type(o).dtype != DType::kF32) throw Error(Str("operands must be f32, got ", m_.type(o).ToString()));
      const float* a = static_cast<const float*>(P(0));
      const float* b = static_cast<const float*>(P(1));
      float* y = static_cast<float*>(out);
      if (conv_[v]) {
        conv_[v]->Run(a, b, y);
        return;
      }
      SS_CHECK(!in.Has(kNhwcAttr), "channels-last convolution %", v, " has no planned kernel");
      if (in.op == OpCode::kConv2d) Conv2dForward(ConvShapeOf(shape(0), shape(1), in), a, b, y);
      else if (in.op == OpCode::kConv2dInputGrad) Conv2dInputGrad(ConvShapeOf(in.type.shape, shape(1), in), a, b, y);
      else Conv2dFilterGrad(ConvShapeOf(shape(0), in.type.shape, in), a, b, y);
      return;
    }
    case OpCode::kMaxPool:
    case OpCode::kMaxPoolGrad:
    case OpCode::kAvgPool:
    case OpCode::kAvgPoolGrad: {
      for (ValueId o : in.operands)
        if (m_.type(o).dtype != DType::kF32) throw Error(Str("operands must be f32, got ", m_.type(o).ToString()));
      const float* x = static_cast<const float*>(P(0));
      float* y = static_cast<float*>(out);
      if (in.GetInt(kNhwcAttr, 0) != 0) {  // channels-last (jit/channels_last.h): 2x2 windows, stride 2
        const Shape& s = shape(0);
        SS_CHECK(MaxPool2x2NhwcVectorised(), "channels-last pooling %", v, " without its vector loops");
        const NhwcPool g{s[0], s[1], s[2], s[3]};
        if (in.op == OpCode::kMaxPool) MaxPool2x2Nhwc(g, x, y);
        else MaxPool2x2GradNhwc(g, x, static_cast<const float*>(P(1)), y, in.GetInt(kReluMaskAttr, 0) != 0);
        return;
      }
      if (in.op == OpCode::kMaxPool) MaxPool(PoolShapeOf(shape(0), in), x, y);
      else if (in.op == OpCode::kMaxPoolGrad)
        MaxPoolGrad(PoolShapeOf(shape(0), in), x, static_cast<const float*>(P(1)), y, in.GetInt(kReluMaskAttr, 0) != 0);
      else if (in.op == OpCode::kAvgPool) AvgPool(PoolShapeOf(shape(0), in), x, y);
      else AvgPoolGrad(PoolShapeOf(in.type.shape, in), x, y);
      return;
    }
    case OpCode::kMatmul:  // batched (rank >= 3), bf16-valued operands (Bf16Operands), or bf16 at any rank
      if (HasBf16Operands(m_, in) || Bf16Operands(m_, in)) {
        const bool ta = in.GetInt("transpose_a", 0) != 0, tb = in.GetInt("transpose_b", 0) != 0;
        const Shape &a = shape(0), &b = shape(1);
        const size_t r = a.size();
        const int64_t mm = in.type.shape[r - 2], nn = in.type.shape[r - 1], k = ta ? a[r - 2] : a[r - 1];
        int64_t batches = 1;
        for (size_t d = 0; d + 2 < r; ++d) batches *= a[d];
        if (HasBf16Operands(m_, in))
          ParallelBf16Matmul(ta, tb, batches, mm, nn, k, static_cast<const uint16_t*>(P(0)), a[r - 1],
                             a[r - 2] * a[r - 1], static_cast<const uint16_t*>(P(1)), b[r - 1], b[r - 2] * b[r - 1],
                             static_cast<float*>(out));
        else
          ParallelBf16Matmul(ta, tb, batches, mm, nn, k, static_cast<const float*>(P(0)), a[r - 1],
                             a[r - 2] * a[r - 1], static_cast<const float*>(P(1)), b[r - 1], b[r - 2] * b[r - 1],
                             static_cast<float*>(out));
        return;
      }
      if (in.type.dtype == DType::kBF16) {  // widen (exact), f32 sgemm, round to nearest even
        auto widen = [&](int i) {
          const uint16_t* h = static_cast<const uint16_t*>(P(i));
          std::vector<float> w(m_.type(in.operands[i]).elements());
          for (size_t j = 0; j < w.size(); ++j) w[j] = runtime::Bf16ToF32(h[j]);
          return w;
        };
        const std::vector<float> a = widen(0), b = widen(1);
        std::vector<float> y(in.type.elements());
        BatchedMatmul(in, shape(0), shape(1), a.data(), b.data(), y.data());
        for (size_t j = 0; j < y.size(); ++j) static_cast<uint16_t*>(out)[j] = runtime::F32ToBf16(y[j]);
        return;
      }
      BatchedMatmul(in, shape(0), shape(1), static_cast<const float*>(P(0)), static_cast<const float*>(P(1)),
                    static_cast<float*>(out));
      return;
    case OpCode::kRandomUniform:
      RandomUniform(static_cast<uint64_t>(in.GetInt("seed")), static_cast<const int32_t*>(P(0))[0],
                    static_cast<const int32_t*>(P(1))[0], in.type.shape, static_cast<float*>(out));
      return;
    case OpCode::kScatterAdd: {
      const int64_t count = m_.type(in.operands[0]).elements(), rows = in.type.shape[0];
      const int64_t width = rows ? in.type.elements() / rows : 0;
      const int32_t* idx = static_cast<const int32_t*>(P(0));
      if (in.type.dtype == DType::kF32)
        ScatterAdd<float>(idx, count, static_cast<const float*>(P(1)), rows, width, static_cast<float*>(out));
      else
        ScatterAdd<int32_t>(idx, count, static_cast<const int32_t*>(P(1)), rows, width, static_cast<int32_t*>(out));
      return;
    }
    case OpCode::kAttention:
    case OpCode::kAttentionGrad: {
      const Shape& x = shape(0);
      AttentionShape a;
      a.heads_in = in.GetInt(kHeadsInAttr, 0);  // (names within std::string's short form: no allocation)
      a.heads_out = in.GetInt(kHeadsOutAttr, 0);
      a.t = a.heads_in > 0 ? x[1] : x[x.size() - 2];  // [B, T, H, D] (AttentionHeadsInPlace) or [..., T, D]
      a.d = x.back();
      a.heads = a.t * a.d == 0 ? 0 : m_.type(in.operands[0]).elements() / (a.t * a.d);
      a.scale = static_cast<float>(in.GetFloat("scale"));
      a.causal = in.GetInt("causal", 0) != 0;
      a.bf16 = in.GetInt("bf16", 0) != 0;
      for (size_t i = 0; i < in.operands.size() && i < a.stored_bf16.size(); ++i)  // ReadBf16OperandsInPlace
        a.stored_bf16[i] = m_.type(in.operands[i]).dtype == DType::kBF16;
      a.bf16_out = in.type.dtype == DType::kBF16;  // AttentionHeadsInPlace took a rounding transpose
      AttentionStats stats;  // PlanAttentionStats
      if (attention_stats_at_[v] >= 0) {
        stats.max = ws->attention_stats.data() + attention_stats_at_[v];
        stats.inv_sum = stats.max + a.heads * a.t;
      }
      if (in.op == OpCode::kAttention) return AttentionForward(a, P(0), P(1), P(2), out, &stats);
      if (grad_parts_of_[v] < 0)
        return AttentionBackward(a, P(0), P(1), P(2), P(3), static_cast<float*>(out), nullptr, &stats);
      const GradParts& gp = grad_parts_[grad_parts_of_[v]];  // PlanAttentionGradParts
      AttentionGradParts parts;
      for (int i = 0; i < 3; ++i) {
        parts.bf16[i] = gp.bf16[i] >= 0 ? static_cast<uint16_t*>(ws->ptr[gp.bf16[i]]) : nullptr;
        parts.sums[i] = gp.sums[i] >= 0 ? static_cast<float*>(ws->ptr[gp.sums[i]]) : nullptr;
      }
      parts.f32 = gp.f32;
      parts.block_rows = gp.block_rows;
      AttentionBackward(a, P(0), P(1), P(2), P(3), static_cast<float*>(out), &parts, &stats);
      return;
    }
    case OpCode::kDiv:  // s32 (f32 division is fused)
      DivS32(static_cast<const int32_t*>(P(0)), static_cast<const int32_t*>(P(1)), in.type.elements(),
             static_cast<int32_t*>(out));
      return;
    default: SS_CHECK(false, "no native lowering for ", ir::OpName(in.op));
  }
}

TensorMap CompiledStep::Run(TensorMap& variables, const TensorMap& inputs, int replica, runtime::Collectives* c,
                            Workspace* ws, int batch_parts) const {
  TensorMap outputs;
  Run(variables, inputs, replica, c, ws, batch_parts, &outputs);
  return outputs;
}

void CompiledStep::Run(TensorMap& variables, const TensorMap& inputs, int replica, runtime::Collectives* c,
                       Workspace* ws, int batch_parts, TensorMap* outputs) const {
  StepBinding& b = ws->binding;
  BindVariables(variables, &b);
  BindInputs(inputs, &b);
  BindOutputs(outputs, &b);
  Run(b, replica, c, ws, batch_parts);
}

void CompiledStep::MakeBf16WeightCopies(TensorMap& state) const {
  for (const auto& [copy, weight] : bf16_copies_) {
    const ir::TensorType& type = m_.type(m_.FindVariable(copy));
    auto w = state.find(weight);
    SS_CHECK(w != state.end() && w->second.type.dtype == DType::kF32 && w->second.type.shape == type.shape,
             "the bf16 copy of @", weight, " needs the weight, f32", ir::ShapeToString(type.shape));
    Tensor& t = state[copy];
    if (!(t.type == type)) t = Tensor(type);
    const std::vector<float>& x = w->second.f32;
    for (size_t i = 0; i < x.size(); ++i) t.bf16[i] = runtime::F32ToBf16(x[i]);
  }
}

void CompiledStep::BindVariables(TensorMap& variables, StepBinding* b) const {
  BindSlots(variables, variable_names_, "variable", [&](size_t i) -> const ir::TensorType& { return m_.type(variable_leaf_[i]); },
            &b->variables);
}

void CompiledStep::BindInputs(const TensorMap& inputs, StepBinding* b) const {
  BindSlots(inputs, input_names_, "input", [&](size_t i) -> const ir::TensorType& { return m_.type(input_leaf_[i]); },
            &b->inputs);
}

void CompiledStep::BindOutputs(TensorMap* outputs, StepBinding* b) const {
  b->outputs.resize(m_.outputs.size());
  for (size_t i = 0; i < m_.outputs.size(); ++i) {
    const auto& [name, v] = m_.outputs[i];
    auto it = outputs->find(name);
    if (it == outputs->end() || !(it->second.type == m_.type(v))) it = outputs->insert_or_assign(name, Tensor(m_.type(v))).first;
    b->outputs[i] = &it->second;
  }
}

void CompiledStep::Run(const StepBinding& b, int replica, runtime::Collectives* c, Workspace* ws, int batch_parts) const {
  if (replica < 0 || replica >= m_.num_replicas)
    throw Error(Str("replica ", replica, " out of range [0,", m_.num_replicas, ")"));
  if (c && c->num_replicas() != m_.num_replicas)
    throw Error(Str("module '", m_.name, "' runs on ", m_.num_replicas, " replicas but the collectives connect ",
                    c->num_replicas()));
  if (b.variables.size() != variable_names_.size() || b.inputs.size() != input_names_.size() ||
      b.outputs.size() != m_.outputs.size())
    throw Error(Str("module '", m_.name, "': the binding has ", b.variables.size(), " variables, ", b.inputs.size(),
                    " inputs and ", b.outputs.size(), " outputs; the step has ", variable_names_.size(), ", ",
                    input_names_.size(), " and ", m_.outputs.size(), " (bind them first)"));
  for (size_t i = 0; i < m_.outputs.size(); ++i)  // before the step: a bad binding must not half-run it
    if (!(b.outputs[i]->type == m_.type(m_.outputs[i].second)))
      throw Error(Str("output \"", m_.outputs[i].first, "\": bound to a ", b.outputs[i]->type.ToString(), " tensor, the step writes ",
                      m_.type(m_.outputs[i].second).ToString()));
  if (ws->owner != this) Allocate(ws);
  // The slot table: arena and own storage (a swap at the end of the last step moved the latter).
  char* base = ArenaBase(ws);
  for (ValueId v = 0; v < m_.size(); ++v) {
    if (offset_[v] >= 0) ws->ptr[v] = base + offset_[v];
    else if (ws->is_owned[v]) ws->ptr[v] = ws->owned[v].raw();
  }
  StepContext ctx;
  ctx.slots = ws->ptr.data();
  ctx.step = this;
  ctx.binding = &b;
  ctx.replica = replica;
  ctx.collectives = c;
  ctx.ws = ws;
  ctx.batch_parts = batch_parts;
  ctx.packs = b.packs;
  ctx.run = ++ws->runs;
  if (driver_(&ctx) != 0) std::rethrow_exception(ctx.error);
  for (size_t i = 0; i < m_.outputs.size(); ++i) {
    Tensor& t = *b.outputs[i];
    if (t.bytes() != 0) std::memcpy(t.raw(), ws->ptr[m_.outputs[i].second], t.bytes());  // an empty output has no storage (null)
  }
  Assign(b, ws);
}

// Assignments see the values from before the step: all were computed above, and PlanAssignments
// ordered the copies so that a variable read in place is read before it is overwritten (staging the
// sources of cycles first). An owned value assigned once and not an output is swapped in; anything
// else is copied.
void CompiledStep::Assign(const StepBinding& b, Workspace* ws) const {
  for (size_t i = 0; i < m_.assigns.size(); ++i) {
    if (staging_offset_[i] < 0) continue;
    const ValueId v = m_.assigns[i].second;
    std::memcpy(ws->staging.data() + staging_offset_[i], ws->ptr[v], m_.type(v).bytes());
  }
  for (int i : assign_order_) {
    const auto& [var, v] = m_.assigns[i];
    if (in_place_[v]) continue;  // its kernel wrote it there
    Tensor& dst = *b.variables[assign_slot_[i]];
    SS_CHECK(dst.type == m_.at(var).type, "assign to @", m_.at(var).name, " changes its type");
    Tensor& src = ws->owned[v];
    if (staging_offset_[i] >= 0) {
      std::memcpy(dst.raw(), ws->staging.data() + staging_offset_[i], dst.bytes());
    } else if (swappable_[v] && ws->is_owned[v] && src.type == dst.type && ws->ptr[v] == src.raw()) {
      std::swap(dst.f32, src.f32);
      std::swap(dst.s32, src.s32);
      std::swap(dst.bf16, src.bf16);
    } else {
      std::memmove(dst.raw(), ws->ptr[v], dst.bytes());
    }
  }
}

std::string EmitLlvmIr(const ir::Module& module) {
  ir::Module m = module;
  ir::ElementwiseFuser().Run(m);
  auto step = CompiledStep::Compile(m, JitOptions{"", false, true});
  JitOptions o;
  o.disk_cache = false;
  auto jit = JitCompiler::Create(o);
  llvm::LLVMContext ctx;
  auto mod = step->Emit(ctx, "step");
  std::vector<std::string> remarks;
  jit->Optimize(*mod, &remarks);
  std::string s;
  llvm::raw_string_ostream os(s);
  os << "; " << step->kernels().size() << " fused kernels and the step driver @" << kStepDriverName
     << "; loop-vectorize remarks:\n";
  for (const std::string& r : remarks) os << ";   " << r << "\n";
  mod->print(os, nullptr);
  return os.str();
}

}  // namespace shardstep::jit
