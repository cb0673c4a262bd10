// ChannelsLast (see channels_last.h).
//
// One pass in module order. Each 4-d value v that has an NHWC twin is recorded in nhwc[v]; its NCHW
// uses are redirected to a transpose of the twin (to_nchw[v]), which the final Canonicalize drops
// when nothing NCHW reads it. An op is rewritten when one of its operands has a twin:
//  - a convolution with >= 8 channels on both sides whose NHWC kernel oneDNN has (or any such
//    convolution: its first operand is then transposed once, as oneDNN's reorder did);
//  - an elementwise op of a 4-d shape: its other operands become NHWC too (a broadcast of a smaller
//    value is re-made with its dims remapped, a splat constant re-made in the new shape, anything else
//    transposed);
//  - a reduction whose kept dimensions keep their order, over the remapped axes;
//  - 2x2 stride-2 max pooling and its gradient (the CNN's), by the NHWC loops of jit/max_pool_2x2.h.
#include "jit/channels_last.h"

#include <algorithm>
#include <unordered_map>

#include "jit/dnnl_conv.h"
#include "jit/max_pool_2x2.h"
#include "jit/stem_conv.h"

namespace shardstep::jit {
namespace {

using ir::OpCode;
using ir::ValueId;

constexpr int kNhwcPos[4] = {0, 3, 1, 2};  // NCHW dimension d sits at NHWC position kNhwcPos[d]

ir::Shape Nhwc(const ir::Shape& s) { return {s[0], s[2], s[3], s[1]}; }

bool IsConv(OpCode op) {
  return op == OpCode::kConv2d || op == OpCode::kConv2dInputGrad || op == OpCode::kConv2dFilterGrad;
}

class Rewrite {
 public:
  explicit Rewrite(ir::Module& m) : m_(m) {}

  int Run() {
    const int n = m_.size();
    if (!ChannelsLastAllowed()) return 0;
    // A lone convolution pays in transposes at its edges what it saves in oneDNN's reorders (the CNN's
    // second, between two max poolings, made its step 2-4% slower NHWC while the poolings ran NCHW):
    // the rewrite needs a stack of at least two forward convolutions it can take, or one after a stem
    // when every max pooling runs NHWC too (then only the flattened features cross back, 1/4 of the
    // last convolution's output).
    int forward = 0, stems = 0;
    for (ValueId u = 0; u < n; ++u)
      if (m_.at(u).op == OpCode::kConv2d && Takes(u)) ++(Stem(u) ? stems : forward);
    bool pools = true;
    for (ValueId u = 0; u < n; ++u)
      if (m_.at(u).op == OpCode::kMaxPool || m_.at(u).op == OpCode::kMaxPoolGrad) pools &= PoolTakes(u);
    if (forward < 2 && !(forward == 1 && stems > 0 && pools)) return 0;
    int convs = 0;
    for (ValueId u = 0; u < n; ++u) place_.push_back(u);
    for (ValueId u = 0; u < n; ++u) {
      at_ = u;
      const ir::Instr& in = m_.at(u);
      if (IsConv(in.op)) convs += Conv(u);
      else if (in.op == OpCode::kMaxPool || in.op == OpCode::kMaxPoolGrad) Pool(u);
      else if (in.type.rank() == 4 && ir::HasProperty(in.op, ir::kElementwise)) Elementwise(u);
      else if (in.op == OpCode::kReduceSum || in.op == OpCode::kReduceMean || in.op == OpCode::kReduceMax) Reduction(u);
    }
    if (convs > 0) m_.Canonicalize(place_);
    return convs;
  }

 private:
  bool Has(ValueId v) const { return nhwc_.count(v) != 0; }

  // Appends an instruction made while rewriting op at_, to run where at_ ran: before the ops after it
  // (the optimizer's loops, which then still update the weights in place, PlanInPlaceUpdates).
  ValueId Add(ir::Instr in) {
    place_.push_back(at_);
    return m_.Append(std::move(in));
  }

  // Whether v's NHWC twin can be made without a transpose: it has one, or it is a splat, a broadcast of
  // a per-channel (or per-image) value, or an elementwise op of such values (batch norm's backward
  // scales: broadcast(k) * constant).
  bool Remakes(ValueId v, int depth = 0) {
    if (Has(v)) return true;
    const ir::Instr& in = m_.at(v);
    if (in.type.rank() != 4) return false;
    if (in.op == OpCode::kConstant) return in.Has("value");
    if (in.op == OpCode::kBroadcast) return BroadcastRemaps(in);
    if (!ir::HasProperty(in.op, ir::kElementwise) || depth > 8) return false;
    for (ValueId o : in.operands)
      if (!Remakes(o, depth + 1)) return false;
    return true;
  }

  // The NHWC twin of 4-d value v: recorded, or a broadcast, splat or elementwise op of them re-made, or a
  // transpose.
  ValueId ToNhwc(ValueId v) {
    if (auto it = nhwc_.find(v); it != nhwc_.end()) return it->second;
    const ir::Instr in = m_.at(v);  // a copy: Append may move the instructions
    ir::Instr t;
    if (in.op != OpCode::kBroadcast && in.op != OpCode::kConstant && ir::HasProperty(in.op, ir::kElementwise) &&
        Remakes(v)) {
      t = in;
      for (ValueId& o : t.operands) o = ToNhwc(o);
    } else if (in.op == OpCode::kBroadcast && BroadcastRemaps(in)) {
      t = in;
      ir::IntList dims = in.GetInts("dims");
      for (int64_t& d : dims) d = kNhwcPos[d];
      t.attrs["dims"] = dims;
      t.attrs["shape"] = ir::IntList(Nhwc(in.type.shape));
    } else if (in.op == OpCode::kConstant && in.Has("value")) {
      t = in;
    } else if (in.type.shape[1] == 1) {  // one channel (an image): the same bytes, no copy
      t.op = OpCode::kReshape;
      t.operands = {v};
      t.attrs["shape"] = ir::IntList(Nhwc(in.type.shape));
      t.type = in.type;
    } else {
      t.op = OpCode::kTranspose;
      t.operands = {v};
      t.attrs["perm"] = ir::IntList{0, 2, 3, 1};
      t.type = in.type;
    }
    t.attrs.erase("fusion");
    t.type.shape = Nhwc(in.type.shape);
    const ValueId w = Add(std::move(t));
    nhwc_[v] = w;
    return w;
  }

  // A broadcast whose dims stay increasing in NHWC (a per-channel [C] or per-image [N] or [N, C] value).
  static bool BroadcastRemaps(const ir::Instr& in) {
    const ir::IntList& dims = in.GetInts("dims");
    for (size_t i = 1; i < dims.size(); ++i)
      if (kNhwcPos[dims[i - 1]] >= kNhwcPos[dims[i]]) return false;
    return true;
  }

  // Replaces u (NCHW) by twin w (NHWC): u's readers read a transpose of w.
  void Adopt(ValueId u, ValueId w) {
    ir::Instr back;
    back.op = OpCode::kTranspose;
    back.operands = {w};
    back.attrs["perm"] = ir::IntList{0, 3, 1, 2};
    back.type = m_.at(u).type;
    const ValueId b = Add(std::move(back));
    m_.ReplaceAllUses(u, b);
    nhwc_[u] = w;
    nhwc_[b] = w;
  }

  // Whether convolution u has an NHWC kernel here: f32, >= 8 channels on both sides, and oneDNN takes it.
  bool Takes(ValueId u) const {
    const ir::Instr& in = m_.at(u);
    if (in.type.dtype != ir::DType::kF32) return false;
    for (ValueId o : in.operands)
      if (m_.type(o).dtype != ir::DType::kF32 || m_.type(o).rank() != 4) return false;
    // The NCHW sizes: (x, w) forward, (dx = result, w) input gradient, (x, dw = result) filter gradient.
    const ir::Shape& a = m_.type(in.operands[0]).shape;
    const ir::Shape& b = m_.type(in.operands[1]).shape;
    const ConvShape g = in.op == OpCode::kConv2d            ? ConvShapeOf(a, b, in)
                        : in.op == OpCode::kConv2dInputGrad ? ConvShapeOf(in.type.shape, b, in)
                                                            : ConvShapeOf(a, in.type.shape, in);
    const ConvKind kind = in.op == OpCode::kConv2d            ? ConvKind::kForward
                          : in.op == OpCode::kConv2dInputGrad ? ConvKind::kInputGrad
                                                              : ConvKind::kFilterGrad;
    const bool stem = kind != ConvKind::kInputGrad && StemConvNhwcApplies(g);
    return ((g.c % 8 == 0 && g.o % 8 == 0) || stem) && PlannedChannelsLastConv(kind, g) != nullptr;
  }
  // A network's first convolution, over one input channel (the stem loops' channels-last form).
  bool Stem(ValueId u) const { return m_.type(m_.at(u).operands[0]).shape[1] == 1; }

  int Conv(ValueId u) {
    if (!Takes(u)) return 0;
    const ir::Instr in = m_.at(u);
    ir::Instr c = in;
    c.attrs.erase("fusion");
    c.attrs[kNhwcAttr] = int64_t{1};
    c.operands[0] = ToNhwc(in.operands[0]);
    if (in.op == OpCode::kConv2dFilterGrad) c.operands[1] = ToNhwc(in.operands[1]);
    if (in.op == OpCode::kConv2dFilterGrad) {
      m_.ReplaceAllUses(u, Add(std::move(c)));
    } else {
      c.type.shape = Nhwc(in.type.shape);
      Adopt(u, Add(std::move(c)));
    }
    return 1;
  }

  // Whether max pooling (or its gradient) u has an NHWC loop here: f32, 2x2 windows with stride 2 and no
  // padding over even heights and widths (jit/max_pool_2x2.h), on AVX-512 or AVX2.
  bool PoolTakes(ValueId u) const {
    const ir::Instr& in = m_.at(u);
    const ir::Shape& x = m_.type(in.operands[0]).shape;
    if (in.type.dtype != ir::DType::kF32 || x.size() != 4 || !MaxPool2x2NhwcVectorised()) return false;
    for (ValueId o : in.operands)
      if (m_.type(o).dtype != ir::DType::kF32) return false;
    const ir::IntList& k = in.GetInts("window");
    const ir::IntList& s = in.Has("stride") ? in.GetInts("stride") : k;
    return k == ir::IntList{2, 2} && s == ir::IntList{2, 2} && in.GetInt("padding", 0) == 0 && x[2] % 2 == 0 &&
           x[3] % 2 == 0;
  }

  // Max pooling (x) or its gradient (x, dy) of an NHWC x runs NHWC; dy is transposed in if it comes NCHW.
  void Pool(ValueId u) {
    const ir::Instr in = m_.at(u);
    if (!Has(in.operands[0]) || !PoolTakes(u)) return;
    ir::Instr p = in;
    p.attrs.erase("fusion");
    p.attrs[kNhwcAttr] = int64_t{1};
    for (ValueId& o : p.operands) o = ToNhwc(o);
    p.type.shape = Nhwc(in.type.shape);
    Adopt(u, Add(std::move(p)));
  }

  void Elementwise(ValueId u) {
    const ir::Instr in = m_.at(u);
    bool any = false;
    for (ValueId o : in.operands) any |= Has(o);
    if (!any) return;
    ir::Instr e = in;
    e.attrs.erase("fusion");
    for (ValueId& o : e.operands) o = ToNhwc(o);
    e.type.shape = Nhwc(in.type.shape);
    Adopt(u, Add(std::move(e)));
  }

  void Reduction(ValueId u) {
    const ir::Instr in = m_.at(u);
    const ValueId x = in.operands[0];
    if (m_.type(x).rank() != 4 || !Has(x)) return;
    const ir::IntList& axes = in.GetInts("axes");
    int last = -1;  // the kept dimensions must keep their order
    for (int d = 0; d < 4; ++d) {
      if (std::find(axes.begin(), axes.end(), d) != axes.end()) continue;
      if (kNhwcPos[d] < last) return;
      last = kNhwcPos[d];
    }
    ir::Instr r = in;
    r.attrs.erase("fusion");
    ir::IntList mapped;
    for (int64_t d : axes) mapped.push_back(kNhwcPos[d]);
    std::sort(mapped.begin(), mapped.end());
    r.attrs["axes"] = mapped;
    r.operands[0] = nhwc_.at(x);
    m_.ReplaceAllUses(u, Add(std::move(r)));
  }

  ir::Module& m_;
  std::unordered_map<ValueId, ValueId> nhwc_;
  std::vector<ValueId> place_;  // per instruction: where it runs (Canonicalize)
  ValueId at_ = 0;              // the op being rewritten
};

}  // namespace

int ConvolutionsChannelsLast(ir::Module& m) { return Rewrite(m).Run(); }

}  // namespace shardstep::jit
