// The MPI backend: a Transport whose sends and receives are MPI_Isend / MPI_Irecv and whose
// native collectives are MPI's non-blocking ones (MPI_Iallreduce, MPI_Ibcast, ...), all polled
// against the group's deadline so that nothing waits without a timeout. Compiled only when CMake
// found MPI (DTRAIN_MPI on); otherwise no_mpi.cpp provides the entry points, and says so.
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "dtrain/comm/mpi.h"
#include "dtrain/comm/reduce.h"
#include "dtrain/comm/store.h"
#include "dtrain/core/error.h"

namespace dtrain::comm {
namespace {

using Kind = TransportError::Kind;

std::string mpi_message(int rc) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return std::string(text, static_cast<size_t>(std::max(0, len)));
}

void check_mpi(int rc, const std::string& what) {
  if (rc != MPI_SUCCESS) {
    throw TransportError(Kind::protocol, {}, fmt::format("{}: MPI error: {}", what, mpi_message(rc)), __FILE__,
                         __LINE__);
  }
}

// MPI cannot take back a pending operation: its buffers stay in use until it completes. A
// timeout or abort while one is pending therefore ends the job (the caller could otherwise
// free buffers MPI still reads or writes).
[[noreturn]] void end_job(const std::string& why) {
  std::fprintf(stderr, "dtrain: error: [comm] %s; MPI cannot cancel the pending operation, so the job ends\n",
               why.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 3);
  std::abort();
}

// MPI has no bf16 or f16: they travel as 2-byte types of their own, reduced by user
// operations that widen to f32 (reduce_into), like every other transport.
MPI_Datatype g_bf16 = MPI_DATATYPE_NULL;
MPI_Datatype g_f16 = MPI_DATATYPE_NULL;
MPI_Op g_half_ops[5] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
int g_tag_ub = 32767;
std::once_flag g_init_once;
bool g_init_here = false;

template <ReduceOp Op>
void half_reduce(void* in, void* inout, int* len, MPI_Datatype* type) {
  const DataType t = *type == g_bf16 ? DataType::bf16 : DataType::f16;
  reduce_into(inout, in, static_cast<size_t>(*len), t, Op);
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void init_runtime() {
  std::call_once(g_init_once, [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = 0;
    if (!initialized) {
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      DT_CHECK(rc == MPI_SUCCESS, "comm", "MPI_Init_thread failed: {}", mpi_message(rc));
      g_init_here = true;
      std::atexit(finalize_at_exit);
    } else {
      MPI_Query_thread(&provided);
    }
    DT_CHECK(provided >= MPI_THREAD_MULTIPLE, "comm",
             "the MPI library provides thread level {} but dtrain needs MPI_THREAD_MULTIPLE ({}): every group "
             "runs its operations on a thread of its own",
             provided, MPI_THREAD_MULTIPLE);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Type_contiguous(2, MPI_BYTE, &g_bf16);
    MPI_Type_commit(&g_bf16);
    MPI_Type_contiguous(2, MPI_BYTE, &g_f16);
    MPI_Type_commit(&g_f16);
    MPI_Op_create(&half_reduce<ReduceOp::sum>, 1, &g_half_ops[0]);
    MPI_Op_create(&half_reduce<ReduceOp::sum>, 1, &g_half_ops[1]);  // avg: sum, divided after
    MPI_Op_create(&half_reduce<ReduceOp::max>, 1, &g_half_ops[2]);
    MPI_Op_create(&half_reduce<ReduceOp::min>, 1, &g_half_ops[3]);
    MPI_Op_create(&half_reduce<ReduceOp::prod>, 1, &g_half_ops[4]);
    void* ub = nullptr;
    int found = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &found);
    if (found && ub != nullptr) g_tag_ub = *static_cast<int*>(ub);
  });
}

int op_index(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return 0;
    case ReduceOp::avg:
      return 1;
    case ReduceOp::max:
      return 2;
    case ReduceOp::min:
      return 3;
    case ReduceOp::prod:
      return 4;
  }
  return 0;
}

MPI_Datatype mpi_type(DataType t) {
  switch (t) {
    case DataType::f32:
      return MPI_FLOAT;
    case DataType::f64:
      return MPI_DOUBLE;
    case DataType::i32:
      return MPI_INT32_T;
    case DataType::i64:
      return MPI_INT64_T;
    case DataType::u8:
      return MPI_UINT8_T;
    case DataType::bf16:
      return g_bf16;
    case DataType::f16:
      return g_f16;
  }
  return MPI_BYTE;
}

MPI_Op mpi_op(DataType t, ReduceOp op) {
  if (t == DataType::bf16 || t == DataType::f16) return g_half_ops[op_index(op)];
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return MPI_SUM;
    case ReduceOp::max:
      return MPI_MAX;
    case ReduceOp::min:
      return MPI_MIN;
    case ReduceOp::prod:
      return MPI_PROD;
  }
  return MPI_SUM;
}

// A message's MPI tag: our 64-bit tag, the message's total size and the chunk's index,
// folded into MPI's tag range; a receive compares it with the one it expects, so a message of
// another operation or size is caught even when a chunk's size happens to match.
int fold_tag(uint64_t tag, size_t bytes, size_t chunk) {
  uint64_t x = tag ^ (static_cast<uint64_t>(bytes) * 0x9E3779B97F4A7C15ull) ^ (static_cast<uint64_t>(chunk) << 47);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<int>(x % (static_cast<uint64_t>(g_tag_ub) + 1));
}

// Messages larger than this go as several, each within MPI's int counts.
constexpr size_t kChunkBytes = size_t{1} << 30;
constexpr size_t kCollectiveChunk = size_t{1} << 28;  // elements per collective call

bool overlaps(const void* a, size_t na, const void* b, size_t nb) {
  if (na == 0 || nb == 0) return false;
  const auto a0 = reinterpret_cast<uintptr_t>(a), b0 = reinterpret_cast<uintptr_t>(b);
  return a0 < b0 + nb && b0 < a0 + na;
}

class MpiTransport final : public Transport, public DirectCollectives {
 public:
  MpiTransport(Store& store, const std::string& prefix, int rank, int size, Duration timeout)
      : rank_(rank), size_(size) {
    init_runtime();
    int world_rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    store.set(fmt::format("{}/mpi/{}", prefix, rank), std::to_string(world_rank));
    std::vector<int> members(static_cast<size_t>(size));
    for (int r = 0; r < size; ++r) {
      const std::string v = store.get(fmt::format("{}/mpi/{}", prefix, r), timeout);
      members[static_cast<size_t>(r)] = std::atoi(v.c_str());
    }
    MPI_Group world_group = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    check_mpi(MPI_Group_incl(world_group, size, members.data(), &group),
              fmt::format("group '{}': MPI_Group_incl", prefix));
    const int tag = static_cast<int>(std::hash<std::string>{}(prefix) % static_cast<size_t>(g_tag_ub));
    const int rc = MPI_Comm_create_group(MPI_COMM_WORLD, group, tag, &data_);
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    check_mpi(rc, fmt::format("group '{}': MPI_Comm_create_group", prefix));
    MPI_Comm_set_errhandler(data_, MPI_ERRORS_RETURN);
    check_mpi(MPI_Comm_dup(data_, &control_), fmt::format("group '{}': MPI_Comm_dup", prefix));
    int me = -1;
    MPI_Comm_rank(data_, &me);
    DT_CHECK(me == rank, "comm", "group '{}': MPI placed rank {} at {}", prefix, rank, me);
  }

  ~MpiTransport() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;  // a group that outlived main(): MPI is gone already
    for (auto& [id, req] : pending_) {
      for (MPI_Request& r : req.requests) {
        if (r == MPI_REQUEST_NULL) continue;
        if (req.recv) MPI_Cancel(&r);
        MPI_Request_free(&r);
      }
    }
    if (control_ != MPI_COMM_NULL) MPI_Comm_free(&control_);
    if (data_ != MPI_COMM_NULL) MPI_Comm_free(&data_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  TransportKind kind() const override { return TransportKind::mpi; }

  RequestId post_send(int peer, uint64_t tag, const void* data, size_t bytes) override {
    return post(true, peer, tag, const_cast<void*>(data), bytes);
  }
  RequestId post_recv(int peer, uint64_t tag, void* data, size_t bytes) override {
    return post(false, peer, tag, data, bytes);
  }

  void wait(const std::vector<RequestId>& requests, Deadline deadline) override {
    for (int spins = 0;; ++spins) {
      if (test(requests)) return;
      if (Clock::now() >= deadline) {
        std::vector<int> peers;
        std::string what;
        for (RequestId id : requests) {
          auto it = pending_.find(id);
          if (it == pending_.end()) continue;
          peers.push_back(it->second.peer);
          what += fmt::format("{}{} rank {} ({} bytes)", what.empty() ? "" : ", ",
                              it->second.recv ? "recv from" : "send to", it->second.peer, it->second.bytes);
        }
        end_job(fmt::format("mpi: {} not complete by the deadline (peers: {})", what, fmt::join(peers, ", ")));
      }
      pause(spins);
    }
  }

  bool test(const std::vector<RequestId>& requests) override {
    if (aborted_or_notified()) {
      if (!pending_.empty()) end_job(fmt::format("mpi: aborted with messages in flight: {}", reason()));
      check_abort();
    }
    bool all = true;
    for (RequestId id : requests) {
      auto it = pending_.find(id);
      if (it == pending_.end()) continue;  // reaped earlier
      Pending& p = it->second;
      int done = 0;
      std::vector<MPI_Status> status(p.requests.size());
      const int rc = MPI_Testall(static_cast<int>(p.requests.size()), p.requests.data(), &done, status.data());
      if (rc != MPI_SUCCESS) {
        int err = rc;
        size_t k = 0;
        if (rc == MPI_ERR_IN_STATUS) {
          while (k + 1 < status.size() &&
                 (status[k].MPI_ERROR == MPI_SUCCESS || status[k].MPI_ERROR == MPI_ERR_PENDING))
            ++k;
          err = status[k].MPI_ERROR;
        }
        int got = 0;
        if (p.recv) MPI_Get_count(&status[k], MPI_BYTE, &got);
        const std::string detail =
            p.recv && err == MPI_ERR_TRUNCATE
                ? fmt::format(
                      ": the next message from rank {} is larger than the {} bytes expected (MPI tag {}, "
                      "expected {}): the ranks issued different operations",
                      p.peer, p.chunk_bytes[k], status[k].MPI_TAG, chunk_tag(p, k))
                : "";
        end_job(fmt::format("mpi: {} rank {} (tag {}, {} bytes) failed: {}{}", p.recv ? "recv from" : "send to", p.peer,
                            p.tag, p.bytes, mpi_message(err), detail));
      }
      if (!done) {
        all = false;
        continue;
      }
      if (p.recv) check_received(p, status);
      pending_.erase(it);
    }
    return all;
  }

  void abort(const std::string& reason) override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    std::lock_guard<std::mutex> lock(abort_mu_);
    if (aborted_.load()) return;
    abort_reason_ = reason;
    aborted_.store(true);
    // Tell every peer on the control communicator; each finds it while it polls.
    notice_ = reason.substr(0, 1024);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      MPI_Request req = MPI_REQUEST_NULL;
      if (MPI_Isend(notice_.data(), static_cast<int>(notice_.size()), MPI_CHAR, r, 0, control_, &req) == MPI_SUCCESS) {
        MPI_Request_free(&req);
      }
    }
  }

  DirectCollectives* direct() override { return this; }

  // ------------------------------------------------------------------ native collectives

  void all_reduce(const void* input, void* output, size_t count, DataType dtype, ReduceOp op,
                  Deadline deadline) override {
    const size_t es = size_of(dtype);
    for (size_t off = 0; off < count; off += kCollectiveChunk) {
      const size_t n = std::min(kCollectiveChunk, count - off);
      const char* in = static_cast<const char*>(input) + off * es;
      char* out = static_cast<char*>(output) + off * es;
      MPI_Request req = MPI_REQUEST_NULL;
      check_mpi(MPI_Iallreduce(in == out ? MPI_IN_PLACE : in, out, static_cast<int>(n), mpi_type(dtype),
                               mpi_op(dtype, op), data_, &req),
                "mpi: MPI_Iallreduce");
      complete(req, deadline, "all_reduce");
    }
    finish_avg(output, count, dtype, op, size_);
  }

  void broadcast(void* buffer, size_t count, DataType dtype, int root, Deadline deadline) override {
    const size_t es = size_of(dtype);
    for (size_t off = 0; off < count; off += kCollectiveChunk) {
      const size_t n = std::min(kCollectiveChunk, count - off);
      MPI_Request req = MPI_REQUEST_NULL;
      check_mpi(
          MPI_Ibcast(static_cast<char*>(buffer) + off * es, static_cast<int>(n), mpi_type(dtype), root, data_, &req),
          "mpi: MPI_Ibcast");
      complete(req, deadline, "broadcast");
    }
  }

  void all_gather(const void* input, void* output, size_t count, DataType dtype, Deadline deadline) override {
    check_count(count, "all_gather");
    const size_t es = size_of(dtype);
    // In place: this rank's block first moves to its slot of the output.
    std::memmove(static_cast<char*>(output) + static_cast<size_t>(rank_) * count * es, input, count * es);
    MPI_Request req = MPI_REQUEST_NULL;
    check_mpi(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, output, static_cast<int>(count), mpi_type(dtype),
                             data_, &req),
              "mpi: MPI_Iallgather");
    complete(req, deadline, "all_gather");
  }

  void reduce_scatter(const void* input, void* output, size_t count, DataType dtype, ReduceOp op,
                      Deadline deadline) override {
    check_count(count, "reduce_scatter");
    const size_t es = size_of(dtype), total = count * static_cast<size_t>(size_) * es;
    const void* in = input;
    if (overlaps(input, total, output, count * es)) {
      scratch_.assign(static_cast<const char*>(input), static_cast<const char*>(input) + total);
      in = scratch_.data();
    }
    MPI_Request req = MPI_REQUEST_NULL;
    check_mpi(
        MPI_Ireduce_scatter_block(in, output, static_cast<int>(count), mpi_type(dtype), mpi_op(dtype, op), data_, &req),
        "mpi: MPI_Ireduce_scatter_block");
    complete(req, deadline, "reduce_scatter");
    finish_avg(output, count, dtype, op, size_);
  }

  void barrier(Deadline deadline) override {
    MPI_Request req = MPI_REQUEST_NULL;
    check_mpi(MPI_Ibarrier(data_, &req), "mpi: MPI_Ibarrier");
    complete(req, deadline, "barrier");
  }

 private:
  struct Pending {
    std::vector<MPI_Request> requests;  // one per chunk
    std::vector<size_t> chunk_bytes;
    int peer = -1;
    bool recv = false;
    uint64_t tag = 0;
    size_t bytes = 0;
  };

  RequestId post(bool send, int peer, uint64_t tag, void* data, size_t bytes) {
    check_abort();
    DT_CHECK(peer >= 0 && peer < size_ && peer != rank_, "comm", "mpi: peer {} invalid for rank {} of {}", peer, rank_,
             size_);
    Pending p;
    p.peer = peer;
    p.recv = !send;
    p.tag = tag;
    p.bytes = bytes;
    size_t off = 0;
    do {
      const size_t n = std::min(kChunkBytes, bytes - off);
      MPI_Request req = MPI_REQUEST_NULL;
      char* at = static_cast<char*>(data) + off;
      const int mtag = fold_tag(tag, bytes, p.requests.size());
      const int rc = send ? MPI_Isend(at, static_cast<int>(n), MPI_BYTE, peer, mtag, data_, &req)
                          : MPI_Irecv(at, static_cast<int>(n), MPI_BYTE, peer, MPI_ANY_TAG, data_, &req);
      check_mpi(rc, fmt::format("mpi: {} rank {}", send ? "send to" : "recv from", peer));
      p.requests.push_back(req);
      p.chunk_bytes.push_back(n);
      off += n;
    } while (off < bytes);
    const RequestId id = next_id_++;
    pending_.emplace(id, std::move(p));
    return id;
  }

  // A receive matches the next message from its peer, whatever its tag: a different tag or
  // size means the two ranks disagree on what they exchange.
  static int chunk_tag(const Pending& p, size_t k) { return fold_tag(p.tag, p.bytes, k); }

  void check_received(const Pending& p, const std::vector<MPI_Status>& status) const {
    for (size_t k = 0; k < status.size(); ++k) {
      int got = 0;
      MPI_Get_count(&status[k], MPI_BYTE, &got);
      if (status[k].MPI_TAG != chunk_tag(p, k) || static_cast<size_t>(got) != p.chunk_bytes[k]) {
        throw TransportError(Kind::protocol, {p.peer},
                             fmt::format("mpi: recv from rank {} expected tag {} ({} bytes) but the next message "
                                         "differs in tag or size (MPI tag {}, expected {}; {} bytes): the ranks "
                                         "issued different operations",
                                         p.peer, p.tag, p.bytes, status[k].MPI_TAG, chunk_tag(p, k), got),
                             __FILE__, __LINE__);
      }
    }
  }

  void check_count(size_t count, const char* what) const {
    DT_CHECK(count <= static_cast<size_t>(INT32_MAX), "comm", "mpi {}: {} elements per rank exceed MPI's int counts",
             what, count);
  }

  // Polls a collective's request until it completes, the deadline passes or a peer aborts.
  // MPI cannot cancel a collective: after a timeout the group is broken and the process
  // should end (mpirun then stops the job).
  void complete(MPI_Request& req, Deadline deadline, const char* what) {
    for (int spins = 0;; ++spins) {
      if (aborted_or_notified()) end_job(fmt::format("mpi: {} aborted: {}", what, reason()));
      int done = 0;
      MPI_Status status;
      const int rc = MPI_Test(&req, &done, &status);
      if (rc != MPI_SUCCESS) end_job(fmt::format("mpi: {} failed: {}", what, mpi_message(rc)));
      if (done) return;
      if (Clock::now() >= deadline) {
        end_job(
            fmt::format("mpi: {} not complete by the deadline (some rank did not call it, or called it with "
                        "other arguments)",
                        what));
      }
      pause(spins);
    }
  }

  // Spin briefly, then sleep, growing to 1 ms: more ranks than cores must still progress.
  static void pause(int spins) {
    if (spins < 200) return;
    if (spins < 400) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(std::min(1000, 10 * (spins - 399))));
  }

  // True when this transport was aborted or a peer's abort notice arrived (which it records).
  bool aborted_or_notified() {
    if (aborted_.load()) return true;
    int flag = 0;
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, 0, control_, &flag, &status);
    if (!flag) return false;
    int len = 0;
    MPI_Get_count(&status, MPI_CHAR, &len);
    std::string text(static_cast<size_t>(std::max(0, len)), '\0');
    MPI_Recv(text.data(), len, MPI_CHAR, status.MPI_SOURCE, 0, control_, MPI_STATUS_IGNORE);
    std::lock_guard<std::mutex> lock(abort_mu_);
    if (!aborted_.load()) {
      abort_reason_ = fmt::format("rank {} aborted: {}", status.MPI_SOURCE, text);
      aborted_.store(true);
    }
    return true;
  }

  std::string reason() {
    std::lock_guard<std::mutex> lock(abort_mu_);
    return abort_reason_;
  }

  void check_abort() {
    if (!aborted_or_notified()) return;
    throw TransportError(Kind::aborted, {}, fmt::format("mpi: aborted: {}", reason()), __FILE__, __LINE__);
  }

  int rank_, size_;
  MPI_Comm data_ = MPI_COMM_NULL;     // messages and collectives
  MPI_Comm control_ = MPI_COMM_NULL;  // abort notices, probed while waiting
  std::unordered_map<RequestId, Pending> pending_;
  RequestId next_id_ = 1;
  std::vector<char> scratch_;
  std::mutex abort_mu_;
  std::atomic<bool> aborted_{false};
  std::string abort_reason_;
  std::string notice_;  // the abort notice being sent (outlives its MPI_Isend)
};

}  // namespace

bool mpi_built() { return true; }

MpiWorld mpi_world() {
  init_runtime();
  MpiWorld w;
  MPI_Comm_rank(MPI_COMM_WORLD, &w.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &w.size);
  MPI_Comm local = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local);
  int local_size = 0;
  MPI_Comm_size(local, &local_size);
  MPI_Comm_free(&local);
  w.one_host = local_size == w.size;
  return w;
}

std::string mpi_broadcast_from_root(const std::string& text) {
  init_runtime();
  int n = static_cast<int>(text.size());
  MPI_Bcast(&n, 1, MPI_INT, 0, MPI_COMM_WORLD);
  std::string out = text;
  out.resize(static_cast<size_t>(n));
  MPI_Bcast(out.data(), n, MPI_CHAR, 0, MPI_COMM_WORLD);
  return out;
}

void mpi_abort_job(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
}

std::unique_ptr<Transport> make_mpi_transport(Store& store, const std::string& prefix, int rank, int size,
                                              Duration timeout) {
  return std::make_unique<MpiTransport>(store, prefix, rank, size, timeout);
}

}  // namespace dtrain::comm
