// Where training and evaluation batches come from, for every task: a BatchSource hands out global
// training batches forever in a deterministic order; an EvalSet is a fixed list of evaluation batches.
// Each fills a TensorMap with exactly the model's inputs (names, dtypes and shapes of the task's
// contract in models/models.h), reusing the buffers already in the map.
#pragma once

#include <cstdint>
#include <string>

#include "runtime/interpreter.h"

namespace shardstep::runtime {

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // The next global batch (every input of the model, global batch size along dimension 0).
  virtual void Next(TensorMap* inputs) = 0;
  // Epoch of the batch most recently returned by Next (0 before the first call), and examples of
  // that epoch's order already handed out: together the whole data-order state a checkpoint saves.
  virtual int64_t epoch() const = 0;
  virtual int64_t position() const = 0;
  // Continues as a source that has reached (epoch, position) would. Throws shardstep::Error when out of range.
  virtual void Seek(int64_t epoch, int64_t position) = 0;
  virtual int64_t batches_per_epoch() const = 0;
  // One line for the run's header, e.g. "fashion-mnist train (60000 examples)".
  virtual std::string Describe() const = 0;
};

class EvalSet {
 public:
  virtual ~EvalSet() = default;
  virtual int64_t num_batches() const = 0;
  // Batch i (0 <= i < num_batches()) at the eval batch size; the same data every call.
  virtual void Batch(int64_t i, TensorMap* inputs) const = 0;
  virtual std::string Describe() const = 0;
};

}  // namespace shardstep::runtime

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

namespace shardstep::runtime {

// Prepares the next batch on another thread while the caller runs the step (double buffering). It
// hands out exactly the batches of the wrapped source in the same order, and epoch()/position()
// describe the batch last returned by Next (not the one being prepared), so checkpoints and Seek
// behave as without prefetching. Next's buffers are swapped with the prepared ones (no copy). One
// worker thread, created at the first Next and parked between batches (not a thread per batch), at
// idle priority: it uses the cores the step leaves idle instead of taking one from the step.
class PrefetchingSource : public BatchSource {
 public:
  explicit PrefetchingSource(std::unique_ptr<BatchSource> inner);
  // Borrows `inner`, which must outlive this object.
  explicit PrefetchingSource(BatchSource& inner);
  ~PrefetchingSource() override;
  void Next(TensorMap* inputs) override;
  int64_t epoch() const override { return epoch_; }
  int64_t position() const override { return position_; }
  void Seek(int64_t epoch, int64_t position) override;
  int64_t batches_per_epoch() const override { return inner_->batches_per_epoch(); }
  std::string Describe() const override { return inner_->Describe(); }

 private:
  void Wait();   // for the batch being prepared, if any (rethrows its error)
  void Start();  // prepares the next batch into next_
  void Work();   // the worker's loop

  std::unique_ptr<BatchSource> owned_;
  BatchSource* inner_;
  TensorMap next_;
  std::thread worker_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool requested_ = false;  // Start asked for a batch the worker has not taken yet
  bool busy_ = false;       // a batch is being prepared (requested or in progress)
  bool stop_ = false;
  std::exception_ptr error_;  // the last preparation's failure, rethrown by Wait
  bool ready_ = false;  // next_ holds a prepared batch
  int64_t next_epoch_ = 0, next_position_ = 0;
  int64_t epoch_ = 0, position_ = 0;
};

}  // namespace shardstep::runtime
