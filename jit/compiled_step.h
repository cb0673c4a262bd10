// CompiledStep: a module compiled for the CPU backend: one JIT'd object holding the fused kernels and
// the step driver that runs the schedule (kernels, oneDNN matmuls, native loops, collectives; the
// interpreter's kernels remain only as a fallback for a future op without a native lowering, which no
// op of the table uses), plus the buffer plan that places the step's temporaries in one arena.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "ir/module.h"
#include "jit/data_movement.h"
#include "jit/driver_emitter.h"
#include "jit/huge_pages.h"
#include "jit/jit_compiler.h"
#include "jit/kernel_emitter.h"
#include "jit/step_runtime.h"
#include "runtime/collectives.h"
#include "runtime/interpreter.h"

namespace shardstep::jit {

struct CompileInfo {
  double seconds = 0;      // wall time of Compile (fusion, emission, O3, codegen, or cache load)
  std::string source;      // "compiled", "disk cache", "memory cache"
  std::string key;         // cache key (hash of module, emitter version and target)
  int kernels = 0;         // fused loops
  int fused_ops = 0;       // instructions inside them
  int fused_reductions = 0;  // reductions run inside the loop that produces their operand
  int windowed_values = 0;   // values those loops never write to memory (read only by the reductions)
  int row_views = 0;         // gathers of one row of a variable, read in place (PlanViews)
  int slice_views = 0;       // contiguous slices read in place (PlanViews)
  int packed_collectives = 0;  // combined collectives run on their parts, without concat or slice copies
  int winograd_convs = 0;      // convolutions (of any pass) on Winograd kernels (jit/dnnl_conv.h)
  int channels_last_convs = 0;  // convolutions on NHWC activations (jit/channels_last.h)
  int recomputed_values = 0;   // copies of cheap values made for their later readers' loops (never written)
  int broadcast_copies = 0;    // copies of a broadcast for its second and later loop readers (never written)
  int merged_repeats = 0;      // ops that repeated an earlier op of their loop (MergeRepeatsInLoops)
  int in_place_updates = 0;    // variables' new values stored over the old by their loop (PlanInPlaceUpdates)
  int folded_products = 0;     // products a reduce-scatter computes and folds itself (with in-process collectives)
  int gathered_updates = 0;    // variables' new values written into them by a packed all-gather (the same)
  int in_place_gathers = 0;    // of those, the replica's own slice stored there by its loop (JitOptions::in_place_all_gathers)
  int reused_inputs = 0;       // loop outputs stored over a temporary the loop reads last (PlanReusedInputs)
  int attention_parts = 0;     // bf16 roundings and bias sums attention_grad writes itself (PlanAttentionGradParts)
  int attention_stats = 0;     // attention_grads reusing their forward's softmax statistics (PlanAttentionStats)
  int bf16_weight_copies = 0;  // weights whose bf16 rounding the update's loop writes (JitOptions::bf16_weight_copies)
  bool rejected_corrupt = false;  // a corrupt disk-cache entry was found, deleted and recompiled
  // Buffer plan, per replica: the arena's size vs one buffer per arena value (the saving), and the
  // values kept as their own tensors because they are swapped into variables at the end of a step.
  int64_t arena_bytes = 0;
  int64_t buffer_bytes = 0;
  int64_t swapped_bytes = 0;
};

// How each instruction of the step runs (for tests and `--emit`). kReference: the interpreter's kernel
// on a one-op module (a fallback no op of the table takes; tests/jit/jit_conformance_test.cc checks).
enum class Lowering { kLeaf, kAlias, kFused, kNative, kMatmul, kCollective, kReference };
Lowering LoweringOf(const ir::Module& m, ir::ValueId v);

class CompiledStep;
class ConvKernel;
class SharedWeightPacks;

// The tensors one replica's step reads and writes, bound to the step's slots once (CompiledStep::
// BindVariables, BindInputs, BindOutputs): the step then addresses its variables, inputs and outputs by
// slot and never looks a name up. The pointers are into the caller's maps, so a binding holds until an
// entry is erased or its map is reassigned (bind again then); each step still checks every bound
// tensor's type, so a tensor replaced in place gets a clear error, not a wrong read.
struct StepBinding {
  std::vector<runtime::Tensor*> variables;     // per variable slot (CompiledStep::variable_names())
  std::vector<const runtime::Tensor*> inputs;  // per input slot (CompiledStep::input_names())
  std::vector<runtime::Tensor*> outputs;       // per output of the module, in its order
  SharedWeightPacks* packs = nullptr;          // the packed weights in-process replicas share, if any
};

// Per-replica buffers of one CompiledStep: allocated at the first Run, reused by every later step.
// A row-blocked product's operands, for a member of its reduce-scatter to compute a row block
// (CompiledStep::PlanProductParts).
struct ProductOperands {
  bool ta = false, tb = false;
  int64_t m = 0, n = 0, k = 0;
  const float* a = nullptr;
  int64_t lda = 0;
  const float* b = nullptr;
  int64_t ldb = 0, blocks = 1;
};

struct Workspace {
  const CompiledStep* owner = nullptr;
  HugePageMemory arena;                 // the buffer plan's arena (+ slack to align its base to 64 bytes)
  std::vector<runtime::Tensor> owned;   // per value: its own tensor when it is swapped into a variable
  std::vector<char> is_owned;
  std::vector<void*> ptr;               // the slot table: per value, its storage during this step
  std::vector<double> scratch;          // reductions' accumulators (grown once, then reused)
  // Fused reductions (CompiledStep::ReduceGroup): per TBB thread slot, the kernel's buffer pointers,
  // the reductions' operand pointers and the windows of the operands that are never materialised.
  int thread_slots = 0;
  std::vector<void*> fused_bufs;
  std::vector<const float*> fused_operands;
  std::vector<float> fused_windows;
  StepBinding binding;                  // the name-based Run's, bound again at each call
  std::vector<char> staging;            // assignments staged through a temporary (a swap, a rotation)
  std::vector<const float*> part_ins;   // a packed collective's parts (CompiledStep::PlanPackedCollectives)
  std::vector<runtime::PartProducer> part_producers;  // and the products it folds (PlanProductParts)
  std::vector<ProductOperands> product_operands;
  std::vector<float*> part_outs;
  std::vector<float> attention_stats;   // the forwards' softmax statistics (CompiledStep::PlanAttentionStats)
  uint64_t runs = 0;                    // steps run with it (SharedWeightPacks::Multiply's `run`)
};

class CompiledStep {
 public:
  // Fuses (ElementwiseFuser on a copy), emits and compiles `m`, or takes it from the in-memory or
  // disk cache.
  static std::shared_ptr<const CompiledStep> Compile(const ir::Module& m, const JitOptions& options = {});
  ~CompiledStep();

  const ir::Module& module() const { return m_; }  // with "fusion" attributes
  // Appends the fused loops' addresses and names to /tmp/perf-<pid>.map (SHARDSTEP_JIT_PERF_MAP=1
  // does it at compile time; compiled_step.cc).
  void WritePerfMap() const;
  const CompileInfo& info() const { return info_; }
  const std::vector<FusedKernel>& kernels() const { return kernels_; }
  const std::vector<void*>& kernel_fns() const { return kernel_fns_; }  // per kernel: its compiled loop
  // Byte offset of value v in the workspace arena, or -1 (no buffer, or a tensor of its own).
  int64_t arena_offset(ir::ValueId v) const { return offset_[v]; }

  // The LLVM module Compile JITs: the kernels and the step driver (`--emit=llvm` prints it).
  std::unique_ptr<llvm::Module> Emit(llvm::LLVMContext& ctx, const std::string& name) const;

  // One step as replica `replica`, with the semantics of runtime::RunStep: returns the outputs and
  // writes each assigned variable's new value into `variables`. With batch_parts > 1, `inputs` hold
  // the global batch and this replica reads chunk `replica` of batch_parts equal chunks along
  // dimension 0 in place (no per-step copy).
  runtime::TensorMap Run(runtime::TensorMap& variables, const runtime::TensorMap& inputs, int replica,
                         runtime::Collectives* collectives, Workspace* ws, int batch_parts = 1) const;
  // The same, writing the outputs into `outputs`: a tensor already there with the output's name and
  // type is overwritten in place, so a map kept from step to step makes the step allocate nothing.
  void Run(runtime::TensorMap& variables, const runtime::TensorMap& inputs, int replica,
           runtime::Collectives* collectives, Workspace* ws, int batch_parts, runtime::TensorMap* outputs) const;

  // The names behind the slots of StepBinding, in slot order (each variable and input once).
  const std::vector<std::string>& variable_names() const { return variable_names_; }
  const std::vector<std::string>& input_names() const { return input_names_; }
  ir::ValueId VariableLeaf(int slot) const { return variable_leaf_[slot]; }  // the slot's first instruction
  // The variable slots whose new value a packed all-gather over all `num_replicas` replicas writes
  // straight into the variable (PlanInPlaceUpdates). In-process replicas may bind each of these slots
  // to one tensor shared by all: every replica reads it before the all-gather and then each writes
  // only its own part (runtime::InProcessCollectives::AllGatherParts with one output for all).
  std::vector<int> GatheredVariableSlots(int num_replicas) const;
  // The weights' bf16 copies the step reads and assigns (JitOptions::bf16_weight_copies), as (copy's
  // name, weight's name): variables of the step that are not in the logical state. Whoever runs the
  // step puts convert(weight, bf16) under the copy's name before a step (after any change to the weight
  // made outside the step, and after a step that threw); the step keeps it so.
  const std::vector<std::pair<std::string, std::string>>& bf16_weight_copies() const { return bf16_copies_; }
  // Puts each copy, convert(weight, bf16), into `state` beside its weight: a new entry (before binding
  // `state`), or the bound one rewritten in place (no allocation).
  void MakeBf16WeightCopies(runtime::TensorMap& state) const;
  // Point `b`'s slots at the maps' tensors; a missing name is an error naming it. BindOutputs gives
  // `outputs` a tensor of the right type for each output (keeping one already there) and binds it.
  // Sizes the vectors once: binding again with the same step allocates nothing.
  void BindVariables(runtime::TensorMap& variables, StepBinding* b) const;
  void BindInputs(const runtime::TensorMap& inputs, StepBinding* b) const;
  void BindOutputs(runtime::TensorMap* outputs, StepBinding* b) const;
  // One step on bound tensors, with the semantics of the Run above: writes the outputs into the bound
  // output tensors and each assigned variable's new value into its bound tensor.
  void Run(const StepBinding& b, int replica, runtime::Collectives* collectives, Workspace* ws,
           int batch_parts = 1) const;

 private:
  struct Step {
    int kernel = -1;           // >= 0: run kernels_[kernel]
    ir::ValueId value = -1;    // else: instruction `value`
  };
  friend int32_t(::ss_rt_instr)(shardstep::jit::StepContext* ctx, int64_t value);  // runs RunInstr for the driver
  CompiledStep() = default;
  void Plan(bool fuse_reductions);
  void FuseReductions(const std::vector<int>& kernel_of, std::vector<char>& external);
  int KernelReadingDirectly(ir::ValueId a, ir::ValueId v, const std::vector<int>& kernel_of, int* input) const;
  void RunFusedReductions(int group, Workspace* ws) const;
  void PlanViews();
  void PlanPackedCollectives();
  void PlanRowBlocks();
  void PlanProductParts();
  void RunPackedCollective(ir::ValueId v, const runtime::ReplicaGroup& group, const StepBinding& b, int replica,
                           runtime::Collectives* c, Workspace* ws) const;
  void PlanInPlaceUpdates();
  void PlanAttentionGradParts(bool on);
  void PlanAttentionStats();
  // The storage of variable gather_slot_[v] in `b`, which all-gather result v is written into.
  void* GatheredInto(ir::ValueId v, const StepBinding& b) const;
  std::vector<ir::ValueId> PlanReusedInputs(const std::vector<ir::ValueId>& root, std::vector<int>& last);
  void PlanBuffers();
  void RunInstr(ir::ValueId v, const StepBinding& b, int replica, runtime::Collectives* c, Workspace* ws,
                int batch_parts) const;
  void Allocate(Workspace* ws) const;
  void PlanRoutes();
  void PlanAssignments();
  void PlanLeafSlots();
  void Assign(const StepBinding& b, Workspace* ws) const;

  ir::Module m_;
  CompileInfo info_;
  std::vector<FusedKernel> kernels_;
  std::vector<Step> schedule_;
  std::vector<DriverStep> driver_steps_;       // the schedule as the driver performs it
  StepDriverFn driver_ = nullptr;
  std::vector<char> needs_buffer_;             // per value
  std::vector<char> swappable_;                // per value: assigned once, not an output
  std::vector<char> separate_;                 // per value: owns a tensor (swapped into its variable)
  std::vector<char> in_place_;                 // per value: its kernel or all-gather writes it into its variable (PlanInPlaceUpdates)
  std::vector<int> gather_slot_;               // per all-gather result (or packed one's slice): the variable slot it is written into, or -1
  bool reuse_inputs_ = true;                   // PlanReusedInputs runs (JitOptions::reuse_inputs)
  bool in_place_all_gathers_ = false;          // JitOptions::in_place_all_gathers
  std::vector<ir::ValueId> gathered_from_;     // per all-gather: the loop input holding the member's new chunk in place, or -1
  std::vector<char> view_;                     // per value: a view into its operand's storage (PlanViews)
  // Combined collectives run on their parts (PlanPackedCollectives): a reduce-scatter reads the parts of
  // its concat and an all-gather those of its concat and writes the slices of its result, so neither the
  // concats nor the slices copy anything (elided_). Per collective value, an index into packed_ or -1.
  struct PackedParts {
    std::vector<ir::ValueId> ins, outs;  // outs: all-gather only, the slices it writes
    std::vector<int64_t> lens;
    std::vector<ir::ValueId> products;   // reduce-scatter: per part, the product it folds from its operands, or -1
  };
  std::vector<int> row_blocks_;                // per product: its row blocks (PlanRowBlocks), or 0
  std::vector<char> folded_;                   // per product: computed by its reduce-scatter where collectives fold products
  std::vector<ir::ValueId> plain_product_;     // per reduce-scatter that is not packed: the product it folds, or -1
  void BindProduct(ir::ValueId d, const Workspace& ws, ProductOperands* po) const;
  std::vector<int> packed_of_;
  std::vector<PackedParts> packed_;
  std::vector<char> elided_;                   // per value: its work is done by a packed collective
  // attention_grad values that write their parts' bf16 roundings and column sums themselves (jit/attention.h
  // AttentionGradParts), for the loop and the reductions that did (PlanAttentionGradParts).
  struct GradParts {
    std::array<ir::ValueId, 3> bf16{-1, -1, -1};  // per part: the convert it writes, or -1
    std::array<ir::ValueId, 3> sums{-1, -1, -1};  // per part: the reduce_sum it writes, or -1
    bool f32 = true;                              // its f32 result is read by something else
    int64_t block_rows = 0;
  };
  std::vector<GradParts> grad_parts_;
  std::vector<int> grad_parts_of_;             // per value: its index in grad_parts_, or -1
  std::vector<ir::ValueId> written_by_;        // per value: the attention_grad that writes it, or -1
  std::vector<char> absorbed_;                 // per kernel: its work is done by an attention_grad
  // Per attention and attention_grad of a pair (PlanAttentionStats): where its softmax statistics are in
  // Workspace::attention_stats (2 x heads x t floats: the maxima, then the reciprocal sums), or -1.
  std::vector<int64_t> attention_stats_at_;
  int64_t attention_stats_floats_ = 0;
  std::vector<int64_t> offset_;                // per value: offset in the arena, or -1
  // The assignments, in the order that lets each see the values from before the step, and per
  // assignment its offset in the workspace's staging buffer when it is copied through it (else -1).
  std::vector<int> assign_order_;
  std::vector<int64_t> staging_offset_;
  int64_t staging_bytes_ = 0;
  // Per value: its variable or input slot, or -1 (PlanLeafSlots); per assignment, its variable's slot.
  std::vector<std::string> variable_names_, input_names_;
  std::vector<std::pair<std::string, std::string>> bf16_copies_;  // (copy, weight): Bf16WeightCopies
  std::vector<ir::ValueId> variable_leaf_, input_leaf_;  // per slot: its first instruction
  std::vector<int> leaf_slot_;
  std::vector<int> assign_slot_;
  std::vector<ir::Module> reference_;          // per value: a one-op module for the interpreter, or empty
  std::shared_ptr<JitCompiler> jit_;
  // Per collective value, per replica: its replica group resolved once at planning (or why it has
  // none, reported when the step runs), and a collective_permute's target and source (-1: none).
  struct Route {
    runtime::ReplicaGroup group;
    std::string error;
    int to = -1, from = -1;
  };
  std::vector<std::vector<Route>> routes_;
  std::vector<std::shared_ptr<const ConvKernel>> conv_;  // per value: its convolution, planned (jit/dnnl_conv.h)
  // A fused loop with the f32 sums and means of its outputs (or of inputs it reads element for element)
  // over one layout: run together a window at a time (jit/data_movement.h FusedSums), in the kernel's
  // place in the schedule; an output read only by these reductions goes to a per-thread window, never
  // to memory.
  struct ReduceGroup {
    int kernel = -1;
    std::vector<ir::ValueId> reductions;
    std::vector<int> operand;      // per reduction: its operand's index in the kernel's outputs, or -1 - i
                                   // for its input i (summed from memory just after the loop read it)
    std::vector<char> windowed;    // per kernel output: written to the window only
    std::vector<int> window_of;    // per kernel output: its window's index, or -1
    int windows = 0;
    int64_t window = 0;  // elements per window (compiled_step.cc FusedWindow)
    ReduceLayout layout;
  };
  std::vector<ReduceGroup> reduce_groups_;
  std::string KernelTable() const;  // SHARDSTEP_JIT_DUMP: the fused loops' memory inputs and outputs
  std::vector<int> reduce_group_of_kernel_;  // per kernel: its ReduceGroup, or -1
  std::vector<int> reduce_group_of_value_;   // per value: the ReduceGroup of a fused reduction, or -1
  std::vector<void*> kernel_fns_;            // per kernel: its compiled loop (for the fused reductions)
};

// The LLVM IR of `m`'s fused kernels after O3 (`shardstep compile --emit=llvm`).
std::string EmitLlvmIr(const ir::Module& m);

}  // namespace shardstep::jit
