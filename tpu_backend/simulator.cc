#include "tpu_backend/simulator.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <queue>
#include <sstream>
#include <tuple>

#include "ir/cost.h"
#include "ir/error.h"
#include "ir/memory_plan.h"
#include "ir/passes/elementwise_fuser.h"

namespace shardstep::tpu {
namespace {

constexpr int kWholeMesh = -1;

// One collective's cost on the mesh: its α–β time and what it puts on the wires.
struct CollectiveCost {
  ScheduleTime time;
  std::vector<int64_t> link_bytes;  // per directed link (MeshTopology::LinkIndex)
  int64_t max_on_chip_bytes = 0;    // the busiest ordered pair of cores of a chip
  int64_t messages = 0;             // inter-chip transfers
};

void AddTraffic(const MeshTopology& mesh, const RingSchedule& s, CollectiveCost* c) {
  std::map<std::pair<int, int>, int64_t> pairs;
  for (const auto& step : s.steps)
    for (const Transfer& t : step) {
      const int64_t bytes = t.count * static_cast<int64_t>(sizeof(float));
      if (t.axis == MeshAxis::kCore) {
        pairs[{t.from, t.to}] += bytes;
        continue;
      }
      c->link_bytes[mesh.LinkIndex(mesh.LinkBetween(t.from, t.to, t.axis, t.dir))] += bytes;
      ++c->messages;
    }
  int64_t busiest = 0;
  for (const auto& [pair, b] : pairs) busiest = std::max(busiest, b);
  c->max_on_chip_bytes += busiest;
}

// A reduce-scatter's or all-gather's cost is affine in its shard within each parity: every ring step moves
// chunks of m·shard floats split into halves of ceil and floor (m·shard)/2, the busiest link carries the
// ceil half (times the cores sharing it), and α–β time is affine in bytes. So schedules are generated and
// timed (TimeOf) for the shards 1 to 4 only, and a larger shard's cost is interpolated exactly between 1
// and 3 (odd) or 2 and 4 (even): a 2048-core schedule has ~10^5 transfers and a step has dozens of sizes.
// An all-reduce is a reduce-scatter and an all-gather of the same shard.
class CollectiveCoster {
 public:
  CollectiveCoster(const MeshTopology& mesh, const HardwareTable& hw) : mesh_(mesh), hw_(hw) {}

  // axis: kWholeMesh or a MeshAxis; elements: the operand's per replica.
  CollectiveCost Cost(ir::OpCode op, int axis, int64_t elements) {
    const int64_t group = axis == kWholeMesh ? mesh_.replicas() : mesh_.AxisSize(static_cast<MeshAxis>(axis));
    // reduce-scatter: a buffer of group * shard elements; all-gather: a shard; all-reduce: the smallest
    // shard whose group copies cover the buffer (the padding travels too).
    const int64_t shard = op == ir::OpCode::kAllGather ? elements : (elements + group - 1) / group;
    CollectiveCost c;
    c.link_bytes.assign(mesh_.Links().size(), 0);
    if (op != ir::OpCode::kAllGather) Add(Piece(true, axis, shard), &c);
    if (op != ir::OpCode::kReduceScatter) Add(Piece(false, axis, shard), &c);
    return c;
  }

 private:
  static void Add(const CollectiveCost& p, CollectiveCost* c) {
    c->time.seconds += p.time.seconds;
    c->time.steps += p.time.steps;
    c->time.max_link_bytes_per_step = std::max(c->time.max_link_bytes_per_step, p.time.max_link_bytes_per_step);
    for (size_t l = 0; l < c->link_bytes.size(); ++l) c->link_bytes[l] += p.link_bytes[l];
    c->max_on_chip_bytes += p.max_on_chip_bytes;
    c->messages += p.messages;
  }

  CollectiveCost Piece(bool reduce, int axis, int64_t shard) {
    if (shard <= 4) return Direct(reduce, axis, shard);
    const int64_t a = shard % 2 ? 1 : 2, b = a + 2, k = (shard - a) / 2;  // shard = a + k·(b - a)
    const CollectiveCost& ca = Direct(reduce, axis, a);
    const CollectiveCost& cb = Direct(reduce, axis, b);
    CollectiveCost c = cb;  // steps and messages: as for any shard >= 2
    c.time.seconds = ca.time.seconds + (cb.time.seconds - ca.time.seconds) * static_cast<double>(k);
    c.time.max_link_bytes_per_step =
        ca.time.max_link_bytes_per_step + (cb.time.max_link_bytes_per_step - ca.time.max_link_bytes_per_step) * k;
    for (size_t l = 0; l < c.link_bytes.size(); ++l)
      c.link_bytes[l] = ca.link_bytes[l] + (cb.link_bytes[l] - ca.link_bytes[l]) * k;
    c.max_on_chip_bytes = ca.max_on_chip_bytes + (cb.max_on_chip_bytes - ca.max_on_chip_bytes) * k;
    return c;
  }

  const CollectiveCost& Direct(bool reduce, int axis, int64_t shard) {
    const auto key = std::make_tuple(reduce, axis, shard);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    CollectiveCost c;
    c.link_bytes.assign(mesh_.Links().size(), 0);
    const RingSchedule s = axis == kWholeMesh ? (reduce ? MeshReduceScatter(mesh_, shard) : MeshAllGather(mesh_, shard))
                                              : (reduce ? AxisReduceScatter(mesh_, static_cast<MeshAxis>(axis), shard)
                                                        : AxisAllGather(mesh_, static_cast<MeshAxis>(axis), shard));
    c.time = TimeOf(mesh_, s, hw_.link, hw_.on_chip);
    AddTraffic(mesh_, s, &c);
    return cache_.emplace(key, std::move(c)).first->second;
  }

  const MeshTopology& mesh_;
  const HardwareTable& hw_;
  std::map<std::tuple<bool, int, int64_t>, CollectiveCost> cache_;
};

// The mesh axis whose groups `groups` are (kWholeMesh for none or one group of every replica).
int AxisOfGroups(const MeshTopology& mesh, const ir::IntLists& groups, const std::string& what) {
  if (groups.empty() || (groups.size() == 1 && static_cast<int>(groups[0].size()) == mesh.replicas()))
    return kWholeMesh;
  for (MeshAxis a : {MeshAxis::kX, MeshAxis::kY, MeshAxis::kCore}) {
    const std::vector<runtime::ReplicaGroup> along = mesh.GroupsAlong(a);
    if (along.size() != groups.size()) continue;
    bool same = true;
    for (size_t i = 0; i < groups.size() && same; ++i)
      same = std::vector<int64_t>(groups[i].begin(), groups[i].end()) == along[i];
    if (same) return static_cast<int>(a);
  }
  throw Error(Str("simulate: ", what, " has replica groups that are not the groups along one axis of the ",
                  mesh.ToString(), " mesh (not supported by the simulator)"));
}

enum class Phase { kLeaf, kForward, kBackward, kUpdate, kCollective };

std::string Ms(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", s * 1e3);
  return buf;
}
std::string MiB(int64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(b) / (1 << 20));
  return buf;
}

}  // namespace

ScheduleTime CollectiveTime(const MeshTopology& mesh, const HardwareTable& hw, ir::OpCode op, int64_t elements) {
  CollectiveCoster coster(mesh, hw);
  return coster.Cost(op, kWholeMesh, elements).time;
}

SimulationResult Simulate(const ir::Module& m, const MeshTopology& mesh, const HardwareTable& hw, Precision precision) {
  using ir::OpCode;
  using ir::ValueId;
  if (m.num_replicas != mesh.replicas())
    throw Error(Str("--mesh: the ", mesh.ToString(), " mesh has ", mesh.replicas(),
                    " cores but the step is lowered for ", m.num_replicas, " replicas"));
  if (hw.cores_per_chip != mesh.cores_per_chip())
    throw Error(
        Str("--hardware ", hw.name, ": ", hw.cores_per_chip, " cores per chip, the mesh has ", mesh.cores_per_chip()));
  const ValueId loss = m.FindOutput("loss");
  if (loss == ir::kNoValue) throw Error("simulate: the step has no \"loss\" output");
  const int n = m.size();

  // Phases (simulator.h).
  const std::vector<char> forward = ir::AncestorsOf(m, loss);
  std::vector<char> batch(n, 0), after_gradients(n, 0);
  std::vector<Phase> phase(n, Phase::kLeaf);
  std::vector<char> gradient_collective(n, 0);
  for (ValueId v = 0; v < n; ++v) {
    const ir::Instr& in = m.at(v);
    batch[v] = in.op == OpCode::kInput;
    bool after = false;
    for (ValueId o : in.operands) batch[v] |= batch[o], after = after || after_gradients[o];
    if (ir::HasProperty(in.op, ir::kLeaf)) continue;
    if (ir::HasProperty(in.op, ir::kCollective)) {
      phase[v] = Phase::kCollective;
      gradient_collective[v] = batch[v] && !forward[v] && !after;
      after_gradients[v] = after || gradient_collective[v];
      continue;
    }
    after_gradients[v] = after;
    phase[v] = forward[v] ? Phase::kForward : batch[v] && !after ? Phase::kBackward : Phase::kUpdate;
  }

  SimulationResult r;
  r.mesh = mesh.ToString();
  r.replicas = mesh.replicas();
  r.hardware = hw.name;
  r.precision = precision;

  // Durations. The fusion groups the backends run as one loop (attributes only: the same ops).
  ir::Module fused = m;
  ir::ElementwiseFuser().Run(fused);
  const FusionInfo fusion = FusionOf(fused);
  CollectiveCoster coster(mesh, hw);
  std::vector<double> duration(n, 0);
  std::vector<char> matrix_unit(n, 0), has_flops(n, 0);
  std::vector<int64_t> link_bytes(mesh.Links().size(), 0);
  for (ValueId v = 0; v < n; ++v) {
    const ir::Instr& in = m.at(v);
    if (phase[v] == Phase::kLeaf) continue;
    if (phase[v] == Phase::kCollective) {
      const int axis = AxisOfGroups(mesh, in.GetIntLists("groups"), Str("%", v, " = ", ir::OpName(in.op)));
      const CollectiveCost c = coster.Cost(in.op, axis, m.type(in.operands.at(0)).elements());
      duration[v] = c.time.seconds;
      for (size_t l = 0; l < link_bytes.size(); ++l) link_bytes[l] += c.link_bytes[l];
      r.max_on_chip_bytes += c.max_on_chip_bytes;
      r.link_messages += c.messages;
      ++r.collectives;
      (in.op == OpCode::kReduceScatter ? r.reduce_scatter_s
       : in.op == OpCode::kAllGather   ? r.all_gather_s
                                       : r.all_reduce_s) += duration[v];
      if (gradient_collective[v])
        r.gradient_collective_s += duration[v], r.gradient_bytes += m.type(in.operands[0]).bytes();
      r.collective_s += duration[v];
      continue;
    }
    const OpCost c = CostOfOp(m, v, hw, precision, &fusion);
    duration[v] = c.seconds;
    matrix_unit[v] = c.matrix_unit;
    has_flops[v] = c.flops > 0;
    (phase[v] == Phase::kForward    ? r.forward_s
     : phase[v] == Phase::kBackward ? r.backward_s
                                    : r.weight_update_s) += c.seconds;
    (phase[v] == Phase::kForward    ? r.forward_flops
     : phase[v] == Phase::kBackward ? r.backward_flops
                                    : r.weight_update_flops) += c.flops;
    r.compute_s += c.seconds;
  }
  for (const Link& l : mesh.Links()) {
    const int64_t b = link_bytes[mesh.LinkIndex(l)];
    r.total_link_bytes += b;
    int64_t& max = l.axis == MeshAxis::kX ? r.max_x_link_bytes : r.max_y_link_bytes;
    max = std::max(max, b);
  }

  // Two streams. An op becomes available when its last operand ends; each stream runs, among its
  // available ops whose time has come, the most urgent, and the earlier of the two streams' next starts
  // is committed first, so every commitment happens in time order. Urgent: on the compute stream, the
  // vector ops that only prepare a collective's operand (the combiner's concat, pad, reshape) come first,
  // as a latency-hiding scheduler issues collectives as early as it can; otherwise module order.
  std::vector<char> feeds_collective(n, 0);
  const std::vector<std::vector<ValueId>> users = m.Users();
  for (ValueId v = n - 1; v >= 0; --v) {
    if (phase[v] == Phase::kLeaf || phase[v] == Phase::kCollective || users[v].empty()) continue;
    if (matrix_unit[v]) continue;
    bool all = true;
    for (ValueId u : users[v]) all = all && (phase[u] == Phase::kCollective || feeds_collective[u]);
    feeds_collective[v] = all;
  }
  // On the interconnect stream, the collective whose result the earliest matrix-unit op (in module order,
  // through the vector ops between them: reshapes, bf16 converts) needs goes first: the deferred
  // all-gathers in the order the forward's matmuls use them; then module order.
  std::vector<int64_t> needed_by(n, 0);
  for (ValueId v = n - 1; v >= 0; --v) {
    needed_by[v] = int64_t{n} + v;
    for (ValueId u : users[v]) needed_by[v] = std::min(needed_by[v], matrix_unit[u] ? int64_t{u} : needed_by[u]);
  }
  auto rank = [&](ValueId v) -> int64_t {
    if (phase[v] == Phase::kCollective) return needed_by[v];
    return feeds_collective[v] ? v : int64_t{n} + v;
  };
  std::vector<int> waiting_for(n, 0);
  std::vector<double> available(n, 0);  // when the last operand ends
  using Ranked = std::pair<int64_t, ValueId>;
  struct Stream {
    double free = 0;
    // By availability time, then by rank; ready ones by rank.
    std::priority_queue<std::pair<double, Ranked>, std::vector<std::pair<double, Ranked>>, std::greater<>> pending;
    std::priority_queue<Ranked, std::vector<Ranked>, std::greater<>> ready;
    // The next op this stream would start and when (-1 when it has none); Take() commits it.
    std::pair<ValueId, double> Next() {
      while (!pending.empty() && pending.top().first <= free) ready.push(pending.top().second), pending.pop();
      if (!ready.empty()) return {ready.top().second, free};
      if (pending.empty()) return {-1, 0};
      return {pending.top().second.second, pending.top().first};  // idle until the earliest becomes available
    }
    void Take(double start, double duration) {
      if (!ready.empty())
        ready.pop();
      else
        pending.pop();
      free = start + duration;
    }
  } compute, interconnect;
  auto stream_of = [&](ValueId v) -> Stream& { return phase[v] == Phase::kCollective ? interconnect : compute; };
  std::function<void(ValueId, double)> finish;
  int left = 0;
  auto make_available = [&](ValueId v) {
    if (phase[v] == Phase::kLeaf) return finish(v, 0);
    stream_of(v).pending.push({available[v], {rank(v), v}});
  };
  finish = [&](ValueId v, double t) {
    for (ValueId u : users[v]) {
      available[u] = std::max(available[u], t);
      if (--waiting_for[u] == 0) make_available(u);
    }
  };
  for (ValueId v = 0; v < n; ++v) {
    waiting_for[v] = static_cast<int>(m.at(v).operands.size());
    if (phase[v] != Phase::kLeaf) ++left;
  }
  std::vector<ValueId> roots;  // collected first: a leaf's finish makes its users available
  for (ValueId v = 0; v < n; ++v)
    if (waiting_for[v] == 0) roots.push_back(v);
  for (ValueId v : roots) make_available(v);
  double step = 0;
  const bool trace = std::getenv("SHARDSTEP_SIMULATE_TRACE") != nullptr;  // the schedule, to stderr
  while (left > 0) {
    auto c = compute.Next();
    auto i = interconnect.Next();
    if (c.first < 0 && i.first < 0) throw Error("simulate: internal error: ops left but none available");
    const bool take_compute = i.first < 0 || (c.first >= 0 && c.second <= i.second);
    Stream& s = take_compute ? compute : interconnect;
    const ValueId v = take_compute ? c.first : i.first;
    if (trace && take_compute && c.second > compute.free + 1e-5)
      std::fprintf(stderr, "compute idle %.3f..%.3f ms before %%%d %s\n", compute.free * 1e3, c.second * 1e3, v,
                   ir::OpName(m.at(v).op));
    s.Take(take_compute ? c.second : i.second, duration[v]);
    if (trace && (!take_compute || duration[v] > 1e-4))
      std::fprintf(stderr, "%s %%%d %s %.3f..%.3f ms\n", take_compute ? "compute" : "interconnect", v,
                   ir::OpName(m.at(v).op), (s.free - duration[v]) * 1e3, s.free * 1e3);
    step = std::max(step, s.free);
    --left;
    finish(v, s.free);
  }
  r.step_s = step;
  r.exposed_communication_s = std::max(0.0, step - r.compute_s);

  // Memory per core.
  const ir::MemoryPlan plan = ir::PlanMemory(m);
  r.weight_bytes = plan.weight_bytes;
  r.optimizer_state_bytes = plan.optimizer_state_bytes;
  r.peak_temp_bytes = plan.peak_temp_bytes;
  std::vector<char> kept(n, 0);
  for (ValueId v = 0; v < n; ++v) {
    if (forward[v]) continue;
    for (ValueId o : m.at(v).operands)
      if (forward[o] && !ir::HasProperty(m.at(o).op, ir::kLeaf) && !kept[o])
        kept[o] = 1, r.activation_bytes += m.type(o).bytes();
  }
  r.hbm_capacity_bytes = static_cast<int64_t>(hw.hbm_bytes_per_chip / hw.cores_per_chip);
  return r;
}

std::string SimulationResult::ToText() const {
  std::ostringstream os;
  auto line = [&](const std::string& what, double s, const std::string& note = "") {
    char buf[160];
    std::snprintf(buf, sizeof buf, "  %-34s %10s ms", what.c_str(), Ms(s).c_str());
    os << buf << (note.empty() ? "" : "   " + note) << "\n";
  };
  auto tflops = [](int64_t flops, double s) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "%.3g TFLOP, %.1f TFLOP/s", static_cast<double>(flops) / 1e12,
                  s > 0 ? static_cast<double>(flops) / s / 1e12 : 0.0);
    return std::string(buf);
  };
  os << "simulated step on " << mesh << ", " << hardware << ", " << (precision == Precision::kBf16 ? "bf16" : "f32")
     << " matrix units\n";
  line("step", step_s);
  line("forward", forward_s, tflops(forward_flops, forward_s));
  line("backward", backward_s, tflops(backward_flops, backward_s));
  line("weight update", weight_update_s, tflops(weight_update_flops, weight_update_s));
  line("gradient reduce-scatter/all-reduce", gradient_collective_s);
  line("reduce-scatter (all)", reduce_scatter_s);
  line("all-reduce (all)", all_reduce_s);
  line("all-gather (all)", all_gather_s);
  line("collectives (interconnect busy)", collective_s, Str(collectives, " collectives"));
  line("exposed communication", exposed_communication_s);
  os << "memory per core (" << MiB(hbm_capacity_bytes) << " of HBM)\n"
     << "  weights " << MiB(weight_bytes) << ", gradients " << MiB(gradient_bytes) << ", optimizer state "
     << MiB(optimizer_state_bytes) << ", activations kept for the backward " << MiB(activation_bytes)
     << ", peak temporaries " << MiB(peak_temp_bytes) << "\n";
  os << "link traffic per step: busiest x link " << MiB(max_x_link_bytes) << ", busiest y link "
     << MiB(max_y_link_bytes) << ", all inter-chip links " << MiB(total_link_bytes) << " in " << link_messages
     << " messages, busiest core pair on chip " << MiB(max_on_chip_bytes) << "\n";
  return os.str();
}

std::string SimulationResult::ToJson() const {
  std::ostringstream os;
  auto num = [](double v) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.6g", v);
    return std::string(buf);
  };
  os << "{\"mesh\":\"" << mesh << "\",\"replicas\":" << replicas << ",\"hardware\":\"" << hardware
     << "\",\"precision\":\"" << (precision == Precision::kBf16 ? "bf16" : "f32")
     << "\",\"step_ms\":" << num(step_s * 1e3) << ",\"forward_ms\":" << num(forward_s * 1e3)
     << ",\"backward_ms\":" << num(backward_s * 1e3) << ",\"weight_update_ms\":" << num(weight_update_s * 1e3)
     << ",\"compute_ms\":" << num(compute_s * 1e3) << ",\"gradient_collective_ms\":" << num(gradient_collective_s * 1e3)
     << ",\"reduce_scatter_ms\":" << num(reduce_scatter_s * 1e3) << ",\"all_reduce_ms\":" << num(all_reduce_s * 1e3)
     << ",\"all_gather_ms\":" << num(all_gather_s * 1e3) << ",\"collective_ms\":" << num(collective_s * 1e3)
     << ",\"exposed_communication_ms\":" << num(exposed_communication_s * 1e3) << ",\"collectives\":" << collectives
     << ",\"flops\":{\"forward\":" << forward_flops << ",\"backward\":" << backward_flops
     << ",\"weight_update\":" << weight_update_flops << "},\"memory_bytes\":{\"weights\":" << weight_bytes
     << ",\"gradients\":" << gradient_bytes << ",\"optimizer_state\":" << optimizer_state_bytes
     << ",\"activations\":" << activation_bytes << ",\"peak_temporaries\":" << peak_temp_bytes
     << ",\"hbm_per_core\":" << hbm_capacity_bytes << "},\"link_traffic_bytes\":{\"max_x_link\":" << max_x_link_bytes
     << ",\"max_y_link\":" << max_y_link_bytes << ",\"all_links\":" << total_link_bytes
     << ",\"max_on_chip_pair\":" << max_on_chip_bytes << ",\"messages\":" << link_messages << "}}";
  return os.str();
}

}  // namespace shardstep::tpu
