// MeshCollectives: the rendezvous, then the ring schedules on every member's buffer (see the header).
#include "tpu_backend/mesh_collectives.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include "ir/error.h"

namespace shardstep::tpu {

using runtime::Reduction;
using runtime::ReplicaGroup;

namespace {

std::string GroupText(const ReplicaGroup& g) {
  std::string s = "{";
  for (size_t i = 0; i < g.size(); ++i) s += Str(i ? "," : "", g[i]);
  return s + "}";
}

const char* KindName(int kind) {
  static const char* const names[] = {"all-reduce", "reduce-scatter", "all-gather", "broadcast", "barrier"};
  return names[kind];
}

}  // namespace

struct MeshCollectives::Group {
  ReplicaGroup members;
  bool whole = false;  // the whole mesh in replica order; else a ring along `axis`
  MeshAxis axis = MeshAxis::kX;
  std::vector<Call> posted;  // by group position
  int arrived = 0;
  uint64_t generation = 0;  // bumped when a collective of this group completes
  std::map<std::pair<bool, int64_t>, RingSchedule> schedules;  // by (reduce, shard)
  std::vector<std::vector<float>> scratch;  // by group position
};

MeshCollectives::MeshCollectives(const MeshTopology& mesh) : mesh_(mesh) {
  traffic_.bytes.assign(mesh_.Links().size(), 0);
  traffic_.messages.assign(mesh_.Links().size(), 0);
}

MeshCollectives::~MeshCollectives() = default;

LinkTraffic MeshCollectives::traffic() const {
  std::lock_guard<std::mutex> lock(mu_);
  return traffic_;
}

void MeshCollectives::ResetTraffic() {
  std::lock_guard<std::mutex> lock(mu_);
  traffic_ = LinkTraffic{};
  traffic_.bytes.assign(mesh_.Links().size(), 0);
  traffic_.messages.assign(mesh_.Links().size(), 0);
}

int64_t MeshCollectives::calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_;
}

void MeshCollectives::Abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!aborted_) {
    aborted_ = true;
    why_ = why;
  }
  mailboxes_.Abort(why_);
  cv_.notify_all();
}

void MeshCollectives::Permute(int replica, int to, const float* send, int from, float* recv, int64_t n,
                              int direction) {
  runtime::CheckPermute("tpu-mesh", mesh_.replicas(), replica, to, from, n);
  if (to >= 0 && to != replica) {
    const CoreCoord a = mesh_.CoordOf(replica), b = mesh_.CoordOf(to);
    const int dir = direction < 0 ? -1 : +1;
    std::optional<Link> link;
    if (a.x != b.x || a.y != b.y) {
      for (MeshAxis axis : {MeshAxis::kX, MeshAxis::kY})
        for (int d : {dir, -dir})
          if (!link && mesh_.Neighbor(replica, axis, d) == to) link = mesh_.LinkBetween(replica, to, axis, d);
      if (!link)
        throw Error(Str("tpu-mesh: collective_permute from replica ", replica, " (chip ", a.x, ",", a.y, " core ", a.core,
                        ") to replica ", to, " (chip ", b.x, ",", b.y, " core ", b.core,
                        "): not torus neighbours along x or y nor cores of one chip, on the mesh of ", mesh_.ToString()));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_) ThrowAborted();
      if (n > 0) {
        const int64_t bytes = n * static_cast<int64_t>(sizeof(float));
        if (link) {
          const int l = mesh_.LinkIndex(*link);
          traffic_.bytes[l] += bytes;
          ++traffic_.messages[l];
        } else {
          traffic_.on_chip_bytes += bytes;
          ++traffic_.on_chip_messages;
        }
      }
    }
    mailboxes_.Send(replica, to, send, n);
  } else if (to == replica) {
    mailboxes_.Send(replica, to, send, n);  // to itself: no wire
  }
  if (from >= 0) mailboxes_.Receive(from, replica, recv, n);
  else std::fill_n(recv, n, 0.0f);
}

void MeshCollectives::ThrowAborted() const { throw Error(why_); }

void MeshCollectives::AllReduce(int replica, const ReplicaGroup& group, float* data, int64_t n, Reduction op) {
  Run(replica, group, Call{Kind::kAllReduce, data, data, n, op, 0});
}

void MeshCollectives::AllReduce(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n,
                                Reduction op) {
  Run(replica, group, Call{Kind::kAllReduce, in, out, n, op, 0});
}

void MeshCollectives::ReduceScatter(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n,
                                    Reduction op) {
  Run(replica, group, Call{Kind::kReduceScatter, in, out, n, op, 0});
}

void MeshCollectives::AllGather(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n) {
  Run(replica, group, Call{Kind::kAllGather, in, out, n, Reduction::kSum, 0});
}

void MeshCollectives::Broadcast(int replica, const ReplicaGroup& group, float* data, int64_t n, int root) {
  Run(replica, group, Call{Kind::kBroadcast, data, data, n, Reduction::kSum, root});
}

void MeshCollectives::Barrier(int replica, const ReplicaGroup& group) { Run(replica, group, Call{}); }

void MeshCollectives::Run(int replica, const ReplicaGroup& group, const Call& call) {
  std::unique_lock<std::mutex> lock(mu_);
  if (aborted_) ThrowAborted();
  auto it = groups_.find(group);
  if (it == groups_.end()) {
    // Which ring: the whole mesh, or one group along an axis (checked once per group).
    auto g = std::make_unique<Group>();
    g->members = group;
    for (int64_t r : group)
      if (r < 0 || r >= mesh_.replicas())
        throw Error(Str("tpu-mesh: replica group ", GroupText(group), " names replica ", r, " outside the mesh of ",
                        mesh_.ToString()));
    if (group == mesh_.AllReplicas()) {
      g->whole = true;
    } else if (group.size() > 1) {
      bool found = false;
      for (MeshAxis a : {MeshAxis::kCore, MeshAxis::kX, MeshAxis::kY}) {
        const auto along = mesh_.GroupsAlong(a);
        if (std::find(along.begin(), along.end(), group) != along.end()) {
          g->axis = a;
          found = true;
          break;
        }
      }
      if (!found)
        throw Error(Str("tpu-mesh: replica group ", GroupText(group), " is neither the whole mesh (", mesh_.ToString(),
                        ") nor a group along one of its axes (x, y or the cores of a chip)"));
    }
    g->posted.resize(group.size());
    g->scratch.resize(group.size());
    it = groups_.emplace(group, std::move(g)).first;
  }
  Group& g = *it->second;
  const auto pos_it = std::find(group.begin(), group.end(), replica);
  if (pos_it == group.end())
    throw Error(Str("tpu-mesh: replica ", replica, " called a collective of group ", GroupText(group),
                    " it is not a member of"));
  g.posted[pos_it - group.begin()] = call;
  const uint64_t generation = g.generation;
  if (++g.arrived < static_cast<int>(group.size())) {
    cv_.wait(lock, [&] { return aborted_ || g.generation != generation; });
    if (g.generation == generation) ThrowAborted();
    return;
  }
  // The last arrival runs the collective for everyone.
  g.arrived = 0;
  const Call& c0 = g.posted[0];
  for (size_t p = 1; p < g.posted.size(); ++p) {
    const Call& c = g.posted[p];
    if (c.kind != c0.kind || c.n != c0.n || c.op != c0.op || c.root != c0.root) {
      aborted_ = true;
      why_ = Str("tpu-mesh: the members of replica group ", GroupText(group), " called different collectives: ",
                 KindName(static_cast<int>(c0.kind)), " of ", c0.n, " floats (position 0) and ",
                 KindName(static_cast<int>(c.kind)), " of ", c.n, " floats (position ", p, ")");
      cv_.notify_all();
      ThrowAborted();
    }
  }
  try {
    Execute(g);
  } catch (const Error& e) {
    aborted_ = true;
    why_ = e.what();
    cv_.notify_all();
    throw;
  }
  ++calls_;
  ++g.generation;
  cv_.notify_all();
}

const RingSchedule& MeshCollectives::ScheduleOf(Group& g, bool reduce, int64_t shard) {
  auto key = std::make_pair(reduce, shard);
  auto it = g.schedules.find(key);
  if (it != g.schedules.end()) return it->second;
  RingSchedule s;
  if (g.whole) {
    s = reduce ? MeshReduceScatter(mesh_, shard) : MeshAllGather(mesh_, shard);
  } else {
    // The axis schedule serves every group along the axis at once: keep this group's transfers.
    const RingSchedule all = reduce ? AxisReduceScatter(mesh_, g.axis, shard) : AxisAllGather(mesh_, g.axis, shard);
    const std::set<int64_t> members(g.members.begin(), g.members.end());
    s.name = Str(all.name, ", group ", GroupText(g.members));
    for (const auto& step : all.steps) {
      std::vector<Transfer> kept;
      for (const Transfer& t : step)
        if (members.count(t.from)) kept.push_back(t);
      s.steps.push_back(std::move(kept));
    }
  }
  return g.schedules.emplace(key, std::move(s)).first->second;
}

void MeshCollectives::Execute(Group& g) {
  const Call& c = g.posted[0];
  const int size = static_cast<int>(g.members.size());
  const int64_t n = c.n;
  if (c.kind == Kind::kBarrier) return;
  if (c.kind == Kind::kBroadcast && (c.root < 0 || c.root >= size))
    throw Error(Str("tpu-mesh: broadcast root ", c.root, " outside replica group ", GroupText(g.members)));
  if (size == 1) {
    const int64_t count = c.kind == Kind::kBroadcast ? 0 : n;
    if (c.in != c.out && count > 0) std::copy_n(c.in, count, c.out);
    return;
  }
  std::vector<float*> buffers(mesh_.replicas(), nullptr);
  // Each member's chunk: n floats for reduce-scatter / all-gather / broadcast, ceil(n / size) padded for
  // all-reduce (the same reduce-scatter + all-gather on a zero-padded buffer).
  const int64_t shard = c.kind == Kind::kAllReduce ? (n + size - 1) / size : n;
  const int64_t total = shard * size;
  for (int p = 0; p < size; ++p) {
    std::vector<float>& s = g.scratch[p];
    s.assign(total, 0.0f);
    const Call& cp = g.posted[p];
    if (c.kind == Kind::kReduceScatter || c.kind == Kind::kAllReduce)
      std::copy_n(cp.in, c.kind == Kind::kAllReduce ? n : total, s.data());
    else
      std::copy_n(cp.in, n, s.data() + p * shard);  // all-gather and broadcast: the member's own chunk
    buffers[g.members[p]] = s.data();
  }
  const bool reduces = c.kind == Kind::kReduceScatter || c.kind == Kind::kAllReduce;
  if (reduces) {
    RunSchedule(mesh_, ScheduleOf(g, true, shard), buffers, total, &traffic_, c.op);
    if (c.op == Reduction::kMean) {
      const float d = static_cast<float>(size);
      for (int p = 0; p < size; ++p)
        for (int64_t j = 0; j < shard; ++j) g.scratch[p][p * shard + j] /= d;
    }
  }
  if (c.kind == Kind::kReduceScatter) {
    for (int p = 0; p < size; ++p) std::copy_n(g.scratch[p].data() + p * shard, shard, g.posted[p].out);
    return;
  }
  RunSchedule(mesh_, ScheduleOf(g, false, shard), buffers, total, &traffic_);
  for (int p = 0; p < size; ++p) {
    const Call& cp = g.posted[p];
    if (c.kind == Kind::kAllGather) std::copy_n(g.scratch[p].data(), total, cp.out);
    if (c.kind == Kind::kAllReduce) std::copy_n(g.scratch[p].data(), n, cp.out);
    if (c.kind == Kind::kBroadcast) std::copy_n(g.scratch[p].data() + c.root * shard, n, cp.out);
  }
}

}  // namespace shardstep::tpu
