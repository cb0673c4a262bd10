// BufferPlan: places a step's temporary buffers in one arena, letting buffers whose lifetimes do not
// overlap share bytes.
#pragma once

#include <cstdint>
#include <vector>

namespace shardstep::jit {

// A buffer of `bytes` (0: none) written at schedule position `first` and last read at `last`.
struct BufferRequest {
  int64_t bytes = 0;
  int first = 0;
  int last = 0;
};

struct BufferPlan {
  std::vector<int64_t> offset;  // per request: byte offset in the arena (a multiple of the alignment), or -1
  int64_t arena_bytes = 0;      // the arena's size
  int64_t buffer_bytes = 0;     // what one buffer per request would take (sizes rounded to the alignment)
};

// Greedy by size: the largest buffers are placed first, each at the lowest offset where it overlaps
// no placed buffer that is live at the same time. Live ranges are inclusive at both ends, so a step's
// outputs never share bytes with its operands.
BufferPlan PlanBuffers(const std::vector<BufferRequest>& requests, int64_t alignment = 64);

// The end-of-step assignments as one parallel copy: every assignment must see the values from before
// the step, but a variable read in place (`@a = @b; @b = @a`, or a reshape of another variable)
// would be overwritten by an earlier copy. Each move writes variable `target` from storage that is
// variable `source`'s own (source >= 0; -1: a temporary of the step, never overwritten here).
struct AssignMove {
  int target = -1;
  int source = -1;
};

struct AssignOrder {
  std::vector<int> order;    // the moves in the order to perform them
  std::vector<char> staged;  // per move: copy its source to a temporary before any move is performed
};

// Orders the moves so that each variable is read before it is overwritten; a cycle (a swap, a
// rotation) is broken by staging one of its sources through a temporary: only those moves pay a copy.
AssignOrder SequenceAssignments(const std::vector<AssignMove>& moves);

}  // namespace shardstep::jit
