// WriteFileAtomically: temporary file, fsync, rename, fsync of the directory.
#include "runtime/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "ir/error.h"

namespace shardstep::runtime {
namespace {

bool WriteAll(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

}  // namespace

void WriteFileAtomically(const std::string& path, const std::vector<std::pair<const void*, size_t>>& pieces,
                         const std::string& what) {
  const std::string tmp = Str(path, ".tmp.", ::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(Str(path, ": cannot save ", what, ": cannot create ", tmp, ": ", std::strerror(errno)));
  auto fail = [&](const char* step) {
    const int e = errno;
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    return Error(Str(path, ": cannot save ", what, ": ", step, ": ", std::strerror(e)));
  };
  for (const auto& [data, bytes] : pieces)
    if (!WriteAll(fd, data, bytes)) throw fail("write");
  if (::fsync(fd) != 0) throw fail("fsync");
  const int rc = ::close(fd);
  fd = -1;
  if (rc != 0) throw fail("close");
  if (::rename(tmp.c_str(), path.c_str()) != 0) throw fail("rename");
  // Make the rename itself durable (best effort: some filesystems refuse fsync on directories).
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace shardstep::runtime
