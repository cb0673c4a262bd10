// Mailboxes (see the header) and the Collectives default for backends without point-to-point transfers.
#include "runtime/mailboxes.h"

#include <algorithm>

#include "ir/error.h"
#include "runtime/collectives.h"

namespace shardstep::runtime {

void Collectives::Permute(int replica, int, const float*, int, float*, int64_t, int) {
  throw Error(Str("replica ", replica, ": this Collectives backend has no point-to-point transfers "
                                       "(collective_permute); use the in-process or tpu-mesh collectives"));
}

void Mailboxes::Send(int from, int to, const float* data, int64_t n) {
  std::vector<float> copy(data, data + n);
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_) throw Error(why_);
  queues_[{from, to}].push_back(std::move(copy));
  cv_.notify_all();
}

void Mailboxes::Receive(int from, int to, float* out, int64_t n) {
  std::unique_lock<std::mutex> lock(mu_);
  auto& q = queues_[{from, to}];
  cv_.wait(lock, [&] { return aborted_ || !q.empty(); });
  if (aborted_) throw Error(why_);
  const std::vector<float> msg = std::move(q.front());
  q.pop_front();
  lock.unlock();
  if (static_cast<int64_t>(msg.size()) != n)
    throw Error(Str("collective_permute: replica ", to, " expects ", n, " floats from replica ", from, ", which sent ",
                    msg.size()));
  std::copy(msg.begin(), msg.end(), out);
}

void Mailboxes::Abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!aborted_) {
    aborted_ = true;
    why_ = why;
  }
  cv_.notify_all();
}

void CheckPermute(const char* who, int replicas, int replica, int to, int from, int64_t n) {
  auto bad = [&](int r) { return r < -1 || r >= replicas; };
  if (replica < 0 || replica >= replicas || bad(to) || bad(from) || n < 0)
    throw Error(Str(who, ": collective_permute on replica ", replica, " to ", to, " from ", from, " of ", n,
                    " floats: replicas must be in [0, ", replicas, ") (-1: none) and the size non-negative"));
}

}  // namespace shardstep::runtime
