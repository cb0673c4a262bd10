// ElementwiseFuser: groups chains of elementwise ops over one shape into fusion groups.
//
// Algorithm (one pass in module order):
//  1. Drop any previous "fusion" attributes (the pass is idempotent).
//  2. For each fusible instruction v (IsFusible), try the groups of its operands, first operand
//     first: v joins group g when g's members have v's shape and joining creates no cycle, i.e. no
//     operand of v outside g depends (through non-members) on a member of g. Otherwise v starts a
//     new group. Further operand groups of v's shape are merged into v's group when no path leaves
//     one and re-enters the other (so independent chains that meet, like Adam's m and v updates,
//     end up in one loop).
//  3. Number the groups densely in order of their first member and write "fusion"=<id>.
// Why: the optimizer update of a tensor (Adam: ~15 elementwise ops) becomes one loop over memory
// instead of one loop per op, so it moves 7 words per parameter instead of ~40. Broadcasts join
// the loop too: a scalar (rank-0 value, splat constant) is read once per kernel, any other operand
// through an index map, so neither is materialised at the output's size.
// Not fused (yet): reductions, so a trailing full reduction (a norm) is its own pass over memory.
// A comparison whose grouped operands are written to memory anyway (a non-fusible op reads them) does
// not join their group: it starts its own, which its consumers join. relu's gradient mask (y > 0) is
// then computed in the backward loop from y, which the next layer read anyway, instead of being
// written by the forward loop as one more tensor and read back. Forward uses still merge back in.
#include "ir/passes/elementwise_fuser.h"

#include <algorithm>
#include <vector>

namespace shardstep::ir {

bool IsFusible(const Module& m, ValueId v) {
  const Instr& in = m.at(v);
  if (in.op == OpCode::kBroadcast) return true;  // the loop reads its operand through an index map
  if (!HasProperty(in.op, kElementwise)) return false;
  if (in.op == OpCode::kDiv && in.type.dtype == DType::kS32) return false;
  return true;
}

namespace {

bool IsComparison(OpCode op) {
  return op == OpCode::kEq || op == OpCode::kNe || op == OpCode::kLt || op == OpCode::kLe || op == OpCode::kGt ||
         op == OpCode::kGe;
}

// Values some non-fusible op reads, or the module returns or assigns: in memory whatever the fuser does.
// (Sums and means do not count: the JIT may fuse them with the loop producing their operand.)
std::vector<char> Materialised(const Module& m) {
  std::vector<char> out(m.size(), 0);
  for (const auto& [name, v] : m.outputs) out[v] = 1;
  for (const auto& [var, v] : m.assigns) out[v] = 1;
  for (ValueId u = 0; u < m.size(); ++u) {
    const Instr& in = m.at(u);
    if (IsFusible(m, u) || in.op == OpCode::kReduceSum || in.op == OpCode::kReduceMean) continue;
    for (ValueId o : in.operands) out[o] = 1;
  }
  return out;
}

// Which groups each value depends on: for value v, a bitset over group ids of the groups its
// ancestors-or-self were put in when they were visited (a value is visited once, in module order, and
// gets its set then). Groups merge by relabelling their members; `ids[g]` lists the ids of the groups
// merged into g, so "v depends on a member of g" is "v's set meets ids[g]". This is what a backward
// walk from v would find (a member of g among v's ancestors: the walk returned at the first one), in
// time independent of the module's size: on a bert-large step the walks took seconds.
class GroupDeps {
 public:
  explicit GroupDeps(int n) : offset_(n + 1, 0), words_(n, 0) {}

  // Record v's set, once its group is decided (`group`: -1 or v's group id; `groups`: ids in use).
  void Visit(const Module& m, ValueId v, int group, size_t groups) {
    const size_t words = (groups + 63) / 64;
    offset_[v] = bits_.size();
    words_[v] = words;
    bits_.resize(bits_.size() + words, 0);
    uint64_t* d = bits_.data() + offset_[v];
    for (ValueId o : m.at(v).operands) {
      const uint64_t* od = bits_.data() + offset_[o];
      for (size_t w = 0; w < words_[o]; ++w) d[w] |= od[w];
    }
    if (group >= 0) d[group / 64] |= uint64_t{1} << (group % 64);
  }
  // Does visited value v depend on (or is it) a member of any group whose id is in `ids`?
  bool Meets(ValueId v, const std::vector<int>& ids) const {
    const uint64_t* d = bits_.data() + offset_[v];
    for (int i : ids)
      if (static_cast<size_t>(i / 64) < words_[v] && ((d[i / 64] >> (i % 64)) & 1)) return true;
    return false;
  }

 private:
  std::vector<uint64_t> bits_;
  std::vector<size_t> offset_, words_;
};

}  // namespace

bool ElementwiseFuser::Run(Module& m) {
  bool had = false;
  for (Instr& in : m.instrs) had |= in.attrs.erase(kFusionAttr) > 0;
  const int n = m.size();
  std::vector<int> group(n, -1);
  std::vector<ValueId> first;             // per group: its first member (groups only grow downwards)
  std::vector<std::vector<ValueId>> members;
  std::vector<std::vector<int>> ids;      // per group: the group ids merged into it (itself included)
  std::vector<Shape> shape;
  GroupDeps deps(n);
  const std::vector<char> materialised = Materialised(m);
  // Would operand `p` of a member of `into` (or of the new member) close a cycle through group `g`?
  // (Does p depend on a member of g through a path that leaves the group: p is not in g, so any path.)
  auto reaches = [&](ValueId p, int g) { return deps.Meets(p, ids[g]); };
  // May groups a and b become one? Only if no path leaves one and enters the other.
  auto can_merge = [&](int a, int b) {
    for (int x : {a, b}) {
      const int y = x == a ? b : a;
      for (ValueId v : members[x])
        for (ValueId p : m.at(v).operands)
          if (group[p] != a && group[p] != b && reaches(p, y)) return false;
    }
    return true;
  };
  for (ValueId v = 0; v < n; ++v) {
    if (!IsFusible(m, v)) {
      deps.Visit(m, v, -1, first.size());
      continue;
    }
    const Instr& in = m.at(v);
    bool own_group = IsComparison(in.op);
    for (ValueId o : in.operands) own_group &= group[o] < 0 || materialised[o];
    int chosen = -1;
    for (ValueId o : in.operands) {
      const int g = group[o];
      if (own_group || g < 0 || g == chosen || shape[g] != in.type.shape) continue;
      if (chosen < 0) {
        // v joins g unless one of its other operands depends on g through a non-member.
        bool cycle = false;
        for (ValueId p : in.operands)
          if (group[p] != g && reaches(p, g)) { cycle = true; break; }
        if (!cycle) chosen = g;
      } else if (can_merge(chosen, g)) {
        // A second operand group: merge it into the chosen one (v's own operands are checked below).
        bool cycle = false;
        for (ValueId p : in.operands)
          if (group[p] != g && group[p] != chosen && (reaches(p, g) || reaches(p, chosen))) { cycle = true; break; }
        if (cycle) continue;
        for (ValueId x : members[g]) group[x] = chosen;
        members[chosen].insert(members[chosen].end(), members[g].begin(), members[g].end());
        members[g].clear();
        ids[chosen].insert(ids[chosen].end(), ids[g].begin(), ids[g].end());
        ids[g].clear();
        first[chosen] = std::min(first[chosen], first[g]);
      }
    }
    if (chosen < 0) {
      chosen = static_cast<int>(first.size());
      first.push_back(v);
      members.emplace_back();
      shape.push_back(in.type.shape);
      ids.push_back({chosen});
    }
    group[v] = chosen;
    members[chosen].push_back(v);
    deps.Visit(m, v, chosen, first.size());
  }
  // Dense ids in order of each group's first member.
  std::vector<int> id(first.size(), -1);
  int next = 0;
  for (ValueId v = 0; v < n; ++v)
    if (group[v] >= 0 && id[group[v]] < 0) id[group[v]] = next++;
  for (ValueId v = 0; v < n; ++v)
    if (group[v] >= 0) m.at(v).attrs[kFusionAttr] = static_cast<int64_t>(id[group[v]]);
  return had || next > 0;
}

}  // namespace shardstep::ir
