// Double-buffered batch preparation.
#include "runtime/batch_source.h"

namespace shardstep::runtime {

PrefetchingSource::PrefetchingSource(std::unique_ptr<BatchSource> inner) : PrefetchingSource(*inner) {
  owned_ = std::move(inner);
}

PrefetchingSource::PrefetchingSource(BatchSource& inner) : inner_(&inner) {
  epoch_ = inner_->epoch();
  position_ = inner_->position();
}

PrefetchingSource::~PrefetchingSource() {
  if (pending_.valid()) pending_.wait();  // the worker writes into next_ and reads inner_
}

void PrefetchingSource::Wait() {
  if (!pending_.valid()) return;
  std::future<void> f = std::move(pending_);
  f.get();  // an error preparing the batch surfaces in the Next that wanted it
}

void PrefetchingSource::Start() {
  ready_ = false;
  pending_ = std::async(std::launch::async, [this] {
    inner_->Next(&next_);
    next_epoch_ = inner_->epoch();
    next_position_ = inner_->position();
    ready_ = true;
  });
}

void PrefetchingSource::Next(TensorMap* inputs) {
  if (!pending_.valid() && !ready_) Start();  // the first call, or after a Seek
  Wait();
  std::swap(*inputs, next_);
  epoch_ = next_epoch_;
  position_ = next_position_;
  Start();  // overlaps the caller's step; reuses the caller's previous buffers
}

void PrefetchingSource::Seek(int64_t epoch, int64_t position) {
  Wait();  // the prepared batch (if any) is dropped: the inner source is repositioned
  ready_ = false;
  inner_->Seek(epoch, position);
  epoch_ = inner_->epoch();
  position_ = inner_->position();
}

}  // namespace shardstep::runtime
