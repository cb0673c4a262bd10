// Training data: the IDX (MNIST / Fashion-MNIST) loader, a synthetic classification set, and a
// deterministic batch iterator.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ir/types.h"
#include "runtime/tensor.h"

namespace shardstep::runtime {

inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

struct Dataset {
  Tensor images;  // f32 [n, channels, h, w], pixels scaled to [0, 1]
  Tensor labels;  // s32 [n]
  int64_t size() const { return labels.shape().empty() ? 0 : labels.shape()[0]; }
};

// Loads an IDX image file (magic 0x00000803) and label file (magic 0x00000801), gzip-compressed or
// not. Validates magics, dimensions, exact byte counts, matching counts and labels < num_classes;
// every problem throws shardstep::Error naming the file.
Dataset LoadIdx(const std::string& images_path, const std::string& labels_path, int num_classes = 10);

// The Fashion-MNIST train (60000) or test (10000) split from `dir`.
Dataset LoadFashionMnist(const std::string& dir = kFashionMnistDir, bool train = true);
// The image and label files LoadFashionMnist reads for a split: "<dir>/train-images-idx3-ubyte.gz"
// (t10k- for the test split), or the gunzipped name when only that file exists.
std::vector<std::string> FashionMnistFiles(const std::string& dir, bool train);
// The Debian package that installs the Fashion-MNIST files into kFashionMnistDir.
inline constexpr const char* kFashionMnistPackage = "dataset-fashion-mnist";

// A deterministic, learnable set: each class has a fixed random mean image; an example is its
// class's mean plus uniform noise. Labels are uniform over [0, classes).
Dataset SyntheticClassification(int64_t n, int channels, int h, int w, int classes, uint64_t seed);

// Returns `t` with a new shape of the same element count (throws shardstep::Error otherwise).
Tensor ReshapeTensor(Tensor t, ir::Shape shape);

// Examples [begin, end) of `d` (e.g. to split one synthetic set into train and test).
Dataset TakeExamples(const Dataset& d, int64_t begin, int64_t end);

// Hands out fixed-size batches forever. With shuffle, epoch e visits the examples in the order of a
// Fisher-Yates shuffle driven by splitmix64(seed + e), so the order depends only on (seed, epoch),
// never on the standard library. Without shuffle, batches are in file order. The incomplete last
// batch of each epoch is dropped. The dataset must outlive the iterator.
class BatchIterator {
 public:
  // `example_shape` is the per-example image shape of the batches (e.g. {784} for an MLP); empty
  // keeps the dataset's own ({1, 28, 28}). Throws shardstep::Error on a bad batch size or shape.
  BatchIterator(const Dataset& data, int64_t batch, bool shuffle, uint64_t seed,
                ir::Shape example_shape = {});

  // Fills images (f32 [batch, example_shape...]) and labels (s32 [batch]); buffers are reused.
  void Next(Tensor* images, Tensor* labels);
  // Epoch of the batch most recently returned by Next (0 before the first call).
  int64_t epoch() const { return epoch_; }
  int64_t batches_per_epoch() const { return data_->size() / batch_; }
  // Examples of the current epoch's order already handed out; with epoch() the whole data-order state
  // (the order itself follows from the seed and the epoch), saved in periodic checkpoints.
  int64_t position() const { return pos_; }
  // Continues as an iterator that has reached (epoch, position) would (resume from a checkpoint).
  // Throws shardstep::Error when position is outside [0, dataset size] or epoch is negative.
  void Seek(int64_t epoch, int64_t position);

 private:
  void StartEpoch(int64_t epoch);

  const Dataset* data_;
  int64_t batch_;
  bool shuffle_;
  uint64_t seed_;
  ir::Shape example_shape_;
  int64_t example_elems_;
  std::vector<int64_t> order_;
  int64_t epoch_ = 0;
  int64_t pos_ = 0;
};

}  // namespace shardstep::runtime
