// Winograd F(2x2, 3x3) on NHWC activations (see winograd_nhwc.h): the loops (winograd_nhwc_loops.inc)
// built once for AVX-512 and once for AVX2 + FMA, and the calls that run them over a batch.
#include "jit/winograd_nhwc.h"

#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "ir/error.h"
#include "jit/simd.h"

namespace shardstep::jit {
namespace {

constexpr int kPositions = 16;  // a 4x4 input tile's transformed positions, p = 4 i + j
constexpr int64_t kMaxChannels = 256;

// Output channels blocked OB vectors per product, and the most tiles per group for that block.
struct Blocking {
  int ob, max_tiles;
};

// Output tiles walked in row-major order: one division per call, not two per tile (an integer
// division costs about what a tile's input transform does with 16 channels).
struct TileWalk {
  int64_t ty, tx, tiles_w;
  TileWalk(int64_t first, int64_t w) : ty(first / w), tx(first % w), tiles_w(w) {}
  void Next() {
    if (++tx == tiles_w) tx = 0, ++ty;
  }
};

// Tiles transformed per sweep over the filter gradient's sums m: a sweep loads and stores all of m
// (16 x C x O floats: 256 KB with 64 channels), so it runs over several images' tiles at once.
constexpr int64_t kTilesPerSweep = 64;
int64_t ImagesPerSweep(const ConvShape& g) {
  const int64_t tiles = ((g.oh + 1) / 2) * ((g.ow + 1) / 2);
  return std::max<int64_t>(1, kTilesPerSweep / std::max<int64_t>(tiles, 1));
}

// One instruction set's loops (winograd_nhwc_loops.inc).
struct LoopSet {
  int64_t lanes;
  int64_t min_channels;  // the fewest input and output channels where the loops beat oneDNN's direct kernel
  Blocking (*blocking)(int64_t o);
  void (*transform_filter)(const ConvShape& g, const float* w, float* u);
  bool (*image)(const ConvShape& g, const float* x, const float* u, float* y, int64_t per_group, float* v, float* m);
  void (*filter_grad_images)(const ConvShape& g, const float* x, const float* dy, int64_t first, int64_t last, float* v,
                             float* w, float* m);
  void (*transform_filter_grad)(const ConvShape& g, const float* m, float* dw);
};

// The loops built for AVX-512 and for AVX2 (jit/simd_each_target.inc).
#define SS_SIMD_BODY "jit/winograd_nhwc_loops.inc"
#include "jit/simd_each_target.inc"

// The widest loops this CPU runs, or none.
const LoopSet* CpuLoops() {
  const int64_t lanes = simd::CpuLanes();
  return lanes == 16 ? &avx512::kLoops : lanes == 8 ? &avx2::kLoops : nullptr;
}

// Whether any of v[0, n) is an inf or a NaN.
bool AnyNonFinite(const float* v, int64_t n) {
  const uint32_t* u = reinterpret_cast<const uint32_t*>(v);
  uint32_t found = 0;
  for (int64_t i = 0; i < n; ++i) found |= static_cast<uint32_t>((u[i] & 0x7f800000u) == 0x7f800000u);
  return found != 0;
}

}  // namespace

bool WinogradNhwcApplies(const ConvShape& g) {
  const LoopSet* loops = CpuLoops();
  return loops && g.kh == 3 && g.kw == 3 && g.sh == 1 && g.sw == 1 && g.ph == 1 && g.pw == 1 && g.c % 16 == 0 &&
         g.o % 16 == 0 && g.c >= loops->min_channels && g.o >= loops->min_channels && g.c <= kMaxChannels &&
         g.o <= kMaxChannels && g.oh == g.h && g.ow == g.w && g.h > 0 && g.w > 0;
}

const char* WinogradNhwcIsa() {
  const LoopSet* loops = CpuLoops();
  return !loops ? "none" : loops->lanes == 16 ? "avx512" : "avx2";
}

bool WinogradNhwcForward(const ConvShape& g, const float* x, const float* w, float* y) {
  const LoopSet& loops = *CpuLoops();
  const int64_t lanes = loops.lanes;
  thread_local std::vector<float> u;  // the calling thread's transformed filter
  if (static_cast<int64_t>(u.size()) < kPositions * g.c * g.o) u.resize(kPositions * g.c * g.o);
  loops.transform_filter(g, w, u.data());
  // Groups of tiles: as few as the register blocking allows, of equal size but the last.
  const Blocking bl = loops.blocking(g.o);
  const int64_t tiles = ((g.oh + 1) / 2) * ((g.ow + 1) / 2);
  const int64_t groups = (tiles + bl.max_tiles - 1) / bl.max_tiles, per_group = (tiles + groups - 1) / groups;
  const int64_t v_size = kPositions * (per_group * g.c + lanes);
  const int64_t image_in = g.h * g.w * g.c, image_out = g.oh * g.ow * g.o;
  std::atomic<bool> finite{true};
  const float* uu = u.data();
  // v then m per TBB thread slot, owned by the calling (replica) thread and grown by it: a worker may
  // run its first image of a shape in any step, and then finds its scratch made.
  thread_local std::vector<std::vector<float>> caller_slots;
  std::vector<std::vector<float>>& slots = caller_slots;  // (in the tasks, the caller's: not their own)
  const size_t need = static_cast<size_t>(v_size + kPositions * (per_group * bl.ob * lanes + lanes));
  slots.resize(std::max(tbb::this_task_arena::max_concurrency(), tbb::info::default_concurrency()));
  for (std::vector<float>& slot : slots)
    if (slot.size() < need) slot.resize(need);
  tbb::parallel_for(int64_t{0}, g.n, [&](int64_t n) {
    const int index = std::max(0, tbb::this_task_arena::current_thread_index());
    SS_CHECK(index < static_cast<int>(slots.size()), "thread slot ", index, " beyond the Winograd loops' ", slots.size());
    float* scratch = slots[index].data();
    if (!loops.image(g, x + n * image_in, uu, y + n * image_out, per_group, scratch, scratch + v_size))
      finite.store(false, std::memory_order_relaxed);
  });
  return finite.load();
}

bool WinogradNhwcFilterGrad(const ConvShape& g, const float* x, const float* dy, float* dw) {
  // Fixed groups of images (as the other filter-gradient paths), each group's sums in one order
  // (image, position, tile), the groups added in order: the same bits on any number of threads.
  constexpr int64_t kGroups = 8;
  const LoopSet& loops = *CpuLoops();
  const int64_t lanes = loops.lanes;
  const int64_t tiles = ((g.oh + 1) / 2) * ((g.ow + 1) / 2), part = kPositions * g.c * g.o;
  const int64_t sweep = std::min(ImagesPerSweep(g), std::max<int64_t>(g.n, 1)) * tiles;
  const int64_t v_size = kPositions * (sweep * g.c + lanes), w_size = kPositions * (sweep * g.o + lanes);
  // Per calling thread: the groups' sums; per TBB thread slot: an image's transformed tiles.
  thread_local std::vector<float> caller_parts;
  thread_local std::vector<std::vector<float>> caller_slots;
  std::vector<float>& parts = caller_parts;
  std::vector<std::vector<float>>& slots = caller_slots;
  if (static_cast<int64_t>(parts.size()) < kGroups * part) parts.resize(kGroups * part);
  slots.resize(std::max(tbb::this_task_arena::max_concurrency(), tbb::info::default_concurrency()));
  for (std::vector<float>& slot : slots)
    if (static_cast<int64_t>(slot.size()) < v_size + w_size) slot.resize(v_size + w_size);
  const int64_t per_group = (g.n + kGroups - 1) / kGroups;
  tbb::parallel_for(int64_t{0}, kGroups, [&](int64_t group) {
    const int index = std::max(0, tbb::this_task_arena::current_thread_index());
    SS_CHECK(index < static_cast<int>(slots.size()), "thread slot ", index, " beyond the Winograd loops' ", slots.size());
    float* m = parts.data() + group * part;
    std::fill_n(m, part, 0.0f);
    float* scratch = slots[index].data();
    loops.filter_grad_images(g, x, dy, std::min(g.n, group * per_group), std::min(g.n, (group + 1) * per_group), scratch,
                     scratch + v_size, m);
  });
  float* m = parts.data();
  for (int64_t group = 1; group < kGroups; ++group)
    for (int64_t i = 0; i < part; ++i) m[i] += parts[group * part + i];
  loops.transform_filter_grad(g, m, dw);
  return !AnyNonFinite(dw, g.o * g.c * 9);
}

}  // namespace shardstep::jit
