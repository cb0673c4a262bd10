// oneDNN sgemm and the process threading policy (see dnnl_kernels.h).
#include "jit/dnnl_kernels.h"
#include "jit/dnnl_runtime.h"
#include "jit/data_movement.h"
#include "jit/small_gemm.h"

#include <cpuid.h>
#include <dlfcn.h>
#include <dnnl.h>
#include <immintrin.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <thread>
#include <unordered_map>
#include <vector>

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

namespace {
// Row blocks of an m x n x k product: about 2M multiply-adds per block at least, at most 8 blocks,
// rows a multiple of 8. They depend only on the shapes, so the results do not depend on the threads.
struct RowBlocks {
  int64_t rows, count;
};
RowBlocks BlocksOf(int64_t m, int64_t n, int64_t k) {
  const int64_t work = m * n * k;
  int64_t blocks = std::clamp<int64_t>(work >> 21, 1, 8);
  // A long inner dimension (a weight gradient summed over many tokens: K at least 8x the larger output
  // dimension): every block streams all of its K x n operand from memory, so fewer blocks read it fewer
  // times. transformer_lm's [128|512, 128|512] x 4096 products in 2 blocks instead of 8 (/tmp micro-
  // benchmark on 2 cores, medians): bf16 0.47 -> 0.36 ms, 1.79 -> 1.37-1.43, 1.55-1.69 -> 1.35-1.37; f32
  // 10-15% faster.
  if (k >= 8 * std::max(m, n)) blocks = std::min<int64_t>(blocks, 2);
  // oneDNN's AVX2 sgemm packs the whole undivided operand on every call, so each block past one per
  // core packs it again: on an AMD Zen 3 guest (2 cores, /tmp micro-benchmark, medians of 41) the MLP's
  // 8 GEMMs took 22-30 ms in 8 blocks, 13-15 in 4, 8.1-8.9 in 2 (oneDNN's own 2 threads: 8.1-8.7).
  // The cores are the machine's, not the threads a call gets, so one machine keeps its bits.
  if (!OnednnAvx512Core()) blocks = std::min<int64_t>(blocks, NumCores());
  blocks = std::min<int64_t>(blocks, std::max<int64_t>(1, m / 8));
  int64_t rows = (m + blocks - 1) / blocks;
  rows = (rows + 7) / 8 * 8;
  return {rows, std::max<int64_t>(1, (m + rows - 1) / rows)};
}
}  // namespace

void ParallelSgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                   int64_t ldb, float* c) {
  // Row blocks, or column blocks when the product is wider than tall (as ParallelBf16Matmul).
  const bool by_columns = m < n;
  const auto [span, blocks] = by_columns ? BlocksOf(n, m, k) : BlocksOf(m, n, k);
  auto run = [&](int64_t blk) {
    thread_local const bool single = (SetOmpThreads(1), true);
    (void)single;
    const int64_t first = blk * span;
    if (by_columns) {
      const int64_t nb = std::min(span, n - first);
      DnnlSgemm(ta, tb, m, nb, k, a, lda, b + (tb ? first * ldb : first), ldb, 0.0f, c + first, n);
    } else {
      const int64_t mb = std::min(span, m - first);
      DnnlSgemm(ta, tb, mb, n, k, a + (ta ? first : first * lda), lda, b, ldb, 0.0f, c + first * n, n);
    }
  };
  if (blocks <= 1) {
    run(0);
    return;
  }
  tbb::parallel_for(int64_t{0}, blocks, run);
}

namespace {
void SgemmRowBlockBeta(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                       int64_t ldb, int64_t blocks, int64_t block, float beta, float* dst) {
  thread_local const bool single = (SetOmpThreads(1), true);
  (void)single;
  const int64_t rows = m / blocks, first = block * rows;
  if (SmallGemmApplies(ta, tb, rows, n, k))
    return SmallGemm(ta, tb, rows, n, k, a + (ta ? first : first * lda), lda, b, ldb, beta != 0.0f, dst, n);
  DnnlSgemm(ta, tb, rows, n, k, a + (ta ? first : first * lda), lda, b, ldb, beta, dst, n);
}
}  // namespace

void SgemmRowBlock(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                   int64_t ldb, int64_t blocks, int64_t block, float* dst) {
  SgemmRowBlockBeta(ta, tb, m, n, k, a, lda, b, ldb, blocks, block, 0.0f, dst);
}

void SgemmRowBlockAdd(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                      int64_t ldb, int64_t blocks, int64_t block, float* dst) {
  SS_CHECK(SgemmAddsExactly(ta, m / blocks, n, k), "SgemmRowBlockAdd: a ", m / blocks, "x", n, "x", k,
           " product is not added exactly");
  SgemmRowBlockBeta(ta, tb, m, n, k, a, lda, b, ldb, blocks, block, 1.0f, dst);
}

bool SgemmAddsExactly(bool ta, int64_t m, int64_t n, int64_t k) {
  if (SmallGemmApplies(ta, false, m, n, k)) return true;  // SmallGemm adds the finished product
  // oneDNN 2.6's AVX2 sgemm sums a transposed A in k blocks of 96 (found on an AMD Zen 3 guest: k = 96
  // exact for every shape tried, k = 97 not); its avx512_core one in blocks of 256 either way.
  const int64_t one_pass = ta && !OnednnAvx512Core() ? 96 : 256;
  return k >= 1 && k <= one_pass && m >= 8 && n >= 8;
}

void RowBlockSgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                   int64_t ldb, int64_t blocks, float* c) {
  SS_CHECK(blocks > 0 && m % blocks == 0, "RowBlockSgemm: ", m, " rows in ", blocks, " blocks");
  const int64_t rows = m / blocks;
  tbb::parallel_for(int64_t{0}, blocks, [&](int64_t blk) {
    SgemmRowBlock(ta, tb, m, n, k, a, lda, b, ldb, blocks, blk, c + blk * rows * n);
  });
}

bool SgemmTurnsAround(bool ta, bool tb, int64_t m, int64_t n, int64_t k) {
  // Measured on 2-D products (bench/sgemm_shapes): turned is 0.3-0.8x the direct time for m in
  // [16, 48] when k is a multiple of 512 and n <= k; outside that it is slower or level.
  return !ta && tb && m >= 16 && m <= 48 && k >= 512 && k % 512 == 0 && n >= 128 && n <= k;
}

namespace {
// The calling (replica) thread's scratch, grown only: StepSgemm runs on the replica thread, and the
// TBB tasks it starts get pointers.
float* TurnScratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}
}  // namespace

void TurnedSgemmNT(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* c) {
  float* const at = TurnScratch(m * k + n * m);  // A^T [k, m], then C^T [n, m]
  float* const ct = at + m * k;
  TransposeMatrix(a, m, k, at);
  ParallelSgemm(false, false, n, m, k, b, k, at, m, ct);
  TransposeMatrix(ct, n, m, c);
}

void StepSgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
               int64_t ldb, float* c) {
  // SmallGemm before padded panels, where both take an NN product (a replica's few rows times a weight
  // whose rows are 4 KiB apart: the MLP at N = 8): in-process replicas share that weight's packed form
  // (jit/shared_weight_packs.h), which must give this call's bits. (Through oneDNN on padded panels,
  // each replica copying the weight, it ran faster than SmallGemm's own packing: `shardstep train
  // --replicas 8 --batch 128`, median step_ms alternately, 18.0 / 16.8 / 16.5 against 22.4 / 17.9 / 18.0
  // ms; the shared packing beats both.) The rules meet only there (SmallGemm's TN needs k <= 32,
  // padding k >= 512; padding never takes a transposed B).
  if (SmallGemmApplies(ta, tb, m, n, k)) return ParallelSmallGemm(ta, tb, m, n, k, a, lda, b, ldb, c);
  if (SgemmPadsB(tb, m, n, k, ldb)) return PaddedBSgemm(ta, m, n, k, a, lda, b, ldb, c);
  if (SgemmTurnsAround(ta, tb, m, n, k) && lda == k && ldb == k) return TurnedSgemmNT(m, n, k, a, b, c);
  ParallelSgemm(ta, tb, m, n, k, a, lda, b, ldb, c);
}

bool SgemmPadsB(bool tb, int64_t m, int64_t n, int64_t k, int64_t ldb) {
  // Measured on an AMD Zen 3 guest (AVX2 sgemm; /tmp micro-benchmark, B in 2 MiB pages): m = 128,
  // k = 2048, n = 4096 (BERT's masked-LM weight gradient) 28.9 -> 2.4 + 14.7 ms, n = 1024 6.9 -> 0.5 +
  // 3.6; m = 256, n = 1024, k = 4096 29.2 -> 1.2 + 18.5; m = 128, n = 4096, k = 512 6.6 -> 0.5 + 3.5;
  // at m = 512 no gain (27.3 -> 28.6 at n = 4096, k = 1024: the packing is then a small part). The
  // MLP's forward products (128 x 1024 x 784 and x 1024; its weights are plain heap memory, where rows
  // 4 KiB apart still share L1 sets): isolated, level in 4 KiB pages and 2.7 -> 1.9 ms in 2 MiB pages;
  // in the step, `shardstep train` batch 128, median step_ms, alternately: 9.0 / 10.0 / 9.8 ms copied,
  // 9.7 / 10.3 / 11.0 direct (N = 2: 11.0 / 11.3 against 11.1 / 13.7).
  if (OnednnAvx512Core() || tb) return false;
  return m <= 256 && k >= 512 && n >= 256 && ldb >= n && (ldb * 4) % 4096 == 0 && k * ldb * 4 >= (int64_t{2} << 20);
}

int64_t PaddedBPanelColumns(int64_t n, int64_t k) {
  // At most 1 Mi floats (4 MiB) a panel, so the scratch stays bounded (a panel per core) whatever B's
  // size, and at least one panel per core; a multiple of 16 columns. As ParallelSgemm's blocks, they
  // depend on the shapes and the machine's cores only.
  const int64_t bounded = std::max<int64_t>(64, (int64_t{1} << 20) / std::max<int64_t>(k, 1) / 16 * 16);
  const int64_t cores = NumCores(), per_core = ((n + cores - 1) / cores + 15) / 16 * 16;
  return std::min({bounded, per_core, n});
}

void PaddedBSgemm(bool ta, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                  float* c) {
  const int64_t cols = PaddedBPanelColumns(n, k), ld = cols + kPaddedBExtra;
  const int64_t panels = (n + cols - 1) / cols, at_once = std::min<int64_t>(panels, NumCores());
  float* const scratch = TurnScratch(at_once * k * ld);
  for (int64_t group = 0; group < panels; group += at_once) {
    tbb::parallel_for(group, std::min(group + at_once, panels), [&](int64_t p) {
      thread_local const bool single = (SetOmpThreads(1), true);
      (void)single;
      float* const panel = scratch + (p - group) * k * ld;
      const int64_t first = p * cols, nb = std::min(cols, n - first);
      for (int64_t r = 0; r < k; ++r) std::memcpy(panel + r * ld, b + r * ldb + first, nb * sizeof(float));
      DnnlSgemm(ta, false, m, nb, k, a, lda, panel, ld, 0.0f, c + first, n);
    });
  }
}

bool CpuHasAmx() {
  static const bool amx = dnnl::get_effective_cpu_isa() == dnnl::cpu_isa::avx512_core_amx;
  return amx;
}

bool OnednnAvx512Core() {
  // dnnl::cpu_isa values are bit sets: an ISA includes avx512_core when it has all of its bits.
  static const bool core = [] {
    const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    const auto want = static_cast<unsigned>(dnnl::cpu_isa::avx512_core);
    return (isa & want) == want;
  }();
  return core;
}

namespace {
void WidenRow(const uint16_t* h, int64_t count, float* x);
bool IntelCpu() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  return b == 0x756e6547 && d == 0x49656e69 && c == 0x6c65746e;  // "GenuineIntel"
}
std::atomic<int> bf16_widens_override{-1};
}  // namespace

bool Bf16MatmulWidens() {
  static const bool by_cpu = [] {
    const char* e = std::getenv("SHARDSTEP_BF16_MATMUL");
    const std::string v = e ? e : "";
    if (v == "widen") return true;
    if (v == "onednn") {
      if (!OnednnAvx512Core())
        throw Error("SHARDSTEP_BF16_MATMUL=onednn: oneDNN has no bf16 matmul on this CPU (no avx512_core)");
      return false;
    }
    if (!v.empty()) throw Error(Str("SHARDSTEP_BF16_MATMUL: '", v, "' is neither 'widen' nor 'onednn'"));
    if (CpuHasAmx()) return false;
    return !__builtin_cpu_supports("avx512bf16") || IntelCpu();  // emulated by oneDNN, or half-rate
  }();
  const int o = bf16_widens_override.load();
  return o < 0 ? by_cpu : o == 1;
}

void SetBf16MatmulWidens(int widens) { bf16_widens_override = widens; }

void WidenBf16Values(const uint16_t* h, int64_t count, float* x) { WidenRow(h, count, x); }

const dnnl::engine& DnnlEngine() {
  static const dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

dnnl_stream_t DnnlThreadStream() {
  struct Stream {
    dnnl_stream_t s = nullptr;
    Stream() {
      const dnnl_status_t st = dnnl_stream_create(&s, DnnlEngine().get(), dnnl_stream_default_flags);
      SS_CHECK(st == dnnl_success, "oneDNN stream creation failed with status ", static_cast<int>(st));
    }
    ~Stream() { dnnl_stream_destroy(s); }
  };
  thread_local Stream s;
  return s.s;
}

namespace {
thread_local int inside_execute = 0;
}  // namespace

bool InsideDnnlExecute() { return inside_execute > 0; }

DnnlMem::DnnlMem(const dnnl::memory::desc& md, void* handle) {
  const dnnl_status_t st = dnnl_memory_create(&m_, &md.data, DnnlEngine().get(), handle);
  SS_CHECK(st == dnnl_success, "oneDNN memory creation failed with status ", static_cast<int>(st));
}

DnnlMem::~DnnlMem() {
  if (m_) dnnl_memory_destroy(m_);
}

dnnl_memory_t BoundDnnlMem::Bind(const dnnl::memory::desc& md, void* handle) {
  if (!mem_.get()) {
    mem_ = DnnlMem(md, handle);
  } else if (handle != handle_) {
    const dnnl_status_t st = dnnl_memory_set_data_handle(mem_.get(), handle);
    SS_CHECK(st == dnnl_success, "oneDNN set_data_handle failed with status ", static_cast<int>(st));
  }
  handle_ = handle;
  return mem_.get();
}

void DnnlExecute(const_dnnl_primitive_t p, int nargs, const dnnl_exec_arg_t* args, const char* what,
                 dnnl_stream_t stream) {
  ++inside_execute;
  const dnnl_status_t st = dnnl_primitive_execute(p, stream ? stream : DnnlThreadStream(), nargs, args);
  --inside_execute;
  SS_CHECK(st == dnnl_success, "oneDNN ", what, " failed with status ", static_cast<int>(st));
}

namespace {

const dnnl::engine& Engine() { return DnnlEngine(); }

// One block shape's bf16 x bf16 -> f32 matmul, built on a thread with one OpenMP thread (oneDNN sizes
// its partitioning and scratchpad by the threads at creation) and user scratchpad mode.
struct Bf16Matmul {
  dnnl::memory::desc a, b, c;
  dnnl::matmul prim;
  size_t scratch = 0;
  dnnl::memory::desc scratch_md;  // bytes, when scratch > 0
};

// One call's product, or `group` > 1 products of a batch at once (a 3D primitive: batch strides sa, sb
// and m * n), which saves oneDNN's per-call cost on attention's small products.
std::shared_ptr<const Bf16Matmul> Bf16Primitive(bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t lda,
                                                int64_t ldb, int64_t ldc, int64_t group = 1, int64_t sa = 0,
                                                int64_t sb = 0) {
  using dnnl::memory;
  static std::mutex mu;
  static std::map<std::array<int64_t, 11>, std::shared_ptr<const Bf16Matmul>> cache;
  const std::array<int64_t, 11> key{ta, tb, m, n, k, lda, ldb, ldc, group, group > 1 ? sa : 0, group > 1 ? sb : 0};
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  auto p = std::make_shared<Bf16Matmul>();
  if (group == 1) {
    p->a = memory::desc({m, k}, memory::data_type::bf16, ta ? memory::dims{1, lda} : memory::dims{lda, 1});
    p->b = memory::desc({k, n}, memory::data_type::bf16, tb ? memory::dims{1, ldb} : memory::dims{ldb, 1});
    p->c = memory::desc({m, n}, memory::data_type::f32, memory::dims{ldc, 1});
  } else {
    p->a = memory::desc({group, m, k}, memory::data_type::bf16, ta ? memory::dims{sa, 1, lda} : memory::dims{sa, lda, 1});
    p->b = memory::desc({group, k, n}, memory::data_type::bf16, tb ? memory::dims{sb, 1, ldb} : memory::dims{sb, ldb, 1});
    p->c = memory::desc({group, m, n}, memory::data_type::f32, memory::dims{m * ldc, ldc, 1});
  }
  try {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(p->a, p->b, p->c), attr, Engine());
    p->prim = dnnl::matmul(pd);
    p->scratch = pd.scratchpad_desc().get_size();
    p->scratch_md = memory::desc({static_cast<int64_t>(std::max<size_t>(p->scratch, 1))}, memory::data_type::u8,
                                 memory::format_tag::a);
  } catch (const dnnl::error& e) {
    throw Error(Str("oneDNN refused the bf16 matmul ", m, "x", n, "x", k, " (transpose ", ta, tb, "): ", e.what()));
  }
  cache.emplace(key, p);
  return p;
}


// Round to nearest even: exact (the top half) for the bf16 values this is meant for.
void ToBf16(const float* x, int64_t count, uint16_t* y) {
  tbb::parallel_for(int64_t{0}, (count + (1 << 16) - 1) >> 16, [&](int64_t chunk) {
    const int64_t i0 = chunk << 16, i1 = std::min(count, i0 + (int64_t{1} << 16));
    for (int64_t i = i0; i < i1; ++i) {
      uint32_t u;
      std::memcpy(&u, x + i, 4);
      y[i] = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  });
}

// The converted operands of the calling thread's ParallelBf16Matmul calls, one pair per nesting level
// (a thread waiting in tbb::parallel_for may run another call's task): grown only.
struct Bf16Operands {
  std::vector<uint16_t> a, b;
  std::vector<float> wide_a, wide_b;           // the widened operands (Bf16MatmulWidens)
  std::vector<std::vector<float>> block_slots;  // a widened block per TBB thread slot
  std::vector<float> turned;  // C^T of a turned-around product (ParallelBf16Matmul)
};
struct OperandsScope {
  static thread_local std::vector<std::unique_ptr<Bf16Operands>> stack;
  static thread_local size_t depth;
  Bf16Operands* ops;
  OperandsScope() {
    if (stack.size() <= depth) stack.push_back(std::make_unique<Bf16Operands>());
    ops = stack[depth++].get();
  }
  ~OperandsScope() { --depth; }
};
thread_local std::vector<std::unique_ptr<Bf16Operands>> OperandsScope::stack;
thread_local size_t OperandsScope::depth = 0;


// Exact: bf16 h is the f32 whose top half is h.
void WidenBf16Scalar(const uint16_t* h, int64_t count, float* x) {
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t u = static_cast<uint32_t>(h[i]) << 16;
    std::memcpy(x + i, &u, 4);
  }
}
__attribute__((target("avx512f"))) void WidenBf16Avx512(const uint16_t* h, int64_t count, float* x) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i)));
    _mm512_storeu_si512(x + i, _mm512_slli_epi32(w, 16));
  }
  WidenBf16Scalar(h + i, count - i, x + i);
}
void WidenRow(const uint16_t* h, int64_t count, float* x) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (avx512) WidenBf16Avx512(h, count, x);
  else WidenBf16Scalar(h, count, x);
}
void WidenBf16(const uint16_t* h, int64_t count, float* x) {
  tbb::parallel_for(int64_t{0}, (count + (1 << 16) - 1) >> 16, [&](int64_t chunk) {
    const int64_t i0 = chunk << 16, i1 = std::min(count, i0 + (int64_t{1} << 16));
    WidenRow(h + i0, i1 - i0, x + i0);
  });
}

// An operand of a widened product: f32 holding bf16 values, or stored as bf16.
struct WideOperand {
  const float* f = nullptr;
  const uint16_t* h = nullptr;
  int64_t ld = 0, extent = 0;  // row stride; elements the product may read
  // The whole operand as f32 with its own row stride: in place, or widened into `buf`.
  const float* Whole(std::vector<float>& buf) const {
    if (f) return f;
    if (static_cast<int64_t>(buf.size()) < extent) buf.resize(extent);
    WidenBf16(h, extent, buf.data());
    return buf.data();
  }
  // Stored rows [r0, r0 + rows) x columns [c0, c0 + cols) as f32, dense (cols apart) at dst.
  void Block(int64_t r0, int64_t rows, int64_t c0, int64_t cols, float* dst) const {
    for (int64_t r = 0; r < rows; ++r) {
      if (f) std::memcpy(dst + r * cols, f + (r0 + r) * ld + c0, sizeof(float) * cols);
      else WidenRow(h + (r0 + r) * ld + c0, cols, dst + r * cols);
    }
  }
};

// ParallelBf16Matmul as f32 sgemm on the operands widened to f32 (Bf16MatmulWidens), in the blocks of
// ParallelSgemm: the operand a block reads a part of (op(A)'s rows, or op(B)'s columns when the product
// is wider than tall) is copied for each block, widened, into the task's scratch, where the sgemm reads
// it from cache (not widened whole into memory and read back: transformer_lm's activations), the other
// one read whole. A batch's products, an NT product StepSgemm turns around, and a single block read
// both whole. Both overloads take the same route on the same values with the same strides, so give the
// same bits; the route depends on the shapes only.
void WidenedMatmul(bool ta, bool tb, int64_t batches, int64_t m, int64_t n, int64_t k, const WideOperand& a,
                   const WideOperand& b, int64_t sa, int64_t sb, float* c) {
  OperandsScope scope;
  Bf16Operands& ops = *scope.ops;
  if (batches > 1) {
    const float *wa = a.Whole(ops.wide_a), *wb = b.Whole(ops.wide_b);
    tbb::parallel_for(int64_t{0}, batches, [&](int64_t i) {
      thread_local const bool single = (SetOmpThreads(1), true);
      (void)single;
      DnnlSgemm(ta, tb, m, n, k, wa + i * sa, a.ld, wb + i * sb, b.ld, 0.0f, c + i * m * n, n);
    });
    return;
  }
  const bool by_columns = m < n;
  const auto [span, blocks] = by_columns ? BlocksOf(n, m, k) : BlocksOf(m, n, k);
  if (blocks <= 1 || (SgemmTurnsAround(ta, tb, m, n, k) && a.ld == k && b.ld == k))
    return StepSgemm(ta, tb, m, n, k, a.Whole(ops.wide_a), a.ld, b.Whole(ops.wide_b), b.ld, c);
  const WideOperand& split = by_columns ? b : a;
  const float* whole = by_columns ? a.Whole(ops.wide_a) : b.Whole(ops.wide_b);
  // One scratch block per TBB thread slot, sized here (grown only): no task allocates.
  ops.block_slots.resize(std::max(tbb::this_task_arena::max_concurrency(), tbb::info::default_concurrency()));
  for (std::vector<float>& slot : ops.block_slots)
    if (static_cast<int64_t>(slot.size()) < span * k) slot.resize(span * k);
  std::vector<std::vector<float>>& slots = ops.block_slots;
  tbb::parallel_for(int64_t{0}, blocks, [&](int64_t blk) {
    thread_local const bool single = (SetOmpThreads(1), true);
    (void)single;
    const int index = std::max(0, tbb::this_task_arena::current_thread_index());
    SS_CHECK(index < static_cast<int>(slots.size()), "thread slot ", index, " beyond the widened matmul's ", slots.size());
    float* part = slots[index].data();
    const int64_t first = blk * span, len = std::min(span, (by_columns ? n : m) - first);
    // op(A)'s rows [first, +len): stored rows (k wide), or stored columns (A^T); op(B)'s columns: stored
    // columns, or stored rows (B^T). The part keeps the operand's transposition, densely.
    const bool stored_rows = by_columns ? tb : !ta;
    if (stored_rows) split.Block(first, len, 0, k, part);
    else split.Block(0, k, first, len, part);
    const int64_t part_ld = stored_rows ? k : len;
    if (by_columns) DnnlSgemm(ta, tb, m, len, k, whole, a.ld, part, part_ld, 0.0f, c + first, n);
    else DnnlSgemm(ta, tb, len, n, k, part, part_ld, whole, b.ld, 0.0f, c + first * n, n);
  });
}

}  // namespace

void ParallelBf16Matmul(bool ta, bool tb, int64_t batches, int64_t m, int64_t n, int64_t k, const float* a,
                        int64_t lda, int64_t sa, const float* b, int64_t ldb, int64_t sb, float* c) {
  if (batches > 0 && m > 0 && n > 0 && k > 0 && Bf16MatmulWidens()) {
    const int64_t na = (batches - 1) * sa + (ta ? k : m) * lda, nb = (batches - 1) * sb + (tb ? n : k) * ldb;
    return WidenedMatmul(ta, tb, batches, m, n, k, WideOperand{a, nullptr, lda, na}, WideOperand{b, nullptr, ldb, nb},
                         sa, sb, c);
  }
  if (batches == 0 || m == 0 || n == 0 || k == 0) {
    ParallelBf16Matmul(ta, tb, batches, m, n, k, static_cast<const uint16_t*>(nullptr), lda, sa, nullptr, ldb, sb, c);
    return;
  }
  OperandsScope scope;
  const int64_t na = (batches - 1) * sa + (ta ? k : m) * lda, nb = (batches - 1) * sb + (tb ? n : k) * ldb;
  if (static_cast<int64_t>(scope.ops->a.size()) < na) scope.ops->a.resize(na);
  if (static_cast<int64_t>(scope.ops->b.size()) < nb) scope.ops->b.resize(nb);
  ToBf16(a, na, scope.ops->a.data());
  ToBf16(b, nb, scope.ops->b.data());
  ParallelBf16Matmul(ta, tb, batches, m, n, k, scope.ops->a.data(), lda, sa, scope.ops->b.data(), ldb, sb, c);
}

void ParallelBf16Matmul(bool ta, bool tb, int64_t batches, int64_t m, int64_t n, int64_t k, const uint16_t* ha,
                        int64_t lda, int64_t sa, const uint16_t* hb, int64_t ldb, int64_t sb, float* c) {
  if (batches == 0 || m == 0 || n == 0) return;
  if (k == 0) {
    std::fill(c, c + batches * m * n, 0.0f);
    return;
  }
  if (Bf16MatmulWidens()) {
    const int64_t na = (batches - 1) * sa + (ta ? k : m) * lda, nb = (batches - 1) * sb + (tb ? n : k) * ldb;
    return WidenedMatmul(ta, tb, batches, m, n, k, WideOperand{nullptr, ha, lda, na}, WideOperand{nullptr, hb, ldb, nb},
                         sa, sb, c);
  }
  // A weight gradient A^T B taller than wide runs turned around, C^T = B^T A, then C^T is transposed:
  // oneDNN 2.6's gemm:jit is faster on the wider form (bench/step --bf16, per shape with
  // SS_GEMM_SHAPES; here: transformer_lm's fc2 512x128x4096 0.73 -> 0.67 ms warm, 0.81 -> 0.78 cold,
  // its head's 128x63x4096 0.18 -> 0.12; 128x512 turned is slower, square is level). The choice
  // depends on the shapes only.
  if (ta && !tb && batches == 1 && m > n && !CpuHasAmx()) {
    OperandsScope scope;
    std::vector<float>& ct = scope.ops->turned;
    if (static_cast<int64_t>(ct.size()) < m * n) ct.resize(m * n);
    ParallelBf16Matmul(true, false, 1, n, m, k, hb, ldb, 0, ha, lda, 0, ct.data());
    TransposeMatrix(ct.data(), n, m, c);
    return;
  }
  // Blocks of rows, or of columns when the product is wider than tall (the MLP's batch-128 forward and
  // input-gradient products: row blocks would each read all of B, column blocks read B once). Each
  // output element is one oneDNN call's either way; the split depends on the shapes only.
  // With AMX, a transposed A (a weight gradient, A^T B) goes in at most 2 row blocks, each block's
  // columns of the stored A copied dense first (k x rows, small): oneDNN 2.6 runs its AMX kernels only
  // on dense operands, and the column blocks' strided B and C sent these products to its gemm:jit,
  // 1.7-2x slower (bench/step --bf16, the MLP's 784x1024x128 and 1024x1024x128).
  const bool dense_rows = ta && CpuHasAmx();
  const bool by_columns = m < n && !dense_rows;
  auto [span, blocks] = by_columns ? BlocksOf(n, m, k) : BlocksOf(m, n, k);
  if (dense_rows && blocks > 2) {
    span = ((m + 1) / 2 + 7) / 8 * 8;
    blocks = (m + span - 1) / span;
  }
  const bool copy_a = dense_rows && (blocks > 1 || lda != m);
  // Small products of a batch (one block each: attention's) go `group` at a time, the largest divisor
  // of the batch count with at most about 4M multiply-adds per call; it depends on the shapes only.
  int64_t group = 1;
  if (blocks == 1 && batches > 1 && !copy_a)
    for (int64_t g = std::min<int64_t>(batches, std::max<int64_t>(1, (int64_t{1} << 22) / (m * n * k))); g > 1; --g)
      if (batches % g == 0) {
        group = g;
        break;
      }
  // The primitives of the full blocks and of the last one (smaller when the span does not divide),
  // looked up once per call, not per block.
  const int64_t len = by_columns ? n : m, last = len - (blocks - 1) * span;
  auto primitive = [&](int64_t extent) {
    return by_columns ? Bf16Primitive(ta, tb, m, extent, k, lda, ldb, n, group, sa, sb)
                      : Bf16Primitive(ta, tb, extent, n, k, copy_a ? extent : lda, ldb, n, group, sa, sb);
  };
  const std::shared_ptr<const Bf16Matmul> full = primitive(std::min(span, len)), tail = last == span ? full : primitive(last);
  // The calling (replica) thread's memory objects and scratchpads for these primitives, one set per TBB
  // thread slot, all made at the thread's first call: a worker's first task then makes nothing, and each
  // block re-points its slot's objects at its operands.
  struct SlotMems {
    BoundDnnlMem a, b, c, scratch;
    std::vector<char> scratch_buf;
    std::vector<uint16_t> dense_a;  // copy_a: the block's rows of op(A), k x rows
    char* ScratchPtr() {
      const uintptr_t p = reinterpret_cast<uintptr_t>(scratch_buf.data());
      return scratch_buf.data() + (64 - p % 64) % 64;
    }
  };
  thread_local std::unordered_map<const Bf16Matmul*, std::vector<SlotMems>> mems_of;
  auto slots_of = [&](const Bf16Matmul& p, int64_t extent) -> std::vector<SlotMems>& {
    std::vector<SlotMems>& v = mems_of[&p];  // a reference into an unordered_map survives its rehashes
    if (v.empty()) {
      v.resize(std::max(tbb::this_task_arena::max_concurrency(), tbb::info::default_concurrency()));
      for (SlotMems& slot : v) {
        slot.scratch_buf.resize(p.scratch + 64);
        slot.a.Bind(p.a, const_cast<uint16_t*>(ha));
        slot.b.Bind(p.b, const_cast<uint16_t*>(hb));
        slot.c.Bind(p.c, c);
        if (p.scratch > 0) slot.scratch.Bind(p.scratch_md, slot.ScratchPtr());
      }
    }
    // Another call may have made the slots of an equal primitive without a copy.
    if (copy_a && static_cast<int64_t>(v[0].dense_a.size()) < extent * k)
      for (SlotMems& slot : v) slot.dense_a.resize(extent * k);
    return v;
  };
  std::vector<SlotMems>& full_slots = slots_of(*full, std::min(span, len));
  std::vector<SlotMems>& tail_slots = slots_of(*tail, last);
  auto run = [&](int64_t task) {
    thread_local const bool single = (SetOmpThreads(1), true);
    (void)single;
    const int64_t bt = task / blocks * group, blk = task % blocks, first = blk * span;
    const int64_t r0 = by_columns ? 0 : first, c0 = by_columns ? first : 0;
    const bool is_tail = blk == blocks - 1;
    const Bf16Matmul& p = is_tail ? *tail : *full;
    std::vector<SlotMems>& slots = is_tail ? tail_slots : full_slots;
    const int index = std::max(0, tbb::this_task_arena::current_thread_index());
    SS_CHECK(index < static_cast<int>(slots.size()), "thread slot ", index, " beyond the bf16 matmul's ", slots.size());
    SlotMems& mm = slots[index];
    const uint16_t* a = ha + bt * sa + (ta ? r0 : r0 * lda);
    if (copy_a) {  // op(A)'s rows r0.. are columns of the stored k x lda matrix
      const int64_t rows = is_tail ? last : span;
      for (int64_t p = 0; p < k; ++p) std::memcpy(mm.dense_a.data() + p * rows, a + p * lda, rows * sizeof(uint16_t));
      a = mm.dense_a.data();
    }
    // oneDNN reads the operands only; its handles are non-const.
    dnnl_exec_arg_t args[] = {
        {DNNL_ARG_SRC, mm.a.Bind(p.a, const_cast<uint16_t*>(a))},
        {DNNL_ARG_WEIGHTS, mm.b.Bind(p.b, const_cast<uint16_t*>(hb + bt * sb + (tb ? c0 * ldb : c0)))},
        {DNNL_ARG_DST, mm.c.Bind(p.c, c + bt * m * n + r0 * n + c0)},
        {DNNL_ARG_SCRATCHPAD, p.scratch > 0 ? mm.scratch.Bind(p.scratch_md, mm.ScratchPtr()) : nullptr}};
    DnnlExecute(p.prim.get(), p.scratch > 0 ? 4 : 3, args, "bf16 matmul");
  };
  const int64_t tasks = batches / group * blocks;
  if (tasks == 1) {
    run(0);
    return;
  }
  tbb::parallel_for(int64_t{0}, tasks, run);
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
