// jit::SmallGemm (the replica's small products): every element is one chain of fused multiply-adds
// over k in order from zero, so the loops must give, bit for bit, a scalar std::fma chain -- whatever
// the lanes (AVX-512 or AVX2 builds), the tiles and their tails, the strides and the TBB split -- and
// `add` must give the product computed alone and then added. Where the CPU has neither build, the
// test says so.
#include <catch2/catch.hpp>
#include <tbb/task_arena.h>

#include <barrier>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "jit/dnnl_kernels.h"
#include "jit/shared_weight_packs.h"
#include "jit/simd.h"
#include "jit/small_gemm.h"

using namespace shardstep;

namespace {

struct Case {
  bool ta, tb;
  int64_t m, n, k;
};

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// The oracle: C[i, j] = fma chain over kk in order from +0, in scalar float arithmetic.
std::vector<float> FmaChain(const Case& c, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t ldc,
                            const std::vector<float>& before, bool add) {
  std::vector<float> out = before;
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = 0; j < c.n; ++j) {
      float acc = 0.0f;
      for (int64_t kk = 0; kk < c.k; ++kk) {
        const float x = c.ta ? a[kk * lda + i] : a[i * lda + kk];
        const float y = c.tb ? b[j * ldb + kk] : b[kk * ldb + j];
        acc = std::fma(x, y, acc);
      }
      out[i * ldc + j] = add ? out[i * ldc + j] + acc : acc;
    }
  return out;
}

// Runs SmallGemm with leading dimensions `pad` past the operands' widths; returns whether the bits
// (and the padding, untouched) match the oracle.
bool MatchesChain(const Case& c, int64_t pad, bool add) {
  const int64_t lda = (c.ta ? c.m : c.k) + pad, ldb = (c.tb ? c.k : c.n) + pad, ldc = c.n + pad;
  const std::vector<float> a = Random((c.ta ? c.k : c.m) * lda, 1), b = Random((c.tb ? c.n : c.k) * ldb, 2);
  std::vector<float> got = Random(c.m * ldc, 3);
  const std::vector<float> want = FmaChain(c, a.data(), lda, b.data(), ldb, ldc, got, add);
  jit::SmallGemm(c.ta, c.tb, c.m, c.n, c.k, a.data(), lda, b.data(), ldb, add, got.data(), ldc);
  return std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0;
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (int64_t m : {1, 5, 6, 7, 13, 16, 32})
    for (int64_t n : {8, 10, 17, 33, 64, 100})
      for (int64_t k : {1, 3, 16, 70}) {
        cases.push_back({false, false, m, n, k});
        cases.push_back({false, true, m, n, k});
        cases.push_back({true, false, m, n, k});
      }
  return cases;
}

// Every case on each vector build this CPU runs (16 lanes, then 8 through simd::LanesForTesting).
template <typename Check>
void OnEachBuild(Check check) {
  for (int64_t lanes : {16, 8}) {
    if (jit::simd::CpuLanes() < lanes) continue;
    jit::simd::LanesForTesting() = lanes;
    INFO("lanes " << lanes);
    check();
  }
  jit::simd::LanesForTesting() = 0;
}

}  // namespace

TEST_CASE("SmallGemm is the scalar fma chain bit for bit: NN, NT, TN, tails, strides, add", "[jit][gemm]") {
  if (!jit::SmallGemmRuns()) {
    WARN("this CPU has neither AVX2 + FMA nor AVX-512: SmallGemm cannot run here");
    return;
  }
  OnEachBuild([] {
    for (const Case& c : Cases())
      for (int64_t pad : {0, 3})
        for (bool add : {false, true}) {
          INFO((c.ta ? "T" : "N") << (c.tb ? "T" : "N") << " " << c.m << "x" << c.n << "x" << c.k << " pad " << pad
                                  << " add " << add);
          REQUIRE(MatchesChain(c, pad, add));
        }
  });
}

TEST_CASE("ParallelSmallGemm gives SmallGemm's bits on any number of threads", "[jit][gemm]") {
  if (!jit::SmallGemmRuns()) return;
  // The MLP's products at N = 8 and N = 4 replicas, large enough to be split into tasks.
  const Case cases[] = {{false, false, 16, 1024, 784}, {false, false, 32, 1000, 100}, {false, true, 16, 1024, 1024},
                        {false, true, 13, 300, 512},   {true, false, 128, 1024, 16},   {true, false, 98, 1030, 32}};
  for (const Case& c : cases) {
    INFO((c.ta ? "T" : "N") << (c.tb ? "T" : "N") << " " << c.m << "x" << c.n << "x" << c.k);
    const int64_t lda = c.ta ? c.m : c.k, ldb = c.tb ? c.k : c.n;
    const std::vector<float> a = Random(c.m * c.k, 4), b = Random(c.n * c.k, 5);
    std::vector<float> one(c.m * c.n, 9.0f);
    jit::SmallGemm(c.ta, c.tb, c.m, c.n, c.k, a.data(), lda, b.data(), ldb, false, one.data(), c.n);
    const std::vector<float> want = FmaChain(c, a.data(), lda, b.data(), ldb, c.n, one, false);
    CHECK(std::memcmp(one.data(), want.data(), 4 * one.size()) == 0);
    for (int threads : {1, 2}) {
      tbb::task_arena arena(threads);
      std::vector<float> split(c.m * c.n, 9.0f);
      arena.execute([&] { jit::ParallelSmallGemm(c.ta, c.tb, c.m, c.n, c.k, a.data(), lda, b.data(), ldb, split.data()); });
      CHECK(std::memcmp(one.data(), split.data(), 4 * one.size()) == 0);
    }
  }
}

TEST_CASE("the step's small products go to SmallGemm by their shape, and its row blocks add exactly", "[jit][gemm]") {
  if (!jit::SmallGemmApplies(false, false, 16, 1024, 784)) {
    WARN("SmallGemm is not used on this CPU (oneDNN's avx512_core kernels, or no AVX2)");
    return;
  }
  CHECK(jit::SmallGemmApplies(false, true, 16, 1024, 1024));  // dX = dY W^T, a replica of 8 at batch 128
  CHECK(jit::SmallGemmApplies(true, false, 128, 1024, 16));   // a row block of dW = X^T dY
  CHECK_FALSE(jit::SmallGemmApplies(false, false, 128, 1024, 784));  // the whole batch: oneDNN
  CHECK_FALSE(jit::SmallGemmApplies(true, false, 1024, 1024, 128));
  CHECK_FALSE(jit::SmallGemmApplies(true, true, 16, 1024, 1024));
  // StepSgemm is SmallGemm where the rule says so (and padded panels do not take the shape first: a
  // weight with 1000 columns, rows not 4 KiB apart).
  REQUIRE_FALSE(jit::SgemmPadsB(false, 16, 1000, 784, 1000));
  const std::vector<float> a = Random(16 * 784, 6), b = Random(784 * 1000, 7);
  std::vector<float> step(16 * 1000), small(16 * 1000);
  jit::StepSgemm(false, false, 16, 1000, 784, a.data(), 784, b.data(), 1000, step.data());
  jit::SmallGemm(false, false, 16, 1000, 784, a.data(), 784, b.data(), 1000, false, small.data(), 1000);
  CHECK(std::memcmp(step.data(), small.data(), 4 * step.size()) == 0);
  // With rows 4 KiB apart (the MLP's weights at N = 8) too, where padded panels would also take the
  // shape: the replicas' shared packed copy gives SmallGemm's bits (jit/shared_weight_packs.h).
  {
    const std::vector<float> w = Random(784 * 1024, 7);
    std::vector<float> via_step(16 * 1024), small_w(16 * 1024);
    REQUIRE(jit::SgemmPadsB(false, 16, 1024, 784, 1024));
    jit::StepSgemm(false, false, 16, 1024, 784, a.data(), 784, w.data(), 1024, via_step.data());
    jit::SmallGemm(false, false, 16, 1024, 784, a.data(), 784, w.data(), 1024, false, small_w.data(), 1024);
    CHECK(std::memcmp(via_step.data(), small_w.data(), 4 * small_w.size()) == 0);
  }
  // A weight gradient's row block folded by adding (the reduce-scatter's fold) gives the bits of the
  // block computed alone and added.
  const int64_t m = 1024, n = 512, k = 16, blocks = 8, rows = m / blocks;
  REQUIRE(jit::SgemmAddsExactly(true, rows, n, k));
  const std::vector<float> x = Random(k * m, 8), dy = Random(k * n, 9);
  std::vector<float> sum = Random(rows * n, 10), alone(rows * n);
  std::vector<float> want = sum;
  jit::SgemmRowBlock(true, false, m, n, k, x.data(), m, dy.data(), n, blocks, 3, alone.data());
  for (int64_t i = 0; i < rows * n; ++i) want[i] += alone[i];
  jit::SgemmRowBlockAdd(true, false, m, n, k, x.data(), m, dy.data(), n, blocks, 3, sum.data());
  CHECK(std::memcmp(sum.data(), want.data(), 4 * sum.size()) == 0);
}

TEST_CASE("products whose B rows are 4 KiB apart are copied into padded panels, the bits fixed by the shapes", "[jit][gemm]") {
  struct Case {
    bool ta;
    int64_t m, n, k, ldb;
  };
  // BERT's masked-LM weight gradient (h^T dlogits), a transformer MLP's dW1 shape, an NN product with
  // a column tail (n < ldb, and not a multiple of the panel), and one panel only.
  for (const Case c : {Case{true, 128, 4096, 2048, 4096}, Case{true, 256, 1024, 4096, 1024},
                       Case{false, 40, 1300, 600, 2048}, Case{false, 48, 300, 1024, 1024}}) {
    CAPTURE(c.ta, c.m, c.n, c.k, c.ldb);
    if (!jit::SgemmPadsB(false, c.m, c.n, c.k, c.ldb)) {
      WARN("B is not copied into padded panels on this CPU (oneDNN's avx512_core kernels)");
      return;
    }
    const int64_t lda = c.ta ? c.m : c.k;
    const std::vector<float> a = Random(c.m * c.k, 11), b = Random(c.k * c.ldb, 12);
    std::vector<float> direct(c.m * c.n, 5.0f), padded(c.m * c.n, 7.0f), one(c.m * c.n, 8.0f), step(c.m * c.n, 9.0f);
    jit::ParallelSgemm(c.ta, false, c.m, c.n, c.k, a.data(), lda, b.data(), c.ldb, direct.data());
    jit::PaddedBSgemm(c.ta, c.m, c.n, c.k, a.data(), lda, b.data(), c.ldb, padded.data());
    tbb::task_arena single(1);
    single.execute([&] { jit::PaddedBSgemm(c.ta, c.m, c.n, c.k, a.data(), lda, b.data(), c.ldb, one.data()); });
    jit::StepSgemm(c.ta, false, c.m, c.n, c.k, a.data(), lda, b.data(), c.ldb, step.data());
    CHECK(std::memcmp(padded.data(), one.data(), 4 * one.size()) == 0);  // not the threads' doing
    CHECK(std::memcmp(padded.data(), step.data(), 4 * step.size()) == 0);
    // The same product up to the order of the sums (oneDNN picks its blocking by the panel's width):
    // terms in [-1, 1], so each sum's rounding stays far below k * 2^-24 * k.
    double worst = 0;
    for (size_t i = 0; i < direct.size(); ++i) worst = std::max(worst, double(std::fabs(direct[i] - padded[i])));
    CHECK(worst <= 1e-6 * double(c.k));
  }
  CHECK_FALSE(jit::SgemmPadsB(true, 128, 4096, 2048, 4096));   // B transposed
  CHECK_FALSE(jit::SgemmPadsB(false, 512, 4096, 1024, 4096));  // many rows of C: no gain measured
  CHECK_FALSE(jit::SgemmPadsB(false, 128, 1000, 2048, 1000));  // rows not 4 KiB apart
  CHECK_FALSE(jit::SgemmPadsB(false, 128, 4096, 256, 4096));   // a short sum
}

TEST_CASE("B packed beforehand gives SmallGemm's bits, whole or packed in chunks", "[jit][gemm]") {
  OnEachBuild([] {
    const int64_t panel = jit::SmallGemmPanelColumns();
    for (int64_t m : {1, 7, 16, 32})
      for (int64_t n : {8, 33, 100, 1000})
        for (int64_t k : {1, 70, 784}) {
          CAPTURE(m, n, k);
          const std::vector<float> a = Random(m * k, 21), b = Random(k * n, 22);
          std::vector<float> want(m * n), got(m * n, 3.0f), packed(jit::PackedBFloats(n, k), 9.0f);
          jit::SmallGemm(false, false, m, n, k, a.data(), k, b.data(), n, false, want.data(), n);
          for (int64_t j = 0; j < n; j += 2 * panel) jit::PackB(n, k, b.data(), n, j, std::min(n, j + 2 * panel), packed.data());
          jit::ParallelSmallGemmPackedB(m, n, k, a.data(), k, packed.data(), got.data());
          CHECK(std::memcmp(got.data(), want.data(), 4 * want.size()) == 0);
        }
  });
}

TEST_CASE("replicas share one packed copy of a weight a run: each gets SmallGemm's bits of its own rows", "[jit][gemm]") {
  if (!jit::SmallGemmRuns()) {
    WARN("no SmallGemm build runs on this CPU");
    return;
  }
  constexpr int kThreads = 8, kRuns = 3;
  const int64_t m = 16, n = 1000, k = 300;
  jit::SharedPackedB shared(n, k);
  std::vector<std::vector<float>> a(kThreads), got(kThreads, std::vector<float>(kRuns * m * n));
  for (int t = 0; t < kThreads; ++t) a[t] = Random(m * k, 30 + t);
  // The weight changes between runs (as the update writes it), never within one.
  std::vector<std::vector<float>> w(kRuns);
  for (int r = 0; r < kRuns; ++r) w[r] = Random(k * n, 40 + r);
  std::vector<float> b = w[0];
  std::barrier sync(kThreads + 1);
  std::vector<int> used(kThreads * kRuns, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRuns; ++r) {
        sync.arrive_and_wait();  // b holds run r's weight
        used[t * kRuns + r] = shared.Multiply(r + 1, m, a[t].data(), k, b.data(), got[t].data() + r * m * n);
        sync.arrive_and_wait();
      }
    });
  for (int r = 0; r < kRuns; ++r) {
    b = w[r];
    sync.arrive_and_wait();
    sync.arrive_and_wait();
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t)
    for (int r = 0; r < kRuns; ++r) {
      CAPTURE(t, r);
      CHECK(used[t * kRuns + r] == 1);
      std::vector<float> want(m * n);
      jit::SmallGemm(false, false, m, n, k, a[t].data(), k, w[r].data(), n, false, want.data(), n);
      CHECK(std::memcmp(got[t].data() + r * m * n, want.data(), 4 * want.size()) == 0);
    }
  // A thread behind the others (its step failed before this product), or another matrix in the same
  // run: not the shared copy -- the caller multiplies by its own.
  std::vector<float> c(m * n);
  CHECK_FALSE(shared.Multiply(kRuns - 1, m, a[0].data(), k, b.data(), c.data()));
  const std::vector<float> other = w[0];
  CHECK_FALSE(shared.Multiply(kRuns, m, a[0].data(), k, other.data(), c.data()));
  CHECK(shared.Multiply(kRuns + 1, m, a[0].data(), k, other.data(), c.data()));
}
