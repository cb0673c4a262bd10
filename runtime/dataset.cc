// IDX loading (gzip or raw, via zlib), synthetic data and deterministic batching.
#include "runtime/dataset.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>

#include "ir/error.h"
#include "runtime/splitmix64.h"

namespace shardstep::runtime {
namespace {

constexpr uint32_t kImagesMagic = 0x00000803;  // unsigned bytes, 3 dims
constexpr uint32_t kLabelsMagic = 0x00000801;  // unsigned bytes, 1 dim


// One IDX file: its dimensions and raw unsigned-byte payload.
struct IdxFile {
  std::vector<uint64_t> dims;
  std::vector<uint8_t> data;
};

class GzReader {
 public:
  explicit GzReader(const std::string& path) : path_(path) {
    errno = 0;
    f_ = gzopen(path.c_str(), "rb");  // reads uncompressed files transparently
    if (!f_) throw Error(Str("cannot open ", path, ": ", errno ? std::strerror(errno) : "out of memory"));
  }
  ~GzReader() { gzclose(f_); }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;

  // Reads up to n bytes; fewer only at the end of the data.
  size_t Read(uint8_t* buf, size_t n) {
    size_t got = 0;
    while (got < n) {
      unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - got, 1u << 30));
      int r = gzread(f_, buf + got, chunk);
      if (r < 0) {
        int code;
        std::string msg = gzerror(f_, &code);
        if (code == Z_ERRNO) throw Error(Str(path_, ": cannot read: ", std::strerror(errno)));
        if (msg.rfind(path_ + ": ", 0) == 0) msg.erase(0, path_.size() + 2);  // zlib prefixes the path
        throw Error(Str(path_, ": corrupt gzip data: ", msg));
      }
      if (r == 0) break;
      got += static_cast<size_t>(r);
    }
    return got;
  }

 private:
  std::string path_;
  gzFile f_;
};

uint32_t BigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// Reads an IDX file whose magic must be `magic`; `kind` ("images"/"labels") is for error messages.
IdxFile ReadIdx(const std::string& path, uint32_t magic, const char* kind) {
  const size_t ndims = magic & 0xff;
  GzReader in(path);
  uint8_t header[16];
  const size_t header_bytes = 4 + 4 * ndims;
  size_t got = in.Read(header, header_bytes);
  if (got >= 4 && BigEndian32(header) != magic) {
    throw Error(Str(path, ": bad magic 0x", std::hex, BigEndian32(header), ", expected 0x", magic,
                    std::dec, " (IDX ", kind, " file)"));
  }
  if (got < header_bytes) {
    throw Error(Str(path, ": truncated: file holds ", got, " bytes, too short for the ", header_bytes,
                    "-byte IDX header"));
  }
  IdxFile f;
  uint64_t total = 1;
  for (size_t i = 0; i < ndims; ++i) {
    uint64_t d = BigEndian32(header + 4 + 4 * i);
    if (d == 0 && i > 0) throw Error(Str(path, ": dimension ", i, " is 0"));
    f.dims.push_back(d);
    if (__builtin_mul_overflow(total, d, &total)) throw Error(Str(path, ": dimensions overflow"));
  }
  std::string what = ndims == 3 ? Str(f.dims[0], " images of ", f.dims[1], "x", f.dims[2])
                                : Str(f.dims[0], " labels");
  // Grow as we read, doubling from 64 KiB, so a lying header cannot make us allocate more than about
  // twice what the file holds (a fixed 16 MiB first chunk made every tiny corrupt file cost 16 MiB).
  constexpr uint64_t kFirstChunk = uint64_t{64} << 10;
  while (f.data.size() < total) {
    size_t old = f.data.size();
    size_t want = static_cast<size_t>(std::min<uint64_t>(total - old, std::max<uint64_t>(old, kFirstChunk)));
    f.data.resize(old + want);
    size_t n = in.Read(f.data.data() + old, want);
    if (n < want) {
      f.data.resize(old + n);
      throw Error(Str(path, ": truncated: header says ", what, " (", total, " bytes), file holds ",
                      f.data.size(), " bytes after the header"));
    }
  }
  uint8_t extra[4096];
  uint64_t trailing = 0;
  while (size_t n = in.Read(extra, sizeof(extra))) trailing += n;
  if (trailing) {
    throw Error(Str(path, ": header says ", what, " (", total, " bytes), but the file holds ", trailing,
                    " more bytes"));
  }
  return f;
}

}  // namespace

Dataset LoadIdx(const std::string& images_path, const std::string& labels_path, int num_classes) {
  if (num_classes < 1 || num_classes > 256) throw Error(Str("LoadIdx: num_classes ", num_classes, " not in [1, 256]"));
  IdxFile images = ReadIdx(images_path, kImagesMagic, "images");
  IdxFile labels = ReadIdx(labels_path, kLabelsMagic, "labels");
  const uint64_t n = images.dims[0];
  if (labels.dims[0] != n) {
    throw Error(Str(images_path, " holds ", n, " images but ", labels_path, " holds ", labels.dims[0],
                    " labels"));
  }
  if (n > INT32_MAX) throw Error(Str(images_path, ": too many images (", n, ")"));
  Dataset d;
  std::vector<float> pixels(images.data.size());
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = images.data[i] / 255.0f;
  d.images = Tensor::F32({static_cast<int64_t>(n), 1, static_cast<int64_t>(images.dims[1]),
                          static_cast<int64_t>(images.dims[2])},
                         std::move(pixels));
  std::vector<int32_t> ys(n);
  for (uint64_t i = 0; i < n; ++i) {
    ys[i] = labels.data[i];
    if (ys[i] >= num_classes) {
      throw Error(Str(labels_path, ": label ", ys[i], " at index ", i, " is out of range [0, ",
                      num_classes, ")"));
    }
  }
  d.labels = Tensor::S32({static_cast<int64_t>(n)}, std::move(ys));
  return d;
}

std::vector<std::string> FashionMnistFiles(const std::string& dir, bool train) {
  // Prefer the .gz files as distributed; fall back to gunzipped copies.
  auto path = [&](const char* name) {
    std::string p = dir + "/" + (train ? "train" : "t10k") + name;
    return !std::filesystem::exists(p + ".gz") && std::filesystem::exists(p) ? p : p + ".gz";
  };
  return {path("-images-idx3-ubyte"), path("-labels-idx1-ubyte")};
}

Dataset LoadFashionMnist(const std::string& dir, bool train) {
  const std::vector<std::string> files = FashionMnistFiles(dir, train);
  return LoadIdx(files[0], files[1], 10);
}

Dataset SyntheticClassification(int64_t n, int channels, int h, int w, int classes, uint64_t seed) {
  if (n < 0 || channels < 1 || h < 1 || w < 1 || classes < 1) {
    throw Error(Str("SyntheticClassification: bad arguments n=", n, " channels=", channels, " h=", h,
                    " w=", w, " classes=", classes));
  }
  const int64_t elems = int64_t{channels} * h * w;
  SplitMix64 rng(seed);
  std::vector<float> means(classes * elems);
  for (float& m : means) m = rng.UniformFloat();
  std::vector<float> pixels(n * elems);
  std::vector<int32_t> labels(n);
  for (int64_t i = 0; i < n; ++i) {
    labels[i] = static_cast<int32_t>(rng.Below(classes));
    const float* mean = &means[labels[i] * elems];
    for (int64_t k = 0; k < elems; ++k) pixels[i * elems + k] = 0.5f * mean[k] + 0.5f * rng.UniformFloat();
  }
  return {Tensor::F32({n, channels, h, w}, std::move(pixels)), Tensor::S32({n}, std::move(labels))};
}

Tensor ReshapeTensor(Tensor t, ir::Shape shape) {
  if (ir::NumElements(shape) != t.elements()) {
    throw Error(Str("cannot reshape ", t.type.ToString(), " to ", ir::ShapeToString(shape), ": ",
                    t.elements(), " vs ", ir::NumElements(shape), " elements"));
  }
  t.type.shape = std::move(shape);
  return t;
}

BatchIterator::BatchIterator(const Dataset& data, int64_t batch, bool shuffle, uint64_t seed,
                             ir::Shape example_shape)
    : data_(&data), batch_(batch), shuffle_(shuffle), seed_(seed) {
  const int64_t n = data.size();
  if (data.images.dtype() != ir::DType::kF32 || data.labels.dtype() != ir::DType::kS32 ||
      data.images.shape().empty() || data.images.shape()[0] != n) {
    throw Error(Str("BatchIterator: dataset must be f32 images [n,...] and s32 labels [n], got ",
                    data.images.type.ToString(), " and ", data.labels.type.ToString()));
  }
  if (batch < 1 || batch > n) {
    throw Error(Str("BatchIterator: batch size ", batch, " must be in [1, ", n, "] (dataset size)"));
  }
  ir::Shape own(data.images.shape().begin() + 1, data.images.shape().end());
  example_elems_ = ir::NumElements(own);
  example_shape_ = example_shape.empty() ? own : std::move(example_shape);
  if (ir::NumElements(example_shape_) != example_elems_) {
    throw Error(Str("BatchIterator: example shape ", ir::ShapeToString(example_shape_), " does not match ",
                    ir::ShapeToString(own), " (", example_elems_, " elements)"));
  }
  StartEpoch(0);
}

void BatchIterator::StartEpoch(int64_t epoch) {
  epoch_ = epoch;
  pos_ = 0;
  const int64_t n = data_->size();
  order_.resize(n);
  for (int64_t i = 0; i < n; ++i) order_[i] = i;
  if (!shuffle_) return;
  SplitMix64 rng(seed_ + static_cast<uint64_t>(epoch));
  for (int64_t i = n - 1; i > 0; --i) std::swap(order_[i], order_[rng.Below(i + 1)]);
}

void BatchIterator::Seek(int64_t epoch, int64_t position) {
  if (epoch < 0 || position < 0 || position > data_->size())
    throw Error(Str("BatchIterator: cannot seek to epoch ", epoch, " position ", position, " of a dataset of ",
                    data_->size()));
  StartEpoch(epoch);
  pos_ = position;
}

void BatchIterator::Next(Tensor* images, Tensor* labels) {
  if (pos_ + batch_ > data_->size()) StartEpoch(epoch_ + 1);  // drop the incomplete batch
  ir::Shape shape{batch_};
  shape.insert(shape.end(), example_shape_.begin(), example_shape_.end());
  images->type = {ir::DType::kF32, std::move(shape)};
  images->f32.resize(batch_ * example_elems_);
  images->s32.clear();
  labels->type = {ir::DType::kS32, {batch_}};
  labels->s32.resize(batch_);
  labels->f32.clear();
  for (int64_t b = 0; b < batch_; ++b) {
    const int64_t i = order_[pos_ + b];
    std::memcpy(&images->f32[b * example_elems_], &data_->images.f32[i * example_elems_],
                example_elems_ * sizeof(float));
    labels->s32[b] = data_->labels.s32[i];
  }
  pos_ += batch_;
}

}  // namespace shardstep::runtime

namespace shardstep::runtime {

Dataset TakeExamples(const Dataset& d, int64_t begin, int64_t end) {
  if (begin < 0 || end > d.size() || begin > end)
    throw Error(Str("TakeExamples: range [", begin, ",", end, ") outside a dataset of ", d.size()));
  const int64_t elems = d.images.elements() / std::max<int64_t>(d.size(), 1);
  ir::Shape shape = d.images.shape();
  shape[0] = end - begin;
  return {Tensor::F32(shape, std::vector<float>(d.images.f32.begin() + begin * elems, d.images.f32.begin() + end * elems)),
          Tensor::S32({end - begin}, std::vector<int32_t>(d.labels.s32.begin() + begin, d.labels.s32.begin() + end))};
}

}  // namespace shardstep::runtime
