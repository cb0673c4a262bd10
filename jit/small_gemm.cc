// Small products on the replica's thread or TBB tasks (see small_gemm.h).
#include "jit/small_gemm.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ir/error.h"
#include "jit/data_movement.h"
#include "jit/dnnl_kernels.h"
#include "jit/simd.h"

namespace shardstep::jit {
namespace {

#define SS_SIMD_BODY "jit/small_gemm_loops.inc"
#include "jit/simd_each_target.inc"

// The rows of C, 0:rows, each (+)= sum over kk < k of A(r, kk) * B[kk, 0:cols] (small_gemm_loops.inc).
using TilesFn = void (*)(int64_t rows, int64_t k, const float* a, int64_t a_row, int64_t a_k, const float* b,
                         int64_t ldb, float* c, int64_t ldc, int64_t cols);
struct Loops {
  TilesFn store, add;
  int64_t panel;  // columns of one micro-tile
  TilesFn Of(bool plus) const { return plus ? add : store; }
};
Loops CpuLoops() {
  if (simd::CpuLanes() == 16) return {&avx512::TilesStore, &avx512::TilesAdd, avx512::PanelColumns()};
  return {&avx2::TilesStore, &avx2::TilesAdd, avx2::PanelColumns()};
}

constexpr int64_t kGroup = 4;  // panels of B packed together (NnColumns)

// One row of a panel: w of B's floats, zero up to the panel's width. A whole row is a copy of constant
// size, which the compiler makes two vector moves (a libc memcpy call per 64 bytes was ~1.5% of an MLP
// step at N = 8).
inline void CopyPanelRow(float* dst, const float* src, int64_t w, int64_t panel) {
  if (w == 16 && panel == 16) return static_cast<void>(std::memcpy(dst, src, 16 * sizeof(float)));
  if (w == 32 && panel == 32) return static_cast<void>(std::memcpy(dst, src, 32 * sizeof(float)));
  std::memcpy(dst, src, w * sizeof(float));
  std::fill(dst + w, dst + panel, 0.0f);
}

// B's columns [j0, j1) into its packed form (PackedBFloats): panel p at packed + p * k * panel, its k
// rows `panel` floats apart, zero past j1. Read a row's part whole and prefetch the rows ahead, as
// NnColumns.
void PackColumns(const Loops& l, int64_t k, const float* b, int64_t ldb, int64_t j0, int64_t j1,
                 float* packed) {
  constexpr int64_t kAhead = 16;  // rows
  const int64_t p0 = j0 / l.panel, p1 = (j1 + l.panel - 1) / l.panel;
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* row = b + kk * ldb;
    if (kk + kAhead < k)
      for (int64_t x = j0; x < j1; x += 16) __builtin_prefetch(row + kAhead * ldb + x);
    for (int64_t p = p0; p < p1; ++p) {
      float* dst = packed + (p * k + kk) * l.panel;
      const int64_t w = std::min(l.panel, j1 - p * l.panel);
      CopyPanelRow(dst, row + p * l.panel, w, l.panel);
    }
  }
}

// C = A B (+ C) over C's columns [j0, j1), kGroup panels at a time: the group's k rows of B copied
// into one contiguous buffer per panel first (`pack`: kGroup * k * panel floats; B's rows are a
// weight's rows, 4 KiB apart, where the cache keeps few lines of one panel and no hardware prefetcher
// crosses the pages: each row's part is read whole and the rows ahead are prefetched), then every row
// of C against each panel. bench/small_gemm on a Zen 3 guest: 0.55-0.6x oneDNN's time at m = 16.
void NnColumns(const Loops& l, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
               int64_t ldb, bool add, float* c, int64_t ldc, int64_t j0, int64_t j1, float* pack) {
  for (int64_t j = j0; j < j1; j += kGroup * l.panel) {
    const int64_t panels = std::min(kGroup, (j1 - j + l.panel - 1) / l.panel);
    PackColumns(l, k, b + j, ldb, 0, std::min(j1, j + kGroup * l.panel) - j, pack);
    for (int64_t p = 0; p < panels; ++p)
      l.Of(add)(m, k, a, lda, 1, pack + p * k * l.panel, l.panel, c + j + p * l.panel, ldc,
                std::min(l.panel, n - j - p * l.panel));
  }
}

// at[i * k + kk] = A[kk, i] (A^T, [m, k] row-major, of A [k, m] with leading dimension lda).
void TransposeA(int64_t m, int64_t k, const float* a, int64_t lda, float* at) {
  for (int64_t kk = 0; kk < k; ++kk)
    for (int64_t i = 0; i < m; ++i) at[i * k + kk] = a[kk * lda + i];
}

// C = A^T B (+ C) over C's columns [j0, j1) with k short, from A^T copied whole (`at`, TransposeA)
// and each panel of B copied before its tiles (`pack`: k * panel floats), so a tile's loads are a few
// contiguous lines (A's and B's rows are often 4 KiB apart, where the cache keeps few of them).
void TnColumns(const Loops& l, int64_t m, int64_t n, int64_t k, const float* at, const float* b, int64_t ldb,
               bool add, float* c, int64_t ldc, int64_t j0, int64_t j1, float* pack) {
  for (int64_t j = j0; j < j1; j += l.panel) {
    const int64_t w = std::min(l.panel, n - j);
    for (int64_t kk = 0; kk < k; ++kk) {
      CopyPanelRow(pack + kk * l.panel, b + kk * ldb + j, w, l.panel);
    }
    l.Of(add)(m, k, at, k, 1, pack, l.panel, c + j, ldc, w);
  }
}

// A^T's panels for C = A B^T turned around (C^T = B A^T): pack[p][kk][0:panel] = A[p * panel + i, kk],
// zero past m (NtPackFloats floats).
int64_t NtPackFloats(const Loops& l, int64_t m, int64_t k) { return (m + l.panel - 1) / l.panel * k * l.panel; }
void PackTransposed(const Loops& l, int64_t m, int64_t k, const float* a, int64_t lda, float* pack) {
  std::fill(pack, pack + NtPackFloats(l, m, k), 0.0f);
  for (int64_t i = 0; i < m; ++i) {
    float* dst = pack + (i / l.panel) * k * l.panel + i % l.panel;
    const float* src = a + i * lda;
    for (int64_t kk = 0; kk < k; ++kk) dst[kk * l.panel] = src[kk];
  }
}

// C^T's rows [r0, r1) (C^T = B A^T, [n, m] row-major) from A^T's panels.
void NtTurnedRows(const Loops& l, int64_t m, int64_t k, const float* pack, const float* b, int64_t ldb, float* ct,
                  int64_t r0, int64_t r1) {
  for (int64_t p = 0; p * l.panel < m; ++p)
    l.store(r1 - r0, k, b + r0 * ldb, ldb, 1, pack + p * k * l.panel, l.panel, ct + r0 * m + p * l.panel, m,
            std::min(l.panel, m - p * l.panel));
}

void WriteTransposed(const float* ct, int64_t n, int64_t m, bool add, float* c, int64_t ldc) {
  if (!add && ldc == n) return TransposeMatrix(ct, n, m, c);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = add ? c[i * ldc + j] + ct[j * m + i] : ct[j * m + i];
}

// Scratch floats of a product on one thread (`blocks` panel packs for the parallel form).
int64_t ScratchFloats(const Loops& l, bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t blocks) {
  if (ta) return m * k + blocks * k * l.panel;
  if (tb) return NtPackFloats(l, m, k) + n * m;
  return blocks * kGroup * k * l.panel;
}

// ParallelSmallGemm's scratch: the calling (replica) thread's, grown only, so a step allocates
// nothing once warm whichever TBB workers take its tasks.
float* CallerScratch(int64_t floats) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < floats) buf.resize(floats);
  return buf.data();
}

void CheckShape(bool ta, bool tb, int64_t m, int64_t n, int64_t k) {
  SS_CHECK(SmallGemmRuns(), "SmallGemm: this CPU has neither AVX2 + FMA nor AVX-512");
  SS_CHECK(!(ta && tb), "SmallGemm: op(A) op(B) with both transposed is not supported");
  SS_CHECK(m > 0 && n > 0 && k > 0, "SmallGemm: empty product ", m, "x", n, "x", k);
}

// The serial product with its scratch at `w`.
void SmallGemmWith(const Loops& l, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                   const float* b, int64_t ldb, bool add, float* c, int64_t ldc, float* w) {
  if (ta) {
    TransposeA(m, k, a, lda, w);
    return TnColumns(l, m, n, k, w, b, ldb, add, c, ldc, 0, n, w + m * k);
  }
  if (!tb) return NnColumns(l, m, n, k, a, lda, b, ldb, add, c, ldc, 0, n, w);
  PackTransposed(l, m, k, a, lda, w);
  float* const ct = w + NtPackFloats(l, m, k);
  NtTurnedRows(l, m, k, w, b, ldb, ct, 0, n);
  WriteTransposed(ct, n, m, add, c, ldc);
}

}  // namespace

bool SmallGemmRuns() { return simd::CpuLanes() > 0; }

bool SmallGemmApplies(bool ta, bool tb, int64_t m, int64_t n, int64_t k) {
  static const bool cpu = [] {
    const char* e = std::getenv("SHARDSTEP_SMALL_GEMM");
    const std::string v = e ? e : "";
    if (v == "off") return false;
    if (v == "on") {
      if (!SmallGemmRuns()) throw Error("SHARDSTEP_SMALL_GEMM=on: this CPU has neither AVX2 + FMA nor AVX-512");
      return true;
    }
    if (!v.empty()) throw Error(Str("SHARDSTEP_SMALL_GEMM: '", v, "' is neither 'on' nor 'off'"));
    return SmallGemmRuns() && !OnednnAvx512Core();
  }();
  if (!cpu || (ta && tb)) return false;
  if (ta) return k >= 1 && k <= 32 && m >= 8 && m <= 256 && n >= 8;
  if (tb) return m >= 1 && m <= 32 && n >= 64 && k >= 64 && k % 8 == 0;
  return m >= 1 && m <= 32 && n >= 64 && k >= 64;
}

void SmallGemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
               int64_t ldb, bool add, float* c, int64_t ldc) {
  CheckShape(ta, tb, m, n, k);
  const Loops l = CpuLoops();
  // On the stack where it fits (every product of the step's rule: a weight gradient's row block of at
  // most 256 rows and 32 terms needs 9K floats): this may run in any TBB worker, and a step allocates
  // nothing once warm.
  constexpr int64_t kStackFloats = 16384;
  const int64_t need = ScratchFloats(l, ta, tb, m, n, k, 1);
  if (need <= kStackFloats) {
    alignas(64) float w[kStackFloats];
    return SmallGemmWith(l, ta, tb, m, n, k, a, lda, b, ldb, add, c, ldc, w);
  }
  std::vector<float> w(need);
  SmallGemmWith(l, ta, tb, m, n, k, a, lda, b, ldb, add, c, ldc, w.data());
}

int64_t SmallGemmPanelColumns() { return CpuLoops().panel; }

int64_t PackedBFloats(int64_t n, int64_t k) {
  const int64_t panel = CpuLoops().panel;
  return (n + panel - 1) / panel * panel * k;
}

void PackB(int64_t n, int64_t k, const float* b, int64_t ldb, int64_t j0, int64_t j1, float* packed) {
  const Loops l = CpuLoops();
  SS_CHECK(j0 % l.panel == 0 && j0 < j1 && j1 <= n && (j1 == n || j1 % l.panel == 0), "PackB: columns [", j0,
           ", ", j1, ") of ", n, " are not whole panels of ", l.panel);
  PackColumns(l, k, b, ldb, j0, j1, packed);
}

void ParallelSmallGemmPackedB(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* packed,
                              float* c) {
  CheckShape(false, false, m, n, k);
  const Loops l = CpuLoops();
  // ParallelSmallGemm's split (the bits do not depend on it either).
  const int64_t panels = (n + l.panel - 1) / l.panel;
  const int64_t blocks = m * n * k < (int64_t{1} << 21) ? 1 : std::min<int64_t>(NumCores(), panels);
  tbb::parallel_for(int64_t{0}, blocks, [&](int64_t blk) {
    for (int64_t p = panels * blk / blocks; p < panels * (blk + 1) / blocks; ++p)
      l.store(m, k, a, lda, 1, packed + p * k * l.panel, l.panel, c + p * l.panel, n,
              std::min(l.panel, n - p * l.panel));
  });
}

void ParallelSmallGemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                       const float* b, int64_t ldb, float* c) {
  CheckShape(ta, tb, m, n, k);
  const Loops l = CpuLoops();
  // One task per core for products of 2M multiply-adds or more (as ParallelSgemm), split on panels.
  const int64_t panels = (n + l.panel - 1) / l.panel;
  const int64_t blocks = m * n * k < (int64_t{1} << 21) ? 1 : std::min<int64_t>(NumCores(), panels);
  auto cols = [&](int64_t blk) { return std::min(n, (panels * blk / blocks) * l.panel); };
  float* const w = CallerScratch(ScratchFloats(l, ta, tb, m, n, k, blocks));
  if (ta) {
    TransposeA(m, k, a, lda, w);
    float* const packs = w + m * k;
    return tbb::parallel_for(int64_t{0}, blocks, [&](int64_t blk) {
      TnColumns(l, m, n, k, w, b, ldb, false, c, n, cols(blk), cols(blk + 1), packs + blk * k * l.panel);
    });
  }
  if (!tb)
    return tbb::parallel_for(int64_t{0}, blocks, [&](int64_t blk) {
      NnColumns(l, m, n, k, a, lda, b, ldb, false, c, n, cols(blk), cols(blk + 1), w + blk * kGroup * k * l.panel);
    });
  // Turned around: C^T's rows (C's columns) split.
  PackTransposed(l, m, k, a, lda, w);
  float* const ct = w + NtPackFloats(l, m, k);
  tbb::parallel_for(int64_t{0}, blocks, [&](int64_t blk) { NtTurnedRows(l, m, k, w, b, ldb, ct, cols(blk), cols(blk + 1)); });
  WriteTransposed(ct, n, m, false, c, n);
}

}  // namespace shardstep::jit
