// Checks that run before anything is built, allocated or trained: output paths are writable, the
// dataset files are there, and the run fits in the machine's available memory.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ir/module.h"

namespace shardstep::cli {

// Throws shardstep::Error "<flag> <path>: <why>" unless `path` could be written: it is not a
// directory, its directory exists, and a file can be created there (tried, then removed: this holds
// for root and read-only file systems too). Empty paths are skipped.
void CheckOutputPath(const std::string& flag, const std::string& path);
// Each (flag, path) pair, then that no two flags name the same file.
void CheckOutputPaths(const std::vector<std::pair<std::string, std::string>>& flag_paths);

// Throws shardstep::Error naming the missing or unreadable file of the Fashion-MNIST split, the flag
// that sets the directory and the package that provides the default one.
void CheckFashionMnistDir(const std::string& dir);

// Bytes the kernel could hand out now without swapping (MemAvailable in /proc/meminfo), or -1 when
// it cannot be read.
int64_t AvailableMemoryBytes();

// What a run holds in memory at once, per the IR memory plan.
struct MemoryNeed {
  int replicas = 1;
  int64_t per_replica_state = 0;       // weights + optimizer state, as one replica stores them
  int64_t per_replica_temporaries = 0; // peak live temporaries of one replica's step (or all its values)
  bool keeps_all_values = false;       // per_replica_temporaries counts every value, not the peak
  int64_t batch_bytes = 0;             // the global batch and the replicas' slices of it
  std::vector<std::pair<std::string, int64_t>> others;  // what else the run holds: (what, bytes)
  int64_t total() const {
    int64_t t = replicas * (per_replica_state + per_replica_temporaries) + batch_bytes;
    for (const auto& [what, bytes] : others) t += bytes;
    return t;
  }
};

// The need of running `step` (one replica's module; its num_replicas replicas in this process) on
// batches of its inputs; the caller adds what it holds besides to `others`. `keeps_all_values`: the
// backend holds every value of the step at once (the reference interpreter), not only the live ones.
MemoryNeed StepMemoryNeed(const ir::Module& step, bool keeps_all_values = false);

// Throws shardstep::Error "not enough memory: needs 212.4 GiB (4096 replicas x 53.1 MiB ...), 22.8 GiB
// available ..." when `need` exceeds `available` bytes (skipped when available < 0). `hint` ends the
// message (what to change).
void CheckMemory(const MemoryNeed& need, int64_t available, const std::string& hint);

// "53.1 MiB", "212.4 GiB".
std::string Bytes(int64_t b);

}  // namespace shardstep::cli
