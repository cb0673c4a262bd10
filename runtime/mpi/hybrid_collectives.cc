// HybridCollectives: K ranks x T replica threads, folded in global replica order (see the header).
#include "runtime/mpi/hybrid_collectives.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <set>
#include <thread>
#include <vector>

#include "ir/error.h"

namespace shardstep::runtime {
namespace {

enum class Kind { kReduceScatter, kAllGather, kBroadcast, kBarrier };

const char* KindName(Kind k) {
  switch (k) {
    case Kind::kReduceScatter: return "reduce-scatter";
    case Kind::kAllGather: return "all-gather";
    case Kind::kBroadcast: return "broadcast";
    case Kind::kBarrier: return "barrier";
  }
  return "?";
}

void Check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(Str(call, " failed: ", std::string(text, len)));
}

std::string GroupString(const ReplicaGroup& group) {
  std::string s = "{";
  for (size_t i = 0; i < group.size(); ++i) s += (i ? "," : "") + std::to_string(group[i]);
  return s + "}";
}

MPI_Comm& CommOf(void*& p) { return *static_cast<MPI_Comm*>(p); }

}  // namespace

struct HybridCollectives::Call {
  Kind kind;
  int64_t n;
  Reduction op;
  int root;
  const float* in;
  bool operator==(const Call& o) const { return kind == o.kind && n == o.n && op == o.op && root == o.root; }
};

struct HybridCollectives::Group {
  struct Peer {
    int rank;
    std::vector<int> positions;  // of its members, in group order
    std::vector<float> send, recv;
  };
  ReplicaGroup members;
  std::vector<int> rank_of, index_on_rank;  // per position: the rank, the index among that rank's members
  std::vector<int> local_positions;         // this rank's members, in group order
  std::vector<int> peer_of_rank;            // rank -> index in peers, or -1
  std::vector<Peer> peers;                  // the other ranks with members, by rank
  int tag = 0;
  int size() const { return static_cast<int>(members.size()); }
  int locals() const { return static_cast<int>(local_positions.size()); }

  // The local meeting (Exchange, then Done).
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0, finished = 0;
  uint64_t generation = 0, finished_generation = 0;
  std::vector<Call> calls;  // per local member

  // Where member position q's piece for local member `me` (local index) is, after the exchange:
  // reduce-scatter's chunk p (q's chunk for `me`'s position), or all-gather's whole input.
  const float* Source(int q, int me, int my_rank, int64_t n, bool chunked) const {
    if (rank_of[q] == my_rank) {
      const Call& c = calls[index_on_rank[q]];
      return chunked ? c.in + static_cast<int64_t>(local_positions[me]) * n : c.in;
    }
    const Peer& peer = peers[peer_of_rank[rank_of[q]]];
    const int64_t piece = chunked ? int64_t{index_on_rank[q]} * locals() + me : index_on_rank[q];
    return peer.recv.data() + piece * n;
  }
};

HybridCollectives::HybridCollectives(int replicas_per_process, double timeout_seconds)
    : per_rank_(replicas_per_process), timeout_seconds_(timeout_seconds), comm_(new MPI_Comm(MPI_COMM_NULL)) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw Error("HybridCollectives needs MPI to be initialised first (an MpiSession)");
  if (per_rank_ < 1) throw Error(Str("--replicas-per-process must be at least 1, got ", per_rank_));
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks_);
  Check(MPI_Comm_dup(MPI_COMM_WORLD, &CommOf(comm_)), "MPI_Comm_dup");
}

HybridCollectives::~HybridCollectives() {
  if (CommOf(comm_) != MPI_COMM_NULL) MPI_Comm_free(&CommOf(comm_));
  delete static_cast<MPI_Comm*>(comm_);
}

HybridCollectives::Group& HybridCollectives::GroupFor(int replica, const ReplicaGroup& group, const char* what,
                                                      int* local) {
  if (replica / per_rank_ != rank_ || replica < 0)
    throw Error(Str(what, ": replica ", replica, " does not run on rank ", rank_, " (replicas ", first_replica(), "..",
                    first_replica() + per_rank_ - 1, ")"));
  std::lock_guard lk(groups_mu_);
  auto& g = groups_[group];
  if (!g) {
    const std::set<int64_t> unique(group.begin(), group.end());
    if (unique.size() != group.size() || group.empty() || *unique.begin() < 0 || *unique.rbegin() >= num_replicas()) {
      groups_.erase(group);
      throw Error(Str(what, ": invalid replica group ", GroupString(group),
                      ": members must be distinct replica ids in [0, ", num_replicas(), ")"));
    }
    auto ng = std::make_unique<Group>();
    ng->members = group;
    ng->peer_of_rank.assign(ranks_, -1);
    std::vector<int> count(ranks_, 0);
    for (int q = 0; q < ng->size(); ++q) {
      const int r = static_cast<int>(group[q] / per_rank_);
      ng->rank_of.push_back(r);
      ng->index_on_rank.push_back(count[r]++);
      if (r == rank_) {
        ng->local_positions.push_back(q);
      } else {
        if (ng->peer_of_rank[r] < 0) ng->peer_of_rank[r] = 0;  // numbered below, by rank
      }
    }
    for (int r = 0; r < ranks_; ++r)
      if (ng->peer_of_rank[r] == 0) {
        ng->peer_of_rank[r] = static_cast<int>(ng->peers.size());
        ng->peers.push_back({r, {}, {}, {}});
      }
    for (int q = 0; q < ng->size(); ++q)
      if (ng->rank_of[q] != rank_) ng->peers[ng->peer_of_rank[ng->rank_of[q]]].positions.push_back(q);
    ng->calls.resize(ng->local_positions.size());
    ng->tag = static_cast<int>(1 + std::hash<std::string>()(GroupString(group)) % 32000);
    g = std::move(ng);
  }
  const auto it = std::find(group.begin(), group.end(), replica);
  if (it == group.end()) throw Error(Str(what, ": replica ", replica, " is not in replica group ", GroupString(group)));
  const int position = static_cast<int>(it - group.begin());
  *local = g->index_on_rank[position];
  return *g;
}

void HybridCollectives::Exchange(Group& g, int local, const Call& call) {
  std::unique_lock lk(g.mu);
  g.calls[local] = call;
  if (++g.arrived < g.locals()) {
    const uint64_t gen = g.generation;
    g.cv.wait(lk, [&] { return g.generation != gen; });
    return;
  }
  for (int i = 1; i < g.locals(); ++i)
    if (!(g.calls[i] == g.calls[0]))
      Abort(Str("collective mismatch in replica group ", GroupString(g.members), ": replica ",
                g.members[g.local_positions[0]], " called ", KindName(g.calls[0].kind), "(n=", g.calls[0].n,
                ") but replica ", g.members[g.local_positions[i]], " called ", KindName(g.calls[i].kind), "(n=",
                g.calls[i].n, ")"));
  RunExchange(g);
  g.arrived = 0;
  ++g.generation;
  g.cv.notify_all();
}

void HybridCollectives::Done(Group& g) {
  if (g.locals() == 1) return;
  std::unique_lock lk(g.mu);
  if (++g.finished == g.locals()) {
    g.finished = 0;
    ++g.finished_generation;
    g.cv.notify_all();
    return;
  }
  const uint64_t gen = g.finished_generation;
  g.cv.wait(lk, [&] { return g.finished_generation != gen; });
}

// Runs at the last local arrival: one message each way with every peer rank that needs one.
void HybridCollectives::RunExchange(Group& g) {
  const Call& c = g.calls[0];
  const int64_t n = c.n;
  const int locals = g.locals();
  std::vector<MPI_Request> requests;
  std::vector<std::pair<const float*, int64_t>> pieces;
  const int root_rank = c.kind == Kind::kBroadcast ? g.rank_of[c.root] : -1;
  std::unique_lock mpi(mpi_mu_);
  for (Group::Peer& peer : g.peers) {
    const int64_t theirs = static_cast<int64_t>(peer.positions.size());
    bool send = true, recv = true;
    int64_t recv_count = 0;
    pieces.clear();
    switch (c.kind) {
      case Kind::kReduceScatter:  // my members' chunks for each of theirs, mine outer
        for (int li = 0; li < locals; ++li)
          for (int p : peer.positions) pieces.push_back({g.calls[li].in + static_cast<int64_t>(p) * n, n});
        recv_count = theirs * locals * n;
        break;
      case Kind::kAllGather:
        for (int li = 0; li < locals; ++li) pieces.push_back({g.calls[li].in, n});
        recv_count = theirs * n;
        break;
      case Kind::kBroadcast:
        send = root_rank == rank_;
        recv = peer.rank == root_rank;
        if (send) pieces.push_back({g.calls[g.index_on_rank[c.root]].in, n});
        recv_count = recv ? n : 0;
        break;
      case Kind::kBarrier:
        break;
    }
    if (recv) {
      if (recv_count > INT_MAX)
        throw Error(Str(KindName(c.kind), ": ", recv_count, " elements do not fit one MPI message"));
      peer.recv.resize(recv_count);
      requests.emplace_back();
      Check(MPI_Irecv(peer.recv.data(), static_cast<int>(recv_count), MPI_FLOAT, peer.rank, g.tag, CommOf(comm_),
                      &requests.back()),
            "MPI_Irecv");
    }
    if (send) {
      // Merge adjacent pieces; one piece is sent from the caller's buffer, several are packed.
      std::vector<std::pair<const float*, int64_t>> merged;
      for (const auto& pc : pieces) {
        if (!merged.empty() && merged.back().first + merged.back().second == pc.first)
          merged.back().second += pc.second;
        else
          merged.push_back(pc);
      }
      const float* buf = nullptr;
      int64_t count = 0;
      if (merged.size() == 1) {
        buf = merged[0].first, count = merged[0].second;
      } else if (merged.size() > 1) {
        peer.send.clear();
        for (const auto& [p, k] : merged) peer.send.insert(peer.send.end(), p, p + k);
        buf = peer.send.data(), count = static_cast<int64_t>(peer.send.size());
      }
      if (count > INT_MAX) throw Error(Str(KindName(c.kind), ": ", count, " elements do not fit one MPI message"));
      requests.emplace_back();
      Check(MPI_Isend(buf, static_cast<int>(count), MPI_FLOAT, peer.rank, g.tag, CommOf(comm_), &requests.back()),
            "MPI_Isend");
      bytes_sent_ += count * static_cast<int64_t>(sizeof(float));
    }
  }
  const auto start = std::chrono::steady_clock::now();
  for (int polls = 0;; ++polls) {
    int done = 0;
    Check(MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    if (done) return;
    mpi.unlock();  // other groups' exchanges may progress meanwhile
    if (polls < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (timeout_seconds_ > 0 && waited > timeout_seconds_)
        Abort(Str(KindName(c.kind), " over replicas ", GroupString(g.members), " did not complete within ",
                  timeout_seconds_, " s (--collective-timeout): another rank is hung or gone"));
    }
    mpi.lock();
  }
}

void HybridCollectives::ReduceScatter(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n,
                                      Reduction op) {
  int me;
  Group& g = GroupFor(replica, group, "reduce-scatter", &me);
  if (n < 0) throw Error(Str("reduce-scatter: negative element count ", n));
  Exchange(g, me, {Kind::kReduceScatter, n, op, 0, in});
  std::copy_n(g.Source(0, me, rank_, n, true), n, out);
  for (int q = 1; q < g.size(); ++q) {
    const float* x = g.Source(q, me, rank_, n, true);
    if (op == Reduction::kMax) {
      for (int64_t j = 0; j < n; ++j) out[j] = FoldMax(out[j], x[j]);
    } else {
      for (int64_t j = 0; j < n; ++j) out[j] += x[j];
    }
  }
  if (op == Reduction::kMean) {
    const float d = static_cast<float>(g.size());
    for (int64_t j = 0; j < n; ++j) out[j] /= d;
  }
  Done(g);
}

void HybridCollectives::AllGather(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n) {
  int me;
  Group& g = GroupFor(replica, group, "all-gather", &me);
  if (n < 0) throw Error(Str("all-gather: negative element count ", n));
  Exchange(g, me, {Kind::kAllGather, n, Reduction::kSum, 0, in});
  for (int q = 0; q < g.size(); ++q)
    std::copy_n(g.Source(q, me, rank_, n, false), n, out + static_cast<int64_t>(q) * n);
  Done(g);
}

void HybridCollectives::AllReduce(int replica, const ReplicaGroup& group, float* data, int64_t n, Reduction op) {
  // Shards of ceil(n / size), the last ones zero-padded; padding never reaches `data`.
  const int64_t size = static_cast<int64_t>(group.size());
  const int64_t shard = size > 0 ? (n + size - 1) / size : 0;
  std::vector<float> padded(static_cast<size_t>(shard * size), 0.0f), reduced(shard);
  std::copy_n(data, n, padded.data());
  ReduceScatter(replica, group, padded.data(), reduced.data(), shard, op);
  AllGather(replica, group, reduced.data(), padded.data(), shard);
  std::copy_n(padded.data(), n, data);
}

void HybridCollectives::Broadcast(int replica, const ReplicaGroup& group, float* data, int64_t n, int root) {
  int me;
  Group& g = GroupFor(replica, group, "broadcast", &me);
  if (root < 0 || root >= g.size())
    throw Error(Str("broadcast: root position ", root, " is outside replica group ", GroupString(group)));
  Exchange(g, me, {Kind::kBroadcast, n, Reduction::kSum, root, data});
  if (g.local_positions[me] != root) {
    const float* src = g.rank_of[root] == rank_ ? g.calls[g.index_on_rank[root]].in
                                                : g.peers[g.peer_of_rank[g.rank_of[root]]].recv.data();
    std::copy_n(src, n, data);
  }
  Done(g);
}

void HybridCollectives::Barrier(int replica, const ReplicaGroup& group) {
  int me;
  Group& g = GroupFor(replica, group, "barrier", &me);
  Exchange(g, me, {Kind::kBarrier, 0, Reduction::kSum, 0, nullptr});
  Done(g);
}

void HybridCollectives::Abort(const std::string& why) {
  std::fprintf(stderr, "shardstep: rank %d failed: %s\n", rank_, why.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

}  // namespace shardstep::runtime
