#include "runtime/mpi/mpi_collectives.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <climits>
#include <cstdio>
#include <memory>

#include "ir/error.h"

namespace shardstep::runtime {
namespace {

void Check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(Str(call, " failed: ", std::string(text, len)));
}

int CountArg(int64_t n, const char* what) {
  if (n < 0 || n > INT_MAX) throw Error(Str(what, ": ", n, " elements do not fit one MPI message"));
  return static_cast<int>(n);
}

}  // namespace

MpiSession::MpiSession(int* argc, char*** argv) {
  int provided = 0;
  Check(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
  if (provided < MPI_THREAD_SERIALIZED) throw Error("this MPI library cannot be called from several threads in turn");
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
}

MpiSession::~MpiSession() { MPI_Finalize(); }

struct MpiCollectives::Comm {
  MPI_Comm comm = MPI_COMM_NULL;
  int position = 0, size = 0;
};

MpiCollectives::MpiCollectives(double timeout_seconds) : timeout_seconds_(timeout_seconds) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw Error("MpiCollectives needs MPI to be initialised first (an MpiSession)");
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
}

MpiCollectives::~MpiCollectives() {
  for (auto& [group, c] : comms_) {
    if (c->comm != MPI_COMM_NULL) MPI_Comm_free(&c->comm);
    delete c;
  }
}

const MpiCollectives::Comm& MpiCollectives::CommFor(int replica, const ReplicaGroup& group, const char* what) {
  if (replica != rank_)
    throw Error(Str(what, ": rank ", rank_, " runs replica ", rank_, ", not replica ", replica));
  auto it = comms_.find(group);
  if (it != comms_.end()) return *it->second;
  const auto pos = std::find(group.begin(), group.end(), replica);
  if (pos == group.end()) throw Error(Str(what, ": replica ", replica, " is not in its own group"));
  std::vector<int> ranks;
  for (int64_t r : group) {
    if (r < 0 || r >= size_) throw Error(Str(what, ": replica ", r, " of a group is not among the ", size_, " ranks"));
    ranks.push_back(static_cast<int>(r));
  }
  MPI_Group world, sub;
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  Check(MPI_Group_incl(world, static_cast<int>(ranks.size()), ranks.data(), &sub), "MPI_Group_incl");
  auto c = std::make_unique<Comm>();
  // Only the members call this; the tag keeps concurrent creations of different groups apart.
  Check(MPI_Comm_create_group(MPI_COMM_WORLD, sub, /*tag=*/ranks.front(), &c->comm), "MPI_Comm_create_group");
  MPI_Group_free(&sub);
  MPI_Group_free(&world);
  MPI_Comm_rank(c->comm, &c->position);
  MPI_Comm_size(c->comm, &c->size);
  SS_CHECK(c->position == pos - group.begin(), "group order is rank order in the communicator");
  return *(comms_[group] = c.release());
}

void MpiCollectives::Wait(void* request, const char* what, const ReplicaGroup& group) {
  auto* req = static_cast<MPI_Request*>(request);
  const auto start = std::chrono::steady_clock::now();
  for (int polls = 0;; ++polls) {
    int done = 0;
    Check(MPI_Test(req, &done, MPI_STATUS_IGNORE), what);
    if (done) return;
    // Spin briefly (most collectives finish in microseconds), then poll without taking a core.
    if (polls < 1000) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (timeout_seconds_ > 0 && waited > timeout_seconds_) {
      std::string members;
      for (int64_t r : group) members += (members.empty() ? "" : ",") + std::to_string(r);
      Abort(Str(what, " over replicas {", members, "} did not complete within ", timeout_seconds_,
                " s (--collective-timeout): another rank is hung or gone"));
    }
  }
}

void MpiCollectives::ReduceScatter(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n,
                                   Reduction op) {
  const Comm& c = CommFor(replica, group, "reduce-scatter");
  const int count = CountArg(n, "reduce-scatter");
  scratch_.resize(static_cast<size_t>(n) * c.size);
  // scratch_[p*n ..] = member p's copy of my chunk.
  MPI_Request req;
  Check(MPI_Ialltoall(in, count, MPI_FLOAT, scratch_.data(), count, MPI_FLOAT, c.comm, &req), "MPI_Ialltoall");
  Wait(&req, "reduce-scatter", group);
  bytes_sent_ += static_cast<int64_t>(c.size - 1) * n * static_cast<int64_t>(sizeof(float));
  std::copy_n(scratch_.data(), n, out);
  for (int p = 1; p < c.size; ++p) {
    const float* x = scratch_.data() + static_cast<size_t>(p) * n;
    if (op == Reduction::kMax) {
      for (int64_t j = 0; j < n; ++j) out[j] = FoldMax(out[j], x[j]);
    } else {
      for (int64_t j = 0; j < n; ++j) out[j] += x[j];
    }
  }
  if (op == Reduction::kMean) {
    const float d = static_cast<float>(c.size);
    for (int64_t j = 0; j < n; ++j) out[j] /= d;
  }
}

void MpiCollectives::AllGather(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n) {
  const Comm& c = CommFor(replica, group, "all-gather");
  const int count = CountArg(n, "all-gather");
  MPI_Request req;
  Check(MPI_Iallgather(in, count, MPI_FLOAT, out, count, MPI_FLOAT, c.comm, &req), "MPI_Iallgather");
  Wait(&req, "all-gather", group);
  bytes_sent_ += static_cast<int64_t>(c.size - 1) * n * static_cast<int64_t>(sizeof(float));
}

void MpiCollectives::AllReduce(int replica, const ReplicaGroup& group, float* data, int64_t n, Reduction op) {
  const Comm& c = CommFor(replica, group, "all-reduce");
  // Shards of ceil(n / size), the last ones zero-padded; padding never reaches `data`.
  const int64_t shard = (n + c.size - 1) / c.size;
  padded_.assign(static_cast<size_t>(shard) * c.size, 0.0f);
  std::copy_n(data, n, padded_.data());
  std::vector<float> reduced(shard);
  ReduceScatter(replica, group, padded_.data(), reduced.data(), shard, op);
  AllGather(replica, group, reduced.data(), padded_.data(), shard);
  std::copy_n(padded_.data(), n, data);
}

void MpiCollectives::Broadcast(int replica, const ReplicaGroup& group, float* data, int64_t n, int root) {
  const Comm& c = CommFor(replica, group, "broadcast");
  if (root < 0 || root >= c.size) throw Error(Str("broadcast: root position ", root, " is not in a group of ", c.size));
  MPI_Request req;
  Check(MPI_Ibcast(data, CountArg(n, "broadcast"), MPI_FLOAT, root, c.comm, &req), "MPI_Ibcast");
  Wait(&req, "broadcast", group);
  if (c.position == root) bytes_sent_ += static_cast<int64_t>(c.size - 1) * n * static_cast<int64_t>(sizeof(float));
}

void MpiCollectives::Barrier(int replica, const ReplicaGroup& group) {
  MPI_Request req;
  Check(MPI_Ibarrier(CommFor(replica, group, "barrier").comm, &req), "MPI_Ibarrier");
  Wait(&req, "barrier", group);
}

void MpiCollectives::Abort(const std::string& why) {
  std::fprintf(stderr, "shardstep: rank %d failed: %s\n", rank_, why.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
}

}  // namespace shardstep::runtime
