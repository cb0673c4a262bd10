// ResNet-20 and ResNet-50 v1.5 in the DSL; names as the contract pins them (parity tests read them).
#include "models/resnet.h"

#include <string>

#include "ir/error.h"

namespace shardstep::models {
namespace {

dsl::BatchNormOptions Bn(const ModelOptions& o) {
  return dsl::BatchNormOptions().with_cross_replica(o.cross_replica_bn);
}

// conv (no bias) -> batch norm.
dsl::Tensor ConvBn(const dsl::Tensor& x, int64_t filters, int64_t kernel, int64_t stride, int64_t padding,
                   const std::string& conv, const std::string& bn, const ModelOptions& o) {
  return x.conv2d(filters, kernel, conv, stride, padding, /*bias=*/false).batch_norm(bn, Bn(o));
}

dsl::Tensor Loss(dsl::Model& m, const dsl::Tensor& logits, const dsl::Tensor& labels, const ModelOptions& o) {
  m.output("logits", logits);
  dsl::CrossEntropyOptions ce;
  ce.label_smoothing = o.label_smoothing;
  return logits.cross_entropy_mean(labels, ce);
}

void CheckImageOptions(const ModelOptions& o) {
  if (o.image_size < 0) throw Error(Str("--image-size ", o.image_size, " must be positive"));
  if (o.channels < 0) throw Error(Str("--channels ", o.channels, " must be positive"));
  if (o.classes < 1) throw Error(Str("--classes ", o.classes, " must be positive"));
}

}  // namespace

dsl::Tensor DefineResnet20(dsl::Model& m, const ModelOptions& o) {
  CheckImageOptions(o);
  const int64_t size = o.image_size > 0 ? o.image_size : 28, channels = o.channels > 0 ? o.channels : 1;
  auto x = m.input("image", dsl::f32({o.batch, channels, size, size}));
  auto y = m.input("label", dsl::s32({o.batch}));
  auto h = ConvBn(x, 16, 3, 1, 1, "conv1", "bn1", o).relu();
  const int64_t widths[] = {16, 32, 64};
  int64_t in = 16;
  for (int s = 1; s <= 3; ++s) {
    const int64_t f = widths[s - 1];
    for (int b = 0; b < 3; ++b) {
      const std::string n = "s" + std::to_string(s) + "b" + std::to_string(b);
      const int64_t stride = b == 0 && s > 1 ? 2 : 1;
      auto main = ConvBn(h, f, 3, stride, 1, n + ".conv1", n + ".bn1", o).relu();
      main = ConvBn(main, f, 3, 1, 1, n + ".conv2", n + ".bn2", o);
      auto shortcut = stride != 1 || in != f ? ConvBn(h, f, 1, stride, 0, n + ".proj", n + ".proj_bn", o) : h;
      h = (main + shortcut).relu();
      in = f;
    }
  }
  auto logits = h.global_avg_pool().dense(o.classes, "fc");
  return Loss(m, logits, y, o);
}

dsl::Tensor DefineResnet50(dsl::Model& m, const ModelOptions& o) {
  CheckImageOptions(o);
  const int64_t size = o.image_size > 0 ? o.image_size : 224, channels = o.channels > 0 ? o.channels : 3;
  auto x = m.input("image", dsl::f32({o.batch, channels, size, size}));
  auto y = m.input("label", dsl::s32({o.batch}));
  auto h = ConvBn(x, 64, 7, 2, 3, "conv1", "bn1", o).relu().max_pool(3, 2, 1);
  const int64_t widths[] = {64, 128, 256, 512}, blocks[] = {3, 4, 6, 3};
  int64_t in = 64;
  for (int s = 1; s <= 4; ++s) {
    const int64_t f = widths[s - 1], out = 4 * f;
    for (int b = 0; b < blocks[s - 1]; ++b) {
      const std::string n = "s" + std::to_string(s) + "b" + std::to_string(b);
      const int64_t stride = b == 0 && s > 1 ? 2 : 1;  // v1.5: the stride is on the 3x3
      auto main = ConvBn(h, f, 1, 1, 0, n + ".conv1", n + ".bn1", o).relu();
      main = ConvBn(main, f, 3, stride, 1, n + ".conv2", n + ".bn2", o).relu();
      main = ConvBn(main, out, 1, 1, 0, n + ".conv3", n + ".bn3", o);
      auto shortcut = stride != 1 || in != out ? ConvBn(h, out, 1, stride, 0, n + ".proj", n + ".proj_bn", o) : h;
      h = (main + shortcut).relu();
      in = out;
    }
  }
  auto logits = h.global_avg_pool().dense(o.classes, "fc");
  return Loss(m, logits, y, o);
}

}  // namespace shardstep::models
