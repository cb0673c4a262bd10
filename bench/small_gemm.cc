// bench/small_gemm: the products a data-parallel replica runs with few rows or a short sum (a replica's
// slice of the batch: C = X W, dX = dY W^T with m = batch / N; its weight gradients' row blocks, dW =
// X^T dY with k = batch / N) through jit::SmallGemm against what the step ran before it (oneDNN sgemm:
// jit::ParallelSgemm, or jit::TurnedSgemmNT where StepSgemm's rule turns the product; one dnnl_sgemm
// call for a row block). Medians of wall time over --reps calls, the two measured alternately. Prints
// ms, GFLOP/s, the ratio small / oneDNN, whether jit::SmallGemmApplies picks the shape, and checks the
// two agree to float rounding. `--threads 1` is a replica's view when N >= cores; `--replicas R` runs
// R threads at once, each its own product on the shared B (the step's view: R replicas on the machine's
// cores, each calling the same product on its slice; ms are then the wall time of all R calls).
#include <CLI/CLI.hpp>
#include <tbb/task_arena.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "jit/dnnl_kernels.h"
#include "jit/huge_pages.h"
#include "jit/small_gemm.h"

using namespace shardstep;

namespace {
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
struct Shape {
  bool ta, tb;
  int64_t m, n, k;
  const char* what;
};
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"small products: jit::SmallGemm against oneDNN sgemm"};
  int reps = 21, threads = 1;
  app.add_option("--reps", reps, "calls per shape and path (medians)")->check(CLI::Range(3, 1000));
  app.add_option("--threads", threads, "TBB threads (0: all cores; with --replicas 1)")->check(CLI::Range(0, 256));
  int replicas = 1;
  app.add_option("--replicas", replicas, "threads calling the product at once, each on its own A and C")
      ->check(CLI::Range(1, 64));
  bool huge = false;
  app.add_flag("--huge-pages", huge, "B (the weight) in 2 MiB pages (jit::HugePageMemory)");
  CLI11_PARSE(app, argc, argv);
  if (!jit::SmallGemmRuns()) {
    std::printf("bench/small_gemm: this CPU has neither AVX2 + FMA nor AVX-512; nothing to measure\n");
    return 0;
  }
  jit::ConfigureThreadsForReplica(1);
  tbb::task_arena arena(threads > 0 ? threads : tbb::task_arena::automatic);
  std::vector<Shape> shapes;
  for (int64_t m : {8, 16, 32, 64}) {
    shapes.push_back({false, false, m, 1024, 784, "forward X W"});
    shapes.push_back({false, false, m, 1024, 1024, "forward X W"});
    shapes.push_back({false, false, m, 2048, 512, "forward X W"});
  }
  for (int64_t m : {8, 16, 32, 64}) {
    shapes.push_back({false, true, m, 1024, 1024, "input gradient dY W^T"});
    shapes.push_back({false, true, m, 512, 2048, "input gradient dY W^T"});
  }
  for (int64_t k : {8, 16, 32, 64}) {
    shapes.push_back({true, false, 128, 1024, k, "weight gradient row block X^T dY"});
    shapes.push_back({true, false, 98, 1024, k, "weight gradient row block X^T dY"});
    shapes.push_back({true, false, 1024, 1024, k, "weight gradient X^T dY"});
  }
  if (replicas > 1)
    std::printf("%d replica threads at once (each its own A and C, B shared; ms: all of their calls), medians of %d\n",
                replicas, reps);
  else std::printf("threads %d (TBB arena), medians of %d calls\n", threads, reps);
  std::printf("%-2s %5s %5s %5s  %10s %10s  %8s %8s  %6s  %-6s %s\n", "op", "m", "n", "k", "oneDNN ms", "small ms",
              "GFLOP/s", "GFLOP/s", "ratio", "rule", "what");
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  double worst = 0;
  for (const Shape& s : shapes) {
    const int64_t lda = s.ta ? s.m : s.k, ldb = s.tb ? s.k : s.n;
    std::vector<std::vector<float>> as(replicas, std::vector<float>(s.m * s.k)), refs(replicas, std::vector<float>(s.m * s.n)),
        gots(replicas, std::vector<float>(s.m * s.n));
    std::vector<float>& ref = refs[0];
    std::vector<float>& got = gots[0];
    jit::HugePageMemory bmem;
    std::vector<float> bvec;
    float* b_data;
    if (huge) {
      bmem.Assign(s.k * s.n * sizeof(float));
      b_data = reinterpret_cast<float*>(bmem.data());
    } else {
      bvec.resize(s.k * s.n);
      b_data = bvec.data();
    }
    for (auto& x : as)
      for (float& v : x) v = u(rng);
    for (int64_t i = 0; i < s.k * s.n; ++i) b_data[i] = u(rng);
    // Path 0 (oneDNN, as the step ran it before SmallGemm) or 1 (SmallGemm) on replica t's operands.
    auto call = [&](int path, int t) {
      const float* at = as[t].data();
      if (path == 0) {
        float* c = refs[t].data();
        if (s.ta) jit::DnnlSgemm(s.ta, s.tb, s.m, s.n, s.k, at, lda, b_data, ldb, 0.0f, c, s.n);
        else if (jit::SgemmTurnsAround(s.ta, s.tb, s.m, s.n, s.k)) jit::TurnedSgemmNT(s.m, s.n, s.k, at, b_data, c);
        else jit::ParallelSgemm(s.ta, s.tb, s.m, s.n, s.k, at, lda, b_data, ldb, c);
      } else {
        float* c = gots[t].data();
        if (s.ta) jit::SmallGemm(s.ta, s.tb, s.m, s.n, s.k, at, lda, b_data, ldb, false, c, s.n);
        else jit::ParallelSmallGemm(s.ta, s.tb, s.m, s.n, s.k, at, lda, b_data, ldb, c);
      }
    };
    // All replicas' calls of one path: on this thread, or on `replicas` threads started together.
    int path = 0;
    bool stop = false;
    std::barrier sync(replicas + 1);
    std::vector<std::thread> threads_of;
    if (replicas > 1)
      for (int t = 0; t < replicas; ++t)
        threads_of.emplace_back([&, t] {
          jit::ConfigureThreadsForReplica(replicas);
          for (;;) {
            sync.arrive_and_wait();
            if (stop) return;
            call(path, t);
            sync.arrive_and_wait();
          }
        });
    auto run = [&](int p) {
      if (replicas == 1) return call(p, 0);
      path = p;
      sync.arrive_and_wait();
      sync.arrive_and_wait();
    };
    std::vector<double> td, ts;
    arena.execute([&] {
      for (int r = 0; r < reps + 1; ++r) {
        auto t0 = std::chrono::steady_clock::now();
        run(0);
        auto t1 = std::chrono::steady_clock::now();
        run(1);
        auto t2 = std::chrono::steady_clock::now();
        if (r == 0) continue;  // warm-up
        td.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        ts.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
      }
    });
    if (replicas > 1) {
      stop = true;
      sync.arrive_and_wait();
      for (std::thread& t : threads_of) t.join();
    }
    double diff = 0, scale = 0;
    for (int64_t i = 0; i < s.m * s.n; ++i) {
      diff = std::max<double>(diff, std::fabs(ref[i] - got[i]));
      scale = std::max<double>(scale, std::fabs(ref[i]));
    }
    worst = std::max(worst, diff / scale);
    const double d = Median(td), t = Median(ts), gflop = 2.0 * s.m * s.n * s.k * 1e-9 * replicas;
    std::printf("%-2s %5lld %5lld %5lld  %10.4f %10.4f  %8.1f %8.1f  %6.2f  %-6s %s\n", s.ta ? "TN" : s.tb ? "NT" : "NN",
                static_cast<long long>(s.m), static_cast<long long>(s.n), static_cast<long long>(s.k), d, t,
                gflop / d * 1e3, gflop / t * 1e3, t / d, jit::SmallGemmApplies(s.ta, s.tb, s.m, s.n, s.k) ? "small" : "oneDNN",
                s.what);
  }
  std::printf("largest |oneDNN - small| / max |oneDNN|: %.3g (float rounding: the sums run in another order)\n", worst);
  if (!(worst < 1e-5)) {
    std::fprintf(stderr, "bench/small_gemm: the two products disagree beyond rounding\n");
    return 1;
  }
  return 0;
}
