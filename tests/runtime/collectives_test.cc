// Collectives conformance test: CheckCollectivesConformance(factory) runs against any Collectives
// implementation (in-process here; MPI and the TPU mesh reuse it with their own factory).
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ir/error.h"
#include "runtime/collectives.h"
#include "runtime/inprocess_collectives.h"
#include "runtime/replica_runner.h"

namespace shardstep::runtime {
namespace {

using Clock = std::chrono::steady_clock;
using Buffers = std::vector<std::vector<float>>;
using CollectivesFactory = std::function<std::unique_ptr<Collectives>(int num_replicas)>;

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

ReplicaGroup Iota(int64_t first, int64_t count) {
  ReplicaGroup g;
  for (int64_t i = 0; i < count; ++i) g.push_back(first + i);
  return g;
}

// Mixed signs and magnitudes (1e-3 .. 1e3), so a different summation order gives different bits.
std::vector<float> RandomData(uint64_t seed, int64_t n) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> mant(0.5f, 1.0f), expo(-3.0f, 3.0f);
  std::vector<float> v(n);
  for (float& x : v) x = (rng() & 1 ? -1.0f : 1.0f) * mant(rng) * std::pow(10.0f, expo(rng));
  return v;
}

// The oracle: element-wise fold over `xs` in the given (group) order, mean divided once at the end.
std::vector<float> SequentialFold(const std::vector<const std::vector<float>*>& xs, Reduction op) {
  std::vector<float> out = *xs[0];
  for (size_t p = 1; p < xs.size(); ++p) {
    for (size_t j = 0; j < out.size(); ++j) {
      const float x = (*xs[p])[j];
      out[j] = op == Reduction::kMax ? std::max(out[j], x) : out[j] + x;
    }
  }
  if (op == Reduction::kMean) {
    for (float& x : out) x /= static_cast<float>(xs.size());
  }
  return out;
}

std::vector<float> SequentialFold(const Buffers& bufs, const ReplicaGroup& group, Reduction op) {
  std::vector<const std::vector<float>*> xs;
  for (int64_t r : group) xs.push_back(&bufs[r]);
  return SequentialFold(xs, op);
}

// "" when the bits agree, else the first difference.
std::string BitDiff(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return Str("size ", got.size(), " != ", want.size());
  for (size_t j = 0; j < got.size(); ++j) {
    if (std::memcmp(&got[j], &want[j], sizeof(float)) != 0) return Str("element ", j, ": ", got[j], " != ", want[j]);
  }
  return "";
}

const Reduction kAllOps[] = {Reduction::kSum, Reduction::kMean, Reduction::kMax};

void CheckCollectivesConformance(const CollectivesFactory& make) {
  SECTION("all-reduce sum/mean/max equals a sequential fold in group order") {
    for (int nrep : {1, 2, 3, 4, 8}) {
      auto c = make(nrep);
      const ReplicaGroup all = Iota(0, nrep);
      for (Reduction op : kAllOps) {
        for (int64_t n : {0, 1, 5, 1000, 4099}) {
          Buffers in(nrep);
          for (int r = 0; r < nrep; ++r) in[r] = RandomData(1000 * nrep + 10 * n + r, n);
          Buffers out = in;
          RunReplicas(nrep, c.get(), [&](int r) { c->AllReduce(r, all, out[r].data(), n, op); });
          const std::vector<float> want = SequentialFold(in, all, op);
          for (int r = 0; r < nrep; ++r) {
            INFO("N=" << nrep << " n=" << n << " op=" << static_cast<int>(op) << " replica " << r);
            CHECK(BitDiff(out[r], want) == "");
          }
        }
      }
    }
  }

  SECTION("all-reduce has the bits of reduce-scatter + all-gather, also for n not divisible by N") {
    for (int nrep : {2, 3, 4, 8}) {
      auto c = make(nrep);
      const ReplicaGroup all = Iota(0, nrep);
      for (Reduction op : kAllOps) {
        for (int64_t m : {1, 7, 1001}) {
          const int64_t chunk = (m + nrep - 1) / nrep;  // pad to chunk * N with zeros
          Buffers in(nrep), reduced(nrep), scattered(nrep, std::vector<float>(chunk)),
              gathered(nrep, std::vector<float>(chunk * nrep));
          for (int r = 0; r < nrep; ++r) {
            in[r] = RandomData(77 * nrep + m + r, m);
            reduced[r] = in[r];
            in[r].resize(chunk * nrep, 0.0f);
          }
          RunReplicas(nrep, c.get(), [&](int r) {
            c->AllReduce(r, all, reduced[r].data(), m, op);
            c->ReduceScatter(r, all, in[r].data(), scattered[r].data(), chunk, op);
            c->AllGather(r, all, scattered[r].data(), gathered[r].data(), chunk);
          });
          std::vector<float> want = SequentialFold(in, all, op);
          for (int r = 0; r < nrep; ++r) {
            INFO("N=" << nrep << " m=" << m << " op=" << static_cast<int>(op) << " replica " << r);
            CHECK(BitDiff(scattered[r], std::vector<float>(want.begin() + r * chunk, want.begin() + (r + 1) * chunk)) ==
                  "");
            CHECK(BitDiff(gathered[r], want) == "");
            gathered[r].resize(m);
            CHECK(BitDiff(reduced[r], gathered[r]) == "");
          }
        }
      }
    }
  }

  SECTION("all-gather concatenates in group order, broadcast copies the root") {
    const int nrep = 5;
    const int64_t n = 33;
    auto c = make(nrep);
    const ReplicaGroup all = Iota(0, nrep);
    Buffers in(nrep), gathered(nrep, std::vector<float>(n * nrep));
    for (int r = 0; r < nrep; ++r) in[r] = RandomData(500 + r, n);
    for (int root = 0; root < nrep; ++root) {
      Buffers data = in;
      RunReplicas(nrep, c.get(), [&](int r) {
        c->AllGather(r, all, in[r].data(), gathered[r].data(), n);
        c->Broadcast(r, all, data[r].data(), n, root);
      });
      for (int r = 0; r < nrep; ++r) {
        INFO("root " << root << " replica " << r);
        CHECK(BitDiff(data[r], in[root]) == "");
        for (int p = 0; p < nrep; ++p) {
          CHECK(BitDiff(std::vector<float>(gathered[r].begin() + p * n, gathered[r].begin() + (p + 1) * n), in[p]) == "");
        }
      }
    }
  }

  SECTION("the parts forms have the bits of the packed reduce-scatter and all-gather, on sub-groups too") {
    // Parts of 0, 1, 7 and 1001 columns (an empty one among them), packed column-wise as the collective
    // combiner's concat does; the all-gather's parts unpacked as its slices do.
    const std::vector<int64_t> ns = {7, 0, 1001, 1};
    const int64_t total = 1009;
    for (int nrep : {1, 3, 4}) {
      auto c = make(nrep);
      for (const ReplicaGroup& group : {Iota(0, nrep), nrep == 4 ? ReplicaGroup{3, 1} : Iota(0, nrep)}) {
        const int64_t g = static_cast<int64_t>(group.size());
        for (Reduction op : kAllOps) {
          // parts[r][i]: replica r's part i, [g, ns[i]]; packed[r]: [g, total]
          std::vector<Buffers> parts(nrep, Buffers(ns.size()));
          Buffers packed(nrep, std::vector<float>(g * total)), shard_packed(nrep, std::vector<float>(total)),
              shard_parts = shard_packed;
          for (int r = 0; r < nrep; ++r)
            for (size_t i = 0, col = 0; i < ns.size(); col += ns[i++]) {
              parts[r][i] = RandomData(31 * r + 7 * i + nrep, g * ns[i]);
              for (int64_t row = 0; row < g; ++row)
                std::copy_n(parts[r][i].data() + row * ns[i], ns[i], packed[r].data() + row * total + col);
            }
          // The all-gather's input: each replica's reduced shard, in parts.
          Buffers gathered_packed(nrep, std::vector<float>(g * total));
          std::vector<Buffers> gathered_parts(nrep, Buffers(ns.size()));
          for (int r = 0; r < nrep; ++r)
            for (size_t i = 0; i < ns.size(); ++i) gathered_parts[r][i].assign(g * ns[i], -1.0f);
          RunReplicas(nrep, c.get(), [&](int r) {
            if (std::find(group.begin(), group.end(), r) == group.end()) return;
            std::vector<const float*> ins, shard_ins;
            std::vector<float*> outs;
            for (size_t i = 0, col = 0; i < ns.size(); col += ns[i++]) {
              ins.push_back(parts[r][i].data());
              shard_ins.push_back(shard_parts[r].data() + col);
              outs.push_back(gathered_parts[r][i].data());
            }
            c->ReduceScatter(r, group, packed[r].data(), shard_packed[r].data(), total, op);
            c->ReduceScatterParts(r, group, ins.data(), ns.data(), static_cast<int>(ns.size()), shard_parts[r].data(), op);
            c->AllGather(r, group, shard_packed[r].data(), gathered_packed[r].data(), total);
            c->AllGatherParts(r, group, shard_ins.data(), ns.data(), static_cast<int>(ns.size()), outs.data());
          });
          for (int64_t r : group) {
            INFO("N=" << nrep << " group of " << g << " op=" << static_cast<int>(op) << " replica " << r);
            CHECK(BitDiff(shard_parts[r], shard_packed[r]) == "");
            for (size_t i = 0, col = 0; i < ns.size(); col += ns[i++])
              for (int64_t row = 0; row < g; ++row) {
                const float* want = gathered_packed[r].data() + row * total + col;
                CHECK(BitDiff(std::vector<float>(gathered_parts[r][i].begin() + row * ns[i],
                                                 gathered_parts[r][i].begin() + (row + 1) * ns[i]),
                              std::vector<float>(want, want + ns[i])) == "");
              }
          }
        }
      }
    }
  }

  SECTION("barrier: writes before it are visible to every member after it") {
    const int nrep = 6;
    auto c = make(nrep);
    const ReplicaGroup all = Iota(0, nrep);
    for (int round = 0; round < 20; ++round) {
      std::vector<int> before(nrep, 0), seen(nrep, 0);
      RunReplicas(nrep, c.get(), [&](int r) {
        std::this_thread::sleep_for(std::chrono::microseconds((r * 37 + round * 11) % 300));
        before[r] = 1;
        c->Barrier(r, all);
        for (int q = 0; q < nrep; ++q) seen[r] += before[q];
      });
      for (int r = 0; r < nrep; ++r) CHECK(seen[r] == nrep);
    }
  }

  SECTION("results are bit-identical whatever the thread timing") {
    const int nrep = 8;
    const int64_t n = 4097;
    auto c = make(nrep);
    const ReplicaGroup all = Iota(0, nrep);
    Buffers in(nrep);
    for (int r = 0; r < nrep; ++r) in[r] = RandomData(9000 + r, n);
    const std::vector<float> want = SequentialFold(in, all, Reduction::kSum);
    for (int run = 0; run < 15; ++run) {
      Buffers out = in;
      RunReplicas(nrep, c.get(), [&](int r) {
        std::mt19937 rng(run * 100 + r);
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
        c->Barrier(r, all);  // vary who arrives last at the all-reduce, too
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
        c->AllReduce(r, all, out[r].data(), n, Reduction::kSum);
      });
      for (int r = 0; r < nrep; ++r) {
        INFO("run " << run << " replica " << r);
        CHECK(BitDiff(out[r], want) == "");
      }
    }
  }

  SECTION("disjoint replica groups run concurrently, each folded in its own group order") {
    const int nrep = 8;
    const int64_t n = 301;
    auto c = make(nrep);
    for (const std::vector<ReplicaGroup>& groups :
         {std::vector<ReplicaGroup>{{0, 1, 2, 3}, {4, 5, 6, 7}}, std::vector<ReplicaGroup>{{6, 0, 4, 2}, {7, 5, 3, 1}}}) {
      auto group_of = [&](int r) -> const ReplicaGroup& {
        return std::find(groups[0].begin(), groups[0].end(), r) != groups[0].end() ? groups[0] : groups[1];
      };
      Buffers in(nrep);
      for (int r = 0; r < nrep; ++r) in[r] = RandomData(4242 + r, n);
      for (int step = 0; step < 10; ++step) {
        Buffers out = in, scattered(nrep, std::vector<float>(n / 4 + 1)), padded(nrep);
        RunReplicas(nrep, c.get(), [&](int r) {
          std::mt19937 rng(step * 100 + r);
          std::this_thread::sleep_for(std::chrono::microseconds(rng() % 1000));
          c->AllReduce(r, group_of(r), out[r].data(), n, Reduction::kSum);
          padded[r] = in[r];
          padded[r].resize((n / 4 + 1) * 4, 0.0f);
          c->ReduceScatter(r, group_of(r), padded[r].data(), scattered[r].data(), n / 4 + 1, Reduction::kMax);
        });
        for (const ReplicaGroup& g : groups) {
          const std::vector<float> sum = SequentialFold(in, g, Reduction::kSum);
          const std::vector<float> max = SequentialFold(padded, g, Reduction::kMax);
          for (size_t p = 0; p < g.size(); ++p) {
            INFO("group member " << g[p] << " step " << step);
            CHECK(BitDiff(out[g[p]], sum) == "");
            const int64_t k = n / 4 + 1;
            CHECK(BitDiff(scattered[g[p]], std::vector<float>(max.begin() + p * k, max.begin() + (p + 1) * k)) == "");
          }
        }
      }
    }
  }

  SECTION("64 replica threads on few cores do 200 all-reduces") {
    const int nrep = 64, steps = 200;
    const int64_t n = 256;
    auto c = make(nrep);
    const ReplicaGroup all = Iota(0, nrep);
    std::vector<int> wrong(nrep, 0);
    const auto start = Clock::now();
    RunReplicas(nrep, c.get(), [&](int r) {
      std::vector<float> data(n);
      for (int step = 0; step < steps; ++step) {
        std::fill(data.begin(), data.end(), static_cast<float>(r + step));  // small integers: exact sums
        c->AllReduce(r, all, data.data(), n, Reduction::kSum);
        const float want = static_cast<float>(nrep * (nrep - 1) / 2 + nrep * step);
        for (float x : data) wrong[r] += x != want;
      }
    });
    const double seconds = SecondsSince(start);
    INFO("64 x 200 all-reduces took " << seconds << " s");
    for (int r = 0; r < nrep; ++r) CHECK(wrong[r] == 0);
    CHECK(seconds < 60.0);  // blocking, not spinning: normally well under a second
  }

  SECTION("a failing replica stops the run with its own message while others wait in a collective") {
    const int nrep = 8;
    auto c = make(nrep);
    const ReplicaGroup all = Iota(0, nrep), low = Iota(0, 4), high = Iota(4, 4);
    std::atomic<int64_t> failed_at{0};
    const auto start = Clock::now();
    try {
      RunReplicas(nrep, c.get(), [&](int r) {
        std::vector<float> data(1000, 1.0f);
        for (int step = 0;; ++step) {  // the others would loop forever without the abort
          if (r == 5 && step == 20) {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));  // let the others block first
            failed_at = (Clock::now() - start).count();
            throw Error("loss is NaN at step 20");
          }
          c->AllReduce(r, r < 4 ? low : high, data.data(), 1000, Reduction::kMean);
          if (step >= 20) c->Barrier(r, all);  // replicas 0-3 also end up waiting for replica 5
        }
      });
      FAIL("RunReplicas returned normally");
    } catch (const Error& e) {
      CHECK(std::string(e.what()) == "replica 5: loss is NaN at step 20");
    }
    const double after_failure = SecondsSince(start) - std::chrono::duration<double>(Clock::duration(failed_at)).count();
    CHECK(after_failure < 1.0);
    // The object stays aborted: every later call throws the same message.
    CHECK_THROWS_WITH(c->Barrier(0, all), "replica 5: loss is NaN at step 20");
  }

  SECTION("an abort in the middle of large collectives frees no buffer that another member still reads") {
    const int nrep = 6;
    const int64_t n = 1 << 20;
    auto c = make(nrep);
    const ReplicaGroup group = Iota(0, nrep - 1);
    for (int round = 0; round < 3; ++round) {
      CHECK_THROWS_WITH(RunReplicas(nrep, c.get(),
                                    [&](int r) {
                                      if (r == nrep - 1) {
                                        std::this_thread::sleep_for(std::chrono::milliseconds(5 + 7 * round));
                                        throw Error("stop");
                                      }
                                      for (;;) {  // each buffer is freed as its replica unwinds
                                        std::vector<float> data(n, 1.0f);
                                        c->AllReduce(r, group, data.data(), n, Reduction::kSum);
                                      }
                                    }),
                        "replica 5: stop");
      c = make(nrep);
    }
  }

  SECTION("an exception of any type is reported with its replica") {
    const int nrep = 3;
    auto c = make(nrep);
    const ReplicaGroup all = Iota(0, nrep);
    CHECK_THROWS_WITH(RunReplicas(nrep, c.get(),
                                  [&](int r) {
                                    if (r == 1) throw std::runtime_error("out of memory");
                                    c->Barrier(r, all);
                                  }),
                      "replica 1: out of memory");
  }

  SECTION("one object serves many steps of mixed collectives") {
    const int nrep = 4, steps = 300;
    auto c = make(nrep);
    const std::vector<ReplicaGroup> groupings[] = {{Iota(0, 4)}, {{0, 1}, {2, 3}}, {{3, 1}, {2, 0}}};
    // Every replica derives every replica's input from (step, replica), so each checks its own result.
    auto input = [](int step, int64_t r, int64_t n) { return RandomData(step * 131 + r, n); };
    std::vector<int> wrong(nrep, 0);
    RunReplicas(nrep, c.get(), [&](int r) {
      for (int step = 0; step < steps; ++step) {
        std::mt19937 plan(step);  // same plan on every replica
        const int kind = plan() % 5;
        const int64_t n = plan() % 200;
        const Reduction op = kAllOps[plan() % 3];
        const std::vector<ReplicaGroup>& grouping = groupings[plan() % 3];
        const ReplicaGroup& g = std::find(grouping[0].begin(), grouping[0].end(), r) != grouping[0].end()
                                    ? grouping[0]
                                    : grouping[1];
        const int64_t pos = std::find(g.begin(), g.end(), r) - g.begin();
        const int64_t gs = static_cast<int64_t>(g.size());
        Buffers ins;
        for (int64_t m : g) ins.push_back(input(step, m, kind == 1 ? n * gs : n));
        std::vector<const std::vector<float>*> xs;
        for (const auto& x : ins) xs.push_back(&x);
        std::vector<float> mine = ins[pos], got, want;
        switch (kind) {
          case 0:
            c->AllReduce(r, g, mine.data(), n, op);
            got = mine, want = SequentialFold(xs, op);
            break;
          case 1:
            got.resize(n);
            c->ReduceScatter(r, g, mine.data(), got.data(), n, op);
            want = SequentialFold(xs, op);
            want = std::vector<float>(want.begin() + pos * n, want.begin() + (pos + 1) * n);
            break;
          case 2:
            got.resize(n * gs);
            c->AllGather(r, g, mine.data(), got.data(), n);
            for (const auto& x : ins) want.insert(want.end(), x.begin(), x.end());
            break;
          case 3:
            c->Broadcast(r, g, mine.data(), n, step % gs);
            got = mine, want = ins[step % gs];
            break;
          default:
            c->Barrier(r, g);
        }
        wrong[r] += BitDiff(got, want) != "";
      }
    });
    for (int r = 0; r < nrep; ++r) CHECK(wrong[r] == 0);
  }
}

TEST_CASE("ParseReduction names sum, mean and max", "[collectives]") {
  CHECK(ParseReduction("sum") == Reduction::kSum);
  CHECK(ParseReduction("mean") == Reduction::kMean);
  CHECK(ParseReduction("max") == Reduction::kMax);
  CHECK_THROWS_AS(ParseReduction("avg"), Error);
  CHECK_THROWS_WITH(ParseReduction("avg"), "unknown reduction 'avg' (expected sum, mean or max)");
}

TEST_CASE("InProcessCollectives passes the Collectives conformance test", "[collectives]") {
  CheckCollectivesConformance([](int n) { return std::make_unique<InProcessCollectives>(n); });
}

// Forwards the packed collectives only, so the parts forms run through Collectives' packing defaults
// (the path of MPI and the TPU mesh).
class PackingDefaults final : public Collectives {
 public:
  explicit PackingDefaults(int n) : inner_(n) {}
  int num_replicas() const override { return inner_.num_replicas(); }
  void AllReduce(int r, const ReplicaGroup& g, float* d, int64_t n, Reduction op) override { inner_.AllReduce(r, g, d, n, op); }
  void ReduceScatter(int r, const ReplicaGroup& g, const float* in, float* out, int64_t n, Reduction op) override {
    inner_.ReduceScatter(r, g, in, out, n, op);
  }
  void AllGather(int r, const ReplicaGroup& g, const float* in, float* out, int64_t n) override {
    inner_.AllGather(r, g, in, out, n);
  }
  void Broadcast(int r, const ReplicaGroup& g, float* d, int64_t n, int root) override { inner_.Broadcast(r, g, d, n, root); }
  void Barrier(int r, const ReplicaGroup& g) override { inner_.Barrier(r, g); }
  void Abort(const std::string& why) override { inner_.Abort(why); }

 private:
  InProcessCollectives inner_;
};

TEST_CASE("Collectives' packing defaults of the parts forms pass the conformance test", "[collectives]") {
  CheckCollectivesConformance([](int n) { return std::make_unique<PackingDefaults>(n); });
}

TEST_CASE("InProcessCollectives reports misuse instead of hanging", "[collectives]") {
  SECTION("members disagree on the element count") {
    InProcessCollectives c(2);
    std::vector<float> a(5, 1.0f), b(5, 1.0f);
    CHECK_THROWS_WITH(RunReplicas(2, &c,
                                  [&](int r) { c.AllReduce(r, {0, 1}, (r ? b : a).data(), r ? 5 : 4, Reduction::kSum); }),
                      Catch::Contains("collective mismatch in replica group {0,1}") &&
                          Catch::Contains("AllReduce(n=4, sum)") && Catch::Contains("AllReduce(n=5, sum)"));
  }
  SECTION("members call different collectives") {
    InProcessCollectives c(2);
    std::vector<float> a(4, 1.0f);
    CHECK_THROWS_WITH(RunReplicas(2, &c,
                                  [&](int r) {
                                    if (r == 0) c.Barrier(r, {0, 1});
                                    else c.Broadcast(r, {0, 1}, a.data(), 4, 0);
                                  }),
                      Catch::Contains("Barrier(n=0)") && Catch::Contains("Broadcast(n=4, root=0)"));
  }
  SECTION("bad groups and arguments") {
    InProcessCollectives c(4);
    float x = 0;
    CHECK_THROWS_WITH(c.Barrier(0, {1, 2}), "replica 0 is not in replica group {1,2}");
    CHECK_THROWS_WITH(c.Barrier(0, {0, 0}), Catch::Contains("invalid replica group {0,0}"));
    CHECK_THROWS_WITH(c.Barrier(0, {0, 4}), Catch::Contains("invalid replica group {0,4}"));
    CHECK_THROWS_WITH(c.Broadcast(0, {0}, &x, 1, 1), Catch::Contains("root position 1"));
    CHECK_THROWS_WITH(c.AllReduce(0, {0}, &x, -1, Reduction::kSum), Catch::Contains("negative element count"));
    CHECK_THROWS_AS(InProcessCollectives(0), Error);
    std::vector<float> buf(8);
    CHECK_THROWS_WITH(c.AllGather(0, {0, 1}, buf.data() + 2, buf.data(), 2),
                      "AllGather: the input and output buffers overlap");
    CHECK_THROWS_WITH(c.ReduceScatter(0, {0, 1}, buf.data(), buf.data() + 3, 2, Reduction::kSum),
                      "ReduceScatter: the input and output buffers overlap");
    CHECK_FALSE(c.aborted());  // argument errors do not abort the object
  }
}

TEST_CASE("InProcessCollectives: out-of-place all-reduce has the in-place bits and leaves the input alone",
          "[collectives]") {
  const int n = 5;
  const int64_t m = 1003;
  Buffers in(n), inplace(n), out(n, std::vector<float>(m));
  for (int r = 0; r < n; ++r) in[r] = inplace[r] = RandomData(50 + r, m);
  const Buffers original = in;
  InProcessCollectives c(n);
  RunReplicas(n, &c, [&](int r) {
    c.AllReduce(r, Iota(0, n), in[r].data(), out[r].data(), m, Reduction::kMean);
    c.AllReduce(r, Iota(0, n), inplace[r].data(), m, Reduction::kMean);
  });
  for (int r = 0; r < n; ++r) {
    CHECK(BitDiff(out[r], inplace[r]) == "");
    CHECK(BitDiff(in[r], original[r]) == "");
  }
}

TEST_CASE("InProcessCollectives: members that pass one shared output each write only their own chunk",
          "[collectives]") {
  const int n = 6;
  const std::vector<int64_t> ns = {5, 0, 1001};
  Buffers in(n);
  for (int r = 0; r < n; ++r) in[r] = RandomData(70 + r, 1006);
  // Part 0 and 2 shared by all members (with a sentinel after the end: nothing writes past it), part 1
  // (empty) each its own; the plain all-gather into one shared buffer too.
  std::vector<float> shared0(n * 5 + 1, -7.0f), shared2(n * 1001 + 1, -7.0f), shared_plain(n * 1006 + 1, -7.0f);
  Buffers own1(n, std::vector<float>(1, -7.0f));
  InProcessCollectives c(n);
  for (int round = 0; round < 3; ++round) {
    RunReplicas(n, &c, [&](int r) {
      const float* ins[] = {in[r].data(), in[r].data() + 5, in[r].data() + 5};
      float* outs[] = {shared0.data(), own1[r].data(), shared2.data()};
      c.AllGatherParts(r, Iota(0, n), ins, ns.data(), 3, outs);
      c.AllGather(r, Iota(0, n), in[r].data(), shared_plain.data(), 1006);
    });
    for (int q = 0; q < n; ++q) {
      INFO("round " << round << " chunk " << q);
      CHECK(BitDiff(std::vector<float>(shared0.begin() + q * 5, shared0.begin() + (q + 1) * 5),
                    std::vector<float>(in[q].begin(), in[q].begin() + 5)) == "");
      CHECK(BitDiff(std::vector<float>(shared2.begin() + q * 1001, shared2.begin() + (q + 1) * 1001),
                    std::vector<float>(in[q].begin() + 5, in[q].end())) == "");
      CHECK(BitDiff(std::vector<float>(shared_plain.begin() + q * 1006, shared_plain.begin() + (q + 1) * 1006), in[q]) ==
            "");
    }
    CHECK(shared0.back() == -7.0f);
    CHECK(shared2.back() == -7.0f);
    CHECK(shared_plain.back() == -7.0f);
  }
  SECTION("some members sharing an output and others not is an error, not a race") {
    InProcessCollectives c3(3);
    std::vector<float> a(3), b(3);
    CHECK_THROWS_WITH(RunReplicas(3, &c3,
                                  [&](int r) {
                                    const float x = 1.0f;
                                    c3.AllGather(r, Iota(0, 3), &x, r == 2 ? b.data() : a.data(), 1);
                                  }),
                      Catch::Contains("replicas 0 and 1 write into the same buffer but others do not"));
    InProcessCollectives c4(3);
    CHECK_THROWS_WITH(RunReplicas(3, &c4,
                                  [&](int r) {
                                    const float x = 1.0f;
                                    const float* ins[] = {&x};
                                    const int64_t len[] = {1};
                                    float* outs[] = {r == 0 ? b.data() : a.data()};
                                    c4.AllGatherParts(r, Iota(0, 3), ins, len, 1, outs);
                                  }),
                      Catch::Contains("replicas 1 and 2 write part 0 into the same buffer but others do not"));
  }
}

// The sharded weight update's loop stores a replica's new slice where the all-gather's output has it
// (jit::JitOptions::in_place_all_gathers): the all-gather then copies the other members' chunks only.
TEST_CASE("InProcessCollectives: an all-gather whose input is the member's own chunk of its output runs in place",
          "[collectives]") {
  const int n = 4;
  const int64_t m = 1001;
  Buffers data(n);
  for (int r = 0; r < n; ++r) data[r] = RandomData(90 + r, m);
  SECTION("each member its own output") {
    Buffers out(n, std::vector<float>(n * m + 1, -7.0f));
    for (int r = 0; r < n; ++r) std::copy(data[r].begin(), data[r].end(), out[r].begin() + r * m);
    InProcessCollectives c(n);
    RunReplicas(n, &c, [&](int r) { c.AllGather(r, Iota(0, n), out[r].data() + r * m, out[r].data(), m); });
    for (int r = 0; r < n; ++r)
      for (int q = 0; q < n; ++q) {
        INFO("member " << r << " chunk " << q);
        CHECK(BitDiff(std::vector<float>(out[r].begin() + q * m, out[r].begin() + (q + 1) * m), data[q]) == "");
      }
    for (int r = 0; r < n; ++r) CHECK(out[r].back() == -7.0f);
  }
  SECTION("one output shared by all") {
    std::vector<float> shared(n * m + 1, -7.0f);
    for (int r = 0; r < n; ++r) std::copy(data[r].begin(), data[r].end(), shared.begin() + r * m);
    InProcessCollectives c(n);
    RunReplicas(n, &c, [&](int r) { c.AllGather(r, Iota(0, n), shared.data() + r * m, shared.data(), m); });
    for (int q = 0; q < n; ++q)
      CHECK(BitDiff(std::vector<float>(shared.begin() + q * m, shared.begin() + (q + 1) * m), data[q]) == "");
    CHECK(shared.back() == -7.0f);
  }
  SECTION("another member's chunk of the output is still an overlap") {
    InProcessCollectives c(2);
    std::vector<float> buf(4);
    CHECK_THROWS_WITH(c.AllGather(0, {0, 1}, buf.data() + 2, buf.data(), 2), "AllGather: the input and output buffers overlap");
  }
}

TEST_CASE("InProcessCollectives counts communication time, and with phase timing members leave together",
          "[collectives]") {
  const int n = 4;
  const int64_t m = 1 << 20;
  for (bool phase : {false, true}) {
    InProcessCollectives c(n);
    c.set_phase_timing(phase);
    Buffers data(n, std::vector<float>(m, 1.0f)), shard(n, std::vector<float>(m / n)), full(n, std::vector<float>(m));
    std::vector<int> complete_peers(n, 0);
    const auto t0 = Clock::now();
    RunReplicas(n, &c, [&](int r) {
      // Replica r arrives r * 20 ms late: the wait is not communication.
      std::this_thread::sleep_for(std::chrono::milliseconds(20 * r));
      c.ReduceScatter(r, Iota(0, n), data[r].data(), shard[r].data(), m / n, Reduction::kSum);
      if (phase) {  // everyone has finished the reduce-scatter: other members' outputs are complete
        for (int q = 0; q < n; ++q)
          complete_peers[r] += std::all_of(shard[q].begin(), shard[q].end(), [&](float x) { return x == n; });
      }
      c.AllGather(r, Iota(0, n), shard[r].data(), full[r].data(), m / n);
      c.AllReduce(r, Iota(0, n), data[r].data(), m, Reduction::kSum);
    });
    const double wall = SecondsSince(t0);
    CHECK(c.calls() == 3);
    CHECK(c.busy_seconds() > 0);
    CHECK(c.busy_seconds() < wall - 0.05);  // the 60 ms of staggered arrival is not counted
    for (int r = 0; r < n; ++r) CHECK(full[r][0] == static_cast<float>(n));
    if (phase) {
      for (int r = 0; r < n; ++r) CHECK(complete_peers[r] == n);
    }
  }
}


namespace {
// A produced part for ReduceScatterProducts: writes row `chunk` of its owner's [n, len] buffer, and
// counts the calls.
struct RowProducer {
  const float* rows;
  int64_t len;
  std::atomic<int>* calls;
  static void Produce(const void* self, int64_t chunk, float* dst) {
    const auto& p = *static_cast<const RowProducer*>(self);
    std::copy_n(p.rows + chunk * p.len, p.len, dst);
    ++*p.calls;
  }
  static void Add(const void* self, int64_t chunk, float* dst) {
    const auto& p = *static_cast<const RowProducer*>(self);
    for (int64_t j = 0; j < p.len; ++j) dst[j] += p.rows[chunk * p.len + j];
    *p.calls += 1000;
  }
};
}  // namespace

TEST_CASE("InProcessCollectives: produced parts fold with the bits of the materialised parts", "[collectives]") {
  const int n = 5;
  const std::vector<int64_t> ns = {7, 3001, 1};  // part 1 produced (longer than FoldFrom's window), 0 and 2 in memory
  Buffers in(n);
  for (int r = 0; r < n; ++r) in[r] = RandomData(90 + r, n * (7 + 3001 + 1));
  // Member r's part i starts at in[r] + offset[i] * n ([n, ns[i]] row-major, as ReduceScatterParts reads).
  const int64_t offset[] = {0, 7, 7 + 3001};
  for (Reduction op : {Reduction::kSum, Reduction::kMean, Reduction::kMax}) {
    INFO("reduction " << static_cast<int>(op));
    Buffers materialised(n, std::vector<float>(3009)), produced(n, std::vector<float>(3009, -7.0f));
    InProcessCollectives c(n);
    std::atomic<int> calls{0};
    RunReplicas(n, &c, [&](int r) {
      const float* ins[] = {in[r].data(), in[r].data() + offset[1] * n, in[r].data() + offset[2] * n};
      c.ReduceScatterParts(r, Iota(0, n), ins, ns.data(), 3, materialised[r].data(), op);
      const RowProducer rows{ins[1], ns[1], &calls};
      const PartProducer producers[] = {{}, {&RowProducer::Produce, &rows}, {}};
      const float* no_part1[] = {ins[0], nullptr, ins[2]};  // a produced part is never read
      c.ReduceScatterProducts(r, Iota(0, n), no_part1, producers, ns.data(), 3, produced[r].data(), op);
    });
    CHECK(calls.load() == n * n);  // each member produces its chunk of every member's part
    for (int r = 0; r < n; ++r) CHECK(BitDiff(produced[r], materialised[r]) == "");
    // With an add: the first member's chunk produced, each later one added into the result (a max
    // still produces every chunk and folds it).
    Buffers added(n, std::vector<float>(3009, -7.0f));
    calls = 0;
    RunReplicas(n, &c, [&](int r) {
      const float* ins[] = {in[r].data(), in[r].data() + offset[1] * n, in[r].data() + offset[2] * n};
      const RowProducer rows{ins[1], ns[1], &calls};
      const PartProducer producers[] = {{}, {&RowProducer::Produce, &rows, &RowProducer::Add}, {}};
      const float* no_part1[] = {ins[0], nullptr, ins[2]};
      c.ReduceScatterProducts(r, Iota(0, n), no_part1, producers, ns.data(), 3, added[r].data(), op);
    });
    CHECK(calls.load() == (op == Reduction::kMax ? n * n : n + 1000 * n * (n - 1)));
    for (int r = 0; r < n; ++r) CHECK(BitDiff(added[r], materialised[r]) == "");
  }
  SECTION("members that disagree on which parts are produced get an error naming them") {
    InProcessCollectives c(2);
    std::atomic<int> calls{0};
    CHECK_THROWS_WITH(RunReplicas(2, &c,
                                  [&](int r) {
                                    const float x[2] = {1.0f, 2.0f};
                                    const float* ins[] = {x};
                                    const int64_t len[] = {1};
                                    const RowProducer rows{x, 1, &calls};
                                    const PartProducer producers[] = {{&RowProducer::Produce, &rows}};
                                    float out = 0;
                                    c.ReduceScatterProducts(r, Iota(0, 2), ins, r == 0 ? producers : nullptr, len, 1,
                                                            &out, Reduction::kSum);
                                  }),
                      Catch::Contains("collective mismatch in replica group {0,1}") && Catch::Contains("produced: 0"));
  }
  SECTION("folding products can be switched off (the step then materialises them)") {
    InProcessCollectives c(1);
    c.set_fold_products(false);
    CHECK_FALSE(c.FoldsProducts());
    c.set_fold_products(true);
    CHECK(c.FoldsProducts());
  }
}

}  // namespace
}  // namespace shardstep::runtime
