// MeshCollectives through the runtime::Collectives interface, called from one thread per replica as the
// executor calls it: sums, means and maxima against a sequential oracle (integers: every order is
// exact), all-reduce = reduce-scatter + all-gather bit for bit (uniform values, any padding), gathers,
// broadcasts, disjoint groups along each axis running concurrently, and per-link counters.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>

#include "ir/error.h"
#include "runtime/replica_runner.h"
#include "tpu_backend/mesh_collectives.h"

using namespace shardstep;
using namespace shardstep::tpu;
using runtime::Reduction;

namespace {

std::vector<std::vector<float>> Inputs(int replicas, int64_t n, bool integers, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<float>> in(replicas, std::vector<float>(n));
  for (auto& d : in)
    for (float& v : d)
      v = integers ? static_cast<float>(static_cast<int>(rng() % 17) - 8) : std::ldexp(static_cast<float>(rng() % 100000), -13);
  return in;
}

}  // namespace

TEST_CASE("whole-mesh collectives from replica threads equal the oracle") {
  for (auto [x, y] : {std::pair{1, 2}, std::pair{2, 2}, std::pair{3, 2}}) {
    const MeshTopology mesh(x, y);
    const int n = mesh.replicas();
    INFO(mesh.ToString());
    MeshCollectives c(mesh);
    const runtime::ReplicaGroup all = mesh.AllReplicas();
    for (int64_t len : {int64_t{1}, int64_t{13}, int64_t{64}}) {
      INFO("n " << len);
      const auto in = Inputs(n, len, true, 5);
      std::vector<std::vector<float>> sum(n), mean(n), max(n);
      runtime::RunReplicas(n, &c, [&](int r) {
        sum[r] = in[r];
        c.AllReduce(r, all, sum[r].data(), len, Reduction::kSum);
        mean[r].resize(len);
        c.AllReduce(r, all, in[r].data(), mean[r].data(), len, Reduction::kMean);
        max[r] = in[r];
        c.AllReduce(r, all, max[r].data(), len, Reduction::kMax);
      });
      for (int64_t j = 0; j < len; ++j) {
        float s = 0, m = -1e30f;
        for (int r = 0; r < n; ++r) s += in[r][j], m = std::max(m, in[r][j]);
        for (int r = 0; r < n; ++r) {
          CHECK(sum[r][j] == s);
          CHECK(mean[r][j] == s / static_cast<float>(n));
          CHECK(max[r][j] == m);
        }
      }
    }
  }
}

TEST_CASE("all-reduce equals reduce-scatter + all-gather bitwise; gather and broadcast") {
  const MeshTopology mesh(2, 2);
  const int n = mesh.replicas();
  const runtime::ReplicaGroup all = mesh.AllReplicas();
  MeshCollectives c(mesh);
  const int64_t len = 37, shard = (len + n - 1) / n;  // padded to n * shard
  const auto in = Inputs(n, len, false, 9);
  std::vector<std::vector<float>> ar(n), two(n), gathered(n), bcast(n);
  runtime::RunReplicas(n, &c, [&](int r) {
    ar[r] = in[r];
    c.AllReduce(r, all, ar[r].data(), len, Reduction::kMean);
    std::vector<float> padded(n * shard, 0.0f), mine(shard);
    std::copy(in[r].begin(), in[r].end(), padded.begin());
    c.ReduceScatter(r, all, padded.data(), mine.data(), shard, Reduction::kMean);
    two[r].resize(n * shard);
    c.AllGather(r, all, mine.data(), two[r].data(), shard);
    gathered[r].resize(n * len);
    c.AllGather(r, all, in[r].data(), gathered[r].data(), len);
    bcast[r] = in[r];
    c.Broadcast(r, all, bcast[r].data(), len, 3);
    c.Barrier(r, all);
  });
  for (int r = 0; r < n; ++r) {
    INFO("replica " << r);
    CHECK(std::memcmp(ar[r].data(), two[r].data(), len * sizeof(float)) == 0);
    CHECK(std::memcmp(ar[r].data(), ar[0].data(), len * sizeof(float)) == 0);  // every member, the same bits
    for (int p = 0; p < n; ++p) CHECK(std::memcmp(gathered[r].data() + p * len, in[p].data(), len * sizeof(float)) == 0);
    CHECK(bcast[r] == in[3]);
  }
  // The ring's sum is a sum: within rounding of the sequential one.
  for (int64_t j = 0; j < len; ++j) {
    double s = 0;
    for (int r = 0; r < n; ++r) s += in[r][j];
    CHECK(std::abs(ar[0][j] - s / n) <= 1e-6 * std::abs(s / n) + 1e-30);
  }
  CHECK(c.calls() == 6);
}

TEST_CASE("disjoint groups along each axis run concurrently and use only that axis's links") {
  const MeshTopology mesh(2, 3);
  const int n = mesh.replicas();
  for (MeshAxis axis : {MeshAxis::kX, MeshAxis::kY, MeshAxis::kCore}) {
    INFO("axis " << AxisName(axis));
    MeshCollectives c(mesh);
    const auto groups = mesh.GroupsAlong(axis);
    std::vector<int> group_of(n);
    for (size_t g = 0; g < groups.size(); ++g)
      for (int64_t r : groups[g]) group_of[r] = static_cast<int>(g);
    const int64_t len = 10;
    const auto in = Inputs(n, len, true, 2);
    std::vector<std::vector<float>> out(n);
    runtime::RunReplicas(n, &c, [&](int r) {
      out[r] = in[r];
      c.AllReduce(r, groups[group_of[r]], out[r].data(), len, Reduction::kSum);
    });
    for (int r = 0; r < n; ++r)
      for (int64_t j = 0; j < len; ++j) {
        float s = 0;
        for (int64_t q : groups[group_of[r]]) s += in[q][j];
        CHECK(out[r][j] == s);
      }
    const LinkTraffic t = c.traffic();
    int64_t bytes = 0;
    for (const Link& l : mesh.Links()) {
      const int64_t b = t.bytes[mesh.LinkIndex(l)];
      bytes += b;
      if (l.axis != axis) CHECK(b == 0);
    }
    if (axis == MeshAxis::kCore) {
      CHECK(bytes == 0);
      CHECK(t.on_chip_bytes > 0);
    } else {
      CHECK(bytes > 0);
      CHECK(t.on_chip_bytes == 0);
    }
  }
}

TEST_CASE("a mismatched call or a failing replica aborts every member instead of hanging") {
  const MeshTopology mesh(1, 2);
  MeshCollectives c(mesh);
  const runtime::ReplicaGroup all = mesh.AllReplicas();
  CHECK_THROWS_WITH(runtime::RunReplicas(4, &c,
                                         [&](int r) {
                                           std::vector<float> v(8, 1.0f);
                                           c.AllReduce(r, all, v.data(), r == 2 ? 4 : 8, Reduction::kSum);
                                         }),
                    Catch::Contains("called different collectives"));
  MeshCollectives d(mesh);
  CHECK_THROWS_WITH(runtime::RunReplicas(4, &d,
                                         [&](int r) {
                                           if (r == 1) throw Error("boom");
                                           std::vector<float> v(8, 1.0f);
                                           d.AllReduce(r, all, v.data(), 8, Reduction::kSum);
                                         }),
                    Catch::Contains("boom"));
}
