// oneDNN kernels for the CPU backend (matmul as sgemm) and the threading policy that keeps oneDNN's
// OpenMP threads, TBB's workers and the replica threads from oversubscribing the cores.
#pragma once

#include <cstdint>

namespace shardstep::jit {

// Row-major C[m,n] = op(A)[m,k] * op(B)[k,n] (+ beta * C) through dnnl_sgemm.
void DnnlSgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
               int64_t ldb, float beta, float* c, int64_t ldc);

// The step's matmul: C = op(A) op(B) split into row blocks (column blocks when m < n: the MLP's
// batch-128 products, where every row block would read all of B) whose boundaries depend only on the
// shapes, run as TBB tasks, each one single-threaded dnnl_sgemm. So TBB alone owns the cores: no
// OpenMP team is ever started by a step, and no OpenMP worker spins after a call.
void ParallelSgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                   int64_t ldb, float* c);

// A step's 2-D matmul, called from the replica thread (not from a TBB task: it may use that thread's
// scratch). PaddedBSgemm where SgemmPadsB takes the shape (B's rows 4 KiB apart, a long sum: also a
// replica's few rows times a weight), else jit::SmallGemm where its rule takes the shape (a replica's slice of the batch at N >= 4 on
// an AVX2 CPU: jit/small_gemm.h). Else as ParallelSgemm, except C = A B^T with few rows and a leading dimension that is a multiple
// of 512 floats (a replica's slice of the batch times a weight in the backward pass: dX = dY W^T) is
// computed turned around, C^T = B A^T, and transposed back. oneDNN packs B^T for each such call, and
// B's rows 2 KiB apart alias in the cache: at m = 16, n = k = 1024 the direct call is 3.2x slower
// (bench/sgemm_shapes). And B's rows a multiple of 4 KiB apart with a long sum: SgemmPadsB. The
// choice depends only on the shapes, so the bits do too.
void StepSgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
               int64_t ldb, float* c);
// C = op(A) op(B) in `blocks` equal row blocks (m % blocks == 0), each one single-threaded dnnl_sgemm
// call (TBB tasks): a weight gradient summed across `blocks` replicas, whose chunks are its row blocks.
// SgemmRowBlock computes one block into any row-major [m / blocks, n] buffer with the same call, so
// the same bits: a member of the sum can compute its chunk of every replica's product itself. A block
// jit::SmallGemmApplies to (k, the replica's rows, <= 32) runs there.
void RowBlockSgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                   int64_t ldb, int64_t blocks, float* c);
void SgemmRowBlock(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                   int64_t ldb, int64_t blocks, int64_t block, float* dst);
// dst += the block SgemmRowBlock computes, with the bits of computing it into a buffer and adding that
// to dst element by element (dnnl_sgemm with beta = 1: oneDNN 2.6 adds C to the finished product) --
// only where SgemmAddsExactly says so; a fold of products then reads and writes each chunk once.
void SgemmRowBlockAdd(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                      int64_t ldb, int64_t blocks, int64_t block, float* dst);
// Whether dnnl_sgemm(beta = 1) into C gives C + (the beta = 0 product) bit for bit for an m x n x k
// product: one pass over k (k <= 256, and with a transposed A k <= 96 on oneDNN's AVX2 kernels; longer
// ones are summed in k blocks into C, and differ) and no matrix-vector shape (m or n < 8: its gemv
// kernel accumulates into C as it goes). Checked on oneDNN's build here by jit_conformance_test
// ("beta = 1 adds the finished product"), which fails if an update or another CPU changes it.
// (SmallGemm's blocks always do: each is added to C after its sum.)
bool SgemmAddsExactly(bool ta, int64_t m, int64_t n, int64_t k);

// Whether StepSgemm copies B into panels with padded rows first (PaddedBSgemm): B not transposed, its
// rows a multiple of 4 KiB apart, a long sum (k >= 512) and few rows of C (m <= 256), 2 MiB of B at
// least, on CPUs without oneDNN's avx512_core kernels (measured only there). oneDNN's AVX2 sgemm packs
// B in column blocks read down k rows; in the workspace arena's 2 MiB pages rows 4 KiB apart keep
// their physical stride and fall into a few L2 sets, so each line is fetched again and again (BERT's
// masked-LM weight gradient, h^T dlogits with dlogits [2048, 4096]: 28.9 ms direct, 2.4 + 14.7 ms
// copied). The panels depend only on the shapes and the cores, so the bits do too (oneDNN's blocking of a sum
// depends on the call's width: they may differ from ParallelSgemm's in the last place).
bool SgemmPadsB(bool tb, int64_t m, int64_t n, int64_t k, int64_t ldb);
// The panels' columns: at most 4 MiB of B a panel (the scratch holds one panel per core), at least a
// panel per core.
int64_t PaddedBPanelColumns(int64_t n, int64_t k);
// Floats added to each copied row: 64 bytes, so consecutive rows start in consecutive L2 sets.
inline constexpr int64_t kPaddedBExtra = 16;
// Row-major C[m,n] = op(A) B with B's column panels copied into the calling thread's scratch with
// rows kPaddedBExtra floats longer, each panel one single-threaded dnnl_sgemm in a TBB task.
void PaddedBSgemm(bool ta, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                  float* c);

// Whether StepSgemm computes this product turned around.
bool SgemmTurnsAround(bool ta, bool tb, int64_t m, int64_t n, int64_t k);
// Row-major C[m,n] = A[m,k] B[n,k]^T computed turned around (the calling thread's scratch holds A^T
// and C^T).
void TurnedSgemmNT(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* c);

// C = op(A) op(B) for operands holding bf16 values (f32 whose low 16 bits are zero: the
// mixed-precision pass's rounded operands) as oneDNN bf16 x bf16 -> f32 matmuls (AVX512-BF16 where the
// CPU has it; where its bf16 arithmetic is slow, f32 sgemm on the widened operands: Bf16MatmulWidens):
// exact products, f32 accumulation, as the f32 sgemm on the same values up to the order of the sums and
// denormals (flushed). The operands are converted to bf16 (exactly) once per call, then
// `batches` independent products (A, B, C advanced by sa, sb, m*n elements) are split into row blocks
// (column blocks when m < n) that depend only on the shapes, each one oneDNN call on one OpenMP thread in a TBB task; the
// primitives are built at the first call per block shape and cached for the process.
void ParallelBf16Matmul(bool ta, bool tb, int64_t batches, int64_t m, int64_t n, int64_t k, const float* a,
                        int64_t lda, int64_t sa, const float* b, int64_t ldb, int64_t sb, float* c);
// The same on operands already stored as bf16 (the step's rounded operands, read in place: no
// conversion).
void ParallelBf16Matmul(bool ta, bool tb, int64_t batches, int64_t m, int64_t n, int64_t k, const uint16_t* a,
                        int64_t lda, int64_t sa, const uint16_t* b, int64_t ldb, int64_t sb, float* c);

// Whether ParallelBf16Matmul computes its products as f32 sgemm on the widened operands (exact: a
// bf16 value is an f32 whose low 16 bits are zero; the products are exact in f32 and summed in f32,
// as oneDNN's bf16 kernels do, in another order). Chosen by the CPU, so one machine always computes
// the same bits: widened on a CPU without AVX512-BF16 (oneDNN would emulate the bf16 products) and on
// an Intel CPU without AMX in effect (Sapphire/Emerald Rapids in a VM that hides it), where VDPBF16PS
// retires one 512-bit instruction every 2 cycles and VFMADD231PS two a cycle, so bf16 products run at
// half the f32 rate (bench/step --bf16 prints both peaks: 113 against 225 GFLOP/s a core on an Emerald
// Rapids guest, where oneDNN's bf16 MLP matmuls took 1.4-1.6x the f32 ones); oneDNN's bf16 kernels with
// AMX, and on AMD Zen 4, which runs VDPBF16PS at the full rate. SHARDSTEP_BF16_MATMUL=widen|onednn
// overrides; SetBf16MatmulWidens (tests) too.
bool Bf16MatmulWidens();
void SetBf16MatmulWidens(int widens);  // 1 widen, 0 oneDNN, -1 back to the CPU's choice
// x[i] = the f32 of bf16 h[i] (exact), on the calling thread.
void WidenBf16Values(const uint16_t* h, int64_t count, float* x);

// Whether oneDNN runs AMX kernels on this CPU (read once). Rules that choose a kernel by measurements
// that differ between CPUs key on it, so one machine always computes the same bits.
bool CpuHasAmx();
// Whether oneDNN's kernels for this CPU are its avx512_core ones (read once). Without them (an AVX2
// CPU) it has no bf16 matmul or convolution, no Winograd, blocked layouts of 8 channels, and an sgemm
// that sums a transposed A's k in blocks of 96; rules that depend on those key on this.
bool OnednnAvx512Core();

// Threading policy. Debian's libdnnl uses OpenMP (libgomp), whose workers spin after each parallel
// call and were seen taking half the machine from TBB. So every oneDNN call made by a step runs
// with one OpenMP thread (omp_set_num_threads is per calling thread; ParallelSgemm sets it in each
// TBB worker), OpenBLAS (the interpreter's BLAS) runs one thread, and TBB splits the work. Call from
// each replica thread before its first step.
void ConfigureThreadsForReplica(int replicas);
// omp_set_num_threads(n) on the calling thread (benchmarks use it to measure oneDNN's own threading).
void SetOmpThreads(int n);
// The hardware threads this process may use.
int NumCores();
// Threads oneDNN's OpenMP would use on the calling thread (omp_get_max_threads), or -1 if unknown.
int OmpMaxThreads();

}  // namespace shardstep::jit
