// ReplicaPool (runtime/replica_runner.h): replica threads started once and parked between runs.
// Each replica keeps its thread across runs; the first failure aborts the collectives, wakes the
// replicas blocked in them and is rethrown; the pool keeps working afterwards; executors step on it.
#include <catch2/catch.hpp>
#include <sched.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <set>
#include <thread>

#include "ir/error.h"
#include "runtime/inprocess_collectives.h"
#include "runtime/replica_runner.h"

using namespace shardstep;
using namespace shardstep::runtime;

TEST_CASE("a replica keeps its thread from run to run, and runs see each other's writes") {
  constexpr int kReplicas = 6;
  ReplicaPool pool(kReplicas);
  CHECK(pool.size() == kReplicas);
  std::vector<std::thread::id> first(kReplicas);
  pool.Run(nullptr, [&](int r) { first[r] = std::this_thread::get_id(); });
  CHECK(std::set<std::thread::id>(first.begin(), first.end()).size() == kReplicas);
  CHECK(std::find(first.begin(), first.end(), std::this_thread::get_id()) == first.end());
  // Catch2's assertions are not thread-safe: the replicas record, the test thread checks.
  std::vector<int64_t> counter(kReplicas, 0), moved(kReplicas, 0);
  for (int run = 0; run < 500; ++run)
    pool.Run(nullptr, [&](int r) {
      moved[r] += std::this_thread::get_id() != first[r];
      counter[r] += r + 1;  // read and written by the same replica in successive runs
    });
  for (int r = 0; r < kReplicas; ++r) {
    CHECK(moved[r] == 0);
    CHECK(counter[r] == 500 * (r + 1));
  }
  CHECK_THROWS_WITH(ReplicaPool(0), Catch::Contains("at least one replica"));
}

// With at least as many replicas as allowed CPUs, thread r runs only on the (r mod count)-th allowed
// CPU; with fewer, the threads are left to the scheduler (another process's replicas may need the rest).
TEST_CASE("pool threads of more replicas than CPUs stay on one CPU each, taken in turn") {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  REQUIRE(sched_getaffinity(0, sizeof(allowed), &allowed) == 0);
  std::vector<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &allowed)) cpus.push_back(cpu);
  const int n = 2 * static_cast<int>(cpus.size()) + 1;
  const std::vector<int> of = ReplicaCpus(n);
  if (const char* e = std::getenv("SHARDSTEP_PIN_REPLICAS"); e && std::string(e) == "0") {
    CHECK(of.empty());  // switched off: nothing else to check
    return;
  }
  REQUIRE(static_cast<int>(of.size()) == n);
  for (int r = 0; r < n; ++r) CHECK(of[r] == cpus[r % cpus.size()]);
  if (cpus.size() > 1) CHECK(ReplicaCpus(static_cast<int>(cpus.size()) - 1).empty());
  ReplicaPool pool(n);
  std::vector<std::vector<int>> runs_on(n);  // each thread's allowed CPUs, as it sees them
  pool.Run(nullptr, [&](int r) {
    cpu_set_t mine;
    CPU_ZERO(&mine);
    if (sched_getaffinity(0, sizeof(mine), &mine) != 0) return;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
      if (CPU_ISSET(cpu, &mine)) runs_on[r].push_back(cpu);
  });
  for (int r = 0; r < n; ++r) CHECK(runs_on[r] == std::vector<int>{of[r]});
}

TEST_CASE("collectives work across pool threads, and the first failure wakes the others and is rethrown") {
  constexpr int kReplicas = 4;
  InProcessCollectives c(kReplicas);
  ReplicaPool pool(kReplicas);
  const ReplicaGroup all{0, 1, 2, 3};
  for (int run = 0; run < 50; ++run) {
    std::vector<float> x(kReplicas);
    pool.Run(&c, [&](int r) {
      float v = static_cast<float>(r + run);
      c.AllReduce(r, all, &v, 1, Reduction::kSum);
      x[r] = v;
    });
    for (float v : x) CHECK(v == static_cast<float>(6 + 4 * run));
  }
  // Replica 2 fails while the others wait in an all-reduce: they are woken, and replica 2's message
  // (not the others' "aborted") comes out.
  std::atomic<int> woken{0};
  CHECK_THROWS_WITH(pool.Run(&c,
                             [&](int r) {
                               if (r == 2) throw Error("bad batch");
                               float v = 1;
                               try {
                                 c.AllReduce(r, all, &v, 1, Reduction::kSum);
                               } catch (const Error&) {
                                 ++woken;
                                 throw;
                               }
                             }),
                    Catch::Equals("replica 2: bad batch"));
  CHECK(woken == 3);
  // The pool itself still runs (the collectives stay aborted, as after any failure).
  std::atomic<int> ran{0};
  pool.Run(nullptr, [&](int) { ++ran; });
  CHECK(ran == kReplicas);
  CHECK_THROWS_WITH(pool.Run(nullptr, [](int r) { if (r == 3) throw 7; }), Catch::Equals("replica 3: unknown exception"));
}
