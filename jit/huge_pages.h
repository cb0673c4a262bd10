// Zeroed memory in 2 MiB pages where the kernel gives them: mapped at a 2 MiB boundary with
// madvise(MADV_HUGEPAGE) (Debian 12's transparent huge pages are "madvise": plain malloc'd memory stays in
// 4 KiB pages). For the step's large buffers read across many pages: the workspace arena, oneDNN's
// scratchpads of packed operands. The transposed operands of the weight gradients are read across rows,
// and each row of a 4 KiB page costs a TLB entry (bench/step --bf16: transformer_lm's bf16 step 0.5-2 ms
// faster with the arena in huge pages). Heap memory below kMinBytes, and under AddressSanitizer (an
// access past the end is then reported).
#pragma once

#include <cstddef>
#include <utility>

namespace shardstep::jit {

class HugePageMemory {
 public:
  // Below this, heap memory: a huge page is resident whole once touched.
  static constexpr size_t kMinBytes = size_t{1} << 20;

  HugePageMemory() = default;
  HugePageMemory(HugePageMemory&& o) noexcept { *this = std::move(o); }
  HugePageMemory& operator=(HugePageMemory&& o) noexcept;
  ~HugePageMemory() { Release(); }
  void Assign(size_t bytes);  // fresh zeroed memory of at least `bytes` (the old memory is released)
  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void Release();
  char* data_ = nullptr;
  size_t size_ = 0, mapped_ = 0;  // mapped_ 0: heap memory
};

}  // namespace shardstep::jit
