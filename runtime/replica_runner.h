// Running one body per replica, each on its own thread, and turning the first failure into an error.
//
// Replica threads block (inside collectives they sleep on futexes), so n may far exceed the
// core count, e.g. 64 replicas on 2 cores. Work inside a replica may use oneTBB (parallel_for etc.): all
// replica threads share TBB's default arena. Call collectives only from the replica's own thread, never
// from inside a TBB task: a worker blocked in a collective would starve the arena.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "runtime/collectives.h"

namespace shardstep::runtime {

// Runs body(r) for r in [0, n), each on its own std::thread, and joins them all. If a replica throws,
// calls c->Abort("replica <r>: <message>") so replicas blocked in a collective wake up and throw too,
// then, after joining, throws shardstep::Error with that first failing replica's message (the secondary
// "aborted" errors of the others are dropped). `c` may be null when the body uses no collectives.
void RunReplicas(int n, Collectives* c, const std::function<void(int replica)>& body);

// The same, on n threads started once and parked between runs: replica r always runs on the same
// thread, so a training step starts no thread and its thread-local scratch (kernels' buffers, oneDNN's
// per-thread settings) survives from step to step. Run is not reentrant; the destructor joins.
// With at least as many replicas as CPUs the process may run on, replica r's thread stays on the
// (r mod count)-th of them (ReplicaCpus): every CPU is busy with replicas anyway, and the scheduler
// otherwise spent the first ~15 steps after each pause moving 8 threads between 2 cores (MLP N = 8:
// 5.4-6.0 ms steps falling to 4.4 over a 20-step block after a 150 ms pause; pinned, 4.5 from the
// second step). SHARDSTEP_PIN_REPLICAS=0 leaves the threads to the scheduler.
// The CPU each of n pool threads is pinned to, or none (fewer replicas than allowed CPUs, or
// SHARDSTEP_PIN_REPLICAS=0): the process's allowed CPUs (sched_getaffinity) taken in turn.
std::vector<int> ReplicaCpus(int n);

class ReplicaPool {
 public:
  explicit ReplicaPool(int n);
  ~ReplicaPool();
  ReplicaPool(const ReplicaPool&) = delete;
  ReplicaPool& operator=(const ReplicaPool&) = delete;

  int size() const { return static_cast<int>(threads_.size()); }
  // RunReplicas' semantics (first failure aborts `c` and is rethrown after every replica returned).
  void Run(Collectives* c, const std::function<void(int replica)>& body);

 private:
  void Worker(int r);

  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* body_ = nullptr;
  Collectives* collectives_ = nullptr;
  uint64_t generation_ = 0;  // bumped by every Run
  int running_ = 0;          // replicas of the current run not yet finished
  bool stop_ = false;
  std::optional<std::string> first_failure_;
  std::vector<std::thread> threads_;
};

}  // namespace shardstep::runtime
