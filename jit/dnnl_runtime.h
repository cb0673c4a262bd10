// What every oneDNN primitive of a step shares (jit/dnnl_kernels.cc defines them): the CPU engine they are
// built for, and each thread's stream, created on its first use and kept for the thread's life.
#pragma once

#include <dnnl.hpp>

namespace shardstep::jit {

const dnnl::engine& DnnlEngine();
dnnl_stream_t DnnlThreadStream();

// Runs a primitive through the C API (no argument map of ours) on `stream`, or on the calling thread's
// when null; a failure is an error naming `what`.
void DnnlExecute(const_dnnl_primitive_t p, int nargs, const dnnl_exec_arg_t* args, const char* what,
                 dnnl_stream_t stream = nullptr);
// Whether the calling thread is inside DnnlExecute. oneDNN v2's execute converts the arguments into
// its own map (a few small allocations inside the library per call, which its API cannot avoid); the
// allocation tests count those apart from ours.
bool InsideDnnlExecute();

}  // namespace shardstep::jit
