// What every oneDNN primitive of a step shares (jit/dnnl_kernels.cc defines them): the CPU engine they are
// built for, and each thread's stream, created on its first use and kept for the thread's life.
#pragma once

#include <dnnl.hpp>
#include <utility>

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

// A oneDNN memory object over storage we own: through the C API, so the only allocations are
// oneDNN's own small ones (the C++ handles would add a shared_ptr per object). Move-only.
class DnnlMem {
 public:
  DnnlMem() = default;
  DnnlMem(const dnnl::memory::desc& md, void* handle);
  DnnlMem(const DnnlMem&) = delete;
  DnnlMem(DnnlMem&& o) noexcept : m_(o.m_) { o.m_ = nullptr; }
  DnnlMem& operator=(DnnlMem&& o) noexcept {
    std::swap(m_, o.m_);
    return *this;
  }
  ~DnnlMem();
  dnnl_memory_t get() const { return m_; }

 private:
  dnnl_memory_t m_ = nullptr;
};

// A memory object over a fixed descriptor whose storage may move: made at the first Bind, re-pointed
// (dnnl_memory_set_data_handle) only when the address differs from the last one. Kept per thread
// and per primitive argument, so a step after the first makes none.
class BoundDnnlMem {
 public:
  dnnl_memory_t Bind(const dnnl::memory::desc& md, void* handle);

 private:
  DnnlMem mem_;
  void* handle_ = nullptr;
};

}  // namespace shardstep::jit
