// bench/sgemm_shapes: C = A B^T (the backward pass's dX = dY W^T) with few rows, as the step runs it
// (ParallelSgemm: blocks as TBB tasks, one OpenMP thread per oneDNN call) against the same product
// turned around (jit::TurnedSgemmNT: C^T = B A^T, then transposed back), over a grid of shapes.
// Medians of wall time over --reps calls, the two measured alternately so machine noise hits both
// alike. `--threads 1` is a replica's view when N >= cores (each replica thread runs its own work).
// Prints the ratio turned / direct and whether StepSgemm's rule (jit::SgemmTurnsAround) turns the
// shape, and checks that the two agree to float rounding.
#include <CLI/CLI.hpp>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "jit/dnnl_kernels.h"

using namespace shardstep;

namespace {
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"C = A B^T with few rows: direct against turned around"};
  int reps = 15, threads = 0;
  app.add_option("--reps", reps, "calls per shape and path (medians)")->check(CLI::Range(3, 1000));
  app.add_option("--threads", threads, "TBB threads (0: all cores)")->check(CLI::Range(0, 256));
  CLI11_PARSE(app, argc, argv);
  jit::ConfigureThreadsForReplica(1);
  tbb::task_arena arena(threads > 0 ? threads : tbb::task_arena::automatic);
  const int64_t nk[][2] = {{1024, 1024}, {1024, 784}, {512, 512}, {128, 512}, {512, 4096}, {4096, 512}, {512, 128}};
  std::printf("%6s %6s %4s  %10s %10s  %6s  %s\n", "n", "k", "m", "direct ms", "turned ms", "ratio", "rule turns");
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  double worst = 0;
  for (const auto& [n, k] : nk) {
    for (int64_t m : {8, 12, 16, 24, 32, 48, 64, 128}) {
      std::vector<float> a(m * k), b(n * k), direct(m * n), turned(m * n);
      for (float& x : a) x = u(rng);
      for (float& x : b) x = u(rng);
      std::vector<double> td, tt;
      arena.execute([&] {
        for (int r = 0; r < reps + 1; ++r) {
          auto t0 = std::chrono::steady_clock::now();
          jit::ParallelSgemm(false, true, m, n, k, a.data(), k, b.data(), k, direct.data());
          auto t1 = std::chrono::steady_clock::now();
          jit::TurnedSgemmNT(m, n, k, a.data(), b.data(), turned.data());
          auto t2 = std::chrono::steady_clock::now();
          if (r == 0) continue;  // warm-up
          td.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
          tt.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
        }
      });
      double diff = 0, scale = 0;
      for (int64_t i = 0; i < m * n; ++i) {
        diff = std::max<double>(diff, std::fabs(direct[i] - turned[i]));
        scale = std::max<double>(scale, std::fabs(direct[i]));
      }
      worst = std::max(worst, diff / scale);
      const double d = Median(td), t = Median(tt);
      std::printf("%6lld %6lld %4lld  %10.4f %10.4f  %6.2f  %s\n", static_cast<long long>(n), static_cast<long long>(k),
                  static_cast<long long>(m), d, t, t / d, jit::SgemmTurnsAround(false, true, m, n, k) ? "yes" : "no");
    }
  }
  std::printf("largest |direct - turned| / max |direct|: %.3g (float rounding: the sums run in another order)\n", worst);
  if (!(worst < 1e-5)) {
    std::fprintf(stderr, "turned and direct products disagree beyond rounding\n");
    return 1;
  }
  return 0;
}
