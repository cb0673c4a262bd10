// oneDNN sgemm and the process threading policy (see dnnl_kernels.h).
#include "jit/dnnl_kernels.h"

#include <dlfcn.h>
#include <dnnl.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <thread>

#include "ir/error.h"

namespace shardstep::jit {

int NumCores() { return std::max(1u, std::thread::hardware_concurrency()); }

namespace {
// libgomp is loaded as oneDNN's dependency; we look its API up instead of linking -fopenmp.
using SetThreads = void (*)(int);
using GetThreads = int (*)();
SetThreads OmpSet() {
  static SetThreads f = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  return f;
}
GetThreads OmpGet() {
  static GetThreads f = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
  return f;
}
}  // namespace

int OmpMaxThreads() { return OmpGet() ? OmpGet()() : -1; }

void ConfigureThreadsForReplica(int replicas) {
  static const bool blas_once = [] {  // OpenBLAS (the interpreter's BLAS) stays single-threaded
    if (auto f = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) f(1);
    return true;
  }();
  (void)blas_once;
  SetOmpThreads(1);
}

void SetOmpThreads(int n) {
  if (SetThreads f = OmpSet()) f(std::max(1, n));
}

void ParallelSgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                   int64_t ldb, float* c) {
  // About 2M multiply-adds per block at least, at most 8 blocks, rows a multiple of 8.
  const int64_t work = m * n * k;
  int64_t blocks = std::clamp<int64_t>(work >> 21, 1, 8);
  blocks = std::min<int64_t>(blocks, std::max<int64_t>(1, m / 8));
  int64_t rows = (m + blocks - 1) / blocks;
  rows = (rows + 7) / 8 * 8;
  blocks = (m + rows - 1) / rows;
  auto run = [&](int64_t blk) {
    thread_local const bool single = (SetOmpThreads(1), true);
    (void)single;
    const int64_t r0 = blk * rows, mb = std::min(rows, m - r0);
    DnnlSgemm(ta, tb, mb, n, k, a + (ta ? r0 : r0 * lda), lda, b, ldb, 0.0f, c + r0 * n, n);
  };
  if (blocks <= 1) {
    run(0);
    return;
  }
  tbb::parallel_for(int64_t{0}, blocks, run);
}

void DnnlSgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
               int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (beta == 0)
      for (int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
    return;
  }
  dnnl_status_t s = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, 1.0f, a, std::max<int64_t>(lda, 1), b,
                               std::max<int64_t>(ldb, 1), beta, c, std::max<int64_t>(ldc, 1));
  SS_CHECK(s == dnnl_success, "dnnl_sgemm failed with status ", static_cast<int>(s));
}

}  // namespace shardstep::jit
