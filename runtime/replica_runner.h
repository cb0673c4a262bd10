// RunReplicas: runs one body per replica, each on its own thread, and turns the first failure into an error.
//
// Replica threads block (inside collectives they wait on condition variables), so n may far exceed the
// core count, e.g. 64 replicas on 2 cores. Work inside a replica may use oneTBB (parallel_for etc.): all
// replica threads share TBB's default arena. Call collectives only from the replica's own thread, never
// from inside a TBB task: a worker blocked in a collective would starve the arena.
#pragma once

#include <functional>

#include "runtime/collectives.h"

namespace shardstep::runtime {

// Runs body(r) for r in [0, n), each on its own std::thread, and joins them all. If a replica throws,
// calls c->Abort("replica <r>: <message>") so replicas blocked in a collective wake up and throw too,
// then, after joining, throws shardstep::Error with that first failing replica's message (the secondary
// "aborted" errors of the others are dropped). `c` may be null when the body uses no collectives.
void RunReplicas(int n, Collectives* c, const std::function<void(int replica)>& body);

}  // namespace shardstep::runtime
