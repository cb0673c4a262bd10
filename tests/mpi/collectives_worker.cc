// Launched by tests/runtime/mpi_collectives_test.cc under mpirun: every rank computes, for each case,
// what InProcessCollectives gives for all K replicas (K threads in this process) and checks its own
// replica's result from MpiCollectives against it bit for bit. Prints one line per rank; exit 1 on a
// mismatch. With --replicas-per-process T: HybridCollectives, T replica threads per rank (K = ranks x T),
// each checked (tests/mpi/mpi_hybrid_test.cc).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "runtime/inprocess_collectives.h"
#include "runtime/mpi/hybrid_collectives.h"
#include "runtime/mpi/mpi_collectives.h"
#include "runtime/replica_runner.h"

using namespace shardstep::runtime;

namespace {

enum class Kind { kAllReduce, kReduceScatter, kAllGather, kBroadcast };

// Replica r's input: mixed magnitudes, so the order of a sum shows in its bits.
std::vector<float> Input(int r, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed * 131 + r);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> x(n);
  for (float& v : x) v = std::ldexp(u(rng), static_cast<int>(rng() % 21) - 10);
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  MpiSession session(&argc, &argv);
  // --replicas-per-process T: HybridCollectives, T replica threads per rank (K = ranks x T replicas).
  const int T = argc >= 3 && std::string(argv[1]) == "--replicas-per-process" ? std::atoi(argv[2]) : 0;
  MpiCollectives mpi;
  std::unique_ptr<HybridCollectives> hybrid = T > 0 ? std::make_unique<HybridCollectives>(T, 30.0) : nullptr;
  Collectives& c = hybrid ? static_cast<Collectives&>(*hybrid) : mpi;
  const int per_rank = std::max(T, 1), K = session.size() * per_rank, first = session.rank() * per_rank;
  int cases = 0, mismatches = 0;
  int64_t elements = 0, order_sensitive = 0;
  uint32_t seed = 1;
  std::vector<std::vector<ReplicaGroup>> groupings = {{ReplicaGroup{}}};
  for (int r = 0; r < K; ++r) groupings[0][0].push_back(r);
  if (K % 2 == 0) {  // pairs (0,1), (2,3)... and interleaved (0,2,4..), (1,3,5..)
    std::vector<ReplicaGroup> pairs, halves(2);
    for (int r = 0; r < K; r += 2) pairs.push_back({r, r + 1});
    for (int r = 0; r < K; ++r) halves[r % 2].push_back(r);
    groupings.push_back(pairs);
    groupings.push_back(halves);
  }
  for (const auto& groups : groupings)
    for (Kind kind : {Kind::kAllReduce, Kind::kReduceScatter, Kind::kAllGather, Kind::kBroadcast})
      for (Reduction op : {Reduction::kSum, Reduction::kMean, Reduction::kMax})
        for (int64_t n : {0, 1, 7, 1000, 4099}) {
          if ((kind == Kind::kAllGather || kind == Kind::kBroadcast) && op != Reduction::kSum) continue;
          ++seed;
          auto group_of = [&](int r) -> const ReplicaGroup& {
            for (const auto& g : groups)
              for (int64_t m : g)
                if (m == r) return g;
            std::abort();
          };
          const int64_t g = static_cast<int64_t>(group_of(first).size());  // every group has the same size
          const int64_t in_n = kind == Kind::kReduceScatter ? n * g : n;
          const int64_t out_n = kind == Kind::kAllGather ? n * g : n;
          std::vector<std::vector<float>> in(K), ref(K, std::vector<float>(out_n));
          for (int r = 0; r < K; ++r) in[r] = Input(r, in_n, seed);
          // The in-process reference for every replica.
          InProcessCollectives ip(K);
          RunReplicas(K, &ip, [&](int r) {
            const ReplicaGroup& gr = group_of(r);
            switch (kind) {
              case Kind::kAllReduce: ref[r] = in[r]; ip.AllReduce(r, gr, ref[r].data(), n, op); break;
              case Kind::kReduceScatter: ip.ReduceScatter(r, gr, in[r].data(), ref[r].data(), n, op); break;
              case Kind::kAllGather: ip.AllGather(r, gr, in[r].data(), ref[r].data(), n); break;
              case Kind::kBroadcast: ref[r] = in[r]; ip.Broadcast(r, gr, ref[r].data(), n, 1 % gr.size()); break;
            }
          });
          std::vector<std::vector<float>> outs(per_rank, std::vector<float>(out_n));
          RunReplicas(per_rank, &c, [&](int t) {
            const int me = first + t;
            std::vector<float>& out = outs[t];
            const ReplicaGroup& gr = group_of(me);
            switch (kind) {
              case Kind::kAllReduce: out = in[me]; c.AllReduce(me, gr, out.data(), n, op); break;
              case Kind::kReduceScatter: c.ReduceScatter(me, gr, in[me].data(), out.data(), n, op); break;
              case Kind::kAllGather: c.AllGather(me, gr, in[me].data(), out.data(), n); break;
              case Kind::kBroadcast: out = in[me]; c.Broadcast(me, gr, out.data(), n, 1 % gr.size()); break;
            }
          });
          for (int t = 0; t < per_rank; ++t) {
            const int me = first + t;
            const std::vector<float>& out = outs[t];
            const ReplicaGroup& gr = group_of(me);
            ++cases;
            elements += out_n;
            if (out_n && std::memcmp(out.data(), ref[me].data(), out_n * sizeof(float)) != 0) {
              ++mismatches;
              std::fprintf(stderr, "replica %d: case %d (kind %d, op %d, n %ld, %zu groups) differs from in-process\n",
                           me, cases, static_cast<int>(kind), static_cast<int>(op), static_cast<long>(n),
                           groups.size());
            }
            // That the check can fail: the same all-reduce summed in the reverse group order differs somewhere.
            if (kind == Kind::kAllReduce && op == Reduction::kSum && g > 2)
              for (int64_t j = 0; j < n; ++j) {
                float rev = 0;
                for (auto it = gr.rbegin(); it != gr.rend(); ++it) rev += in[*it][j];
                order_sensitive += std::memcmp(&rev, &out[j], 4) != 0;
              }
          }
        }
  std::printf("rank %d of %d: %s, %d cases, %ld elements, %ld order-sensitive sums\n", session.rank(), session.size(),
              mismatches ? "MISMATCH" : "ok", cases, static_cast<long>(elements), static_cast<long>(order_sensitive));
  std::fflush(stdout);
  return mismatches ? 1 : 0;
}
