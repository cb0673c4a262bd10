// jit/huge_pages.h: the workspace arena's memory. Zeroed, writable to its last byte, at a 2 MiB boundary
// when it is mapped (from kMinBytes up, outside AddressSanitizer), released and replaced by Assign,
// handed over by a move.
#include <catch2/catch.hpp>

#include <cstdint>

#include "jit/huge_pages.h"

using shardstep::jit::HugePageMemory;

namespace {
bool Zeroed(const HugePageMemory& m) {
  for (size_t i = 0; i < m.size(); i += 4093)
    if (m.data()[i] != 0) return false;
  return m.size() == 0 || m.data()[m.size() - 1] == 0;
}
}  // namespace

TEST_CASE("huge-page memory: zeroed, writable to the end, 2 MiB aligned when mapped", "[jit]") {
  for (size_t bytes : {size_t{1}, size_t{4096}, HugePageMemory::kMinBytes - 1, HugePageMemory::kMinBytes,
                       (size_t{3} << 20) + 1, size_t{8} << 20}) {
    INFO(bytes << " bytes");
    HugePageMemory m;
    m.Assign(bytes);
    REQUIRE(m.data() != nullptr);
    CHECK(m.size() == bytes);
    CHECK(Zeroed(m));
    m.data()[0] = 1;
    m.data()[bytes - 1] = 2;
    CHECK(m.data()[bytes - 1] == 2);
#if !defined(__SANITIZE_ADDRESS__)
    if (bytes >= HugePageMemory::kMinBytes) CHECK(reinterpret_cast<uintptr_t>(m.data()) % (size_t{2} << 20) == 0);
#endif
    m.Assign(bytes);  // fresh memory, zeroed again
    CHECK(Zeroed(m));
  }
}

TEST_CASE("huge-page memory: a move hands the memory over, empty memory is empty", "[jit]") {
  HugePageMemory a;
  CHECK(a.data() == nullptr);
  a.Assign(0);
  CHECK(a.data() == nullptr);
  CHECK(a.size() == 0);
  a.Assign(size_t{4} << 20);
  char* p = a.data();
  p[12345] = 7;
  HugePageMemory b(std::move(a));
  CHECK(b.data() == p);
  CHECK(b.data()[12345] == 7);
  CHECK(a.data() == nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state is defined
  HugePageMemory c;
  c.Assign(100);
  c = std::move(b);
  CHECK(c.data() == p);
  CHECK(c.size() == (size_t{4} << 20));
}
