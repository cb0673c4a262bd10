// Image classification data behind the BatchSource/EvalSet interfaces (runtime/batch_source.h):
// Fashion-MNIST, the synthetic classification set, and "synthetic-imagenet" (random images and
// 1000-class labels generated on the fly, for throughput runs of ImageNet-sized models).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "ir/types.h"
#include "runtime/batch_source.h"
#include "runtime/dataset.h"

namespace shardstep::runtime {

// Training batches of a Dataset in BatchIterator's order: inputs "image" f32 [batch, example_shape...]
// and "label" s32 [batch]. Owns the dataset.
class ImageBatchSource : public BatchSource {
 public:
  ImageBatchSource(std::shared_ptr<const Dataset> data, int64_t batch, bool shuffle, uint64_t seed,
                   ir::Shape example_shape, std::string name);
  void Next(TensorMap* inputs) override;
  int64_t epoch() const override { return it_.epoch(); }
  int64_t position() const override { return it_.position(); }
  void Seek(int64_t epoch, int64_t position) override { it_.Seek(epoch, position); }
  int64_t batches_per_epoch() const override { return it_.batches_per_epoch(); }
  std::string Describe() const override;

 private:
  std::shared_ptr<const Dataset> data_;
  BatchIterator it_;
  std::string name_;
};

// The whole split in file order, `eval_batch` examples a batch. Throws shardstep::Error when
// eval_batch does not divide the split (no example is left out silently) or exceeds it.
class ImageEvalSet : public EvalSet {
 public:
  ImageEvalSet(std::shared_ptr<const Dataset> data, int64_t eval_batch, ir::Shape example_shape, std::string name);
  int64_t num_batches() const override { return data_->size() / eval_batch_; }
  void Batch(int64_t i, TensorMap* inputs) const override;
  std::string Describe() const override;

 private:
  std::shared_ptr<const Dataset> data_;
  int64_t eval_batch_;
  ir::Shape example_shape_;
  int64_t example_elems_;
  std::string name_;
};

// The value of every pixel and label of synthetic-imagenet example `index` depends only on (seed,
// index): batches are the same whatever the batch size or the order they are asked for in.
// Images are uniform in [0, 1), labels uniform over [0, classes).
void SyntheticImageExample(uint64_t seed, int64_t index, int64_t elements, int64_t classes, float* pixels, int32_t* label);

struct ImageDataOptions {
  std::string dataset = "fashion-mnist";  // fashion-mnist | synthetic | synthetic-imagenet
  std::string data_dir = kFashionMnistDir;
  int64_t batch = 64;
  int64_t eval_batch = 1000;
  uint64_t seed = 0;
  bool shuffle = true;
  ir::Shape example_shape;    // what the model's "image" takes per example ({} = the data's own)
  int64_t image_size = 224;   // synthetic-imagenet: images are [3, size, size]
  int64_t classes = 1000;     // synthetic-imagenet
  int64_t max_eval_batches = 0;  // synthetic-imagenet: evaluation batches (0 = 2)
};

struct ImageData {
  std::unique_ptr<BatchSource> train;
  std::unique_ptr<EvalSet> eval;
};

// Examples in each split, known before anything is loaded.
inline constexpr int64_t kFashionTrainSize = 60000, kFashionTestSize = 10000;
inline constexpr int64_t kSyntheticSize = 10000, kSyntheticTrainSize = 8000;
// --dataset synthetic: the most values per example it makes (else synthetic-imagenet's per-batch images).
inline constexpr int64_t kSyntheticMaxElements = 3 * 32 * 32;
inline constexpr int64_t kSyntheticImagenetTrainSize = 1281167;  // one "epoch", as ImageNet-1k's train split

ImageData MakeImageData(const ImageDataOptions& o);

}  // namespace shardstep::runtime
