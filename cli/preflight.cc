// Pre-flight checks: output paths, dataset files, memory.
#include "cli/preflight.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include "ir/error.h"
#include "ir/memory_plan.h"
#include "runtime/dataset.h"

namespace shardstep::cli {

std::string Bytes(int64_t b) {
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  if (b < 1024) return Str(b, " B");
  double v = b / 1024.0;
  int u = 0;
  while (v >= 1024 && u < 3) v /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

void CheckOutputPath(const std::string& flag, const std::string& path) {
  if (path.empty()) return;
  auto fail = [&](const std::string& why) { throw Error(Str("cannot write ", flag, " ", path, ": ", why)); };
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) fail("it is a directory");
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  if (::stat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT) fail(Str("directory ", dir, " does not exist"));
    if (errno == ENOTDIR) fail(Str("directory ", dir, ": a part of it is not a directory"));
    fail(Str("directory ", dir, ": ", std::strerror(errno)));
  }
  if (!S_ISDIR(st.st_mode)) fail(Str(dir, " is not a directory"));
  // Try it: permissions alone do not tell (root, read-only mounts, /proc).
  const std::string probe = Str(dir, "/.shardstep-write-check.", ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) fail(Str("cannot create files in directory ", dir, ": ", std::strerror(errno)));
  ::close(fd);
  ::unlink(probe.c_str());
  if (::access(path.c_str(), F_OK) == 0 && ::access(path.c_str(), W_OK) != 0)
    fail(Str("the file exists and is not writable: ", std::strerror(errno)));
}

void CheckOutputPaths(const std::vector<std::pair<std::string, std::string>>& flag_paths) {
  std::map<std::string, std::string> seen;  // path -> flag
  for (const auto& [flag, path] : flag_paths) {
    if (path.empty()) continue;
    CheckOutputPath(flag, path);
    auto [it, fresh] = seen.emplace(path, flag);
    if (!fresh) throw Error(Str(it->second, " and ", flag, " name the same file ", path));
  }
}

void CheckFashionMnistDir(const std::string& dir) {
  const std::string files =
      "train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz "
      "(gzipped or not)";
  const std::string hint =
      dir == runtime::kFashionMnistDir
          ? Str("install the Debian package ", runtime::kFashionMnistPackage,
                " (scripts/setup does), pass --data-dir DIR with the files, or use --dataset synthetic")
          : Str("the Debian package ", runtime::kFashionMnistPackage, " installs them in ", runtime::kFashionMnistDir,
                " (the default --data-dir); or use --dataset synthetic");
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0)
    throw Error(Str("--data-dir ", dir, ": ", std::strerror(errno), "; it must hold ", files, "; ", hint));
  if (!S_ISDIR(st.st_mode)) throw Error(Str("--data-dir ", dir, ": not a directory; it must hold ", files, "; ", hint));
  std::string missing;
  int count = 0;
  for (bool train : {true, false})
    for (const std::string& f : runtime::FashionMnistFiles(dir, train))
      if (::access(f.c_str(), R_OK) != 0) {
        const int err = errno;
        missing += Str(count++ ? ", " : "", f.substr(f.rfind('/') + 1), err == ENOENT ? "" : Str(" (", std::strerror(err), ")"));
      }
  if (count == 4) throw Error(Str("--data-dir ", dir, " holds none of the Fashion-MNIST files ", files, "; ", hint));
  if (count)
    throw Error(Str("--data-dir ", dir, ": missing Fashion-MNIST file", count > 1 ? "s " : " ", missing, "; ", hint));
}

int64_t AvailableMemoryBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  int64_t value = 0;
  while (in >> key >> value) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return value * 1024;  // kB
  }
  return -1;
}

MemoryNeed StepMemoryNeed(const ir::Module& step, bool keeps_all_values) {
  const ir::MemoryPlan plan = ir::PlanMemory(step);
  MemoryNeed need;
  need.replicas = step.num_replicas;
  need.per_replica_state = plan.weight_bytes + plan.optimizer_state_bytes;
  need.per_replica_temporaries = plan.peak_temp_bytes;
  need.keeps_all_values = keeps_all_values;
  if (keeps_all_values) {
    need.per_replica_temporaries = 0;
    for (const ir::Instr& in : step.instrs)
      if (in.op != ir::OpCode::kVariable && in.op != ir::OpCode::kInput) need.per_replica_temporaries += in.type.bytes();
  }
  int64_t inputs = 0;
  for (ir::ValueId v : step.Inputs()) inputs += step.type(v).bytes();
  // The global batch, plus each replica's slice of it when there are several.
  need.batch_bytes = inputs * step.num_replicas * (step.num_replicas > 1 ? 2 : 1);
  return need;
}

void CheckMemory(const MemoryNeed& need, int64_t available, const std::string& hint) {
  if (available < 0 || need.total() <= available) return;
  std::string others;
  for (const auto& [what, bytes] : need.others) others += Str(", ", what, " ", Bytes(bytes));
  throw Error(Str("not enough memory: needs ", Bytes(need.total()), " (", need.replicas, " replica",
                  need.replicas == 1 ? "" : "s", " x ", Bytes(need.per_replica_state + need.per_replica_temporaries),
                  " [state ", Bytes(need.per_replica_state), " + ", need.keeps_all_values ? "all values " : "peak temporaries ",
                  Bytes(need.per_replica_temporaries),
                  "], batch buffers ", Bytes(need.batch_bytes), others, "), ",
                  Bytes(available), " available (MemAvailable in /proc/meminfo); ", hint));
}

}  // namespace shardstep::cli
