// What every oneDNN primitive of a step shares (jit/dnnl_kernels.cc defines them): the CPU engine they are
// built for, and each thread's stream, created on its first use and kept for the thread's life.
#pragma once

#include <dnnl.hpp>

namespace shardstep::jit {

const dnnl::engine& DnnlEngine();
dnnl_stream_t DnnlThreadStream();

}  // namespace shardstep::jit
