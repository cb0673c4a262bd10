// Tests for the IDX loader (real Fashion-MNIST and broken files), synthetic data and batching.
#include "runtime/dataset.h"
#include "runtime/image_data.h"

#include <stdlib.h>
#include <zlib.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <set>

#include "ir/error.h"
#include "tests/test_util.h"

using namespace shardstep;
using namespace shardstep::runtime;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {

using shardstep::testing::TempDir;

std::vector<uint8_t> Idx(uint32_t magic, std::vector<uint32_t> dims, std::vector<uint8_t> data) {
  std::vector<uint8_t> out;
  auto put = [&](uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<uint8_t>(v >> s));
  };
  put(magic);
  for (uint32_t d : dims) put(d);
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

void WriteRaw(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

void WriteGz(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f);
  REQUIRE(gzwrite(f, bytes.data(), bytes.size()) == static_cast<int>(bytes.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

std::vector<uint8_t> ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// Two tiny 2x3 images with pixels 0..11 scaled by 20, labels {7, 2}.
std::vector<uint8_t> TinyImages() {
  std::vector<uint8_t> px(12);
  for (int i = 0; i < 12; ++i) px[i] = static_cast<uint8_t>(i * 20);
  return Idx(0x803, {2, 2, 3}, px);
}
std::vector<uint8_t> TinyLabels() { return Idx(0x801, {2}, {7, 2}); }

// A dataset whose example i has label i and every pixel equal to i, to trace batches.
Dataset IndexDataset(int64_t n) {
  std::vector<float> px(n * 4);
  std::vector<int32_t> ys(n);
  for (int64_t i = 0; i < n; ++i) {
    ys[i] = static_cast<int32_t>(i);
    std::fill(px.begin() + i * 4, px.begin() + i * 4 + 4, static_cast<float>(i));
  }
  return {Tensor::F32({n, 1, 2, 2}, std::move(px)), Tensor::S32({n}, std::move(ys))};
}

std::vector<int32_t> Labels(BatchIterator& it) {
  Tensor x, y;
  it.Next(&x, &y);
  return y.s32;
}

}  // namespace

TEST_CASE("Fashion-MNIST train split loads with the published contents") {
  Dataset d = LoadFashionMnist(kFashionMnistDir, /*train=*/true);
  REQUIRE(d.size() == 60000);
  REQUIRE(d.images.type == (ir::TensorType{ir::DType::kF32, {60000, 1, 28, 28}}));
  REQUIRE(d.labels.type == (ir::TensorType{ir::DType::kS32, {60000}}));
  // Values read independently with Python's gzip module.
  REQUIRE(std::vector<int32_t>(d.labels.s32.begin(), d.labels.s32.begin() + 10) ==
          std::vector<int32_t>{9, 0, 0, 3, 0, 2, 7, 2, 5, 5});
  REQUIRE(std::vector<int32_t>(d.labels.s32.end() - 3, d.labels.s32.end()) == std::vector<int32_t>{3, 0, 5});
  std::vector<int> counts(10);
  for (int32_t y : d.labels.s32) counts.at(y)++;
  REQUIRE(counts == std::vector<int>(10, 6000));
  auto [lo, hi] = std::minmax_element(d.images.f32.begin(), d.images.f32.end());
  REQUIRE(*lo == 0.0f);
  REQUIRE(*hi == 1.0f);
  double first = std::accumulate(d.images.f32.begin(), d.images.f32.begin() + 784, 0.0);
  REQUIRE(first * 255 == Approx(76247).epsilon(1e-6));
  double all = std::accumulate(d.images.f32.begin(), d.images.f32.end(), 0.0);
  REQUIRE(all * 255 == Approx(3431114169.0).epsilon(1e-6));
}

TEST_CASE("Fashion-MNIST test split loads") {
  Dataset d = LoadFashionMnist(kFashionMnistDir, /*train=*/false);
  REQUIRE(d.size() == 10000);
  REQUIRE(std::vector<int32_t>(d.labels.s32.begin(), d.labels.s32.begin() + 10) ==
          std::vector<int32_t>{9, 2, 1, 1, 6, 1, 4, 6, 5, 7});
}

TEST_CASE("IDX files load gzipped or raw, with identical results") {
  TempDir dir;
  WriteRaw(dir / "img", TinyImages());
  WriteRaw(dir / "lbl", TinyLabels());
  WriteGz(dir / "img.gz", TinyImages());
  WriteGz(dir / "lbl.gz", TinyLabels());
  Dataset raw = LoadIdx(dir / "img", dir / "lbl");
  Dataset gz = LoadIdx(dir / "img.gz", dir / "lbl.gz");
  REQUIRE(raw.images.type == (ir::TensorType{ir::DType::kF32, {2, 1, 2, 3}}));
  REQUIRE(raw.labels.s32 == std::vector<int32_t>{7, 2});
  REQUIRE(raw.images.f32[0] == 0.0f);
  REQUIRE(raw.images.f32[11] == 220 / 255.0f);
  REQUIRE(raw.images == gz.images);
  REQUIRE(raw.labels == gz.labels);
}

TEST_CASE("LoadFashionMnist falls back to gunzipped files") {
  TempDir dir;
  WriteRaw(dir / "t10k-images-idx3-ubyte", TinyImages());
  WriteGz(dir / "t10k-labels-idx1-ubyte.gz", TinyLabels());
  REQUIRE(LoadFashionMnist(dir.path, false).size() == 2);
}

TEST_CASE("A truncated copy of the real gzip file is reported as truncated") {
  TempDir dir;
  std::vector<uint8_t> gz = ReadBytes(std::string(kFashionMnistDir) + "/train-images-idx3-ubyte.gz");
  gz.resize(200000);
  WriteRaw(dir / "train-images-idx3-ubyte.gz", gz);
  fs::copy(std::string(kFashionMnistDir) + "/train-labels-idx1-ubyte.gz", dir / "train-labels-idx1-ubyte.gz");
  REQUIRE_THROWS_WITH(LoadFashionMnist(dir.path, true),
                      Contains(dir / "train-images-idx3-ubyte.gz") &&
                          Contains("truncated: header says 60000 images of 28x28 (47040000 bytes), file holds"));
}

TEST_CASE("Broken IDX files give errors that name the file and the problem") {
  TempDir dir;
  const std::string img = dir / "img", lbl = dir / "lbl";
  WriteRaw(lbl, TinyLabels());

  SECTION("missing file") {
    WriteRaw(img, TinyImages());
    REQUIRE_THROWS_WITH(LoadIdx(dir / "nope.gz", lbl),
                        Contains("cannot open " + (dir / "nope.gz") + ": No such file or directory"));
  }
  SECTION("truncated pixel data") {
    std::vector<uint8_t> bytes = Idx(0x803, {3, 28, 28}, std::vector<uint8_t>(1000));
    WriteRaw(img, bytes);
    REQUIRE_THROWS_WITH(LoadIdx(img, lbl),
                        Contains(img + ": truncated: header says 3 images of 28x28 (2352 bytes), file holds 1000"));
  }
  SECTION("truncated header") {
    WriteRaw(img, {0, 0, 8, 3, 0, 0});
    REQUIRE_THROWS_WITH(LoadIdx(img, lbl), Contains(img + ": truncated") && Contains("16-byte IDX header"));
  }
  SECTION("empty file") {
    WriteRaw(img, {});
    REQUIRE_THROWS_WITH(LoadIdx(img, lbl), Contains(img + ": truncated"));
  }
  SECTION("bad magic: labels file given as images") {
    REQUIRE_THROWS_WITH(LoadIdx(lbl, lbl), Contains(lbl + ": bad magic 0x801, expected 0x803"));
  }
  SECTION("trailing bytes") {
    std::vector<uint8_t> bytes = TinyImages();
    bytes.push_back(0);
    WriteRaw(img, bytes);
    REQUIRE_THROWS_WITH(LoadIdx(img, lbl), Contains(img) && Contains("1 more bytes"));
  }
  SECTION("image and label counts differ") {
    WriteRaw(img, TinyImages());
    WriteRaw(lbl, Idx(0x801, {3}, {1, 2, 3}));
    REQUIRE_THROWS_WITH(LoadIdx(img, lbl), Contains(img + " holds 2 images but " + lbl + " holds 3 labels"));
  }
  SECTION("label out of range") {
    WriteRaw(img, TinyImages());
    WriteRaw(lbl, Idx(0x801, {2}, {1, 12}));
    REQUIRE_THROWS_WITH(LoadIdx(img, lbl), Contains(lbl + ": label 12 at index 1 is out of range [0, 10)"));
    REQUIRE(LoadIdx(img, lbl, 13).labels.s32 == std::vector<int32_t>{1, 12});
  }
  SECTION("zero-size images") {
    WriteRaw(img, Idx(0x803, {2, 0, 3}, {}));
    REQUIRE_THROWS_WITH(LoadIdx(img, lbl), Contains(img + ": dimension 1 is 0"));
  }
  SECTION("corrupt gzip stream") {
    std::vector<uint8_t> gz = ReadBytes(std::string(kFashionMnistDir) + "/t10k-labels-idx1-ubyte.gz");
    for (size_t i = 100; i < 200; ++i) gz[i] ^= 0x5a;
    WriteRaw(lbl, gz);
    WriteRaw(img, TinyImages());
    REQUIRE_THROWS_WITH(LoadIdx(img, lbl), Contains(lbl + ": corrupt gzip data: "));
  }
}

TEST_CASE("SyntheticClassification is deterministic and learnable") {
  Dataset a = SyntheticClassification(2000, 1, 8, 8, 5, 7);
  Dataset b = SyntheticClassification(2000, 1, 8, 8, 5, 7);
  Dataset c = SyntheticClassification(2000, 1, 8, 8, 5, 8);
  REQUIRE(a.images.type == (ir::TensorType{ir::DType::kF32, {2000, 1, 8, 8}}));
  REQUIRE(a.images == b.images);
  REQUIRE(a.labels == b.labels);
  REQUIRE_FALSE(a.images == c.images);
  REQUIRE(std::all_of(a.images.f32.begin(), a.images.f32.end(), [](float v) { return v >= 0 && v < 1; }));
  std::vector<int> counts(5);
  for (int32_t y : a.labels.s32) counts.at(y)++;
  for (int n : counts) REQUIRE(n > 300);

  // Learnable: class means from the first half classify the second half almost perfectly.
  std::vector<std::vector<double>> mean(5, std::vector<double>(64));
  for (int i = 0; i < 1000; ++i)
    for (int k = 0; k < 64; ++k) mean[a.labels.s32[i]][k] += a.images.f32[i * 64 + k];
  int correct = 0;
  for (int i = 1000; i < 2000; ++i) {
    int best = 0;
    double best_d = 1e300;
    for (int c2 = 0; c2 < 5; ++c2) {
      double n = std::count(a.labels.s32.begin(), a.labels.s32.begin() + 1000, c2), d = 0;
      for (int k = 0; k < 64; ++k) d += std::pow(a.images.f32[i * 64 + k] - mean[c2][k] / n, 2);
      if (d < best_d) best_d = d, best = c2;
    }
    correct += best == a.labels.s32[i];
  }
  REQUIRE(correct > 950);
}

TEST_CASE("BatchIterator without shuffle goes in file order and drops the last partial batch") {
  Dataset d = IndexDataset(10);
  BatchIterator it(d, 4, /*shuffle=*/false, 0);
  REQUIRE(it.batches_per_epoch() == 2);
  REQUIRE(Labels(it) == std::vector<int32_t>{0, 1, 2, 3});
  REQUIRE(it.epoch() == 0);
  Tensor x, y;
  it.Next(&x, &y);
  REQUIRE(y.s32 == std::vector<int32_t>{4, 5, 6, 7});
  REQUIRE(x.type == (ir::TensorType{ir::DType::kF32, {4, 1, 2, 2}}));
  REQUIRE(x.f32[0] == 4.0f);
  REQUIRE(x.f32[15] == 7.0f);
  REQUIRE(Labels(it) == std::vector<int32_t>{0, 1, 2, 3});  // 8, 9 dropped
  REQUIRE(it.epoch() == 1);
}

TEST_CASE("BatchIterator shuffles deterministically, a fresh permutation per epoch") {
  Dataset d = IndexDataset(100);
  auto epoch_order = [&](BatchIterator& it) {
    std::vector<int32_t> all;
    for (int b = 0; b < 10; ++b) {
      std::vector<int32_t> y = Labels(it);
      all.insert(all.end(), y.begin(), y.end());
    }
    return all;
  };
  BatchIterator a(d, 10, true, 42), b(d, 10, true, 42), c(d, 10, true, 43);
  std::vector<int32_t> a0 = epoch_order(a), a1 = epoch_order(a);
  REQUIRE(a.epoch() == 1);
  REQUIRE(epoch_order(b) == a0);
  REQUIRE(epoch_order(b) == a1);
  REQUIRE(epoch_order(c) != a0);
  REQUIRE(a0 != a1);
  std::vector<int32_t> identity(100);
  std::iota(identity.begin(), identity.end(), 0);
  REQUIRE(a0 != identity);
  for (auto order : {a0, a1}) {
    std::sort(order.begin(), order.end());
    REQUIRE(order == identity);
  }
  // Epoch e uses seed + e: epoch 1 of seed 42 is epoch 0 of seed 43.
  REQUIRE(a1 == epoch_order(*std::make_unique<BatchIterator>(d, 10, true, 43)));
  // Pinned (computed by an independent Python splitmix64 + Fisher-Yates) so the order never changes.
  REQUIRE(std::vector<int32_t>(a0.begin(), a0.begin() + 10) == std::vector<int32_t>{91, 99, 1, 14, 65, 55, 78, 70, 66, 9});
}

TEST_CASE("BatchIterator with a partial last batch: distinct examples each epoch") {
  Dataset d = IndexDataset(23);
  BatchIterator it(d, 5, true, 3);
  for (int epoch = 0; epoch < 3; ++epoch) {
    std::set<int32_t> seen;
    for (int b = 0; b < 4; ++b)
      for (int32_t y : Labels(it)) seen.insert(y);
    REQUIRE(it.epoch() == epoch);
    REQUIRE(seen.size() == 20);
  }
}

TEST_CASE("BatchIterator reshapes examples and rejects bad arguments") {
  Dataset d = IndexDataset(8);
  BatchIterator it(d, 2, false, 0, {4});
  Tensor x, y;
  it.Next(&x, &y);
  REQUIRE(x.type == (ir::TensorType{ir::DType::kF32, {2, 4}}));
  REQUIRE_THROWS_WITH(BatchIterator(d, 2, false, 0, {5}), Contains("example shape [5]") && Contains("[1,2,2]"));
  REQUIRE_THROWS_WITH(BatchIterator(d, 9, false, 0), Contains("batch size 9 must be in [1, 8]"));
  REQUIRE_THROWS_WITH(BatchIterator(d, 0, false, 0), Contains("batch size 0"));
}

TEST_CASE("ReshapeTensor keeps data and checks the element count") {
  Tensor t = ReshapeTensor(Tensor::F32({2, 1, 2}, {1, 2, 3, 4}), {4});
  REQUIRE(t.type == (ir::TensorType{ir::DType::kF32, {4}}));
  REQUIRE(t.f32 == std::vector<float>{1, 2, 3, 4});
  REQUIRE_THROWS_AS(ReshapeTensor(t, {3}), Error);
  REQUIRE_THROWS_WITH(ReshapeTensor(t, {3}), Contains("cannot reshape f32[4] to [3]"));
}

TEST_CASE("image sources: synthetic-imagenet is deterministic per example, whatever the batch size") {
  ImageDataOptions o;
  o.dataset = "synthetic-imagenet";
  o.image_size = 8;
  o.batch = 4;
  o.eval_batch = 3;
  o.seed = 5;
  ImageData a = MakeImageData(o);
  o.batch = 2;
  ImageData b = MakeImageData(o);
  TensorMap x, y1, y2;
  a.train->Next(&x);
  b.train->Next(&y1);
  b.train->Next(&y2);
  REQUIRE(x.at("image").shape() == ir::Shape{4, 3, 8, 8});
  REQUIRE(x.at("label").shape() == ir::Shape{4});
  const int64_t half = 2 * 3 * 8 * 8;
  CHECK(std::equal(y1.at("image").f32.begin(), y1.at("image").f32.end(), x.at("image").f32.begin()));
  CHECK(std::equal(y2.at("image").f32.begin(), y2.at("image").f32.end(), x.at("image").f32.begin() + half));
  CHECK(x.at("label").s32[2] == y2.at("label").s32[0]);
  for (float v : x.at("image").f32) REQUIRE((v >= 0 && v < 1));
  for (int32_t l : x.at("label").s32) REQUIRE((l >= 0 && l < 1000));
  CHECK(x.at("image").f32[0] != x.at("image").f32[1]);
  // Seek continues the stream; the evaluation set is the same at every call and differs from training.
  a.train->Seek(0, 2);
  a.train->Next(&y1);
  CHECK(std::equal(y1.at("image").f32.begin(), y1.at("image").f32.begin() + half, x.at("image").f32.begin() + half));
  CHECK(a.train->position() == 6);
  REQUIRE(a.eval->num_batches() == 2);
  TensorMap e1, e2;
  a.eval->Batch(1, &e1);
  a.eval->Batch(1, &e2);
  CHECK(e1.at("image").f32 == e2.at("image").f32);
  CHECK(e1.at("image").shape() == ir::Shape{3, 3, 8, 8});
  CHECK(e1.at("image").f32[0] != x.at("image").f32[0]);
}

TEST_CASE("image sources: Fashion-MNIST-style sets wrap BatchIterator; the eval batch must divide the split") {
  auto d = std::make_shared<Dataset>(SyntheticClassification(40, 1, 2, 2, 3, 1));
  ImageBatchSource s(d, 8, /*shuffle=*/true, 9, {4}, "tiny");
  BatchIterator it(*d, 8, true, 9, {4});
  TensorMap in;
  Tensor x, y;
  for (int i = 0; i < 7; ++i) {
    s.Next(&in);
    it.Next(&x, &y);
    REQUIRE(in.at("image").f32 == x.f32);
    REQUIRE(in.at("label").s32 == y.s32);
    CHECK(s.epoch() == it.epoch());
    CHECK(s.position() == it.position());
  }
  CHECK_THAT(s.Describe(), Contains("tiny train (40 examples)"));
  ImageEvalSet e(d, 10, {4}, "tiny");
  CHECK(e.num_batches() == 4);
  e.Batch(3, &in);
  CHECK(in.at("label").s32 == std::vector<int32_t>(d->labels.s32.begin() + 30, d->labels.s32.end()));
  CHECK_THROWS_WITH(ImageEvalSet(d, 12, {4}, "tiny"), Contains("does not divide the split (40 examples)"));
  ImageDataOptions o;
  o.dataset = "kjv";
  CHECK_THROWS_WITH(MakeImageData(o), Contains("not an image dataset"));
}

TEST_CASE("image sources: synthetic makes the model's small image size, and names synthetic-imagenet for large ones") {
  ImageDataOptions o;
  o.dataset = "synthetic";
  o.batch = 4;
  o.eval_batch = 1000;
  TensorMap x;
  o.example_shape = {784};  // the MLP's flattened Fashion-MNIST-sized examples
  MakeImageData(o).train->Next(&x);
  CHECK(x.at("image").shape() == ir::Shape{4, 784});
  o.example_shape = {1, 32, 32};  // resnet20 --image-size 32
  ImageData d = MakeImageData(o);
  d.train->Next(&x);
  CHECK(x.at("image").shape() == ir::Shape{4, 1, 32, 32});
  for (float v : x.at("image").f32) REQUIRE(std::isfinite(v));
  CHECK(d.eval->num_batches() == 2);
  o.example_shape = {3, 64, 64};
  CHECK_THROWS_WITH(MakeImageData(o), Contains("[3,64,64]") && Contains("synthetic-imagenet"));
}
