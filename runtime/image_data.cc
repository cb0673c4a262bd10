// Image classification sources: Fashion-MNIST, synthetic, synthetic-imagenet.
#include "runtime/image_data.h"

#include <cstring>

#include "ir/error.h"

namespace shardstep::runtime {
namespace {

uint64_t Mix(uint64_t z) {  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void FillImageInputs(TensorMap* inputs, int64_t batch, const ir::Shape& example_shape, Tensor** images, Tensor** labels) {
  Tensor& x = (*inputs)["image"];
  Tensor& y = (*inputs)["label"];
  ir::Shape shape{batch};
  shape.insert(shape.end(), example_shape.begin(), example_shape.end());
  x.type = {ir::DType::kF32, std::move(shape)};
  x.f32.resize(x.type.elements());
  x.s32.clear();
  y.type = {ir::DType::kS32, {batch}};
  y.s32.resize(batch);
  y.f32.clear();
  *images = &x;
  *labels = &y;
}

class SyntheticImagenetSource : public BatchSource {
 public:
  SyntheticImagenetSource(int64_t batch, uint64_t seed, ir::Shape example_shape, int64_t classes)
      : batch_(batch), seed_(seed), example_shape_(std::move(example_shape)), classes_(classes) {}
  void Next(TensorMap* inputs) override {
    if (position_ + batch_ > kSyntheticImagenetTrainSize) epoch_++, position_ = 0;
    Tensor *x, *y;
    FillImageInputs(inputs, batch_, example_shape_, &x, &y);
    const int64_t elems = ir::NumElements(example_shape_);
    for (int64_t b = 0; b < batch_; ++b)
      SyntheticImageExample(seed_, epoch_ * kSyntheticImagenetTrainSize + position_ + b, elems, classes_,
                            x->f32.data() + b * elems, y->s32.data() + b);
    position_ += batch_;
  }
  int64_t epoch() const override { return epoch_; }
  int64_t position() const override { return position_; }
  void Seek(int64_t epoch, int64_t position) override {
    if (epoch < 0 || position < 0 || position > kSyntheticImagenetTrainSize)
      throw Error(Str("synthetic-imagenet: cannot seek to epoch ", epoch, " position ", position));
    epoch_ = epoch, position_ = position;
  }
  int64_t batches_per_epoch() const override { return kSyntheticImagenetTrainSize / batch_; }
  std::string Describe() const override {
    return Str("synthetic-imagenet train (random ", ir::ShapeToString(example_shape_), " images, ", classes_,
               " classes, generated per step)");
  }

 private:
  int64_t batch_;
  uint64_t seed_;
  ir::Shape example_shape_;
  int64_t classes_;
  int64_t epoch_ = 0, position_ = 0;
};

class SyntheticImagenetEval : public EvalSet {
 public:
  SyntheticImagenetEval(int64_t eval_batch, int64_t batches, uint64_t seed, ir::Shape example_shape, int64_t classes)
      : eval_batch_(eval_batch), batches_(batches), seed_(seed), example_shape_(std::move(example_shape)),
        classes_(classes) {}
  int64_t num_batches() const override { return batches_; }
  void Batch(int64_t i, TensorMap* inputs) const override {
    Tensor *x, *y;
    FillImageInputs(inputs, eval_batch_, example_shape_, &x, &y);
    const int64_t elems = ir::NumElements(example_shape_);
    for (int64_t b = 0; b < eval_batch_; ++b)  // a stream of its own: the negative indices
      SyntheticImageExample(seed_, -1 - (i * eval_batch_ + b), elems, classes_, x->f32.data() + b * elems,
                            y->s32.data() + b);
  }
  std::string Describe() const override {
    return Str("synthetic-imagenet eval (", batches_ * eval_batch_, " examples)");
  }

 private:
  int64_t eval_batch_, batches_;
  uint64_t seed_;
  ir::Shape example_shape_;
  int64_t classes_;
};

}  // namespace

void SyntheticImageExample(uint64_t seed, int64_t index, int64_t elements, int64_t classes, float* pixels, int32_t* label) {
  const uint64_t key = Mix(seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(index) + 0x632be59bd9b4e019ull);
  *label = static_cast<int32_t>(Mix(key) % static_cast<uint64_t>(classes));
  uint64_t state = key;
  for (int64_t k = 0; k < elements; ++k) {
    state += 0x9e3779b97f4a7c15ull;
    pixels[k] = static_cast<float>(Mix(state) >> 40) * 0x1p-24f;
  }
}

ImageBatchSource::ImageBatchSource(std::shared_ptr<const Dataset> data, int64_t batch, bool shuffle, uint64_t seed,
                                   ir::Shape example_shape, std::string name)
    : data_(std::move(data)), it_(*data_, batch, shuffle, seed, std::move(example_shape)), name_(std::move(name)) {}

void ImageBatchSource::Next(TensorMap* inputs) { it_.Next(&(*inputs)["image"], &(*inputs)["label"]); }

std::string ImageBatchSource::Describe() const { return Str(name_, " train (", data_->size(), " examples)"); }

ImageEvalSet::ImageEvalSet(std::shared_ptr<const Dataset> data, int64_t eval_batch, ir::Shape example_shape,
                           std::string name)
    : data_(std::move(data)), eval_batch_(eval_batch), name_(std::move(name)) {
  const int64_t n = data_->size();
  if (eval_batch < 1 || eval_batch > n)
    throw Error(Str("evaluation batch ", eval_batch, " is larger than the split (", n, ")"));
  if (n % eval_batch != 0)
    throw Error(Str("evaluation batch ", eval_batch, " does not divide the split (", n, " examples): the last ",
                    n % eval_batch, " would not be evaluated"));
  ir::Shape own(data_->images.shape().begin() + 1, data_->images.shape().end());
  example_elems_ = ir::NumElements(own);
  example_shape_ = example_shape.empty() ? own : std::move(example_shape);
  if (ir::NumElements(example_shape_) != example_elems_)
    throw Error(Str("evaluation: example shape ", ir::ShapeToString(example_shape_), " does not match the data's ",
                    ir::ShapeToString(own)));
}

void ImageEvalSet::Batch(int64_t i, TensorMap* inputs) const {
  if (i < 0 || i >= num_batches()) throw Error(Str("evaluation batch ", i, " out of range [0, ", num_batches(), ")"));
  Tensor *x, *y;
  FillImageInputs(inputs, eval_batch_, example_shape_, &x, &y);
  std::memcpy(x->f32.data(), data_->images.f32.data() + i * eval_batch_ * example_elems_,
              eval_batch_ * example_elems_ * sizeof(float));
  std::memcpy(y->s32.data(), data_->labels.s32.data() + i * eval_batch_, eval_batch_ * sizeof(int32_t));
}

std::string ImageEvalSet::Describe() const { return Str(name_, " test (", data_->size(), " examples)"); }

ImageData MakeImageData(const ImageDataOptions& o) {
  ImageData d;
  if (o.dataset == "synthetic-imagenet") {
    ir::Shape shape = o.example_shape.empty() ? ir::Shape{3, o.image_size, o.image_size} : o.example_shape;
    d.train = std::make_unique<SyntheticImagenetSource>(o.batch, o.seed, shape, o.classes);
    d.eval = std::make_unique<SyntheticImagenetEval>(o.eval_batch, o.max_eval_batches > 0 ? o.max_eval_batches : 2,
                                                     o.seed, shape, o.classes);
    return d;
  }
  std::shared_ptr<Dataset> train, test;
  if (o.dataset == "fashion-mnist") {
    train = std::make_shared<Dataset>(LoadFashionMnist(o.data_dir, true));
    test = std::make_shared<Dataset>(LoadFashionMnist(o.data_dir, false));
  } else if (o.dataset == "synthetic") {
    // One distribution, split into train and test: 1x28x28 images (Fashion-MNIST's), or the model's
    // own [C, H, W] when it takes another size (resnet20 --image-size 32) and that stays small; large
    // images are synthetic-imagenet's, made per batch.
    ir::Shape shape{1, 28, 28};
    if (o.example_shape.size() == 3 && ir::NumElements(o.example_shape) != 28 * 28) {
      if (ir::NumElements(o.example_shape) > kSyntheticMaxElements)
        throw Error(Str("--dataset synthetic holds its ", kSyntheticSize, " images in memory, up to ", kSyntheticMaxElements,
                        " values each; the model takes ", ir::ShapeToString(o.example_shape),
                        ": use --dataset synthetic-imagenet (images made per batch)"));
      shape = o.example_shape;
    }
    Dataset all = SyntheticClassification(kSyntheticSize, static_cast<int>(shape[0]), static_cast<int>(shape[1]),
                                          static_cast<int>(shape[2]), 10, o.seed);
    train = std::make_shared<Dataset>(TakeExamples(all, 0, kSyntheticTrainSize));
    test = std::make_shared<Dataset>(TakeExamples(all, kSyntheticTrainSize, kSyntheticSize));
  } else {
    throw Error(Str("--dataset ", o.dataset, " is not an image dataset (fashion-mnist, synthetic, synthetic-imagenet)"));
  }
  d.train = std::make_unique<ImageBatchSource>(train, o.batch, o.shuffle, o.seed, o.example_shape, o.dataset);
  d.eval = std::make_unique<ImageEvalSet>(test, o.eval_batch, o.example_shape, o.dataset);
  return d;
}

}  // namespace shardstep::runtime
