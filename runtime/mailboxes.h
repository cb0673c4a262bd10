// Mailboxes: point-to-point messages between the replica threads of one process (the transport of
// Collectives::Permute in InProcessCollectives and tpu::MeshCollectives). One FIFO per directed pair
// of replicas: Send enqueues a copy and returns at once; Receive waits (condition variable, never
// spinning) for the oldest message from that sender. After Abort(why), waiting and later receives
// throw shardstep::Error(why).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace shardstep::runtime {

class Mailboxes {
 public:
  void Send(int from, int to, const float* data, int64_t n);
  // Throws if the oldest message from `from` to `to` does not hold n floats (the replicas disagree on
  // what they exchange), naming both.
  void Receive(int from, int to, float* out, int64_t n);
  void Abort(const std::string& why);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<int, int>, std::deque<std::vector<float>>> queues_;
  bool aborted_ = false;
  std::string why_;
};

// Checks a Permute call's arguments (replica ids in [0, replicas), n >= 0), naming `who`.
void CheckPermute(const char* who, int replicas, int replica, int to, int from, int64_t n);

}  // namespace shardstep::runtime
