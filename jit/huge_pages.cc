// HugePageMemory (see huge_pages.h).
#include "jit/huge_pages.h"

#include <sys/mman.h>

#include <cstdint>
#include <new>

// AddressSanitizer (GCC's macro, clang's feature test).
#if defined(__SANITIZE_ADDRESS__)
#define SS_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SS_ASAN 1
#endif
#endif

namespace shardstep::jit {

HugePageMemory& HugePageMemory::operator=(HugePageMemory&& o) noexcept {
  if (this != &o) {
    Release();
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(mapped_, o.mapped_);
  }
  return *this;
}

void HugePageMemory::Assign(size_t bytes) {
  Release();
  if (bytes == 0) return;
  size_ = bytes;
#if defined(SS_ASAN)
  const bool heap = true;
#else
  const bool heap = bytes < kMinBytes;
#endif
  if (heap) {
    data_ = new char[bytes]();
    return;
  }
  constexpr size_t kHuge = size_t{2} << 20;
  mapped_ = (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = mmap(nullptr, mapped_ + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  // Start at a 2 MiB boundary (the slack before and after it unmapped) so every page can be huge.
  char* base = static_cast<char*>(p);
  char* aligned = base + (kHuge - reinterpret_cast<uintptr_t>(base) % kHuge) % kHuge;
  if (aligned > base) munmap(base, aligned - base);
  if (char* end = aligned + mapped_; end < base + mapped_ + kHuge) munmap(end, base + mapped_ + kHuge - end);
  madvise(aligned, mapped_, MADV_HUGEPAGE);  // advice: refused, the pages stay 4 KiB
  data_ = aligned;
}

void HugePageMemory::Release() {
  if (data_ && mapped_ > 0) munmap(data_, mapped_);
  else delete[] data_;
  data_ = nullptr;
  size_ = mapped_ = 0;
}

}  // namespace shardstep::jit
