// Point-to-point transport between the ranks of one group: the only thing algorithms talk to.
//
// Semantics: between an ordered pair (src -> dst) messages form one FIFO stream. post_send
// and post_recv return immediately; wait() drives progress on all the listed requests (in the
// calling thread) until they complete. Receives from one peer match that peer's sends in
// order; each message carries a tag and a byte count, and a receive whose tag or size differs
// from the message that arrives fails with an error naming both (this is how mismatched
// collectives are detected instead of silently corrupting data).
//
// Waits never hang: wait() throws TransportError when the deadline passes (naming the peers
// whose requests are still pending), when a peer died (its process is gone or its connection
// closed), or when abort() was called on this or a peer's transport.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/types.h"

namespace dtrain::comm {

class TransportError : public Error {
 public:
  enum class Kind { timeout, peer_dead, aborted, protocol };
  TransportError(Kind kind, std::vector<int> peers, const std::string& message, const char* file, int line)
      : Error("comm", message, file, line), kind_(kind), peers_(std::move(peers)) {}
  Kind kind() const { return kind_; }
  const std::vector<int>& peers() const { return peers_; }

 private:
  Kind kind_;
  std::vector<int> peers_;
};

using RequestId = uint64_t;

/// The transports a group can run over. `automatic` is a request only (GroupOptions): shm when
/// every rank is on one host, tcp otherwise; `none` is the kind of an empty Group.
enum class TransportKind : uint8_t { automatic, shm, tcp, mpi, none };
/// "auto", "shm", "tcp", "mpi", "none".
const char* name_of(TransportKind kind);
/// "auto", "shm", "tcp" or "mpi"; throws dtrain::Error naming the text.
TransportKind parse_transport(const std::string& text);

/// True on a group's progress thread, which runs asynchronous operations while the process's
/// own thread goes on computing: a transport waiting for peers there shares a core with that
/// computation, so it yields its core at every turn instead of spinning (measured on 2 cores,
/// PyTorch DDP on two ranks: spinning there took the GPT's backward 14% slower than a DDP hook
/// that communicates nothing; yielding, 9%).
bool on_progress_thread();

/// Collectives that a transport runs natively instead of through point-to-point messages:
/// the shm transport reduces straight from the ranks' shared staging buffers (each byte is
/// copied into shared memory once and read from there, with no per-hop copies). The result
/// is bitwise identical on every rank. Every rank must make the same calls in the same order;
/// a call whose (collective, dtype, count, op, root) differs from a peer's fails with
/// TransportError::Kind::protocol naming both calls. Failure semantics are those of wait().
class DirectCollectives {
 public:
  virtual ~DirectCollectives() = default;
  virtual void all_reduce(const void* input, void* output, size_t count, DataType dtype, ReduceOp op,
                          Deadline deadline) = 0;
  virtual void broadcast(void* buffer, size_t count, DataType dtype, int root, Deadline deadline) = 0;
  /// output holds size() * count elements; rank r's block at r * count.
  virtual void all_gather(const void* input, void* output, size_t count, DataType dtype, Deadline deadline) = 0;
  /// input holds size() * count elements; rank r receives block r reduced.
  virtual void reduce_scatter(const void* input, void* output, size_t count, DataType dtype, ReduceOp op,
                              Deadline deadline) = 0;
  /// Synchronisation only.
  virtual void barrier(Deadline deadline) = 0;
};

/// Collectives over memory that every rank of the group maps (shared.h, allocate_shared): only
/// a transport whose ranks share memory has them (Transport::mapped()). Rules as for
/// DirectCollectives.
class MappedCollectives {
 public:
  virtual ~MappedCollectives() = default;
  /// reduce_scatter without a copy in: rank q's input (size() * count elements) lies at
  /// inputs + q * stride bytes. Returns when every rank has read its block from every input,
  /// so they may be reused then. `output` may be this rank's block of input 0 or 1 (both are
  /// read before it is written), not of any other input.
  virtual void reduce_scatter_mapped(const char* inputs, size_t stride, void* output, size_t count, DataType dtype,
                                     ReduceOp op, Deadline deadline) = 0;
  /// all_reduce in place without a copy in or out: rank q's vector (count elements) lies at
  /// vectors + q * stride bytes. Each rank reduces its slice straight from every vector, in
  /// rank order, and writes the result into every vector. Returns when every vector holds the
  /// whole result and nobody reads or writes them any more.
  virtual void all_reduce_mapped(char* vectors, size_t stride, size_t count, DataType dtype, ReduceOp op,
                                 Deadline deadline) = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual TransportKind kind() const = 0;

  /// Queues a message of `bytes` bytes to `peer`. `data` must stay valid until a wait()
  /// covering this request returned.
  virtual RequestId post_send(int peer, uint64_t tag, const void* data, size_t bytes) = 0;
  /// Queues the receive of the next message from `peer` into `data`.
  virtual RequestId post_recv(int peer, uint64_t tag, void* data, size_t bytes) = 0;
  /// Drives progress until all `requests` completed; throws TransportError (see above).
  virtual void wait(const std::vector<RequestId>& requests, Deadline deadline) = 0;
  /// Drives progress once without blocking; true when all `requests` completed (they are then
  /// reaped as by wait). Throws TransportError like wait(), except that it never times out.
  /// wait() and test() progress every queued request, listed or not, so a posted send moves
  /// while the rank waits for something else (no deadlock between a send and a later recv).
  virtual bool test(const std::vector<RequestId>& requests) = 0;
  /// Fails every current and future wait on this transport and, where the medium allows,
  /// on the peers' transports too (shm: a shared abort flag; tcp: an abort frame carrying
  /// the reason, then the connections' sending halves closed). May be called from any thread.
  virtual void abort(const std::string& reason) = 0;
  /// The transport's native collectives, or nullptr when it has none.
  virtual DirectCollectives* direct() { return nullptr; }
  /// Its collectives over memory every rank maps, or nullptr when its ranks share none.
  virtual MappedCollectives* mapped() { return nullptr; }
};

class Store;

/// Shared-memory transport between processes (or threads) on one host. Rank 0 creates a
/// segment named after `prefix` and publishes its name in `store`; the others map it. The
/// segment is unlinked as soon as every rank mapped it, so nothing is left in /dev/shm even
/// after a crash. Waits spin briefly (at least `spin`), then sleep on a futex. A peer whose
/// process is gone is reported as dead.
std::unique_ptr<Transport> make_shm_transport(Store& store, const std::string& prefix, int rank, int size,
                                              Duration timeout,
                                              std::chrono::microseconds spin = std::chrono::microseconds(0));

/// TCP transport: one connection per pair (lower rank connects to higher), TCP_NODELAY,
/// non-blocking sockets driven by poll() in the waiting thread. Each rank listens on
/// `bind_address` (an ephemeral port; "" means 127.0.0.1, a wildcard publishes the host name)
/// and publishes "host:port" in `store` under `prefix`. Every connection is authenticated in
/// both directions with `secret` (HMAC-SHA256 challenge-response) and states its rank; a
/// connection with a wrong secret, a rank that may not dial this one, or a rank already
/// connected is refused with the reason, and the rank keeps waiting for the genuine peer.
/// Setup is bounded by `timeout` (TransportError timeout naming the missing ranks and the
/// refused connections). Messages stream straight from and into the callers' buffers; a
/// message is read only once its receive is posted, so memory stays bounded.
/// A peer whose connection closes is reported dead, after what it sent before is delivered.
std::unique_ptr<Transport> make_tcp_transport(Store& store, const std::string& prefix, int rank, int size,
                                              const std::string& secret, const std::string& bind_address,
                                              Duration timeout);

}  // namespace dtrain::comm
