// The TPU mesh's topology and its collectives as ring schedules (tpu_backend/): numbering, torus
// neighbours, replica groups along axes, and reduce-scatter / all-gather run by the emulator's one
// primitive (a transfer over one link) on every mesh from 1x1 to 4x4 with 1 and 2 cores per chip:
// results against a sequential-sum oracle, all-reduce = reduce-scatter + all-gather, and the bytes
// and messages on every link against the closed form of bidirectional rings on a 2D torus, written
// here from the algorithm's description, not from the implementation.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "ir/error.h"
#include "tpu_backend/mesh_topology.h"
#include "tpu_backend/ring_cost.h"
#include "tpu_backend/ring_schedule.h"

using namespace shardstep;
using namespace shardstep::tpu;

namespace {

std::vector<MeshTopology> AllMeshes() {
  std::vector<MeshTopology> out;
  for (int cores : {1, 2})
    for (int x = 1; x <= 4; ++x)
      for (int y = 1; y <= 4; ++y) out.emplace_back(x, y, cores);
  return out;
}

struct Buffers {
  std::vector<std::vector<float>> data;
  std::vector<float*> Pointers() {
    std::vector<float*> p;
    for (auto& d : data) p.push_back(d.data());
    return p;
  }
};

// Replica r's input: small integers (every sum exact in f32) or uniform values.
Buffers Inputs(int replicas, int64_t n, bool integers, uint32_t seed) {
  std::mt19937 rng(seed);
  Buffers b;
  b.data.resize(replicas, std::vector<float>(n));
  for (auto& d : b.data)
    for (float& v : d) v = integers ? static_cast<float>(static_cast<int>(rng() % 17) - 8) : std::ldexp(static_cast<float>(rng() % 100000), -10);
  return b;
}

}  // namespace

TEST_CASE("mesh shapes parse, and bad ones are named errors") {
  MeshTopology m = MeshTopology::Parse("4x2");
  CHECK(m.x() == 4);
  CHECK(m.y() == 2);
  CHECK(m.replicas() == 16);
  CHECK(m.ToString() == "4x2 chips, 2 cores each (16 replicas)");
  for (const char* bad : {"", "4", "x4", "4x", "4x-2", "4x2x2", "a x b", "0x2", "2x0", "4 x 4", "200x1"}) {
    INFO(bad);
    CHECK_THROWS_WITH(MeshTopology::Parse(bad), Catch::Contains("--mesh"));
  }
  CHECK_THROWS_WITH(MeshTopology::Parse("axb"), Catch::Contains("'axb' is not a mesh shape"));
  CHECK_THROWS_WITH(MeshTopology(2, 2, 0), Catch::Contains("cores per chip"));
}

TEST_CASE("replica numbering, torus neighbours and groups along each axis") {
  for (const MeshTopology& m : AllMeshes()) {
    INFO(m.ToString());
    std::set<std::tuple<int, int, int>> seen;
    for (int r = 0; r < m.replicas(); ++r) {
      const CoreCoord c = m.CoordOf(r);
      CHECK(m.ReplicaAt(c) == r);
      CHECK(r == (c.core * m.x() + c.x) * m.y() + c.y);  // the documented shard order
      seen.insert({c.x, c.y, c.core});
      // Neighbours wrap around and are inverse to each other.
      for (MeshAxis a : {MeshAxis::kX, MeshAxis::kY, MeshAxis::kCore}) {
        CHECK(m.Neighbor(m.Neighbor(r, a, +1), a, -1) == r);
        int q = r;
        for (int i = 0; i < m.AxisSize(a); ++i) q = m.Neighbor(q, a, +1);
        CHECK(q == r);
      }
      const CoreCoord right = m.CoordOf(m.Neighbor(r, MeshAxis::kX, +1));
      CHECK(right.x == (c.x + 1) % m.x());
      CHECK(right.y == c.y);
      CHECK(right.core == c.core);
    }
    CHECK(static_cast<int>(seen.size()) == m.replicas());
    CHECK_THROWS_WITH(m.CoordOf(m.replicas()), Catch::Contains("is not on the"));

    for (MeshAxis a : {MeshAxis::kX, MeshAxis::kY, MeshAxis::kCore}) {
      const auto groups = m.GroupsAlong(a);
      CHECK(static_cast<int>(groups.size()) * m.AxisSize(a) == m.replicas());
      std::set<int64_t> members;
      for (const auto& g : groups) {
        REQUIRE(static_cast<int>(g.size()) == m.AxisSize(a));
        for (size_t i = 0; i < g.size(); ++i) {
          members.insert(g[i]);
          if (i > 0) CHECK(g[i] > g[i - 1]);
          const CoreCoord c = m.CoordOf(static_cast<int>(g[i])), c0 = m.CoordOf(static_cast<int>(g[0]));
          // Same position on the other axes, increasing along this one.
          CHECK((a == MeshAxis::kX ? c.x : a == MeshAxis::kY ? c.y : c.core) == static_cast<int>(i));
          if (a != MeshAxis::kX) CHECK(c.x == c0.x);
          if (a != MeshAxis::kY) CHECK(c.y == c0.y);
          if (a != MeshAxis::kCore) CHECK(c.core == c0.core);
        }
      }
      CHECK(static_cast<int>(members.size()) == m.replicas());
    }

    // Links: two per chip and axis of size >= 2, densely indexed.
    const auto links = m.Links();
    CHECK(static_cast<int>(links.size()) == m.chips() * 2 * ((m.x() >= 2) + (m.y() >= 2)));
    for (size_t i = 0; i < links.size(); ++i) CHECK(m.LinkIndex(links[i]) == static_cast<int>(i));
  }
  MeshTopology m(3, 3, 2);
  CHECK_THROWS_WITH(m.LinkBetween(0, 2, MeshAxis::kY, +1), Catch::Contains("are not neighbours along y+"));
  CHECK_THROWS_WITH(m.LinkBetween(0, 9, MeshAxis::kCore, +1), Catch::Contains("not joined by an inter-chip link"));
  CHECK_THROWS(MeshTopology(1, 3, 2).LinkIndex(Link{0, 0, MeshAxis::kX, +1}));
}

TEST_CASE("mesh reduce-scatter and all-gather give the sums on every mesh up to 4x4") {
  for (const MeshTopology& m : AllMeshes()) {
    for (int64_t shard : {0, 1, 5, 6}) {
      INFO(m.ToString() << ", shard " << shard);
      const int n_rep = m.replicas();
      const int64_t n = shard * n_rep;
      for (bool integers : {true, false}) {
        Buffers in = Inputs(n_rep, n, integers, static_cast<uint32_t>(n_rep * 7 + shard));
        Buffers rs = in;
        LinkTraffic traffic;
        RunSchedule(m, MeshReduceScatter(m, shard), rs.Pointers(), n, &traffic);
        for (int r = 0; r < n_rep; ++r)
          for (int64_t j = r * shard; j < (r + 1) * shard; ++j) {
            double sum = 0, abs_sum = 0;
            for (int q = 0; q < n_rep; ++q) sum += in.data[q][j], abs_sum += std::abs(in.data[q][j]);
            if (integers) {
              REQUIRE(rs.data[r][j] == static_cast<float>(sum));  // exact: small integers
            } else {
              REQUIRE(std::abs(rs.data[r][j] - sum) <= n_rep * 0x1p-24 * abs_sum);
            }
          }
        // All-gather of the reduced shards: every replica gets every shard, bit for bit.
        Buffers ag(rs);
        for (int r = 0; r < n_rep; ++r)  // only the own shard is meaningful before the gather
          for (int64_t j = 0; j < n; ++j)
            if (j / std::max<int64_t>(shard, 1) != r) ag.data[r][j] = -1.0f;
        RunSchedule(m, MeshAllGather(m, shard), ag.Pointers(), n, &traffic);
        for (int r = 0; r < n_rep; ++r)
          for (int64_t j = 0; j < n; ++j) REQUIRE(std::memcmp(&ag.data[r][j], &rs.data[j / shard][j], 4) == 0);
        // Deterministic: the same inputs give the same bits again.
        Buffers again = in;
        LinkTraffic t2;
        RunSchedule(m, MeshReduceScatter(m, shard), again.Pointers(), n, &t2);
        for (int r = 0; r < n_rep; ++r)
          for (int64_t j = r * shard; j < (r + 1) * shard; ++j)
            REQUIRE(std::memcmp(&again.data[r][j], &rs.data[r][j], 4) == 0);
      }
    }
  }
}

// Closed form, from the algorithm: a bidirectional ring of p members over chunks of c floats moves,
// in p - 1 steps, ceil(c/2) floats per step over each member's "+" link and floor(c/2) over its "-"
// link. On the mesh, the core phase (c = X*Y*shard) stays on chip; the X phase (c = Y*shard) runs one
// ring per (y, core), so the C cores of a chip share its X links; the Y phase (c = shard) likewise.
TEST_CASE("bytes and messages per link equal the closed form of bidirectional torus rings") {
  for (const MeshTopology& m : AllMeshes()) {
    for (int64_t shard : {1, 5, 6}) {
      INFO(m.ToString() << ", shard " << shard);
      const int64_t X = m.x(), Y = m.y(), C = m.cores_per_chip();
      for (bool gather : {false, true}) {
        Buffers b = Inputs(m.replicas(), shard * m.replicas(), true, 3);
        LinkTraffic t;
        RunSchedule(m, gather ? MeshAllGather(m, shard) : MeshReduceScatter(m, shard), b.Pointers(),
                    shard * m.replicas(), &t);
        auto up = [](int64_t c) { return (c + 1) / 2; };
        auto down = [](int64_t c) { return c / 2; };
        for (const Link& l : m.Links()) {
          INFO(LinkName(l));
          const int64_t p = l.axis == MeshAxis::kX ? X : Y, c = l.axis == MeshAxis::kX ? Y * shard : shard;
          const int64_t half = l.dir > 0 ? up(c) : down(c);
          CHECK(t.bytes[m.LinkIndex(l)] == (p - 1) * C * half * 4);
          CHECK(t.messages[m.LinkIndex(l)] == (half > 0 ? (p - 1) * C : 0));
        }
        CHECK(t.on_chip_bytes == m.replicas() * (C - 1) * X * Y * shard * 4);
        CHECK(t.steps == (C > 1 && X * Y * shard > 0) * (C - 1) + (X > 1) * (X - 1) + (Y > 1) * (Y - 1));
      }
    }
  }
  // The bidirectional ring halves the busiest link's load against a one-way ring ((p-1) * c per link).
  MeshTopology m(4, 1, 1);
  Buffers b = Inputs(4, 4 * 8, true, 1);
  LinkTraffic t;
  RunSchedule(m, MeshReduceScatter(m, 8), b.Pointers(), 32, &t);
  CHECK(t.MaxLinkBytes() == 3 * 4 * 4);
  CHECK(t.TotalLinkBytes() == 8 * 3 * 4 * 4);
}

TEST_CASE("collectives along one axis use only that axis's links") {
  MeshTopology m(3, 2, 2);
  const int64_t shard = 4;
  for (MeshAxis a : {MeshAxis::kX, MeshAxis::kY, MeshAxis::kCore}) {
    INFO(AxisName(a));
    const int64_t n = shard * m.AxisSize(a);
    Buffers in = Inputs(m.replicas(), n, true, 11), rs = in;
    LinkTraffic t;
    RunSchedule(m, AxisReduceScatter(m, a, shard), rs.Pointers(), n, &t);
    for (const auto& g : m.GroupsAlong(a))
      for (size_t pos = 0; pos < g.size(); ++pos)
        for (int64_t j = static_cast<int64_t>(pos) * shard; j < static_cast<int64_t>(pos + 1) * shard; ++j) {
          float sum = 0;
          for (int64_t q : g) sum += in.data[q][j];
          REQUIRE(rs.data[g[pos]][j] == sum);
        }
    RunSchedule(m, AxisAllGather(m, a, shard), rs.Pointers(), n, &t);
    for (const auto& g : m.GroupsAlong(a))
      for (int64_t q : g) CHECK(rs.data[q] == rs.data[g[0]]);
    for (const Link& l : m.Links())
      if (l.axis != a) CHECK(t.bytes[m.LinkIndex(l)] == 0);
    CHECK((t.on_chip_bytes > 0) == (a == MeshAxis::kCore));
  }
}

TEST_CASE("the emulator refuses transfers that are not one hop or leave the buffer") {
  MeshTopology m(3, 1, 1);
  std::vector<std::vector<float>> data(3, std::vector<float>(4));
  std::vector<float*> ptrs{data[0].data(), data[1].data(), data[2].data()};
  LinkTraffic t;
  RingSchedule bad{"test", {{Transfer{0, 2, MeshAxis::kX, +1, 0, 1, false}}}};
  CHECK_THROWS_WITH(RunSchedule(m, bad, ptrs, 4, &t), Catch::Contains("are not neighbours along x"));
  RingSchedule out_of_range{"test", {{Transfer{0, 1, MeshAxis::kX, +1, 3, 2, false}}}};
  CHECK_THROWS_WITH(RunSchedule(m, out_of_range, ptrs, 4, &t), Catch::Contains("leaves the buffer"));
  CHECK_THROWS_WITH(RunSchedule(m, bad, {ptrs[0]}, 4, &t), Catch::Contains("1 buffers for 3 replicas"));
  CHECK_THROWS_WITH(MeshReduceScatter(m, -1), Catch::Contains("non-negative shard size"));
}

// α–β closed form, from the algorithm: a phase along an axis of p members over chunks of c floats
// is p - 1 steps, each as long as its busiest link: latency + (C rings sharing a chip's link) *
// ceil(c/2) * 4 bytes / bandwidth. On chip an ordered pair of cores has one path, so with 2 cores per
// chip both halves of a chunk share it (c floats a step). Reduce-scatter and all-gather cost the same.
TEST_CASE("the alpha-beta time of the mesh collectives equals the closed form") {
  const LinkModel ici{2e-6, 70e9}, chip{0.5e-6, 300e9};
  for (const MeshTopology& m : AllMeshes()) {
    for (int64_t shard : {1, 6, 1001}) {
      INFO(m.ToString() << ", shard " << shard);
      const double X = m.x(), Y = m.y(), C = m.cores_per_chip();
      auto phase = [&](double p, double floats_per_step, const LinkModel& l) {
        return p < 2 ? 0.0 : (p - 1) * (l.latency_s + floats_per_step * 4 / l.bytes_per_s);
      };
      const double on_chip = C == 2 ? X * Y * shard : std::ceil(X * Y * shard / 2.0);
      const double expected = phase(C, on_chip, chip) + phase(X, C * std::ceil(Y * shard / 2.0), ici) +
                              phase(Y, C * std::ceil(shard / 2.0), ici);
      for (bool gather : {false, true}) {
        const ScheduleTime t = TimeOf(m, gather ? MeshAllGather(m, shard) : MeshReduceScatter(m, shard), ici, chip);
        CHECK(t.seconds == Approx(expected).epsilon(1e-9));
      }
    }
  }
  CHECK_THROWS_WITH(TimeOf(MeshTopology(2, 2), MeshReduceScatter(MeshTopology(2, 2), 4), LinkModel{1e-6, 0}, chip),
                    Catch::Contains("inter-chip link model needs a positive bandwidth"));
}
