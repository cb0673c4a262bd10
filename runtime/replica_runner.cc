// One thread per replica (fresh, or parked in a pool), first failure aborts the collectives and is rethrown.
#include "runtime/replica_runner.h"

#include <pthread.h>
#include <sched.h>

#include <cstdlib>
#include <cstring>
#include <exception>

#include "ir/error.h"

namespace shardstep::runtime {
namespace {

// Runs body(r) and returns the failure message, if any.
std::optional<std::string> Guarded(int r, const std::function<void(int)>& body) {
  try {
    body(r);
    return std::nullopt;
  } catch (const std::exception& e) {
    return Str("replica ", r, ": ", e.what());
  } catch (...) {
    return Str("replica ", r, ": unknown exception");
  }
}

}  // namespace

void RunReplicas(int n, Collectives* c, const std::function<void(int replica)>& body) {
  if (n <= 0) throw Error(Str("RunReplicas needs at least one replica, got ", n));

  std::mutex mu;
  std::optional<std::string> first_failure;
  auto fail = [&](const std::string& why) {
    {
      std::lock_guard lk(mu);
      if (first_failure) return;  // a secondary error, most likely caused by the abort
      first_failure = why;
    }
    if (c) c->Abort(why);
  };

  std::vector<std::thread> threads;
  threads.reserve(n);
  try {
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        if (auto why = Guarded(r, body)) fail(*why);
      });
  } catch (const std::exception& e) {  // could not start every thread: release the ones that run
    fail(Str("could not start replica thread ", threads.size(), ": ", e.what()));
  }
  for (std::thread& t : threads) t.join();
  if (first_failure) throw Error(*first_failure);
}

std::vector<int> ReplicaCpus(int n) {
  static const bool wanted = [] {
    const char* e = std::getenv("SHARDSTEP_PIN_REPLICAS");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (!wanted || sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return {};
  std::vector<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &allowed)) cpus.push_back(cpu);
  if (cpus.empty() || n < static_cast<int>(cpus.size())) return {};
  std::vector<int> of(n);
  for (int r = 0; r < n; ++r) of[r] = cpus[r % cpus.size()];
  return of;
}

ReplicaPool::ReplicaPool(int n) {
  if (n <= 0) throw Error(Str("a replica pool needs at least one replica, got ", n));
  threads_.reserve(n);
  const std::vector<int> cpus = ReplicaCpus(n);
  try {
    for (int r = 0; r < n; ++r) {
      threads_.emplace_back(&ReplicaPool::Worker, this, r);
      if (cpus.empty()) continue;
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpus[r], &one);
      pthread_setaffinity_np(threads_.back().native_handle(), sizeof(one), &one);  // a failure only costs speed
    }
  } catch (const std::exception& e) {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : threads_) t.join();
    throw Error(Str("could not start replica thread ", threads_.size(), " of ", n, ": ", e.what()));
  }
}

ReplicaPool::~ReplicaPool() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void ReplicaPool::Run(Collectives* c, const std::function<void(int replica)>& body) {
  std::unique_lock lk(mu_);
  body_ = &body;
  collectives_ = c;
  first_failure_.reset();
  running_ = size();
  ++generation_;
  wake_.notify_all();
  done_.wait(lk, [&] { return running_ == 0; });
  body_ = nullptr;
  if (first_failure_) throw Error(*first_failure_);
}

void ReplicaPool::Worker(int r) {
  uint64_t seen = 0;
  std::unique_lock lk(mu_);
  for (;;) {
    wake_.wait(lk, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    const std::function<void(int)>& body = *body_;
    Collectives* c = collectives_;
    lk.unlock();
    std::optional<std::string> why = Guarded(r, body);
    if (why) {
      bool first = false;
      {
        std::lock_guard failure_lock(mu_);
        if (!first_failure_) first_failure_ = *why, first = true;
      }
      if (first && c) c->Abort(*why);  // outside the lock: Abort wakes replicas that may fail in turn
    }
    lk.lock();
    if (--running_ == 0) done_.notify_one();
  }
}

}  // namespace shardstep::runtime
