// libFuzzer target: safetensors (see fuzz/fuzz_entry.h for what counts as a failure).
#include <cstddef>
#include <cstdint>

#include "fuzz/fuzz_entry.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  shardstep::fuzz::FuzzSafetensors(data, size);
  return 0;
}
