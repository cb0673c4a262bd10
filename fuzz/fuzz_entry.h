// Fuzz entry points: one function per file reader, shared by the libFuzzer targets (fuzz/*_fuzzer.cc)
// and the regression test that replays fuzz/regressions/ in the normal build (tests/fuzz/).
//
// Contract of every entry: bad input is rejected with shardstep::Error (the user-error channel) and
// the entry returns normally. Anything else is a bug the fuzzer reports: a sanitizer finding, an
// SS_CHECK, an exception of another type escaping (std::out_of_range, std::bad_alloc, ...), or a
// broken property (abort via FuzzPropertyFailed, with the input's printed forms on stderr).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "cli/config_file.h"
#include "ir/error.h"
#include "ir/module.h"
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "runtime/checkpoint.h"
#include "runtime/dataset.h"

namespace shardstep::fuzz {

[[noreturn]] inline void FuzzPropertyFailed(const std::string& what) {
  std::fprintf(stderr, "fuzz property failed: %s\n", what.c_str());
  std::abort();
}

// IR text: Parse; Print must be total (also for modules the verifier rejects); for a module that
// verifies, Print(Parse(Print(m))) == Print(m) and the re-parsed module verifies too.
inline void FuzzIrParser(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  ir::Module m;
  try {
    m = ir::Parse(text, "<fuzz>");
  } catch (const Error&) {
    return;
  }
  const std::string printed = ir::Print(m);
  try {
    ir::Verify(m);
  } catch (const Error&) {
    return;
  }
  ir::Module again;
  try {
    again = ir::Parse(printed, "<printed>");
  } catch (const Error& e) {
    FuzzPropertyFailed(Str("printed form of a verified module does not parse: ", e.what(), "\n--- printed:\n", printed));
  }
  try {
    ir::Verify(again);
  } catch (const Error& e) {
    FuzzPropertyFailed(Str("re-parsed module does not verify: ", e.what(), "\n--- printed:\n", printed));
  }
  const std::string reprinted = ir::Print(again);
  if (reprinted != printed) {
    FuzzPropertyFailed(Str("print(parse(print(m))) != print(m)\n--- first:\n", printed, "\n--- second:\n", reprinted));
  }
}

// safetensors: the whole input is the file.
inline void FuzzSafetensors(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  std::map<std::string, std::string> metadata;
  try {
    runtime::LoadCheckpointFromBytes(bytes, "<fuzz>", &metadata);
  } catch (const Error&) {
  }
}

// An anonymous in-memory file (memfd) holding `bytes`, opened again by path (/proc/self/fd/N) so the
// reader under test runs its own file code (gzopen) unchanged. Closes on destruction.
class MemFile {
 public:
  MemFile(const char* name, const uint8_t* data, size_t size) : fd_(memfd_create(name, MFD_CLOEXEC)) {
    if (fd_ < 0) FuzzPropertyFailed(Str("memfd_create: ", std::strerror(errno)));
    for (size_t done = 0; done < size;) {
      ssize_t w = ::write(fd_, data + done, size - done);
      if (w <= 0) FuzzPropertyFailed(Str("write to memfd: ", std::strerror(errno)));
      done += static_cast<size_t>(w);
    }
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_;
};

// IDX: the input is [u32 little-endian n][n bytes: the images file][rest: the labels file] (n is
// clamped to what follows), both read by LoadIdx with 10 classes, gzip-compressed or not.
inline void FuzzIdx(const uint8_t* data, size_t size) {
  if (size < 4) return;
  uint32_t n = 0;
  std::memcpy(&n, data, 4);
  data += 4;
  size -= 4;
  const size_t images = std::min<size_t>(n, size);
  MemFile image_file("images", data, images);
  MemFile label_file("labels", data + images, size - images);
  try {
    runtime::Dataset d = runtime::LoadIdx(image_file.path(), label_file.path(), 10);
    if (d.images.shape().size() != 4 || d.images.shape()[0] != d.size())
      FuzzPropertyFailed("LoadIdx returned images whose count differs from the labels'");
  } catch (const Error&) {
  }
}

// Config files: the input is the file's text.
inline void FuzzConfigFile(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    cli::ConfigFile f = cli::ParseConfig(text, "<fuzz>");
    for (const cli::ConfigEntry& e : f.entries)
      if (e.line < 1) FuzzPropertyFailed(Str("entry '", e.key, "' has line ", e.line));
  } catch (const Error&) {
  }
}

}  // namespace shardstep::fuzz
