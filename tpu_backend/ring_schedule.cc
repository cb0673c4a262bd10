#include "tpu_backend/ring_schedule.h"

#include <algorithm>

#include "ir/error.h"

namespace shardstep::tpu {
namespace {

int64_t Mod(int64_t a, int64_t p) { return ((a % p) + p) % p; }

// Position of `replica` along `axis`, and the replica's coordinates as the phases before `axis` see
// them (which part of the buffer it works on).
int PositionAlong(const MeshTopology& mesh, int replica, MeshAxis axis) {
  const CoreCoord c = mesh.CoordOf(replica);
  return axis == MeshAxis::kX ? c.x : axis == MeshAxis::kY ? c.y : c.core;
}

// One phase: bidirectional rings along `axis`, each member working on p chunks of `chunk` floats
// starting at base[replica]. Appends p - 1 steps to `out`.
void AppendPhase(const MeshTopology& mesh, MeshAxis axis, int64_t chunk, const std::vector<int64_t>& base,
                 bool reduce, RingSchedule* out) {
  const int p = mesh.AxisSize(axis);
  if (p < 2 || chunk == 0) return;
  const int64_t low = (chunk + 1) / 2, high = chunk - low;
  const auto groups = mesh.GroupsAlong(axis);
  for (int s = 0; s < p - 1; ++s) {
    std::vector<Transfer> step;
    for (const auto& g : groups)
      for (int i = 0; i < p; ++i) {
        const int me = static_cast<int>(g[i]);
        // +ring: the low half of a chunk to the next member; -ring: the high half to the previous one.
        const int64_t up = reduce ? Mod(i - s - 1, p) : Mod(i - s, p);
        const int64_t down = reduce ? Mod(i + s + 1, p) : Mod(i + s, p);
        if (low > 0)
          step.push_back(Transfer{me, static_cast<int>(g[Mod(i + 1, p)]), axis, +1, base[me] + up * chunk, low, reduce});
        if (high > 0)
          step.push_back(
              Transfer{me, static_cast<int>(g[Mod(i - 1, p)]), axis, -1, base[me] + down * chunk + low, high, reduce});
      }
    out->steps.push_back(std::move(step));
  }
}

void CheckShard(int64_t shard) {
  if (shard < 0) throw Error(Str("a ring collective needs a non-negative shard size, got ", shard));
}

}  // namespace

RingSchedule AxisReduceScatter(const MeshTopology& mesh, MeshAxis axis, int64_t shard) {
  CheckShard(shard);
  RingSchedule out{Str("reduce-scatter along ", AxisName(axis), " of ", mesh.ToString(), ", shard ", shard), {}};
  AppendPhase(mesh, axis, shard, std::vector<int64_t>(mesh.replicas(), 0), true, &out);
  return out;
}

RingSchedule AxisAllGather(const MeshTopology& mesh, MeshAxis axis, int64_t shard) {
  CheckShard(shard);
  RingSchedule out{Str("all-gather along ", AxisName(axis), " of ", mesh.ToString(), ", shard ", shard), {}};
  AppendPhase(mesh, axis, shard, std::vector<int64_t>(mesh.replicas(), 0), false, &out);
  return out;
}

namespace {

// The phases of the whole-mesh collectives, in reduce-scatter order, with each replica's region start
// and chunk size per phase: region sizes shrink by the axis size at each phase.
struct Phase {
  MeshAxis axis;
  int64_t chunk;
  std::vector<int64_t> base;
};

std::vector<Phase> MeshPhases(const MeshTopology& mesh, int64_t shard) {
  std::vector<Phase> phases;
  std::vector<int64_t> base(mesh.replicas(), 0);
  int64_t region = shard * mesh.replicas();
  for (MeshAxis axis : {MeshAxis::kCore, MeshAxis::kX, MeshAxis::kY}) {
    const int p = mesh.AxisSize(axis);
    const int64_t chunk = region / p;
    phases.push_back(Phase{axis, chunk, base});
    for (int r = 0; r < mesh.replicas(); ++r) base[r] += PositionAlong(mesh, r, axis) * chunk;
    region = chunk;
  }
  return phases;
}

}  // namespace

RingSchedule MeshReduceScatter(const MeshTopology& mesh, int64_t shard) {
  CheckShard(shard);
  RingSchedule out{Str("reduce-scatter over ", mesh.ToString(), ", shard ", shard), {}};
  for (const Phase& ph : MeshPhases(mesh, shard)) AppendPhase(mesh, ph.axis, ph.chunk, ph.base, true, &out);
  return out;
}

RingSchedule MeshAllGather(const MeshTopology& mesh, int64_t shard) {
  CheckShard(shard);
  RingSchedule out{Str("all-gather over ", mesh.ToString(), ", shard ", shard), {}};
  const std::vector<Phase> phases = MeshPhases(mesh, shard);
  for (auto it = phases.rbegin(); it != phases.rend(); ++it) AppendPhase(mesh, it->axis, it->chunk, it->base, false, &out);
  return out;
}

int64_t LinkTraffic::TotalLinkBytes() const {
  int64_t t = 0;
  for (int64_t b : bytes) t += b;
  return t;
}

int64_t LinkTraffic::MaxLinkBytes() const { return bytes.empty() ? 0 : *std::max_element(bytes.begin(), bytes.end()); }

void RunSchedule(const MeshTopology& mesh, const RingSchedule& schedule, const std::vector<float*>& buffers,
                 int64_t buffer_elements, LinkTraffic* traffic, runtime::Reduction op) {
  if (static_cast<int>(buffers.size()) != mesh.replicas())
    throw Error(Str(schedule.name, ": ", buffers.size(), " buffers for ", mesh.replicas(), " replicas"));
  const size_t links = mesh.Links().size();
  if (traffic->bytes.size() != links) {
    traffic->bytes.assign(links, 0);
    traffic->messages.assign(links, 0);
  }
  std::vector<float> staged;
  for (const auto& step : schedule.steps) {
    // Read every sender's data first: transfers of a step happen together.
    staged.clear();
    for (const Transfer& t : step) {
      if (t.offset < 0 || t.count < 0 || t.offset + t.count > buffer_elements)
        throw Error(Str(schedule.name, ": a transfer of ", t.count, " floats at ", t.offset, " leaves the buffer of ",
                        buffer_elements));
      if (mesh.Neighbor(t.from, t.axis, t.dir) != t.to)
        throw Error(Str(schedule.name, ": replicas ", t.from, " and ", t.to, " are not neighbours along ",
                        AxisName(t.axis)));
      staged.insert(staged.end(), buffers[t.from] + t.offset, buffers[t.from] + t.offset + t.count);
      const int64_t bytes = t.count * static_cast<int64_t>(sizeof(float));
      if (t.axis == MeshAxis::kCore) {
        traffic->on_chip_bytes += bytes;
        ++traffic->on_chip_messages;
      } else {
        const int link = mesh.LinkIndex(mesh.LinkBetween(t.from, t.to, t.axis, t.dir));
        traffic->bytes[link] += bytes;
        ++traffic->messages[link];
      }
    }
    const float* in = staged.data();
    for (const Transfer& t : step) {
      float* dst = buffers[t.to] + t.offset;
      if (t.accumulate && op == runtime::Reduction::kMax) {
        for (int64_t j = 0; j < t.count; ++j) dst[j] = runtime::FoldMax(in[j], dst[j]);
      } else if (t.accumulate) {
        for (int64_t j = 0; j < t.count; ++j) dst[j] += in[j];
      } else {
        std::copy_n(in, t.count, dst);
      }
      in += t.count;
    }
    ++traffic->steps;
  }
}

}  // namespace shardstep::tpu
