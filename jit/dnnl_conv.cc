// Convolutions planned once per shape (see dnnl_conv.h).
//
// A oneDNN kernel is built for a block of a fixed number of images (plus one for the last, smaller
// block when the batch does not divide). Each block runs as a TBB task with one OpenMP thread: the
// primitives are created with one OpenMP thread too, since oneDNN fixes its work split when it builds
// a primitive. Each block's blocked operands and oneDNN's scratchpad (user mode: oneDNN allocates none)
// live in the calling thread's buffer, which only grows; the memory objects over them are made at the
// calling thread's first call, one set per block index, and re-pointed only when an operand's address
// changes (a planned step's buffers keep theirs, so a step allocates nothing here). With blocked
// layouts the weights are reordered once per call by the calling thread and read by every block (when
// the blocked weights carry no padding, which oneDNN would rewrite when a block binds them; else each
// block reorders them itself). On the Winograd path, each block checks its result for an inf or a NaN;
// if any block finds one, the call is computed again by the direct kernel (see dnnl_conv.h).
#include "jit/dnnl_conv.h"
#include "jit/dnnl_runtime.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <dnnl.hpp>
#include <map>
#include <mutex>
#include <unordered_map>
#include <atomic>
#include <vector>

#include "ir/error.h"
#include "jit/data_movement.h"
#include "jit/dnnl_kernels.h"
#include "jit/nhwc16_filter_grad.h"
#include "jit/stem_conv.h"
#include "jit/winograd_nhwc.h"

namespace shardstep::jit {
namespace {

using dnnl::memory;
using Tag = memory::format_tag;

const dnnl::engine& Engine() { return DnnlEngine(); }

constexpr int64_t kFilterGradGroups = 8;  // as Conv2dFilterGrad: the same blocks of images

// One argument of a block's convolution, as the step holds it (plain) and as the primitive reads it.
struct Arg {
  int id = 0;                 // DNNL_ARG_*
  bool shared = false;        // the weights of the forward pass / input gradient: one per call
  bool output = false;
  memory::desc user, prim;
  bool reordered = false;     // prim != user: a reorder (user -> prim, or prim -> user for the output)
  dnnl::reorder reorder;
};

// The primitives for blocks of `images` images.
struct Block {
  int64_t images = 0;
  dnnl::primitive conv;
  Arg args[3];                // a, b, out (see ConvKernel::Run)
  size_t scratch = 0;         // bytes: the largest scratchpad among the convolution and its reorders
  bool share_weights = false;
  // A block's slice of the Work buffer: the reordered operands at prim_offset[i], then the scratchpad.
  size_t prim_offset[3] = {0, 0, 0}, scratch_offset = 0, work_bytes = 0;
  memory::desc scratch_md;
};

}  // namespace

struct ConvKernel::Impl {
  uint64_t id = 0;            // unique per kernel: the key of the calling threads' memory objects
  int64_t per_block = 0;      // images per block
  std::vector<Block> blocks;  // [0]: per_block images; [1]: the remainder, when there is one
  std::string describe;
  std::shared_ptr<const ConvKernel> exact;  // Winograd: the direct kernel for a non-finite result
};

namespace {

// A oneDNN stream made by the calling thread (a TBB worker that runs a block then makes nothing).
struct Stream {
  dnnl_stream_t s = nullptr;
  Stream() {
    const dnnl_status_t st = dnnl_stream_create(&s, DnnlEngine().get(), dnnl_stream_default_flags);
    SS_CHECK(st == dnnl_success, "oneDNN stream creation failed with status ", static_cast<int>(st));
  }
  Stream(const Stream&) = delete;
  Stream(Stream&& o) noexcept : s(o.s) { o.s = nullptr; }
  ~Stream() {
    if (s) dnnl_stream_destroy(s);
  }
};

// The memory objects of one block index: the operands as the step holds them and as the primitive
// reads them, and the scratchpad; and the block's stream.
struct BlockMems {
  BoundDnnlMem user[3], prim[3], scratch;
  Stream stream;
};
// The reorder of the shared weights, per block kind.
struct WeightMems {
  BoundDnnlMem from, to, scratch;
};
struct KernelMems {
  std::vector<BlockMems> blocks;  // per block index of a call
  WeightMems weights[2];
};

// Per calling (replica) thread and kernel, made at the thread's first call of the kernel; the TBB
// tasks of one call each use their own block index's objects.
KernelMems& MemsOf(uint64_t kernel_id, int64_t nblocks) {
  thread_local std::unordered_map<uint64_t, KernelMems> mems;
  KernelMems& k = mems[kernel_id];
  if (static_cast<int64_t>(k.blocks.size()) < nblocks) k.blocks.resize(nblocks);
  return k;
}

// Per calling (replica) thread, grown only, 64-byte aligned: every block's blocked operands and
// scratchpad (Work: a slice per block, so TBB workers keep no state and a step after the first grows
// nothing), and the reordered weights (Weights).
char* Grown(std::vector<char>& v, size_t bytes) {
  if (v.size() < bytes + 64) v.resize(bytes + 64);
  const uintptr_t p = reinterpret_cast<uintptr_t>(v.data());
  return v.data() + (64 - p % 64) % 64;
}
char* Work(size_t bytes) {
  thread_local std::vector<char> v;
  return Grown(v, bytes);
}
char* Weights(size_t bytes) {
  thread_local std::vector<char> v;
  return Grown(v, bytes);
}


void Execute(const dnnl::primitive& p, std::initializer_list<dnnl_exec_arg_t> args, dnnl_stream_t stream) {
  DnnlExecute(p.get(), static_cast<int>(args.size()), args.begin(), "convolution", stream);
}

void Reorder(const Arg& a, dnnl_memory_t from, dnnl_memory_t to, dnnl_memory_t scratch, dnnl_stream_t stream) {
  Execute(a.reorder, {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}, {DNNL_ARG_SCRATCHPAD, scratch}}, stream);
}

// Sets the OpenMP threads of the calling thread for the scope (primitives are built with one).
struct OneOmpThread {
  int before = OmpMaxThreads();
  OneOmpThread() { SetOmpThreads(1); }
  ~OneOmpThread() {
    if (before > 0) SetOmpThreads(before);
  }
};

memory::desc Md(memory::dims d, Tag t) { return memory::desc(d, memory::data_type::f32, t); }

// `user`: the layout of the step's activations (nchw, or nhwc on the channels-last path, where the
// primitive takes them as they are).
Block MakeBlock(ConvKind kind, const ConvShape& g, int64_t images, bool blocked, dnnl::algorithm alg,
                Tag user = Tag::nchw) {
  const memory::dims x{images, g.c, g.h, g.w}, w{g.o, g.c, g.kh, g.kw}, y{images, g.o, g.oh, g.ow};
  const memory::dims strides{g.sh, g.sw}, pad{g.ph, g.pw};
  // With exactly 16 channels in and out, NHWC is oneDNN's nChw16c byte for byte, whose direct avx512_core
  // kernels beat the brgemm ones it picks for nhwc (resnet20's 16-channel forward pass, ONEDNN_VERBOSE:
  // 24.6 -> 18-19 ms of thread time per step). Not without avx512_core: oneDNN's AVX2 kernels block
  // channels in 8s, and nChw16c there is its reference loop (0.4-1.7 s a call on resnet20's shapes).
  if (user == Tag::nhwc && g.c == 16 && g.o == 16 && OnednnAvx512Core()) user = Tag::nChw16c;
  const Tag act = user != Tag::nchw ? user : blocked ? Tag::any : Tag::nchw, wt = blocked ? Tag::any : Tag::oihw;
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::convolution_forward::primitive_desc fwd(
      dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, alg, Md(x, act), Md(w, wt), Md(y, act), strides,
                                      pad, pad),
      attr, Engine());
  Block b;
  b.images = images;
  dnnl::primitive_desc_base pd = fwd;
  auto arg = [](int id, memory::desc user, memory::desc prim, bool shared, bool output) {
    Arg a;
    a.id = id;
    a.user = user;
    a.prim = prim;
    a.shared = shared;
    a.output = output;
    a.reordered = user != prim;
    return a;
  };
  if (kind == ConvKind::kForward) {
    b.conv = dnnl::convolution_forward(fwd);
    b.args[0] = arg(DNNL_ARG_SRC, Md(x, user), fwd.src_desc(), false, false);
    b.args[1] = arg(DNNL_ARG_WEIGHTS, Md(w, Tag::oihw), fwd.weights_desc(), true, false);
    b.args[2] = arg(DNNL_ARG_DST, Md(y, user), fwd.dst_desc(), false, true);
  } else if (kind == ConvKind::kInputGrad) {
    const dnnl::convolution_backward_data::primitive_desc bwd(
        dnnl::convolution_backward_data::desc(alg, Md(x, act), Md(w, wt), Md(y, act), strides, pad, pad), attr, Engine(),
        fwd);
    pd = bwd;
    b.conv = dnnl::convolution_backward_data(bwd);
    b.args[0] = arg(DNNL_ARG_DIFF_DST, Md(y, user), bwd.diff_dst_desc(), false, false);
    b.args[1] = arg(DNNL_ARG_WEIGHTS, Md(w, Tag::oihw), bwd.weights_desc(), true, false);
    b.args[2] = arg(DNNL_ARG_DIFF_SRC, Md(x, user), bwd.diff_src_desc(), false, true);
  } else {
    const dnnl::convolution_backward_weights::primitive_desc bwd(
        dnnl::convolution_backward_weights::desc(alg, Md(x, act), Md(w, wt), Md(y, act), strides, pad, pad), attr,
        Engine(), fwd);
    pd = bwd;
    b.conv = dnnl::convolution_backward_weights(bwd);
    b.args[0] = arg(DNNL_ARG_SRC, Md(x, user), bwd.src_desc(), false, false);
    b.args[1] = arg(DNNL_ARG_DIFF_DST, Md(y, user), bwd.diff_dst_desc(), false, false);
    b.args[2] = arg(DNNL_ARG_DIFF_WEIGHTS, Md(w, Tag::oihw), bwd.diff_weights_desc(), false, true);
  }
  b.scratch = pd.scratchpad_desc().get_size();
  for (Arg& a : b.args) {
    if (!a.reordered) continue;
    const dnnl::reorder::primitive_desc r = a.output ? dnnl::reorder::primitive_desc(Engine(), a.prim, Engine(), a.user, attr)
                                                     : dnnl::reorder::primitive_desc(Engine(), a.user, Engine(), a.prim, attr);
    a.reorder = dnnl::reorder(r);
    b.scratch = std::max(b.scratch, r.scratchpad_desc().get_size());
  }
  // Blocked weights padded past O or C would be re-zeroed by oneDNN whenever a block binds them.
  const Arg& wa = b.args[1];
  b.share_weights = wa.shared && wa.reordered && wa.prim.get_size() == wa.user.get_size();
  auto round = [](size_t bytes) { return (bytes + 63) / 64 * 64; };
  for (int i = 0; i < 3; ++i) {
    b.prim_offset[i] = b.work_bytes;
    if (b.args[i].reordered && !(b.args[i].shared && b.share_weights)) b.work_bytes += round(b.args[i].prim.get_size());
  }
  b.scratch_offset = b.work_bytes;
  b.work_bytes += round(std::max<size_t>(b.scratch, 1));
  b.scratch_md = memory::desc({static_cast<memory::dim>(std::max<size_t>(b.scratch, 1))}, memory::data_type::u8, Tag::x);
  return b;
}

int64_t ImagesPerBlock(ConvKind kind, const ConvShape& g) {
  if (kind == ConvKind::kFilterGrad) return (g.n + kFilterGradGroups - 1) / kFilterGradGroups;
  return std::min(kConvChunk, g.n);
}

}  // namespace

const char* ConvPathName(ConvPath p) {
  switch (p) {
    case ConvPath::kIm2col: return "im2col+sgemm";
    case ConvPath::kDnnlPlain: return "onednn-plain";
    case ConvPath::kDnnlBlocked: return "onednn-blocked";
    case ConvPath::kDnnlWinograd: return "onednn-winograd";
    case ConvPath::kStem: return "stem-avx512";
    case ConvPath::kDnnlChannelsLast: return "onednn-nhwc";
  }
  return "?";
}

namespace {
// bench/conv on resnet20's shapes (AVX-512; blocks of 8 images, or the filter gradient's 8 groups, one
// thread each): oneDNN's Winograd F(4x4, 3x3) kernels beat its direct ones on 3x3 stride-1
// convolutions with 32 or more channels when the output tiles exactly in 4x4 (CIFAR's 32x32 and
// 16x16: 0.45-0.7x the direct time in all three passes); with partial tiles (Fashion-MNIST's 14x14 and
// 7x7) only in the filter gradient (0.6-0.8x), where the direct kernels are slowest. With 16 channels
// they gain nothing. Not for a forward pass whose equal patches must give equal outputs. That was an
// AMD CPU (AVX-512, AVX512-BF16). On an Intel CPU with AMX, oneDNN's direct avx512_core kernels won
// every Winograd-eligible resnet20 shape at 28x28 and 32x32 (0.78-0.96x of Winograd's time, one tie;
// bench/conv), and the CNN's step was 20.1-20.3 -> 18.4-18.8 ms without it: no Winograd there.
bool WinogradFaster(ConvKind kind, const ConvShape& g, ConvTies ties, bool winograd_cpu) {
  if (!winograd_cpu) return false;
  if (g.kh != 3 || g.kw != 3 || g.sh != 1 || g.sw != 1 || g.ph != 1 || g.pw != 1) return false;
  if (g.c % 16 != 0 || g.o % 16 != 0 || g.c < 32) return false;
  if (kind == ConvKind::kForward && ties == ConvTies::kExact) return false;
  return kind == ConvKind::kFilterGrad || (g.oh % 4 == 0 && g.ow % 4 == 0);
}
}  // namespace

// oneDNN 2.6 has Winograd kernels only for avx512_core.
bool WinogradCpu() { return OnednnAvx512Core() && !CpuHasAmx(); }  // see WinogradFaster

namespace {
// Whether a channels-last input gradient runs as the forward pass of the turned filter (RunTurned):
// bench/conv, 16 -> 16 channels at 28x28, batch 128: the input-gradient kernel 2.08 ms, the forward
// one on the same multiplies 1.57 ms.
// With the Winograd loops (jit/winograd_nhwc.h) the turned forward pass takes them: every shape they
// take (bench/conv).
ConvShape TurnedShape(const ConvShape& g) {  // the forward convolution of the output gradient
  ConvShape f = g;
  std::swap(f.c, f.o);
  std::swap(f.h, f.oh);
  std::swap(f.w, f.ow);
  return f;
}
bool TurnedInputGradPays(const ConvShape& g) {
  if (WinogradAllowed() && WinogradNhwcApplies(TurnedShape(g))) return true;
  return g.c == 16 && g.o == 16 && g.kh == 3 && g.kw == 3 && g.sh == 1 && g.sw == 1 && g.ph == 1 && g.pw == 1 &&
         g.oh == g.h && g.ow == g.w;
}
}  // namespace

ConvPath PreferredConvPath(ConvKind kind, const ConvShape& g, ConvTies ties, bool winograd_cpu) {
  // bench/conv on resnet20's shapes (AVX2): oneDNN's direct kernels on blocked layouts (channels in
  // blocks of 8), reorders included, beat im2col for the 3x3 convolutions with 16-64 channels; with
  // one input channel (the stem) the blocks are mostly padding and im2col wins 4-6x; a 1x1 convolution
  // is one sgemm per image already, and oneDNN's 1x1 kernels with the reorders were no faster. oneDNN
  // on plain NCHW (its gemm convolution) was slower than im2col on most shapes.
  if (g.n == 0 || g.k() == 0 || g.p() == 0) return ConvPath::kIm2col;
  // One input channel, 3x3, stride 1 (a grey image's first convolution): bench/conv on an Intel CPU
  // with AVX-512 (AMX), batch 128 at 28x28, 16 and 32 output channels: the stem loops take 0.55-0.83x
  // im2col's time forward and 0.69-0.96x in the filter gradient (both near the memory bound: the
  // output or its gradient is 6-13 MB); oneDNN's blocked kernels 1.2-1.9x.
  if (kind != ConvKind::kInputGrad && StemConvApplies(g)) return ConvPath::kStem;
  if (WinogradFaster(kind, g, ties, winograd_cpu)) return ConvPath::kDnnlWinograd;
  return g.kh * g.kw > 1 && g.c % 8 == 0 && g.o % 8 == 0 ? ConvPath::kDnnlBlocked : ConvPath::kIm2col;
}

namespace {
const std::string& ConvChoice() {  // SHARDSTEP_CONV, read once per process
  static const std::string choice = [] {
    const char* e = std::getenv("SHARDSTEP_CONV");
    std::string v = e ? e : "";
    if (!v.empty() && v != "im2col" && v != "direct")
      throw Error(Str("SHARDSTEP_CONV: '", v, "' is neither 'im2col' nor 'direct'"));
    return v;
  }();
  return choice;
}
}  // namespace

bool ChannelsLastAllowed() { return ConvChoice() != "im2col"; }

// Our loops pay where oneDNN's Winograd does (AVX-512 without AMX) and on AVX2 CPUs, where oneDNN's
// direct kernels run resnet20's convolutions at 55-75% of the FMA peak (bench/conv on an AMD Zen 3).
bool WinogradAllowed() {
  return (WinogradCpu() || !OnednnAvx512Core()) && ConvChoice() != "direct" && ConvChoice() != "im2col";
}

ConvPath ChooseConvPath(ConvKind kind, const ConvShape& g, ConvTies ties) {
  const std::string& choice = ConvChoice();
  if (choice == "im2col") return ConvPath::kIm2col;
  const ConvPath p = PreferredConvPath(kind, g, ties, WinogradCpu());
  return choice == "direct" && p == ConvPath::kDnnlWinograd ? ConvPath::kDnnlBlocked : p;
}

std::shared_ptr<const ConvKernel> PlannedConv(ConvKind kind, const ConvShape& g, ConvTies ties) {
  using Key = std::array<int64_t, 15>;
  static std::mutex mu;
  static std::map<Key, std::shared_ptr<const ConvKernel>> cache;
  ConvPath path = ChooseConvPath(kind, g, ties);
  const Key key{static_cast<int64_t>(kind), g.n, g.c, g.h, g.w, g.o, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.oh, g.ow,
                static_cast<int64_t>(path)};
  std::lock_guard<std::mutex> lock(mu);
  auto& k = cache[key];
  while (!k) {
    try {
      k = std::make_shared<const ConvKernel>(kind, g, path);
    } catch (const Error&) {  // a shape oneDNN does not take: the next path computes it
      path = path == ConvPath::kDnnlWinograd ? ConvPath::kDnnlBlocked : ConvPath::kIm2col;
    }
  }
  return k;
}

std::shared_ptr<const ConvKernel> PlannedChannelsLastConv(ConvKind kind, const ConvShape& g, ConvTies ties) {
  using Key = std::array<int64_t, 15>;
  static std::mutex mu;
  static std::map<Key, std::shared_ptr<const ConvKernel>> cache;
  const Key key{static_cast<int64_t>(kind), g.n, g.c, g.h, g.w, g.o, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.oh, g.ow,
                static_cast<int64_t>(ties)};
  std::lock_guard<std::mutex> lock(mu);
  auto [it, fresh] = cache.emplace(key, nullptr);
  if (fresh) {
    try {
      it->second = std::make_shared<const ConvKernel>(kind, g, ConvPath::kDnnlChannelsLast, ties);
    } catch (const Error&) {  // no such kernel: the caller keeps the convolution NCHW
    }
  }
  return it->second;
}

ConvKernel::ConvKernel(ConvKind kind, const ConvShape& g, ConvPath path, ConvTies ties)
    : kind_(kind), g_(g), path_(path) {
  if (path == ConvPath::kIm2col) return;
  if (path == ConvPath::kStem) {
    if (kind == ConvKind::kInputGrad || !StemConvApplies(g))
      throw Error(Str("the stem loops take one input channel, a 3x3 filter, stride 1 and padding 1 (forward and "
                      "filter gradient, AVX-512), not input ", g.n, "x", g.c, "x", g.h, "x", g.w, ", filter ", g.o,
                      "x", g.c, "x", g.kh, "x", g.kw));
    return;
  }
  if (path == ConvPath::kDnnlChannelsLast && kind != ConvKind::kInputGrad && StemConvNhwcApplies(g)) {
    stem_nhwc_ = true;
    return;
  }
  if (path == ConvPath::kDnnlChannelsLast && kind == ConvKind::kFilterGrad && Nhwc16FilterGradApplies(g)) {
    nhwc16_filter_grad_ = true;
    return;
  }
  static std::atomic<uint64_t> next_id{1};
  auto impl = std::make_shared<Impl>();
  impl->id = next_id++;
  impl->per_block = ImagesPerBlock(kind, g);
  const OneOmpThread one;
  const bool blocked = path != ConvPath::kDnnlPlain;
  const auto alg = path == ConvPath::kDnnlWinograd ? dnnl::algorithm::convolution_winograd
                                                   : dnnl::algorithm::convolution_direct;
  const Tag user = path == ConvPath::kDnnlChannelsLast ? Tag::nhwc : Tag::nchw;
  try {
    impl->blocks.push_back(MakeBlock(kind, g, impl->per_block, blocked, alg, user));
    const int64_t rest = g.n % impl->per_block;
    if (rest) impl->blocks.push_back(MakeBlock(kind, g, rest, blocked, alg, user));
  } catch (const dnnl::error& e) {
    throw Error(Str("oneDNN has no convolution for input ", g.n, "x", g.c, "x", g.h, "x", g.w, ", filter ", g.o, "x", g.c,
                    "x", g.kh, "x", g.kw, ": ", e.what()));
  }
  const_dnnl_primitive_desc_t pd = impl->blocks[0].conv.get_primitive_desc();
  const char* name = nullptr;
  dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &name);
  impl->describe = Str(ConvPathName(path), " ", name ? name : "?", impl->blocks[0].share_weights ? " (shared weights)" : "");
  if (path == ConvPath::kDnnlWinograd) impl->exact = std::make_shared<const ConvKernel>(kind, g, ConvPath::kDnnlBlocked);
  impl_ = std::move(impl);
  winograd_nhwc_ = path == ConvPath::kDnnlChannelsLast && WinogradAllowed() && WinogradNhwcApplies(g) &&
                   (kind == ConvKind::kFilterGrad || (kind == ConvKind::kForward && ties == ConvTies::kFree));
  if (path == ConvPath::kDnnlChannelsLast && kind == ConvKind::kInputGrad && TurnedInputGradPays(g)) {
    // The forward convolution of the output gradient (channels o) into the input gradient (channels c):
    // an input gradient has no ties to keep.
    turned_forward_ = std::make_shared<const ConvKernel>(ConvKind::kForward, TurnedShape(g), ConvPath::kDnnlChannelsLast,
                                                         ConvTies::kFree);
  }
}

bool ConvKernel::winograd() const {
  return path_ == ConvPath::kDnnlWinograd || winograd_nhwc_ || (turned_forward_ && turned_forward_->winograd());
}

ConvKernel::~ConvKernel() = default;

std::string ConvKernel::Describe() const {
  if (nhwc16_filter_grad_) return Str(ConvPathName(path_), " nhwc16-avx512");
  if (stem_nhwc_) return Str(ConvPathName(path_), " stem-avx512");
  if (turned_forward_) return Str(turned_forward_->Describe(), " (turned filter)");
  if (winograd_nhwc_) return Str(ConvPathName(path_), " winograd-f2x2-", WinogradNhwcIsa(), " (else ", impl_->describe, ")");
  return impl_ ? impl_->describe : ConvPathName(path_);
}

namespace {
// Whether any of v[0, n) is an inf or a NaN (an integer OR over the exponents: vectorises).
bool AnyNonFinite(const float* v, int64_t n) {
  const uint32_t* u = reinterpret_cast<const uint32_t*>(v);
  uint32_t found = 0;
  for (int64_t i = 0; i < n; ++i) found |= static_cast<uint32_t>((u[i] & 0x7f800000u) == 0x7f800000u);
  return found != 0;
}

// Whether one filter tap reads inside the image at every output position (no padding), in both
// dimensions: its filter-gradient sums then take every output-gradient element.
bool HasInteriorTap(const ConvShape& g) {
  auto inside = [](int64_t k, int64_t stride, int64_t pad, int64_t in, int64_t out) {
    for (int64_t i = 0; i < k; ++i)
      if (i - pad >= 0 && (out - 1) * stride + i - pad <= in - 1) return true;
    return false;
  };
  return g.oh > 0 && g.ow > 0 && inside(g.kh, g.sh, g.ph, g.h, g.oh) && inside(g.kw, g.sw, g.pw, g.w, g.ow);
}
}  // namespace

// The im2col kernels on NCHW copies: the rare call whose padded taps meet an inf or a NaN (see Run).
void ConvKernel::RunExactChannelsLast(const float* a, const float* b, float* out) const {
  const ConvShape& g = g_;
  std::vector<float> x(g.n * g.c * g.h * g.w), y(g.n * g.o * g.oh * g.ow);
  if (kind_ == ConvKind::kForward) {
    NhwcToNchw(a, g.n, g.c, g.h * g.w, x.data());
    Conv2dForward(g, x.data(), b, y.data());
    NchwToNhwc(y.data(), g.n, g.o, g.oh * g.ow, out);
  } else if (kind_ == ConvKind::kInputGrad) {
    NhwcToNchw(a, g.n, g.o, g.oh * g.ow, y.data());
    Conv2dInputGrad(g, y.data(), b, x.data());
    NchwToNhwc(x.data(), g.n, g.c, g.h * g.w, out);
  } else {
    NhwcToNchw(a, g.n, g.c, g.h * g.w, x.data());
    NhwcToNchw(b, g.n, g.o, g.oh * g.ow, y.data());
    Conv2dFilterGrad(g, x.data(), y.data(), out);
  }
}

// The input gradient of a 3x3 stride-1 padding-1 convolution is the forward convolution of the output
// gradient with the filter turned: dx[c, y, x] = sum over o, i, j of dy[o, y + i - 1, x + j - 1] *
// w[o, c, 2 - i, 2 - j], the taps outside the image dropped as the input gradient drops them. The
// turned filter is made per call (16 x 16 x 9 floats) in the calling thread's buffer.
void ConvKernel::RunTurned(const float* dy, const float* w, float* dx) const {
  const ConvShape& g = g_;
  thread_local std::vector<float> turned;
  if (static_cast<int64_t>(turned.size()) < g.o * g.k()) turned.resize(g.o * g.k());
  for (int64_t o = 0; o < g.o; ++o)
    for (int64_t c = 0; c < g.c; ++c)
      for (int64_t i = 0; i < 3; ++i)
        for (int64_t j = 0; j < 3; ++j)
          turned[((c * g.o + o) * 3 + (2 - i)) * 3 + (2 - j)] = w[((o * g.c + c) * 3 + i) * 3 + j];
  turned_forward_->Run(dy, turned.data(), dx);
}

void ConvKernel::Run(const float* a, const float* b, float* out) const {
  if (stem_nhwc_) {  // multiplies padded zeros, as the interpreter does
    if (kind_ == ConvKind::kForward) StemConvForwardNhwc(g_, a, b, out);
    else StemConvFilterGradNhwc(g_, a, b, out);
    return;
  }
  if (nhwc16_filter_grad_) {
    Nhwc16FilterGrad(g_, a, b, out);
    // The loops skip the taps on padding. An inf or NaN in the output gradient makes every output
    // channel it touches non-finite at the centre tap (which reads no padding), so a finite result
    // means no padded zero met one: otherwise the im2col kernels multiply the zeros as the
    // interpreter does.
    if (AnyNonFinite(out, g_.o * g_.k())) RunExactChannelsLast(a, b, out);
    return;
  }
  // An inf or NaN weight: oneDNN's own input-gradient kernel (the turned forward pass would meet
  // padding where the input gradient drops it).
  if (turned_forward_ && !AnyNonFinite(b, g_.o * g_.k())) return RunTurned(a, b, out);
  // Winograd (the forward pass with finite weights); a result that is not all finite is computed again
  // below (an inf input spreads over its whole tile there).
  if (winograd_nhwc_ && (kind_ == ConvKind::kFilterGrad ? WinogradNhwcFilterGrad(g_, a, b, out)
                                                         : !AnyNonFinite(b, g_.o * g_.k()) && WinogradNhwcForward(g_, a, b, out)))
    return;
  if (path_ == ConvPath::kStem) {  // multiplies padded zeros, as the interpreter does
    if (kind_ == ConvKind::kForward) StemConvForward(g_, a, b, out);
    else StemConvFilterGrad(g_, a, b, out);
    return;
  }
  // oneDNN skips the taps that fall on padding, where the interpreter multiplies a padded zero: an
  // inf or NaN weight (forward) or output gradient (filter gradient) then gives NaN there. Such calls
  // take the im2col path, which multiplies the zeros too. (The input gradient drops padded cells.)
  // A filter gradient with a tap that reads inside the image at every output position checks its
  // result instead of scanning the whole output gradient first (a serial pass over up to 6 MB per
  // call): an inf or NaN in the gradient makes that tap's sums non-finite for every input channel.
  const bool padded = g_.ph > 0 || g_.pw > 0;
  const bool check_result = padded && impl_ && kind_ == ConvKind::kFilterGrad && HasInteriorTap(g_);
  const bool exact_nonfinite = padded && impl_ &&
                               ((kind_ == ConvKind::kForward && AnyNonFinite(b, g_.o * g_.k())) ||
                                (kind_ == ConvKind::kFilterGrad && !check_result && AnyNonFinite(b, g_.n * g_.o * g_.p())));
  if (impl_ && !exact_nonfinite) {
    RunPrimitives(a, b, out);
    if (!check_result || !AnyNonFinite(out, g_.o * g_.k())) return;
  }
  if (path_ == ConvPath::kDnnlChannelsLast) return RunExactChannelsLast(a, b, out);
  if (kind_ == ConvKind::kForward) Conv2dForward(g_, a, b, out);
  else if (kind_ == ConvKind::kInputGrad) Conv2dInputGrad(g_, a, b, out);
  else Conv2dFilterGrad(g_, a, b, out);
}

// oneDNN's primitives over the blocks of images (see the class comment).
void ConvKernel::RunPrimitives(const float* a, const float* b, float* out) const {
  const Impl& im = *impl_;
  const ConvShape& g = g_;
  const int64_t xs = g.c * g.h * g.w, ys = g.o * g.p(), ws = g.o * g.k();
  // Per image: the a and b operands' and the output's elements (b and out: 0 when shared or summed).
  const int64_t a_img = kind_ == ConvKind::kInputGrad ? ys : xs;
  const int64_t b_img = kind_ == ConvKind::kFilterGrad ? ys : 0;
  const int64_t out_img = kind_ == ConvKind::kForward ? ys : kind_ == ConvKind::kInputGrad ? xs : 0;
  const int64_t per = im.per_block;
  const int64_t nblocks = kind_ == ConvKind::kFilterGrad ? kFilterGradGroups : (g.n + per - 1) / per;

  // The filter gradient's partial sums: per calling (replica) thread, grown once.
  thread_local std::vector<float> parts_buf;
  float* parts = nullptr;
  if (kind_ == ConvKind::kFilterGrad) {
    if (static_cast<int64_t>(parts_buf.size()) < kFilterGradGroups * ws) parts_buf.resize(kFilterGradGroups * ws);
    parts = parts_buf.data();
  }
  // Weights reordered once by the calling thread, per block kind.
  void* shared[2] = {nullptr, nullptr};
  size_t weight_bytes = 0;
  for (const Block& blk : im.blocks) weight_bytes += blk.share_weights ? (blk.args[1].prim.get_size() + 63) / 64 * 64 : 0;
  size_t slice = 0;  // Work bytes per block
  for (const Block& blk : im.blocks) slice = std::max(slice, blk.work_bytes);
  char* const work_all = Work(slice * nblocks);
  KernelMems& mems = MemsOf(im.id, nblocks);
  if (weight_bytes) {
    char* w = Weights(weight_bytes);
    const OneOmpThread one;  // the caller's own setting back afterwards
    for (size_t k = 0; k < im.blocks.size(); ++k) {
      const Block& blk = im.blocks[k];
      if (!blk.share_weights) continue;
      shared[k] = w;
      w += (blk.args[1].prim.get_size() + 63) / 64 * 64;
      WeightMems& wm = mems.weights[k];
      Reorder(blk.args[1], wm.from.Bind(blk.args[1].user, const_cast<float*>(b)), wm.to.Bind(blk.args[1].prim, shared[k]),
              wm.scratch.Bind(blk.scratch_md, work_all + blk.scratch_offset), nullptr);
    }
  }

  std::atomic<bool> nonfinite{false};  // a Winograd block's result holds an inf or a NaN
  tbb::parallel_for(int64_t{0}, nblocks, [&](int64_t blk_index) {
    thread_local const bool single = (SetOmpThreads(1), true);
    (void)single;
    const int64_t first = blk_index * per, images = std::min(g.n, first + per) - first;
    if (images <= 0) {  // a filter-gradient group with no image: a zero part
      std::fill_n(parts + blk_index * ws, ws, 0.0f);
      return;
    }
    const size_t k = images == per ? 0 : 1;
    const Block& blk = im.blocks[k];
    char* work = work_all + blk_index * slice;
    BlockMems& bm = mems.blocks[blk_index];
    const dnnl_memory_t scratch = bm.scratch.Bind(blk.scratch_md, work + blk.scratch_offset);
    void* ptr[3] = {const_cast<float*>(a + first * a_img),
                    b_img ? const_cast<float*>(b + first * b_img) : const_cast<float*>(b),
                    parts ? parts + blk_index * ws : out + first * out_img};
    dnnl_memory_t user[3], bound[3];
    for (int i = 0; i < 3; ++i) {
      const Arg& arg = blk.args[i];
      user[i] = bm.user[i].Bind(arg.user, ptr[i]);
      bound[i] = user[i];
      if (!arg.reordered) continue;
      const bool shared_weights = arg.shared && blk.share_weights;
      bound[i] = bm.prim[i].Bind(arg.prim, shared_weights ? shared[k] : work + blk.prim_offset[i]);
      if (!shared_weights && !arg.output) Reorder(arg, user[i], bound[i], scratch, bm.stream.s);
    }
    Execute(blk.conv, {{blk.args[0].id, bound[0]}, {blk.args[1].id, bound[1]}, {blk.args[2].id, bound[2]},
                       {DNNL_ARG_SCRATCHPAD, scratch}}, bm.stream.s);
    if (blk.args[2].reordered) Reorder(blk.args[2], bound[2], user[2], scratch, bm.stream.s);
    if (im.exact && AnyNonFinite(static_cast<const float*>(ptr[2]), parts ? ws : images * out_img))
      nonfinite.store(true, std::memory_order_relaxed);
  });
  if (nonfinite.load()) return im.exact->Run(a, b, out);
  if (!parts) return;
  std::fill(out, out + ws, 0.0f);
  for (int64_t group = 0; group < kFilterGradGroups; ++group)
    for (int64_t j = 0; j < ws; ++j) out[j] += parts[group * ws + j];
}

}  // namespace shardstep::jit
