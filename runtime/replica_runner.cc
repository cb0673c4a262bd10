// RunReplicas: one thread per replica, first failure aborts the collectives and is rethrown.
#include "runtime/replica_runner.h"

#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ir/error.h"

namespace shardstep::runtime {

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
  auto run = [&](int r) {
    try {
      body(r);
    } catch (const std::exception& e) {
      fail(Str("replica ", r, ": ", e.what()));
    } catch (...) {
      fail(Str("replica ", r, ": unknown exception"));
    }
  };

  std::vector<std::thread> threads;
  threads.reserve(n);
  try {
    for (int r = 0; r < n; ++r) threads.emplace_back(run, r);
  } catch (const std::exception& e) {  // could not start every thread: release the ones that run
    fail(Str("could not start replica thread ", threads.size(), ": ", e.what()));
  }
  for (std::thread& t : threads) t.join();
  if (first_failure) throw Error(*first_failure);
}

}  // namespace shardstep::runtime
