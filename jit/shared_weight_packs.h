// The packed weights that a process's in-process replicas share. Each replica multiplies its slice of
// the batch by the same weight (one copy for all: CpuExecutor's shared weights), X_r W with a few
// rows (SmallGemm's NN rule); SmallGemm copies W into column panels for every such product, so at
// N = 8 the weight was copied eight times a step. Here it is packed once a step, by the replicas that
// reach the product first, in chunks they take from a counter, and every replica's product reads the
// one packed copy (jit::ParallelSmallGemmPackedB: the bits of SmallGemm, so of the replica that packs
// its own).
//
// Why a step's packing holds for all its replicas: a weight the replicas share is read only before
// the rendezvous after which its all-gather (or the loop storing the replica's own slice) writes it
// (CompiledStep::GatheredVariableSlots), so every replica's product in a step sees the weight as the
// packer saw it; and a step starts only after every replica has finished the one before.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "ir/module.h"

namespace shardstep::jit {

class CompiledStep;

// One weight's packed form for C = A B with B [k, n] (row-major, rows n floats apart), made in each run
// by the threads that multiply by it then, read by all of them.
class SharedPackedB {
 public:
  SharedPackedB(int64_t n, int64_t k);  // allocates the packed copy
  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  int64_t bytes() const { return static_cast<int64_t>(packed_.size() * sizeof(float)); }
  // C[m, n] = A B in run number `run` of the calling thread (every thread that shares B counts the same
  // runs; in one run B does not change until every thread's call has returned): true when done with the
  // shared copy, false (nothing done) when this thread is behind the others or B is not the matrix they
  // packed in this run.
  bool Multiply(uint64_t run, int64_t m, const float* a, int64_t lda, const float* b, float* c);

 private:
  int64_t n_, k_, chunk_columns_;
  int chunks_;
  std::vector<float> packed_;
  // Chunks of columns the threads take from `next_`; `done_` counts the packed ones (a futex: a thread
  // that finds nothing left to take sleeps on it until the last chunk is in).
  std::mutex mu_;                  // guards run_ and source_, and the counters' reset for a new run
  uint64_t run_ = 0;               // the run whose packing packed_ holds (or is being made)
  const float* source_ = nullptr;  // the matrix packed in that run
  std::atomic<int> next_{0}, done_{0};
};

class SharedWeightPacks {
 public:
  // The products of `step` that read a weight of `shared_slots` (variable slots bound to one tensor for
  // all replicas) as B of a SmallGemm NN product. Allocates their packed copies now (none in a step).
  SharedWeightPacks(const CompiledStep& step, const std::vector<int>& shared_slots);
  ~SharedWeightPacks();

  int products() const { return static_cast<int>(entries_.size()); }
  int64_t bytes() const;  // the packed copies'

  // C = A B for instruction v in the replica's step number `run` (each replica counts its own steps;
  // they all run every step): true when v is one of these products and the call used the shared copy;
  // false (nothing done) when v is not, or this replica is behind the others (a step that failed on it
  // alone), or B is not the tensor the others packed -- the caller then computes it as usual.
  bool Multiply(ir::ValueId v, uint64_t run, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                const float* b, int64_t ldb, float* c);

 private:
  std::vector<int> entry_of_;  // per value: index into entries_, or -1
  std::vector<std::unique_ptr<SharedPackedB>> entries_;
};

}  // namespace shardstep::jit
