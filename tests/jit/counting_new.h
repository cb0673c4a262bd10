// Replaces global operator new/delete by a counting one for the test executable that includes this header
// (include it in exactly one translation unit): while g_counting is set, every allocation on any thread is
// counted (g_allocs; g_large those of at least kLarge bytes; g_bytes their sizes), except those oneDNN
// makes inside its execute (jit::InsideDnnlExecute: the library's own argument map per call, which its
// v2 API cannot avoid), counted apart in g_library_allocs. Not under
// AddressSanitizer (kCountingAllocations is then false): ASan replaces operator new itself, and libLLVM's own
// new/delete pairs would then be split between ASan's operators and these (an alloc-dealloc mismatch).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "jit/dnnl_runtime.h"

namespace counting_new {

// Below the MLP's smallest activation (its 32 x 10 logits, 1280 bytes).
constexpr size_t kLarge = 1024;
inline std::atomic<bool> g_counting{false};
inline std::atomic<int64_t> g_allocs{0}, g_large{0}, g_bytes{0}, g_library_allocs{0};

[[maybe_unused]] inline void* Counted(size_t n, size_t align) {
  if (g_counting.load(std::memory_order_relaxed) && shardstep::jit::InsideDnnlExecute()) {
    ++g_library_allocs;
  } else if (g_counting.load(std::memory_order_relaxed)) {
    ++g_allocs;
    g_bytes += static_cast<int64_t>(n);
    if (n >= kLarge) ++g_large;
  }
  void* p = align > alignof(std::max_align_t) ? std::aligned_alloc(align, (n + align - 1) / align * align)
                                              : std::malloc(n ? n : 1);
  if (!p) throw std::bad_alloc();
  return p;
}

}  // namespace counting_new

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kCountingAllocations = false;
#else
constexpr bool kCountingAllocations = true;
void* operator new(size_t n) { return counting_new::Counted(n, 0); }
void* operator new[](size_t n) { return counting_new::Counted(n, 0); }
void* operator new(size_t n, std::align_val_t a) { return counting_new::Counted(n, static_cast<size_t>(a)); }
void* operator new[](size_t n, std::align_val_t a) { return counting_new::Counted(n, static_cast<size_t>(a)); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { std::free(p); }
#endif

using counting_new::g_allocs;
using counting_new::g_bytes;
using counting_new::g_counting;
using counting_new::g_large;
using counting_new::g_library_allocs;
using counting_new::kLarge;
