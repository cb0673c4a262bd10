// oneDNN kernels for the CPU backend (matmul as sgemm) and the threading policy that keeps oneDNN's
// OpenMP threads, TBB's workers and the replica threads from oversubscribing the cores.
#pragma once

#include <cstdint>

namespace shardstep::jit {

// Row-major C[m,n] = op(A)[m,k] * op(B)[k,n] (+ beta * C) through dnnl_sgemm.
void DnnlSgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
               int64_t ldb, float beta, float* c, int64_t ldc);

// Threading policy. Debian's libdnnl uses OpenMP (libgomp). Call from each replica thread before
// its first oneDNN call: with `replicas` threads sharing the machine each gets
// max(1, cores / replicas) OpenMP threads (omp_set_num_threads is per calling thread). OpenBLAS is
// set to one thread (the interpreter does the same); TBB runs the fused loops.
void ConfigureThreadsForReplica(int replicas);
// The hardware threads this process may use.
int NumCores();
// Threads oneDNN's OpenMP would use on the calling thread (omp_get_max_threads), or -1 if unknown.
int OmpMaxThreads();

}  // namespace shardstep::jit
