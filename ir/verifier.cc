// Verifier: walks a module once and throws shardstep::Error at the first broken invariant.
//
// Every message starts "module @name: " and names the value ("%12 (reduce_scatter): ") or the module
// entry ("assign %0 = %6: "), then the attribute and its bad value. Attributes are read here from the
// raw map (never through Instr::GetInt and friends, which abort on a wrong type).
#include "ir/verifier.h"

#include <set>

#include "ir/error.h"
#include "ir/printer.h"
#include "ir/shape_inference.h"
#include "ir/shard_format.h"

namespace shardstep::ir {
namespace {

constexpr int64_t kMaxBytes = int64_t{1} << 62;

std::string Where(const Module& m, ValueId id) { return Str("%", id, " (", OpName(m.instrs[id].op), ")"); }

// "" when `shape` has non-negative dimensions and `element_bytes` * its element count fits in 2^62.
std::string SizeProblem(const Shape& shape, int64_t element_bytes) {
  int64_t bytes = element_bytes;
  for (int64_t d : shape) {
    if (d < 0) return Str("has a negative dimension ", d);
    if (__builtin_mul_overflow(bytes, d, &bytes) || bytes > kMaxBytes) {
      bytes = -1;
      break;
    }
  }
  if (bytes < 0) {
    for (int64_t d : shape)
      if (d == 0) return "";  // empty, whatever the other dimensions
    return "has more than 2^62 bytes";
  }
  return "";
}

class InstrVerifier {
 public:
  InstrVerifier(const Module& m, ValueId id) : m_(m), id_(id), in_(m.instrs[id]) {}

  [[noreturn]] void Fail(const std::string& why) const {
    throw Error(Str("module ", PrintName(m_.name), ": ", Where(m_, id_), ": ", why));
  }

  void Run(std::set<std::string>* variables, std::set<std::string>* inputs) {
    Structure(variables, inputs);
    Type();
    CommonAttrs();
    if (in_.op == OpCode::kVariable) ShardSpec();
    if (HasProperty(in_.op, kCollective)) Collective();
    if (in_.op == OpCode::kMatmul)
      for (const char* key : {"transpose_a", "transpose_b"})
        if (const AttrValue* v = Find(key); v && !(Int(key) == 0 || Int(key) == 1))
          Fail(Str("attribute '", key, "'=", PrintAttrValue(*v), " must be 0 or 1"));
  }

 private:
  const AttrValue* Find(const char* key) const {
    auto it = in_.attrs.find(key);
    return it == in_.attrs.end() ? nullptr : &it->second;
  }
  std::string Shown(const char* key) const { return Str("attribute '", key, "'=", PrintAttrValue(*Find(key))); }
  int64_t Int(const char* key) const {
    const AttrValue* v = Find(key);
    if (auto* i = std::get_if<int64_t>(v)) return *i;
    Fail(Str(Shown(key), " must be an integer"));
  }
  const std::string& String(const char* key) const {
    const AttrValue* v = Find(key);
    if (auto* s = std::get_if<std::string>(v)) return *s;
    Fail(Str(Shown(key), " must be a string"));
  }
  IntList Ints(const char* key) const {
    const AttrValue* v = Find(key);
    if (auto* l = std::get_if<IntList>(v)) return *l;
    Fail(Str(Shown(key), " must be a list of integers such as [8,2]"));
  }

  void Structure(std::set<std::string>* variables, std::set<std::string>* inputs) const {
    for (ValueId o : in_.operands)
      if (o < 0 || o >= id_) Fail(Str("operand %", o, " is not defined before use"));
    const int arity = OpArity(in_.op), n = static_cast<int>(in_.operands.size());
    if (HasProperty(in_.op, kLeaf) && n != 0) Fail(Str("a leaf takes no operands, got ", n));
    if (arity >= 0 && n != arity) Fail(Str("takes ", arity, arity == 1 ? " operand" : " operands", ", got ", n));
    if (arity < 0 && n < 1) Fail("takes at least 1 operand, got 0");
    if (in_.op == OpCode::kVariable || in_.op == OpCode::kInput) {
      auto* names = in_.op == OpCode::kVariable ? variables : inputs;
      if (in_.name.empty()) Fail("has no name");
      if (!names->insert(in_.name).second) Fail(Str("name ", PrintName(in_.name), " is used twice"));
    }
  }

  void Type() const {
    if (std::string why = SizeProblem(in_.type.shape, DTypeBytes(in_.type.dtype)); !why.empty())
      Fail(Str("type ", in_.type.ToString(), " ", why));
    std::vector<TensorType> types;
    for (ValueId o : in_.operands) types.push_back(m_.instrs[o].type);
    TensorType inferred;
    try {
      inferred = InferType(in_.op, types, in_.attrs, &in_.type);
    } catch (const Error& e) {
      Fail(e.what());
    }
    if (inferred != in_.type)
      Fail(Str("recorded type ", in_.type.ToString(), " but its operands give ", inferred.ToString()));
  }

  // Attributes any op may carry.
  void CommonAttrs() const {
    if (Find("role")) String("role");
    if (Find(kFusionKey) && Int(kFusionKey) < 0) Fail(Str(Shown(kFusionKey), " must be a non-negative integer"));
  }
  static constexpr const char* kFusionKey = "fusion";  // ElementwiseFuser's group id (ir/passes/elementwise_fuser.h)

  // A sharded variable's spec (ir/shard_format.h): what the runtime reshards checkpoints with.
  void ShardSpec() const {
    const char* keys[] = {"shard_format", "shard_count", "logical_shape"};
    int present = 0;
    for (const char* k : keys) present += Find(k) != nullptr;
    if (present == 0) return;
    for (const char* k : keys)
      if (!Find(k))
        Fail(Str("a sharded variable needs 'shard_format', 'shard_count' and 'logical_shape'; '", k, "' is missing"));
    const std::string& format = String("shard_format");
    const int64_t count = Int("shard_count");
    const Shape logical = Ints("logical_shape");
    if (format != "dim0" && format != "flat") Fail(Str(Shown("shard_format"), " must be \"dim0\" or \"flat\""));
    if (count < 1 || count > m_.num_replicas || m_.num_replicas % count != 0)
      Fail(Str(Shown("shard_count"), " must divide replicas=", m_.num_replicas));
    if (std::string why = SizeProblem(logical, DTypeBytes(in_.type.dtype)); !why.empty())
      Fail(Str(Shown("logical_shape"), " ", why));
    if (in_.type.dtype != DType::kF32) Fail(Str("a sharded variable must be f32, got ", in_.type.ToString()));
    const ShardFormat f = ShardFormat::For(logical, count);
    if (format != f.kind())
      Fail(Str(Shown("shard_format"), " but logical_shape=", ShapeToString(logical),
               f.flat ? Str(" does not split along dimension 0 into ", count, " parts (expected \"flat\")")
                      : Str(" splits along dimension 0 into ", count, " parts (expected \"dim0\")")));
    const TensorType shard{in_.type.dtype, f.ShardShape()};
    if (in_.type != shard)
      Fail(Str("type ", in_.type.ToString(), " is not a shard of logical_shape=", ShapeToString(logical), " in ", count,
               " parts (", f.kind(), ": expected ", shard.ToString(), ")"));
  }

  // collective_permute's pairs: a partial permutation of the replicas.
  void Pairs() const {
    const int n = m_.num_replicas;
    const AttrValue* v = Find("pairs");
    if (!v) Fail("missing attribute 'pairs' (a list of [source,target] replica pairs such as [[0,1],[1,0]])");
    auto* lists = std::get_if<IntLists>(v);
    if (!lists && !(std::get_if<IntList>(v) && std::get_if<IntList>(v)->empty()))
      Fail(Str(Shown("pairs"), " must be a list of [source,target] replica pairs such as [[0,1],[1,0]]"));
    std::vector<char> source(n, 0), target(n, 0);
    for (const auto& pair : lists ? *lists : IntLists{}) {
      if (pair.size() != 2) Fail(Str(Shown("pairs"), " has an entry of ", pair.size(), " replicas, not [source,target]"));
      for (int64_t r : pair)
        if (r < 0 || r >= n) Fail(Str(Shown("pairs"), " names replica ", r, ", outside [0, replicas=", n, ")"));
      if (source[pair[0]]++) Fail(Str(Shown("pairs"), " names replica ", pair[0], " as a source twice"));
      if (target[pair[1]]++) Fail(Str(Shown("pairs"), " names replica ", pair[1], " as a target twice"));
    }
    for (const char* key : {"groups", "group_size", "reduction"})
      if (Find(key)) Fail(Str(Shown(key), ": collective_permute takes pairs, not groups or a reduction"));
  }

  // Replica groups, group size, packing count and reduction of a collective.
  void Collective() const {
    if (in_.op == OpCode::kCollectivePermute) return Pairs();
    const int n = m_.num_replicas;
    int64_t size = n;
    if (const AttrValue* g = Find("groups")) {
      auto* lists = std::get_if<IntLists>(g);
      auto* flat = std::get_if<IntList>(g);
      if (!lists && !(flat && flat->empty()))
        Fail(Str(Shown("groups"), " must be a list of replica lists such as [[0,1],[2,3]]"));
      if (lists) {
        std::vector<char> seen(n, 0);
        for (const auto& group : *lists) {
          if (group.empty()) Fail(Str(Shown("groups"), " has an empty group"));
          if (group.size() != lists->front().size())
            Fail(Str(Shown("groups"), " has groups of different sizes (", lists->front().size(), " and ", group.size(),
                     ")"));
          for (int64_t r : group) {
            if (r < 0 || r >= n) Fail(Str(Shown("groups"), " names replica ", r, ", outside [0, replicas=", n, ")"));
            if (seen[r]++) Fail(Str(Shown("groups"), " names replica ", r, " twice"));
          }
        }
        for (int r = 0; r < n; ++r)
          if (!seen[r]) Fail(Str(Shown("groups"), " leaves out replica ", r, " (every replica must be in one group)"));
        size = static_cast<int64_t>(lists->front().size());
      }
    }
    if (Find("group_size") && Int("group_size") != size)
      Fail(Str(Shown("group_size"), " but the replica groups have ", size, " replicas each"));
    if (Find("combined") && Int("combined") < 1) Fail(Str(Shown("combined"), " must be a positive integer"));
    if (in_.op == OpCode::kAllGather && Find("reduction")) Fail(Str(Shown("reduction"), ": all_gather does not reduce"));
  }

  const Module& m_;
  ValueId id_;
  const Instr& in_;
};

// gradient/assign entries: (variable, value) pairs, each variable at most once.
void VerifyUpdates(const Module& m, const std::vector<std::pair<ValueId, ValueId>>& entries, const char* what) {
  std::set<ValueId> seen;
  for (const auto& [var, v] : entries) {
    auto fail = [&, var = var, v = v](const std::string& why) {  // init-captures: clang 14 cannot capture bindings
      throw Error(Str("module ", PrintName(m.name), ": ", what, " %", var, " = %", v, ": ", why));
    };
    if (var < 0 || var >= m.size() || m.instrs[var].op != OpCode::kVariable)
      fail(Str("target %", var, " is not a variable"));
    if (v < 0 || v >= m.size()) fail(Str("value %", v, " is not defined"));
    const Instr& target = m.instrs[var];
    if (m.instrs[v].type != target.type)
      fail(Str("value type ", m.instrs[v].type.ToString(), " differs from variable ", PrintName(target.name), " type ",
               target.type.ToString()));
    if (!seen.insert(var).second) fail(Str("variable ", PrintName(target.name), " has a second ", what));
  }
}

}  // namespace

void Verify(const Module& m) {
  if (m.num_replicas < 1)
    throw Error(Str("module ", PrintName(m.name), ": replicas=", m.num_replicas, " must be at least 1"));
  std::set<std::string> variables, inputs;
  for (ValueId id = 0; id < m.size(); ++id) InstrVerifier(m, id).Run(&variables, &inputs);
  VerifyUpdates(m, m.gradients, "gradient");
  VerifyUpdates(m, m.assigns, "assign");
  std::set<std::string> outputs;
  for (const auto& [name, v] : m.outputs) {
    auto fail = [&, &name = name, v = v](const std::string& why) {  // init-captures: clang 14 cannot capture bindings
      throw Error(Str("module ", PrintName(m.name), ": output ", PrintName(name), " = %", v, ": ", why));
    };
    if (v < 0 || v >= m.size()) fail(Str("value %", v, " is not defined"));
    if (!outputs.insert(name).second) fail("output name used twice");
  }
}

}  // namespace shardstep::ir
