// PlanBuffers: interval-graph packing of a step's buffers into one arena.
//  1. Sizes are rounded up to the alignment, so every offset stays aligned.
//  2. Requests are taken largest first (ties: earlier definition, then index, for a deterministic plan):
//     big buffers placed early leave the small ones to fill the gaps between them.
//  3. Each goes at the lowest offset that fits between the placed buffers whose live ranges meet its
//     own; the arena is the highest end.
// SequenceAssignments: the parallel-copy sequencing of register allocators. A move is ready when no
// other pending move still reads its target; perform the ready ones (in the given order); when none
// is ready the pending moves form cycles: stage the first pending move that reads a pending target
// (its source still holds the value from before the step, since that target's move is pending), which
// breaks its cycle, and go on.
#include "jit/buffer_plan.h"

#include <algorithm>
#include <numeric>
#include <utility>

namespace shardstep::jit {

BufferPlan PlanBuffers(const std::vector<BufferRequest>& requests, int64_t alignment) {
  const size_t n = requests.size();
  BufferPlan plan;
  plan.offset.assign(n, -1);
  std::vector<int64_t> size(n);
  for (size_t i = 0; i < n; ++i) {
    size[i] = (requests[i].bytes + alignment - 1) / alignment * alignment;
    plan.buffer_bytes += size[i];
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (size[a] != size[b]) return size[a] > size[b];
    if (requests[a].first != requests[b].first) return requests[a].first < requests[b].first;
    return a < b;
  });
  std::vector<size_t> placed;
  std::vector<std::pair<int64_t, int64_t>> busy;  // [begin, end) of the placed buffers live with this one
  for (size_t i : order) {
    if (size[i] == 0) continue;
    busy.clear();
    for (size_t j : placed)
      if (requests[j].first <= requests[i].last && requests[i].first <= requests[j].last)
        busy.push_back({plan.offset[j], plan.offset[j] + size[j]});
    std::sort(busy.begin(), busy.end());
    int64_t at = 0;
    for (const auto& [begin, end] : busy) {
      if (begin - at >= size[i]) break;
      at = std::max(at, end);
    }
    plan.offset[i] = at;
    plan.arena_bytes = std::max(plan.arena_bytes, at + size[i]);
    placed.push_back(i);
  }
  return plan;
}

AssignOrder SequenceAssignments(const std::vector<AssignMove>& moves) {
  const size_t n = moves.size();
  AssignOrder out;
  out.staged.assign(n, 0);
  std::vector<char> done(n, 0);
  // Does a pending, unstaged move other than `j` read move j's target?
  auto read_by_other = [&](size_t j) {
    for (size_t i = 0; i < n; ++i)
      if (i != j && !done[i] && !out.staged[i] && moves[i].source >= 0 && moves[i].source == moves[j].target) return true;
    return false;
  };
  while (out.order.size() < n) {
    bool progress = false;
    for (size_t j = 0; j < n; ++j) {
      if (done[j] || read_by_other(j)) continue;
      done[j] = 1;
      out.order.push_back(static_cast<int>(j));
      progress = true;
    }
    if (progress) continue;
    for (size_t i = 0; i < n; ++i) {  // all pending moves are blocked: stage one in a cycle
      if (done[i] || out.staged[i] || moves[i].source < 0) continue;
      bool reads_pending_target = false;
      for (size_t j = 0; j < n; ++j) reads_pending_target |= j != i && !done[j] && moves[j].target == moves[i].source;
      if (!reads_pending_target) continue;
      out.staged[i] = 1;
      break;
    }
  }
  return out;
}

}  // namespace shardstep::jit
