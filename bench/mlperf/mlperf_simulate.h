// --simulate: the same MLPerf-style binary predicts its recipe's step time and time to train on a TPU pod
// slice, with the weight update sharded and replicated, using the pod-scale simulator
// (tpu_backend/simulator.h) as `shardstep simulate` does: the recipe's model at global batch
// per-core batch x 2·X·Y cores, lowered for one replica per core, every pass run (but
// shard-order-reductions, as `shardstep simulate`: it only makes the bits of the replicated update's norms
// match the sharded order), walked through the cost model. No numerics, no training data (text recipes
// read the corpus for its vocabulary only).
//
// Time to train = steps to the target x simulated step time. Evaluation is not modelled (not counted).
// The steps come from:
//  - --steps-from FILE: a result JSON of a real run of this binary (<name>_result.json): the mean of the
//    successful runs' examples to the target (steps x global batch), converted to steps at the pod's
//    global batch. Exact when the global batches are equal; when the pod's batch is larger, this assumes
//    the same number of examples (epochs) suffices, which real runs at large batch usually beat only with
//    retuned hyperparameters: an optimistic estimate, and the output says so.
//  - otherwise the recipe's step budget (its examples, budget x recipe batch, converted the same way): an
//    upper bound at the recipe's batch, not a measurement, and labelled so.
#pragma once

#include "bench/mlperf/mlperf_common.h"

namespace shardstep::mlperf {

// Runs the simulation of `b` with the flags (--mesh, --per-core-batch, --hardware, --precision,
// --steps-from, --seed), prints the table and writes "simulation" into <out_dir>/<name>_result.json
// (merged into the file when it holds a real run's result). Throws shardstep::Error naming the flag.
int RunSimulation(const Benchmark& b, const Flags& f);

}  // namespace shardstep::mlperf
