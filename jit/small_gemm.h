// Products with few rows or a short sum, as a replica of a data-parallel step runs them: its slice of
// the batch times a weight (C = X W, dX = dY W^T: m = the batch / N rows) and its weight gradients'
// row blocks folded by the reduce-scatter (dW = X^T dY: k = the batch / N). oneDNN's sgemm packs the
// whole weight on every such call (jit/dnnl_kernels.h); these loops read it once in place, in
// micro-tiles of 6 rows x 2 vectors (jit/small_gemm_loops.inc), built for AVX-512 and AVX2 + FMA.
//
// Each element of C is one chain of fused multiply-adds over k in order from zero (then added to C
// with `add`): its bits depend only on the operands, not on the lanes, the tiles or the threads.
#pragma once

#include <cstdint>

namespace shardstep::jit {

// Whether the step's products of this shape run here (SmallGemm) instead of oneDNN: NN and NT with
// 1 <= m <= 32 and n, k >= 64 (NT: k a multiple of 8); TN with k <= 32, 8 <= m <= 256 (a row block) and
// n >= 8. A rule on the
// shapes and the CPU alone (oneDNN without its avx512_core kernels: where these were measured faster,
// bench/small_gemm), so one machine always computes the same bits. SHARDSTEP_SMALL_GEMM=off|on
// overrides the CPU's choice for the process (measurements).
bool SmallGemmApplies(bool ta, bool tb, int64_t m, int64_t n, int64_t k);

// C[m, n] (row-major, leading dimension ldc) = op(A) op(B), or C += op(A) op(B) with `add`
// (bit for bit the product computed alone and then added). NN, NT and TN; runs on the calling thread.
void SmallGemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
               int64_t ldb, bool add, float* c, int64_t ldc);

// The same product split into TBB tasks (the bits do not depend on the split). C = op(A) op(B).
void ParallelSmallGemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                       const float* b, int64_t ldb, float* c);

// C = A B (NN) from B packed beforehand, bit for bit ParallelSmallGemm's: the replicas of one process
// multiply their slices of the batch by the one weight they share, packed once for all of them
// (jit/shared_weight_packs.h) instead of once by each. B's packed form: column panels of
// SmallGemmPanelColumns() columns (the last zero-padded), each its k rows one after another.
int64_t SmallGemmPanelColumns();
int64_t PackedBFloats(int64_t n, int64_t k);
// Packs B's columns [j0, j1) (j0 a multiple of the panel columns; j1 one too, or n) into `packed`.
void PackB(int64_t n, int64_t k, const float* b, int64_t ldb, int64_t j0, int64_t j1, float* packed);
void ParallelSmallGemmPackedB(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* packed,
                              float* c);

// Whether the loops can run on this CPU (AVX2 + FMA or AVX-512).
bool SmallGemmRuns();

}  // namespace shardstep::jit
