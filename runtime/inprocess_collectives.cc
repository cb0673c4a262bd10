// InProcessCollectives: shared-memory collectives for replica threads (see the header for the protocol).
#include "runtime/inprocess_collectives.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "ir/error.h"

namespace shardstep::runtime {
namespace {

enum class Kind { kAllReduce, kReduceScatter, kAllGather, kReduceScatterParts, kAllGatherParts, kBroadcast, kBarrier };

const char* KindName(Kind k) {
  switch (k) {
    case Kind::kAllReduce: return "AllReduce";
    case Kind::kReduceScatter: return "ReduceScatter";
    case Kind::kAllGather: return "AllGather";
    case Kind::kReduceScatterParts: return "ReduceScatterParts";
    case Kind::kAllGatherParts: return "AllGatherParts";
    case Kind::kBroadcast: return "Broadcast";
    case Kind::kBarrier: return "Barrier";
  }
  return "?";
}

const char* ReductionName(Reduction op) {
  switch (op) {
    case Reduction::kSum: return "sum";
    case Reduction::kMean: return "mean";
    case Reduction::kMax: return "max";
  }
  return "?";
}

std::string GroupString(const ReplicaGroup& group) {
  std::string s = "{";
  for (size_t i = 0; i < group.size(); ++i) s += (i ? "," : "") + std::to_string(group[i]);
  return s + "}";
}

inline float MaxOf(float acc, float x) { return FoldMax(acc, x); }

void CheckDisjoint(const char* what, const float* in, int64_t n_in, const float* out, int64_t n_out) {
  if (n_in == 0 || n_out == 0) return;
  const auto a = reinterpret_cast<uintptr_t>(in), b = reinterpret_cast<uintptr_t>(out);
  if (a < b + n_out * sizeof(float) && b < a + n_in * sizeof(float)) throw Error(Str(what, ": the input and output buffers overlap"));
}

// out[j] += x[j] and out[j] = FoldMax(out[j], x[j]) for j < n, also compiled for AVX-512 and AVX2 and
// picked once by the CPU (the build targets baseline x86-64): one add or compare per element, so the
// same bits on every instruction set.
[[gnu::always_inline]] inline void AddIntoBody(float* __restrict out, const float* __restrict x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] += x[j];
}
[[gnu::always_inline]] inline void FoldMaxIntoBody(float* __restrict out, const float* __restrict x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = MaxOf(out[j], x[j]);
}
#define SS_ISA_VARIANTS(NAME)                                                                                     \
  __attribute__((target("avx512f"))) void NAME##Avx512(float* out, const float* x, int64_t n) { NAME##Body(out, x, n); } \
  __attribute__((target("avx2"))) void NAME##Avx2(float* out, const float* x, int64_t n) { NAME##Body(out, x, n); }      \
  void NAME##Base(float* out, const float* x, int64_t n) { NAME##Body(out, x, n); }                                    \
  void NAME(float* out, const float* x, int64_t n) {                                                                   \
    static const int isa = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;           \
    if (isa == 2) return NAME##Avx512(out, x, n);                                                                      \
    if (isa == 1) return NAME##Avx2(out, x, n);                                                                        \
    NAME##Base(out, x, n);                                                                                             \
  }
SS_ISA_VARIANTS(AddInto)
SS_ISA_VARIANTS(FoldMaxInto)
#undef SS_ISA_VARIANTS

}  // namespace

struct InProcessCollectives::Slot {
  Kind kind;
  int64_t n;
  Reduction op;
  int root;
  const float* in;
  // The parts collectives: nparts inputs and their lengths (n is their sum).
  const float* const* parts = nullptr;
  const int64_t* ns = nullptr;
  int nparts = 0;
  float* const* outs = nullptr;  // AllGatherParts: the member's outputs
  const PartProducer* producers = nullptr;  // ReduceScatterProducts: per part, set where it is produced
  float* out = nullptr;          // AllGather: the member's output

  bool Reduces() const { return kind == Kind::kAllReduce || kind == Kind::kReduceScatter || kind == Kind::kReduceScatterParts; }
  bool Matches(const Slot& o) const {
    return kind == o.kind && n == o.n && (!Reduces() || op == o.op) && (kind != Kind::kBroadcast || root == o.root) &&
           nparts == o.nparts && std::equal(ns, ns + nparts, o.ns) && SameProduced(o);
  }
  // Every member produces the same parts (or none).
  bool SameProduced(const Slot& o) const {
    for (int i = 0; i < nparts; ++i)
      if (Produced(i) != o.Produced(i)) return false;
    return true;
  }
  bool Produced(int i) const { return producers && producers[i].produce; }
  std::string ToString() const {
    std::string s = Str(KindName(kind), "(n=", n);
    if (nparts > 0) s += Str(" in ", nparts, " parts");
    for (int i = 0; i < nparts; ++i)
      if (Produced(i)) s += Str(i == 0 || !Produced(i - 1) ? ", produced: " : " ", i);
    if (Reduces()) s += Str(", ", ReductionName(op));
    if (kind == Kind::kBroadcast) s += Str(", root=", root);
    return s + ")";
  }
};

struct InProcessCollectives::Group {
  explicit Group(ReplicaGroup m) : members(std::move(m)), slots(members.size()) {}
  int size() const { return static_cast<int>(members.size()); }

  // Runs at the last arrival of the publish rendezvous, under mu. Returns an error on a mismatch.
  std::string Prepare() {
    for (int p = 1; p < size(); ++p) {
      if (!slots[p].Matches(slots[0])) {
        return Str("collective mismatch in replica group ", GroupString(members), ": replica ", members[0],
                   " called ", slots[0].ToString(), " but replica ", members[p], " called ", slots[p].ToString());
      }
    }
    const Slot& s = slots[0];
    if (s.kind == Kind::kAllGather) {  // one output for all members, or each its own
      shared_outs.assign(1, 1);
      for (int p = 1; p < size(); ++p) shared_outs[0] &= slots[p].out == s.out;
      for (int p = 0; p < size() && !shared_outs[0]; ++p)
        for (int q = p + 1; q < size(); ++q)
          if (slots[p].out == slots[q].out)
            return Str("AllGather in replica group ", GroupString(members), ": replicas ", members[p], " and ", members[q],
                       " write into the same buffer but others do not");
    }
    if (s.kind == Kind::kAllGatherParts) {  // per part: one output for all members, or each its own
      shared_outs.assign(s.nparts, 1);  // capacity kept: no allocation after the first call
      for (int i = 0; i < s.nparts; ++i) {
        for (int p = 1; p < size(); ++p) shared_outs[i] &= slots[p].outs[i] == s.outs[i];
        for (int p = 0; p < size() && !shared_outs[i]; ++p)
          for (int q = p + 1; q < size(); ++q)
            if (slots[p].outs[i] == slots[q].outs[i])
              return Str("AllGatherParts in replica group ", GroupString(members), ": replicas ", members[p], " and ",
                         members[q], " write part ", i, " into the same buffer but others do not");
      }
    }
    const int64_t need = s.kind == Kind::kAllReduce ? s.n : 0;
    if (static_cast<int64_t>(scratch.size()) < need) scratch.resize(need);
    reading = s.kind == Kind::kBarrier ? 0 : size();
    started = std::chrono::steady_clock::now();
    return "";
  }

  // out[0..count) = fold over positions of in_p[offset + j], in group order (one function for all).
  void Fold(int64_t offset, int64_t count, Reduction op, float* out) const {
    FoldFrom([&](int p) { return slots[p].in + offset; }, count, op, out);
  }
  // The same over the elements at source(p) of each position p, a chunk of kFoldChunk elements at a
  // time: each output element still folds its positions in group order (the same bits), but the chunk
  // stays in L2 while the positions are added instead of streaming the whole output once per position.
  // 128 KiB chunks: each position's read is a long enough run for the prefetchers (MLP N=8 train,
  // alternated pairs: 2048 -> 8192 elements 3-7% faster in 4 of 4, -> 32768 a further 2-7% in 4 of 4,
  // -> 131072 level or slower).
  template <typename Source>
  void FoldFrom(Source source, int64_t count, Reduction op, float* out) const {
    constexpr int64_t kFoldChunk = 32768;
    for (int64_t c0 = 0; c0 < count; c0 += kFoldChunk) {
      const int64_t len = std::min(kFoldChunk, count - c0);
      float* o = out + c0;
      std::copy_n(source(0) + c0, len, o);
      for (int p = 1; p < size(); ++p) {
        const float* x = source(p) + c0;
        if (op == Reduction::kMax) FoldMaxInto(o, x, len);
        else AddInto(o, x, len);
      }
      if (op == Reduction::kMean) {
        const float d = static_cast<float>(size());
        for (int64_t j = 0; j < len; ++j) o[j] /= d;
      }
    }
  }

  const ReplicaGroup members;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;   // bumped by every completed rendezvous (reusable barrier)
  // The rendezvous' waiters sleep on `wake` (a futex through std::atomic::wait), not on cv: a
  // condition variable's woken waiters each take mu again, and 8 replica threads on 2 cores queued on
  // it (~2 extra context switches a waiter per rendezvous, 116 a step). `done` is `generation`, read
  // without mu; `wake` changes at every completion and abort.
  std::atomic<uint64_t> done{0};
  std::atomic<int> wake{0};
  void Wake() {
    wake.fetch_add(1, std::memory_order_release);
    wake.notify_all();
  }
  int reading = 0;           // members in the work phase, possibly reading other members' buffers
  std::vector<Slot> slots;   // one per position, written under mu before the publish rendezvous
  std::vector<float> scratch;
  std::vector<char> shared_outs;  // AllGatherParts, per part: every member passed the same output (Prepare)
  std::chrono::steady_clock::time_point started;  // the last arrival of the current collective
  std::atomic<int> leaving{0};
  int left = 0;                  // phase timing: members that left, under mu
  uint64_t left_generation = 0;  // phase timing: bumped when the last member leaves
  std::atomic<int64_t> busy_ns{0};
};

InProcessCollectives::InProcessCollectives(int num_replicas)
    : num_replicas_(num_replicas), fold_products_([] {
        const char* e = std::getenv("SHARDSTEP_JIT_FOLD_PRODUCTS");
        return !(e && std::string(e) == "0");
      }()) {
  if (num_replicas <= 0) throw Error(Str("InProcessCollectives needs at least one replica, got ", num_replicas));
}

InProcessCollectives::~InProcessCollectives() = default;

void InProcessCollectives::ThrowAborted() {
  std::lock_guard lk(abort_mu_);
  throw Error(why_);
}

InProcessCollectives::Group& InProcessCollectives::Enter(int replica, const ReplicaGroup& group, int64_t n,
                                                         int* position) {
  if (aborted_) ThrowAborted();
  if (n < 0) throw Error(Str("collective on replica ", replica, ": negative element count ", n));
  const auto it = std::find(group.begin(), group.end(), replica);
  if (it == group.end()) throw Error(Str("replica ", replica, " is not in replica group ", GroupString(group)));
  *position = static_cast<int>(it - group.begin());

  std::lock_guard lk(groups_mu_);
  auto& g = groups_[group];
  if (!g) {
    const std::set<int64_t> unique(group.begin(), group.end());
    if (unique.size() != group.size() || *unique.begin() < 0 || *unique.rbegin() >= num_replicas_) {
      groups_.erase(group);
      throw Error(Str("invalid replica group ", GroupString(group), ": members must be distinct replica ids in [0, ",
                      num_replicas_, ")"));
    }
    g = std::make_unique<Group>(group);
  }
  return *g;
}

void InProcessCollectives::Sync(Group& g, int position, const Slot* publish) {
  std::string mismatch;
  {
    std::unique_lock lk(g.mu);
    if (publish) {
      g.slots[position] = *publish;
    } else if (--g.reading == 0 && aborted_) {
      g.cv.notify_all();  // aborted members may leave now that nobody reads their buffers
    }
    if (!aborted_) {
      if (++g.arrived == g.size()) {
        if (publish) mismatch = g.Prepare();
        if (mismatch.empty()) {
          g.arrived = 0;
          g.done.store(++g.generation, std::memory_order_release);
          lk.unlock();
          g.Wake();
          return;
        }
      } else {
        const uint64_t gen = g.generation;
        lk.unlock();
        for (;;) {
          const int w = g.wake.load(std::memory_order_acquire);
          if (g.done.load(std::memory_order_acquire) != gen) return;  // completed (an abort is noticed at the next rendezvous)
          if (aborted_) break;
          g.wake.wait(w, std::memory_order_acquire);
        }
        lk.lock();
      }
    }
    // Aborted: leave only once no member reads this member's buffers any more.
    if (mismatch.empty()) g.cv.wait(lk, [&] { return g.reading == 0; });
  }
  if (!mismatch.empty()) Abort(mismatch);
  ThrowAborted();
}

void InProcessCollectives::Leave(Group& g) {
  auto record = [&] {
    g.busy_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - g.started).count();
    ++calls_;
  };
  if (phase_timing_) {  // everyone leaves together
    std::unique_lock lk(g.mu);
    if (++g.left == g.size()) {
      g.left = 0;
      record();
      ++g.left_generation;
      g.cv.notify_all();
    } else {
      const uint64_t gen = g.left_generation;
      g.cv.wait(lk, [&] { return g.left_generation != gen || aborted_; });
    }
    return;
  }
  // The next collective's rendezvous needs every member, including this last one, so nobody can
  // touch `leaving` or `started` again before the reset below.
  if (g.leaving.fetch_add(1) + 1 != g.size()) return;
  g.leaving.store(0);
  record();
}

double InProcessCollectives::busy_seconds() const {
  std::lock_guard lk(groups_mu_);
  int64_t most = 0;
  for (const auto& [members, g] : groups_) most = std::max<int64_t>(most, g->busy_ns.load());
  return most * 1e-9;
}

void InProcessCollectives::Abort(const std::string& why) {
  {
    std::lock_guard lk(abort_mu_);
    if (aborted_) return;
    why_ = why;
    aborted_ = true;
  }
  mailboxes_.Abort(why);
  std::lock_guard lk(groups_mu_);
  for (auto& [members, g] : groups_) {
    std::lock_guard gl(g->mu);
    g->cv.notify_all();
    g->Wake();
  }
}

void InProcessCollectives::AllReduce(int replica, const ReplicaGroup& group, float* data, int64_t n,
                                     Reduction op) {
  AllReduce(replica, group, data, data, n, op);
}

void InProcessCollectives::AllReduce(int replica, const ReplicaGroup& group, const float* in, float* data, int64_t n,
                                     Reduction op) {
  int p;
  Group& g = Enter(replica, group, n, &p);
  const Slot slot{Kind::kAllReduce, n, op, 0, in};
  Sync(g, p, &slot);
  // Balanced chunks: the first n % size members take one extra element.
  const int64_t base = n / g.size(), extra = n % g.size();
  const int64_t lo = p * base + std::min<int64_t>(p, extra);
  const int64_t count = base + (p < extra ? 1 : 0);
  g.Fold(lo, count, op, g.scratch.data() + lo);
  Sync(g, p, nullptr);
  std::copy_n(g.scratch.data(), n, data);
  Leave(g);
}

void InProcessCollectives::ReduceScatter(int replica, const ReplicaGroup& group, const float* in, float* out,
                                         int64_t n, Reduction op) {
  int p;
  Group& g = Enter(replica, group, n, &p);
  CheckDisjoint("ReduceScatter", in, n * g.size(), out, n);
  const Slot slot{Kind::kReduceScatter, n, op, 0, in};
  Sync(g, p, &slot);
  g.Fold(p * n, n, op, out);
  Sync(g, p, nullptr);
  Leave(g);
}

void InProcessCollectives::AllGather(int replica, const ReplicaGroup& group, const float* in, float* out,
                                     int64_t n) {
  int p;
  Group& g = Enter(replica, group, n, &p);
  const bool own_chunk = in == out + p * n;  // in place: the input is already the member's chunk of the output
  if (!own_chunk) CheckDisjoint("AllGather", in, n, out, n * g.size());
  Slot slot{Kind::kAllGather, n, Reduction::kSum, 0, in};
  slot.out = out;
  Sync(g, p, &slot);
  if (g.shared_outs[0]) {  // one output for all: each member writes its own chunk
    if (!own_chunk) std::copy_n(in, n, out + p * n);
  } else {
    for (int q = 0; q < g.size(); ++q)
      if (!(q == p && own_chunk)) std::copy_n(g.slots[q].in, n, out + q * n);
  }
  Sync(g, p, nullptr);
  Leave(g);
}

void InProcessCollectives::ReduceScatterParts(int replica, const ReplicaGroup& group, const float* const* ins,
                                              const int64_t* ns, int parts, float* out, Reduction op) {
  ReduceScatterProducts(replica, group, ins, nullptr, ns, parts, out, op);
}

namespace {
// The calling (member) thread's buffer for one produced chunk: grown only.
float* ProducedChunk(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}
}  // namespace

void InProcessCollectives::ReduceScatterProducts(int replica, const ReplicaGroup& group, const float* const* ins,
                                                 const PartProducer* producers, const int64_t* ns, int parts,
                                                 float* out, Reduction op) {
  int64_t total = 0;
  for (int i = 0; i < parts; ++i) total += ns[i];
  int p;
  Group& g = Enter(replica, group, total, &p);
  for (int i = 0; i < parts; ++i)
    if (!(producers && producers[i].produce)) CheckDisjoint("ReduceScatterParts", ins[i], ns[i] * g.size(), out, total);
  Slot slot{Kind::kReduceScatterParts, total, op, 0, nullptr};
  slot.parts = ins;
  slot.ns = ns;
  slot.nparts = parts;
  slot.producers = producers;
  Sync(g, p, &slot);
  for (int64_t i = 0, col = 0; i < parts; col += ns[i++]) {
    if (!g.slots[0].Produced(static_cast<int>(i))) {
      g.FoldFrom([&](int q) { return g.slots[q].parts[i] + p * ns[i]; }, ns[i], op, out + col);
      continue;
    }
    // FoldFrom's per-element order: the first member's chunk, then each later one folded in, then
    // the mean's division; the chunk computed by its owner's producer, member by member (a sum's
    // later chunks added straight into the result where the producer can: PartProducer::add).
    float* o = out + col;
    float* chunk = ProducedChunk(ns[i]);
    for (int q = 0; q < g.size(); ++q) {
      const PartProducer& pr = g.slots[q].producers[i];
      if (q > 0 && pr.add && op != Reduction::kMax) {
        pr.add(pr.context, p, o);
        continue;
      }
      pr.produce(pr.context, p, q == 0 ? o : chunk);
      if (q == 0) continue;
      if (op == Reduction::kMax) FoldMaxInto(o, chunk, ns[i]);
      else AddInto(o, chunk, ns[i]);
    }
    if (op == Reduction::kMean) {
      const float d = static_cast<float>(g.size());
      for (int64_t j = 0; j < ns[i]; ++j) o[j] /= d;
    }
  }
  Sync(g, p, nullptr);
  Leave(g);
}

void InProcessCollectives::AllGatherParts(int replica, const ReplicaGroup& group, const float* const* ins,
                                          const int64_t* ns, int parts, float* const* outs) {
  int64_t total = 0;
  for (int i = 0; i < parts; ++i) total += ns[i];
  int p;
  Group& g = Enter(replica, group, total, &p);
  for (int i = 0; i < parts; ++i) CheckDisjoint("AllGatherParts", ins[i], ns[i], outs[i], ns[i] * g.size());
  Slot slot{Kind::kAllGatherParts, total, Reduction::kSum, 0, nullptr};
  slot.parts = ins;
  slot.ns = ns;
  slot.nparts = parts;
  slot.outs = outs;
  Sync(g, p, &slot);
  for (int i = 0; i < parts; ++i) {
    if (g.shared_outs[i]) {  // one output for all: each member writes its own row
      std::copy_n(ins[i], ns[i], outs[i] + p * ns[i]);
      continue;
    }
    for (int q = 0; q < g.size(); ++q) std::copy_n(g.slots[q].parts[i], ns[i], outs[i] + q * ns[i]);
  }
  Sync(g, p, nullptr);
  Leave(g);
}

void InProcessCollectives::Broadcast(int replica, const ReplicaGroup& group, float* data, int64_t n, int root) {
  int p;
  Group& g = Enter(replica, group, n, &p);
  if (root < 0 || root >= g.size()) {
    throw Error(Str("Broadcast root position ", root, " is outside replica group ", GroupString(group)));
  }
  const Slot slot{Kind::kBroadcast, n, Reduction::kSum, root, data};
  Sync(g, p, &slot);
  if (p != root) std::copy_n(g.slots[root].in, n, data);  // root keeps its buffer until the rendezvous
  Sync(g, p, nullptr);
  Leave(g);
}

void InProcessCollectives::Barrier(int replica, const ReplicaGroup& group) {
  int p;
  Group& g = Enter(replica, group, 0, &p);
  const Slot slot{Kind::kBarrier, 0, Reduction::kSum, 0, nullptr};
  Sync(g, p, &slot);
}

void InProcessCollectives::Permute(int replica, int to, const float* send, int from, float* recv, int64_t n, int) {
  if (aborted_) ThrowAborted();
  CheckPermute("in-process collectives", num_replicas_, replica, to, from, n);
  if (to >= 0) mailboxes_.Send(replica, to, send, n);
  if (from >= 0) mailboxes_.Receive(from, replica, recv, n);
  else std::fill_n(recv, n, 0.0f);
}

}  // namespace shardstep::runtime
